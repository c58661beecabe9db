"""The RL loop on one GPU with SGLang: HARTS vs trajectory-wise training from the same seed.

Starts one SGLang server (``megatron_harts.rollout.engines.SGLangServer``, ``--engine-env`` gives
its ``PYTHONPATH``), then runs the loop twice on it, first with the tree-packed trainer, then with
the trajectory-wise one (each pushes its own initial weights first, the same for both: same seed),
each with the same supervised warm-up (scripted lookup demonstrations) followed by ``--steps`` RL
steps. Writes ``<out>/rollout.json``: ``{"runs": {"tree": {...}, "traj": {...}}}`` with the per-step
rows of :class:`megatron_harts.rollout.loop.RLLoop` and the server's start-up seconds.

    PYTHONPATH=/tmp/harts_site:$PWD python3 scripts/gpu_rl.py --out out/rl --steps 40 \
        --engine-env PYTHONPATH=/tmp/site --engine-args "--mem-fraction-static 0.25 --disable-cuda-graph"
"""
from __future__ import annotations

import argparse
import json
import logging
import shlex
import shutil
import time
from dataclasses import replace
from pathlib import Path

from megatron_harts.rollout.agent_loop import RolloutConfig
from megatron_harts.rollout.loop import LoopConfig, RLLoop


def same_batch_check(path: Path, cfg: LoopConfig) -> dict:
    """Tree-packed and trajectory-wise trainers, same seed, one step on the same real rollout batch
    (a step of the run, from its JSONL): losses, gradient norms, and the largest difference of
    their log-probs after the step (same weights before it: the step's update must agree)."""
    import numpy as np

    from megatron_harts.rollout.trainer import HartsTrainer
    from megatron_harts.rollout.weight_sync import model_config
    from megatron_harts.tree import read_jsonl

    trajs = read_jsonl(path)
    kw = dict(lr=cfg.lr, chunk_size=cfg.chunk_size, device=cfg.device, seed=cfg.seed,
              attention_backend=cfg.attention_backend)
    out = {"batch": str(path), "trajectories": len(trajs)}
    lps = {}
    for name in ("tree", "traj"):
        t = HartsTrainer(model_config(cfg.model), tree=name == "tree", **kw)
        before = t.logprobs(trajs)
        m = t.train_step(trajs)
        lps[name] = (before, t.logprobs(trajs))
        out[name] = {k: m[k] for k in ("loss", "grad_norm", "nll", "compression", "train_s", "fwd_bwd_s")}
        del t
    diff = lambda a, b: max(float(np.abs(x - y).max()) for x, y in zip(a, b))
    out["logprob_max_abs_diff_before"] = diff(lps["tree"][0], lps["traj"][0])
    out["logprob_max_abs_diff_after"] = diff(lps["tree"][1], lps["traj"][1])
    out["update_max_abs"] = diff(lps["traj"][1], lps["traj"][0])
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="out/rl")
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--warmup", type=int, default=8, help="supervised warm-up steps before RL")
    ap.add_argument("--model", default="small-moe")
    ap.add_argument("--lr", type=float, default=5e-5, help="RL learning rate")
    ap.add_argument("--warmup-lr", type=float, default=5e-4)
    ap.add_argument("--warmup-target-reward", type=float, default=None,
                    help="stop the first trainer's warm-up once a probe rollout reaches this mean reward (--warmup is "
                         "then the most); later trainers run the same number of warm-up steps, so both start alike")
    ap.add_argument("--tasks-per-step", type=int, default=8)
    ap.add_argument("--group-size", type=int, default=8)
    ap.add_argument("--branch-factor", type=int, default=2)
    ap.add_argument("--trainers", default="tree,traj")
    ap.add_argument("--engine-env", action="append", default=[])
    ap.add_argument("--engine-args", default="--mem-fraction-static 0.25 --disable-cuda-graph")
    ap.add_argument("--attention-backend", default="torch")
    ap.add_argument("--old-logprobs", default="trainer", choices=["trainer", "engine"])
    ap.add_argument("--engine", default="sglang", help="embedded + --device cpu: a dry run of this script on CPU")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--weights-dir", default="/dev/shm/harts_rl", help="checkpoints (RAM disk: no disk write)")
    a = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s", datefmt="%H:%M:%S")
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    base = LoopConfig(steps=a.steps, engine=a.engine, engine_args=shlex.split(a.engine_args),
                      engine_env=dict(e.split("=", 1) for e in a.engine_env), family="lookup",
                      tasks_per_step=a.tasks_per_step,
                      rollout=RolloutConfig(group_size=a.group_size, branch_turn=1, branch_factor=a.branch_factor,
                                            max_turns=2, max_new_tokens=8, max_concurrency=64),
                      model=a.model, lr=a.lr, chunk_size=64, device=a.device, seed=0,
                      sft_warmup_steps=a.warmup, warmup_lr=a.warmup_lr, warmup_target_reward=a.warmup_target_reward,
                      attention_backend=a.attention_backend,
                      old_logprobs=a.old_logprobs)
    runs, servers, urls = {}, [], []
    try:
        for trainer in a.trainers.split(","):
            cfg = replace(base, trainer=trainer, out=str(out / trainer), engine_urls=list(urls), keep_engines=True,
                          weights_dir=a.weights_dir and f"{a.weights_dir}/{trainer}")
            t0 = time.perf_counter()
            loop = RLLoop(cfg)
            rows = loop.run()
            runs[trainer] = {"rows": rows, "wall_s": time.perf_counter() - t0, "warmup": loop.warmup}
            if base.warmup_target_reward is not None:      # the next trainers: the same warm-up, no probes
                base = replace(base, sft_warmup_steps=loop.warmup["steps"], warmup_target_reward=None)
            shutil.rmtree(cfg.weights_dir or out / trainer / "weights", ignore_errors=True)   # not results
            if not urls:
                servers = loop.servers
                urls = [s.url() for s in servers]
                runs[trainer]["engine_start_s"] = [s.startup_s() for s in servers]
            json.dump({"config": json.loads(json.dumps(vars(a))), "runs": runs}, open(out / "rollout.json", "w"),
                      indent=1, default=str)
    finally:
        for s in servers:
            s.stop()
    first = a.trainers.split(",")[0]
    step = max(runs[first]["rows"], key=lambda r: r["grad_norm"])["step"] if first in runs else -1
    last = out / first / "rollouts" / f"step_{step:04d}.jsonl"      # the step with the largest update
    if last.exists():
        check = same_batch_check(last, base)
        json.dump({"config": json.loads(json.dumps(vars(a))), "runs": runs, "same_batch": check},
                  open(out / "rollout.json", "w"), indent=1, default=str)
        print("same batch, tree vs trajectory-wise:", json.dumps(check))
    for name, r in runs.items():
        rows = r["rows"]
        print(f"{name}: reward {rows[0]['reward_mean']:.3f} -> {rows[-1]['reward_mean']:.3f}, compression "
              f"{sum(x['compression'] for x in rows) / len(rows):.2f}x, train {sum(x['train_s'] for x in rows):.1f} s, "
              f"rollout {sum(x['rollout_s'] for x in rows):.1f} s, sync {sum(x['sync_s'] for x in rows):.1f} s, "
              f"mismatch max {max(x['logprob_mismatch_max'] or 0 for x in rows):.3g}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
