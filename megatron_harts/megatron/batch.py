"""Per-microbatch inputs and the RL loss for Megatron's ``forward_step`` / ``loss_func``.

Data flow of one optimizer step (every rank computes the same plan from the same trajectories,
so no collective is needed and every TP/PP rank sees the same packs)::

    trajectories of the step -> trees (one per group) -> assign to DP ranks x M microbatches
    -> TreePack per microbatch (``pack``; baseline: ``pack_trajectories``) -> TreeMicrobatch

``TreeMicrobatch`` carries the pack, the per-trajectory RL fields (:class:`RLBatch`) and the
**global** normalisers of the step (masked tokens, sequences, max length over all trajectories
of all DP ranks and microbatches), so each microbatch's loss is its exact share of the
full-batch loss: summing the microbatch losses over microbatches and DP ranks gives the loss of
the whole step, whatever the packing.

Megatron 0.19.2 contract (``core/pipeline_parallel/schedules.py:forward_step_calc_loss``,
``distributed/finalize_model_grads.py``): ``loss_func(output_tensor)`` returns
``(loss, num_tokens, report)``; Megatron divides ``loss`` by ``num_tokens`` and by the number of
microbatches M (unless ``calculate_per_token_loss``, where it instead divides the gradients by
``num_tokens`` summed over microbatches and DP) and averages gradients over DP. With
``num_tokens = 1`` and ``loss = share * M * dp`` both modes give the gradient of the sum of the
shares, i.e. of the global loss. ``report`` values are ``[numerator, denominator]`` pairs that
Megatron sums over microbatches and DP ranks before dividing.
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Iterator, Sequence

import numpy as np
import torch

from ..ops import tree_token_logprobs
from ..packing import TreePack, pack, pack_trajectories
from ..rl import RLBatch, policy_loss
from ..tree import RolloutTree, Trajectory, trees_from_trajectories
from .packed_seq import TreePackedSeqParams, tree_packed_seq_params

logger = logging.getLogger(__name__)


@dataclass
class GlobalNormalisers:
    """Loss normalisers of the whole step (all DP ranks and microbatches)."""

    num_tokens: int          # masked (trained) tokens
    num_sequences: int       # trajectories with at least one masked token
    max_len: int             # longest trajectory (in predicted tokens, L - 1)

    @classmethod
    def of(cls, trajectories: Sequence[Trajectory]) -> "GlobalNormalisers":
        b = RLBatch.from_trajectories(trajectories)
        return cls(b.num_tokens, b.num_sequences, b.max_len)


@dataclass
class TreeMicrobatch:
    """One microbatch: ``pack`` (CPU or device), ``rl`` aligned with ``pack.trajectories``,
    the step's ``norms``, and ``num_microbatches`` / ``dp_size`` for Megatron's loss scaling;
    ``stats``: this pack's ``trajectory_tokens`` / ``tokens`` and the whole step's ``step_tokens``
    (compact tokens of the step's trees before the planner splits any, whose parts replay their
    shared prefix; trajectory tokens without tree packing)."""

    pack: TreePack
    rl: RLBatch
    norms: GlobalNormalisers
    num_microbatches: int
    dp_size: int
    step: int = 0
    stats: dict = field(default_factory=dict)

    def to(self, device) -> "TreeMicrobatch":
        return TreeMicrobatch(self.pack.to(device), self.rl.to(device), self.norms, self.num_microbatches,
                              self.dp_size, self.step, self.stats)


def greedy_bins(trees: Sequence[RolloutTree], num_bins: int) -> list[list[int]]:
    """Tree indices per bin (bin = dp_rank * M + microbatch), longest-processing-time first on
    compact tokens. Every bin gets >= 1 tree."""
    if len(trees) < num_bins:
        raise ValueError(f"{len(trees)} trees for {num_bins} microbatches (DP x M): every microbatch needs "
                         "at least one tree; raise --tree-groups-per-step or lower --global-batch-size")
    cost = np.array([t.num_tokens for t in trees])
    load = np.zeros(num_bins, dtype=np.int64)
    bins: list[list[int]] = [[] for _ in range(num_bins)]
    for i in np.argsort(-cost, kind="stable"):
        b = int(np.argmin(load))
        bins[b].append(int(i))
        load[b] += cost[i]
    return [sorted(b) for b in bins]


def rank_microbatches(trees: Sequence[RolloutTree], *, dp_size: int, dp_rank: int, num_microbatches: int,
                      planner: str = "greedy", capacity: int | None = None,
                      chunk_size: int = 64) -> list[list[RolloutTree]]:
    """The trees of each of ``dp_rank``'s ``num_microbatches`` microbatches, in slot order.

    ``greedy``: :func:`greedy_bins`. ``harts``: :func:`megatron_harts.planner.plan` (cost model,
    splits trees over ``capacity`` compact + replay tokens at branch nodes; default capacity: no
    limit). Computed identically on every rank from the same step data.
    """
    if planner == "greedy":
        bins = greedy_bins(trees, dp_size * num_microbatches)
        return [[trees[i] for i in b] for b in bins[dp_rank * num_microbatches:(dp_rank + 1) * num_microbatches]]
    if planner != "harts":
        raise ValueError(f"--tree-planner must be 'harts' or 'greedy', got {planner!r}")
    from ..planner import plan
    cap = capacity or sum(t.num_tokens for t in trees) + chunk_size * sum(len(t) for t in trees)
    mbs = plan(trees, dp_size=dp_size, microbatch_capacity=cap, num_microbatches=num_microbatches,
               chunk_size=chunk_size).microbatches(trees, dp_rank)
    if any(not mb for mb in mbs):
        raise ValueError(f"the planner left a microbatch of rank {dp_rank} empty: {len(trees)} trees are too few "
                         f"for {dp_size} ranks x {num_microbatches} microbatches; raise --tree-groups-per-step")
    return mbs


def build_step(trajectories: Sequence[Trajectory], *, dp_size: int, dp_rank: int, num_microbatches: int,
               tree_packing: bool = True, chunk_size: int = 64, planner: str = "greedy",
               capacity: int | None = None, step: int = 0) -> list[TreeMicrobatch]:
    """The ``num_microbatches`` microbatches of ``dp_rank`` for one step over ``trajectories``
    (the whole step's trajectories, identical on all ranks)."""
    trees = trees_from_trajectories(trajectories)
    norms = GlobalNormalisers.of(trajectories)
    layout = pack if tree_packing else pack_trajectories
    step_tokens = sum(t.num_tokens for t in trees) if tree_packing else sum(len(t) for t in trajectories)
    out = []
    for mb_trees in rank_microbatches(trees, dp_size=dp_size, dp_rank=dp_rank, num_microbatches=num_microbatches,
                                      planner=planner, capacity=capacity, chunk_size=chunk_size):
        p = layout(mb_trees, chunk_size=chunk_size)
        out.append(TreeMicrobatch(p, RLBatch.from_trajectories(p.trajectories), norms, num_microbatches, dp_size,
                                  step, {"trajectory_tokens": p.num_trajectory_tokens, "tokens": p.num_tokens,
                                         "step_tokens": step_tokens}))
    return out


def group_trajectories(trajectories: Sequence[Trajectory]) -> list[list[Trajectory]]:
    """Trajectories by ``group_id`` in order of first appearance (ungrouped ones alone)."""
    return [t.records for t in trees_from_trajectories(trajectories)]


class TreeMicrobatchIterator:
    """Yields this DP rank's :class:`TreeMicrobatch` es, ``num_microbatches`` per step, forever
    (cycling over the groups; ``groups_per_step`` groups a step). Logs per step, on info level:
    compression, trajectory tokens and trajectory tokens/s (wall time between steps)."""

    def __init__(self, groups: Sequence[Sequence[Trajectory]], *, groups_per_step: int, dp_size: int, dp_rank: int,
                 num_microbatches: int, tree_packing: bool = True, chunk_size: int = 64, planner: str = "greedy",
                 max_tokens: int | None = None, log: bool = True):
        if groups_per_step > len(groups):
            raise ValueError(f"groups_per_step={groups_per_step} exceeds the {len(groups)} groups in the data")
        self.groups, self.groups_per_step = list(groups), groups_per_step
        self.kw = dict(dp_size=dp_size, dp_rank=dp_rank, num_microbatches=num_microbatches,
                       tree_packing=tree_packing, chunk_size=chunk_size, planner=planner, capacity=max_tokens)
        self.max_tokens, self.log = max_tokens, log
        self.step, self._queue, self._t = 0, [], None

    def _step_trajectories(self) -> list[Trajectory]:
        n = len(self.groups)
        start = (self.step * self.groups_per_step) % n
        idx = [(start + j) % n for j in range(self.groups_per_step)]
        return [t for i in idx for t in self.groups[i]]

    def __iter__(self) -> Iterator[TreeMicrobatch]:
        return self

    def __next__(self) -> TreeMicrobatch:
        if not self._queue:
            trajs = self._step_trajectories()
            self._queue = build_step(trajs, step=self.step, **self.kw)
            if self.log:
                now = time.perf_counter()
                traj_tokens = sum(len(t) for t in trajs)
                compact = self._queue[0].stats["step_tokens"]      # the step's trees, unsplit
                rate = f", {traj_tokens / (now - self._t):.1f} trajectory tokens/s" if self._t else ""
                logger.info("step %d: %d trajectories, %d trajectory tokens, %d compact tokens, "
                            "compression %.2fx%s", self.step, len(trajs), traj_tokens, compact,
                            traj_tokens / max(compact, 1), rate)
                self._t = now
            if self.max_tokens:
                for mb in self._queue:
                    if mb.pack.num_tokens > self.max_tokens:
                        logger.warning("step %d: a microbatch has %d tokens > --tree-max-tokens %d",
                                       self.step, mb.pack.num_tokens, self.max_tokens)
            self.step += 1
        return self._queue.pop(0)


def model_inputs(mb: TreeMicrobatch) -> tuple[torch.Tensor, torch.Tensor, TreePackedSeqParams]:
    """``(tokens [1, T], position_ids [1, T], packed_seq_params)`` for
    ``HybridModel(tokens, position_ids, None, packed_seq_params=...)`` (on ``mb.pack.device``)."""
    p = mb.pack
    return p.tokens[None], p.position_ids[None], tree_packed_seq_params(p)


def rl_loss(logits: torch.Tensor, mb: TreeMicrobatch, *, tp_group=None, **loss_kwargs):
    """Megatron ``loss_func`` body. logits ``[1, T, V/tp]`` (vocab-parallel over ``tp_group``)
    -> ``(loss * M * dp, num_tokens=1 (int), report)``; see the module docstring.

    ``loss`` = :func:`policy_loss` of this microbatch's trajectories with the step's global
    normalisers (``loss_kwargs``: loss_type, clip_eps, loss_agg_mode, kl_coef, ...). ``report``:
    ``rl loss`` (global step loss) and ``rl loss negated`` (Megatron's iteration line prints only
    non-negative averages, and policy losses are often negative), token-mean metrics (pg_clipfrac, ppo_kl, kl, ...),
    ``compression`` (trajectory / compact tokens over the step).
    """
    if logits.dim() != 3 or logits.shape[0] != 1:
        raise ValueError(f"expected logits [1, T, V/tp], got {tuple(logits.shape)}")
    logprobs = tree_token_logprobs(logits[0], mb.pack, tp_group=tp_group)
    n = mb.norms
    loss, metrics = policy_loss(logprobs, mb.rl, global_num_tokens=n.num_tokens,
                                global_num_sequences=n.num_sequences, global_max_len=n.max_len, **loss_kwargs)
    scale = mb.num_microbatches * mb.dp_size
    dev = loss.device
    one = torch.ones((), dtype=torch.float32, device=dev)
    ntok = torch.tensor(float(mb.rl.num_tokens), device=dev)
    rl = torch.stack([loss.detach().float() * scale, one])
    # Megatron's training_log prints only averages >= 0: exactly one of the two shows a policy loss.
    report = {"rl loss": rl, "rl loss negated": torch.stack([-rl[0], rl[1]])}
    for k, v in metrics.items():
        if k not in ("loss", "pg_loss", "kl_loss", "entropy_loss", "ratio_max", "ratio_min"):
            report[k] = torch.stack([v.float() * ntok, ntok])
    report["compression"] = torch.tensor([float(mb.pack.num_trajectory_tokens), float(mb.pack.num_tokens)],
                                         device=dev)
    return loss * scale, torch.ones((), dtype=torch.int, device=dev), report
