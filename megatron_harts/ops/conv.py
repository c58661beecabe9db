"""Tree-aware short causal depthwise convolution (the GDN / Mamba2 conv1d)."""
from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F

from ..packing import TreePack
from .plan import conv_ancestors, conv_fix_plan, conv_fix_taps

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
    after a branch or root with the gather form; on packs without branches (trajectory packs) it
    is fla's varlen conv over the trajectories, exactly what a THD baseline runs.
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
    if backend == "torch":
        return _gather_conv(x, weight, bias, conv_ancestors(pack, W), activation)
    if pack.is_chain:       # trajectory packs (the THD baseline): fla's varlen conv, nothing to patch
        from fla.modules.causal_conv1d.ops import causal_conv1d

        cu, cu_cpu = pack.root_segments
        return causal_conv1d(x.unsqueeze(0), weight, bias, activation=activation, cu_seqlens=cu,
                             cu_seqlens_cpu=cu_cpu)[0].squeeze(0)
    rows, sources, local = conv_fix_plan(pack, W)
    return _TreeConvFla.apply(x, weight, bias, rows, sources, local, conv_fix_taps(pack, W), activation)


class _TreeConvFla(torch.autograd.Function):
    """fla's causal conv over the compact array as one sequence, rows ``rows`` replaced by the
    gather form over their ancestor windows (``sources`` / ``local``, see ``plan.conv_fix_plan``).

    The fix-up is computed in fp32 (as fla accumulates) over the U source rows. Backward: fla's conv
    backward with the replaced rows' output gradient zeroed, plus the fix-up's gradient over the
    source rows (fp32, by hand: ``_conv_taps_bwd``), added into dx in place (distinct rows). No
    [T, D] zero buffers per window tap, no out-of-place copies of y. Like fla's own conv, the output
    is a view and must not be modified in place.

    ``taps_plan`` (``plan.conv_fix_taps``): the fix-up's taps come from x in one gather, the taps
    past a root zeroed in place (the same values as gathering ``sources`` and then ``local`` over
    them with a zero row appended: two launches fewer per forward). The backward gets the forward's
    fp32 tap weights ``[W, 1, D]`` (no cast / flip / copy of the weight again) and adds the fix-up's
    weight gradient into fla's in its tap order with one ``index_add_`` (no flip and add)."""

    @staticmethod
    def forward(ctx, x, weight, bias, rows, sources, local, taps_plan, activation):
        from fla.modules.causal_conv1d.ops import causal_conv1d_fwd

        weight, bias = weight.contiguous(), None if bias is None else bias.contiguous()

        with torch.cuda.device(x.device) if x.is_cuda else contextlib.nullcontext():
            y, _ = causal_conv1d_fwd(x=x.unsqueeze(0), weight=weight, bias=bias, residual=None,
                                     activation=activation)
        y = y.squeeze(0)
        index, past_root, reverse = taps_plan
        W, D = weight.shape[1], x.shape[1]
        taps = x.index_select(0, index).float().view(W, past_root.shape[1], D).masked_fill_(past_root, 0)  # [W, R, D]
        wt = _tap_weights(weight.float())
        fix, pre = _conv_taps(taps, wt, None if bias is None else bias.float(), activation)
        y.index_copy_(0, rows, fix.to(y.dtype))
        # taps [W, R, D] / pre [R, D] (fp32, R fix-up rows: small) and the tap weights are what the
        # backward of the fix-up needs; kept instead of gathered and recomputed there (same values,
        # fewer launches)
        ctx.save_for_backward(x, weight, bias, rows, sources, local, reverse, taps, pre, wt)
        ctx.activation = activation
        return y

    @staticmethod
    def backward(ctx, dy):
        from fla.modules.causal_conv1d.ops import causal_conv1d_bwd

        x, weight, bias, rows, sources, local, reverse, taps, pre, wt = ctx.saved_tensors
        with torch.cuda.device(x.device) if x.is_cuda else contextlib.nullcontext():
            dx, dw, db, _, _ = causal_conv1d_bwd(x=x.unsqueeze(0), dy=dy.index_fill(0, rows, 0).unsqueeze(0), dht=None,
                                                 weight=weight, bias=bias, residual=None, initial_state=None,
                                                 activation=ctx.activation)
        dx = dx.squeeze(0)
        dsrc, dwt, dbf = _conv_taps_bwd(taps, pre, wt, bias is not None, sources.shape[0], local,
                                        ctx.activation, dy.index_select(0, rows).float())
        dx.index_add_(0, sources, dsrc.to(dx.dtype))
        # dweight[:, W-1-j] += dwt[j]: one add per element, as (dw + flipped dwt) was
        dw = dw.float().index_add_(1, reverse, dwt.t()).to(dw.dtype)
        db = (db.float() + dbf).to(db.dtype) if bias is not None else None
        return dx, dw, db, None, None, None, None, None


def _taps(x, anc):
    """``[W, R, D]``: rows ``anc`` of x with a zero row appended (index ``len(x)`` = past a root)."""
    return torch.cat([x, x.new_zeros(1, x.shape[1])]).index_select(0, anc.reshape(-1)).view(*anc.shape, x.shape[1])


def _tap_weights(weight):
    """``[W, 1, D]`` view of weight ``[D, W]`` in tap order: row j multiplies ancestor j (``weight[:, W-1-j]``)."""
    return weight.flip(1).t().unsqueeze(1)


def _conv_taps(taps, wt, bias, activation):
    """(y ``[R, D]``, pre-activation ``[R, D]``) from taps ``[W, R, D]`` and tap weights ``wt``
    ``[W, 1, D]`` (:func:`_tap_weights`)."""
    y = (taps * wt).sum(0)   # [W, R, D] x [W, 1, D]
    if bias is not None:
        y = y + bias
    return (F.silu(y) if activation in ("silu", "swish") else y), y


def _gather_conv_fwd(x, weight, bias, anc, activation):
    """Rows ``anc[0]`` of the tree conv; anc ``[W, R]`` row indices into x ``[U, D]`` (``U`` = past a root).

    All W taps in one gather over x with a zero row appended, one weighted sum: a fixed handful of
    ops whatever W. Returns (y ``[R, D]``, taps ``[W, R, D]``, pre-activation ``[R, D]``), the last
    two for :func:`_conv_taps_bwd`."""
    taps = _taps(x, anc)
    y, pre = _conv_taps(taps, _tap_weights(weight), bias, activation)
    return y, taps, pre


def _gather_conv(x, weight, bias, anc, activation):
    """``y [R, D]`` of :func:`_gather_conv_fwd` (differentiable by autograd: the torch backend)."""
    return _gather_conv_fwd(x, weight, bias, anc, activation)[0]


def _conv_taps_bwd(taps, pre, wt, has_bias, num_rows, anc, activation, dy):
    """Gradients of :func:`_gather_conv` for output gradient dy ``[R, D]``, from the forward's
    ``taps`` ``[W, R, D]``, pre-activation ``pre`` ``[R, D]`` and tap weights ``wt`` ``[W, 1, D]``
    (:func:`_tap_weights`; fp32): (dx ``[num_rows, D]``, dweight in tap order ``[W, D]`` (row j:
    ``weight[:, W-1-j]``), dbias ``[D]`` or None), by hand (no autograd graph: it runs in every conv
    layer's backward)."""
    W, R, D = taps.shape
    if activation in ("silu", "swish"):
        sig = torch.sigmoid(pre)
        dy = dy * sig * (1 + pre * (1 - sig))
    # written into a [W, R, D] buffer: wt is a transposed view, and the rows must be contiguous
    dtaps = torch.mul(dy.unsqueeze(0), wt, out=taps.new_empty(W, R, D)).view(-1, D)   # [W * R, D]
    dx = taps.new_zeros(num_rows + 1, D).index_add_(0, anc.reshape(-1), dtaps)[:-1]
    dweight = (taps * dy.unsqueeze(0)).sum(1)                     # [W, D]
    return dx, dweight, dy.sum(0) if has_bias else None
