"""Per-step host cost and per-layer op / launch / sync counts of tree-packed microbatches, on CPU.

Two measurements, both on the workloads ``scripts/bench_e2e.py`` runs for ``sweep:C`` (default
``sweep:8`` and ``sweep:10``; ``sweep_batch`` of 131,072 trajectory tokens, 2 groups of 16
trajectories, prompt -> 4 mid branches -> 4 leaves each; chunk size 64):

1. ``host``: wall milliseconds (median of ``--host-reps``) of the host phases of one step, split as
   bench_e2e's ``microbatches()`` does them, at the bench's real token counts (host work does not
   depend on the model width): ``trees`` (tries of the groups), ``plan`` (planner + microbatch
   lists; baseline: LPT), ``pack`` (``pack``), ``chunk_plan_host`` (numpy chunk rounds),
   ``conv_plan_host`` (conv fix-up rows / windows), ``weights`` (loss-weight tensors), and, on the
   CPU "device", the per-pack device plans the first forward builds: ``chunk_plan_dev`` (torch
   tensors of the rounds, replay indices), ``fused_rounds`` (fla varlen metadata of all rounds) and
   ``conv_plan_dev``. FlexAttention block masks are not timed at full size (on CPU
   ``create_block_mask`` materialises ``[T, T]``; the GPU builds them compiled, block by block).
2. ``ops``: one forward + backward of each layer kind alone (``G`` = GDN with its tree conv and
   tree GDN op, ``*`` = attention, ``-`` = MLP) of the dense bench model (pattern ``'G-G-G-*-' x 6``)
   shrunk to hidden 64 (4 GDN heads x 16, attention 4/2 heads x 16) on a tree pack of the same
   tree shape with ``--op-tokens`` trajectory tokens (the 3 rounds and 42 sequences of the real
   pack; op counts do not depend on the token count, ``tests/test_fla_backend.py`` checks that),
   and on the same trajectories as chains (the trajectory-wise THD baseline, same layers). Counted
   under a ``TorchDispatchMode`` (``scripts.moe_op_counts.OpCounter``): ``launches`` = aten ops
   that launch a kernel on CUDA (not views, allocations or syncs), ``triton`` = Triton kernel
   launches (fla's kernels run in Triton's interpreter, so the GPU code path is what is counted:
   ``backend="fla"`` conv / GDN; attention on the GPU path: FlexAttention for trees, FlashAttention
   varlen for chains, each stood in for by one SDPA op so the kernel counts as one launch),
   ``syncs`` = device->host syncs (``.item()``, ``.tolist()`` / ``.cpu()`` of device tensors,
   ``nonzero``, ``unique``, ``masked_select``, ``repeat_interleave`` without ``output_size``,
   boolean indexing). Launches are split by where they come from: ``conv`` (tree / varlen conv),
   ``mixer_op`` (the tree GDN op with its layout gathers, or fla's varlen GDN), ``attn_kernel``
   (``tree_attention``), ``rest`` (projections, norms, gates, RoPE, residuals). Per-pack plans
   are built before counting (they are per microbatch, not per layer); the whole model
   (``model``: 24 mixer + 24 MLP layers, full recomputation, log-probs and loss) is counted too,
   fwd and bwd, with syncs, after one warm forward that builds the pack's plans.

    PYTHONPATH=. python scripts/tree_op_counts.py                       # both tables, sweep:8 and sweep:10
    PYTHONPATH=. python scripts/tree_op_counts.py --json docs/benchmarks/tree_op_counts.json
"""
from __future__ import annotations

import argparse
import collections
import contextlib
import json
import os
import statistics
import sys
import time
import traceback

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests"))

if os.environ.get("TRITON_INTERPRET") != "1" and "fla" not in sys.modules:
    import fla_interpret   # noqa: E402  (fla's Triton kernels in Triton's interpreter: the GPU code path on CPU)

    fla_interpret.enable()

import numpy as np  # noqa: E402
import torch  # noqa: E402

from scripts.moe_op_counts import OpCounter, _device_to_host_hooks, _mark_host  # noqa: E402

#: where a launch comes from (first match over the Python stack, innermost first)
SOURCES = (("conv", ("megatron_harts/ops/conv.py", "fla/modules/causal_conv1d")),
           ("mixer_op", ("megatron_harts/ops/linear_attention.py", "megatron_harts/ops/fla_rounds.py",
                         "megatron_harts/ops/gather.py", "fla/ops/", "fla/modules/norm/l2norm")),
           ("attn_kernel", ("megatron_harts/ops/attention.py",)))


def _source() -> str:
    for fr in reversed(traceback.extract_stack()):
        f = fr.filename.replace(os.sep, "/")
        for name, pats in SOURCES:
            if any(p in f for p in pats):
                return name
    return "rest"


class LayerCounter(OpCounter):
    """``OpCounter`` whose launches and syncs are attributed to :data:`SOURCES` (region); also
    counts every aten op (``aten``: launches plus views, allocations and syncs, i.e. each
    dispatch the host pays for)."""

    def _region(self) -> str:
        return _source()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.counts[(self.phase, _source(), "aten")] += 1
        return super().__torch_dispatch__(func, types, args, kwargs)


@contextlib.contextmanager
def counting():
    """(counter, triton launches list): aten launches / syncs by (phase, source), Triton launches."""
    import triton.runtime.interpreter as interpreter
    c = LayerCounter()
    patched = _device_to_host_hooks(c)
    run = interpreter.InterpretedFunction.run

    def counted(self, *a, **k):
        c.counts[(c.phase, _source(), "triton")] += 1
        with torch.utils._python_dispatch._disable_current_modes():
            return run(self, *a, **k)
    interpreter.InterpretedFunction.run = counted
    try:
        with c:
            yield c
    finally:
        interpreter.InterpretedFunction.run = run
        for n, orig in patched:
            setattr(torch.Tensor, n, orig)


# ------------------------------------------------------------------------------------------------ GPU code path on CPU

@contextlib.contextmanager
def gpu_code_path():
    """Run the layers' tree ops as on CUDA: conv / GDN ``backend="fla"`` (Triton interpreter),
    attention ``flex`` for tree packs and ``varlen`` for chains, with the attention kernel stood in
    for by one SDPA call on the ancestor mask (one launch forward, one backward)."""
    import torch.nn.functional as F

    from megatron_harts.megatron import layers
    from megatron_harts.ops import attention as A
    saved = (layers.tree_causal_conv1d, layers.tree_gated_delta_rule, A._flex_attention, A._causal_varlen,
             A.varlen_applies)

    def conv(*a, **k):
        return saved[0](*a, **{**k, "backend": "fla"})

    def gdn(*a, **k):
        return saved[1](*a, **{**k, "backend": "fla"})

    def flex_stub():
        def run(q, k, v, block_mask, scale=None, enable_gqa=False):
            T = q.shape[2]
            mask = _masks.get(id(block_mask))
            if mask is None:
                from torch.nn.attention.flex_attention import create_mask
                with torch.utils._python_dispatch._disable_current_modes():
                    mask = create_mask(block_mask.mask_mod, None, None, T, T, device=q.device)[0, 0]
                _masks[id(block_mask)] = mask
            return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=enable_gqa)
        return run

    def varlen_stub(q, k, v, cu, max_len, scale):
        T = q.shape[0]
        key = ("varlen", T, cu.data_ptr())
        mask = _masks.get(key)
        if mask is None:
            with torch.utils._python_dispatch._disable_current_modes():
                seg = torch.searchsorted(cu.long(), torch.arange(T), right=True)
                idx = torch.arange(T)
                mask = (seg[:, None] == seg[None, :]) & (idx[None, :] <= idx[:, None])
            _masks[key] = mask
        qh, kh, vh = (x.transpose(0, 1).unsqueeze(0) for x in (q, k, v))
        o = F.scaled_dot_product_attention(qh, kh, vh, attn_mask=mask, scale=scale, enable_gqa=q.shape[1] != k.shape[1])
        return o.squeeze(0).transpose(0, 1)

    _masks = {}
    layers.tree_causal_conv1d, layers.tree_gated_delta_rule = conv, gdn
    A._flex_attention, A._causal_varlen = flex_stub, varlen_stub
    A.varlen_applies = lambda q, pack: pack.is_chain
    try:
        yield
    finally:
        (layers.tree_causal_conv1d, layers.tree_gated_delta_rule, A._flex_attention, A._causal_varlen,
         A.varlen_applies) = saved


# ------------------------------------------------------------------------------------------------ host phases

def _ms(fn, reps: int) -> tuple[float, object]:
    out, ts = None, []
    for _ in range(reps):
        t0 = time.perf_counter()
        out = fn()
        ts.append(1e3 * (time.perf_counter() - t0))
    return statistics.median(ts), out


def host_phases(compression: str, args) -> dict:
    """Milliseconds of each host phase of one step (module docstring), HARTS and baseline."""
    from megatron_harts.ops import chunk_plan
    from megatron_harts.ops.fla_rounds import fused_rounds
    from megatron_harts.ops.plan import build_chunk_plan_host, conv_fix_plan, conv_fix_taps
    from megatron_harts.packing import pack
    from megatron_harts.planner import plan
    from megatron_harts.planner.plan import assign
    from megatron_harts.tree import RolloutTree, trees_from_trajectories
    from scripts.bench_e2e import cost_model_for, workload

    a = argparse.Namespace(tiny=False, sweep_tokens=args.sweep_tokens, seed=args.seed, capacity=args.capacity,
                           chunk_size=64, vocab=32768)
    trajs = workload(f"sweep:{compression}", a)
    cm = cost_model_for("dense", a)
    reps, C = args.host_reps, 64
    out = {}
    t_trees, trees = _ms(lambda: trees_from_trajectories(trajs), reps)
    t_plan, mbs = _ms(lambda: [m for m in plan(trees, dp_size=1, microbatch_capacity=args.capacity, cost_model=cm,
                                                chunk_size=C).microbatches(trees, 0) if m], reps)
    t_pack, pks = _ms(lambda: [pack(m, chunk_size=C) for m in mbs], reps)
    hp = [(pk.parent.numpy(), pk.position_ids.numpy()) for pk in pks]
    t_cph, _ = _ms(lambda: [build_chunk_plan_host(p, pos, C) for p, pos in hp], reps)

    def fresh():     # packs without cached plans (a step builds them once)
        return [pack(m, chunk_size=C) for m in mbs]

    def timed_plans(step):
        ts = []
        for _ in range(reps):
            ps = fresh()
            for p in ps:
                chunk_plan(p, C) if step != "chunk_plan_host" else None
            t0 = time.perf_counter()
            for p in ps:
                if step == "conv_plan":
                    conv_fix_plan(p, 4)
                    conv_fix_taps(p, 4)
                elif step == "fused_rounds":
                    fused_rounds(p, C)
                elif step == "chunk_plan_dev":
                    p._cache.pop(("chunk_plan", C, str(p.device)))
                    chunk_plan(p, C)
            ts.append(1e3 * (time.perf_counter() - t0))
        return statistics.median(ts)

    def weights():
        return [[torch.from_numpy(np.asarray(r.loss_mask[1:], np.float32) * np.float32(r.advantage or 0.0))
                 for r in pk.trajectories] for pk in pks]
    t_w, _ = _ms(weights, reps)
    out["harts"] = dict(trees=t_trees, plan=t_plan, pack=t_pack, chunk_plan_host=t_cph,
                        chunk_plan_dev=timed_plans("chunk_plan_dev"), fused_rounds=timed_plans("fused_rounds"),
                        conv_plan=timed_plans("conv_plan"), weights=t_w, microbatches=len(pks),
                        tokens=[p.num_tokens for p in pks], rounds=[chunk_plan(p, C).num_rounds for p in pks],
                        sequences=[chunk_plan(p, C).num_sequences for p in pks])
    out["harts"]["total"] = sum(v for k, v in out["harts"].items() if isinstance(v, float))

    lens = np.array([len(t) for t in trajs], np.int64)

    def lpt():
        _, mb, M = assign(lens.astype(np.float64), lens, dp_size=1, capacity=args.capacity, refine=True)
        return [[RolloutTree([trajs[i] for i in np.flatnonzero(mb == m)], merge_prefixes=False)]
                for m in range(M) if (mb == m).any()]
    t_lpt, bmbs = _ms(lpt, reps)
    t_bpack, bpks = _ms(lambda: [pack(m, chunk_size=C) for m in bmbs], reps)
    out["baseline"] = dict(plan=t_lpt, pack=t_bpack, microbatches=len(bpks), tokens=[p.num_tokens for p in bpks])
    out["baseline"]["total"] = t_lpt + t_bpack
    return out


# ------------------------------------------------------------------------------------------------ op counts

def build_model(args):
    """The dense bench model (``MODELS["dense"]``, full recomputation) at hidden ``args.hidden``, its
    pattern repeated ``args.repeat`` times of 6 (``'G-G-G-*-'`` is one repeat)."""
    from megatron_harts.megatron import cpu_shim, tree_hybrid_stack_spec
    from scripts.bench_e2e import MODELS, RECOMPUTE
    pattern, over = MODELS["dense"]
    pattern = pattern[:len(pattern) // 6 * args.repeat]
    h = args.hidden
    over = dict(over, hidden_size=h, ffn_hidden_size=2 * h, num_attention_heads=4, num_query_groups=2, kv_channels=h // 4,
                linear_key_head_dim=h // 4, linear_value_head_dim=h // 4, linear_num_key_heads=4,
                linear_num_value_heads=4, **RECOMPUTE)
    cpu_shim.cpu_manual_seed(0)
    return pattern, cpu_shim.build_tiny_hybrid_model(pattern, vocab_size=args.vocab, max_sequence_length=8192,
                                                     hybrid_stack_spec=tree_hybrid_stack_spec(None),
                                                     init_method_std=0.1, **over)


def op_packs(compression: str, args) -> dict:
    """The sweep tree shape at ``--op-tokens`` trajectory tokens (tree pack, 2 groups) and, for the
    baseline, the trajectories of a ``--chain-tokens`` batch as chains (a chain pack's counts do not
    depend on its token count: one varlen call per op; fewer tokens keep the interpreter quick)."""
    from megatron_harts import workloads as W
    from megatron_harts.packing import pack
    from megatron_harts.tree import RolloutTree, trees_from_trajectories
    trajs = W.sweep_batch(args.op_tokens, float(compression), seed=args.seed, vocab_size=args.vocab,
                          tokens_per_group=args.op_tokens // 2)
    chains = W.sweep_batch(args.chain_tokens, float(compression), seed=args.seed, vocab_size=args.vocab,
                           tokens_per_group=args.chain_tokens // 2)
    return {"tree": pack(trees_from_trajectories(trajs), chunk_size=64),
            "traj": pack([RolloutTree(chains, merge_prefixes=False)], chunk_size=64)}


def _summary(c) -> dict:
    """{phase: {kind: {source: n}}} of a counter, plus totals."""
    out = {}
    for (ph, src, kind), n in c.counts.items():
        out.setdefault(ph, {}).setdefault(kind, {})[src] = out.get(ph, {}).get(kind, {}).get(src, 0) + n
    for ph in out.values():
        for kind, d in ph.items():
            d["total"] = sum(d.values())
    return out


def layer_counts(model, pk) -> dict:
    """Per layer kind (``G``, ``*``, ``-``): the first layer of that kind alone, forward + backward
    (no recomputation: under full recomputation a layer costs fwd + fwd + bwd), after one warm run
    that builds the pack's plans."""
    from megatron_harts.megatron import tree_packed_seq_params
    psp = tree_packed_seq_params(pk)
    for t in (psp.cu_seqlens_q_padded, psp.cu_seqlens_kv_padded):   # host tensors (made on the host, as in a step)
        _mark_host(t)
    rot = model.rotary_pos_emb(8192, packed_seq=True).index_select(0, pk.position_ids)
    kinds = {}
    for layer in model.decoder.layers:
        kind = _kind(layer)
        if kind in kinds:
            continue
        h = torch.randn(pk.num_tokens, 1, model.config.hidden_size)
        for rep in range(2):
            hb = h.clone().requires_grad_()
            with counting() as c:
                c.phase = "fwd"
                y = layer(hb, None, rotary_pos_emb=rot, packed_seq_params=psp)
                y = y[0] if isinstance(y, tuple) else y
                c.phase = "bwd"
                y.square().sum().backward()
        kinds[kind] = _summary(c)
    return kinds


def _kind(layer) -> str:
    from megatron_harts.megatron.layers import TreeGatedDeltaNet
    mods = [type(m).__name__ for m in layer.modules()]
    if any(isinstance(m, TreeGatedDeltaNet) for m in layer.modules()):
        return "G"
    if "SelfAttention" in mods:
        return "*"
    return "-"


def model_counts(model, pk) -> dict:
    """The whole model, one microbatch: forward (model + log-probs + loss) and backward (with the
    recomputed forwards), after one warm step (plans and caches built)."""
    from megatron_harts.megatron import tree_packed_seq_params
    from megatron_harts.ops import tree_token_logprobs

    def step(c=None):
        model.zero_grad(set_to_none=True)
        logits = model(pk.tokens[None], pk.position_ids[None], None, packed_seq_params=tree_packed_seq_params(pk))
        loss = -sum(lp.float().sum() for lp in tree_token_logprobs(logits[0], pk))
        if c is not None:
            c.phase = "bwd"
        loss.backward()
    step()
    with counting() as c:
        c.phase = "fwd"
        step(c)
    s = _summary(c)
    s["sync_sites"] = {f"{ph} {site}": n for (ph, _, site), n in sorted(c.sync_sites.items())}
    return s


def run_ops(args) -> dict:
    import torch._dynamo as dynamo

    from megatron_harts.megatron import cpu_shim
    dynamo.config.disable = True
    out = {}
    with cpu_shim.cpu_megatron(seed=0), gpu_code_path():
        pattern, model = build_model(args)
        for comp in args.compressions.split(","):
            packs = op_packs(comp, args)
            row = {"pattern": pattern}
            for side, pk in packs.items():
                from megatron_harts.megatron import attention_backend
                from megatron_harts.ops import chunk_plan
                # the GPU's kernels: FlexAttention for tree packs, FlashAttention varlen for chains
                with attention_backend(model, "flex" if side == "tree" else "varlen"):
                    row[side] = dict(tokens=pk.num_tokens, rounds=chunk_plan(pk, 64).num_rounds,
                                     layers=layer_counts(model, pk))
                    if not args.no_model:
                        row[side]["model"] = model_counts(model, pk)
            out[f"sweep:{comp}"] = row
    return out


def _n(d: dict, ph: str, kind: str, src: str = "total") -> int:
    return d.get(ph, {}).get(kind, {}).get(src, 0)


def print_tables(res: dict) -> None:
    for wl, r in res.get("host", {}).items():
        h, b = r["harts"], r["baseline"]
        print(f"\n{wl}: host ms per step (median), HARTS {h['microbatches']} microbatch(es) of {h['tokens']} compact "
              f"tokens, rounds {h['rounds']}, sequences {h['sequences']}; baseline {b['microbatches']} microbatches")
        keys = [k for k, v in h.items() if isinstance(v, float)]
        print("| side | " + " | ".join(keys) + " |\n|---|" + "---:|" * len(keys))
        print("| HARTS | " + " | ".join(f"{h[k]:.2f}" for k in keys) + " |")
        print(f"| baseline | LPT {b['plan']:.2f}, pack {b['pack']:.2f}, total {b['total']:.2f} |")
    for wl, r in res.get("ops", {}).items():
        print(f"\n{wl}: ops per layer, forward / backward (one layer alone; aten launches + Triton launches; syncs)")
        print("| side | layer | launches fwd | of which conv / mixer op / attn kernel / rest | triton fwd | "
              "launches bwd | of which conv / mixer op / attn kernel / rest | triton bwd | syncs fwd+bwd |")
        print("|---|---|---:|---|---:|---:|---|---:|---:|")
        for side in ("tree", "traj"):
            for kind, d in r[side]["layers"].items():
                parts = lambda ph: " / ".join(str(_n(d, ph, "launches", s)) for s in ("conv", "mixer_op", "attn_kernel", "rest"))  # noqa: E731
                print(f"| {side} ({r[side]['tokens']} tok, {r[side]['rounds']} rounds) | {kind} | "
                      f"{_n(d, 'fwd', 'launches')} | {parts('fwd')} | {_n(d, 'fwd', 'triton')} | "
                      f"{_n(d, 'bwd', 'launches')} | {parts('bwd')} | {_n(d, 'bwd', 'triton')} | "
                      f"{_n(d, 'fwd', 'syncs') + _n(d, 'bwd', 'syncs')} |")
        for side in ("tree", "traj"):
            m = r[side].get("model")
            if m:
                print(f"model ({side}): fwd launches {_n(m, 'fwd', 'launches')} + triton {_n(m, 'fwd', 'triton')}, "
                      f"bwd launches {_n(m, 'bwd', 'launches')} + triton {_n(m, 'bwd', 'triton')}, syncs fwd "
                      f"{_n(m, 'fwd', 'syncs')} bwd {_n(m, 'bwd', 'syncs')}")
                for s, n in m["sync_sites"].items():
                    print(f"    {n:4d}  {s}")


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--compressions", default="8,10")
    ap.add_argument("--sweep-tokens", type=int, default=131072, help="trajectory tokens of the host-phase batch")
    ap.add_argument("--capacity", type=int, default=65536)
    ap.add_argument("--seed", type=int, default=1, help="bench_e2e's first timed step")
    ap.add_argument("--host-reps", type=int, default=7)
    ap.add_argument("--op-tokens", type=int, default=8192, help="trajectory tokens of the op-count batch")
    ap.add_argument("--chain-tokens", type=int, default=2048, help="trajectory tokens of the chain (baseline) pack")
    ap.add_argument("--hidden", type=int, default=64)
    ap.add_argument("--repeat", type=int, default=1, help="repeats of 'G-G-G-*-' in the model (the bench: 6)")
    ap.add_argument("--vocab", type=int, default=256)
    ap.add_argument("--skip", choices=("host", "ops"), help="skip one of the two measurements")
    ap.add_argument("--no-model", action="store_true", help="per-layer counts only (no whole-model count)")
    ap.add_argument("--json")
    args = ap.parse_args(argv)
    res = {"args": vars(args)}
    if args.skip != "host":
        res["host"] = {f"sweep:{c}": host_phases(c, args) for c in args.compressions.split(",")}
    if args.skip != "ops":
        res["ops"] = run_ops(args)
    print_tables(res)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=1)
    return res


if __name__ == "__main__":
    main()
