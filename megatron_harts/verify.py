"""Check tree-packed training against the trajectory-wise baseline on a Megatron model.

``python -m megatron_harts.verify --pattern 'G*-G-' --seed 0 [--trajectories FILE.jsonl]
[--recompute] [--num-moe-experts N [--grouped-experts]] [--dtype float32|float64] [--chunk-size C] [--mutant NAME]
[--device cpu|cuda] [--model tiny|1.5b] [--spec local|te]`` builds a ``HybridModel`` with
``tree_hybrid_stack_spec``, runs the same weights on ``pack_trajectories(trees)`` (every
trajectory its own chain: THD packing) and on ``pack(trees)``, and prints one JSON line::

    {"max_logprob_abs_diff", "loss_rel_diff", "max_grad_rel_diff", "worst_grad",
     "max_grad_rel_diff_non_decay", "per_class", "compression", "gates", "margin", "worst_gate"}
    (MoE adds "moe_losses_rel_diff", "moe_counts_rel_diff"; --mutant adds "mutant"; CUDA adds
    "baseline_rerun", "noise_reruns", "params" and, with a varlen baseline, "baseline_flex",
    "tree_vs_baseline_flex", "baseline_flex_rerun"; the two reruns shown are the reversed-order ones;
    "baseline_reruns" / "baseline_flex_reruns" hold every rerun's difference, in rerun order, so the
    gates of fewer reruns can be recomputed from one run)

The loss is ``sum_i <logprobs_i, w_i>`` with random weights. Gradients are compared per parameter
(``max|a - b| / max|b|``) and gated per parameter class (:data:`PARAM_CLASSES`: embedding, attention
qkv / proj, GDN in_proj / conv / out_proj, Mamba in_proj / conv / D / out_proj, decay = the GDN and
Mamba ``A_log``/``dt_bias``, norms, MLP, router, experts, output; ``per_class`` holds the largest
difference of each class). ``gates`` lists every gated quantity with its difference, its gate and
their ratio, the margin (``margin``: the largest ratio, at ``worst_gate``); exit status 1 when a
margin exceeds 1 (or is NaN).

CPU (default): tiny model through ``cpu_shim``, torch backends. ``--dtype float32`` (default):
log-probs within ``--tol`` (1e-5) times the largest baseline log-prob, loss and every class within
``--tol``, the decay class within ``--decay-tol`` (5e-4: ``[HV]`` sums over all tokens with heavy
cancellation, whose fp32 noise reaches ~1e-4 relative, e.g. 1.2e-4 tree vs baseline and 3.5e-5
baseline chunk 32 vs 64 on the default batch with seed 1). ``--dtype float64`` (no ``M`` layers:
the Mamba mixer computes in fp32): the model in fp64 and both tolerances 1e-6 by default, decay
included. Every class then agrees to within 1-3e-7 on the default batches (seeds 0-3, with and
without MoE), the decay grads as closely as the rest: their fp32 differences are rounding, not
layout. What remains comes from the few stages that compute in fp32 whatever the model's dtype (the
log-softmax of ``tree_token_logprobs``, the q/k l2norm of the torch GDN, the router's multiplicity
weights).

CUDA: bf16 (``--model 1.5b``: the 1.48B ``HYBRID_1P5B`` preset with ``--pattern`` ignored), fla
and FlexAttention for the tree; the baseline is rerun ``--noise-reruns`` times (default
:data:`NOISE_RERUNS` = 4) on the trees in other orders, reversed first, then seeded shuffles
(:func:`noise_orders`: other pack positions and reduction orders): the bf16 noise floor
(``baseline_rerun``: the reversed one). Where the baseline's attention is FlashAttention varlen
(``ops.attention.chain_pack_backend``), it also runs on FlexAttention, the tree's kernel:
``baseline_flex`` (what the kernel alone changes) and ``tree_vs_baseline_flex`` (the like-for-like
comparison), and that FlexAttention baseline is rerun in the same orders (``baseline_flex_rerun``:
the reversed one). Each gated quantity of the like-for-like tree difference (log-probs, loss, each
gradient class, MoE objectives) must stay within ``--noise-factor`` times the same quantity's noise
floor: the largest of all reruns' differences, floored by ``BF16_FLOOR`` (see :func:`noise_gates`).
Several reruns, because each difference is a maximum over elements, one draw of a heavy-tailed
quantity (a bf16 MoE routing flip lands in a branch window or not): with one rerun a correct tree
failed the 3x gate (H200, MoE with grouped experts, ``grad/gdn_out_proj`` 0.081 against 0.075; CPU
bf16 analogue, ``scripts/verify_noise_floor.py``: 4 of 12 correct trees, worst 4.4x the floor; with
four reruns none, worst 2.5x). So a class is held to its own rerun noise: the noisy decay grads no
longer set the bar for every weight. FlashAttention varlen's forward is
batch-invariant: its reversed rerun reproduced the baseline's log-probs bit for bit on the H200,
so alone it would not measure the tree's (FlexAttention) bf16 noise.

MoE (``E`` layers need ``--num-moe-experts N``): the routers use sigmoid scores with aux-loss,
per-sequence and global aux losses, z-loss and expert bias (:data:`MOE_OBJECTIVES`), all weighted
by multiplicity on the tree side; their gradients enter the backward (Megatron's
``MoEAuxLossAutoScaler``), and the logged router losses (``moe_losses_rel_diff``) and per-expert
token counts of the expert-bias update (``moe_counts_rel_diff``) are gated too.

Plan checks (exact, no floating point; gate 0): the derived plans that the layers read from the tree
pack are checked against the trajectories themselves (:func:`plan_errors`): ``plan/attention_mask``
(rows of the attention mask the kernel will use, the FlexAttention block mask's ``mask_mod`` on CUDA
and the dense SDPA mask on CPU, that do not allow exactly the token's own trajectory prefix),
``plan/linear_attention`` (broken links of the chunk plan the GDN / Mamba layers run: parent order,
zero states only at roots, handoffs from the parent's sequence, outputs from their own token),
``plan/positions`` (RoPE positions that are not the token's position in its trajectories) and,
with MoE layers, ``plan/moe_multiplicity`` (router token weights that are not the number of
trajectories through the token). A bf16 run on random weights cannot see one wrongly visible token
among a thousand ancestors; these can. ``numeric_margin`` is the margin of the numeric gates alone.
``max_logprob_abs_diff_branch`` is the log-prob difference over the :data:`BRANCH_WINDOW` entries
from each token that starts a branch (where mask, state-handoff and position bugs show first),
gated like the other log-probs. On CUDA the default batch adds short-prefix probe groups
(:data:`PROBE`), where one wrongly visible token carries a noticeable share of attention.

``--mutant NAME`` (``megatron_harts.verify_mutants``: ``sibling_visible``, ``state_handoff_dropped``,
``position_off_by_one``, ``moe_multiplicity_ignored``) runs the tree side on a deliberately broken
pack, a self-test of the checker: verify must then exit 1, and its margin says by how much the
gate rejected the broken tree (CPU margins: ``docs/benchmarks/verify_mutants.md``). A mutant the
workload cannot show (no branch point, no handoff, no layer it touches) exits 2. ``--mutant all``
runs the baseline sides once, then the tree side unmutated and with every mutant the pattern can
show, and prints one JSON line ``{"unmutated": {...}, "mutants": {name: {...}}, "all_rejected"}``:
exit 0 only when the unmutated tree passes and every mutant is rejected.

Without ``--trajectories`` a synthetic agentic batch is used (small on CPU; 2 groups x 8 samples,
56K tokens, on CUDA, where the 1.5b model always recomputes activations: the baseline side runs the
whole batch as one pack).
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import faulthandler
import json
import math
import random
import sys

import torch

from .megatron import attention_backend, cpu_shim, tree_hybrid_stack_spec, tree_packed_seq_params
from .megatron.arguments import TREE_SUPPORTED_LAYER_SYMBOLS
from .ops import tree_token_logprobs
from .ops.attention import chain_pack_backend
from .packing import pack, pack_trajectories
from .tree import TreeValidationError, read_jsonl, trees_from_trajectories
from .workloads import AgenticConfig, agentic_batch

RECOMPUTE = dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1)
DECAY_PARAMS = ("A_log", "dt_bias")
# CUDA check: the reversed rerun keeps the token count (same GEMM shapes), so it can underestimate
# bf16 noise (down to 0 without attention layers); differences below these floors always pass.
# Gradient classes use the "max_grad_rel_diff" floor, the MoE objectives MOE_FLOOR.
BF16_FLOOR = {"max_logprob_abs_diff": 1e-2, "loss_rel_diff": 1e-3, "max_grad_rel_diff": 1e-2}
MOE_FLOOR = 1e-2
#: Parameter classes, first match wins (``pattern in name``; decay: the name ends with it).
PARAM_CLASSES = (
    ("decay", DECAY_PARAMS), ("norm", ("norm",)), ("embedding", ("embedding.",)), ("output", ("output_layer.",)),
    ("attention_qkv", ("linear_qkv",)), ("attention_proj", ("self_attention.linear_proj",)),
    ("gdn_in_proj", ("self_attention.in_proj",)), ("gdn_conv", ("self_attention.conv1d",)),
    ("gdn_out_proj", ("self_attention.out_proj",)), ("mamba_in_proj", ("mixer.in_proj",)),
    ("mamba_conv", ("mixer.conv1d",)), ("mamba_D", ("mixer.D",)), ("mamba_out_proj", ("mixer.out_proj",)),
    ("router", ("mlp.router",)), ("experts", ("mlp.experts", "mlp.shared_experts")), ("mlp", ("mlp.",)),
)
#: Router objectives of ``E`` layers in verify: every multiplicity-weighted one on.
MOE_OBJECTIVES = dict(moe_router_score_function="sigmoid", moe_router_enable_expert_bias=True,
                      moe_router_bias_update_rate=1e-2,
                      moe_router_load_balancing_type=["aux_loss", "seq_aux_loss", "global_aux_loss"],
                      moe_aux_loss_coeff=[0.1, 0.1, 0.1], moe_z_loss_coeff=1e-2)
CPU_TOL = {"float32": (1e-5, 5e-4), "float64": (1e-6, 1e-6)}     # (--tol, --decay-tol) defaults
#: CUDA: baseline reruns per attention kernel for the noise floor (reversed order, then shuffles). One
#: rerun is one draw of a max-based difference: on a CPU bf16 analogue (scripts/verify_noise_floor.py,
#: docs/benchmarks/verify_mutants.md) a correct tree's worst difference reached 4.4x a single rerun's
#: (a false failure at the 3x gate) and at most 2.5x the largest of four.
NOISE_RERUNS = 4
#: Log-prob entries gated separately from each token that starts a branch on (``max_logprob_abs_diff_branch``).
BRANCH_WINDOW = 8
#: CUDA default batch: probe groups beside the long agentic batch. Short prompts and turns, so the
#: first token after a branch has 10-40 ancestors and one wrongly visible token carries a share of
#: its attention that bf16 noise cannot hide (behind 500-1500-token prompts it carries 1/1000).
PROBE = AgenticConfig(num_groups=4, group_size=8, turns=(2, 4), vocab_size=32768, prompt_tokens=(4, 12),
                      assistant_tokens=(4, 12), tool_tokens_median=6, tool_tokens_max=16, id_prefix="probe")


def param_class(name: str) -> str:
    """The :data:`PARAM_CLASSES` class of a parameter name (``other`` if none matches)."""
    for cls, keys in PARAM_CLASSES:
        if (name.endswith(keys) if cls == "decay" else any(k in name for k in keys)):
            return cls
    return "other"


def rel_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    """``max|a - b| / max|b|`` in float64."""
    return float((a.double() - b.double()).abs().max() / b.double().abs().max().clamp(min=1e-12))


def _trajectory_positions(p) -> tuple[torch.Tensor, torch.Tensor]:
    """``(traj_index [sum L], t [sum L])``: every trajectory token's compact index and its position in
    its trajectory, from ``traj_cu_seqlens`` alone (not from the pack's ``position_ids``)."""
    idx, cu = p.traj_index, p.traj_cu_seqlens
    lens = cu[1:] - cu[:-1]
    t = torch.arange(idx.numel(), device=idx.device) - torch.repeat_interleave(cu[:-1], lens)
    return idx, t


def _mask_of(p):
    """``allowed(q [R, 1], kv [1, C]) -> bool [R, C]`` of the attention mask the tree pack's
    attention layers use (cached on the pack, so a swapped plan is what gets checked), over
    ``flex_length`` columns on CUDA."""
    if p.device.type == "cuda":
        from .ops.attention import block_mask, flex_length
        bm = block_mask(p)
        zero = torch.zeros((), dtype=torch.long, device=p.device)
        return (lambda q, kv: bm.mask_mod(zero, zero, q, kv)), flex_length(p.num_tokens)
    from .ops.attention import ancestor_mask
    m = ancestor_mask(p)
    return (lambda q, kv: m[q, kv]), p.num_tokens


def plan_errors(p, block_rows: int = 1024) -> dict[str, int]:
    """Exact checks of the tree pack's derived plans against its trajectories (integers, gate 0):

    * ``plan/attention_mask``: compact tokens whose mask row does not allow exactly their trajectory
      prefix: every ``(traj_index[t], traj_index[s])``, ``s <= t``, allowed, and the row allows
      ``t + 1`` tokens in all (``[block_rows, C]`` at a time; C = padded columns on CUDA);
    * ``plan/positions``: compact tokens whose RoPE position differs from their trajectory position;
    * ``plan/linear_attention``: broken links of the chunk plan that the GDN / Mamba layers run
      (:func:`chunk_plan_errors`; on CUDA the fla path runs ``fused_rounds``, built from this plan:
      a bug in that build shows in the numeric gates only);
    * ``plan/moe_multiplicity`` (only when the router's weights are cached on the pack, i.e. after an
      ``E`` layer ran or a mutant built them): tokens whose router weight is not the number of
      trajectories through them.
    """
    idx, t = _trajectory_positions(p)
    T, dev = p.num_tokens, p.device
    depth = torch.full((T,), -1, dtype=torch.long, device=dev)
    depth[idx] = t
    bad = torch.zeros(T, dtype=torch.bool, device=dev)
    allowed, C = _mask_of(p)
    cols = torch.arange(C, device=dev)
    for r0 in range(0, T, block_rows):
        rows = torch.arange(r0, min(T, r0 + block_rows), device=dev)
        bad[rows] |= allowed(rows[:, None], cols[None, :]).sum(1) != depth[rows] + 1
    cu = p.traj_cu_seqlens.tolist()
    for i in range(len(cu) - 1):
        ti = idx[cu[i]:cu[i + 1]]
        for r0 in range(0, ti.numel(), block_rows):
            q = ti[r0:r0 + block_rows]
            tril = torch.arange(ti.numel(), device=dev)[None, :] <= torch.arange(r0, r0 + q.numel(), device=dev)[:, None]
            bad[q] |= (tril & ~allowed(q[:, None], ti[None, :])).any(1)
    out = {"plan/attention_mask": int(bad.sum()), "plan/linear_attention": chunk_plan_errors(p),
           "plan/positions": int(torch.unique(idx[p.position_ids[idx] != t]).numel())}
    key = ("moe_multiplicity", str(dev))
    if key in p._cache:
        want = torch.bincount(idx, minlength=T).to(torch.float32)
        out["plan/moe_multiplicity"] = int((p._cache[key] != want).sum())
    return out


def chunk_plan_errors(p) -> int:
    """Broken links of the pack's chunk plan (the cached one the linear-attention layers read), against
    the tree's ``parent`` array: within a sequence each gathered token must be the child of the one
    before it; a round-0 sequence must start at a tree root (zero initial state); a later round's
    sequence must start at a child of the last token of the previous-round sequence whose final state
    it starts from (``init_from``); and every compact token's output must come from a position that
    gathered that token. Together these say that the recurrence each output sees has consumed
    exactly the token's root path, i.e. its trajectory prefix. Returns the number of violations."""
    from .ops.plan import chunk_plan
    plan = chunk_plan(p, p.chunk_size)
    parent, dev = p.parent, p.device
    bad, prev_last = 0, None
    for rd in plan.rounds:
        g, cu = rd.gather, rd.cu_seqlens_cpu.to(dev)
        starts = cu[:-1]
        inner = torch.ones(g.numel(), dtype=torch.bool, device=dev)
        inner[starts[starts < g.numel()]] = False
        i = torch.nonzero(inner).flatten()
        bad += int((parent[g[i]] != g[i - 1]).sum())
        first = g[starts]
        want = torch.full_like(first, -1) if rd.init_from is None else prev_last[rd.init_from.to(dev)]
        bad += int((parent[first] != want).sum())
        prev_last = g[cu[1:] - 1]
    T = p.num_tokens
    bad += int((plan.gather_all[plan.out_index] != torch.arange(T, device=dev)).sum())
    return bad


def branch_windows(p, window: int = BRANCH_WINDOW) -> list[torch.Tensor]:
    """Per trajectory of the tree pack ``p`` (pack order), bool ``[L_i - 1]`` over its log-prob
    entries: the ``window`` entries from every token that starts a branch (its parent has >= 2
    children) on. Entry ``j`` is the model's output at token ``j``, so a wrongly visible token,
    a dropped state or a shifted position at a branch shows there first."""
    parent = p.parent.cpu()
    T = p.num_tokens
    kids = torch.bincount(parent[parent >= 0], minlength=T)
    starts = torch.zeros(T, dtype=torch.bool)
    has = parent >= 0
    starts[has] = kids[parent[has]] >= 2
    idx, cu = p.traj_index.cpu(), p.traj_cu_seqlens.cpu().tolist()
    out = []
    for i in range(len(cu) - 1):
        c = torch.cumsum(starts[idx[cu[i]:cu[i + 1]]].long(), 0)
        lagged = torch.cat([torch.zeros(window, dtype=torch.long), c])[:c.numel()]
        out.append((c - lagged > 0)[:-1])
    return out


def backward(model, logprobs: list[torch.Tensor], weights: list[torch.Tensor]):
    """loss = sum_i <logprobs_i, weights_i>; backward; returns (loss, {param name: grad})."""
    model.zero_grad(set_to_none=True)
    loss = sum((lp * w).sum() for lp, w in zip(logprobs, weights))
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


def run_packed(model, trees, layout, weights, chunk_size: int, device: str = "cpu", transform=None,
               keep: dict | None = None):
    """``model`` on ``layout(trees)`` (``pack`` or ``pack_trajectories``; ``transform``, if given,
    maps the pack first: a mutant): per-trajectory log-probs ``[L_i - 1]`` (detached, fp32 or
    wider), loss, grads. ``keep["pack"]`` (if given) gets the device pack the model ran on."""
    p = layout(trees, chunk_size=chunk_size).to(device)
    if transform is not None:
        p = transform(p)
    if keep is not None:
        keep["pack"] = p
    logits = model(p.tokens[None], p.position_ids[None], None, packed_seq_params=tree_packed_seq_params(p))
    lps = [lp.to(torch.promote_types(lp.dtype, torch.float32)) for lp in tree_token_logprobs(logits[0], p)]
    return [lp.detach() for lp in lps], *backward(model, lps, [w.to(device) for w in weights])


def run_permuted(model, trees, layout, weights, chunk_size: int, device: str, order: list[int]):
    """:func:`run_packed` on the trees in ``order`` (a permutation of ``range(len(trees))``), results
    mapped back to the original order: the same trajectories at other pack positions, so other
    reduction orders (the bf16 noise floor on CUDA)."""
    assert sorted(order) == list(range(len(trees))), order
    sizes = [len(t.records) for t in trees]
    starts = [sum(sizes[:i]) for i in range(len(trees))]
    perm_w = [weights[starts[i] + j] for i in order for j in range(sizes[i])]
    lps, loss, grads = run_packed(model, [trees[i] for i in order], layout, perm_w, chunk_size, device)
    per_tree, k = [None] * len(trees), 0
    for i in order:
        per_tree[i], k = lps[k:k + sizes[i]], k + sizes[i]
    return [lp for c in per_tree for lp in c], loss, grads


def run_reversed(model, trees, layout, weights, chunk_size: int, device: str):
    """:func:`run_permuted` with the trees in reverse order."""
    return run_permuted(model, trees, layout, weights, chunk_size, device, list(range(len(trees)))[::-1])


def noise_orders(num_trees: int, count: int, seed: int = 0) -> list[list[int]]:
    """Up to ``count`` distinct non-identity orders of ``num_trees`` trees for the noise reruns: the
    reversed order first, then seeded shuffles (fewer when fewer exist: one tree has none)."""
    ident = list(range(num_trees))
    orders = [ident[::-1]] if num_trees > 1 and count > 0 else []
    rng, tries = random.Random(seed), 0
    limit = math.factorial(min(num_trees, 10)) - 1              # distinct non-identity orders (capped)
    while len(orders) < min(count, limit) and tries < 100 * count:
        tries += 1
        o = ident[:]
        rng.shuffle(o)
        if o != ident and o not in orders:
            orders.append(o)
    return orders


def _routers(model):
    from .moe import TreeTopKRouter
    return [m for m in model.modules() if isinstance(m, TreeTopKRouter)]


def _moe_reset(model) -> None:
    """Fresh MoE metrics tracker, global aux-loss and expert-bias token counters."""
    from megatron.core.transformer.moe.moe_logging import destroy_moe_metrics_tracker
    destroy_moe_metrics_tracker()
    for r in _routers(model):
        r.reset_global_aux_loss_tracker()
        if r.local_tokens_per_expert is not None:
            r.local_tokens_per_expert.zero_()


def _moe_stats(model) -> dict | None:
    """Logged router losses (``{name: [layers]}``) and per-expert token counts of the last run."""
    routers = _routers(model)
    if not routers:
        return None
    from megatron.core.transformer.moe.moe_logging import get_moe_metrics_tracker
    counts = [c.clone() for r in routers for c in (r.tree_tokens_per_expert, r.local_tokens_per_expert)
              if c is not None]
    return {"losses": {k: v.values.clone() for k, v in get_moe_metrics_tracker().metrics.items()}, "counts": counts}


def run_side(model, trees, layout, weights, chunk_size: int, device: str = "cpu", transform=None,
             reverse: bool = False, keep: dict | None = None, order: list[int] | None = None):
    """:func:`run_packed` (``reverse``: :func:`run_reversed`; ``order``: :func:`run_permuted`) with
    MoE counters reset before and read after: ``(log-probs, loss, grads, MoE stats or None)``."""
    _moe_reset(model)
    if reverse:
        order = list(range(len(trees)))[::-1]
    if order is not None:
        out = run_permuted(model, trees, layout, weights, chunk_size, device, order)
    else:
        out = run_packed(model, trees, layout, weights, chunk_size, device, transform, keep)
    return (*out, _moe_stats(model))


def compare(got, want, windows: list[torch.Tensor] | None = None) -> dict:
    """Differences of two ``run_packed`` / ``run_side`` results: log-probs absolute (``windows``, if
    given: also ``max_logprob_abs_diff_branch`` over :func:`branch_windows`), loss and grads
    relative (per parameter; ``per_class``: the largest of each :func:`param_class`), and with MoE
    stats the logged router losses and expert token counts (relative)."""
    grad_errs = {n: rel_diff(got[2][n], want[2][n]) for n in want[2]}
    worst = max(grad_errs, key=grad_errs.get)
    worst_other = max((e for n, e in grad_errs.items() if not n.endswith(DECAY_PARAMS)), default=0.0)
    per_class: dict[str, float] = {}
    for n, e in grad_errs.items():
        c = param_class(n)
        per_class[c] = e if math.isnan(e) else max(per_class.get(c, 0.0), e)
    out = {"max_logprob_abs_diff": max(float((a - b).abs().max()) for a, b in zip(got[0], want[0]) if b.numel()),
           "loss_rel_diff": rel_diff(got[1], want[1]), "max_grad_rel_diff": grad_errs[worst],
           "worst_grad": worst, "max_grad_rel_diff_non_decay": worst_other, "per_class": per_class}
    if windows is not None:
        out["max_logprob_abs_diff_branch"] = max(
            [float((a - b)[w.to(a.device)].abs().max()) for a, b, w in zip(got[0], want[0], windows) if w.any()],
            default=0.0)
    moe, moe_want = (got[3], want[3]) if len(got) > 3 and len(want) > 3 else (None, None)
    if moe is not None and moe_want is not None:
        if moe["losses"].keys() != moe_want["losses"].keys():
            raise RuntimeError(f"router losses differ in kind: {sorted(moe['losses'])} vs {sorted(moe_want['losses'])}")
        out["moe_losses_rel_diff"] = max((rel_diff(moe["losses"][k], v) for k, v in moe_want["losses"].items()),
                                         default=0.0)
        out["moe_counts_rel_diff"] = max((rel_diff(a, b) for a, b in zip(moe["counts"], moe_want["counts"])),
                                         default=0.0)
    return out


def _gated_keys(diff: dict) -> list[str]:
    keys = ["max_logprob_abs_diff"] + (["max_logprob_abs_diff_branch"] if "max_logprob_abs_diff_branch" in diff else [])
    keys += ["loss_rel_diff"]
    keys += [f"grad/{c}" for c in diff["per_class"]] if "per_class" in diff else ["max_grad_rel_diff"]
    return keys + [k for k in ("moe_losses_rel_diff", "moe_counts_rel_diff") if k in diff]


def _value(diff: dict, key: str) -> float:
    return diff["per_class"].get(key[5:], 0.0) if key.startswith("grad/") else diff.get(key, 0.0)


def cpu_gates(diff: dict, tol: float, decay_tol: float, logprob_scale: float) -> dict[str, tuple[float, float]]:
    """``{key: (difference, gate)}`` of the CPU check: log-probs within ``tol * logprob_scale``, the
    decay class within ``decay_tol``, everything else within ``tol``."""
    bar = {"max_logprob_abs_diff": tol * logprob_scale, "max_logprob_abs_diff_branch": tol * logprob_scale,
           "grad/decay": decay_tol}
    return {k: (_value(diff, k), bar.get(k, tol)) for k in _gated_keys(diff)}


def noise_gates(diff: dict, noise: list[dict], factor: float) -> dict[str, tuple[float, float]]:
    """``{key: (difference, gate)}`` of the CUDA check: each quantity of ``diff`` (log-probs, loss,
    each gradient class, MoE objectives) against ``factor`` x its noise floor, the largest of the
    ``noise`` comparisons (each a :func:`compare` result of a baseline and its reordered rerun) for
    that same quantity, at least its ``BF16_FLOOR`` (gradient classes: ``max_grad_rel_diff``'s,
    MoE: ``MOE_FLOOR``). Results without ``per_class`` gate ``max_grad_rel_diff`` as a whole."""
    def floor(k):
        k = "max_logprob_abs_diff" if k == "max_logprob_abs_diff_branch" else k
        return BF16_FLOOR.get(k, BF16_FLOOR["max_grad_rel_diff"] if k.startswith("grad/") else MOE_FLOOR)
    return {k: (_value(diff, k), factor * max([floor(k)] + [_value(n, k) for n in noise]))
            for k in _gated_keys(diff)}


def within_noise(diff: dict, noise: list[dict], factor: float) -> list[str]:
    """Keys of :func:`noise_gates` whose difference exceeds its gate (or is NaN). Empty when within
    noise."""
    return [k for k, (d, bar) in noise_gates(diff, noise, factor).items() if not d <= bar]


def _margin(d: float, bar: float) -> float:
    if math.isnan(d):
        return math.nan
    return d / bar if bar > 0 else (math.inf if d > 0 else 0.0)


def _report(res: dict, gates: dict[str, tuple[float, float]], mutant: str | None, emit: bool = True) -> int:
    """Add ``gates`` / ``margin`` / ``worst_gate`` / ``numeric_margin`` (numeric gates only, the
    ``plan/`` ones left out) to ``res``, print it (``emit``), explain failures on stderr; exit
    status (1 when a margin exceeds 1 or is NaN)."""
    def key(k):
        m = _margin(*gates[k])
        return math.inf if math.isnan(m) else m
    res["gates"] = {k: {"diff": d, "gate": bar, "margin": _margin(d, bar)} for k, (d, bar) in gates.items()}
    worst = max(gates, key=key)
    res["margin"], res["worst_gate"] = _margin(*gates[worst]), worst
    numeric = [k for k in gates if not k.startswith("plan/")]
    worst_num = max(numeric, key=key)
    res["numeric_margin"], res["numeric_worst_gate"] = _margin(*gates[worst_num]), worst_num
    if emit:
        print(json.dumps(res))
    failing = [k for k, (d, bar) in gates.items() if not d <= bar]
    for k in failing:
        d, bar = gates[k]
        print(f"verify{f' [{mutant}]' if mutant else ''}: {k} {d:.3g} exceeds its gate {bar:.3g} "
              f"(margin {_margin(d, bar):.3g})", file=sys.stderr)
    if mutant:
        verdict = "rejected" if failing else "NOT rejected: the gate misses this broken tree"
        print(f"verify: mutant {mutant} {verdict} (margin {res['margin']:.3g} at {worst}; numeric gates alone "
              f"{res['numeric_margin']:.3g} at {worst_num})", file=sys.stderr)
    return 1 if failing else 0


def _mutation(name: str | None, chunk_size: int):
    """``(transform for the tree-side pack or None, info dict it fills)``."""
    if not name:
        return None, {}
    from . import verify_mutants
    info = {"name": name}

    def transform(p):
        out, n = verify_mutants.apply(name, p)
        info.update(exercised=n, **verify_mutants.branch_coverage(p, chunk_size))
        return out
    return transform, info


def _mutant_names(args) -> list[str | None]:
    """Tree-side runs: ``[None]`` (unmutated), ``[NAME]`` or, for ``--mutant all``, ``None`` then
    every mutant with a layer in the pattern."""
    from .verify_mutants import MUTANTS
    if args.mutant == "all":
        return [None] + [n for n, m in sorted(MUTANTS.items()) if any(c in args.pattern for c in m.layers)]
    return [args.mutant]


def _check_runs(args, run_tree, gates_of) -> int:
    """Run the tree side once per :func:`_mutant_names` entry (``run_tree(transform, keep) ->
    result``; ``gates_of(result, pack) -> (res dict, gates)``), report, exit status."""
    names = _mutant_names(args)
    out, rcs = {}, {}
    for name in names:
        transform, info = _mutation(name, args.chunk_size)
        keep: dict = {}
        tree = run_tree(transform, keep)
        if name and not info.get("exercised"):
            print(f"verify: --mutant {name} changes nothing in this workload ({json.dumps(info)}); use a "
                  "smaller --chunk-size or trajectories with more branches", file=sys.stderr)
            if args.mutant != "all":
                return 2
            out[name] = {"mutant": info, "skipped": "not exercised"}
            continue
        res, gates = gates_of(tree, keep["pack"])
        if info:
            res["mutant"] = info
        rcs[name] = _report(res, gates, name, emit=args.mutant != "all")
        out[name] = res
    if args.mutant != "all":
        return rcs[names[0]]
    muts = {n: r for n, r in out.items() if n}
    summary = {n: {"rejected": rcs.get(n) == 1, "margin": r.get("margin"), "worst_gate": r.get("worst_gate"),
                   "numeric_margin": r.get("numeric_margin"), "numeric_worst_gate": r.get("numeric_worst_gate"),
                   "exercised": r["mutant"].get("exercised")} for n, r in muts.items()}
    if not any(s["exercised"] for s in summary.values()):
        print("verify --mutant all: no mutant changes anything in this workload; use a smaller --chunk-size or "
              "trajectories with more branches", file=sys.stderr)
        return 2
    ok = rcs[None] == 0 and all(s["rejected"] for s in summary.values() if s["exercised"])
    print(json.dumps({"unmutated": out[None], "mutants": muts, "summary": summary, "all_rejected": ok}))
    for n, s_ in summary.items():
        print(f"verify --mutant all: {n}: {'rejected' if s_['rejected'] else 'NOT rejected'} "
              f"(margin {s_['margin']}, numeric {s_['numeric_margin']})", file=sys.stderr)
    return 0 if ok else 1


def main(argv: list[str] | None = None) -> int:
    from .verify_mutants import MUTANTS

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--pattern", default="G*-G-")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--trajectories", help="trajectory JSONL (one tree per group)")
    ap.add_argument("--recompute", action="store_true", help="full activation recomputation, 1 layer per chunk")
    ap.add_argument("--num-moe-experts", type=int, help="experts of 'E' layers (tree router: "
                    "multiplicity-weighted aux losses, z-loss and expert-bias counts, all on)")
    ap.add_argument("--grouped-experts", action="store_true", help="MoE experts on torch's grouped GEMM "
                    "(megatron_harts.moe.grouped) instead of SequentialMLP")
    ap.add_argument("--device", choices=["cpu", "cuda"], default="cpu", help="cpu: fp32 tiny model; cuda: bf16")
    ap.add_argument("--dtype", choices=["float32", "float64"], default="float32",
                    help="cpu: model dtype (float64: tolerances 1e-6 by default, decay included)")
    ap.add_argument("--model", choices=["tiny", "1.5b"], default="tiny", help="1.5b: HYBRID_1P5B (cuda only)")
    ap.add_argument("--spec", choices=["local", "te"], default="local",
                    help="cuda: layer spec (te = Transformer Engine modules, needs TE)")
    ap.add_argument("--noise-factor", type=float, default=3.0, help="cuda: allowed multiple of the bf16 noise floor")
    ap.add_argument("--noise-reruns", type=int, default=NOISE_RERUNS,
                    help="cuda: baseline reruns in other tree orders (reversed, then shuffles) whose largest "
                         "difference is the noise floor")
    ap.add_argument("--chunk-size", type=int, default=64)
    ap.add_argument("--mutant", choices=sorted(MUTANTS) + ["all"], help="self-test of the checker: run the tree "
                    "side on a deliberately broken pack (megatron_harts.verify_mutants); verify must exit 1. "
                    "all: the unmutated tree and every mutant the pattern can show, in one process")
    ap.add_argument("--no-probe", dest="probe", action="store_false", help="cuda: leave the short-prefix probe "
                    "groups (PROBE) out of the default batch")
    ap.add_argument("--watchdog", type=float, default=0, help="dump all stacks and exit after this many seconds")
    ap.add_argument("--tol", type=float, help="cpu: relative tolerance (default 1e-5, float64 1e-6)")
    ap.add_argument("--decay-tol", type=float, help="cpu: tolerance of A_log/dt_bias grads (default 5e-4, "
                    "float64 1e-6)")
    args = ap.parse_args(argv)
    bad = sorted(set(args.pattern) - TREE_SUPPORTED_LAYER_SYMBOLS)
    if not args.pattern or bad:
        ap.error(f"--pattern {args.pattern!r}: layer symbols must be from "
                 f"{''.join(sorted(TREE_SUPPORTED_LAYER_SYMBOLS))!r}" + (f" (got {''.join(bad)!r})" if bad else ""))
    if args.chunk_size < 1:
        ap.error(f"--chunk-size must be >= 1, got {args.chunk_size}")
    if args.num_moe_experts is not None and args.num_moe_experts < 1:
        ap.error(f"--num-moe-experts must be >= 1, got {args.num_moe_experts}")
    for name in ("tol", "decay_tol", "noise_factor"):
        if getattr(args, name) is not None and not getattr(args, name) > 0:
            ap.error(f"--{name.replace('_', '-')} must be > 0, got {getattr(args, name)}")
    if args.noise_reruns < 1:
        ap.error(f"--noise-reruns must be >= 1, got {args.noise_reruns}")
    if args.watchdog < 0:
        ap.error(f"--watchdog must be >= 0, got {args.watchdog}")
    if args.trajectories:
        try:
            args.trajectories = read_jsonl(args.trajectories)
        except (OSError, TreeValidationError) as e:
            ap.error(f"--trajectories: {e}")
        if not args.trajectories:
            ap.error("--trajectories: the file holds no trajectories")
    if args.watchdog:
        faulthandler.dump_traceback_later(args.watchdog, exit=True)
    if args.model != "tiny" and args.device != "cuda":
        ap.error("--model 1.5b needs --device cuda")
    if args.spec == "te" and args.device != "cuda":
        ap.error("--spec te needs --device cuda (Transformer Engine)")
    if args.dtype != "float32" and args.device != "cpu":
        ap.error("--dtype float64 is for --device cpu (cuda runs bf16)")
    if args.dtype == "float64" and "M" in args.pattern:
        ap.error("--dtype float64 needs a pattern without Mamba2 ('M') layers: the Mamba mixer computes in fp32")
    if args.model == "1.5b":
        from .megatron.gpu import HYBRID_1P5B
        args.pattern = HYBRID_1P5B[0]
    if "E" in args.pattern and not args.num_moe_experts:
        ap.error(f"--pattern {args.pattern!r} has MoE layers ('E'): give their expert count with --num-moe-experts N")
    if args.grouped_experts and not args.num_moe_experts:
        ap.error("--grouped-experts needs MoE layers ('E' in --pattern and --num-moe-experts N)")
    if args.grouped_experts and args.spec == "te":
        ap.error("--grouped-experts is for the local spec (--spec te has TE's grouped experts)")
    if args.num_moe_experts and "E" not in args.pattern:
        ap.error(f"--num-moe-experts needs MoE layers ('E') in --pattern (got {args.pattern!r})")
    if args.mutant and args.mutant != "all" and not any(c in args.pattern for c in MUTANTS[args.mutant].layers):
        ap.error(f"--mutant {args.mutant} needs a layer of type {' or '.join(MUTANTS[args.mutant].layers)!r} "
                 f"in --pattern (got {args.pattern!r})")
    if args.device == "cuda":
        return _main_cuda(args)
    return _main_cpu(args)


def _main_cpu(args) -> int:
    tol, decay_tol = CPU_TOL[args.dtype]
    tol = tol if args.tol is None else args.tol
    decay_tol = decay_tol if args.decay_tol is None else args.decay_tol
    dtype = getattr(torch, args.dtype)
    if args.trajectories:
        trajs = args.trajectories            # read and checked by main
    else:
        trajs = agentic_batch(AgenticConfig(num_groups=2, group_size=4, vocab_size=64, prompt_tokens=(20, 40),
                                            assistant_tokens=(5, 15), tool_tokens_median=10, tool_tokens_max=40,
                                            seed=args.seed))
    trees = trees_from_trajectories(trajs)
    vocab = max(64, 1 + max(int(max(t.tokens)) for t in trajs))
    g = torch.Generator().manual_seed(args.seed)
    weights = [torch.randn(len(r) - 1, generator=g).to(dtype) for tree in trees for r in tree.records]
    moe = dict(MOE_OBJECTIVES, num_moe_experts=args.num_moe_experts) if args.num_moe_experts else {}
    windows = branch_windows(pack(trees, chunk_size=args.chunk_size))
    owns = not cpu_shim.is_enabled()    # else reuse the caller's CPU Megatron setup (e.g. a test)
    with cpu_shim.cpu_megatron(seed=args.seed) if owns else contextlib.nullcontext():
        cpu_shim.cpu_manual_seed(args.seed)
        model = cpu_shim.build_tiny_hybrid_model(args.pattern, vocab_size=vocab, init_method_std=0.1,
                                                 max_sequence_length=max(len(t.tokens) for t in trajs),
                                                 hybrid_stack_spec=tree_hybrid_stack_spec(
                                                     args.num_moe_experts, grouped_experts=args.grouped_experts),
                                                 params_dtype=dtype, **moe, **(RECOMPUTE if args.recompute else {}))
        for prm in model.parameters():      # the torch norms ignore params_dtype
            prm.data = prm.data.to(dtype)
        base = run_side(model, trees, pack_trajectories, weights, args.chunk_size)
        scale = max(float(lp.abs().max()) for lp in base[0] if lp.numel())

        def gates_of(tree, p):
            res = compare(tree, base, windows)
            res.update(compression=pack(trees).compression, dtype=args.dtype, plan=plan_errors(p))
            gates = cpu_gates(res, tol, decay_tol, scale)
            return res, {**gates, **{k: (v, 0.0) for k, v in res["plan"].items()}}
        return _check_runs(args, lambda transform, keep: run_side(model, trees, pack, weights, args.chunk_size,
                                                                  transform=transform, keep=keep), gates_of)


def _main_cuda(args) -> int:
    """bf16 tree vs baseline next to the baseline's reruns in other tree orders, on the current GPU."""
    from .megatron.gpu import HYBRID_1P5B, build_gpu_hybrid_model, init_single_gpu

    if args.trajectories:
        trajs = args.trajectories            # read and checked by main
    else:
        trajs = agentic_batch(AgenticConfig(num_groups=2, group_size=8, vocab_size=32768, prompt_tokens=(500, 1500),
                                            seed=args.seed))  # seed 0: 56,279 tokens, 2.97x
        if args.probe:
            trajs += agentic_batch(dataclasses.replace(PROBE, seed=args.seed))
    trees = trees_from_trajectories(trajs)
    # the noise floor: each baseline rerun with the trees in other orders (reversed first)
    orders = noise_orders(len(trees), args.noise_reruns, args.seed)
    if not orders:
        print(f"verify: --device cuda needs at least 2 trees (groups of trajectories) for its noise floor, got "
              f"{len(trees)}", file=sys.stderr)
        return 2
    if len(orders) < args.noise_reruns:
        print(f"verify: {len(trees)} trees have only {len(orders)} other order(s): the noise floor comes from "
              f"{len(orders)} rerun(s) per baseline, not {args.noise_reruns}", file=sys.stderr)
    vocab = max(32768, 1 + max(int(max(t.tokens)) for t in trajs))
    g = torch.Generator().manual_seed(args.seed)
    weights = [torch.randn(len(r) - 1, generator=g) for tree in trees for r in tree.records]
    windows = branch_windows(pack(trees, chunk_size=args.chunk_size))
    init_single_gpu(args.seed)
    pattern, over = HYBRID_1P5B if args.model == "1.5b" else (args.pattern, dict(hidden_size=256))
    recompute = args.recompute or args.model == "1.5b"   # the baseline runs the whole batch as one pack
    moe = dict(MOE_OBJECTIVES, num_moe_experts=args.num_moe_experts, moe_router_dtype="fp32") \
        if args.num_moe_experts else {}
    over = dict(over, **moe, **(RECOMPUTE if recompute else {}))
    model = build_gpu_hybrid_model(pattern, vocab, max(len(t.tokens) for t in trajs), spec=args.spec,
                                   grouped_experts=args.grouped_experts, **over)
    run = lambda layout, **kw: run_side(model, trees, layout, weights, args.chunk_size, "cuda", **kw)  # noqa: E731
    # each rerun's difference is compared right away (a result holds a copy of every gradient)
    base = run(pack_trajectories)
    noise_base = [compare(run(pack_trajectories, order=o), base, windows) for o in orders]
    noises, noise_flex, base_flex = list(noise_base), [], None
    if chain_pack_backend(torch.device("cuda")) == "varlen":       # tree packs run FlexAttention
        with attention_backend(model, "flex"):
            base_flex = run(pack_trajectories)
            noise_flex = [compare(run(pack_trajectories, order=o), base_flex, windows) for o in orders]
        noises += noise_flex
    n_params = sum(p.numel() for p in model.parameters())

    def gates_of(tree, p):
        res = compare(tree, base, windows)
        same_kernel = res
        if base_flex is not None:
            same_kernel = compare(tree, base_flex, windows)
            res.update(baseline_flex=compare(base_flex, base, windows), tree_vs_baseline_flex=same_kernel,
                       baseline_flex_rerun=noise_flex[0], baseline_flex_reruns=noise_flex)
        res.update(compression=pack(trees).compression, baseline_rerun=noise_base[0], baseline_reruns=noise_base,
                   noise_reruns=len(orders),
                   params=n_params, trajectories=len(trajs), plan=plan_errors(p))
        gates = noise_gates(same_kernel, noises, args.noise_factor)
        return res, {**gates, **{k: (v, 0.0) for k, v in res["plan"].items()}}
    return _check_runs(args, lambda transform, keep: run(pack, transform=transform, keep=keep), gates_of)


if __name__ == "__main__":
    sys.exit(main())
