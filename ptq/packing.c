/* Dense int32 packing of signed integers, compiled: the torch reference is ptq/packing.py
   (pack_int32, unpack_int32), whose layout this file writes bit for bit.

   Each value of `bits` bits is offset by 2^(bits-1) and written into one little-endian bit
   stream per row: element j occupies bits [j*bits, (j+1)*bits), spilling into the next
   word when it straddles a boundary. A row of n values takes ceil(n * bits / 32) words;
   bits past the row's last value are 0. Integer arithmetic only: the same on every CPU. */

#include "algorithms/quant_math.h"

/* byte i of a uint64_t in memory is its bits [8i, 8i + 8) (x86-64, Arm) */
#define LITTLE_ENDIAN_BYTES (__BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__)

/* words [0, count) of a row whose values fill them whole (32 / bits each); inlined with
   bits a constant, the fixed count of values per word lets the compiler vectorize it */
static inline __attribute__((always_inline)) void whole_words(const int8_t *v, uint32_t *w, int64_t count,
                                                              const int bits) {
    const int per = 32 / bits;
    const int32_t offset = 1 << (bits - 1);
    for (int64_t k = 0; k < count; k++) {
        uint32_t word = 0;
        for (int i = 0; i < per; i++)
            word |= (uint32_t)((int32_t)v[k * per + i] + offset) << (i * bits);
        w[k] = word;
    }
}

/* values [rows, n] int8 (row stride vstride) into words [rows, nwords] (nwords =
   ceil(n * bits / 32), contiguous); each value in -2^(bits-1) .. 2^(bits-1) - 1 */
VECTORIZED void ptq_pack_int32(const int8_t *values, int64_t rows, int64_t n, int64_t vstride, int32_t bits,
                               int32_t *words, int64_t nwords) {
    const uint32_t offset = 1u << (bits - 1);
    for (int64_t r = 0; r < rows; r++) {
        const int8_t *v = values + r * vstride;
        uint32_t *w = (uint32_t *)words + r * nwords;
        if (32 % bits == 0) { /* whole values per word: no straddling */
            const int64_t per = 32 / bits, whole = n / per;
            if (bits == 4) /* the common case, with a constant count */
                whole_words(v, w, whole, 4);
            else
                whole_words(v, w, whole, bits);
            if (whole < nwords) { /* the row's last values, part of a word */
                uint32_t word = 0;
                for (int64_t j = whole * per; j < n; j++)
                    word |= (uint32_t)((int32_t)v[j] + (int32_t)offset) << ((j - whole * per) * bits);
                w[whole] = word;
            }
            continue;
        }
        for (int64_t k = 0; k < nwords; k++)
            w[k] = 0;
        for (int64_t j = 0; j < n; j++) {
            const uint64_t u = (uint64_t)(uint32_t)((int32_t)v[j] + (int32_t)offset);
            const int64_t bit = j * bits, k = bit / 32, shift = bit % 32;
            const uint64_t field = u << shift; /* at most 39 bits */
            w[k] |= (uint32_t)field;
            if (shift + bits > 32)
                w[k + 1] |= (uint32_t)(field >> 32);
        }
    }
}

/* words [rows, nwords] (contiguous) into values [rows, n] int8 (contiguous) */
VECTORIZED void ptq_unpack_int32(const int32_t *words, int64_t rows, int64_t nwords, int32_t bits, int64_t n,
                                 int8_t *values) {
    const int32_t offset = 1 << (bits - 1);
    const uint32_t mask = (1u << bits) - 1;
    for (int64_t r = 0; r < rows; r++) {
        const uint32_t *w = (const uint32_t *)words + r * nwords;
        int8_t *v = values + r * n;
        if (bits == 4 && n % 8 == 0 && LITTLE_ENDIAN_BYTES) { /* the common case: 8 fields to 8 bytes at once */
            for (int64_t k = 0; k < nwords; k++) {
                uint64_t x = w[k];
                x = (x | x << 16) & 0x0000FFFF0000FFFFull;
                x = (x | x << 8) & 0x00FF00FF00FF00FFull;
                x = (x | x << 4) & 0x0F0F0F0F0F0F0F0Full; /* field i in byte i */
                /* each byte less 8, as int8: from 128 + field no byte borrows from the next */
                x = ((x | 0x8080808080808080ull) - 0x0808080808080808ull) ^ 0x8080808080808080ull;
                memcpy(v + k * 8, &x, 8);
            }
            continue;
        }
        if (32 % bits == 0) {
            const int64_t per = 32 / bits;
            for (int64_t k = 0; k < nwords; k++) {
                const uint32_t word = w[k];
                const int64_t j0 = k * per, j1 = j0 + per < n ? j0 + per : n;
                for (int64_t j = j0; j < j1; j++)
                    v[j] = (int8_t)((int32_t)((word >> ((j - j0) * bits)) & mask) - offset);
            }
            continue;
        }
        for (int64_t j = 0; j < n; j++) {
            const int64_t bit = j * bits, k = bit / 32, shift = bit % 32;
            uint64_t stream = w[k];
            if (k + 1 < nwords)
                stream |= (uint64_t)w[k + 1] << 32;
            v[j] = (int8_t)((int32_t)((stream >> shift) & mask) - offset);
        }
    }
}

/* The codes in words [rows, nwords] (packed as above), dequantized as
   ptq/primitives.py's dequantize computes them: (q - zero) · scale in the scale's dtype.
   Row r's n codes form `groups` groups of n / groups consecutive codes, group g with the
   scale scale[r, g] (float32 or bf16: scale_kind, SCALE_* of quant_math.h) and the zero
   point zero[r, g] (int8 [rows, groups]; NULL: symmetric, zero 0). out [rows, n], in the
   scale's dtype. The same bits as torch: the difference of two 8-bit integers is exact in
   float32 and in bf16, and its product with a bf16 scale (8 significant bits each) exact
   in float32, which one rounding to bf16 (to nearest even) makes torch's bf16 product;
   with float32 scales the steps are torch's own. codes: n bytes of scratch. */
VECTORIZED void ptq_dequantize_packed(const int32_t *words, int64_t nwords, int32_t bits, int64_t n,
                                      const void *scale, int32_t scale_kind, int64_t groups, const int8_t *zero,
                                      void *out, int64_t rows, int8_t *codes) {
    const int64_t size = n / groups;
    for (int64_t r = 0; r < rows; r++) {
        ptq_unpack_int32(words + r * nwords, 1, nwords, bits, n, codes);
        for (int64_t g = 0; g < groups; g++) {
            const int64_t at = r * groups + g;
            const float s = scale_kind == SCALE_BF16 ? bf16_widened(((const uint16_t *)scale)[at])
                                                     : ((const float *)scale)[at];
            const float z = zero ? (float)zero[at] : 0.0f;
            const int8_t *c = codes + g * size;
            if (scale_kind == SCALE_BF16) {
                uint16_t *o = (uint16_t *)out + r * n + g * size;
                for (int64_t j = 0; j < size; j++) {
                    const float v = to_bf16(((float)c[j] - z) * s);
                    uint32_t u;
                    memcpy(&u, &v, 4);
                    o[j] = (uint16_t)(u >> 16);
                }
            } else {
                float *o = (float *)out + r * n + g * size;
                for (int64_t j = 0; j < size; j++)
                    o[j] = ((float)c[j] - z) * s;
            }
        }
    }
}
