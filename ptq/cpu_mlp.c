/* The SiLU-gated product of a Llama-style MLP in bf16 on a CPU, compiled: the calibration
   passes' act_fn(gate) * up (ptq/cpu_mlp.py; the torch reference is transformers'
   LlamaMLP.forward with a SiLU activation):

       y = bf16(float(silu(g)) · float(u))

   silu(g), a bf16 value of a bf16 g, is looked up in a table of all 65536 that torch's own
   F.silu computed (ptq/cpu_mlp.py makes it once, in its vector code), so it is torch's
   bits without its exp; the product is exact in float32 steps as torch's (bf16 operands
   widened, one multiply) and rounded to bf16 to nearest even. torch makes two passes over
   the activations (silu, rounded, then the product), each converting bf16 to float32 and
   back; here one reads g and u once and writes y.

   Non-finite products are counted, not matched: torch's vector code writes 0xFFFF for a NaN
   where c10::BFloat16 writes 0x7FC0, so a caller that sees any runs torch instead. On a CPU
   with AVX-512, 16 lanes at a time (a gather from the table); elsewhere the portable loop,
   with the same bits. */

#include "algorithms/quant_math.h"

/* y[i] = bf16(silu[g[i]] · u[i]) for i in [i0, i1); the number of non-finite products */
static int64_t silu_mul_portable(const uint16_t *g, const uint16_t *u, const uint16_t *silu, int64_t i0, int64_t i1,
                                 uint16_t *y) {
    int64_t odd = 0;
    for (int64_t i = i0; i < i1; i++) {
        const float p = bf16_widened(silu[g[i]]) * bf16_widened(u[i]);
        odd += !(p - p == 0.0f); /* NaN for an infinite or NaN p */
        const float r = to_bf16(p);
        uint32_t bits;
        memcpy(&bits, &r, 4);
        y[i] = (uint16_t)(bits >> 16);
    }
    return odd;
}

#if HAS_AVX512 /* (quant_math.h) */
AVX512 static int64_t silu_mul_avx512(const uint16_t *g, const uint16_t *u, const uint16_t *silu, int64_t n,
                                      uint16_t *y) {
    int64_t odd = 0, i = 0;
    const __m512 zero = _mm512_setzero_ps();
    for (; i + 16 <= n; i += 16) {
        const __m512i index = _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)(g + i)));
        /* 32 bits at silu + 2·index: the entry in the low half (little-endian), the next
           one (the table has one more, for the last) shifted out */
        const __m512i entry = _mm512_i32gather_epi32(index, (const void *)silu, 2);
        const __m512 s = _mm512_castsi512_ps(_mm512_slli_epi32(entry, 16));
        const __m512 v = bf16_load_v(u + i);
        const __m512 p = _mm512_mul_ps(s, v);
        odd += __builtin_popcount(_mm512_cmp_ps_mask(_mm512_sub_ps(p, p), zero, _CMP_NEQ_UQ));
        const __m512i bits = _mm512_srli_epi32(_mm512_castps_si512(to_bf16_v(p)), 16);
        _mm256_storeu_si256((__m256i *)(y + i), _mm512_cvtepi32_epi16(bits));
    }
    return odd + silu_mul_portable(g, u, silu, i, n, y);
}
#endif

/* Rows of g and u are asked into the cache this many rows ahead: the gathers from the table
   hold up the loads behind them, so without it few cache misses were in flight and the
   product of activations that had left the cache ran at 0.8 G values/s on a Xeon (AMX) VM,
   against 3 with them in cache. */
enum { AHEAD = 4 };

/* y = bf16(silu[g] · u) over rows of n bf16 values (see the header), row r of g, u and y
   at r·gstride, r·ustride and r·n values (g and u may be column slices of one wider
   tensor: gate/up computed in one GEMM); silu: 65537 bf16 values, the SiLU of every bf16
   bit pattern in order and one more (read, never used). portable: not the AVX-512 code
   (the same bits: for tests). Returns how many products are not finite. */
int64_t ptq_silu_mul_bf16(const uint16_t *g, int64_t gstride, const uint16_t *u, int64_t ustride, int64_t rows,
                          int64_t n, const uint16_t *silu, int32_t portable, uint16_t *y) {
    int64_t odd = 0;
    for (int64_t r = 0; r < rows; r++) {
        const uint16_t *gr = g + r * gstride, *ur = u + r * ustride;
        uint16_t *yr = y + r * n;
        if (r + AHEAD < rows) /* see AHEAD */
            for (int64_t k = 0; k < n; k += 32) {
                __builtin_prefetch(gr + AHEAD * gstride + k);
                __builtin_prefetch(ur + AHEAD * ustride + k);
            }
#if HAS_AVX512
        if (!portable && __builtin_cpu_supports("avx512f")) {
            odd += silu_mul_avx512(gr, ur, silu, n, yr);
            continue;
        }
#endif
        odd += silu_mul_portable(gr, ur, silu, 0, n, yr);
    }
    (void)portable;
    return odd;
}
