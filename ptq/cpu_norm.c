/* RMSNorm of bf16 rows on a CPU, compiled: the calibration passes' Llama-style norms
   (ptq/cpu_norm.py; the torch reference is transformers' LlamaRMSNorm.forward):

       y = w · bf16(x · 1/√(Σx²/n + ε))

   in the float32 steps torch takes, each rounded as torch rounds it: x² (exact for bf16
   x), its sum over the row, the sum divided by n, plus ε, its square root, 1 over that, x
   times it, rounded to bf16 (to nearest even), times w (exact in float32) rounded to bf16.

   The sum runs in the order of ATen's vectorized sum over a contiguous row (SumKernel.cpp,
   row_sum and multi_row_sum) for vectors of L floats: 4 accumulator vectors, the row's
   whole vectors added to them in turn (a round: the next 4·L values), every 16 rounds (or
   more, for long rows) moved up a cascade of 4 levels; then the leftover whole vectors to
   the first accumulator, the other three added to it; the row's last n % L values summed
   from 0 one by one, then the first accumulator's lanes added to that one by one. With
   the L of the ATen kernel that sums here (16 or 8: ptq/cpu_norm.py finds it on a probe;
   torch 2.13 sums with its AVX2 kernel, 8, on an AVX-512 CPU too) the result is torch's
   bits, from one pass over x to sum and one to write y instead of seven (a float32 copy,
   its square, the sum, the products, two roundings, the product with w).

   On a CPU with AVX-512 the rounds and the outputs run 16 lanes at a time (the same
   operations on each value, so the same bits); elsewhere the portable loops. */

#include <math.h>

#include "algorithms/quant_math.h"

#define ALWAYS_INLINE static inline __attribute__((always_inline))

enum { MAX_LANES = 16, ILP = 4, LEVELS = 4, ROUND_MAX = ILP * MAX_LANES };

/* x rounded to bf16 to nearest even; NaN to 0x7FC0 (c10::BFloat16's scalar conversion; torch's
   vector code may keep a NaN's sign and payload: NaN either way) */
ALWAYS_INLINE uint16_t bf16_bits(float x) {
    const float rounded = to_bf16(x); /* quant_math.h */
    uint32_t u;
    memcpy(&u, &rounded, 4);
    return x != x ? (uint16_t)0x7FC0 : (uint16_t)(u >> 16);
}

/* acc[c] += x[i·W + c]² for rounds [i0, i1) of W values (W = ILP·L: lane l of accumulator
   vector k is acc[k·L + l]) */
VECTORIZED static void add_rounds(float *acc, const uint16_t *x, int64_t i0, int64_t i1, int W) {
    for (int64_t i = i0; i < i1; i++)
        for (int c = 0; c < W; c++) {
            const float v = bf16_widened(x[i * W + c]);
            acc[c] += v * v;
        }
}

/* y[j] = bf16(w[j] · bf16(x[j] · scale)) for j < n */
VECTORIZED static void scaled_row(const uint16_t *x, const uint16_t *w, int64_t n, float scale, uint16_t *y) {
    for (int64_t j = 0; j < n; j++)
        y[j] = bf16_bits(bf16_widened(w[j]) * bf16_widened(bf16_bits(bf16_widened(x[j]) * scale)));
}

#if HAS_AVX512 /* (quant_math.h) */
AVX512 static inline __m512 bf16_values_v(__m256i h) { /* 16 bf16 -> float32 */
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

/* add_rounds with W/16 accumulator vectors held in registers */
AVX512 static void add_rounds_avx512(float *acc, const uint16_t *x, int64_t i0, int64_t i1, int W) {
    __m512 a[ILP];
    const int vectors = W / 16;
    for (int k = 0; k < vectors; k++)
        a[k] = _mm512_loadu_ps(acc + 16 * k);
    for (int64_t i = i0; i < i1; i++)
        for (int k = 0; k < vectors; k++) {
            const __m512 v = bf16_load_v(x + i * W + 16 * k);
            a[k] = _mm512_add_ps(a[k], _mm512_mul_ps(v, v));
        }
    for (int k = 0; k < vectors; k++)
        _mm512_storeu_ps(acc + 16 * k, a[k]);
}

AVX512 static void scaled_row_avx512(const uint16_t *x, const uint16_t *w, int64_t n, float scale, uint16_t *y) {
    const __m512 s = _mm512_set1_ps(scale);
    int64_t j = 0;
    for (; j + 16 <= n; j += 16) {
        const __m512 h = bf16_values_v(bf16_bits_v(_mm512_mul_ps(bf16_load_v(x + j), s), 0x7FC0));
        _mm256_storeu_si256((__m256i *)(y + j), bf16_bits_v(_mm512_mul_ps(bf16_load_v(w + j), h), 0x7FC0));
    }
    scaled_row(x + j, w + j, n - j, scale, y + j);
}
#endif

/* Σ_j x[j]² in ATen's order for vectors of L lanes (see the header) */
static float sum_of_squares(const uint16_t *x, int64_t n, int L, int wide) {
    float acc[LEVELS][ROUND_MAX] = {{0}};
    const int W = ILP * L;
    const int64_t vectors = n / L, rounds = vectors / ILP;
    int64_t level_power = 0; /* max(4, ceil(log2(rounds)) / LEVELS) */
    while (((int64_t)1 << level_power) < rounds)
        level_power++;
    level_power = level_power / LEVELS > 4 ? level_power / LEVELS : 4;
    const int64_t step = (int64_t)1 << level_power, mask = step - 1;
#if HAS_AVX512
    void (*add)(float *, const uint16_t *, int64_t, int64_t, int) = wide ? add_rounds_avx512 : add_rounds;
#else
    void (*add)(float *, const uint16_t *, int64_t, int64_t, int) = add_rounds;
    (void)wide;
#endif
    int64_t i = 0;
    while (i + step <= rounds) {
        add(acc[0], x, i, i + step, W);
        i += step;
        for (int j = 1; j < LEVELS; j++) {
            for (int c = 0; c < W; c++) {
                acc[j][c] += acc[j - 1][c];
                acc[j - 1][c] = 0;
            }
            if ((i & (mask << (j * level_power))) != 0)
                break;
        }
    }
    add(acc[0], x, i, rounds, W);
    for (int j = 1; j < LEVELS; j++)
        for (int c = 0; c < W; c++)
            acc[0][c] += acc[j][c];
    for (int64_t v = rounds * ILP; v < vectors; v++) /* whole vectors past the last round */
        for (int l = 0; l < L; l++) {
            const float e = bf16_widened(x[v * L + l]);
            acc[0][l] += e * e;
        }
    for (int k = 1; k < ILP; k++)
        for (int l = 0; l < L; l++)
            acc[0][l] += acc[0][k * L + l];
    float total = 0;
    for (int64_t j = vectors * L; j < n; j++) {
        const float e = bf16_widened(x[j]);
        total += e * e;
    }
    for (int l = 0; l < L; l++)
        total += acc[0][l];
    return total;
}

static int wide_here(int32_t portable) {
#if HAS_AVX512
    return !portable && __builtin_cpu_supports("avx512f");
#else
    (void)portable;
    return 0;
#endif
}

/* rows [r0, r1) of out = RMSNorm(x) with weight w [n] (see the header); x [rows, n] and
   out bf16 with row strides ldx and ldo, unit stride along n. lanes: 16 or 8, the sum's
   order (ATen's kernels for vectors of 16 or 8 floats). portable: not the AVX-512 code
   (the same bits: for tests). Returns 0, or 1 for another lane count. */
int ptq_rms_norm_bf16(const uint16_t *x, int64_t ldx, const uint16_t *w, int64_t r0, int64_t r1, int64_t n,
                      float eps, int32_t lanes, int32_t portable, uint16_t *out, int64_t ldo) {
    if (lanes != 16 && lanes != 8)
        return 1;
    const int wide = wide_here(portable);
    for (int64_t r = r0; r < r1; r++) {
        const uint16_t *xr = x + r * ldx;
        const float variance = sum_of_squares(xr, n, lanes, wide) / (float)n;
        const float scale = 1.0f / sqrtf(variance + eps);
#if HAS_AVX512
        if (wide) {
            scaled_row_avx512(xr, w, n, scale, out + r * ldo);
            continue;
        }
#endif
        scaled_row(xr, w, n, scale, out + r * ldo);
    }
    return 0;
}

/* sums[r] = Σ_j x[r, j]² for rows [0, rows) of bf16 x (row stride ldx), in the norm's order
   for `lanes` (16 or 8): callers compare them with torch's to learn which order it sums in.
   Returns 0, or 1 for another lane count. */
int ptq_sum_squares_bf16(const uint16_t *x, int64_t ldx, int64_t rows, int64_t n, int32_t lanes, float *sums) {
    if (lanes != 16 && lanes != 8)
        return 1;
    const int wide = wide_here(0);
    for (int64_t r = 0; r < rows; r++)
        sums[r] = sum_of_squares(x + r * ldx, n, lanes, wide);
    return 0;
}
