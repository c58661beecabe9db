"""Check tree-packed training against the trajectory-wise baseline on a Megatron model.

``python -m megatron_harts.verify --pattern 'G*-G-' --seed 0 [--trajectories FILE.jsonl]
[--recompute] [--device cpu|cuda] [--model tiny|1.5b] [--spec local|te]`` builds a ``HybridModel`` with
``tree_hybrid_stack_spec``, runs the same weights on ``pack_trajectories(trees)`` (every
trajectory its own chain: THD packing) and on ``pack(trees)``, and prints one JSON line::

    {"max_logprob_abs_diff", "loss_rel_diff", "max_grad_rel_diff", "worst_grad",
     "max_grad_rel_diff_non_decay", "compression"}
    (CUDA adds "baseline_rerun", "params" and, with a varlen baseline, "baseline_flex",
    "tree_vs_baseline_flex", "baseline_flex_rerun")

CPU (default): tiny fp32 model through ``cpu_shim``, torch backends, tolerances below. CUDA: bf16
(``--model 1.5b``: the 1.48B ``HYBRID_1P5B`` preset with ``--pattern`` ignored), fla and
FlexAttention for the tree; the baseline is run a second time on the trees in reverse order (other
pack positions and reduction orders): ``baseline_rerun``, the bf16 noise floor. Where the baseline's
attention is FlashAttention varlen (``ops.attention.chain_pack_backend``), it also runs on
FlexAttention, the tree's kernel: ``baseline_flex`` (what the kernel alone changes) and
``tree_vs_baseline_flex`` (the like-for-like comparison), and that FlexAttention baseline is rerun in
reverse order too (``baseline_flex_rerun``). Exit status 1 when the like-for-like tree difference
exceeds ``--noise-factor`` times the bf16 noise floor (log-probs and loss; gradients against the
worst gradient difference): the larger of the reversed reruns' differences, floored by
``BF16_FLOOR`` (see :func:`within_noise`). FlashAttention varlen's forward is batch-invariant: its
reversed rerun reproduced the baseline's log-probs bit for bit on the H200, so alone it would not
measure the tree's (FlexAttention) bf16 noise.

The loss is ``sum_i <logprobs_i, w_i>`` with random weights. Exit status 1 when a difference
exceeds ``--tol`` (``--decay-tol`` for the GDN ``A_log``/``dt_bias`` grads: ``[HV]`` sums over all
tokens with heavy cancellation, whose fp32 noise reaches ~1e-4 relative, e.g. 1.2e-4 tree vs
baseline and 3.5e-5 baseline chunk 32 vs 64 on the default batch with seed 1, while with the GDN
core computed in fp64 the two layouts agree to 1e-7). Without ``--trajectories`` a synthetic
agentic batch is used (small on CPU; 2 groups x 8 samples, 56K tokens, on CUDA, where the 1.5b model
always recomputes activations: the baseline side runs the whole batch as one pack).
"""
from __future__ import annotations

import argparse
import contextlib
import faulthandler
import json
import sys

import torch

from .megatron import attention_backend, cpu_shim, tree_hybrid_stack_spec, tree_packed_seq_params
from .ops import tree_token_logprobs
from .ops.attention import chain_pack_backend
from .packing import pack, pack_trajectories
from .tree import read_jsonl, trees_from_trajectories
from .workloads import AgenticConfig, agentic_batch

RECOMPUTE = dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1)
DECAY_PARAMS = ("A_log", "dt_bias")
# CUDA check: the reversed rerun keeps the token count (same GEMM shapes), so it can underestimate
# bf16 noise (down to 0 without attention layers); differences below these floors always pass.
BF16_FLOOR = {"max_logprob_abs_diff": 1e-2, "loss_rel_diff": 1e-3, "max_grad_rel_diff": 1e-2}


def rel_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    """``max|a - b| / max|b|`` in float64."""
    return float((a.double() - b.double()).abs().max() / b.double().abs().max().clamp(min=1e-12))


def backward(model, logprobs: list[torch.Tensor], weights: list[torch.Tensor]):
    """loss = sum_i <logprobs_i, weights_i>; backward; returns (loss, {param name: grad})."""
    model.zero_grad(set_to_none=True)
    loss = sum((lp * w).sum() for lp, w in zip(logprobs, weights))
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


def run_packed(model, trees, layout, weights, chunk_size: int, device: str = "cpu"):
    """``model`` on ``layout(trees)`` (``pack`` or ``pack_trajectories``): per-trajectory log-probs
    ``[L_i - 1]`` (detached, fp32), loss, grads."""
    p = layout(trees, chunk_size=chunk_size).to(device)
    logits = model(p.tokens[None], p.position_ids[None], None, packed_seq_params=tree_packed_seq_params(p))
    lps = [lp.float() for lp in tree_token_logprobs(logits[0], p)]      # logits [1, T, V]
    return [lp.detach() for lp in lps], *backward(model, lps, [w.to(device) for w in weights])


def run_reversed(model, trees, layout, weights, chunk_size: int, device: str):
    """:func:`run_packed` on the trees in reverse order, results mapped back to the original order."""
    sizes = [len(t.records) for t in trees]
    per_tree = lambda xs: [xs[sum(sizes[:i]):sum(sizes[:i + 1])] for i in range(len(trees))]
    rev_w = [w for ws in per_tree(weights)[::-1] for w in ws]
    lps, loss, grads = run_packed(model, trees[::-1], layout, rev_w, chunk_size, device)
    rev_sizes = sizes[::-1]
    chunks = [lps[sum(rev_sizes[:i]):sum(rev_sizes[:i + 1])] for i in range(len(trees))][::-1]
    return [lp for c in chunks for lp in c], loss, grads


def within_noise(diff: dict, noise: list[dict], factor: float) -> list[str]:
    """Keys of ``BF16_FLOOR`` where ``diff`` exceeds ``factor`` x the noise floor: the largest of the
    ``noise`` comparisons (each a :func:`compare` result of a baseline and its reordered rerun), at
    least ``BF16_FLOOR``. Empty when within noise."""
    return [k for k in BF16_FLOOR
            if not diff[k] <= factor * max([BF16_FLOOR[k]] + [n[k] for n in noise])]


def compare(got, want) -> dict:
    """Differences of two ``run_packed`` results (log-probs absolute, loss and grads relative)."""
    grad_errs = {n: rel_diff(got[2][n], want[2][n]) for n in want[2]}
    worst = max(grad_errs, key=grad_errs.get)
    worst_other = max((e for n, e in grad_errs.items() if not n.endswith(DECAY_PARAMS)), default=0.0)
    return {"max_logprob_abs_diff": max(float((a - b).abs().max()) for a, b in zip(got[0], want[0]) if b.numel()),
            "loss_rel_diff": rel_diff(got[1], want[1]), "max_grad_rel_diff": grad_errs[worst],
            "worst_grad": worst, "max_grad_rel_diff_non_decay": worst_other}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--pattern", default="G*-G-")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--trajectories", help="trajectory JSONL (one tree per group)")
    ap.add_argument("--recompute", action="store_true", help="full activation recomputation, 1 layer per chunk")
    ap.add_argument("--num-moe-experts", type=int, help="experts of 'E' layers (tree router: "
                    "multiplicity-weighted aux losses)")
    ap.add_argument("--device", choices=["cpu", "cuda"], default="cpu", help="cpu: fp32 tiny model; cuda: bf16")
    ap.add_argument("--model", choices=["tiny", "1.5b"], default="tiny", help="1.5b: HYBRID_1P5B (cuda only)")
    ap.add_argument("--spec", choices=["local", "te"], default="local",
                    help="cuda: layer spec (te = Transformer Engine modules, needs TE)")
    ap.add_argument("--noise-factor", type=float, default=3.0, help="cuda: allowed multiple of the bf16 noise floor")
    ap.add_argument("--chunk-size", type=int, default=64)
    ap.add_argument("--watchdog", type=float, default=0, help="dump all stacks and exit after this many seconds")
    ap.add_argument("--tol", type=float, default=1e-5)
    ap.add_argument("--decay-tol", type=float, default=5e-4)
    args = ap.parse_args(argv)
    if args.watchdog:
        faulthandler.dump_traceback_later(args.watchdog, exit=True)
    if args.model != "tiny" and args.device != "cuda":
        ap.error("--model 1.5b needs --device cuda")
    if args.spec == "te" and args.device != "cuda":
        ap.error("--spec te needs --device cuda (Transformer Engine)")
    if args.device == "cuda":
        return _main_cuda(args)

    if args.trajectories:
        trajs = read_jsonl(args.trajectories)
    else:
        trajs = agentic_batch(AgenticConfig(num_groups=2, group_size=4, vocab_size=64, prompt_tokens=(20, 40),
                                            assistant_tokens=(5, 15), tool_tokens_median=10, tool_tokens_max=40,
                                            seed=args.seed))
    trees = trees_from_trajectories(trajs)
    vocab = max(64, 1 + max(int(max(t.tokens)) for t in trajs))
    g = torch.Generator().manual_seed(args.seed)
    weights = [torch.randn(len(r) - 1, generator=g) for tree in trees for r in tree.records]
    owns = not cpu_shim.is_enabled()    # else reuse the caller's CPU Megatron setup (e.g. a test)
    with cpu_shim.cpu_megatron(seed=args.seed) if owns else contextlib.nullcontext():
        cpu_shim.cpu_manual_seed(args.seed)
        model = cpu_shim.build_tiny_hybrid_model(args.pattern, vocab_size=vocab, init_method_std=0.1,
                                                 max_sequence_length=max(len(t.tokens) for t in trajs),
                                                 hybrid_stack_spec=tree_hybrid_stack_spec(args.num_moe_experts),
                                                 num_moe_experts=args.num_moe_experts,
                                                 **(RECOMPUTE if args.recompute else {}))
        base = run_packed(model, trees, pack_trajectories, weights, args.chunk_size)
        tree = run_packed(model, trees, pack, weights, args.chunk_size)
    res = compare(tree, base)
    res["compression"] = pack(trees).compression
    print(json.dumps(res))
    scale = max(float(lp.abs().max()) for lp in base[0] if lp.numel())
    decay_err = max((rel_diff(tree[2][n], base[2][n]) for n in base[2] if n.endswith(DECAY_PARAMS)), default=0.0)
    ok = (res["max_logprob_abs_diff"] <= args.tol * scale and res["loss_rel_diff"] <= args.tol
          and res["max_grad_rel_diff_non_decay"] <= args.tol and decay_err <= args.decay_tol)
    return 0 if ok else 1


def _main_cuda(args) -> int:
    """bf16 tree vs baseline next to baseline vs its reversed-order rerun, on the current GPU."""
    from .megatron.gpu import HYBRID_1P5B, build_gpu_hybrid_model, init_single_gpu

    if args.trajectories:
        trajs = read_jsonl(args.trajectories)
    else:
        trajs = agentic_batch(AgenticConfig(num_groups=2, group_size=8, vocab_size=32768, prompt_tokens=(500, 1500),
                                            seed=args.seed))  # seed 0: 56,279 tokens, 2.97x
    trees = trees_from_trajectories(trajs)
    vocab = max(32768, 1 + max(int(max(t.tokens)) for t in trajs))
    g = torch.Generator().manual_seed(args.seed)
    weights = [torch.randn(len(r) - 1, generator=g) for tree in trees for r in tree.records]
    init_single_gpu(args.seed)
    pattern, over = HYBRID_1P5B if args.model == "1.5b" else (args.pattern, dict(hidden_size=256))
    recompute = args.recompute or args.model == "1.5b"   # the baseline runs the whole batch as one pack
    over = dict(over, num_moe_experts=args.num_moe_experts, **(RECOMPUTE if recompute else {}))
    model = build_gpu_hybrid_model(pattern, vocab, max(len(t.tokens) for t in trajs), spec=args.spec, **over)
    base = run_packed(model, trees, pack_trajectories, weights, args.chunk_size, "cuda")
    rerun = run_reversed(model, trees, pack_trajectories, weights, args.chunk_size, "cuda")
    tree = run_packed(model, trees, pack, weights, args.chunk_size, "cuda")
    res, noise = compare(tree, base), compare(rerun, base)
    same_kernel, noises = res, [noise]
    if chain_pack_backend(torch.device("cuda")) == "varlen":       # tree packs run FlexAttention
        with attention_backend(model, "flex"):
            base_flex = run_packed(model, trees, pack_trajectories, weights, args.chunk_size, "cuda")
            rerun_flex = run_reversed(model, trees, pack_trajectories, weights, args.chunk_size, "cuda")
        same_kernel = compare(tree, base_flex)
        noises.append(compare(rerun_flex, base_flex))
        res.update(baseline_flex=compare(base_flex, base), tree_vs_baseline_flex=same_kernel,
                   baseline_flex_rerun=noises[-1])
    res.update(compression=pack(trees).compression, baseline_rerun=noise,
               params=sum(p.numel() for p in model.parameters()))
    print(json.dumps(res))
    failing = within_noise(same_kernel, noises, args.noise_factor)
    for k in failing:
        print(f"verify: {k} {same_kernel[k]:.3g} exceeds {args.noise_factor:g} x the bf16 noise floor "
              f"{max([BF16_FLOOR[k]] + [n[k] for n in noises]):.3g}", file=sys.stderr)
    return 1 if failing else 0


if __name__ == "__main__":
    sys.exit(main())
