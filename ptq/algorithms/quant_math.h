/* Arithmetic shared by the compiled loops (gptq_loop.c, awq_grid.c): rounding as torch
   rounds, the scale dtypes, and quantization parameters from a range, in the float32 steps
   of ptq/primitives.py. */

#ifndef PTQ_QUANT_MATH_H
#define PTQ_QUANT_MATH_H

#include <stdint.h>
#include <stdlib.h>
#include <string.h>

/* ptq_compiled_abi's answer: raised whenever an exported function's arguments change, so that
   a library built before (an editable install not rebuilt) is refused instead of called wrongly */
enum { PTQ_COMPILED_ABI = 21 };

enum { SCALE_F32 = 0, SCALE_BF16 = 1, SCALE_F16 = 2 }; /* also the dtypes of weights and outputs */

#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define VECTORIZED __attribute__((target_clones("avx512f", "avx2", "default")))
#else
#define VECTORIZED
#endif

static const float ROUNDER = 12582912.0f; /* 1.5 * 2^23: x + R - R rounds |x| < 2^22 half to even */

/* round half to even, then clamp to [lo, hi]. Exact for |x| < 2^22; larger |x| (and inf)
   end beyond any 8-bit range and clamp as rint would. */
static inline float round_clamp(float x, float lo, float hi) {
    float r = (x + ROUNDER) - ROUNDER;
    r = r < lo ? lo : r;
    return r > hi ? hi : r;
}

/* a bf16 value (its bits) as float32: exact */
static inline float bf16_widened(uint16_t h) {
    const uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

static inline float to_bf16(float x) {
    uint32_t u;
    memcpy(&u, &x, 4);
    u += 0x7FFFu + ((u >> 16) & 1u); /* round to nearest even (x finite) */
    u &= 0xFFFF0000u;
    memcpy(&x, &u, 4);
    return x;
}

static inline float to_scale_dtype(float x, int kind) {
    if (kind == SCALE_BF16)
        return to_bf16(x);
#if defined(__FLT16_MAX__)
    if (kind == SCALE_F16)
        return (float)(_Float16)x;
#endif
    return x;
}

#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#include <immintrin.h>
#define AVX512 __attribute__((target("avx512f")))
#define HAS_AVX512 1

/* to_bf16, 16 lanes at a time (for code on the AVX-512 paths) */
AVX512 static inline __m512 to_bf16_v(__m512 x) {
    __m512i u = _mm512_castps_si512(x);
    const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
    u = _mm512_add_epi32(u, _mm512_add_epi32(odd, _mm512_set1_epi32(0x7FFF)));
    return _mm512_castsi512_ps(_mm512_and_si512(u, _mm512_set1_epi32((int)0xFFFF0000u)));
}
/* 16 bf16 values at p widened to float32 (exact) */
AVX512 static inline __m512 bf16_load_v(const uint16_t *p) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)p)), 16));
}
/* 16 float32 rounded to bf16 (to_bf16_v) as their 16 bits, NaN lanes as `nan` (torch's
   scalar conversion writes 0x7FC0 for a NaN, its vector code 0xFFFF) */
AVX512 static inline __m256i bf16_bits_v(__m512 x, int nan) {
    const __m512i rounded = _mm512_srli_epi32(_mm512_castps_si512(to_bf16_v(x)), 16);
    const __mmask16 lanes = _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q);
    return _mm512_cvtepi32_epi16(_mm512_mask_mov_epi32(rounded, lanes, _mm512_set1_epi32(nan)));
}
/* 16 float32 that hold bf16 values (to_bf16_v's) stored at p as bf16 */
AVX512 static inline void bf16_store_v(uint16_t *p, __m512 x) {
    _mm256_storeu_si256((__m256i *)p, _mm512_cvtepi32_epi16(_mm512_srli_epi32(_mm512_castps_si512(x), 16)));
}
/* rows [16] of 16 32-bit values, transposed in place (4 rounds of shuffles) */
AVX512 static inline void transpose16(__m512i r[16]) {
    __m512i a[16], b[16];
    for (int i = 0; i < 8; i++) {
        a[2 * i] = _mm512_unpacklo_epi32(r[2 * i], r[2 * i + 1]);
        a[2 * i + 1] = _mm512_unpackhi_epi32(r[2 * i], r[2 * i + 1]);
    }
    for (int i = 0; i < 4; i++) { /* b[4i + k], 128-bit lane L: column 4L + k of rows 4i..4i+3 */
        b[4 * i + 0] = _mm512_unpacklo_epi64(a[4 * i + 0], a[4 * i + 2]);
        b[4 * i + 1] = _mm512_unpackhi_epi64(a[4 * i + 0], a[4 * i + 2]);
        b[4 * i + 2] = _mm512_unpacklo_epi64(a[4 * i + 1], a[4 * i + 3]);
        b[4 * i + 3] = _mm512_unpackhi_epi64(a[4 * i + 1], a[4 * i + 3]);
    }
    for (int k = 0; k < 4; k++) { /* row 4L + k: lane L of b[k], b[4 + k], b[8 + k], b[12 + k] */
        const __m512i c0 = _mm512_shuffle_i32x4(b[k], b[4 + k], 0x88), c1 = _mm512_shuffle_i32x4(b[k], b[4 + k], 0xDD);
        const __m512i d0 = _mm512_shuffle_i32x4(b[8 + k], b[12 + k], 0x88);
        const __m512i d1 = _mm512_shuffle_i32x4(b[8 + k], b[12 + k], 0xDD);
        r[k] = _mm512_shuffle_i32x4(c0, d0, 0x88);
        r[4 + k] = _mm512_shuffle_i32x4(c1, d1, 0x88);
        r[8 + k] = _mm512_shuffle_i32x4(c0, d0, 0xDD);
        r[12 + k] = _mm512_shuffle_i32x4(c1, d1, 0xDD);
    }
}

#if __GNUC__ >= 11
/* AMX's tile configuration (palette 1): tiles 0-7 as 16 rows of 64 bytes each. A static
   object: built on the stack, GCC 12 dropped the stores of rows and colsb before
   ldtilecfg (which then faulted on the reserved bytes left unset). */
typedef struct {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} TileConfig;
static const TileConfig TILES_16x64 = {.palette = 1,
                                       .colsb = {64, 64, 64, 64, 64, 64, 64, 64},
                                       .rows = {16, 16, 16, 16, 16, 16, 16, 16}};

/* this thread's tiles as TILES_16x64 (the process must have asked for AMX: ptq_amx_available) */
__attribute__((target("amx-tile"))) static inline void configure_tiles(void) { _tile_loadconfig(&TILES_16x64); }
/* and back to no tiles (the state freed) */
__attribute__((target("amx-tile"))) static inline void release_tiles(void) { _tile_release(); }
#endif
#else
#define HAS_AVX512 0
#endif

/* Cephes' expf constants, shared by the attention's exp_v (16 lanes,
   ptq/cpu_attention.c) and exp8 (8 lanes, ptq/cpu_attention_f32.c) */
#define EXP_LOWEST -87.0f
#define EXP_LOG2E 1.44269504088896341f
#define EXP_LN2_HI 0.693359375f
#define EXP_LN2_LO -2.12194440e-4f
#define EXP_P0 1.9875691500e-4f
#define EXP_P1 1.3981999507e-3f
#define EXP_P2 8.3334519073e-3f
#define EXP_P3 4.1665795894e-2f
#define EXP_P4 1.6666665459e-1f
#define EXP_P5 5.0000001201e-1f

/* the smallest normal value of the scale dtype (torch.finfo(dtype).tiny) */
static inline float tiny_of(int kind) { return kind == SCALE_F16 ? 6.103515625e-05f : 1.17549435e-38f; }

/* scale and zero of one group from its range [lo, hi] (primitives.qparams_from_minmax): the
   scale rounded to the scale dtype, the zero (asymmetric only) an integer held in a float */
static inline void group_params(float lo, float hi, float qmin, float qmax, int kind, int asym, float *scale,
                                float *zero) {
    const float tiny = tiny_of(kind);
    lo = lo > 0 ? 0 : lo;
    hi = hi < 0 ? 0 : hi;
    float sc;
    if (asym) {
        sc = to_scale_dtype((hi - lo) / (qmax - qmin), kind);
        sc = sc < tiny ? tiny : sc;
        *zero = round_clamp(qmin - lo / sc, qmin, qmax);
    } else {
        const float absmax = -lo > hi ? -lo : hi;
        sc = to_scale_dtype(absmax / ((qmax - qmin) / 2), kind);
        sc = sc < tiny ? tiny : sc;
    }
    *scale = sc;
}

#endif
