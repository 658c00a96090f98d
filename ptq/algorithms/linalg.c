/* Dense float32 linear algebra for GPTQ on a CPU with AVX-512 (or AVX2, the factorisation
   only: linalg_avx2.c), compiled: the lower Cholesky factor L of a Hessian
   (ptq_cholesky_padded, on one thread, or ptq_cholesky_shared: its pieces shared by the
   threads that call it)
   and from it GPTQ's error-feedback matrix (ptq_feedback_copy), the inverse L⁻¹ of a
   diagonal block's factor (ptq_inverse_tiles: tiles of columns, shared likewise), and the
   column loop's lazy updates C -= A·B (ptq_gemm_subtract).

   The torch references are ptq/algorithms/cholesky.py (_lapack_feedback: LAPACK's potrf
   on one thread, then feedback_of_; the tests solve against the identity for the inverse) and
   ptq/algorithms/gptq_compiled.py (an addmm_ per block). On a CPU where MKL runs its AVX2
   code (AMD's), those reached 30, 17 and 90 GFLOP/s on one thread; here the same
   arithmetic runs in tiles of 8 rows x 32 columns of fused multiply-adds (16 accumulators).

   - GEMM: each element of C is C's value less its products in order of p, one rounding
     each (a fused multiply-add), whatever the tile it falls in: the bits do not depend on
     how callers split the rows or columns (the column loop's slices of rows).
   - Cholesky: the matrix is copied into a buffer of np = n rounded up to 32 rows and
     columns, the extra ones the identity, so that every block is whole: its factor is
     [[L, 0], [0, I]] and its inverse [[L⁻¹, 0], [0, I]]. Right-looking, a block column of 32
     at a time: the diagonal block factored element by element; the rows below it solved
     against it, 16 rows per vector, from a transposed copy of the block column (P); then
     the lower triangle to their right less P's products, in tiles (right of each group of
     four block columns, once for the group: see cholesky()).
   - Inverse, a tile of 32 columns at a time (they do not depend on each other: threads
     share them), and within it a block of 8 rows at a time, top to bottom: each block of 8
     rows x 32 columns is the sum of L's rows times the rows of L⁻¹ found before, then the
     8 rows solved against their diagonal block in the registers. Column by column the
     passes over L stay in the cache better than row by row: 1536 rows 5.8 against 7.8 ms
     on one thread of an AMD EPYC (Zen 5), the same bits.

   Every sum runs in a fixed order, whichever thread runs it: the bits depend on nothing
   but the input (not on the thread count, nor the CPU, AVX-512 being there). They differ from LAPACK's and
   MKL's in the last places, as those differ between their own code paths. */

#include "linalg.h"

#include <sched.h>

/* per block column of 32: taken, diagonal block (1 done, -1 not positive definite), then
   (next, done) for its panel's rows, the updates inside its group, the updates right of it */
enum { STEP_WORDS = 8, PANEL_ROWS = 64, GROUP = 4 * BLOCK };

/* the row stride of the Cholesky's P (GROUP rows): np floats and a cache line (see cholesky) */
static inline int64_t panel_stride(int64_t np) { return np + 16; }

#if HAS_AVX512 /* (quant_math.h) */

/* C[rows (at most 8), 32 columns, those beyond the masks' lanes untouched] (row stride ldc)
   less the products Σ_p a(r, p)·B[p, :] over p < k, a(r, p) = A[r·ar + p·ap], B's rows ldb
   floats apart. */
AVX512 static inline __attribute__((always_inline)) void tile_subtract(float *C, int64_t ldc, const float *A,
                                                                       int64_t ar, int64_t ap, const float *B,
                                                                       int64_t ldb, int64_t k, int rows,
                                                                       __mmask16 m0, __mmask16 m1) {
    __m512 acc[ROWS][2];
    for (int r = 0; r < rows; r++) {
        acc[r][0] = _mm512_maskz_loadu_ps(m0, C + r * ldc);
        acc[r][1] = _mm512_maskz_loadu_ps(m1, C + r * ldc + 16);
    }
    for (int64_t p = 0; p < k; p++) {
        const __m512 b0 = _mm512_maskz_loadu_ps(m0, B + p * ldb), b1 = _mm512_maskz_loadu_ps(m1, B + p * ldb + 16);
        for (int r = 0; r < rows; r++) {
            const __m512 a = _mm512_set1_ps(A[r * ar + p * ap]);
            acc[r][0] = _mm512_fnmadd_ps(a, b0, acc[r][0]);
            acc[r][1] = _mm512_fnmadd_ps(a, b1, acc[r][1]);
        }
    }
    for (int r = 0; r < rows; r++) {
        _mm512_mask_storeu_ps(C + r * ldc, m0, acc[r][0]);
        _mm512_mask_storeu_ps(C + r * ldc + 16, m1, acc[r][1]);
    }
}

/* C [m, n] (row stride ldc) -= A·B, A(i, p) = A[i·ar + p·ap] [m, k], B [k, n] (row stride ldb).
   Both are first copied where a tile reads them contiguously (where that memory is there):
   A's whole tiles of 8 rows p-major, [m / 8][k][8], and each block of 32 columns of B,
   [k][32]. Read in place, a tile's values for successive p lie a row of storage apart (the
   column loop's A is a transposed slice of H⁻¹, its B a slice of the errors' rows), and
   where rows are 4, 6 or 12 KiB long (1024, 1536 or 3072 floats) all k of them fall into
   one or two sets of the L1 cache and evict each other; and whole blocks of 32 columns
   load B without masks (masks known only at run time made every load of B a masked one).
   The same products in the same order: the same bits either way. One thread of a Xeon
   with AMX, the column loop's shapes (k 128): 80-111 -> 120-154 GFLOP/s, MKL's 140-161. */
AVX512 static void gemm_subtract(float *C, int64_t ldc, const float *A, int64_t ar, int64_t ap, const float *B,
                                 int64_t ldb, int64_t m, int64_t n, int64_t k) {
    const int64_t whole = m / ROWS * ROWS;
    float *packed = whole && k ? aligned_alloc(64, (size_t)((whole * k + 15) / 16 * 16) * sizeof(float)) : NULL;
    if (packed)
        for (int64_t i0 = 0; i0 < whole; i0 += ROWS)
            for (int64_t p = 0; p < k; p++)
                for (int r = 0; r < ROWS; r++)
                    packed[i0 * k + p * ROWS + r] = A[(i0 + r) * ar + p * ap];
    float *panel = k ? aligned_alloc(64, (size_t)(k * BLOCK) * sizeof(float)) : NULL; /* rows on cache lines */
    for (int64_t j0 = 0; j0 < n; j0 += BLOCK) {
        const int64_t w = n - j0 < BLOCK ? n - j0 : BLOCK;
        const __mmask16 m0 = w >= 16 ? 0xFFFF : (__mmask16)((1u << w) - 1);
        const __mmask16 m1 = w >= 32 ? 0xFFFF : w <= 16 ? 0 : (__mmask16)((1u << (w - 16)) - 1);
        const float *b = B + j0;
        int64_t lb = ldb;
        if (panel) {
            for (int64_t p = 0; p < k; p++)
                memcpy(panel + p * BLOCK, B + p * ldb + j0, (size_t)w * sizeof(float));
            b = panel, lb = BLOCK;
        }
        /* a tile's rows of A: copied ([k][8]) or in place */
        const int64_t tr = packed ? 1 : ar, tp = packed ? ROWS : ap;
        int64_t i0 = 0;
        for (; i0 < whole; i0 += ROWS) {
            const float *a = packed ? packed + i0 * k : A + i0 * ar;
            if (w == BLOCK) /* constant masks: plain loads */
                tile_subtract(C + i0 * ldc + j0, ldc, a, tr, tp, b, lb, k, ROWS, 0xFFFF, 0xFFFF);
            else
                tile_subtract(C + i0 * ldc + j0, ldc, a, tr, tp, b, lb, k, ROWS, m0, m1);
        }
        for (; i0 < m; i0++)
            tile_subtract(C + i0 * ldc + j0, ldc, A + i0 * ar, ar, ap, b, lb, k, 1, m0, m1);
    }
    free(panel);
    free(packed);
}

/* Rows [i0, i1) (multiples of 16, at or below k1 = k0 + 32) of block column k0's panel:
   solved against its diagonal block, from and into P's 32 rows (their elements indexed
   by A's rows, rows lp floats apart), then written back to A. Each row depends on its own
   values and the diagonal block alone. */
AVX512 static void panel_rows(float *A, int64_t np, int64_t k0, float *P, int64_t lp, int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; i++) /* P[c, i] = A[i, k0 + c] */
        for (int64_t c = 0; c < BLOCK; c++)
            P[c * lp + i] = A[i * np + k0 + c];
    for (int64_t c = 0; c < BLOCK; c++) { /* P[c] = (P[c] - Σ L11[c, c'] P[c']) / L11[c, c] */
        const __m512 d = _mm512_set1_ps(A[(k0 + c) * np + k0 + c]);
        for (int64_t i = i0; i < i1; i += 16) {
            __m512 v = _mm512_loadu_ps(P + c * lp + i);
            for (int64_t e = 0; e < c; e++)
                v = _mm512_fnmadd_ps(_mm512_set1_ps(A[(k0 + c) * np + k0 + e]), _mm512_loadu_ps(P + e * lp + i), v);
            _mm512_storeu_ps(P + c * lp + i, _mm512_div_ps(v, d));
        }
    }
    for (int64_t i = i0; i < i1; i++)
        for (int64_t c = 0; c < BLOCK; c++)
            A[i * np + k0 + c] = P[c * lp + i];
}

/* Rows [i0, i0 + 8) of A less the products of P's first k rows (elements indexed by A's
   rows, rows lp floats apart), in the columns [j0, j1) on and below the diagonal's tile: A's
   lower triangle less Lᵀ's products, in whole tiles of 32 columns. */
AVX512 static void update_rows(float *A, int64_t np, const float *P, int64_t lp, int64_t k, int64_t i0, int64_t j0,
                               int64_t j1) {
    for (int64_t j = j0; j < j1 && j <= i0 + ROWS - 1; j += BLOCK)
        tile_subtract(A + i0 * np + j, np, P + i0, 1, lp, P + j, lp, k, ROWS, 0xFFFF, 0xFFFF);
}

/* Waits until *flag (read with acquire order) is at least `until_at_least`, or negative (a
   failure); returns it. Spins a while, then yields the core at each look: on a busy CPU a
   partner thread that was descheduled gets it back sooner. */
static inline int64_t wait_for(const int64_t *flag, int64_t until_at_least) {
    int64_t seen;
    for (int spins = 0; (seen = __atomic_load_n(flag, __ATOMIC_ACQUIRE)) < until_at_least && seen >= 0; spins++) {
        if (spins < 4096)
            __builtin_ia32_pause();
        else
            sched_yield();
    }
    return seen;
}

/* Takes the units (0 .. units - 1) that next[0] hands out, each once, running `unit` for
   each (u its number) and counting it in next[1]; then waits until all are done. */
#define SHARE_UNITS(next, units, unit)                                                        \
    do {                                                                                      \
        for (int64_t u; (u = __atomic_fetch_add(&(next)[0], 1, __ATOMIC_RELAXED)) < (units);) { \
            unit;                                                                             \
            __atomic_fetch_add(&(next)[1], 1, __ATOMIC_RELEASE);                              \
        }                                                                                     \
        wait_for(&(next)[1], units);                                                          \
    } while (0)

/* A [np, np] (row-major, np a multiple of 32) to L in its lower triangle, right-looking a
   block column of 32 at a time; the strict upper triangle is left holding scratch. The
   columns right of each group of GROUP columns take the group's products in one pass (at
   the group's end, 128 products an element in order): the same roundings, in the same
   order, as four passes of 32, and a quarter of the passes over the trailing matrix,
   which on large matrices is read from memory each time. P: GROUP rows of lp = np + 16
   floats (rows a whole number of cache lines plus one apart: np floats apart, the 128
   values a tile reads down P's rows fell into two sets of the L1 cache, 1536 rows taking
   18.8 against 12.9 ms).

   The work is shared by every thread that calls this with the same A, P and state
   (STEP_WORDS x np / 32 int64, zeros before the first call): the first to reach a block
   column factors its diagonal block while the others wait; then all take the panel's rows
   (PANEL_ROWS at a time), then rows of 8 of the updates (whole tiles reaching the
   diagonal, the longest rows first), waiting for each part's end. Each piece is the same
   operations whichever thread computes it: the bits do not depend on how many call. 0
   when A is not positive definite. */
AVX512 static int cholesky(float *A, int64_t np, float *P, int64_t *state) {
    const int64_t lp = panel_stride(np);
    for (int64_t g0 = 0; g0 < np; g0 += GROUP) {
        const int64_t g1 = g0 + GROUP < np ? g0 + GROUP : np;
        for (int64_t k0 = g0; k0 < g1; k0 += BLOCK) {
            int64_t *step = state + (k0 / BLOCK) * STEP_WORDS;
            float *panel = P + (k0 - g0) * lp;
            const int64_t k1 = k0 + BLOCK, pieces = (np - k1 + PANEL_ROWS - 1) / PANEL_ROWS;
            if (__atomic_fetch_add(&step[0], 1, __ATOMIC_ACQ_REL) == 0)
                __atomic_store_n(&step[1], factor_diagonal(A, np, k0) ? 1 : -1, __ATOMIC_RELEASE);
            if (wait_for(&step[1], 1) < 0)
                return 0;
            SHARE_UNITS(step + 2, pieces,
                        panel_rows(A, np, k0, panel, lp, k1 + u * PANEL_ROWS,
                                   k1 + (u + 1) * PANEL_ROWS < np ? k1 + (u + 1) * PANEL_ROWS : np));
            const int64_t units = (np - k1) / ROWS; /* the group's columns right of this block */
            SHARE_UNITS(step + 4, units, update_rows(A, np, panel, lp, BLOCK, np - (u + 1) * ROWS, k1, g1));
        }
        int64_t *step = state + (g0 / BLOCK) * STEP_WORDS; /* the columns right of the group */
        SHARE_UNITS(step + 6, (np - g1) / ROWS, update_rows(A, np, P, lp, g1 - g0, np - (u + 1) * ROWS, g1, np));
    }
    return 1;
}

/* Columns [j0, j0 + 32) of X = L⁻¹ (L in A's lower triangle), rows j0 and below, zeros above
   the diagonal: a block of 8 rows at a time, top to bottom, into T (T's row k - j0 holds
   X[k, j0:j0 + 32]; its rows ld floats apart). A tile depends on L and on its own columns
   alone, so tiles may be computed in any order, by any thread: the same bits. */
AVX512 static void inverse_tile(const float *A, int64_t np, float *T, int64_t ld, int64_t j0) {
    for (int64_t i0 = j0; i0 < np; i0 += ROWS) {
        /* S = Σ_{j0 <= k < i0} L[i, k] X[k, j] (X[k, j] is 0 for j > k) */
        __m512 acc[ROWS][2];
        for (int r = 0; r < ROWS; r++)
            acc[r][0] = acc[r][1] = _mm512_setzero_ps();
        for (int64_t k = j0; k < i0; k++) {
            const float *row = T + (k - j0) * ld;
            const __m512 b0 = _mm512_loadu_ps(row), b1 = _mm512_loadu_ps(row + 16);
            for (int r = 0; r < ROWS; r++) {
                const __m512 a = _mm512_set1_ps(A[(i0 + r) * np + k]);
                acc[r][0] = _mm512_fmadd_ps(a, b0, acc[r][0]);
                acc[r][1] = _mm512_fmadd_ps(a, b1, acc[r][1]);
            }
        }
        /* rows i of L X = I: X[i, j] = (δ_ij - S_i - Σ_{i0 <= k < i} L[i, k] X[k, j]) / L[i, i] */
        for (int r = 0; r < ROWS; r++) {
            const int64_t i = i0 + r;
            for (int h = 0; h < 2; h++) {
                __m512 v = _mm512_sub_ps(_mm512_setzero_ps(), acc[r][h]);
                const int64_t lane = i - j0 - 16 * h;
                if (lane >= 0 && lane < 16)
                    v = _mm512_mask_add_ps(v, (__mmask16)(1u << lane), v, _mm512_set1_ps(1.0f));
                for (int e = 0; e < r; e++)
                    v = _mm512_fnmadd_ps(_mm512_set1_ps(A[i * np + i0 + e]), acc[e][h], v);
                acc[r][h] = _mm512_div_ps(v, _mm512_set1_ps(A[i * np + i]));
            }
            for (int h = 0; h < 2; h++) { /* zeros above the diagonal */
                const int64_t first = i + 1 - j0 - 16 * h; /* lanes from here lie above it */
                const __mmask16 keep = first <= 0 ? 0 : first >= 16 ? 0xFFFF : (__mmask16)((1u << first) - 1);
                _mm512_storeu_ps(T + (i - j0) * ld + 16 * h, _mm512_maskz_mov_ps(keep, acc[r][h]));
            }
        }
    }
}

/* 2: the factorisation and the GEMM run here (AVX-512); 1: the factorisation (AVX2, FMA); 0 */
int ptq_linalg_available(void) { return __builtin_cpu_supports("avx512f") ? 2 : ptq_avx2_fma_() ? 1 : 0; }

#else

int ptq_linalg_available(void) { return 0; }

#endif

/* C [m, n] (row stride ldc) -= A·B with A(i, p) = A[i·ar + p·ap] [m, k] and B [k, n] (row
   stride ldb), float32: see the GEMM above. Returns 0, or 4 without AVX-512
   (ptq_linalg_available says so). */
int ptq_gemm_subtract(float *C, int64_t ldc, const float *A, int64_t ar, int64_t ap, const float *B, int64_t ldb,
                      int64_t m, int64_t n, int64_t k) {
#if HAS_AVX512
    if (ptq_linalg_available() != 2)
        return 4;
    gemm_subtract(C, ldc, A, ar, ap, B, ldb, m, n, k);
    return 0;
#else
    (void)C, (void)ldc, (void)A, (void)ar, (void)ap, (void)B, (void)ldb, (void)m, (void)n, (void)k;
    return 4;
#endif
}

/* The factorisation in three calls (compiled.inverse_cholesky drives them):

   ptq_cholesky_padded: the Cholesky factor L of the symmetric matrix H [n, n] (float32, row
   stride ld, its lower triangle read; with an order R [n], of H[R][:, R], read from both
   triangles of a symmetric H: GPTQ's reversed Hessian without a copy of it first) with its
   diagonal replaced by diag [n], into the lower triangle of A [np, np] (np = n rounded up
   to 32; the extra rows and columns the identity's; its strict upper triangle left holding
   scratch). Returns 0; 1 when the
   matrix is not positive definite; 3 when memory ran out; 4 without AVX-512 or AVX2
   (ptq_linalg_available says so). narrow: the AVX2 code on a CPU with AVX-512 too (tests
   compare the two; the same bits).

   ptq_cholesky_copy and ptq_cholesky_shared: the same factor (AVX-512 only; the same bits)
   with its work shared by threads: the copy into A on one thread, then every thread calls
   ptq_cholesky_shared(A, np, P, state) with the same P (floats) and state (int64, zeros),
   of the sizes ptq_cholesky_scratch gives. Returns as ptq_cholesky_padded, in every thread.

   ptq_inverse_tiles: columns of X [np, np] = L⁻¹, a tile (32 columns; 8 with the AVX2 code)
   at a time, the next tile's number taken from *next until none is left: callers on
   several threads share the tiles, each tile computed as on one thread.

   ptq_inverse_copy: L⁻¹ from X into out [n, n] (contiguous): lower triangular, zeros above
   the diagonal. Returns 0, or 2 when L⁻¹ has an entry that is not finite. */
void ptq_cholesky_scratch(int64_t np, int64_t *sizes) {
    sizes[0] = GROUP * panel_stride(np);  /* P */
    sizes[1] = STEP_WORDS * (np / BLOCK); /* state */
}

#if HAS_AVX512
/* H's lower triangle (of H[R][:, R] where R is given) with its diagonal replaced by diag,
   padded with the identity, into A */
static void padded_copy(const float *H, int64_t n, int64_t ld, const int64_t *R, const float *diag, float *A,
                        int64_t np) {
    memset(A, 0, (size_t)(np * np) * sizeof(float));
    for (int64_t i = 0; i < np; i++) {
        float *a = A + i * np;
        if (i < n && R) { /* the strict lower triangle, gathered */
            const float *row = H + R[i] * ld;
            for (int64_t j = 0; j < i; j++)
                a[j] = row[R[j]];
        } else if (i < n) {
            memcpy(a, H + i * ld, (size_t)i * sizeof(float));
        }
        a[i] = i < n ? diag[i] : 1.0f;
    }
}
#endif

int ptq_cholesky_padded(const float *H, int64_t n, int64_t ld, const int64_t *R, const float *diag, float *A,
                        int32_t narrow) {
#if HAS_AVX512
    const int wide = !narrow && __builtin_cpu_supports("avx512f");
    if (!wide && !ptq_avx2_fma_())
        return 4;
    const int64_t np = (n + BLOCK - 1) / BLOCK * BLOCK;
    int64_t sizes[2];
    ptq_cholesky_scratch(np, sizes);
    float *P = malloc((size_t)sizes[0] * sizeof(float));
    int64_t *state = calloc((size_t)sizes[1], sizeof(int64_t));
    if (!P || !state) {
        free(P), free(state);
        return 3;
    }
    padded_copy(H, n, ld, R, diag, A, np);
    const int status = (wide ? cholesky(A, np, P, state) : ptq_cholesky_avx2_(A, np, P)) ? 0 : 1;
    free(P), free(state);
    return status;
#else
    (void)H, (void)n, (void)ld, (void)R, (void)diag, (void)A, (void)narrow;
    return 4;
#endif
}

int ptq_cholesky_copy(const float *H, int64_t n, int64_t ld, const int64_t *R, const float *diag, float *A) {
#if HAS_AVX512
    if (ptq_linalg_available() != 2)
        return 4;
    padded_copy(H, n, ld, R, diag, A, (n + BLOCK - 1) / BLOCK * BLOCK);
    return 0;
#else
    (void)H, (void)n, (void)ld, (void)R, (void)diag, (void)A;
    return 4;
#endif
}

int ptq_cholesky_shared(float *A, int64_t np, float *P, int64_t *state) {
#if HAS_AVX512
    if (ptq_linalg_available() != 2)
        return 4;
    return cholesky(A, np, P, state) ? 0 : 1;
#else
    (void)A, (void)np, (void)P, (void)state;
    return 4;
#endif
}

void ptq_inverse_tiles(const float *A, int64_t np, float *X, int64_t *next, int32_t narrow) {
#if HAS_AVX512
    const int wide = !narrow && __builtin_cpu_supports("avx512f");
    const int64_t width = wide ? BLOCK : 8;
    /* AVX-512 tiles are solved in a panel of 32 contiguous columns, then copied into X: in
       place their rows lie np floats apart, and where that is 4, 6 or 8 KiB (1024, 1536 or
       2048 rows) the rows read again for every block of 8 crowd a few sets of the caches
       (one thread of a Xeon with AMX: 78, 78 and 57 GFLOP/s at those sizes against 134 at
       576 rows). The same operations in the same order: the same bits. */
    float *panel = wide ? aligned_alloc(64, (size_t)(np * BLOCK) * sizeof(float)) : NULL;
    for (;;) {
        const int64_t j0 = __atomic_fetch_add(next, 1, __ATOMIC_RELAXED) * width;
        if (j0 >= np)
            break;
        if (wide && panel) {
            inverse_tile(A, np, panel, BLOCK, j0);
            for (int64_t k = j0; k < np; k++)
                memcpy(X + k * np + j0, panel + (k - j0) * BLOCK, BLOCK * sizeof(float));
        } else if (wide) {
            inverse_tile(A, np, X + j0 * np + j0, np, j0);
        } else {
            ptq_inverse_tile_avx2_(A, np, X, j0);
        }
    }
    free(panel);
#else
    (void)A, (void)np, (void)X, (void)next, (void)narrow;
#endif
}

/* GPTQ's error-feedback matrix F [n, n] (out, contiguous; cholesky.feedback) from the
   Cholesky factor L of J H J in A [np, np] (J reverses the order): with m = n - 1 - p and
   b = n - 1 - k, F[p][p] = L[m][m] and F[p][k] = -(L[m][b] / L[b][b]) for k > p, zeros
   below the diagonal. Returns 0, or 2 when an entry is not finite. */
int ptq_feedback_copy(const float *A, int64_t np, int64_t n, float *out) {
    float *diagonal = malloc((size_t)(n > 0 ? n : 1) * sizeof(float));
    if (!diagonal)
        return 3;
    for (int64_t b = 0; b < n; b++)
        diagonal[b] = A[b * np + b];
    int finite = 1;
    for (int64_t p = 0; p < n; p++) {
        const int64_t m = n - 1 - p;
        const float *a = A + m * np;
        float *f = out + p * n;
        memset(f, 0, (size_t)p * sizeof(float));
        f[p] = a[m];
        for (int64_t b = 0; b < m; b++) {
            const float v = -(a[b] / diagonal[b]);
            finite &= isfinite(v) != 0;
            f[n - 1 - b] = v;
        }
    }
    free(diagonal);
    return finite ? 0 : 2;
}

int ptq_inverse_copy(const float *X, int64_t np, int64_t n, float *out) {
    int finite = 1;
    for (int64_t i = 0; i < n; i++) { /* X's row i is written up to its diagonal's tile */
        for (int64_t j = 0; j <= i; j++)
            finite &= isfinite(X[i * np + j]) != 0;
        memcpy(out + i * n, X + i * np, (size_t)(i + 1) * sizeof(float));
        memset(out + i * n + i + 1, 0, (size_t)(n - i - 1) * sizeof(float));
    }
    return finite ? 0 : 2;
}
