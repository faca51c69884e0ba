/* GF(2^8) matrix-times-pages kernels for unbroken.erasure (the native CPU backend).
 *
 * One entry point computes, for r < rows and every byte position p < len:
 *
 *     dst[r][off + p]  (=  or  ^=)  XOR_c  coef[r][c] * (src[c][p] ^ src2[c][p])
 *
 * (src2 may be NULL). Three implementations, picked at run time by CPU features:
 *   - AVX-512 + GFNI: one GF2P8AFFINEQB per 64 bytes per coefficient; up to 16 parity rows stay
 *     in registers, so the data is read once for the default 16 parity pages (ISA-L splits 16
 *     rows into passes of at most 6 and reads the data three times).
 *   - AVX2: the split-nibble PSHUFB method, 4 rows per pass.
 *   - portable C: a 256 x 256 product table.
 * Hand-written because no library on PyPI offers this fused old^new update over scattered
 * pages, and numba/numpy cannot emit GFNI. Compiled by unbroken.erasure.native_backend with the
 * system C compiler; every SIMD function carries its own target attribute, so the file builds
 * without -march flags and runs on any x86-64 (the dispatcher never calls an unsupported path).
 */
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#define UB_X86 1
#else
#define UB_X86 0
#endif

#define UB_ISA_SCALAR 0
#define UB_ISA_AVX2 1
#define UB_ISA_GFNI512 2

#define UB_INLINE static inline __attribute__((always_inline))

int ub_best_isa(void) {
#if UB_X86
    __builtin_cpu_init();
    if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
        __builtin_cpu_supports("gfni"))
        return UB_ISA_GFNI512;
    if (__builtin_cpu_supports("avx2"))
        return UB_ISA_AVX2;
#endif
    return UB_ISA_SCALAR;
}

/* ---------------------------------------------------------------- portable C */

static void apply_scalar(int rows, int cols, const uint8_t *coef, const uint8_t *mul,
                         const uint8_t *const *src, const uint8_t *const *src2,
                         uint8_t *const *dst, size_t len, size_t off, int accumulate) {
    enum { BLOCK = 4096 };
    uint8_t delta[BLOCK];
    uint8_t acc[BLOCK];
    for (size_t pos = 0; pos < len; pos += BLOCK) {
        size_t n = len - pos < BLOCK ? len - pos : BLOCK;
        for (int r = 0; r < rows; r++) {
            if (accumulate)
                memcpy(acc, dst[r] + off + pos, n);
            else
                memset(acc, 0, n);
            for (int c = 0; c < cols; c++) {
                const uint8_t *row = mul + 256 * (size_t)coef[(size_t)r * cols + c];
                const uint8_t *s = src[c] + pos;
                if (src2) {
                    const uint8_t *s2 = src2[c] + pos;
                    for (size_t i = 0; i < n; i++)
                        delta[i] = s[i] ^ s2[i];
                    s = delta;
                }
                for (size_t i = 0; i < n; i++)
                    acc[i] ^= row[s[i]];
            }
            memcpy(dst[r] + off + pos, acc, n);
        }
    }
}

#if UB_X86
/* ---------------------------------------------------------------- AVX-512 + GFNI */

#ifndef UB_PREFETCH
#define UB_PREFETCH 512
#endif
#ifndef UB_STAGE_SLICE
#define UB_STAGE_SLICE 512
#endif
#ifndef UB_STAGE_AHEAD
#define UB_STAGE_AHEAD 4
#endif
#ifndef UB_STAGE_MIN_STREAMS
#define UB_STAGE_MIN_STREAMS 40 /* below this many source streams, prefetching alone keeps up */
#endif
#define GFNI_TARGET __attribute__((target("avx512f,avx512bw,gfni")))

/* aff holds the GF2P8AFFINEQB operand of each coefficient, column-major: aff[c * stride + r].
 * Two columns per step, folded with one VPTERNLOGQ (three-way XOR) per row. */
GFNI_TARGET UB_INLINE void gfni_rows(const int R, const int fused, const int prefetch, int cols,
                                     const uint64_t *aff, size_t stride,
                                     const uint8_t *const *src, const uint8_t *const *src2,
                                     size_t src_off, uint8_t *const *dst, size_t len, size_t off,
                                     int accumulate) {
    for (size_t pos = 0; pos < len; pos += 64) {
        const size_t left = len - pos;
        const __mmask64 mask = left >= 64 ? ~(__mmask64)0 : (((__mmask64)1 << left) - 1);
        const size_t at = src_off + pos;
        __m512i acc[16];
#pragma GCC unroll 16
        for (int r = 0; r < R; r++)
            acc[r] = accumulate ? _mm512_maskz_loadu_epi8(mask, dst[r] + off + pos)
                                : _mm512_setzero_si512();
        int c = 0;
        for (; c + 2 <= cols; c += 2) {
            if (prefetch) {
                _mm_prefetch((const char *)(src[c] + at + UB_PREFETCH), _MM_HINT_T0);
                _mm_prefetch((const char *)(src[c + 1] + at + UB_PREFETCH), _MM_HINT_T0);
            }
            __m512i x0 = _mm512_maskz_loadu_epi8(mask, src[c] + at);
            __m512i x1 = _mm512_maskz_loadu_epi8(mask, src[c + 1] + at);
            if (fused) {
                x0 = _mm512_xor_si512(x0, _mm512_maskz_loadu_epi8(mask, src2[c] + at));
                x1 = _mm512_xor_si512(x1, _mm512_maskz_loadu_epi8(mask, src2[c + 1] + at));
            }
            const uint64_t *a0 = aff + (size_t)c * stride;
            const uint64_t *a1 = a0 + stride;
#pragma GCC unroll 16
            for (int r = 0; r < R; r++)
                acc[r] = _mm512_ternarylogic_epi64(
                    acc[r], _mm512_gf2p8affine_epi64_epi8(x0, _mm512_set1_epi64((long long)a0[r]), 0),
                    _mm512_gf2p8affine_epi64_epi8(x1, _mm512_set1_epi64((long long)a1[r]), 0), 0x96);
        }
        if (c < cols) {
            __m512i x = _mm512_maskz_loadu_epi8(mask, src[c] + at);
            if (fused)
                x = _mm512_xor_si512(x, _mm512_maskz_loadu_epi8(mask, src2[c] + at));
            const uint64_t *a = aff + (size_t)c * stride;
#pragma GCC unroll 16
            for (int r = 0; r < R; r++)
                acc[r] = _mm512_xor_si512(
                    acc[r], _mm512_gf2p8affine_epi64_epi8(x, _mm512_set1_epi64((long long)a[r]), 0));
        }
#pragma GCC unroll 16
        for (int r = 0; r < R; r++)
            _mm512_mask_storeu_epi8(dst[r] + off + pos, mask, acc[r]);
    }
}

#define GFNI_CASE(R)                                                                         \
    case R:                                                                                  \
        if (src2)                                                                            \
            gfni_rows(R, 1, 1, cols, aff, stride, src, src2, 0, dst, len, off, accumulate);  \
        else if (staged)                                                                     \
            gfni_rows(R, 0, 0, cols, aff, stride, src, src2, src_off, dst, len, off,         \
                      accumulate);                                                           \
        else                                                                                 \
            gfni_rows(R, 0, 1, cols, aff, stride, src, src2, 0, dst, len, off, accumulate);  \
        break;

GFNI_TARGET static void gfni_block(int R, int cols, const uint64_t *aff, size_t stride,
                                   const uint8_t *const *src, const uint8_t *const *src2,
                                   int staged, size_t src_off, uint8_t *const *dst, size_t len,
                                   size_t off, int accumulate) {
    switch (R) {
        GFNI_CASE(1) GFNI_CASE(2) GFNI_CASE(3) GFNI_CASE(4) GFNI_CASE(5) GFNI_CASE(6)
        GFNI_CASE(7) GFNI_CASE(8) GFNI_CASE(9) GFNI_CASE(10) GFNI_CASE(11) GFNI_CASE(12)
        GFNI_CASE(13) GFNI_CASE(14) GFNI_CASE(15) GFNI_CASE(16)
    default:
        break;
    }
}

/* Copy (or XOR, for the fused update) one slice of every source into a padded staging area.
 * Pages are usually aligned to large powers of two, so the same offset of all sources falls in
 * one cache set: reading 240 of them line by line thrashes L1 and L2. Copying a run of each page
 * (sequential, prefetched a few pages ahead) into rows whose stride is not a power of two turns
 * the compute loop into L2 hits. */
GFNI_TARGET static void gfni_stage(int cols, const uint8_t *const *src, const uint8_t *const *src2,
                                   size_t pos, size_t n, uint8_t *stage, size_t pitch,
                                   uint8_t **rows) {
    for (int c = 0; c < cols; c++) {
        uint8_t *out = stage + (size_t)c * pitch;
        rows[c] = out;
        if (c + UB_STAGE_AHEAD < cols)
            for (size_t i = 0; i < n; i += 64) {
                _mm_prefetch((const char *)(src[c + UB_STAGE_AHEAD] + pos + i), _MM_HINT_T0);
                if (src2)
                    _mm_prefetch((const char *)(src2[c + UB_STAGE_AHEAD] + pos + i), _MM_HINT_T0);
            }
        for (size_t i = 0; i < n; i += 64) {
            const size_t left = n - i;
            const __mmask64 mask = left >= 64 ? ~(__mmask64)0 : (((__mmask64)1 << left) - 1);
            __m512i x = _mm512_maskz_loadu_epi8(mask, src[c] + pos + i);
            if (src2)
                x = _mm512_xor_si512(x, _mm512_maskz_loadu_epi8(mask, src2[c] + pos + i));
            _mm512_storeu_si512(out + i, x);
        }
    }
}

/* More than 16 rows (only when more than 16 pages are rebuilt at once) take several passes. */
static int apply_gfni(int rows, int cols, const uint64_t *aff, const uint8_t *const *src,
                      const uint8_t *const *src2, uint8_t *const *dst, size_t len, size_t off,
                      int accumulate) {
    const int streams = src2 ? 2 * cols : cols;
    if (streams < UB_STAGE_MIN_STREAMS || len < UB_STAGE_SLICE) {
        for (int r0 = 0; r0 < rows; r0 += 16) {
            int R = rows - r0 < 16 ? rows - r0 : 16;
            gfni_block(R, cols, aff + r0, (size_t)rows, src, src2, 0, 0, dst + r0, len, off,
                       accumulate);
        }
        return 0;
    }
    const size_t pitch = UB_STAGE_SLICE + 64;
    uint8_t *stage = aligned_alloc(64, (size_t)cols * pitch);
    uint8_t **staged = malloc((size_t)cols * sizeof(uint8_t *));
    if (!stage || !staged) {
        free(stage);
        free(staged);
        return -1;
    }
    for (size_t pos = 0; pos < len; pos += UB_STAGE_SLICE) {
        const size_t n = len - pos < UB_STAGE_SLICE ? len - pos : UB_STAGE_SLICE;
        gfni_stage(cols, src, src2, pos, n, stage, pitch, staged);
        for (int r0 = 0; r0 < rows; r0 += 16) {
            int R = rows - r0 < 16 ? rows - r0 : 16;
            gfni_block(R, cols, aff + r0, (size_t)rows, (const uint8_t *const *)staged, NULL, 1,
                       0, dst + r0, n, off + pos, accumulate);
        }
    }
    free(stage);
    free(staged);
    return 0;
}

/* ---------------------------------------------------------------- AVX2 split-nibble */

#define AVX2_TARGET __attribute__((target("avx2")))
#define AVX2_ROWS 4

/* tables: for each column c and row r of the block, 16 bytes of c*x for x < 16 and 16 bytes of
 * c*(x << 4): tables[(c * R + r) * 32]. */
AVX2_TARGET UB_INLINE void avx2_rows(const int R, const int fused, int cols, const uint8_t *tables,
                                     const uint8_t *const *src, const uint8_t *const *src2,
                                     uint8_t *const *dst, size_t len, size_t off, int accumulate) {
    const __m256i low = _mm256_set1_epi8(0x0f);
    size_t pos = 0;
    for (; pos + 32 <= len; pos += 32) {
        __m256i acc[AVX2_ROWS];
        for (int r = 0; r < R; r++)
            acc[r] = accumulate ? _mm256_loadu_si256((const __m256i *)(dst[r] + off + pos))
                                : _mm256_setzero_si256();
        for (int c = 0; c < cols; c++) {
            __m256i x = _mm256_loadu_si256((const __m256i *)(src[c] + pos));
            if (fused)
                x = _mm256_xor_si256(x, _mm256_loadu_si256((const __m256i *)(src2[c] + pos)));
            const __m256i lo = _mm256_and_si256(x, low);
            const __m256i hi = _mm256_and_si256(_mm256_srli_epi64(x, 4), low);
            const uint8_t *t = tables + (size_t)c * R * 32;
            for (int r = 0; r < R; r++) {
                const __m256i tl =
                    _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)(t + 32 * r)));
                const __m256i th = _mm256_broadcastsi128_si256(
                    _mm_loadu_si128((const __m128i *)(t + 32 * r + 16)));
                acc[r] = _mm256_xor_si256(
                    acc[r], _mm256_xor_si256(_mm256_shuffle_epi8(tl, lo), _mm256_shuffle_epi8(th, hi)));
            }
        }
        for (int r = 0; r < R; r++)
            _mm256_storeu_si256((__m256i *)(dst[r] + off + pos), acc[r]);
    }
    for (; pos < len; pos++) { /* tail bytes: the same tables, one byte at a time */
        for (int r = 0; r < R; r++) {
            uint8_t a = accumulate ? dst[r][off + pos] : 0;
            for (int c = 0; c < cols; c++) {
                uint8_t x = src[c][pos];
                if (fused)
                    x ^= src2[c][pos];
                const uint8_t *t = tables + ((size_t)c * R + r) * 32;
                a ^= t[x & 15] ^ t[16 + (x >> 4)];
            }
            dst[r][off + pos] = a;
        }
    }
}

#define AVX2_CASE(R, LABEL)                                                                  \
    LABEL:                                                                                   \
        if (src2)                                                                            \
            avx2_rows(R, 1, cols, tables, src, src2, dst, len, off, accumulate);             \
        else                                                                                 \
            avx2_rows(R, 0, cols, tables, src, src2, dst, len, off, accumulate);             \
        break;

AVX2_TARGET static void avx2_block(int R, int cols, const uint8_t *tables,
                                   const uint8_t *const *src, const uint8_t *const *src2,
                                   uint8_t *const *dst, size_t len, size_t off, int accumulate) {
    switch (R) {
        AVX2_CASE(1, case 1)
        AVX2_CASE(2, case 2)
        AVX2_CASE(3, case 3)
        AVX2_CASE(4, default)
    }
}

static int apply_avx2(int rows, int cols, const uint8_t *coef, const uint8_t *mul,
                      const uint8_t *const *src, const uint8_t *const *src2, uint8_t *const *dst,
                      size_t len, size_t off, int accumulate) {
    uint8_t *tables = malloc((size_t)cols * AVX2_ROWS * 32);
    if (!tables)
        return -1;
    for (int r0 = 0; r0 < rows; r0 += AVX2_ROWS) {
        int R = rows - r0 < AVX2_ROWS ? rows - r0 : AVX2_ROWS;
        for (int c = 0; c < cols; c++)
            for (int r = 0; r < R; r++) {
                const uint8_t *row = mul + 256 * (size_t)coef[(size_t)(r0 + r) * cols + c];
                uint8_t *t = tables + ((size_t)c * R + r) * 32;
                for (int x = 0; x < 16; x++) {
                    t[x] = row[x];
                    t[16 + x] = row[x << 4];
                }
            }
        avx2_block(R, cols, tables, src, src2, dst + r0, len, off, accumulate);
    }
    free(tables);
    return 0;
}
#endif /* UB_X86 */

/* coef: rows x cols, row-major. aff: the GF2P8AFFINEQB operands, cols x rows (column-major).
 * mul: the 256 x 256 product table. Returns 0, or -1 if the ISA is unavailable or out of
 * memory. */
int ub_gf_apply(int rows, int cols, const uint8_t *coef, const uint64_t *aff, const uint8_t *mul,
                const uint8_t *const *src, const uint8_t *const *src2, uint8_t *const *dst,
                size_t len, size_t off, int accumulate, int isa) {
    if (rows <= 0 || len == 0)
        return 0;
    if (cols == 0) {
        if (!accumulate)
            for (int r = 0; r < rows; r++)
                memset(dst[r] + off, 0, len);
        return 0;
    }
    if (isa > ub_best_isa())
        return -1;
#if UB_X86
    if (isa == UB_ISA_GFNI512)
        return apply_gfni(rows, cols, aff, src, src2, dst, len, off, accumulate);
    if (isa == UB_ISA_AVX2)
        return apply_avx2(rows, cols, coef, mul, src, src2, dst, len, off, accumulate);
#endif
    apply_scalar(rows, cols, coef, mul, src, src2, dst, len, off, accumulate);
    return 0;
}
