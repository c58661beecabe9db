"""``python -m megatron_harts.rollout``: agentic RL on SGLang (or the embedded CPU engine) with HARTS.

CPU (the default, runs anywhere; the embedded transformers engine, not SGLang)::

    python -m megatron_harts.rollout --steps 2

GPU (SGLang 0.5.x installed; the trainer on the same GPU)::

    python -m megatron_harts.rollout --engine sglang --device cuda --model small-moe --steps 50 \
        --engine-args="--mem-fraction-static 0.3"

or against running servers: ``--engine-urls http://host:30000,http://host:30001``. Prints one
line per step (reward, compression, rollout / train / sync seconds, rollout-train log-prob
mismatch) and writes ``<out>/rollout.json``. ``--trainer traj`` trains the same loop
trajectory-wise (the baseline). ``--ray`` runs the engines, the environment workers and the
trainer as Ray actors (a local cluster is started unless ``RAY_ADDRESS`` points to one).

Libra in the loop (CPU): ``--libra-pool 3`` replaces the trainer and the engines by an elastic pool
of 3 Ray workers (Megatron trainer in Megatron DDP, embedded engines) split every step between
rollout and training by Libra's planner on the measured step times (``--libra-policy planner``)
or a fixed list (``--libra-policy schedule --libra-schedule 1,2,1``: rollout workers per step)::

    python -m megatron_harts.rollout --libra-pool 3 --steps 4
"""
from __future__ import annotations

import argparse
import logging
import shlex
import sys
import warnings

from .agent_loop import RolloutConfig
from .envs import list_families
from .loop import NUM_TASK_INDICES, LoopConfig, RLLoop
from .weight_sync import model_config


def parse_args(argv=None) -> LoopConfig:
    ap = argparse.ArgumentParser(prog="python -m megatron_harts.rollout", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    g = ap.add_argument_group("loop")
    g.add_argument("--steps", type=int, default=2)
    g.add_argument("--out", default="out/rl", help="run directory (checkpoints, engine logs, rollout.json)")
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--ray", action="store_true", help="engines, rollout workers and the trainer as Ray actors")
    g = ap.add_argument_group("engine")
    g.add_argument("--engine", choices=["embedded", "sglang"], default="embedded",
                   help="embedded: in-process transformers server (CPU default); sglang: SGLang servers")
    g.add_argument("--engine-urls", default="", help="comma-separated URLs of running servers (nothing started)")
    g.add_argument("--num-engines", type=int, default=1)
    g.add_argument("--engine-args", default="", help="extra server arguments, one shell-quoted string")
    g.add_argument("--engine-env", action="append", default=[], metavar="KEY=VALUE",
                   help="environment of started servers (repeatable), e.g. PYTHONPATH=/opt/sglang")
    g = ap.add_argument_group("rollouts")
    g.add_argument("--family", default="lookup", choices=list_families(),
                   help="task family (lookup: learnable; code_repair)")
    g.add_argument("--tasks-per-step", type=int, default=4)
    g.add_argument("--group-size", type=int, default=4)
    g.add_argument("--branch-turn", type=int, default=1, help="fork running episodes after this turn (0: never)")
    g.add_argument("--branch-factor", type=int, default=2)
    g.add_argument("--max-turns", type=int, help="model turns per episode (default: the task family's)")
    g.add_argument("--max-new-tokens", type=int, default=8, help="per model turn")
    g.add_argument("--max-context-tokens", type=int, default=2048)
    g.add_argument("--temperature", type=float, default=1.0)
    g.add_argument("--max-concurrency", type=int, default=16)
    g.add_argument("--rollout-workers", type=int, default=1)
    g.add_argument("--router", choices=["sticky", "war"], default="sticky",
                   help="turn placement on the engines: sticky least-loaded, or WAR's cache/progress/load-aware "
                        "scheduler")
    g.add_argument("--turn-queue", choices=["fcfs", "plas", "cmlfq"], default=None,
                   help="Libra: order of the turns waiting for one of --max-concurrency slots (cmlfq: causality-driven "
                        "MLFQ, tool successes first; default: the loop's own first-come order)")
    g.add_argument("--shadows", type=int, default=0,
                   help="Belayer: pre-started shadow engine workers that take over a failed one, whose requests "
                        "continue from their logged tokens (0: off; started engines, without --ray)")
    g = ap.add_argument_group("libra (elastic pool)")
    g.add_argument("--libra-pool", type=int, default=0, metavar="N",
                   help="run an elastic pool of N Ray workers (Megatron trainer, embedded engines) whose split between "
                        "rollout and training changes per step (0: off; >= 2)")
    g.add_argument("--libra-policy", choices=["planner", "schedule"], default="planner",
                   help="planner: Libra's StreamPlanner (synchronous objective) on the measured step; schedule: "
                        "--libra-schedule")
    g.add_argument("--libra-schedule", default="", metavar="R,R,...",
                   help="rollout workers per step (cycled), e.g. 1,2,1 (with --libra-policy schedule)")
    g = ap.add_argument_group("trainer")
    g.add_argument("--trainer", choices=["tree", "traj"], default="tree", help="tree: HARTS; traj: baseline")
    g.add_argument("--model", default="tiny", help="model preset (tiny, tiny-moe, small, small-moe; SGLang "
                   "serves only the -moe ones) or a Qwen3-Next config.json / checkpoint directory")
    g.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    g.add_argument("--lr", type=float, default=1e-3)
    g.add_argument("--chunk-size", type=int, default=16)
    g.add_argument("--attention-backend", choices=["auto", "torch", "flex"], default="auto",
                   help="tree attention kernel of the trainer (torch: SDPA with a dense mask, for small packs)")
    g.add_argument("--sft-warmup-steps", type=int, default=0,
                   help="supervised steps on scripted demonstrations before RL (cold start)")
    g.add_argument("--old-logprobs", choices=["trainer", "engine"], default="trainer",
                   help="ratio denominator: the trainer's own forward (on-policy) or the engine's log-probs")
    g.add_argument("--warmup-lr", type=float, help="learning rate of the warm-up (default: --lr)")
    g.add_argument("--warmup-target-reward", type=float,
                   help="stop the warm-up once a probe rollout (every 2 warm-up steps) reaches this mean reward; "
                        "--sft-warmup-steps is then the most it runs")
    a = ap.parse_args(argv)
    for name in ("steps", "tasks_per_step", "group_size", "branch_factor", "max_new_tokens", "num_engines",
                 "rollout_workers", "max_concurrency", "chunk_size", "max_context_tokens"):
        if getattr(a, name) < 1:
            ap.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(a, name)}")
    if a.max_turns is not None and a.max_turns < 1:
        ap.error(f"--max-turns must be >= 1, got {a.max_turns}")
    if a.tasks_per_step > NUM_TASK_INDICES:
        ap.error(f"--tasks-per-step must be <= {NUM_TASK_INDICES}, got {a.tasks_per_step}")
    if a.lr <= 0:
        ap.error(f"--lr must be > 0, got {a.lr}")
    if a.warmup_lr is not None and a.warmup_lr <= 0:
        ap.error(f"--warmup-lr must be > 0, got {a.warmup_lr}")
    for name in ("branch_turn", "sft_warmup_steps", "temperature"):
        if getattr(a, name) < 0:
            ap.error(f"--{name.replace('_', '-')} must be >= 0, got {getattr(a, name)}")
    if a.warmup_target_reward is not None and not a.sft_warmup_steps:
        ap.error("--warmup-target-reward needs --sft-warmup-steps N > 0 (the most warm-up steps)")
    try:
        model_config(a.model, check=True)
    except ValueError as e:
        ap.error(f"--model: {e}")
    if a.shadows < 0:
        ap.error(f"--shadows must be >= 0, got {a.shadows}")
    if a.shadows and (a.ray or a.engine_urls):
        ap.error("--shadows needs engines started by the loop on the local path (not with --ray or --engine-urls)")
    bad = [e for e in a.engine_env if "=" not in e]
    if bad:
        ap.error(f"--engine-env expects KEY=VALUE, got {bad[0]!r}")
    try:
        schedule = [int(x) for x in a.libra_schedule.split(",") if x.strip()]
    except ValueError:
        ap.error(f"--libra-schedule expects comma-separated integers, got {a.libra_schedule!r}")
    ro = RolloutConfig(group_size=a.group_size, branch_turn=a.branch_turn or None, branch_factor=a.branch_factor,
                       max_turns=a.max_turns, max_new_tokens=a.max_new_tokens,
                       max_context_tokens=a.max_context_tokens, temperature=a.temperature,
                       max_concurrency=a.max_concurrency, seed=a.seed)
    try:
        return LoopConfig(steps=a.steps, engine=a.engine, engine_urls=[u for u in a.engine_urls.split(",") if u],
                          num_engines=a.num_engines, engine_args=shlex.split(a.engine_args),
                          engine_env=dict(e.split("=", 1) for e in a.engine_env), family=a.family,
                          tasks_per_step=a.tasks_per_step, rollout=ro, rollout_workers=a.rollout_workers,
                          trainer=a.trainer, model=a.model, lr=a.lr, chunk_size=a.chunk_size, device=a.device,
                          attention_backend=a.attention_backend,
                          seed=a.seed, use_ray=a.ray, out=a.out, sft_warmup_steps=a.sft_warmup_steps,
                          warmup_lr=a.warmup_lr, warmup_target_reward=a.warmup_target_reward,
                          old_logprobs=a.old_logprobs, router=a.router, shadows=a.shadows,
                          turn_queue=a.turn_queue, libra_pool=a.libra_pool, libra_policy=a.libra_policy,
                          libra_schedule=schedule)
    except ValueError as e:                 # LoopConfig's own checks (e.g. --libra-pool with --engine sglang)
        ap.error(str(e))


HEADER = "step  reward  compr.  traj  rollout_s  train_s  sync_s  mismatch"
ROW = "{step:>4}  {reward_mean:>6.3f}  {compression:>5.2f}x  {trajectories:>4}  {rollout_s:>9.2f}  {train_s:>7.2f}  " \
      "{sync_s:>6.2f}  {mismatch:>8.2e}"


LIBRA_HEADER = "  split(r/t)  switch_s  trained"
LIBRA_ROW = "  {0:>4}/{1:<4}  {switch_s:>8.2f}  {train_ranks}"


def main(argv=None) -> int:
    cfg = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s", datefmt="%H:%M:%S")
    warnings.filterwarnings("ignore", category=UserWarning, module=r"(megatron|fla)\.")
    try:
        rows = RLLoop(cfg).run()
    except (ValueError, RuntimeError, OSError) as e:      # bad input, engines down, every episode failed
        print(f"error: {e}", file=sys.stderr)
        return 1
    print(f"\n{cfg.trainer} trainer, {cfg.engine} engine, family {cfg.family}: rows in {cfg.out}/rollout.json")
    print(HEADER + (LIBRA_HEADER if cfg.libra_pool else ""))
    for r in rows:
        print(ROW.format(**r, mismatch=r["logprob_mismatch_max"] if r["logprob_mismatch_max"] is not None
                         else float("nan")) + (LIBRA_ROW.format(*r["libra_split"], **r) if cfg.libra_pool else ""))
    return 0
