#include "linalg.h"

#if HAS_AVX512 /* (quant_math.h: x86-64 and GCC, where these targets compile) */

/* The factorisation of linalg.c on a CPU with AVX2 and FMA (8 lanes, 16 registers): the Cholesky's
   trailing updates in tiles of 4 rows x 16 columns, the inverse in tiles of 8 rows x 8
   columns (the same blocks of 8 rows as linalg.c's). Every element is the same sequence of
   roundings as on the AVX-512 path, only in other tiles: the same bits on either kind of
   CPU. On a 2-core AMD EPYC (Zen 3) 576 rows take 2.7-5.8 ms against LAPACK's 12-14 (whose
   triangular solve runs at 11-12 GFLOP/s there), 768 rows 12 against 28; from 1024 rows
   the blocked path on two threads is faster. The GEMM stays AVX-512's alone: in these
   tiles it ran at half MKL's speed there. */
#define AVX2 __attribute__((target("avx2,fma")))

/* the first w (0..8) lanes set */
AVX2 static inline __m256i lanes2(int64_t w) {
    const __m256i index = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    return _mm256_cmpgt_epi32(_mm256_set1_epi32((int)(w < 0 ? 0 : w > 8 ? 8 : w)), index);
}

/* linalg.c's tile_subtract on 4 rows x 16 columns, all of them */
AVX2 static inline __attribute__((always_inline)) void tile_subtract2(float *C, int64_t ldc, const float *A, int64_t ar,
                                                                     int64_t ap, const float *B, int64_t ldb, int64_t k) {
    __m256 acc[4][2];
    for (int r = 0; r < 4; r++) {
        acc[r][0] = _mm256_loadu_ps(C + r * ldc);
        acc[r][1] = _mm256_loadu_ps(C + r * ldc + 8);
    }
    for (int64_t p = 0; p < k; p++) {
        const __m256 b0 = _mm256_loadu_ps(B + p * ldb), b1 = _mm256_loadu_ps(B + p * ldb + 8);
        for (int r = 0; r < 4; r++) {
            const __m256 a = _mm256_broadcast_ss(A + r * ar + p * ap);
            acc[r][0] = _mm256_fnmadd_ps(a, b0, acc[r][0]);
            acc[r][1] = _mm256_fnmadd_ps(a, b1, acc[r][1]);
        }
    }
    for (int r = 0; r < 4; r++) {
        _mm256_storeu_ps(C + r * ldc, acc[r][0]);
        _mm256_storeu_ps(C + r * ldc + 8, acc[r][1]);
    }
}

AVX2 int ptq_cholesky_avx2_(float *A, int64_t np, float *P) {
    for (int64_t k0 = 0; k0 < np; k0 += BLOCK) {
        if (!factor_diagonal(A, np, k0))
            return 0;
        const int64_t k1 = k0 + BLOCK, m = np - k1;
        if (m == 0)
            return 1;
        for (int64_t i = 0; i < m; i++)
            for (int64_t c = 0; c < BLOCK; c++)
                P[c * m + i] = A[(k1 + i) * np + k0 + c];
        for (int64_t c = 0; c < BLOCK; c++) {
            const __m256 d = _mm256_set1_ps(A[(k0 + c) * np + k0 + c]);
            for (int64_t i = 0; i < m; i += 8) {
                __m256 v = _mm256_loadu_ps(P + c * m + i);
                for (int64_t e = 0; e < c; e++)
                    v = _mm256_fnmadd_ps(_mm256_set1_ps(A[(k0 + c) * np + k0 + e]), _mm256_loadu_ps(P + e * m + i), v);
                _mm256_storeu_ps(P + c * m + i, _mm256_div_ps(v, d));
            }
        }
        for (int64_t i = 0; i < m; i++)
            for (int64_t c = 0; c < BLOCK; c++)
                A[(k1 + i) * np + k0 + c] = P[c * m + i];
        for (int64_t i0 = 0; i0 < m; i0 += 4)
            for (int64_t j0 = 0; j0 <= i0 + 3; j0 += 16)
                tile_subtract2(A + (k1 + i0) * np + k1 + j0, np, P + i0, 1, m, P + j0, m, BLOCK);
    }
    return 1;
}

/* inverse_tile on columns [j0, j0 + 8) */
AVX2 void ptq_inverse_tile_avx2_(const float *A, int64_t np, float *X, int64_t j0) {
    const __m256i index = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    for (int64_t i0 = j0; i0 < np; i0 += ROWS) {
        __m256 acc[ROWS];
        for (int r = 0; r < ROWS; r++)
            acc[r] = _mm256_setzero_ps();
        for (int64_t k = j0; k < i0; k++) {
            const __m256 b = _mm256_loadu_ps(X + k * np + j0);
            for (int r = 0; r < ROWS; r++)
                acc[r] = _mm256_fmadd_ps(_mm256_broadcast_ss(A + (i0 + r) * np + k), b, acc[r]);
        }
#pragma GCC unroll 8 /* else acc, indexed by r and e, lives on the stack (stored every k) */
        for (int r = 0; r < ROWS; r++) {
            const int64_t i = i0 + r;
            __m256 v = _mm256_sub_ps(_mm256_setzero_ps(), acc[r]);
            const __m256 diagonal = _mm256_castsi256_ps(_mm256_cmpeq_epi32(index, _mm256_set1_epi32((int)(i - j0))));
            v = _mm256_add_ps(v, _mm256_and_ps(diagonal, _mm256_set1_ps(1.0f))); /* + 0 elsewhere: exact */
#pragma GCC unroll 8
            for (int e = 0; e < r; e++)
                v = _mm256_fnmadd_ps(_mm256_set1_ps(A[i * np + i0 + e]), acc[e], v);
            acc[r] = _mm256_div_ps(v, _mm256_set1_ps(A[i * np + i]));
            const __m256 keep = _mm256_castsi256_ps(lanes2(i + 1 - j0)); /* zeros above the diagonal */
            _mm256_storeu_ps(X + i * np + j0, _mm256_and_ps(keep, acc[r]));
        }
    }
}

int ptq_avx2_fma_(void) { return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma"); }

#endif
