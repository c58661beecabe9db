"""Model-free suffix drafter for speculative decoding over completed trajectories (SuffixDecoding).

Index: a depth-bounded suffix trie with occurrence counts (:class:`SuffixTrie`). Every substring
of an indexed token sequence of length ``<= max_depth`` is one path from the root; a node's
``count`` is the number of occurrences of its string in everything indexed, so the empirical
probability that string ``s`` continues with token ``c`` is ``count(s + c) / count(s)``.
Adding a sequence of ``n`` tokens costs ``O(n * max_depth)`` dictionary operations; removing it
(FIFO eviction under a token budget) costs the same and restores the exact trie that was there
without it.

:class:`SuffixDrafter` keeps one index per group (a task's earlier samples: this step's finished
ones and earlier steps'), one global index over all groups (:class:`CorpusIndex`: drafted from
exactly as such a trie would be, from n-gram occurrence lists, so indexing costs ``O(1)``
dictionary operations per token), and for each request its own context
(:class:`ContextIndex`: the prompt, then every accepted token; drafted from exactly as a trie of it
would be, but computed from occurrence positions, so appending costs ``O(1)`` per token instead of
``O(max_depth)`` dictionary operations). A draft:

1. *match*: the longest suffix of the context (at most ``max_depth - budget`` tokens, so that
   the draft fits below the depth bound) that is a path of the trie with a continuation, found
   by binary search on its length (monotone: a suffix of a continued string is continued at the
   same place) -> ``O(max_depth log max_depth)`` lookups;
2. *expand* greedily along the most frequent child while the product of the continuation
   probabilities stays ``>= min_token_prob``, up to ``min(budget, floor(max_spec_factor * m +
   max_spec_offset))`` tokens for a match of length ``m`` (a long match earns a long draft) and
   never below the trie's depth;
   (with ``tree``: a best-first tree of up to ``budget`` nodes instead, SuffixDecoding's tree
   form, each path capped the same way);
3. *choose* among the candidates of the request's own context, its group and the global trie the
   one with the largest score = sum of the cumulative probabilities (the expected number of
   accepted tokens if the estimates were right); ties go to the more local source.

Every draft is a continuation seen in the index: ``context[-match_len:] + draft`` is a substring
of one indexed sequence (or of the context itself) -- tested against a brute-force reference.
Units: tokens are ints, latencies seconds.
"""
from __future__ import annotations

import heapq
import itertools
import logging
import math
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Hashable, Sequence

import numpy as np

log = logging.getLogger(__name__)
_VERSIONS = itertools.count(1)      # trie versions, unique across tries
_SEP = -(1 << 62)                   # CorpusIndex's trajectory separator (no token id)


@dataclass
class DrafterConfig:
    """``max_depth``: longest indexed substring (tokens); ``budget``: most draft tokens per call;
    ``max_spec_factor``/``max_spec_offset``: draft length cap ``factor * match_len + offset``;
    ``min_token_prob``: stop expanding below this cumulative probability; ``min_match``: shortest
    context match that may draft; ``max_indexed_tokens``: FIFO eviction of whole trajectories
    beyond this many indexed tokens (0: no limit); ``use_global``: also draft from other groups;
    ``tree``: draft a tree of up to ``budget`` nodes (best-first by cumulative probability, each
    path capped like a chain) instead of one chain, for tree verification (SGLang's NGRAM path)."""

    max_depth: int = 64
    budget: int = 16
    max_spec_factor: float = 1.0
    max_spec_offset: float = 0.0
    min_token_prob: float = 0.1
    min_match: int = 1
    max_indexed_tokens: int = 0
    use_global: bool = True
    tree: bool = False

    def __post_init__(self):
        for name in ("max_depth", "budget", "min_match"):
            if getattr(self, name) < 1:
                raise ValueError(f"DrafterConfig.{name} must be >= 1, got {getattr(self, name)}")
        if not 0.0 <= self.min_token_prob <= 1.0:
            raise ValueError(f"DrafterConfig.min_token_prob must be in [0, 1], got {self.min_token_prob}")
        if self.max_indexed_tokens < 0:
            raise ValueError(f"DrafterConfig.max_indexed_tokens must be >= 0, got {self.max_indexed_tokens}")


@dataclass
class Draft:
    """A proposal: ``tokens`` ``[k]``, ``probs`` ``[k]`` (cumulative estimated probability that the
    first ``i+1`` tokens are accepted), ``match_len`` (context tokens matched), ``score``
    (``sum(probs)``), ``source`` (``context``, ``group`` or ``global``; ``""`` when empty)."""

    tokens: list[int] = field(default_factory=list)
    probs: list[float] = field(default_factory=list)
    match_len: int = 0
    score: float = 0.0
    source: str = ""
    parents: list[int] | None = None

    def __len__(self) -> int:
        return len(self.tokens)

    def paths(self) -> list[list[int]]:
        """Root-to-leaf token paths: ``[tokens]`` for a chain; for a tree (``parents[i]``: index of
        node ``i``'s parent, -1 for a child of the root; parents come first) one per leaf."""
        if not self.tokens:
            return []
        if self.parents is None:
            return [list(self.tokens)]
        inner = set(self.parents)
        out = []
        for i in range(len(self.tokens)):
            if i in inner:
                continue
            path, j = [], i
            while j >= 0:
                path.append(self.tokens[j])
                j = self.parents[j]
            out.append(path[::-1])
        return out


def _group_by_token(toks: np.ndarray, pos: np.ndarray, small: int) -> dict:
    """Positions ``pos`` ``[n]`` grouped by their tokens ``toks`` ``[n]``: token -> its positions in
    input order (a numpy array when more than ``small``, else a list)."""
    order = np.argsort(toks, kind="stable")
    ts, ps = toks[order], pos[order]
    cut = np.flatnonzero(np.diff(ts)) + 1
    starts, stops, tl = [0, *cut.tolist()], [*cut.tolist(), len(ts)], ts.tolist()
    return {tl[i]: (ps[i:j] if j - i > small else ps[i:j].tolist()) for i, j in zip(starts, stops)}


class SuffixTrie:
    """Suffix trie of bounded depth with occurrence counts; node 0 is the root.

    ``children[v]``: token -> child node; ``count[v]``: occurrences of node ``v``'s string
    (the root counts indexed tokens). Freed nodes are recycled.
    """

    def __init__(self, max_depth: int = 64):
        if max_depth < 1:
            raise ValueError(f"max_depth must be >= 1, got {max_depth}")
        self.max_depth = int(max_depth)
        self.children: list[dict[int, int]] = [{}]
        self.count: list[int] = [0]
        self._free: list[int] = []
        self.version = next(_VERSIONS)   # renewed by every change (invalidates cached match states)
        self._memo: dict[tuple, tuple] = {}    # (node, m, cap, budget, tree, min_prob) -> expansion
        self._memo_version = -1

    @property
    def num_nodes(self) -> int:
        return len(self.count) - len(self._free)

    def _child(self, v: int, t: int) -> int:
        c = self.children[v].get(t)
        if c is None:
            if self._free:
                c = self._free.pop()
                self.children[c], self.count[c] = {}, 0
            else:
                c = len(self.count)
                self.children.append({})
                self.count.append(0)
            self.children[v][t] = c
        return c

    def extend(self, tokens: Sequence[int], frontier: list[int] | None = None) -> list[int]:
        """Index ``tokens`` as the continuation of a stream whose current ``frontier`` (the nodes of
        its suffixes of length 1, 2, ... ending at its last token; ``None``/empty: a new stream) is
        given; returns the new frontier. ``O(len(tokens) * max_depth)``."""
        front = list(frontier or [])
        self.version = next(_VERSIONS)
        d, children, count, free = self.max_depth, self.children, self.count, self._free
        for t in tokens:
            t = int(t)
            count[0] += 1
            new = []
            for v in [0, *front[:d - 1]]:           # inlined _child: this loop is the indexing cost
                ch = children[v]
                c = ch.get(t)
                if c is None:
                    if free:
                        c = free.pop()
                        children[c], count[c] = {}, 0
                    else:
                        c = len(count)
                        children.append({})
                        count.append(0)
                    ch[t] = c
                count[c] += 1
                new.append(c)
            front = new
        return front

    def add(self, tokens: Sequence[int]) -> None:
        """Index every substring of ``tokens`` of length ``<= max_depth``."""
        self.extend(tokens)

    def remove(self, tokens: Sequence[int]) -> None:
        """Undo :meth:`add` of the same ``tokens`` (nodes whose count drops to 0 are freed)."""
        d, children, count = self.max_depth, self.children, self.count
        self.version = next(_VERSIONS)
        front: list[int] = []          # node of each suffix ending at the previous token
        for t in tokens:
            t = int(t)
            count[0] -= 1
            parents = [0] + front[:d - 1]
            new = []
            for p in parents:
                c = children[p].get(t)
                if c is None:
                    raise ValueError("remove(): these tokens were not added to this trie")
                new.append(c)
            for p, c in zip(parents, new):
                count[c] -= 1
                if count[c] == 0:       # count(child) <= count(parent): its subtree empties too
                    del children[p][t]
                    self._free.append(c)
            front = new                 # freed ids keep their child maps until reused

    def walk(self, tokens: Sequence[int]) -> int:
        """The node of string ``tokens`` (-1 if absent or longer than ``max_depth``)."""
        if len(tokens) > self.max_depth:
            return -1
        v, children = 0, self.children
        for t in tokens:
            v = children[v].get(int(t), -1)
            if v < 0:
                return -1
        return v

    def longest_match(self, context: Sequence[int], max_len: int) -> tuple[int, int]:
        """``(m, node)``: the longest suffix ``context[-m:]`` (``m <= max_len``) that is a path
        with at least one continuation (a child), by binary search on ``m``: the property is
        monotone (a suffix of a continued string is continued at the same place); ``(0, 0)`` if
        none."""
        hi = min(len(context), max_len, self.max_depth - 1)
        lo, node = 0, 0
        if hi <= 0 or not self.children[0]:
            return 0, 0
        n = len(context)
        while lo < hi:
            mid = (lo + hi + 1) // 2
            v = self.walk(context[n - mid:])
            if v >= 0 and self.children[v]:
                lo, node = mid, v
            else:
                hi = mid - 1
        return lo, node

    def expand(self, node: int, depth: int, max_tokens: int, min_prob: float) -> tuple[list[int], list[float]]:
        """Greedy most-frequent-child path from ``node`` (at ``depth``): tokens and cumulative
        probabilities, stopping at ``max_tokens``, the trie's depth, or a cumulative probability
        below ``min_prob``. Ties between children go to the smaller token id."""
        toks: list[int] = []
        probs: list[float] = []
        p = 1.0
        children, count = self.children, self.count
        while len(toks) < max_tokens and depth < self.max_depth:
            ch = children[node]
            if not ch:
                break
            best_t, best_c = None, -1
            for t, c in ch.items():
                n = count[c]
                if n > best_c or (n == best_c and t < best_t):
                    best_t, best_c = t, n
            q = p * best_c / count[node]
            if q < min_prob:
                break
            p = q
            node, depth = ch[best_t], depth + 1
            toks.append(best_t)
            probs.append(p)
        return toks, probs

    def expand_tree(self, node: int, depth: int, max_nodes: int, max_len: int,
                    min_prob: float) -> tuple[list[int], list[float], list[int]]:
        """Best-first tree from ``node`` (at ``depth``): repeatedly take the candidate continuation
        with the largest cumulative probability (ties: smaller token, then earlier), up to
        ``max_nodes`` nodes, paths of at most ``max_len`` tokens, never below the trie's depth or
        ``min_prob``. Returns tokens, cumulative probabilities and parent indices (-1: root), in the
        order taken (a parent before its children; probabilities non-increasing)."""
        children, count = self.children, self.count
        heap: list[tuple[float, int, int, int, int, int, int]] = []
        seq = itertools.count()

        def push(v: int, d: int, parent: int, p: float, plen: int) -> None:
            if plen >= max_len or d >= self.max_depth:
                return
            n = count[v]
            for t, c in children[v].items():
                q = p * count[c] / n
                if q >= min_prob:
                    heapq.heappush(heap, (-q, t, next(seq), c, d + 1, parent, plen + 1))

        toks: list[int] = []
        probs: list[float] = []
        parents: list[int] = []
        push(node, depth, -1, 1.0, 0)
        while heap and len(toks) < max_nodes:
            nq, t, _, c, d, parent, plen = heapq.heappop(heap)
            parents.append(parent)
            toks.append(t)
            probs.append(-nq)
            if len(toks) < max_nodes:            # else the loop ends: its children are never taken
                push(c, d, len(toks) - 1, -nq, plen)
        return toks, probs, parents

    def match_from(self, context: Sequence[int], max_len: int, state: list | None) -> tuple[int, int]:
        """:meth:`longest_match`, reusing ``state`` = ``[version, context length, m, node,
        max_len]`` of an earlier call on a prefix of the same context (updated in place). If the
        trie and ``max_len`` are unchanged and the old match extends by the ``j`` new tokens to a
        continued node of length ``<= max_len``, that is the longest match (a longer one would end
        in a match longer than ``m`` before the new tokens); otherwise the longest match is at
        most ``m + j`` long (same argument), found by binary search on ``[0, min(hi, m + j)]``.
        ``context`` holds ints (no conversion)."""
        n = len(context)
        hi = min(n, max_len, self.max_depth - 1)
        children = self.children
        if state is not None and state[0] == self.version and state[4] == max_len and 0 <= n - state[1]:
            j = n - state[1]
            if state[2] > 0 and state[2] + j <= hi:
                v = state[3]
                for t in context[state[1]:]:
                    v = children[v].get(t, -1)
                    if v < 0:
                        break
                if v >= 0 and children[v]:
                    m = state[2] + j
                    state[1:4] = [n, m, v]
                    return m, v
            hi = min(hi, state[2] + j)
        lo, node = 0, 0
        if hi > 0 and children[0]:
            while lo < hi:
                mid = (lo + hi + 1) // 2
                v = 0
                for t in context[n - mid:]:
                    v = children[v].get(t, -1)
                    if v < 0:
                        break
                if v >= 0 and children[v]:
                    lo, node = mid, v
                else:
                    hi = mid - 1
        if state is not None:
            state[:] = [self.version, n, lo, node, max_len]
        return lo, node

    def draft(self, context: Sequence[int], cfg: DrafterConfig, budget: int | None = None,
              source: str = "", state: list | None = None) -> Draft:
        """The draft of this trie alone for ``context`` (see the module docstring); ``state``:
        a per-request match cache (:meth:`match_from`). The expansion from a matched node is
        memoised while the trie is unchanged (requests of a batch often match the same node)."""
        budget = cfg.budget if budget is None else budget
        # leave room for the draft below the depth bound
        m, node = self.match_from(context, max(1, self.max_depth - budget), state)
        if m < cfg.min_match:
            return Draft()
        cap = min(budget, int(math.floor(cfg.max_spec_factor * m + cfg.max_spec_offset)))
        if cap <= 0:
            return Draft()
        if self._memo_version != self.version or len(self._memo) > 4096:
            self._memo.clear()
            self._memo_version = self.version
        key = (node, m, cap, budget, cfg.tree, cfg.min_token_prob)
        hit = self._memo.get(key)
        if hit is None:
            if cfg.tree:
                hit = self.expand_tree(node, m, budget, cap, cfg.min_token_prob)
            else:
                hit = (*self.expand(node, m, cap, cfg.min_token_prob), None)
            self._memo[key] = hit
        toks, probs, parents = hit
        return Draft(list(toks), list(probs), m, float(sum(probs)), source if toks else "",
                     None if parents is None else list(parents))


class _OccurrenceExpansion:
    """``SuffixTrie.expand`` / ``expand_tree`` over a node given by its occurrence end positions
    (``ends``, ``count`` = its trie count): shared by :class:`ContextIndex` and
    :class:`CorpusIndex`, which define ``_kids(ends, depth) -> {token: child ends}``."""

    max_depth: int

    def _kids(self, ends, depth: int) -> dict:
        raise NotImplementedError

    def _expand(self, ends, count: int, depth: int, max_tokens: int, min_prob: float):
        """``SuffixTrie.expand`` from the node (``ends``, ``count``) at ``depth``."""
        toks: list[int] = []
        probs: list[float] = []
        p, D = 1.0, self.max_depth
        while len(toks) < max_tokens and depth < D:
            ch = self._kids(ends, depth)
            if not ch:
                break
            best_t, best_c = None, -1
            for t, e in ch.items():                    # ties: the smaller token, as SuffixTrie.expand
                c = len(e)
                if c > best_c or (c == best_c and t < best_t):
                    best_t, best_c = t, c
            q = p * best_c / count
            if q < min_prob:
                break
            p = q
            ends, count, depth = ch[best_t], best_c, depth + 1
            toks.append(best_t)
            probs.append(p)
        return toks, probs

    def _expand_tree(self, ends, count: int, depth: int, max_nodes: int, max_len: int, min_prob: float):
        """``SuffixTrie.expand_tree`` from the node (``ends``, ``count``) at ``depth`` (same heap
        keys: probability, token, push order)."""
        heap: list = []
        seq = itertools.count()
        D = self.max_depth

        def push(e, c: int, d: int, parent: int, p: float, plen: int) -> None:
            if plen >= max_len or d >= D:
                return
            for t, ce in self._kids(e, d).items():
                q = p * len(ce) / c
                if q >= min_prob:
                    heapq.heappush(heap, (-q, t, next(seq), ce, d + 1, parent, plen + 1))

        toks: list[int] = []
        probs: list[float] = []
        parents: list[int] = []
        push(ends, count, depth, -1, 1.0, 0)
        while heap and len(toks) < max_nodes:
            nq, t, _, ce, d, parent, plen = heapq.heappop(heap)
            parents.append(parent)
            toks.append(t)
            probs.append(-nq)
            if len(toks) < max_nodes:
                push(ce, len(ce), d, len(toks) - 1, -nq, plen)
        return toks, probs, parents


class ContextIndex(_OccurrenceExpansion):
    """One request's own context (prompt, then accepted tokens), drafted from as a depth-bounded
    suffix trie of it would be, without building one.

    ``extend(tokens)`` appends (``O(len(tokens))``: the tokens go into a list and a numpy buffer);
    ``tokens`` is the full context so far. :meth:`draft` returns exactly what
    ``SuffixTrie(max_depth)`` holding every substring of ``tokens`` would draft for ``tokens``
    (``SuffixTrie.draft``: same match, counts, probabilities, tie-breaks and float arithmetic),
    computing the few trie nodes a draft visits from occurrence positions instead: a node is the
    set of end positions of its string in the context (its count is their number), its children
    are the tokens following those positions. Indexing the context in a trie cost
    ``O(tokens * max_depth)`` dictionary operations in the scheduler loop (tens of ms per 1K
    tokens at depth 32 in Python, docs/war.md); a draft here costs one vectorised scan of the
    context (int64 ``[n]``) plus work proportional to the occurrences it visits."""

    _SMALL = 32          # occurrence sets up to this size are handled in Python, larger in numpy

    def __init__(self, max_depth: int, prompt: Sequence[int] = ()):
        if max_depth < 1:
            raise ValueError(f"max_depth must be >= 1, got {max_depth}")
        self.max_depth = int(max_depth)
        self.tokens: list[int] = []
        self._arr = np.zeros(max(64, len(prompt) * 2), dtype=np.int64)   # tokens [capacity]; first n valid
        self._rev = np.arange(self.max_depth, dtype=np.int64)              # 0 .. max_depth-1
        self.match_state: dict[int, list] = {}        # id(trie) -> its match_from state (other sources)
        self._last: tuple[int, int, int] | None = None   # (context length, match length, cap) of the last draft
        self.extend(prompt)

    def extend(self, tokens: Sequence[int]) -> None:
        toks = [int(t) for t in tokens]
        n, k = len(self.tokens), len(toks)
        if n + k > len(self._arr):
            arr = np.zeros(max(2 * len(self._arr), n + k), dtype=np.int64)
            arr[:n] = self._arr[:n]
            self._arr = arr
        if k:
            self._arr[n:n + k] = toks
        self.tokens += toks

    # -- the context trie's nodes, computed from occurrence positions ----------------------------
    def _match(self, hi: int, cap: int):
        """Longest ``m <= hi`` such that ``tokens[-m:]`` occurs ending at some ``e < n - 1`` (a
        trie path with a child); returns ``(m, ends)``, ``ends``: those ``e`` (ascending; int64
        array or list) -- the node's occurrences but the one at the context's end; ``(0, None)``.
        ``cap``: the length bound other than ``n`` (``min(max_len, max_depth - 1)``). Reuses the
        last call's ``(n0, m0)`` under the same ``cap``: with ``j`` tokens appended since, the
        match is at most ``m0 + j`` long (its prefix without them was a continued match then)."""
        n, a = len(self.tokens), self._arr
        st = self._last
        if st is not None and st[2] == cap and n >= st[0]:
            hi = min(hi, st[1] + n - st[0])
        m, ends = self._match_upto(hi, n, a)
        self._last = (n, m, cap)
        return m, ends

    def _match_upto(self, hi: int, n: int, a):
        if hi <= 0 or n < 2:
            return 0, None
        last = a[n - 1]
        if hi == 1 or n < 3:
            e = np.flatnonzero(a[:n - 1] == last)
            return (1, e) if len(e) else (0, None)
        eq1 = a[1:n - 1] == last                           # e = i + 1 for i in [0, n-2)
        e = np.flatnonzero(eq1 & (a[:n - 2] == a[n - 2])) + 1    # continued occurrences of the bigram
        if not len(e):
            if eq1.any() or a[0] == last:
                return 1, np.flatnonzero(a[:n - 1] == last)
            return 0, None
        if hi == 2:
            return 2, e
        if len(e) > self._SMALL:
            r = self._rev[2:hi]
            idx = e[:, None] - r                            # [k, hi-2]: e-2, ..., e-hi+1
            ok = idx >= 0
            eq = (a[np.where(ok, idx, 0)] == a[n - 1 - r]) & ok
            lens = np.cumprod(eq, axis=1).sum(axis=1)       # matched length beyond the bigram
            m = int(lens.max())
            return m + 2, e[lens == m]
        tk = self.tokens
        best, ends = 0, []
        for x in e.tolist():
            L = 2
            while L < hi and x >= L and tk[x - L] == tk[n - 1 - L]:
                L += 1
            if L > best:
                best, ends = L, [x]
            elif L == best:
                ends.append(x)
        return best, ends

    def _kids(self, ends, depth: int) -> dict:
        return self._children(ends, len(self.tokens))

    def _children(self, ends, n: int):
        """Children of the node whose occurrences end at ``ends`` (ascending; numpy or list):
        ``{token: child ends}`` (ascending ends; dict order unspecified: callers break ties by
        token as the trie does). Occurrences at ``n - 1`` (the context's end) have no
        continuation."""
        if len(ends) > self._SMALL:
            nxt = np.asarray(ends)
            if len(nxt) and nxt[-1] >= n - 1:
                nxt = nxt[:-1]
            if not len(nxt):
                return {}
            nxt = nxt + 1
            toks = self._arr[nxt]
            return _group_by_token(toks, nxt, self._SMALL)
        out: dict[int, list[int]] = {}
        tk = self.tokens
        for x in ends:
            if x < n - 1:
                t = tk[x + 1]
                lst = out.get(t)
                if lst is None:
                    out[t] = [x + 1]
                else:
                    lst.append(x + 1)
        return out

    def draft(self, cfg: "DrafterConfig", budget: int | None = None, source: str = "context",
              beat: float | None = None) -> "Draft | None":
        """``SuffixTrie(max_depth).draft(tokens, cfg, budget, source)`` of a trie holding this
        context, bitwise (tokens, probabilities, parents, match length, score). ``beat``: return
        ``None`` instead when the draft's score provably stays below ``beat``: a draft of paths of
        at most ``cap`` tokens scores at most ``cap`` (the cumulative probabilities of one path
        length sum to <= 1), so the expansion is skipped when ``cap < beat`` (with a float margin)."""
        budget = cfg.budget if budget is None else budget
        D, n = self.max_depth, len(self.tokens)
        max_len = max(1, D - budget)
        m, ends = self._match(min(n, max_len, D - 1), min(max_len, D - 1))
        if m < cfg.min_match:
            return Draft()
        cap = min(budget, int(math.floor(cfg.max_spec_factor * m + cfg.max_spec_offset)))
        if cap <= 0:
            return Draft()
        if beat is not None and cap * (1.0 + 1e-9) + 1e-9 < beat:
            return None
        count0 = len(ends) + 1                           # + the occurrence at the context's end
        if cfg.tree:
            toks, probs, parents = self._expand_tree(ends, count0, m, budget, cap, cfg.min_token_prob)
            return Draft(toks, probs, m, float(sum(probs)), source if toks else "", parents)
        toks, probs = self._expand(ends, count0, m, cap, cfg.min_token_prob)
        return Draft(toks, probs, m, float(sum(probs)), source if toks else "")


class CorpusIndex(_OccurrenceExpansion):
    """Completed trajectories (a group's or all of them), drafted from exactly as a
    ``SuffixTrie(max_depth)`` holding them would be (``SuffixTrie.draft``: same match, counts,
    probabilities, tie-breaks and float arithmetic), without building one.

    The tokens are concatenated, each trajectory preceded by a separator (``SEP``, a value no
    token takes), into a list and a numpy buffer; every position is appended to the occurrence list
    of the 1-, 2- and 3-gram ending there (inside one trajectory), and each new 2-/3-gram adds its
    last token to its prefix's successors, so indexing costs ~3 dictionary operations per token
    instead of ``max_depth`` (the trie; ~0.6 vs ~8.5 us per token here). A trie node is the set of
    end positions of its string (its ``count``: their number), its children the tokens after them
    (not a separator nor past the indexed end): for strings of up to 2 tokens the successors'
    occurrence lists, longer ones grouped from the positions (Python, or numpy beyond ``_SMALL``).
    The match: the longest suffix of up to 3 tokens with a successor (or a continued trigram
    occurrence), then the trigram's occurrences filtered by the earlier tokens one length at a
    time; reusing the last call's match while the index is unchanged, as ``SuffixTrie.match_from``.
    Same streaming interface as the trie (``extend(tokens, frontier) -> frontier``, streams one
    after another; ``remove(tokens)`` of the oldest, FIFO); removed positions leave the lists and
    the buffer is compacted once they dominate. Tested against the trie on random inputs."""

    _SMALL = 128         # occurrence sets up to this size are handled in Python, larger in numpy
    _COMPACT = 4096      # compact once more than this many (and half the) positions are removed
    SEP = _SEP

    def __init__(self, max_depth: int = 64):
        if max_depth < 1:
            raise ValueError(f"max_depth must be >= 1, got {max_depth}")
        self.max_depth = int(max_depth)
        self.version = next(_VERSIONS)
        self._reset()

    def _reset(self) -> None:
        self._arr = np.full(1024, self.SEP, dtype=np.int64)   # [capacity]; first _n valid, the rest SEP
        self._tk: list[int] = [self.SEP, self.SEP]             # the same as a list, plus one SEP past the end
        self._n = 1                                            # position 0: a separator
        self._occ: dict[tuple, list[int]] = {}                 # n-gram (n <= 3) -> end positions (ascending)
        self._succ: dict[tuple, list[int]] = {}                # n-gram (n < 3) -> the tokens that follow it
        self._npc: dict = {}                                   # key -> numpy copy of a long list
        self._segs: deque[tuple[int, int]] = deque()           # [start, end) of complete-or-open streams
        self._open = None                                      # id of the open stream (its segment is last)
        self._dead = 0                                         # positions below this were removed
        self.num_tokens = 0                                    # indexed tokens (the trie's root count)
        self._memo: dict[tuple, tuple] = {}
        self._memo_version = -1

    # -- indexing ----------------------------------------------------------------------------------
    def extend(self, tokens: Sequence[int], frontier=None):
        """Index ``tokens`` as the continuation of the stream ``frontier`` (what the last call for
        it returned; ``None``: a new stream, which closes any open one); returns the stream's new
        frontier. Streams are indexed one after another. ``O(len(tokens))``."""
        toks = [int(t) for t in tokens]
        if _SEP in toks:
            raise ValueError(f"CorpusIndex: token {_SEP} is reserved (the separator)")
        self.version = next(_VERSIONS)
        if frontier is None or frontier != self._open:
            if frontier is not None:
                raise ValueError("CorpusIndex.extend(): streams must be indexed one after another")
            if self._tk[self._n - 1] != self.SEP:               # close the last stream
                self._n += 1
                self._tk.append(self.SEP)
            self._open = next(_VERSIONS)
            self._segs.append((self._n, self._n))
        k, p0 = len(toks), self._n
        if not k:
            return self._open
        if p0 + k + 2 > len(self._arr):
            arr = np.full(max(2 * len(self._arr), p0 + k + 2), self.SEP, dtype=np.int64)
            arr[:p0] = self._arr[:p0]
            self._arr = arr
        self._arr[p0:p0 + k] = toks
        tk = self._tk
        prev = tk[p0 - 1]
        tk.pop()
        tk += toks
        tk.append(self.SEP)
        occ, succ = self._occ, self._succ
        sep = _SEP
        a1 = tk[p0 - 2] if prev != sep else sep              # the two tokens before (sep: none)
        a2 = prev
        for p, t in enumerate(toks, p0):
            key = (t,)
            lst = occ.get(key)
            if lst is None:
                occ[key] = [p]
            else:
                lst.append(p)
            if a2 != sep:
                key = (a2, t)
                lst = occ.get(key)
                if lst is None:
                    occ[key] = [p]
                    self._add_succ((a2,), t)
                else:
                    lst.append(p)
                if a1 != sep:
                    key = (a1, a2, t)
                    lst = occ.get(key)
                    if lst is None:
                        occ[key] = [p]
                        self._add_succ((a1, a2), t)
                    else:
                        lst.append(p)
            a1, a2 = a2, t
        self._n = p0 + k
        s, _ = self._segs[-1]
        self._segs[-1] = (s, self._n)
        self.num_tokens += k
        return self._open

    def add(self, tokens: Sequence[int]) -> None:
        self.extend(tokens)

    def _add_succ(self, key: tuple, t: int) -> None:
        nxt = self._succ.get(key)
        if nxt is None:
            self._succ[key] = [t]
        else:
            nxt.append(t)

    def remove(self, tokens: Sequence[int]) -> None:
        """Undo the indexing of the oldest trajectory, which must be ``tokens``."""
        toks = [int(t) for t in tokens]
        if not self._segs:
            raise ValueError("remove(): these tokens were not added to this index")
        s, e = self._segs[0]
        if self._tk[s:e] != toks:
            raise ValueError("remove(): these tokens were not added to this index (as the oldest)")
        self.version = next(_VERSIONS)
        self._segs.popleft()
        if not self._segs:
            self._open = None
        cnt: dict[tuple, int] = {}                # n-gram -> its end positions in the trajectory
        for i in range(len(toks)):
            for n in range(1, min(3, i + 1) + 1):
                key = tuple(toks[i + 1 - n:i + 1])
                cnt[key] = cnt.get(key, 0) + 1
        occ, succ = self._occ, self._succ
        for key, c in cnt.items():                # its positions are the first c of each list
            lst = occ[key]
            if c < len(lst):
                del lst[:c]
                continue
            del occ[key]
            if len(key) > 1:
                nxt = succ[key[:-1]]
                nxt.remove(key[-1])
                if not nxt:
                    del succ[key[:-1]]
        self._npc.clear()
        self.num_tokens -= len(toks)
        self._dead = e
        if not self._segs:
            self._reset()
        elif self._dead > self._COMPACT and self._dead > self._n - self._dead:
            self._compact()

    def _compact(self) -> None:
        """Re-index the live streams from position 1 (amortised ``O(1)`` per removed token); the
        last one stays open under the same frontier."""
        live, opened = self.trajectories(), self._open
        self._reset()
        for toks in live:
            self.extend(toks)
        self._open = opened

    def trajectories(self) -> list[list[int]]:
        """The indexed streams (oldest first; the last possibly partly indexed)."""
        return [self._tk[s:e] for s, e in self._segs]

    def to_trie(self) -> SuffixTrie:
        """A :class:`SuffixTrie` holding the same streams (tests)."""
        trie = SuffixTrie(self.max_depth)
        for toks in self.trajectories():
            trie.add(toks)
        return trie

    # -- the trie's nodes, computed from occurrence positions --------------------------------------
    def _np(self, key, lst):
        arr = self._npc.get(key)          # lists only grow between removals (which clear this)
        if arr is None:
            arr = self._npc[key] = np.array(lst, dtype=np.int64)
        elif len(arr) != len(lst):
            arr = self._npc[key] = np.concatenate((arr, np.array(lst[len(arr):], dtype=np.int64)))
        return arr

    def _continued(self, ends) -> bool:
        """Whether some occurrence in ``ends`` (of a string longer than 2) continues."""
        tk = self._tk
        for x in ends[:8]:                       # usually the first ones do
            if tk[x + 1] != _SEP:
                return True
        if len(ends) <= 8:
            return False
        if isinstance(ends, np.ndarray):
            return bool((self._arr[ends[8:] + 1] != self.SEP).any())
        return any(tk[x + 1] != _SEP for x in ends[8:])

    def _ends(self, key):
        """The occurrence list of an n-gram (live: read it, never change it)."""
        return self._occ[key]

    def _search(self, ctx: Sequence[int], hi: int):
        """Longest ``m <= hi`` such that ``ctx[-m:]`` has a continued occurrence; ``(m, ends)``
        with ``ends`` all its occurrences (ascending), ``(0, None)`` if none. Up to 3 tokens: an
        n-gram with a successor; longer: the trigram's occurrences filtered by the earlier tokens
        one length at a time."""
        n = len(ctx)
        if hi <= 0 or n == 0 or not self.num_tokens:
            return 0, None
        for d in range(min(hi, n, 3), 0, -1):
            key = tuple(ctx[n - d:])
            if d < 3:
                if key in self._succ:
                    return d, self._ends(key)
                continue
            lst = self._occ.get(key)
            if lst is None:
                continue
            ends = self._np(key, lst) if len(lst) > self._SMALL else lst
            if not self._continued(ends):
                continue
            best, best_ends = 3, ends
            L, a, tk = 4, self._arr, self._tk
            while L <= hi:
                q = ctx[n - L]
                if isinstance(ends, np.ndarray):
                    ends = ends[a[ends - (L - 1)] == q]
                    if len(ends) <= self._SMALL:
                        ends = ends.tolist()
                else:
                    ends = [x for x in ends if tk[x - L + 1] == q]
                if not len(ends) or not self._continued(ends):
                    break
                best, best_ends = L, ends
                L += 1
            return best, best_ends
        return 0, None

    def match_from(self, ctx: Sequence[int], max_len: int, state: list | None):
        """``SuffixTrie.match_from``: ``(m, ends)`` of the longest continued suffix of ``ctx``
        (``m <= max_len``), reusing ``state`` = ``[version, context length, m, ends, max_len]``:
        with ``j`` tokens appended and the index unchanged the match is at most ``m + j`` long,
        and exactly that if the old occurrences continue with the new tokens and then some."""
        n = len(ctx)
        hi = min(n, max_len, self.max_depth - 1)
        if state is not None and state[0] == self.version and state[4] == max_len and 0 <= n - state[1]:
            j, m0 = n - state[1], state[2]
            if 3 < m0 + j <= hi and m0 > 0:           # (up to 3 tokens the search is a few lookups)
                ends = state[3]
                new = ctx[state[1]:]
                if j:
                    if len(ends) > self._SMALL:
                        ends = np.asarray(ends)
                        a = self._arr
                        for i, t in enumerate(new, 1):
                            ends = ends[a[ends + i] == t]
                        ends = ends + j
                        if len(ends) <= self._SMALL:
                            ends = ends.tolist()
                    else:
                        tk, new = self._tk, list(new)
                        ends = [x + j for x in ends if tk[x + 1:x + j + 1] == new]
                if len(ends) and self._continued(ends):
                    state[1:4] = [n, m0 + j, ends]
                    return m0 + j, ends
            hi = min(hi, m0 + j)
        m, ends = self._search(ctx, hi)
        if state is not None:
            state[:] = [self.version, n, m, ends, max_len]
        return m, ends

    def _children(self, ends, depth: int):
        """``{token: child ends}`` of the node of length ``depth`` whose occurrences end at
        ``ends`` (ascending; separators and the indexed end have no continuation; dict order
        unspecified): up to 2 tokens, the n-gram's successors' occurrence lists; longer, grouped."""
        if depth < 3:
            e = int(ends[0])
            key = tuple(self._tk[e - depth + 1:e + 1])
            return {t: self._ends(key + (t,)) for t in self._succ.get(key, ())}
        if len(ends) > self._SMALL:
            nxt = np.asarray(ends) + 1
            toks = self._arr[nxt]
            keep = toks != self.SEP
            if not keep.all():
                nxt, toks = nxt[keep], toks[keep]
            if not len(nxt):
                return {}
            return _group_by_token(toks, nxt, self._SMALL)
        out: dict[int, list[int]] = {}
        tk = self._tk
        for x in ends:
            t = tk[x + 1]
            if t != _SEP:
                lst = out.get(t)
                if lst is None:
                    out[t] = [x + 1]
                else:
                    lst.append(x + 1)
        return out

    def _kids(self, ends, depth: int) -> dict:
        return self._children(ends, depth)

    def draft(self, context: Sequence[int], cfg: DrafterConfig, budget: int | None = None,
              source: str = "", state: list | None = None) -> Draft:
        """``SuffixTrie.draft`` of a trie holding the indexed streams, bitwise."""
        budget = cfg.budget if budget is None else budget
        m, ends = self.match_from(context, max(1, self.max_depth - budget), state)
        if m < cfg.min_match:
            return Draft()
        cap = min(budget, int(math.floor(cfg.max_spec_factor * m + cfg.max_spec_offset)))
        if cap <= 0:
            return Draft()
        if self._memo_version != self.version or len(self._memo) > 4096:
            self._memo.clear()
            self._memo_version = self.version
        key = (int(ends[0]), m, cap, budget, cfg.tree, cfg.min_token_prob)   # first end + length: the string
        hit = self._memo.get(key)
        if hit is None:
            if cfg.tree:
                hit = self._expand_tree(ends, len(ends), m, budget, cap, cfg.min_token_prob)
            else:
                hit = (*self._expand(ends, len(ends), m, cap, cfg.min_token_prob), None)
            self._memo[key] = hit
        toks, probs, parents = hit
        return Draft(list(toks), list(probs), m, float(sum(probs)), source if toks else "",
                     None if parents is None else list(parents))


class SuffixDrafter:
    """Drafts from completed trajectories (per group and global) and the request's context.

    ``add_trajectory(tokens, group)`` indexes a finished trajectory (all its tokens: prompt,
    model turns, observations); ``start(prompt)`` returns a :class:`ContextIndex` for one request,
    ``draft(ctx, group)`` proposes the continuation of ``ctx.tokens``. Not thread-safe: guard it
    with a lock when shared (the engine's scheduler is one thread).
    """

    def __init__(self, config: DrafterConfig | None = None):
        self.cfg = config or DrafterConfig()
        self.groups: dict[Hashable, CorpusIndex] = {}
        self.glob = CorpusIndex(self.cfg.max_depth)
        self._fifo: deque[tuple[Hashable, tuple[int, ...]]] = deque()
        self.indexed_tokens = 0
        # queued trajectories: [tokens, group, next position, group-trie frontier, global frontier]
        self._queue: deque[list] = deque()

    @property
    def pending_tokens(self) -> int:
        """Tokens of queued trajectories not indexed yet."""
        return sum(len(j[0]) - j[2] for j in self._queue)

    def queue_trajectory(self, tokens: Sequence[int], group: Hashable = None) -> None:
        """Queue a completed trajectory for :meth:`index_pending` (indexing costs ~0.6 us per token
        and index in Python, ~10 ms for 8K tokens into the group and global indexes: a caller on a
        serving loop still spreads it over calls)."""
        toks = tuple(int(t) for t in tokens)
        if toks:
            self._queue.append([toks, group, 0, None, None])

    def index_pending(self, max_tokens: int | None = None, max_s: float | None = None,
                      slice_tokens: int = 256) -> int:
        """Index queued trajectories in order, stopping after ``max_tokens`` tokens or once
        ``max_s`` seconds have passed (checked every ``slice_tokens``; ``None``: no limit); returns
        the tokens indexed. A trajectory is drafted from as far as it is indexed (its prefix's
        substrings are all in the tries) and enters the FIFO eviction order once complete, so the
        tries end exactly as :meth:`add_trajectory` of each would leave them."""
        t0 = time.perf_counter()
        done = 0
        use_glob = self.cfg.use_global
        while self._queue:
            if max_tokens is not None and done >= max_tokens:
                break
            if max_s is not None and done and time.perf_counter() - t0 >= max_s:
                break
            job = self._queue[0]
            toks, group, pos = job[0], job[1], job[2]
            n = min(len(toks) - pos, slice_tokens if max_tokens is None else min(slice_tokens, max_tokens - done))
            piece = toks[pos:pos + n]
            if group is not None:
                job[3] = self.groups.setdefault(group, CorpusIndex(self.cfg.max_depth)).extend(piece, job[3])
            if use_glob or group is None:
                job[4] = self.glob.extend(piece, job[4])
            job[2] = pos + n
            done += n
            if job[2] == len(toks):
                self._queue.popleft()
                self._complete(group, toks)
        return done

    def add_trajectory(self, tokens: Sequence[int], group: Hashable = None) -> None:
        """Index a completed trajectory under ``group`` (``None``: global only) now, after any
        queued ones; evicts the oldest trajectories beyond ``max_indexed_tokens``."""
        self.queue_trajectory(tokens, group)
        self.index_pending()

    def _complete(self, group: Hashable, toks: tuple[int, ...]) -> None:
        self._fifo.append((group, toks))
        self.indexed_tokens += len(toks)
        lim = self.cfg.max_indexed_tokens
        while lim and self.indexed_tokens > lim and len(self._fifo) > 1:
            self._evict()

    def _evict(self) -> None:
        g, toks = self._fifo.popleft()
        if g is not None:
            trie = self.groups[g]
            trie.remove(toks)
            if trie.num_tokens == 0:
                del self.groups[g]
        if self.cfg.use_global or g is None:
            self.glob.remove(toks)
        self.indexed_tokens -= len(toks)

    def start(self, prompt: Sequence[int] = ()) -> ContextIndex:
        return ContextIndex(self.cfg.max_depth, prompt)

    def draft(self, ctx: ContextIndex | Sequence[int], group: Hashable = None, budget: int | None = None) -> Draft:
        """Best draft for the continuation of the context (``ctx``: a :class:`ContextIndex`, or a
        plain token list, then only the trajectory index is used)."""
        is_ctx = isinstance(ctx, ContextIndex)
        tokens, states = (ctx.tokens, ctx.match_state) if is_ctx else (list(ctx), {})
        sources = []
        if group is not None and group in self.groups:
            sources.append((self.groups[group], "group"))
        if self.cfg.use_global or group is None:
            sources.append((self.glob, "global"))
        # the best of (context, group, global) by score, ties to the earlier, none unless > 0; the
        # context comes last here so that its expansion is skipped when it cannot win
        best = Draft()
        for trie, name in sources:
            st = states.setdefault(id(trie), [-1, 0, 0, 0, 0])
            d = trie.draft(tokens, self.cfg, budget, name, st)
            if d.score > best.score:
                best = d
        if is_ctx:
            d = ctx.draft(self.cfg, budget, beat=best.score if best.score > 0.0 else None)
            if d is not None and d.score > 0.0 and d.score >= best.score:
                best = d
        return best
