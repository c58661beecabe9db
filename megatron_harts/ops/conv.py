"""Tree-aware short causal depthwise convolution (the GDN / Mamba2 conv1d)."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from ..packing import TreePack
from .plan import conv_ancestors, conv_fix_rows

ACTIVATIONS = (None, "silu", "swish")
BACKENDS = ("auto", "torch", "fla")


def tree_causal_conv1d(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, pack: TreePack,
                       activation: str | None = None, backend: str = "auto") -> torch.Tensor:
    """x ``[T, D]``, weight ``[D, W]``, bias ``[D]`` -> ``[T, D]``.

    ``y(u) = sum_j weight[:, W-1-j] * x(anc_j(u))`` with ``anc_0 = u``, ``anc_{j+1} = parent(anc_j)``
    and zero past the root: per trajectory, exactly a causal depthwise conv.

    Backends: ``torch`` gathers the W ancestors of every token. ``fla`` runs fla's causal conv
    over the compact array as one sequence (right wherever the previous W-1 compact tokens are
    the ancestors, i.e. away from branch points) and recomputes only the rows within W-1 tokens
    after a branch or root with the gather form.
    """
    if x.dim() != 2 or x.shape[0] != pack.num_tokens:
        raise ValueError(f"x: expected [{pack.num_tokens}, D], got {tuple(x.shape)}")
    if weight.dim() != 2 or weight.shape[0] != x.shape[1]:
        raise ValueError(f"weight: expected [{x.shape[1]}, W], got {tuple(weight.shape)}")
    if activation not in ACTIVATIONS:
        raise ValueError(f"activation must be one of {ACTIVATIONS}, got {activation!r}")
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    if backend == "auto":
        backend = "fla" if x.is_cuda else "torch"
    W = weight.shape[1]
    anc = conv_ancestors(pack, W)
    if backend == "torch":
        return _gather_conv(x, weight, bias, anc, activation)
    from fla.modules.causal_conv1d.ops import causal_conv1d

    rows = conv_fix_rows(pack, W)
    y, _ = causal_conv1d(x.unsqueeze(0), weight, bias, activation=activation)
    y, fix = y.squeeze(0), _gather_conv(x, weight, bias, anc[:, rows], activation)
    # fla saves only its inputs, so patching its output in place is safe for autograd, unless
    # the output is a view made inside fla's autograd Function (autograd then refuses at once).
    try:
        return y.index_copy_(0, rows, fix)
    except RuntimeError:
        return y.index_copy(0, rows, fix)


def _gather_conv(x, weight, bias, anc, activation):
    """Rows ``anc[0]`` of the tree conv; anc ``[W, R]`` ancestor indices (``T`` = past a root)."""
    T, W = x.shape[0], weight.shape[1]
    y = None
    for j in range(W):
        term = x.index_select(0, anc[j].clamp(max=T - 1))
        if j:
            term = term * (anc[j] < T).unsqueeze(-1).to(x.dtype)
        term = term * weight[:, W - 1 - j]
        y = term if y is None else y + term
    if bias is not None:
        y = y + bias
    return F.silu(y) if activation in ("silu", "swish") else y
