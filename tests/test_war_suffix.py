"""The suffix drafter (rollout/war/suffix.py) against a brute-force reference."""
import math
import random

import pytest
from hypothesis import given, settings, strategies as st

from megatron_harts.rollout.war.suffix import DrafterConfig, SuffixDrafter, SuffixTrie


def occ(seqs, s, depth):
    """Occurrences of ``s`` (len <= depth) in ``seqs``, counted by brute force."""
    if len(s) > depth:
        return 0
    n = len(s)
    return sum(1 for q in seqs for i in range(len(q) - n + 1) if list(q[i:i + n]) == list(s))


def continued(seqs, s, depth):
    n = len(s)
    return n + 1 <= depth and any(list(q[i:i + n]) == list(s) for q in seqs for i in range(len(q) - n))


def ref_draft(seqs, ctx, cfg, depth):
    """The specified draft of one trie, computed from substring counts only."""
    hi = min(len(ctx), max(1, depth - cfg.budget), depth - 1)
    m = max((k for k in range(1, hi + 1) if continued(seqs, ctx[len(ctx) - k:], depth)), default=0)
    if m < cfg.min_match:
        return [], 0
    cap = min(cfg.budget, math.floor(cfg.max_spec_factor * m + cfg.max_spec_offset))
    s, p, out = list(ctx[len(ctx) - m:]), 1.0, []
    vocab = sorted({t for q in seqs for t in q})
    while len(out) < cap and len(s) < depth:
        counts = [(occ(seqs, s + [c], depth), c) for c in vocab]
        counts = [(n, c) for n, c in counts if n > 0]
        if not counts:
            break
        n, c = max(counts, key=lambda x: (x[0], -x[1]))
        q = p * n / occ(seqs, s, depth)
        if q < cfg.min_token_prob:
            break
        p = q
        s.append(c)
        out.append(c)
    return out, m


def canon(trie, depth):
    """{string: count} of every node (a trie's exact content; a ``CorpusIndex``: of the trie of
    what it holds)."""
    if hasattr(trie, "to_trie"):
        trie = trie.to_trie()
    out, stack = {}, [(0, ())]
    while stack:
        v, s = stack.pop()
        out[s] = trie.count[v]
        for t, c in trie.children[v].items():
            stack.append((c, s + (t,)))
    return out


seq_st = st.lists(st.integers(0, 3), min_size=0, max_size=18)


@settings(max_examples=150, deadline=None)
@given(seqs=st.lists(seq_st, min_size=1, max_size=4), ctx=st.lists(st.integers(0, 3), min_size=1, max_size=10),
       depth=st.integers(2, 7), budget=st.integers(1, 5), minp=st.sampled_from([0.0, 0.1, 0.3, 0.6]),
       factor=st.sampled_from([0.5, 1.0, 2.0]))
def test_trie_draft_matches_brute_force(seqs, ctx, depth, budget, minp, factor):
    cfg = DrafterConfig(max_depth=depth, budget=budget, min_token_prob=minp, max_spec_factor=factor)
    trie = SuffixTrie(depth)
    for q in seqs:
        trie.add(q)
    d = trie.draft(ctx, cfg)
    want, m = ref_draft(seqs, ctx, cfg, depth)
    assert d.tokens == want
    if d.tokens:
        assert d.match_len == m
        # the proposal is a continuation seen in the index
        whole = list(ctx[len(ctx) - m:]) + d.tokens
        assert any(occ([q], whole, len(whole)) for q in seqs)
        assert all(1.0 >= a >= b >= minp for a, b in zip(d.probs, d.probs[1:] + [minp]))
    # every node's count is the substring's occurrence count
    for s, n in canon(trie, depth).items():
        if s:
            assert n == occ(seqs, list(s), depth), s


def ref_tree_probs(seqs, ctx, cfg, depth):
    """The specified tree draft's node probabilities (descending) and match length, by brute force:
    the ``budget`` most probable continuations of the match (every string ``s`` of at most ``cap``
    tokens with ``len(match + s) <= depth`` and ``occ(match + s) / occ(match) >= min_token_prob``)."""
    _, m = ref_draft(seqs, ctx, cfg, depth)
    if m < cfg.min_match:
        return [], m
    cap = min(cfg.budget, math.floor(cfg.max_spec_factor * m + cfg.max_spec_offset))
    match = list(ctx[len(ctx) - m:])
    base = occ(seqs, match, depth)
    vocab = sorted({t for q in seqs for t in q})
    probs, frontier = [], [[]]
    for _ in range(min(cap, depth - m)):
        nxt = []
        for s in frontier:
            for c in vocab:
                n = occ(seqs, match + s + [c], depth)
                if n and n / base >= cfg.min_token_prob:
                    probs.append(n / base)
                    nxt.append(s + [c])
        frontier = nxt
    return sorted(probs, reverse=True)[:cfg.budget], m


@settings(max_examples=150, deadline=None)
@given(seqs=st.lists(seq_st, min_size=1, max_size=4), ctx=st.lists(st.integers(0, 3), min_size=1, max_size=10),
       depth=st.integers(2, 7), budget=st.integers(1, 6), minp=st.sampled_from([0.0, 0.1, 0.3]),
       factor=st.sampled_from([0.5, 1.0, 2.0]))
def test_tree_draft_takes_the_most_probable_continuations(seqs, ctx, depth, budget, minp, factor):
    cfg = DrafterConfig(max_depth=depth, budget=budget, min_token_prob=minp, max_spec_factor=factor, tree=True)
    trie = SuffixTrie(depth)
    for q in seqs:
        trie.add(q)
    d = trie.draft(ctx, cfg)
    want, m = ref_tree_probs(seqs, ctx, cfg, depth)
    assert [round(p, 9) for p in sorted(d.probs, reverse=True)] == [round(p, 9) for p in want]
    if not d.tokens:
        return
    assert d.match_len == m and len(d.tokens) <= budget and d.score == pytest.approx(sum(d.probs))
    match = list(ctx[len(ctx) - m:])
    base = occ(seqs, match, depth)
    for i, parent in enumerate(d.parents):       # parents first; each node's probability is its string's
        assert parent < i
        path, j = [], i
        while j >= 0:
            path.append(d.tokens[j])
            j = d.parents[j]
        path = path[::-1]
        assert d.probs[i] == pytest.approx(occ(seqs, match + path, depth) / base)
        assert len(path) <= min(budget, math.floor(factor * m)) and m + len(path) <= depth
    paths = d.paths()
    assert len(set(map(tuple, paths))) == len(paths) and all(p for p in paths)
    # the chain is the tree's most probable path when the tree holds it whole
    chain = trie.draft(ctx, DrafterConfig(max_depth=depth, budget=budget, min_token_prob=minp,
                                          max_spec_factor=factor))
    assert chain.tokens[:1] == [d.tokens[0]] or not chain.tokens


def test_tree_draft_is_a_chain_on_a_single_continuation():
    trie = SuffixTrie(16)
    trie.add([1, 2, 3, 4, 5, 6, 7, 8])
    d = trie.draft([1, 2, 3], DrafterConfig(max_depth=16, budget=4, tree=True))
    assert d.tokens == [4, 5, 6] and d.parents == [-1, 0, 1] and d.paths() == [[4, 5, 6]]
    trie.add([1, 2, 3, 9, 9])          # a second continuation after 1 2 3: a branch at the root
    d = trie.draft([1, 2, 3], DrafterConfig(max_depth=16, budget=4, tree=True, min_token_prob=0.0))
    assert sorted(map(tuple, d.paths()))[0][0] in (4, 9) and len(d.paths()) == 2


@settings(max_examples=60, deadline=None)
@given(seqs=st.lists(seq_st, min_size=2, max_size=5), depth=st.integers(1, 6))
def test_remove_restores_the_trie(seqs, depth):
    full, rest = SuffixTrie(depth), SuffixTrie(depth)
    for q in seqs:
        full.add(q)
    for q in seqs[1:]:
        rest.add(q)
    full.remove(seqs[0])
    assert canon(full, depth) == canon(rest, depth)
    for q in seqs[1:]:          # freed nodes are reused without corrupting the rest
        full.add(q)
        rest.add(q)
    assert canon(full, depth) == canon(rest, depth)


@settings(max_examples=80, deadline=None)
@given(ops=st.lists(st.tuples(st.sampled_from(["ctx", "ctx", "ctx", "add"]), st.lists(st.integers(0, 2), min_size=1,
                                                                                      max_size=6),
                              st.integers(1, 4)), min_size=1, max_size=25),
       depth=st.integers(2, 9))
def test_cached_match_state_equals_fresh_search(ops, depth):
    """The per-request match cache gives exactly the fresh binary search's drafts."""
    cfg = DrafterConfig(max_depth=depth, budget=3, min_token_prob=0.0)
    trie, ctx, state = SuffixTrie(depth), [], [-1, 0, 0, 0, 0]
    trie.add([0, 1, 2, 0, 1, 1, 2])
    for kind, toks, budget in ops:
        if kind == "add":
            trie.add(toks)
        else:
            ctx += toks
        got = trie.draft(ctx, cfg, budget, state=state)
        want = trie.draft(ctx, cfg, budget)
        assert (got.tokens, got.match_len) == (want.tokens, want.match_len)


def test_cached_match_state_invalidation():
    cfg = DrafterConfig(max_depth=6, budget=4, min_token_prob=0.0)
    trie, state = SuffixTrie(6), [-1, 0, 0, 0, 0]
    trie.add([5, 6, 7])
    assert trie.draft([9, 6], cfg, state=state).tokens == [7]
    trie.add([9, 6, 8, 8])                      # a longer match appears: the state must not be reused
    d = trie.draft([9, 6], cfg, state=state)
    assert (d.match_len, d.tokens) == (2, [8, 8])
    trie, state = SuffixTrie(6), [-1, 0, 0, 0, 0]
    trie.add([1, 2, 3, 4, 5, 6])
    assert trie.draft([1, 2, 3], cfg, 4, state=state).match_len == 2       # capped at 6 - 4
    assert trie.draft([1, 2, 3, 4], cfg, 1, state=state).match_len == 4    # a larger cap: search again


def test_streaming_extend_equals_add():
    rng = random.Random(0)
    q = [rng.randrange(5) for _ in range(300)]
    a, b = SuffixTrie(9), SuffixTrie(9)
    a.add(q)
    front = None
    for i in range(0, 300, 7):
        front = b.extend(q[i:i + 7], front)
    assert canon(a, 9) == canon(b, 9)
    with pytest.raises(ValueError, match="not added"):
        a.remove([4, 4, 4, 99])


def test_drafter_sources_groups_and_eviction():
    cfg = DrafterConfig(max_depth=16, budget=6, max_indexed_tokens=40)
    d = SuffixDrafter(cfg)
    d.add_trajectory([1, 2, 3, 4, 5, 6, 7, 8, 9], group="a")
    d.add_trajectory([1, 2, 3, 40, 50, 60, 70, 80], group="b")
    # group b's trie only knows b's continuation; the global one is a 1:1 tie -> smaller token
    assert d.draft([0, 1, 2, 3], group="b").tokens == [40, 50, 60]
    assert d.draft([0, 1, 2, 3], group="b").source == "group"
    # the request's own context drafts what it repeats (the match occurs twice: p = 1/2)
    ctx = d.start([20, 21, 22, 30, 31, 32, 33, 20, 21])
    ctx.extend([22])
    got = d.draft(ctx, group="a")
    assert got.tokens == [30, 31, 32] and got.source == "context" and got.probs == [0.5] * 3
    # a stronger group match beats a weaker context match
    ctx.extend([1, 2, 3])
    assert d.draft(ctx, group="a").source == "group"
    # eviction: a third trajectory pushes the first out (FIFO, 40 tokens)
    d.add_trajectory(list(range(100, 130)), group="c")
    assert "a" not in d.groups and d.indexed_tokens == 8 + 30
    assert d.draft([1, 2, 3], group="a").tokens == [40, 50, 60]
    with pytest.raises(ValueError, match="max_depth"):
        DrafterConfig(max_depth=0)


@settings(max_examples=40, deadline=None)
@given(st.lists(st.tuples(seq_st, st.sampled_from(["a", "b", None])), min_size=1, max_size=6),
       st.integers(1, 7), st.integers(3, 8), st.sampled_from([0, 20]))
def test_queued_indexing_in_slices_equals_add_trajectory(trajs, step, depth, limit):
    """Indexing queued trajectories a few tokens per call (drafting between calls) leaves the same
    tries, FIFO order and evictions as adding each at once; a partly indexed trajectory drafts
    from its indexed prefix only."""
    cfg = DrafterConfig(max_depth=depth, budget=3, max_indexed_tokens=limit)
    whole, sliced = SuffixDrafter(cfg), SuffixDrafter(cfg)
    for toks, g in trajs:
        whole.add_trajectory(toks, g)
        sliced.queue_trajectory(toks, g)
    assert sliced.pending_tokens == sum(len(t) for t, _ in trajs)
    while sliced.pending_tokens:
        before = sliced.pending_tokens
        assert sliced.index_pending(max_tokens=step) == min(step, before)
        sliced.draft([0, 1, 2], group="a")                     # drafting in between is allowed
    assert canon(sliced.glob, depth) == canon(whole.glob, depth)
    assert sliced.groups.keys() == whole.groups.keys()
    for g in whole.groups:
        assert canon(sliced.groups[g], depth) == canon(whole.groups[g], depth)
    assert list(sliced._fifo) == list(whole._fifo) and sliced.indexed_tokens == whole.indexed_tokens


def test_index_pending_time_budget():
    d = SuffixDrafter(DrafterConfig(max_depth=32, budget=4, min_token_prob=0.0))
    d.queue_trajectory(list(range(1000, 1200)) + list(range(100)) * 200, "g")
    got = d.index_pending(max_s=0.0)                           # at least one slice, then stop
    assert got == 256 and d.pending_tokens == 20200 - 256
    assert d.indexed_tokens == 0 and d.groups["g"].num_tokens == 256     # not complete: not in the FIFO yet
    assert d.draft([1003, 1004, 1005, 1006], group="g").tokens == [1007, 1008, 1009, 1010]   # the indexed prefix drafts
    assert d.draft([58, 59, 60, 61], group="g").tokens == []                 # 60, 61 come after token 256
    while d.pending_tokens:
        d.index_pending(max_s=0.01)
    assert d.indexed_tokens == 20200 and d.glob.num_tokens == 20200
    assert d.draft([58, 59, 60, 61], group="g").tokens == [62, 63, 64, 65]
