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
#ifdef __AVX2__
#include <immintrin.h>
#endif

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

/* Position-weighted digest lanes over signed 16-bit words, fused with a non-finite scan
 * (see delta_sync/digest.py for the definition; the torch-op path computes the same bits).
 *
 *   w          the words, `n` of them, standing at absolute word positions k0, k0+1, ...
 *   lanes      number of lanes (1..4); lane l has prime p[l] and multiplier a[l]
 *   lo, hi     per lane, DIGEST_BLOCK-periodic weights split in bytes: the weight of relative
 *              word j (j < tab_len, a multiple of DIGEST_BLOCK) is hi[j] * 256 + lo[j] =
 *              (a[l]*j + c[l]) mod p[l]; tables are laid out lane after lane
 *   out        lanes residues in [0, p[l]) of sum_k w_k * ((a[l]*k + c[l]) mod p[l])
 *   exp_mask   non-zero: count words with (w & exp_mask) == exp_mask at positions with
 *              (k - k0) % stride == phase (bf16/fp16: every word; fp32: its high word)
 *   returns    that count (0 when exp_mask is 0)
 *
 * Split weights keep every product below 2**23, so int32 sums over a DIGEST_BLOCK of words
 * cannot overflow (and vectorise as multiply-add of 16-bit pairs); blocks are summed in int64
 * and reduced modulo p, so the result is the exact integer definition.
 */
#define DIGEST_BLOCK 256

int64_t digest_words(const int16_t *w, int64_t n, int64_t k0, int lanes, const int64_t *p,
                     const int64_t *a, const int16_t *lo, const int16_t *hi, int64_t tab_len,
                     int64_t *out, int16_t exp_mask, int64_t stride, int64_t phase) {
    int64_t acc[4] = {0, 0, 0, 0};
    int64_t bad = 0;
    for (int64_t s = 0; s < n; s += tab_len) {
        int64_t m = n - s < tab_len ? n - s : tab_len;
        const int16_t *x = w + s;
        int64_t total = 0;
        int64_t dot[4] = {0, 0, 0, 0};
        for (int64_t b = 0; b < m; b += DIGEST_BLOCK) {
            int64_t e = m - b < DIGEST_BLOCK ? m - b : DIGEST_BLOCK;
            const int16_t *xb = x + b;
#ifdef __AVX2__
            if (lanes == 4 && e == DIGEST_BLOCK && (!exp_mask || stride == 1)) {
                /* 16 words per step: _mm256_madd_epi16 multiplies 16-bit pairs and adds them into
                 * int32 (|pair sum| < 2**24, 16 steps < 2**28: no overflow), as the scalar loop. */
                __m256i al[4], ah[4], tot = _mm256_setzero_si256(), nbad = _mm256_setzero_si256();
                const __m256i ones = _mm256_set1_epi16(1), mask = _mm256_set1_epi16(exp_mask);
                for (int l = 0; l < 4; ++l) al[l] = ah[l] = _mm256_setzero_si256();
                for (int64_t j = 0; j < DIGEST_BLOCK; j += 16) {
                    __m256i v = _mm256_loadu_si256((const __m256i *)(xb + j));
                    tot = _mm256_add_epi32(tot, _mm256_madd_epi16(v, ones));
                    for (int l = 0; l < 4; ++l) {
                        al[l] = _mm256_add_epi32(al[l], _mm256_madd_epi16(
                            v, _mm256_loadu_si256((const __m256i *)(lo + l * tab_len + b + j))));
                        ah[l] = _mm256_add_epi32(ah[l], _mm256_madd_epi16(
                            v, _mm256_loadu_si256((const __m256i *)(hi + l * tab_len + b + j))));
                    }
                    if (exp_mask)  /* -1 per matching word */
                        nbad = _mm256_add_epi16(nbad, _mm256_cmpeq_epi16(_mm256_and_si256(v, mask), mask));
                }
                int32_t buf[8];
                _mm256_storeu_si256((__m256i *)buf, tot);
                for (int k = 0; k < 8; ++k) total += buf[k];
                for (int l = 0; l < 4; ++l) {
                    int64_t sl = 0, sh = 0;
                    _mm256_storeu_si256((__m256i *)buf, al[l]);
                    for (int k = 0; k < 8; ++k) sl += buf[k];
                    _mm256_storeu_si256((__m256i *)buf, ah[l]);
                    for (int k = 0; k < 8; ++k) sh += buf[k];
                    dot[l] += sh * 256 + sl;
                }
                if (exp_mask) {  /* 16 steps of at most -1 per 16-bit slot: no overflow */
                    int16_t c16[16];
                    _mm256_storeu_si256((__m256i *)c16, nbad);
                    for (int k = 0; k < 16; ++k) bad -= c16[k];
                }
                continue;
            }
#endif
            int32_t t32 = 0;
            for (int64_t j = 0; j < e; ++j) t32 += xb[j];
            total += t32;
            if (lanes == 4) {  /* one pass over the block for all lanes */
                const int16_t *l0 = lo + b, *l1 = lo + tab_len + b, *l2 = lo + 2 * tab_len + b,
                              *l3 = lo + 3 * tab_len + b, *h0 = hi + b, *h1 = hi + tab_len + b,
                              *h2 = hi + 2 * tab_len + b, *h3 = hi + 3 * tab_len + b;
                int32_t a0 = 0, a1 = 0, a2 = 0, a3 = 0, b0 = 0, b1 = 0, b2 = 0, b3 = 0;
                for (int64_t j = 0; j < e; ++j) {
                    int32_t v = xb[j];
                    a0 += v * l0[j]; a1 += v * l1[j]; a2 += v * l2[j]; a3 += v * l3[j];
                    b0 += v * h0[j]; b1 += v * h1[j]; b2 += v * h2[j]; b3 += v * h3[j];
                }
                dot[0] += (int64_t)b0 * 256 + a0; dot[1] += (int64_t)b1 * 256 + a1;
                dot[2] += (int64_t)b2 * 256 + a2; dot[3] += (int64_t)b3 * 256 + a3;
            } else {
                for (int l = 0; l < lanes; ++l) {
                    const int16_t *tl = lo + l * tab_len + b, *th = hi + l * tab_len + b;
                    int32_t dl = 0, dh = 0;
                    for (int64_t j = 0; j < e; ++j) {
                        dl += (int32_t)xb[j] * (int32_t)tl[j];
                        dh += (int32_t)xb[j] * (int32_t)th[j];
                    }
                    dot[l] += (int64_t)dh * 256 + dl;
                }
            }
            if (exp_mask) {
                int32_t c = 0;
                if (stride == 1) {
                    for (int64_t j = 0; j < e; ++j) c += (xb[j] & exp_mask) == exp_mask;
                } else {
                    for (int64_t j = 0; j < e; ++j)
                        c += ((((k0 + s + b + j) - (k0 + phase)) % stride) == 0) & ((xb[j] & exp_mask) == exp_mask);
                }
                bad += c;
            }
        }
        for (int l = 0; l < lanes; ++l) {
            int64_t off = (a[l] % p[l]) * ((k0 + s) % p[l]) % p[l];
            acc[l] = (acc[l] + dot[l] % p[l] + (total % p[l]) * off) % p[l];
        }
    }
    for (int l = 0; l < lanes; ++l) out[l] = (acc[l] % p[l] + p[l]) % p[l];
    return bad;
}
