"""Trace-driven discrete-event simulator of rollout engines and RL steps (SIMULATION: every number it
produces is simulated from the cost models of :mod:`.costs`, never measured).

:class:`EnginePool` simulates continuous-batching engines exactly for the linear decode model of
:class:`~.costs.RolloutCost`: between two events an engine runs decode iterations at a fixed
batch, and the time of ``n`` iterations is closed-form (contexts grow by one token per request
per iteration), so an event is a request completion, a tool return, a release or an engine
joining, never a single decode iteration (thousands of programs x 64 engines run in seconds).
Each engine has its own waiting queue ordered by the queue policy (:mod:`.cmlfq`); programs are
sticky to their last engine (prefix cache: a turn on the same engine prefills only its new
tokens, elsewhere the whole context), new programs and programs the policy routes to another
bucket go to the least-loaded engine of their bucket, and an engine with a free slot and an
empty queue steals the best request of the longest queue (a cache miss).

Step-level drivers (:func:`run_policy`): ``static`` (a fixed rollout/training split tuned on
the first step, verl-style disaggregation), ``colocated`` (verl's hybrid engine: all GPUs roll
out, then all train), ``tail`` (RollPacker-style tail batching on the static split), ``elastic`` (synchronous: an
elastic pool whose drained engines switch to training and train the completed groups while the
tail still runs), ``libra`` (the planner decides every step; synchronous: ``elastic`` or a split
it re-tunes; asynchronous: bounded staleness ``k`` with the split re-planned per batch).

:func:`run_stream` is the streaming bounded-staleness driver (continuous rollout, per-trajectory
staleness checked when training consumes it, too-stale groups dropped or aborted and regenerated),
for a fixed split (``static``) or the planner's re-split (``libra``); :func:`hindsight_static_split`
searches the best fixed split for it on the same trace (a reference, not a deployable policy).
"""
from __future__ import annotations

import bisect
import heapq
import itertools
import logging
import math
from dataclasses import dataclass, field, replace
from typing import Callable, Optional, Sequence

import numpy as np

from .cmlfq import SIGNAL_NONE, QueuePolicy, Request, make_policy
from .costs import RolloutCost, TrainCost
from .workload import Program, WorkloadConfig, compact_tokens, step_batch

logger = logging.getLogger(__name__)

_READY, _DONE, _JOIN, _CALL = 0, 1, 2, 3


@dataclass
class Engine:
    eid: int
    cost: RolloutCost
    bucket: int = 0
    active: bool = True
    draining: bool = False
    left: bool = False                  # drained and gone (to training)
    t: float = 0.0                      # the engine's clock: simulated up to here
    version: int = 0
    rem: list = field(default_factory=list)     # remaining tokens of each running request
    ctx: list = field(default_factory=list)     # context of each running request
    prog: list = field(default_factory=list)    # program index of each running request
    busy_s: float = 0.0
    tokens: int = 0
    iters: int = 0                      # decode iterations run (tokens / iters: the mean batch)
    decode_s: float = 0.0               # seconds of decode iterations (decode_s / iters: the mean iteration)

    @property
    def batch(self) -> int:
        return len(self.rem)

    def advance(self, t: float) -> None:
        """Run decode iterations up to time ``t`` (never past a request's completion)."""
        if not self.rem:
            self.t = max(self.t, t)
            return
        B, C = len(self.rem), float(sum(self.ctx))
        n = min(self.cost.steps_within(t - self.t, B, C), min(self.rem))
        if n > 0:
            self._step(n, B, C)

    def _step(self, n: int, B: int, C: float) -> None:
        dt = float(self.cost.steps_time(n, B, C))
        self.t += dt
        self.busy_s += dt
        self.decode_s += dt
        self.tokens += n * B
        self.iters += n
        self.rem = [r - n for r in self.rem]
        self.ctx = [c + n for c in self.ctx]

    def next_done(self) -> float:
        B, C = len(self.rem), float(sum(self.ctx))
        return self.t + float(self.cost.steps_time(min(self.rem), B, C))


class EnginePool:
    """Engines, programs, a queue policy and an event heap. ``engines``: list of
    ``(RolloutCost, bucket)``; ``policy``: a :class:`~.cmlfq.QueuePolicy`; ``predictor(program)``:
    predicted remaining tokens for SPF (``None``: the oracle remaining length times log-normal
    noise of ``pred_sigma``, seeded)."""

    def __init__(self, engines: Sequence[tuple[RolloutCost, int]], policy: QueuePolicy, *, pred_sigma: float = 0.5,
                 seed: int = 0, sticky: bool = True, overflow: float = 2.0):
        self.engines = [Engine(i, c, b) for i, (c, b) in enumerate(engines)]
        self.policy, self.sticky, self.overflow = policy, sticky, overflow
        self.queues = [policy.clone() for _ in self.engines]   # one waiting queue per engine
        self.rng = np.random.default_rng(seed)
        self.pred_sigma = pred_sigma
        self.programs: list[Program] = []
        self.turn: list[int] = []
        self.attained: list[int] = []
        self.last_engine: list[int] = []
        self.cached: list[int] = []
        self.release: list[float] = []
        self.done_at: list[float] = []
        self.tag: list[object] = []
        self.started: list[float] = []             # time of the program's first admission (s), nan before
        self.aborted: set[int] = set()
        self._noise: list[float] = []
        self._calls: dict[int, Callable[[float], None]] = {}
        self.now = 0.0
        self._heap: list = []
        self._seq = itertools.count()
        self.on_program_done: Optional[Callable[[int, float], None]] = None
        self.on_engine_left: Optional[Callable[[int, float], None]] = None
        self.prefill_tokens = 0
        self.cache_misses = 0
        self.turn_log: list[tuple[float, float]] = []   # (end s, seconds from admission) per finished turn
        self._admitted: dict[int, float] = {}

    # -- building ----------------------------------------------------------------------------

    def add_programs(self, programs: Sequence[Program], release: float, tag: object = None) -> list[int]:
        ids = []
        for p in programs:
            i = len(self.programs)
            self.programs.append(p)
            self.turn.append(0), self.attained.append(0), self.last_engine.append(-1), self.cached.append(0)
            self.release.append(release), self.done_at.append(math.nan), self.tag.append(tag)
            self.started.append(math.nan)
            self._noise.append(float(self.rng.lognormal(0.0, self.pred_sigma)) if self.pred_sigma > 0 else 1.0)
            self._push(release, _READY, i)
            ids.append(i)
        return ids

    def _push(self, t: float, kind: int, x: int, y: int = 0) -> None:
        heapq.heappush(self._heap, (t, next(self._seq), kind, x, y))

    def call_at(self, t: float, fn: Callable[[float], None]) -> None:
        """Run ``fn(t)`` as an event at simulated time ``t`` (s), in order with the pool's own events."""
        cid = next(self._seq)
        self._calls[cid] = fn
        self._push(t, _CALL, cid)

    def abort(self, i: int, now: float) -> int:
        """Abort program ``i`` at ``now`` (s): a running turn leaves its engine at once (its slot is
        refilled), a waiting or future turn is never admitted, ``on_program_done`` is never called.
        Returns the tokens it had generated (its attained service plus the running turn's part)."""
        if i in self.aborted or not math.isnan(self.done_at[i]):
            return 0
        self.aborted.add(i)
        wasted = self.attained[i]
        for e in self.engines:
            if i in e.prog:
                e.advance(now)
                k = e.prog.index(i)
                wasted += int(self.programs[i].gen[self.turn[i]]) - e.rem[k]
                del e.rem[k], e.ctx[k], e.prog[k]
                e.t = max(e.t, now)
                if e.draining and not e.rem:
                    e.version += 1
                    self._leave(e, now)
                else:
                    self._fill(e, now)
                    self._schedule(e)
                break
        return wasted

    def add_engine(self, cost: RolloutCost, bucket: int, ready_at: float) -> int:
        e = Engine(len(self.engines), cost, bucket, active=False, t=ready_at)
        self.engines.append(e)
        self.queues.append(self.policy.clone())
        self._push(ready_at, _JOIN, e.eid)
        return e.eid

    def drain(self, eid: int, now: float) -> None:
        """Stop admitting on ``eid``; it leaves (``on_engine_left``) once its running requests end."""
        e = self.engines[eid]
        if not e.active or e.draining:
            raise ValueError(f"engine {eid} is not an active engine")
        e.draining = True
        q = self.queues[eid]
        moved = []
        while len(q):
            moved.append(q.pop(0, now))
        for req in moved:                           # its waiting turns go elsewhere
            self._enqueue(req.program, req, now)
        if not e.rem:
            self._leave(e, now)

    def _leave(self, e: Engine, now: float) -> None:
        e.active, e.draining, e.left = False, False, True
        if self.on_engine_left:
            self.on_engine_left(e.eid, max(now, e.t))

    @property
    def active_engines(self) -> list[Engine]:
        return [e for e in self.engines if e.active and not e.draining]

    # -- requests ----------------------------------------------------------------------------

    def _request(self, i: int, now: float) -> Request:
        p, t = self.programs[i], self.turn[i]
        prev = t - 1
        return Request(program=i, turn=t, ctx=p.ctx_before(t), attained=self.attained[i],
                       signal=int(p.signal[prev]) if prev >= 0 else SIGNAL_NONE,
                       obs_tokens=int(p.obs[prev]) if prev >= 0 else 0, arrival=now,
                       predicted_remaining=float(p.gen[t:].sum()) * self._noise[i])

    def _fits(self, e: Engine, ctx: int) -> bool:
        return e.batch < e.cost.max_batch and sum(e.ctx) + ctx <= e.cost.kv_tokens

    def _admit(self, e: Engine, i: int, now: float) -> None:
        p, t = self.programs[i], self.turn[i]
        ctx = p.ctx_before(t)
        hit = self.last_engine[i] == e.eid
        new = ctx - (self.cached[i] if hit else 0)
        if t == 0 and math.isnan(self.started[i]):
            self.started[i] = now
        if not hit and self.last_engine[i] >= 0:
            self.cache_misses += 1
        e.advance(now)
        pre = new / e.cost.prefill_tok_s
        e.t = max(e.t, now) + pre
        e.busy_s += pre
        self.prefill_tokens += new
        self._admitted[i] = now
        e.rem.append(int(p.gen[t]))
        e.ctx.append(ctx)
        e.prog.append(i)
        self.last_engine[i] = e.eid

    def _schedule(self, e: Engine) -> None:
        e.version += 1
        if e.rem:
            self._push(e.next_done(), _DONE, e.eid, e.version)

    def _load(self, e: Engine) -> int:
        return e.batch + len(self.queues[e.eid])

    def _target(self, i: int, req: Request) -> Engine:
        """Sticky routing: the program's last engine if it is serving and in the bucket the policy
        routes it to; else the least-loaded (running + waiting) engine of that bucket; else of any."""
        b = self.policy.route(req)
        last = self.last_engine[i]
        serving = [e for e in self.engines if e.active and not e.draining]
        if not serving:
            serving = [e for e in self.engines if not e.draining and not e.left]    # engines about to join
        if not serving:
            raise RuntimeError("EnginePool: no engine serves or is about to join (all drained)")
        if self.sticky and last >= 0:
            e = self.engines[last]
            if e.active and not e.draining and (e.bucket == b or not any(x.bucket == b for x in serving)):
                return e
        same = [e for e in serving if e.bucket == b] or serving
        best = min(same, key=lambda e: (self._load(e), e.eid))
        anyb = min(serving, key=lambda e: (self._load(e), e.eid))
        if self._load(best) > self.overflow * (self._load(anyb) + 1):
            return anyb                           # the bucket is overloaded: spill over
        return best

    def _enqueue(self, i: int, req: Request, now: float) -> None:
        e = self._target(i, req)
        self.queues[e.eid].push(req, req.arrival)
        if e.active and not e.draining and e.batch < e.cost.max_batch:
            self._fill(e, now)

    def _steal(self, e: Engine, now: float) -> Optional[Request]:
        """An engine with a free slot and an empty queue takes the best request of the longest
        queue (same bucket first): work conserving, at the price of a prefix-cache miss."""
        cands = [x for x in self.engines if x is not e and len(self.queues[x.eid])]
        if not cands:
            return None
        v = max(cands, key=lambda x: (x.bucket == e.bucket, len(self.queues[x.eid]), -x.eid))
        if len(self.queues[v.eid]) < 2 and v.active and not v.draining and v.batch < v.cost.max_batch:
            return None                           # its own engine will take it
        return self.queues[v.eid].pop(e.bucket, now)

    def _fill(self, e: Engine, now: float) -> None:
        if not e.active or e.draining:
            return
        changed = False
        q = self.queues[e.eid]
        while e.batch < e.cost.max_batch:
            req = q.pop(e.bucket, now) if len(q) else self._steal(e, now)
            if req is None:
                break
            if req.program in self.aborted:
                continue
            if not self._fits(e, req.ctx) and e.batch > 0:
                q.push(req, req.arrival)          # back, unchanged arrival (KV full)
                break
            self._admit(e, req.program, now)
            changed = True
        if changed:
            self._schedule(e)

    def _ready(self, i: int, now: float) -> None:
        if i in self.aborted:
            return
        self._enqueue(i, self._request(i, now), now)

    def _complete(self, e: Engine, now: float) -> None:
        B, C = e.batch, float(sum(e.ctx))
        n = min(e.rem)
        e._step(n, B, C)
        e.t = now                                  # exact event time (no float drift)
        keep = [k for k, r in enumerate(e.rem) if r > 0]
        finished = [e.prog[k] for k, r in enumerate(e.rem) if r <= 0]
        fin_ctx = {e.prog[k]: e.ctx[k] for k, r in enumerate(e.rem) if r <= 0}
        e.rem, e.ctx, e.prog = [e.rem[k] for k in keep], [e.ctx[k] for k in keep], [e.prog[k] for k in keep]
        for i in finished:
            if i in self.aborted:
                continue
            p, t = self.programs[i], self.turn[i]
            self.attained[i] += int(p.gen[t])
            self.turn_log.append((now, now - self._admitted.pop(i, now)))
            self.cached[i] = fin_ctx[i]
            self.turn[i] = t + 1
            if self.turn[i] >= p.turns:
                self.done_at[i] = now
                if self.on_program_done:
                    self.on_program_done(i, now)
            else:
                self._push(now + float(p.tool_s[t]), _READY, i)
        if e.draining:
            if e.rem:
                self._schedule(e)
            else:
                self._leave(e, now)
        else:
            self._fill(e, now)
            self._schedule(e)

    # -- running -----------------------------------------------------------------------------

    def step(self) -> bool:
        """Process one event; False when none is left."""
        while self._heap:
            t, _, kind, x, y = heapq.heappop(self._heap)
            if kind == _DONE and (y != self.engines[x].version or not self.engines[x].rem):
                continue                             # stale
            self.now = t
            if kind == _READY:
                self._ready(x, t)
            elif kind == _DONE:
                self._complete(self.engines[x], t)
            elif kind == _CALL:
                self._calls.pop(x)(t)
            elif kind == _JOIN:
                e = self.engines[x]
                e.active, e.t = True, max(e.t, t)
                self._fill(e, t)
            return True
        return False

    def run(self, until: Optional[Callable[[], bool]] = None) -> float:
        while (until is None or not until()) and self.step():
            pass
        return self.now

    def reset_clock_idle(self, t: float) -> None:
        for e in self.engines:
            e.t = max(e.t, t)


# -- helpers for the drivers -------------------------------------------------------------------

@dataclass
class SimConfig:
    """Shared settings of a simulated run (seconds, GPUs). ``sync_s``: weight sync per step (default:
    the measured median export + push of ``rollout.json``); ``switch_s``: one role switch of one
    GPU from training to rollout (ASSUMPTION for a switch between GPUs; the colocated switch on one
    H200 measured 0.41-0.51 s); ``switch_back_s``: one GPU from rollout back to training (None: equal
    to ``switch_s``; the colocated H200 switch measured 0.05-0.08 s); ``staleness``: 0 = synchronous RL, k >= 1 =
    bounded-staleness asynchronous RL; ``queue``: the queue policy name; ``long_bucket``: GPUs of the
    rollout pool set up for long contexts (C-MLFQ routes to them; other policies use them as
    ordinary engines); ``static_split``: rollout GPUs of the static split (and the starting split of
    the others), None: tuned on step 0 (:func:`tune_static_split`)."""

    gpus: int = 16
    steps: int = 20
    staleness: int = 0
    sync_s: float = 0.39            # H200 small-moe export + push, rollout.json (2026-12-02)
    switch_s: float = 10.0
    switch_back_s: float | None = None
    queue: str = "fcfs"
    long_bucket: int = 0
    pred_sigma: float = 0.5
    tail_overprovision: float = 0.25
    seed: int = 0
    static_split: int | None = None

    @property
    def back_s(self) -> float:
        """Seconds for one GPU to switch from rollout back to training."""
        return self.switch_s if self.switch_back_s is None else self.switch_back_s


def pool_for(rcost: RolloutCost, n: int, cfg: SimConfig, queue: str | None = None) -> EnginePool:
    nl = min(cfg.long_bucket, max(0, n - 1))
    engines = [(rcost, 0)] * (n - nl) + [(rcost, 1)] * nl
    return EnginePool(engines, make_policy(queue or cfg.queue), pred_sigma=cfg.pred_sigma, seed=cfg.seed)


def rollout_once(programs: Sequence[Program], rcost: RolloutCost, engines: int, cfg: SimConfig,
                 queue: str | None = None) -> dict:
    """Simulate one synchronous rollout of ``programs`` on ``engines`` engines released at t=0.
    Returns makespan (s), per-program completion times (array, s), per-group completion times (dict)."""
    pool = pool_for(rcost, engines, cfg, queue)
    pool.add_programs(programs, 0.0)
    end = pool.run()
    done = np.array(pool.done_at)
    groups: dict[int, float] = {}
    for p, d in zip(programs, done):
        groups[p.group] = max(groups.get(p.group, 0.0), float(d))
    return {"makespan": float(np.nanmax(done)) if len(done) else 0.0, "done": done, "groups": groups, "end": end,
            "tokens": int(sum(e.tokens for e in pool.engines)), "cache_misses": pool.cache_misses}


def fluid_finish(releases: Sequence[tuple[float, float]], capacity: Sequence[tuple[float, int]]) -> float:
    """Finish time of divisible work: ``releases`` = (time, GPU-seconds) that become available;
    ``capacity`` = (time, GPUs) steps of the GPUs working on it (each step lasts until the next;
    0 GPUs before the first). Work-conserving fluid schedule (a microbatch is assumed small next
    to a group's work)."""
    rel, cap = sorted(releases), sorted(capacity)
    times = sorted({t for t, _ in rel} | {t for t, _ in cap})
    if not rel or sum(w for _, w in rel) <= 0:
        return max([t for t, _ in rel] or [0.0])
    avail, k, ri, ci = 0.0, 0, 0, 0
    for j, t in enumerate(times):
        while ri < len(rel) and rel[ri][0] <= t:
            avail += rel[ri][1]
            ri += 1
        while ci < len(cap) and cap[ci][0] <= t:
            k = cap[ci][1]
            ci += 1
        nxt = times[j + 1] if j + 1 < len(times) else math.inf
        if ri == len(rel) and k > 0 and avail <= k * (nxt - t):
            return t + avail / k
        if k > 0:
            avail = max(0.0, avail - k * (nxt - t))
    raise ValueError("fluid_finish: no GPU ever works on the released work")


# -- step-level drivers ------------------------------------------------------------------------

POLICIES = ("static", "colocated", "tail", "elastic", "libra")


def _train_work(programs: Sequence[Program], tcost: TrainCost) -> tuple[float, float]:
    """(compact tokens, mean trajectory length) of a set of programs."""
    if not programs:
        return 0.0, 1.0
    return float(compact_tokens(list(programs))), float(np.mean([p.tokens for p in programs]))


def _comm_s(tcost: TrainCost, gpus: int) -> float:
    return tcost.step_s(0.0, 1.0, gpus)                # all-reduce + optimizer only


def _static_split(programs, rcost, tcost, cfg) -> int:
    """``cfg.static_split`` when given, else :func:`tune_static_split`."""
    return cfg.static_split if cfg.static_split is not None else tune_static_split(programs, rcost, tcost, cfg)


def tune_static_split(programs: Sequence[Program], rcost: RolloutCost, tcost: TrainCost, cfg: SimConfig) -> int:
    """The rollout GPUs of the best fixed split for ``programs`` (the first step), found by simulating
    the rollout on each candidate (every ``N / 16``-th R): the strongest static baseline (it is tuned
    on the data it starts with). Synchronous: rollout makespan + training + sync; asynchronous
    (staleness k): max(makespan / (k + 1), training + sync), a proxy of the pipelined step."""
    n = cfg.gpus
    cands = sorted(set(list(range(1, n, max(1, n // 16))) + [n - 1]))
    comp, mlen = _train_work(programs, tcost)
    best = None
    for r in cands:
        ro = rollout_once(programs, rcost, r, cfg)["makespan"]
        if cfg.staleness == 0:
            t = ro + tcost.step_s(comp, mlen, n - r) + cfg.sync_s
        else:
            t = max(ro / (cfg.staleness + 1), tcost.step_s(comp, mlen, n - r) + cfg.sync_s)
        if best is None or t < best[0]:
            best = (t, r)
    return best[1]


def _sync_step_static(programs, rcost, tcost, cfg, r) -> dict:
    ro = rollout_once(programs, rcost, r, cfg)
    comp, mlen = _train_work(programs, tcost)
    tr = tcost.step_s(comp, mlen, cfg.gpus - r)
    return {"rollout_s": ro["makespan"], "train_s": tr, "step_s": ro["makespan"] + tr + cfg.sync_s,
            "rollout_gpus": r, "trained": programs, "p99_done": float(np.quantile(ro["done"], 0.99))}


def _sync_step_colocated(programs, rcost, tcost, cfg) -> dict:
    ro = rollout_once(programs, rcost, cfg.gpus, cfg)
    comp, mlen = _train_work(programs, tcost)
    tr = tcost.step_s(comp, mlen, cfg.gpus)
    return {"rollout_s": ro["makespan"], "train_s": tr, "step_s": ro["makespan"] + cfg.back_s + cfg.switch_s + tr + cfg.sync_s,
            "rollout_gpus": cfg.gpus, "trained": programs, "p99_done": float(np.quantile(ro["done"], 0.99))}


def elastic_sync_step(programs: Sequence[Program], rcost: RolloutCost, tcost: TrainCost, cfg: SimConfig, *,
                      low_batch: float | None = None, min_engines: int = 1, first: bool = False) -> dict:
    """One synchronous step on Libra's elastic pool: all GPUs roll out; whenever the running programs
    would fit on one engine fewer at ``low_batch`` each (default ``a / (8 (b + c x ctx))`` of the
    decode model, ``ctx`` the running requests' mean context at that moment: that many requests add
    1/8 of the fixed iteration cost, so packing the tail onto fewer engines slows its decode
    iterations by ~12%; ~3 with GPU.md's two points, ~5-30 with the H200 calibration's small ``b``
    as contexts grow 20K-1K; the earlier ``a / (8 b)`` ignored the context term and allowed ~47
    with the calibration), the least-loaded engine drains and, after
    ``switch_back_s``, trains the groups already complete (same global batch, gradients accumulated over
    whichever GPUs computed them). At the end the remaining engines switch too; then all-reduce,
    optimizer, weight sync, and (except before the first step) the switch back to rollout."""
    pool = pool_for(rcost, cfg.gpus, cfg)

    def low() -> float:
        if low_batch is not None:
            return low_batch
        ctx = [c for e in pool.active_engines for c in e.ctx]
        return rcost.a_s / (8 * (rcost.b_s + rcost.c_s * (float(np.mean(ctx)) if ctx else 0.0)))

    ids = pool.add_programs(programs, 0.0)
    group_of = {i: programs[k].group for k, i in enumerate(ids)}
    left_in_group: dict[int, int] = {}
    for p in programs:
        left_in_group[p.group] = left_in_group.get(p.group, 0) + 1
    by_group: dict[int, list] = {}
    for p in programs:
        by_group.setdefault(p.group, []).append(p)
    releases: list[tuple[float, float]] = []
    capacity: list[tuple[float, int]] = []
    train_gpus = [0]
    active = [len(programs)]

    def joined(eid: int, t: float) -> None:
        train_gpus[0] += 1
        capacity.append((t + cfg.back_s, train_gpus[0]))

    def done(i: int, t: float) -> None:
        active[0] -= 1
        g = group_of[i]
        left_in_group[g] -= 1
        if left_in_group[g] == 0:
            comp, mlen = _train_work(by_group[g], tcost)
            releases.append((t, tcost.gpu_seconds(comp, mlen)))
        engines = pool.active_engines
        if len(engines) > min_engines and active[0] < (len(engines) - 1) * low():
            pool.drain(min(engines, key=lambda e: (e.batch, -e.eid)).eid, t)

    pool.on_program_done, pool.on_engine_left = done, joined
    end = pool.run()
    rollout_s = float(np.nanmax(np.array(pool.done_at)))
    rest = len(pool.active_engines) + sum(1 for e in pool.engines if e.draining)
    capacity.append((rollout_s + cfg.back_s, train_gpus[0] + rest))
    finish = fluid_finish(releases, capacity)
    tr_alone = finish - rollout_s
    step = finish + _comm_s(tcost, cfg.gpus) + cfg.sync_s + (0.0 if first else cfg.switch_s)
    return {"rollout_s": rollout_s, "train_s": tr_alone, "step_s": step, "rollout_gpus": cfg.gpus,
            "trained": programs, "p99_done": float(np.quantile(np.array(pool.done_at), 0.99)),
            "drained_before_end": train_gpus[0], "end": end}


def tail_step(fresh: Sequence[Program], deferred: list, rcost, tcost, cfg: SimConfig, r: int, groups: int) -> dict:
    """RollPacker-style tail batching on a fixed split of ``r`` engines. A *short round* launches
    ``(1 + tail_overprovision) x groups`` fresh groups and ends when ``groups`` of them are complete;
    the unfinished groups are aborted (their tokens wasted) and deferred. Once ``groups`` groups are
    deferred, the next round is a *long round* that runs them to completion (no over-provisioning)."""
    if len(deferred) >= groups:
        todo = [g for g in deferred[:groups]]
        del deferred[:groups]
        programs = [p for g in todo for p in g]
        out = _sync_step_static(programs, rcost, tcost, cfg, r)
        out["round"] = "long"
        return out
    pool = pool_for(rcost, r, cfg)
    ids = pool.add_programs(fresh, 0.0)
    left: dict[int, int] = {}
    for p in fresh:
        left[p.group] = left.get(p.group, 0) + 1
    complete: list[int] = []

    def done(i, t):
        g = pool.programs[i].group
        left[g] -= 1
        if left[g] == 0:
            complete.append(g)

    pool.on_program_done = done
    pool.run(until=lambda: len(complete) >= groups)
    t_end = pool.now
    chosen = set(complete[:groups])
    trained = [p for p in fresh if p.group in chosen]
    by_group: dict[int, list] = {}
    for p in fresh:
        if p.group not in chosen:
            by_group.setdefault(p.group, []).append(p)
    deferred.extend(by_group.values())
    comp, mlen = _train_work(trained, tcost)
    tr = tcost.step_s(comp, mlen, cfg.gpus - r)
    return {"rollout_s": t_end, "train_s": tr, "step_s": t_end + tr + cfg.sync_s, "rollout_gpus": r,
            "trained": trained, "round": "short", "wasted_tokens": int(sum(e.tokens for e in pool.engines))
            - sum(p.generated for p in trained)}


def _libra_sync_step(progs, rcost, tcost, cfg: SimConfig, step: int, state: dict) -> dict:
    """Libra, synchronous: the planner (fed with the previous steps' programs) picks ``split`` (R
    engines, N - R trainers; moving GPUs costs one ``switch_s``) or ``elastic`` for this step;
    the first step, with no estimate yet, is elastic."""
    from .planner import Planner, ProgramEstimator
    est = state.setdefault("est", ProgramEstimator())
    pl = state.setdefault("planner", Planner(rcost, tcost, cfg.gpus, sync_s=cfg.sync_s, switch_s=cfg.switch_s))
    prev = state.get("prev")                       # ("elastic", N) or ("split", R)
    plan = None if not est._steps else pl.plan_sync(est, len(progs))
    if plan is None or plan.mode == "elastic":
        out = elastic_sync_step(progs, rcost, tcost, cfg, first=(step == 0))
        state["prev"] = ("elastic", cfg.gpus)
    else:
        out = _sync_step_static(progs, rcost, tcost, cfg, plan.rollout_gpus)
        if prev != ("split", plan.rollout_gpus):
            out["step_s"] += cfg.switch_s
        state["prev"] = ("split", plan.rollout_gpus)
    out["mode"] = state["prev"][0]
    est.update(progs)
    return out


def run_sync(policy: str, wcfg: WorkloadConfig, cfg: SimConfig, rcost: RolloutCost, tcost: TrainCost,
             progress: bool = False) -> dict:
    """Synchronous RL (``cfg.staleness == 0``) for ``cfg.steps`` steps; returns per-step rows and totals."""
    rows, deferred = [], []
    state: dict = {}
    r0 = _static_split(step_batch(wcfg, 0), rcost, tcost, cfg) if policy in ("static", "tail") else cfg.gpus
    over = int(round(wcfg.groups * (1 + cfg.tail_overprovision)))
    for s in range(cfg.steps):
        if policy == "tail":
            fresh = step_batch(wcfg, s, groups=over, group_offset=s * over * 2)
            out = tail_step(fresh, deferred, rcost, tcost, cfg, r0, wcfg.groups)
        else:
            progs = step_batch(wcfg, s)
            if policy == "static":
                out = _sync_step_static(progs, rcost, tcost, cfg, r0)
            elif policy == "colocated":
                out = _sync_step_colocated(progs, rcost, tcost, cfg)
            elif policy == "elastic":
                out = elastic_sync_step(progs, rcost, tcost, cfg, first=(s == 0))
            elif policy == "libra":
                out = _libra_sync_step(progs, rcost, tcost, cfg, s, state)
            else:
                raise ValueError(f"policy must be one of {POLICIES}, got {policy!r}")
        trained = out.pop("trained")
        out.update(step=s, tokens=int(sum(p.tokens for p in trained)), programs=len(trained))
        out.pop("end", None)
        rows.append(out)
        if progress:
            logger.info("%s step %d: %.1f s", policy, s, out["step_s"])
    return _totals(policy, rows, cfg)


def _totals(policy: str, rows: list[dict], cfg: SimConfig, wall: float | None = None) -> dict:
    total_s = wall if wall is not None else sum(r["step_s"] for r in rows)
    tokens = sum(r["tokens"] for r in rows)
    return {"policy": policy, "gpus": cfg.gpus, "staleness": cfg.staleness, "rows": rows, "total_s": total_s,
            "tokens": tokens, "throughput": tokens / total_s, "step_s": total_s / len(rows), "simulated": True}


def run_async(policy: str, wcfg: WorkloadConfig, cfg: SimConfig, rcost: RolloutCost, tcost: TrainCost,
              planner=None) -> dict:
    """Bounded-staleness asynchronous RL (``cfg.staleness = k >= 1``): batch ``b`` is rolled out
    with weights of version >= ``b - k`` (released when training step ``b - k - 1`` and its weight
    sync are done), rollout engines run continuously, training step ``j`` starts when batch ``j``
    is complete and step ``j - 1`` is done. ``static``: the split tuned on step 0, fixed.
    ``libra``: ``planner.plan_async`` re-plans at every completed batch (its estimator fed with the
    completed batches); moved GPUs pay ``switch_s``: engines drain first, trainers move between
    training steps."""
    from .planner import ProgramEstimator
    k, n = cfg.staleness, cfg.gpus
    if k < 1:
        raise ValueError("run_async needs staleness >= 1")
    batches = [step_batch(wcfg, s, group_offset=s * wcfg.groups) for s in range(cfg.steps)]
    r = _static_split(batches[0], rcost, tcost, cfg)
    pool = pool_for(rcost, r, cfg)
    # training GPUs: times from which each is available to the trainer
    trainers = [0.0] * (n - r)
    left = [len(b) for b in batches]
    batch_done = [math.nan] * cfg.steps
    train_end = [math.nan] * cfg.steps
    rows: list[dict] = []
    est = ProgramEstimator()
    state = {"next_train": 0, "released": 0}
    released: dict[int, float] = {}

    def release(b: int, t: float) -> None:
        if b < cfg.steps and b == state["released"]:
            pool.add_programs(batches[b], t, tag=b)
            released[b] = t
            state["released"] += 1

    def joined(eid: int, t: float) -> None:
        trainers.append(t + cfg.back_s)

    def advance_training(now: float) -> None:
        while state["next_train"] < cfg.steps and not math.isnan(batch_done[state["next_train"]]):
            j = state["next_train"]
            start = max(batch_done[j], train_end[j - 1] if j else 0.0)
            est.update(batches[j])
            if policy == "libra" and planner is not None:
                cur = len(pool.active_engines)
                target = planner.plan_async(est, len(batches[j]), k, current=cur).rollout_gpus
                if target < cur:
                    for e in sorted(pool.active_engines, key=lambda e: (e.batch, -e.eid))[:cur - target]:
                        pool.drain(e.eid, now)
                elif target > cur:
                    avail = sorted(trainers)
                    move = min(target - cur, max(0, len(avail) - 1))
                    for _ in range(move):
                        trainers.remove(avail.pop(0))
                        pool.add_engine(rcost, 0, start + cfg.switch_s)
            g = sum(1 for t in trainers if t <= start)
            if g == 0:                       # wait for the first trainer to arrive
                start = min(trainers)
                g = sum(1 for t in trainers if t <= start)
            comp, mlen = _train_work(batches[j], tcost)
            dur = tcost.step_s(comp, mlen, g)
            train_end[j] = start + dur + cfg.sync_s
            rows.append({"step": j, "rollout_gpus": len(pool.active_engines), "train_gpus": g, "train_s": dur,
                         "batch_done": batch_done[j], "train_end": train_end[j],
                         "tokens": int(sum(p.tokens for p in batches[j])), "programs": len(batches[j])})
            state["next_train"] += 1
            release(j + k + 1, train_end[j])

    def done(i: int, t: float) -> None:
        b = pool.tag[i]
        left[b] -= 1
        if left[b] == 0:
            batch_done[b] = t
            advance_training(t)

    pool.on_program_done, pool.on_engine_left = done, joined
    for b in range(min(k + 1, cfg.steps)):
        release(b, 0.0)
    pool.run()
    if any(math.isnan(x) for x in train_end):
        raise RuntimeError("run_async: not every step trained (simulator bug)")
    prev = 0.0
    for row in rows:
        row["step_s"] = row["train_end"] - prev
        prev = row["train_end"]
    out = _totals(policy, rows, cfg, wall=train_end[-1])
    out["release"] = released
    return out


class GroupSource:
    """GRPO groups drawn at a policy version: version ``v``'s groups come from the workload's step ``v``
    (its drift progress), in chunks of a full batch, chunk ``m`` = ``step_batch(wcfg, v, group_offset=
    m x groups)`` (chunk 0 is the synchronous drivers' batch of step ``v``). Groups get fresh ids
    (0, 1, ...) in the order drawn, so a group id names one group of the stream."""

    def __init__(self, wcfg: WorkloadConfig):
        self.wcfg = wcfg
        self._buf: dict[int, list[list[Program]]] = {}
        self._chunk: dict[int, int] = {}
        self._next_id = 0

    def draw(self, version: int) -> list[Program]:
        """The next group (``group_size`` programs) of ``version``."""
        buf = self._buf.setdefault(version, [])
        if not buf:
            m = self._chunk.get(version, 0)
            self._chunk[version] = m + 1
            progs = step_batch(self.wcfg, version, group_offset=m * self.wcfg.groups)
            by: dict[int, list[Program]] = {}
            for p in progs:
                by.setdefault(p.group, []).append(p)
            buf.extend(by[g] for g in sorted(by))
        gid = self._next_id
        self._next_id += 1
        return [replace(p, group=gid) for p in buf.pop(0)]


STREAM_POLICIES = ("static", "libra")
STREAM_PLANNERS = ("measured", "model")


def run_stream(policy: str, wcfg: WorkloadConfig, cfg: SimConfig, rcost: RolloutCost, tcost: TrainCost,
               planner=None, *, feedback: bool = True, planner_mode: str = "measured", window: int = 3) -> dict:
    """Streaming, bounded-staleness asynchronous RL (SIMULATION). Rollout engines generate
    continuously; finished GRPO groups wait in a buffer; training step ``j`` (it turns weights of
    version ``j`` into ``j + 1``, published to the engines ``sync_s`` after its gradient step)
    consumes ``wcfg.groups`` complete groups.

    * **Version of a trajectory** = the oldest policy version any of its turns was generated with:
      the version published when its first turn was admitted to an engine (versions only grow;
      a turn running across a publish counts with the older one). A group's version is the
      minimum over its trajectories.
    * **Staleness bound, checked per trajectory at consumption**: step ``j`` may use a group only
      if ``j - version <= k`` (``k = cfg.staleness``) for every trajectory in it; among usable
      complete groups it takes the oldest first. Complete groups that are too stale for step ``j``
      are dropped; after step ``j`` started, groups that could not meet the bound at step ``j + 1``
      either are dropped (complete) or aborted (running: their engines are freed at once). Both are
      counted (``dropped_groups``, ``aborted_groups``, ``discarded_tokens``: tokens generated for
      them) and **regenerated**: replaced by new groups at the current version.
    * **Admission** (AReaL-style): at most ``(v + k + 1) x groups`` groups released and not discarded
      while version ``v`` is the newest published one, so at most ``k + 1`` batches are in flight or
      waiting. With ``k = 0`` this is the synchronous step (release a batch at version ``v``, wait
      for all of it, train, sync): the same trajectories and the same time as ``run_sync("static")``
      on the same split, to floating-point rounding (``tests/test_libra.py``).
    * Groups of version ``v`` are the workload's step ``v`` (:class:`GroupSource`): lengths drift
      with the policy that generated them.

    ``static``: the split ``cfg.static_split`` or tuned on step 0 (:func:`tune_static_split` with
    the asynchronous proxy when ``k >= 1``), fixed. ``libra`` with ``planner_mode="measured"`` (the
    default): same start, then at every training step a :class:`~.planner.StreamPlanner` (or
    ``planner`` if one is given) re-plans from what the run measured over the last ``window``
    steps (:class:`~.planner.StreamMeasure`: useful generated tokens per busy engine-second,
    tokens per batch, the latest training seconds, the fraction of time training waited for
    data), with its bottleneck rule and hysteresis; ``feedback`` is ignored. ``libra`` with
    ``planner_mode="model"`` (the earlier variant): ``planner.plan_async``
    (its estimator fed with the consumed groups) re-plans at every training step: engines drain and
    join training ``switch_back_s`` after their last turn ends; trainers become engines ``switch_s``
    after the step starts. With ``feedback`` the planner's rollout prediction is scaled by the
    measured one: after a step whose training waited for data (rollout-bound), the seconds since
    the previous step's start over the planner's predicted rollout seconds per batch for the
    engines in use (exponentially weighted, weight 0.5 on the newest); without it, the cost model alone.

    Returns :func:`run_policy`'s dict plus ``dropped_groups``, ``aborted_groups``,
    ``discarded_tokens`` (generated tokens thrown away), ``generated_tokens`` (all tokens decoded),
    ``max_staleness`` / ``mean_staleness`` (over consumed groups), ``released_groups``, ``decisions``
    (measured planner: per step ``step``, ``current``, ``target``, ``why``), ``consumed``
    (per consumed group: ``step``, ``group``, ``version``, ``first_start_s``: its first admission); each row has ``step``,
    ``start`` / ``train_end`` (s), ``train_s``, ``step_s``, ``rollout_gpus``, ``train_gpus``,
    ``staleness`` (per consumed group), ``tokens``, ``programs``.
    """
    from .planner import Planner, ProgramEstimator, StreamMeasure, StreamPlanner
    if policy not in STREAM_POLICIES:
        raise ValueError(f"run_stream supports {STREAM_POLICIES}, got {policy!r}")
    if planner_mode not in STREAM_PLANNERS:
        raise ValueError(f"planner_mode must be one of {STREAM_PLANNERS}, got {planner_mode!r}")
    if window < 1:
        raise ValueError(f"window must be >= 1, got {window}")
    k, n, G = cfg.staleness, cfg.gpus, wcfg.groups
    if k < 0:
        raise ValueError(f"staleness must be >= 0, got {k}")
    if policy == "libra" and planner is None:
        planner = (StreamPlanner(tcost, n, sync_s=cfg.sync_s, switch_s=cfg.switch_s, switch_back_s=cfg.back_s)
                   if planner_mode == "measured" else Planner(rcost, tcost, n, sync_s=cfg.sync_s, switch_s=cfg.switch_s))
    r = _static_split(step_batch(wcfg, 0), rcost, tcost, cfg)
    if not 1 <= r < n:
        raise ValueError(f"the split needs 1 <= rollout GPUs < {n}, got {r}")
    pool = pool_for(rcost, r, cfg)
    src = GroupSource(wcfg)
    est = ProgramEstimator()
    trainers = [0.0] * (n - r)                 # time (s) from which each training GPU is free to train
    publish: list[float] = []                  # publish[v - 1]: time (s) version v reached the engines
    members: dict[int, list[int]] = {}         # group id -> pool program ids
    left: dict[int, int] = {}                  # group id -> programs not finished
    complete: dict[int, float] = {}            # group id -> completion time (s), waiting for training
    live: set[int] = set()                     # released, not consumed, not discarded
    # no interval before step 0: its start includes the pipeline's cold start (every engine starts
    # empty), which made the correction 6x and over-provisioned rollout in every case tried
    fb = {"scale": 1.0, "prev_start": None, "pred": None}
    st = {"step": 0, "busy_until": 0.0, "released": 0, "discarded": 0, "dropped": 0, "aborted": 0,
          "wasted": 0, "max_stale": 0}
    rows: list[dict] = []
    consumed: list[dict] = []                  # per consumed group: step, group id, version, first admission (s)
    finished: list[tuple[float, int]] = []     # (completion time s, generated tokens) per completed group
    marks: list[dict] = []                     # per step start: time, busy engine-seconds so far, training idle before it
    decisions: list[dict] = []

    def measure(j: int, now: float) -> StreamMeasure | None:
        """The window of the last ``window`` intervals between step starts (never before step 0)."""
        if j < 1:
            return None
        a = marks[max(0, j - window)]
        b = marks[j]
        span = b["t"] - a["t"]
        busy = b["busy"] - a["busy"]
        got = [tok for (t, tok) in finished if a["t"] < t <= b["t"]]
        if span <= 0 or busy <= 0 or not got:
            return None
        idle = sum(m["idle"] for m in marks[max(0, j - window) + 1:j + 1])
        last = rows[-1]
        # a drained engine leaves once all its running turns end: the window's longest turn
        turns = [d for (t, d) in pool.turn_log if a["t"] < t <= b["t"]]
        iters = b["iters"] - a["iters"]
        return StreamMeasure(rollout_tok_s=sum(got) / busy, batch_tokens=G * float(np.mean(got)),
                             train_s=last["train_s"], train_gpus=last["train_gpus"],
                             idle_frac=idle / span, intervals=j - max(0, j - window),
                             drain_s=float(max(turns)) if turns else 0.0, current=len(pool.active_engines),
                             occupancy=(b["tok"] - a["tok"]) / iters / rcost.max_batch if iters else 1.0,
                             load_frac=max(0.0, 1.0 - rcost.a_s * iters / (b["dec"] - a["dec"])) if iters else 1.0)

    def version_of(gid: int) -> float:
        ts = [pool.started[i] for i in members[gid] if not math.isnan(pool.started[i])]
        return float(bisect.bisect_right(publish, min(ts))) if ts else math.inf

    def release(t: float) -> None:
        v = len(publish)
        while st["released"] - st["discarded"] < (v + k + 1) * G:
            progs = src.draw(v)
            gid = progs[0].group
            members[gid] = pool.add_programs(progs, t, tag=gid)
            left[gid] = len(progs)
            live.add(gid)
            st["released"] += 1

    def discard(gid: int, t: float, why: str) -> None:
        live.discard(gid)
        st["discarded"] += 1
        st[why] += 1
        if gid in complete:
            del complete[gid]
            st["wasted"] += sum(pool.programs[i].generated for i in members[gid])
        else:
            st["wasted"] += sum(pool.abort(i, t) if math.isnan(pool.done_at[i]) else pool.programs[i].generated
                                for i in members[gid])

    def resplit(j: int, start: float, now: float, waited: bool, progs) -> None:
        cur = len(pool.active_engines)
        nprog, kk = G * wcfg.group_size, max(k, 1)
        if planner_mode == "measured":
            m = measure(j, now)
            plan = planner.plan(m, cur, _train_work(progs, tcost), cfg.steps - j - 1)
            target = plan.rollout_gpus
            decisions.append({"step": j, "current": cur, "target": target, "why": plan.detail.get("why"),
                              "measure": None if m is None else dict(vars(m)), "pred_step_s": plan.predicted_step_s,
                              **{x: plan.detail[x] for x in ("candidate", "gain_s", "switch_cost_s", "rollout_bound")
                                 if x in plan.detail}})
        else:
            if feedback and waited and fb["prev_start"] is not None and fb["pred"]:
                ratio = (start - fb["prev_start"]) / fb["pred"]
                fb["scale"] = 0.5 * fb["scale"] + 0.5 * ratio
            target = planner.plan_async(est, nprog, kk, current=cur, rollout_scale=fb["scale"]).rollout_gpus
            fb["prev_start"] = start
            fb["pred"] = planner.rollout_s(est, nprog, max(1, target), inflight=kk + 1)["per_batch"]
        if target < cur:
            for e in sorted(pool.active_engines, key=lambda e: (e.batch, -e.eid))[:cur - target]:
                pool.drain(e.eid, now)
        elif target > cur:
            avail = sorted(trainers)
            for _ in range(min(target - cur, max(0, len(avail) - 1))):
                t0 = avail.pop(0)
                trainers.remove(t0)
                pool.add_engine(rcost, 0, max(start, t0) + cfg.switch_s)

    def try_train(t: float) -> None:
        j = st["step"]
        if j >= cfg.steps or t < st["busy_until"]:
            return
        for gid in [g for g in complete if j - version_of(g) > k]:
            discard(gid, t, "dropped")
        if len(complete) < G:
            release(t)
            return
        pick = sorted(complete, key=lambda g: (version_of(g), complete[g], g))[:G]
        stale = [j - int(version_of(g)) for g in pick]
        if max(stale) > k or min(stale) < 0:
            raise RuntimeError(f"run_stream: consumed staleness {stale} outside [0, {k}] (simulator bug)")
        st["max_stale"] = max(st["max_stale"], max(stale))
        for g in pick:
            consumed.append({"step": j, "group": g, "version": int(version_of(g)),
                             "first_start_s": min(pool.started[i] for i in members[g])})
        progs = [pool.programs[i] for g in pick for i in members[g]]
        for g in pick:
            del complete[g]
            live.discard(g)
        start = t
        waited = t > st["busy_until"]                 # training idled: the rollout was the bottleneck
        marks.append({"t": t, "busy": sum(e.busy_s for e in pool.engines), "tok": sum(e.tokens for e in pool.engines),
                      "iters": sum(e.iters for e in pool.engines), "dec": sum(e.decode_s for e in pool.engines),
                      "idle": max(0.0, t - st["busy_until"]) if j > 0 else 0.0})
        est.update(progs)
        if policy == "libra" and j + 1 < cfg.steps:
            resplit(j, start, t, waited, progs)
        g_avail = sum(1 for x in trainers if x <= start)
        if g_avail == 0:                              # wait for the first trainer to arrive
            start = min(trainers)
            g_avail = sum(1 for x in trainers if x <= start)
        comp, mlen = _train_work(progs, tcost)
        dur = tcost.step_s(comp, mlen, g_avail)
        end = start + dur + cfg.sync_s
        rows.append({"step": j, "start": start, "train_end": end, "train_s": dur, "train_gpus": g_avail,
                     "rollout_gpus": len(pool.active_engines), "staleness": stale,
                     "tokens": int(sum(p.tokens for p in progs)), "programs": len(progs)})
        st["step"], st["busy_until"] = j + 1, end
        # groups that cannot meet the bound at step j + 1 any more: dropped / aborted now, regenerated
        for gid in [g for g in live if j + 1 - version_of(g) > k]:
            discard(gid, t, "dropped" if gid in complete else "aborted")
        release(t)
        if j + 1 < cfg.steps:
            pool.call_at(end, published)

    def published(t: float) -> None:
        publish.append(t)
        release(t)
        try_train(t)

    def done(i: int, t: float) -> None:
        gid = pool.tag[i]
        left[gid] -= 1
        if left[gid] == 0 and gid in live:
            complete[gid] = t
            finished.append((t, sum(pool.programs[x].generated for x in members[gid])))
            try_train(t)

    def joined(eid: int, t: float) -> None:
        trainers.append(t + cfg.back_s)

    pool.on_program_done, pool.on_engine_left = done, joined
    release(0.0)
    pool.run(until=lambda: st["step"] >= cfg.steps)
    if len(rows) != cfg.steps:
        raise RuntimeError(f"run_stream: {len(rows)} of {cfg.steps} steps trained (simulator bug)")
    prev = 0.0
    for row in rows:
        row["step_s"] = row["train_end"] - prev
        prev = row["train_end"]
    out = _totals(policy, rows, cfg, wall=rows[-1]["train_end"])
    out.update(mode="stream", rollout_scale=fb["scale"], dropped_groups=st["dropped"], aborted_groups=st["aborted"],
               discarded_tokens=int(st["wasted"]), released_groups=st["released"], max_staleness=st["max_stale"],
               generated_tokens=int(sum(e.tokens for e in pool.engines)), static_split=r,
               consumed=consumed, decisions=decisions, planner_mode=planner_mode if policy == "libra" else None,
               mean_staleness=float(np.mean([x for row in rows for x in row["staleness"]])))
    logger.info("stream %s k=%d %d GPUs: %.0f tok/s, %d dropped + %d aborted groups (%d tokens discarded)",
                policy, k, n, out["throughput"], st["dropped"], st["aborted"], st["wasted"])
    return out


def hindsight_static_split(wcfg: WorkloadConfig, cfg: SimConfig, rcost: RolloutCost, tcost: TrainCost, *,
                           candidates: Sequence[int] | None = None, refine: bool = True) -> dict:
    """The best fixed split **with hindsight** for :func:`run_stream` (``static``) on this trace: not a
    deployable baseline (it sees the whole run), an upper reference for any fixed split. Searches
    ``candidates`` (default: :func:`tune_static_split`'s grid, every ``N / 16``-th R plus ``N - 1``)
    and, with ``refine``, every R between the best grid point's neighbours. Returns ``{best_r,
    best (tok/s), throughput_by_r (every R simulated), runs (R -> run_stream's dict)}``."""
    n = cfg.gpus
    cands = sorted(set(candidates if candidates is not None else list(range(1, n, max(1, n // 16))) + [n - 1]))
    runs: dict[int, dict] = {}

    def sim_r(r: int) -> None:
        if r not in runs:
            runs[r] = run_stream("static", wcfg, replace(cfg, static_split=r), rcost, tcost)

    for r in cands:
        sim_r(r)
    if refine:
        best = max(runs, key=lambda r: runs[r]["throughput"])
        i = cands.index(best)
        lo, hi = cands[max(0, i - 1)], cands[min(len(cands) - 1, i + 1)]
        for r in range(lo, hi + 1):
            sim_r(r)
    by_r = {r: runs[r]["throughput"] for r in sorted(runs)}
    best = max(by_r, key=by_r.get)
    return {"best_r": best, "best": by_r[best], "throughput_by_r": by_r, "runs": runs}


def run_policy(policy: str, wcfg: WorkloadConfig, cfg: SimConfig, rcost: RolloutCost, tcost: TrainCost,
               planner=None) -> dict:
    """Simulate ``policy`` (:data:`POLICIES`) for ``cfg.steps`` steps; synchronous when
    ``cfg.staleness == 0``. Returns ``{policy, gpus, staleness, rows, total_s, tokens, throughput
    (trained trajectory tokens/s), step_s, simulated: True}``."""
    if policy not in POLICIES:
        raise ValueError(f"policy must be one of {POLICIES}, got {policy!r}")
    if cfg.staleness == 0:
        return run_sync(policy, wcfg, cfg, rcost, tcost)
    if policy not in ("static", "libra"):
        raise ValueError(f"asynchronous runs support static and libra, got {policy!r}")
    if policy == "libra" and planner is None:
        from .planner import Planner
        planner = Planner(rcost, tcost, cfg.gpus, sync_s=cfg.sync_s, switch_s=cfg.switch_s)
    return run_async(policy, wcfg, cfg, rcost, tcost, planner)
