/* AWQ's grid of candidate weights on a CPU, compiled, and the dot products of its loss.

   The torch reference is ptq/algorithms/awq.py (candidate_weights) over
   ptq/primitives.py (fake_quantize): for candidate scales s [in], each row's groups of W·s
   get min-max parameters, are rounded, dequantized in the scale dtype, divided by s and
   rounded to the weights' dtype, in the same float32 steps as torch, so to the same bits.
   torch takes about ten passes over [candidates, out, in] tensors for this; here each
   group is done while it is in the cache. Rows are independent: callers split them, or the
   candidates, across threads. Built with the GPTQ loop (setup.py): no fused multiply-add. */

#include "quant_math.h"

enum { LANES = 16 };

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
   s [in]: groups of `size` consecutive columns (in for one group per row), the scale
   rounded to scale_kind, the candidate to weight_kind (SCALE_* both). Writes the candidate,
   or (delta) the candidate minus W, in out_kind into out [rows, in] (rows r0..r1 only).
   Returns 0, or 1 when memory ran out. */
int ptq_awq_candidates(int64_t r0, int64_t r1, const float *W, int64_t in, const float *s, int64_t size,
                       int32_t scale_kind, float qmin, float qmax, int32_t asym, int32_t weight_kind,
                       int32_t delta, int32_t out_kind, void *out) {
    float *x = malloc((size_t)in * sizeof(float));
    if (!x)
        return 1;
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
    free(x);
    return 0;
}

static inline float bf16_value(uint16_t bits) {
    const uint32_t u = (uint32_t)bits << 16;
    float x;
    memcpy(&x, &u, 4);
    return x;
}

/* Σ a·b over n elements of float32 or bf16 (kind): products and runs of STRIDE of them
   summed in float32 (in LANES partial sums; bf16 products are exact), the runs in float64,
   in a fixed order, so the result is the same on every CPU. */
#define DOT(name, T, VALUE)                                                                                    \
    VECTORIZED static double name(const T *x, const T *y, int64_t n) {                                         \
        double acc[LANES] = {0};                                                                               \
        int64_t i = 0;                                                                                         \
        for (; i + STRIDE <= n; i += STRIDE) {                                                                 \
            float run[LANES] = {0};                                                                            \
            for (int64_t k = 0; k < STRIDE; k += LANES)                                                        \
                for (int64_t l = 0; l < LANES; l++)                                                            \
                    run[l] += VALUE(x[i + k + l]) * VALUE(y[i + k + l]);                                       \
            for (int64_t l = 0; l < LANES; l++)                                                                \
                acc[l] += run[l];                                                                              \
        }                                                                                                      \
        for (; i < n; i++)                                                                                     \
            acc[0] += (double)VALUE(x[i]) * (double)VALUE(y[i]);                                               \
        double total = 0;                                                                                      \
        for (int64_t l = 0; l < LANES; l++)                                                                    \
            total += acc[l];                                                                                   \
        return total;                                                                                          \
    }
#define F32_VALUE(x) (x)
enum { STRIDE = 16 * LANES };
DOT(dot_bf16, uint16_t, bf16_value)
DOT(dot_f32, float, F32_VALUE)

double ptq_awq_dot(const void *a, const void *b, int64_t n, int32_t kind) {
    return kind == SCALE_BF16 ? dot_bf16(a, b, n) : dot_f32(a, b, n);
}

/* the arguments' version of this library's functions (PTQ_COMPILED_ABI) */
int ptq_compiled_abi(void) { return PTQ_COMPILED_ABI; }
