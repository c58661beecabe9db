"""Tree-aware short causal depthwise convolution (the GDN / Mamba2 conv1d)."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from ..packing import TreePack
from .plan import conv_ancestors

ACTIVATIONS = (None, "silu", "swish")


def tree_causal_conv1d(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, pack: TreePack,
                       activation: str | None = None) -> torch.Tensor:
    """x ``[T, D]``, weight ``[D, W]``, bias ``[D]`` -> ``[T, D]``.

    ``y(u) = sum_j weight[:, W-1-j] * x(anc_j(u))`` with ``anc_0 = u``, ``anc_{j+1} = parent(anc_j)``
    and zero past the root: per trajectory, exactly a causal depthwise conv. W gathers of x.
    """
    if x.dim() != 2 or x.shape[0] != pack.num_tokens:
        raise ValueError(f"x: expected [{pack.num_tokens}, D], got {tuple(x.shape)}")
    if weight.dim() != 2 or weight.shape[0] != x.shape[1]:
        raise ValueError(f"weight: expected [{x.shape[1]}, W], got {tuple(weight.shape)}")
    if activation not in ACTIVATIONS:
        raise ValueError(f"activation must be one of {ACTIVATIONS}, got {activation!r}")
    W = weight.shape[1]
    anc = conv_ancestors(pack, W)
    xp = torch.cat([x, x.new_zeros(1, x.shape[1])])
    y = x * weight[:, W - 1]
    for j in range(1, W):
        y = y + xp.index_select(0, anc[j]) * weight[:, W - 1 - j]
    if bias is not None:
        y = y + bias
    return F.silu(y) if activation in ("silu", "swish") else y
