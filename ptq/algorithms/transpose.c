/* Transposed copies with a gather, compiled: dst[i, j] = src[R[j], C[i]] (R, C optional
   index maps, identity when NULL). GPTQ's working copy of a weight (W [out, in] as
   [in, out] with its columns in processing order, bf16 or float32 widened to float32) and
   its codes put back (Qt [in, out] int8, rows in processing order, as [out, in]). torch's
   strided copies of these were 2-3 times slower (ptq.algorithms.compiled.transposed calls
   this file). Moves and exact bf16 -> float32 widening only: the same bits anywhere. */

#include "quant_math.h" /* VECTORIZED: the AVX-512 clone widens 1.5x faster */

enum { TILE = 32 }; /* source rows read together: one cache line each stays in L1 across i */

#define GATHER_TRANSPOSE(NAME, SRC, DST, CONVERT)                                                       \
    VECTORIZED void NAME(const SRC *src, int64_t ld, const int64_t *R, const int64_t *C, int64_t i0,   \
                         int64_t i1, int64_t nj, DST *dst) {                                          \
        for (int64_t j0 = 0; j0 < nj; j0 += TILE) {                                                   \
            const int64_t width = j0 + TILE < nj ? TILE : nj - j0;                                    \
            const SRC *rows[TILE];                                                                    \
            for (int64_t j = 0; j < width; j++)                                                       \
                rows[j] = src + (R ? R[j0 + j] : j0 + j) * ld;                                        \
            for (int64_t i = i0; i < i1; i++) {                                                       \
                const int64_t c = C ? C[i] : i;                                                       \
                DST *d = dst + i * nj + j0;                                                           \
                for (int64_t j = 0; j < width; j++)                                                   \
                    d[j] = CONVERT(rows[j][c]);                                                       \
            }                                                                                         \
        }                                                                                             \
    }

static inline uint8_t same8(uint8_t x) { return x; }
static inline uint16_t same16(uint16_t x) { return x; }
static inline uint32_t same32(uint32_t x) { return x; }
static inline uint32_t bf16_to_f32_bits(uint16_t x) { return (uint32_t)x << 16; } /* exact */

/* rows [i0, i1) of dst [ni, nj] (contiguous) from src (rows of stride ld elements) */
GATHER_TRANSPOSE(ptq_transpose_8, uint8_t, uint8_t, same8)
GATHER_TRANSPOSE(ptq_transpose_16, uint16_t, uint16_t, same16)
GATHER_TRANSPOSE(ptq_transpose_32, uint32_t, uint32_t, same32)
GATHER_TRANSPOSE(ptq_transpose_bf16_f32, uint16_t, uint32_t, bf16_to_f32_bits)

/* Rows [i0, i1) of dst [ni, nj] (contiguous) = src[R[i], C[j]] (src's rows of stride ld):
   a gather of rows and of columns within them, in one pass (gptq's reversed Hessian) */
VECTORIZED void ptq_gather_32(const uint32_t *src, int64_t ld, const int64_t *R, const int64_t *C, int64_t i0,
                              int64_t i1, int64_t nj, uint32_t *dst) {
    for (int64_t i = i0; i < i1; i++) {
        const uint32_t *row = src + R[i] * ld;
        uint32_t *d = dst + i * nj;
        for (int64_t j = 0; j < nj; j++)
            d[j] = row[C[j]];
    }
}

/* A [n, n] (rows of stride ld): rows [i0, i1) of its strict lower triangle from the strict
   upper one (A[i, j] = A[j, i], j < i), or with to_upper the strict upper triangle of
   those rows from the strict lower one (A[i, j] = A[j, i], j > i). Rows [i0, i1) are the
   only ones written and the other triangle the only one read: row ranges split freely. */
VECTORIZED void ptq_mirror_32(uint32_t *A, int64_t n, int64_t ld, int64_t i0, int64_t i1, int32_t to_upper) {
    for (int64_t j0 = 0; j0 < n; j0 += TILE) {
        const int64_t j1 = j0 + TILE < n ? j0 + TILE : n;
        for (int64_t i = i0; i < i1; i++) {
            const int64_t a = to_upper ? (j0 > i + 1 ? j0 : i + 1) : j0;  /* columns [a, b) of row i */
            const int64_t b = to_upper ? j1 : (j1 < i ? j1 : i);
            uint32_t *d = A + i * ld;
            for (int64_t j = a; j < b; j++)
                d[j] = A[j * ld + i];
        }
    }
}

/* a [total] reversed in place, positions [k0, k1) of its first half swapped with theirs
   from the end (k1 <= total / 2): disjoint ranges split freely */
VECTORIZED void ptq_reverse_32(uint32_t *a, int64_t total, int64_t k0, int64_t k1) {
    for (int64_t k = k0; k < k1; k++) {
        const uint32_t x = a[k];
        a[k] = a[total - 1 - k];
        a[total - 1 - k] = x;
    }
}
