#!/usr/bin/env python
"""RL training of a hybrid (GDN / attention / MLP / MoE) model on rollout trees with Megatron-LM's
``megatron.training.pretrain`` (megatron-core 0.19.x wheel).

Launch with ``scripts/launch_torchrun.sh`` or ``scripts/launch_slurm.sbatch``; all Megatron flags
apply, plus those of ``megatron_harts.megatron.arguments`` (``--tree-packing``,
``--tree-trajectories``, ``--rl-*``). Each optimizer step takes ``--tree-groups-per-step`` groups
(trees) of the JSONL, packs them into ``--global-batch-size`` tree packs (one per microbatch,
``--micro-batch-size 1``) spread over DP ranks, and minimises the clipped policy loss on the
restored per-trajectory log-probs, normalised over the whole step. Without ``--tree-packing`` the
same code trains the trajectory-wise (THD) baseline. Logs: Megatron's iteration line with
``rl loss``, ``compression`` and RL metrics; ``megatron_harts`` info lines with trajectory tokens,
compression and trajectory tokens/s per step.

Needs CUDA (Megatron's ``initialize_megatron``); the pieces (``forward_step``, ``loss_func``,
the data iterator) are tested on CPU in ``tests/test_megatron_dist.py``, and the whole loop, tree
and THD from one seed, in ``tests/test_pretrain_cpu.py`` (CUDA calls faked, gloo, tiny model).
"""
from __future__ import annotations

import logging
import os
import sys


sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from megatron.core.enums import ModelType  # noqa: E402
from megatron.training import pretrain  # noqa: E402
from megatron.training.argument_utils import hybrid_config_from_args, pretrain_cfg_container_from_args  # noqa: E402
from megatron.training.arguments import parse_and_validate_args  # noqa: E402

from megatron_harts.megatron.arguments import add_tree_packing_args, validate_tree_packing_args_or_exit  # noqa: E402
from megatron_harts.megatron.training import (configure_model, forward_step,  # noqa: E402
                                              train_valid_test_datasets_provider, use_prebuilt_dataset_helpers)


def main():
    logging.basicConfig(level=logging.INFO, format="[%(asctime)s] %(name)s: %(message)s")
    args = parse_and_validate_args(extra_args_provider=add_tree_packing_args,
                                   args_defaults={"tokenizer_type": "NullTokenizer", "dataloader_type": "external"})
    validate_tree_packing_args_or_exit(args)
    if args.tree_trajectories is None:
        raise SystemExit("--tree-trajectories PATH (trajectory JSONL) is required")
    if not os.path.isfile(args.tree_trajectories):
        raise SystemExit(f"--tree-trajectories {args.tree_trajectories}: no such file")
    if args.micro_batch_size != 1:
        raise SystemExit("--micro-batch-size must be 1 (one [1, T] pack per microbatch)")
    if args.dataloader_type != "external":
        raise SystemExit("--dataloader-type must be 'external' (the tree iterator is passed through)")
    use_prebuilt_dataset_helpers()
    model_cfg = configure_model(args, hybrid_config_from_args(args))
    pretrain(pretrain_cfg_container_from_args(args, model_cfg), train_valid_test_datasets_provider,
             ModelType.encoder_or_decoder, forward_step)


if __name__ == "__main__":
    main()
