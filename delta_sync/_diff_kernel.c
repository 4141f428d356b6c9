/* Host-memory kernels: the fused bitwise diff (below), the digest's scan and the moves of sparse
 * patches (further down).
 *
 * Fused bitwise diff for host memory: one pass over two word arrays, emitting the flat index and
 * the new bits of every changed element (optionally also its old bits, while moving the old array
 * to the new values: a snapshot then needs no second, random-access pass to commit). Memory-bound: it reads each input once and writes only
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
 *   prev       NULL, or output beside `val`: the bits of `a` at each entry; then every changed word
 *              of `a` is overwritten with `b`'s (the snapshot advances in the pass that reads it)
 *   *done      words consumed; the call stops early, at a word boundary, when the next word
 *              could overflow the output, so the caller loops with bounded scratch
 *   returns    entries written, flat indices strictly increasing
 */
#include <stdint.h>
#ifdef __AVX2__
#include <immintrin.h>
#endif

/* The first word index from w on, in steps of 16 words, whose 16-word block differs between a and
 * b, or the last such step that fits (the caller's 8-word loop takes it from there). Most blocks of
 * a delta are equal: with AVX2 an equal block costs a few vector instructions instead of sixteen
 * scalar xor/or, which keeps the diff memory-bound rather than instruction-bound. */
static inline int64_t skip_equal(const uint64_t *a, const uint64_t *b, int64_t w, int64_t nwords) {
#ifdef __AVX2__
    for (; w + 16 <= nwords; w += 16) {
        __m256i x0 = _mm256_xor_si256(_mm256_loadu_si256((const __m256i *)(a + w)),
                                      _mm256_loadu_si256((const __m256i *)(b + w)));
        __m256i x1 = _mm256_xor_si256(_mm256_loadu_si256((const __m256i *)(a + w + 4)),
                                      _mm256_loadu_si256((const __m256i *)(b + w + 4)));
        __m256i x2 = _mm256_xor_si256(_mm256_loadu_si256((const __m256i *)(a + w + 8)),
                                      _mm256_loadu_si256((const __m256i *)(b + w + 8)));
        __m256i x3 = _mm256_xor_si256(_mm256_loadu_si256((const __m256i *)(a + w + 12)),
                                      _mm256_loadu_si256((const __m256i *)(b + w + 12)));
        __m256i o = _mm256_or_si256(_mm256_or_si256(x0, x1), _mm256_or_si256(x2, x3));
        if (!_mm256_testz_si256(o, o)) break;
    }
#else
    (void)a; (void)b; (void)nwords;
#endif
    return w;
}

/* One 8-word block of 16-bit elements known to differ somewhere: compare all 32 lanes at once and
 * visit only the changed ones (a set bit each), instead of a branch per word and per lane, which
 * mispredicts about once per changed element when a few percent change (a real Adam step). Writes
 * entries from k on (the caller checked room for 32), advances the block of `a` to `b` when
 * `prev` is set (the whole block: its unchanged words hold `b`'s bits already) and returns the new
 * k. Without AVX2 the generic loop below runs instead (HAVE_LANE_MASKS 0). */
#ifdef __AVX2__
#define HAVE_LANE_MASKS 1
static inline int64_t changed_lanes16(uint64_t *a, const uint64_t *b, int64_t first, int32_t *idx,
                                      uint16_t *val, uint16_t *prev, int64_t k) {
    __m256i a0 = _mm256_loadu_si256((const __m256i *)a), a1 = _mm256_loadu_si256((const __m256i *)(a + 4));
    __m256i b0 = _mm256_loadu_si256((const __m256i *)b), b1 = _mm256_loadu_si256((const __m256i *)(b + 4));
    /* two mask bits per 16-bit lane, set where the lanes differ */
    uint64_t m = (uint64_t)(uint32_t)~_mm256_movemask_epi8(_mm256_cmpeq_epi16(a0, b0))
               | (uint64_t)(uint32_t)~_mm256_movemask_epi8(_mm256_cmpeq_epi16(a1, b1)) << 32;
    const uint16_t *nb = (const uint16_t *)b, *ob = (const uint16_t *)a;
    while (m) {
        int lane = __builtin_ctzll(m) >> 1;
        idx[k] = (int32_t)(first + lane);
        val[k] = nb[lane];
        if (prev) prev[k] = ob[lane];
        ++k;
        m &= m - 1;
        m &= m - 1; /* both bits of the lane */
    }
    if (prev) {
        _mm256_storeu_si256((__m256i *)a, b0);
        _mm256_storeu_si256((__m256i *)(a + 4), b1);
    }
    return k;
}
#else
#define HAVE_LANE_MASKS 0
static inline int64_t changed_lanes16(uint64_t *a, const uint64_t *b, int64_t first, int32_t *idx,
                                      uint16_t *val, uint16_t *prev, int64_t k) {
    (void)a; (void)b; (void)first; (void)idx; (void)val; (void)prev;
    return k;
}
#endif

#define DEFINE_DIFF(W, VT)                                                                      \
    int64_t diff_words_##W(uint64_t *a, const uint64_t *b, int64_t nwords, int64_t base,        \
                           int32_t *idx, VT *val, VT *prev, int64_t cap, int64_t *done) {       \
        const int lanes = 64 / (W);                                                             \
        const uint64_t lane_mask = (1ull << (W)) - 1;                                           \
        int64_t k = 0, w = 0;                                                                   \
        for (; w < nwords; w += 8) {                                                            \
            if ((w & 15) == 0) {                                                                \
                w = skip_equal(a, b, w, nwords);                                                \
                if (w >= nwords) break;                                                         \
            }                                                                                   \
            int64_t end = w + 8 < nwords ? w + 8 : nwords;                                      \
            uint64_t any = 0;                                                                   \
            if (end - w == 8) {                                                                 \
                for (int j = 0; j < 8; ++j) any |= a[w + j] ^ b[w + j];                        \
                if (__builtin_expect(any == 0, 1)) continue;                                    \
            }                                                                                   \
            if (k + (end - w) * lanes > cap) break;                                             \
            if ((W) == 16 && end - w == 8 && HAVE_LANE_MASKS) {                                 \
                k = changed_lanes16(a + w, b + w, base + w * 4, idx, (uint16_t *)val,           \
                                    (uint16_t *)prev, k);                                       \
                continue;                                                                       \
            }                                                                                   \
            for (int64_t v = w; v < end; ++v) {                                                 \
                uint64_t x = a[v] ^ b[v];                                                       \
                if (!x) continue;                                                               \
                uint64_t nb = b[v], ob = a[v];                                                  \
                if (prev) a[v] = nb;                                                            \
                for (int l = 0; l < lanes; ++l) {                                               \
                    if ((x >> ((W) * l)) & lane_mask) {                                         \
                        idx[k] = (int32_t)(base + v * lanes + l);                               \
                        val[k] = (VT)(nb >> ((W) * l));                                         \
                        if (prev) prev[k] = (VT)(ob >> ((W) * l));                              \
                        ++k;                                                                    \
                    }                                                                           \
                }                                                                               \
            }                                                                                   \
        }                                                                                       \
        *done = w < nwords ? w : nwords;                                                        \
        return k;                                                                               \
    }

/* diff_many_W: diff_words_W over many tensors in one call (a model's thousands of small tensors
 * would otherwise pay a foreign call and its scratch each). Tensor t is a_addr[t] / b_addr[t]
 * (word addresses) with nwords[t] words; the call starts at word w0 of tensor t0 and fills one
 * output, ends[t] = entries written up to the end of tensor t. It stops at a word boundary when the
 * output could overflow: *stop_t / *stop_w say where to resume (stop_t == ntensors: all done).
 * Returns the entries written. */
#define DEFINE_DIFF_MANY(W, VT)                                                                 \
    int64_t diff_many_##W(int64_t ntensors, const int64_t *a_addr, const int64_t *b_addr,       \
                          const int64_t *nwords, int64_t t0, int64_t w0, int32_t *idx, VT *val, \
                          VT *prev, int64_t cap, int64_t *ends, int64_t *stop_t,                \
                          int64_t *stop_w) {                                                    \
        const int lanes = 64 / (W);                                                             \
        int64_t k = 0, t = t0, w = w0;                                                          \
        for (; t < ntensors; ++t, w = 0) {                                                      \
            int64_t done = 0;                                                                   \
            k += diff_words_##W((uint64_t *)(uintptr_t)a_addr[t] + w,                           \
                                (const uint64_t *)(uintptr_t)b_addr[t] + w, nwords[t] - w,      \
                                w * lanes, idx + k, val + k, prev ? prev + k : 0, cap - k,      \
                                &done);                                                         \
            if (w + done < nwords[t]) {                                                         \
                *stop_t = t;                                                                    \
                *stop_w = w + done;                                                             \
                return k;                                                                       \
            }                                                                                   \
            ends[t] = k;                                                                        \
        }                                                                                       \
        *stop_t = ntensors;                                                                     \
        *stop_w = 0;                                                                            \
        return k;                                                                               \
    }

DEFINE_DIFF(16, uint16_t)
DEFINE_DIFF(32, uint32_t)
DEFINE_DIFF_MANY(16, uint16_t)
DEFINE_DIFF_MANY(32, uint32_t)

/* Position-weighted digest lanes over signed 16-bit words, fused with a non-finite scan and,
 * optionally, a copy (see delta_sync/digest.py for the definition; the torch-op path computes
 * the same bits).
 *
 * A word's weight (a*k + c) mod p is congruent to a*k + c, so a lane is
 *     D = a * S1 + c * S0  (mod p),   S0 = sum_k w_k,   S1 = sum_k k * w_k
 * and the kernel only needs S0 and S1: two multiply-adds per 16 words (by ones and by the word's
 * position in its block), not a weight-table load and multiply per lane.
 *
 *   w, n       the words and their count; word j stands at position k = k0 + j
 *   lanes      number of lanes (1..4); lane l has prime p[l], multiplier a[l], addend c[l]
 *   out        lanes residues in [0, p[l])
 *   exp_mask   non-zero: count words with (w & exp_mask) == exp_mask at positions with
 *              (k - k0) % stride == phase (bf16/fp16: every word; fp32: its high word)
 *   dst        non-NULL: the words are also copied there (one read of the source for both)
 *   returns    that count (0 when exp_mask is 0)
 *
 * Exact integers throughout: within a 256-word block |sum j * w_j| < 2**31 (int32 lanes, 16
 * steps of pair sums < 2**24); blocks fold into int64 sums over a 2**16-word super-block
 * (|sum| < 2**47; with AVX2 as four int64 vector lanes, reduced once per super-block, not per
 * block), and super-blocks are reduced modulo each p.
 */
#define DIGEST_BLOCK 256
#define DIGEST_SUPER 65536

static int64_t mod_p(int64_t x, int64_t p) { x %= p; return x < 0 ? x + p : x; }

int64_t digest_words(const int16_t *w, int64_t n, int64_t k0, int lanes, const int64_t *p,
                     const int64_t *a, const int64_t *c, int64_t *out, int16_t exp_mask,
                     int64_t stride, int64_t phase, int16_t *dst) {
    int64_t s0[4] = {0, 0, 0, 0}, s1[4] = {0, 0, 0, 0};  /* residues of S0 and of S1 - k0*S0 */
    int64_t bad = 0;
#ifdef __AVX2__
    int16_t jtab[DIGEST_BLOCK] __attribute__((aligned(32)));
    for (int j = 0; j < DIGEST_BLOCK; ++j) jtab[j] = (int16_t)j;
#endif
    for (int64_t s = 0; s < n; s += DIGEST_SUPER) {
        int64_t m = n - s < DIGEST_SUPER ? n - s : DIGEST_SUPER;
        const int16_t *x = w + s;
        int16_t *y = dst ? dst + s : 0;
        int64_t t_sum = 0, u_sum = 0;  /* sum w, sum (j - s) * w over this super-block */
#ifdef __AVX2__
        /* whole blocks fold into int64 vector sums, reduced once per super-block:
         * lane-wise, T += tot and U += pos + b * tot (a lane's share of b * t + u) */
        __m256i vt = _mm256_setzero_si256(), vu = _mm256_setzero_si256(), vbad = _mm256_setzero_si256();
        int64_t vec_end = (!exp_mask || stride == 1) ? m - m % DIGEST_BLOCK : 0;
        {
            const __m256i ones = _mm256_set1_epi16(1), mask = _mm256_set1_epi16(exp_mask);
            for (int64_t b = 0; b < vec_end; b += DIGEST_BLOCK) {
                const int16_t *xb = x + b;
                __m256i tot = _mm256_setzero_si256(), pos = _mm256_setzero_si256();
                for (int64_t j = 0; j < DIGEST_BLOCK; j += 16) {
                    __m256i v = _mm256_loadu_si256((const __m256i *)(xb + j));
                    if (y) _mm256_storeu_si256((__m256i *)(y + b + j), v);
                    tot = _mm256_add_epi32(tot, _mm256_madd_epi16(v, ones));
                    pos = _mm256_add_epi32(pos, _mm256_madd_epi16(v, _mm256_load_si256((const __m256i *)(jtab + j))));
                    if (exp_mask)  /* -1 per matching word; at most 4096 per slot per super-block */
                        vbad = _mm256_add_epi16(vbad, _mm256_cmpeq_epi16(_mm256_and_si256(v, mask), mask));
                }
                __m256i tlo = _mm256_cvtepi32_epi64(_mm256_castsi256_si128(tot));
                __m256i thi = _mm256_cvtepi32_epi64(_mm256_extracti128_si256(tot, 1));
                __m256i plo = _mm256_cvtepi32_epi64(_mm256_castsi256_si128(pos));
                __m256i phi = _mm256_cvtepi32_epi64(_mm256_extracti128_si256(pos, 1));
                __m256i t4 = _mm256_add_epi64(tlo, thi);
                const __m256i bb = _mm256_set1_epi64x(b);
                vt = _mm256_add_epi64(vt, t4);
                vu = _mm256_add_epi64(vu, _mm256_add_epi64(_mm256_add_epi64(plo, phi), _mm256_mul_epi32(t4, bb)));
            }
        }
        {
            int64_t buf[4];
            _mm256_storeu_si256((__m256i *)buf, vt);
            t_sum += buf[0] + buf[1] + buf[2] + buf[3];
            _mm256_storeu_si256((__m256i *)buf, vu);
            u_sum += buf[0] + buf[1] + buf[2] + buf[3];
            int16_t c16[16];
            _mm256_storeu_si256((__m256i *)c16, vbad);
            for (int k = 0; k < 16; ++k) bad -= c16[k];
        }
#else
        int64_t vec_end = 0;
#endif
        for (int64_t b = vec_end; b < m; b += DIGEST_BLOCK) {  /* the tail, or no AVX2 */
            int64_t e = m - b < DIGEST_BLOCK ? m - b : DIGEST_BLOCK;
            const int16_t *xb = x + b;
            int32_t t = 0, u = 0;
            for (int64_t j = 0; j < e; ++j) {
                int32_t v = xb[j];
                t += v;
                u += v * (int32_t)j;
            }
            if (y) for (int64_t j = 0; j < e; ++j) y[b + j] = xb[j];
            if (exp_mask) {
                if (stride == 1) {
                    for (int64_t j = 0; j < e; ++j) bad += (xb[j] & exp_mask) == exp_mask;
                } else {
                    for (int64_t j = 0; j < e; ++j)
                        bad += ((((s + b + j) - phase) % stride) == 0) & ((xb[j] & exp_mask) == exp_mask);
                }
            }
            t_sum += t;
            u_sum += b * (int64_t)t + u;
        }
        for (int l = 0; l < lanes; ++l) {
            s0[l] = mod_p(s0[l] + mod_p(t_sum, p[l]), p[l]);
            s1[l] = mod_p(s1[l] + mod_p(s, p[l]) * mod_p(t_sum, p[l]) + mod_p(u_sum, p[l]), p[l]);
        }
    }
    for (int l = 0; l < lanes; ++l) {
        int64_t full = mod_p(s1[l] + mod_p(k0, p[l]) * s0[l], p[l]);  /* S1 = sum (k0 + j) * w_j */
        out[l] = mod_p(mod_p(a[l], p[l]) * full + mod_p(c[l], p[l]) * s0[l], p[l]);
    }
    return bad;
}

/* Writes of sparse patches at the positions they name, and the reads of an undo log's old values,
 * for many patches in one call (a model's few hundred tensors cost one foreign call, not one each).
 *
 * Contract of move_rows(count, rows, check): `rows` holds `count` rows of MOVE_ROW int64 each:
 *   base       the target's first element; it holds `limit` elements
 *   pos, n     `n` positions (int32 or int64, per `kind`), each addressing base[off + pos[i]]
 *   off, limit
 *   val        0, or input: base[off + pos[i]] = val[i], in order (a repeated position keeps its
 *              last value, as torch's index_copy_ on a host does)
 *   old        0, or output: old[i] = base[off + pos[i]] before the write
 *   kind       element bytes (1, 2, 4, 8) | position bytes (4, 8) << 8
 * check != 0: nothing is read or written; returns -1, or the first row holding a position outside
 *   [0, limit), with that entry's index in *bad.
 * check == 0: performs the rows in order (positions are not checked: run a check call first);
 *   with both `val` and `old`, each position is read and written in one visit; returns -1.
 * Positions of a patch increase, so the accesses walk each target forward; every one is still a
 * new cache line at a delta's densities (bound by memory latency and bandwidth, not instructions).
 */
#define MOVE_ROW 8
#define MOVE_AHEAD 16

#define MOVE_LOOP(T, P)                                                                             \
    do {                                                                                            \
        T *b = (T *)(intptr_t)r[0] + r[3];                                                          \
        const P *p = (const P *)(intptr_t)r[1];                                                     \
        const T *v = (const T *)(intptr_t)r[5];                                                     \
        T *o = (T *)(intptr_t)r[6];                                                                 \
        int64_t n = r[2], ahead = n > MOVE_AHEAD ? n - MOVE_AHEAD : 0;                              \
        if (o && v) {                                                                               \
            for (int64_t i = 0; i < n; ++i) {                                                       \
                if (i < ahead) __builtin_prefetch(b + p[i + MOVE_AHEAD], 1);                        \
                o[i] = b[p[i]];                                                                     \
                b[p[i]] = v[i];                                                                     \
            }                                                                                       \
        } else if (o) {                                                                             \
            for (int64_t i = 0; i < n; ++i) {                                                       \
                if (i < ahead) __builtin_prefetch(b + p[i + MOVE_AHEAD], 0);                        \
                o[i] = b[p[i]];                                                                     \
            }                                                                                       \
        } else if (v) {                                                                             \
            for (int64_t i = 0; i < n; ++i) {                                                       \
                if (i < ahead) __builtin_prefetch(b + p[i + MOVE_AHEAD], 1);                        \
                b[p[i]] = v[i];                                                                     \
            }                                                                                       \
        }                                                                                           \
    } while (0)

#define MOVE_WIDTHS(P)                                                                              \
    switch (r[7] & 0xff) {                                                                          \
        case 1: MOVE_LOOP(uint8_t, P); break;                                                       \
        case 2: MOVE_LOOP(uint16_t, P); break;                                                      \
        case 4: MOVE_LOOP(uint32_t, P); break;                                                      \
        case 8: MOVE_LOOP(uint64_t, P); break;                                                      \
    }

#define FIRST_OUTSIDE(P)                                                                            \
    do {                                                                                            \
        const P *p = (const P *)(intptr_t)r[1];                                                     \
        int64_t lo = 0, hi = 0;                                                                     \
        for (int64_t i = 0; i < r[2]; ++i) {                                                        \
            lo = p[i] < lo ? p[i] : lo;                                                             \
            hi = p[i] > hi ? p[i] : hi;                                                             \
        }                                                                                           \
        if (r[2] && (r[3] + lo < 0 || r[3] + hi >= r[4]))                                           \
            for (int64_t i = 0; i < r[2]; ++i)                                                      \
                if (r[3] + (int64_t)p[i] < 0 || r[3] + (int64_t)p[i] >= r[4]) return i;             \
    } while (0)

static int64_t first_outside(const int64_t *r) {
    if ((r[7] >> 8) == 4) FIRST_OUTSIDE(int32_t); else FIRST_OUTSIDE(int64_t);
    return -1;
}

int64_t move_rows(int64_t count, const int64_t *rows, int check, int64_t *bad) {
    for (int64_t k = 0; k < count; ++k) {
        const int64_t *r = rows + k * MOVE_ROW;
        if (check) {
            int64_t i = first_outside(r);
            if (i >= 0) { *bad = i; return k; }
        } else if ((r[7] >> 8) == 4) {
            MOVE_WIDTHS(int32_t)
        } else {
            MOVE_WIDTHS(int64_t)
        }
    }
    return -1;
}

/* Order and bounds of the sparse entries of one bucket, in one pass over its int32 index buffer
 * (the packer's check before a bucket leaves and the receiver's before it stages it: five
 * vectorized torch ops and a 1-byte-per-index mask otherwise, each op waiting for its slowest
 * thread on a busy host).
 *
 *   idx, n     the buffer; entry k holds the next counts[k] indices (the entries tile it:
 *              the caller checks sum(counts) == n first)
 *   limits     entry k's indices must lie in [0, limits[k]) and strictly increase
 *   returns    -1, or the buffer position of the first index breaking either rule (the caller
 *              then names it through its own slower path)
 */
int64_t sparse_order_bounds(const int32_t *idx, int64_t n, int64_t nentries, const int64_t *counts,
                            const int64_t *limits) {
    int64_t pos = 0;
    for (int64_t k = 0; k < nentries; ++k) {
        const int64_t end = pos + counts[k], lim = limits[k];
        int64_t prev = -1;  /* a first index below 0 fails v <= prev */
        if (end > n) return pos;
        for (; pos < end; ++pos) {
            const int64_t v = idx[pos];
            if (v <= prev || v >= lim) return pos;
            prev = v;
        }
    }
    return -1;
}
