/* One pass over a chunk's values: are they all finite? (promptcache.contract.layout.values_finite)
 *
 * Plain C loaded with ctypes (no Python API: one build serves every interpreter), built by setup.py at install
 * when a C compiler is there; values_finite falls back to two numpy reductions otherwise, and
 * tests/test_load_path.py checks that both agree on every class of bit pattern. A value is NaN or Inf exactly
 * when its exponent bits are all ones; the loop below is a max reduction without the sign bit, which the
 * compiler vectorizes, and it stops at the first block of 4096 values that holds one. */
#include <stdint.h>

#define BLOCK 4096

/* Compiled for several instruction sets and picked at load time by the CPU (GCC's target_clones, x86-64 with
 * glibc): SSE2 alone moves 16 bytes a step, slower than numpy's AVX-512 reductions. */
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__) && defined(__linux__)
#define CLONES __attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default")))
#else
#define CLONES
#endif

/* kind: 0 float32, 1 float16, 2 bfloat16. n: values. 1 when all are finite, 0 when one is not, -1 bad kind. */
CLONES int pc_all_finite(const void *data, int64_t n, int kind)
{
    /* Without the sign bit, a value is NaN or Inf exactly when its bits are >= the exponent's all-ones pattern:
     * one max reduction per block. */
    if (kind == 0) {
        const uint32_t *x = (const uint32_t *)data;
        for (int64_t at = 0; at < n; at += BLOCK) {
            const int64_t end = n - at < BLOCK ? n : at + BLOCK;
            uint32_t top = 0;
            for (int64_t i = at; i < end; i++) {
                const uint32_t v = x[i] & 0x7FFFFFFFu;
                top = v > top ? v : top;
            }
            if (top >= 0x7F800000u)
                return 0;
        }
        return 1;
    }
    if (kind == 1 || kind == 2) {
        const uint16_t limit = kind == 1 ? 0x7C00 : 0x7F80;
        const uint16_t *x = (const uint16_t *)data;
        for (int64_t at = 0; at < n; at += BLOCK) {
            const int64_t end = n - at < BLOCK ? n : at + BLOCK;
            uint16_t top = 0;
            for (int64_t i = at; i < end; i++) {
                const uint16_t v = x[i] & 0x7FFF;
                top = v > top ? v : top;
            }
            if (top >= limit)
                return 0;
        }
        return 1;
    }
    return -1;
}

/* A Put's chunk bytes, copied from where they arrived (a small receive buffer, a data frame, a client's memfd)
 * into the chunk's own memory and scanned on the way (promptcache.contract.layout.copy_finite): one read of the
 * source while it is in the CPU's cache, instead of a copy into the chunk and then a second pass that reads it back
 * from memory. The chunk's memory is long-lived and mostly written far from where it was last touched (memory of an
 * evicted chunk), so the copy uses streaming stores: no read of each destination line before it is written, and no
 * cache filled with bytes nobody reads soon. kind: 0-2 as pc_all_finite, 3 copy only (opaque bytes). nbytes must be
 * whole values of `kind`. Returns as pc_all_finite (-1 also for a partial value). */
#include <string.h>
#if defined(__SSE2__)
#include <emmintrin.h>
#endif

#define COPY_BLOCK 4096 /* scanned, then copied, while in the first-level cache */

static void copy_streaming(unsigned char *d, const unsigned char *s, int64_t n)
{
#if defined(__SSE2__)
    int64_t head = (int64_t)((16 - ((uintptr_t)d & 15)) & 15);
    if (head > n)
        head = n;
    memcpy(d, s, (size_t)head);
    d += head, s += head, n -= head;
    for (; n >= 64; n -= 64, d += 64, s += 64) {
        const __m128i a = _mm_loadu_si128((const __m128i *)s), b = _mm_loadu_si128((const __m128i *)(s + 16));
        const __m128i c = _mm_loadu_si128((const __m128i *)(s + 32)), e = _mm_loadu_si128((const __m128i *)(s + 48));
        _mm_stream_si128((__m128i *)d, a);
        _mm_stream_si128((__m128i *)(d + 16), b);
        _mm_stream_si128((__m128i *)(d + 32), c);
        _mm_stream_si128((__m128i *)(d + 48), e);
    }
#endif
    memcpy(d, s, (size_t)n);
}

int pc_copy_finite(void *dst, const void *src, int64_t nbytes, int kind)
{
    static const int itemsize[4] = {4, 2, 2, 1};
    if (kind < 0 || kind > 3 || nbytes < 0 || nbytes % itemsize[kind])
        return -1;
    unsigned char *d = (unsigned char *)dst;
    const unsigned char *s = (const unsigned char *)src;
    int finite = 1;
    for (int64_t at = 0; at < nbytes; at += COPY_BLOCK) {
        const int64_t len = nbytes - at < COPY_BLOCK ? nbytes - at : COPY_BLOCK;
        if (kind != 3 && finite)
            finite = pc_all_finite(s + at, len / itemsize[kind], kind);
        copy_streaming(d + at, s + at, len);
    }
#if defined(__SSE2__)
    _mm_sfence(); /* the streaming stores are visible before the chunk is committed (another thread may read it) */
#endif
    return finite;
}
