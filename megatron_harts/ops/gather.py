"""Moving a layer's tensors between compact order and a chunk plan's all-rounds layout.

``gather_rounds``: x ``[T, ...]`` -> ``x[plan.gather_all]`` ``[N, ...]``. Every compact token is
owned by exactly one position (``out_index``), the other N - T positions are replay, so the
backward is a gather of the owned rows plus the replay rows' gradients summed in fp32 per
distinct token (a token can be replayed once per branch), instead of an atomic ``index_add_``
over all N rows in the input dtype.
``owned_outputs``: o ``[N, ...]`` -> ``o[plan.out_index]`` ``[T, ...]``; backward is one copy
(injective index, replay positions get zero gradient).
"""
from __future__ import annotations

import torch

from .plan import ChunkPlan


class _GatherRounds(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, gather_all, out_index, replay_pos, replay_rows, replay_slot):
        ctx.save_for_backward(out_index, replay_pos, replay_rows, replay_slot)
        return x.index_select(0, gather_all)

    @staticmethod
    def backward(ctx, gy):
        out_index, replay_pos, replay_rows, replay_slot = ctx.saved_tensors
        gx = gy.index_select(0, out_index)
        if replay_pos.numel():
            acc = gx.index_select(0, replay_rows).float()
            acc.index_add_(0, replay_slot, gy.index_select(0, replay_pos).float())
            gx.index_copy_(0, replay_rows, acc.to(gx.dtype))
        return gx, None, None, None, None, None


class _OwnedOutputs(torch.autograd.Function):
    @staticmethod
    def forward(ctx, o, out_index):
        ctx.save_for_backward(out_index)
        ctx.rows = o.shape[0]
        return o.index_select(0, out_index)

    @staticmethod
    def backward(ctx, g):
        (out_index,) = ctx.saved_tensors
        return g.new_zeros((ctx.rows, *g.shape[1:])).index_copy_(0, out_index, g), None


def gather_rounds(x: torch.Tensor, plan: ChunkPlan) -> torch.Tensor:
    """``x[plan.gather_all]`` with the backward described in the module docstring."""
    return _GatherRounds.apply(x, plan.gather_all, plan.out_index, plan.replay_pos, plan.replay_rows,
                               plan.replay_slot)


def owned_outputs(o: torch.Tensor, plan: ChunkPlan) -> torch.Tensor:
    """``o[plan.out_index]`` (compact order) with a copy as backward."""
    return _OwnedOutputs.apply(o, plan.out_index)
