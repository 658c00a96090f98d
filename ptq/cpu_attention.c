/* Causal self-attention of bf16 queries, keys and values on a CPU with AVX512-BF16,
   compiled: the calibration passes' attention (ptq/cpu_attention.py, whose torch reference is
   torch's scaled_dot_product_attention with is_causal, as transformers' "sdpa" calls it).

   Per sample and key-value head, the keys are laid out as pairs of dimensions
   Kp [D/2][S16][2] (16 keys per vector) and the values as pairs of positions
   Vp [S2/2][D][2], zeros past the sequence; each query head of the group then runs, 8
   query rows at a time:

   - scores s = (q · k) · scale in float32 (VDPBF16PS: exact products of bf16 values, summed
     in float32) for the keys up to the block's last row;
   - each row's softmax: m = max over its keys j <= i, p = exp(s - m) in float32 (exp_v:
     within 2 ulp of expf), the sum of the p in float32, and the p rounded to bf16 for
     the product with V (as torch's CPU flash kernel does);
   - o = (Σ p v) / sum in float32 (VDPBF16PS), rounded to bf16 (to nearest even).

   On a CPU with AMX (ptq_attention_causal_amx) the same layouts feed the tile unit: 16 query
   rows at a time, their scores as 16 x 16 tiles of float32 sums (TDPBF16PS: Q rows against
   Kp's rows of dimension pairs), the same softmax, then P against Vp's rows of key pairs
   in tiles of 16 rows x 16 dimensions. The tiles sum the products in their own order, so
   the two paths differ in the last bits of a score or output.

   Every output depends only on its own row's numbers, in a fixed order: the same bits
   however samples and heads are split across threads or calls. They differ from torch's
   kernel in the last bits (other blocks of sums, another exp). */

#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "algorithms/quant_math.h"

#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__) && __GNUC__ >= 11 && defined(__linux__)

enum { ROWS = 8 };

/* e^x in float32 for x <= 0 (Cephes' expf: x = n ln2 + r, |r| <= ln2 / 2, a degree-6
   polynomial in r, times 2^n); x below -87 gives about 2^-126 (a negligible weight) */
__attribute__((target("avx512f"))) static inline __m512 exp_v(__m512 x) {
    x = _mm512_max_ps(x, _mm512_set1_ps(EXP_LOWEST));
    const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(EXP_LOG2E)),
                                          _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(EXP_LN2_HI), x);
    r = _mm512_fnmadd_ps(n, _mm512_set1_ps(EXP_LN2_LO), r);
    __m512 p = _mm512_set1_ps(EXP_P0);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(EXP_P1));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(EXP_P2));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(EXP_P3));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(EXP_P4));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(EXP_P5));
    p = _mm512_fmadd_ps(p, _mm512_mul_ps(r, r), _mm512_add_ps(r, _mm512_set1_ps(1.0f)));
    return _mm512_scalef_ps(p, n); /* p · 2^n, one rounding: as multiplying by the float 2^n */
}

/* 16 float32 -> their 16 bf16 (quant_math.h's rounding, to nearest even) */
__attribute__((target("avx512f,avx512bw,avx512vl"))) static inline __m256i to_bf16_16(__m512 x) {
    return _mm512_cvtepi32_epi16(_mm512_srli_epi32(_mm512_castps_si512(to_bf16_v(x)), 16));
}

/* scores [ROWS][ld] = Q rows · keys [j, j + 16 C), from Kp (pairs of dimensions); unscaled, as the
   AMX tiles leave them (softmax_row scales) */
__attribute__((target("avx512f,avx512bf16"), always_inline)) static inline void
scores_block(const uint32_t *const q[ROWS], const uint16_t *Kp, int64_t S16, int64_t D, int64_t j, int C,
             float *scores, int64_t ld) {
    __m512 acc[ROWS][3];
    for (int r = 0; r < ROWS; r++)
        for (int c = 0; c < C; c++)
            acc[r][c] = _mm512_setzero_ps();
    for (int64_t d = 0; d < D / 2; d++) {
        __m512bh k[3];
        for (int c = 0; c < C; c++)
            k[c] = (__m512bh)_mm512_loadu_si512((const void *)(Kp + (d * S16 + j + 16 * c) * 2));
        for (int r = 0; r < ROWS; r++) {
            const __m512bh x = (__m512bh)_mm512_set1_epi32((int)q[r][d]);
            for (int c = 0; c < C; c++)
                acc[r][c] = _mm512_dpbf16_ps(acc[r][c], x, k[c]);
        }
    }
    for (int r = 0; r < ROWS; r++)
        for (int c = 0; c < C; c++)
            _mm512_storeu_ps(scores + r * ld + j + 16 * c, acc[r][c]);
}

/* out rows [ROWS] of dimensions [dc, dc + 32) = Σ_j P[r][j] v[j] / sums[r], j < 2 pairs */
__attribute__((target("avx512f,avx512bf16,avx512bw,avx512vl"), always_inline)) static inline void
values_block(const uint16_t *P, int64_t ldp, const uint16_t *Vp, int64_t D, int64_t pairs, int64_t dc,
             const float *sums, uint16_t *const out[ROWS], int rows) {
    __m512 acc[ROWS][2];
    for (int r = 0; r < ROWS; r++)
        acc[r][0] = acc[r][1] = _mm512_setzero_ps();
    for (int64_t t = 0; t < pairs; t++) {
        const __m512bh v0 = (__m512bh)_mm512_loadu_si512((const void *)(Vp + (t * D + dc) * 2));
        const __m512bh v1 = (__m512bh)_mm512_loadu_si512((const void *)(Vp + (t * D + dc + 16) * 2));
        for (int r = 0; r < ROWS; r++) {
            const __m512bh x = (__m512bh)_mm512_set1_epi32((int)((const uint32_t *)(P + r * ldp))[t]);
            acc[r][0] = _mm512_dpbf16_ps(acc[r][0], x, v0);
            acc[r][1] = _mm512_dpbf16_ps(acc[r][1], x, v1);
        }
    }
    for (int r = 0; r < rows; r++) {
        const __m512 sum = _mm512_set1_ps(sums[r]);
        _mm256_storeu_si256((__m256i *)(out[r] + dc), to_bf16_16(_mm512_div_ps(acc[r][0], sum)));
        _mm256_storeu_si256((__m256i *)(out[r] + dc + 16), to_bf16_16(_mm512_div_ps(acc[r][1], sum)));
    }
}

/* One row's weights: p[k] = exp(s[k] · scale - max) rounded to bf16 for its keys k < n
   (max over them), zeros from n up to `width` (a multiple of 2); returns the sum of the
   unrounded exp in float32 (1 for a row without keys, n = 0: its output is not stored).
   The rounding to bf16 is VCVTNEPS2BF16's (to nearest even; a weight below 2^-126 becomes
   0, where a sum of weights is at least 1). */
__attribute__((target("avx512f,avx512bw,avx512vl,avx512bf16"))) static float softmax_row(const float *s, float scale,
                                                                                        int64_t n, int64_t width,
                                                                                        uint16_t *p) {
    const __m512 factor = _mm512_set1_ps(scale);
    __m512 m = _mm512_set1_ps(-__builtin_inff());
    for (int64_t k = 0; k < n; k += 16) {
        const __mmask16 valid = n - k >= 16 ? 0xFFFF : (__mmask16)((1u << (n - k)) - 1);
        m = _mm512_mask_max_ps(m, valid, m, _mm512_mul_ps(_mm512_loadu_ps(s + k), factor));
    }
    const __m512 max = _mm512_set1_ps(_mm512_reduce_max_ps(m));
    __m512 total = _mm512_setzero_ps();
    int64_t k = 0;
    for (; k < n; k += 16) {
        const __mmask16 valid = n - k >= 16 ? 0xFFFF : (__mmask16)((1u << (n - k)) - 1);
        const __m512 x = _mm512_mul_ps(_mm512_maskz_loadu_ps(valid, s + k), factor);
        const __m512 e = _mm512_maskz_mov_ps(valid, exp_v(_mm512_sub_ps(x, max)));
        total = _mm512_add_ps(total, e);
        const __m256i b = (__m256i)_mm512_cvtneps_pbh(e);
        if (width - k >= 16)
            _mm256_storeu_si256((__m256i *)(p + k), b);
        else
            _mm256_mask_storeu_epi16(p + k, (__mmask16)((1u << (width - k)) - 1), b);
    }
    for (; k < width; k += 16) /* past the row's keys */
        _mm256_mask_storeu_epi16(p + k, width - k >= 16 ? 0xFFFF : (__mmask16)((1u << (width - k)) - 1),
                                 _mm256_setzero_si256());
    if (n == 0)
        return 1.0f;
    float lanes[16], sum = 0;
    _mm512_storeu_ps(lanes, total);
    for (int l = 0; l < 16; l++)
        sum += lanes[l];
    return sum;
}

/* One query head against its key-value head's packed keys and values. */
__attribute__((target("avx512f,avx512bf16,avx512bw,avx512vl"))) static void
head(const uint16_t *Q, int64_t qs, uint16_t *O, int64_t os, const uint16_t *Kp, const uint16_t *Vp, int64_t S,
     int64_t S16, int64_t D, float scale, float *scores, uint16_t *P, int64_t ldp) {
    for (int64_t i0 = 0; i0 < S; i0 += ROWS) {
        const int rows = S - i0 < ROWS ? (int)(S - i0) : ROWS;
        const uint32_t *q[ROWS];
        uint16_t *out[ROWS];
        for (int r = 0; r < ROWS; r++) { /* rows past the sequence repeat its last (not stored) */
            const int64_t i = r < rows ? i0 + r : i0 + rows - 1;
            q[r] = (const uint32_t *)(Q + i * qs);
            out[r] = O + i * os;
        }
        const int64_t keys = i0 + rows, cols = (keys + 15) / 16 * 16, pairs = (keys + 1) / 2;
        int64_t j = 0;
        for (; j + 48 <= cols; j += 48)
            scores_block(q, Kp, S16, D, j, 3, scores, S16);
        if (j + 32 <= cols)
            scores_block(q, Kp, S16, D, j, 2, scores, S16);
        else if (j < cols)
            scores_block(q, Kp, S16, D, j, 1, scores, S16);
        float sums[ROWS];
        for (int r = 0; r < ROWS; r++)
            sums[r] = softmax_row(scores + r * S16, scale, r < rows ? i0 + r + 1 : 0, 2 * pairs, P + r * ldp);
        for (int64_t dc = 0; dc < D; dc += 32)
            values_block(P, ldp, Vp, D, pairs, dc, sums, out, rows);
    }
}

/* Kp [D/2][S16] (pairs of dimensions, as 32-bit words) of the keys k [S, D] (row stride ks):
   16 keys x 16 pairs at a time, transposed in the registers; keys from S on are zeros. */
__attribute__((target("avx512f"))) static void pack_keys(const uint16_t *k, int64_t ks, int64_t S, int64_t S16,
                                                         int64_t D, uint32_t *Kp) {
    for (int64_t j = 0; j < S16; j += 16)
        for (int64_t d2 = 0; d2 < D / 2; d2 += 16) {
            __m512i rows[16];
            for (int r = 0; r < 16; r++)
                rows[r] = j + r < S ? _mm512_loadu_si512((const void *)(k + (j + r) * ks + 2 * d2))
                                    : _mm512_setzero_si512();
            transpose16(rows);
            for (int c = 0; c < 16; c++)
                _mm512_storeu_si512((void *)(Kp + (d2 + c) * S16 + j), rows[c]);
        }
}

/* Vp [S2/2][D][2] (pairs of positions) of the values v [S, D] (row stride vs): two rows
   interleaved, 32 dimensions at a time; a last odd row is paired with zeros. */
__attribute__((target("avx512f,avx512bw"))) static void pack_values(const uint16_t *v, int64_t vs, int64_t S,
                                                                    int64_t D, uint16_t *Vp) {
    const __m512i low = _mm512_set_epi16(47, 15, 46, 14, 45, 13, 44, 12, 43, 11, 42, 10, 41, 9, 40, 8, 39, 7, 38, 6,
                                         37, 5, 36, 4, 35, 3, 34, 2, 33, 1, 32, 0);
    const __m512i high = _mm512_add_epi16(low, _mm512_set1_epi16(16));
    for (int64_t j = 0; j < S; j += 2)
        for (int64_t d = 0; d < D; d += 32) {
            const __m512i a = _mm512_loadu_si512((const void *)(v + j * vs + d));
            const __m512i b =
                j + 1 < S ? _mm512_loadu_si512((const void *)(v + (j + 1) * vs + d)) : _mm512_setzero_si512();
            uint16_t *out = Vp + ((j / 2) * D + d) * 2;
            _mm512_storeu_si512((void *)out, _mm512_permutex2var_epi16(a, low, b));
            _mm512_storeu_si512((void *)(out + 32), _mm512_permutex2var_epi16(a, high, b));
        }
}

enum { AMX_ROWS = 16, KEY_TILE = 32 /* keys per tile of P (bf16 pairs) */ };

/* n (1-4) tiles of sums, each 16 rows x 16 float32 columns: Σ over `steps` of A (16 rows
   of 32 bf16, rows a_row bytes apart; the next step a_step elements on) times B (16 rows
   of pairs, b_row bytes apart; tile c's 32 elements on; the next step b_step elements
   on), stored at out (rows ld bytes apart; tile c 16 floats on). Tiles 0-3: sums, 4: A,
   5-7: B; independent sums keep the tile unit busy (one alone waits out each product). */
__attribute__((target("amx-tile,amx-bf16"), always_inline)) static inline void
tile_sums(int n, const uint16_t *A, int64_t a_row, int64_t a_step, const uint16_t *B, int64_t b_row, int64_t b_step,
          int64_t steps, float *out, int64_t ld) {
    _tile_zero(0);
    if (n > 1) _tile_zero(1);
    if (n > 2) _tile_zero(2);
    if (n > 3) _tile_zero(3);
    for (int64_t k = 0; k < steps; k++) {
        const uint16_t *b = B + k * b_step;
        _tile_loadd(4, A + k * a_step, a_row);
        _tile_loadd(5, b, b_row);
        _tile_dpbf16ps(0, 4, 5);
        if (n > 1) {
            _tile_loadd(6, b + 32, b_row);
            _tile_dpbf16ps(1, 4, 6);
        }
        if (n > 2) {
            _tile_loadd(7, b + 64, b_row);
            _tile_dpbf16ps(2, 4, 7);
        }
        if (n > 3) {
            _tile_loadd(5, b + 96, b_row);
            _tile_dpbf16ps(3, 4, 5);
        }
    }
    _tile_stored(0, out, ld);
    if (n > 1) _tile_stored(1, out + 16, ld);
    if (n > 2) _tile_stored(2, out + 32, ld);
    if (n > 3) _tile_stored(3, out + 48, ld);
}

/* One query head on AMX tiles: blocks of 16 query rows, copied (zeros past the sequence)
   into Qb [16][D]; their scores into `scores` [16][S16] unscaled, 64 keys at a time, the
   weights P [16][ldp] (ldp a multiple of KEY_TILE, zeros past each row's keys), then the
   outputs' float32 sums, 64 dimensions at a time, into acc [16][D]. */
__attribute__((target("avx512f,avx512bf16,avx512bw,avx512vl,amx-tile,amx-bf16"))) static void
head_amx(const uint16_t *Q, int64_t qs, uint16_t *O, int64_t os, const uint16_t *Kp, const uint16_t *Vp, int64_t S,
         int64_t S16, int64_t D, float scale, float *scores, uint16_t *P, int64_t ldp, uint16_t *Qb, float *acc) {
    for (int64_t i0 = 0; i0 < S; i0 += AMX_ROWS) {
        const int rows = S - i0 < AMX_ROWS ? (int)(S - i0) : AMX_ROWS;
        for (int r = 0; r < AMX_ROWS; r++) {
            if (r < rows)
                memcpy(Qb + r * D, Q + (i0 + r) * qs, (size_t)D * 2);
            else
                memset(Qb + r * D, 0, (size_t)D * 2);
        }
        const int64_t keys = i0 + rows, cols = (keys + 15) / 16 * 16;
        const int64_t width = (keys + KEY_TILE - 1) / KEY_TILE * KEY_TILE; /* P's columns read */
        for (int64_t j = 0; j < cols; j += 64) /* Q's 32 dimensions a step against Kp's 16 pairs */
            tile_sums(cols - j >= 64 ? 4 : (int)((cols - j) / 16), Qb, D * 2, 32, Kp + j * 2, S16 * 4, 32 * S16,
                      D / 32, scores + j, S16 * 4);
        float sums[AMX_ROWS];
        for (int r = 0; r < AMX_ROWS; r++)
            sums[r] = softmax_row(scores + r * S16, scale, r < rows ? i0 + r + 1 : 0, width, P + r * ldp);
        for (int64_t dc = 0; dc < D; dc += 64) /* P's 32 keys a step against Vp's 16 pairs of positions */
            tile_sums(D - dc >= 64 ? 4 : (int)((D - dc) / 16), P, ldp * 2, KEY_TILE, Vp + dc * 2, D * 4, 32 * D,
                      width / KEY_TILE, acc + dc, D * 4);
        for (int r = 0; r < rows; r++) {
            const __m512 sum = _mm512_set1_ps(sums[r]);
            for (int64_t d = 0; d < D; d += 16)
                _mm256_storeu_si256((__m256i *)(O + (i0 + r) * os + d),
                                    to_bf16_16(_mm512_div_ps(_mm512_loadu_ps(acc + r * D + d), sum)));
        }
    }
}

/* O[b, h] = causal attention of Q[b, h] on K[b, h / group], V[b, h / group] for the samples
   [b0, b1) and every head; tensors bf16 with unit stride along D and the given strides
   (elements) for sample, head and position; D a multiple of 32. amx: on AMX tiles (the
   process must have asked for them: ptq_amx_available). 0, or -1 when memory for the
   layouts could not be had. */
__attribute__((target("avx512f,avx512bf16,avx512bw,avx512vl"))) static int
attention_bf16(const uint16_t *Q, const uint16_t *K, const uint16_t *V, uint16_t *O, int64_t b0, int64_t b1,
               int64_t H, int64_t KVH, int64_t S, int64_t D, const int64_t *strides, float scale, int amx) {
    const int64_t qb = strides[0], qh = strides[1], qs = strides[2], kb = strides[3], kh = strides[4],
                  ks = strides[5], vb = strides[6], vh = strides[7], vs = strides[8], ob = strides[9],
                  oh = strides[10], os = strides[11];
    const int64_t S16 = (S + 15) / 16 * 16, S32 = (S + KEY_TILE - 1) / KEY_TILE * KEY_TILE, group = H / KVH;
    const int64_t ldp = amx ? S32 : S16 + 16, rows = amx ? AMX_ROWS : ROWS;
    uint16_t *Kp = calloc((size_t)(D / 2 * S16 * 2), 2), *Vp = calloc((size_t)(S32 * D), 2);
    uint16_t *P = calloc((size_t)(rows * ldp), 2), *Qb = amx ? calloc((size_t)(AMX_ROWS * D), 2) : NULL;
    float *scores = calloc((size_t)(rows * S16), 4), *acc = amx ? calloc((size_t)(AMX_ROWS * D), 4) : NULL;
    if (!Kp || !Vp || !P || !scores || (amx && (!Qb || !acc))) {
        free(Kp), free(Vp), free(P), free(Qb), free(scores), free(acc);
        return -1;
    }
    if (amx)
        configure_tiles();
    for (int64_t b = b0; b < b1; b++)
        for (int64_t g = 0; g < KVH; g++) {
            const uint16_t *k = K + b * kb + g * kh, *v = V + b * vb + g * vh;
            pack_keys(k, ks, S, S16, D, (uint32_t *)Kp);
            pack_values(v, vs, S, D, Vp);
            for (int64_t h = g * group; h < (g + 1) * group; h++) {
                const uint16_t *q = Q + b * qb + h * qh;
                uint16_t *o = O + b * ob + h * oh;
                if (amx)
                    head_amx(q, qs, o, os, Kp, Vp, S, S16, D, scale, scores, P, ldp, Qb, acc);
                else
                    head(q, qs, o, os, Kp, Vp, S, S16, D, scale, scores, P, ldp);
            }
        }
    if (amx)
        release_tiles();
    free(Kp), free(Vp), free(P), free(Qb), free(scores), free(acc);
    return 0;
}

int ptq_attention_causal(const uint16_t *Q, const uint16_t *K, const uint16_t *V, uint16_t *O, int64_t b0, int64_t b1,
                         int64_t H, int64_t KVH, int64_t S, int64_t D, const int64_t *strides, float scale) {
    return attention_bf16(Q, K, V, O, b0, b1, H, KVH, S, D, strides, scale, 0);
}

int ptq_attention_causal_amx(const uint16_t *Q, const uint16_t *K, const uint16_t *V, uint16_t *O, int64_t b0,
                             int64_t b1, int64_t H, int64_t KVH, int64_t S, int64_t D, const int64_t *strides,
                             float scale) {
    return attention_bf16(Q, K, V, O, b0, b1, H, KVH, S, D, strides, scale, 1);
}

#else /* not built for this CPU: ptq/cpu_attention.py keeps torch's kernel */

int ptq_attention_causal(const uint16_t *Q, const uint16_t *K, const uint16_t *V, uint16_t *O, int64_t b0, int64_t b1,
                         int64_t H, int64_t KVH, int64_t S, int64_t D, const int64_t *strides, float scale) {
    (void)Q, (void)K, (void)V, (void)O, (void)b0, (void)b1, (void)H, (void)KVH, (void)S, (void)D, (void)strides;
    (void)scale;
    return -2;
}

int ptq_attention_causal_amx(const uint16_t *Q, const uint16_t *K, const uint16_t *V, uint16_t *O, int64_t b0,
                             int64_t b1, int64_t H, int64_t KVH, int64_t S, int64_t D, const int64_t *strides,
                             float scale) {
    return ptq_attention_causal(Q, K, V, O, b0, b1, H, KVH, S, D, strides, scale);
}

#endif
