"""Token-by-token recurrent forms: the ground truth tests compare the tree ops against.

Each takes ONE sequence (no tree, no chunks) and loops over its tokens; slow by design.
"""
from __future__ import annotations

import torch


def _f(*xs):
    """Promote to at least fp32 (float64 inputs stay float64)."""
    return [x.to(torch.promote_types(x.dtype, torch.float32)) for x in xs]


def recurrent_gated_delta_rule(q, k, v, g, beta, *, scale=None, initial_state=None):
    """q, k ``[L, H, K]``; v ``[L, HV, V]``; g, beta ``[L, HV]`` -> (o ``[L, HV, V]``, state).

    ``S_t = exp(g_t) S_{t-1};  S_t += beta_t k_t (v_t - S_t^T k_t)^T;  o_t = scale S_t^T q_t``.
    """
    HV, H = v.shape[1], q.shape[1]
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    q, k, v, g, beta = _f(q.repeat_interleave(HV // H, 1), k.repeat_interleave(HV // H, 1), v, g, beta)
    S = _f(initial_state)[0] if initial_state is not None else q.new_zeros(HV, q.shape[-1], v.shape[-1])
    out = []
    for t in range(q.shape[0]):
        S = S * g[t].exp()[:, None, None]
        pred = torch.einsum("hkv,hk->hv", S, k[t])
        S = S + torch.einsum("hk,hv->hkv", k[t] * beta[t][:, None], v[t] - pred)
        out.append(torch.einsum("hkv,hk->hv", S, q[t] * scale))
    return torch.stack(out), S


def recurrent_simple_gla(q, k, v, g, *, scale=None, initial_state=None):
    """q, k ``[L, H, K]``; v ``[L, H, V]``; g ``[L, H]``: ``S_t = exp(g_t) S_{t-1} + k_t v_t^T``,
    ``o_t = scale S_t^T q_t``."""
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    q, k, v, g = _f(q, k, v, g)
    S = _f(initial_state)[0] if initial_state is not None else q.new_zeros(q.shape[1], q.shape[-1], v.shape[-1])
    out = []
    for t in range(q.shape[0]):
        S = S * g[t].exp()[:, None, None] + torch.einsum("hk,hv->hkv", k[t], v[t])
        out.append(torch.einsum("hkv,hk->hv", S, q[t] * scale))
    return torch.stack(out), S


def causal_conv1d(x, weight, bias=None, activation=None):
    """x ``[L, D]``, weight ``[D, W]``: ``y_t = sum_i weight[:, i] * x_{t - W + 1 + i}`` (zeros before 0)."""
    W = weight.shape[1]
    xp = torch.cat([x.new_zeros(W - 1, x.shape[1]), x])
    y = sum(xp[i:i + x.shape[0]] * weight[:, i] for i in range(W))
    if bias is not None:
        y = y + bias
    return torch.nn.functional.silu(y) if activation in ("silu", "swish") else y


def causal_attention(q, k, v, *, scale=None):
    """q ``[L, Hq, D]``, k/v ``[L, Hkv, D]``: plain causal softmax attention (GQA by repetition)."""
    rep = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    q, k, v = _f(q, k, v)
    s = torch.einsum("qhd,khd->hqk", q, k) * scale
    L = q.shape[0]
    s = s.masked_fill(~torch.ones(L, L, dtype=torch.bool, device=q.device).tril(), float("-inf"))
    return torch.einsum("hqk,khd->qhd", s.softmax(-1), v)


def token_logprobs(logits, tokens):
    """logits ``[L, V]``, tokens ``[L]`` -> ``[L - 1]``: log p(tokens[t] | tokens[:t]) for t >= 1."""
    return torch.log_softmax(_f(logits)[0][:-1], -1).gather(-1, tokens[1:, None]).squeeze(-1)
