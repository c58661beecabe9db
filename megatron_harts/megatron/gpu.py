"""Single-GPU Megatron setup and a ~1.5B hybrid preset, shared by ``verify`` and the benchmarks.

``init_single_gpu`` does what Megatron's ``initialize_megatron`` does for one process (NCCL
group, model-parallel groups, CUDA RNG tracker); ``build_gpu_hybrid_model`` builds a bf16
``HybridModel`` with the tree-aware local spec on the current GPU.
"""
from __future__ import annotations

import os

import torch

from .cpu_shim import tiny_hybrid_config
from .specs import tree_hybrid_stack_spec, tree_te_hybrid_stack_spec

# Qwen3-Next-like 3:1 GDN:attention, 1.48B parameters with vocab 32768 (``pattern`` x 6 = 48 layers).
HYBRID_1P5B = ("G-G-G-*-" * 6, dict(hidden_size=2048, ffn_hidden_size=6144, num_attention_heads=16, num_query_groups=4,
                                    kv_channels=128, linear_key_head_dim=128, linear_value_head_dim=128,
                                    linear_num_key_heads=16, linear_num_value_heads=16))


def init_single_gpu(seed: int) -> None:
    """NCCL process group of one rank, TP=PP=1 model-parallel groups, CUDA RNG tracker."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    torch.cuda.set_device(0)
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(29500 + os.getpid() % 1000))
    if not dist.is_initialized():
        dist.init_process_group("nccl", rank=0, world_size=1)
    if not ps.model_parallel_is_initialized():
        ps.initialize_model_parallel(tensor_model_parallel_size=1)
    model_parallel_cuda_manual_seed(seed)


def build_gpu_hybrid_model(pattern: str, vocab_size: int, max_sequence_length: int, spec: str = "local",
                           grouped_experts: bool = False, **overrides):
    """bf16 ``HybridModel`` (``spec``: ``local`` = ``tree_hybrid_stack_spec``, ``te`` =
    ``tree_te_hybrid_stack_spec``; RoPE, untied embeddings) on the current GPU; ``overrides`` are
    ``TransformerConfig`` fields; ``grouped_experts``: MoE experts on torch's grouped GEMM (local
    spec only, ``megatron_harts.moe.grouped``). Needs :func:`init_single_gpu` first."""
    if grouped_experts and spec == "te":
        raise ValueError("grouped_experts is for the local spec; the TE spec has TE's grouped experts already")
    from megatron.core.models.hybrid.hybrid_model import HybridModel

    cfg = tiny_hybrid_config(pattern, **{"init_method_std": 0.02, **overrides}, params_dtype=torch.bfloat16,
                             bf16=True, use_cpu_initialization=False)
    stack = tree_te_hybrid_stack_spec() if spec == "te" else tree_hybrid_stack_spec(
        cfg.num_moe_experts, grouped_experts=grouped_experts)
    model = HybridModel(config=cfg, hybrid_stack_spec=stack,
                        vocab_size=vocab_size, max_sequence_length=max_sequence_length, hybrid_layer_pattern=pattern,
                        position_embedding_type="rope", share_embeddings_and_output_weights=False)
    return model.cuda(torch.cuda.current_device())  # local-spec norms are created on the host (as in get_model)
