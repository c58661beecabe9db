"""Libra in the real loop, on CPU: ``RLLoop`` with ``libra_pool=3`` runs an elastic pool of three
Ray workers (Megatron-Core ``HybridModel`` in Megatron DDP over the pool's DP group, embedded
engines), forced by a ``schedule`` to change its rollout/training split between steps; then a
fresh two-worker pool replays the same batches on a fixed split.

What is checked against what:

* the loop switched: rows record the splits 2/1, 1/2, 2/1 (rollout/training workers), the ranks
  that trained ({0}, {0, 1}, {0}), the moves (two engine starts, a return to training with the
  state broadcast, a resumed resident engine), and every rollout ran on the version pushed last
  (the loop's ``rollout_weight_versions`` check) with the trainer's log-probs of the sampled tokens
  equal to the engines' (<= 2e-4 nats: the engines, including the one resumed on a worker that had
  trained, serve exactly the trained weights);
* the issue's property "the same global batch gives the same gradients before and after a
  switch": the RL gradient (tree-packed microbatches, policy loss with the step's global
  normalisers, Megatron DDP all-reduce) of a saved step's trajectories on 2 training ranks equals
  the one on 1 rank, and the loop's trained weights (warm-up on 1 rank, RL steps on 1, 2, 1 ranks)
  equal the fixed-split replay's (2 ranks throughout);
* bad configurations end in a one-line ``ValueError`` (``LoopConfig``) or a CLI error.

Tolerances (fp32): gradients within 1e-6 of the largest entry (the 1- and 2-rank runs pack
different trees together and sum the same fp32 terms in another order; the existing pool tests
measure ~2e-7 of it). Weights: the loop's and the replay's Adam updates differ by fp32 rounding
of the gradient, which Adam divides by its own magnitude, so entries whose gradient is near zero
move by up to ~lr differently; the bound is on the whole update: ||w_loop - w_replay|| <= 1e-4 x
||w_loop - w_0||. A normalisation that depends on the split (e.g. rank-local token counts) makes
the 1-rank and 2-rank steps different losses and fails both checks.
"""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import load_file

from megatron_harts.rollout.agent_loop import RolloutConfig
from megatron_harts.rollout.libra.elastic_loop import CPU_TRAIN_SHAPE, LibraController, LibraSplit
from megatron_harts.rollout.libra.planner import StreamMeasure, StreamPlanner
from megatron_harts.rollout.loop import LoopConfig, RLLoop, demonstrations
from megatron_harts.rollout.weight_sync import model_config
from megatron_harts.tree import read_jsonl

SCHEDULE = [2, 1, 2]          # rollout workers of 3 at steps 0, 1, 2 (the warm-up runs at the first)
WARMUP = 2


def _cfg(out, **kw):
    base = dict(steps=3, tasks_per_step=4, out=str(out), chunk_size=8, sft_warmup_steps=WARMUP,
                rollout=RolloutConfig(group_size=2, branch_turn=1, branch_factor=2, max_turns=2, max_new_tokens=6),
                libra_pool=3, libra_policy="schedule", libra_schedule=list(SCHEDULE))
    return LoopConfig(**{**base, **kw})


@pytest.fixture(scope="module")
def switched(tmp_path_factory):
    """One loop run with the forced switch schedule (its pool and Ray are gone when it returns)."""
    import ray  # noqa: F401  (a test dependency: an ImportError if missing, never a skip)

    out = tmp_path_factory.mktemp("libra_loop")
    loop = RLLoop(_cfg(out))
    rows = loop.run()
    return loop, rows, out


@pytest.fixture(scope="module")
def replay(switched, tmp_path_factory):
    """A fresh two-worker pool with the loop's settings (same seed: same initial weights)."""
    loop, _, _ = switched
    cfg = loop.cfg
    c = LibraController(2, model_config(cfg.model), str(tmp_path_factory.mktemp("replay")),
                        LibraSplit(2, "schedule", [1]), seed=cfg.seed, lr=cfg.lr, chunk_size=cfg.chunk_size,
                        rl=dict(tree=True, old_logprobs=cfg.old_logprobs), timeout_s=60)
    yield c.pool
    c.close()


def _warmup_batches(loop):
    """The demonstrations the loop's warm-up trained on (same task draw as ``RLLoop.run``)."""
    cfg = loop.cfg
    out = []
    for w in range(WARMUP):
        tasks, gids = loop._tasks(1_000_000 + w, cfg.tasks_per_step * cfg.rollout.group_size)
        out.append(demonstrations(cfg.family, tasks, gids, seed=cfg.seed))
    return out


def _checkpoint(path) -> dict:
    return load_file(str(next(Path(path).glob("*.safetensors"))))


def _close(a, b):
    assert np.abs(b).max() > 0
    np.testing.assert_allclose(a, b, rtol=0, atol=1e-6 * np.abs(b).max())


@pytest.mark.timeout(420)
def test_loop_switches_roles_between_steps(switched):
    loop, rows, out = switched
    assert [r["libra_split"] for r in rows] == [[2, 1], [1, 2], [2, 1]]
    assert [r["rollout_ranks"] for r in rows] == [[1, 2], [2], [1, 2]]
    assert [r["train_ranks"] for r in rows] == [[0], [0, 1], [0]]
    moves = [[(m["rank"], m["to"]) for m in r["libra_moves"]] for r in rows]
    assert moves == [[(2, "rollout"), (1, "rollout")], [(1, "training")], [(1, "rollout")]]
    assert rows[1]["libra_moves"][0]["state_sync_s"] > 0          # parameters + AdamW state broadcast
    assert rows[2]["libra_moves"][0]["resident"] is True           # the kept engine resumed
    assert all(r["switch_s"] > 0 for r in rows)
    assert [r["rollout_weight_versions"] for r in rows] == [["v0w"], ["v1"], ["v2"]]
    for r in rows:
        assert r["failed"] == 0 and r["trajectories"] > 0 and r["compression"] > 1.0
        assert r["logprob_mismatch_max"] < 2e-4, r["logprob_mismatch_max"]
    saved = json.load(open(out / "rollout.json"))
    assert saved["config"]["libra_pool"] == 3 and [r["libra_split"] for r in saved["rows"]] == [[2, 1], [1, 2], [2, 1]]


@pytest.mark.timeout(420)
def test_same_batch_same_gradient_and_weights_across_switches(switched, replay):
    loop, rows, out = switched
    pool = replay
    warm = _warmup_batches(loop)
    # a saved RL step (real trees: forks share their prefix); the random model's episodes all score
    # 0, so their GRPO advantages are 0: give them +-1 to get a gradient through the policy loss
    step0 = read_jsonl(out / "rollouts" / "step_0000.jsonl")
    for i, t in enumerate(step0):
        t.advantage = 1.0 if i % 2 else -1.0
    assert pool.training == [0, 1]
    g2 = [pool.rl_grads(b) for b in (warm[0], step0)]         # DP = {0, 1}
    pool.to_rollout(1)                                          # worker 1 serves: DP = {0}
    g1 = [pool.rl_grads(b) for b in (warm[0], step0)]
    pool.to_training(1)
    for a, b in zip(g1, g2):
        _close(a, b)
    # the fixed split (2 ranks) replays the loop's batches: warm-up, then the saved RL steps
    for b, logged in zip(warm, loop.warmup["train"]):
        m = pool.train_step(b)
        assert logged["train_ranks"] == [0] and m["train_ranks"] == [0, 1] and m["grad_norm"] > 0
        assert m["grad_norm"] == pytest.approx(logged["grad_norm"], rel=1e-5)      # before clipping: scale-sensitive
        assert m["loss"] == pytest.approx(logged["loss"], rel=1e-5)
    for step, row in enumerate(rows):
        m = pool.train_step(read_jsonl(out / "rollouts" / f"step_{step:04d}.jsonl"))
        assert m["train_ranks"] == [0, 1] and m["loss"] == pytest.approx(row["loss"], abs=1e-6)
    mine, _ = pool.export("v3")
    w_loop = _checkpoint(out / "weights" / "train_v3")
    w_fixed = _checkpoint(mine)
    w0 = _checkpoint(out / "weights" / "w2_v0")                   # the first engine's v0 export
    assert w_loop.keys() == w_fixed.keys()
    names = sorted(w_loop)
    diff = np.sqrt(sum(float(np.sum((w_loop[k].astype(np.float64) - w_fixed[k]) ** 2)) for k in names))
    moved = np.sqrt(sum(float(np.sum((w_loop[k].astype(np.float64) - w0[k]) ** 2)) for k in names))
    assert moved > 1e-3 and diff <= 1e-4 * moved, (diff, moved)


def test_sync_planner_moves_only_when_the_saving_pays_for_the_switch():
    """``StreamPlanner.plan_sync``: rollout seconds ~ 1 / engines, training ~ 1 / workers, summed."""
    m = StreamMeasure(rollout_tok_s=10.0, batch_tokens=400.0, train_s=1.0, train_gpus=2, idle_frac=0.0,
                      intervals=1, current=1)             # rollout 40 s on 1 engine, training 1 s on 2
    p = StreamPlanner(train=CPU_TRAIN_SHAPE, gpus=3, sync_s=0.0, switch_s=5.0, switch_back_s=0.1,
                      latency_bound=False, min_intervals=1)
    assert p.sync_step_s(m, 1, (100.0, 10.0)) == pytest.approx(41.0)
    assert p.sync_step_s(m, 2, (100.0, 10.0)) == pytest.approx(22.0)      # 20 s rollout + 2 s on 1 worker
    plan = p.plan_sync(m, 1, (100.0, 10.0), steps_left=3)
    assert plan.rollout_gpus == 2 and plan.detail["why"] == "move"
    slow = StreamPlanner(train=CPU_TRAIN_SHAPE, gpus=3, switch_s=100.0, latency_bound=False, min_intervals=1)
    assert slow.plan_sync(m, 1, (100.0, 10.0), steps_left=3).detail["why"] == "hysteresis"
    assert p.plan_sync(None, 1, (100.0, 10.0), steps_left=3).detail["why"] == "not converged"
    # the loop's policy reads its rows and measured switches
    row = {"rollout_ranks": [2], "train_ranks": [0, 1], "sync_s": 0.0, "generated_tokens": 400, "rollout_s": 40.0,
           "train_s": 1.0, "packed_tokens": 100, "trajectory_tokens": 100, "trajectories": 10}
    r, detail = LibraSplit(3, "planner").plan(1, 4, [row], [{"to": "rollout", "seconds": 5.0}])
    assert r == 2 and detail["why"] == "move" and detail["predicted_step_s"]["2"] < detail["predicted_step_s"]["1"]


@pytest.mark.parametrize("kw, message", [
    (dict(libra_pool=1), "libra_pool must be 0 (off) or >= 2"),
    (dict(libra_pool=3, engine="sglang"), "does not support engine='sglang'"),
    (dict(libra_pool=3, use_ray=True), "does not support use_ray"),
    (dict(libra_pool=3, engine_urls=["http://127.0.0.1:9"]), "does not support engine_urls"),
    (dict(libra_pool=3, libra_policy="schedule"), "needs libra_schedule"),
    (dict(libra_pool=3, libra_policy="schedule", libra_schedule=[1, 3]), "entries must be rollout workers in 1..2"),
    (dict(libra_pool=3, libra_policy="greedy"), "libra_policy must be one of"),
    (dict(libra_schedule=[1]), "libra_schedule needs libra_pool >= 2"),
])
def test_bad_libra_config_is_one_line_value_error(kw, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")) as e:
        LoopConfig(**kw)
    assert "\n" not in str(e.value)


def test_cli_libra_flags(capsys):
    from megatron_harts.rollout.cli import parse_args

    cfg = parse_args(["--libra-pool", "3", "--libra-policy", "schedule", "--libra-schedule", "1,2,1"])
    assert (cfg.libra_pool, cfg.libra_policy, cfg.libra_schedule) == (3, "schedule", [1, 2, 1])
    with pytest.raises(SystemExit) as e:
        parse_args(["--libra-pool", "3", "--engine", "sglang"])
    assert e.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert "does not support engine='sglang'" in err[-1] and "Traceback" not in "\n".join(err)
