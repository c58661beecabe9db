"""Environment checkpoint / restore and prefix consistency with the model's context.

:class:`CheckpointedEnv` wraps a :class:`~megatron_harts.rollout.envs.base.SandboxEnv` (any
environment whose state is a :class:`~megatron_harts.rollout.sandbox.Sandbox` plus plain Python
attributes) and implements :class:`~megatron_harts.rollout.types.Environment`:

* **log**: every action (the model turn's text) and its :class:`StepResult`, in order;
* **checkpoints** after a turn: the file system (a copy of the overlay's upper directory: only what
  the episode wrote, never the task's base files; an upper directory unchanged since the last
  checkpoint is not copied again, the new checkpoint points at the old copy) and the runtime state
  (the environment object's attributes: turn count, commands run, ``done``, family state). Each
  command runs in its own ``bwrap``: no process outlives a command, so nothing else is lost
  (a family with long-lived processes would restart them by replaying their start command, the
  same replay as below; CRIU does not work on these kernels, so process memory is not restored);
* **when**: a checkpoint is copied in a background thread while the model generates the next turn
  when the predicted generation interval (moving average of the gaps between ``step`` calls) is at
  least ``overlap_factor`` times the predicted copy time; otherwise inline when ``every`` turns
  passed since the last one, else skipped. The next ``step`` waits for a running copy;
* **restore to turn k**: a new sandbox from the newest checkpoint ``c <= k``, the runtime state of
  ``c``, then the logged actions ``c+1..k`` replayed (``recovery="replay"``) with each replayed
  observation compared with the logged one: the first mismatch stops the replay there (the
  environment and the logged context agree up to that turn only); ``recovery="checkpoint"``
  replays nothing (restores ``c``). :meth:`restore` returns the turn reached;
* **faults inside a step** (detected: the sandbox's command killed from outside (negative exit
  status without a timeout), a timed-out (hung) command, output with bytes that are not text
  (U+FFFD, NUL, control characters), a sandbox whose mount or directory is gone
  (``SandboxError``)): the environment is restored to the turn before the action and the action
  re-run; a suspect result that reproduces (the same observation for the same action at the same turn,
  also across a context cut) is the tool's real behaviour and accepted.
  When the restore reaches an earlier turn than the action needs (checkpoint recovery, or a replay
  mismatch) ``step`` raises :class:`PrefixCut` with that turn: the caller cuts the trajectory back
  (:class:`BelayerAgentLoop`) and generation continues from there (prefix consistency).

Baseline (:meth:`CheckpointedEnv.recreate_and_replay`): a fresh environment, every logged action
replayed from the start.
"""
from __future__ import annotations

import copy
import itertools
import logging
import os
import shutil
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from ..agent_loop import AgentLoop, Episode
from ..sandbox import Sandbox, SandboxError
from ..types import StepResult

log = logging.getLogger(__name__)
_BAD_CHARS = {chr(c) for c in range(32) if chr(c) not in "\n\t\r"} | {"\ufffd", "\x7f"}


class PrefixCut(Exception):
    """The environment was restored to turn ``turn`` (< the turns the context holds): cut the
    trajectory back to the end of that turn's observation and generate again from there."""

    def __init__(self, turn: int, reason: str):
        super().__init__(f"environment restored to turn {turn}: {reason}")
        self.turn, self.reason = turn, reason


@dataclass
class Checkpoint:
    """State after turn ``turn``: ``files`` (a copy of the upper dir, possibly shared with the
    previous checkpoint when nothing changed; None while nothing was written), ``state`` (the
    env's attributes, deep-copied), ``fingerprint`` of the upper dir, ``mode`` (``initial``,
    ``background``, ``inline``, ``unchanged``, ``empty``) and the copy's seconds."""

    turn: int
    files: Path | None
    state: dict
    fingerprint: tuple
    mode: str
    seconds: float = 0.0
    ready: threading.Event = field(default_factory=threading.Event)
    error: str | None = None


@dataclass
class CheckpointPolicy:
    """``every``: a checkpoint is due every this many turns; a due checkpoint is copied in the
    background (overlapped with the next turn's generation) when the predicted generation interval
    >= ``overlap_factor`` x the predicted copy time (the first one, with nothing predicted yet,
    too), else inline when ``inline``, else skipped (due again at the next turn); ``ema``: weight
    of the newest sample in the moving averages; ``enabled``: False = only the initial checkpoint
    (recovery replays from the start)."""

    every: int = 1
    overlap_factor: float = 2.0
    inline: bool = True
    ema: float = 0.5
    enabled: bool = True


def _fingerprint(upper: Path) -> tuple:
    out = []
    for dirpath, dirnames, filenames in os.walk(upper):
        for name in sorted(dirnames) + sorted(filenames):
            p = os.path.join(dirpath, name)
            st = os.lstat(p)
            out.append((os.path.relpath(p, upper), st.st_mode, st.st_size, st.st_mtime_ns, st.st_rdev))
    return tuple(sorted(out))


def suspect(res: StepResult, action: str = "") -> str | None:
    """Why a step's result looks like an infrastructure fault (None when it does not): a timed-out
    command (``hang``), one killed from outside (negative exit status: ``killed``), or more
    non-text characters (U+FFFD, NUL, control characters other than newline and tab) in the
    observation than in the ``action`` it answers (a tool may echo the action's own bytes)."""
    info = res.info or {}
    if info.get("tool") == "run":
        if info.get("timed_out"):
            return "hang"
        if isinstance(info.get("exit"), int) and info["exit"] < 0:
            return "killed"
    if res.observation:
        n_bad = sum(c in _BAD_CHARS for c in res.observation)
        if n_bad > sum(c in _BAD_CHARS for c in action):
            return "garbage"
    return None


class CheckpointedEnv:
    """An :class:`~megatron_harts.rollout.types.Environment` with checkpoints, restore and fault
    recovery (see the module doc). ``make()``: a fresh inner environment (a ``SandboxEnv``);
    ``recovery``: ``"replay"`` or ``"checkpoint"``; ``max_retries``: re-runs of a faulty step;
    ``root``: where checkpoint copies go (default: the temp dir); ``break_recovery``: only for
    proving the checker (``"no_cut"``: restore without telling the caller, so the context keeps
    turns the environment no longer has)."""

    _ids = itertools.count()

    def __init__(self, make: Callable[[], Any], *, policy: CheckpointPolicy | None = None,
                 recovery: str = "replay", max_retries: int = 2, root: str | None = None,
                 break_recovery: str | None = None, _inner: Any = None, _log: tuple | None = None):
        if recovery not in ("replay", "checkpoint"):
            raise ValueError(f"recovery must be 'replay' or 'checkpoint', got {recovery!r}")
        self._make, self.policy = make, policy or CheckpointPolicy()
        self.recovery, self.max_retries, self.break_recovery = recovery, max_retries, break_recovery
        self.env = _inner if _inner is not None else make()
        self.task_id = self.env.task_id
        self._dir = Path(tempfile.mkdtemp(prefix=f"harts-ckpt-{os.getpid()}-", dir=root))
        self._root = root
        self.actions: list[str] = list(_log[0]) if _log else []
        self.results: list[StepResult] = list(_log[1]) if _log else []
        self.checkpoints: list[Checkpoint] = []
        self.stats: dict[str, Any] = {"faults": [], "restores": [], "checkpoint_s": 0.0, "checkpoint_wait_s": 0.0,
                                      "modes": {}, "wrapper_s": 0.0, "inner_s": 0.0}
        self._gen_ema: float | None = None
        self._ckpt_ema: float | None = None
        self._last_step_end: float | None = None
        self._thread: threading.Thread | None = None
        self._suspects: set[tuple] = set()      # (turn, action, why, observation) seen once
        self._frozen: dict[str, Any] = {}          # attributes whose deep copy is themselves (see _state)
        self._checkpoint("initial" if not self.actions else "inline")

    # -- Environment protocol ---------------------------------------------------------------------
    def prompt(self) -> str:
        return self.env.prompt()

    def step(self, action: str) -> StepResult:
        t_in = time.monotonic()
        if self._last_step_end is not None:                 # the model's generation interval
            self._gen_ema = self._avg(self._gen_ema, t_in - self._last_step_end)
        self._wait_checkpoint()
        turn = len(self.actions)                            # this action is turn + 1
        res = None
        inner_s = 0.0
        for attempt in range(self.max_retries + 1):
            t_try = time.monotonic()
            why, res = self._try(action)
            inner_s += time.monotonic() - t_try
            if why is None:
                break
            self.stats["faults"].append({"turn": turn + 1, "why": why, "attempt": attempt})
            if res is not None and attempt == self.max_retries:
                log.info("%s: turn %d: %s on every attempt: accepted as the tool's behaviour", self.task_id,
                         turn + 1, why)
                break
            log.warning("%s: turn %d: %s; restoring to turn %d", self.task_id, turn + 1, why, turn)
            reached = self.restore(turn, cause=why)
            if reached < turn and self.break_recovery != "no_cut":   # no_cut: deliberately broken
                raise PrefixCut(reached, why)
            res = None
        if res is None:
            raise SandboxError(f"{self.task_id}: turn {turn + 1} failed {self.max_retries + 1} times")
        self.actions.append(action)
        self.results.append(res)
        self._after_step(res)
        self._last_step_end = time.monotonic()
        if not self.stats["faults"] or self.stats["faults"][-1]["turn"] != turn + 1:   # failure-free steps only
            self.stats["wrapper_s"] += self._last_step_end - t_in - inner_s
            self.stats["inner_s"] += inner_s
        return res

    def _try(self, action: str) -> tuple[str | None, StepResult | None]:
        if not self._sandbox_ok():
            return "sandbox lost", None
        try:
            res = self.env.step(action)
        except SandboxError as e:
            return f"sandbox error: {e}", None
        if not self._sandbox_ok():         # lost while the command ran: its output cannot be trusted
            return "sandbox lost during the command", None
        why = suspect(res, action)
        if why is not None:
            key = (len(self.actions), action, why, res.observation)
            if key in self._suspects:       # the same result for the same action again: not a fault
                return None, res
            self._suspects.add(key)
        return why, res

    def fork(self) -> "CheckpointedEnv":
        self._wait_checkpoint()
        inner = self.env.fork()
        return CheckpointedEnv(self._make, policy=self.policy, recovery=self.recovery, max_retries=self.max_retries,
                               root=self._root, break_recovery=self.break_recovery, _inner=inner,
                               _log=(self.actions, self.results))

    def close(self) -> None:
        self._wait_checkpoint()
        try:
            self.env.close()
        finally:
            shutil.rmtree(self._dir, ignore_errors=True)

    def __getattr__(self, name):          # family attributes (e.g. LookupEnv.solution) pass through
        if name.startswith("_") or name in ("env",):
            raise AttributeError(name)
        return getattr(self.env, name)

    # -- checkpoints ----------------------------------------------------------------------------
    def _avg(self, old: float | None, new: float) -> float:
        return new if old is None else (1 - self.policy.ema) * old + self.policy.ema * new

    def _state(self) -> dict:
        """The env's attributes, deep-copied. An attribute whose deep copy was the object itself
        (immutable for ``deepcopy``: atomic values, tuples of them, functions) is not copied again
        while the attribute still holds that very object: the task's constants (e.g. code_repair's
        expected outcomes, ~0.1 ms per copy) are walked once per episode, not once per checkpoint."""
        out, frozen = {}, self._frozen
        for k, v in self.env.__dict__.items():
            if k == "sandbox":
                continue
            if k in frozen and frozen[k] is v:
                out[k] = v
                continue
            c = out[k] = copy.deepcopy(v)
            if c is v:
                frozen[k] = v
            else:
                frozen.pop(k, None)
        return out

    def _after_step(self, res: StepResult) -> None:
        if res.done or not self.policy.enabled:
            return
        if len(self.actions) - self.checkpoints[-1].turn < max(1, self.policy.every):
            return
        pred_gen, pred_ckpt = self._gen_ema, self._ckpt_ema
        if pred_gen is None or pred_ckpt is None or pred_gen >= self.policy.overlap_factor * pred_ckpt:
            self._checkpoint("background")
        elif self.policy.inline:
            self._checkpoint("inline")
        else:
            self.stats["modes"]["skipped"] = self.stats["modes"].get("skipped", 0) + 1

    def _checkpoint(self, mode: str) -> Checkpoint:
        sb: Sandbox = self.env.sandbox
        fp = _fingerprint(sb.upper)
        prev = self.checkpoints[-1] if self.checkpoints else None
        turn = len(self.actions)
        if prev is not None and prev.fingerprint == fp and prev.error is None:
            ck = Checkpoint(turn, prev.files, self._state(), fp, "unchanged")
            prev.ready.wait()
            ck.ready.set()
        elif not fp:                       # nothing written yet: the base layer alone is the state
            ck = Checkpoint(turn, None, self._state(), fp, "empty")
            ck.ready.set()
        else:
            ck = Checkpoint(turn, self._dir / f"t{turn:04d}-{next(self._ids)}", self._state(), fp, mode)
            if mode == "background":
                self._thread = threading.Thread(target=self._copy, args=(ck, sb), daemon=True,
                                                name=f"ckpt-{self.task_id}")
                self._thread.start()
            else:
                self._copy(ck, sb)
        self.checkpoints.append(ck)
        self.stats["modes"][ck.mode] = self.stats["modes"].get(ck.mode, 0) + 1
        return ck

    def _copy(self, ck: Checkpoint, sb: Sandbox) -> None:
        t0 = time.monotonic()
        try:
            sb.snapshot(ck.files)
        except Exception as e:      # noqa: BLE001 - a failed checkpoint is skipped, not fatal
            ck.error = f"{type(e).__name__}: {e}"
            log.warning("%s: checkpoint after turn %d failed: %s", self.task_id, ck.turn, ck.error)
        ck.seconds = time.monotonic() - t0
        self._ckpt_ema = self._avg(self._ckpt_ema, ck.seconds)
        self.stats["checkpoint_s"] += ck.seconds
        ck.ready.set()

    def _wait_checkpoint(self) -> None:
        t = self._thread
        if t is not None:
            t0 = time.monotonic()
            t.join()
            self._thread = None
            self.stats["checkpoint_wait_s"] += time.monotonic() - t0

    def _sandbox_ok(self) -> bool:
        sb: Sandbox = self.env.sandbox
        return not sb.closed and sb.root.is_dir() and os.path.ismount(sb.merged)

    # -- restore --------------------------------------------------------------------------------
    def restore(self, turn: int, cause: str = "") -> int:
        """Bring the environment to its state after ``turn`` (see the module doc); returns the turn
        reached (``<= turn``); the log is cut to it."""
        t0 = time.monotonic()
        self._wait_checkpoint()
        ck = next(c for c in reversed(self.checkpoints) if c.turn <= turn and c.error is None and c.ready.is_set())
        old = self.env.sandbox
        new = Sandbox(old.base_dir, limits=old.limits, ro_binds=old.ro_binds, root=old._root_parent)
        try:
            if ck.files is not None and ck.files.is_dir():
                new.restore(ck.files)
        except BaseException:
            new.close()
            raise
        try:
            old.close()
        except Exception as e:         # noqa: BLE001 - the old one may be half gone
            log.debug("closing the failed sandbox: %s", e)
        self.env.__dict__.update(copy.deepcopy(ck.state))
        self.env.sandbox = new
        reached, replayed = ck.turn, 0
        if self.recovery == "replay":
            for i in range(ck.turn, turn):
                res = self.env.step(self.actions[i])
                replayed += 1
                if not _same(res, self.results[i]):
                    log.warning("%s: replayed turn %d differs from the log: the context is cut there", self.task_id,
                                i + 1)
                    # the env now holds turn i+1 as replayed; restore the state before it
                    self._rebuild(ck, i)
                    reached = i
                    break
                reached = i + 1
        self.checkpoints = [c for c in self.checkpoints if c.turn <= reached]
        self.actions, self.results = self.actions[:reached], self.results[:reached]
        self.stats["restores"].append({"to": turn, "reached": reached, "from_checkpoint": ck.turn,
                                       "replayed": replayed, "seconds": time.monotonic() - t0, "cause": cause})
        return reached

    def _rebuild(self, ck: Checkpoint, upto: int) -> None:
        """Restore ``ck`` and replay up to (not including) turn ``upto + 1`` without checks."""
        old = self.env.sandbox
        new = Sandbox(old.base_dir, limits=old.limits, ro_binds=old.ro_binds, root=old._root_parent)
        if ck.files is not None and ck.files.is_dir():
            new.restore(ck.files)
        old.close()
        self.env.__dict__.update(copy.deepcopy(ck.state))
        self.env.sandbox = new
        for i in range(ck.turn, upto):
            self.env.step(self.actions[i])

    def recreate_and_replay(self, turn: int | None = None) -> float:
        """The baseline recovery: a fresh environment, the logged actions ``1..turn`` (default:
        all) replayed from the start; returns seconds. Replaces the inner environment."""
        t0 = time.monotonic()
        self._wait_checkpoint()
        turn = len(self.actions) if turn is None else turn
        try:
            self.env.close()
        except Exception:      # noqa: BLE001
            pass
        self.env = self._make()
        for a in self.actions[:turn]:
            self.env.step(a)
        return time.monotonic() - t0


def _same(a: StepResult, b: StepResult) -> bool:
    return a.observation == b.observation and a.done == b.done and a.reward == b.reward


class BelayerAgentLoop(AgentLoop):
    """:class:`~megatron_harts.rollout.agent_loop.AgentLoop` whose episodes survive environment
    restores: when ``Environment.step`` raises :class:`PrefixCut` (its environment was restored to
    an earlier turn ``k``), the episode's context (tokens, loss mask, log-probs, turns) is cut back
    to the end of turn ``k``'s observation and the episode goes on from there (the next turn is
    generated again). Use it with :class:`CheckpointedEnv` environments and, for engine failures,
    :class:`~.engine.ResumableEngine` engines. Cuts are counted in ``Episode.info["cuts"]``."""

    max_cuts: int = 8

    def _advance(self, ep: Episode) -> Episode:
        try:
            return super()._advance(ep)
        except PrefixCut as cut:
            k = cut.turn
            n_cuts = ep.info.get("cuts", 0) + 1
            if n_cuts > self.max_cuts:
                raise
            end = ep.turns[k].start if k < len(ep.turns) else len(ep.tokens)
            del ep.tokens[end:], ep.loss_mask[end:], ep.logprobs[end:], ep.turns[k:]
            ep.info["cuts"] = n_cuts
            logger_cut.warning("%s: context cut back to turn %d (%s)", ep.traj_id, k, cut.reason)
            return ep


logger_cut = logging.getLogger(__name__ + ".cut")
