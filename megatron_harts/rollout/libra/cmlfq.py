"""Request queues for rollout engines: C-MLFQ (causality-driven multi-level feedback queue) and the
baselines it is compared with.

A *request* is one turn of an agentic trajectory (a *program*): the engine generates, the tool
runs, and the next turn arrives as a new request. A policy orders the requests waiting for a
slot on an engine and (C-MLFQ only) routes programs to engine *buckets* (e.g. engines set up for
short and for long contexts). Policies see only what a serving system sees: the program's
attained service (tokens generated so far), its turn count, its context length, and the
causal signals of the last tool return (success, error, observation size). ``SPF`` alone also
sees a *predicted* remaining length (a length predictor; in the simulator a noisy oracle, see
:class:`SPF`).

Policies (all non-preemptive: a running request keeps its slot, as SGLang's continuous batching
does without retraction):

* :class:`FCFS` - by arrival of the request.
* :class:`SPF` - shortest predicted remaining program length first.
* :class:`PLAS` - Autellix-style program-level least attained service: levels by the program's
  attained service (thresholds ``base * ratio ** i`` tokens), FCFS within a level.
* :class:`CMLFQ` - PLAS's levels moved by causal signals (rules in its docstring), heterogeneous
  bucket routing by context / observation size, aging against starvation.

Interface (what the simulator and a real router call): ``push(req, now)``, ``pop(bucket, now)``
(``bucket`` of the engine asking; returns a :class:`Request` or ``None``), ``route(req)`` (the
bucket a program should run on), ``__len__``, ``clone()`` (an empty queue with the same rules:
one per engine).
"""
from __future__ import annotations

import copy
import heapq
import itertools
from dataclasses import dataclass, field
from typing import Optional

import numpy as np

SIGNAL_NONE, SIGNAL_SUCCESS, SIGNAL_ERROR = 0, 1, 2


@dataclass
class Request:
    """One turn waiting for an engine. ``attained``: tokens the program generated before this
    turn; ``turn``: 0-based turn index; ``ctx``: context tokens at the start of the turn;
    ``signal``: last tool return (``SIGNAL_*``); ``obs_tokens``: size of that observation;
    ``arrival``: seconds, when the request entered the queue; ``predicted_remaining``: a length
    predictor's estimate of the program's remaining generated tokens (SPF only)."""

    program: int
    turn: int
    ctx: int
    attained: int = 0
    signal: int = SIGNAL_NONE
    obs_tokens: int = 0
    arrival: float = 0.0
    predicted_remaining: float = 0.0
    payload: object = None
    seq: int = field(default=0, compare=False)


class QueuePolicy:
    """Base: one priority heap per bucket (the bucket :meth:`route` picks), lazy deletion, an
    engine of bucket ``b`` takes from its own heap first and steals from the others when it is
    empty (work conserving). Subclasses define :meth:`key` (smaller = sooner)."""

    name = "base"
    buckets = 1

    def __init__(self):
        self._reset()

    def _reset(self) -> None:
        self._heaps: dict[int, list] = {}
        self._count = itertools.count()
        self._n = 0

    def clone(self) -> "QueuePolicy":
        """An empty queue with the same rules (one per engine)."""
        c = copy.copy(self)
        c._reset()
        return c

    def key(self, req: Request, now: float) -> tuple:
        raise NotImplementedError

    def route(self, req: Request) -> int:
        return 0

    def push(self, req: Request, now: float) -> None:
        req.seq = next(self._count)
        b = self.route(req)
        heapq.heappush(self._heaps.setdefault(b, []), (self.key(req, now), req.seq, req))
        self._n += 1

    def _pop_from(self, b: int, now: float) -> Optional[Request]:
        h = self._heaps.get(b)
        if not h:
            return None
        self._n -= 1
        return heapq.heappop(h)[2]

    def pop(self, bucket: int = 0, now: float = 0.0) -> Optional[Request]:
        req = self._pop_from(bucket, now)
        if req is not None:
            return req
        for b in sorted(self._heaps, key=lambda b: -len(self._heaps[b])):
            if b != bucket:
                req = self._pop_from(b, now)
                if req is not None:
                    return req
        return None

    def __len__(self) -> int:
        return self._n


class FCFS(QueuePolicy):
    """First come, first served."""

    name = "fcfs"

    def key(self, req, now):
        return (req.arrival,)


class SPF(QueuePolicy):
    """Shortest predicted (remaining program length) first; ``req.predicted_remaining`` is set by
    the caller's length predictor."""

    name = "spf"

    def key(self, req, now):
        return (req.predicted_remaining, req.arrival)


class PLAS(QueuePolicy):
    """Autellix's program-level least attained service: level ``i`` holds programs whose attained
    service (generated tokens, all turns) is in ``[base * ratio**(i-1), base * ratio**i)``; lower
    levels first, FCFS within a level; ``levels`` caps the depth."""

    name = "plas"

    def __init__(self, base: float = 512.0, ratio: float = 2.0, levels: int = 8):
        super().__init__()
        if base <= 0 or ratio <= 1 or levels < 1:
            raise ValueError(f"PLAS needs base > 0, ratio > 1, levels >= 1 (got {base}, {ratio}, {levels})")
        self.base, self.ratio, self.levels = base, ratio, levels

    def level(self, req: Request) -> int:
        if req.attained < self.base:
            return 0
        return int(min(self.levels - 1, 1 + np.floor(np.log(req.attained / self.base) / np.log(self.ratio))))

    def key(self, req, now):
        return (self.level(req), req.arrival)


class CMLFQ(PLAS):
    """Causality-driven MLFQ. The level starts from PLAS's attained-service level, then:

    * **promote** by ``success_boost`` after a successful tool return (the program's own signal
      that it is close to done: finishing it frees its slot and KV, and completes its group);
    * **demote** by ``error_penalty`` after a tool error (a retry loop: more turns to come);
    * **demote** by 1 once the turn count reaches ``turn_demote`` (long programs yield to young ones);
    * clamp to ``[0, levels - 1]``; FCFS within a level;
    * **aging**: a request that has waited ``age_s`` seconds goes ahead of every level
      (starvation guard: checked on every pop against the oldest waiting request of the bucket);
    * **routing** (``buckets = 2``): a program whose context reaches ``long_ctx`` tokens, or whose
      last observation has ``long_obs`` tokens or more, goes to bucket 1 (long-context engines);
      others to bucket 0. Engines steal from the other bucket when theirs is empty.
    """

    name = "cmlfq"

    def __init__(self, base: float = 512.0, ratio: float = 2.0, levels: int = 8, *, success_boost: int = 2,
                 error_penalty: int = 1, turn_demote: int = 12, age_s: float = 60.0, long_ctx: int = 16384,
                 long_obs: int = 2048, buckets: int = 2):
        super().__init__(base, ratio, levels)
        if buckets not in (1, 2):
            raise ValueError(f"CMLFQ buckets must be 1 or 2, got {buckets}")
        self.success_boost, self.error_penalty, self.turn_demote = success_boost, error_penalty, turn_demote
        self.age_s, self.long_ctx, self.long_obs, self.buckets = age_s, long_ctx, long_obs, buckets

    def _reset(self) -> None:
        super()._reset()
        self._fifo: dict[int, list] = {}
        self._taken: set[int] = set()

    def level(self, req: Request) -> int:
        lv = super().level(req)
        if req.signal == SIGNAL_SUCCESS:
            lv -= self.success_boost
        elif req.signal == SIGNAL_ERROR:
            lv += self.error_penalty
        if req.turn >= self.turn_demote:
            lv += 1
        return int(min(max(lv, 0), self.levels - 1))

    def route(self, req: Request) -> int:
        if self.buckets == 1:
            return 0
        return int(req.ctx >= self.long_ctx or req.obs_tokens >= self.long_obs)

    def push(self, req, now):
        super().push(req, now)
        heapq.heappush(self._fifo.setdefault(self.route(req), []), (req.arrival, req.seq, req))

    def _pop_from(self, b, now):
        h, f = self._heaps.get(b), self._fifo.get(b)
        while f and f[0][1] in self._taken:            # drop FIFO entries already served
            self._taken.discard(heapq.heappop(f)[1])
        if f and now - f[0][0] >= self.age_s:            # aging: the oldest request first
            req = heapq.heappop(f)[2]
            self._taken.add(req.seq)
            self._n -= 1
            return req
        while h:
            _, seq, req = heapq.heappop(h)
            if seq in self._taken:                       # already served by aging
                self._taken.discard(seq)
                continue
            self._taken.add(seq)
            self._n -= 1
            return req
        return None


POLICIES = {"fcfs": FCFS, "spf": SPF, "plas": PLAS, "cmlfq": CMLFQ}


def make_policy(name: str, **kw) -> QueuePolicy:
    """A fresh policy by name (``fcfs``, ``spf``, ``plas``, ``cmlfq``)."""
    if name not in POLICIES:
        raise ValueError(f"queue policy must be one of {sorted(POLICIES)}, got {name!r}")
    return POLICIES[name](**kw)


class TurnQueue:
    """A policy as the agent loop's ``turn_queue`` (:class:`~megatron_harts.rollout.agent_loop.AgentLoop`):
    ready turns are pushed with their :class:`~megatron_harts.rollout.agent_loop.TurnSignals` and
    popped into free slots in the policy's order. One bucket: the loop's slots are not split by
    engine kind (heterogeneous buckets stay the simulator's). ``now`` is seconds (monotonic)."""

    def __init__(self, policy: QueuePolicy | str):
        self.policy = (make_policy(policy, **({"buckets": 1} if policy == "cmlfq" else {}))
                       if isinstance(policy, str) else policy.clone())
        if self.policy.buckets != 1:
            raise ValueError(f"TurnQueue takes a one-bucket policy, got {self.policy.name} with "
                             f"{self.policy.buckets} buckets")
        self.name = self.policy.name

    def push(self, item, sig, now: float) -> None:
        signal = SIGNAL_NONE if sig.tool_ok is None else SIGNAL_SUCCESS if sig.tool_ok else SIGNAL_ERROR
        self.policy.push(Request(program=sig.program, turn=sig.turn, ctx=sig.ctx, attained=sig.attained,
                                 signal=signal, obs_tokens=sig.obs_tokens, arrival=now, payload=item), now)

    def pop(self, now: float):
        req = self.policy.pop(0, now)
        return None if req is None else req.payload

    def __len__(self) -> int:
        return len(self.policy)
