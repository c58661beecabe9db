"""Chunked linear attention in plain torch: varlen, initial/final states, autograd.

The torch backend of the tree ops (CPU and any device): the same chunk partition as fla's
kernels (chunks aligned to each sequence's start), computed in fp32. Sequences are padded to
whole chunks with neutral tokens (k = v = 0, g = 0, beta = 0), which leave the state unchanged.
Loops run over chunks, never over tokens. Computes in fp32, or fp64 for fp64 inputs.
"""
from __future__ import annotations

import torch


def l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """fla's ``l2norm`` in torch: ``x / sqrt(sum(x^2, -1) + eps)`` over the last dim, in fp32,
    returned in x's dtype."""
    xf = x.float()
    return (xf * torch.rsqrt(xf.square().sum(-1, keepdim=True) + eps)).to(x.dtype)


def _acc(x: torch.Tensor) -> torch.Tensor:
    """Accumulation dtype: fp32, or fp64 for fp64 inputs."""
    return x.to(torch.promote_types(x.dtype, torch.float32))


def _to_chunks(xs: list[torch.Tensor], cu_seqlens_cpu: torch.Tensor, C: int):
    """Scatter varlen rows ``[N, ...]`` into ``[S, n, C, ...]`` (zero padded); returns the
    chunked tensors and the flat index of every valid position in the padded layout."""
    cu = cu_seqlens_cpu.tolist()
    S = len(cu) - 1
    lens = [cu[i + 1] - cu[i] for i in range(S)]
    n = max(1, max((l + C - 1) // C for l in lens))
    dev = xs[0].device
    lens_t = torch.tensor(lens, device=dev)
    starts = torch.tensor(cu[:-1], device=dev)
    seg = torch.repeat_interleave(torch.arange(S, device=dev), lens_t)
    N = int(cu[-1])
    pos = torch.arange(N, device=dev) - starts[seg]
    flat = seg * (n * C) + pos
    out = []
    for x in xs:
        buf = x.new_zeros((S * n * C,) + tuple(x.shape[1:]))
        buf = buf.index_copy(0, flat, x)
        out.append(buf.view((S, n, C) + tuple(x.shape[1:])))
    return out, flat, n


def _from_chunks(o: torch.Tensor, flat: torch.Tensor) -> torch.Tensor:
    S, n, C = o.shape[:3]
    return o.reshape((S * n * C,) + tuple(o.shape[3:])).index_select(0, flat)


def _decay_matrix(gc: torch.Tensor) -> torch.Tensor:
    """``exp(gc_i - gc_j)`` for j <= i, else 0; gc ``[..., C]`` -> ``[..., C, C]``."""
    C = gc.shape[-1]
    tril = torch.ones(C, C, dtype=torch.bool, device=gc.device).tril()
    diff = gc.unsqueeze(-1) - gc.unsqueeze(-2)
    return diff.masked_fill(~tril, float("-inf")).exp()


def chunk_gated_delta_rule_torch(q, k, v, g, beta, *, cu_seqlens_cpu, chunk_size=64, scale=None,
                                 initial_state=None, output_final_state=False):
    """Varlen gated delta rule. q, k ``[N, H, K]``; v ``[N, HV, V]``; g, beta ``[N, HV]``;
    initial_state ``[S, HV, K, V]`` (fp32) or None. Returns (o ``[N, HV, V]``, final ``[S, HV, K, V]``
    fp32 or None)."""
    C, dtype = chunk_size, v.dtype
    HV, H = v.shape[1], q.shape[1]
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    if HV != H:
        q, k = q.repeat_interleave(HV // H, dim=1), k.repeat_interleave(HV // H, dim=1)
    f32 = [_acc(x) for x in (q, k, v, g, beta)]
    (q, k, v, g, beta), flat, n = _to_chunks(f32, cu_seqlens_cpu, C)
    # [S, n, C, H, D] -> [S, H, n, C, D]
    q, k, v = (x.permute(0, 3, 1, 2, 4) for x in (q, k, v))
    g, beta = (x.permute(0, 3, 1, 2) for x in (g, beta))
    q = q * scale
    gc = g.cumsum(-1)
    decay = _decay_matrix(gc)
    kb = k * beta.unsqueeze(-1)
    strict = torch.ones(C, C, dtype=torch.bool, device=q.device).tril(-1)
    A = ((kb @ k.transpose(-1, -2)) * decay).masked_fill(~strict, 0)
    eye = torch.eye(C, dtype=A.dtype, device=A.device)
    rhs = torch.cat([v * beta.unsqueeze(-1), kb * gc.exp().unsqueeze(-1)], dim=-1)
    uw = torch.linalg.solve_triangular(A + eye, rhs, upper=False, unitriangular=True)
    u, w = uw[..., :v.shape[-1]], uw[..., v.shape[-1]:]
    attn = (q @ k.transpose(-1, -2)) * decay
    S_, Hh, _, _, K = k.shape
    state = (_acc(initial_state) if initial_state is not None
             else q.new_zeros(S_, Hh, K, v.shape[-1]))
    outs = []
    for i in range(n):
        v_new = u[:, :, i] - w[:, :, i] @ state
        outs.append((q[:, :, i] * gc[:, :, i].exp().unsqueeze(-1)) @ state + attn[:, :, i] @ v_new)
        last = gc[:, :, i, -1:]
        state = state * last.exp().unsqueeze(-1) + \
            (k[:, :, i] * (last - gc[:, :, i]).exp().unsqueeze(-1)).transpose(-1, -2) @ v_new
    o = torch.stack(outs, dim=2).permute(0, 2, 3, 1, 4)  # [S, n, C, H, V]
    return _from_chunks(o, flat).to(dtype), (state if output_final_state else None)


def chunk_simple_gla_torch(q, k, v, g, *, cu_seqlens_cpu, chunk_size=64, scale=None,
                           initial_state=None, output_final_state=False):
    """Varlen scalar-gated linear attention (Mamba2's SSD). q, k ``[N, H, K]``; v ``[N, H, V]``;
    g ``[N, H]`` (log decay); initial_state ``[S, H, K, V]`` or None."""
    C, dtype = chunk_size, v.dtype
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    f32 = [_acc(x) for x in (q, k, v, g)]
    (q, k, v, g), flat, n = _to_chunks(f32, cu_seqlens_cpu, C)
    q, k, v = (x.permute(0, 3, 1, 2, 4) for x in (q, k, v))
    g = g.permute(0, 3, 1, 2)
    q = q * scale
    gc = g.cumsum(-1)
    attn = (q @ k.transpose(-1, -2)) * _decay_matrix(gc)
    S_, Hh, _, _, K = k.shape
    state = (_acc(initial_state) if initial_state is not None
             else q.new_zeros(S_, Hh, K, v.shape[-1]))
    outs = []
    for i in range(n):
        outs.append((q[:, :, i] * gc[:, :, i].exp().unsqueeze(-1)) @ state + attn[:, :, i] @ v[:, :, i])
        last = gc[:, :, i, -1:]
        state = state * last.exp().unsqueeze(-1) + \
            (k[:, :, i] * (last - gc[:, :, i]).exp().unsqueeze(-1)).transpose(-1, -2) @ v[:, :, i]
    o = torch.stack(outs, dim=2).permute(0, 2, 3, 1, 4)
    return _from_chunks(o, flat).to(dtype), (state if output_final_state else None)
