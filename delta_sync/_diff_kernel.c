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
#include <string.h>
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

/* Keyed digest lanes over signed 16-bit words, fused with a non-finite scan and, optionally, a
 * copy (see delta_sync/digest.py for the definition; the torch-op path computes the same bits).
 *
 * Word k (= k0 + j) of lane l weighs t1[l][k % R] * t2[l][(k / R) % R] * t3[l][k / R^2] mod p[l],
 * R = KEY_ROW, so a lane is a sum over rows of R words:
 *     D = sum_r (sum_j w_j * t1[j] mod p) * t2[r % R] * t3[r / R]   (mod p)
 * and the kernel's inner loop is one 16-bit multiply-add per word and lane (against the row's
 * table, which stays in L1), reduced once per row.
 *
 *   w, n       the words and their count; word j stands at position k = k0 + j
 *   lanes      number of lanes (0..4); lane l has prime p[l] and tables t1 + l*R, t2 + l*R,
 *              t3 + l*t3_len (int16: t1 < 2**12, t2 and t3 < p); k / R^2 < t3_len (caller checks)
 *   out        lanes residues in [0, p[l])
 *   exp_mask   non-zero: count words with (w & exp_mask) == exp_mask at positions with
 *              j % stride == phase (bf16/fp16: every word; fp32: its high word)
 *   dst        non-NULL: the words are also copied there (one read of the source for both)
 *   returns    that count (0 when exp_mask is 0)
 *
 * Exact integers throughout: |w * t1| < 2**15 * 2**12, so a multiply-add pair stays below 2**28
 * and eight of them below 2**31 (int32: one widening per 128 words and lane); they fold into int64
 * per row (|row sum| < 2**38); rows are reduced modulo p before their weight (< 2**15) multiplies
 * them.
 */
#define KEY_ROW 1024
#define KEY_SHIFT 10

static int64_t mod_p128(__int128 x, int64_t p) { int64_t m = (int64_t)(x % p); return m < 0 ? m + p : m; }

/* sum_j x[j] * t[j], j < m (scalar: a row's partial ends, hosts without AVX2) */
static int64_t dot16(const int16_t *x, const int16_t *t, int64_t m) {
    int64_t s = 0;
    for (int64_t j = 0; j < m; ++j) s += (int32_t)x[j] * (int32_t)t[j];
    return s;
}

/* One lane's share of a row step (8 vectors of W words in v[], against the lane's table row t1):
 * eight multiply-adds summed in int32 (|each| < 2**28: t1 < 2**12), then widened once into
 * acc[l]. P: the intrinsics' prefix of the vector type VEC; LOAD, LO, HI: its unaligned load and
 * its halves as the next narrower type; MADD_ADD(s, x, t): s plus x's multiply-add with t. FOR_LANES:
 * a step of every lane, unrolled for four (the accumulators stay in registers). */
#define LANE_STEP(l, VEC, P, LOAD, LO, HI, W, MADD_ADD)                                             \
    do {                                                                                            \
        const int16_t *t = t1 + (l) * KEY_ROW + j;                                                  \
        VEC s = P##_madd_epi16(v[0], LOAD(t));                                                      \
        for (int q = 1; q < 8; ++q) s = MADD_ADD(s, v[q], LOAD(t + (W) * q));                       \
        acc[l] = P##_add_epi64(acc[l], P##_add_epi64(P##_cvtepi32_epi64(LO(s)), P##_cvtepi32_epi64(HI(s)))); \
    } while (0)
#define FOR_LANES(STEP)                                                                             \
    do {                                                                                            \
        if (lanes == 4) { STEP(0); STEP(1); STEP(2); STEP(3); }                                     \
        else for (int l = 0; l < lanes; ++l) STEP(l);                                               \
    } while (0)
#define LOAD256(p) _mm256_loadu_si256((const __m256i *)(p))
#define LO256(s) _mm256_castsi256_si128(s)
#define HI256(s) _mm256_extracti128_si256(s, 1)
#define MADD_ADD256(s, x, t) _mm256_add_epi32((s), _mm256_madd_epi16((x), (t)))
#define STEP256(l) LANE_STEP(l, __m256i, _mm256, LOAD256, LO256, HI256, 16, MADD_ADD256)
#define LOAD512(p) _mm512_loadu_si512((const void *)(p))
#define LO512(s) _mm512_castsi512_si256(s)
#define HI512(s) _mm512_extracti64x4_epi64(s, 1)
#ifdef __AVX512VNNI__
/* the multiply-add and the int32 sum in one instruction (VNNI's vpdpwssd: the same sums, in order) */
#define MADD_ADD512(s, x, t) _mm512_dpwssd_epi32((s), (x), (t))
#else
#define MADD_ADD512(s, x, t) _mm512_add_epi32((s), _mm512_madd_epi16((x), (t)))
#endif
#define STEP512(l) LANE_STEP(l, __m512i, _mm512, LOAD512, LO512, HI512, 32, MADD_ADD512)

#ifdef __AVX2__
/* One whole row (KEY_ROW words): per lane sum_j x[j] * t1[j] into rows[l]; non-finite count;
 * y non-NULL: the row is copied there in the same pass */
static int64_t row_avx2(const int16_t *x, int16_t *y, int lanes, const int16_t *t1, int16_t exp_mask,
                        __m256i sel, int64_t *rows) {
    __m256i acc[4] = {_mm256_setzero_si256(), _mm256_setzero_si256(), _mm256_setzero_si256(),
                      _mm256_setzero_si256()};
    __m256i vbad = _mm256_setzero_si256();
    const __m256i mask = _mm256_set1_epi16(exp_mask);
    for (int64_t j = 0; j < KEY_ROW; j += 128) {  /* 8 vectors: 128 words */
        __m256i v[8];
        for (int q = 0; q < 8; ++q) {
            v[q] = _mm256_loadu_si256((const __m256i *)(x + j + 16 * q));
            if (y) _mm256_storeu_si256((__m256i *)(y + j + 16 * q), v[q]);
            if (exp_mask)  /* -1 per matching word; at most 64 per slot per row */
                vbad = _mm256_add_epi16(vbad, _mm256_and_si256(sel, _mm256_cmpeq_epi16(_mm256_and_si256(v[q], mask), mask)));
        }
        FOR_LANES(STEP256);
    }
    int64_t buf[4];
    for (int l = 0; l < lanes; ++l) {
        _mm256_storeu_si256((__m256i *)buf, acc[l]);
        rows[l] = buf[0] + buf[1] + buf[2] + buf[3];
    }
    int16_t c16[16];
    _mm256_storeu_si256((__m256i *)c16, vbad);
    int64_t bad = 0;
    for (int k = 0; k < 16; ++k) bad -= c16[k];
    return bad;
}
#endif

#ifdef __AVX512BW__
/* row_avx2 at twice the width (hosts with AVX-512BW): 32 words per vector, the non-finite test a
 * compare into a bit mask (sel: the words counted) and a popcount */
static int64_t row_avx512(const int16_t *x, int16_t *y, int lanes, const int16_t *t1, int16_t exp_mask,
                          __mmask32 sel, int64_t *rows) {
    __m512i acc[4] = {_mm512_setzero_si512(), _mm512_setzero_si512(), _mm512_setzero_si512(),
                      _mm512_setzero_si512()};
    int64_t bad = 0;
    const __m512i mask = _mm512_set1_epi16(exp_mask);
    for (int64_t j = 0; j < KEY_ROW; j += 256) {  /* 8 vectors: 256 words */
        __m512i v[8];
        for (int q = 0; q < 8; ++q) {
            v[q] = _mm512_loadu_si512((const void *)(x + j + 32 * q));
            if (y) _mm512_storeu_si512((void *)(y + j + 32 * q), v[q]);
            if (exp_mask)
                bad += __builtin_popcount((unsigned)_mm512_mask_cmpeq_epi16_mask(sel, _mm512_and_si512(v[q], mask), mask));
        }
        FOR_LANES(STEP512);
    }
    for (int l = 0; l < lanes; ++l) rows[l] = _mm512_reduce_add_epi64(acc[l]);
    return bad;
}
#endif

int64_t digest_words(const int16_t *w, int64_t n, int64_t k0, int lanes, const int64_t *p,
                     const int16_t *t1, const int16_t *t2, const int16_t *t3, int64_t t3_len,
                     int64_t *out, int16_t exp_mask, int64_t stride, int64_t phase, int16_t *dst) {
    int64_t acc[4] = {0, 0, 0, 0}, bad = 0, block = -1;
    __int128 part[4] = {0, 0, 0, 0};
    for (int64_t i = 0; i < n;) {
        int64_t k = k0 + i, j0 = k & (KEY_ROW - 1), m = KEY_ROW - j0;
        if (m > n - i) m = n - i;
        const int16_t *x = w + i;
        int64_t rows[4] = {0, 0, 0, 0};
        int counted = 0;
#if defined(__AVX512BW__) || defined(__AVX2__)
        /* the words counted: all (stride 1) or every other one (fp32's high words, odd slots) */
        if (m == KEY_ROW && (!exp_mask || stride == 1 || (stride == 2 && phase == 1 && i % 2 == 0))) {
#ifdef __AVX512BW__
            __mmask32 sel = stride == 1 ? (__mmask32)0xFFFFFFFFu : (__mmask32)0xAAAAAAAAu;
            bad += row_avx512(x, dst ? dst + i : 0, lanes, t1, exp_mask, sel, rows);
#else
            __m256i sel = stride == 1 ? _mm256_set1_epi16(-1) : _mm256_set1_epi32((int32_t)0xFFFF0000u);
            bad += row_avx2(x, dst ? dst + i : 0, lanes, t1, exp_mask, sel, rows);
#endif
            counted = 1;
        } else
#endif
        {
            if (dst)
                for (int64_t j = 0; j < m; ++j) dst[i + j] = x[j];
            for (int l = 0; l < lanes; ++l) rows[l] = dot16(x, t1 + l * KEY_ROW + j0, m);
        }
        if (exp_mask && !counted) {
            for (int64_t j = 0; j < m; ++j)
                bad += ((((i + j) - phase) % stride) == 0) & ((x[j] & exp_mask) == exp_mask);
        }
        /* a row weighs t2[r % R] * t3[r / R]: rows of one t3 block are summed against t2 exactly
         * (|row| < 2**38, t2 < 2**15, R rows: < 2**63 in 128 bits), reduced and weighed by t3 once
         * per block, not three divisions per row and lane */
        int64_t r = k >> KEY_SHIFT, b = r >> KEY_SHIFT;
        if (b != block) {
            for (int l = 0; l < lanes; ++l) {
                acc[l] = (acc[l] + mod_p128(part[l], p[l]) * (block < 0 ? 0 : t3[l * t3_len + block])) % p[l];
                part[l] = 0;
            }
            block = b;
        }
        for (int l = 0; l < lanes; ++l) part[l] += (__int128)rows[l] * t2[l * KEY_ROW + (r & (KEY_ROW - 1))];
        i += m;
    }
    for (int l = 0; l < lanes; ++l)
        out[l] = block < 0 ? acc[l] : (acc[l] + mod_p128(part[l], p[l]) * t3[l * t3_len + block]) % p[l];
    return bad;
}

/* digest_words of many ranges in one call (a model's thousands of small tensors cost one foreign
 * call per thread, not one each). `items` holds n rows of DIGEST_ITEM int64:
 *   w, nwords, k0   the int16 words, how many, the position of the first
 *   dst             0, or where the words are copied in the same pass
 *   exp_mask        the non-finite test's exponent bits (0: none), as a 16-bit pattern
 *   stride          words per element (the test reads each element's last word)
 * out: n rows of 5 int64: the lane residues (lanes of them, the rest 0), the non-finite count. */
#define DIGEST_ITEM 6
void digest_many(int64_t n, const int64_t *items, int lanes, const int64_t *p, const int16_t *t1,
                 const int16_t *t2, const int16_t *t3, int64_t t3_len, int64_t *out) {
    for (int64_t i = 0; i < n; ++i) {
        const int64_t *it = items + i * DIGEST_ITEM;
        int64_t *o = out + i * 5;
        o[0] = o[1] = o[2] = o[3] = 0;
        o[4] = digest_words((const int16_t *)(intptr_t)it[0], it[1], it[2], lanes, p, t1, t2, t3, t3_len, o,
                            (int16_t)it[4], it[5], it[5] - 1, (int16_t *)(intptr_t)it[3]);
    }
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
        if (end > n) return pos;
        if (end <= pos) continue;
        /* branch-free first (it vectorizes: no value carried from one element to the next), then,
         * only for an entry that fails, the first bad position */
        const int32_t *a = idx + pos;
        const int64_t cnt = end - pos;
        int bad = a[0] < 0 || (int64_t)a[0] >= lim;
        for (int64_t i = 1; i < cnt; ++i) bad |= (a[i] <= a[i - 1]) | ((int64_t)a[i] >= lim);
        if (bad) {
            int64_t prev = -1;  /* a first index below 0 fails v <= prev */
            for (; pos < end; ++pos) {
                const int64_t v = idx[pos];
                if (v <= prev || v >= lim) return pos;
                prev = v;
            }
        }
        pos = end;
    }
    return -1;
}

/* A delta's changed elements in checkpoint coordinates (the Megatron fast path), in two passes
 * that touch each changed element once, whatever the number of parameters and runs.
 *
 * run_slices: run r of a parameter covers its local flat offsets [start[r], end[r]); the
 * parameter's changed offsets are the `cnt[param[r]]` int32 at `idx_ptr[param[r]]`, increasing.
 * Writes lo[r], the first of them at or after start[r], and n[r], how many fall in the run.
 */
static int64_t lower_bound32(const int32_t *a, int64_t n, int64_t v) {
    int64_t lo = 0, hi = n;
    while (lo < hi) {
        const int64_t mid = lo + (hi - lo) / 2;
        if ((int64_t)a[mid] < v) lo = mid + 1; else hi = mid;
    }
    return lo;
}

/* The first i >= from with a[i] >= v, where every a[j] (j < from) is below v: doubling steps from
 * `from`, then a binary search in the last step (a run's few changes cost a few reads, not a
 * search of the whole parameter's). */
static int64_t gallop32(const int32_t *a, int64_t n, int64_t from, int64_t v) {
    if (from >= n || (int64_t)a[from] >= v) return from;
    int64_t below = from, step = 1, hi = from + 1;  /* a[below] < v */
    while (hi < n && (int64_t)a[hi] < v) {
        below = hi;
        step <<= 1;
        hi = from + step;
    }
    if (hi > n) hi = n;
    return below + 1 + lower_bound32(a + below + 1, hi - below - 1, v);
}

void run_slices(int64_t nruns, const int64_t *param, const int64_t *start, const int64_t *end,
                const int64_t *idx_ptr, const int64_t *cnt, int64_t *lo, int64_t *n) {
    int64_t last_param = -1, last_end = 0, at = 0;  /* where the run before ended among its changes */
    for (int64_t r = 0; r < nruns; ++r) {
        const int32_t *idx = (const int32_t *)(intptr_t)idx_ptr[param[r]];
        const int64_t m = cnt[param[r]];
        /* a parameter's runs in local order (as tables keep them) go on from where the last one
         * ended; another parameter, or a run before the last one's end, from the start */
        if (param[r] != last_param || start[r] < last_end) at = 0;
        lo[r] = gallop32(idx, m, at, start[r]);
        at = gallop32(idx, m, lo[r], end[r]);
        n[r] = at - lo[r];
        last_param = param[r];
        last_end = end[r];
    }
}

/* gather_runs: rows of (int32 offsets address, values address, count, shift), in output order;
 * each row's offsets plus its shift go to out_idx (int32) and its values (`width` bytes each) to
 * out_val, one row after the other. */
void gather_runs(int64_t nrows, const int64_t *rows, int64_t width, int32_t *out_idx, char *out_val) {
    for (int64_t k = 0; k < nrows; ++k) {
        const int64_t *r = rows + 4 * k;
        const int32_t *src = (const int32_t *)(intptr_t)r[0];
        const int64_t n = r[2], shift = r[3];
        if (n == 0) continue;  /* (a run without changes: its addresses may be those of empty tensors) */
        for (int64_t i = 0; i < n; ++i) out_idx[i] = (int32_t)((int64_t)src[i] + shift);
        memcpy(out_val, (const char *)(intptr_t)r[1], (size_t)(n * width));
        out_idx += n;
        out_val += n * width;
    }
}
