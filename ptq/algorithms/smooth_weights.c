/* The passes over bf16 weights around AWQ's grid and SmoothQuant, compiled (AVX-512):

   - ptq_abs_over_max: |W| / (max |W| of its group + 1e-6) in float32, the normalized
     weights whose mean over the rows is AWQ's w̄ (ptq/algorithms/awq.py, weight_mean);
   - ptq_scale_bf16: W · f rounded to bf16, f a float32 factor per column or per row, the
     scales folded into the weights (ptq/algorithms/smoothquant.py, _scale_).

   Each takes the float32 steps of its torch reference, so gives its bits, in one pass over
   the weights where torch takes three or four (widen, abs, max, divide; widen, multiply,
   round). ptq.algorithms.smooth_compiled calls each on one thread: the passes are bound by
   memory. */

#include "quant_math.h"

#if HAS_AVX512

/* W [rows, cols] (bf16) to |W| / (m + 1e-6) into out (float32, the same
   shape), m the largest |w| of each group of `size` consecutive columns of a row (size a
   multiple of 16 dividing cols). The largest |w| is exact, and NaN where the group holds a
   NaN (as torch's amax: the whole group's quotients are NaN then); the sum and the quotient
   are float32 ops rounded once, as torch's. */
AVX512 static void abs_over_max_rows(const uint16_t *W, int64_t rows, int64_t cols, int64_t size, float *out) {
    for (int64_t r = 0; r < rows; r++)
        for (int64_t b = 0; b < cols; b += size) {
            const uint16_t *w = W + r * cols + b;
            __m512 m = _mm512_abs_ps(bf16_load_v(w));
            __mmask16 nan = _mm512_cmp_ps_mask(m, m, _CMP_UNORD_Q);
            for (int64_t k = 16; k < size; k += 16) {
                const __m512 v = _mm512_abs_ps(bf16_load_v(w + k));
                nan |= _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
                m = _mm512_max_ps(v, m);
            }
            float largest = _mm512_reduce_max_ps(m);
            if (nan) /* torch's amax is NaN then; max_ps may have dropped it */
                largest = __builtin_nanf("");
            const __m512 divisor = _mm512_set1_ps(largest + 1e-6f);
            for (int64_t k = 0; k < size; k += 16)
                _mm512_storeu_ps(out + r * cols + b + k,
                                 _mm512_div_ps(_mm512_abs_ps(bf16_load_v(w + k)), divisor));
        }
}

/* W [rows, cols] (bf16) times f (float32: f[c] per column, or f[r] per row where per_row)
   rounded to bf16 into out (the same shape; may be W); cols a multiple of 16 */
AVX512 static void scale_rows(const uint16_t *W, int64_t rows, int64_t cols, const float *f, int32_t per_row,
                              uint16_t *out) {
    for (int64_t r = 0; r < rows; r++) {
        const __m512 row_factor = _mm512_set1_ps(per_row ? f[r] : 0);
        for (int64_t c = 0; c < cols; c += 16) {
            const __m512 factor = per_row ? row_factor : _mm512_loadu_ps(f + c);
            const __m512 x = _mm512_mul_ps(bf16_load_v(W + r * cols + c), factor);
            /* NaN as torch's vectorized conversion writes it */
            _mm256_storeu_si256((__m256i *)(out + r * cols + c), bf16_bits_v(x, 0xFFFF));
        }
    }
}
#endif

/* abs_over_max_rows and scale_rows where they run (AVX-512; groups and rows of a multiple
   of 16 columns): 0, else 1 (nothing written) */
int ptq_abs_over_max(const uint16_t *W, int64_t rows, int64_t cols, int64_t size, float *out) {
#if HAS_AVX512
    if (__builtin_cpu_supports("avx512f") && size % 16 == 0 && cols % size == 0) {
        abs_over_max_rows(W, rows, cols, size, out);
        return 0;
    }
#endif
    (void)W, (void)rows, (void)cols, (void)size, (void)out;
    return 1;
}

int ptq_scale_bf16(const uint16_t *W, int64_t rows, int64_t cols, const float *f, int32_t per_row, uint16_t *out) {
#if HAS_AVX512
    if (__builtin_cpu_supports("avx512f") && cols % 16 == 0) {
        scale_rows(W, rows, cols, f, per_row, out);
        return 0;
    }
#endif
    (void)W, (void)rows, (void)cols, (void)f, (void)per_row, (void)out;
    return 1;
}
