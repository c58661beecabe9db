"""Planner (issue 6): capacity, coverage, determinism, equal microbatch counts, errors, exact stats."""
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from megatron_harts.ops.plan import build_chunk_plan_host
from megatron_harts.packing import pack
from megatron_harts.planner import CostModel, TreeStats, plan, split_parts, tree_stats
from megatron_harts.tree import RolloutTree
from trees import trajectory_sets


@st.composite
def forests(draw, max_trees=6):
    C = draw(st.sampled_from([2, 4, 8]))
    sets = draw(st.lists(trajectory_sets(C, max_traj=6, max_chunks=3, vocab=4), min_size=1, max_size=max_trees))
    return C, [RolloutTree.from_trajectories([t or [0] for t in s]) for s in sets]


def check_plan(pl, trees, R, cap):
    assert len(pl.ranks) == R and len({len(r) for r in pl.ranks}) == 1
    assert (pl.memory <= cap).all()
    seen = {}
    for r in range(R):
        for mb, mb_trees in zip(pl.ranks[r], pl.microbatches(trees, r)):
            for part, t in zip(mb, mb_trees):
                trajs = range(len(trees[part.tree])) if part.trajectories is None else part.trajectories
                for i in trajs:
                    seen[(part.tree, i)] = seen.get((part.tree, i), 0) + 1
                assert len(t) == len(trajs)
            if mb:
                assert sum(t.num_tokens for t in mb_trees) <= cap  # compact tokens alone
    assert seen == {(i, j): 1 for i, t in enumerate(trees) for j in range(len(t))}


@given(forests(), st.integers(1, 4), st.integers(0, 2), st.sampled_from([None, 4]))
def test_plan_properties(data, R, slack, M):
    C, trees = data
    cap = max(max(len(x) for t in trees for x in t.records) + slack * 16, 1)
    cm = CostModel(per_token=1.0, per_ancestor=0.01, per_round=3.0)
    try:
        pl = plan(trees, dp_size=R, microbatch_capacity=cap, num_microbatches=M, cost_model=cm, chunk_size=C)
    except ValueError as e:
        assert M is not None and "does not fit" in str(e)
        return
    check_plan(pl, trees, R, cap)
    if M is not None:
        assert pl.num_microbatches == M
    again = plan(trees, dp_size=R, microbatch_capacity=cap, num_microbatches=M, cost_model=cm, chunk_size=C)
    assert again.ranks == pl.ranks and np.array_equal(again.cost, pl.cost)
    # Reported memory is exact: packs of each microbatch (compact + chunk-plan replay).
    for r in range(R):
        for mb, mb_trees in zip(pl.memory[r], pl.microbatches(trees, r)):
            if mb_trees:
                pk = pack(mb_trees, chunk_size=C)
                h = build_chunk_plan_host(pk.parent.numpy(), pk.position_ids.numpy(), C)
                assert pk.num_tokens + h["num_replay_tokens"] == mb


@settings(max_examples=60)
@given(forests(max_trees=1))
def test_stats_match_chunk_plan(data):
    C, trees = data
    parts = split_parts(tree_stats(trees, C), 10 ** 9)
    pk = pack(trees, chunk_size=C)
    h = build_chunk_plan_host(pk.parent.numpy(), pk.position_ids.numpy(), C)
    assert (parts.tokens[0], parts.replay[0], parts.ancestors[0], parts.rounds[0]) == \
        (pk.num_tokens, h["num_replay_tokens"], int((pk.position_ids + 1).sum()), len(h["rounds"]))


def test_split_counts_duplicated_prefix():
    rng = np.random.default_rng(0)
    prompt = rng.integers(0, 9, 50).tolist()
    tree = RolloutTree.from_trajectories([prompt + rng.integers(0, 9, 30).tolist() for _ in range(8)])
    pl = plan([tree], dp_size=2, microbatch_capacity=200)
    check_plan(pl, [tree], 2, 200)
    s = pl.stats()
    assert s["num_split_trees"] == 1 and s["compression"] < tree.compression
    assert pl.compact_tokens > tree.num_tokens and pl.trajectory_tokens == tree.num_trajectory_tokens


def test_balance_many_trees():
    rng = np.random.default_rng(1)
    n = rng.integers(2, 9, 400)
    L = np.clip(np.repeat(rng.lognormal(5, 1, 400), n) * rng.uniform(0.5, 1.5, n.sum()), 1, 2000).astype(np.int64)
    cu = np.concatenate([[0], np.cumsum(n)])
    lcp = (np.minimum(L, np.concatenate([[0], L[:-1]])) * 0.6).astype(np.int64)
    lcp[cu[:-1]] = 0
    stats = TreeStats.from_arrays(cu, L, lcp)
    pl = plan(stats, dp_size=8, microbatch_capacity=8192, cost_model=CostModel.from_pattern("G-*-", 512))
    assert pl.stats()["imbalance"] < 1.02 and (pl.memory <= 8192).all()


def test_errors():
    tree = RolloutTree.from_trajectories([[1, 2, 3, 4, 5], [1, 2]])
    with pytest.raises(ValueError, match=r"5 tokens.*microbatch_capacity=4"):
        plan([tree], dp_size=1, microbatch_capacity=4)
    with pytest.raises(ValueError, match="dp_size must be >= 1, got 0"):
        plan([tree], dp_size=0, microbatch_capacity=8)
    with pytest.raises(ValueError, match="empty batch"):
        plan([], dp_size=1, microbatch_capacity=8)
    with pytest.raises(ValueError, match=r"does not fit 1 microbatches x 1 ranks x microbatch_capacity=5"):
        plan([tree, tree], dp_size=1, microbatch_capacity=5, num_microbatches=1)


def test_cost_model_from_pattern():
    cm = CostModel.from_pattern("G-G-G-*-", 1024)
    assert cm.per_ancestor == 3 * 4 * 1024 and cm.per_token > 0 and cm.per_round > 0
    assert CostModel.from_pattern("G-", 1024).per_ancestor == 0
