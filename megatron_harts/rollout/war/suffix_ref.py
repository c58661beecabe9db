"""Reference implementation of the suffix drafter and the plugin's corpus as they were before the
fast context index (2026-12-03): every request's context indexed in a depth-bounded suffix trie
(``O(tokens * max_depth)`` dictionary operations in the scheduler loop), per-row mask building.
Kept verbatim for the equivalence test (``tests/test_war_steps.py``: the fast path drafts
bitwise the same) and the before/after benchmark (``scripts/bench_war_steps.py``). Not used by
the server.
"""
from __future__ import annotations

import heapq
import itertools
import logging
import math
import time
from collections import deque
from typing import Hashable, Sequence

import json
import os
from collections import OrderedDict

import numpy as np

from .sglang_plugin import CORPUS_ENV, _concat_last_n, draft_config, group_of, traj_of
from .suffix import Draft, DrafterConfig

log = logging.getLogger(__name__)
_VERSIONS = itertools.count(1)      # trie versions, unique across tries


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
            push(c, d, len(toks) - 1, -nq, plen)
        return toks, probs, parents

    def match_from(self, context: Sequence[int], max_len: int, state: list | None) -> tuple[int, int]:
        """:meth:`longest_match`, reusing ``state`` = ``[version, context length, m, node,
        max_len]`` of an earlier call on a prefix of the same context (updated in place). If the
        trie and ``max_len`` are unchanged and the old match extends by the ``j`` new tokens to a continued node of length
        ``<= max_len``, that is the longest match (a longer one would end in a match longer than
        ``m`` before the new tokens); otherwise a fresh binary search."""
        n = len(context)
        if state is not None and state[0] == self.version and state[4] == max_len and 0 <= n - state[1] \
                and state[2] > 0 and state[2] + n - state[1] <= min(max_len, self.max_depth - 1):
            v, children = state[3], self.children
            for t in context[state[1]:]:
                v = children[v].get(int(t), -1)
                if v < 0:
                    break
            if v >= 0 and children[v]:
                m = state[2] + n - state[1]
                state[1:4] = [n, m, v]
                return m, v
        m, v = self.longest_match(context, max_len)
        if state is not None:
            state[:] = [self.version, n, m, v, max_len]
        return m, v

    def draft(self, context: Sequence[int], cfg: DrafterConfig, budget: int | None = None,
              source: str = "", state: list | None = None) -> Draft:
        """The draft of this trie alone for ``context`` (see the module docstring); ``state``:
        a per-request match cache (:meth:`match_from`)."""
        budget = cfg.budget if budget is None else budget
        # leave room for the draft below the depth bound
        m, node = self.match_from(context, max(1, self.max_depth - budget), state)
        if m < cfg.min_match:
            return Draft()
        cap = min(budget, int(math.floor(cfg.max_spec_factor * m + cfg.max_spec_offset)))
        if cap <= 0:
            return Draft()
        if cfg.tree:
            toks, probs, parents = self.expand_tree(node, m, budget, cap, cfg.min_token_prob)
            return Draft(toks, probs, m, float(sum(probs)), source if toks else "", parents)
        toks, probs = self.expand(node, m, cap, cfg.min_token_prob)
        return Draft(toks, probs, m, float(sum(probs)), source if toks else "")


class ContextIndex:
    """The streaming suffix trie of one request's own context (prompt, then accepted tokens).

    ``extend(tokens)`` appends; ``tokens`` is the full context so far (the drafter matches its
    tail)."""

    def __init__(self, max_depth: int, prompt: Sequence[int] = ()):
        self.trie = SuffixTrie(max_depth)
        self.tokens: list[int] = []
        self._front: list[int] = []
        self.match_state: dict[int, list] = {}        # id(trie) -> its match_from state
        self.extend(prompt)

    def extend(self, tokens: Sequence[int]) -> None:
        toks = [int(t) for t in tokens]
        self._front = self.trie.extend(toks, self._front)
        self.tokens += toks


class SuffixDrafter:
    """Drafts from completed trajectories (per group and global) and the request's context.

    ``add_trajectory(tokens, group)`` indexes a finished trajectory (all its tokens: prompt,
    model turns, observations); ``start(prompt)`` returns a :class:`ContextIndex` for one request,
    ``draft(ctx, group)`` proposes the continuation of ``ctx.tokens``. Not thread-safe: guard it
    with a lock when shared (the engine's scheduler is one thread).
    """

    def __init__(self, config: DrafterConfig | None = None):
        self.cfg = config or DrafterConfig()
        self.groups: dict[Hashable, SuffixTrie] = {}
        self.glob = SuffixTrie(self.cfg.max_depth)
        self._fifo: deque[tuple[Hashable, tuple[int, ...]]] = deque()
        self.indexed_tokens = 0
        # queued trajectories: [tokens, group, next position, group-trie frontier, global frontier]
        self._queue: deque[list] = deque()

    @property
    def pending_tokens(self) -> int:
        """Tokens of queued trajectories not indexed yet."""
        return sum(len(j[0]) - j[2] for j in self._queue)

    def queue_trajectory(self, tokens: Sequence[int], group: Hashable = None) -> None:
        """Queue a completed trajectory for :meth:`index_pending` (indexing costs ``O(len *
        max_depth)`` dictionary operations, ~0.1 s for 8K tokens at depth 32 in Python: a caller
        on a serving loop spreads it over many calls instead of stalling one)."""
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
                job[3] = self.groups.setdefault(group, SuffixTrie(self.cfg.max_depth)).extend(piece, job[3])
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
            if trie.count[0] == 0:
                del self.groups[g]
        if self.cfg.use_global or g is None:
            self.glob.remove(toks)
        self.indexed_tokens -= len(toks)

    def start(self, prompt: Sequence[int] = ()) -> ContextIndex:
        return ContextIndex(self.cfg.max_depth, prompt)

    def draft(self, ctx: ContextIndex | Sequence[int], group: Hashable = None, budget: int | None = None) -> Draft:
        """Best draft for the continuation of the context (``ctx``: a :class:`ContextIndex`, or a
        plain token list, then only the trajectory index is used)."""
        if isinstance(ctx, ContextIndex):
            tokens, sources = ctx.tokens, [(ctx.trie, "context")]
        else:
            tokens, sources = list(ctx), []
        if group is not None and group in self.groups:
            sources.append((self.groups[group], "group"))
        if self.cfg.use_global or group is None:
            sources.append((self.glob, "global"))
        best = Draft()
        states = ctx.match_state if isinstance(ctx, ContextIndex) else {}
        for trie, name in sources:
            st = states.setdefault(id(trie), [-1, 0, 0, 0, 0])
            d = trie.draft(tokens, self.cfg, budget, name, st)
            if d.score > best.score:
                best = d
        return best


class RefSuffixCorpus:
    """Drop-in for SGLang's ``NgramCorpus`` inside ``NGRAMWorker``, drafting with
    :class:`SuffixDrafter`.

    ``batch_get(req_ids, batch_tokens, total_lens)``: ``batch_tokens[i]`` ends at context length
    ``total_lens[i]`` and holds at least the tokens not seen yet for that request (all of them
    the first time); returns ``(ids [bs * n] int64, mask [bs * n * n] bool)`` in NGRAM's layout:
    node 0 is the last context token, ``mask[i, j]`` = node ``j`` is node ``i`` or its ancestor
    (a chain, or with ``DrafterConfig(tree=True)`` a tree whose parents precede their children).
    ``feed``: JSONL path of completed trajectories (``None``: ``$HARTS_SUFFIX_CORPUS``).
    """

    def __init__(self, draft_token_num: int, config: DrafterConfig | None = None, feed: str | None = None,
                 poll_s: float = 0.5, index_s: float = 0.004):
        if draft_token_num < 2:
            raise ValueError(f"draft_token_num must be >= 2 (root + drafts), got {draft_token_num}")
        self.n = int(draft_token_num)
        cfg = config or draft_config(self.n)
        # feed trajectories are queued and indexed at most ~index_s seconds per scheduler iteration
        # (synchronize), so a burst of finished trajectories never stalls the serving loop
        self.index_s = index_s
        self.drafter = SuffixDrafter(cfg)
        self.ctx: dict[str, ContextIndex] = {}
        self.feed = feed if feed is not None else os.environ.get(CORPUS_ENV)
        self.poll_s, self._pos, self._last_poll = poll_s, 0, 0.0
        self.stats = {"calls": 0, "drafted": 0, "fed": 0, "reused": 0, "indexed": 0}
        # a trajectory's next turn (a new rid whose context extends the last one's) takes over the
        # context trie of its previous turn instead of re-indexing the whole context (~50 ms per
        # 3K tokens in Python): parked tries of departed requests, and the live rid per trajectory
        self._parked: OrderedDict[str, ContextIndex] = OrderedDict()
        self._live: dict[str, str] = {}
        self.max_parked = 4096

    # -- NgramCorpus interface used by NGRAMWorker ------------------------------------------------
    def synchronize(self) -> None:
        self.poll(force=False)
        if self.drafter._queue:
            self.stats["indexed"] += self.drafter.index_pending(max_s=self.index_s)

    def after_verify(self) -> None:
        """The worker's hook after the verify forward's launch (the current plugin indexes its feed
        there): the same indexing as :meth:`synchronize`, so replays drive both corpora alike."""
        self.synchronize()

    def batch_put(self, batch_tokens) -> None:
        """NGRAM's online insertion; the suffix corpus indexes requests in ``batch_get``."""

    def reset(self) -> None:
        self.ctx.clear()
        self._parked.clear()
        self._live.clear()

    def erase_match_state(self, req_ids: list[str]) -> None:
        for rid in req_ids:
            c = self.ctx.pop(rid, None)
            traj = traj_of(rid)
            if traj is not None and self._live.get(traj) == rid:
                del self._live[traj]
                if c is not None:
                    self._park(traj, c)

    def _park(self, traj: str, c: ContextIndex) -> None:
        self._parked[traj] = c
        self._parked.move_to_end(traj)
        while len(self._parked) > self.max_parked:
            self._parked.popitem(last=False)

    def _takeover(self, rid: str, toks: list[int], total: int) -> ContextIndex | None:
        """The context trie of the same trajectory's previous turn, extended to ``toks`` (the whole
        context), if that turn's context is a prefix of it; else ``None``."""
        traj = traj_of(rid)
        if traj is None or len(toks) < total:
            return None
        old = self._live.pop(traj, None)
        c = self.ctx.pop(old, None) if old is not None and old != rid else None
        if c is None:
            c = self._parked.pop(traj, None)
        if c is None:
            return None
        n = len(c.tokens)
        if n == 0 or n > len(toks) or list(toks[:n]) != c.tokens:
            return None
        if len(toks) > n:
            c.extend(toks[n:])
        self.stats["reused"] += 1
        return c

    def known(self, rid: str) -> int:
        c = self.ctx.get(rid)
        return len(c.tokens) if c is not None else 0

    def batch_get(self, req_ids: list[str], batch_tokens: list[list[int]], total_lens: list[int]):
        n = self.n
        ids = np.zeros((len(req_ids), n), dtype=np.int64)
        mask = np.zeros((len(req_ids), n, n), dtype=bool)
        for b, (rid, toks, total) in enumerate(zip(req_ids, batch_tokens, total_lens)):
            c = self.ctx.get(rid)
            if c is None:
                c = self._takeover(rid, toks, total)
                if c is None:
                    if len(toks) < total:
                        raise ValueError(f"request {rid}: first batch_get needs its whole context "
                                         f"({total} tokens), got {len(toks)}")
                    c = self.drafter.start(toks[:-1] if toks else [])
                    c.extend(toks[-1:])
                self.ctx[rid] = c
                traj = traj_of(rid)
                if traj is not None:
                    self._live[traj] = rid
            else:
                new = total - len(c.tokens)
                if new < 0 or new > len(toks):
                    raise ValueError(f"request {rid}: context went from {len(c.tokens)} to {total} tokens "
                                     f"but only {len(toks)} were passed")
                if new:
                    c.extend(toks[len(toks) - new:])
            d = self.drafter.draft(c, group_of(rid), budget=n - 1)
            k = len(d.tokens)
            ids[b, 0] = c.tokens[-1] if c.tokens else 0
            ids[b, 1:k + 1] = d.tokens
            mask[b, 0, 0] = True
            parents = d.parents if d.parents is not None else range(-1, k - 1)    # a chain: i-1
            for i, par in enumerate(parents):    # node i+1: its parent's ancestors and itself
                mask[b, i + 1] = mask[b, par + 1]
                mask[b, i + 1, i + 1] = True
            for i in range(k + 1, n):            # unused nodes: leaves under the root
                mask[b, i, 0] = mask[b, i, i] = True
            self.stats["calls"] += 1
            self.stats["drafted"] += k
        return ids.reshape(-1), mask.reshape(-1)

    # external corpus API of NGRAMWorker (its HTTP endpoint is NGRAM-only; these index the same way)
    def load_external_corpus_named(self, corpus_id: str, chunks) -> int:
        n = 0
        for ch in chunks:
            self.drafter.add_trajectory(ch, None)
            n += len(ch)
        return n

    def commit_external_corpus_load(self, corpus_id: str, loaded: int) -> None:
        pass

    # -- the feed ----------------------------------------------------------------------------------
    def poll(self, force: bool = True) -> int:
        """Queue the trajectories appended to the feed since the last poll for indexing (``force``:
        index them all now; else :meth:`synchronize` indexes them a slice per call); returns how
        many."""
        if not self.feed:
            return 0
        now = time.monotonic()
        if not force and now - self._last_poll < self.poll_s:
            return 0
        self._last_poll = now
        try:
            with open(self.feed, "rb") as f:
                f.seek(self._pos)
                data = f.read()
        except FileNotFoundError:
            return 0
        end = data.rfind(b"\n") + 1          # a line being written is read next time
        count = 0
        for line in data[:end].splitlines():
            if line.strip():
                obj = json.loads(line)
                self.drafter.queue_trajectory(obj["tokens"], obj.get("group"))
                count += 1
        self._pos += end
        self.stats["fed"] += count
        if force:
            self.stats["indexed"] += self.drafter.index_pending()
        return count


def ref_gather_draft_inputs(corpus: "RefSuffixCorpus", owner: dict, depth: int, reqs, prev_ids: list[int],
                        prev_lens: list[int], stride: int, use_prev: bool):
    """The per-step inputs of :meth:`SuffixCorpus.batch_get` for SGLang ``Req``s (``rid``,
    ``origin_input_ids``, ``output_ids``): ``(rids, toks, totals)``, ``toks[i]`` the request's
    last ``max(depth, new tokens)`` context tokens, ``totals[i]`` its context length (tokens).
    ``prev_ids`` ``[bs * stride]`` / ``prev_lens`` ``[bs]``: the last verify step's accepted tokens,
    spliced in when ``use_prev`` (overlap mode, as NGRAM does). ``owner``: rid -> ``id(req)``; a
    new ``Req`` object under a known rid (or a context shorter than indexed) starts afresh. This is
    ``HartsSuffixWorker._prepare_draft_tokens``' loop, here so it runs (and is timed) on CPU."""
    rids, toks, totals = [], [], []
    for i, req in enumerate(reqs):
        prev = prev_ids[i * stride: i * stride + prev_lens[i]] if use_prev else []
        total = len(req.origin_input_ids) + len(req.output_ids) + len(prev)
        rid = req.rid
        if owner.get(rid) != id(req) or corpus.known(rid) > total:   # a new request
            corpus.erase_match_state([rid])
            owner[rid] = id(req)
        need = max(depth, total - corpus.known(rid))
        toks.append(_concat_last_n(list(req.origin_input_ids), list(req.output_ids[-need:]) + prev, need))
        rids.append(rid)
        totals.append(total)
    return rids, toks, totals
