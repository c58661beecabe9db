import json

import numpy as np
import pytest
from hypothesis import given, strategies as st

from megatron_harts.packing import pack
from megatron_harts.tree import RolloutTree, TreeValidationError, read_jsonl, trees_from_trajectories, write_jsonl
from trees import corner_cases, trajectory_sets


def _anc_from_parent(parent):
    T = len(parent)
    anc = np.zeros((T, T), dtype=bool)
    for u in range(T):
        v = u
        while v >= 0:
            anc[u, v] = True
            v = parent[v]
    return anc


def _check_pack(trajs_per_tree):
    trees = [RolloutTree.from_trajectories(t) for t in trajs_per_tree]
    p = pack(trees)
    all_trajs = [t for ts in trajs_per_tree for t in ts]
    assert p.num_trajectories == len(all_trajs)
    parent = p.parent.numpy()
    end = p.subtree_end.numpy()
    T = p.num_tokens
    counts = np.zeros(T, dtype=np.int64)
    for toks, idx in zip(all_trajs, p.index_of_trajectory):
        idx = idx.numpy()
        assert p.tokens[idx].tolist() == toks                       # round trip
        assert (np.diff(idx) > 0).all()                              # strictly increasing
        assert parent[idx[0]] == -1 and (parent[idx[1:]] == idx[:-1]).all()  # parent-linked
        assert (p.position_ids.numpy()[idx] == np.arange(len(idx))).all()
        counts[idx] += 1
    assert (counts == p.multiplicity.numpy()).all()                  # multiplicities
    assert (counts > 0).all()                                        # no orphan nodes
    # subtree ranges nest and agree with parent chains
    anc = _anc_from_parent(parent)
    idx = np.arange(T)
    anc_range = (idx[None, :] <= idx[:, None]) & (idx[:, None] < end[None, :])
    assert (anc == anc_range).all()
    # distinct trie: no two children of a node share a token
    tree_of = np.searchsorted(p.tree_cu.numpy(), idx, side="right")
    keys = set(zip(tree_of.tolist(), parent.tolist(), p.tokens.tolist()))
    assert len(keys) == T
    for tree, ts in zip(trees, trajs_per_tree):
        assert [t.tokens.tolist() for t in tree.trajectories()] == ts


@given(st.lists(trajectory_sets(chunk_size=4), min_size=1, max_size=3))
def test_trie_and_pack_properties(trees):
    _check_pack(trees)


@pytest.mark.parametrize("case", list(corner_cases(8)))
def test_corner_case_packs(case):
    _check_pack([corner_cases(8)[case]])


def test_compression_and_merge_off():
    trajs = [[1, 2, 3, 4], [1, 2, 3, 5], [1, 2, 3, 4]]
    tree = RolloutTree.from_trajectories(trajs)
    assert tree.num_tokens == 5 and tree.num_trajectory_tokens == 12
    assert tree.trie.multiplicity.tolist() == [3, 3, 3, 2, 1]
    flat = RolloutTree.from_trajectories(trajs, merge_prefixes=False)
    assert flat.num_tokens == 12 and (flat.trie.multiplicity == 1).all()


def test_pack_one_million_tokens_is_fast():
    import time
    rng = np.random.default_rng(0)
    trees = []
    for g in range(64):  # 64 groups x 16 trajectories x ~1K tokens
        prompt = rng.integers(0, 1000, size=300).tolist()
        trajs = [prompt + rng.integers(0, 1000, size=int(rng.integers(500, 1400))).tolist() for _ in range(16)]
        trees.append(trajs)
    t0 = time.perf_counter()
    packed = pack([RolloutTree.from_trajectories(t) for t in trees])
    dt = time.perf_counter() - t0
    assert packed.num_trajectory_tokens > 1_000_000
    assert dt < 5.0, f"packing {packed.num_trajectory_tokens} tokens took {dt:.2f}s"


# ---- validation: every error names its field -------------------------------------------------

@pytest.mark.parametrize("kwargs, field", [
    (dict(token_lists=[[]]), "tokens"),
    (dict(token_lists=[[1, -2]]), "tokens"),
    (dict(token_lists=[[1, 99]], vocab_size=50), "tokens"),
    (dict(token_lists=[[1, 2]], loss_masks=[[0, 1, 1]]), "loss_mask"),
    (dict(token_lists=[[1, 2]], loss_masks=[[1, 1]]), "loss_mask"),
    (dict(token_lists=[[1, 2]], old_logprobs=[[0.0]]), "old_logprobs"),
    (dict(token_lists=[[1, 2]], ref_logprobs=[[0.0, float("nan")]]), "ref_logprobs"),
    (dict(token_lists=[[1, 2]], advantages=[float("nan")]), "advantage"),
    (dict(token_lists=[[1, 2]], advantages=[[0.1, 0.2, 0.3]]), "advantage"),
    (dict(token_lists=[[1, 2], [1, 3]], traj_ids=["a", "a"]), "traj_id"),
    (dict(token_lists=[[1, 2], [1, 3]], rewards=[1.0]), "rewards"),
    (dict(token_lists=[[1, 2]], old_logprobs=[["a", "b"]]), "old_logprobs"),
    (dict(token_lists=[[1, 2]], ref_logprobs=[[0.0, [1.0, 2.0]]]), "ref_logprobs"),
    (dict(token_lists=[[1, 2]], advantages=["high"]), "advantage"),
    (dict(token_lists=[[1, 2]], rewards=["ok"]), "reward"),
])
def test_validation_errors_name_the_field(kwargs, field):
    with pytest.raises(TreeValidationError, match=field):
        RolloutTree.from_trajectories(**kwargs)


def test_validation_names_the_trajectory():
    with pytest.raises(TreeValidationError, match=r"trajectory 1 \(id 'b'\)"):
        RolloutTree.from_trajectories([[1, 2], [3, 4]], traj_ids=["a", "b"], loss_masks=[[0, 1], [0, 1, 1]])


def test_identical_duplicates_are_legal():
    tree = RolloutTree.from_trajectories([[1, 2, 3], [1, 2, 3]], traj_ids=["a", "b"])
    assert tree.trie.multiplicity.tolist() == [2, 2, 2]


def test_jsonl_round_trip(tmp_path):
    trajs = [[5, 6, 7], [5, 6, 8, 9], [1]]
    tree = RolloutTree.from_trajectories(
        trajs, traj_ids=["a", "b", "c"], group_ids=["g", "g", "h"], loss_masks=[[0, 1, 1], [0, 0, 1, 1], [0]],
        old_logprobs=[[0, -1, -2], [0, -1, -2, -3], [0]], advantages=[0.5, [0, 0, 1, 1], -1.0], rewards=[1, 0, 2])
    path = tmp_path / "t.jsonl"
    write_jsonl(path, tree.trajectories())
    back = read_jsonl(path)
    assert [t.tokens.tolist() for t in back] == trajs
    assert [t.traj_id for t in back] == ["a", "b", "c"]
    assert back[1].loss_mask.tolist() == [False, False, True, True]
    assert back[1].advantage.tolist() == [0, 0, 1, 1] and back[0].advantage == 0.5
    groups = trees_from_trajectories(back)
    assert [len(g) for g in groups] == [2, 1]
    rec = json.loads(path.read_text().splitlines()[0])
    assert rec["id"] == "a" and rec["group"] == "g"


def test_jsonl_errors_name_line_and_field(tmp_path):
    path = tmp_path / "bad.jsonl"
    path.write_text('{"tokens": [1, 2]}\n{"tokens": [1, 2], "loss_mask": [0]}\n')
    with pytest.raises(TreeValidationError, match=r":2: .*loss_mask"):
        read_jsonl(path)
    path.write_text('{"toks": [1]}\n')
    with pytest.raises(TreeValidationError, match="tokens"):
        read_jsonl(path)
    path.write_text('{"tokens": [1, 2]}\n{"tokens": [1, 2], "old_logprobs": [0, "x"]}\n')
    with pytest.raises(TreeValidationError, match=r":2: .*old_logprobs"):
        read_jsonl(path)
    path.write_text('[1, 2]\n7\n')
    with pytest.raises(TreeValidationError, match=r":1: expected a JSON object, got list"):
        read_jsonl(path)


def test_pack_to_device_carries_the_host_values_the_ops_read():
    """``TreePack.to`` from the host caches the token maximum, the trajectory lengths and ``is_chain``
    first: on the GPU, the log-probs read them after the whole forward was issued, and a device read
    there waited for the GPU (H100 sync audit, 2026-12-06). The meta device has no data: any read
    of it raises, so these values must come from the host cache."""
    import torch
    from megatron_harts.ops import tree_token_logprobs

    p = pack([RolloutTree.from_trajectories([[1, 2, 3, 4], [1, 2, 5], [7, 8]])], chunk_size=4)
    m = p.to("meta")
    with pytest.raises(Exception):
        int(m.tokens.max())                    # a device read fails on meta
    assert m.max_token == 8 and m.trajectory_lengths_host == [4, 3, 2] and m.is_chain is False
    chains = pack([RolloutTree.from_trajectories([[1, 2], [3]], merge_prefixes=False)]).to("meta")
    assert chains.is_chain is True
    logits = torch.randn(p.num_tokens, 16)     # the host pack's log-probs use the same cached values
    assert [x.shape[0] for x in tree_token_logprobs(logits, p)] == [3, 2, 1]
