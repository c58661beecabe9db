"""The main job on an embedded default: a synthetic agentic batch, tree-packed.

``python -m megatron_harts.demo`` prints the token compression and the linear-attention plan of
a synthetic agentic batch, then runs a tiny Megatron hybrid model (GDN, attention, MLP) tree-packed
and trajectory-wise on a small batch and prints their differences (``megatron_harts.verify``).
Runs on CPU.
"""
from __future__ import annotations

import argparse
import logging
import time
import warnings

from tqdm import tqdm

from .ops import chunk_plan
from .packing import pack
from .tree import RolloutTree
from .workloads import AgenticConfig, agentic_batch

log = logging.getLogger("megatron_harts.demo")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--groups", type=int, default=6)
    ap.add_argument("--group-size", type=int, default=8)
    ap.add_argument("--chunk-size", type=int, default=64)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--no-model", action="store_true", help="only pack; skip the tiny-model comparison")
    args = ap.parse_args(argv)
    for name in ("groups", "group_size", "chunk_size"):
        if getattr(args, name) < 1:
            ap.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    # "Transformer Engine / Apex / Triton not available: falling back" notices on a CPU machine.
    warnings.filterwarnings("ignore", category=UserWarning, module=r"(megatron|fla)\.")

    cfg = AgenticConfig(num_groups=args.groups, group_size=args.group_size, seed=args.seed)
    trajs = agentic_batch(cfg)
    trees = []
    for g in tqdm(range(cfg.num_groups), desc="building trees", unit="group"):
        trees.append(RolloutTree([t for t in trajs if t.group_id == f"g{g}"]))
    t0 = time.perf_counter()
    p = pack(trees, chunk_size=args.chunk_size)
    plan = chunk_plan(p)
    dt = time.perf_counter() - t0

    print(f"{'group':>6} {'traj':>5} {'traj tokens':>12} {'compact':>9} {'compression':>12}")
    for g, tree in enumerate(trees):
        print(f"{g:>6} {len(tree):>5} {tree.num_trajectory_tokens:>12} {tree.num_tokens:>9} {tree.compression:>11.2f}x")
    print(f"{'all':>6} {p.num_trajectories:>5} {p.num_trajectory_tokens:>12} {p.num_tokens:>9} {p.compression:>11.2f}x")
    print(f"linear attention (chunk {args.chunk_size}): {plan.num_rounds} rounds, {plan.num_sequences} sequences, "
          f"{plan.num_replay_tokens} replay tokens ({100 * plan.num_replay_tokens / p.num_tokens:.1f}% of compact)")
    print(f"pack + plan: {dt * 1e3:.1f} ms")
    if args.no_model:
        return 0
    from . import verify
    print("\ntiny Megatron HybridModel 'G*-G-' (fp32, CPU): tree-packed vs trajectory-wise, same weights")
    return verify.main(["--pattern", "G*-G-", "--seed", str(args.seed)])


if __name__ == "__main__":
    raise SystemExit(main())
