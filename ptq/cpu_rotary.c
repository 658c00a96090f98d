/* Rotary position embedding of queries or keys on a CPU, compiled: the calibration passes'
   apply_rotary_pos_emb (ptq/cpu_rotary.py; the torch reference is transformers' Llama one,
   q · cos + rotate_half(q) · sin, rotate_half(x) = [-x2, x1] of the two halves of a head):

       out[i]     = r(r(x[i] · cos[i])     + r(-x[i + h] · sin[i]))      i < h = dim / 2
       out[i + h] = r(r(x[i + h] · cos[i + h]) + r(x[i] · sin[i + h]))

   each step as torch takes it: in bf16 the operands widened to float32 (products exact),
   every product and the sum rounded to bf16 (r: to nearest even), torch's three ops and
   their roundings; in float32 each product and the sum rounded to float32 (no fused
   multiply-add: the library is built with -ffp-contract=off). torch runs five passes, each
   allocating its result (the products, the halves' concatenation, the sum); here one reads
   x, cos and sin once and writes out.

   Non-finite results are flagged, not matched (torch's vector code writes NaN as 0xFFFF
   where c10::BFloat16 writes 0x7FC0): a caller that sees any runs torch instead. bf16 rows
   on a CPU with AVX-512 take 16 lanes at a time where a half holds a multiple of 16;
   elsewhere the portable loops, with the same bits. */

#include "algorithms/quant_math.h"

static inline uint16_t narrowed(float r) { /* a float32 holding a bf16 value, as bf16 bits */
    uint32_t bits;
    memcpy(&bits, &r, 4);
    return (uint16_t)(bits >> 16);
}

/* one head row of 2h bf16 values; non-finite results counted */
static int64_t row_bf16_portable(const uint16_t *x, const uint16_t *c, const uint16_t *s, int64_t h, uint16_t *out) {
    int64_t odd = 0;
    for (int64_t i = 0; i < h; i++) {
        const float a = bf16_widened(x[i]), b = bf16_widened(x[i + h]);
        const float lo = to_bf16(to_bf16(a * bf16_widened(c[i])) + to_bf16(-b * bf16_widened(s[i])));
        const float hi = to_bf16(to_bf16(b * bf16_widened(c[i + h])) + to_bf16(a * bf16_widened(s[i + h])));
        odd += !(lo - lo == 0.0f) + !(hi - hi == 0.0f); /* NaN for an infinite or NaN value */
        out[i] = narrowed(lo);
        out[i + h] = narrowed(hi);
    }
    return odd;
}

#if HAS_AVX512 /* (quant_math.h) */
/* row_bf16_portable for every head at one position: x and out the first head's row, the
   others `xs` and `os` elements apart; cos and sin read once for all heads; h a multiple
   of 16. Returns nonzero where some result is not finite. */
AVX512 static int64_t position_bf16_avx512(const uint16_t *x, int64_t xs, int64_t heads, const uint16_t *c,
                                           const uint16_t *s, int64_t h, uint16_t *out, int64_t os) {
    const __m512 zero = _mm512_setzero_ps();
    const __m512i sign = _mm512_set1_epi32((int)0x80000000u);
    __mmask16 odd = 0;
    for (int64_t i = 0; i < h; i += 16) {
        const __m512 c_lo = bf16_load_v(c + i), c_hi = bf16_load_v(c + i + h);
        const __m512 s_lo = bf16_load_v(s + i), s_hi = bf16_load_v(s + i + h);
        for (int64_t k = 0; k < heads; k++) {
            const uint16_t *xr = x + k * xs;
            const __m512 a = bf16_load_v(xr + i), b = bf16_load_v(xr + i + h);
            const __m512 nb = _mm512_castsi512_ps(_mm512_xor_si512(_mm512_castps_si512(b), sign));
            const __m512 lo = to_bf16_v(_mm512_add_ps(to_bf16_v(_mm512_mul_ps(a, c_lo)),
                                                      to_bf16_v(_mm512_mul_ps(nb, s_lo))));
            const __m512 hi = to_bf16_v(_mm512_add_ps(to_bf16_v(_mm512_mul_ps(b, c_hi)),
                                                      to_bf16_v(_mm512_mul_ps(a, s_hi))));
            odd |= _mm512_cmp_ps_mask(_mm512_sub_ps(lo, lo), zero, _CMP_NEQ_UQ);
            odd |= _mm512_cmp_ps_mask(_mm512_sub_ps(hi, hi), zero, _CMP_NEQ_UQ);
            bf16_store_v(out + k * os + i, lo);
            bf16_store_v(out + k * os + i + h, hi);
        }
    }
    return odd != 0;
}
#endif

/* one head row of 2h float32 values; non-finite results counted */
VECTORIZED static int64_t row_f32(const float *x, const float *c, const float *s, int64_t h, float *out) {
    int64_t odd = 0;
    for (int64_t i = 0; i < h; i++) {
        const float a = x[i], b = x[i + h];
        const float lo = a * c[i] + (-b) * s[i];
        const float hi = b * c[i + h] + a * s[i + h];
        odd += !(lo - lo == 0.0f) + !(hi - hi == 0.0f);
        out[i] = lo;
        out[i + h] = hi;
    }
    return odd;
}

/* The rotary embedding of x [batch, heads, seq, dim] into out (same shape), each with its
   own strides in elements (the last one 1), by cos and sin [batch or 1, seq, dim] (strides
   cs0, 0 where one row serves every batch, and cs1; the last one 1; cos and sin share
   them). float32: 1 for float32 tensors, 0 for bf16; dim even. portable: not the AVX-512
   code (the same bits: for tests). Positions in order, all heads at each (a projection's
   heads at one position lie side by side). Returns nonzero where some result is not
   finite. */
int64_t ptq_rotary(const void *x, int64_t batch, int64_t heads, int64_t seq, int64_t dim, int64_t xs0, int64_t xs1,
                   int64_t xs2, const void *cos, const void *sin, int64_t cs0, int64_t cs1, int32_t float32,
                   int32_t portable, void *out, int64_t os0, int64_t os1, int64_t os2) {
    const int64_t h = dim / 2;
#if HAS_AVX512
    const int wide = !portable && !float32 && h % 16 == 0 && __builtin_cpu_supports("avx512f");
#else
    const int wide = 0;
    (void)portable;
#endif
    int64_t odd = 0;
    for (int64_t b = 0; b < batch; b++)
        for (int64_t t = 0; t < seq; t++) {
            const int64_t xi = b * xs0 + t * xs2, oi = b * os0 + t * os2, ci = b * cs0 + t * cs1;
            if (float32) {
                for (int64_t k = 0; k < heads; k++)
                    odd += row_f32((const float *)x + xi + k * xs1, (const float *)cos + ci, (const float *)sin + ci,
                                   h, (float *)out + oi + k * os1);
                continue;
            }
            const uint16_t *xr = (const uint16_t *)x + xi, *cr = (const uint16_t *)cos + ci;
            const uint16_t *sr = (const uint16_t *)sin + ci;
            uint16_t *orow = (uint16_t *)out + oi;
#if HAS_AVX512
            if (wide) {
                odd += position_bf16_avx512(xr, xs1, heads, cr, sr, h, orow, os1);
                continue;
            }
#endif
            for (int64_t k = 0; k < heads; k++)
                odd += row_bf16_portable(xr + k * xs1, cr, sr, h, orow + k * os1);
        }
    return odd;
}
