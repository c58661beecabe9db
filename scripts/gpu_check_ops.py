"""bf16 equivalence of the fast tree ops (fla / FlexAttention) on a GPU.

For each op: the tree-packed fast path and the trajectory-wise fast path (same kernels, varlen
over trajectories; ``attention_varlen``: the trajectory side on FlashAttention varlen), both in bf16, against an fp32 trajectory-wise reference (torch backend).
Reports max abs / relative error of outputs and of every input gradient; the tree error should
be of the size of the trajectory-wise error. Writes ``ops_check.json`` to ``--out``.

    python scripts/gpu_check_ops.py --out /tmp/out
"""
from __future__ import annotations

import argparse
import faulthandler
import json
import os
import sys
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))
from trees import corner_cases  # noqa: E402

from megatron_harts.ops import (node_logprobs, tree_attention, tree_causal_conv1d,  # noqa: E402
                                tree_gated_delta_rule, tree_simple_gla)
from megatron_harts.ops.fla_autotune import add_save_fla_configs_arg, save_fla_autotune  # noqa: E402
from megatron_harts.packing import pack, pack_trajectories  # noqa: E402
from megatron_harts.tree import RolloutTree  # noqa: E402
from megatron_harts.workloads import sweep_trees  # noqa: E402


def errors(a: torch.Tensor, ref: torch.Tensor) -> dict:
    d = (a.double() - ref.double()).abs().max().item()
    return {"abs": d, "rel": d / max(ref.double().abs().max().item(), 1e-30)}


T0 = time.perf_counter()


def log(msg):
    print(f"[{time.perf_counter() - T0:7.1f}s] {msg}", flush=True)


def run_case(inputs, per_token, tree_fn, traj_fn, ref_fn, p, seed=0, keep_fp32=()):
    """inputs: compact fp32 tensors; the first ``per_token`` are per token; those at
    ``keep_fp32`` (log decays) stay fp32 in the bf16 runs. Returns errors per path."""
    idx = p.traj_index
    g = torch.Generator(device="cuda").manual_seed(seed)

    def go(fn, dtype, gather):
        leaves = [x.detach().to(torch.float32 if i in keep_fp32 else dtype).requires_grad_(True)
                  for i, x in enumerate(inputs)]
        # Gathers between compact and trajectory tokens run in fp32 (their backward sums the up to
        # hundreds of copies of a shared token: a bf16 index_add rounds after every add). Otherwise
        # the traj path's input grads and the tree path's output grad, hence its weight and gate
        # grads, carry that harness rounding rather than the op's.
        xs = [x.float().index_select(0, idx).to(x.dtype) if (gather and i < per_token) else x
              for i, x in enumerate(leaves)]
        o = fn(*xs)
        o_t = o if gather else o.float().index_select(0, idx).to(o.dtype)
        return o_t, leaves

    out = {}
    log("  fp32 reference")
    o_ref, l_ref = go(ref_fn, torch.float32, True)
    do = torch.randn(o_ref.shape, generator=g, device="cuda")
    results = {}
    for label, fn, gather in (("tree", tree_fn, False), ("traj", traj_fn, True)):
        log(f"  {label} path")
        o, leaves = go(fn, torch.bfloat16, gather)
        (o.float() * do).sum().backward()
        results[label] = (o, leaves)
    (o_ref.float() * do).sum().backward()
    for label, (o, leaves) in results.items():
        e = {"out": errors(o, o_ref)}
        for i, (a, b) in enumerate(zip(leaves, l_ref)):
            if a.grad is not None:
                e[f"grad{i}"] = errors(a.grad, b.grad)
        e["nan"] = bool(torch.isnan(o).any())
        out[label] = e
    return out


def save(out_dir, report, fla_dir=None):
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, "ops_check.json"), "w") as f:
        json.dump(report, f, indent=1)
    if fla_dir:
        save_fla_autotune(fla_dir)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--ops", default="gdn,gdn_l2norm,simple_gla,conv,conv_nobias,attention,attention_varlen,logprobs",
                    help="attention_varlen: trajectory-wise side on FlashAttention varlen (torch >= 2.10)")
    add_save_fla_configs_arg(ap)
    ap.add_argument("--watchdog", type=float, default=0, help="dump all stacks and exit after this many seconds")
    args = ap.parse_args()
    if args.watchdog:
        faulthandler.dump_traceback_later(args.watchdog, exit=True)
    torch.manual_seed(args.seed)
    C = 64
    groups = list(corner_cases(C).values()) + sweep_trees(4096, 4, seed=args.seed)
    trees = [RolloutTree.from_trajectories(t) for t in groups]
    p = pack(trees, C).to("cuda")
    pt = pack_trajectories(trees, C).to("cuda")
    T = p.num_tokens
    print(f"pack: {p.num_trajectories} trajectories, {p.num_trajectory_tokens} trajectory tokens, "
          f"{T} compact ({p.compression:.2f}x)")
    dev = "cuda"
    H, HV, K = args.heads, args.heads, 128  # the benchmark's shapes: kernels compiled once
    q = F.normalize(torch.randn(T, H, K, device=dev), dim=-1)
    k = F.normalize(torch.randn(T, H, K, device=dev), dim=-1)
    v = torch.randn(T, HV, K, device=dev)
    gate = F.logsigmoid(torch.randn(T, HV, device=dev) + 3)
    beta = torch.rand(T, HV, device=dev)
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule
    from fla.ops.simple_gla import chunk_simple_gla
    from fla.modules.causal_conv1d.ops import causal_conv1d
    cu, cu_cpu = pt.traj_cu_seqlens, pt.traj_cu_seqlens.cpu()

    def fla_gdn(q, k, v, g, b, l2norm=False):
        return chunk_gated_delta_rule(q[None], k[None], v[None], g[None].float(), b[None], cu_seqlens=cu,
                                      cu_seqlens_cpu=cu_cpu, use_qk_l2norm_in_kernel=l2norm)[0][0]

    def fla_gla(q, k, v, g):
        return chunk_simple_gla(q[None], k[None], v[None], g[None].float(), cu_seqlens=cu, cu_seqlens_cpu=cu_cpu)[0][0]

    D = 3 * H * K  # GDN conv channels, as in the benchmark
    V = 32768      # sweep_trees draws ids below 32000
    # name -> (inputs, number of per-token inputs, tree fast path, trajectory-wise fast path,
    #          fp32 reference on the trajectory-wise layout, inputs kept in fp32)
    cases = {
        "gdn": (lambda: [q, k, v, gate, beta], 5,
                lambda *x: tree_gated_delta_rule(*x, p, backend="fla"), fla_gdn,
                lambda *x: tree_gated_delta_rule(*x, pt, backend="torch"), (3,)),
        "gdn_l2norm": (lambda: [3 * torch.randn(T, H, K, device=dev), 3 * torch.randn(T, H, K, device=dev), v, gate,
                                beta], 5,
                       lambda *x: tree_gated_delta_rule(*x, p, backend="fla", use_qk_l2norm_in_kernel=True),
                       lambda *x: fla_gdn(*x, l2norm=True),
                       lambda *x: tree_gated_delta_rule(*x, pt, backend="torch", use_qk_l2norm_in_kernel=True), (3,)),
        "simple_gla": (lambda: [q, k, v[:, :H].contiguous(), gate[:, :H].contiguous()], 4,
                       lambda *x: tree_simple_gla(*x, p, backend="fla"), fla_gla,
                       lambda *x: tree_simple_gla(*x, pt, backend="torch"), (3,)),
        "conv": (lambda: [torch.randn(T, D, device=dev), torch.randn(D, 4, device=dev) / 2,
                          torch.randn(D, device=dev)], 1,
                 lambda x, w, b: tree_causal_conv1d(x, w, b, p, "silu", backend="fla"),
                 lambda x, w, b: causal_conv1d(x[None], w, b, activation="silu", cu_seqlens=cu,
                                               cu_seqlens_cpu=cu_cpu)[0][0],
                 lambda x, w, b: tree_causal_conv1d(x, w, b, pt, "silu", backend="torch"), ()),
        "conv_nobias": (lambda: [torch.randn(T, D, device=dev), torch.randn(D, 4, device=dev) / 2], 1,
                        lambda x, w: tree_causal_conv1d(x, w, None, p, "silu", backend="fla"),
                        lambda x, w: causal_conv1d(x[None], w, None, activation="silu", cu_seqlens=cu,
                                                   cu_seqlens_cpu=cu_cpu)[0][0],
                        lambda x, w: tree_causal_conv1d(x, w, None, pt, "silu", backend="torch"), ()),
        "attention": (lambda: [torch.randn(T, 16, 128, device=dev), torch.randn(T, 4, 128, device=dev),
                               torch.randn(T, 4, 128, device=dev)], 3,
                      lambda *x: tree_attention(*x, p, backend="flex"),
                      lambda *x: tree_attention(*x, pt, backend="flex"),
                      lambda *x: tree_attention(*x, pt, backend="torch"), ()),
        "attention_varlen": (lambda: [torch.randn(T, 16, 128, device=dev), torch.randn(T, 4, 128, device=dev),
                                      torch.randn(T, 4, 128, device=dev)], 3,
                             lambda *x: tree_attention(*x, p, backend="flex"),
                             lambda *x: tree_attention(*x, pt, backend="varlen"),
                             lambda *x: tree_attention(*x, pt, backend="torch"), ()),
        "logprobs": (lambda: [4 * torch.randn(T, V, device=dev)], 1,
                     lambda l: node_logprobs(l, p)[:, None], lambda l: node_logprobs(l, pt)[:, None],
                     lambda l: node_logprobs(l, pt)[:, None], ()),
    }
    report = {"pack": {"trajectories": p.num_trajectories, "trajectory_tokens": p.num_trajectory_tokens,
                       "compact_tokens": T}}
    ops = args.ops.split(",")
    for name in ops:
        log(name)
        make, per_token, tree_fn, traj_fn, ref_fn, keep = cases[name]
        try:
            report[name] = run_case(make(), per_token, tree_fn, traj_fn, ref_fn, p, keep_fp32=keep)
        except (RuntimeError, NotImplementedError) as e:   # e.g. no varlen_attn in this torch: the next op runs
            if isinstance(e, torch.OutOfMemoryError):
                raise
            report[name] = {"error": f"{type(e).__name__}: {e}"}
            log(f"  {name} failed: {e}")
        save(args.out, report, args.save_fla_configs)
    save(args.out, report, args.save_fla_configs)
    print(f"{'op':<16} {'path':<5} {'out abs':>9} {'out rel':>9} {'worst grad rel':>15} nan")
    for op in ops:
        for label in ("tree", "traj") if "error" not in report[op] else ():
            e = report[op][label]
            gmax = max((v["rel"] for k_, v in e.items() if k_.startswith("grad")), default=float("nan"))
            print(f"{op:<16} {label:<5} {e['out']['abs']:>9.2e} {e['out']['rel']:>9.2e} {gmax:>15.2e} {e['nan']}")


if __name__ == "__main__":
    main()
