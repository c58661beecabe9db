"""Megatron-LM glue: ``forward_step``, ``loss_func`` and the data provider for
``megatron.training.pretrain`` (used by ``scripts/pretrain_hybrid_harts.py`` and by
``patches/pretrain_hybrid_tree_packing.patch``). Reads Megatron's global args; everything below
``megatron_harts.megatron.batch`` is argument-free and CPU-testable.
"""
from __future__ import annotations

import logging
import os
import random
from functools import partial

import torch
from megatron.core import mpu
from megatron.core.num_microbatches_calculator import get_num_microbatches
from megatron.training import get_args, get_timers, print_rank_0

from ..tree import TreeValidationError, read_jsonl
from .batch import TreeMicrobatchIterator, group_trajectories, model_inputs, rl_loss
from .specs import tree_hybrid_stack_spec, tree_te_hybrid_stack_spec

logger = logging.getLogger(__name__)


def use_prebuilt_dataset_helpers() -> bool:
    """Let ``initialize_megatron`` run from the megatron-core wheel: it builds
    ``megatron/core/datasets/helpers_cpp`` with ``make`` on rank 0 and exits when that fails, but the
    wheel ships the compiled module without the Makefile. When the Makefile is absent and the
    prebuilt module imports, the build step is skipped (returns True); a source checkout is untouched."""
    from megatron.core.datasets import utils as dataset_utils
    if os.path.exists(os.path.join(os.path.dirname(dataset_utils.__file__), "Makefile")):
        return False
    try:
        from megatron.core.datasets import helpers_cpp  # noqa: F401
    except ImportError:
        return False

    def compile_helpers():
        logger.info("megatron-core wheel: using the prebuilt dataset helpers (no Makefile to build them)")

    dataset_utils.compile_helpers = compile_helpers
    return True


def configure_model(args, model_cfg):
    """Point a ``HybridModelConfig`` at the tree spec of ``--tree-spec`` (local or TE layers) with the
    core attention of ``--tree-attention-backend``; returns it."""
    backend = getattr(args, "tree_attention_backend", "auto")
    if getattr(args, "tree_spec", "local") == "te":
        model_cfg.hybrid_stack_spec = tree_te_hybrid_stack_spec(backend)
    else:
        model_cfg.hybrid_stack_spec = tree_hybrid_stack_spec(args.num_experts, args.qk_layernorm, backend)
    return model_cfg


def rl_loss_kwargs(args) -> dict:
    """``policy_loss`` keyword arguments from the ``--rl-*`` flags."""
    return dict(loss_type=args.rl_loss_type, loss_agg_mode=args.rl_loss_agg_mode, clip_eps=args.rl_clip_eps,
                clip_eps_high=args.rl_clip_eps_high, dual_clip_c=args.rl_dual_clip_c, kl_coef=args.rl_kl_coef,
                kl_estimator=args.rl_kl_estimator)


def loss_func(mb, output_tensor: torch.Tensor):
    """logits ``[1, T, V/tp]`` -> ``(loss, num_tokens, report)`` (see ``megatron_harts.megatron.batch``)."""
    tp_group = mpu.get_tensor_model_parallel_group() if mpu.get_tensor_model_parallel_world_size() > 1 else None
    return rl_loss(output_tensor, mb, tp_group=tp_group, **rl_loss_kwargs(get_args()))


def forward_step(data_iterator, model):
    """One microbatch: the next ``TreeMicrobatch`` -> ``model(tokens [1, T], position_ids [1, T],
    None, packed_seq_params=TreePackedSeqParams)`` -> logits ``[1, T, V/tp]`` (hidden states on
    non-last pipeline stages)."""
    timers = get_timers()
    timers("batch-generator", log_level=2).start()
    mb = next(data_iterator).to(torch.cuda.current_device())
    tokens, position_ids, packed_seq_params = model_inputs(mb)
    timers("batch-generator").stop()
    output = model(tokens, position_ids, None, packed_seq_params=packed_seq_params)
    return output, partial(loss_func, mb)


def train_valid_test_datasets_provider(train_val_test_num_samples, vp_stage=None):
    """Returns ``(train iterator, None, None)``; ``--dataloader-type external`` passes it through.
    Every rank reads the JSONL and plans the same steps, so TP/PP ranks need no broadcast."""
    args = get_args()
    try:
        groups = group_trajectories(read_jsonl(args.tree_trajectories, vocab_size=args.padded_vocab_size))
    except (OSError, TreeValidationError) as e:     # every rank reads the file: each exits with one line
        raise SystemExit(f"--tree-trajectories: {e}") from None
    if args.tree_shuffle_seed is not None:
        random.Random(args.tree_shuffle_seed).shuffle(groups)
    dp = mpu.get_data_parallel_world_size()
    per_step = args.tree_groups_per_step or args.global_batch_size
    try:
        it = TreeMicrobatchIterator(
            groups, groups_per_step=per_step, dp_size=dp,
            dp_rank=mpu.get_data_parallel_rank(), num_microbatches=get_num_microbatches(),
            tree_packing=args.tree_packing, chunk_size=args.tree_chunk_size, planner=args.tree_planner,
            max_tokens=args.tree_max_tokens, log=torch.distributed.get_rank() == 0)
    except ValueError as e:            # too few groups in the file for a step: every rank exits with one line
        flag = "--tree-groups-per-step" if args.tree_groups_per_step else "--global-batch-size (groups per step)"
        raise SystemExit(f"{flag} {per_step}: {e} ({args.tree_trajectories})") from None
    print_rank_0(f"> megatron_harts: {sum(len(g) for g in groups)} trajectories in {len(groups)} groups, "
                 f"tree packing {'on' if args.tree_packing else 'off (trajectory-wise baseline)'}")
    return it, None, None


train_valid_test_datasets_provider.is_distributed = True
