"""DP rank x microbatch x slot planning of a step's rollout trees (docs/design.md#10-planner).

1. Statistics per tree (compact / replay tokens, attention pairs, rounds); trees whose memory
   (compact + replay tokens) exceeds ``microbatch_capacity`` are cut into contiguous DFS ranges
   of trajectories (split at branch nodes; the shared prefix is charged to every part).
2. LPT: parts by decreasing cost go to the cheapest rank that has a microbatch with room, into
   its cheapest such microbatch. ``num_microbatches=None`` starts at the memory lower bound
   ``ceil(sum memory / (dp_size * capacity))`` and grows until everything fits.
3. Refinement: moves and swaps between the most loaded rank and the least loaded ones while
   they lower the maximum.
4. Slot schedule: each rank runs its microbatches by decreasing cost, so slot s holds the s-th
   costliest microbatch of every rank.

Everything is a pure function of the input (stable sorts, index tie-breaks): every rank can
compute the same plan.
"""
from __future__ import annotations

import heapq
import logging
from dataclasses import dataclass, field
from typing import Sequence

import numpy as np

from .cost import CostModel
from .split import Parts, TreeStats, split_parts, tree_stats

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Part:
    """A tree (``trajectories is None``) or the sub-tree of the given trajectories (input indices
    in the tree, ascending) after a split."""

    tree: int
    trajectories: tuple[int, ...] | None = None


@dataclass
class Plan:
    """``ranks[r][s]``: the parts of the microbatch rank r runs at slot s (same count on every
    rank; a microbatch may be empty when there are fewer parts than microbatches).
    cost: float ``[R, M]`` FLOPs (fwd + bwd) per microbatch; memory: int ``[R, M]`` compact +
    replay tokens; compact_tokens / trajectory_tokens: totals over all parts (duplicated prefixes
    of split trees counted in compact_tokens)."""

    ranks: list[list[list[Part]]]
    cost: np.ndarray
    memory: np.ndarray
    capacity: int
    compact_tokens: int
    trajectory_tokens: int
    num_split_trees: int
    cost_model: CostModel = field(default_factory=CostModel)

    @property
    def dp_size(self) -> int:
        return len(self.ranks)

    @property
    def num_microbatches(self) -> int:
        return len(self.ranks[0])

    def microbatches(self, trees: Sequence, rank: int) -> list[list]:
        """Rank ``rank``'s microbatches in slot order as lists of RolloutTree (sub-trees are new
        RolloutTrees of their trajectory records)."""
        from ..tree import RolloutTree
        return [[trees[p.tree] if p.trajectories is None else
                 RolloutTree([trees[p.tree].records[i] for i in p.trajectories]) for p in mb]
                for mb in self.ranks[rank]]

    def stats(self) -> dict:
        """imbalance: max rank cost / mean; slot_imbalance: sum over slots of the max rank cost
        / sum of the mean (1 = ranks in lockstep lose nothing); max_slot_imbalance: worst slot's
        max / mean; compression: trajectory tokens / compact tokens; fill: memory / capacity."""
        rank_cost = self.cost.sum(1)
        mean_slot = self.cost.mean(0)
        return dict(dp_size=self.dp_size, num_microbatches=self.num_microbatches,
                    imbalance=float(rank_cost.max() / max(rank_cost.mean(), 1e-30)),
                    slot_imbalance=float(self.cost.max(0).sum() / max(mean_slot.sum(), 1e-30)),
                    max_slot_imbalance=float((self.cost.max(0) / np.maximum(mean_slot, 1e-30)).max()),
                    compression=self.trajectory_tokens / max(self.compact_tokens, 1),
                    fill=float(self.memory.sum() / (self.memory.size * self.capacity)),
                    max_memory=int(self.memory.max()), num_split_trees=self.num_split_trees,
                    max_rank_cost=float(rank_cost.max()), mean_rank_cost=float(rank_cost.mean()))


class _State:
    """Assignment under construction: part -> flat bin ``rank * M + microbatch``; per bin the
    additive cost, memory and max rounds; bin cost = additive + per_round * rounds."""

    def __init__(self, cost, mem, rounds, per_round, R, M, cap):
        self.cost, self.mem, self.rounds, self.pr, self.R, self.M, self.cap = cost, mem, rounds, per_round, R, M, cap
        self.bin = np.full(cost.shape[0], -1, np.int64)
        self.add = np.zeros(R * M)
        self.bmem = np.zeros(R * M, np.int64)
        self.brnd = np.zeros(R * M, np.int64)

    @property
    def bcost(self) -> np.ndarray:
        return self.add + self.pr * self.brnd

    def lpt(self) -> bool:
        """Parts by decreasing cost to the cheapest rank with room, into the microbatch where the
        result is cheapest. False when a part fits nowhere. (Plain Python lists: M is small.)"""
        M, R, cap, pr = self.M, self.R, self.cap, self.pr
        order = np.lexsort((np.arange(self.cost.shape[0]), -self.mem, -self.cost))
        add = [[0.0] * M for _ in range(R)]
        bmem = [[0] * M for _ in range(R)]
        brnd = [[0] * M for _ in range(R)]
        binof = self.bin
        heap = [(0.0, r) for r in range(R)]
        for p, c, m, k in zip(order.tolist(), self.cost[order].tolist(), self.mem[order].tolist(),
                              self.rounds[order].tolist()):
            skipped = []
            while heap:
                rc, r = heapq.heappop(heap)
                am, mm, rr = add[r], bmem[r], brnd[r]
                best, bj = None, -1
                for j in range(M):
                    if mm[j] + m <= cap:
                        v = am[j] + c + pr * (rr[j] if rr[j] > k else k)
                        if best is None or v < best:
                            best, bj = v, j
                if bj >= 0:
                    inc = c + pr * max(k - rr[bj], 0)
                    am[bj] += c
                    mm[bj] += m
                    rr[bj] = max(rr[bj], k)
                    binof[p] = r * M + bj
                    heapq.heappush(heap, (rc + inc, r))
                    break
                skipped.append((rc, r))
            else:
                return False
            for s in skipped:
                heapq.heappush(heap, s)
        self.add = np.array(add).reshape(-1)
        self.bmem = np.array(bmem, dtype=np.int64).reshape(-1)
        self.brnd = np.array(brnd, dtype=np.int64).reshape(-1)
        return True

    def _recount(self, f: int):
        mem = np.flatnonzero(self.bin == f)
        self.add[f] = self.cost[mem].sum()
        self.bmem[f] = self.mem[mem].sum()
        self.brnd[f] = self.rounds[mem].max(initial=0)

    def _best(self, a, cost_a, b, b_bins, cost_b):
        """Best move of a part in ``a`` (part indices) into a bin of ``b_bins``, or swap with a
        part in ``b``, that lowers max(cost_a, cost_b) (the two sides' totals). Round overhead is
        bounded from above: removing a part saves none. Returns (new max, p, q or -1, bin)."""
        top, pr, cap = max(cost_a, cost_b), self.pr, self.cap
        cp, mp, rp = self.cost[a], self.mem[a], self.rounds[a]
        best = (top, -1, -1, -1)
        room = cap - self.bmem[b_bins]
        inc = cp[:, None] + pr * np.maximum(rp[:, None] - self.brnd[b_bins][None, :], 0)
        inc = np.where(mp[:, None] <= room[None, :], inc, np.inf)
        j = np.argmin(inc, axis=1)
        new = np.maximum(cost_a - cp, cost_b + inc[np.arange(a.shape[0]), j])
        if new.shape[0] and new.min() < best[0]:
            i = int(np.argmin(new))
            best = (float(new[i]), int(a[i]), -1, int(b_bins[j[i]]))
        if b.shape[0] and a.shape[0]:
            cq, mq, rq = self.cost[b], self.mem[b], self.rounds[b]
            fa, fb = self.bin[a], self.bin[b]
            feas = (self.bmem[fa][:, None] - mp[:, None] + mq[None, :] <= cap) & \
                   (self.bmem[fb][None, :] - mq[None, :] + mp[:, None] <= cap)
            d = cp[:, None] - cq[None, :]
            new_a = cost_a - d + pr * np.maximum(rq[None, :] - self.brnd[fa][:, None], 0)
            new_b = cost_b + d + pr * np.maximum(rp[:, None] - self.brnd[fb][None, :], 0)
            new = np.where(feas, np.maximum(new_a, new_b), np.inf)
            k = int(np.argmin(new))
            i, q = divmod(k, b.shape[0])
            if new[i, q] < best[0]:
                best = (float(new[i, q]), int(a[i]), int(b[q]), -1)
        return best

    def _apply(self, p, q, f):
        fp = int(self.bin[p])
        if q < 0:
            self.bin[p] = f
            touched = (fp, f)
        else:
            fq = int(self.bin[q])
            self.bin[p], self.bin[q] = fq, fp
            touched = (fp, fq)
        for x in touched:
            self._recount(x)

    def refine_ranks(self, max_iter: int, partners: int = 3, tol: float = 1e-4) -> int:
        """Moves / swaps from the costliest rank to the cheapest ones while its cost drops, until
        max / mean - 1 <= tol."""
        M = self.M
        for it in range(max_iter):
            rc = self.bcost.reshape(self.R, M).sum(1)
            A = int(np.argmax(rc))
            if rc[A] <= (1 + tol) * rc.mean():
                return it
            prank = self.bin // M
            a = np.flatnonzero(prank == A)
            best = (rc[A], -1, -1, -1)
            for B in np.argsort(rc, kind="stable")[:partners].tolist():
                if B == A:
                    continue
                cand = self._best(a, rc[A], np.flatnonzero(prank == B), np.arange(B * M, (B + 1) * M), rc[B])
                if cand[0] < best[0] - 1e-9 * rc[A]:
                    best = cand
            if best[1] < 0:
                return it
            self._apply(*best[1:])
        return max_iter

    def refine_slots(self, max_iter: int, tol: float = 1e-3) -> int:
        """Within each rank, even out its microbatches (moves / swaps from the costliest to the
        cheapest), so that sorted slots line up across ranks."""
        M, steps = self.M, 0
        if M == 1:
            return 0
        for r in range(self.R):
            for _ in range(max_iter):
                bc = self.bcost[r * M:(r + 1) * M]
                hi, lo = r * M + int(np.argmax(bc)), r * M + int(np.argmin(bc))
                ch, cl = float(bc[hi - r * M]), float(bc[lo - r * M])
                if ch - cl <= tol * ch:
                    break
                best = self._best(np.flatnonzero(self.bin == hi), ch, np.flatnonzero(self.bin == lo),
                                  np.array([lo]), cl)
                if best[1] < 0 or best[0] >= ch - 1e-9 * ch:
                    break
                self._apply(*best[1:])
                steps += 1
        return steps


# Auto microbatch count starts at memory / (ranks x capacity x this fill), leaving the balancer room.
AUTO_FILL = 0.95


def assign(cost: np.ndarray, mem: np.ndarray, *, dp_size: int, capacity: int, num_microbatches: int | None = None,
           rounds: np.ndarray | None = None, per_round: float = 0.0, refine: bool = True):
    """(rank, microbatch, M) for parts of additive cost, memory (each <= capacity) and rounds."""
    n = cost.shape[0]
    rounds = np.zeros(n, np.int64) if rounds is None else rounds
    total = int(mem.sum())
    M = num_microbatches or max(1, int(np.ceil(total / (dp_size * capacity * AUTO_FILL))))
    while True:
        st = _State(np.asarray(cost, np.float64), mem, rounds, per_round, dp_size, M, capacity)
        if st.lpt():
            break
        if num_microbatches is not None:
            raise ValueError(f"the batch ({total} compact + replay tokens in {n} parts, largest {int(mem.max())}) "
                             f"does not fit {num_microbatches} microbatches x {dp_size} ranks x "
                             f"microbatch_capacity={capacity} tokens; use more microbatches or a larger capacity")
        M += max(1, M // 16)
        log.debug("planner: growing to %d microbatches per rank", M)
    if refine:
        a = st.refine_ranks(max_iter=4 * dp_size + 64)
        b = st.refine_slots(max_iter=2 * M + 8)
        log.debug("planner: %d rank and %d slot refinement steps", a, b)
    return st.bin // M, st.bin % M, M


def plan(trees, *, dp_size: int, microbatch_capacity: int, num_microbatches: int | None = None,
         cost_model: CostModel | None = None, chunk_size: int = 64) -> Plan:
    """Assign every tree (or part of a split tree) to (DP rank, slot). See the module docstring.

    trees: RolloutTrees, or a :class:`TreeStats` of them (``tree_stats``; statistics only).
    microbatch_capacity: max compact + replay tokens of a microbatch (replay at ``chunk_size``).
    num_microbatches: per rank; None = the fewest the greedy fits into.
    """
    if dp_size < 1:
        raise ValueError(f"dp_size must be >= 1, got {dp_size}")
    if microbatch_capacity < 1:
        raise ValueError(f"microbatch_capacity must be >= 1 token, got {microbatch_capacity}")
    if num_microbatches is not None and num_microbatches < 1:
        raise ValueError(f"num_microbatches must be >= 1, got {num_microbatches}")
    st = trees if isinstance(trees, TreeStats) else tree_stats(trees, chunk_size)
    if len(st) == 0:
        raise ValueError("empty batch: plan() needs at least one tree")
    cm = cost_model or CostModel()
    parts = split_parts(st, microbatch_capacity)
    cost = cm.tree_cost(parts.tokens, parts.ancestors)
    mem = parts.memory
    prank, pmb, M = assign(cost, mem, dp_size=dp_size, capacity=microbatch_capacity,
                           num_microbatches=num_microbatches, rounds=parts.rounds, per_round=cm.per_round)
    return _build(st, parts, prank, pmb, dp_size, M, microbatch_capacity, cm)


def _build(st: TreeStats, parts: Parts, prank, pmb, R: int, M: int, cap: int, cm: CostModel) -> Plan:
    """Exact microbatch costs (rounds = max over the microbatch), slot order, Part records."""
    flat = prank * M + pmb
    add = np.bincount(flat, weights=cm.tree_cost(parts.tokens, parts.ancestors), minlength=R * M)
    rounds = np.zeros(R * M, np.int64)
    np.maximum.at(rounds, flat, parts.rounds)
    cost = (add + cm.per_round * rounds).reshape(R, M)
    memory = np.bincount(flat, weights=parts.memory, minlength=R * M).astype(np.int64).reshape(R, M)
    slot_of = np.argsort(-cost, axis=1, kind="stable")  # slot s runs microbatch slot_of[r, s]
    cost = np.take_along_axis(cost, slot_of, 1)
    memory = np.take_along_axis(memory, slot_of, 1)
    inv = np.argsort(slot_of, axis=1, kind="stable")
    slot = inv[prank, pmb]
    ranks: list[list[list[Part]]] = [[[] for _ in range(M)] for _ in range(R)]
    for p in np.lexsort((parts.start, parts.tree, slot, prank)).tolist():
        t = int(parts.tree[p])
        traj = None if parts.whole[p] else tuple(sorted(st.index[parts.start[p]:parts.stop[p]].tolist()))
        ranks[int(prank[p])][int(slot[p])].append(Part(t, traj))
    n_split = int(np.unique(parts.tree[~parts.whole]).shape[0])
    pl = Plan(ranks, cost, memory, cap, int(parts.tokens.sum()), int(parts.traj_tokens.sum()), n_split, cm)
    log.info("planner: %d trees (%d split) -> %d ranks x %d microbatches, imbalance %.4f, slot imbalance %.4f",
             len(st), n_split, R, M, *(pl.stats()[k] for k in ("imbalance", "slot_imbalance")))
    return pl
