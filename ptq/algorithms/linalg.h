/* What linalg.c and linalg_avx2.c (its factorisation in AVX2 code) share: the blocks'
   sizes, the diagonal blocks' factorisation (scalar: the same bits on either path), and the
   AVX2 code's entry points (hidden: not part of the library's interface). */
#ifndef PTQ_LINALG_H
#define PTQ_LINALG_H

#include <math.h>

#include "quant_math.h"

enum { BLOCK = 32, ROWS = 8 };

/* The diagonal block A[k0:k0+32, k0:k0+32] (its lower triangle, the earlier blocks'
   products already taken away) to its Cholesky factor, element by element. 0 when a pivot
   is not positive (or not a number). */
static inline int factor_diagonal(float *A, int64_t ld, int64_t k0) {
    for (int64_t j = k0; j < k0 + BLOCK; j++) {
        float d = A[j * ld + j];
        for (int64_t k = k0; k < j; k++)
            d -= A[j * ld + k] * A[j * ld + k];
        if (!(d > 0) || !isfinite(d))
            return 0;
        const float root = sqrtf(d);
        A[j * ld + j] = root;
        for (int64_t i = j + 1; i < k0 + BLOCK; i++) {
            float s = A[i * ld + j];
            for (int64_t k = k0; k < j; k++)
                s -= A[i * ld + k] * A[j * ld + k];
            A[i * ld + j] = s / root;
        }
    }
    return 1;
}

#if HAS_AVX512
#define HIDDEN __attribute__((visibility("hidden")))
/* A [np, np] to its Cholesky factor in its lower triangle (P: 32 x np floats); 0 when it is
   not positive definite */
HIDDEN int ptq_cholesky_avx2_(float *A, int64_t np, float *P);
/* columns [j0, j0 + 8) of X = L⁻¹ (L in A's lower triangle) */
HIDDEN void ptq_inverse_tile_avx2_(const float *A, int64_t np, float *X, int64_t j0);
/* whether the CPU has AVX2 and FMA */
HIDDEN int ptq_avx2_fma_(void);
#endif

#endif
