"""Tree ops vs trajectory-wise varlen calls: fwd+bwd time on one GPU, same data, same process.

For trees of compression 2x..10x at 32K..256K trajectory tokens (H=16 heads, K=V=128), times:
  gdn        tree_gated_delta_rule (fla, rounds)        vs fla chunk_gated_delta_rule varlen
  simple_gla tree_simple_gla (fla, rounds)              vs fla chunk_simple_gla varlen
  conv       tree_causal_conv1d (fla conv + fix rows)   vs fla causal_conv1d varlen
  attention  tree_attention (FlexAttention, ancestors)  vs the faster of FlexAttention (document-causal
             mask) and FlashAttention varlen (torch.nn.attention.varlen; both in the JSON)
Target: tree time <= trajectory time / (0.9 x compression). Prints a table last and writes
``ops.json`` to ``--out``; ``--plot`` renders ``ops.md`` + ``ops.png`` from such a JSON (no GPU).

    python scripts/bench_ops.py --out /tmp/out
    python scripts/bench_ops.py --plot docs/benchmarks/ops.json --out docs/benchmarks
"""
from __future__ import annotations

import argparse
import faulthandler
import json
import math
import os
import statistics
import time

import torch
import torch.nn.functional as F

OPS = ("gdn", "simple_gla", "conv", "attention")
PROFILER_OWN = "Activity Buffer Request"   # the profiler's buffer setup (0.3-7 ms once), listed as CUDA time


def time_fwd_bwd(fn, leaves, reps: int, warmup: int = 3) -> float:
    """Median ms of ``fn()`` (returns an output) + backward of a fixed random cotangent."""
    out = fn()
    do = torch.randn_like(out)
    times = []
    for i in range(warmup + reps):
        for x in leaves:
            x.grad = None
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        fn().backward(do)
        e.record()
        torch.cuda.synchronize()
        if i >= warmup:
            times.append(s.elapsed_time(e))
    return statistics.median(times)


def profile(fn, leaves, path: str, reps: int = 3) -> float:
    """torch.profiler table (CUDA and CPU time per op/kernel) of ``reps`` fwd+bwd of ``fn`` written to
    ``path``; returns the GPU busy time of one fwd+bwd in ms: every kernel's self CUDA time (what the
    op would take if the host never made the GPU wait), without the profiler's own buffer setup.
    Leaf grads are reset before each rep, as in :func:`time_fwd_bwd` (else their accumulation adds
    kernels the timed runs do not have)."""
    from torch.profiler import ProfilerActivity, profile as torch_profile

    out = fn()
    do = torch.randn_like(out)
    torch.cuda.synchronize()
    with torch_profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            for x in leaves:
                x.grad = None
            fn().backward(do)
        torch.cuda.synchronize()
    events = prof.key_averages()
    with open(path, "w") as f:
        f.write(events.table(sort_by="cuda_time_total", row_limit=25))
    kernels = [e for e in events if e.device_type == torch.autograd.DeviceType.CUDA and not e.is_user_annotation
               and e.key != PROFILER_OWN]
    return sum(e.self_device_time_total for e in kernels) / reps / 1e3     # us -> ms


def bench_case(total: int, compression: float, args, on_row=lambda row: None) -> list[dict]:
    """Rows of every op in ``args.ops`` on one sweep batch; ``on_row`` sees each row as soon as it is
    measured (so a run stopped midway keeps what it measured)."""
    from fla.modules.causal_conv1d.ops import causal_conv1d
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule
    from fla.ops.simple_gla import chunk_simple_gla

    from megatron_harts.ops import (chunk_plan, tree_attention, tree_causal_conv1d, tree_gated_delta_rule,
                                    tree_simple_gla)
    from megatron_harts.ops.attention import varlen_applies
    from megatron_harts.packing import pack, pack_trajectories
    from megatron_harts.tree import RolloutTree
    from megatron_harts.workloads import sweep_trees

    trees = [RolloutTree.from_trajectories(t) for t in sweep_trees(total, compression, seed=args.seed)]
    t0 = time.perf_counter()
    p = pack(trees, 64)
    plan_host = chunk_plan(p)
    plan_ms = (time.perf_counter() - t0) * 1e3
    p = p.to("cuda")
    pt = pack_trajectories(trees, 64).to("cuda")
    T, N = p.num_tokens, p.num_trajectory_tokens
    idx = p.traj_index
    cu, cu_cpu = pt.traj_cu_seqlens, pt.traj_cu_seqlens.cpu()
    H, K, dev, bf = args.heads, args.dim, "cuda", torch.bfloat16
    rows = []

    def leaf(x, dtype=bf):
        return x.detach().to(dtype).clone().requires_grad_(True)

    def record(op, tree_ms, traj_ms, **extra):
        r = dict(op=op, trajectory_tokens=N, compact_tokens=T, compression=N / T, tree_ms=tree_ms,
                 traj_ms=traj_ms, speedup=traj_ms / tree_ms, target=0.9 * N / T, plan_ms=plan_ms,
                 rounds=plan_host.num_rounds, replay_tokens=plan_host.num_replay_tokens, **extra)
        r["meets_target"] = r["speedup"] >= r["target"]
        rows.append(r)
        on_row(r)
        print(f"  {op:<10} {N:>7} tok {N / T:5.2f}x  tree {tree_ms:8.2f} ms  traj {traj_ms:8.2f} ms  "
              f"speedup {r['speedup']:5.2f} (target {r['target']:.2f})", flush=True)

    def pair(op, make_inputs, tree_fn, traj_fn, fp32=(), traj_alternatives=None):
        """``traj_alternatives`` {name: fn}: other trajectory-wise kernels; the fastest is the baseline
        (``traj_ms``; each time is kept: ``traj_main_ms`` for ``traj_fn``, ``traj_<name>_ms``)."""
        base = make_inputs()
        tl = [leaf(x, torch.float32 if i in fp32 else bf) for i, x in enumerate(base)]
        jl = [leaf(x[idx] if x.shape[0] == T else x, torch.float32 if i in fp32 else bf) for i, x in enumerate(base)]
        tree_ms = time_fwd_bwd(lambda: tree_fn(*tl), tl, args.reps)
        traj_ms = time_fwd_bwd(lambda: traj_fn(*jl), jl, args.reps)
        alt = {}
        for name, fn in (traj_alternatives or {}).items():
            try:
                alt[name] = time_fwd_bwd(lambda: fn(*jl), jl, args.reps)
            except (RuntimeError, NotImplementedError) as e:
                print(f"  {op}: trajectory-wise {name} failed ({e}); not a baseline", flush=True)
        extra = {f"traj_{name}_ms": ms for name, ms in alt.items()}
        if alt:
            extra["traj_main_ms"] = traj_ms
        if op in args.profile:        # GPU busy time per side (the traj side: traj_fn's kernels)
            for side, fn, leaves in (("tree", tree_fn, tl), ("traj", traj_fn, jl)):
                name = f"profile_{op}_{N // 1024}k_{N / T:.0f}x_{side}.txt"
                extra[f"{side}_gpu_ms"] = profile(lambda: fn(*leaves), leaves, os.path.join(args.out, name))
            extra["gpu_speedup"] = extra["traj_gpu_ms"] / extra["tree_gpu_ms"]
        record(op, tree_ms, min([traj_ms, *alt.values()]), **extra)

    gdn_in = lambda: [F.normalize(torch.randn(T, H, K, device=dev), dim=-1),
                      F.normalize(torch.randn(T, H, K, device=dev), dim=-1), torch.randn(T, H, K, device=dev),
                      F.logsigmoid(torch.randn(T, H, device=dev) + 3), torch.rand(T, H, device=dev)]
    if "gdn" in args.ops:
        pair("gdn", gdn_in, lambda *x: tree_gated_delta_rule(*x, p, backend="fla"),
             lambda q, k, v, g, b: chunk_gated_delta_rule(q[None], k[None], v[None], g[None], b[None], cu_seqlens=cu,
                                                          cu_seqlens_cpu=cu_cpu)[0][0], fp32=(3,))
    if "simple_gla" in args.ops:
        pair("simple_gla", lambda: gdn_in()[:4], lambda *x: tree_simple_gla(*x, p, backend="fla"),
             lambda q, k, v, g: chunk_simple_gla(q[None], k[None], v[None], g[None], cu_seqlens=cu,
                                                 cu_seqlens_cpu=cu_cpu)[0][0], fp32=(3,))
    if "conv" in args.ops:
        D = 2 * H * K + H * K  # GDN conv channels: q, k, v
        pair("conv", lambda: [torch.randn(T, D, device=dev), torch.randn(D, 4, device=dev) / 2,
                              torch.randn(D, device=dev)],
             lambda x, w, b: tree_causal_conv1d(x, w, b, p, "silu", backend="fla"),
             lambda x, w, b: causal_conv1d(x[None], w, b, activation="silu", cu_seqlens=cu,
                                           cu_seqlens_cpu=cu_cpu)[0][0])
    if "attention" in args.ops:
        hkv = max(1, H // 4)
        pair("attention", lambda: [torch.randn(T, H, K, device=dev), torch.randn(T, hkv, K, device=dev),
                                   torch.randn(T, hkv, K, device=dev)],
             lambda *x: tree_attention(*x, p, backend="flex"), lambda *x: tree_attention(*x, pt, backend="flex"),
             traj_alternatives={"varlen": lambda *x: tree_attention(*x, pt, backend="varlen")}
             if varlen_applies(torch.empty(1, device=dev, dtype=bf), pt) else None)
    torch.cuda.empty_cache()
    return rows


def render(rows: list[dict], out_dir: str, meta: dict) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    lines = ["# Tree ops vs trajectory-wise varlen calls (fwd+bwd)", "",
             f"Machine: {meta.get('device', '?')}; torch {meta.get('torch', '?')}; H={meta.get('heads')}, "
             f"K=V={meta.get('dim')}, bf16, chunk 64. Median of {meta.get('reps')} runs after warm-up. "
             "Produced by `scripts/bench_ops.py`; raw numbers in `ops.json`.", ""] + \
            [f"Note: {n}" for n in meta.get("notes", [])] + [
             "", "GPU-time speedup: traj / tree GPU busy time (torch.profiler, rows run with `--profile OP`); "
             "where it exceeds the wall-clock speedup the host's dispatch, not the GPU, set the time.", "",
             "| op | traj tokens | compression | tree ms | traj ms | speedup | target 0.9c | GPU-time speedup | rounds "
             "| replay | met | run |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|---|"]
    for r in rows:
        lines.append(f"| {r['op']} | {r['trajectory_tokens']} | {r['compression']:.2f} | {r['tree_ms']:.2f} | "
                     f"{r['traj_ms']:.2f} | {r['speedup']:.2f} | {r['target']:.2f} | "
                     f"{format(r['gpu_speedup'], '.2f') if 'gpu_speedup' in r else '-'} | {r['rounds']} | "
                     f"{r['replay_tokens']} | {'yes' if r['meets_target'] else 'no'} | {r.get('run', '')} |")
    fig, axes = plt.subplots(1, len(OPS), figsize=(4 * len(OPS), 3.6), sharey=True)
    for ax, op in zip(axes, OPS):
        sel = [r for r in rows if r["op"] == op]
        size = lambda r: 2 ** round(math.log2(r["trajectory_tokens"] / 1024))   # the --sizes bucket, K
        for n in sorted({size(r) for r in sel}):
            pts = sorted((r["compression"], r["speedup"]) for r in sel if size(r) == n)
            ax.plot(*zip(*pts), "o-", color=f"C{int(math.log2(n)) % 10}", label=f"~{n}K tokens")
        ax.plot([1, 10.5], [1, 10.5], "k--", lw=0.8, label="ideal")
        ax.plot([1, 10.5], [0.9, 9.45], "k:", lw=0.8, label="target 0.9c")
        ax.set_title(op)
        ax.set_xlabel("compression")
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("speedup (traj ms / tree ms)")
    axes[0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(os.path.join(out_dir, "ops.png"), dpi=120)
    lines += ["", "![speedup vs compression](ops.png)", ""]
    with open(os.path.join(out_dir, "ops.md"), "w") as f:
        f.write("\n".join(lines))


def main():
    from megatron_harts.ops.fla_autotune import add_save_fla_configs_arg, save_fla_autotune

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--sizes", default="32768,131072,262144")
    ap.add_argument("--compressions", default="2,4,6,8,10")
    ap.add_argument("--ops", default=",".join(OPS))
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--dim", type=int, default=128)
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--run-label", default="", help="label stored in every row (the 'run' column of ops.md)")
    ap.add_argument("--profile", default="", help="ops to profile (torch.profiler tables profile_*.txt in --out)")
    ap.add_argument("--plot", metavar="JSON", help="render ops.md/ops.png from a results JSON and exit")
    add_save_fla_configs_arg(ap)
    ap.add_argument("--watchdog", type=float, default=0, help="dump all stacks and exit after this many seconds")
    args = ap.parse_args()
    if args.watchdog:
        faulthandler.dump_traceback_later(args.watchdog, exit=True)
    os.makedirs(args.out, exist_ok=True)
    if args.plot:
        with open(args.plot) as f:
            data = json.load(f)
        render(data["rows"], args.out, data["meta"])
        return
    args.ops, args.profile = args.ops.split(","), args.profile.split(",")
    meta = dict(device=torch.cuda.get_device_name(), torch=torch.__version__, heads=args.heads, dim=args.dim,
                reps=args.reps)
    rows = []
    path = os.path.join(args.out, "ops.json")

    def save(row):
        rows.append(dict(row, run=args.run_label) if args.run_label else row)
        with open(path, "w") as f:
            json.dump({"meta": meta, "rows": rows}, f, indent=1)
    for total in map(int, args.sizes.split(",")):
        for c in map(float, args.compressions.split(",")):
            bench_case(total, c, args, on_row=save)
            if args.save_fla_configs:
                save_fla_autotune(args.save_fla_configs)
    print(f"\n{'op':<10} {'tokens':>7} {'compr':>6} {'tree ms':>9} {'traj ms':>9} {'speedup':>8} {'target':>7}")
    for r in rows:
        print(f"{r['op']:<10} {r['trajectory_tokens']:>7} {r['compression']:>6.2f} {r['tree_ms']:>9.2f} "
              f"{r['traj_ms']:>9.2f} {r['speedup']:>8.2f} {r['target']:>7.2f}")


if __name__ == "__main__":
    main()
