/* Sums of bf16 products on a CPU with AMX (Intel's tile multiply: bf16 products summed in
   float32 tiles), compiled: Hessians Σ x xᵀ of bf16 inputs, and AWQ's Gram loss Σ d G dᵀ
   (ptq_gram_quadratic, at the end); and the Hessians' sums on a CPU with AVX512-BF16 and
   no AMX (ptq_gram_avx512: AMD's Zen 4 and 5, Intel's Cooper Lake).

   The torch reference is ptq/calibration/observers.py (HessianObserver): there the sum
   runs as oneDNN GEMMs of the inputs converted to float32 and multiplied in bf16, which
   torch offers no faster way to do on a CPU (a bf16 GEMM rounds its sums to bf16). Here:

   - ptq_gram_pack lays a chunk of tokens X [T, n] (bf16, row stride ld) out as tiles:
     B tiles XV [n/16][stride][16 token pairs][16 features][2 tokens] (the layout AMX
     multiplies by) and A tiles XT [n/16][stride][16 features][32 tokens] (the same tiles
     transposed as 32-bit pairs), of which the first Tp/32 per block are used, tokens T..Tp
     zero. Each tile is 1 KiB, contiguous.
   - ptq_gram_amx adds XᵀX to the rows [i0, i1) and columns [j0, n) of the float32 sum,
     on and above the diagonal, 2 x 2 tiles (32 x 32 elements) at a time, over CHUNK tiles
     of tokens while their A tiles stay in the L1 cache, and over a panel of columns whose
     B tiles stay in the L2 cache; with `fresh` it writes those blocks instead, from zero
     (the sum's first chunk: its memory need not be zeroed first, nor is it read).

   - ptq_gram_avx512 adds (or with `fresh` writes) the same blocks from the B tiles
     alone (ptq_gram_pack leaves XT when given none): per token pair, 3 vectors of 16
     features' pairs against 8 rows' pairs broadcast, VDPBF16PS adding both products to
     each float32 lane. Each element's products are summed over SUM_TILES tiles (128
     tokens) from zero, then added to the sum: a float32 sum over all 2048 tokens of a
     chunk in one register was 4-5 times less accurate than oneDNN's GEMMs (4.8e-6 of
     H's largest element against 1.2e-6 over 5000 tokens), in sums of 128 it is more
     accurate (1.9e-7), at the same speed.

   On AMX every element of the sum gets its tokens' products added in token order, pairs
   at a time, as TDPBF16PS does them (round to nearest even; denormal inputs and results
   flushed to zero); with VDPBF16PS in sums of 128 tokens in a fixed order. So the sum does
   not depend on how rows are split across threads or calls. It differs from the oneDNN
   path's in the last bits (another order of sums), and the two kernels' from each other.

   Linux hands out AMX's tile state only on request (arch_prctl): ptq_amx_available asks. */

#include <stdint.h>
#include <string.h>

#include "../algorithms/quant_math.h"

#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__) && __GNUC__ >= 11 && defined(__linux__)
#include <cpuid.h>
#include <sys/syscall.h>
#include <unistd.h>

enum { ARCH_REQ_XCOMP_PERM = 0x1023, XFEATURE_XTILEDATA = 18, CHUNK = 8, TILE = 512 /* bf16 per tile */ };
static const int64_t PANEL_BYTES = 1 << 20;

int ptq_amx_available(void) {
    unsigned a, b, c, d;
    if (!__get_cpuid_count(7, 0, &a, &b, &c, &d) || !((d >> 22) & 1) || !((d >> 24) & 1)) /* AMX-BF16, -TILE */
        return 0;
    if (!__get_cpuid(1, &a, &b, &c, &d) || !((c >> 27) & 1)) /* OSXSAVE: xgetbv may run */
        return 0;
    unsigned lo, hi;
    __asm__ volatile("xgetbv" : "=a"(lo), "=d"(hi) : "c"(0));
    if (((lo >> 17) & 3) != 3) /* the OS saves the tile state */
        return 0;
    return syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0;
}

/* X [T, n] -> XV and XT (see the header) for the feature blocks [f0, f1) of 16; n a
   multiple of 16, Tp of 32, T <= Tp; the buffers hold `stride` tiles per feature block */
__attribute__((target("avx512f,avx2"))) void ptq_gram_pack(const uint16_t *X, int64_t T, int64_t ld, int64_t Tp,
                                                          int64_t stride, int64_t f0, int64_t f1, uint16_t *XV,
                                                          uint16_t *XT) {
    const int64_t tiles = Tp / 32;
    for (int64_t k = 0; k < tiles; k++) /* 32 tokens at a time: their rows stay in the L1 cache */
        for (int64_t f = f0; f < f1; f++) {
            uint16_t *v = XV + (f * stride + k) * TILE, *a = XT + (f * stride + k) * TILE;
            __m512i rows[16];
            for (int64_t p = 0; p < 16; p++) { /* token pair p: its 16 features, interleaved */
                const int64_t t = k * 32 + 2 * p;
                const __m256i x0 = t < T ? _mm256_loadu_si256((const __m256i *)(X + t * ld + f * 16))
                                         : _mm256_setzero_si256();
                const __m256i x1 = t + 1 < T ? _mm256_loadu_si256((const __m256i *)(X + (t + 1) * ld + f * 16))
                                             : _mm256_setzero_si256();
                const __m256i lo = _mm256_unpacklo_epi16(x0, x1), hi = _mm256_unpackhi_epi16(x0, x1);
                const __m256i first = _mm256_permute2x128_si256(lo, hi, 0x20); /* features 0..7 */
                const __m256i last = _mm256_permute2x128_si256(lo, hi, 0x31);  /* features 8..15 */
                rows[p] = _mm512_inserti64x4(_mm512_castsi256_si512(first), last, 1);
                _mm512_storeu_si512(v + p * 32, rows[p]);
            }
            if (!XT) /* the AVX512-BF16 sums read the B tiles only */
                continue;
            transpose16(rows); /* row f: feature f's 16 pairs = 32 tokens */
            for (int64_t r = 0; r < 16; r++)
                _mm512_storeu_si512(a + r * 32, rows[r]);
        }
}

int ptq_avx512bf16_available(void) {
    unsigned a, b, c, d;
    if (!__get_cpuid_count(7, 0, &a, &b, &c, &d) || !((b >> 16) & 1) || !((b >> 30) & 1) || !((b >> 31) & 1))
        return 0; /* AVX512F, BW and VL (ptq/cpu_attention.c uses all three) */
    if (!__get_cpuid_count(7, 1, &a, &b, &c, &d) || !((a >> 5) & 1)) /* AVX512_BF16 */
        return 0;
    if (!__get_cpuid(1, &a, &b, &c, &d) || !((c >> 27) & 1)) /* OSXSAVE: xgetbv may run */
        return 0;
    unsigned lo, hi;
    __asm__ volatile("xgetbv" : "=a"(lo), "=d"(hi) : "c"(0));
    return (lo & 0xE6) == 0xE6; /* the OS saves the vector, opmask and upper ZMM state */
}

/* rows [i, i + 8) and columns [j, j + 16 C) of the sum += the products of the token tiles
   [k0, k1), summed from zero in registers, from the B tiles: per token pair, C vectors of
   16 features' pairs and each row's pair broadcast, VDPBF16PS adding both products */
enum { GRAM_ROWS = 8, SUM_TILES = 4 /* 128 tokens per float32 sum from zero */ };
__attribute__((target("avx512f,avx512bf16"), always_inline)) static inline void
gram_block(const uint16_t *XV, int64_t stride, int64_t k0, int64_t k1, int64_t i, int64_t j, int C, float *sum,
           int64_t ld, int fresh) {
    __m512 acc[GRAM_ROWS][3];
    for (int r = 0; r < GRAM_ROWS; r++)
        for (int c = 0; c < C; c++)
            acc[r][c] = _mm512_setzero_ps();
    const uint32_t *a = (const uint32_t *)(XV + (i / 16) * stride * TILE) + i % 16; /* row i's pair */
    const uint16_t *b = XV + (j / 16) * stride * TILE;
    for (int64_t k = k0; k < k1; k++)
        for (int64_t p = 0; p < 16; p++) {
            const int64_t at = k * TILE + p * 32; /* token pair p of tile k, in bf16 */
            __m512bh v[3];
            for (int c = 0; c < C; c++)
                v[c] = (__m512bh)_mm512_loadu_si512((const void *)(b + c * stride * TILE + at));
            for (int r = 0; r < GRAM_ROWS; r++) {
                const __m512bh x = (__m512bh)_mm512_set1_epi32((int)a[at / 2 + r]);
                for (int c = 0; c < C; c++)
                    acc[r][c] = _mm512_dpbf16_ps(acc[r][c], x, v[c]);
            }
        }
    for (int r = 0; r < GRAM_ROWS; r++)
        for (int c = 0; c < C; c++) {
            float *to = sum + (i + r) * ld + j + 16 * c;
            _mm512_storeu_ps(to, _mm512_add_ps(fresh ? _mm512_setzero_ps() : _mm512_loadu_ps(to), acc[r][c]));
        }
}

/* ptq_gram_amx's sums on a CPU with AVX512-BF16 and no AMX, from the B tiles alone: the
   same blocks of 32 x 32 on and above the diagonal, rows of 8 at a time against 48
   columns, over chunks of tokens whose tiles stay in the L2 cache */
__attribute__((target("avx512f,avx512bf16"))) void ptq_gram_avx512(const uint16_t *XV, int64_t Tp, int64_t stride,
                                                                  int64_t n, int64_t i0, int64_t i1, int64_t j0,
                                                                  float *sum, int64_t ld, int fresh) {
    const int64_t tiles = Tp / 32;
    int64_t chunk = PANEL_BYTES / (n * 64) / SUM_TILES * SUM_TILES; /* token tiles of every feature in about 1 MiB */
    chunk = chunk < SUM_TILES ? SUM_TILES : chunk;
    for (int64_t k0 = 0; k0 < tiles; k0 += chunk) {
        const int64_t k1 = k0 + chunk < tiles ? k0 + chunk : tiles;
        for (int64_t i = i0; i < i1; i += GRAM_ROWS) {
            int64_t j = i / 32 * 32;
            j = j < j0 ? j0 : j;
            for (; j < n; j += 48)
                for (int64_t k = k0; k < k1; k += SUM_TILES) {
                    const int64_t k2 = k + SUM_TILES < k1 ? k + SUM_TILES : k1;
                    if (j + 48 <= n)
                        gram_block(XV, stride, k, k2, i, j, 3, sum, ld, fresh && k == 0);
                    else if (j + 32 <= n)
                        gram_block(XV, stride, k, k2, i, j, 2, sum, ld, fresh && k == 0);
                    else
                        gram_block(XV, stride, k, k2, i, j, 1, sum, ld, fresh && k == 0);
                }
        }
    }
}

/* sum[i0:i1, j0:n] += XᵀX from the packed tiles of Tp tokens (`stride` tiles per feature
   block in the buffers), in blocks of 32 x 32 on and above the diagonal only; i0, i1, j0
   and n multiples of 32; sum float32 with row stride ld */
__attribute__((target("amx-tile,amx-bf16"))) void ptq_gram_amx(const uint16_t *XV, const uint16_t *XT, int64_t Tp,
                                                               int64_t stride, int64_t n, int64_t i0, int64_t i1,
                                                               int64_t j0, float *sum, int64_t ld, int fresh) {
    configure_tiles(); /* 0-3: sums, 4-5: A, 6-7: B */
    const int64_t tiles = Tp / 32, row_bytes = ld * (int64_t)sizeof(float);
    int64_t panel = PANEL_BYTES / (Tp * 2) / 32 * 32; /* columns whose B tiles stay in the L2 cache */
    panel = panel < 32 ? 32 : panel;
    for (int64_t p0 = j0; p0 < n; p0 += panel)
        for (int64_t i = i0; i < i1; i += 32)
            for (int64_t k0 = 0; k0 < tiles; k0 += CHUNK) {
                const int64_t k1 = k0 + CHUNK < tiles ? k0 + CHUNK : tiles;
                const uint16_t *a0 = XT + (i / 16) * stride * TILE, *a1 = a0 + stride * TILE;
                for (int64_t j = p0 > i ? p0 : i; j < n && j < p0 + panel; j += 32) { /* on and above the diagonal */
                    const uint16_t *b0 = XV + (j / 16) * stride * TILE, *b1 = b0 + stride * TILE;
                    float *c = sum + i * ld + j;
                    if (fresh && k0 == 0) { /* the sum's first tokens: from zero, the memory not read */
                        _tile_zero(0);
                        _tile_zero(1);
                        _tile_zero(2);
                        _tile_zero(3);
                    } else {
                        _tile_loadd(0, c, row_bytes);
                        _tile_loadd(1, c + 16, row_bytes);
                        _tile_loadd(2, c + 16 * ld, row_bytes);
                        _tile_loadd(3, c + 16 * ld + 16, row_bytes);
                    }
                    for (int64_t k = k0; k < k1; k++) {
                        _tile_loadd(4, a0 + k * TILE, 64);
                        _tile_loadd(5, a1 + k * TILE, 64);
                        _tile_loadd(6, b0 + k * TILE, 64);
                        _tile_loadd(7, b1 + k * TILE, 64);
                        _tile_dpbf16ps(0, 4, 6);
                        _tile_dpbf16ps(1, 4, 7);
                        _tile_dpbf16ps(2, 5, 6);
                        _tile_dpbf16ps(3, 5, 7);
                    }
                    _tile_stored(0, c, row_bytes);
                    _tile_stored(1, c + 16, row_bytes);
                    _tile_stored(2, c + 16 * ld, row_bytes);
                    _tile_stored(3, c + 16 * ld + 16, row_bytes);
                }
            }
    release_tiles();
}

/* G [n, n] (float32, row stride ld) -> GV for ptq_gram_quadratic: its 32 x 32 blocks on and
   above the diagonal (row block kb <= column block jb) rounded to bf16 (to nearest even),
   those above the diagonal doubled (exact); column blocks [jb0, jb1) only (callers may
   split them across threads); the blocks below the diagonal are not written */
__attribute__((target("avx512f"))) void ptq_gram_quadratic_pack(const float *G, int64_t n, int64_t ld, int64_t jb0,
                                                                int64_t jb1, uint16_t *GV) {
    const int64_t blocks = n / 32;
    for (int64_t jb = jb0; jb < jb1; jb++)
        for (int64_t kb = 0; kb <= jb; kb++) {
            uint16_t *tile = GV + (jb * blocks + kb) * 2 * TILE; /* [half][pair][16][2] */
            const __m512 factor = _mm512_set1_ps(kb < jb ? 2.0f : 1.0f);
            for (int64_t h = 0; h < 2; h++)
                for (int64_t p = 0; p < 16; p++) {
                    const float *g0 = G + (kb * 32 + 2 * p) * ld + jb * 32 + h * 16, *g1 = g0 + ld;
                    /* bf16 of each, to nearest even, then doubled: pairs of rows interleaved */
                    const __m512i b0 = _mm512_castps_si512(_mm512_mul_ps(to_bf16_v(_mm512_loadu_ps(g0)), factor));
                    const __m512i b1 = _mm512_castps_si512(_mm512_mul_ps(to_bf16_v(_mm512_loadu_ps(g1)), factor));
                    /* the even row's bf16 in the low half of each 32 bits, the odd row's in the high */
                    const __m512i pairs = _mm512_or_si512(_mm512_srli_epi32(b0, 16), b1);
                    _mm512_storeu_si512((void *)(tile + h * TILE + p * 32), pairs);
                }
        }
}

/* The end of the panel of GV's column blocks that starts at j0 (ptq_gram_quadratic and its
   AVX512-BF16 twin): as many as fit PANEL_BYTES, one at least. */
static int64_t panel_end(int64_t j0, int64_t blocks) {
    int64_t j1 = j0, bytes = 0; /* column block jb holds jb + 1 blocks of GV, 2 KiB each */
    for (; j1 < blocks && (j1 == j0 || bytes + (j1 + 1) * 4 * TILE <= PANEL_BYTES); j1++)
        bytes += (j1 + 1) * 4 * TILE;
    return j1;
}

/* sum + c0 · d[0:16] + c1 · d[16:32], d 32 bf16 widened to float32, in that order */
__attribute__((target("avx512f"))) static inline __m512 add_row_products(__m512 sum, __m512 c0, __m512 c1,
                                                                        const uint16_t *d) {
    const __m512i v = _mm512_loadu_si512((const void *)d);
    const __m512 lo = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm512_castsi512_si256(v)), 16));
    const __m512 hi = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm512_extracti64x4_epi64(v, 1)), 16));
    sum = _mm512_add_ps(sum, _mm512_mul_ps(c0, lo));
    return _mm512_add_ps(sum, _mm512_mul_ps(c1, hi));
}

/* Σ_r d_r G d_rᵀ over the rows of D [rows, in] (bf16; rows a multiple of 32, in of 32):
   AWQ's Gram loss of one candidate (ptq/algorithms/awq.py, make_linear_loss), with G
   given as GV, the B tiles of its blocks of 32 x 32 on and above the diagonal, those
   above it doubled (compiled.QuadraticForm): GV [in/32 column blocks][in/32 row blocks]
   [2 halves of 16 columns][16 row pairs][16][2]. Each 32 x 32 block of D·G' is summed in
   float32 tiles and multiplied by D's block. Column blocks go in panels whose GV stays in
   the L2 cache (about 1 MiB: one panel up to 1024 features) while every row passes; the
   products are summed in float32 lanes per panel and 32 rows, then in float64, in a fixed
   order. */
__attribute__((target("amx-tile,amx-bf16,avx512f"))) double ptq_gram_quadratic(const uint16_t *D, int64_t rows,
                                                                               int64_t in, const uint16_t *GV) {
    configure_tiles();
    const int64_t blocks = in / 32, row_bytes = in * 2;
    double total = 0;
    float C[32][32];
    for (int64_t j0 = 0, j1; j0 < blocks; j0 = j1) {
        j1 = panel_end(j0, blocks);
        for (int64_t r = 0; r < rows; r += 32) {
            const uint16_t *d0 = D + r * in, *d1 = d0 + 16 * in;
            __m512 sum = _mm512_setzero_ps();
            for (int64_t jb = j0; jb < j1; jb++) {
                _tile_zero(0);
                _tile_zero(1);
                _tile_zero(2);
                _tile_zero(3);
                const uint16_t *g = GV + jb * blocks * 2 * TILE;
                for (int64_t kb = 0; kb <= jb; kb++) {
                    _tile_loadd(4, d0 + kb * 32, row_bytes);
                    _tile_loadd(6, g + kb * 2 * TILE, 64);
                    _tile_loadd(7, g + kb * 2 * TILE + TILE, 64);
                    _tile_dpbf16ps(0, 4, 6);
                    _tile_dpbf16ps(1, 4, 7);
                    _tile_loadd(5, d1 + kb * 32, row_bytes); /* loaded while the first two run */
                    _tile_dpbf16ps(2, 5, 6);
                    _tile_dpbf16ps(3, 5, 7);
                }
                _tile_stored(0, &C[0][0], 128);
                _tile_stored(1, &C[0][16], 128);
                _tile_stored(2, &C[16][0], 128);
                _tile_stored(3, &C[16][16], 128);
                for (int m = 0; m < 32; m++) /* C's rows times D's */
                    sum = add_row_products(sum, _mm512_loadu_ps(C[m]), _mm512_loadu_ps(C[m] + 16),
                                           D + (r + m) * in + jb * 32);
            }
            float lanes[16];
            _mm512_storeu_ps(lanes, sum);
            for (int l = 0; l < 16; l++)
                total += lanes[l];
        }
    }
    release_tiles();
    return total;
}

/* ptq_gram_quadratic on a CPU with AVX512-BF16 and no AMX, from the same GV: 8 rows of D
   at a time, each 32 x 32 block of D·G' summed in float32 lanes by VDPBF16PS (D's pairs
   broadcast against GV's B tiles), times D's block. Column blocks go in panels whose GV
   stays in the L2 cache (about 1 MiB) while every row passes; the products are summed in
   float32 lanes per panel and 32 rows, then in float64, in a fixed order. */
__attribute__((target("avx512f,avx512bf16"))) double ptq_gram_quadratic_avx512(const uint16_t *D, int64_t rows,
                                                                               int64_t in, const uint16_t *GV) {
    const int64_t blocks = in / 32;
    double total = 0;
    for (int64_t j0 = 0, j1; j0 < blocks; j0 = j1) {
        j1 = panel_end(j0, blocks);
        for (int64_t r0 = 0; r0 < rows; r0 += 32) {
            __m512 sum = _mm512_setzero_ps();
            for (int64_t r = r0; r < r0 + 32; r += GRAM_ROWS)
                for (int64_t jb = j0; jb < j1; jb++) {
                    __m512 acc[GRAM_ROWS][2];
                    for (int m = 0; m < GRAM_ROWS; m++)
                        acc[m][0] = acc[m][1] = _mm512_setzero_ps();
                    const uint16_t *g = GV + jb * blocks * 2 * TILE;
                    for (int64_t kb = 0; kb <= jb; kb++)
                        for (int64_t p = 0; p < 16; p++) {
                            const __m512bh v0 =
                                (__m512bh)_mm512_loadu_si512((const void *)(g + kb * 2 * TILE + p * 32));
                            const __m512bh v1 =
                                (__m512bh)_mm512_loadu_si512((const void *)(g + kb * 2 * TILE + TILE + p * 32));
                            for (int m = 0; m < GRAM_ROWS; m++) {
                                const uint32_t pair = ((const uint32_t *)(D + (r + m) * in + kb * 32))[p];
                                const __m512bh x = (__m512bh)_mm512_set1_epi32((int)pair);
                                acc[m][0] = _mm512_dpbf16_ps(acc[m][0], x, v0);
                                acc[m][1] = _mm512_dpbf16_ps(acc[m][1], x, v1);
                            }
                        }
                    for (int m = 0; m < GRAM_ROWS; m++) /* the block's rows times D's */
                        sum = add_row_products(sum, acc[m][0], acc[m][1], D + (r + m) * in + jb * 32);
                }
            float lanes[16];
            _mm512_storeu_ps(lanes, sum);
            for (int l = 0; l < 16; l++)
                total += lanes[l];
        }
    }
    return total;
}

#else /* no AMX here (ptq_amx_available says so): ptq keeps its GEMMs */

int ptq_amx_available(void) { return 0; }

int ptq_avx512bf16_available(void) { return 0; }

void ptq_gram_avx512(const uint16_t *XV, int64_t Tp, int64_t stride, int64_t n, int64_t i0, int64_t i1, int64_t j0,
                     float *sum, int64_t ld, int fresh) {
    (void)XV, (void)Tp, (void)stride, (void)n, (void)i0, (void)i1, (void)j0, (void)sum, (void)ld, (void)fresh;
}

void ptq_gram_pack(const uint16_t *X, int64_t T, int64_t ld, int64_t Tp, int64_t stride, int64_t f0, int64_t f1,
                   uint16_t *XV, uint16_t *XT) {
    (void)X, (void)T, (void)ld, (void)Tp, (void)stride, (void)f0, (void)f1, (void)XV, (void)XT;
}

void ptq_gram_amx(const uint16_t *XV, const uint16_t *XT, int64_t Tp, int64_t stride, int64_t n, int64_t i0,
                  int64_t i1, int64_t j0, float *sum, int64_t ld, int fresh) {
    (void)XV, (void)XT, (void)Tp, (void)stride, (void)n, (void)i0, (void)i1, (void)j0, (void)sum, (void)ld, (void)fresh;
}

double ptq_gram_quadratic(const uint16_t *D, int64_t rows, int64_t in, const uint16_t *GV) {
    (void)D, (void)rows, (void)in, (void)GV;
    return 0;
}

double ptq_gram_quadratic_avx512(const uint16_t *D, int64_t rows, int64_t in, const uint16_t *GV) {
    (void)D, (void)rows, (void)in, (void)GV;
    return 0;
}

void ptq_gram_quadratic_pack(const float *G, int64_t n, int64_t ld, int64_t jb0, int64_t jb1, uint16_t *GV) {
    (void)G, (void)n, (void)ld, (void)jb0, (void)jb1, (void)GV;
}

#endif
