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
