"""Host time of one tree GDN layer's op (fwd + bwd) on the GPU: the previous round loops vs the
current ones, same process, same data (a tau-like HARTS microbatch, as bench_e2e packs it).

Paths, interleaved rep by rep:
  reference    ``fla_rounds.reference_round_loops()``: per-round slices and allocations, every
               recurrence launch through fla's ``triton.heuristics`` + autotuner (the old code)
  new_no_fast  the round loops on the all-rounds tensors, launches the normal way
               (``fla_rounds.FAST_LAUNCH = False``: the default)
  new          the round loops on the all-rounds tensors with ``_Launch`` (``HARTS_FLA_FAST_LAUNCH=1``)
and the trajectory-wise baseline (fla's ``chunk_gated_delta_rule`` on the same trajectories as a
chain pack, THD as bench_e2e's baseline) with and without ``_Launch`` for its recurrence kernels
(``chain_no_fast`` / ``chain``: both sides get the same launch path).

Per path and rep: ``host_fwd_ms`` / ``host_bwd_ms`` (``time.perf_counter`` around the forward /
``backward`` call, no synchronize: what the host spends issuing), ``total_ms`` (synchronize
before, call, synchronize after), ``gpu_ms`` (CUDA events around fwd + bwd issued behind a
``torch.cuda._sleep`` so the host runs ahead: kernel time without host gaps), and the round loops
alone (``loops_host_ms``: the forward recurrence + the backward's recomputed states and state
gradients on the all-rounds tensors, host time without synchronize). Reports min / median / max,
and whether outputs and input gradients equal the reference's (bitwise; else the max abs
difference, next to the reference's own rerun difference: ``index_add_`` of fp32 on CUDA is not
deterministic where round r-1 states feed several round-r sequences). JSON to ``--out``.

    python scripts/bench_tree_gdn_host.py --out /tmp/tree_gdn_host.json        # about 30 s on an H200

fla configs: ``configs/fla/H200`` (``FLA_CACHE_MODE=fuzzy``) unless ``FLA_CACHE_MODE`` is set, so
the run does not autotune.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
DEVICE = "cuda"          # tests: "cpu" with fla in Triton's interpreter and torch.cuda's timing calls stubbed


def tau_like_packs(seed: int = 1, chunk_size: int = 64, capacity: int = 65536, which: int = 0, device="cpu"):
    """(HARTS pack, baseline chain pack) of bench_e2e's tau-like batch (8 tasks, seed ``seed``):
    the ``which``-th HARTS microbatch and the trajectory-wise pack of the same trajectories."""
    import torch

    from megatron_harts.packing import pack
    from megatron_harts.tree import RolloutTree
    from scripts.bench_e2e import cost_model_for, microbatches, workload
    a = argparse.Namespace(tiny=False, tau_groups=8, seed=seed, capacity=capacity, chunk_size=chunk_size,
                           vocab=32768, pad_multiple=0)
    mb = microbatches(workload("tau", a), "harts", a, cost_model_for("moe", a), torch.device(device))[which]
    trajs = mb["pack"].trajectories
    chain = pack([RolloutTree(list(trajs), merge_prefixes=False)], chunk_size=chunk_size).to(device)
    return mb["pack"], chain


def _stats(xs: list[float]) -> dict:
    return dict(min=min(xs), median=statistics.median(xs), max=max(xs), n=len(xs))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True, help="JSON path")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--heads", type=int, default=8, help="GDN key heads (MoE bench model: 8; dense 1.5B: 16)")
    ap.add_argument("--value-heads", type=int, default=None, help="default: --heads")
    ap.add_argument("--dim", type=int, default=128, help="key = value head dim")
    ap.add_argument("--microbatch", type=int, default=0, help="which HARTS microbatch of the tau-like batch")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--no-chain", action="store_true", help="skip the trajectory-wise baseline rows")
    args = ap.parse_args(argv)

    import torch
    if not torch.cuda.is_available():
        print("bench_tree_gdn_host: CUDA is not available (this benchmark times GPU launches)", file=sys.stderr)
        return 2
    if "FLA_CACHE_MODE" not in os.environ:
        os.environ.update(FLA_CACHE_MODE="fuzzy", FLA_CONFIG_DIR=os.path.join(ROOT, "configs", "fla", "H200"))
    import torch.nn.functional as F

    from megatron_harts.ops import chunk_plan, tree_gated_delta_rule
    from megatron_harts.ops import fla_rounds as FR
    FR.install_fast_launches(into_fla=True)   # both sides: FAST_LAUNCH then switches the fast path per path

    t_start = time.perf_counter()
    dev = torch.device(DEVICE)
    torch.manual_seed(args.seed)
    pk, chain = tau_like_packs(args.seed, which=args.microbatch, device=DEVICE)
    fr = FR.fused_rounds(pk, 64)
    H, HV, D = args.heads, args.value_heads or args.heads, args.dim
    scale = D ** -0.5

    def inputs(T):
        g = torch.Generator(device=dev).manual_seed(args.seed)
        r = lambda *s: torch.randn(*s, generator=g, device=dev)   # noqa: E731
        return [r(T, H, D).bfloat16(), r(T, H, D).bfloat16(), r(T, HV, D).bfloat16(),
                F.logsigmoid(r(T, HV) + 2).float(), torch.rand(T, HV, generator=g, device=dev).bfloat16()]

    def op_of(p):
        return lambda *x: tree_gated_delta_rule(*x, p, chunk_size=64, scale=scale, backend="fla",
                                                use_qk_l2norm_in_kernel=True)

    @contextlib.contextmanager
    def mode(path):
        saved = FR.FAST_LAUNCH
        FR.FAST_LAUNCH = path in ("new", "chain")
        try:
            with FR.reference_round_loops() if path == "reference" else contextlib.nullcontext():
                yield
        finally:
            FR.FAST_LAUNCH = saved

    xs_tree, xs_chain = inputs(pk.num_tokens), None
    dy_tree = torch.randn(pk.num_tokens, HV, D, device=dev).bfloat16()
    paths = {"reference": (op_of(pk), xs_tree, dy_tree), "new_no_fast": (op_of(pk), xs_tree, dy_tree),
             "new": (op_of(pk), xs_tree, dy_tree)}
    if not args.no_chain:
        xs_chain = inputs(chain.num_tokens)
        dy_chain = torch.randn(chain.num_tokens, HV, D, device=dev).bfloat16()
        paths.update(chain_no_fast=(op_of(chain), xs_chain, dy_chain), chain=(op_of(chain), xs_chain, dy_chain))

    def fwd_bwd(path, timed: dict | None = None, sleep: bool = False):
        fn, xs, dy = paths[path]
        leaves = [x.detach().clone().requires_grad_() for x in xs]
        with mode(path):
            if timed is not None:
                torch.cuda.synchronize()
                if sleep:
                    torch.cuda._sleep(int(2e8))          # ~0.1 s of GPU cycles: the host runs ahead
                e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                e0.record()
                t0 = time.perf_counter()
            out = fn(*leaves)
            if timed is not None:
                t1 = time.perf_counter()
            out.backward(dy)
            if timed is not None:
                t2 = time.perf_counter()
                e1.record()
                torch.cuda.synchronize()
                t3 = time.perf_counter()
                key = "sleep" if sleep else "plain"
                timed.setdefault(f"{key}_host_fwd_ms", []).append(1e3 * (t1 - t0))
                timed.setdefault(f"{key}_host_bwd_ms", []).append(1e3 * (t2 - t1))
                timed.setdefault(f"{key}_total_ms" if not sleep else "sleep_events_ms", []).append(
                    1e3 * (t3 - t0) if not sleep else e0.elapsed_time(e1))
        return [out.detach()] + [x.grad for x in leaves]

    # the round loops alone, on the all-rounds tensors (the part this change is about)
    N = int(fr.all.tokens.stop)
    g = torch.Generator(device=dev).manual_seed(7)
    rl = lambda *s: torch.randn(*s, generator=g, device=dev).bfloat16()   # noqa: E731
    lq, lk, lw, lu, ldo, ldv = rl(1, N, H, D), F.normalize(rl(1, N, H, D).float(), dim=-1).bfloat16(), \
        rl(1, N, HV, D) * 0.1, rl(1, N, HV, D), rl(1, N, HV, D), rl(1, N, HV, D)
    lgc = F.logsigmoid(torch.randn(1, N, HV, generator=g, device=dev) + 2).float()   # any decay (timing only)

    def loops(path, timed=None):
        with mode(path):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            if path == "reference":
                FR._round_states_reference(lk, lw, lu, lgc, fr, keep_inits=False)
                _, _, inits = FR._round_states_reference(lk, lw, lu, lgc, fr, keep_inits=True)
                FR._round_state_grads_reference(lq, lk, lw, ldo, ldv, lgc, inits, fr, scale)
            else:
                FR._round_states(lk, lw, lu, lgc, fr)
                FR._round_states(lk, lw, lu, lgc, fr)
                FR._round_state_grads(lq, lk, lw, ldo, ldv, lgc, fr, scale)
            t1 = time.perf_counter()
            torch.cuda.synchronize()
            if timed is not None:
                timed.setdefault("loops_host_ms", []).append(1e3 * (t1 - t0))
                timed.setdefault("loops_total_ms", []).append(1e3 * (time.perf_counter() - t0))

    # warm-up: compile / load configs of every kernel of every path
    results = {p: fwd_bwd(p) for p in paths}
    for p in ("reference", "new_no_fast", "new"):
        loops(p)
    torch.cuda.synchronize()
    t_warm = time.perf_counter() - t_start

    timed = {p: {} for p in paths}
    for rep in range(args.reps):
        order = list(paths) if rep % 2 == 0 else list(reversed(paths))
        for p in order:
            fwd_bwd(p, timed[p])
            fwd_bwd(p, timed[p], sleep=True)
            if not p.startswith("chain"):
                loops(p, timed[p])

    def compare(a, b):
        eq = all(torch.equal(x, y) for x, y in zip(a, b))
        diff = max(float((x.float() - y.float()).abs().max()) for x, y in zip(a, b))
        return dict(bitwise_equal=eq, max_abs_diff=diff)

    ref2 = fwd_bwd("reference")
    equality = {"reference_rerun": compare(ref2, results["reference"]),
                "new": compare(fwd_bwd("new"), results["reference"]),
                "new_no_fast": compare(fwd_bwd("new_no_fast"), results["reference"])}
    if not args.no_chain:
        equality["chain_vs_chain_no_fast"] = compare(fwd_bwd("chain"), results["chain_no_fast"])

    res = dict(device=torch.cuda.get_device_name(), torch=torch.__version__, heads=H, value_heads=HV, dim=D,
               tokens=pk.num_tokens, chain_tokens=chain.num_tokens, rounds=chunk_plan(pk, 64).num_rounds,
               sequences=fr.seq_counts, reps=args.reps, warmup_s=t_warm,
               fla_cache_mode=os.environ.get("FLA_CACHE_MODE"),
               paths={p: {k: _stats(v) for k, v in d.items()} for p, d in timed.items()}, equality=equality)
    res["wall_s"] = time.perf_counter() - t_start
    with open(args.out, "w") as f:
        json.dump(res, f, indent=1)

    print(f"tau-like microbatch {args.microbatch}: {pk.num_tokens} compact tokens, {res['rounds']} rounds "
          f"{fr.seq_counts} sequences; chain {chain.num_tokens} tokens; H={H} HV={HV} D={D}; warm-up {t_warm:.1f} s")
    cols = ("plain_host_fwd_ms", "plain_host_bwd_ms", "plain_total_ms", "sleep_events_ms", "loops_host_ms",
            "loops_total_ms")
    print("| path | " + " | ".join(c.replace("_ms", "") for c in cols) + " |  (ms, median [min])")
    for p, d in res["paths"].items():
        print(f"| {p} | " + " | ".join(f"{d[c]['median']:.3f} [{d[c]['min']:.3f}]" if c in d else "-" for c in cols)
              + " |")
    for k, v in equality.items():
        print(f"equality {k}: {v}")
    print(f"wrote {args.out} ({res['wall_s']:.1f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
