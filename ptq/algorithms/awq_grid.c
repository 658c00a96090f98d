/* AWQ's grid of candidate weights on a CPU, compiled.

   The torch reference is ptq/algorithms/awq.py (candidate_weights) over
   ptq/primitives.py (fake_quantize): for candidate scales s [in], each row's groups of W·s
   get min-max parameters, are rounded, dequantized in the scale dtype, divided by s and
   rounded to the weights' dtype, in the same float32 steps as torch, so to the same bits.
   torch takes about ten passes over [candidates, out, in] tensors for this; here each
   group is done while it is in the cache. Rows are independent: callers split them, or the
   candidates, across threads. Built with the GPTQ loop (setup.py): no fused multiply-add
   is formed by the compiler.

   On a CPU with AVX-512, groups of a multiple of 16 columns take a vector path with the
   same bits (candidate_rows_avx512): the ranges of 16 rows' groups first, reduced and made
   parameters 16 at a time (one row a lane), then each row's candidates, so that no group
   waits on the one before, in loops of their own for the common dtypes (no test on the
   dtypes per 16 weights) where, with at most 16 levels (4 bits), each weight's dequantized
   level is looked up in the group's table of 16 instead of scaled and rounded to bf16 one
   by one; and each division by the group scale or by s done as a multiplication by the
   reciprocal and one exact correction (Markstein's: q = a·y, then q + (a - q·b)·y with
   y = 1/b rounded to nearest and the residual exact by one fused multiply-add; rounded to
   nearest, that is a/b rounded to nearest while dividend, residual and quotient stay in
   the normal range). Where they may not (values beyond SAFE, scales or quotients below
   SMALLEST), it divides, or runs the row the portable way. Checked bit for bit against the
   portable loop on 849M random weights (tests/algorithms/test_awq_compiled.py checks edge
   values), and the blocks of 16 rows and the tables against the one-row-at-a-time loop
   before them on 800 random cases (rows not a multiple of 16, every dtype, scheme, bit
   width and path, infinities, NaN and subnormals). */

#include "quant_math.h"

enum { BLOCK = 16 }; /* rows whose ranges and parameters are found together, one per lane */

/* x = w·s over one group, and its min and max. Finite math lets min and max vectorize; they
   are exact, so the order they run in changes nothing (but the sign of a zero range end,
   which group_params treats alike). */
__attribute__((optimize("finite-math-only", "no-signed-zeros")))
VECTORIZED static void scaled_range(const float *w, const float *s, float *x, int64_t size, float *lo_out,
                                    float *hi_out) {
    for (int64_t m = 0; m < size; m++)
        x[m] = w[m] * s[m];
    float lo = x[0], hi = x[0];
    for (int64_t m = 0; m < size; m++) {
        lo = x[m] < lo ? x[m] : lo;
        hi = x[m] > hi ? x[m] : hi;
    }
    *lo_out = lo;
    *hi_out = hi;
}

/* x [size] (scaled weights) to Q(x)/s rounded to the weights' dtype, one function per pair
   of (scale, weight) dtypes so that the loop has no branch and vectorizes. A symmetric
   scheme passes zero = 0: adding and taking away 0 changes nothing but a -0 to +0, as
   torch's round trip through int8 does. */
#define CANDIDATE_GROUP(name, SCALE_KIND, WEIGHT_KIND)                                                         \
    VECTORIZED static void name(float *x, const float *s, int64_t size, float scale, float zero, float qmin,    \
                                float qmax) {                                                                   \
        for (int64_t m = 0; m < size; m++) {                                                                    \
            const float t = round_clamp(x[m] / scale + zero, qmin, qmax) - zero;                                \
            x[m] = to_scale_dtype(to_scale_dtype(t * scale, SCALE_KIND) / s[m], WEIGHT_KIND);                   \
        }                                                                                                       \
    }
CANDIDATE_GROUP(group_f32_f32, SCALE_F32, SCALE_F32)
CANDIDATE_GROUP(group_f32_bf16, SCALE_F32, SCALE_BF16)
CANDIDATE_GROUP(group_f32_f16, SCALE_F32, SCALE_F16)
CANDIDATE_GROUP(group_bf16_f32, SCALE_BF16, SCALE_F32)
CANDIDATE_GROUP(group_bf16_bf16, SCALE_BF16, SCALE_BF16)
CANDIDATE_GROUP(group_bf16_f16, SCALE_BF16, SCALE_F16)
CANDIDATE_GROUP(group_f16_f32, SCALE_F16, SCALE_F32)
CANDIDATE_GROUP(group_f16_bf16, SCALE_F16, SCALE_BF16)
CANDIDATE_GROUP(group_f16_f16, SCALE_F16, SCALE_F16)

typedef void (*GroupFn)(float *, const float *, int64_t, float, float, float, float);
static const GroupFn GROUPS[3][3] = { /* [scale kind][weight kind] */
    {group_f32_f32, group_f32_bf16, group_f32_f16},
    {group_bf16_f32, group_bf16_bf16, group_bf16_f16},
    {group_f16_f32, group_f16_bf16, group_f16_f16},
};

VECTORIZED static void subtract(float *x, const float *w, int64_t n) {
    for (int64_t i = 0; i < n; i++)
        x[i] = x[i] - w[i];
}

VECTORIZED static void store(const float *x, void *out, int64_t n, int kind) {
    if (kind == SCALE_BF16) {
        uint16_t *o = out;
        for (int64_t i = 0; i < n; i++) {
            uint32_t u;
            const float r = to_bf16(x[i]);
            memcpy(&u, &r, 4);
            o[i] = (uint16_t)(u >> 16);
        }
        return;
    }
#if defined(__FLT16_MAX__)
    if (kind == SCALE_F16) {
        _Float16 *o = out;
        for (int64_t i = 0; i < n; i++)
            o[i] = (_Float16)x[i];
        return;
    }
#endif
    memcpy(out, x, (size_t)n * sizeof(float));
}

/* Candidate weights of rows [r0, r1) of W [rows, in] (float32) for the candidate scales
   s [in], portably: see ptq_awq_candidates. x: `in` floats of scratch. */
static void candidate_rows(int64_t r0, int64_t r1, const float *W, int64_t in, const float *s, int64_t size,
                           int32_t scale_kind, float qmin, float qmax, int32_t asym, int32_t weight_kind,
                           int32_t delta, int32_t out_kind, void *out, float *x) {
    const size_t width = out_kind == SCALE_F32 ? 4 : 2;
    const GroupFn candidate_group = GROUPS[scale_kind][weight_kind];
    for (int64_t r = r0; r < r1; r++) {
        const float *w = W + r * in;
        for (int64_t g = 0; g + size <= in; g += size) {
            float lo, hi, scale, zero = 0;
            scaled_range(w + g, s + g, x + g, size, &lo, &hi);
            group_params(lo, hi, qmin, qmax, scale_kind, asym, &scale, &zero);
            candidate_group(x + g, s + g, size, scale, zero, qmin, qmax);
        }
        if (delta)
            subtract(x, w, in);
        store(x, (char *)out + (size_t)r * (size_t)in * width, in, out_kind);
    }
}

/* ---- The AVX-512 path: the portable loop's float32 steps, 16 columns at a time. */
#if HAS_AVX512 /* (quant_math.h) */

AVX512 static inline __m512 to_scale_dtype_v(__m512 x, int kind) {
    if (kind == SCALE_BF16)
        return to_bf16_v(x);
    if (kind == SCALE_F16)
        return _mm512_cvtph_ps(_mm512_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
    return x;
}

/* round_clamp: (r < lo ? lo : r), then (r > hi ? hi : r), as max and min take them */
AVX512 static inline __m512 round_clamp_v(__m512 x, __m512 lo, __m512 hi) {
    const __m512 rounder = _mm512_set1_ps(ROUNDER);
    const __m512 r = _mm512_sub_ps(_mm512_add_ps(x, rounder), rounder);
    return _mm512_min_ps(hi, _mm512_max_ps(lo, r));
}

/* a / b rounded to nearest, from y = 1/b rounded to nearest (Markstein's correction) */
AVX512 static inline __m512 divide_v(__m512 a, __m512 b, __m512 y) {
    const __m512 q = _mm512_mul_ps(a, y);
    return _mm512_fmadd_ps(_mm512_fnmadd_ps(q, b, a), y, q);
}

AVX512 static inline void store_v(__m512 y, void *out, int64_t i, int kind) { /* store, 16 values */
    if (kind == SCALE_BF16) {
        const __m512i bits = _mm512_srli_epi32(_mm512_castps_si512(to_bf16_v(y)), 16);
        _mm256_storeu_si256((__m256i *)((uint16_t *)out + i), _mm512_cvtepi32_epi16(bits));
    } else if (kind == SCALE_F16) {
        _mm256_storeu_si256((__m256i *)((uint16_t *)out + i),
                            _mm512_cvtps_ph(y, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
    } else {
        _mm512_storeu_ps((float *)out + i, y);
    }
}

static const float SAFE = 0x1p100f; /* reciprocals of values within [1/SAFE, SAFE] stay normal */
/* Markstein's correction is exact where the dividend and the quotient are above this (the
   residual and its product with the reciprocal stay normal) */
static const float SMALLEST = 0x1p-90f;

/* columns [m0, m1) of one row's candidates (CANDIDATES_OF_ROW's variables in scope); the
   other arguments as CANDIDATES_OF_ROW's, or constants for the compiler to fold. TABLE: the
   dequantized values looked up in `table` (one lane per level, level l at l & 15: at most
   16 levels) by the clamped quotient rounded to an integer, where the portable loop rounds,
   clamps and multiplies by the scale (the same value: the levels and the range's ends are
   integers, and rounding is monotone) */
#define CANDIDATE_LOOP(TO_BF16, STORE_BF16, ODD, DIVIDE, MAY_BE_TINY, SCALE_KIND, ASYM, WEIGHT_KIND, DELTA,      \
                       OUT_KIND, TABLE)                                                                           \
    do {                                                                                                         \
    for (int64_t m = m0; m < m1; m += 16) {                                                                      \
        const __m512 wv = _mm512_loadu_ps(w + m), sv = _mm512_loadu_ps(s + m);                                  \
        /* else the dividends are above SMALLEST, or their quotients below 1/2 (0 once rounded,                  \
           however inexact) */                                                                                    \
        const __m512 x = _mm512_mul_ps(wv, sv);                                                                  \
        const __m512 q = (DIVIDE) ? _mm512_div_ps(x, sc) : divide_v(x, sc, rsc);                                 \
        __m512 a;                                                                                                \
        if (TABLE) {                                                                                             \
            const __m512 y = _mm512_min_ps(vqmax, _mm512_max_ps(vqmin, (ASYM) ? _mm512_add_ps(q, zr) : q));       \
            a = _mm512_permutexvar_ps(_mm512_cvt_roundps_epi32(y, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC),  \
                                      table);                                                                    \
        } else {                                                                                                 \
            const __m512 t = (ASYM) ? _mm512_sub_ps(round_clamp_v(_mm512_add_ps(q, zr), vqmin, vqmax), zr)       \
                                    : round_clamp_v(q, vqmin, vqmax);                                             \
            /* 0, or at least the scale: normal (the scale dtype's smallest normal at least) */                   \
            const __m512 p = _mm512_mul_ps(t, sc);                                                               \
            a = (SCALE_KIND) == SCALE_BF16 ? TO_BF16(p) : to_scale_dtype_v(p, (SCALE_KIND));                     \
        }                                                                                                        \
        __m512 c = (DIVIDE) ? _mm512_div_ps(a, sv) : divide_v(a, sv, _mm512_loadu_ps(rs + m));                  \
        __mmask16 odd = ODD(wv);                                                                                 \
        if (MAY_BE_TINY) {                                                                                       \
            const __mmask16 tiny = _mm512_cmp_ps_mask(_mm512_abs_ps(c), smallest, _CMP_LT_OQ) &                  \
                                   _mm512_cmp_ps_mask(a, _mm512_setzero_ps(), _CMP_NEQ_UQ);                       \
            if (tiny) /* the quotient too: divide */                                                             \
                c = _mm512_mask_div_ps(c, tiny, a, sv);                                                          \
            odd |= tiny;                                                                                         \
        }                                                                                                        \
        c = (WEIGHT_KIND) == SCALE_BF16 && !odd ? TO_BF16(c) : to_scale_dtype_v(c, (WEIGHT_KIND));               \
        if (DELTA)                                                                                               \
            c = _mm512_sub_ps(c, wv);                                                                            \
        if ((OUT_KIND) == SCALE_BF16 && !odd)                                                                    \
            STORE_BF16(c, o, m);                                                                                 \
        else                                                                                                     \
            store_v(c, o, m, (OUT_KIND));                                                                        \
    }                                                                                                            \
    } while (0)

/* CANDIDATE_LOOP for bf16 scales, weights and outputs and no tiny quotient, one loop for
   each scheme (asym) and output (delta) */
#define BF16_LOOPS(TO_BF16, STORE_BF16, ODD, TABLE)                                                              \
    do {                                                                                                         \
        if (asym && delta)                                                                                       \
            CANDIDATE_LOOP(TO_BF16, STORE_BF16, ODD, 0, 0, SCALE_BF16, 1, SCALE_BF16, 1, SCALE_BF16, TABLE);    \
        else if (asym)                                                                                           \
            CANDIDATE_LOOP(TO_BF16, STORE_BF16, ODD, 0, 0, SCALE_BF16, 1, SCALE_BF16, 0, SCALE_BF16, TABLE);    \
        else if (delta)                                                                                          \
            CANDIDATE_LOOP(TO_BF16, STORE_BF16, ODD, 0, 0, SCALE_BF16, 0, SCALE_BF16, 1, SCALE_BF16, TABLE);    \
        else                                                                                                     \
            CANDIDATE_LOOP(TO_BF16, STORE_BF16, ODD, 0, 0, SCALE_BF16, 0, SCALE_BF16, 0, SCALE_BF16, TABLE);    \
    } while (0)

/* One row's candidates, 16 columns at a time, from its groups' parameters (scale, zero and
   1/scale: group g's at [g * BLOCK], the rows of a block interleaved). bound: no quotient
   of a group whose scale is at least this can fall below SMALLEST (its candidates are 0 or
   at least scale / max(s)). A symmetric scheme's zero is 0, and adding and taking it away
   changes no bit here (the rounded value is never -0), so it is left out. TO_BF16 rounds
   values that are zero or normal to bf16; STORE_BF16 stores them as bf16 (x exact in bf16,
   or zero or normal); both take the slow way (lanes tiny or odd) where a lane may not be:
   see the callers. */
#define CANDIDATES_OF_ROW(name, TARGET, TO_BF16, STORE_BF16, ODD)                                               \
    TARGET static void name(const float *w, const float *s, const float *rs, int64_t groups, int64_t size,       \
                            const float *scale, const float *zero, const float *rscale, float bound,             \
                            int32_t scale_kind, float qmin, float qmax, int32_t asym, int32_t weight_kind,        \
                            int32_t delta, int32_t out_kind, void *o) {                                           \
        const __m512 vqmin = _mm512_set1_ps(qmin), vqmax = _mm512_set1_ps(qmax);                                \
        const __m512 smallest = _mm512_set1_ps(SMALLEST);                                                        \
        const int bf16 = scale_kind == SCALE_BF16 && weight_kind == SCALE_BF16 && out_kind == SCALE_BF16;       \
        /* with at most 16 levels, lane i of `levels` holds the level l with l & 15 = i */                       \
        const int few = qmax - qmin < 16;                                                                        \
        const __m512i first = _mm512_set1_epi32((int32_t)qmin);                                                  \
        const __m512i iota = _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0);             \
        const __m512 levels = _mm512_cvtepi32_ps(_mm512_add_epi32(                                               \
            first, _mm512_and_si512(_mm512_sub_epi32(iota, first), _mm512_set1_epi32(15))));                      \
        for (int64_t g = 0; g < groups; g++) {                                                                   \
            const float sg = scale[g * BLOCK];                                                                   \
            const __m512 sc = _mm512_set1_ps(sg), zr = _mm512_set1_ps(zero[g * BLOCK]);                          \
            const __m512 rsc = _mm512_set1_ps(rscale[g * BLOCK]);                                                \
            const int64_t m0 = g * size, m1 = m0 + size;                                                         \
            /* a scale this small would leave the corrections' residuals inexact: divide */                     \
            const int divide = sg < SMALLEST, may_be_tiny = divide || !(sg >= bound);                            \
            /* the common cases as loops of their own, with no test in them but for odd lanes; with few      \
               levels, those dequantized as the portable loop does ((l - zero) · scale, to bf16) */              \
            const int fast = bf16 && !may_be_tiny;                                                               \
            const __m512 table = fast && few                                                                     \
                ? TO_BF16(_mm512_mul_ps(asym ? _mm512_sub_ps(levels, zr) : levels, sc)) : _mm512_setzero_ps();  \
            if (fast && few)                                                                                     \
                BF16_LOOPS(TO_BF16, STORE_BF16, ODD, 1);                                                         \
            else if (fast)                                                                                       \
                BF16_LOOPS(TO_BF16, STORE_BF16, ODD, 0);                                                         \
            else                                                                                                 \
                CANDIDATE_LOOP(TO_BF16, STORE_BF16, ODD, divide, may_be_tiny, scale_kind, asym, weight_kind,     \
                               delta, out_kind, 0);                                                              \
        }                                                                                                        \
    }

AVX512 static inline __mmask16 never_odd(__m512 w) {
    (void)w;
    return 0;
}

AVX512 static inline void store_bf16_v(__m512 x, void *out, int64_t i) {
    store_v(x, out, i, SCALE_BF16);
}

CANDIDATES_OF_ROW(candidates_of_row, AVX512, to_bf16_v, store_bf16_v, never_odd)

/* With AVX512-BF16, bf16 rounding is one instruction (VCVTNEPS2BF16: to nearest even, as
   to_bf16_v, but for subnormal inputs, which it takes as 0). The values it rounds are 0 or
   normal but in lanes where the quotient is tiny (they go to_bf16_v's way) and where the
   weight w is subnormal: a candidate c is 0 or at least SMALLEST there, and so c - w is 0
   or normal (a multiple of the ulp of the smaller of two normal floats at least 2^-126
   apart from 0; -w where c is 0) unless w is subnormal (odd: VFPCLASSPS). */
#define BF16_TARGET __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512bf16")))

/* whether candidates_of_row_bf16 runs here (the instructions BF16_TARGET names) */
static int bf16_rounding(void) {
    return __builtin_cpu_supports("avx512bf16") && __builtin_cpu_supports("avx512bw") &&
           __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq");
}

BF16_TARGET static inline __m512 to_bf16_cvt(__m512 x) {
    const __m256i h = (__m256i)_mm512_cvtneps_pbh(x);
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

BF16_TARGET static inline void store_bf16_cvt(__m512 x, void *out, int64_t i) {
    _mm256_storeu_si256((__m256i *)((uint16_t *)out + i), (__m256i)_mm512_cvtneps_pbh(x));
}

BF16_TARGET static inline __mmask16 subnormal(__m512 w) {
    return _mm512_fpclass_ps_mask(w, 0x20); /* 0x20: denormal */
}

CANDIDATES_OF_ROW(candidates_of_row_bf16, BF16_TARGET, to_bf16_cvt, store_bf16_cvt, subnormal)

/* lane i of the result: op over the 16 lanes of v[4 (i % 4) + i / 4] (ROW_SLOT), in four
   rounds that each fold pairs of vectors into one: 30 shuffles and 15 ops for 16 rows, where
   one reduction per row takes 8 each. min and max are exact, so the order changes nothing but
   a zero's sign (see scaled_range). */
#define REDUCE16(name, OP)                                                                                      \
    AVX512 static inline __m512 name(const __m512 v[16]) {                                                      \
        __m512 a[8], b[4], c[2];                                                                                 \
        for (int k = 0; k < 8; k++) /* halves: 128-bit lanes [v0 | v2] and [v1 | v3] of each */                 \
            a[k] = OP(_mm512_shuffle_f32x4(v[2 * k], v[2 * k + 1], 0x44),                                        \
                      _mm512_shuffle_f32x4(v[2 * k], v[2 * k + 1], 0xEE));                                       \
        for (int k = 0; k < 4; k++) /* 128-bit lane L: v[4k + L], 4 values left */                               \
            b[k] = OP(_mm512_shuffle_f32x4(a[2 * k], a[2 * k + 1], 0x88),                                        \
                      _mm512_shuffle_f32x4(a[2 * k], a[2 * k + 1], 0xDD));                                       \
        for (int k = 0; k < 2; k++) /* in lane L, elements 0 and 2: v[8k + L]; 1 and 3: v[8k + 4 + L] */         \
            c[k] = OP(_mm512_unpacklo_ps(b[2 * k], b[2 * k + 1]), _mm512_unpackhi_ps(b[2 * k], b[2 * k + 1]));   \
        return OP(_mm512_castpd_ps(_mm512_unpacklo_pd(_mm512_castps_pd(c[0]), _mm512_castps_pd(c[1]))),          \
                  _mm512_castpd_ps(_mm512_unpackhi_pd(_mm512_castps_pd(c[0]), _mm512_castps_pd(c[1]))));         \
    }
REDUCE16(reduce16_min, _mm512_min_ps)
REDUCE16(reduce16_max, _mm512_max_ps)
#define ROW_SLOT(i) (4 * ((i) % 4) + (i) / 4)

/* group_params for 16 groups at once, lane by lane in its float32 steps (the scale's rounding
   and the divisions are IEEE's in both) */
AVX512 static inline void group_params_v(__m512 lo, __m512 hi, float qmin, float qmax, int kind, int asym,
                                         __m512 *scale, __m512 *zero) {
    const __m512 nil = _mm512_setzero_ps(), tiny = _mm512_set1_ps(tiny_of(kind));
    lo = _mm512_mask_mov_ps(lo, _mm512_cmp_ps_mask(lo, nil, _CMP_GT_OQ), nil);
    hi = _mm512_mask_mov_ps(hi, _mm512_cmp_ps_mask(hi, nil, _CMP_LT_OQ), nil);
    __m512 sc;
    if (asym) {
        sc = to_scale_dtype_v(_mm512_div_ps(_mm512_sub_ps(hi, lo), _mm512_set1_ps(qmax - qmin)), kind);
        sc = _mm512_mask_mov_ps(sc, _mm512_cmp_ps_mask(sc, tiny, _CMP_LT_OQ), tiny);
        *zero = round_clamp_v(_mm512_sub_ps(_mm512_set1_ps(qmin), _mm512_div_ps(lo, sc)), _mm512_set1_ps(qmin),
                              _mm512_set1_ps(qmax));
    } else {
        const __m512 neg = _mm512_castsi512_ps(_mm512_xor_si512(_mm512_castps_si512(lo), _mm512_set1_epi32(INT32_MIN)));
        const __m512 absmax = _mm512_mask_mov_ps(hi, _mm512_cmp_ps_mask(neg, hi, _CMP_GT_OQ), neg);
        sc = to_scale_dtype_v(_mm512_div_ps(absmax, _mm512_set1_ps((qmax - qmin) / 2)), kind);
        sc = _mm512_mask_mov_ps(sc, _mm512_cmp_ps_mask(sc, tiny, _CMP_LT_OQ), tiny);
        *zero = nil;
    }
    *scale = sc;
}

/* The portable loop's rows, for groups of a multiple of 16 columns and every s within
   [1/SAFE, SAFE], BLOCK rows at a time: each group's ranges over the block's rows, reduced
   together (REDUCE16) into one vector of parameters, then each row's candidates. rs: 1/s;
   smax: the largest s; params: 3 BLOCK floats per group. A row whose scaled range is not
   finite or reaches SAFE goes the portable way (x: its scratch). cvt: round to bf16 with
   AVX512-BF16's instruction (candidates_of_row_bf16). */
AVX512 static void candidate_rows_avx512(int64_t r0, int64_t r1, const float *W, int64_t in, const float *s,
                                         const float *rs, float smax, int64_t size, int32_t scale_kind, float qmin,
                                         float qmax, int32_t asym, int32_t weight_kind, int32_t delta,
                                         int32_t out_kind, void *out, float *params, float *x, int cvt) {
    const size_t width = out_kind == SCALE_F32 ? 4 : 2;
    const int64_t groups = in / size;
    float *scale = params, *zero = scale + groups * BLOCK, *rscale = zero + groups * BLOCK;
    /* a quotient of a scale at least this by any s is at least 2 SMALLEST (smax <= SAFE) */
    const float bound = 4 * SMALLEST * smax;
    const __m512 safe = _mm512_set1_ps(SAFE);
    for (int64_t r = r0; r < r1; r += BLOCK) {
        const int rows = r1 - r < BLOCK ? (int)(r1 - r) : BLOCK;
        uint32_t wide = 0; /* rows with a value not below SAFE: infinite, NaN, or too large for the reciprocals */
        for (int64_t g = 0; g < groups; g++) {
            const int64_t b = g * size;
            __m512 l[BLOCK], h[BLOCK];
            for (int i = 0; i < BLOCK; i++) {
                if (i >= rows) { /* no row: any value */
                    l[ROW_SLOT(i)] = h[ROW_SLOT(i)] = _mm512_setzero_ps();
                    continue;
                }
                const float *w = W + (r + i) * in;
                __m512 lo = _mm512_mul_ps(_mm512_loadu_ps(w + b), _mm512_loadu_ps(s + b)), hi = lo;
                __mmask16 far = _mm512_cmp_ps_mask(_mm512_abs_ps(lo), safe, _CMP_NLT_UQ);
                for (int64_t m = b + 16; m < b + size; m += 16) {
                    const __m512 v = _mm512_mul_ps(_mm512_loadu_ps(w + m), _mm512_loadu_ps(s + m));
                    far |= _mm512_cmp_ps_mask(_mm512_abs_ps(v), safe, _CMP_NLT_UQ);
                    lo = _mm512_min_ps(v, lo);
                    hi = _mm512_max_ps(v, hi);
                }
                wide |= (uint32_t)(far != 0) << i;
                l[ROW_SLOT(i)] = lo;
                h[ROW_SLOT(i)] = hi;
            }
            __m512 sc, zr;
            group_params_v(reduce16_min(l), reduce16_max(h), qmin, qmax, scale_kind, asym, &sc, &zr);
            _mm512_storeu_ps(scale + g * BLOCK, sc);
            _mm512_storeu_ps(zero + g * BLOCK, zr);
            _mm512_storeu_ps(rscale + g * BLOCK, _mm512_div_ps(_mm512_set1_ps(1.0f), sc));
        }
        for (int i = 0; i < rows; i++) {
            if (wide >> i & 1) {
                candidate_rows(r + i, r + i + 1, W, in, s, size, scale_kind, qmin, qmax, asym, weight_kind, delta,
                               out_kind, out, x);
                continue;
            }
            void *o = (char *)out + (size_t)(r + i) * (size_t)in * width;
            (cvt ? candidates_of_row_bf16 : candidates_of_row)(W + (r + i) * in, s, rs, groups, size, scale + i,
                                                                 zero + i, rscale + i, bound, scale_kind, qmin, qmax,
                                                                 asym, weight_kind, delta, out_kind, o);
        }
    }
}

/* whether every s is within [1/SAFE, SAFE]; and its reciprocals into rs, its largest value
   into smax */
AVX512 static int reciprocals(const float *s, float *rs, int64_t n, float *smax) {
    __mmask16 outside = 0;
    __m512 largest = _mm512_setzero_ps();
    for (int64_t m = 0; m < n; m += 16) {
        const __m512 v = _mm512_loadu_ps(s + m);
        outside |= _mm512_cmp_ps_mask(v, _mm512_set1_ps(1 / SAFE), _CMP_NGE_UQ) |
                   _mm512_cmp_ps_mask(v, _mm512_set1_ps(SAFE), _CMP_NLE_UQ);
        largest = _mm512_max_ps(v, largest);
        _mm512_storeu_ps(rs + m, _mm512_div_ps(_mm512_set1_ps(1.0f), v));
    }
    *smax = _mm512_reduce_max_ps(largest);
    return outside == 0;
}
#endif

enum { PORTABLE = 1, NO_BF16_ROUNDING = 2 }; /* ptq_awq_candidates' paths other than the fastest */

/* Candidate weights of rows [r0, r1) of W [rows, in] (float32) for the candidate scales
   s [in]: groups of `size` consecutive columns (in for one group per row), the scale
   rounded to scale_kind, the candidate to weight_kind (SCALE_* both). Writes the candidate,
   or (delta) the candidate minus W, in out_kind into out [rows, in] (rows r0..r1 only).
   path: 0, the fastest here; 1, never the AVX-512 path (PORTABLE); 2, the AVX-512 path
   without AVX512-BF16's rounding (NO_BF16_ROUNDING). All three give the same bits (1 and
   2 for tests). Returns 0, or 1
   when memory ran out. */
int ptq_awq_candidates(int64_t r0, int64_t r1, const float *W, int64_t in, const float *s, int64_t size,
                       int32_t scale_kind, float qmin, float qmax, int32_t asym, int32_t weight_kind,
                       int32_t delta, int32_t out_kind, void *out, int32_t path) {
    const int64_t groups = in / size;
    float *x = malloc((size_t)(2 * in + 3 * BLOCK * groups) * sizeof(float)); /* x, then rs and params */
    if (!x)
        return 1;
#if HAS_AVX512
    float smax;
    if (path != PORTABLE && size % 16 == 0 && __builtin_cpu_supports("avx512f") &&
        reciprocals(s, x + in, in, &smax)) {
        const int cvt = path != NO_BF16_ROUNDING && bf16_rounding();
        candidate_rows_avx512(r0, r1, W, in, s, x + in, smax, size, scale_kind, qmin, qmax, asym, weight_kind, delta,
                              out_kind, out, x + 2 * in, x, cvt);
    } else
#endif
        candidate_rows(r0, r1, W, in, s, size, scale_kind, qmin, qmax, asym, weight_kind, delta, out_kind, out, x);
    (void)path;
    free(x);
    return 0;
}

/* the arguments' version of this library's functions (PTQ_COMPILED_ABI) */
int ptq_compiled_abi(void) { return PTQ_COMPILED_ABI; }

#ifndef PTQ_SOURCE_DIGEST
#define PTQ_SOURCE_DIGEST "" /* built without setup.py: not checked */
#endif
/* the digest of the C sources this library was built from (ptq/_sources.py) */
const char *ptq_compiled_source(void) { return PTQ_SOURCE_DIGEST; }
