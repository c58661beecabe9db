"""The suffix drafter's compiled parts (war/suffix_expand.c) next to the Python they replace: the
expansion (same tokens, probabilities and parents as ``_OccurrenceExpansion`` and the trie, on corner
cases), and, through the hypothesis tests of ``test_war_steps`` run with each, the context's whole
draft and the corpus' trigram match."""
import random

import numpy as np
import pytest

from megatron_harts.rollout.war import suffix, suffix_native
from megatron_harts.rollout.war.suffix import _SEP, ContextIndex, CorpusIndex, DrafterConfig, SuffixDrafter

import test_war_steps


@pytest.fixture
def nat():
    lib = suffix_native.native_expansion()
    assert lib is not None, "the compiled expansion did not build (is a C compiler installed? see the warning)"
    return lib


@pytest.fixture(params=["native", "python"])
def expansion(request, monkeypatch, nat):
    """Run a test with the compiled expansion, then with the Python one."""
    monkeypatch.setattr(suffix, "_NATIVE", nat if request.param == "native" else None)
    return request.param


def _walk(trie, s):
    v = 0
    for t in s:
        v = trie.children[v].get(t, -1)
        if v < 0:
            return -1
    return v


def test_native_expansion_equals_python_and_trie_on_random_corpora(nat):
    """From every matched node of random corpora (tiny vocabularies: long runs and ties; depth
    bounds 2-64; min_prob 0 keeps every child; budget 1; the last stream partly indexed), the C
    chain and tree equal ``_expand`` / ``_expand_tree`` and the trie's ``expand`` /
    ``expand_tree`` from the same node, bitwise."""
    rng = random.Random(0)
    checked = 0
    for _ in range(200):
        vocab, depth = rng.choice([1, 2, 3, 5, 20]), rng.choice([2, 3, 8, 16, 64])
        idx = CorpusIndex(depth)
        for _ in range(rng.randint(1, 5)):
            idx.extend([rng.randrange(vocab) for _ in range(rng.randint(1, 150))])
        idx.extend([rng.randrange(vocab) for _ in range(rng.randint(1, 20))], idx._open)   # open stream
        trie = idx.to_trie()
        for _ in range(8):
            ctx = [rng.randrange(vocab) for _ in range(rng.randint(1, 20))]
            m, ends = idx.match_from(ctx, depth - 1, None)
            if not m:
                continue
            node = _walk(trie, ctx[len(ctx) - m:])
            minp = rng.choice([0.0, 0.05, 0.1, 0.3, 1.0])
            budget = rng.randint(1, 16)
            cap = rng.randint(1, budget)
            got_tree = nat.tree(idx._ptr, idx._n, _SEP, ends, m, depth, budget, cap, minp)
            assert got_tree == tuple(map(list, idx._expand_tree(ends, len(ends), m, budget, cap, minp)))
            assert got_tree == tuple(map(list, trie.expand_tree(node, m, budget, cap, minp)))
            got_chain = nat.chain(idx._ptr, idx._n, _SEP, ends, m, depth, cap, minp)
            assert got_chain == tuple(map(list, idx._expand(ends, len(ends), m, cap, minp)))
            assert got_chain == tuple(map(list, trie.expand(node, m, cap, minp)))
            checked += 1
    assert checked > 500


def test_native_expansion_of_a_context_counts_its_last_occurrence(nat):
    """A context's node includes the occurrence at its end, which continues nothing: ``[1, 2] * 3``
    has the node ``[1, 2]`` with count 3 and child ``1`` twice: probability 2/3; the draft matches
    the longest continued suffix, ``[1, 2, 1, 2]`` (count 2, child once): 1/2."""
    ctx = ContextIndex(8, [1, 2, 1, 2, 1, 2])
    toks, probs = nat.chain(ctx._ptr, 6, _SEP, [1, 3, 5], 2, 8, 1, 0.0)
    assert toks == [1] and probs == [2 / 3]
    d = ctx.draft(DrafterConfig(max_depth=8, budget=1, min_token_prob=0.0))
    assert (d.match_len, d.tokens, d.probs) == (4, [1], [0.5])


def test_native_expansion_takes_large_nodes_and_many_children(nat):
    """A node of 20,000 occurrences over 1,000 distinct next tokens (the hash table grows, most
    children below min_prob) and min_prob 0 (all kept) equal the Python expansion."""
    rng = np.random.default_rng(1)
    idx = CorpusIndex(16)
    seq = []
    for i in range(20000):
        seq += [7, int(rng.integers(0, 1000)) if i % 3 else 5]
    idx.extend(seq)
    ends = idx._occ[(7,)]
    for minp in (0.0, 0.01, 0.1):
        for budget in (1, 16, 64):
            assert nat.tree(idx._ptr, idx._n, _SEP, ends, 1, 16, budget, budget, minp) == tuple(
                map(list, idx._expand_tree(ends, len(ends), 1, budget, budget, minp)))
            assert nat.chain(idx._ptr, idx._n, _SEP, ends, 1, 16, budget, minp) == tuple(
                map(list, idx._expand(ends, len(ends), 1, budget, minp)))


def test_context_index_equals_trie_both_expansions(expansion):
    test_war_steps.test_context_index_draft_equals_a_trie_of_the_context()


def test_corpus_index_equals_trie_both_expansions(expansion):
    test_war_steps.test_corpus_index_draft_equals_a_trie_of_the_trajectories()


def test_drafter_choice_equals_reference_both_expansions(expansion):
    test_war_steps.test_drafter_choice_among_sources_equals_reference()


def test_drafter_uses_the_compiled_expansion(nat, monkeypatch):
    """The default path calls the C functions (a broken one is noticed, not bypassed)."""
    monkeypatch.setattr(suffix, "_NATIVE", nat)
    calls = []
    orig = nat.tree

    def spy(*a):
        calls.append(a)
        return orig(*a)

    monkeypatch.setattr(nat, "tree", spy)
    d = SuffixDrafter(DrafterConfig(max_depth=16, budget=4, tree=True))
    d.add_trajectory([1, 2, 3, 4, 5, 6] * 4, "g")
    ctx = d.start([9, 1, 2, 3])
    assert d.draft(ctx, "g").tokens == [4, 5, 6]          # capped at the match length, 3
    assert calls


def test_build_failure_falls_back_with_a_warning(tmp_path, monkeypatch, caplog):
    """No compiler: ``build`` raises one line naming it, ``native_expansion`` logs it and returns
    ``None`` (the drafter then expands in Python); a bad ``$HARTS_SUFFIX_NATIVE`` is refused."""
    monkeypatch.setenv("CC", str(tmp_path / "no-such-cc"))
    monkeypatch.setenv("HARTS_NATIVE_CACHE", str(tmp_path / "cache"))
    with pytest.raises(RuntimeError, match="no C compiler"):
        suffix_native.build()
    monkeypatch.setattr(suffix_native, "_STATE", {})
    with caplog.at_level("WARNING"):
        assert suffix_native.native_expansion() is None
    assert "expanding in Python" in caplog.text
    monkeypatch.setattr(suffix_native, "_STATE", {})
    monkeypatch.setenv("HARTS_SUFFIX_NATIVE", "yes")
    with pytest.raises(ValueError, match="HARTS_SUFFIX_NATIVE"):
        suffix_native.native_expansion()
    monkeypatch.setattr(suffix_native, "_STATE", {})
    monkeypatch.setenv("HARTS_SUFFIX_NATIVE", "0")
    assert suffix_native.native_expansion() is None


def test_build_reports_compiler_errors(tmp_path, monkeypatch):
    fake = tmp_path / "cc"
    fake.write_text("#!/bin/sh\necho 'suffix_expand.c:1: error: boom' >&2\nexit 1\n")
    fake.chmod(0o755)
    monkeypatch.setenv("CC", str(fake))
    with pytest.raises(RuntimeError, match="boom"):
        suffix_native.build(tmp_path / "cache")
    assert not list((tmp_path / "cache").glob("*.so"))


@pytest.mark.parametrize("n", [5, 17, 70])
def test_batch_layout_equals_reference_both_forms(expansion, n):
    """The verify batch's ids and tree masks (the compiled ``tree_masks``, or the Python bit rows)
    equal the reference corpus' per-row build, narrow and wide."""
    test_war_steps.test_batch_get_layout_equals_reference_any_width(n)


def test_tree_masks_layout_and_refusals(nat):
    """Two requests: a tree (node 3 under node 1) and an empty draft: every row marks the node and
    its ancestors, unused nodes are leaves under the root; a parent that is not an earlier node, or a
    draft as large as the tree, is refused."""
    m = nat.tree_masks([-1, -1, 0], [3, 0], 4).reshape(2, 4, 4).astype(int)
    assert m[0].tolist() == [[1, 0, 0, 0], [1, 1, 0, 0], [1, 0, 1, 0], [1, 1, 0, 1]]
    assert m[1].tolist() == [[1, 0, 0, 0], [1, 1, 0, 0], [1, 0, 1, 0], [1, 0, 0, 1]]
    with pytest.raises(ValueError, match="earlier node"):
        nat.tree_masks([-1, 1], [2], 4)
    with pytest.raises(ValueError, match="earlier node"):
        nat.tree_masks([-1, 0, 1, 2], [4], 4)
