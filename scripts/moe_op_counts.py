"""Host syncs and kernel-launching ops per MoE layer and per microbatch, forward and backward, on CPU.

Runs the bench's MoE configuration (``scripts/bench_e2e.py`` ``MODELS["moe"]``: pattern
'GEGEGE*E' x 3, 16 experts top-2, allgather dispatcher, aux loss 1e-3, full recomputation; hidden
size shrunk to --hidden so it runs on CPU: the counts do not depend on it) on one tree-packed
microbatch (``pack`` of merged trees, as HARTS) and on the same trajectories as chains (the
trajectory-wise baseline: the same layers, un-merged trees), and counts, under a
``TorchDispatchMode``, every aten op:

* ``syncs``: ops that make the host wait for the device on CUDA: ``aten::_local_scalar_dense`` of a
  device tensor (``.item()``, ``bool(t)``, ``int(t)``), ``nonzero``, ``masked_select``,
  ``unique*``, ``repeat_interleave`` without ``output_size``, boolean-mask indexing, and
  ``.cpu()`` / ``.tolist()`` / ``.numpy()`` of a device tensor;
* ``h2d``: tensors made from Python data (``torch.tensor(list)``) inside the counted region: host
  tensors made to be copied to the device from pageable memory (e.g. grouped-GEMM offsets);
* ``launches``: ops that would launch a device kernel (every aten op on device tensors that is not
  a view, an allocation or a sync), a proxy for the launch count (fused / composite kernels and the
  GPU-only paths, fla's Triton kernels and FlexAttention, differ on CUDA: the CPU runs the torch
  reference of the GDN layers, whose ``_to_chunks`` syncs are CPU-only).

On CPU all tensors are host tensors, so the script tags which would be host tensors on the GPU:
results of ``.cpu()`` / ``.tolist()`` and ``torch.tensor(python data)``, and whatever is computed
from host tensors only; every other tensor (parameters, the pack, activations) is a device tensor.
MoE region: inside a ``MoELayer`` forward (its recomputed forward under full recomputation counts
as ``bwd``) or called from Megatron's / this package's MoE modules; a MoE layer's backward kernels
run outside any Python frame and count in ``other`` (the one-layer table measures them apart).
``--device cuda`` instead counts the syncs CUDA itself reports for one MoE layer of the real model
and times it (no GPU in the CPU run).

    PYTHONPATH=. python scripts/moe_op_counts.py                  # table (per layer, per microbatch)
    PYTHONPATH=. python scripts/moe_op_counts.py --json out.json --grouped-experts
    PYTHONPATH=. python scripts/moe_op_counts.py --microbatches swe,tau     # bench_e2e's microbatches per step
    PYTHONPATH=. python scripts/moe_op_counts.py --device cuda --grouped-experts --tokens 196608   # H200
"""
from __future__ import annotations

import argparse
import collections
import contextlib
import json
import os
import sys
import traceback

import torch
from torch.utils._python_dispatch import TorchDispatchMode

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

aten = torch.ops.aten
_ALLOC = {aten.empty.memory_format, aten.empty_strided.default, aten.empty_like.default,
          aten.new_empty.default, aten.new_empty_strided.default}
_SYNC_NAMES = ("aten::_local_scalar_dense", "aten::nonzero", "aten::masked_select", "aten::unique",
               "aten::_unique", "aten::unique_consecutive", "aten::unique_dim", "aten::_unique2")
_MOE_FILES = ("megatron/core/transformer/moe/", "megatron_harts/moe/")


def _is_view(func) -> bool:
    rets = func._schema.returns
    return bool(rets) and all(r.alias_info is not None and not r.alias_info.is_write for r in rets)


def _is_host(t: torch.Tensor) -> bool:
    return getattr(t, "_moe_op_counts_host", False)


def _mark_host(t: torch.Tensor) -> None:
    t._moe_op_counts_host = True


class OpCounter(TorchDispatchMode):
    """Counts syncs and kernel launches; tags tensors as device / host (module docstring)."""

    def __init__(self):
        super().__init__()
        self.region = "other"               # set by the MoE hooks: "moe" inside a MoE layer's forward
        self.counts = collections.Counter()   # (phase, region, kind) -> n
        self.sync_sites = collections.Counter()
        self.ops = collections.Counter()
        self.phase = "fwd"

    def _site(self) -> str:
        for fr in reversed(traceback.extract_stack()[:-3]):
            f = fr.filename.replace(os.sep, "/")
            if "site-packages/torch/" in f or f.endswith("moe_op_counts.py"):
                continue
            short = f.split("site-packages/")[-1].split("wt_moe/")[-1]
            return f"{short}:{fr.lineno} {fr.name}"
        return "?"

    def _region(self) -> str:
        if self.region != "other":
            return self.region
        return "moe" if any(any(m in fr.filename.replace(os.sep, "/") for m in _MOE_FILES)
                            for fr in traceback.extract_stack()[-14:]) else "other"

    def _add(self, kind: str, site: bool = False, op: str = ""):
        region = self._region()
        self.counts[(self.phase, region, kind)] += 1
        if kind == "launches" and op:
            self.ops[(self.phase, region, op)] += 1
        if site:
            self.sync_sites[(self.phase, region, self._site())] += 1

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = func._schema.name
        out = func(*args, **kwargs)
        flat = [a for a in torch.utils._pytree.tree_leaves((args, kwargs)) if isinstance(a, torch.Tensor)]
        srcs_host = [a for a in flat if _is_host(a)]
        if name in _SYNC_NAMES or (name == "aten::repeat_interleave" and kwargs.get("output_size") is None
                                   and len(args) == 1) or (
                name == "aten::index" and any(isinstance(i, torch.Tensor) and i.dtype == torch.bool
                                              for i in (args[1] if len(args) > 1 else []) if i is not None)):
            if name != "aten::_local_scalar_dense" or not srcs_host:      # .item() of a host tensor: free
                self._add("syncs", site=True)
            if name != "aten::_local_scalar_dense":
                self._add("launches")
            return out
        if name == "aten::lift_fresh":          # torch.tensor(python data): made on the host, for the device
            self._add("h2d")
        if name == "aten::lift_fresh" or (name == "aten::_to_copy" and kwargs.get("pin_memory")):
            for t in torch.utils._pytree.tree_leaves(out):   # torch.tensor(list): made on the host
                if isinstance(t, torch.Tensor):
                    _mark_host(t)
            return out
        if func in _ALLOC or _is_view(func) or name in ("aten::detach", "aten::lift_fresh_copy"):
            if srcs_host:
                for t in torch.utils._pytree.tree_leaves(out):
                    if isinstance(t, torch.Tensor):
                        _mark_host(t)
            return out
        if flat and all(_is_host(a) for a in flat):          # host arithmetic (e.g. on CPU counts)
            for t in torch.utils._pytree.tree_leaves(out):
                if isinstance(t, torch.Tensor):
                    _mark_host(t)
            return out
        self._add("launches", op=name)
        return out


def _device_to_host_hooks(counter: OpCounter):
    """Count ``.cpu()``, ``.tolist()``, ``.numpy()`` of device tensors (no aten op on CPU)."""
    patched = []

    def wrap(name):
        orig = getattr(torch.Tensor, name)

        def f(self, *a, **k):
            if not _is_host(self):
                counter._add("syncs", site=True)
            with torch.utils._python_dispatch._disable_current_modes():
                out = orig(self, *a, **k)
                if out is self:              # CPU: .cpu() is the tensor itself; the GPU makes a copy
                    out = self.clone()
            if isinstance(out, torch.Tensor):
                _mark_host(out)
            return out
        setattr(torch.Tensor, name, f)
        patched.append((name, orig))

    for n in ("cpu", "tolist", "numpy"):
        wrap(n)
    return patched


@contextlib.contextmanager
def counting(model):
    counter = OpCounter()
    patched = _device_to_host_hooks(counter)
    from megatron.core.transformer.moe.moe_layer import MoELayer
    hooks = []
    for m in model.modules():
        if isinstance(m, MoELayer):
            hooks.append(m.register_forward_pre_hook(lambda *_: setattr(counter, "region", "moe")))
            hooks.append(m.register_forward_hook(lambda *_: setattr(counter, "region", "other")))
    try:
        with counter:
            yield counter
    finally:
        for h in hooks:
            h.remove()
        for n, orig in patched:
            setattr(torch.Tensor, n, orig)


def build(args):
    import torch._dynamo as dynamo

    from megatron_harts.megatron import cpu_shim, tree_hybrid_stack_spec
    from scripts.bench_e2e import MODELS, RECOMPUTE
    dynamo.config.disable = True
    pattern, over = MODELS["moe"]
    over = dict(over, hidden_size=args.hidden, ffn_hidden_size=2 * args.hidden, moe_ffn_hidden_size=args.hidden,
                num_attention_heads=4, num_query_groups=2, kv_channels=args.hidden // 4,
                linear_key_head_dim=args.hidden // 4, linear_value_head_dim=args.hidden // 4,
                linear_num_key_heads=4, linear_num_value_heads=4, **(RECOMPUTE if args.recompute else {}))
    over = {k: v for k, v in over.items() if k != "mamba_num_heads"}
    cpu_shim.cpu_manual_seed(0)
    spec = tree_hybrid_stack_spec(over["num_moe_experts"], grouped_experts=args.grouped_experts)
    return pattern, cpu_shim.build_tiny_hybrid_model(pattern, vocab_size=args.vocab, max_sequence_length=4096,
                                                     hybrid_stack_spec=spec, init_method_std=0.1, **over)


def packs(args):
    """One HARTS microbatch (merged trees) and the same trajectories as chains."""
    from megatron_harts import workloads as W
    from megatron_harts.packing import pack
    from megatron_harts.tree import RolloutTree, trees_from_trajectories
    trajs = W.sweep_batch(args.tokens, 4.0, seed=0, vocab_size=args.vocab, tokens_per_group=args.tokens)
    tree = pack(trees_from_trajectories(trajs), chunk_size=args.chunk_size)
    chains = pack([RolloutTree(trajs, merge_prefixes=False)], chunk_size=args.chunk_size)
    return {"tree": tree, "traj": chains}


def measure(model, pk, args) -> dict:
    from megatron_harts.megatron import tree_packed_seq_params
    from megatron_harts.ops import tree_token_logprobs
    model.zero_grad(set_to_none=True)
    with counting(model) as c:
        c.phase = "fwd"
        logits = model(pk.tokens[None], pk.position_ids[None], None, packed_seq_params=tree_packed_seq_params(pk))
        loss = -sum(lp.float().sum() for lp in tree_token_logprobs(logits[0], pk))
        c.phase = "bwd"
        loss.backward()
    return c


def layer_counts(model, pk) -> dict:
    """One MoE layer alone, forward + backward on a tree pack (router in tree mode, no
    recomputation): {(phase, kind): n} summed over regions."""
    from megatron.core.transformer.moe.moe_layer import MoELayer
    layer = next(m for m in model.modules() if isinstance(m, MoELayer))
    h = torch.randn(pk.num_tokens, 1, layer.config.hidden_size)
    for _ in range(2):                                  # the second run: the pack's caches built
        hb = h.clone().requires_grad_()
        with counting(layer) as c:
            with layer.router.tree_routing(pk):
                y, _ = layer(hb)
            c.phase = "bwd"
            y.square().sum().backward()
    return {(ph, k): sum(v for (p2, _, k2), v in c.counts.items() if p2 == ph and k2 == k)
            for ph in ("fwd", "bwd") for k in ("syncs", "h2d", "launches")}


def microbatch_counts(workloads: list[str], capacity: int, seeds: list[int]) -> list[dict]:
    """Per workload and timed-step seed of ``bench_e2e`` (CPU, no model): microbatches of each side
    as bench_e2e splits them (HARTS: the planner; baseline: LPT on trajectory tokens), their tokens
    (HARTS: compact tree tokens; baseline: trajectory tokens) and the trajectory tokens."""
    import numpy as np

    from megatron_harts.planner import plan
    from megatron_harts.planner.plan import assign
    from megatron_harts.tree import trees_from_trajectories
    from scripts.bench_e2e import cost_model_for, workload
    rows = []
    for wl in workloads:
        for sd in seeds:
            a = argparse.Namespace(tiny=False, swe_groups=2, swe_max_tokens=32768, tau_groups=8, sweep_tokens=131072,
                                   seed=sd, capacity=capacity, chunk_size=64, vocab=32768)
            trajs = workload(wl, a)
            trees = trees_from_trajectories(trajs)
            p = plan(trees, dp_size=1, microbatch_capacity=capacity, cost_model=cost_model_for("moe", a), chunk_size=64)
            h = [sum(t.num_tokens for t in mb) for mb in p.microbatches(trees, 0) if mb]
            lens = np.array([len(t) for t in trajs], np.int64)
            _, mb, M = assign(lens.astype(np.float64), lens, dp_size=1, capacity=capacity, refine=True)
            b = [int(lens[mb == m].sum()) for m in range(M) if (mb == m).any()]
            rows.append(dict(workload=wl, seed=sd, traj_tokens=int(lens.sum()), harts_microbatches=len(h),
                             harts_tokens=h, baseline_microbatches=len(b), baseline_tokens=b,
                             compression=float(lens.sum()) / sum(h)))
    return rows


def layer_timing(args) -> dict:
    """``--device cuda``: one MoE layer of the bench's real MoE model (bf16, hidden 1024, 16 experts
    top-2, grouped or SequentialMLP experts) on a tree pack of ``--tokens`` trajectory tokens
    (sweep 4x), router in tree mode: per dispatcher, the host syncs CUDA reports
    (``torch.cuda.set_sync_debug_mode("warn")``) in one forward + backward, and the median wall ms
    of a forward + backward (``--reps``, synchronised after each) with the ms the host spends
    issuing it (before the final synchronisation)."""
    import statistics
    import time

    from megatron.core.transformer.moe.moe_layer import MoELayer

    from megatron_harts.megatron.gpu import build_gpu_hybrid_model, init_single_gpu
    from megatron_harts.moe.dispatch import use_counts_once_dispatcher
    from scripts.bench_e2e import MODELS, sync_sites
    init_single_gpu(0)
    pattern, over = MODELS["moe"]
    model = build_gpu_hybrid_model(pattern, 32768, 4096, grouped_experts=args.grouped_experts, **over)
    layer = next(m for m in model.modules() if isinstance(m, MoELayer))
    pk = packs(argparse.Namespace(**{**vars(args), "vocab": 32768}))["tree"].to("cuda")
    h = torch.randn(pk.num_tokens, 1, layer.config.hidden_size, device="cuda", dtype=torch.bfloat16)

    def step():
        hb = h.clone().requires_grad_()
        with layer.router.tree_routing(pk):
            y, _ = layer(hb)
        y.float().square().sum().backward()

    out = {"tokens": pk.num_tokens, "grouped_experts": args.grouped_experts}
    for backend in ("reference", "fast"):
        use_counts_once_dispatcher(layer, backend)
        for _ in range(3):
            step()
        torch.cuda.synchronize()
        audit = sync_sites(step)
        torch.cuda.synchronize()
        walls, issue = [], []
        for _ in range(args.reps):
            t0 = time.perf_counter()
            step()
            t1 = time.perf_counter()
            torch.cuda.synchronize()
            walls.append(1e3 * (time.perf_counter() - t0))
            issue.append(1e3 * (t1 - t0))
        out[backend] = dict(syncs=audit["count"], sync_sites=audit["sites"], wall_ms=statistics.median(walls),
                            host_issue_ms=statistics.median(issue))
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--hidden", type=int, default=64)
    ap.add_argument("--vocab", type=int, default=256)
    ap.add_argument("--tokens", type=int, default=1024, help="trajectory tokens of the microbatch (sweep 4x)")
    ap.add_argument("--chunk-size", type=int, default=64)
    ap.add_argument("--grouped-experts", action="store_true")
    ap.add_argument("--recompute", choices=("on", "off"), default="on")
    ap.add_argument("--dispatcher", choices=("fast", "reference"), default="fast",
                    help="MoE token permutation: megatron_harts.moe.dispatch (fast) or Megatron's own (reference)")
    ap.add_argument("--sites", action="store_true", help="also list where the syncs happen")
    ap.add_argument("--ops", action="store_true", help="also list the launching ops of a MoE layer forward")
    ap.add_argument("--microbatches", metavar="WORKLOADS", help="instead: microbatches per step of bench_e2e's "
                    "workloads (e.g. swe,tau) on both sides at --capacity, seeds 1..5 (its timed steps)")
    ap.add_argument("--capacity", type=int, default=65536)
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cpu", help="cuda: sync count (CUDA's sync debug "
                    "mode) and timing of one MoE layer of the bench's real model instead")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--json")
    args = ap.parse_args(argv)
    if args.device == "cuda":
        out = layer_timing(args)
        print(f"one MoE layer (bench config, {'grouped' if args.grouped_experts else 'SequentialMLP'} experts), tree "
              f"pack of {out['tokens']} compact tokens, forward + backward on CUDA:")
        print("| dispatcher | syncs (CUDA sync debug) | wall ms (median) | host issue ms |\n|---|---|---|---|")
        for b in ("reference", "fast"):
            r = out[b]
            print(f"| {b} | {r['syncs']} | {r['wall_ms']:.3f} | {r['host_issue_ms']:.3f} |")
        if args.json:
            with open(args.json, "w") as f:
                json.dump(out, f, indent=1)
        return
    if args.microbatches:
        rows = microbatch_counts(args.microbatches.split(","), args.capacity, [1, 2, 3, 4, 5])
        print("| workload | seed | traj tokens | compression | HARTS microbatches | HARTS tokens/microbatch "
              "(compact) | baseline microbatches | baseline tokens/microbatch |\n|---|---|---|---|---|---|---|---|")
        for r in rows:
            print(f"| {r['workload']} | {r['seed']} | {r['traj_tokens']} | {r['compression']:.2f} | "
                  f"{r['harts_microbatches']} | {', '.join(map(str, r['harts_tokens']))} | "
                  f"{r['baseline_microbatches']} | "
                  f"{', '.join(map(str, r['baseline_tokens']))} |")
        if args.json:
            with open(args.json, "w") as f:
                json.dump(rows, f, indent=1)
        return
    args.recompute = args.recompute == "on"

    from megatron_harts.megatron import cpu_shim
    from megatron_harts.moe.layer import TreeMoETransformerLayer
    TreeMoETransformerLayer.dispatcher_backend = args.dispatcher
    with cpu_shim.cpu_megatron(seed=0):
        pattern, model = build(args)
        n_moe = pattern.count("E")
        result = dict(pattern=pattern, moe_layers=n_moe, grouped_experts=args.grouped_experts,
                      dispatcher=args.dispatcher,
                      recompute=args.recompute, sides={})
        from megatron_harts.moe.dispatch import use_counts_once_dispatcher
        from megatron.core.transformer.moe.moe_layer import MoELayer
        tree_pk = packs(args)["tree"]
        result["layer"] = {}
        for backend in ("reference", "fast"):
            for m in model.modules():
                if isinstance(m, MoELayer):
                    use_counts_once_dispatcher(m, backend)
            result["layer"][backend] = {f"{ph}_{k}": n for (ph, k), n in layer_counts(model, tree_pk).items()}
        for m in model.modules():
            if isinstance(m, MoELayer):
                use_counts_once_dispatcher(m, args.dispatcher)
        for side, pk in packs(args).items():
            measure(model, pk, args)            # warm: caches of the pack and of the model
            c = measure(model, pk, args)
            row = {f"{ph}_{reg}_{k}": c.counts[(ph, reg, k)] for ph in ("fwd", "bwd") for reg in ("moe", "other")
                   for k in ("syncs", "launches", "h2d")}
            row["tokens"] = pk.num_tokens
            row["sync_sites"] = {f"{ph} {reg} {s}": n for (ph, reg, s), n in sorted(c.sync_sites.items())}
            row["moe_fwd_ops"] = {op: n / n_moe for (ph, reg, op), n in sorted(c.ops.items(), key=lambda x: -x[1])
                                  if ph == "fwd" and reg == "moe"}
            result["sides"][side] = row
    print(f"one MoE layer alone, forward + backward (tree pack of "
          f"{result['sides']['tree']['tokens']} compact tokens, router in tree mode, no recomputation), "
          f"{'grouped experts' if args.grouped_experts else 'SequentialMLP experts'}:")
    print("| dispatcher | syncs fwd | syncs bwd | h2d copies fwd | h2d bwd | launches fwd | launches bwd |\n"
          "|---|---|---|---|---|---|---|")
    for backend, r in result["layer"].items():
        print(f"| {backend} | {r['fwd_syncs']} | {r['bwd_syncs']} | {r['fwd_h2d']} | {r['bwd_h2d']} | "
              f"{r['fwd_launches']} | {r['bwd_launches']} |")
    print(f"\none microbatch, whole model (dispatcher={args.dispatcher}, recompute={args.recompute}):")
    hdr = ("side", "tokens", "MoE syncs/layer fwd", "bwd", "MoE h2d/layer fwd", "bwd", "MoE launches/layer fwd",
           "bwd", "syncs/microbatch (all layers)", "launches/microbatch")
    print("| " + " | ".join(hdr) + " |\n|" + "---|" * len(hdr))
    for side, r in result["sides"].items():
        per = lambda k: f"{r[k] / n_moe:.1f}"   # noqa: E731
        tot_s = sum(r[f"{p}_{g}_syncs"] for p in ("fwd", "bwd") for g in ("moe", "other"))
        tot_l = sum(r[f"{p}_{g}_launches"] for p in ("fwd", "bwd") for g in ("moe", "other"))
        print(f"| {side} | {r['tokens']} | {per('fwd_moe_syncs')} | {per('bwd_moe_syncs')} | {per('fwd_moe_h2d')} | "
              f"{per('bwd_moe_h2d')} | {per('fwd_moe_launches')} | {per('bwd_moe_launches')} | {tot_s} | {tot_l} |")
    print(f"\n{n_moe} MoE layers, dispatcher={args.dispatcher}, grouped_experts={args.grouped_experts}, "
          f"recompute={args.recompute}; MoE 'bwd' = the "
          "recomputed forward of the MoE layers under full recomputation (their backward kernels count in 'other').")
    if args.sites:
        for side, r in result["sides"].items():
            print(f"\nsync sites ({side}):")
            for s, n in r["sync_sites"].items():
                print(f"  {n:5d}  {s}")
    if args.ops:
        print("\nkernel-launching ops of one MoE layer forward (tree side):")
        for op, n in result["sides"]["tree"]["moe_fwd_ops"].items():
            print(f"  {n:5.1f}  {op}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
