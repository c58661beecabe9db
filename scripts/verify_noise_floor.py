"""How many baseline reruns ``verify --device cuda`` needs for its bf16 noise floor: a CPU bf16 analogue.

``verify --device cuda`` gates each quantity of a correct tree's difference to the baseline at
``--noise-factor`` (3) times the baseline's own difference to its reruns in other tree orders. Each
difference is a maximum over elements, one draw of a heavy-tailed quantity (in bf16 a MoE routing
flip lands in a branch window or not), so a floor from one rerun can sit far below the next draw.
This script measures that on CPU without a GPU: the tiny MoE hybrid (``G*E-G*E-``, 8 experts, every
multiplicity-weighted router objective on) in bf16 through ``cpu_shim``, torch backends, per seed and
expert kind (Megatron's ``SequentialMLP`` / torch's grouped GEMM): the tree's difference to the
baseline over the floor of the first K reruns (``verify.noise_orders``: reversed, then shuffles),
per gated quantity. A correct tree's worst ratio above ``--noise-factor`` is a false failure.

    python scripts/verify_noise_floor.py --seeds 0,1,2,3 --experts sequential,grouped --reruns 4 \\
        --out docs/benchmarks/verify_noise_floor_cpu.json

Prints a markdown table (worst ratio per K, and where) and writes the rows as JSON. CPU kernels are
not the H200's; the H200 check itself runs with ``--noise-reruns`` (docs/benchmarks/verify_mutants.md).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megatron_harts import verify as V  # noqa: E402
from megatron_harts.megatron import cpu_shim, tree_hybrid_stack_spec  # noqa: E402
from megatron_harts.packing import pack, pack_trajectories  # noqa: E402
from megatron_harts.tree import trees_from_trajectories  # noqa: E402
from megatron_harts.workloads import AgenticConfig, agentic_batch  # noqa: E402


def measure(seed: int, grouped: bool, reruns: int, *, pattern: str = "G*E-G*E-", experts: int = 8,
            groups: int = 4, group_size: int = 6, prompt_tokens: tuple[int, int] = (40, 80),
            chunk_size: int = 64, factor: float = 3.0) -> dict:
    """One seed and expert kind: ``{"ratio_by_reruns": {K: [worst key, worst diff / floor]}, ...}``
    for K = 1 .. ``reruns`` (floor = the largest of the first K reruns' differences, at least
    ``verify.BF16_FLOOR``); ``false_failure`` per K when the worst ratio exceeds ``factor``."""
    dtype = torch.bfloat16
    trajs = agentic_batch(AgenticConfig(num_groups=groups, group_size=group_size, vocab_size=256,
                                        prompt_tokens=prompt_tokens, assistant_tokens=(8, 20),
                                        tool_tokens_median=12, tool_tokens_max=40, seed=seed))
    trees = trees_from_trajectories(trajs)
    g = torch.Generator().manual_seed(seed)
    weights = [torch.randn(len(r) - 1, generator=g).to(dtype) for tree in trees for r in tree.records]
    windows = V.branch_windows(pack(trees, chunk_size=chunk_size))
    orders = V.noise_orders(len(trees), reruns, seed)
    moe = dict(V.MOE_OBJECTIVES, num_moe_experts=experts)
    t0 = time.perf_counter()
    with cpu_shim.cpu_megatron(seed=seed):
        cpu_shim.cpu_manual_seed(seed)
        model = cpu_shim.build_tiny_hybrid_model(
            pattern, vocab_size=256, init_method_std=0.1, max_sequence_length=max(len(t.tokens) for t in trajs),
            hybrid_stack_spec=tree_hybrid_stack_spec(experts, grouped_experts=grouped), params_dtype=dtype, **moe)
        for prm in model.parameters():          # the torch norms ignore params_dtype
            prm.data = prm.data.to(dtype)
        run = lambda layout, **kw: V.run_side(model, trees, layout, weights, chunk_size, **kw)  # noqa: E731
        base = run(pack_trajectories)
        noises = [V.compare(run(pack_trajectories, order=o), base, windows) for o in orders]
        diff = V.compare(run(pack), base, windows)
    by_k = {}
    for k in range(1, len(orders) + 1):
        gates = V.noise_gates(diff, noises[:k], factor)
        worst = max(gates, key=lambda q: gates[q][0] / gates[q][1])
        by_k[k] = [worst, gates[worst][0] / gates[worst][1] * factor]
    return {"seed": seed, "experts": "grouped" if grouped else "sequential", "trajectories": len(trajs),
            "tokens": sum(len(t.tokens) for t in trajs), "compression": pack(trees).compression,
            "reruns": len(orders), "ratio_by_reruns": by_k,
            "false_failure": {k: v[1] > factor for k, v in by_k.items()}, "seconds": time.perf_counter() - t0}


def table(rows: list[dict], factor: float) -> list[str]:
    ks = sorted({int(k) for r in rows for k in r["ratio_by_reruns"]})
    head = "| seed | experts | " + " | ".join(f"worst ratio, {k} rerun{'s' * (k > 1)}" for k in ks) + " |"
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for r in rows:
        cells = []
        for k in ks:
            key, ratio = r["ratio_by_reruns"].get(k, r["ratio_by_reruns"].get(str(k), ["-", float("nan")]))
            cells.append(f"{'**' if ratio > factor else ''}{ratio:.2f}{'**' if ratio > factor else ''} ({key})")
        lines.append(f"| {r['seed']} | {r['experts']} | " + " | ".join(cells) + " |")
    fails = {k: sum(bool(r["false_failure"].get(k, r["false_failure"].get(str(k)))) for r in rows) for k in ks}
    lines += ["", "False failures of a correct tree at the " + f"{factor:g}x gate: "
              + ", ".join(f"{n} of {len(rows)} with {k} rerun{'s' * (k > 1)}" for k, n in fails.items())]
    return lines


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seeds", default="0,1,2,3")
    ap.add_argument("--experts", default="sequential,grouped", help="sequential (SequentialMLP), grouped, or both")
    ap.add_argument("--reruns", type=int, default=V.NOISE_RERUNS)
    ap.add_argument("--noise-factor", type=float, default=3.0)
    ap.add_argument("--groups", type=int, default=4, help="trees per batch (>= 2)")
    ap.add_argument("--out", help="JSON file for the rows")
    args = ap.parse_args(argv)
    try:
        seeds = [int(s) for s in args.seeds.split(",") if s]
    except ValueError:
        ap.error(f"--seeds: comma-separated integers, got {args.seeds!r}")
    kinds = [k for k in args.experts.split(",") if k]
    if not kinds or any(k not in ("sequential", "grouped") for k in kinds):
        ap.error(f"--experts: sequential and/or grouped, got {args.experts!r}")
    if args.reruns < 1 or args.groups < 2 or not args.noise_factor > 0:
        ap.error("--reruns must be >= 1, --groups >= 2, --noise-factor > 0")
    rows = []
    for seed in seeds:
        for kind in kinds:
            rows.append(measure(seed, kind == "grouped", args.reruns, groups=args.groups, factor=args.noise_factor))
            print(f"[noise-floor] seed {seed} {kind}: " + ", ".join(
                f"K={k} {v[1]:.2f} ({v[0]})" for k, v in rows[-1]["ratio_by_reruns"].items()), file=sys.stderr)
    print("\n".join(table(rows, args.noise_factor)))
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"argv": sys.argv[1:] if argv is None else argv, "torch": torch.__version__, "rows": rows}, f,
                      indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
