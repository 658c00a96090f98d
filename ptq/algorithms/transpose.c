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
GATHER_TRANSPOSE(transpose_8_scalar, uint8_t, uint8_t, same8)
GATHER_TRANSPOSE(ptq_transpose_16, uint16_t, uint16_t, same16)
GATHER_TRANSPOSE(ptq_transpose_32, uint32_t, uint32_t, same32)
GATHER_TRANSPOSE(ptq_transpose_bf16_f32, uint16_t, uint32_t, bf16_to_f32_bits)

#if defined(__SSE2__)
#include <emmintrin.h>

/* r[k] = byte k of each of r[0..15]: a 16 x 16 byte transpose in registers, unpacking
   bytes, then pairs, quads and eights of the rows' elements */
static inline void transpose16x16_8(__m128i r[16]) {
    __m128i t[16], u[16], v[16];
    for (int i = 0; i < 8; i++) { /* t[2i + h]: words (row 2i, row 2i + 1) of columns 8h.. */
        t[2 * i] = _mm_unpacklo_epi8(r[2 * i], r[2 * i + 1]);
        t[2 * i + 1] = _mm_unpackhi_epi8(r[2 * i], r[2 * i + 1]);
    }
    for (int i = 0; i < 4; i++) { /* u[4i + q]: rows 4i..4i+3 of columns 4q.. */
        u[4 * i] = _mm_unpacklo_epi16(t[4 * i], t[4 * i + 2]);
        u[4 * i + 1] = _mm_unpackhi_epi16(t[4 * i], t[4 * i + 2]);
        u[4 * i + 2] = _mm_unpacklo_epi16(t[4 * i + 1], t[4 * i + 3]);
        u[4 * i + 3] = _mm_unpackhi_epi16(t[4 * i + 1], t[4 * i + 3]);
    }
    for (int h = 0; h < 2; h++) /* v[8h + 2q + p]: rows 8h..8h+7 of columns 4q + 2p, 4q + 2p + 1 */
        for (int q = 0; q < 4; q++) {
            v[8 * h + 2 * q] = _mm_unpacklo_epi32(u[8 * h + q], u[8 * h + 4 + q]);
            v[8 * h + 2 * q + 1] = _mm_unpackhi_epi32(u[8 * h + q], u[8 * h + 4 + q]);
        }
    for (int k = 0; k < 8; k++) { /* column 2k and 2k + 1: rows 0-7 from v[k], rows 8-15 from v[8 + k] */
        r[2 * k] = _mm_unpacklo_epi64(v[k], v[8 + k]);
        r[2 * k + 1] = _mm_unpackhi_epi64(v[k], v[8 + k]);
    }
}

/* ptq_transpose_8 without a column map: blocks of 16 x 16 bytes moved through registers
   (GPTQ's codes, [in, out] -> [out, in]: 576 x 3072 on one thread of the AMX Xeon 1.13 ->
   0.23 ms), the edges byte by byte */
static void transpose_8_blocks(const uint8_t *src, int64_t ld, const int64_t *R, int64_t i0, int64_t i1, int64_t nj,
                               uint8_t *dst) {
    enum { BAND = 64 }; /* dst rows per band: their 64 x nj bytes stay in the cache across the sources */
    const int64_t jw = nj / 16 * 16;
    for (int64_t b0 = i0; b0 + 16 <= i1; b0 += BAND) {
        const int64_t b1 = b0 + BAND < i1 ? b0 + BAND : i1;
        for (int64_t j = 0; j < jw; j += 16) {
            const uint8_t *rows[16];
            for (int k = 0; k < 16; k++)
                rows[k] = src + (R ? R[j + k] : j + k) * ld;
            for (int64_t i = b0; i + 16 <= b1; i += 16) {
                __m128i r[16];
                for (int k = 0; k < 16; k++)
                    r[k] = _mm_loadu_si128((const __m128i *)(rows[k] + i));
                transpose16x16_8(r);
                for (int k = 0; k < 16; k++)
                    _mm_storeu_si128((__m128i *)(dst + (i + k) * nj + j), r[k]);
            }
        }
    }
    const int64_t full = i0 + (i1 - i0) / 16 * 16; /* rows [i0, full) done in whole blocks of columns [0, jw) */
    for (int64_t i = i0; i < i1; i++)
        for (int64_t j = i < full ? jw : 0; j < nj; j++)
            dst[i * nj + j] = src[(R ? R[j] : j) * ld + i];
}
#endif

void ptq_transpose_8(const uint8_t *src, int64_t ld, const int64_t *R, const int64_t *C, int64_t i0, int64_t i1,
                     int64_t nj, uint8_t *dst) {
#if defined(__SSE2__)
    if (!C) {
        transpose_8_blocks(src, ld, R, i0, i1, nj, dst);
        return;
    }
#endif
    transpose_8_scalar(src, ld, R, C, i0, i1, nj, dst);
}
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
