"""Command-line flags for tree-packed RL training with Megatron-LM's argument parser.

Use as Megatron's ``extra_args_provider`` and validate after Megatron's own validation::

    from megatron.training.arguments import parse_and_validate_args
    from megatron_harts.megatron.arguments import add_tree_packing_args, validate_tree_packing_args_or_exit

    args = parse_and_validate_args(extra_args_provider=add_tree_packing_args)
    validate_tree_packing_args_or_exit(args)     # or validate_tree_packing_args: raises TreePackingArgumentError

Argument names of megatron-core 0.19.2 that are checked: ``context_parallel_size``,
``mtp_num_layers``, ``hybrid_layer_pattern`` (``hybrid_override_pattern`` is its deprecated
alias, folded into it by Megatron's ``validate_args``), ``moe_expert_capacity_factor``,
``moe_pad_expert_input_to_capacity``, ``micro_batch_size``, ``pipeline_model_parallel_size``,
``num_experts``, ``moe_token_dispatcher_type``, ``variable_seq_lengths``.
"""
from __future__ import annotations

import argparse
import logging

from ..ops.attention import BACKENDS as ATTENTION_BACKENDS
from ..rl import KL_ESTIMATORS, LOSS_AGG_MODES, LOSS_TYPES

logger = logging.getLogger(__name__)

#: Layer symbols of ``--hybrid-layer-pattern`` that have a tree path; ``D`` (DSA) and ``+`` (MLA)
#: have none.
TREE_SUPPORTED_LAYER_SYMBOLS = frozenset("G*-EM")
#: Pattern characters that are not layers: pipeline-stage boundary.
PATTERN_SEPARATORS = frozenset("|")
PLANNERS = ("harts", "greedy")
SPECS = ("local", "te")


class TreePackingArgumentError(ValueError):
    """An argument combination that tree packing does not support."""


def add_tree_packing_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add the ``tree packing`` and ``RL loss`` groups to Megatron's parser; returns it."""
    g = parser.add_argument_group(title="tree packing (megatron_harts)")
    g.add_argument("--tree-packing", action="store_true",
                   help="Pack each rollout tree once (shared prefixes computed once). Without it, "
                        "trajectories are packed one after another (THD baseline) by the same code.")
    g.add_argument("--tree-chunk-size", type=int, default=64,
                   help="Chunk size of the tree linear-attention ops (fla uses 64). Default 64.")
    g.add_argument("--tree-planner", choices=PLANNERS, default="harts",
                   help="Assignment of trees to DP ranks x microbatches: 'harts' (cost-model "
                        "co-planning, megatron_harts.planner) or 'greedy' (largest first onto the "
                        "least loaded microbatch, by compact tokens). Default harts.")
    g.add_argument("--tree-trajectories", type=str, default=None, metavar="PATH",
                   help="Trajectory JSONL (one trajectory a line, see README). Required for training.")
    g.add_argument("--tree-groups-per-step", type=int, default=None,
                   help="Rollout groups (trees) consumed per optimizer step; must be >= "
                        "global batch size (= DP x microbatches, one tree pack per microbatch). "
                        "Default: global batch size.")
    g.add_argument("--tree-spec", choices=SPECS, default="local",
                   help="Layer spec of the tree-packed model: 'local' (Megatron-Core modules, tested on "
                        "CPU and the H200) or 'te' (Transformer Engine modules; needs TE; its numerics are "
                        "untested here: run `python -m megatron_harts.verify --device cuda --spec te` "
                        "first). Default local.")
    g.add_argument("--tree-attention-backend", choices=ATTENTION_BACKENDS, default="auto",
                   help="Kernel of the '*' layers' core attention on tree and trajectory packs: 'auto' "
                        "(CUDA: FlashAttention varlen for trajectory packs, i.e. without --tree-packing, "
                        "FlexAttention with the ancestor mask for tree packs; CPU: masked SDPA), 'flex', "
                        "'varlen' (trajectory packs only) or 'torch' (dense mask, O(T^2) memory). Default auto.")
    g.add_argument("--tree-max-tokens", type=int, default=None,
                   help="Warn when a microbatch holds more compact tokens than this.")
    g.add_argument("--tree-shuffle-seed", type=int, default=None,
                   help="Shuffle groups once with this seed before iterating (default: file order).")
    r = parser.add_argument_group(title="RL loss (megatron_harts)")
    r.add_argument("--rl-loss-type", choices=LOSS_TYPES, default="grpo")
    r.add_argument("--rl-loss-agg-mode", choices=LOSS_AGG_MODES, default="token-mean")
    r.add_argument("--rl-clip-eps", type=float, default=0.2, help="Lower (and default upper) clip range.")
    r.add_argument("--rl-clip-eps-high", type=float, default=None, help="Upper clip range (DAPO clip-higher).")
    r.add_argument("--rl-dual-clip-c", type=float, default=None, help="Dual-clip constant (> 1).")
    r.add_argument("--rl-kl-coef", type=float, default=0.0, help="KL(pi||ref) coefficient; needs ref_logprobs.")
    r.add_argument("--rl-kl-estimator", choices=KL_ESTIMATORS, default="k1")
    return parser


def _pattern(args) -> str | None:
    return getattr(args, "hybrid_layer_pattern", None) or getattr(args, "hybrid_override_pattern", None)


def tree_packing_errors(args) -> list[str]:
    """All unsupported-combination messages for ``args`` (empty when fine or tree packing is off)."""
    if not getattr(args, "tree_packing", False):
        return []
    errs = []
    cp = getattr(args, "context_parallel_size", 1) or 1
    if cp > 1:
        errs.append(f"--tree-packing does not support context parallelism (--context-parallel-size {cp}); "
                    "use tensor/data parallelism or --context-parallel-size 1")
    if getattr(args, "mtp_num_layers", None):
        errs.append(f"--tree-packing does not support multi-token prediction (--mtp-num-layers "
                    f"{args.mtp_num_layers}, or a '/' MTP section in the hybrid pattern)")
    pattern = _pattern(args)
    if pattern is None:
        errs.append("--tree-packing needs a hybrid model: set --hybrid-layer-pattern (e.g. 'G*-G-')")
    else:
        main, *mtp = pattern.split("/")
        if mtp and not getattr(args, "mtp_num_layers", None):
            errs.append(f"--tree-packing does not support multi-token prediction ('/' in pattern {pattern!r})")
        bad = sorted(set(main) - TREE_SUPPORTED_LAYER_SYMBOLS - PATTERN_SEPARATORS)
        if bad:
            errs.append(f"--tree-packing: layer symbol(s) {bad} in --hybrid-layer-pattern {pattern!r} have no "
                        f"tree path; supported: {sorted(TREE_SUPPORTED_LAYER_SYMBOLS)}")
    if getattr(args, "moe_expert_capacity_factor", None) is not None:
        errs.append("--tree-packing does not support token-dropping MoE (--moe-expert-capacity-factor "
                    f"{args.moe_expert_capacity_factor}): a compact token stands for several trajectory "
                    "tokens, so dropping would differ from trajectory-wise training; use dropless routing")
    if getattr(args, "moe_pad_expert_input_to_capacity", False):
        errs.append("--tree-packing does not support --moe-pad-expert-input-to-capacity (capacity-based MoE)")
    mbs = getattr(args, "micro_batch_size", None)
    if mbs not in (None, 1):
        errs.append(f"--tree-packing packs each microbatch into one [1, T] sequence: set --micro-batch-size 1 "
                    f"(got {mbs}); use --global-batch-size for the number of tree packs per step")
    if getattr(args, "tree_chunk_size", 64) < 1:
        errs.append(f"--tree-chunk-size must be >= 1, got {args.tree_chunk_size}")
    if getattr(args, "tree_attention_backend", "auto") == "varlen":
        errs.append("--tree-packing with --tree-attention-backend varlen: FlashAttention varlen only covers "
                    "trajectory packs (no branches); tree packs need 'auto', 'flex' or 'torch'")
    if getattr(args, "tree_spec", "local") == "te":
        from megatron.core.extensions.transformer_engine import HAVE_TE
        if not HAVE_TE:
            errs.append("--tree-spec te needs Transformer Engine, which is not installed; use --tree-spec local")
    pp = getattr(args, "pipeline_model_parallel_size", 1) or 1
    if pp > 1 and getattr(args, "num_experts", None) and \
            getattr(args, "moe_token_dispatcher_type", "allgather") == "allgather":
        errs.append("--tree-packing with --pipeline-model-parallel-size > 1 and MoE needs "
                    "--moe-token-dispatcher-type alltoall (or flex): tree packs differ in length, so pipeline "
                    "stages exchange variable sequence lengths, which Megatron's allgather dispatcher refuses")
    ep = getattr(args, "expert_model_parallel_size", 1) or 1
    if ep > 1 and getattr(args, "num_experts", None) and \
            getattr(args, "moe_token_dispatcher_type", "allgather") == "allgather":
        errs.append(f"--tree-packing with --expert-model-parallel-size {ep} needs --moe-token-dispatcher-type "
                    "alltoall (or flex): the DP ranks of an expert-parallel group hold packs of different lengths, "
                    "and Megatron's allgather dispatcher gathers equal token counts (all_gather_into_tensor)")
    if getattr(args, "rl_dual_clip_c", None) is not None and args.rl_dual_clip_c <= 1:
        errs.append(f"--rl-dual-clip-c must be > 1, got {args.rl_dual_clip_c}")
    for name in ("rl_clip_eps", "rl_clip_eps_high"):
        if getattr(args, name, None) is not None and getattr(args, name) < 0:
            errs.append(f"--{name.replace('_', '-')} must be >= 0, got {getattr(args, name)}")
    if getattr(args, "tree_groups_per_step", None) is not None and args.tree_groups_per_step < 1:
        errs.append(f"--tree-groups-per-step must be >= 1, got {args.tree_groups_per_step}")
    return errs


def validate_tree_packing_args_or_exit(args) -> None:
    """:func:`validate_tree_packing_args` for launch scripts (``scripts/pretrain_hybrid_harts.py``,
    ``patches/pretrain_hybrid_tree_packing.patch``): unsupported combinations end the process with
    their message (``SystemExit``, exit status 1) instead of a traceback on every rank."""
    try:
        validate_tree_packing_args(args)
    except TreePackingArgumentError as e:
        raise SystemExit(str(e)) from None


def validate_tree_packing_args(args) -> None:
    """Raise :class:`TreePackingArgumentError` listing every unsupported combination (no-op
    without ``--tree-packing``). Call after Megatron's ``validate_args``, before the model config
    is built.

    Also turns RoPE fusion and attention dropout off (Megatron's defaults: on and 0.1) when packs of
    this package are used (``--tree-packing`` or ``--tree-trajectories``, whose THD baseline takes
    the same path): tree packs carry one position per token (a pre-gathered rotary table), which
    TE's fused THD RoPE kernel has not been validated with (no TE here; the unfused path is
    tested), and tree attention has no dropout. Warns about hidden dropout with tree packing.

    Under pipeline parallelism (``--pipeline-model-parallel-size > 1``) with these packs, sets
    ``variable_seq_lengths`` (Megatron's ``validate_args`` sets it False; a pack's T changes from
    microbatch to microbatch, so stages must exchange shapes) and, for models without experts,
    ``moe_token_dispatcher_type = "alltoall"`` (unused there, but Megatron's config refuses
    ``variable_seq_lengths`` with the default ``allgather``)."""
    errs = tree_packing_errors(args)
    if errs:
        raise TreePackingArgumentError("invalid arguments for tree packing:\n  - " + "\n  - ".join(errs))
    packs = getattr(args, "tree_packing", False) or getattr(args, "tree_trajectories", None)
    if getattr(args, "apply_rope_fusion", False) and packs:
        args.apply_rope_fusion = False
        logger.warning("tree packs: RoPE fusion turned off (TE's fused THD RoPE is not validated with "
                       "per-token tree positions); pass --no-rope-fusion to silence this")
    if (getattr(args, "attention_dropout", 0.0) or 0.0) > 0 and packs:
        logger.warning("tree packs: attention dropout %s turned off (Megatron's default is 0.1; tree attention "
                       "has no dropout); pass --attention-dropout 0.0 to silence this", args.attention_dropout)
        args.attention_dropout = 0.0
    if (getattr(args, "hidden_dropout", 0.0) or 0.0) > 0 and getattr(args, "tree_packing", False):
        logger.warning("tree packing with --hidden-dropout %s: a shared-prefix token draws one dropout mask for "
                       "all its trajectories (trajectory-wise training draws one per trajectory), and RL "
                       "log-prob ratios are usually computed without dropout; consider --hidden-dropout 0.0",
                       args.hidden_dropout)
    if packs and (getattr(args, "pipeline_model_parallel_size", 1) or 1) > 1:
        if not getattr(args, "variable_seq_lengths", False):
            args.variable_seq_lengths = True
            logger.info("tree packs with pipeline parallelism: variable_seq_lengths on (packs differ in length)")
        if not getattr(args, "num_experts", None) and getattr(args, "moe_token_dispatcher_type", None) == "allgather":
            args.moe_token_dispatcher_type = "alltoall"    # unused without experts; allgather refuses variable lengths
    if getattr(args, "tree_packing", False):
        logger.info("tree packing: pattern %r, chunk size %d, planner %s", _pattern(args),
                    args.tree_chunk_size, args.tree_planner)
