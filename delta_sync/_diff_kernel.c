/* Fused bitwise diff for host memory: one pass over two word arrays, emitting the flat index and
 * the new bits of every changed element. Memory-bound: it reads each input once and writes only
 * the changed entries, which the torch-op path cannot do (its compare writes a mask and its
 * gathers revisit the inputs at random).
 *
 * Built on first use by delta_sync/native.py (plain C, no Python or torch headers) and called
 * through ctypes, which releases the GIL, so ranges of one tensor run on several threads.
 *
 * Contract of diff_words_W (W = element width in bits, 16 or 32):
 *   a, b       the two inputs as 64-bit words (8-byte aligned), `nwords` of them
 *   base       flat element index of a[0]'s first lane
 *   idx, val   output, room for `cap` entries (cap >= 8 words' worth: 8 * 64 / W)
 *   *done      words consumed; the call stops early, at a word boundary, when the next word
 *              could overflow the output, so the caller loops with bounded scratch
 *   returns    entries written, flat indices strictly increasing
 */
#include <stdint.h>

#define DEFINE_DIFF(W, VT)                                                                      \
    int64_t diff_words_##W(const uint64_t *a, const uint64_t *b, int64_t nwords, int64_t base,  \
                           int32_t *idx, VT *val, int64_t cap, int64_t *done) {                 \
        const int lanes = 64 / (W);                                                             \
        const uint64_t lane_mask = (1ull << (W)) - 1;                                           \
        int64_t k = 0, w = 0;                                                                   \
        for (; w < nwords; w += 8) {                                                            \
            int64_t end = w + 8 < nwords ? w + 8 : nwords;                                      \
            uint64_t any = 0;                                                                   \
            if (end - w == 8) {                                                                 \
                for (int j = 0; j < 8; ++j) any |= a[w + j] ^ b[w + j];                        \
                if (__builtin_expect(any == 0, 1)) continue;                                    \
            }                                                                                   \
            if (k + (end - w) * lanes > cap) break;                                             \
            for (int64_t v = w; v < end; ++v) {                                                 \
                uint64_t x = a[v] ^ b[v];                                                       \
                if (!x) continue;                                                               \
                uint64_t nb = b[v];                                                             \
                for (int l = 0; l < lanes; ++l) {                                               \
                    if ((x >> ((W) * l)) & lane_mask) {                                         \
                        idx[k] = (int32_t)(base + v * lanes + l);                               \
                        val[k] = (VT)(nb >> ((W) * l));                                         \
                        ++k;                                                                    \
                    }                                                                           \
                }                                                                               \
            }                                                                                   \
        }                                                                                       \
        *done = w < nwords ? w : nwords;                                                        \
        return k;                                                                               \
    }

DEFINE_DIFF(16, uint16_t)
DEFINE_DIFF(32, uint32_t)
