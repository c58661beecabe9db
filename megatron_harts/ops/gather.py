"""Moving a layer's tensors between compact order and a chunk plan's all-rounds layout.

``gather_rounds``: x ``[T, ...]`` -> ``x[plan.gather_all]`` ``[N, ...]``. Every compact token is
owned by exactly one position (``out_index``), the other N - T positions are replay, so the
backward is a gather of the owned rows plus the replay rows' gradients summed in fp32 per
distinct token (a token can be replayed once per branch), instead of an atomic ``index_add_``
over all N rows in the input dtype.
``owned_outputs``: o ``[N, ...]`` -> ``o[plan.out_index]`` ``[T, ...]``; backward is one copy
(injective index, replay positions get zero gradient).
The plain functions (``to_rounds``, ``rounds_grad_to_compact``, ``from_rounds``,
``compact_grad_to_rounds``) are the same steps without autograd nodes, for custom Functions that
do the layout change inside their own forward / backward.
"""
from __future__ import annotations

import torch

from .plan import ChunkPlan


def to_rounds(x: torch.Tensor, plan: ChunkPlan) -> torch.Tensor:
    """``x[plan.gather_all]``: compact ``[T, ...]`` -> all-rounds ``[N, ...]`` (no autograd node)."""
    return x.index_select(0, plan.gather_all)


def rounds_grad_to_compact(gy: torch.Tensor, plan: ChunkPlan) -> torch.Tensor:
    """Backward of :func:`to_rounds`: ``[N, ...]`` -> ``[T, ...]``, owned rows gathered, replayed
    rows' gradients summed in fp32 per distinct token (owned row first, then the replays in
    ``replay_pos`` order)."""
    if plan.replay_pos.numel() and gy.dtype == torch.float32:
        # fp32 (e.g. the GDN gate's gradient): owned rows [T] and replayed rows [P] in one gather,
        # the replays added into their owned rows in place: 2 launches instead of 4, same additions
        T = plan.out_index.shape[0]
        both = gy.index_select(0, plan.owned_then_replay)
        return both[:T].index_add_(0, plan.replay_token, both[T:])
    gx = gy.index_select(0, plan.out_index)
    if plan.replay_pos.numel():
        # one gather: [U owned rows of the replayed tokens (= gx[replay_rows]); P replayed rows]
        both = gy.index_select(0, plan.replay_gather).float()
        acc = both[:plan.replay_rows.shape[0]]
        acc.index_add_(0, plan.replay_slot, both[plan.replay_rows.shape[0]:])
        gx.index_copy_(0, plan.replay_rows, acc.to(gx.dtype))
    return gx


def from_rounds(o: torch.Tensor, plan: ChunkPlan) -> torch.Tensor:
    """``o[plan.out_index]``: all-rounds ``[N, ...]`` -> compact ``[T, ...]`` (owned outputs)."""
    return o.index_select(0, plan.out_index)


def compact_grad_to_rounds(g: torch.Tensor, plan: ChunkPlan) -> torch.Tensor:
    """Backward of :func:`from_rounds`: ``[T, ...]`` -> ``[N, ...]`` with zeros at replay positions."""
    out = g.new_empty((plan.gather_all.shape[0], *g.shape[1:])).index_copy_(0, plan.out_index, g)
    return out.index_fill_(0, plan.replay_pos, 0) if plan.replay_pos.numel() else out


class _GatherRounds(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, plan):
        ctx.plan = plan
        return to_rounds(x, plan)

    @staticmethod
    def backward(ctx, gy):
        return rounds_grad_to_compact(gy, ctx.plan), None


class _OwnedOutputs(torch.autograd.Function):
    @staticmethod
    def forward(ctx, o, plan):
        ctx.plan = plan
        return from_rounds(o, plan)

    @staticmethod
    def backward(ctx, g):
        return compact_grad_to_rounds(g, ctx.plan), None


def gather_rounds(x: torch.Tensor, plan: ChunkPlan) -> torch.Tensor:
    """``x[plan.gather_all]`` with the backward described in the module docstring."""
    return _GatherRounds.apply(x, plan)


def owned_outputs(o: torch.Tensor, plan: ChunkPlan) -> torch.Tensor:
    """``o[plan.out_index]`` (compact order) with a copy as backward."""
    return _OwnedOutputs.apply(o, plan)
