"""Engine-worker fault tolerance: a token log, resumable requests, shadow workers and a supervisor.

Pieces (each behind the :class:`~megatron_harts.rollout.types.Engine` protocol or a narrow one):

* :class:`TokenLog`: per request, the prompt, the sampling parameters and every generated token
  with its log-prob and arrival time, appended as the engine streams them (optionally also to a
  JSONL write-ahead file). What was logged is never rewritten.
* :class:`Supervisor`: owns the engine servers it starts (``start_server(model_path, version)`` ->
  a :class:`~megatron_harts.rollout.engines.launch._ServerProcess`): ``num_active`` serving
  slots and ``num_shadows`` pre-started *shadow* workers, already loaded and kept at the current
  weight version (:meth:`Supervisor.update_weights_from_disk` goes to every worker, shadows
  included, and a shadow started later comes up on the newest checkpoint). A monitor thread checks
  each active worker every ``health_interval_s`` (the server's ``alive()``: process exit, and for
  SGLang a dead scheduler or detokenizer child) and, in a second thread, ``GET /health``; a client
  that sees a connection error reports it (:meth:`Supervisor.failover`). A failed slot gets a
  shadow (promotion: a pointer swap, milliseconds); the failed server's process group is SIGKILLed
  at once (``kill_failed``: a request still reading its stream, e.g. from an SGLang HTTP process
  whose scheduler died, gets a broken connection and resumes on the shadow now, not when the
  server exits by itself), it is reaped and a new shadow is started in the background. With no
  shadow ready the slot waits for one being started, or cold-starts a server (the baseline).
  With a weight keeper (``Supervisor(keeper=..., start_dummy=...)``, off by default; :mod:`.keeper`)
  a new worker does not read the checkpoint: it starts with dummy weights and is re-armed from the
  keeper's memory (CUDA IPC / shared memory) after a health check of the keeper; a dead, unhealthy
  or stale keeper falls back to the checkpoint.
* :class:`ResumableEngine`: the ``Engine`` the agent loop sees for one slot. ``generate`` streams
  (``HttpEngine.generate_stream``), logging tokens as they arrive; when the worker fails mid-request
  it continues on the slot's replacement with ``input_ids = prompt + generated so far`` and
  ``max_new_tokens = budget - generated``: the KV cache is rebuilt by one prefill and no generated
  token (or its log-prob) is lost or changed. With the engines' deterministic sampling (SGLang's
  and the embedded engine's ``--enable-deterministic-inference``: draws keyed by seed and token
  position) the continuation is the one the dead worker would have produced. With a server
  ``--stream-interval N`` (SGLang's flag; the embedded server's too) the log grows by whole events
  of N tokens: the up to N - 1 tokens a dead worker generated after its last event were never
  logged and are generated again by the resumed request (the same ones with deterministic
  sampling); nothing logged is lost or changed. N > 1 removes most of the per-token cost of
  streaming (docs/belayer.md, "Stream interval").

Times are ``time.monotonic()`` seconds; token ids are the engine's vocabulary.
"""
from __future__ import annotations

import dataclasses
import itertools
import json
import logging
import threading
import time
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

from ..engines.http import HttpEngine
from ..types import EngineError, Generation, SamplingParams

log = logging.getLogger(__name__)


# ------------------------------------------------------------------------------------ the log
@dataclass
class Segment:
    """One engine attempt of a request: which worker, from which output offset, when it started,
    when its first token arrived, how many tokens it added and how it ended (``error`` or None)."""

    worker: str
    offset: int
    t_start: float
    t_first: float | None = None
    tokens: int = 0
    error: str | None = None
    weight_version: str | None = None


@dataclass
class RequestRecord:
    """The log of one request: ``prompt`` ``[P]`` (released when it finishes; ``prompt_len`` = P),
    ``output_ids`` / ``logprobs`` / ``times`` ``[n]`` (token, its log-prob, its arrival time), the
    attempts (``segments``) and the end."""

    rid: str
    prompt: list[int]
    sampling: SamplingParams
    output_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    times: list[float] = field(default_factory=list)
    segments: list[Segment] = field(default_factory=list)
    finish_reason: str | None = None
    t_submit: float = field(default_factory=time.monotonic)
    prompt_len: int = 0

    @property
    def resumed(self) -> bool:
        return any(s.error for s in self.segments)


class TokenLog:
    """Thread-safe request records, keyed by rid; ``path``: also append each event as a JSON line
    (``{"rid", "prompt"}`` once, then ``{"rid", "ids", "logprobs"}`` per streamed piece and
    ``{"rid", "finish"}``). Nothing reads the file back: the records of this process are what
    :class:`ResumableEngine` resumes from, and after a crash of the client process the episode
    journal (:mod:`.journal`) resumes at turn boundaries, regenerating the turn in flight.

    Memory stays bounded over a long run: a request in flight is never dropped; a finished one
    releases its prompt (only a resume reads it; ``prompt_len`` stays) and at most ``keep`` finished
    records are kept, the oldest dropped first (``resumed()`` reports among those)."""

    def __init__(self, path: str | None = None, keep: int = 4096):
        if keep < 0:
            raise ValueError(f"TokenLog: keep must be >= 0, got {keep}")
        self._lock = threading.Lock()
        self.records: dict[str, RequestRecord] = {}
        self._finished: deque[str] = deque()
        self.keep = keep
        self._file = open(path, "a", buffering=1) if path else None

    def open(self, rid: str, prompt: Sequence[int], sampling: SamplingParams) -> RequestRecord:
        rec = RequestRecord(rid, [int(t) for t in prompt], sampling)
        rec.prompt_len = len(rec.prompt)
        with self._lock:
            if rid in self.records:
                raise ValueError(f"request id {rid} is already in the token log")
            self.records[rid] = rec
            if self._file:
                self._file.write(json.dumps({"rid": rid, "prompt": rec.prompt}) + "\n")
        return rec

    def append(self, rec: RequestRecord, ids: Sequence[int], logprobs: Sequence[float]) -> None:
        now = time.monotonic()
        with self._lock:
            rec.output_ids += [int(t) for t in ids]
            rec.logprobs += [float(x) for x in logprobs]
            rec.times += [now] * len(ids)
            if self._file:
                self._file.write(json.dumps({"rid": rec.rid, "ids": list(ids), "logprobs": list(logprobs)}) + "\n")

    def finish(self, rec: RequestRecord, reason: str) -> None:
        with self._lock:
            rec.finish_reason = reason
            rec.prompt = []
            if self.records.get(rec.rid) is rec:
                self._finished.append(rec.rid)
                while len(self._finished) > self.keep:
                    self.records.pop(self._finished.popleft(), None)
            if self._file:
                self._file.write(json.dumps({"rid": rec.rid, "finish": reason}) + "\n")

    def resumed(self) -> list[RequestRecord]:
        with self._lock:
            return [r for r in self.records.values() if r.resumed]

    def close(self) -> None:
        if self._file:
            self._file.close()
            self._file = None


# ---------------------------------------------------------------------------------- supervisor
@dataclass
class Worker:
    """One started server and its client. ``version``: the weight version it serves."""

    server: Any
    engine: HttpEngine
    version: str | None
    started_s: float
    name: str


@dataclass
class FailoverEvent:
    """A worker failure handled by the supervisor: ``t_detect`` (when it was reported or seen),
    ``t_ready`` (when the slot had a live replacement), ``how`` (``shadow``, ``cold`` start,
    ``transient``: the worker was healthy after all), ``cause``."""

    slot: int
    failed: str
    replacement: str
    how: str
    cause: str
    t_detect: float
    t_ready: float

    @property
    def seconds(self) -> float:
        return self.t_ready - self.t_detect


class Supervisor:
    """Active workers, shadow workers, failure detection and promotion (see the module doc).

    ``start_server(model_path, version)``: starts one server and returns it once healthy (e.g.
    ``lambda p, v: EmbeddedServer(p, weight_version=v).start()``; anything with ``engine()``,
    ``alive()``, ``stop()``, ``url``); ``num_active``: serving slots; ``num_shadows``: shadows
    kept ready (0: failures are recovered by a cold start, the baseline); ``health_interval_s``:
    the monitor's period (0: no monitor thread, failures found by clients only);
    ``engine_kw``: :class:`HttpEngine` keywords for the clients; ``parallel_start``: start the
    initial workers in parallel (``False``: one after the other, needed for SGLang servers sharing
    one GPU: each sizes its KV pool from the memory free when it starts, so two profiling at once
    can leave one with none); ``warmup(engine)``: run on every new worker before it is used (a
    shadow before it is ready, a cold start before it serves), e.g. a short sampled generation so
    that JIT compilation (SGLang's ``torch.compile``'d seeded sampler, Triton autotuning) is not
    charged to the first real request; its time is part of ``cold_starts`` (also in ``warmups``);
    ``kill_failed``: SIGKILL a failed worker's process group (the server's ``kill()``) the moment
    its slot is handed to another worker (False: only the background ``stop()``, SIGTERM then
    SIGKILL after the server's grace period, during which its open streams may stay silent; an
    SGLang server given SIGTERM drains its requests, which a dead scheduler never finishes).
    The price of True: a worker declared failed by mistake loses its in-flight requests, which then
    resume on the new worker. ``health_grace_s``: how long ``GET /health`` must keep failing (each
    call a 2 s timeout) while the server's processes are alive before the worker is declared failed
    (default 30 s). A dead process (the server, or SGLang's scheduler / detokenizer child) is
    caught by the process check within one ``health_interval_s`` whatever this is; the grace only
    delays catching a worker that hangs with its processes alive. It keeps a busy but healthy
    server from being killed: on the H200 (2026-12-03) an SGLang server compiling its seeded
    sampler on its first request answered no ``/health`` for > 4 s and, with the old rule (two
    failed calls in a row), was SIGKILLed with 16 requests in flight.

    ``keeper`` (default None: off): a :class:`~.keeper.Keeper` that owns the current weights in a
    process of its own; with it every new worker (shadow or cold start) is started by
    ``start_dummy(model_path, version)`` (a server that does not read the checkpoint: SGLang's or
    the embedded engine's ``--load-format dummy``) and re-armed from the keeper
    (:meth:`~.keeper.Keeper.rearm`: health check of the keeper and its GPU, handles at the
    supervisor's weight version, ``/update_weights_from_tensor``). When the keeper is dead,
    unhealthy or holds another version (refused, never served), or the worker refuses the
    tensors, the worker is started by ``start_server`` instead (the checkpoint); ``rearms`` records
    every start made with a keeper configured (``{"how": "keeper" | "checkpoint", "reason",
    "start_s", "health_s", "handles_s", "update_s", "rearm_s"}``, seconds).
    :meth:`update_weights_from_disk` also moves the keeper to the new checkpoint. The supervisor
    does not start or stop the keeper.
    """

    def __init__(self, start_server: Callable[[str, str | None], Any], model_path: str, version: str | None = None,
                 *, num_active: int = 1, num_shadows: int = 1, health_interval_s: float = 0.5,
                 engine_kw: dict | None = None, failover_timeout_s: float = 600.0, parallel_start: bool = True,
                 warmup: Callable[[HttpEngine], Any] | None = None, kill_failed: bool = True,
                 keeper: Any = None, start_dummy: Callable[[str, str | None], Any] | None = None,
                 health_grace_s: float = 30.0):
        if num_active < 1 or num_shadows < 0:
            raise ValueError(f"Supervisor needs num_active >= 1 and num_shadows >= 0, got {num_active}, {num_shadows}")
        if keeper is not None and start_dummy is None:
            raise ValueError("Supervisor: keeper needs start_dummy (a server start that does not read the checkpoint)")
        self._start_server = start_server
        self.keeper, self._start_dummy = keeper, start_dummy
        self.rearms: list[dict[str, Any]] = []
        self.model_path, self.version = str(model_path), version
        self.num_active, self.num_shadows = num_active, num_shadows
        self.health_interval_s = float(health_interval_s)
        self.health_grace_s = float(health_grace_s)
        self.engine_kw = dict(engine_kw or {"timeout": 120.0, "retries": 0})
        self.failover_timeout_s = float(failover_timeout_s)
        self.parallel_start, self._warmup = bool(parallel_start), warmup
        self.kill_failed = bool(kill_failed)
        self._lock = threading.RLock()
        self._cv = threading.Condition(self._lock)
        self.slots: list[Worker | None] = [None] * num_active
        self.shadows: deque[Worker] = deque()
        self._starting = 0                 # shadows being started in the background
        self.events: list[FailoverEvent] = []
        self.cold_starts: list[float] = []  # seconds of every server start (shadows and cold), warm-up included
        self.warmups: list[float] = []      # seconds of the warm-up part of each
        self._ids = itertools.count()
        self._stop = threading.Event()
        self._pool = ThreadPoolExecutor(max_workers=4, thread_name_prefix="belayer-sup")
        self._monitors: list[threading.Thread] = []

    # -- lifecycle ------------------------------------------------------------------------------
    def _new_worker(self) -> Worker:
        with self._lock:
            path, version = self.model_path, self.version
        t0 = time.monotonic()
        server = self._start(path, version)
        w = Worker(server, server.engine(**self.engine_kw), version, time.monotonic() - t0,
                   f"w{next(self._ids)}@{server.url}")
        t_warm = time.monotonic()
        if self._warmup is not None:
            try:
                self._warmup(w.engine)
            except Exception:
                self._stop_quietly(w)
                raise
        secs = w.started_s = time.monotonic() - t0
        with self._lock:
            self.cold_starts.append(secs)
            self.warmups.append(time.monotonic() - t_warm)
            stale = self.version != version
        if stale:                          # a weight update happened while it started
            self._update_worker(w, self.model_path, self.version)
        log.info("belayer: worker %s up in %.2f s (weights %s)", w.name, secs, w.version)
        return w

    def _start(self, path: str, version: str | None) -> Any:
        """A started server at ``version``: re-armed from the keeper when there is one and it is
        fit, else loaded from the checkpoint ``path`` (see the class doc)."""
        if self.keeper is None:
            return self._start_server(path, version)
        from .keeper import KeeperError, StaleWeights

        t0 = time.monotonic()
        rec: dict[str, Any] = {"how": "checkpoint", "reason": None}
        try:
            held = self.keeper.health().get("weight_version")
            if held != version:     # checked before a server is started for nothing
                raise StaleWeights(f"keeper holds weight version {held!r}, the supervisor serves {version!r}")
        except KeeperError as e:
            rec["reason"] = str(e)
        else:
            server = None
            try:
                server = self._start_dummy(path, version)
                rec["start_s"] = time.monotonic() - t0
                rec.update(self.keeper.rearm(server.engine(**self.engine_kw), version))
            except EngineError as e:              # the dummy start failed, KeeperError / StaleWeights, refused
                rec["reason"] = str(e)
                try:
                    if server is not None:
                        server.stop()
                except Exception as e2:     # noqa: BLE001 - best effort; the checkpoint start follows
                    log.debug("stopping the un-armed server: %s", e2)
            else:
                rec["how"] = "keeper"
                with self._lock:
                    self.rearms.append(rec)
                log.info("belayer: worker at %s re-armed from the keeper (start %.2f s, re-arm %.3f s)",
                         getattr(server, "url", "?"), rec["start_s"], rec["rearm_s"])
                return server
        log.warning("belayer: not re-armed from the keeper (%s); loading the checkpoint %s", rec["reason"], path)
        t1 = time.monotonic()
        server = self._start_server(path, version)
        rec["start_s"] = time.monotonic() - t1
        with self._lock:
            self.rearms.append(rec)
        return server

    def start(self) -> "Supervisor":
        """Start the active workers and the shadows (in parallel unless ``parallel_start`` is
        False) and the monitor."""
        n = self.num_active + self.num_shadows
        workers, errors = [], []
        if self.parallel_start:
            futures = [self._pool.submit(self._new_worker) for _ in range(n)]
            for f in futures:
                try:
                    workers.append(f.result())
                except Exception as e:       # noqa: BLE001 - stop the ones that came up, then raise
                    errors.append(e)
        else:
            for _ in range(n):
                try:
                    workers.append(self._new_worker())
                except Exception as e:       # noqa: BLE001 - stop the ones that came up, then raise
                    errors.append(e)
                    break
        if errors:
            for w in workers:
                self._stop_quietly(w)
            self._pool.shutdown(wait=False, cancel_futures=True)
            raise errors[0]
        with self._lock:
            self.slots = workers[:self.num_active]
            self.shadows.extend(workers[self.num_active:])
        if self.health_interval_s > 0:
            self._monitors = [threading.Thread(target=f, name=f"belayer-monitor-{n}", daemon=True)
                              for f, n in ((self._watch, "process"), (self._watch_health, "health"))]
            for t in self._monitors:
                t.start()
        return self

    def close(self, wait: bool = True) -> None:
        """Stop the monitor and every server. ``wait=False``: do not wait for shadows still
        starting in the background (each stops itself once up; the caller may stop them sooner)."""
        self._stop.set()
        for t in self._monitors:
            t.join(5.0)
        self._pool.shutdown(wait=wait, cancel_futures=True)
        with self._lock:
            workers = [w for w in self.slots if w is not None] + list(self.shadows)
            self.slots, self.shadows = [None] * self.num_active, deque()
        for w in workers:
            self._stop_quietly(w)

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc):
        self.close()

    @staticmethod
    def _stop_quietly(w: Worker) -> None:
        try:
            w.server.stop()
        except Exception as e:       # noqa: BLE001 - best effort on a dead server
            log.debug("stopping %s: %s", w.name, e)

    # -- serving --------------------------------------------------------------------------------
    def engine(self, slot: int) -> HttpEngine:
        """The client of the worker serving ``slot`` now (waits while the slot is being replaced)."""
        with self._cv:
            deadline = time.monotonic() + self.failover_timeout_s
            while self.slots[slot] is None:
                if not self._cv.wait(max(0.0, deadline - time.monotonic())) and time.monotonic() > deadline:
                    raise EngineError(f"belayer: slot {slot} has no worker after {self.failover_timeout_s:g} s")
            return self.slots[slot].engine

    def worker(self, slot: int) -> Worker | None:
        with self._lock:
            return self.slots[slot]

    def _healthy(self, w: Worker, timeout: float = 2.0) -> bool:
        alive = getattr(w.server, "alive", None)
        if alive is not None and not alive():
            return False
        return w.engine.alive(timeout=timeout)

    def failover(self, slot: int, failed_engine: HttpEngine | None, cause: str) -> HttpEngine:
        """Called when ``failed_engine`` (the slot's client a request used) failed: if the slot
        already has another worker, return it; if the worker is in fact healthy (a transient
        error), keep it; else replace it by a shadow (or a cold start) and return the new client."""
        t_detect = time.monotonic()
        with self._cv:
            w = self.slots[slot]
            if w is None or (failed_engine is not None and w.engine is not failed_engine):
                claimed = None                     # being replaced, or replaced already
            else:
                claimed, self.slots[slot] = w, None      # claim the replacement
        if claimed is None:
            return self.engine(slot)
        if self._healthy(claimed, timeout=1.0):  # a transient error: keep the worker
            with self._cv:
                self.slots[slot] = claimed
                self._cv.notify_all()
            self.events.append(FailoverEvent(slot, claimed.name, claimed.name, "transient", cause, t_detect,
                                             time.monotonic()))
            return claimed.engine
        return self._replace(slot, claimed, cause, t_detect).engine

    @staticmethod
    def _kill_quietly(w: Worker) -> None:
        kill = getattr(w.server, "kill", None)
        if kill is None:
            return
        try:
            kill()
        except Exception as e:       # noqa: BLE001 - best effort on a dead server
            log.debug("killing %s: %s", w.name, e)

    def _replace(self, slot: int, failed: Worker, cause: str, t_detect: float) -> Worker:
        if self.kill_failed:         # its open streams break now: their requests fail over at once
            self._kill_quietly(failed)
        self._pool.submit(self._stop_quietly, failed)          # reap the dead server in the background
        new = self._take_shadow()
        with self._cv:
            waiting_for_shadow = new is None and self._starting > 0
        how = "shadow"
        if new is None and waiting_for_shadow:                 # one is starting: wait for it
            with self._cv:
                deadline = time.monotonic() + self.failover_timeout_s
                while not self.shadows and self._starting > 0 and time.monotonic() < deadline:
                    self._cv.wait(0.5)
            new = self._take_shadow()
            how = "shadow (waited)"
        if new is None:                                        # no shadow: cold start (the baseline)
            new = self._new_worker()
            how = "cold"
        with self._cv:
            self.slots[slot] = new
            self._cv.notify_all()
        ev = FailoverEvent(slot, failed.name, new.name, how, cause, t_detect, time.monotonic())
        self.events.append(ev)
        log.warning("belayer: slot %d: %s failed (%s); %s now serves it (%s, %.3f s)", slot, failed.name, cause,
                    new.name, how, ev.seconds)
        self._refill()
        return new

    def _take_shadow(self) -> Worker | None:
        """A ready shadow at the current weight version (a stale one is updated first; one whose
        update fails is stopped and the next is tried), or None."""
        while True:
            with self._cv:
                if not self.shadows:
                    return None
                w = self.shadows.popleft()
                path, version = self.model_path, self.version
            try:
                self._update_worker(w, path, version)
                return w
            except Exception as e:      # noqa: BLE001 - a broken shadow is discarded, not promoted
                log.warning("belayer: shadow %s could not load %s (%s); discarded", w.name, version, e)
                self._pool.submit(self._stop_quietly, w)

    def _refill(self) -> None:
        """Start shadows in the background until ``num_shadows`` are ready or starting."""
        with self._cv:
            need = self.num_shadows - len(self.shadows) - self._starting
            if self._stop.is_set() or need <= 0:
                return
            self._starting += need
        for _ in range(need):
            self._pool.submit(self._start_shadow)

    def _start_shadow(self) -> None:
        try:
            w = self._new_worker()
        except Exception as e:          # noqa: BLE001 - logged; the next failure retries
            log.error("belayer: starting a shadow failed: %s", e)
            with self._cv:
                self._starting -= 1
                self._cv.notify_all()
            return
        with self._cv:
            self._starting -= 1
            if self._stop.is_set():
                stop = True
            else:
                stop = False
                self.shadows.append(w)
            self._cv.notify_all()
        if stop:
            self._stop_quietly(w)

    def _watch(self) -> None:
        """Monitor, process part: an active worker whose server is not ``alive()`` (process
        exited; for SGLang also a dead scheduler or detokenizer child) is replaced at once. Its own
        thread: cheap ``/proc`` reads every ``health_interval_s``, never stuck behind a ``/health``
        call (SGLang's takes >= 1 s and one in flight when the scheduler dies hangs 2 s)."""
        while not self._stop.wait(self.health_interval_s):
            for slot in range(self.num_active):
                w = self.worker(slot)
                alive = getattr(w.server, "alive", None) if w is not None else None
                if alive is None or alive() or self._stop.is_set():
                    continue
                self.failover(slot, w.engine, f"monitor: {getattr(w.server, 'dead_reason', None) or 'process exited'}")

    def _watch_health(self) -> None:
        """Monitor, health part: an active worker whose ``GET /health`` has failed on every call for
        at least ``health_grace_s`` (and at least twice in a row: one slow reply is not a failure)
        is replaced, proactively, before a client trips over it. Dead processes are the process
        part's (:meth:`_watch`); this part catches workers that hang with their processes alive."""
        failing: dict[int, tuple[Any, float, int]] = {}      # slot -> (worker, first failure, count)
        while not self._stop.wait(self.health_interval_s):
            for slot in range(self.num_active):
                w = self.worker(slot)
                if w is None or w.engine.alive(timeout=2.0):
                    failing.pop(slot, None)
                    continue
                prev = failing.get(slot)
                w0, since, n = prev if prev is not None and prev[0] is w else (w, time.monotonic(), 0)
                failing[slot] = (w0, since, n + 1)
                if n + 1 < 2 or time.monotonic() - since < self.health_grace_s:
                    log.warning("belayer: %s: /health failed %d time(s) over %.1f s (grace %.0f s)",
                                w.name, n + 1, time.monotonic() - since, self.health_grace_s)
                    continue
                failing.pop(slot, None)
                if not self._stop.is_set() and self.worker(slot) is w:
                    self.failover(slot, w.engine, f"monitor: /health failed for {time.monotonic() - since:.1f} s")

    # -- weights --------------------------------------------------------------------------------
    def _update_worker(self, w: Worker, path: str, version: str | None) -> None:
        if w.version == version:
            return
        w.engine.update_weights_from_disk(path, version)
        w.version = version

    def update_weights_from_disk(self, path: str, version: str) -> float:
        """Load ``path`` (tagged ``version``) on every active and shadow worker (in parallel);
        shadows started later come up on it. Returns wall seconds. Idempotent per version."""
        t0 = time.monotonic()
        with self._lock:
            self.model_path, self.version = str(path), version
            workers = [w for w in self.slots if w is not None] + list(self.shadows)
        keeper_f = self._pool.submit(self.keeper.load, str(path), version) if self.keeper is not None else None
        errors, stale = [], []
        for w, f in [(w, self._pool.submit(self._update_worker, w, str(path), version)) for w in workers]:
            try:
                f.result()
            except Exception as e:     # noqa: BLE001 - a dead active worker is the monitor's business
                errors.append(f"{w.name}: {e}")
                stale.append(w)
        if keeper_f is not None:
            try:
                keeper_f.result()
            except Exception as e:     # noqa: BLE001 - a stale keeper is refused at the next re-arm
                log.warning("belayer: the keeper did not take weight version %s (%s): new workers load the "
                            "checkpoint until it does", version, e)
        if errors:
            log.warning("belayer: weight update to %s failed on %s", version, errors)
        with self._cv:                 # a shadow that missed the update must never be promoted: replace it
            dropped = [w for w in stale if w in self.shadows]
            for w in dropped:
                self.shadows.remove(w)
        for w in dropped:
            self._pool.submit(self._stop_quietly, w)
        if dropped:
            self._refill()             # new shadows come up on this version
        return time.monotonic() - t0

    def versions(self) -> dict[str, str | None]:
        with self._lock:
            return {w.name: w.version for w in [*self.slots, *self.shadows] if w is not None}


# --------------------------------------------------------------------------- resumable engine
class ResumableEngine:
    """The :class:`~megatron_harts.rollout.types.Engine` of one supervisor slot, with requests
    that survive the worker (see the module doc).

    ``resume``: ``"prefix"`` (continue from prompt + logged tokens: Belayer) or ``"restart"``
    (abort and resubmit from scratch on the replacement: the baseline; the logged tokens are
    discarded); ``max_failovers``: per request; ``break_recovery``: only for proving the checker
    (``"drop_token"``: the resumed request forgets the last logged token); never set otherwise.
    """

    def __init__(self, supervisor: Supervisor, slot: int = 0, log: TokenLog | None = None, *,
                 resume: str = "prefix", max_failovers: int = 3, break_recovery: str | None = None):
        if resume not in ("prefix", "restart"):
            raise ValueError(f"resume must be 'prefix' or 'restart', got {resume!r}")
        self.sup, self.slot = supervisor, slot
        self.log = log or TokenLog()
        self.mode, self.max_failovers, self.break_recovery = resume, max_failovers, break_recovery
        self.name = f"belayer[{slot}]"
        self._rid = itertools.count()
        self._active: dict[str, tuple[RequestRecord, HttpEngine, str]] = {}
        self._aborted: set[str] = set()
        self._lock = threading.Lock()

    def generate(self, input_ids: Sequence[int], sampling: SamplingParams, rid: str | None = None) -> Generation:
        rid = rid or f"belayer-{id(self):x}-{next(self._rid)}"
        rec = self.log.open(rid, input_ids, sampling)
        stops = set(sampling.stop_token_ids)
        errors: list[str] = []
        dropped: set[int] = set()          # only with break_recovery="drop_token"
        t0 = time.perf_counter()
        gen: Generation | None = None
        for attempt in range(self.max_failovers + 1):
            n = len(rec.output_ids)
            if n and (rec.output_ids[-1] in stops):
                reason = "stop"
                break
            if n >= sampling.max_new_tokens:
                reason = "length"
                break
            engine = self.sup.engine(self.slot)
            seg = Segment(engine.name, n, time.monotonic())
            rec.segments.append(seg)
            sp = dataclasses.replace(sampling, max_new_tokens=sampling.max_new_tokens - n)

            def on_tokens(ids, lps, seg=seg):
                if seg.t_first is None:
                    seg.t_first = time.monotonic()
                seg.tokens += len(ids)
                self.log.append(rec, ids, lps)

            sub_rid = f"{rid}.{attempt}~"           # prefix-free (SGLang aborts by rid prefix)
            with self._lock:
                if rid in self._aborted:
                    reason = "abort"
                    break
                self._active[rid] = (rec, engine, sub_rid)
            try:
                gen = engine.generate_stream(rec.prompt + rec.output_ids, sp, rid=sub_rid, on_tokens=on_tokens)
                seg.weight_version = gen.weight_version
                if gen.finish_reason == "abort" and rid not in self._aborted:
                    raise EngineError(f"{engine.name}: request aborted by the engine")
                reason = gen.finish_reason
                break
            except EngineError as e:
                seg.error = str(e)
                errors.append(str(e))
                if rid in self._aborted:
                    reason = "abort"
                    break
                log.warning("belayer: %s failed on %s after %d tokens (%s); failing over", rid, engine.name,
                            len(rec.output_ids), e)
                self.sup.failover(self.slot, engine, str(e))
                if self.mode == "restart":           # baseline: throw the logged tokens away
                    with self.log._lock:
                        del rec.output_ids[:], rec.logprobs[:], rec.times[:]
                elif self.break_recovery == "drop_token" and rec.output_ids:
                    dropped.add(len(rec.output_ids) - 1)   # deliberately broken: lose the last logged token
            finally:
                with self._lock:
                    self._active.pop(rid, None)
        else:
            self.log.finish(rec, "error")
            raise EngineError(f"belayer: {rid} failed {self.max_failovers + 1} times: " + "; ".join(errors))
        with self._lock:
            self._aborted.discard(rid)
        self.log.finish(rec, reason)
        version = gen.weight_version if gen is not None else (rec.segments[-1].weight_version if rec.segments else None)
        keep = [i for i in range(len(rec.output_ids)) if i not in dropped]
        return Generation(output_ids=[rec.output_ids[i] for i in keep], logprobs=[rec.logprobs[i] for i in keep],
                          finish_reason=reason,
                          weight_version=version, prompt_tokens=len(input_ids), latency_s=time.perf_counter() - t0)

    def abort(self, rid: str) -> None:
        with self._lock:
            self._aborted.add(rid)
            active = self._active.get(rid)
        if active is not None:
            active[1].abort(active[2])

    def load(self) -> dict[str, Any]:
        return self.sup.engine(self.slot).load()

    def health(self, timeout: float = 5.0) -> bool:
        return self.sup.engine(self.slot).health(timeout)

    def update_weights_from_disk(self, path: str, version: str) -> float:
        """Every worker of the supervisor (actives and shadows) loads ``path``."""
        return self.sup.update_weights_from_disk(path, version)

    def weight_version(self) -> str | None:
        return self.sup.engine(self.slot).weight_version()

    def flush_cache(self) -> None:
        self.sup.engine(self.slot).flush_cache()

    def release_memory(self) -> None:
        self.sup.engine(self.slot).release_memory()

    def resume_memory(self) -> None:
        self.sup.engine(self.slot).resume_memory()

    def pause(self) -> None:
        self.sup.engine(self.slot).pause()

    def resume(self) -> None:
        self.sup.engine(self.slot).resume()

    def __repr__(self) -> str:
        return f"ResumableEngine(slot={self.slot}, resume={self.mode!r})"
