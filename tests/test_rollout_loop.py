"""The RL loop on real parts, on CPU: embedded transformers engine (its own process, SGLang's HTTP
API), bubblewrap + overlayfs sandboxes, Megatron trainer (tree-packed and trajectory-wise), weight
sync through Hugging Face checkpoints; locally and on a Ray cluster.

What is checked against what:
* trajectories: loss mask exactly on generated tokens, engine log-probs there, rewards from the
  environment, forks sharing their prefix so trees compress (> 1x);
* after each sync the engine serves the new version, and the trainer's tree-packed log-probs of
  the next step's sampled tokens equal the engine's (fp32: <= 2e-4 nats), i.e. the engine really
  loaded the trained weights (a stale engine differs by the update, checked > 1e-3);
* tree-packed and trajectory-wise trainers take the same step on the same rollouts (loss,
  gradients' effect on log-probs);
* faults: a dead engine URL next to a live one loses no episode; with only dead engines every
  episode is reported failed (none silently dropped).
"""
from __future__ import annotations

import json
import os

import numpy as np
import pytest
import torch

from megatron_harts.rollout.agent_loop import AgentLoop, RolloutConfig
from megatron_harts.rollout.engines import HttpEngine, start_engine
from megatron_harts.rollout.envs import make_env
from megatron_harts.rollout.loop import LoopConfig, RLLoop, TrainerWorker, demonstrations
from megatron_harts.rollout.tokenizer import ByteTokenizer
from megatron_harts.rollout.weight_sync import model_config

DEAD_URL = "http://127.0.0.1:9"          # discard port: connection refused at once
WARMUP_STEPS = 25


@pytest.fixture(scope="module")
def trainer_and_engine(tmp_path_factory):
    out = tmp_path_factory.mktemp("rl")
    tw = TrainerWorker(model_config("tiny"), str(out / "weights"), tree=True, lr=1e-2, chunk_size=8, device="cpu",
                       seed=0)
    # cold start: supervised steps on scripted correct episodes (real sandboxes), so that the
    # sampled episodes call the tool and fork (a random model rarely emits </call>)
    for i in range(WARMUP_STEPS):
        demo = demonstrations("lookup", list(range(1000 + 16 * i, 1016 + 16 * i)), [f"demo{j}" for j in range(16)])
        tw.train_step(demo)
    path, _ = tw.export("v0")
    srv = start_engine("embedded", path, log_path=str(out / "engine.log"), weight_version="v0")
    try:
        yield tw, srv, out
    finally:
        srv.stop()
        tw.trainer.close()


def _loop(urls, cfg=None):
    return AgentLoop([HttpEngine(u, timeout=60, retries=1) for u in urls], ByteTokenizer(),
                     lambda task: make_env("lookup", int(task), seed=0),
                     cfg or RolloutConfig(group_size=2, branch_turn=1, branch_factor=2, max_turns=2,
                                          max_new_tokens=6, max_concurrency=4))


def test_rollout_train_sync_consistency(trainer_and_engine):
    tw, srv, out = trainer_and_engine
    res = _loop([srv.url]).rollout([3, 5], ["g3", "g5"])
    assert not res.failed and len(res.trajectories) >= 4
    assert res.stats["groups"] == 2 and 0 <= res.stats["zero_variance_groups"] <= 2
    tok = ByteTokenizer()
    for t in res.trajectories:
        mask = t.loss_mask.astype(bool)
        assert mask.any() and not mask[0]
        gen = t.old_logprobs[mask]
        assert (gen < 0).all() and (t.old_logprobs[~mask] == 0).all()
        assert t.reward is not None and t.extra["turns"][0][3] == "v0"
        assert tok.decode(t.tokens[:1]) == "<bos>"
    # forks after turn 1 share the prompt and the first turn: real trees; an episode that ended at
    # turn 1 (the sampled model answered without a tool call) has nothing to fork
    depth = {t.traj_id: len(t.traj_id.split("/")[1].split(".")) for t in res.trajectories}
    assert 2 in depth.values() and set(depth.values()) <= {1, 2}, depth
    for t in res.trajectories:
        assert depth[t.traj_id] == 2 or len(t.extra["turns"]) <= 1, (t.traj_id, len(t.extra["turns"]))

    m0 = tw.train_step(res.trajectories)
    assert m0["compression"] > 1.0
    assert m0["logprob_mismatch_max"] < 2e-4, m0           # engine v0 == trainer v0
    path, _ = tw.export("v1")
    HttpEngine(srv.url).update_weights_from_disk(path, "v1")
    assert HttpEngine(srv.url).weight_version() == "v1"

    res1 = _loop([srv.url]).rollout([7], ["g7"])
    assert all(t.extra["turns"][-1][3] == "v1" for t in res1.trajectories)
    lp = tw.logprobs(res1.trajectories)                     # trainer at v1, tree-packed
    diffs = [np.abs(l - t.old_logprobs[1:])[t.loss_mask[1:].astype(bool)] for l, t in zip(lp, res1.trajectories)]
    assert max(d.max() for d in diffs) < 2e-4
    # the update changed the policy: the stale (v0) weights would not match
    stale = TrainerWorker(model_config("tiny"), str(out / "stale"), tree=True, lr=0.0, chunk_size=8, device="cpu",
                          seed=0)
    try:
        lp0 = stale.logprobs(res1.trajectories)
        moved = max(np.abs(a - b)[t.loss_mask[1:].astype(bool)].max()
                    for a, b, t in zip(lp0, lp, res1.trajectories))
        assert moved > 1e-3
    finally:
        stale.trainer.close()


def test_dead_engine_loses_no_episode(trainer_and_engine):
    _, srv, _ = trainer_and_engine
    res = _loop([DEAD_URL, srv.url]).rollout([11, 12], ["a", "b"])
    alone = _loop([srv.url]).rollout([11, 12], ["a", "b"])        # seeded sampling: the same episodes
    assert not res.failed and len(res.trajectories) == len(alone.trajectories) >= 4
    assert [t.tokens.tolist() for t in res.trajectories] == [t.tokens.tolist() for t in alone.trajectories]
    res = _loop([DEAD_URL]).rollout([11], ["a"])
    assert not res.trajectories and len(res.failed) == 2       # both roots, each reported with its reason
    assert all("127.0.0.1:9" in why for _, why in res.failed)


@pytest.mark.parametrize("use_ray", [False, True], ids=["local", "ray"])
def test_loop_two_steps(tmp_path, use_ray):
    cfg = LoopConfig(steps=2, tasks_per_step=2, rollout=RolloutConfig(group_size=2, branch_turn=1, branch_factor=2,
                                                                      max_turns=2, max_new_tokens=6),
                     out=str(tmp_path), use_ray=use_ray, chunk_size=8)
    rows = RLLoop(cfg).run()
    assert [r["step"] for r in rows] == [0, 1]
    for r in rows:
        assert r["failed"] == 0 and r["compression"] > 1.0
        assert r["logprob_mismatch_max"] < 2e-4
        assert r["rollout_s"] > 0 and r["train_s"] > 0 and r["sync_s"] > 0
    assert rows[1]["rollout_weight_versions"] == ["v1"]
    saved = json.load(open(tmp_path / "rollout.json"))
    assert len(saved["rows"]) == 2
    for k in ("step", "engine", "rollout_s", "train_s", "sync_s", "compression", "reward_mean",
              "logprob_mismatch_max"):
        assert k in saved["rows"][0]


def test_tree_and_trajectory_trainers_take_the_same_step(trainer_and_engine, tmp_path):
    """HARTS in the loop: the tree-packed and the trajectory-wise trainer, same seed and rollouts,
    end the step with the same weights (their log-probs agree to fp32 noise)."""
    _, srv, _ = trainer_and_engine
    res = _loop([srv.url]).rollout([21, 22], ["x", "y"])
    ws = [TrainerWorker(model_config("tiny"), str(tmp_path / k), tree=k == "tree", lr=3e-3, chunk_size=8,
                        device="cpu", seed=0) for k in ("tree", "traj")]
    try:
        ms = [w.train_step(res.trajectories) for w in ws]
        assert ms[0]["compression"] > 1.0 and ms[1]["compression"] == 1.0
        assert abs(ms[0]["loss"] - ms[1]["loss"]) <= 1e-5 * max(1.0, abs(ms[1]["loss"]))
        assert abs(ms[0]["grad_norm"] - ms[1]["grad_norm"]) <= 1e-4 * ms[1]["grad_norm"]
        a, b = (w.logprobs(res.trajectories) for w in ws)
        assert max(float(np.abs(x - y).max()) for x, y in zip(a, b)) < 1e-4
    finally:
        for w in ws:
            w.trainer.close()


@pytest.mark.parametrize("tree", [True, False], ids=["tree", "traj"])
def test_step_moves_policy_along_the_advantage(tree):
    """One on-policy step raises the log-probs of the positive-advantage trajectories' generated
    tokens and lowers the negative ones' (the sign of the whole trainer path; a shared prompt, so
    the tree pack has a branch point)."""
    from megatron_harts.rollout.trainer import HartsTrainer
    from megatron_harts.tree import make_trajectory

    t = HartsTrainer(model_config("tiny"), tree=tree, lr=1e-3, chunk_size=8, seed=0)
    try:
        rng = np.random.default_rng(0)
        prompt = [1] + [int(x) for x in rng.integers(8, 264, 10)]
        trajs = [make_trajectory(i, prompt + [int(x) for x in rng.integers(8, 264, 5)], traj_id=f"t{i}",
                                 group_id="g", loss_mask=[0] * len(prompt) + [1] * 5,
                                 advantage=1.0 if i < 4 else -1.0) for i in range(8)]
        before = t.logprobs(trajs)
        for tr, lp in zip(trajs, before):
            tr.old_logprobs = np.concatenate([[0.0], lp]).astype(np.float32)
        m = t.train_step(trajs)
        assert m["logprob_mismatch_max"] < 1e-5 and (m["compression"] > 1.0) == tree
        moved = [float((b - a)[-5:].sum()) for a, b in zip(before, t.logprobs(trajs))]
        assert all(d > 0.1 for d in moved[:4]) and all(d < -0.1 for d in moved[4:]), moved
    finally:
        t.close()


@pytest.mark.parametrize("args, message", [
    (["--family", "nope"], "invalid choice: 'nope'"),
    (["--tasks-per-step", "20000"], "--tasks-per-step must be <= 10000"),
    (["--chunk-size", "0"], "--chunk-size must be >= 1"),
    (["--engine-env", "NOEQUALS"], "--engine-env expects KEY=VALUE"),
    (["--model", "/nonexistent/config.json"], "neither a preset"),
    (["--model", "{bad}"], "missing or invalid field"),
])
def test_cli_rejects_bad_input_in_one_line(args, message, tmp_path, capsys):
    """User mistakes end at argument parsing with exit status 2 and one line naming the flag
    (no traceback, nothing started)."""
    from megatron_harts.rollout.cli import parse_args

    if "{bad}" in args:
        (tmp_path / "config.json").write_text('{"model_type": "qwen3_next", "hidden_size": 8}')
        args = [a.replace("{bad}", str(tmp_path / "config.json")) for a in args]
    with pytest.raises(SystemExit) as e:
        parse_args(args)
    assert e.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert message in err[-1] and "Traceback" not in "\n".join(err)


@pytest.mark.parametrize("target, steps_done", [(-1.0, 2), (2.0, 4)], ids=["reached", "never"])
def test_warmup_stops_at_the_target_reward(tmp_path, target, steps_done):
    """A probe rollout every 2 warm-up steps: a reachable target (-1: any reward) ends the warm-up at
    the first probe, an unreachable one (2: above the maximum reward 1) runs all 4 steps; the probes
    are recorded, served on their own pushed weights, and the RL step then runs on the warm-up's."""
    cfg = LoopConfig(steps=1, tasks_per_step=2, rollout=RolloutConfig(group_size=2, branch_turn=1, branch_factor=2,
                                                                      max_turns=2, max_new_tokens=6),
                     out=str(tmp_path), chunk_size=8, sft_warmup_steps=4, warmup_target_reward=target,
                     warmup_probe_every=2)
    loop = RLLoop(cfg)
    rows = loop.run()
    assert loop.warmup["steps"] == steps_done
    assert [p["after_steps"] for p in loop.warmup["probes"]] == [2]       # none after the last step
    assert 0.0 <= loop.warmup["probes"][0]["reward_mean"] <= 1.0
    assert rows[0]["rollout_weight_versions"] == ["v0w"]
    assert json.load(open(tmp_path / "rollout.json"))["warmup"]["steps"] == steps_done


def test_warmup_target_needs_warmup_steps():
    with pytest.raises(ValueError, match="warmup_target_reward needs sft_warmup_steps"):
        LoopConfig(warmup_target_reward=0.5)
