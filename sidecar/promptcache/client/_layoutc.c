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
 * Transposes go through 4x4 (32-bit) and 8x8 (16-bit) register tiles (SSE2, x86-64's baseline; scalar
 * elsewhere), grouped so that each destination cache line is written whole at once, with streaming stores
 * on large loads.
 */
#include <stdint.h>
#include <string.h>
#if defined(__SSE2__)
#include <emmintrin.h>
#include <xmmintrin.h>
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
static void transpose32(uint32_t *dst, const uint32_t *src, int64_t rows, int64_t cols, int64_t ss, int64_t ds, int nt)
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
static void transpose16(uint16_t *dst, const uint16_t *src, int64_t rows, int64_t cols, int64_t ss, int64_t ds, int nt)
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
static void vnni_pairs16(uint16_t *dst, const uint16_t *src, int64_t N, int64_t D, int nt)
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
    int any_nt = 0;
    for (int64_t l = 0; l < L; l++) {
        const char *layer = (const char *)chunk + l * 2 * H * C * D * esize;
        for (int64_t k = 0; k < count; k++) {
            char *block = (char *)caches[l] + block_ids[k] * H * 2 * bytes;
            const int64_t b = first_block + k;
            for (int64_t h = 0; h < H; h++) {
                const char *ks = layer + (h * C + b * N) * D * esize;
                const char *vs = layer + ((H + h) * C + b * N) * D * esize;
                char *kd = block + h * 2 * bytes, *vd = kd + bytes;
                /* streaming stores need 16-byte aligned addresses: both regions aligned, rows of whole 16 bytes */
                const int nt = stream && !(((uintptr_t)kd | (uintptr_t)vd) & 63) && bytes % 64 == 0
                               && (N * esize) % 16 == 0;
                any_nt |= nt;
                if (layout == 2) {
                    copy(kd, ks, bytes, nt);
                    copy(vd, vs, bytes, nt);
                } else if (layout == 0) {
                    if (esize == 4)
                        transpose32((uint32_t *)kd, (const uint32_t *)ks, N, D, D, N, nt);
                    else
                        transpose16((uint16_t *)kd, (const uint16_t *)ks, N, D, D, N, nt);
                    copy(vd, vs, bytes, nt);
                } else {
                    /* K: dims 2j, 2j+1 side by side already; as 32-bit units a [16][D/2] -> [D/2][16] transpose
                     * per 16 tokens. */
                    for (int64_t g = 0; g < N / 16; g++)
                        transpose32((uint32_t *)kd + g * 16 * (D / 2), (const uint32_t *)ks + g * 16 * (D / 2),
                                    16, D / 2, D / 2, 16, nt);
                    vnni_pairs16((uint16_t *)vd, (const uint16_t *)vs, N, D, nt);
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
