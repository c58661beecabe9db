"""The Libra planner: per RL step (or on drift) choose how many of ``N`` GPUs roll out and how many
train, from the cost models (:mod:`.costs`) and the online distribution of recent programs.

Predictions (seconds), for ``R`` rollout engines and ``n`` programs drawn from the estimate:

* rollout bulk: decode tokens / (``R`` x engine tokens/s at the per-engine batch ``min(max_batch,
  n / R)`` and the mean context) + prefill tokens / (``R`` x prefill tokens/s);
* rollout critical path: the ``1 - 1/(2n)`` quantile (the largest of ``n``) over programs of (generated tokens x decode
  iteration time + the program's tool seconds + its prefill), the iteration time taken at the
  batch the engine holds on average while that program runs (``B x mean / its length``): the
  longest program, which a synchronous step waits for however many engines it has;
* synchronous rollout = max(bulk, critical); asynchronous (staleness >= 1) = bulk of the ``k + 1``
  batches in flight divided by ``k + 1`` (the tail of one batch overlaps the next);
* training: :meth:`~.costs.TrainCost.step_s` on ``N - R`` GPUs, plus the weight sync.

Synchronous RL: ``split`` (``R`` engines, ``N - R`` trainers, rollout then training) against
``elastic`` (all ``N`` roll out; drained engines switch to training and train completed groups
during the tail; predicted as the rollout on ``N``, a switch, the training that half the pool
cannot absorb during the tail (at least one group's share of it), the sync, and the switch back). Asynchronous RL: ``R`` minimising max(rollout per batch, training + sync);
a re-split is taken only when the predicted saving over ``horizon`` steps exceeds the switch
cost (``switch_s`` per moved GPU, counted as lost GPU-seconds over ``N``).
"""
from __future__ import annotations

import logging
import math
from dataclasses import dataclass, field
from typing import Sequence

import numpy as np

from .costs import RolloutCost, TrainCost
from .workload import Program, compact_tokens

logger = logging.getLogger(__name__)

FIELDS = ("gen", "turns", "tool_s", "tokens", "prefill")


def program_stats(programs: Sequence[Program]) -> np.ndarray:
    """``[n, 5]`` float array of ``FIELDS`` per program: generated tokens, turns, tool seconds,
    trajectory tokens, prefill tokens (prompt + observations, with prefix caching)."""
    return np.array([[p.generated, p.turns, float(p.tool_s.sum()), p.tokens, p.prompt + int(p.obs.sum())]
                     for p in programs], dtype=np.float64)


@dataclass
class ProgramEstimator:
    """Exponentially weighted per-program statistics of recent steps (step ``age`` steps old
    weighs ``decay ** age``; ``window`` steps kept), plus each step's compression (trajectory /
    compact tokens). Same weighting as :class:`~.costs.LengthEstimator`, over several fields so
    that joint quantities (a program's critical path) keep their correlation."""

    decay: float = 0.7
    window: int = 8
    drift_tol: float = 0.15
    _steps: list = field(default_factory=list)
    _compression: list = field(default_factory=list)

    def update(self, programs: Sequence[Program]) -> bool:
        """Add a step; returns True if its median generated length moved by > ``drift_tol``."""
        s = program_stats(programs)
        drift = bool(self._steps) and abs(np.median(s[:, 0]) / max(self.quantile(lambda x: x[:, 0], 0.5), 1e-9) - 1) > self.drift_tol
        self._steps.append(s)
        self._compression.append(s[:, 3].sum() / compact_tokens(list(programs)))
        del self._steps[:-self.window], self._compression[:-self.window]
        return drift

    def _weighted(self):
        if not self._steps:
            raise ValueError("ProgramEstimator has no steps yet")
        n = len(self._steps)
        xs = np.concatenate(self._steps)
        ws = np.concatenate([np.full(len(s), self.decay ** (n - 1 - i) / len(s)) for i, s in enumerate(self._steps)])
        return xs, ws / ws.sum()

    def mean(self, fn) -> float:
        xs, ws = self._weighted()
        return float(np.sum(fn(xs) * ws))

    def quantile(self, fn, q: float) -> float:
        xs, ws = self._weighted()
        v = fn(xs)
        o = np.argsort(v, kind="stable")
        cw = np.cumsum(ws[o])
        return float(v[o][min(int(np.searchsorted(cw, q - 1e-12)), len(v) - 1)])

    def compression(self) -> float:
        w = np.array([self.decay ** (len(self._compression) - 1 - i) for i in range(len(self._compression))])
        return float(np.sum(np.array(self._compression) * w) / w.sum())


@dataclass
class Plan:
    mode: str                  # "split" | "elastic" | "async" | "stream" | "sync"
    rollout_gpus: int
    train_gpus: int
    predicted_step_s: float
    detail: dict = field(default_factory=dict)


@dataclass
class Planner:
    rollout: RolloutCost
    train: TrainCost
    gpus: int
    sync_s: float = 0.39            # H200 small-moe export + push, rollout.json (2026-12-02)
    switch_s: float = 10.0
    horizon: int = 3

    def __post_init__(self):
        if self.gpus < 2:
            raise ValueError(f"gpus must be >= 2 (one rollout engine and one trainer), got {self.gpus}")

    # -- predictions -------------------------------------------------------------------------

    def rollout_s(self, est: ProgramEstimator, n: int, engines: int, *, inflight: int = 1) -> dict:
        """Predicted rollout seconds of ``n`` programs on ``engines`` engines (``inflight`` batches
        of ``n`` share them: asynchronous RL). Keys: bulk, critical, sync, per_batch."""
        rc = self.rollout
        total = n * inflight
        B = max(1.0, min(rc.max_batch, total / engines))
        mean_gen = est.mean(lambda x: x[:, 0])
        mean_ctx = est.mean(lambda x: x[:, 3]) / 2
        step = rc.step_s(B, B * mean_ctx)
        dec = total * mean_gen * step / B / engines
        pre = total * est.mean(lambda x: x[:, 4]) / rc.prefill_tok_s / engines
        bulk = dec + pre
        q = 1.0 - 0.5 / max(n, 2)          # the largest of n draws

        def path(x):
            # while a program of g tokens decodes, its engine runs ~B * mean_gen / g others on average
            b = np.maximum(1.0, np.minimum(B, B * mean_gen / np.maximum(x[:, 0], 1.0)))
            return x[:, 0] * rc.step_s(b, b * mean_ctx) + x[:, 2] + x[:, 4] / rc.prefill_tok_s

        critical = est.quantile(path, q)
        return {"bulk": bulk, "critical": critical, "sync": max(bulk, critical), "per_batch": bulk / inflight}

    def train_s(self, est: ProgramEstimator, n: int, gpus: int) -> float:
        tokens = n * est.mean(lambda x: x[:, 3])
        return self.train.step_s(tokens / est.compression(), est.mean(lambda x: x[:, 3]), gpus)

    # -- plans -------------------------------------------------------------------------------

    def plan_sync(self, est: ProgramEstimator, n: int) -> Plan:
        """Best ``split`` against ``elastic`` for a synchronous step of ``n`` programs."""
        best = None
        for r in range(1, self.gpus):
            t = self.rollout_s(est, n, r)["sync"] + self.train_s(est, n, self.gpus - r) + self.sync_s
            if best is None or t < best[0]:
                best = (t, r)
        ro = self.rollout_s(est, n, self.gpus)
        tr = self.train_s(est, n, self.gpus)
        # engines drained during the tail train the completed groups there: about half the pool over
        # the tail (critical path minus bulk, minus the switch) is available; the rest of the
        # training (at least the last group's share) runs after the last engines switch
        tail = max(0.0, ro["critical"] - ro["bulk"] - self.switch_s)
        work = tr * self.gpus
        groups = max(1.0, n / 8)
        residual = max(work - tail * self.gpus / 2, work / groups) / self.gpus
        elastic = ro["sync"] + self.switch_s + residual + self.sync_s + self.switch_s
        detail = {"split_s": best[0], "split_r": best[1], "elastic_s": elastic, **{f"rollout_{k}": v for k, v in ro.items()}}
        if elastic < best[0]:
            return Plan("elastic", self.gpus, 0, elastic, detail)
        return Plan("split", best[1], self.gpus - best[1], best[0], detail)

    def async_step_s(self, est: ProgramEstimator, n: int, r: int, staleness: int, rollout_scale: float = 1.0) -> float:
        """Predicted seconds per asynchronous step on ``r`` rollout GPUs: max(rollout per batch x
        ``rollout_scale``, training + sync)."""
        ro = self.rollout_s(est, n, r, inflight=staleness + 1)["per_batch"] * rollout_scale
        return max(ro, self.train_s(est, n, self.gpus - r) + self.sync_s)

    def plan_async(self, est: ProgramEstimator, n: int, staleness: int, current: int | None = None,
                   rollout_scale: float = 1.0) -> Plan:
        """``R`` for bounded-staleness asynchronous RL; keeps ``current`` unless moving saves more
        than the switch over ``horizon`` steps. ``rollout_scale``: measured / predicted rollout
        seconds per batch (the streaming driver's online correction; 1: the cost model alone)."""
        if staleness < 1:
            raise ValueError(f"plan_async needs staleness >= 1, got {staleness}")
        if not rollout_scale > 0:
            raise ValueError(f"rollout_scale must be > 0, got {rollout_scale}")
        costs = {r: self.async_step_s(est, n, r, staleness, rollout_scale) for r in range(1, self.gpus)}
        r = min(costs, key=costs.get)
        if current is not None and current in costs and r != current:
            moved = abs(r - current)
            saving = (costs[current] - costs[r]) * self.horizon
            if saving <= self.switch_s * moved / self.gpus + 1e-9:
                r = current
        return Plan("async", r, self.gpus - r, costs[r], {"costs": costs})


@dataclass
class StreamMeasure:
    """What the streaming driver measured over a sliding window of recent training steps (the
    interval before step 0, which holds the pipeline's cold start, is never part of it).

    ``rollout_tok_s``: generated tokens of the groups that completed in the window per
    busy engine-second (decode + prefill) in the window: one engine's useful rollout rate.
    ``batch_tokens``: generated tokens per training batch (``groups`` completed groups, at the
    window's mean group size). ``train_s`` / ``train_gpus``: the latest step's measured training
    seconds and the GPUs it trained on. ``idle_frac``: the fraction of the window in which training
    waited for data (> 0: the rollout is the bottleneck). ``intervals``: measured steps in the window.
    ``drain_s``: how long a drained engine keeps its GPU (the window's longest turn). ``current``:
    rollout engines during the measurement; ``load_frac``: 1 - a x decode iterations / decode
    seconds over the window; ``occupancy``: mean running batch / ``max_batch`` (reported only)."""

    rollout_tok_s: float
    batch_tokens: float
    train_s: float
    train_gpus: int
    idle_frac: float
    intervals: int
    drain_s: float = 0.0            # seconds a drained engine keeps running (its turns in flight end)
    occupancy: float = 1.0          # mean running batch per engine / max_batch over the window
    current: int = 0                # rollout engines when measured
    load_frac: float = 1.0          # share of a decode iteration that grows with the engine's load (batch, context)


@dataclass
class StreamPlanner:
    """Re-split for streaming bounded-staleness RL from **measured** rates, not the bulk cost model.

    Predicted seconds per step on ``R`` rollout GPUs: max(rollout per batch, ``train_s`` rescaled
    to ``N - R`` GPUs by the training cost model's shape + ``sync_s``): the pipeline's bottleneck.
    Rollout per batch on the ``current`` engines = ``batch_tokens / (rollout_tok_s x current)``
    (measured); on ``R`` engines, with ``latency_bound`` (default), the same in-flight programs
    spread over ``R`` engines: it scales like a decode iteration, ``1 - load_frac + load_frac x
    current / R`` (``load_frac``: the measured share of an iteration above the calibrated fixed
    cost ``a``, i.e. the part that batch and context add), since the streaming rollout is a chain
    of turns per program, far from the engines' slot limit; without it, ``current / R`` (a rollout
    bound by engine capacity). Rules, in order:

    * no re-split before ``min_intervals`` measured steps;
    * never against the measured bottleneck: when training waited for data (``idle_frac >
      idle_tol``: rollout-bound) GPUs never move to training; when it did not (training-bound),
      GPUs never move to rollout;
    * hysteresis: the move is taken only if the predicted saving over the next ``min(horizon,
      steps_left)`` steps, less the steps that pass while the moved GPUs switch (to training: after
      their running turns end, ``drain_s``), exceeds ``margin`` x the switch cost both ways: ``moved x switch_in /
      (GPUs on the receiving side)`` (the bottleneck side gets them late) + ``moved x switch_out /
      (GPUs on the giving side)`` (the same GPUs going back later)."""

    train: TrainCost
    gpus: int
    sync_s: float = 0.39
    switch_s: float = 10.0          # training -> rollout, one GPU
    switch_back_s: float = 10.0     # rollout -> training, one GPU
    horizon: int = 5
    margin: float = 1.5
    min_intervals: int = 2
    idle_tol: float = 0.02

    latency_bound: bool = True      # rollout time scales with the iteration time, not 1 / engines

    def rollout_step_s(self, m: StreamMeasure, r: int) -> float:
        if self.latency_bound and m.current:
            # the in-flight programs spread over r engines: the load part of an iteration scales
            # as current / r, the fixed part does not; the rollout's turn chains scale with it
            now = m.batch_tokens / max(m.rollout_tok_s * m.current, 1e-12)
            return now * (1.0 - m.load_frac + m.load_frac * m.current / r)
        return m.batch_tokens / max(m.rollout_tok_s * r, 1e-12)

    def train_step_s(self, m: StreamMeasure, gpus: int, work: tuple[float, float]) -> float:
        """Measured training seconds rescaled from ``m.train_gpus`` to ``gpus`` GPUs with the cost
        model's shape for ``work`` = (compact tokens, mean length) of the latest batch; + sync."""
        comp, mlen = work
        ref = self.train.step_s(comp, mlen, m.train_gpus)
        scale = m.train_s / ref if ref > 0 and math.isfinite(ref) else 1.0
        return self.train.step_s(comp, mlen, gpus) * scale + self.sync_s

    def step_s(self, m: StreamMeasure, r: int, work: tuple[float, float]) -> float:
        """Predicted seconds per step on ``r`` rollout GPUs: the slower of the two sides."""
        return max(self.rollout_step_s(m, r), self.train_step_s(m, self.gpus - r, work))

    def switch_cost_s(self, current: int, target: int) -> float:
        """Pipeline seconds a move from ``current`` to ``target`` rollout GPUs costs, both ways."""
        moved = abs(target - current)
        if moved == 0:
            return 0.0
        if target > current:          # training -> rollout: rollout (receiving) gets them switch_s late
            return moved * self.switch_s / target + moved * self.switch_back_s / (self.gpus - target)
        return moved * self.switch_back_s / (self.gpus - target) + moved * self.switch_s / target

    def plan(self, m: StreamMeasure | None, current: int, work: tuple[float, float], steps_left: int) -> Plan:
        """``current`` or a better split; ``detail['why']`` says which rule decided."""
        if m is None or m.intervals < self.min_intervals:
            return Plan("stream", current, self.gpus - current, math.nan, {"why": "not converged"})
        costs = {r: self.step_s(m, r, work) for r in range(1, self.gpus)}
        rollout_bound = m.idle_frac > self.idle_tol
        allowed = [r for r in costs if (r >= current if rollout_bound else r <= current)]
        best = min(allowed, key=lambda r: (costs[r], abs(r - current)))
        detail = {"costs": costs, "rollout_bound": rollout_bound, "unconstrained": min(costs, key=costs.get)}
        if best == current:
            return Plan("stream", current, self.gpus - current, costs[current], {**detail, "why": "best"})
        # the new split only takes effect once the moved GPUs have switched: the saving accrues over
        # the steps of the horizon left after the switch
        delay = self.switch_s if best > current else m.drain_s + self.switch_back_s
        steps = max(0.0, min(self.horizon, steps_left) - delay / max(costs[current], 1e-9))
        gain = (costs[current] - costs[best]) * steps
        return self._move_or_stay("stream", current, best, costs, detail, gain, self.switch_cost_s(current, best))

    def _move_or_stay(self, mode: str, current: int, best: int, costs: dict, detail: dict, gain: float,
                      cost: float) -> Plan:
        """The hysteresis rule of :meth:`plan` and :meth:`plan_sync`: move to ``best`` only if the
        predicted ``gain`` (s) exceeds ``margin`` x the switch ``cost`` (s)."""
        detail.update(gain_s=gain, switch_cost_s=cost, candidate=best)
        if gain <= self.margin * cost:
            return Plan(mode, current, self.gpus - current, costs[current], {**detail, "why": "hysteresis"})
        return Plan(mode, best, self.gpus - best, costs[best], {**detail, "why": "move"})

    def sync_step_s(self, m: StreamMeasure, r: int, work: tuple[float, float]) -> float:
        """Predicted seconds of a **synchronous** step on ``r`` rollout GPUs: rollout, then training
        (+ sync), one after the other: the sum where :meth:`step_s` takes the max."""
        return self.rollout_step_s(m, r) + self.train_step_s(m, self.gpus - r, work)

    def plan_sync(self, m: StreamMeasure | None, current: int, work: tuple[float, float], steps_left: int) -> Plan:
        """``current`` or a better split for synchronous RL (the real loop's ``RLLoop`` with
        ``libra_pool``), from the same measured rates as :meth:`plan`. Objective
        :meth:`sync_step_s`; no bottleneck rule (in a synchronous step each side waits for the other
        every step, so ``idle_frac`` carries nothing); no re-split before ``min_intervals`` measured
        steps. Hysteresis: the whole pool waits while workers switch, so a move of ``k`` GPUs costs
        ``k x switch_s`` (to rollout) or ``k x switch_back_s`` (to training) once, and is taken only
        if the predicted saving over the next ``min(horizon, steps_left)`` steps exceeds ``margin``
        times that. ``detail['why']``: ``not converged``, ``best``, ``hysteresis`` or ``move``."""
        if m is None or m.intervals < self.min_intervals:
            return Plan("sync", current, self.gpus - current, math.nan, {"why": "not converged"})
        costs = {r: self.sync_step_s(m, r, work) for r in range(1, self.gpus)}
        best = min(costs, key=lambda r: (costs[r], abs(r - current)))
        detail = {"costs": costs}
        if best == current:
            return Plan("sync", current, self.gpus - current, costs[current], {**detail, "why": "best"})
        moved = abs(best - current)
        cost = moved * (self.switch_s if best > current else self.switch_back_s)
        gain = (costs[current] - costs[best]) * min(self.horizon, steps_left)
        return self._move_or_stay("sync", current, best, costs, detail, gain, cost)
