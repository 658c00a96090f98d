/* GPTQ's column loop on a CPU, compiled: one block of columns for a slice of the rows.

   The torch reference is ptq/algorithms/gptq.py (_solve, _Grid, _current) and
   ptq/primitives.py (qparams_from_minmax, qparams_mse, _rounding_error): this file does the
   same arithmetic in the same float32 steps, one row at a time, so that no op is dispatched
   per column. Rows are independent given F, so callers split them across threads, each
   thread calling ptq_gptq_block on its own slice [r0, r1): what one row gets does not
   depend on the split, the thread count or the vector width.

   No fused multiply-add is formed (built with -ffp-contract=off), and every sum runs in a
   fixed order, so the result is the same on every x86-64 or Arm CPU. It may differ from the
   torch loop's in the last bit of an update (MKL's rank-1 update fuses its multiply-add),
   hence in an occasional rounding decision near a tie.

   Layout (as in gptq.py): Wt [cols, R] is the working weight transposed, row p the column
   at position p in processing order, and W0 [cols, R] the same before any update; F
   [cols, cols] the error-feedback matrix in processing order (cholesky.feedback: upper
   triangular, its diagonal the factor's); Qt [cols, R] the int8 codes; scale, zero
   [groups, R] float32 (scale values exactly representable in the scale dtype). Once
   rounded, a column's row of Wt holds its error against the original weights,
   W0 - dequantized (the torch loop's E, which needs no room of its own here: the block's
   rows of Wt and its errors would not both stay in a core's L2 cache, 2 x 768 KiB on
   SmolLM2's gate/up, 3072 x 576, two slices). */

#include "quant_math.h"

typedef struct {
    int64_t R, r0, n;      /* row stride, first row, rows in the slice */
    int64_t hs0, hs1;      /* F's strides: element [k, j] at k * hs0 + j * hs1 */
    float qmin, qmax;
    int32_t kind;          /* SCALE_* */
    int32_t asym;
    int32_t wide;          /* the AVX-512 code runs here (update_rows) */
} Shape;

/* Calls body(asym, kind) with the shape's asymmetry and scale dtype as constants: inlined
   into the caller, a loop over rows then has no branch inside, so the compiler vectorizes
   it (with a branch per element it did not: round_column ran at about 2 ns per weight). */
#define WITH_KIND(s, body, asym)                                      \
    do {                                                              \
        if ((s)->kind == SCALE_BF16)                                  \
            body(asym, SCALE_BF16);                                   \
        else if ((s)->kind == SCALE_F16)                              \
            body(asym, SCALE_F16);                                    \
        else                                                          \
            body(asym, SCALE_F32);                                    \
    } while (0)
#define WITH_CONSTANT_KIND(s, body)                                   \
    do {                                                              \
        if ((s)->asym)                                                \
            WITH_KIND(s, body, 1);                                    \
        else                                                          \
            WITH_KIND(s, body, 0);                                    \
    } while (0)

#define ALWAYS_INLINE static inline __attribute__((always_inline))

ALWAYS_INLINE void params_as(int64_t n, const float *lo, const float *hi, const float *shrink, float qmin,
                             float qmax, float *scale, float *zero, const int asym, const int kind) {
    for (int64_t r = 0; r < n; r++)
        group_params(lo[r] * shrink[r], hi[r] * shrink[r], qmin, qmax, kind, asym, scale + r, zero + r);
}

/* scale and zero of each row from its range [lo, hi] shrunk by `shrink` (qparams_from_minmax) */
VECTORIZED static void params(const Shape *s, const float *lo, const float *hi, const float *shrink,
                              float *scale, float *zero) {
#define PARAMS_AS(asym, kind) params_as(s->n, lo, hi, shrink, s->qmin, s->qmax, scale, zero, asym, kind)
    WITH_CONSTANT_KIND(s, PARAMS_AS);
#undef PARAMS_AS
}

/* Σ_m importance[m] (x_m - dequantize(quantize(x_m)))² per row (primitives._rounding_error) */
VECTORIZED static void rounding_error(const Shape *s, const float *x, int64_t size, const float *importance,
                                      const float *scale, const float *zero, float *error) {
    for (int64_t r = 0; r < s->n; r++)
        error[r] = 0;
    for (int64_t m = 0; m < size; m++) {
        const float *xm = x + m * s->n;
        const float w = importance ? importance[m] : 1.0f;
        for (int64_t r = 0; r < s->n; r++) {
            float t = xm[r] / scale[r];
            if (s->asym)
                t = t + zero[r];
            t = round_clamp(t, s->qmin, s->qmax);
            if (s->asym)
                t = t - zero[r];
            float d = t * scale[r] - xm[r];
            d = d * d;
            error[r] += importance ? d * w : d;
        }
    }
}

/* The group's columns as they stand at position p (gptq._current): members inside the
   block are up to date in Wt; later ones still miss the block's pending update,
   -Σ_{k in [i1, p)} F[k, P] E[k - i1]. Copied into x [size, n]. */
VECTORIZED static void current(const Shape *s, const float *Wt, const float *F, const float *E,
                               const int64_t *pos, int64_t size, int64_t i1, int64_t i2, int64_t p,
                               float *x, float *acc) {
    for (int64_t m = 0; m < size; m++) {
        const int64_t P = pos[m];
        float *xm = x + m * s->n;
        memcpy(xm, Wt + P * s->R + s->r0, (size_t)s->n * sizeof(float));
        if (P < i2 || p == i1)
            continue;
        for (int64_t r = 0; r < s->n; r++)
            acc[r] = 0;
        for (int64_t k = i1; k < p; k++) {
            const float h = F[k * s->hs0 + P * s->hs1];
            const float *e = E + (k - i1) * s->R + s->r0;
            for (int64_t r = 0; r < s->n; r++)
                acc[r] += h * e[r];
        }
        for (int64_t r = 0; r < s->n; r++)
            xm[r] -= acc[r];
    }
}

/* Parameters of one group from its current columns x [size, n] (qparams_mse, or min-max
   when ncandidates is 1 with the candidate 1.0): the first candidate, then each later one
   where its error is strictly lower, then (mse) the two beside the best by ±fine. */
static int fit(const Shape *s, const float *x, int64_t size, const float *importance, const float *candidates,
               int64_t ncandidates, float fine, float *scale, float *zero) {
    const int64_t n = s->n;
    float *buf = malloc((size_t)n * 9 * sizeof(float));
    if (!buf)
        return 1;
    float *lo = buf, *hi = lo + n, *shrink = hi + n, *sc = shrink + n, *zr = sc + n, *err = zr + n;
    float *best_err = err + n, *best_shrink = best_err + n, *center = best_shrink + n;
    for (int64_t r = 0; r < n; r++) {
        lo[r] = x[r];
        hi[r] = x[r];
    }
    for (int64_t m = 1; m < size; m++) {
        const float *xm = x + m * n;
        for (int64_t r = 0; r < n; r++) {
            lo[r] = xm[r] < lo[r] ? xm[r] : lo[r];
            hi[r] = xm[r] > hi[r] ? xm[r] : hi[r];
        }
    }
    const int search = fine > 0;
    const int64_t steps = ncandidates + (search ? 2 : 0);
    for (int64_t c = 0; c < steps; c++) {
        if (c < ncandidates) {
            for (int64_t r = 0; r < n; r++)
                shrink[r] = candidates[c];
        } else {
            if (c == ncandidates)
                memcpy(center, best_shrink, (size_t)n * sizeof(float));
            const float step = c == ncandidates ? fine : -fine;
            for (int64_t r = 0; r < n; r++) {
                const float f = center[r] + step;
                shrink[r] = f > 1.0f ? 1.0f : f;
            }
        }
        params(s, lo, hi, shrink, sc, zr);
        if (steps == 1) { /* min-max: no error to compare */
            memcpy(scale, sc, (size_t)n * sizeof(float));
            if (s->asym)
                memcpy(zero, zr, (size_t)n * sizeof(float));
            break;
        }
        rounding_error(s, x, size, importance, sc, zr, err);
        for (int64_t r = 0; r < n; r++) {
            if (c == 0 || err[r] < best_err[r]) {
                best_err[r] = err[r];
                best_shrink[r] = shrink[r];
                scale[r] = sc[r];
                if (s->asym)
                    zero[r] = zr[r];
            }
        }
    }
    free(buf);
    return 0;
}

ALWAYS_INLINE void round_column_as(int64_t n, float *w, const float *w0, const float *scale, const float *zero,
                                   float pivot, float qmin, float qmax, int8_t *q, double *squares,
                                   const int asym, const int kind) {
    for (int64_t r = 0; r < n; r++) {
        float t = w[r] / scale[r];
        if (asym)
            t = t + zero[r];
        t = round_clamp(t, qmin, qmax);
        q[r] = (int8_t)(int32_t)t;
        if (asym)
            t = t - zero[r];
        const float dq = to_scale_dtype(t * scale[r], kind);
        const float scaled = (w[r] - dq) * pivot;
        squares[r] += (double)scaled * (double)scaled;
        w[r] = w0[r] - dq;
    }
}

/* Round column w [n] with its group's scale and zero into q; then w becomes its error
   against the original weights, w0 - dequantized, and the square of its scaled error
   (w - dequantized) * pivot is added to squares (gptq._Grid.round_column, then _solve). */
VECTORIZED static void round_column(const Shape *s, float *w, const float *w0, const float *scale,
                                    const float *zero, float pivot, int8_t *q, double *squares) {
#define ROUND_AS(asym, kind) \
    round_column_as(s->n, w, w0, scale, zero, pivot, s->qmin, s->qmax, q, squares, asym, kind)
    WITH_CONSTANT_KIND(s, ROUND_AS);
#undef ROUND_AS
}

/* Wt[k] -= h * e for the block's later columns k (gptq._solve's addr_) */
VECTORIZED static void update(float *w, const float *e, float h, int64_t n) {
    for (int64_t r = 0; r < n; r++)
        w[r] = w[r] - h * e[r];
}

#if HAS_AVX512 /* (quant_math.h) */
enum { LANES = 16, TILE = 8 }; /* a tile: TILE vectors of LANES of the slice's rows, held in registers */

/* Wt[k] -= F[j, k] E[j - i1] for j in [c0, c1) on `vectors` (at most TILE) vectors of rows
   from w = Wt row k + offset, the last one masked by `last`; e = E's row c0 - i1, same offset */
AVX512 static inline __attribute__((always_inline)) void update_tile(float *w, const float *e, int64_t R,
                                                                     const float *h, int64_t hs0, int64_t columns,
                                                                     int vectors, __mmask16 last) {
    __m512 acc[TILE];
    for (int v = 0; v < vectors; v++)
        acc[v] = _mm512_maskz_loadu_ps(v == vectors - 1 ? last : 0xFFFF, w + v * LANES);
    for (int64_t j = 0; j < columns; j++) {
        const __m512 hj = _mm512_set1_ps(h[j * hs0]);
        const float *ej = e + j * R;
        for (int v = 0; v < vectors; v++) /* the product rounded, then the difference: as `update` */
            acc[v] = _mm512_sub_ps(acc[v], _mm512_mul_ps(hj, _mm512_maskz_loadu_ps(v == vectors - 1 ? last : 0xFFFF,
                                                                                   ej + v * LANES)));
    }
    for (int v = 0; v < vectors; v++)
        _mm512_mask_storeu_ps(w + v * LANES, v == vectors - 1 ? last : 0xFFFF, acc[v]);
}

/* update_rows with each tile of a Wt row in registers across all the columns: read and written
   once instead of once per column, the columns' errors of a tile staying in L1 over the rows
   (a whole block of 128 columns with min-max ranges, on one Zen 5 core at 256-1536 rows: 80-91
   GFLOP/s of updates against 43-61 with the loop below; with mse ranges the range search takes most of
   the time) */
AVX512 static void update_rows_avx512(const Shape *s, float *Wt, const float *E, const float *F, int64_t i1,
                                      int64_t c0, int64_t c1, int64_t k0, int64_t k1) {
    const float *e = E + (c0 - i1) * s->R + s->r0;
    int64_t a = 0;
    for (; a + TILE * LANES <= s->n; a += TILE * LANES) /* whole tiles (their errors stay in L1 over k) */
        for (int64_t k = k0; k < k1; k++)
            update_tile(Wt + k * s->R + s->r0 + a, e + a, s->R, F + c0 * s->hs0 + k * s->hs1, s->hs0, c1 - c0,
                        TILE, 0xFFFF);
    for (; a < s->n; a += LANES) { /* the rest a vector at a time, the last one masked */
        const int64_t left = s->n - a;
        const __mmask16 last = left >= LANES ? (__mmask16)0xFFFF : (__mmask16)((1u << left) - 1);
        for (int64_t k = k0; k < k1; k++)
            update_tile(Wt + k * s->R + s->r0 + a, e + a, s->R, F + c0 * s->hs0 + k * s->hs1, s->hs0, c1 - c0,
                        1, last);
    }
}
#endif

/* The updates of columns [c0, c1) on the block's rows [k0, k1): Wt[k] -= F[j, k] E[j - i1]
   for j from c0 up, a chunk of the slice's rows at a time, so that each Wt row is read and
   written once for all those columns (and their errors stay in the L1 cache) instead of
   once per column. Every element takes the same operations in the same order as from
   `update` column by column: the bits are the same. */
VECTORIZED static void update_rows(const Shape *s, float *Wt, const float *E, const float *F, int64_t i1,
                                   int64_t c0, int64_t c1, int64_t k0, int64_t k1) {
#if HAS_AVX512
    if (s->wide) {
        update_rows_avx512(s, Wt, E, F, i1, c0, c1, k0, k1);
        return;
    }
#endif
    enum { CHUNK = 256 };
    for (int64_t a = 0; a < s->n; a += CHUNK) {
        const int64_t len = s->n - a < CHUNK ? s->n - a : CHUNK;
        for (int64_t k = k0; k < k1; k++) {
            float *w = Wt + k * s->R + s->r0 + a;
            for (int64_t j = c0; j < c1; j++)
                update(w, E + (j - i1) * s->R + s->r0 + a, F[j * s->hs0 + k * s->hs1], len);
        }
    }
}

/* Σ squares[r] over the slice's rows, in order */
static double sum_rows(const double *squares, int64_t n) {
    double total = 0;
    for (int64_t r = 0; r < n; r++)
        total += squares[r];
    return total;
}

/* GPTQ's column loop over positions [i1, i2) for rows [r0, r1): quantizes each column into
   Qt, its error into its row of Wt, and moves the block's later columns by it; at a position
   where first_group names a group, fits that group's parameters first.
   group_of [cols], first_group [cols] (-1: none), members [groups, size] (positions,
   ascending), importance [cols] (diag H in processing order; NULL: all alike).
   candidates [ncandidates]: the shrink factors tried (mse: MSE_COARSE; min-max: {1.0});
   fine > 0: the mse search's fine step. portable: not the AVX-512 updates, which give the
   same bits (for tests). *loss: Σ s² of the block's scaled errors on the slice (the block's
   Losses, times 2), each row's summed over the columns, then the rows in order. Returns 0,
   or 1 when memory ran out. */
int ptq_gptq_block(int64_t r0, int64_t r1, int64_t i1, int64_t i2, double *loss, float *Wt, const float *W0,
                   int64_t R, const float *F, int64_t hs0, int64_t hs1, int8_t *Qt,
                   const int64_t *group_of,
                   const int64_t *first_group, const int64_t *members, int64_t size, const float *importance,
                   float *scale, float *zero, int32_t kind, float qmin, float qmax, const float *candidates,
                   int64_t ncandidates, float fine, int32_t portable) {
#if HAS_AVX512
    const int wide = !portable && __builtin_cpu_supports("avx512f");
#else
    const int wide = 0;
    (void)portable;
#endif
    const Shape s = {R, r0, r1 - r0, hs0, hs1, qmin, qmax, kind, zero != NULL, wide};
    *loss = 0;
    if (s.n <= 0)
        return 0;
    float *x = NULL, *acc = NULL, *imp = NULL;
    const float *E = Wt + i1 * R; /* the block's errors: its rows of Wt once rounded */
    double *squares = calloc((size_t)s.n, sizeof(double));
    if (!squares)
        return 1;
    int status = 0;
    /* Columns go in runs [b0, b1) of at most RUN: a column's error moves the run's later
       rows at once, the rows after the run when the run ends (update_rows). Rows [p, b1)
       always hold every earlier column's update, rows from b1 on those before b0; a group
       fitted at p reads its members' rows, so a run is cut there first. */
    enum { RUN = 16 };
    int64_t b0 = i1, b1 = i1 + RUN < i2 ? i1 + RUN : i2;
    for (int64_t p = i1; p < i2 && status == 0; p++) {
        const int64_t fg = first_group[p];
        if (p == b1 || fg >= 0) {
            update_rows(&s, Wt, E, F, i1, b0, p, b1, i2);
            b0 = p;
            b1 = p + RUN < i2 ? p + RUN : i2;
        }
        if (fg >= 0) {
            const int64_t *pos = members + fg * size;
            if (!x) {
                x = malloc((size_t)(size * s.n + s.n + size) * sizeof(float));
                if (!x) {
                    status = 1;
                    break;
                }
                acc = x + size * s.n;
                imp = acc + s.n;
            }
            current(&s, Wt, F, E, pos, size, i1, i2, p, x, acc);
            if (importance)
                for (int64_t m = 0; m < size; m++)
                    imp[m] = importance[pos[m]];
            status = fit(&s, x, size, importance ? imp : NULL, candidates, ncandidates, fine,
                         scale + fg * R + r0, zero ? zero + fg * R + r0 : NULL);
            if (status)
                break;
        }
        const int64_t g = group_of[p];
        float *e = Wt + p * R + r0;
        round_column(&s, e, W0 + p * R + r0, scale + g * R + r0, zero ? zero + g * R + r0 : NULL,
                     F[p * hs0 + p * hs1], Qt + p * R + r0, squares);
        for (int64_t k = p + 1; k < b1; k++)
            update(Wt + k * R + r0, e, F[p * hs0 + k * hs1], s.n);
    }
    free(x);
    if (status == 0)
        *loss = sum_rows(squares, s.n);
    free(squares);
    return status;
}

/* 1 when this build converts to float16 exactly (the compiler has _Float16), else 0 */
int ptq_gptq_has_float16(void) {
#if defined(__FLT16_MAX__)
    return 1;
#else
    return 0;
#endif
}
