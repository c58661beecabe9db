"""Global cache/progress/load-aware placement of agentic turns on engine replicas (WAR).

:class:`WarScheduler` is the agent loop's ``pick_engine(episode, engines, in_flight) -> int``
hook and, through :meth:`WarScheduler.wrap`, an :class:`~megatron_harts.rollout.types.Engine`
wrapper per replica that (a) admits at most ``max_running`` turns at a time to its replica,
the waiting ones ordered by trajectory progress, and (b) reports each finished turn back (its
tokens enter the replica's prefix model, its ``cached_tokens`` the hit statistics).

Per turn of a trajectory whose context has ``L`` tokens, replica ``r`` costs (token units)::

    cost_r = prefill_weight * (L - cached_r)  +  load_weight * (1 + progress_weight * progress) * load_r

``cached_r``: the longest prefix of the context that replica ``r`` holds according to its
:class:`PrefixModel` (token blocks of ``block`` tokens keyed by the hash of the whole prefix,
LRU-evicted beyond ``cache_tokens``: a radix cache evicts leaves first, and LRU does the same
here because matching touches every ancestor block). ``load_r``: the work queued and running on
``r``: for each turn in flight, its uncached prefill plus ``expected_decode`` tokens, counted from
its placement (a turn placed but still waiting to start is queued work, and its context counts as
cached on ``r`` for later placements: a group's samples, placed before any of them starts, stay together).
``progress`` in ``[0, 1]``: the trajectory's turns so far over the most turns seen, so late,
long trajectories (which set the step's makespan) weigh waiting more and move to an idle
replica earlier; they are also admitted first (``max_running``). A trajectory's next turn
returns to its replica by default because that replica holds its prefix (``cached_r = L -
new tokens``).

Progress priority inside the engine (``SchedulerConfig(priority="progress")``, or
:func:`with_progress_priority` around any placement): every turn carries
``SamplingParams.priority`` = the turns its trajectory has done, so an engine started with
``--enable-priority-scheduling`` (SGLang; the embedded engine honours the same flag) serves late
trajectories first when its waiting queue is full, without holding turns back on the client (the
admission gate lost on the H200: docs/war.md).

:class:`SpecSwitch` turns speculation on below a measured load (``crossover`` concurrent
trajectories; on CPU a parameter, on the H200 the crossover of ``scripts/bench_war.py``).
"""
from __future__ import annotations

import heapq
import itertools
import logging
import threading
from collections import OrderedDict
from dataclasses import dataclass, field, replace
from typing import Any, Sequence

from ..types import Engine, Generation, SamplingParams

log = logging.getLogger(__name__)


PRIORITY_MODES = (None, "progress")


def progress_priority(turns_done: int) -> int:
    """The engine priority of a turn whose trajectory has done ``turns_done`` turns: that count
    (larger is served first in SGLang's default direction). Small integers on purpose: SGLang
    0.5.17 preempts a running request when a waiting one's priority exceeds it by more than
    ``--priority-scheduling-preemption-threshold`` (default 10), so a turn count only preempts
    across more than 10 turns (the bench also passes ``--disable-priority-preemption``)."""
    if turns_done < 0:
        raise ValueError(f"turns_done must be >= 0, got {turns_done}")
    return int(turns_done)


def turns_of(rid: str | None) -> int | None:
    """Turns done from the agent loop's rid ``traj_id#turns-n~tag`` (``None`` for other rids)."""
    _, sep, rest = (rid or "").rpartition("#")
    head = rest.split("-", 1)[0]
    return int(head) if sep and head.isdigit() else None


@dataclass
class SchedulerConfig:
    """``cache_tokens``: KV capacity of a replica (tokens) in the prefix model; ``block``: its
    granularity; ``prefill_weight``/``load_weight``: cost of one uncached prompt token / one token
    of queued work; ``expected_decode``: tokens a turn generates (for load); ``progress_weight``:
    how much more a late trajectory weighs waiting; ``max_running``: turns admitted per replica
    at once by :meth:`WarScheduler.wrap`'s gate (0: no gate); ``max_trajectories``: per-trajectory
    records kept (least recently placed dropped first: a long run's memory stays bounded; a dropped
    trajectory loses only its stickiness, its prefix stays in the replicas' models);
    ``hybrid_cache``: the engine reuses a cached prefix only where it stored a recurrent state
    (SGLang's radix cache on Mamba / Gated DeltaNet hybrids keeps one with a request's prompt and
    with its finished sequence, not at every token): the prefix model then credits a replica only
    up to the longest whole earlier prompt or sequence it holds (:class:`PrefixModel` ``checkpoints``).
    On the H200 the token-level model predicted 0.76 hits where SGLang reported 0.64-0.66 on a
    Qwen3-Next hybrid (docs/war.md). ``spec_replicas``: replicas that run speculative decoding
    (SGLang switches speculation per server, so the switch is a choice of replica);
    ``spec_crossover``: with turns in flight at most this many, turns go to those replicas, above it
    to the others (:class:`SpecSwitch`; a kind with no usable replica falls back to all);
    ``priority``: ``"progress"`` gives every turn the engine priority :func:`progress_priority` of its
    trajectory (turns done; the engine must run with ``--enable-priority-scheduling``), ``None``
    sends none."""

    cache_tokens: int = 400_000
    block: int = 16
    prefill_weight: float = 1.0
    load_weight: float = 1.0
    expected_decode: int = 128
    progress_weight: float = 1.0
    max_running: int = 0
    max_trajectories: int = 65536
    hybrid_cache: bool = False
    spec_replicas: tuple[int, ...] = ()
    spec_crossover: int = 0
    priority: str | None = None

    def __post_init__(self):
        if self.priority not in PRIORITY_MODES:
            raise ValueError(f"SchedulerConfig.priority must be one of {PRIORITY_MODES}, got {self.priority!r}")
        if self.block < 1 or self.cache_tokens < self.block:
            raise ValueError(f"SchedulerConfig: block ({self.block}) must be >= 1 and <= cache_tokens "
                             f"({self.cache_tokens})")
        if self.max_running < 0:
            raise ValueError(f"SchedulerConfig.max_running must be >= 0, got {self.max_running}")
        if self.max_trajectories < 1:
            raise ValueError(f"SchedulerConfig.max_trajectories must be >= 1, got {self.max_trajectories}")
        if self.spec_crossover < 0:
            raise ValueError(f"SchedulerConfig.spec_crossover must be >= 0, got {self.spec_crossover}")


class PrefixModel:
    """Token-level model of one replica's prefix cache: full blocks of ``block`` tokens keyed by
    the hash chain of the prefix ending at them, LRU beyond ``capacity`` tokens.

    ``checkpoints=True`` models a hybrid (recurrent-state) cache: a prefix is reusable only up to
    the last block of a whole sequence inserted before (a prompt, or a prompt + output), where the
    engine stored the layer states; blocks in between hold attention KV that cannot be resumed
    without the state at their end. Precision: the block (a sequence's tail of fewer than
    ``block`` tokens is not counted)."""

    def __init__(self, capacity: int, block: int = 16, checkpoints: bool = False):
        self.capacity_blocks, self.block = max(1, capacity // block), block
        self._lru: OrderedDict[int, None] = OrderedDict()
        self.checkpoints = checkpoints
        self._ckpt: set[int] = set()           # block hashes that end an inserted sequence

    def block_hashes(self, tokens: Sequence[int], start: list[int] | None = None) -> list[int]:
        """Hash chain of the full blocks of ``tokens`` (``start``: the chain of a prefix of them)."""
        out = list(start or [])
        b = self.block
        h = out[-1] if out else 0
        for i in range(len(out) * b, len(tokens) - b + 1, b):
            h = hash((h, tuple(tokens[i:i + b])))
            out.append(h)
        return out

    def match(self, hashes: Sequence[int], touch: bool = True) -> int:
        """Cached prefix length (tokens) of a context with these block hashes."""
        n = usable = 0
        for h in hashes:
            if h not in self._lru:
                break
            if touch:
                self._lru.move_to_end(h)
            n += 1
            if h in self._ckpt:
                usable = n
        return (usable if self.checkpoints else n) * self.block

    def insert(self, hashes: Sequence[int]) -> None:
        """A sequence with these block hashes is now cached (its last block: a state checkpoint)."""
        for h in hashes:
            self._lru[h] = None
            self._lru.move_to_end(h)
        if hashes:
            self._ckpt.add(hashes[-1])
        while len(self._lru) > self.capacity_blocks:
            self._ckpt.discard(self._lru.popitem(last=False)[0])

    def __len__(self) -> int:
        return len(self._lru) * self.block


@dataclass
class _Traj:
    replica: int | None = None
    turns: int = 0
    hashes: list[int] = field(default_factory=list)
    length: int = 0


class WarScheduler:
    """See the module docstring. Use as ``AgentLoop(scheduler.wrap(engines), ...,
    pick_engine=scheduler)``."""

    def __init__(self, num_replicas: int, config: SchedulerConfig | None = None):
        if num_replicas < 1:
            raise ValueError(f"num_replicas must be >= 1, got {num_replicas}")
        self.cfg = config or SchedulerConfig()
        self.n = num_replicas
        self.models = [PrefixModel(self.cfg.cache_tokens, self.cfg.block, checkpoints=self.cfg.hybrid_cache)
                       for _ in range(num_replicas)]
        self.load = [0.0] * num_replicas            # tokens of work in flight per replica
        self._work: dict[str, tuple[int, float]] = {}     # rid -> (replica, work)
        self._traj: OrderedDict[str, _Traj] = OrderedDict()     # least recently placed first
        # turns placed but not yet started (queued in an admission gate, or on their way): traj id ->
        # (replica, block hashes of the context, work). Their work is in ``load`` and their context counts
        # as cached on that replica for later placements (the prompt will be prefilled there): the
        # samples of a group, placed together before any of them starts, stay together.
        self._pending: dict[str, tuple[int, list[int], float]] = {}
        self._max_turns = 1
        self._lock = threading.Lock()
        self.stats = {"turns": 0, "prompt_tokens": 0, "predicted_cached": 0, "reported_cached": 0, "moves": 0,
                      "started_prompt": 0, "started_cached": 0, "spec_turns": 0}
        bad = [r for r in self.cfg.spec_replicas if not 0 <= r < num_replicas]
        if bad:
            raise ValueError(f"SchedulerConfig.spec_replicas: replica {bad[0]} out of range 0..{num_replicas - 1}")
        self._spec = frozenset(self.cfg.spec_replicas)
        self.switch = SpecSwitch(self.cfg.spec_crossover)

    # -- the pick_engine hook ----------------------------------------------------------------------
    def __call__(self, episode, engines: Sequence[Engine], in_flight: Sequence[int]) -> int:
        return self.place(episode.traj_id, episode.tokens, len(episode.turns), in_flight)

    def place(self, traj_id: str, tokens: Sequence[int], turns: int, in_flight: Sequence[int] | None = None) -> int:
        """The replica for the next turn of ``traj_id`` (context ``tokens``, ``turns`` done).
        ``in_flight``: the agent loop's per-engine counts (engines it must avoid carry +2**20)."""
        cfg = self.cfg
        with self._lock:
            tr = self._traj.get(traj_id)
            if tr is None:                      # a fork continues its parent's prefix
                tr = self._traj[traj_id] = _Traj()
                while len(self._traj) > cfg.max_trajectories:
                    self._drop_pending(self._traj.popitem(last=False)[0])
            else:
                self._traj.move_to_end(traj_id)
            tr.hashes = self.models[0].block_hashes(tokens, tr.hashes if len(tokens) >= tr.length else None)
            tr.length, tr.turns = len(tokens), turns
            self._max_turns = max(self._max_turns, turns + 1)
            progress = turns / self._max_turns
            usable = [r for r in range(self.n) if in_flight is None or in_flight[r] < 1 << 20]  # else down/tried
            if self._spec:                       # speculation by load: a choice of replica kind
                want = self.switch.speculate(len(self._work))
                kind = [r for r in usable if (r in self._spec) == want]
                usable = kind or usable
                self.stats["spec_turns"] += bool(kind) and want
            self._drop_pending(traj_id)          # placed again before its last placement started
            pending = self._pending_match(tr.hashes)
            best, best_cost, cached_best = 0, float("inf"), 0
            for r in usable:
                cached = max(self.models[r].match(tr.hashes, touch=False), pending[r])
                cost = cfg.prefill_weight * (len(tokens) - cached) + \
                    cfg.load_weight * (1.0 + cfg.progress_weight * progress) * self.load[r]
                if cost < best_cost - 1e-9 or (abs(cost - best_cost) <= 1e-9 and r == tr.replica):
                    best, best_cost, cached_best = r, cost, cached
            if best_cost == float("inf"):
                best = min(range(self.n), key=lambda r: in_flight[r] if in_flight is not None else 0)
                cached_best = max(self.models[best].match(tr.hashes, touch=False), pending[best])
            if tr.replica is not None and tr.replica != best:
                self.stats["moves"] += 1
            tr.replica = best
            self.stats["turns"] += 1
            self.stats["prompt_tokens"] += len(tokens)
            self.stats["predicted_cached"] += cached_best
            self.models[best].match(tr.hashes)           # touch: it is about to be used
            work = len(tokens) - cached_best + cfg.expected_decode
            self._pending[traj_id] = (best, tr.hashes, work)
            self.load[best] += work
        return best

    def _pending_match(self, hashes: list[int]) -> list[int]:
        """Per replica, the longest prefix (tokens) of ``hashes`` that a pending turn's context shares
        (with ``hybrid_cache``: only a whole pending context, where the engine will store states)."""
        out = [0] * self.n
        for r, other, _ in self._pending.values():
            k = 0
            for a, b in zip(hashes, other):
                if a != b:
                    break
                k += 1
            if self.cfg.hybrid_cache and k < len(other):
                k = 0
            out[r] = max(out[r], k * self.cfg.block)
        return out

    def _drop_pending(self, traj_id: str) -> None:
        """Forget ``traj_id``'s placed-not-started turn (its work leaves ``load``). Caller holds the lock."""
        p = self._pending.pop(traj_id, None)
        if p is not None:
            self.load[p[0]] = max(0.0, self.load[p[0]] - p[2])

    def priority(self, traj_id: str) -> tuple[int, int]:
        """Admission order key (smaller first): more turns done, then longer context, first."""
        tr = self._traj.get(traj_id)
        return (-tr.turns, -tr.length) if tr is not None else (0, 0)

    def engine_priority(self, rid: str | None) -> int | None:
        """The ``SamplingParams.priority`` of request ``rid`` under ``cfg.priority`` (``None``: off,
        or a rid of no trajectory this scheduler placed nor of the agent loop's form)."""
        if self.cfg.priority is None:
            return None
        tr = self._traj.get(traj_of(rid))
        turns = tr.turns if tr is not None else turns_of(rid)
        return None if turns is None else progress_priority(turns)

    # -- bookkeeping from the engine wrappers --------------------------------------------------------
    def started(self, replica: int, rid: str, tokens: Sequence[int], max_new: int) -> None:
        with self._lock:
            self._drop_pending(traj_of(rid))     # its placement's estimate -> the turn's own work
            hashes = self.models[replica].block_hashes(tokens)
            cached = self.models[replica].match(hashes, touch=False)
            work = len(tokens) - cached + min(max_new, self.cfg.expected_decode)
            self.stats["started_prompt"] += len(tokens)
            self.stats["started_cached"] += cached          # the modelled prefix-cache hits
            self._work[rid] = (replica, work)
            self.load[replica] += work
            self.models[replica].insert(hashes)          # the prompt is cached once prefilled

    def finished(self, replica: int, rid: str, tokens: Sequence[int], gen: Generation | None) -> None:
        with self._lock:
            self._drop_pending(traj_of(rid))     # (started already did, unless started was skipped)
            r, work = self._work.pop(rid, (replica, 0.0))
            self.load[r] = max(0.0, self.load[r] - work)
            if gen is not None:
                self.stats["reported_cached"] += int(gen.cached_tokens)
                self.models[r].insert(self.models[r].block_hashes(list(tokens) + list(gen.output_ids)))

    def cache_hit(self) -> float:
        """Modelled prefix-cache hit rate of the turns started so far (cached / prompt tokens)."""
        return self.stats["started_cached"] / max(1, self.stats["started_prompt"])

    def wrap(self, engines: Sequence[Engine]) -> list["ScheduledEngine"]:
        if len(engines) != self.n:
            raise ValueError(f"the scheduler models {self.n} replicas, got {len(engines)} engines")
        return [ScheduledEngine(e, i, self) for i, e in enumerate(engines)]


def traj_of(rid: str | None) -> str:
    """The agent loop's rid ``traj_id#turn-n`` -> ``traj_id``."""
    return (rid or "").split("#", 1)[0]


class ScheduledEngine:
    """An :class:`Engine` that reports to a :class:`WarScheduler` and admits at most
    ``max_running`` turns to its replica, the waiting ones by progress (most advanced first)."""

    def __init__(self, engine: Engine, index: int, scheduler: WarScheduler):
        self.engine, self.index, self.sched = engine, index, scheduler
        self.name = getattr(engine, "name", f"replica{index}")
        self._cv = threading.Condition()
        self._running = 0
        self._waiting: list[tuple[Any, int]] = []
        self._seq = itertools.count()

    def __getattr__(self, item):             # everything else is the engine's
        return getattr(self.engine, item)

    def _admit(self, key) -> None:
        limit = self.sched.cfg.max_running
        if not limit:
            return
        with self._cv:
            me = (key, next(self._seq))
            heapq.heappush(self._waiting, me)
            while self._running >= limit or self._waiting[0] != me:
                self._cv.wait()
            heapq.heappop(self._waiting)
            self._running += 1
            self._cv.notify_all()

    def _release(self) -> None:
        if not self.sched.cfg.max_running:
            return
        with self._cv:
            self._running -= 1
            self._cv.notify_all()

    def generate(self, input_ids: Sequence[int], sampling: SamplingParams, rid: str | None = None) -> Generation:
        self._admit(self.sched.priority(traj_of(rid)))
        prio = self.sched.engine_priority(rid)
        if prio is not None:
            sampling = replace(sampling, priority=prio)
        key = rid or f"anon-{next(self._seq)}"
        self.sched.started(self.index, key, input_ids, sampling.max_new_tokens)
        gen = None
        try:
            gen = self.engine.generate(input_ids, sampling, rid=rid)
            return gen
        finally:
            self.sched.finished(self.index, key, input_ids, gen)
            self._release()


class ProgressPriorityEngine:
    """An :class:`Engine` that sends every request with ``SamplingParams.priority`` =
    :func:`progress_priority` of the turns in its agent-loop rid (other rids: unchanged); placement
    stays the caller's (e.g. ``sticky_least_loaded``)."""

    def __init__(self, engine: Engine):
        self.engine = engine
        self.name = getattr(engine, "name", "engine")

    def __getattr__(self, item):
        return getattr(self.engine, item)

    def generate(self, input_ids: Sequence[int], sampling: SamplingParams, rid: str | None = None) -> Generation:
        turns = turns_of(rid)
        if turns is not None:
            sampling = replace(sampling, priority=progress_priority(turns))
        return self.engine.generate(input_ids, sampling, rid=rid)


def with_progress_priority(engines: Sequence[Engine]) -> list[ProgressPriorityEngine]:
    """``engines`` wrapped by :class:`ProgressPriorityEngine` (same order)."""
    return [ProgressPriorityEngine(e) for e in engines]


class SpecSwitch:
    """Speculation on while the turns in flight are at most ``crossover``; :meth:`from_rows` takes
    the crossover from measured rollout rows instead of a guess."""

    def __init__(self, crossover: int):
        if crossover < 0:
            raise ValueError(f"crossover must be >= 0, got {crossover}")
        self.crossover = crossover

    def speculate(self, concurrent: int) -> bool:
        return concurrent <= self.crossover

    @classmethod
    def from_rows(cls, rows: Sequence[dict], spec_policy: str = "suffix") -> "SpecSwitch":
        """The crossover measured: the largest concurrency up to which ``spec_policy``'s tokens/s is
        at least no speculation's (``none``) at every measured concurrency (``bench_war`` rows with
        ``concurrency``, ``policy``, ``tokens_per_s``; several rows of a policy and concurrency are
        averaged). Pass the rows of the configuration that will run (same model, engine flags, CUDA
        graphs or not). 0 where speculation never paid or nothing comparable was measured."""
        tps: dict[int, dict[str, list[float]]] = {}
        for r in rows:
            if r.get("tokens_per_s") is not None and r.get("concurrency") is not None:
                tps.setdefault(int(r["concurrency"]), {}).setdefault(r.get("policy"), []).append(float(r["tokens_per_s"]))
        crossover = 0
        for conc in sorted(tps):
            d = {k: sum(v) / len(v) for k, v in tps[conc].items()}
            if spec_policy not in d or "none" not in d:
                continue
            if d[spec_policy] < d["none"]:
                break
            crossover = conc
        return cls(crossover)
