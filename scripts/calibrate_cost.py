#!/usr/bin/env python
"""Fit the planner's CostModel (``megatron_harts.planner.cost``) from measured fwd+bwd times.

Model (per microbatch, one tree pack)::

    time = per_token * tokens + per_ancestor * ancestors + per_round * rounds (+ intercept)

tokens: compact tokens of the pack; ancestors: ``sum_u (position(u) + 1)`` (the (query, key)
pairs of tree attention); rounds: varlen calls of each linear-attention layer
(``ops.chunk_plan(pack).num_rounds``, what ``planner.split`` computes from tree statistics).

Method.

1. Build the model from flags (``HybridModel`` with ``tree_hybrid_stack_spec``; bf16 on CUDA by
   default; ``--device cpu --tiny``: ``cpu_shim.build_tiny_hybrid_model``, fp32, a smoke test).
2. Design packs that move the three features independently: *chains* (rounds 1; at a fixed
   token count the chain length sets ancestors from ~T*64 to ~T^2/2), *sweep* trees
   (``workloads.sweep_trees``: 16-leaf groups at compressions 2-8, 1 or 4 groups), *combs* (a
   spine branching once per chunk at b chunks: rounds b + 1 for ~constant tokens / ancestors),
   and *agentic* trees (``workloads.agentic_batch``), each at several fractions of ``--tokens``.
   With ``--bucket Q`` every pack is padded with short chains to a multiple of Q tokens, so
   shape-specialised kernels (FlexAttention under ``torch.compile``) compile only a few times.
3. Time fwd + bwd (``model(..., labels=...)``, per-token cross-entropy summed, backward):
   ``--warmup`` untimed runs (compilation, cached plans), then the median of ``--reps`` runs
   (CUDA events on GPU, ``time.perf_counter`` on CPU). Each sample is logged and appended to
   ``<out>.samples.jsonl`` as it is measured.
4. Non-negative least squares (``scipy.optimize.nnls``) on columns scaled to unit max, rows
   weighted by 1 / time (``--weighting relative``, the default: minimises relative error;
   ``absolute`` = plain residuals). Reports R^2 (unweighted, on times), per-sample relative
   error and the condition number of the scaled design; prints a table and the
   ``CostModel.from_pattern`` FLOP estimate converted at ``--flops-per-s`` for comparison.
5. Writes ``--out`` (JSON): ``per_token``, ``per_ancestor``, ``per_round`` in **seconds**
   (the planner balances ratios, so any unit works), ``intercept`` (per microbatch; equal
   microbatch counts per rank make it irrelevant to the plan), fit statistics, samples, config.

Use in the planner::

    from megatron_harts.planner import CostModel, plan
    p = plan(trees, dp_size=64, microbatch_capacity=65536, cost_model=CostModel.from_json("cost_model.json"))

Examples::

    python scripts/calibrate_cost.py --out $OUT/cost_model.json --watchdog 900       # H200, bf16
      # default model: ('G-G-G-*-') * 12, hidden 2048 (as bench_planner); 63 packs of <= 16K tokens
      # (96 layers without --recompute need ~75 GB at 16K); a pack that runs out of memory is skipped
    python scripts/calibrate_cost.py --device cpu --tiny --out /tmp/cost.json         # smoke, < 1 min
    python scripts/calibrate_cost.py --refit /tmp/cost.samples.jsonl --out /tmp/cost.json  # fit only
"""
from __future__ import annotations

import argparse
import faulthandler
import json
import os
import statistics
import sys
import time

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from megatron_harts.planner.cost import CostModel  # noqa: E402

T0 = time.perf_counter()
FEATURES = ("tokens", "ancestors", "rounds")


def log(msg: str) -> None:
    print(f"[{time.perf_counter() - T0:7.1f}s] {msg}", flush=True)


# ------------------------------------------------------------------------------------------------
# Fit (numpy + scipy; used by tests)
# ------------------------------------------------------------------------------------------------


def _nnls(A: np.ndarray, b: np.ndarray) -> np.ndarray:
    from scipy.optimize import nnls
    return nnls(A, b)[0]


def fit_cost_model(tokens, ancestors, rounds, times, *, intercept: bool = True,
                   weighting: str = "relative") -> tuple[CostModel, dict]:
    """Non-negative least squares ``times ~ a*tokens + b*ancestors + c*rounds (+ d)``.

    Returns the CostModel (a, b, c in the units of ``times``) and a dict: ``intercept`` (d),
    ``r2`` (on times), ``rel_err`` (per sample, (pred - time) / time), ``median_abs_rel_err``,
    ``max_abs_rel_err``, ``cond`` (condition number of the scaled, weighted design)."""
    cols = [np.asarray(x, np.float64) for x in (tokens, ancestors, rounds)]
    y = np.asarray(times, np.float64)
    if intercept:
        cols.append(np.ones_like(y))
    X = np.stack(cols, 1)
    if X.shape[0] < X.shape[1]:
        raise ValueError(f"need at least {X.shape[1]} samples to fit {X.shape[1]} coefficients, got {X.shape[0]}")
    if weighting not in ("relative", "absolute"):
        raise ValueError(f"weighting must be 'relative' or 'absolute', got {weighting!r}")
    w = 1.0 / np.maximum(y, 1e-30) if weighting == "relative" else np.ones_like(y)
    A = X * w[:, None]
    scale = np.abs(A).max(0)
    scale[scale == 0] = 1.0
    coef = _nnls(A / scale, y * w) / scale
    pred = X @ coef
    ss_tot = float(((y - y.mean()) ** 2).sum())
    rel = (pred - y) / np.maximum(y, 1e-30)
    info = dict(intercept=float(coef[3]) if intercept else 0.0,
                r2=1.0 - float(((y - pred) ** 2).sum()) / ss_tot if ss_tot > 0 else float("nan"),
                rel_err=rel.tolist(), median_abs_rel_err=float(np.median(np.abs(rel))),
                max_abs_rel_err=float(np.abs(rel).max()), cond=float(np.linalg.cond(A / scale)),
                weighting=weighting)
    return CostModel(*(float(c) for c in coef[:3])), info


# ------------------------------------------------------------------------------------------------
# Sample design: lists of trees, each a list of token lists
# ------------------------------------------------------------------------------------------------


def _chains(rng, n_tokens: int, length: int, vocab: int) -> list[list[list[int]]]:
    """Chains (one-trajectory trees) of ``length`` tokens (the last one shorter), ``n_tokens`` in all."""
    out, left = [], n_tokens
    while left > 0:
        L = min(length, left)
        out.append([rng.integers(0, vocab, L).tolist()])
        left -= L
    return out


def _comb(rng, spine: int, branches: int, C: int, vocab: int) -> list[list[int]]:
    """A spine of ``spine`` tokens with ``branches`` side branches (C // 2 tokens each) leaving it
    in distinct chunks (position k*C + C//2, k = 1..branches): the chunk plan has branches + 1
    rounds."""
    s = rng.integers(0, vocab, spine).tolist()
    trajs = [s]
    for k in range(1, branches + 1):
        p = k * C + C // 2
        tail = rng.integers(0, vocab, max(1, C // 2)).tolist()
        tail[0] = (s[p] + 1) % vocab if p < spine else tail[0]   # diverge right after position p - 1
        trajs.append(s[:p] + tail)
    return trajs


def design(max_tokens: int, chunk_size: int, vocab: int, seed: int = 0,
           fractions=(0.25, 0.5, 0.75, 1.0)) -> list[tuple[str, list[list[list[int]]]]]:
    """Named packs (lists of trees) of up to ~``max_tokens`` compact tokens; see the module doc."""
    from megatron_harts.workloads import AgenticConfig, agentic_batch, sweep_trees

    rng = np.random.default_rng(seed)
    C = chunk_size
    out: list[tuple[str, list]] = []
    for f in fractions:
        T = max(4 * C, int(max_tokens * f))
        for L in sorted({min(T, max(8, C)), max(8, T // 16), max(8, T // 4), T}):
            out.append((f"chains T={T} L={L}", _chains(rng, T, L, vocab)))
        for comp in (2.0, 4.0, 8.0):
            for groups in (1, 4):
                total = int(T * comp * 0.9)
                if total // (groups * 16) < 8:
                    continue
                s = int(rng.integers(1 << 30))
                trees = sweep_trees(total, comp, tokens_per_group=max(1, total // groups), vocab_size=vocab, seed=s)
                out.append((f"sweep T~{int(total / comp)} c={comp:g} g={groups}", trees))
        spine = T // 2
        max_b = max(0, (spine - C) // C - 1)
        for b in sorted({0, min(2, max_b), min(8, max_b), max_b // 2, max_b}):
            trees = [_comb(rng, spine, b, C, vocab)]
            used = spine + b * max(1, C // 2)
            filler = max(0, T - used)
            out.append((f"comb T~{T} b={b}", trees + (_chains(rng, filler, max(C, filler // 4), vocab) if filler else [])))
    # Agentic trees (heavy-tailed tools, branching retries), filled greedily up to each size.
    small = max_tokens < 8192
    cfg = AgenticConfig(num_groups=64, group_size=8, vocab_size=vocab, seed=seed,
                        **(dict(prompt_tokens=(20, 60), assistant_tokens=(5, 20), tool_tokens_median=12,
                                tool_tokens_max=64, turns=(2, 6)) if small else {}))
    from megatron_harts.tree import trees_from_trajectories
    agentic = trees_from_trajectories(agentic_batch(cfg))
    token_lists = [[list(map(int, r.tokens)) for r in t.records] for t in agentic]
    for f in fractions:
        T, used, trees = int(max_tokens * f), 0, []
        for t, tree in zip(agentic, token_lists):
            if used + t.num_tokens > T:
                continue
            trees.append(tree)
            used += t.num_tokens
        if trees:
            out.append((f"agentic T~{used}", trees))
    return out


def pad_trees(rng, trees, n_tokens: int, quantum: int, vocab: int, fill_len: int = 128):
    """Append short chains so the pack has a multiple of ``quantum`` compact tokens (0 = off)."""
    if quantum <= 0 or n_tokens % quantum == 0:
        return trees
    return trees + _chains(rng, quantum - n_tokens % quantum, fill_len, vocab)


def features(pack) -> dict:
    from megatron_harts.ops.plan import chunk_plan
    return dict(tokens=pack.num_tokens, ancestors=int((pack.position_ids.long() + 1).sum()),
                rounds=chunk_plan(pack).num_rounds, trajectory_tokens=pack.num_trajectory_tokens,
                max_len=int(pack.trajectory_lengths.max()))


# ------------------------------------------------------------------------------------------------
# Model and timing
# ------------------------------------------------------------------------------------------------


def build_model(args, max_len: int):
    """(model, device, stack) for the flags; ``stack`` is closed at the end (CPU shim teardown)."""
    import contextlib

    import torch

    from megatron_harts.megatron import cpu_shim, tree_hybrid_stack_spec

    stack = contextlib.ExitStack()
    spec = tree_hybrid_stack_spec(args.num_experts or None)
    if args.device == "cpu":
        stack.enter_context(cpu_shim.cpu_megatron(seed=args.seed))
        kw = _config_overrides(args, torch.float32)
        if args.tiny:
            kw = {k: kw[k] for k in kw if k.startswith("recompute")}
        model = cpu_shim.build_tiny_hybrid_model(args.pattern, vocab_size=args.vocab, max_sequence_length=max_len,
                                                 hidden_size=args.hidden, hybrid_stack_spec=spec,
                                                 num_moe_experts=args.num_experts or None, **kw)
        return model, torch.device("cpu"), stack

    import torch.distributed as dist
    from megatron.core import parallel_state as ps
    from megatron.core import tensor_parallel
    from megatron.core.models.hybrid.hybrid_model import HybridModel

    torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    if not dist.is_initialized():
        if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
            dist.init_process_group(backend="nccl")
        else:
            dist.init_process_group(backend="nccl", store=dist.HashStore(), rank=0, world_size=1)
    if not ps.model_parallel_is_initialized():
        ps.initialize_model_parallel()
    tensor_parallel.model_parallel_cuda_manual_seed(args.seed)
    dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float32
    config = cpu_shim.tiny_hybrid_config(args.pattern, hidden_size=args.hidden, **_config_overrides(args, dtype),
                                         num_moe_experts=args.num_experts or None)
    model = HybridModel(config=config, hybrid_stack_spec=spec, vocab_size=args.vocab, max_sequence_length=max_len,
                        hybrid_layer_pattern=args.pattern, position_embedding_type="rope",
                        share_embeddings_and_output_weights=False).cuda()
    stack.callback(ps.destroy_model_parallel)
    return model, torch.device("cuda"), stack


def _config_overrides(args, dtype) -> dict:
    """TransformerConfig fields from the size flags (on top of ``cpu_shim.tiny_hybrid_config``)."""
    import torch
    kw = dict(ffn_hidden_size=args.ffn_hidden or 4 * args.hidden, num_attention_heads=args.heads,
              num_query_groups=args.kv_heads, kv_channels=args.head_dim,
              linear_key_head_dim=args.linear_head_dim, linear_value_head_dim=args.linear_head_dim,
              linear_num_key_heads=args.linear_key_heads, linear_num_value_heads=args.linear_value_heads,
              params_dtype=dtype, bf16=dtype == torch.bfloat16, use_cpu_initialization=args.device == "cpu")
    if args.recompute:
        kw.update(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1)
    if args.num_experts:
        kw.update(moe_router_topk=args.moe_topk, moe_ffn_hidden_size=args.moe_ffn_hidden or args.hidden)
    return kw


def time_fwd_bwd(model, pack, reps: int, warmup: int) -> list[float]:
    """Seconds of each of ``reps`` timed fwd + bwd runs of ``model`` on ``pack`` (after ``warmup``)."""
    import torch

    from megatron_harts.megatron import tree_packed_seq_params

    cuda = pack.device.type == "cuda"
    params = tree_packed_seq_params(pack)
    tokens, pos = pack.tokens[None], pack.position_ids[None]
    labels = torch.roll(pack.tokens, -1)[None]
    times = []
    for i in range(warmup + reps):
        model.zero_grad(set_to_none=True)
        if cuda:
            s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            s.record()
        else:
            t = time.perf_counter()
        loss = model(tokens, pos, None, labels=labels, packed_seq_params=params)
        loss.float().sum().backward()
        if cuda:
            e.record()
            torch.cuda.synchronize()
            dt = s.elapsed_time(e) / 1e3
        else:
            dt = time.perf_counter() - t
        if i >= warmup:
            times.append(dt)
    return times


# ------------------------------------------------------------------------------------------------
# Report
# ------------------------------------------------------------------------------------------------


def report(samples: list[dict], cm: CostModel, info: dict, ref: CostModel | None, flops_per_s: float) -> str:
    lines = [f"{'sample':<28} {'tokens':>8} {'ancestors':>12} {'rounds':>6} {'ms':>9} {'fit ms':>9} {'rel err':>8}"]
    for s, e in zip(samples, info["rel_err"]):
        lines.append(f"{s['name'][:28]:<28} {s['tokens']:>8} {s['ancestors']:>12} {s['rounds']:>6} "
                     f"{1e3 * s['time_s']:>9.3f} {1e3 * s['time_s'] * (1 + e):>9.3f} {100 * e:>7.1f}%")
    lines += ["", f"{'coefficient':<14} {'fitted (s)':>12} " + (f"{'from_pattern (s)':>17}" if ref else "")]
    for k in FEATURES:
        name = f"per_{k[:-1] if k != 'ancestors' else 'ancestor'}"
        lines.append(f"{name:<14} {getattr(cm, name):>12.4e} " +
                     (f"{getattr(ref, name) / flops_per_s:>17.4e}" if ref else ""))
    lines.append(f"{'intercept':<14} {info['intercept']:>12.4e}")
    lines.append(f"R^2 {info['r2']:.4f}  median |rel err| {100 * info['median_abs_rel_err']:.1f}%  "
                 f"max |rel err| {100 * info['max_abs_rel_err']:.1f}%  cond {info['cond']:.1f}  "
                 f"({len(samples)} samples, {info['weighting']} weighting)")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=os.path.join(os.environ.get("OUT", "."), "cost_model.json"),
                    help="JSON to write (a directory: cost_model.json in it)")
    ap.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    ap.add_argument("--tiny", action="store_true", help="tiny fp32 model of cpu_shim (sizes below ignored), "
                    "small packs (default --tokens 768, --chunk-size 16, --reps 3, --warmup 1)")
    ap.add_argument("--pattern", help="hybrid layer pattern (default: ('G-G-G-*-') * 12; tiny: 'G*-G-')")
    ap.add_argument("--hidden", type=int, help="hidden size (default 2048; tiny: 64)")
    ap.add_argument("--ffn-hidden", type=int, help="MLP width (default 4 x hidden)")
    ap.add_argument("--heads", type=int, default=16, help="attention heads")
    ap.add_argument("--kv-heads", type=int, default=2, help="attention query groups (GQA)")
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--linear-key-heads", type=int, default=16, help="GDN key heads")
    ap.add_argument("--linear-value-heads", type=int, default=32, help="GDN value heads")
    ap.add_argument("--linear-head-dim", type=int, default=128, help="GDN key / value head dim")
    ap.add_argument("--num-experts", type=int, default=0, help="experts of 'E' layers")
    ap.add_argument("--moe-topk", type=int, default=8)
    ap.add_argument("--moe-ffn-hidden", type=int)
    ap.add_argument("--vocab", type=int, help="vocabulary (default 32000; tiny: 64)")
    ap.add_argument("--recompute", action="store_true", help="full activation recomputation, 1 layer per "
                    "chunk (calibrate in the mode training uses)")
    ap.add_argument("--dtype", choices=["bf16", "fp32"], help="default bf16 on CUDA, fp32 on CPU")
    ap.add_argument("--tokens", type=int, help="largest pack, compact tokens (default 16384; tiny: 768)")
    ap.add_argument("--chunk-size", type=int, help="chunk size of the tree linear-attention ops (default 64)")
    ap.add_argument("--bucket", type=int, help="pad packs to a multiple of this many tokens (default 2048 "
                    "on CUDA, 0 = off on CPU): bounds torch.compile recompilations")
    ap.add_argument("--reps", type=int, help="timed runs per pack (median; default 5; tiny: 3)")
    ap.add_argument("--warmup", type=int, help="untimed runs per pack (default 2; tiny: 1)")
    ap.add_argument("--max-samples", type=int, default=0, help="measure only the first N packs (0 = all)")
    ap.add_argument("--weighting", choices=["relative", "absolute"], default="relative")
    ap.add_argument("--no-intercept", action="store_true")
    ap.add_argument("--flops-per-s", type=float, default=4e14, help="to compare with CostModel.from_pattern")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=0, help="CPU: torch threads (default: 1 with --tiny, else torch's)")
    ap.add_argument("--refit", metavar="JSONL", help="fit samples of an earlier run (no model) and exit")
    ap.add_argument("--watchdog", type=float, default=0, help="dump all stacks and exit after this many seconds")
    args = ap.parse_args(argv)
    if args.watchdog:
        faulthandler.dump_traceback_later(args.watchdog, exit=True)
    tiny = args.tiny
    dflt = lambda name, full, small: setattr(args, name, getattr(args, name) if getattr(args, name) is not None
                                             else (small if tiny else full))
    dflt("pattern", "G-G-G-*-" * 12, "G*-G-")
    dflt("hidden", 2048, 64)
    dflt("vocab", 32000, 64)
    dflt("tokens", 16384, 768)
    dflt("chunk_size", 64, 16)
    dflt("reps", 5, 3)
    dflt("warmup", 2, 1)
    if args.dtype is None:
        args.dtype = "bf16" if args.device == "cuda" else "fp32"
    if args.bucket is None:
        args.bucket = 2048 if args.device == "cuda" else 0
    out = os.path.join(args.out, "cost_model.json") if os.path.isdir(args.out) or args.out.endswith("/") else args.out
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    samples_path = os.path.splitext(out)[0] + ".samples.jsonl"

    if args.refit:
        samples = read_samples(args.refit)
        meta = dict(refit=args.refit)
    else:
        samples, meta = measure(args, samples_path)

    cm, info = fit_cost_model(*([s[k] for s in samples] for k in (*FEATURES, "time_s")),
                              intercept=not args.no_intercept, weighting=args.weighting)
    ref = None
    if not tiny and not args.refit:
        kv = args.kv_heads * args.head_dim / args.hidden
        ref = CostModel.from_pattern(args.pattern, args.hidden, head_dim=args.head_dim, ffn_hidden=args.ffn_hidden,
                                     moe_ffn_hidden=args.moe_ffn_hidden, moe_topk=args.moe_topk,
                                     num_experts=args.num_experts, kv_fraction=kv, vocab_size=args.vocab,
                                     chunk_size=args.chunk_size)
    print(report(samples, cm, info, ref, args.flops_per_s), flush=True)
    cm.to_json(out, units="seconds", intercept=info["intercept"],
               fit={k: v for k, v in info.items() if k not in ("intercept", "rel_err")},
               from_pattern_flops=vars(ref) if ref else None, flops_per_s=args.flops_per_s, meta=meta,
               samples=[{**s, "rel_err": e} for s, e in zip(samples, info["rel_err"])])
    log(f"wrote {out} (load: CostModel.from_json({out!r}))")
    return 0


def read_samples(path: str) -> list[dict]:
    """The samples JSONL of an earlier run (``--refit``); a bad file exits with its line and field."""
    samples = []
    try:
        with open(path) as f:
            for lineno, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    s = json.loads(line)
                except ValueError as e:
                    raise SystemExit(f"--refit {path}:{lineno}: not valid JSON ({e})") from None
                bad = [k for k in (*FEATURES, "time_s") if not isinstance(s, dict) or isinstance(s.get(k), bool)
                       or not isinstance(s.get(k), (int, float))]
                if bad:
                    raise SystemExit(f"--refit {path}:{lineno}: field(s) {bad} missing or not numbers")
                samples.append(s)
    except OSError as e:
        raise SystemExit(f"--refit: {e}") from None
    if not samples:
        raise SystemExit(f"--refit {path}: no samples")
    return samples


def measure(args, samples_path: str) -> tuple[list[dict], dict]:
    """Design packs, build the model, time every pack; samples are appended to ``samples_path``."""
    import torch

    from megatron_harts.packing import pack as make_pack
    from megatron_harts.tree import RolloutTree

    if args.device == "cpu" and (args.threads or args.tiny):
        torch.set_num_threads(args.threads or 1)   # tiny ops: threads only add barrier waits
    if args.device == "cuda":
        import torch._dynamo
        for k in ("cache_size_limit", "recompile_limit", "accumulated_cache_size_limit",
                  "accumulated_recompile_limit"):
            if hasattr(torch._dynamo.config, k):
                setattr(torch._dynamo.config, k, max(256, getattr(torch._dynamo.config, k)))
    rng = np.random.default_rng(args.seed + 1)
    packs = []
    fractions = (0.5, 1.0) if args.tiny else (0.25, 0.5, 0.75, 1.0)
    for name, trees in design(args.tokens, args.chunk_size, args.vocab, args.seed, fractions):
        rt = [RolloutTree.from_trajectories(t) for t in trees]
        n = sum(t.num_tokens for t in rt)
        if args.bucket:
            rt += [RolloutTree.from_trajectories(t) for t in pad_trees(rng, [], n, args.bucket, args.vocab)]
        p = make_pack(rt, chunk_size=args.chunk_size)
        packs.append((name, p, features(p)))
    if args.max_samples:
        packs = packs[:args.max_samples]
    log(f"{len(packs)} packs, {min(f['tokens'] for _, _, f in packs)}-{max(f['tokens'] for _, _, f in packs)} tokens, "
        f"rounds {min(f['rounds'] for _, _, f in packs)}-{max(f['rounds'] for _, _, f in packs)}")
    max_len = max(f["max_len"] for _, _, f in packs)
    model, device, stack = build_model(args, max_len)
    meta = dict(device=torch.cuda.get_device_name() if device.type == "cuda" else "cpu", torch=torch.__version__,
                pattern=args.pattern, hidden=args.hidden, dtype=args.dtype, tiny=args.tiny, vocab=args.vocab,
                chunk_size=args.chunk_size, reps=args.reps, warmup=args.warmup, bucket=args.bucket,
                params=sum(p.numel() for p in model.parameters()))
    log(f"model {args.pattern!r} hidden {args.hidden} {args.dtype} on {meta['device']}: {meta['params']:,} params")
    samples = []
    open(samples_path, "w").close()
    with stack:
        model.train()
        for name, p, feat in packs:
            try:
                times = time_fwd_bwd(model, p.to(device), args.reps, args.warmup)
            except torch.cuda.OutOfMemoryError:
                log(f"{name}: out of memory, skipped (use --recompute or fewer --tokens)")
                model.zero_grad(set_to_none=True)
                torch.cuda.empty_cache()
                continue
            s = dict(name=name, **feat, time_s=statistics.median(times), times_s=times)
            samples.append(s)
            with open(samples_path, "a") as f:
                f.write(json.dumps(s) + "\n")
            log(f"{name:<28} tokens {feat['tokens']:>7} ancestors {feat['ancestors']:>12} rounds {feat['rounds']:>4}"
                f"  {1e3 * s['time_s']:9.3f} ms")
    return samples, meta


if __name__ == "__main__":
    sys.exit(main())
