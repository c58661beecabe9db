"""Mamba2 mixer (``M``) in torch, for tree packs and ordinary inputs, without ``mamba_ssm``.

:class:`TreeMambaMixer` subclasses Megatron's ``MambaMixer``: same constructor, parameters and
names (``in_proj``, ``conv1d_weight``, ``conv1d_bias``, ``dt_bias``, ``A_log``, ``D``,
``norm.weight``, ``out_proj``), same init (same RNG draws) and ``sharded_state_dict``, so
checkpoints load both ways. Without ``mamba_ssm`` the parent constructor is run with its import
guard lifted and ``ExtendedRMSNorm`` (a mamba_ssm Triton norm) replaced by :class:`GatedRMSNorm`
(same ``weight`` parameter); with ``mamba_ssm`` the stock norm is built and only its ``weight``
/ ``eps`` are read. ``forward`` never calls mamba_ssm/causal_conv1d kernels:

    zxBCdt = in_proj(h);  xBC = silu(conv1d(xBC) + bias)   (tree: tree_causal_conv1d)
    dt = softplus(dt + dt_bias);  A = -exp(A_log)
    y  = SSD(q=C, k=B, v=x*dt, g=A*dt, scale=1) + D*x      (tree: tree_simple_gla)
    out = out_proj(RMSNorm_group(y * silu(z)) * norm.weight)

(the math of Megatron's ``_ssm_training`` / ``_ssm_prefill``: ``mamba_split_conv1d_scan_combined``
with ``norm_before_gate=False``, then the group RMSNorm over ``d_inner / ngroups``). Head ``h``
reads B/C of group ``h // (nheads / ngroups)``. The SSD and the norm run in fp32.

Inputs: a :class:`TreePackedSeqParams` (``[T, 1, h]``) -> tree ops with ``pack.chunk_size``;
plain THD ``PackedSeqParams`` (``[T, 1, h]``, ``cu_seqlens_q``, unpadded) or none (``[s, b, h]``,
each batch row one sequence) -> a varlen causal conv and ``chunk_simple_gla_torch`` (chunk
``self.chunk_size``) over the same math. Not supported: inference (static/dynamic caches),
context parallelism, padded THD.
"""
from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F
from megatron.core.ssm import mamba_mixer as _mm
from megatron.core.ssm.mamba_mixer import MambaMixer
from megatron.core.transformer.utils import make_sharded_tensors_for_checkpoint

from ..ops import tree_causal_conv1d, tree_simple_gla
from ..ops.chunk_torch import chunk_simple_gla_torch
from .packed_seq import TreePackedSeqParams


class GatedRMSNorm(torch.nn.Module):
    """Torch stand-in for mamba_ssm's ``layernorm_gated.RMSNorm`` (``weight [d]``, no bias):
    ``forward(x, z=None)`` = ``rmsnorm_group(x * silu(z)) * weight`` (``norm_before_gate=False``)
    or ``rmsnorm_group(x) * weight * silu(z)`` (``True``), computed in fp32."""

    def __init__(self, hidden_size, eps=1e-5, group_size=None, norm_before_gate=True, device=None, dtype=None):
        super().__init__()
        self.eps, self.group_size, self.norm_before_gate = eps, group_size or hidden_size, norm_before_gate
        self.weight = torch.nn.Parameter(torch.ones(hidden_size, device=device, dtype=dtype))
        self.register_parameter("bias", None)

    def forward(self, x, z=None):
        return gated_rmsnorm(x, z, self.weight, self.eps, self.group_size, self.norm_before_gate)

    def sharded_state_dict(self, prefix="", sharded_offsets=(), metadata=None):
        """As ``ExtendedRMSNorm``: weight sharded along axis 0."""
        return make_sharded_tensors_for_checkpoint(self.state_dict(prefix="", keep_vars=True), prefix, {"weight": 0},
                                                   sharded_offsets, tp_group=self.tp_group,
                                                   dp_cp_group=metadata["dp_cp_group"])


def gated_rmsnorm(x, z, weight, eps, group_size, norm_before_gate=False):
    """mamba_ssm ``rmsnorm_fn`` in torch (fp32 math, output in x's dtype)."""
    dtype, xf = x.dtype, x.float()
    if z is not None and not norm_before_gate:
        xf = xf * F.silu(z.float())
    g = xf.unflatten(-1, (-1, group_size))
    y = (g * torch.rsqrt(g.square().mean(-1, keepdim=True) + eps)).flatten(-2) * weight.float()
    if z is not None and norm_before_gate:
        y = y * F.silu(z.float())
    return y.to(dtype)


@contextlib.contextmanager
def _without_mamba_ssm():
    """Let ``MambaMixer.__init__`` run without mamba_ssm (import guard off, torch norm)."""
    if _mm.HAVE_MAMBA_SSM:
        yield
        return
    saved = _mm.HAVE_MAMBA_SSM, _mm.ExtendedRMSNorm
    _mm.HAVE_MAMBA_SSM, _mm.ExtendedRMSNorm = True, GatedRMSNorm
    try:
        yield
    finally:
        _mm.HAVE_MAMBA_SSM, _mm.ExtendedRMSNorm = saved


def varlen_causal_conv1d(x, weight, bias, cu_seqlens_cpu, activation=None):
    """Depthwise causal conv restarting at every sequence start. x ``[N, D]``, weight ``[D, W]``,
    cu_seqlens ``[S + 1]`` (CPU int) -> ``[N, D]``."""
    N, W = x.shape[0], weight.shape[1]
    lens = cu_seqlens_cpu.diff().long()
    pos = (torch.arange(N) - torch.repeat_interleave(cu_seqlens_cpu[:-1].long(), lens)).to(x.device)
    y = x * weight[:, W - 1]
    for j in range(1, W):
        shifted = F.pad(x[:-j], (0, 0, j, 0)) if j < N else torch.zeros_like(x)
        y = y + shifted * (pos >= j).unsqueeze(-1).to(x.dtype) * weight[:, W - 1 - j]
    if bias is not None:
        y = y + bias
    return F.silu(y) if activation in ("silu", "swish") else y


class TreeMambaMixer(MambaMixer):
    """``MambaMixer`` with a torch forward for tree packs and ordinary sequences (see module doc).

    ``forward(hidden_states [s, b, h], inference_context=None, *, packed_seq_params=None)``
    returns ``(out [s, b, h], out_bias)`` like the parent.
    """

    def __init__(self, *args, **kwargs):
        with _without_mamba_ssm():
            super().__init__(*args, **kwargs)

    def forward(self, hidden_states, inference_context=None, *, inference_params=None,
                packed_seq_params=None):
        if inference_context is not None or inference_params is not None:
            raise NotImplementedError("TreeMambaMixer: inference is not supported")
        if self.cp.cp_size > 1:
            raise NotImplementedError("TreeMambaMixer: context parallelism is not supported")
        zxBCdt, _ = self.in_proj(hidden_states)                          # [s, b, F/tp] (SP: gathered)
        s, b, _ = zxBCdt.shape
        tree = isinstance(packed_seq_params, TreePackedSeqParams)
        if tree or packed_seq_params is not None:
            if b != 1:
                raise ValueError(f"TreeMambaMixer: packed input must be [T, 1, h], got {tuple(zxBCdt.shape)}")
        if tree:
            pack = packed_seq_params.tree_pack
            if s != pack.num_tokens:
                raise ValueError(f"TreeMambaMixer: expected {pack.num_tokens} tokens, got {s}")
            cu = None
        elif packed_seq_params is not None:
            cu = packed_seq_params.cu_seqlens_q
            cu_pad = packed_seq_params.cu_seqlens_q_padded
            if cu is None or (cu_pad is not None and not torch.equal(cu_pad.cpu(), cu.cpu())):
                raise NotImplementedError("TreeMambaMixer: THD needs unpadded cu_seqlens_q")
            cu = cu.cpu().long()
            if int(cu[-1]) != s:
                raise ValueError(f"TreeMambaMixer: cu_seqlens_q[-1]={int(cu[-1])} != {s} tokens")
        else:
            cu = torch.arange(b + 1) * s
        x2 = zxBCdt.transpose(0, 1).reshape(b * s, -1)                    # sequence-major [N, F]
        d_in, GN, H, P = self.d_inner_local_tp, self.ngroups_local_tp * self.d_state, self.nheads_local_tp, self.headdim
        z, xBC, dt = torch.split(x2, [d_in, d_in + 2 * GN, H], dim=-1)
        w = self.conv1d_weight.squeeze(1)
        if tree:
            xBC = tree_causal_conv1d(xBC, w, self.conv1d_bias, pack, activation=self.activation)
        else:
            xBC = varlen_causal_conv1d(xBC, w, self.conv1d_bias, cu, activation=self.activation)
        x, B, C = torch.split(xBC, [d_in, GN, GN], dim=-1)
        N = x.shape[0]
        rep = H // self.ngroups_local_tp
        x = x.reshape(N, H, P).float()
        B = B.reshape(N, -1, self.d_state).float().repeat_interleave(rep, dim=1)   # [N, H, d_state]
        C = C.reshape(N, -1, self.d_state).float().repeat_interleave(rep, dim=1)
        dt = F.softplus(dt.float() + self.dt_bias.float())                          # [N, H]
        A = -torch.exp(self.A_log.float())
        v, g = x * dt.unsqueeze(-1), dt * A
        if tree:
            y = tree_simple_gla(C, B, v, g, pack, chunk_size=pack.chunk_size, scale=1.0)
        else:
            y, _ = chunk_simple_gla_torch(C, B, v, g, cu_seqlens_cpu=cu, chunk_size=self.chunk_size, scale=1.0)
        D = self.D.float()
        y = y + x * (D.reshape(H, P) if self.D_has_hdim else D.unsqueeze(-1))
        y = y.reshape(N, d_in)
        if self.rmsnorm:
            y = gated_rmsnorm(y, z, self.norm.weight, self.norm.eps, d_in // self.ngroups_local_tp)
        else:
            y = y * F.silu(z.float())
        y = y.to(zxBCdt.dtype).reshape(b, s, d_in).transpose(0, 1)                # [s, b, d_inner/tp]
        return self.out_proj(y)
