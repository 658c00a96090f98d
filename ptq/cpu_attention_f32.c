/* Causal self-attention of float32 queries, keys and values on a CPU with AVX2 and FMA,
   compiled: the calibration passes' attention for float32 passes (ptq/cpu_attention.py; its
   bf16 twin, with the same structure, is ptq/cpu_attention.c). */

#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "algorithms/quant_math.h"

#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__) && __GNUC__ >= 11 && defined(__linux__)

/* The same attention in float32 on a CPU with AVX2 and FMA (the passes of a float32 model,
   or of any model on a CPU without fast bf16), torch's float32 sdpa its reference: per
   sample and key-value head the keys are laid out transposed, Kt [D][S8] (8 keys per
   vector, zeros past the sequence), the values read where they are; each query head runs
   4 query rows at a time: scores (q · k) · scale summed in float32 in dimension order, each
   row's softmax (p = exp(s - max), exp8 within 2 ulp of expf, summed in float32, not
   rounded), then o = (Σ p v) / sum in float32, keys in order. Each output depends on its
   own row's numbers only, in a fixed order: the same bits however the work is split. */

enum { ROWS32 = 4 };

/* exp_v's steps on 8 lanes. Not shared the other way: exp_v made of exp8 on its two halves (the
   same bits) made the bf16 attention 11-28% slower on an AVX512-BF16 EPYC */
__attribute__((target("avx2,fma"))) static inline __m256 exp8(__m256 x) {
    x = _mm256_max_ps(x, _mm256_set1_ps(EXP_LOWEST));
    const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(EXP_LOG2E)),
                                     _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(EXP_LN2_HI), x);
    r = _mm256_fnmadd_ps(n, _mm256_set1_ps(EXP_LN2_LO), r);
    __m256 p = _mm256_set1_ps(EXP_P0);
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(EXP_P1));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(EXP_P2));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(EXP_P3));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(EXP_P4));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(EXP_P5));
    p = _mm256_fmadd_ps(p, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.0f)));
    const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(p, _mm256_castsi256_ps(e));
}

/* scores [ROWS32][ld] = (Q rows · keys [j, j + 8 C)) · scale, from Kt */
__attribute__((target("avx2,fma"), always_inline)) static inline void
scores_f32(const float *const q[ROWS32], const float *Kt, int64_t S8, int64_t D, int64_t j, int C, float scale,
           float *scores, int64_t ld) {
    __m256 acc[ROWS32][3];
    for (int r = 0; r < ROWS32; r++)
        for (int c = 0; c < C; c++)
            acc[r][c] = _mm256_setzero_ps();
    for (int64_t d = 0; d < D; d++) {
        __m256 k[3];
        for (int c = 0; c < C; c++)
            k[c] = _mm256_loadu_ps(Kt + d * S8 + j + 8 * c);
        for (int r = 0; r < ROWS32; r++) {
            const __m256 x = _mm256_broadcast_ss(q[r] + d);
            for (int c = 0; c < C; c++)
                acc[r][c] = _mm256_fmadd_ps(x, k[c], acc[r][c]);
        }
    }
    const __m256 s = _mm256_set1_ps(scale);
    for (int r = 0; r < ROWS32; r++)
        for (int c = 0; c < C; c++)
            _mm256_storeu_ps(scores + r * ld + j + 8 * c, _mm256_mul_ps(acc[r][c], s));
}

/* out rows of dimensions [dc, dc + 16) = Σ_{j < keys} P[r][j] v[j] / sums[r] */
__attribute__((target("avx2,fma"), always_inline)) static inline void
values_f32(const float *P, int64_t ld, const float *V, int64_t vs, int64_t keys, int64_t dc, const float *sums,
           float *const out[ROWS32], int rows) {
    __m256 acc[ROWS32][2];
    for (int r = 0; r < ROWS32; r++)
        acc[r][0] = acc[r][1] = _mm256_setzero_ps();
    for (int64_t j = 0; j < keys; j++) {
        const __m256 v0 = _mm256_loadu_ps(V + j * vs + dc), v1 = _mm256_loadu_ps(V + j * vs + dc + 8);
        for (int r = 0; r < ROWS32; r++) {
            const __m256 x = _mm256_broadcast_ss(P + r * ld + j);
            acc[r][0] = _mm256_fmadd_ps(x, v0, acc[r][0]);
            acc[r][1] = _mm256_fmadd_ps(x, v1, acc[r][1]);
        }
    }
#pragma GCC unroll 4 /* a loop to `rows` would keep the sums on the stack (stored every key) */
    for (int r = 0; r < ROWS32; r++) {
        if (r >= rows)
            break;
        const __m256 sum = _mm256_set1_ps(sums[r]);
        _mm256_storeu_ps(out[r] + dc, _mm256_div_ps(acc[r][0], sum));
        _mm256_storeu_ps(out[r] + dc + 8, _mm256_div_ps(acc[r][1], sum));
    }
}

__attribute__((target("avx2,fma"))) static void
head_f32(const float *Q, int64_t qs, float *O, int64_t os, const float *Kt, const float *V, int64_t vs, int64_t S,
         int64_t S8, int64_t D, float scale, float *scores) {
    for (int64_t i0 = 0; i0 < S; i0 += ROWS32) {
        const int rows = S - i0 < ROWS32 ? (int)(S - i0) : ROWS32;
        const float *q[ROWS32];
        float *out[ROWS32];
        for (int r = 0; r < ROWS32; r++) { /* rows past the sequence repeat its last (not stored) */
            const int64_t i = r < rows ? i0 + r : i0 + rows - 1;
            q[r] = Q + i * qs;
            out[r] = O + i * os;
        }
        const int64_t keys = i0 + rows, cols = (keys + 7) / 8 * 8;
        int64_t j = 0;
        for (; j + 24 <= cols; j += 24)
            scores_f32(q, Kt, S8, D, j, 3, scale, scores, S8);
        if (j + 16 <= cols)
            scores_f32(q, Kt, S8, D, j, 2, scale, scores, S8);
        else if (j < cols)
            scores_f32(q, Kt, S8, D, j, 1, scale, scores, S8);
        float sums[ROWS32];
        for (int r = 0; r < ROWS32; r++) {
            float *s = scores + r * S8;
            const int64_t n = r < rows ? i0 + r + 1 : 0; /* keys 0 .. i; none for rows past the end */
            __m256 m = _mm256_set1_ps(-__builtin_inff());
            int64_t k = 0;
            for (; k + 8 <= n; k += 8)
                m = _mm256_max_ps(m, _mm256_loadu_ps(s + k));
            float lanes[8], max = -__builtin_inff(), sum = 0;
            _mm256_storeu_ps(lanes, m);
            for (int l = 0; l < 8; l++)
                max = lanes[l] > max ? lanes[l] : max;
            for (int64_t t = k; t < n; t++)
                max = s[t] > max ? s[t] : max;
            const __m256 top = _mm256_set1_ps(max);
            __m256 total = _mm256_setzero_ps();
            for (k = 0; k < cols; k += 8) { /* keys past i weigh zero */
                const __m256 e = exp8(_mm256_sub_ps(_mm256_loadu_ps(s + k), top));
                const __m256i index = _mm256_add_epi32(_mm256_set1_epi32((int)k), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
                const __m256 valid = _mm256_castsi256_ps(_mm256_cmpgt_epi32(_mm256_set1_epi32((int)n), index));
                const __m256 p = _mm256_and_ps(e, valid);
                total = _mm256_add_ps(total, p);
                _mm256_storeu_ps(s + k, p);
            }
            _mm256_storeu_ps(lanes, total);
            for (int l = 0; l < 8; l++)
                sum += lanes[l];
            sums[r] = n ? sum : 1.0f;
        }
        for (int64_t dc = 0; dc < D; dc += 16)
            values_f32(scores, S8, V, vs, keys, dc, sums, out, rows);
    }
}

/* ptq_attention_causal for float32 tensors; D a multiple of 16. 0, or -1 when memory for
   the keys' layout could not be had. */
__attribute__((target("avx2,fma"))) int
ptq_attention_causal_f32(const float *Q, const float *K, const float *V, float *O, int64_t b0, int64_t b1, int64_t H,
                         int64_t KVH, int64_t S, int64_t D, const int64_t *strides, float scale) {
    const int64_t qb = strides[0], qh = strides[1], qs = strides[2], kb = strides[3], kh = strides[4],
                  ks = strides[5], vb = strides[6], vh = strides[7], vs = strides[8], ob = strides[9],
                  oh = strides[10], os = strides[11];
    const int64_t S8 = (S + 7) / 8 * 8, group = H / KVH;
    float *Kt = calloc((size_t)(D * S8), 4), *scores = calloc((size_t)(ROWS32 * S8), 4);
    if (!Kt || !scores) {
        free(Kt), free(scores);
        return -1;
    }
    for (int64_t b = b0; b < b1; b++)
        for (int64_t g = 0; g < KVH; g++) {
            const float *k = K + b * kb + g * kh;
            for (int64_t j = 0; j < S; j++) /* Kt[d][j] */
                for (int64_t d = 0; d < D; d++)
                    Kt[d * S8 + j] = k[j * ks + d];
            for (int64_t h = g * group; h < (g + 1) * group; h++)
                head_f32(Q + b * qb + h * qh, qs, O + b * ob + h * oh, os, Kt, V + b * vb + g * vh, vs, S, S8, D, scale,
                         scores);
        }
    free(Kt), free(scores);
    return 0;
}

int ptq_attention_f32_available(void) { return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma"); }

#else /* not built for this CPU: ptq/cpu_attention.py keeps torch's kernel */

int ptq_attention_causal_f32(const float *Q, const float *K, const float *V, float *O, int64_t b0, int64_t b1, int64_t H,
                             int64_t KVH, int64_t S, int64_t D, const int64_t *strides, float scale) {
    (void)Q, (void)K, (void)V, (void)O, (void)b0, (void)b1, (void)H, (void)KVH, (void)S, (void)D, (void)strides;
    (void)scale;
    return -2;
}

int ptq_attention_f32_available(void) { return 0; }

#endif
