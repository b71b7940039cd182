/* The connector's load-path write into vLLM's CPU block layouts, one blocked pass at memory speed.
 *
 * A plain C library (no Python API, so one build serves every interpreter: the project's virtualenv and vLLM's),
 * built by setup.py at install when a C compiler is there and loaded with ctypes by vllm_layout.py, which falls
 * back to its pure torch/numpy copy otherwise; tests/test_vllm_layout.py checks that both write the same bits.
 *
 * pc_write_chunk copies `count` blocks of one canonical chunk [L, 2, H, C, D] (contiguous; values of `esize`
 * bytes, moved as bits) into block_ids[k] of every layer's cache [blocks, H, 2*N*D] (contiguous): per (block,
 * head) the block's K then its V, each N x D values, as the layout wants them (vllm_layout.py's docstring):
 *   0 cpu_vec      K transposed [D][N], V [N][D]
 *   1 cpu_amx      16-bit values in VNNI pairs: K [N/16][D/2][16][2], V [D/16][N/2][16][2]
 *   2 token_major  K and V [N][D]
 * Transposes go through register tiles: 4x4 (32-bit) and 8x8 (16-bit) in each 128-bit lane, SSE2 (x86-64's
 * baseline; scalar elsewhere), or with AVX2 / AVX-512 (picked at load time by the CPU, pc_layout_isa) the same
 * shuffles on 2 or 4 lanes at once, each lane a different group of source rows: one register then holds 32 or
 * 64 consecutive bytes of a destination row, so with AVX-512 every destination cache line is written whole by
 * one store. Large loads use streaming stores. Only integer moves and shuffles: the bits move unchanged.
 */
#include <stdint.h>
#include <string.h>
#if defined(__SSE2__)
#include <emmintrin.h>
#include <xmmintrin.h>
#endif
/* AVX2 and AVX-512 kernels compiled with per-function target attributes (the file's own flags stay x86-64's
 * baseline) and called only where the CPU (and OS) has them. */
#if defined(__x86_64__) && defined(__GNUC__) && defined(__SSE2__)
#include <immintrin.h>
#define PC_WIDE 1
#define TARGET_AVX2 __attribute__((target("avx2")))
#define TARGET_AVX512 __attribute__((target("avx512f,avx512bw")))
#endif

#if defined(__SSE2__)
/* 16 bytes to p: a streaming (non-temporal) store when nt, else a plain one. A large load streams: its blocks are
 * written whole and read later by the attention kernel, so caching them on the way only costs a read of each
 * destination line first (what keeps a plain-store copy at ~0.6x memcpy, which streams above a few MB). */
static inline void put128(void *p, __m128i x, int nt)
{
    if (nt)
        _mm_stream_si128((__m128i *)p, x);
    else
        _mm_storeu_si128((__m128i *)p, x);
}
#endif

/* dst[c * ds + r] = src[r * ss + c] for r < rows, c < cols (32-bit values). Destination rows in the outer loop,
 * 4 source rows at a time through a 4x4 register transpose: the writes run along 4 destination rows in order, so
 * lines are filled one after another. nt: streaming stores (dst and ds 16-byte aligned). */
static void transpose32_sse2(uint32_t *dst, const uint32_t *src, int64_t rows, int64_t cols, int64_t ss, int64_t ds,
                             int nt)
{
    int64_t c = 0;
#if defined(__SSE2__)
    const int64_t rows4 = rows - rows % 4;
    for (; c + 4 <= cols; c += 4) {
        for (int64_t r = 0; r < rows4; r += 4) {
            const uint32_t *s0 = src + r * ss + c;
            __m128 a = _mm_loadu_ps((const float *)s0);
            __m128 b = _mm_loadu_ps((const float *)(s0 + ss));
            __m128 e = _mm_loadu_ps((const float *)(s0 + 2 * ss));
            __m128 f = _mm_loadu_ps((const float *)(s0 + 3 * ss));
            _MM_TRANSPOSE4_PS(a, b, e, f); /* shuffles: the bits move unchanged, NaN payloads included */
            uint32_t *d0 = dst + c * ds + r;
            put128(d0, _mm_castps_si128(a), nt);
            put128(d0 + ds, _mm_castps_si128(b), nt);
            put128(d0 + 2 * ds, _mm_castps_si128(e), nt);
            put128(d0 + 3 * ds, _mm_castps_si128(f), nt);
        }
        for (int64_t r = rows4; r < rows; r++)
            for (int64_t i = 0; i < 4; i++)
                dst[(c + i) * ds + r] = src[r * ss + c + i];
    }
#endif
    for (; c < cols; c++)
        for (int64_t r = 0; r < rows; r++)
            dst[c * ds + r] = src[r * ss + c];
}

/* The same for 16-bit values: 8 destination rows at a time, through 8x8 register transposes. */
static void transpose16_sse2(uint16_t *dst, const uint16_t *src, int64_t rows, int64_t cols, int64_t ss, int64_t ds,
                             int nt)
{
    int64_t c = 0;
#if defined(__SSE2__)
    const int64_t rows8 = rows - rows % 8;
    for (; c + 8 <= cols; c += 8) {
        for (int64_t r = 0; r < rows8; r += 8) {
            __m128i a[8], b[8], e[8];
            for (int i = 0; i < 8; i++)
                a[i] = _mm_loadu_si128((const __m128i *)(src + (r + i) * ss + c));
            for (int i = 0; i < 4; i++) {
                b[2 * i] = _mm_unpacklo_epi16(a[2 * i], a[2 * i + 1]);
                b[2 * i + 1] = _mm_unpackhi_epi16(a[2 * i], a[2 * i + 1]);
            }
            e[0] = _mm_unpacklo_epi32(b[0], b[2]);
            e[1] = _mm_unpackhi_epi32(b[0], b[2]);
            e[2] = _mm_unpacklo_epi32(b[1], b[3]);
            e[3] = _mm_unpackhi_epi32(b[1], b[3]);
            e[4] = _mm_unpacklo_epi32(b[4], b[6]);
            e[5] = _mm_unpackhi_epi32(b[4], b[6]);
            e[6] = _mm_unpacklo_epi32(b[5], b[7]);
            e[7] = _mm_unpackhi_epi32(b[5], b[7]);
            uint16_t *d0 = dst + c * ds + r;
            for (int i = 0; i < 4; i++) {
                put128(d0 + (2 * i) * ds, _mm_unpacklo_epi64(e[i], e[i + 4]), nt);
                put128(d0 + (2 * i + 1) * ds, _mm_unpackhi_epi64(e[i], e[i + 4]), nt);
            }
        }
        for (int64_t r = rows8; r < rows; r++)
            for (int64_t i = 0; i < 8; i++)
                dst[(c + i) * ds + r] = src[r * ss + c + i];
    }
#endif
    for (; c < cols; c++)
        for (int64_t r = 0; r < rows; r++)
            dst[c * ds + r] = src[r * ss + c];
}

/* cpu_amx V: dst [D/16][N/2][16][2] from src [N][D]: token pairs (2i, 2i+1) interleaved per 16 dims. */
static void vnni_pairs16_sse2(uint16_t *dst, const uint16_t *src, int64_t N, int64_t D, int nt)
{
    for (int64_t g = 0; g < D / 16; g++) {
        for (int64_t i = 0; i < N / 2; i++) {
            const uint16_t *even = src + (2 * i) * D + g * 16, *odd = even + D;
            uint16_t *out = dst + (g * (N / 2) + i) * 32;
#if defined(__SSE2__)
            __m128i e0 = _mm_loadu_si128((const __m128i *)even), e1 = _mm_loadu_si128((const __m128i *)(even + 8));
            __m128i o0 = _mm_loadu_si128((const __m128i *)odd), o1 = _mm_loadu_si128((const __m128i *)(odd + 8));
            put128(out + 0, _mm_unpacklo_epi16(e0, o0), nt);
            put128(out + 8, _mm_unpackhi_epi16(e0, o0), nt);
            put128(out + 16, _mm_unpacklo_epi16(e1, o1), nt);
            put128(out + 24, _mm_unpackhi_epi16(e1, o1), nt);
#else
            (void)nt;
            for (int64_t j = 0; j < 16; j++) {
                out[2 * j] = even[j];
                out[2 * j + 1] = odd[j];
            }
#endif
        }
    }
}

/* The instruction set the transposes use: 0 SSE2 (or scalar), 1 AVX2, 2 AVX-512 (F and BW). */
static int isa = -1;

static int isa_detected(void)
{
#if defined(PC_WIDE)
    __builtin_cpu_init();
    if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw"))
        return 2;
    if (__builtin_cpu_supports("avx2"))
        return 1;
#endif
    return 0;
}

/* want < 0: the level in use (the best this CPU has unless set). want >= 0: use at most that level (tests run each
 * kernel this way). Returns the level in use. */
int pc_layout_isa(int want)
{
    static int best = -1;
    if (best < 0)
        best = isa_detected();
    if (want >= 0)
        isa = want < best ? want : best;
    else if (isa < 0)
        isa = best;
    return isa;
}

#if defined(PC_WIDE)
TARGET_AVX2 static inline void put256(void *p, __m256i x, int nt)
{
    if (nt)
        _mm256_stream_si256((__m256i *)p, x);
    else
        _mm256_storeu_si256((__m256i *)p, x);
}

TARGET_AVX512 static inline void put512(void *p, __m512i x, int nt)
{
    if (nt)
        _mm512_stream_si512((__m512i *)p, x);
    else
        _mm512_storeu_si512((__m512i *)p, x);
}

/* The next strip of source rows (`lines` cache lines at p), fetched while this strip's tiles are done, `per` lines
 * by tile t; after the last strip, the rows that follow (pc_write_chunk transposes the next block's next: they are
 * its first; a prefetch never faults, and p is an integer: no pointer past an array is formed). The transposes
 * read each source line in 16-byte pieces spread over a strip, which the hardware prefetchers do not follow:
 * without this the 16-bit AVX-512 transpose ran at ~0.45x memcpy, and at ~0.6x prefetching within a block only. */
static inline void prefetch_share(uintptr_t p, int64_t lines, int64_t t, int64_t per)
{
    for (int64_t q = t * per, end = q + per < lines ? q + per : lines; q < end; q++)
        _mm_prefetch((const char *)(p + q * 64), _MM_HINT_T0);
}

/* The lines of a strip of `rows` source rows of `ss` values of `esize` bytes, and how many each of `tiles` tiles
 * prefetches. */
#define STRIP_LINES(rows, ss, esize, tiles) \
    const int64_t lines = ((rows) * (ss) * (esize) + 63) / 64, per = (lines + (tiles) - 1) / (tiles)

/* 16 bytes of each of 2 rows, `step` rows apart, as the 2 lanes of a register. */
TARGET_AVX2 static inline __m256i load2x128(const void *p, int64_t step)
{
    const __m128i *q = (const __m128i *)p;
    return _mm256_inserti128_si256(_mm256_castsi128_si256(_mm_loadu_si128(q)),
                                   _mm_loadu_si128((const __m128i *)((const char *)p + step)), 1);
}

/* 16 bytes of each of 4 rows, `step` bytes apart, as the 4 lanes of a register. */
TARGET_AVX512 static inline __m512i load4x128(const void *p, int64_t step)
{
    const char *c = (const char *)p;
    __m512i v = _mm512_castsi128_si512(_mm_loadu_si128((const __m128i *)c));
    v = _mm512_inserti32x4(v, _mm_loadu_si128((const __m128i *)(c + step)), 1);
    v = _mm512_inserti32x4(v, _mm_loadu_si128((const __m128i *)(c + 2 * step)), 2);
    return _mm512_inserti32x4(v, _mm_loadu_si128((const __m128i *)(c + 3 * step)), 3);
}

/* transpose32 on rows % 8 == 0, cols % 4 == 0: tiles of 8 source rows x 4 columns; lane k of register i holds
 * row r + 4k + i, so after a 4x4 transpose per lane register j holds rows r..r+7 of column c + j (32 bytes). Two
 * tiles (16 rows) back to back where they fit, so each destination line's halves are stored one after the other
 * (a line's halves stored far apart ran at half the speed with streaming stores). */
TARGET_AVX2 static void transpose32_avx2(uint32_t *dst, const uint32_t *src, int64_t rows, int64_t cols,
                                         int64_t ss, int64_t ds, int nt)
{
    STRIP_LINES(16, ss, 4, cols / 4);
    for (int64_t r0 = 0; r0 < rows; r0 += 16)
        for (int64_t c = 0; c < cols; c += 4)
            for (int64_t r = r0; r < r0 + 16 && r < rows; r += 8) {
                if (r == r0)
                    prefetch_share((uintptr_t)src + (r0 + 16) * ss * sizeof *src, lines, c / 4, per);
                const uint32_t *s0 = src + r * ss + c;
                const int64_t step = 4 * ss * 4;
                __m256i a = load2x128(s0, step), b = load2x128(s0 + ss, step);
                __m256i e = load2x128(s0 + 2 * ss, step), f = load2x128(s0 + 3 * ss, step);
                __m256i t0 = _mm256_unpacklo_epi32(a, b), t1 = _mm256_unpackhi_epi32(a, b);
                __m256i t2 = _mm256_unpacklo_epi32(e, f), t3 = _mm256_unpackhi_epi32(e, f);
                uint32_t *d0 = dst + c * ds + r;
                put256(d0, _mm256_unpacklo_epi64(t0, t2), nt);
                put256(d0 + ds, _mm256_unpackhi_epi64(t0, t2), nt);
                put256(d0 + 2 * ds, _mm256_unpacklo_epi64(t1, t3), nt);
                put256(d0 + 3 * ds, _mm256_unpackhi_epi64(t1, t3), nt);
            }
}

/* The same on rows % 16 == 0 with 4 lanes: each store is 64 bytes, a whole line of a destination row. */
TARGET_AVX512 static void transpose32_avx512(uint32_t *dst, const uint32_t *src, int64_t rows, int64_t cols,
                                             int64_t ss, int64_t ds, int nt)
{
    STRIP_LINES(16, ss, 4, cols / 4);
    for (int64_t r = 0; r < rows; r += 16)
        for (int64_t c = 0; c < cols; c += 4) {
            prefetch_share((uintptr_t)src + (r + 16) * ss * sizeof *src, lines, c / 4, per);
            const uint32_t *s0 = src + r * ss + c;
            const int64_t step = 4 * ss * 4;
            __m512i a = load4x128(s0, step), b = load4x128(s0 + ss, step);
            __m512i e = load4x128(s0 + 2 * ss, step), f = load4x128(s0 + 3 * ss, step);
            __m512i t0 = _mm512_unpacklo_epi32(a, b), t1 = _mm512_unpackhi_epi32(a, b);
            __m512i t2 = _mm512_unpacklo_epi32(e, f), t3 = _mm512_unpackhi_epi32(e, f);
            uint32_t *d0 = dst + c * ds + r;
            put512(d0, _mm512_unpacklo_epi64(t0, t2), nt);
            put512(d0 + ds, _mm512_unpackhi_epi64(t0, t2), nt);
            put512(d0 + 2 * ds, _mm512_unpacklo_epi64(t1, t3), nt);
            put512(d0 + 3 * ds, _mm512_unpackhi_epi64(t1, t3), nt);
        }
}

/* 8x8 16-bit transposes in each lane of x[0..7] (lane k of x[i]: 8 values of one source row), the SSE2 kernel's
 * shuffles; out[j] lane k: value j of the 8 rows of lane k. */
#define TRANSPOSE8x16_LANES(T, unpacklo16, unpackhi16, unpacklo32, unpackhi32, unpacklo64, unpackhi64, x, out) \
    do {                                                                                                       \
        T b_[8], e_[8];                                                                                        \
        for (int i_ = 0; i_ < 4; i_++) {                                                                       \
            b_[2 * i_] = unpacklo16(x[2 * i_], x[2 * i_ + 1]);                                                 \
            b_[2 * i_ + 1] = unpackhi16(x[2 * i_], x[2 * i_ + 1]);                                             \
        }                                                                                                      \
        e_[0] = unpacklo32(b_[0], b_[2]);                                                                      \
        e_[1] = unpackhi32(b_[0], b_[2]);                                                                      \
        e_[2] = unpacklo32(b_[1], b_[3]);                                                                      \
        e_[3] = unpackhi32(b_[1], b_[3]);                                                                      \
        e_[4] = unpacklo32(b_[4], b_[6]);                                                                      \
        e_[5] = unpackhi32(b_[4], b_[6]);                                                                      \
        e_[6] = unpacklo32(b_[5], b_[7]);                                                                      \
        e_[7] = unpackhi32(b_[5], b_[7]);                                                                      \
        for (int i_ = 0; i_ < 4; i_++) {                                                                       \
            out[2 * i_] = unpacklo64(e_[i_], e_[i_ + 4]);                                                      \
            out[2 * i_ + 1] = unpackhi64(e_[i_], e_[i_ + 4]);                                                  \
        }                                                                                                      \
    } while (0)

/* transpose16 on rows % 16 == 0, cols % 8 == 0: tiles of 16 source rows x 8 columns, lane k of register i holds
 * row r + 8k + i; two tiles (32 rows) back to back where they fit, so each destination line's halves are stored
 * one after the other. */
TARGET_AVX2 static void transpose16_avx2(uint16_t *dst, const uint16_t *src, int64_t rows, int64_t cols,
                                         int64_t ss, int64_t ds, int nt)
{
    STRIP_LINES(32, ss, 2, cols / 8);
    for (int64_t r0 = 0; r0 < rows; r0 += 32)
        for (int64_t c = 0; c < cols; c += 8)
            for (int64_t r = r0; r < r0 + 32 && r < rows; r += 16) {
                if (r == r0)
                    prefetch_share((uintptr_t)src + (r0 + 32) * ss * sizeof *src, lines, c / 8, per);
                __m256i x[8], out[8];
                for (int i = 0; i < 8; i++)
                    x[i] = load2x128(src + (r + i) * ss + c, 8 * ss * 2);
                TRANSPOSE8x16_LANES(__m256i, _mm256_unpacklo_epi16, _mm256_unpackhi_epi16, _mm256_unpacklo_epi32,
                                    _mm256_unpackhi_epi32, _mm256_unpacklo_epi64, _mm256_unpackhi_epi64, x, out);
                uint16_t *d0 = dst + c * ds + r;
                for (int j = 0; j < 8; j++)
                    put256(d0 + j * ds, out[j], nt);
            }
}

/* The same on rows % 32 == 0 with 4 lanes: 32 source rows x 8 columns, each store a whole 64-byte line. */
TARGET_AVX512 static void transpose16_avx512(uint16_t *dst, const uint16_t *src, int64_t rows, int64_t cols,
                                             int64_t ss, int64_t ds, int nt)
{
    STRIP_LINES(32, ss, 2, cols / 8);
    for (int64_t r = 0; r < rows; r += 32)
        for (int64_t c = 0; c < cols; c += 8) {
            prefetch_share((uintptr_t)src + (r + 32) * ss * sizeof *src, lines, c / 8, per);
            __m512i x[8], out[8];
            for (int i = 0; i < 8; i++)
                x[i] = load4x128(src + (r + i) * ss + c, 8 * ss * 2);
            TRANSPOSE8x16_LANES(__m512i, _mm512_unpacklo_epi16, _mm512_unpackhi_epi16, _mm512_unpacklo_epi32,
                                _mm512_unpackhi_epi32, _mm512_unpacklo_epi64, _mm512_unpackhi_epi64, x, out);
            uint16_t *d0 = dst + c * ds + r;
            for (int j = 0; j < 8; j++)
                put512(d0 + j * ds, out[j], nt);
        }
}

/* cpu_amx V (vnni_pairs16) with AVX-512: each output line (16 dims of a token pair) is one permute of the pair's
 * 32-byte runs and one 64-byte store; the token pairs in the outer loop, so the source is read in order. */
TARGET_AVX512 static void vnni_pairs16_avx512(uint16_t *dst, const uint16_t *src, int64_t N, int64_t D, int nt)
{
    static const uint16_t order[32] = {0, 32, 1, 33, 2, 34, 3, 35, 4, 36, 5, 37, 6, 38, 7, 39,
                                       8, 40, 9, 41, 10, 42, 11, 43, 12, 44, 13, 45, 14, 46, 15, 47};
    const __m512i idx = _mm512_loadu_si512((const void *)order); /* value j of the even token, then of the odd */
    for (int64_t i = 0; i < N / 2; i++)
        for (int64_t g = 0; g < D / 16; g++) {
            const uint16_t *even = src + (2 * i) * D + g * 16;
            __m512i e = _mm512_castsi256_si512(_mm256_loadu_si256((const __m256i *)even));
            __m512i o = _mm512_castsi256_si512(_mm256_loadu_si256((const __m256i *)(even + D)));
            put512(dst + (g * (N / 2) + i) * 32, _mm512_permutex2var_epi16(e, idx, o), nt);
        }
}
#endif

/* dst[c * ds + r] = src[r * ss + c] for r < rows, c < cols (32-bit values), with the widest kernel the CPU has
 * for the whole tiles and the next narrower one for what is left. nt: streaming stores, where the kernel's store
 * addresses allow (the caller checks the 16-byte alignment SSE2 needs: dst, and ds * 4 bytes). */
static void transpose32_at(int level, uint32_t *dst, const uint32_t *src, int64_t rows, int64_t cols, int64_t ss,
                           int64_t ds, int nt)
{
    int64_t rw, cw;
#if defined(PC_WIDE)
    const uintptr_t at = (uintptr_t)dst | (uintptr_t)(ds * 4);
    if (level >= 2 && rows >= 16 && cols >= 4) {
        rw = rows - rows % 16, cw = cols - cols % 4;
        transpose32_avx512(dst, src, rw, cw, ss, ds, nt && !(at & 63));
    } else if (level >= 1 && rows >= 8 && cols >= 4) {
        rw = rows - rows % 8, cw = cols - cols % 4;
        transpose32_avx2(dst, src, rw, cw, ss, ds, nt && !(at & 31));
    } else
#endif
    {
        (void)level;
        transpose32_sse2(dst, src, rows, cols, ss, ds, nt);
        return;
    }
    if (cols > cw)
        transpose32_at(level - 1, dst + cw * ds, src + cw, rows, cols - cw, ss, ds, nt);
    if (rows > rw)
        transpose32_at(level - 1, dst + rw, src + rw * ss, rows - rw, cw, ss, ds, nt);
}

/* The same for 16-bit values. */
static void transpose16_at(int level, uint16_t *dst, const uint16_t *src, int64_t rows, int64_t cols, int64_t ss,
                           int64_t ds, int nt)
{
    int64_t rw, cw;
#if defined(PC_WIDE)
    const uintptr_t at = (uintptr_t)dst | (uintptr_t)(ds * 2);
    if (level >= 2 && rows >= 32 && cols >= 8) {
        rw = rows - rows % 32, cw = cols - cols % 8;
        transpose16_avx512(dst, src, rw, cw, ss, ds, nt && !(at & 63));
    } else if (level >= 1 && rows >= 16 && cols >= 8) {
        rw = rows - rows % 16, cw = cols - cols % 8;
        transpose16_avx2(dst, src, rw, cw, ss, ds, nt && !(at & 31));
    } else
#endif
    {
        (void)level;
        transpose16_sse2(dst, src, rows, cols, ss, ds, nt);
        return;
    }
    if (cols > cw)
        transpose16_at(level - 1, dst + cw * ds, src + cw, rows, cols - cw, ss, ds, nt);
    if (rows > rw)
        transpose16_at(level - 1, dst + rw, src + rw * ss, rows - rw, cw, ss, ds, nt);
}

static void vnni_pairs16(int level, uint16_t *dst, const uint16_t *src, int64_t N, int64_t D, int nt)
{
#if defined(PC_WIDE)
    if (level >= 2) {
        vnni_pairs16_avx512(dst, src, N, D, nt && !((uintptr_t)dst & 63));
        return;
    }
#endif
    (void)level;
    vnni_pairs16_sse2(dst, src, N, D, nt);
}

/* n bytes (a multiple of 64 when nt) from src to dst. */
static void copy(char *dst, const char *src, int64_t n, int nt)
{
#if defined(__SSE2__)
    if (nt) {
        for (int64_t o = 0; o < n; o += 64) {
            __m128i x0 = _mm_loadu_si128((const __m128i *)(src + o));
            __m128i x1 = _mm_loadu_si128((const __m128i *)(src + o + 16));
            __m128i x2 = _mm_loadu_si128((const __m128i *)(src + o + 32));
            __m128i x3 = _mm_loadu_si128((const __m128i *)(src + o + 48));
            _mm_stream_si128((__m128i *)(dst + o), x0);
            _mm_stream_si128((__m128i *)(dst + o + 16), x1);
            _mm_stream_si128((__m128i *)(dst + o + 32), x2);
            _mm_stream_si128((__m128i *)(dst + o + 48), x3);
        }
        return;
    }
#endif
    (void)nt;
    memcpy(dst, src, n);
}

/* 0 when written; -1 when this layout, value size and shape are not handled here (the caller copies itself).
 * stream: write with streaming stores where the addresses allow (the caller asks for it on large loads). */
int pc_write_chunk(int layout, int esize, int64_t L, int64_t H, int64_t N, int64_t D, int64_t C,
                   const void *chunk, int64_t first_block, int64_t count, void *const *caches,
                   const int64_t *block_ids, int stream)
{
    if ((esize != 2 && esize != 4) || layout < 0 || layout > 2 || N <= 0 || D <= 0 || C % N)
        return -1;
    if (layout == 1 && (esize != 2 || N % 16 || D % 32))
        return -1;
    const int64_t nd = N * D, bytes = nd * esize;
    const int level = pc_layout_isa(-1);
    int any_nt = 0;
    /* Per layer and head, the K of every block, then the V: consecutive blocks of a chunk are consecutive source
     * rows, so each transpose's prefetch of the strip after its last one fetches the next block's first rows. */
    for (int64_t l = 0; l < L; l++) {
        const char *layer = (const char *)chunk + l * 2 * H * C * D * esize;
        for (int64_t h = 0; h < H; h++) {
            for (int part = 0; part < 2; part++) {
                for (int64_t k = 0; k < count; k++) {
                    const char *s = layer + ((part * H + h) * C + (first_block + k) * N) * D * esize;
                    char *d = (char *)caches[l] + (block_ids[k] * H * 2 + h * 2 + part) * bytes;
                    /* streaming stores need 16-byte aligned addresses: the region 64-byte aligned, rows of whole
                     * 16 bytes (the kernels check what their wider stores need) */
                    const int nt = stream && !((uintptr_t)d & 63) && bytes % 64 == 0 && (N * esize) % 16 == 0;
                    any_nt |= nt;
                    if (layout == 2 || (layout == 0 && part == 1))
                        copy(d, s, bytes, nt);
                    else if (layout == 0 && esize == 4)
                        transpose32_at(level, (uint32_t *)d, (const uint32_t *)s, N, D, D, N, nt);
                    else if (layout == 0)
                        transpose16_at(level, (uint16_t *)d, (const uint16_t *)s, N, D, D, N, nt);
                    else if (part == 0)
                        /* cpu_amx K: dims 2j, 2j+1 side by side already; as 32-bit units a [16][D/2] -> [D/2][16]
                         * transpose per 16 tokens (consecutive source rows: each prefetches the next's) */
                        for (int64_t g = 0; g < N / 16; g++)
                            transpose32_at(level, (uint32_t *)d + g * 16 * (D / 2),
                                           (const uint32_t *)s + g * 16 * (D / 2), 16, D / 2, D / 2, 16, nt);
                    else
                        vnni_pairs16(level, (uint16_t *)d, (const uint16_t *)s, N, D, nt);
                }
            }
        }
    }
#if defined(__SSE2__)
    if (any_nt)
        _mm_sfence(); /* streamed stores are visible before the caller goes on */
#endif
    return 0;
}
