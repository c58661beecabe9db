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
_UNSET = object()
_NATIVE = _UNSET                    # the compiled parts (suffix_native), None: all in Python
# CorpusIndex expands matches of at least this many tokens natively: a 1-token match's node is a
# token's every occurrence (thousands in a large corpus), which C hashes one by one, while the Python
# expansion reads the successors' occurrence lists (memoised): 565 vs 644 us per scheduler step with
# all native, 739 all Python (bench_war_steps, h200model streams, batch 8, CPU clock, 5 repeats)
_NATIVE_MIN_MATCH = 2


def native():
    """The compiled parts of the drafter (:mod:`.suffix_native`, built at the first call: the
    expansion, a context's whole draft, a corpus' trigram match), or ``None`` where they are off or
    cannot be built: the indexes then work in Python (``_OccurrenceExpansion`` and the matches, the
    same drafts). Tests set ``_NATIVE`` to compare the two."""
    global _NATIVE
    if _NATIVE is _UNSET:
        from .suffix_native import native_expansion
        _NATIVE = native_expansion()
    return _NATIVE


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


def _group_list(base: list[int], nxt: list[int], o1: int, count: int, min_prob: float, sep: int | None) -> list:
    """Children of a node whose occurrences end at ``base + o1 - 1``, followed by the tokens
    ``nxt`` (``sep``: a token that continues nothing): ``[(-child count, token, child ends)]``
    sorted, those with ``1.0 * child count / count >= min_prob`` (see ``_OccurrenceExpansion``)."""
    groups: dict[int, list[int]] = {}
    for x, t in zip(base, nxt):
        g = groups.get(t)
        if g is None:
            groups[t] = [x + o1]
        else:
            g.append(x + o1)
    out = [(-len(g), t, g) for t, g in groups.items() if t != sep and 1.0 * len(g) / count >= min_prob]
    out.sort()                             # siblings' tokens differ: the ends are never compared
    return out


def _group_np(nxt: np.ndarray, arr: np.ndarray, count: int, min_prob: float, small: int, sep: int | None) -> list:
    """:func:`_group_list` for many occurrences: ``nxt`` (int64, ascending) the positions after
    them, ``arr`` the tokens; counts by ``np.unique``, positions only for the children kept (an
    array when more than ``small``, else a list)."""
    if not len(nxt):
        return []
    toks = arr[nxt]
    u, cnt = np.unique(toks, return_counts=True)
    sel = cnt / count >= min_prob             # float64 division: the same rounding as Python's
    out = []
    if sel.any():
        for t, c in zip(u[sel].tolist(), cnt[sel].tolist()):
            if t != sep:
                ce = nxt[toks == t]
                out.append((-c, t, ce if c > small else ce.tolist()))
        out.sort()
    return out


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
    (``ends``, ``count`` = its trie count), shared by :class:`ContextIndex` and
    :class:`CorpusIndex`, which define :meth:`_kid_list`.

    A node's children come as ``_kid_list``: ``(-child count, token, child ends)``, sorted (most
    frequent first, ties: the smaller token), only those with ``1.0 * child count / count >=
    min_prob``: no other child is ever drafted from the node, since a cumulative probability
    ``p <= 1`` gives ``p * k / count <= 1.0 * k / count`` (rounding is monotone). So the greedy
    chain takes the first child, and the tree stops pushing at the first child below
    ``min_prob``: it pushes exactly the children the trie's ``expand_tree`` pushes, in another
    order; siblings have distinct tokens, so their heap keys never tie, and the pops come in the
    trie's order. Child ends may be a *run* ``(positions, offset, tokens, i, after)``: the node
    whose occurrences end at ``positions + offset``, all of them continued by ``tokens[i:]`` (so
    each of those next nodes is its parent's only child, with the same count); ``after``: the
    tokens following the positions at the run's end (one per position), ``None`` if unknown."""

    max_depth: int

    def _kid_list(self, ends, depth: int, count: int, min_prob: float, ahead: int) -> list:
        """The children of the node (``ends``, ``count``) at ``depth`` that can be drafted from it
        (see the class docstring); ``ahead``: how many levels below the node may be drafted (at
        least 1; bounds the runs)."""
        raise NotImplementedError

    def _expand(self, ends, count: int, depth: int, max_tokens: int, min_prob: float):
        """``SuffixTrie.expand`` from the node (``ends``, ``count``) at ``depth``."""
        toks: list[int] = []
        probs: list[float] = []
        p, D = 1.0, self.max_depth
        while len(toks) < max_tokens and depth < D:
            if type(ends) is tuple and ends[3] < len(ends[2]):   # in a run: its one child, count unchanged
                base, off, run, i, after = ends
                q = p * count / count
                if q < min_prob:
                    break
                p, depth, ends = q, depth + 1, (base, off + 1, run, i + 1, after)
                toks.append(run[i])
                probs.append(p)
                continue
            ch = self._kid_list(ends, depth, count, min_prob, min(max_tokens - len(toks), D - depth))
            if not ch:
                break
            nc, best_t, e = ch[0]                      # the most frequent, ties: the smaller token
            q = p * -nc / count
            if q < min_prob:
                break
            p = q
            ends, count, depth = e, -nc, depth + 1
            toks.append(best_t)
            probs.append(p)
        return toks, probs

    def _expand_tree(self, ends, count: int, depth: int, max_nodes: int, max_len: int, min_prob: float):
        """``SuffixTrie.expand_tree`` from the node (``ends``, ``count``) at ``depth``: the same heap
        keys (probability, token, push order) and pops, except that a child that would be popped
        right after its parent (its key below the heap's top) never enters the heap, and a run's
        next node is taken that way without building its children."""
        heap: list = []
        D, kid_list, push, pop = self.max_depth, self._kid_list, heapq.heappush, heapq.heappop
        toks: list[int] = []
        probs: list[float] = []
        parents: list[int] = []
        seq = 0
        # heap entries: (-q, token, push order, child ends, child count, child depth, parent, path length)
        if max_len > 0 and depth < D:
            for nc, t, ce in kid_list(ends, depth, count, min_prob, min(max_len, D - depth)):
                q = 1.0 * -nc / count
                if q < min_prob:
                    break
                push(heap, (-q, t, seq, ce, -nc, depth + 1, -1, 1))
                seq += 1
        cur = None                                 # the entry popped next, when it skipped the heap
        while len(toks) < max_nodes:
            if cur is None:
                if not heap:
                    break
                cur = pop(heap)
            nq, t, _, ce, c, d, parent, plen = cur
            cur = None
            parents.append(parent)
            toks.append(t)
            probs.append(-nq)
            p = -nq
            if type(ce) is tuple:                  # a run: the next nodes are single children (count c)
                base, off, run, i, after = ce
                nrun, more = len(run), True
                while i < nrun:
                    if len(toks) >= max_nodes or plen >= max_len or d >= D:
                        more = False
                        break
                    q = p * c / c
                    if q < min_prob:
                        more = False
                        break
                    t = run[i]
                    if heap:
                        h = heap[0]
                        if h[0] < -q or (h[0] == -q and h[1] <= t):   # the heap's top comes first
                            push(heap, (-q, t, seq, (base, off + 1, run, i + 1, after), c, d + 1, len(toks) - 1,
                                        plen + 1))
                            seq += 1
                            more = False
                            break
                    seq += 1
                    parents.append(len(toks) - 1)
                    toks.append(t)
                    probs.append(q)
                    p, d, plen, off, i = q, d + 1, plen + 1, off + 1, i + 1
                if not more:
                    continue
                ce = (base, off, run, i, after)    # the run's last node: its children from positions
            if len(toks) < max_nodes and plen < max_len and d < D:   # else its children are never taken
                me, first = len(toks) - 1, True
                for nc, t2, ce2 in kid_list(ce, d, c, min_prob, min(max_len - plen, D - d)):
                    q = p * -nc / c
                    if q < min_prob:
                        break
                    e = (-q, t2, seq, ce2, -nc, d + 1, me, plen + 1)
                    seq += 1
                    if first:                      # the most probable child: its siblings' keys are larger
                        first = False
                        if not heap or e < heap[0]:
                            cur = e
                            continue
                    push(heap, e)
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
        self._ptr = self._arr.ctypes.data                                  # its address (native expansion)
        self._rev = np.arange(self.max_depth, dtype=np.int64)              # 0 .. max_depth-1
        self.match_state: dict[int, list] = {}        # id(trie) -> its match_from state (other sources)
        self._last: tuple[int, int, int] | None = None   # (context length, match length, cap) of the last draft
        self.extend(prompt)

    def extend(self, tokens: Sequence[int]) -> None:
        """Append ``tokens`` (ints) to the context."""
        if not hasattr(tokens, "__len__"):
            tokens = list(tokens)
        k = len(tokens)
        if k > 64:                         # a prompt or an observation: converted by numpy
            chunk = np.asarray(tokens, dtype=np.int64)
            toks = chunk.tolist()
        else:
            chunk = toks = list(map(int, tokens))
        n = len(self.tokens)
        if n + k > len(self._arr):
            arr = np.zeros(max(2 * len(self._arr), n + k), dtype=np.int64)
            arr[:n] = self._arr[:n]
            self._arr = arr
            self._ptr = arr.ctypes.data
        if k:
            self._arr[n:n + k] = chunk
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
        e1 = np.flatnonzero(a[:n - 1] == a[n - 1])           # earlier occurrences of the last token
        if not len(e1):
            return 0, None
        if hi == 1 or n < 3:
            return 1, e1
        e = e1[1:] if e1[0] == 0 else e1
        e = e[a[e - 1] == a[n - 2]]                          # ... of the last two (continued: e < n - 1)
        if not len(e):
            return 1, e1
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

    def _kid_list(self, ends, depth: int, count: int, min_prob: float, ahead: int) -> list:
        """``_OccurrenceExpansion._kid_list``: the tokens after the node's occurrences (but the one
        at the context's end, which has no continuation); where they all agree, for as many
        tokens ahead as they do, a run; numpy beyond ``_SMALL`` occurrences."""
        n = len(self.tokens)
        off, nxt = 0, None                 # the occurrences end at ends + off
        if type(ends) is tuple:            # a run
            base, off, run, i, after = ends
            if i < len(run):
                return [(-count, run[i], (base, off + 1, run, i + 1, after))]
            ends, nxt = base, after
            if base[-1] + off >= n - 1:    # the run reached the context's end (after is None)
                ends = base[:-1]
        elif len(ends) > self._SMALL:
            nxt = np.asarray(ends)
            if nxt[-1] >= n - 1:
                nxt = nxt[:-1]
            return _group_np(nxt + 1, self._arr, count, min_prob, self._SMALL, None)
        else:
            if type(ends) is not list:
                ends = ends.tolist()
            if ends and ends[-1] >= n - 1:     # ascending: only the last can be the context's end
                ends = ends[:-1]
        k = len(ends)
        if not k:
            return []
        tk, o1 = self.tokens, off + 1
        if nxt is None:
            nxt = [tk[x + o1] for x in ends]
        t0 = nxt[0]
        if nxt.count(t0) == k:             # one child
            if 1.0 * k / count < min_prob:
                return []
            run, j, last, nx = [t0], o1 + 1, ends[-1], None
            while len(run) < ahead:        # how far all occurrences go on alike (up to ``ahead``)
                if last + j >= n:          # the last one reaches the context's end
                    break
                nx = [tk[x + j] for x in ends]
                t = nx[0]
                if nx.count(t) != k:
                    break
                run.append(t)
                nx = None
                j += 1
            return [(-k, t0, (ends, o1, run, 1, nx))]
        return _group_list(ends, nxt, o1, count, min_prob, None)

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
        nat = native()
        if nat is not None:                # match and expansion in one compiled call
            hi, bound = min(n, max_len, D - 1), min(max_len, D - 1)
            st = self._last
            if st is not None and st[2] == bound and n >= st[0]:
                hi = min(hi, st[1] + n - st[0])
            m, toks, probs, parents = nat.context(self._ptr, n, hi, cfg.min_match, cfg.max_spec_factor,
                                                  cfg.max_spec_offset, budget, cfg.tree, D, cfg.min_token_prob)
            self._last = (n, m, bound)
            if m < cfg.min_match or min(budget, int(math.floor(cfg.max_spec_factor * m + cfg.max_spec_offset))) <= 0:
                return Draft()
            score = float(sum(probs))
            if beat is not None and score < beat:
                return None
            return Draft(toks, probs, m, score, source if toks else "", parents if toks else ([] if cfg.tree else None))
        m, ends = self._match(min(n, max_len, D - 1), min(max_len, D - 1))
        if m < cfg.min_match:
            return Draft()
        cap = min(budget, int(math.floor(cfg.max_spec_factor * m + cfg.max_spec_offset)))
        if cap <= 0:
            return Draft()
        count0 = len(ends) + 1                           # + the occurrence at the context's end
        # each level of the draft holds at most the probability mass of the first, (count0 - 1) /
        # count0 (the occurrence at the context's end has no continuation): the score is at most
        # cap times that
        if beat is not None and cap * (count0 - 1) / count0 * (1.0 + 1e-9) + 1e-9 < beat:
            return None
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
    occurrence list to its prefix's successors, so indexing costs ~3 dictionary operations per
    token instead of ``max_depth`` (the trie; ~0.6 vs ~8.5 us per token here). A trie node is the
    set of end positions of its string (its ``count``: their number), its children the tokens
    after them (not a separator nor past the indexed end): for strings of up to 2 tokens the
    successors' occurrence lists, longer ones grouped from the positions (:meth:`_kid_list`).
    The match: the longest suffix of up to 3 tokens with a successor (or a continued trigram
    occurrence), then the trigram's occurrences filtered by the earlier tokens; reusing the last
    call's match while the index is unchanged, as ``SuffixTrie.match_from``. Memoised while the
    index is unchanged (``version``): the expansion from a node (requests of a batch often match
    the same node) and the children of short strings.
    Same streaming interface as the trie (``extend(tokens, frontier) -> frontier``, streams one
    after another; ``remove(tokens)`` of the oldest, FIFO); removed positions leave the lists and
    the buffer is compacted once they dominate. Tested against the trie on random inputs."""

    _SMALL = 128         # occurrence sets up to this size are handled in Python, larger in numpy
    _FEW = 8             # the match: occurrences filtered one length at a time down to this many
    _FILTER_NP = 64      # ... in numpy while more than this many
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
        self._ptr = self._arr.ctypes.data                       # its address (native expansion)
        self._tk: list[int] = [self.SEP, self.SEP]             # the same as a list, plus one SEP past the end
        self._n = 1                                            # position 0: a separator
        self._occ: dict[tuple, list[int]] = {}                 # n-gram (n <= 3) -> end positions (ascending)
        self._succ: dict[tuple, list[list[int]]] = {}          # n-gram (n < 3) -> _occ of each one longer
        self._npc: dict = {}                                   # key -> numpy copy of a long list
        self._segs: deque[tuple[int, int]] = deque()           # [start, end) of complete-or-open streams
        self._open = None                                      # id of the open stream (its segment is last)
        self._dead = 0                                         # positions below this were removed
        self.num_tokens = 0                                    # indexed tokens (the trie's root count)
        # (first end, m, cap, budget, tree, min_prob) -> (tokens, probs, parents, score), this version
        self._memo: dict[tuple, tuple] = {}
        self._memo_version = -1
        # (n-gram, min_prob) -> the node's _kid_list, this version (n <= 2, or a trigram beyond _SMALL)
        self._short: dict[tuple, list] = {}
        self._short_version = -1

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
            self._ptr = arr.ctypes.data
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
                    occ[key] = lst = [p]
                    self._add_succ((a2,), lst)
                else:
                    lst.append(p)
                if a1 != sep:
                    key = (a1, a2, t)
                    lst = occ.get(key)
                    if lst is None:
                        occ[key] = lst = [p]
                        self._add_succ((a1, a2), lst)
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

    def _add_succ(self, key: tuple, lst: list[int]) -> None:
        """Record the occurrence list ``lst`` of a new n-gram extending ``key`` by one token (its
        last token: ``_tk[lst[0]]``)."""
        nxt = self._succ.get(key)
        if nxt is None:
            self._succ[key] = [lst]
        else:
            nxt.append(lst)

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
                del nxt[next(i for i, x in enumerate(nxt) if x is lst)]
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

    def _search(self, ctx: Sequence[int], hi: int, ctx_ptr: int | None = None):
        """Longest ``m <= hi`` such that ``ctx[-m:]`` has a continued occurrence; ``(m, ends)``
        with ``ends`` all its occurrences (ascending), ``(0, None)`` if none. Up to 3 tokens: an
        n-gram with a successor; longer: the trigram's occurrences filtered by the earlier tokens
        one length at a time (numpy beyond ``_SMALL`` of them, then Python) while more than
        ``_FEW`` are left, then each remaining occurrence's own match length. ``ctx_ptr``: the
        address of ``ctx`` as int64 (a ``ContextIndex``'s buffer): the trigram's occurrences are
        then matched in C (the same rule, ``suffix_expand.c: corpus_match``)."""
        n = len(ctx)
        if hi <= 0 or n == 0 or not self.num_tokens:
            return 0, None
        if hi >= 3 and n >= 3:
            key = tuple(ctx[n - 3:])
            lst = self._occ.get(key)
            if lst is not None and ctx_ptr is not None and (nat := native()) is not None:
                m, ends = nat.corpus_match(self._ptr, self._n, _SEP, self._np(key, lst), ctx_ptr, n, hi)
                if m:
                    return m, ends
            elif lst is not None and self._continued(lst):
                tk, L, ends = self._tk, 3, lst    # every occurrence in ends matches L tokens
                if len(lst) > self._FILTER_NP:
                    ends, a = self._np(key, lst), self._arr
                    while L < hi:
                        f = ends[a[ends - L] == ctx[n - 1 - L]]
                        if not len(f) or not self._continued(f):
                            break
                        ends, L = f, L + 1
                        if len(ends) <= self._SMALL:
                            ends = ends.tolist()
                            break
                    if type(ends) is not list:
                        return L, (ends if len(ends) > self._SMALL else ends.tolist())
                while L < hi and len(ends) > self._FEW:
                    q = ctx[n - 1 - L]
                    f = [x for x in ends if tk[x - L] == q]
                    for x in f:
                        if tk[x + 1] != _SEP:
                            break
                    else:                          # none (or none continued) matches L + 1 tokens
                        return L, ends
                    ends, L = f, L + 1
                if L == hi:
                    return L, ends
                tgt = ctx[n - hi:n]
                if type(tgt) is not list:
                    tgt = list(tgt)
                rc = tgt[::-1]                     # rc[l] = ctx[n - 1 - l]
                lens, best = [], 0
                for x in ends:                     # each occurrence's match length, up to hi
                    if x >= hi - 1 and tk[x - hi + 1:x + 1] == tgt:    # all of it: one comparison
                        m = hi
                    else:
                        m = L
                        while m < hi and tk[x - m] == rc[m]:
                            m += 1
                    lens.append(m)
                    if m > best and tk[x + 1] != _SEP:
                        best = m
                return best, [x for x, m in zip(ends, lens) if m >= best]
        for d in range(min(hi, n, 2), 0, -1):
            key = tuple(ctx[n - d:])
            if key in self._succ:
                return d, self._ends(key)
        return 0, None

    def match_from(self, ctx: Sequence[int], max_len: int, state: list | None, ctx_ptr: int | None = None):
        """``SuffixTrie.match_from``: ``(m, ends)`` of the longest continued suffix of ``ctx``
        (``m <= max_len``), reusing ``state`` = ``[version, context length, m, ends, max_len]``:
        with ``j`` tokens appended and the index unchanged the match is at most ``m + j`` long,
        and exactly that if the old occurrences continue with the new tokens and then some (tried
        from a match of at least 3 tokens, whose occurrences are few)."""
        n = len(ctx)
        hi = min(n, max_len, self.max_depth - 1)
        if state is not None and state[0] == self.version and state[4] == max_len and 0 <= n - state[1]:
            j, m0 = n - state[1], state[2]
            if 3 <= m0 and m0 + j <= hi:
                ends = state[3]
                if j:
                    new = ctx[state[1]:]
                    # by type, not size: a list may be longer than _SMALL (from a trigram of up to
                    # _FILTER_NP occurrences, or where a test lowers _SMALL), an array is numpy's
                    if type(ends) is not list:
                        a = self._arr
                        for i, t in enumerate(new, 1):
                            ends = ends[a[ends + i] == t]
                        ends = ends + j
                        if len(ends) <= self._SMALL:
                            ends = ends.tolist()
                    else:
                        tk = self._tk
                        if type(new) is not list:
                            new = list(new)
                        ends = [x + j for x in ends if tk[x + 1:x + j + 1] == new]
                if len(ends) and self._continued(ends):
                    state[1:4] = [n, m0 + j, ends]
                    return m0 + j, ends
            hi = min(hi, m0 + j)
        m, ends = self._search(ctx, hi, ctx_ptr)
        if state is not None:
            state[:] = [self.version, n, m, ends, max_len]
        return m, ends

    def _kid_list(self, ends, depth: int, count: int, min_prob: float, ahead: int) -> list:
        """``_OccurrenceExpansion._kid_list``. Strings of up to 2 tokens: from the successors'
        occurrence lists, memoised while the index is unchanged (the frequent short strings recur
        in many drafts), as are trigrams with more than ``_SMALL`` occurrences. Longer ones: the
        tokens after the occurrences (separators and the indexed end have no continuation), in
        Python up to ``_SMALL`` occurrences, where they all agree for as many tokens ahead as they
        do a run; numpy beyond."""
        off, nxt = 0, None                 # the occurrences end at ends + off
        if type(ends) is tuple:            # a run (at depth > 3, up to _SMALL occurrences)
            base, off, run, i, after = ends
            if i < len(run):               # every occurrence continues with run[i]: count, ratio 1
                return [(-count, run[i], (base, off + 1, run, i + 1, after))]
            ends, nxt = base, after
        tk = self._tk
        k = len(ends)
        if depth < 3 or (depth == 3 and k > self._SMALL):
            e = int(ends[0])
            key = tuple(tk[e - depth + 1:e + 1])
            if self._short_version != self.version:
                self._short.clear()
                self._short_version = self.version
            out = self._short.get((key, min_prob))
            if out is None:
                if depth < 3:
                    out = [(-len(lst), tk[lst[0]], lst) for lst in self._succ.get(key, ())
                           if 1.0 * len(lst) / count >= min_prob]
                    out.sort()             # siblings' tokens differ: the ends are never compared
                else:
                    out = _group_np(self._np(key, self._occ[key]) + 1, self._arr, count, min_prob, self._SMALL,
                                    _SEP)
                self._short[(key, min_prob)] = out
            return out
        if k > self._SMALL:
            return _group_np(np.asarray(ends) + 1, self._arr, count, min_prob, self._SMALL, _SEP)
        return self._list_kids(ends, off, nxt, count, min_prob, ahead)

    def _list_kids(self, ends: list[int], off: int, nxt: list[int] | None, count: int, min_prob: float,
                   ahead: int) -> list:
        """``_kid_list`` of the node whose ``len(ends) == count <= _SMALL`` occurrences end at
        ``ends + off`` (``nxt``: the tokens after them, when known)."""
        tk, k, o1 = self._tk, len(ends), off + 1
        if nxt is None:
            nxt = [tk[x + o1] for x in ends]
        t0 = nxt[0]
        if nxt.count(t0) == k:             # one child, as frequent as the node (count == k)
            if t0 == _SEP:
                return []
            run, j, nx = [t0], o1 + 1, None
            while len(run) < ahead:        # how far all occurrences go on alike (up to ``ahead``;
                nx = [tk[x + j] for x in ends]   # a separator ends every stream: x + j stays inside)
                t = nx[0]
                if t == _SEP or nx.count(t) != k:
                    break
                run.append(t)
                nx = None
                j += 1
            return [(-k, t0, (ends, o1, run, 1, nx))]
        return _group_list(ends, nxt, o1, count, min_prob, _SEP)

    def draft(self, context: Sequence[int], cfg: DrafterConfig, budget: int | None = None,
              source: str = "", state: list | None = None, beat: float | None = None,
              twin: tuple | None = None, copy: bool = True, ctx_ptr: int | None = None) -> Draft | None:
        """``SuffixTrie.draft`` of a trie holding the indexed streams, bitwise. ``beat``: return
        ``None`` instead when the draft's score provably stays below ``beat`` (as
        :meth:`ContextIndex.draft`: a draft of paths of at most ``cap`` tokens scores at most
        ``cap``); the match state is updated either way. ``twin``: ``(match length, count,
        draft)`` of an index holding all of this one's streams (and more) for the same context:
        when the match has the same length and count there, every occurrence of the matched
        string and of its continuations lies in this index's streams, so the draft is the twin's.
        ``copy=False``: the draft's lists are the memoised ones (read them, never change them).
        ``ctx_ptr``: the address of ``context`` as int64 (a ``ContextIndex``'s buffer), for the
        compiled match."""
        budget = cfg.budget if budget is None else budget
        m, ends = self.match_from(context, max(1, self.max_depth - budget), state, ctx_ptr)
        if m < cfg.min_match:
            return Draft()
        cap = min(budget, int(math.floor(cfg.max_spec_factor * m + cfg.max_spec_offset)))
        if cap <= 0:
            return Draft()
        if beat is not None and cap * (1.0 + 1e-9) + 1e-9 < beat:
            return None
        if twin is not None and twin[0] == m and twin[1] == len(ends):
            d = twin[2]
            if not copy:
                return Draft(d.tokens, d.probs, m, d.score, source if d.tokens else "", d.parents)
            return Draft(list(d.tokens), list(d.probs), m, d.score, source if d.tokens else "",
                         None if d.parents is None else list(d.parents))
        if self._memo_version != self.version or len(self._memo) > 4096:
            self._memo.clear()
            self._memo_version = self.version
        key = (int(ends[0]), m, cap, budget, cfg.tree, cfg.min_token_prob)   # first end + length: the string
        hit = self._memo.get(key)
        if hit is None:
            nat = native() if m >= _NATIVE_MIN_MATCH else None
            if nat is not None:
                if m <= 3 and type(ends) is list and len(ends) > self._SMALL:
                    key = tuple(context[len(context) - m:])
                    if self._occ.get(key) is ends:         # an n-gram's live list: its cached array
                        ends = self._np(key, ends)
                if cfg.tree:
                    hit = nat.tree(self._ptr, self._n, _SEP, ends, m, self.max_depth, budget, cap, cfg.min_token_prob)
                else:
                    hit = (*nat.chain(self._ptr, self._n, _SEP, ends, m, self.max_depth, cap, cfg.min_token_prob),
                           None)
            elif cfg.tree:
                hit = self._expand_tree(ends, len(ends), m, budget, cap, cfg.min_token_prob)
            else:
                hit = (*self._expand(ends, len(ends), m, cap, cfg.min_token_prob), None)
            hit = self._memo[key] = (*hit, float(sum(hit[1])))
        toks, probs, parents, score = hit
        if not copy:
            return Draft(toks, probs, m, score, source if toks else "", parents)
        return Draft(list(toks), list(probs), m, score, source if toks else "",
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
        ptr = ctx._ptr if is_ctx else None            # the context as int64 (compiled matching)
        sources = []
        if group is not None and group in self.groups:
            sources.append((self.groups[group], "group"))
        if self.cfg.use_global or group is None:
            sources.append((self.glob, "global"))
        # the best of (context, group, global) by score, ties to the earlier, none unless > 0; the
        # context comes last here so that its expansion is skipped when it cannot win
        best = Draft()
        if len(sources) == 2:
            # the global draft first: the group's wins with a score >= the global's (> 0), so its
            # expansion is skipped when its length cap cannot reach that score, or taken from the
            # global draft when the match is the same there (the global index holds the group's)
            (gi, gname), (wi, wname) = sources
            sw = states.setdefault(id(wi), [-1, 0, 0, 0, 0])
            dw = wi.draft(tokens, self.cfg, budget, wname, sw, copy=False, ctx_ptr=ptr)
            twin = (sw[2], len(sw[3]), dw) if dw.match_len and sw[3] is not None else None
            dg = gi.draft(tokens, self.cfg, budget, gname, states.setdefault(id(gi), [-1, 0, 0, 0, 0]),
                          beat=dw.score if dw.score > 0.0 else None, twin=twin, copy=False, ctx_ptr=ptr)
            if dg is not None and dg.score > 0.0 and dg.score >= dw.score:
                best = dg
            elif dw.score > 0.0:
                best = dw
        else:
            for trie, name in sources:
                d = trie.draft(tokens, self.cfg, budget, name, states.setdefault(id(trie), [-1, 0, 0, 0, 0]),
                               copy=False, ctx_ptr=ptr)
                if d.score > best.score:
                    best = d
        if is_ctx:
            d = ctx.draft(self.cfg, budget, beat=best.score if best.score > 0.0 else None)
            if d is not None and d.score > 0.0 and d.score >= best.score:
                return d
        if best.tokens:                    # a corpus draft shares the memoised lists: copied
            best = Draft(list(best.tokens), list(best.probs), best.match_len, best.score, best.source,
                         None if best.parents is None else list(best.parents))
        return best
