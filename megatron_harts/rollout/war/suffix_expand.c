/* Compiled parts of the suffix drafter (megatron_harts/rollout/war/suffix.py): the draft expansion
 * (expand_chain, expand_tree), a request's whole context draft (context_draft: match + expansion)
 * and a corpus' longest match past the trigram (corpus_match), each at the end of this file.
 *
 * The same expansion as SuffixTrie.expand / expand_tree, from a node given by its occurrence
 * end positions in a token buffer (as _OccurrenceExpansion does in Python):
 *
 *   node         = the set of positions e where its string ends; count = their number
 *   its children = the tokens arr[e + 1] over those e with e + 1 < n_valid and arr[e + 1] != sep
 *                  (a separator, or the buffer's end, continues nothing); a child's count is how
 *                  many e it follows, its ends those e + 1
 *   q(child)     = p * c / count (doubles, evaluated left to right as Python does)
 *
 * expand_chain: greedy most frequent child (ties: the smaller token) while q >= min_prob, up to
 * max_tokens tokens and depth < max_depth. expand_tree: best first by (q descending, token
 * ascending, push order ascending), up to max_nodes nodes, paths of at most max_len tokens,
 * depth < max_depth, q >= min_prob; a node's children are pushed in order of (count descending,
 * token ascending) right after it is taken (none once max_nodes are taken). Both are bitwise the
 * Python expansions' results: tested against them and the trie (tests/test_war_suffix_native.py).
 *
 * Plain C (no Python headers): built at first use by `cc -O2 -shared -fPIC` and called through
 * ctypes (megatron_harts/rollout/war/suffix_native.py). No -ffast-math: the probabilities must
 * round as Python's floats do. Returns the number of tokens written, or -1 when out of memory.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

typedef struct { int64_t tok, cnt, first, fill; } slot_t;   /* hash slot: token, count, ends offset */

typedef struct {                       /* a candidate node */
    double q;
    int64_t tok, seq, ends_off, cnt, depth, parent, plen;
} cand_t;

typedef struct { int64_t *a; int64_t n, cap; } pool_t;       /* occurrence ends of all candidates */

static int pool_reserve(pool_t *p, int64_t extra) {
    if (p->n + extra <= p->cap) return 0;
    int64_t cap = p->cap ? p->cap : 1024;
    while (cap < p->n + extra) cap *= 2;
    int64_t *a = (int64_t *)realloc(p->a, (size_t)cap * sizeof(int64_t));
    if (!a) return -1;
    p->a = a;
    p->cap = cap;
    return 0;
}

typedef struct { int64_t tok, cnt, off; } kid_t;

static int kid_cmp(const void *x, const void *y) {          /* count descending, token ascending */
    const kid_t *a = (const kid_t *)x, *b = (const kid_t *)y;
    if (a->cnt != b->cnt) return a->cnt > b->cnt ? -1 : 1;
    return (a->tok > b->tok) - (a->tok < b->tok);
}

/* The slot of `tok` in the open-addressing table t[mask + 1]: where it is, or the empty slot where
 * it goes (a slot is empty while its count is 0). */
static inline int64_t probe(const slot_t *t, int64_t mask, int64_t tok) {
    uint64_t h = ((uint64_t)tok * 0x9E3779B97F4A7C15ull) >> 20;
    int64_t s = (int64_t)(h & (uint64_t)mask);
    while (t[s].cnt && t[s].tok != tok) s = (s + 1) & mask;
    return s;
}

/* The token after an occurrence ending at e - 1 (position e), or 0 with none (past the valid
 * buffer, or a separator). */
static inline int next_token(const int64_t *arr, int64_t n_valid, int64_t sep, int64_t e, int64_t *tok) {
    if (e >= n_valid || arr[e] == sep) return 0;
    *tok = arr[e];
    return 1;
}

/* Children of the node whose `k` ends are pool->a[off:off+k] (count `count`, cumulative
 * probability `p`) that reach min_prob: written to *kids (sorted), their ends appended to the
 * pool. Returns how many, or -1 (out of memory). Hashes the next tokens when k is large. */
static int64_t children(const int64_t *arr, int64_t n_valid, int64_t sep, pool_t *pool, int64_t off,
                        int64_t k, int64_t count, double p, double min_prob, kid_t **kids,
                        int64_t *kids_cap, slot_t **tab, int64_t *tab_cap) {
    int64_t nk = 0;
    int64_t size = 16;
    while (size < 2 * k) size *= 2;
    if (*tab_cap < size) {
        free(*tab);
        *tab = (slot_t *)malloc((size_t)size * sizeof(slot_t));
        if (!*tab) { *tab_cap = 0; return -1; }
        *tab_cap = size;
    }
    slot_t *t = *tab;
    for (int64_t i = 0; i < size; i++) t[i].cnt = 0;
    int64_t mask = size - 1, distinct = 0;
    int64_t tok;
    for (int64_t i = 0; i < k; i++) {                        /* count the tokens after the ends */
        if (!next_token(arr, n_valid, sep, pool->a[off + i] + 1, &tok)) continue;
        int64_t s = probe(t, mask, tok);
        if (!t[s].cnt) { t[s].tok = tok; distinct++; }
        t[s].cnt++;
    }
    if (!distinct) return 0;
    if (*kids_cap < distinct) {
        free(*kids);
        *kids = (kid_t *)malloc((size_t)distinct * sizeof(kid_t));
        if (!*kids) { *kids_cap = 0; return -1; }
        *kids_cap = distinct;
    }
    int64_t total = 0;
    for (int64_t s = 0; s < size; s++) {
        if (!t[s].cnt) continue;
        double q = p * (double)t[s].cnt / (double)count;
        if (q >= min_prob) {
            (*kids)[nk].tok = t[s].tok;
            (*kids)[nk].cnt = t[s].cnt;
            t[s].first = total;                              /* relative offset in the new block */
            t[s].fill = 0;
            total += t[s].cnt;
            nk++;
        } else {
            t[s].first = -1;
        }
    }
    if (!nk) return 0;
    if (pool_reserve(pool, total) < 0) return -1;
    int64_t base = pool->n;
    for (int64_t i = 0; i < k; i++) {                        /* the kept children's ends */
        int64_t e = pool->a[off + i] + 1;
        if (!next_token(arr, n_valid, sep, e, &tok)) continue;
        int64_t s = probe(t, mask, tok);
        if (t[s].first < 0) continue;
        pool->a[base + t[s].first + t[s].fill++] = e;
    }
    for (int64_t j = 0; j < nk; j++)
        (*kids)[j].off = base + t[probe(t, mask, (*kids)[j].tok)].first;
    pool->n = base + total;
    qsort(*kids, (size_t)nk, sizeof(kid_t), kid_cmp);
    return nk;
}

/* heap order: q descending, then token ascending, then push order ascending */
static int before(const cand_t *a, const cand_t *b) {
    if (a->q != b->q) return a->q > b->q;
    if (a->tok != b->tok) return a->tok < b->tok;
    return a->seq < b->seq;
}

static void heap_push(cand_t *h, int64_t *n, cand_t c) {
    int64_t i = (*n)++;
    h[i] = c;
    while (i > 0) {
        int64_t up = (i - 1) / 2;
        if (!before(&h[i], &h[up])) break;
        cand_t tmp = h[i]; h[i] = h[up]; h[up] = tmp;
        i = up;
    }
}

static cand_t heap_pop(cand_t *h, int64_t *n) {
    cand_t top = h[0];
    h[0] = h[--(*n)];
    int64_t i = 0;
    for (;;) {
        int64_t l = 2 * i + 1, r = l + 1, m = i;
        if (l < *n && before(&h[l], &h[m])) m = l;
        if (r < *n && before(&h[r], &h[m])) m = r;
        if (m == i) break;
        cand_t tmp = h[i]; h[i] = h[m]; h[m] = tmp;
        i = m;
    }
    return top;
}

typedef struct { pool_t pool; kid_t *kids; int64_t kids_cap; slot_t *tab; int64_t tab_cap; } scratch_t;

static void scratch_free(scratch_t *s) { free(s->pool.a); free(s->kids); free(s->tab); }

static int seed(scratch_t *s, const int64_t *ends, int64_t k) {
    if (pool_reserve(&s->pool, k) < 0) return -1;
    memcpy(s->pool.a, ends, (size_t)k * sizeof(int64_t));
    s->pool.n = k;
    return 0;
}

/* arr[n_valid]: the token buffer; ends[k]: the node's occurrence ends (count = k, at `depth`).
 * Writes up to max_tokens tokens and cumulative probabilities; returns how many (-1: no memory). */
int64_t expand_chain(const int64_t *arr, int64_t n_valid, int64_t sep, const int64_t *ends, int64_t k,
                     int64_t depth, int64_t max_depth, int64_t max_tokens, double min_prob,
                     int64_t *out_tok, double *out_prob) {
    scratch_t s = {0};
    if (seed(&s, ends, k) < 0) return -1;
    int64_t n = 0, off = 0, count = k;
    double p = 1.0;
    while (n < max_tokens && depth < max_depth) {
        int64_t nk = children(arr, n_valid, sep, &s.pool, off, count, count, p, min_prob, &s.kids, &s.kids_cap,
                              &s.tab, &s.tab_cap);
        if (nk < 0) { scratch_free(&s); return -1; }
        if (nk == 0) break;
        kid_t best = s.kids[0];                              /* most frequent, ties: smaller token */
        p = p * (double)best.cnt / (double)count;
        out_tok[n] = best.tok;
        out_prob[n] = p;
        n++;
        off = best.off;
        count = best.cnt;
        depth++;
    }
    scratch_free(&s);
    return n;
}

/* As expand_chain, a best-first tree: out_parent[i] is node i's parent (-1: the root's child). */
int64_t expand_tree(const int64_t *arr, int64_t n_valid, int64_t sep, const int64_t *ends, int64_t k,
                    int64_t depth, int64_t max_depth, int64_t max_nodes, int64_t max_len, double min_prob,
                    int64_t *out_tok, double *out_prob, int64_t *out_parent) {
    scratch_t s = {0};
    int64_t hn = 0, hcap = 64, seq = 0, n = 0;
    cand_t *heap = (cand_t *)malloc((size_t)hcap * sizeof(cand_t));
    if (!heap || seed(&s, ends, k) < 0) { free(heap); scratch_free(&s); return -1; }
    cand_t root = {1.0, 0, 0, 0, k, depth, -1, 0};
    cand_t cur = root;
    int have = 1;                       /* cur is a node whose children are to be pushed */
    while (have) {
        if (cur.plen < max_len && cur.depth < max_depth) {
            int64_t nk = children(arr, n_valid, sep, &s.pool, cur.ends_off, cur.cnt, cur.cnt, cur.q, min_prob,
                                  &s.kids, &s.kids_cap, &s.tab, &s.tab_cap);
            if (nk < 0) { free(heap); scratch_free(&s); return -1; }
            if (hn + nk > hcap) {
                while (hn + nk > hcap) hcap *= 2;
                cand_t *h = (cand_t *)realloc(heap, (size_t)hcap * sizeof(cand_t));
                if (!h) { free(heap); scratch_free(&s); return -1; }
                heap = h;
            }
            for (int64_t j = 0; j < nk; j++) {
                cand_t c;
                c.q = cur.q * (double)s.kids[j].cnt / (double)cur.cnt;
                c.tok = s.kids[j].tok;
                c.seq = seq++;
                c.ends_off = s.kids[j].off;
                c.cnt = s.kids[j].cnt;
                c.depth = cur.depth + 1;
                c.parent = n - 1;       /* the node just taken (-1 for the root) */
                c.plen = cur.plen + 1;
                heap_push(heap, &hn, c);
            }
        }
        have = 0;
        if (hn && n < max_nodes) {
            cur = heap_pop(heap, &hn);
            out_tok[n] = cur.tok;
            out_prob[n] = cur.q;
            out_parent[n] = cur.parent;
            n++;
            have = n < max_nodes;       /* else its children are never taken */
        }
    }
    free(heap);
    scratch_free(&s);
    return n;
}

/* A request's context draft in one call (ContextIndex.draft: match, then expansion).
 * arr[n]: the context. The match: the longest m <= hi such that arr[n-m:] also occurs ending at
 * some e < n - 1 (so it has a continuation); the node's occurrences are those e and n - 1 (the
 * context's end, which continues nothing). m < min_match: no draft. The length cap is
 * min(budget, floor(factor * m + offset)) (Python's float arithmetic; <= 0: no draft). Then the
 * tree (tree != 0: max_nodes = budget, paths of at most the cap) or the chain (at most the cap).
 * Writes the match length to *out_m (0 if none) and returns the tokens written (-1: no memory). */
int64_t context_draft(const int64_t *arr, int64_t n, int64_t hi, int64_t min_match, double factor,
                      double offset, int64_t budget, int64_t tree, int64_t max_depth, double min_prob,
                      int64_t *out_m, int64_t *out_tok, double *out_prob, int64_t *out_parent) {
    *out_m = 0;
    if (hi <= 0 || n < 2) return 0;
    int64_t last = arr[n - 1], best = 0, k = 0;
    int64_t *ends = (int64_t *)malloc((size_t)n * sizeof(int64_t));
    if (!ends) return -1;
    for (int64_t e = 0; e < n - 1; e++) {                    /* occurrences of the last token */
        if (arr[e] != last) continue;
        int64_t L = 1;
        while (L < hi && e >= L && arr[e - L] == arr[n - 1 - L]) L++;
        if (L > best) { best = L; k = 0; }
        if (L == best) ends[k++] = e;
    }
    *out_m = best;
    if (best == 0 || best < min_match) { free(ends); return 0; }
    double capf = floor(factor * (double)best + offset);
    int64_t cap = capf < (double)budget ? (int64_t)capf : budget;
    if (cap <= 0) { free(ends); return 0; }
    ends[k++] = n - 1;                                       /* the end: counted, no continuation */
    int64_t r = tree ? expand_tree(arr, n, INT64_MIN, ends, k, best, max_depth, budget, cap, min_prob,
                                   out_tok, out_prob, out_parent)
                     : expand_chain(arr, n, INT64_MIN, ends, k, best, max_depth, cap, min_prob, out_tok, out_prob);
    free(ends);
    return r;
}

/* CorpusIndex._search past the trigram (its longest-match rule): occ[k], the end positions of the
 * context's last 3 tokens in arr (ascending); ctx[n_ctx] the context. Each occurrence's match
 * length L (3 <= L <= hi: arr[e - l] == ctx[n_ctx - 1 - l] for l < L; a separator matches no
 * token, so a match never crosses into another stream); m = the largest L over the occurrences
 * that continue (arr[e + 1] is a token: not sep, e + 1 < n_valid). Writes the occurrences with
 * L >= m to out_ends (ascending) and m to *out_m; returns how many (0 and *out_m = 0 when no
 * occurrence continues). */
int64_t corpus_match(const int64_t *arr, int64_t n_valid, int64_t sep, const int64_t *occ, int64_t k,
                     const int64_t *ctx, int64_t n_ctx, int64_t hi, int64_t *out_m, int64_t *out_ends) {
    int64_t best = 0, cnt = 0;
    *out_m = 0;
    for (int64_t i = 0; i < k; i++) {                        /* the best over continued occurrences */
        int64_t e = occ[i];
        if (e + 1 >= n_valid || arr[e + 1] == sep) continue;
        int64_t L = 3;
        while (L < hi && e >= L && arr[e - L] == ctx[n_ctx - 1 - L]) L++;
        if (L > best) best = L;
    }
    if (!best) return 0;
    for (int64_t i = 0; i < k; i++) {                        /* every occurrence that long */
        int64_t e = occ[i], L = 3;
        while (L < best && e >= L && arr[e - L] == ctx[n_ctx - 1 - L]) L++;
        if (L >= best) out_ends[cnt++] = e;
    }
    *out_m = best;
    return cnt;
}

/* The tree masks of a verify batch (SGLang's NGRAM layout): request b has k[b] draft nodes after
 * its root (node 0), node i + 1's parent given by parents[...] (flat, k[b] entries per request in
 * order; -1: the root). Writes out[bs * n * n] (row-major, 0/1 bytes): row i of request b marks node
 * i and its ancestors; a node past k[b] + 1 is unused: a leaf under the root. Returns 0, or -1 when a
 * parent is not an earlier node (or k[b] >= n). */
int64_t tree_masks(const int64_t *parents, const int64_t *k, int64_t bs, int64_t n, uint8_t *out) {
    int64_t off = 0;
    for (int64_t b = 0; b < bs; b++) {
        uint8_t *m = out + b * n * n;
        int64_t kb = k[b];
        if (kb < 0 || kb >= n) return -1;
        memset(m, 0, (size_t)(n * n));
        m[0] = 1;
        for (int64_t i = 0; i < kb; i++) {
            int64_t node = i + 1, par = parents[off + i] + 1;
            if (par < 0 || par >= node) return -1;
            memcpy(m + node * n, m + par * n, (size_t)n);
            m[node * n + node] = 1;
        }
        for (int64_t u = kb + 1; u < n; u++) {
            m[u * n] = 1;
            m[u * n + u] = 1;
        }
        off += kb;
    }
    return 0;
}
