"""MoE experts alone: Megatron's ``SequentialMLP`` (local spec) vs ``TEGroupedMLP`` with
``megatron_harts.moe.grouped.TorchGroupedLinear`` (torch's grouped GEMM), same weights.

Per size: ``--tokens`` tokens routed top-``--topk`` over ``--experts`` experts (counts drawn from a
multinomial, a new draw per repetition: the router's counts change every microbatch), the
permuted rows as the experts get them; forward + backward of the experts module (SwiGLU, expert
FFN ``--ffn``, hidden ``--hidden``), CUDA events, median / min / max over ``--reps`` after
``--warmup``; outputs and input / weight gradients of both against an fp32 per-expert reference.
Needs only torch and megatron-core (no fla / Triton). ``--device cpu`` for a smoke run.

    python scripts/bench_moe_experts.py --out $OUT            # H200 defaults: the e2e MoE model's experts
    python scripts/bench_moe_experts.py --device cpu --tokens 256 --hidden 64 --ffn 64 --reps 2
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def init_megatron(device: str) -> None:
    """One-process Megatron parallel state (gloo on CPU, NCCL on CUDA) and its RNG trackers."""
    import torch.distributed as dist
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed
    if not dist.is_initialized():
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", str(29500 + os.getpid() % 1000))
        dist.init_process_group("nccl" if device == "cuda" else "gloo", rank=0, world_size=1)
    if not parallel_state.model_parallel_is_initialized():
        parallel_state.initialize_model_parallel()
    if device == "cuda":
        model_parallel_cuda_manual_seed(0)


def build(kind: str, args, dtype):
    import torch.nn.functional as F
    from megatron.core.transformer import TransformerConfig
    from megatron.core.transformer.mlp import MLPSubmodules
    from megatron.core.transformer.moe.experts import SequentialMLP
    from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
    from megatron.core.process_groups_config import ProcessGroupCollection
    from megatron_harts.moe.grouped import grouped_experts_builder

    cfg = TransformerConfig(num_layers=1, hidden_size=args.hidden, num_attention_heads=8, num_moe_experts=args.experts,
                            moe_ffn_hidden_size=args.ffn, ffn_hidden_size=args.ffn, moe_router_topk=args.topk,
                            gated_linear_unit=True, activation_func=F.silu, add_bias_linear=False,
                            bias_activation_fusion=False, params_dtype=dtype, bf16=dtype == torch.bfloat16,
                            use_cpu_initialization=args.device == "cpu", init_method_std=0.02,
                            moe_token_dispatcher_type="allgather")
    pg = ProcessGroupCollection.use_mpu_process_groups()
    if kind == "sequential":
        m = SequentialMLP(args.experts, cfg, MLPSubmodules(linear_fc1=ColumnParallelLinear,
                                                           linear_fc2=RowParallelLinear), pg_collection=pg)
    else:
        m = grouped_experts_builder()(args.experts, cfg, pg_collection=pg)
    return m.to(args.device)


def counts(n_rows: int, experts: int, gen: torch.Generator) -> torch.Tensor:
    return torch.bincount(torch.randint(0, experts, (n_rows,), generator=gen), minlength=experts)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    ap.add_argument("--tokens", default="4096,16384,65536", help="tokens per microbatch (comma list)")
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--ffn", type=int, default=1024)
    ap.add_argument("--experts", type=int, default=16)
    ap.add_argument("--topk", type=int, default=2)
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--watchdog", type=float, default=0, help="dump all stacks and exit after this many seconds")
    args = ap.parse_args(argv)
    if args.watchdog:
        import faulthandler
        faulthandler.dump_traceback_later(args.watchdog, exit=True)
    dtype = torch.bfloat16 if args.device == "cuda" else torch.float32
    init_megatron(args.device)
    from megatron_harts.moe.grouped import sequential_to_grouped

    seq, grp = build("sequential", args, dtype), build("grouped", args, dtype)
    sd = sequential_to_grouped({"experts." + k: v for k, v in seq.state_dict().items()})
    missing, unexpected = grp.load_state_dict({k[len("experts."):]: v for k, v in sd.items()}, strict=False)
    if unexpected or any(not k.endswith("_extra_state") for k in missing):
        raise RuntimeError(f"weight copy failed: missing {missing}, unexpected {unexpected}")
    ref = build("sequential", args, torch.float32) if args.device == "cuda" else None
    if ref is not None:
        ref.load_state_dict({k: v.float() if torch.is_tensor(v) else v for k, v in seq.state_dict().items()})
    gen = torch.Generator().manual_seed(0)
    sync = torch.cuda.synchronize if args.device == "cuda" else (lambda: None)
    rows = []
    for n_tok in [int(t) for t in args.tokens.split(",")]:
        n = n_tok * args.topk
        x = torch.randn(n, args.hidden, device=args.device, dtype=dtype)
        probs = torch.rand(n, device=args.device, dtype=torch.float32)
        dy = torch.randn(n, args.hidden, device=args.device, dtype=dtype)
        row = {"tokens": n_tok, "rows": n}
        # accuracy on one draw: both against the fp32 per-expert reference (CUDA) or each other (CPU)
        tpe = counts(n, args.experts, gen).to(args.device)
        outs = {}
        for name, m in (("sequential", seq), ("grouped", grp)) + ((("fp32", ref),) if ref is not None else ()):
            xi = (x.float() if name == "fp32" else x).clone().requires_grad_()
            m.zero_grad(set_to_none=True)
            y, _ = m(xi, tpe, probs)
            (y.float() * dy.float()).sum().backward()
            w1 = m.linear_fc1.weight.grad if name == "grouped" else torch.stack(
                [e.linear_fc1.weight.grad for e in m.local_experts])
            outs[name] = (y.detach().float(), xi.grad.float(), w1.float())
        want = outs.get("fp32", outs["sequential"])
        for name in ("sequential", "grouped"):
            row[f"{name}_rel_err"] = [float((a - b).abs().max() / b.abs().max().clamp(min=1e-12))
                                      for a, b in zip(outs[name], want)]
        for name, m in (("sequential", seq), ("grouped", grp)):
            times = []
            for r in range(args.warmup + args.reps):
                tpe = counts(n, args.experts, gen).to(args.device)
                xi = x.clone().requires_grad_()
                m.zero_grad(set_to_none=True)
                sync()
                if args.device == "cuda":
                    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                    a.record()
                t0 = time.perf_counter()
                y, _ = m(xi, tpe, probs)
                y.backward(dy)
                if args.device == "cuda":
                    b.record()
                    sync()
                    ms = a.elapsed_time(b)
                else:
                    ms = 1e3 * (time.perf_counter() - t0)
                if r >= args.warmup:
                    times.append(ms)
            row[f"{name}_ms"] = dict(median=statistics.median(times), min=min(times), max=max(times))
        row["speedup"] = row["sequential_ms"]["median"] / row["grouped_ms"]["median"]
        rows.append(row)
        print(f"[moe-experts] {n_tok} tokens: sequential {row['sequential_ms']['median']:.2f} ms, grouped "
              f"{row['grouped_ms']['median']:.2f} ms ({row['speedup']:.2f}x); rel err out/dx/dw1 sequential "
              f"{['%.1e' % e for e in row['sequential_rel_err']]} grouped {['%.1e' % e for e in row['grouped_rel_err']]}",
              flush=True)
    meta = dict(device=torch.cuda.get_device_name() if args.device == "cuda" else "cpu", torch=torch.__version__,
                dtype=str(dtype), **{k: getattr(args, k) for k in ("hidden", "ffn", "experts", "topk", "reps", "warmup")})
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "moe_experts.json"), "w") as f:
        json.dump({"meta": meta, "rows": rows}, f, indent=1)
    print("| tokens | SequentialMLP ms | grouped ms | speedup | rel err grouped (out, dx, dW1) | rel err sequential |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        s, g = r["sequential_ms"], r["grouped_ms"]
        print(f"| {r['tokens']} | {s['median']:.2f} [{s['min']:.2f}-{s['max']:.2f}] | {g['median']:.2f} "
              f"[{g['min']:.2f}-{g['max']:.2f}] | {r['speedup']:.2f} | "
              f"{', '.join('%.1e' % e for e in r['grouped_rel_err'])} | {', '.join('%.1e' % e for e in r['sequential_rel_err'])} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
