"""Clipped policy-gradient objectives (PPO / GRPO) with KL and entropy terms, on flat per-token tensors.

Every normaliser is a property of the GLOBAL batch (all microbatches and DP ranks), passed in
as ``global_num_tokens`` / ``global_num_sequences`` / ``global_max_len``; per-sequence
reductions only ever see whole trajectories. Hence the loss is identical whether or not the
batch was tree-packed, and summing the losses of microbatches equals the full-batch loss.
"""
from __future__ import annotations

from typing import Sequence

import torch

from .batch import RLBatch

LOSS_TYPES = ("grpo", "ppo")
LOSS_AGG_MODES = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm")
KL_ESTIMATORS = ("k1", "k3", "low_var_kl")
_LOG_RATIO_CLAMP = 20.0  # as verl: guards exp() overflow; no gradient beyond it


def kl_penalty(logprobs: torch.Tensor, ref_logprobs: torch.Tensor, estimator: str = "k1") -> torch.Tensor:
    """Per-token KL(pi || ref) estimate, same shape as the inputs.

    k1 = logp - ref; k3 = (r - 1) - log r with r = exp(ref - logp); low_var_kl = k3 with the log
    ratio clamped to +-20 and the result to [-10, 10] (verl).
    """
    if estimator == "k1":
        return logprobs - ref_logprobs
    if estimator in ("k3", "low_var_kl"):
        log_r = ref_logprobs - logprobs
        if estimator == "low_var_kl":
            log_r = log_r.clamp(-_LOG_RATIO_CLAMP, _LOG_RATIO_CLAMP)
        kl = torch.expm1(log_r) - log_r
        return kl.clamp(-10.0, 10.0) if estimator == "low_var_kl" else kl
    raise ValueError(f"kl_estimator must be one of {KL_ESTIMATORS}, got {estimator!r}")


def aggregate(values: torch.Tensor, batch: RLBatch, loss_agg_mode: str = "token-mean", *,
              global_num_tokens: float | None = None, global_num_sequences: float | None = None,
              global_max_len: float | None = None, loss_scale_factor: float | None = None) -> torch.Tensor:
    """Reduce per-token ``values [N]`` over masked tokens to a scalar (verl's agg modes).

    token-mean: sum / T; seq-mean-token-mean: sum_i(mean_i) / S; seq-mean-token-sum: sum_i(sum_i) / S;
    seq-mean-token-sum-norm: sum / (S * max_len), or sum / loss_scale_factor when given.
    T / S / max_len default to this batch's ``num_tokens`` / ``num_sequences`` / ``max_len``; pass the
    global ones (ints or all-reduced tensors) so microbatch losses add up to the full-batch loss. Unmasked entries are
    ignored (even if inf/NaN); S counts trajectories with at least one masked token.
    """
    batch.require("loss_mask")
    mask = batch.loss_mask
    v = torch.where(mask, values, torch.zeros((), dtype=values.dtype, device=values.device))
    T = batch.num_tokens if global_num_tokens is None else global_num_tokens
    S = batch.num_sequences if global_num_sequences is None else global_num_sequences
    if loss_agg_mode == "token-mean":
        return v.sum() / _at_least_one(T)
    if loss_agg_mode == "seq-mean-token-mean":
        seq_sum = v.new_zeros(batch.batch_size).index_add(0, batch.seq_index, v)
        seq_cnt = torch.zeros(batch.batch_size, dtype=v.dtype, device=v.device).index_add(
            0, batch.seq_index, mask.to(v.dtype))
        return (seq_sum / seq_cnt.clamp(min=1)).sum() / _at_least_one(S)
    if loss_agg_mode == "seq-mean-token-sum":
        return v.sum() / _at_least_one(S)
    if loss_agg_mode == "seq-mean-token-sum-norm":
        if loss_scale_factor is None:
            loss_scale_factor = _at_least_one(S) * (batch.max_len if global_max_len is None else global_max_len)
        return v.sum() / loss_scale_factor
    raise ValueError(f"loss_agg_mode must be one of {LOSS_AGG_MODES}, got {loss_agg_mode!r}")


def _at_least_one(x):
    return x.clamp(min=1) if isinstance(x, torch.Tensor) else max(x, 1)


def _masked_mean(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    x = torch.where(mask, x, torch.zeros((), dtype=x.dtype, device=x.device))
    return (x.sum() / mask.sum().clamp(min=1)).detach()


def policy_loss(
    logprobs: Sequence[torch.Tensor] | torch.Tensor,
    batch: RLBatch,
    *,
    loss_type: str = "grpo",
    clip_eps: float = 0.2,
    clip_eps_high: float | None = None,
    dual_clip_c: float | None = None,
    loss_agg_mode: str = "token-mean",
    kl_coef: float = 0.0,
    kl_estimator: str = "k1",
    entropy: Sequence[torch.Tensor] | torch.Tensor | None = None,
    entropy_coef: float = 0.0,
    global_num_tokens: float | None = None,
    global_num_sequences: float | None = None,
    global_max_len: float | None = None,
    loss_scale_factor: float | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Clipped surrogate + ``kl_coef`` * KL(pi||ref) - ``entropy_coef`` * entropy, aggregated.

    logprobs: per-trajectory ``[n_i]`` (``tree_token_logprobs`` output) or flat ``[N]``; entropy likewise.
    Per token: r = exp(logp - old), pg = max(-A r, -A clip(r, 1 - clip_eps, 1 + clip_eps_high));
    with ``dual_clip_c`` (> 1), pg = min(pg, -A c) where A < 0. ``loss_type`` "ppo" needs
    ``old_logprobs``; "grpo" uses them when present and is otherwise on-policy (old = logp.detach()).
    KL (needs ``ref_logprobs`` when ``kl_coef != 0``) uses ``kl_estimator``. Aggregation and the
    ``global_*`` normalisers: see :func:`aggregate`.

    Returns (scalar loss, metrics): detached 0-dim tensors, token means over this batch's masked
    tokens (pg_clipfrac, pg_clipfrac_lower, ppo_kl = mean(old - logp), ratio_mean/min/max,
    kl, entropy) and the aggregated pg_loss / kl_loss / entropy_loss terms.
    """
    if loss_type not in LOSS_TYPES:
        raise ValueError(f"loss_type must be one of {LOSS_TYPES}, got {loss_type!r}")
    if dual_clip_c is not None and dual_clip_c <= 1.0:
        raise ValueError(f"dual_clip_c must be > 1, got {dual_clip_c}")
    if clip_eps < 0 or (clip_eps_high is not None and clip_eps_high < 0):
        raise ValueError(f"clip_eps and clip_eps_high must be >= 0, got {clip_eps} and {clip_eps_high}")
    need = ["loss_mask", "advantages"]
    if loss_type == "ppo":
        need.append("old_logprobs")
    if kl_coef != 0.0:
        need.append("ref_logprobs")
    batch.require(*need)

    logp = batch.flatten(logprobs, "logprobs").float()
    mask, adv = batch.loss_mask, batch.advantages
    zero = torch.zeros((), dtype=logp.dtype, device=logp.device)
    agg = dict(batch=batch, loss_agg_mode=loss_agg_mode, global_num_tokens=global_num_tokens,
               global_num_sequences=global_num_sequences, global_max_len=global_max_len,
               loss_scale_factor=loss_scale_factor)

    old = batch.old_logprobs if batch.old_logprobs is not None else logp.detach()
    # Zero the log-ratio off the mask first, so garbage there cannot make NaN gradients.
    log_ratio = torch.where(mask, logp - old, zero).clamp(-_LOG_RATIO_CLAMP, _LOG_RATIO_CLAMP)
    ratio = torch.exp(log_ratio)
    eps_low, eps_high = clip_eps, clip_eps if clip_eps_high is None else clip_eps_high
    pg1 = -adv * ratio
    pg2 = -adv * ratio.clamp(1.0 - eps_low, 1.0 + eps_high)
    pg = torch.maximum(pg1, pg2)
    clipped = pg2 > pg1
    if dual_clip_c is not None:
        pg3 = -adv * dual_clip_c
        lower = (adv < 0) & (pg > pg3)
        pg = torch.where(adv < 0, torch.minimum(pg, pg3), pg)
    else:
        lower = torch.zeros_like(mask)

    pg_loss = aggregate(pg, **agg)
    loss = pg_loss
    metrics = {
        "pg_loss": pg_loss.detach(),
        "pg_clipfrac": _masked_mean(clipped.float(), mask),
        "pg_clipfrac_lower": _masked_mean(lower.float(), mask),
        "ppo_kl": _masked_mean(-log_ratio, mask),
        "ratio_mean": _masked_mean(ratio, mask),
        "ratio_max": torch.where(mask, ratio, zero + (-torch.inf if batch.num_tokens else 1.0)).max().detach(),
        "ratio_min": torch.where(mask, ratio, zero + (torch.inf if batch.num_tokens else 1.0)).min().detach(),
    }
    if batch.ref_logprobs is not None:
        kl = kl_penalty(logp, torch.where(mask, batch.ref_logprobs, logp.detach()), kl_estimator)
        metrics["kl"] = _masked_mean(kl, mask)
        if kl_coef != 0.0:
            kl_loss = aggregate(kl, **agg)
            loss = loss + kl_coef * kl_loss
            metrics["kl_loss"] = kl_loss.detach()
    if entropy is not None:
        ent = batch.flatten(entropy, "entropy").float()
        ent_loss = aggregate(ent, **agg)
        metrics["entropy"] = _masked_mean(ent, mask)
        metrics["entropy_loss"] = ent_loss.detach()
        if entropy_coef != 0.0:
            loss = loss - entropy_coef * ent_loss
    metrics["loss"] = loss.detach()
    return loss, metrics
