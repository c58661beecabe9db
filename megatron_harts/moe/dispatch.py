"""Token permutation of Megatron's allgather MoE dispatcher with one device->host copy per layer.

Megatron's ``MoEAllGatherTokenDispatcher.dispatch_postprocess`` waits for the device twice per
MoE layer forward (and twice more in the recomputed forward under full activation recomputation):

* ``local_map.sum(0).long().cpu()``: the per-expert token counts, which the experts need on the host
  (``SequentialMLP`` splits by them, ``TEGroupedMLP`` passes them as a list);
* ``probs.T.masked_select(local_map.T)``: the permuted router probabilities (a data-dependent
  output size: the device must report it before the host can go on).

Grouped experts on torch's grouped GEMM (``grouped.py``) then copy the cumulative counts back to the
device from pageable host memory, once per linear layer (fc1, fc2, again in recomputation).

:func:`dispatch_plan` computes everything from the routing map with ONE device->host copy (the
counts): the expert-major permutation by ``torch.nonzero_static`` with the size known on the host
(no second sync), the permuted probabilities by a gather with the same flat indices, and the int32
grouped-GEMM end offsets on the device (``cumsum`` of the device counts, no host->device copy);
the offsets are registered (:func:`device_offsets`) so that both linear layers of the experts reuse
them. The plan's permutation is the reversed mapping the combine step and the backward use, so
nothing is recomputed there. The order is Megatron's (expert-major, tokens ascending within an
expert), so the results are bitwise those of the reference.

:class:`CountsOnceAllGatherDispatcher`: the allgather dispatcher with ``backend``:

* ``"fast"`` (default): :func:`dispatch_plan`;
* ``"reference"``: Megatron's own ``dispatch_postprocess`` (kept side by side, fla-style; the tests
  compare the two).

With grouped experts on ``TorchGroupedLinear`` and tree routing (every token has exactly top-k
experts, so the number of permuted rows is ``N * top-k`` without asking the device), even that copy
goes: :func:`device_plan` leaves the counts on the device (:class:`DeviceCounts`) and the grouped
GEMMs take the device offsets, so a MoE layer runs without any host sync (``SequentialMLP``, which
splits by host counts, keeps the one copy).

TE's fused permutation (``moe_permute_fusion``) runs Megatron's path unchanged.
:func:`use_counts_once_dispatcher` swaps it into a ``MoELayer`` (``TreeMoETransformerLayer`` does it
for its MoE MLP: every ``E`` layer of the tree spec, whether it runs a tree pack or trajectory-wise
chains, so HARTS and the baseline run the same dispatcher).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from megatron.core.transformer.moe.token_dispatcher import MoEAllGatherTokenDispatcher


BACKENDS = ("fast", "reference")


@dataclass
class DispatchPlan:
    """Permutation of the ``[N, E]`` routing map ``local_map`` into expert-major order."""
    counts: list[int]                  # [E] tokens per expert (host)
    tokens_per_expert: torch.Tensor    # [E] int64 on the host (Megatron's dispatcher output)
    flat_index: torch.Tensor           # [sum(counts)] int64 indices into local_map.T.reshape(-1)
    token_index: torch.Tensor          # [sum(counts)] int64 source token of each permuted row
    offsets: torch.Tensor              # [E] int32 end offsets on the device (torch._grouped_mm's offs)


def dispatch_plan(local_map: torch.Tensor) -> DispatchPlan:
    """The plan of ``local_map`` ``[N, E]`` (bool) with one device->host copy (the counts)."""
    n, e = local_map.shape
    counts_dev = local_map.sum(0)                                   # [E] int64
    tokens_per_expert = counts_dev.cpu()                            # the one device->host copy
    counts = tokens_per_expert.tolist()
    total = sum(counts)
    flat = torch.nonzero_static(local_map.T.reshape(-1), size=total).view(-1)   # expert-major, no sync
    offsets = counts_dev.cumsum(0, dtype=torch.int32)
    register_offsets(counts, offsets)
    return DispatchPlan(counts, tokens_per_expert, flat, flat % n if n else flat, offsets)


class DeviceCounts:
    """Tokens per expert left on the device: what :class:`CountsOnceAllGatherDispatcher` hands to
    grouped experts when the number of permuted rows is known on the host without asking the device
    (tree routing: every token has exactly top-k experts, all experts local). Megatron's
    ``TEGroupedMLP.forward`` calls ``tokens_per_expert.tolist()`` and passes the result to its
    linear layers: ``tolist()`` returns this object, and
    :class:`~megatron_harts.moe.grouped.TorchGroupedLinear` runs the grouped GEMM on ``offsets``;
    anything that needs the counts on the host calls :meth:`host` (one device->host copy, cached)."""

    def __init__(self, counts: torch.Tensor, offsets: torch.Tensor, total: int):
        self.counts, self.offsets, self.total = counts, offsets, total
        self._host: list[int] | None = None

    def __len__(self) -> int:
        return self.counts.shape[0]

    def tolist(self) -> "DeviceCounts":
        return self

    def host(self) -> list[int]:
        if self._host is None:
            self._host = self.counts.tolist()
        return self._host


def device_plan(local_map: torch.Tensor, topk: int) -> tuple[torch.Tensor, torch.Tensor, DeviceCounts]:
    """``(flat_index, token_index, DeviceCounts)`` of ``local_map`` ``[N, E]`` when every row has
    exactly ``topk`` entries (``N * topk`` permuted rows): no device->host copy at all. The row
    count is checked on the device (``torch._assert_async``), not on the host."""
    n = local_map.shape[0]
    total = n * topk
    counts = local_map.sum(0)
    offsets = counts.cumsum(0, dtype=torch.int32)
    if n:
        torch._assert_async(offsets[-1] == total, "MoE routing map rows must have exactly top-k experts")
    flat = torch.nonzero_static(local_map.T.reshape(-1), size=total).view(-1)
    return flat, flat % n if n else flat, DeviceCounts(counts, offsets, total)


def experts_take_device_counts(experts) -> bool:
    """Whether ``experts`` accept :class:`DeviceCounts`: Megatron's ``TEGroupedMLP`` on
    ``TorchGroupedLinear`` layers, unfused, without fp8 / fp4 padding (which needs host counts)."""
    from megatron.core.transformer.moe.experts import TEGroupedMLP

    from .grouped import TorchGroupedLinear
    cfg = getattr(experts, "config", None)
    return (isinstance(experts, TEGroupedMLP) and isinstance(experts.linear_fc1, TorchGroupedLinear)
            and isinstance(experts.linear_fc2, TorchGroupedLinear) and not getattr(experts, "_with_fused_impl", False)
            and not getattr(cfg, "fp8", None) and not getattr(cfg, "fp4", None))


# The end offsets of the last plan, keyed by its counts: TorchGroupedLinear's fc1 and fc2 (and the
# recomputed forward of the same layer) find them here instead of copying them to the device. A hit
# is correct whatever layer registered it: the offsets are a function of the counts alone.
_OFFSETS: dict = {}


def register_offsets(counts: list[int], offsets: torch.Tensor) -> None:
    _OFFSETS.clear()
    _OFFSETS[(tuple(int(c) for c in counts), offsets.device)] = offsets


def device_offsets(counts: list[int], device) -> torch.Tensor | None:
    """Registered int32 end offsets of ``counts`` on ``device``, or None."""
    return _OFFSETS.get((tuple(int(c) for c in counts), torch.device(device)))


class CountsOnceAllGatherDispatcher(MoEAllGatherTokenDispatcher):
    """``MoEAllGatherTokenDispatcher`` whose ``dispatch_postprocess`` runs :func:`dispatch_plan`
    (``backend="fast"``) or Megatron's own (``"reference"``). Adds no state to the constructor, so
    an existing allgather dispatcher is converted in place (:func:`use_counts_once_dispatcher`)."""

    backend = "fast"
    device_counts = False      # the experts accept DeviceCounts (set by use_counts_once_dispatcher)
    router = None              # the layer's router: tree routing => exactly top-k experts per token

    def _rows_are_full(self) -> bool:
        """Every routing-map row has exactly top-k experts and all experts are local: tree routing
        (deterministic top-k, no padding tokens, no dropping: ``check_tree_moe_config``)."""
        return (getattr(self.router, "_tree_pack", None) is not None
                and self.num_local_experts == self.config.num_moe_experts)

    def dispatch_postprocess(self, hidden_states, probs):
        if self.backend not in BACKENDS:
            raise ValueError(f"dispatcher backend must be one of {BACKENDS}, got {self.backend!r}")
        if self.backend == "reference" or self.config.moe_permute_fusion:
            _OFFSETS.clear()                # the experts copy their offsets from the host, as before
            return super().dispatch_postprocess(hidden_states, probs)
        self.hidden_shape_before_permute = hidden_states.shape
        lo, hi = self.local_expert_indices[0], self.local_expert_indices[-1] + 1
        self.local_map = self.routing_map[:, lo:hi].contiguous()
        if self.device_counts and self._rows_are_full():
            _OFFSETS.clear()
            flat, token_index, tokens_per_expert = device_plan(self.local_map, self.router_topk)
        else:
            plan = dispatch_plan(self.local_map)
            flat, token_index, tokens_per_expert = plan.flat_index, plan.token_index, plan.tokens_per_expert
        permuted = hidden_states.index_select(0, token_index)
        self.local_probs = probs[:, lo:hi].T.contiguous().reshape(-1)[flat]
        self.reversed_local_input_permutation_mapping = token_index
        self.routing_map = None
        return permuted, tokens_per_expert, self.local_probs


def use_counts_once_dispatcher(moe_layer, backend: str = "fast") -> None:
    """In place: the allgather token dispatcher(s) of ``moe_layer`` (a Megatron ``MoELayer``) ->
    :class:`CountsOnceAllGatherDispatcher` with ``backend``; other dispatchers are left alone."""
    if backend not in BACKENDS:
        raise ValueError(f"dispatcher backend must be one of {BACKENDS}, got {backend!r}")
    for name in ("token_dispatcher", "_training_token_dispatcher"):
        d = getattr(moe_layer, name, None)
        if type(d) is MoEAllGatherTokenDispatcher:
            d.__class__ = CountsOnceAllGatherDispatcher
        if isinstance(d, CountsOnceAllGatherDispatcher):
            d.backend = backend
            d.router = getattr(moe_layer, "router", None)
            d.device_counts = experts_take_device_counts(getattr(moe_layer, "experts", None))
