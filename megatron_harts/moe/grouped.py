"""Grouped-GEMM MoE experts without Transformer Engine: torch's grouped matrix multiply inside
Megatron's ``TEGroupedMLP``.

Megatron-Core's local spec runs MoE experts as ``SequentialMLP``: per expert, a slice, two
matmuls and the activation, in a Python loop (16 experts x 2 GEMMs x forward / backward per layer),
which leaves small MoE models host-bound. Its grouped experts, ``TEGroupedMLP``, take their two
linear layers as builders (``GroupedMLPSubmodules(linear_fc1=..., linear_fc2=...)``: Megatron's
``GroupedLinearFc1/Fc2Builder`` protocol, ``forward(x, tokens_per_expert: list[int]) -> (y, bias)``);
TE's ``GroupedLinear`` is the usual one. :class:`TorchGroupedLinear` is that layer on
``torch._grouped_mm`` (CUTLASS grouped GEMM on Hopper in bf16; a CPU kernel too): one launch per
linear layer for all experts, forward and backward (dgrad and wgrad are grouped GEMMs as well).

* weights: one parameter ``weight`` ``[num_experts, out, in]`` (``F.linear`` layout per expert),
  initialised expert by expert with Megatron's ``init_method``; marked ``allreduce=False`` under
  expert parallelism like Megatron's expert linears (DDP reduces it over the expert data-parallel
  group);
* ``backend``: ``grouped`` (``torch._grouped_mm``), ``loop`` (one ``F.linear`` per expert: the
  reference, same signature, also the fallback where the grouped kernel does not apply: rows not
  16-byte aligned, fp32 on CUDA), ``auto`` (default: ``grouped`` where it applies);
* not supported (raised at construction): expert tensor parallelism > 1, biases; Megatron
  distributed checkpoints (``sharded_state_dict`` raises; ``state_dict()`` works).

:func:`use_grouped_experts` swaps the experts of a MoE layer spec (``treeify_moe``'s counterpart),
``tree_hybrid_stack_spec(..., grouped_experts=True)`` does it for the tree spec. Checkpoints of such
a model name the expert weights ``mlp.experts.linear_fc{1,2}.weight`` (``[E, out, in]``); the
Hugging Face conversion (``megatron.convert``) writes SequentialMLP's per-expert names, see
:func:`sequential_to_grouped` to move weights between the two.
"""
from __future__ import annotations

import contextlib
import dataclasses
from functools import partial

import torch
import torch.nn.functional as F

BACKENDS = ("auto", "grouped", "loop")


def _offsets(tokens_per_expert: list[int], device) -> torch.Tensor:
    """int32 ``[E]`` end offsets (cumulative counts), as ``torch._grouped_mm`` takes them: the
    device offsets the layer's dispatcher computed (``dispatch.device_offsets``), else copied from
    the host."""
    from .dispatch import device_offsets

    offs = device_offsets(tokens_per_expert, device)
    if offs is not None:
        return offs
    ends, acc = [], 0
    for n in tokens_per_expert:
        acc += int(n)
        ends.append(acc)
    return torch.tensor(ends, dtype=torch.int32).to(device, non_blocking=True)


def grouped_applies(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether ``torch._grouped_mm`` can run ``x [N, in]`` against ``weight [E, out, in]``: the
    op exists, both have one dtype among fp32 / bf16 / fp16 (bf16 on CUDA), rows are 16-byte
    aligned."""
    if not hasattr(torch, "_grouped_mm"):
        return False
    if x.dtype != weight.dtype or x.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        return False                                   # e.g. float64: the per-expert loop
    item = x.element_size()
    if (weight.shape[1] * item) % 16 or (weight.shape[2] * item) % 16:
        return False
    return x.device.type == "cpu" or x.dtype == torch.bfloat16


class _GroupedLinearFn(torch.autograd.Function):
    """``y_e = x_e @ W_e^T`` for the row blocks ``x_e`` of ``x`` given by ``offs``; dgrad
    ``dx_e = dy_e @ W_e`` and wgrad ``dW_e = dy_e^T @ x_e`` as grouped GEMMs too."""

    @staticmethod
    def forward(ctx, x, weight, offs):
        ctx.save_for_backward(x, weight, offs)
        return torch._grouped_mm(x, weight.transpose(1, 2), offs=offs)

    @staticmethod
    def backward(ctx, dy):
        x, weight, offs = ctx.saved_tensors
        dy = dy.contiguous()
        dx = torch._grouped_mm(dy, weight, offs=offs) if ctx.needs_input_grad[0] else None
        dw = torch._grouped_mm(dy.t(), x, offs=offs) if ctx.needs_input_grad[1] else None
        return dx, dw, None


def grouped_linear(x: torch.Tensor, weight: torch.Tensor, tokens_per_expert: list[int],
                   backend: str = "auto") -> torch.Tensor:
    """``x [N, in]`` (rows grouped by expert, ``tokens_per_expert`` rows each, in expert order),
    ``weight [E, out, in]`` -> ``[N, out]``. ``backend``: see the module docstring."""
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    if len(tokens_per_expert) != weight.shape[0] or sum(tokens_per_expert) != x.shape[0]:
        raise ValueError(f"tokens_per_expert {list(tokens_per_expert)} does not match x {tuple(x.shape)} and "
                         f"{weight.shape[0]} experts")
    if x.shape[0] == 0:
        return F.linear(x, weight[0])                 # [0, out], still in the graph of weight
    if backend == "grouped" or (backend == "auto" and grouped_applies(x, weight)):
        return _GroupedLinearFn.apply(x.contiguous(), weight, _offsets(tokens_per_expert, x.device))
    return torch.cat([F.linear(xe, weight[e]) for e, xe in enumerate(torch.split(x, list(tokens_per_expert)))])


class TorchGroupedLinear(torch.nn.Module):
    """``linear_fc1`` / ``linear_fc2`` of Megatron's ``TEGroupedMLP`` on torch's grouped GEMM (the
    ``GroupedLinearFc1Builder`` / ``Fc2Builder`` signature). ``weight``: ``[num_gemms, output_size,
    input_size]``. ``forward(x [N, input_size], tokens_per_expert) -> ([N, output_size], None)``."""

    def __init__(self, num_gemms: int, input_size: int, output_size: int, /, *, config, init_method, bias: bool,
                 skip_bias_add: bool, is_expert: bool, tp_comm_buffer_name: str | None = None, pg_collection=None,
                 name: str | None = None, backend: str = "auto"):
        super().__init__()
        if backend not in BACKENDS:
            raise ValueError(f"TorchGroupedLinear: backend must be one of {BACKENDS}, got {backend!r}")
        etp = config.expert_tensor_parallel_size or 1
        if pg_collection is not None and getattr(pg_collection, "expt_tp", None) is not None:
            etp = pg_collection.expt_tp.size()
        if etp != 1:
            raise NotImplementedError(f"TorchGroupedLinear ({name or tp_comm_buffer_name}): expert tensor parallelism "
                                      f"{etp} is not supported; set --expert-tensor-parallel-size 1 (expert "
                                      "parallelism works) or use SequentialMLP experts")
        if bias:
            raise NotImplementedError("TorchGroupedLinear: expert biases (--add-bias-linear) are not supported")
        self.num_gemms, self.in_features, self.out_features = num_gemms, input_size, output_size
        self.backend = backend
        device = "cpu" if config.use_cpu_initialization or not torch.cuda.is_available() else torch.cuda.current_device()
        w = torch.empty(num_gemms, output_size, input_size, dtype=config.params_dtype, device=device)
        if config.perform_initialization:
            from megatron.core.tensor_parallel.random import get_cuda_rng_tracker, get_expert_parallel_rng_tracker_name
            fork = (get_cuda_rng_tracker().fork(get_expert_parallel_rng_tracker_name())
                    if w.is_cuda else contextlib.nullcontext())      # CPU: the default generator, as Megatron
            with fork:
                for e in range(num_gemms):
                    init_method(w[e])
        self.weight = torch.nn.Parameter(w)
        from megatron.core.tensor_parallel.layers import set_tensor_model_parallel_attributes
        set_tensor_model_parallel_attributes(self.weight, is_parallel=True, dim=0, stride=1)  # as Megatron's expert linears
        expert_pgs = is_expert and ((config.expert_model_parallel_size or 1) > 1
                                    or (config.expert_tensor_parallel_size or 1) != config.tensor_model_parallel_size)
        setattr(self.weight, "allreduce", not expert_pgs)
        self._name = name or tp_comm_buffer_name or "expert linear"

    def forward(self, x: torch.Tensor, tokens_per_expert):
        """``tokens_per_expert``: a list of ints, or the dispatcher's ``dispatch.DeviceCounts``
        (counts still on the device: the grouped GEMM runs on its device offsets; where it does not
        apply, the counts are copied to the host once)."""
        from .dispatch import DeviceCounts

        if isinstance(tokens_per_expert, DeviceCounts):
            if len(tokens_per_expert) != self.weight.shape[0] or tokens_per_expert.total != x.shape[0]:
                raise ValueError(f"{len(tokens_per_expert)} experts / {tokens_per_expert.total} rows do not match "
                                 f"x {tuple(x.shape)} and {self.weight.shape[0]} experts")
            grouped = self.backend == "grouped" or (self.backend == "auto" and grouped_applies(x, self.weight))
            if x.shape[0] and grouped:
                return _GroupedLinearFn.apply(x.contiguous(), self.weight, tokens_per_expert.offsets), None
            tokens_per_expert = tokens_per_expert.host()
        return grouped_linear(x, self.weight, tokens_per_expert, self.backend), None

    def backward_dw(self) -> None:
        """Megatron's delayed-wgrad hook: the weight gradient is computed in backward here."""

    def sharded_state_dict(self, prefix: str = "", sharded_offsets: tuple = (), metadata=None):
        """Megatron distributed checkpoints (``dist_checkpointing``) of grouped experts are not
        supported yet: refused, so no checkpoint is written with the experts' global layout wrong
        (``TEGroupedMLP`` expects TE's per-expert ``weight{i}`` shards). ``state_dict()`` works."""
        raise NotImplementedError(f"TorchGroupedLinear ({self._name}): Megatron distributed checkpoints of "
                                  "grouped-GEMM experts are not supported; save with torch's state_dict(), or "
                                  "train with SequentialMLP experts (grouped_experts=False) when saving "
                                  "distributed checkpoints")


def grouped_experts_builder(backend: str = "auto"):
    """The experts builder of a ``MoESubmodules``: ``TEGroupedMLP`` with :class:`TorchGroupedLinear`."""
    from megatron.core.transformer.moe.experts import GroupedMLPSubmodules, TEGroupedMLP
    lin = TorchGroupedLinear if backend == "auto" else partial(TorchGroupedLinear, backend=backend)
    return partial(TEGroupedMLP, submodules=GroupedMLPSubmodules(linear_fc1=lin, linear_fc2=lin))


def use_grouped_experts(moe_layer_spec, backend: str = "auto"):
    """In place: the experts of the MoE ``mlp`` of ``moe_layer_spec`` (a ``partial(MoELayer,
    submodules=MoESubmodules(...))`` or a ``ModuleSpec``) -> :func:`grouped_experts_builder`.
    Returns the spec."""
    layer_subs = moe_layer_spec.submodules
    mlp = layer_subs.mlp
    experts = grouped_experts_builder(backend)
    if isinstance(mlp, partial):
        subs = dataclasses.replace(mlp.keywords["submodules"], experts=experts)
        layer_subs.mlp = partial(mlp.func, *mlp.args, **{**mlp.keywords, "submodules": subs})
    else:
        mlp.submodules = dataclasses.replace(mlp.submodules, experts=experts)
    return moe_layer_spec


def sequential_to_grouped(state_dict: dict) -> dict:
    """A state dict with ``SequentialMLP`` expert names (``...experts.local_experts.{e}.linear_fc{1,2}.weight``)
    -> the grouped names (``...experts.linear_fc{1,2}.weight``, ``[E, out, in]``); the per-expert
    linears' ``_extra_state`` entries are dropped, other keys unchanged."""
    import re
    out, groups = {}, {}
    pat = re.compile(r"^(.*experts)\.local_experts\.(\d+)\.(linear_fc[12])\.weight$")
    extra = re.compile(r"^.*experts\.local_experts\.\d+\.linear_fc[12]\._extra_state$")
    for k, v in state_dict.items():
        if extra.match(k):                  # the per-expert linears' (empty) TE extra state
            continue
        m = pat.match(k)
        if m is None:
            out[k] = v
        else:
            groups.setdefault((m.group(1), m.group(3)), {})[int(m.group(2))] = v
    for (prefix, fc), ws in groups.items():
        if sorted(ws) != list(range(len(ws))):
            raise ValueError(f"{prefix}.local_experts: experts {sorted(ws)} are not 0..{len(ws) - 1}")
        out[f"{prefix}.{fc}.weight"] = torch.stack([ws[e] for e in range(len(ws))])
    return out
