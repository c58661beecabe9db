"""Per-token log-probs from compact logits, restored per trajectory.

The logit row of compact token u predicts the next token of every trajectory through u, so a
branch point has several labels: exactly one (parent(v), token(v)) pair per non-root token v.
We compute log-sum-exp once per compact token and gather one logit per pair.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from ..packing import TreePack


def _all_reduce(x: torch.Tensor, op, group) -> torch.Tensor:
    from torch.distributed.nn.functional import all_reduce
    return all_reduce(x, op=op, group=group)


def node_logprobs(logits: torch.Tensor, pack: TreePack, tp_group=None) -> torch.Tensor:
    """logits ``[T, V_local]`` -> ``[T]`` fp32: entry v = log p(token v | its prefix), 0 at roots.

    With ``tp_group``, the vocab is split across the group in rank order (Megatron's
    vocab-parallel layout) and the result is the same on every rank.
    """
    if logits.dim() != 2 or logits.shape[0] != pack.num_tokens:
        raise ValueError(f"logits: expected [{pack.num_tokens}, vocab], got {tuple(logits.shape)}")
    logits = logits.float()
    src = pack.parent.clamp(min=0)
    label = pack.tokens
    if tp_group is None:
        top = pack.max_token     # a host int (taken before the pack went to the device)
        if top >= logits.shape[1]:
            raise ValueError(f"token id {top} outside the logits' vocabulary of {logits.shape[1]}")
        lse = torch.logsumexp(logits, dim=-1)
        target = logits[src, label]
    else:
        v_local = logits.shape[1]
        start = dist.get_rank(tp_group) * v_local
        m = logits.detach().max(dim=-1).values
        dist.all_reduce(m, op=dist.ReduceOp.MAX, group=tp_group)
        lse = m + _all_reduce((logits - m[:, None]).exp().sum(-1), dist.ReduceOp.SUM, tp_group).log()
        local = label - start
        inside = (local >= 0) & (local < v_local)
        target = _all_reduce(logits[src, local.clamp(0, v_local - 1)] * inside, dist.ReduceOp.SUM, tp_group)
    return torch.where(pack.parent >= 0, target - lse[src], torch.zeros_like(target))


def restore(per_token: torch.Tensor, pack: TreePack, drop_first: bool = True) -> list[torch.Tensor]:
    """Scatter a compact ``[T, ...]`` tensor back to per-trajectory tensors ``[L_i (- 1), ...]``."""
    flat = per_token.index_select(0, pack.traj_index)
    lengths = pack.trajectory_lengths_host
    parts = torch.split(flat, lengths)
    return [p[1:] for p in parts] if drop_first else list(parts)


def tree_token_logprobs(logits: torch.Tensor, pack: TreePack, tp_group=None) -> list[torch.Tensor]:
    """For trajectory i, ``[L_i - 1]`` log-probs of its tokens 1..L_i-1 given their prefixes."""
    return restore(node_logprobs(logits, pack, tp_group), pack)
