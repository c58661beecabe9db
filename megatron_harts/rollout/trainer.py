"""The trainer side of the RL loop: a Megatron-Core ``HybridModel`` trained on rollout trees.

:class:`HartsTrainer` builds the Megatron model that matches a Hugging Face Qwen3-Next config
(``megatron.convert``: the engine serves the HF layout, the trainer trains the Megatron one),
and runs one optimizer step per call of :meth:`train_step` on the step's trajectories:
trajectories -> trees (one per group) -> microbatches (``megatron.batch.build_step``: tree packs,
or with ``tree=False`` the trajectory-wise THD baseline on the same code path) -> forward,
per-trajectory log-probs (``tree_token_logprobs``), the clipped policy loss with the step's global
normalisers (``rl.policy_loss``), backward, AdamW. The forward also yields the trainer's log-probs
of the sampled tokens under the weights the engine sampled with, so the rollout-train mismatch
(``|trainer - engine|`` on generated tokens) is measured every step at no extra cost.

This is the single-process trainer of the loop (CPU through ``cpu_shim``, or one GPU); users who
train with ``torchrun``/SLURM run ``scripts/pretrain_hybrid_harts.py`` on the JSONL the loop
writes (``scripts/launch_torchrun.sh``).
"""
from __future__ import annotations

import dataclasses
import logging
import math
import time
from typing import Sequence

import numpy as np
import torch

from ..megatron import convert, cpu_shim
from ..megatron.batch import TreeMicrobatch, build_step, model_inputs
from ..ops import tree_token_logprobs
from ..rl import policy_loss
from ..tree import Trajectory

logger = logging.getLogger(__name__)


#: the RL step's settings and their defaults, shared by :class:`HartsTrainer` and the elastic pool's
#: Megatron replicas (``libra.megatron_replica.MegatronReplica(rl=...)``): tree packs or THD,
#: compact tokens per microbatch, gradient-norm clip, ``policy_loss`` keyword arguments, the ratio's
#: denominator (``trainer`` or ``engine``)
RL_STEP_DEFAULTS = {"tree": True, "microbatch_tokens": 1 << 16, "grad_clip": 1.0, "loss": None, "old_logprobs": "trainer"}
#: AdamW betas of the RL step (both trainers)
ADAM_BETAS = (0.9, 0.99)


def rl_loss_kwargs(loss: dict | None, old_logprobs: str) -> dict:
    """``policy_loss`` keyword arguments (GRPO, token-mean unless ``loss`` says otherwise); checks
    ``old_logprobs``."""
    if old_logprobs not in ("trainer", "engine"):
        raise ValueError(f"old_logprobs must be 'trainer' or 'engine', got {old_logprobs!r}")
    return dict(loss_type="grpo", loss_agg_mode="token-mean", **(loss or {}))


class HartsTrainer:
    """One Megatron model + optimizer. ``hf_config``: Qwen3-Next config kwargs (what the engine
    loads); ``tree``: HARTS tree packing (else trajectory-wise THD packs); ``microbatch_tokens``:
    target compact tokens per microbatch (the step is split into at least that many, at most one
    tree a microbatch); ``loss``: :func:`~megatron_harts.rl.policy_loss` keyword arguments.
    ``device="cuda"`` trains in fp32 parameters on one GPU (the loop's small models), CPU through
    ``cpu_shim``; ``attention_backend``: the tree attention kernel (``auto``, ``torch``, ``flex``;
    see ``ops.attention``), the same for tree and trajectory packs; ``old_logprobs``: the ratio's
    denominator: ``trainer`` (this forward's own log-probs, detached: one on-policy update, ratio 1,
    as verl recomputes them) or ``engine`` (the rollout engine's: the ratio then also corrects for
    the rollout-train mismatch, and clipping can zero the gradient of mismatched tokens). The
    mismatch is measured either way."""

    def __init__(self, hf_config: dict, *, tree: bool = RL_STEP_DEFAULTS["tree"], lr: float = 1e-3,
                 weight_decay: float = 0.0, grad_clip: float = RL_STEP_DEFAULTS["grad_clip"], chunk_size: int = 16,
                 microbatch_tokens: int = RL_STEP_DEFAULTS["microbatch_tokens"], device: str = "cpu", seed: int = 0,
                 loss: dict | None = None, attention_backend: str = "auto",
                 old_logprobs: str = RL_STEP_DEFAULTS["old_logprobs"]):
        self.loss_kwargs = rl_loss_kwargs(loss, old_logprobs)
        self.old_logprobs = old_logprobs
        self.hf_config, self.tree, self.chunk_size = dict(hf_config), tree, chunk_size
        self.microbatch_tokens, self.grad_clip, self.device = microbatch_tokens, grad_clip, device
        self.args = convert.hf_config_to_megatron(self.hf_config)
        self._owns_cpu = False
        if device == "cpu":
            # several trainers in one process (tests: tree vs baseline) share the CPU setup; the
            # first one owns it and tears it down
            from megatron.core import parallel_state as ps
            self._owns_cpu = not (cpu_shim.is_enabled() and ps.model_parallel_is_initialized())
            if self._owns_cpu:
                cpu_shim.init_cpu_model_parallel(1, 1, seed)
            cpu_shim.cpu_manual_seed(seed)
        else:
            from ..megatron.gpu import init_single_gpu
            init_single_gpu(seed)
        torch.manual_seed(seed)        # weights are initialised on the host (use_cpu_initialization)
        self.model = convert.build_megatron_model(self.args, tree=True)
        if device != "cpu":
            self.model = self.model.cuda()
        if attention_backend != "auto":      # e.g. "torch" (SDPA, dense ancestor mask) for small packs on
            from ..megatron.layers import TreeCoreAttention   # a GPU: no FlexAttention compile per new length
            for m in self.model.modules():
                if isinstance(m, TreeCoreAttention):
                    m.tree_attention_backend = attention_backend
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=lr, weight_decay=weight_decay, betas=ADAM_BETAS)
        self.step = 0
        logger.info("trainer: %s HybridModel %r, %.2fM params, %s", "tree-packed" if tree else "trajectory-wise",
                    self.args.pattern, sum(p.numel() for p in self.model.parameters()) / 1e6, device)

    def close(self) -> None:
        if self._owns_cpu:
            cpu_shim.destroy_cpu_model_parallel()
            self._owns_cpu = False

    @property
    def _param_device(self) -> torch.device:
        return next(self.model.parameters()).device

    def set_lr(self, lr: float) -> None:
        """Change the learning rate (e.g. after a supervised warm-up)."""
        for g in self.opt.param_groups:
            g["lr"] = lr

    # -- training ---------------------------------------------------------------------------------
    def _microbatches(self, trajectories: Sequence[Trajectory]):
        return step_microbatches(trajectories, microbatch_tokens=self.microbatch_tokens, tree=self.tree,
                                 chunk_size=self.chunk_size, step=self.step)

    def _forward(self, mb):
        """logits ``[1, T, V]`` of one microbatch (on the parameters' device)."""
        tokens, position_ids, params = model_inputs(mb)
        return self.model(tokens, position_ids, None, packed_seq_params=params)

    def train_step(self, trajectories: Sequence[Trajectory]) -> dict:
        """One optimizer step on ``trajectories`` (needs ``loss_mask`` and ``advantage``; with
        ``old_logprobs`` the mismatch statistics are measured). Returns metrics: loss, grad_norm,
        compression (trajectory / compact tokens), ``nll`` (mean negative log-prob of the trained tokens
        before the update), pack_s, fwd_bwd_s, optim_s, train_s, and
        ``logprob_mismatch_{max,mean,p99}`` (nats, |trainer - engine| over generated tokens)."""
        t0 = time.perf_counter()
        self.model.train()
        mbs = self._microbatches(trajectories)
        t_pack = time.perf_counter() - t0
        self.opt.zero_grad(set_to_none=True)
        totals = forward_backward(self._forward, mbs, self._param_device, loss_kwargs=self.loss_kwargs,
                                  old_logprobs=self.old_logprobs)
        if self.device != "cpu":
            torch.cuda.synchronize()
        t_fb = time.perf_counter() - t0 - t_pack
        grad_norm = float(torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.grad_clip))
        self.opt.step()
        if self.device != "cpu":
            torch.cuda.synchronize()
        t_all = time.perf_counter() - t0
        self.step += 1
        return totals.metrics(grad_norm=grad_norm, num_tokens=mbs[0].norms.num_tokens, microbatches=len(mbs),
                              pack_s=t_pack, fwd_bwd_s=t_fb, train_s=t_all)

    @torch.no_grad()
    def logprobs(self, trajectories: Sequence[Trajectory]) -> list[np.ndarray]:
        """Per-trajectory log-probs ``[L_i - 1]`` (token ``t`` given ``tokens[:t]``, t >= 1) under
        the current weights, tree-packed (or THD when ``tree=False``), in input order."""
        self.model.eval()
        out: dict[int, np.ndarray] = {}
        order = {id(t): i for i, t in enumerate(trajectories)}
        for mb in self._microbatches(trajectories):
            mb = mb.to(self._param_device)
            lps = tree_token_logprobs(self._forward(mb)[0], mb.pack)
            for t, lp in zip(mb.pack.trajectories, lps):
                out[order[id(t)]] = lp.float().cpu().numpy()
        return [out[i] for i in range(len(trajectories))]


def step_microbatches(trajectories: Sequence[Trajectory], *, microbatch_tokens: int, tree: bool, chunk_size: int,
                      step: int = 0, dp_size: int = 1, dp_rank: int = 0) -> list[TreeMicrobatch]:
    """DP rank ``dp_rank``'s microbatches of one step over ``trajectories`` (the whole step's, the
    same list on every rank): trees (one per group) assigned to ``dp_size`` x ``M`` microbatches
    (``megatron.batch.build_step``), ``M = max(1, min(groups // dp_size, ceil(trajectory tokens /
    (microbatch_tokens x dp_size))))`` computed identically on every rank (at most one tree a
    microbatch). Every microbatch carries the step's **global** normalisers (masked tokens,
    sequences, max length over all ranks), so the sum of the microbatch losses over microbatches
    and ranks is the step's loss however the trees are split. ``tree=False``: trajectory-wise THD."""
    groups = len({t.group_id for t in trajectories})
    if groups < dp_size:
        raise ValueError(f"{groups} groups (trees) for {dp_size} DP ranks: every rank needs at least one tree")
    total = sum(len(t) for t in trajectories)
    m = max(1, min(groups // dp_size, math.ceil(total / (microbatch_tokens * dp_size))))
    return build_step(trajectories, dp_size=dp_size, dp_rank=dp_rank, num_microbatches=m, tree_packing=tree,
                      chunk_size=chunk_size, step=step)


@dataclasses.dataclass
class StepTotals:
    """One rank's sums over its microbatches of a step: ``loss`` (its share of the step's loss),
    ``logprob_sum`` (nats, over trained tokens), trajectory / packed tokens, and ``diffs``: the
    |trainer - engine| log-prob differences ``[n]`` of its trained tokens (empty without engine
    log-probs). The elastic pool's replicas sum them over their DP group
    (``MegatronReplica._reduce_totals``)."""

    loss: float = 0.0
    logprob_sum: float = 0.0
    trajectory_tokens: int = 0
    packed_tokens: int = 0
    diffs: list = dataclasses.field(default_factory=list)

    def metrics(self, *, grad_norm: float, num_tokens: int, microbatches: int, pack_s: float, fwd_bwd_s: float,
                train_s: float) -> dict:
        """``train_step``'s metrics; ``num_tokens``: the step's (global) trained tokens."""
        d = torch.cat(self.diffs) if self.diffs else torch.zeros(0)
        out = {"loss": self.loss, "grad_norm": grad_norm, "microbatches": microbatches,
               "nll": -self.logprob_sum / max(1, num_tokens),
               "compression": self.trajectory_tokens / max(self.packed_tokens, 1),
               "trajectory_tokens": self.trajectory_tokens, "packed_tokens": self.packed_tokens,
               "pack_s": pack_s, "fwd_bwd_s": fwd_bwd_s, "optim_s": train_s - pack_s - fwd_bwd_s, "train_s": train_s}
        if d.numel():
            out.update(logprob_mismatch_max=float(d.max()), logprob_mismatch_mean=float(d.mean()),
                       logprob_mismatch_p99=float(torch.quantile(d.double(), 0.99)))
        return out


def forward_backward(forward, mbs: Sequence[TreeMicrobatch], device, *, loss_kwargs: dict,
                     old_logprobs: str = "trainer") -> StepTotals:
    """Forward and backward of one rank's microbatches: ``forward(mb)`` gives logits ``[1, T, V]``,
    per-trajectory log-probs ``[L_i - 1]`` (``tree_token_logprobs``), the clipped policy loss with the
    step's global normalisers (``rl.policy_loss``; ``old_logprobs="trainer"`` drops the engine's
    log-probs from the ratio), ``backward()`` per microbatch: each microbatch's loss is its share of
    the step's loss, so the gradients accumulate to this rank's share of the step's gradient."""
    tot = StepTotals()
    for mb in mbs:
        mb = mb.to(device)
        logprobs = tree_token_logprobs(forward(mb)[0], mb.pack)
        n = mb.norms
        rl = mb.rl if old_logprobs == "engine" else dataclasses.replace(mb.rl, old_logprobs=None)
        loss, _ = policy_loss(logprobs, rl, global_num_tokens=n.num_tokens,
                              global_num_sequences=n.num_sequences, global_max_len=n.max_len, **loss_kwargs)
        loss.backward()              # each microbatch's loss is its share of the global loss
        tot.loss += float(loss.detach())
        lp = torch.cat([x.detach().float() for x in logprobs])
        tot.logprob_sum += float(lp[mb.rl.loss_mask].sum())
        if mb.rl.old_logprobs is not None:
            tot.diffs.append((lp - mb.rl.old_logprobs)[mb.rl.loss_mask].abs().cpu())
        tot.trajectory_tokens += mb.pack.num_trajectory_tokens
        tot.packed_tokens += mb.pack.num_tokens
    return tot
