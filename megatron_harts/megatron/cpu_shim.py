"""Run Megatron-Core 0.19.x models on CPU (tests, demo, CI without a GPU).

Importing this module imports megatron.core but changes nothing; call
:func:`enable_cpu_megatron` (or use :func:`cpu_megatron`). Typical use::

    from megatron_harts.megatron import cpu_shim

    with cpu_shim.cpu_megatron(tensor_model_parallel_size=1, seed=1234):
        model = cpu_shim.build_tiny_hybrid_model("*-*-")
        logits = model(input_ids, position_ids, attention_mask=None)  # [b, s, vocab/tp]

What the shim changes (all undone by :func:`disable_cpu_megatron`):

* ``torch.cuda.current_device`` -> ``torch.device("cpu")``. Megatron allocates every
  parameter and buffer with ``device=torch.cuda.current_device()``.
* ``torch.cuda.current_stream`` -> a :class:`CPUStream` (every wait / record / synchronize a
  no-op: CPU work is already done when the call returns). Megatron's DDP gradient sync
  (``_ParamAndGradBucketGroup.start_grad_sync``, reached from ``finish_grad_sync`` /
  ``finalize_model_grads``) asks for the current stream before its collective.
* ``megatron.core.tensor_parallel.random``: the "CUDA" RNG state helpers read/write the
  CPU default generator, and the RNG tracker is a :class:`CPURNGStatesTracker`, so
  ``get_cuda_rng_tracker().fork()`` (weight init, dropout) and activation recomputation
  (``tensor_parallel.checkpoint``) work and stay reproducible.
* ``megatron.core.fusions.fused_softmax.get_default_causal_mask``: the stock one builds
  its mask with ``device="cuda"``; it is used by the local ``DotProductAttention`` when
  ``attention_mask is None``.

TE-only modules are avoided through the spec, not by patching: :func:`local_hybrid_stack_spec`
uses Megatron's local modules, :class:`TorchNorm` (a torch norm that, unlike Megatron's
``WrappedTorchNorm``, supports sequence parallelism) and :class:`LocalHybridStack` (``HybridStack``
whose ``final_norm`` is a torch norm instead of ``TENorm``).

Limits in megatron-core 0.19.2 on CPU (checked, see ``docs/megatron_internals.md``):

* ``M`` (``MambaMixer``) needs ``mamba_ssm`` to be built at all (ImportError otherwise)
  and its kernels are Triton/CUDA.
* ``G`` (``GatedDeltaNet``) builds, but its forward calls fla's Triton kernels
  (``causal_conv1d``, ``l2norm``, ``chunk_gated_delta_rule``), which need a GPU.
* The local ``DotProductAttention`` rejects ``packed_seq_params`` (THD).
"""

from __future__ import annotations

import contextlib
import logging
import os
from functools import partial
from typing import Callable, Iterator, Optional

import torch
import torch.distributed as dist
import torch.nn.functional as F
from megatron.core.models.hybrid.hybrid_block import HybridStack
from megatron.core.tensor_parallel import random as mrandom
from megatron.core.transformer.torch_norm import L2Norm

logger = logging.getLogger(__name__)

_ENABLED = False
_PATCHES: list[tuple[object, str, object]] = []  # (owner, attribute, original value)
_OWNS_PROCESS_GROUP = False


# ----------------------------------------------------------------------------------------
# RNG
# ----------------------------------------------------------------------------------------


def _cpu_current_device() -> torch.device:
    """Stand-in for ``torch.cuda.current_device``: Megatron allocates on this device."""
    return torch.device("cpu")


class CPUStream:
    """Stand-in for the ``torch.cuda.Stream`` / ``Event`` that ``torch.cuda.current_stream()``
    returns: on CPU every operation has completed when it returns, so waits, records and
    synchronisation are no-ops and queries are true."""

    def wait_event(self, event=None) -> None:
        pass

    def wait_stream(self, stream=None) -> None:
        pass

    def record_event(self, event=None) -> "CPUStream":
        return self

    def record(self, stream=None) -> None:
        pass

    def wait(self, stream=None) -> None:
        pass

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        pass


_CPU_STREAM = CPUStream()


def _cpu_current_stream(device=None) -> CPUStream:
    """Stand-in for ``torch.cuda.current_stream``."""
    return _CPU_STREAM


def _cpu_get_rng_state(device=None, clone: bool = False, graph_safe: bool = False) -> torch.Tensor:
    """Stand-in for ``tensor_parallel.random._get_cuda_rng_state``: CPU generator state."""
    return torch.get_rng_state()


def _cpu_set_rng_state(new_state: torch.Tensor, device=-1, graph_safe: bool = False) -> None:
    """Stand-in for ``tensor_parallel.random._set_cuda_rng_state``."""
    torch.set_rng_state(new_state)


class CPURNGStatesTracker(mrandom.CudaRNGStatesTracker):
    """``CudaRNGStatesTracker`` whose named states live in the CPU default generator.

    ``add(name, seed)`` stores the state of a generator seeded with ``seed``; ``fork(name)``
    swaps that state into the CPU generator for the block and swaps the previous state back
    afterwards (the stock tracker does the same with the CUDA generator, and warns when the
    CPU state changes, which is expected here).
    """

    def add(self, name: str, seed: int) -> None:
        self._is_initialized = True
        if seed in self.seeds_:
            raise Exception(f"seed {seed} already exists")
        if name in self.states_:
            raise Exception(f"rng state {name} already exists")
        self.seeds_.add(seed)
        self.states_[name] = torch.Generator().manual_seed(seed).get_state()

    @contextlib.contextmanager
    def fork(self, name: str = mrandom._MODEL_PARALLEL_RNG_TRACKER_NAME):
        if name not in self.states_:
            raise Exception(f"rng state {name} is not added")
        outer = torch.get_rng_state()
        torch.set_rng_state(self.states_[name])
        try:
            yield
        finally:
            self.states_[name] = torch.get_rng_state()
            torch.set_rng_state(outer)


def cpu_manual_seed(seed: int) -> None:
    """CPU twin of ``tensor_parallel.model_parallel_cuda_manual_seed`` (same seed offsets).

    Seeds the CPU generator with ``seed`` and registers the tracker states
    ``data-parallel-rng`` (seed), ``model-parallel-rng`` (seed + 2718 + tp_rank) and
    ``expert-parallel-rng`` (seed + 1024 + 100 * ep_rank + etp_rank).
    Call after :func:`init_cpu_model_parallel`.
    """
    from megatron.core import parallel_state as ps

    enable_cpu_megatron()
    tracker = mrandom.get_cuda_rng_tracker()
    tracker.reset()
    torch.manual_seed(seed)
    tracker.add(mrandom._DATA_PARALLEL_RNG_TRACKER_NAME, seed)
    tracker.add(
        mrandom._MODEL_PARALLEL_RNG_TRACKER_NAME,
        seed + 2718 + ps.get_tensor_model_parallel_rank(),
    )
    tracker.add(
        mrandom._EXPERT_PARALLEL_RNG_TRACKER_NAME,
        seed
        + 1024
        + 100 * ps.get_expert_model_parallel_rank()
        + ps.get_expert_tensor_parallel_rank(),
    )


# ----------------------------------------------------------------------------------------
# Enable / disable
# ----------------------------------------------------------------------------------------


def _patch(owner: object, name: str, value: object) -> None:
    _PATCHES.append((owner, name, getattr(owner, name)))
    setattr(owner, name, value)


def _cpu_default_causal_mask(sq: int) -> torch.Tensor:
    """[sq, sq] bool, True above the diagonal (= masked), on CPU."""
    return torch.triu(torch.ones(sq, sq, dtype=torch.bool), diagonal=1)


def enable_cpu_megatron() -> None:
    """Redirect Megatron-Core's CUDA-only hooks to CPU. Idempotent; undo with
    :func:`disable_cpu_megatron`. Does not touch ``torch.distributed``."""
    global _ENABLED
    if _ENABLED:
        return
    from megatron.core.fusions import fused_softmax

    if torch.cuda.is_available():
        logger.warning("cpu_shim: CUDA is available but Megatron is being redirected to CPU")
    _patch(torch.cuda, "current_device", _cpu_current_device)
    _patch(torch.cuda, "current_stream", _cpu_current_stream)
    _patch(mrandom, "_get_cuda_rng_state", _cpu_get_rng_state)
    _patch(mrandom, "_set_cuda_rng_state", _cpu_set_rng_state)
    _patch(mrandom, "_CUDA_RNG_STATE_TRACKER", CPURNGStatesTracker())
    _patch(mrandom, "_CUDA_RNG_STATE_TRACKER_INITIALIZED", True)
    _patch(fused_softmax, "get_default_causal_mask", _cpu_default_causal_mask)
    _ENABLED = True
    logger.info("cpu_shim: Megatron-Core redirected to CPU")


def disable_cpu_megatron() -> None:
    """Restore everything :func:`enable_cpu_megatron` patched. Idempotent."""
    global _ENABLED
    while _PATCHES:
        owner, name, original = _PATCHES.pop()
        setattr(owner, name, original)
    _ENABLED = False


def is_enabled() -> bool:
    """Whether the CPU redirections are active."""
    return _ENABLED


# ----------------------------------------------------------------------------------------
# Process groups
# ----------------------------------------------------------------------------------------


def init_cpu_model_parallel(
    tensor_model_parallel_size: int = 1,
    expert_model_parallel_size: int = 1,
    seed: int = 1234,
    pipeline_model_parallel_size: int = 1,
    virtual_pipeline_model_parallel_size: Optional[int] = None,
):
    """Enable the shim, start a gloo process group and Megatron's model-parallel groups.

    Single process: a 1-rank gloo group on an in-memory store. Under ``torchrun``
    (``RANK``/``WORLD_SIZE`` set): ``env://`` gloo, so ``--nproc-per-node 2`` gives TP=2
    (``tensor_model_parallel_size=2``), PP=2 (``pipeline_model_parallel_size=2``, optionally
    interleaved with ``virtual_pipeline_model_parallel_size``) or DP=2 (all sizes 1). CP stays 1.
    Re-initializes Megatron's groups only when the sizes change.

    Returns:
        ProcessGroupCollection of Megatron's groups (``tp``, ``pp``, ``cp``, ``dp``, ...).
    """
    global _OWNS_PROCESS_GROUP
    from megatron.core import parallel_state as ps
    from megatron.core.process_groups_config import ProcessGroupCollection

    enable_cpu_megatron()
    if not dist.is_initialized():
        if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
            dist.init_process_group(backend="gloo")
        else:
            dist.init_process_group(backend="gloo", store=dist.HashStore(), rank=0, world_size=1)
        _OWNS_PROCESS_GROUP = True
    if ps.model_parallel_is_initialized() and (
        ps.get_tensor_model_parallel_world_size() != tensor_model_parallel_size
        or ps.get_expert_model_parallel_world_size() != expert_model_parallel_size
        or ps.get_pipeline_model_parallel_world_size() != pipeline_model_parallel_size
        or ps.get_virtual_pipeline_model_parallel_world_size() != virtual_pipeline_model_parallel_size
    ):
        ps.destroy_model_parallel()
    if not ps.model_parallel_is_initialized():
        ps.initialize_model_parallel(
            tensor_model_parallel_size=tensor_model_parallel_size,
            expert_model_parallel_size=expert_model_parallel_size,
            pipeline_model_parallel_size=pipeline_model_parallel_size,
            virtual_pipeline_model_parallel_size=virtual_pipeline_model_parallel_size,
        )
    cpu_manual_seed(seed)
    logger.info(
        "cpu_shim: rank %d/%d, tp=%d pp=%d dp=%d ep=%d",
        dist.get_rank(),
        dist.get_world_size(),
        ps.get_tensor_model_parallel_world_size(),
        ps.get_pipeline_model_parallel_world_size(),
        ps.get_data_parallel_world_size(),
        ps.get_expert_model_parallel_world_size(),
    )
    return ProcessGroupCollection.use_mpu_process_groups()


def destroy_cpu_model_parallel() -> None:
    """Tear down Megatron's groups, the process group if the shim created it, and the patches."""
    global _OWNS_PROCESS_GROUP
    from megatron.core import parallel_state as ps

    ps.destroy_model_parallel()
    if _OWNS_PROCESS_GROUP and dist.is_initialized():
        dist.destroy_process_group()
    _OWNS_PROCESS_GROUP = False
    disable_cpu_megatron()


@contextlib.contextmanager
def cpu_megatron(
    tensor_model_parallel_size: int = 1,
    expert_model_parallel_size: int = 1,
    seed: int = 1234,
    pipeline_model_parallel_size: int = 1,
    virtual_pipeline_model_parallel_size: Optional[int] = None,
) -> Iterator[object]:
    """Context manager around :func:`init_cpu_model_parallel` /
    :func:`destroy_cpu_model_parallel`; yields the ProcessGroupCollection."""
    pgs = init_cpu_model_parallel(tensor_model_parallel_size, expert_model_parallel_size, seed,
                                  pipeline_model_parallel_size, virtual_pipeline_model_parallel_size)
    try:
        yield pgs
    finally:
        destroy_cpu_model_parallel()


# ----------------------------------------------------------------------------------------
# Local (non-TE) hybrid spec
# ----------------------------------------------------------------------------------------


class TorchNorm:
    """LayerNormBuilder: ``torch.nn.LayerNorm`` / ``RMSNorm`` (Megatron's ``L2Norm``) by
    ``config.normalization``, like Megatron's ``WrappedTorchNorm`` but with sequence parallelism.

    ``WrappedTorchNorm`` asserts ``not config.sequence_parallel``. A norm needs nothing from SP in
    its forward (it is per token); what SP needs is that the weights' gradients, partial per TP
    rank because each rank holds a ``[T / tp]`` slice of the tokens, are summed over the TP group.
    As Megatron's fused and TE norms do, the parameters get ``sequence_parallel = True``, which
    ``finalize_model_grads`` (``_allreduce_non_tensor_model_parallel_grads``) all-reduces over TP.
    """

    def __new__(cls, config, hidden_size: int, eps: float = 1e-5, persist_layer_norm: bool = False,
                zero_centered_gamma: bool = False, normalization: str = "LayerNorm"):
        if config.layernorm_zero_centered_gamma or config.persist_layer_norm or config.memory_efficient_layer_norm:
            raise ValueError("TorchNorm: zero_centered_gamma / persist_layer_norm / memory_efficient_layer_norm "
                             "are not supported by torch norms")
        if config.normalization == "LayerNorm":
            norm = torch.nn.LayerNorm(hidden_size, eps=eps)
        elif config.normalization == "RMSNorm":
            norm = torch.nn.RMSNorm(hidden_size, eps=eps)
        elif config.normalization == "L2Norm":
            norm = L2Norm(hidden_size, eps=eps)
        else:
            raise ValueError(f"TorchNorm: unknown normalization {config.normalization!r}")
        if config.sequence_parallel:
            for p in norm.parameters():
                p.sequence_parallel = True
        return norm


class LocalHybridStack(HybridStack):
    """``HybridStack`` with ``final_norm`` built from a spec param instead of ``TENorm``.

    ``final_norm`` (spec ``params``): a LayerNormBuilder, default :class:`TorchNorm`
    (``torch.nn.LayerNorm``/``RMSNorm`` by ``config.normalization``). Parameter names
    (``final_norm.weight``) and module order match ``HybridStack``.
    """

    def __init__(
        self,
        config,
        submodules,
        *args,
        post_layer_norm: bool = True,
        final_norm: Callable = TorchNorm,
        **kwargs,
    ):
        super().__init__(config, submodules, *args, post_layer_norm=False, **kwargs)
        self.post_layer_norm = post_layer_norm
        if self.post_process and self.post_layer_norm:
            self.final_norm = final_norm(
                config=self.config,
                hidden_size=self.config.hidden_size,
                eps=self.config.layernorm_epsilon,
            )


def local_hybrid_stack_spec(num_moe_experts: Optional[int] = None, qk_layernorm: bool = False):
    """ModuleSpec for ``HybridModel(hybrid_stack_spec=...)`` using only Megatron-Core modules.

    Same layer structure as ``hybrid_layer_specs.hybrid_stack_spec`` with every fused TE
    ``LayerNorm+Linear`` split into a torch norm (:class:`TorchNorm`, sequence parallelism
    supported) + ``ColumnParallelLinear``:
    ``*`` TransformerLayer(input_layernorm, SelfAttention(linear_qkv, DotProductAttention,
    linear_proj)); ``G`` TransformerLayer(input_layernorm, GatedDeltaNet(in_proj, out_norm,
    out_proj)); ``M`` MambaLayer(norm, MambaMixer(in_proj, out_proj)); ``-`` MLPLayer
    (pre_mlp_layernorm, MLP); ``E`` MoETransformerLayer(pre_mlp_layernorm, MoELayer with
    SequentialMLP experts) when ``num_moe_experts`` is given. ``qk_layernorm`` must match
    ``config.qk_layernorm`` (torch q/k norms; ``None`` otherwise, since ``SelfAttention`` would
    fall back to ``TENorm``, and an ``IdentityOp`` would silently skip the norm).
    ``sharded_state_dict_keys_map``
    maps the norms onto the TE checkpoint names. ``D``/``+`` (MLA/DSA) are not provided.
    """
    from megatron.core.fusions.fused_bias_dropout import get_bias_dropout_add
    from megatron.core.models.backends import LocalSpecProvider
    from megatron.core.models.gpt.moe_module_specs import get_moe_module_spec_for_backend
    from megatron.core.models.hybrid.hybrid_block import HybridStackSubmodules
    from megatron.core.ssm.gated_delta_net import GatedDeltaNet, GatedDeltaNetSubmodules
    from megatron.core.ssm.mamba_layer import MambaLayer, MambaLayerSubmodules
    from megatron.core.ssm.mamba_mixer import MambaMixer, MambaMixerSubmodules
    from megatron.core.ssm.mlp_layer import MLPLayer
    from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
    from megatron.core.transformer.attention import SelfAttention, SelfAttentionSubmodules
    from megatron.core.transformer.dot_product_attention import DotProductAttention
    from megatron.core.transformer.enums import AttnMaskType
    from megatron.core.transformer.identity_op import IdentityOp
    from megatron.core.transformer.mlp import MLP, MLPSubmodules
    from megatron.core.transformer.spec_utils import ModuleSpec
    from megatron.core.transformer.transformer_layer import (
        MoETransformerLayer,
        TransformerLayer,
        TransformerLayerSubmodules,
    )

    norm = TorchNorm
    moe_layer = IdentityOp
    if num_moe_experts is not None:
        moe_layer = ModuleSpec(
            module=MoETransformerLayer,
            submodules=TransformerLayerSubmodules(
                pre_mlp_layernorm=norm,
                mlp=get_moe_module_spec_for_backend(
                    LocalSpecProvider(), num_experts=num_moe_experts, moe_grouped_gemm=False
                ),
                mlp_bda=get_bias_dropout_add,
            ),
        )
    return ModuleSpec(
        module=LocalHybridStack,
        params={"final_norm": norm},
        submodules=HybridStackSubmodules(
            mamba_layer=ModuleSpec(
                module=MambaLayer,
                submodules=MambaLayerSubmodules(
                    norm=norm,
                    mixer=ModuleSpec(
                        module=MambaMixer,
                        submodules=MambaMixerSubmodules(
                            in_proj=ColumnParallelLinear, out_proj=RowParallelLinear
                        ),
                    ),
                    mamba_bda=get_bias_dropout_add,
                    sharded_state_dict_keys_map={"norm.": "mixer.in_proj.layer_norm_"},
                ),
            ),
            gdn_layer=ModuleSpec(
                module=TransformerLayer,
                submodules=TransformerLayerSubmodules(
                    input_layernorm=norm,
                    self_attention=ModuleSpec(
                        module=GatedDeltaNet,
                        submodules=GatedDeltaNetSubmodules(
                            in_proj=ColumnParallelLinear, out_norm=norm, out_proj=RowParallelLinear
                        ),
                    ),
                    self_attn_bda=get_bias_dropout_add,
                    sharded_state_dict_keys_map={
                        "input_layernorm.": "self_attention.in_proj.layer_norm_"
                    },
                ),
            ),
            attention_layer=ModuleSpec(
                module=TransformerLayer,
                submodules=TransformerLayerSubmodules(
                    input_layernorm=norm,
                    self_attention=ModuleSpec(
                        module=SelfAttention,
                        params={"attn_mask_type": AttnMaskType.causal},
                        submodules=SelfAttentionSubmodules(
                            linear_qkv=ColumnParallelLinear,
                            core_attention=DotProductAttention,
                            linear_proj=RowParallelLinear,
                            q_layernorm=norm if qk_layernorm else None,
                            k_layernorm=norm if qk_layernorm else None,
                        ),
                    ),
                    self_attn_bda=get_bias_dropout_add,
                    sharded_state_dict_keys_map={
                        "input_layernorm.": "self_attention.linear_qkv.layer_norm_"
                    },
                ),
            ),
            mlp_layer=ModuleSpec(
                module=MLPLayer,
                submodules=TransformerLayerSubmodules(
                    pre_mlp_layernorm=norm,
                    mlp=partial(
                        MLP.as_mlp_submodule,
                        submodules=MLPSubmodules(
                            linear_fc1=ColumnParallelLinear, linear_fc2=RowParallelLinear
                        ),
                    ),
                    mlp_bda=get_bias_dropout_add,
                    sharded_state_dict_keys_map={
                        "pre_mlp_layernorm.": "mlp.linear_fc1.layer_norm_"
                    },
                ),
            ),
            moe_layer=moe_layer,
        ),
    )


# ----------------------------------------------------------------------------------------
# Tiny models
# ----------------------------------------------------------------------------------------


#: Config fields that keep Megatron on its plain torch paths (no fused CUDA kernels), fp32 and
#: TP-independent initialisation: what a CPU run (and a layout-independent check) needs.
UNFUSED_FP32 = dict(bias_activation_fusion=False, bias_dropout_fusion=False, masked_softmax_fusion=False,
                    apply_rope_fusion=False, persist_layer_norm=False, gradient_accumulation_fusion=False,
                    cross_entropy_loss_fusion=False, params_dtype=torch.float32, use_cpu_initialization=True)


def tiny_hybrid_config(pattern: str, hidden_size: int = 64, **overrides):
    """fp32 ``TransformerConfig`` for a tiny hybrid model with ``len(pattern)`` layers (``|``,
    Megatron's pipeline-stage separator, is not a layer).

    Sizes (hidden 64): attention 4 heads x 16 (2 query groups), MLP ffn 128 (SwiGLU),
    GDN 2 key heads x 16 / 4 value heads x 16 / conv width 4, Mamba 8 heads x 16 / state 16
    / 2 groups, MoE (if ``num_moe_experts`` in overrides) top-2 with ffn 64.
    ``activation_func=F.silu`` (GDN asserts silu/swish), RMSNorm, no biases, no dropout,
    no fusions, ``use_cpu_initialization=True`` (TP-independent linear weights).
    ``overrides`` replace any field.
    """
    from megatron.core.transformer import TransformerConfig

    cfg = dict(
        num_layers=len(pattern.replace("|", "")),
        hidden_size=hidden_size,
        ffn_hidden_size=2 * hidden_size,
        num_attention_heads=4,
        num_query_groups=2,
        kv_channels=hidden_size // 4,
        normalization="RMSNorm",
        layernorm_epsilon=1e-5,
        activation_func=F.silu,
        gated_linear_unit=True,
        add_bias_linear=False,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        **UNFUSED_FP32,
        linear_conv_kernel_dim=4,
        linear_key_head_dim=16,
        linear_value_head_dim=16,
        linear_num_key_heads=2,
        linear_num_value_heads=4,
        mamba_state_dim=16,
        mamba_head_dim=16,
        mamba_num_groups=2,
    )
    if overrides.get("num_moe_experts"):
        cfg.update(
            moe_router_topk=2,
            moe_ffn_hidden_size=hidden_size,
            moe_token_dispatcher_type="allgather",
            moe_grouped_gemm=False,
        )
    cfg.update(overrides)
    from megatron.core import parallel_state as ps

    if ps.model_parallel_is_initialized():
        cfg.setdefault("tensor_model_parallel_size", ps.get_tensor_model_parallel_world_size())
        cfg.setdefault("expert_model_parallel_size", ps.get_expert_model_parallel_world_size())
        if ps.get_pipeline_model_parallel_world_size() > 1:
            cfg.setdefault("pipeline_model_parallel_size", ps.get_pipeline_model_parallel_world_size())
            cfg.setdefault("virtual_pipeline_model_parallel_size",
                           ps.get_virtual_pipeline_model_parallel_world_size())
            cfg.setdefault("pipeline_dtype", cfg["params_dtype"])
    return TransformerConfig(**cfg)


def build_tiny_hybrid_model(
    pattern: str,
    vocab_size: int = 128,
    max_sequence_length: int = 512,
    hidden_size: int = 64,
    position_embedding_type: str = "rope",
    hybrid_stack_spec=None,
    pre_process: bool = True,
    post_process: bool = True,
    vp_stage: Optional[int] = None,
    **config_overrides,
):
    """Build a tiny fp32 ``HybridModel`` on CPU from a layer pattern (e.g. ``"G-*-M-"``).

    Requires :func:`init_cpu_model_parallel` (or :func:`cpu_megatron`) first. Uses
    :func:`local_hybrid_stack_spec` (or ``hybrid_stack_spec`` when given) and
    :func:`tiny_hybrid_config`; untied embeddings. Under pipeline parallelism pass this stage's
    ``pre_process`` / ``post_process`` (and ``vp_stage`` for the interleaved schedule); the pattern
    then needs ``|`` stage separators or an even split.
    ``model(input_ids [b, s], position_ids [b, s], attention_mask)`` returns logits
    ``[b, s, vocab_size / tp]`` (``labels`` given: per-token loss ``[b, s]``).
    """
    from megatron.core.models.hybrid.hybrid_model import HybridModel

    enable_cpu_megatron()
    config = tiny_hybrid_config(pattern, hidden_size=hidden_size, **config_overrides)
    model = HybridModel(
        config=config,
        hybrid_stack_spec=hybrid_stack_spec
        or local_hybrid_stack_spec(config.num_moe_experts, config.qk_layernorm),
        vocab_size=vocab_size,
        max_sequence_length=max_sequence_length,
        hybrid_layer_pattern=pattern,
        position_embedding_type=position_embedding_type,
        share_embeddings_and_output_weights=False,
        pre_process=pre_process,
        post_process=post_process,
        vp_stage=vp_stage,
    )
    n_params = sum(p.numel() for p in model.parameters())
    logger.info("cpu_shim: built HybridModel %r, %d params", pattern, n_params)
    return model


__all__ = [
    "CPURNGStatesTracker",
    "CPUStream",
    "LocalHybridStack",
    "TorchNorm",
    "enable_cpu_megatron",
    "disable_cpu_megatron",
    "is_enabled",
    "cpu_manual_seed",
    "init_cpu_model_parallel",
    "destroy_cpu_model_parallel",
    "cpu_megatron",
    "local_hybrid_stack_spec",
    "tiny_hybrid_config",
    "build_tiny_hybrid_model",
]
