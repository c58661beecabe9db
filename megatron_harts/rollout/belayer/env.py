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
  also across a context cut), or the same kind of suspicion on ``max_retries + 1`` runs in a row, is
  the tool's real behaviour and accepted; suspicions of mixed kinds are independent faults and the
  step is re-run (at most ``max_attempts`` runs).
  When the restore reaches an earlier turn than the action needs (checkpoint recovery, or a replay
  mismatch) ``step`` raises :class:`PrefixCut` with that turn: the caller cuts the trajectory back
  (:class:`BelayerAgentLoop`) and generation continues from there (prefix consistency).

Baseline (:meth:`CheckpointedEnv.recreate_and_replay`): a fresh environment, every logged action
replayed from the start.
"""
from __future__ import annotations

import base64
import copy
import hashlib
import itertools
import logging
import os
import pickle
import shutil
import stat
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
    durable: dict | None = None        # its journal entry (CheckpointedEnv.durable_checkpoint), made once


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
    ``recovery``: ``"replay"`` or ``"checkpoint"``; ``max_retries``: re-runs of a step whose
    result is suspect in the same way each time, after which that result is accepted as the tool's
    behaviour; ``max_attempts``: runs of a step whose suspect results differ in kind (independent
    faults) before it fails with ``SandboxError`` (default ``4 * (max_retries + 1)``);
    ``root``: where checkpoint copies go (default: the temp dir); ``break_recovery``: only for
    proving the checker (``"no_cut"``: restore without telling the caller, so the context keeps
    turns the environment no longer has)."""

    _ids = itertools.count()

    def __init__(self, make: Callable[[], Any], *, policy: CheckpointPolicy | None = None,
                 recovery: str = "replay", max_retries: int = 2, max_attempts: int | None = None,
                 root: str | None = None,
                 break_recovery: str | None = None, _inner: Any = None, _log: tuple | None = None):
        if recovery not in ("replay", "checkpoint"):
            raise ValueError(f"recovery must be 'replay' or 'checkpoint', got {recovery!r}")
        self._make, self.policy = make, policy or CheckpointPolicy()
        self.recovery, self.max_retries, self.break_recovery = recovery, max_retries, break_recovery
        self.max_attempts = max(max_attempts if max_attempts is not None else 4 * (max_retries + 1), max_retries + 1)
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
        self._keep = False                         # keep the checkpoint copies at close (journal)
        self._checkpoint("initial" if not self.actions else "inline")
        # the runtime state of a fresh environment of this task (a fork: its root's): what the
        # journal leaves out of a checkpoint's state (see durable_checkpoint)
        self._base_state: dict = self.checkpoints[0].state if _log is None else {}

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
        whys: list[str] = []
        for attempt in range(self.max_attempts):
            t_try = time.monotonic()
            why, res = self._try(action)
            inner_s += time.monotonic() - t_try
            if why is None:
                break
            whys.append(why)
            self.stats["faults"].append({"turn": turn + 1, "why": why, "attempt": attempt})
            last = whys[-(self.max_retries + 1):]
            if res is not None and len(last) == self.max_retries + 1 and len(set(last)) == 1:
                # the same kind of suspect result on max_retries + 1 attempts in a row (e.g. a tool
                # that prints random bytes, or one that always times out): the tool's behaviour.
                # Mixed kinds (a kill, then a hang, then garbage) are independent faults: retried.
                log.info("%s: turn %d: %s on %d attempts in a row: accepted as the tool's behaviour",
                         self.task_id, turn + 1, why, len(last))
                break
            log.warning("%s: turn %d: %s; restoring to turn %d", self.task_id, turn + 1, why, turn)
            reached = self.restore(turn, cause=why)
            if reached < turn and self.break_recovery != "no_cut":   # no_cut: deliberately broken
                raise PrefixCut(reached, why)
            res = None
        if res is None:
            raise SandboxError(f"{self.task_id}: turn {turn + 1} failed {len(whys)} times ({', '.join(whys)})")
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
        child = CheckpointedEnv(self._make, policy=self.policy, recovery=self.recovery, max_retries=self.max_retries,
                                max_attempts=self.max_attempts,
                                root=self._root, break_recovery=self.break_recovery, _inner=inner,
                                _log=(self.actions, self.results))
        child._keep, child._base_state = self._keep, self._base_state
        return child

    def close(self) -> None:
        self._wait_checkpoint()
        try:
            self.env.close()
        finally:
            if not self._keep:
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

    # -- durability across a crash of the client process (belayer.journal) -----------------------
    def keep_checkpoints_in(self, root: str | Path) -> None:
        """Make the checkpoint copies (this environment's and its forks') under ``root``, a
        directory another process can read (the journal's ``snapshots/``), and keep them when the
        environment is closed (the journal deletes them once the rollout is complete). Copies made
        before are moved there."""
        self._wait_checkpoint()
        root = Path(root)
        root.mkdir(parents=True, exist_ok=True)
        new = Path(tempfile.mkdtemp(prefix=f"harts-ckpt-{os.getpid()}-", dir=root))
        for ck in self.checkpoints:
            if ck.files is not None and ck.files.parent == self._dir:
                dest = new / ck.files.name
                if not dest.exists():        # an "unchanged" checkpoint shares its predecessor's copy
                    shutil.move(str(ck.files), dest)
                ck.files = dest
                ck.durable = None
        shutil.rmtree(self._dir, ignore_errors=True)
        self._dir, self._root, self._keep = new, str(root), True

    def durable_checkpoint(self) -> dict:
        """The newest checkpoint whose copy is complete, as the journal stores it (JSON-able, made
        once per checkpoint): ``turn``; ``files``: the upper-dir copy's absolute path (None: nothing
        written); ``digest``: sha1 of the copy's (path, mode, size) entries, checked before a
        resume uses it; ``state``: base64 pickle of the runtime attributes that differ from a fresh
        environment's (None when one of them cannot be pickled: a resume then falls back to the
        initial state + replay of every action). Does not wait for a copy in progress."""
        ck = next((c for c in reversed(self.checkpoints) if c.error is None and c.ready.is_set()), None)
        if ck is None:                       # not even the initial copy worked: a resume replays from turn 0
            return {"turn": 0, "files": None, "digest": None, "state": None}
        if ck.durable is None:
            ck.durable = {"turn": ck.turn, "files": str(ck.files) if ck.files is not None else None,
                          "digest": _digest(ck.fingerprint), "state": self._state_blob(ck.state)}
        return ck.durable

    def _state_blob(self, state: dict) -> str | None:
        base, out = self._base_state, {}
        for k, v in state.items():
            if k in base and base[k] is v:
                continue
            try:
                out[k] = pickle.dumps(v, protocol=pickle.HIGHEST_PROTOCOL)
            except Exception:          # noqa: BLE001 - unpicklable: fine if it is the fresh env's value
                try:
                    same = k in base and bool(base[k] == v)
                except Exception:      # noqa: BLE001
                    same = False
                if not same:
                    log.warning("%s: attribute %r cannot be pickled: a resume replays from turn 0",
                                self.task_id, k)
                    return None
        return base64.b64encode(pickle.dumps(out, protocol=pickle.HIGHEST_PROTOCOL)).decode()

    def resume_from(self, actions: list[str], results: list[StepResult], ckpt: dict | None,
                    break_resume: str | None = None) -> int:
        """Rebuild, in this fresh environment (just made by the factory, in a new process), the
        state a crashed process journaled: the log ``actions`` / ``results`` (one per turn) and its
        newest durable checkpoint ``ckpt`` (:meth:`durable_checkpoint`). The checkpoint (its copy
        and runtime state) becomes this environment's, then :meth:`restore` brings it to the last
        logged turn (replay, compared with the log, or none with ``recovery="checkpoint"``). A copy
        that is gone or incomplete (digest) or a state that could not be saved falls back to turn 0
        (logged). Returns the turn reached (``< len(actions)``: the caller cuts the context there).
        ``break_resume="ignore_snapshot"``: only for proving the test, the copy is not restored."""
        self._wait_checkpoint()
        base = self.checkpoints[0]
        self.actions, self.results = list(actions), list(results)
        use = None
        if ckpt is not None and ckpt["turn"] > 0:
            files = Path(ckpt["files"]) if ckpt.get("files") else None
            problem = None
            if ckpt.get("state") is None:
                problem = "its runtime state was not saved"
            elif ckpt["turn"] > len(actions):
                problem = f"it is after the last logged turn {len(actions)}"
            elif files is not None and not files.is_dir():
                problem = f"its copy {files} is gone"
            elif files is not None and _digest(_fingerprint(files)) != ckpt.get("digest"):
                problem = f"its copy {files} is incomplete (digest)"
            if problem is not None:
                log.warning("%s: journaled checkpoint of turn %d unusable (%s): restoring from turn 0", self.task_id,
                            ckpt["turn"], problem)
            else:
                state = dict(base.state)
                state.update({k: pickle.loads(v) for k, v in pickle.loads(base64.b64decode(ckpt["state"])).items()})
                use = Checkpoint(ckpt["turn"], None if break_resume == "ignore_snapshot" else files, state, None,
                                 "journal")
                use.durable = dict(ckpt)
                use.ready.set()
        self.checkpoints = [base] + ([use] if use is not None else [])
        return self.restore(len(self.actions), cause="client crash")

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


def _digest(fingerprint: tuple | None) -> str | None:
    """sha1 of a :func:`_fingerprint`'s (path, mode, size) entries (times and directory sizes
    left out: they depend on the file system the copy is on); None for None."""
    if fingerprint is None:
        return None
    return hashlib.sha1(repr([(e[0], e[1], 0 if stat.S_ISDIR(e[1]) else e[2]) for e in fingerprint]).encode()
                        ).hexdigest()


def _same(a: StepResult, b: StepResult) -> bool:
    return a.observation == b.observation and a.done == b.done and a.reward == b.reward


class BelayerAgentLoop(AgentLoop):
    """:class:`~megatron_harts.rollout.agent_loop.AgentLoop` whose episodes survive environment
    restores: when ``Environment.step`` raises :class:`PrefixCut` (its environment was restored to
    an earlier turn ``k``), the episode's context (tokens, loss mask, log-probs, turns) is cut back
    to the end of turn ``k``'s observation and the episode goes on from there (the next turn is
    generated again). Use it with :class:`CheckpointedEnv` environments and, for engine failures,
    :class:`~.engine.ResumableEngine` engines. Cuts are counted in ``Episode.info["cuts"]``.

    ``journal``: a directory: every turn boundary is journaled there (:mod:`.journal`) and the
    environments' checkpoint copies are kept under it, so that ``rollout(..., resume=True)`` in a
    new process, after this one crashed, rebuilds the unfinished episodes and returns all
    trajectories (those finished before the crash from the journal). ``journal_fsync_s``: see
    :class:`~.journal.Journal`. ``break_resume``: only for proving the tests (``"ignore_snapshot"``:
    the environments are rebuilt without their checkpoint's files; ``"rerun_finished"``: episodes
    finished before the crash are run again)."""

    max_cuts: int = 8

    def __init__(self, *args, journal: str | os.PathLike | None = None, journal_fsync_s: float = 1.0,
                 break_resume: str | None = None, **kw):
        super().__init__(*args, **kw)
        self.journal_dir, self.journal_fsync_s, self.break_resume = journal, journal_fsync_s, break_resume
        self._journal = None
        self._resume_state = None
        self.resume_stats: dict[str, Any] = {}

    def _cut(self, ep: Episode, k: int, reason: str) -> None:
        """Cut ``ep``'s context back to the end of turn ``k``'s observation."""
        end = ep.turns[k].start if k < len(ep.turns) else len(ep.tokens)
        del ep.tokens[end:], ep.loss_mask[end:], ep.logprobs[end:], ep.turns[k:]
        ep.info["cuts"] = ep.info.get("cuts", 0) + 1
        logger_cut.warning("%s: context cut back to turn %d (%s)", ep.traj_id, k, reason)

    def _advance(self, ep: Episode) -> Episode:
        n0 = len(ep.turns)
        try:
            super()._advance(ep)
        except PrefixCut as cut:
            if ep.info.get("cuts", 0) + 1 > self.max_cuts:
                raise
            self._cut(ep, cut.turn, cut.reason)
            if self._journal is not None:
                from .journal import episode_record
                self._journal.write(episode_record("cut", ep, self._journal.root, keep=cut.turn))
            return ep
        if self._journal is not None:
            from .journal import episode_record
            rec = episode_record("turn" if len(ep.turns) > n0 else "end", ep, self._journal.root)
            self._journal.write(rec, sync=ep.done)
        return ep

    # -- the journal (resume after a crash of this process) ----------------------------------------
    def rollout(self, tasks, group_ids=None, resume: bool = False):
        """As :meth:`AgentLoop.rollout`; with ``journal``: journaled, and ``resume=True`` continues
        the journal a crashed process left (a missing or empty journal: a fresh start). A journal
        of another config or other tasks raises :class:`~.journal.JournalError`. Without
        ``journal``, ``resume`` is an error."""
        if self.journal_dir is None:
            if resume:
                raise ValueError("rollout(resume=True) needs BelayerAgentLoop(journal=DIR)")
            return super().rollout(tasks, group_ids)
        from .journal import Journal
        group_ids = list(group_ids) if group_ids is not None else [f"task{i}" for i in range(len(tasks))]
        journal = Journal(self.journal_dir, fsync_s=self.journal_fsync_s)
        self._resume_state = journal.open(self.cfg, tasks, group_ids, resume)
        self.resume_stats = {}
        self._journal = journal
        try:
            if self._resume_state is not None and self._resume_state.complete is not None:
                res = self._completed(group_ids)
            else:
                res = super().rollout(tasks, group_ids)
                journal.complete(res.failed)
        finally:
            self._journal = None
            journal.close()
        res.stats["journal"] = dict(self.resume_stats, records_written=journal.n_written)
        return res

    def _completed(self, group_ids):
        """A journal that completed: its trajectories (and failures) as journaled, nothing run."""
        from ..agent_loop import RolloutResult
        st = self._resume_state
        finished = [self._finished_episode(e) for e in st.episodes.values() if e.done]
        failed = [tuple(f) for f in st.complete.get("failed", [])]
        self.resume_stats = {"already_complete": True, "finished_before_crash": len(finished)}
        trajs = self._trajectories(finished)
        return RolloutResult(trajs, failed, {"trajectories": len(trajs), "failed": len(failed)})

    def _finished_episode(self, elog) -> Episode:
        tokens, mask, lps, turns = elog.episode_fields()
        ep = Episode(elog.group, elog.path, None, tokens, mask, lps, turns, reward=elog.reward, done=True)
        if elog.truncated:
            ep.info["truncated"] = elog.truncated
        ep.info["cuts"] = elog.cuts
        return ep

    def _new_episode(self, task, gid, sample):
        ep = super()._new_episode(task, gid, sample)
        if self._journal is not None:
            if not hasattr(ep.env, "keep_checkpoints_in"):
                ep.env.close()
                raise TypeError(f"BelayerAgentLoop(journal=...) needs CheckpointedEnv environments, the factory "
                                f"made a {type(ep.env).__name__}")
            ep.env.keep_checkpoints_in(self._journal.snapshots)
        return ep

    def _initial_episodes(self, tasks, group_ids):
        """Fresh episodes, or with a journal to resume: the finished episodes as journaled and
        the others rebuilt (see :mod:`.journal`). A tree's branch without records of its own is
        rebuilt from its parent's log at the fork turn by replaying every logged action since the
        checkpoint (as the loop's fork copies the environment at that turn), so it never goes back
        before the fork."""
        st = self._resume_state
        if st is None:
            return super()._initial_episodes(tasks, group_ids)
        from concurrent.futures import ThreadPoolExecutor
        from .journal import JournalError, episode_record, resolve_ckpt
        t0 = time.monotonic()
        cfg = self.cfg
        forking = cfg.branch_factor > 1 and cfg.branch_turn is not None
        finished: list[Episode] = []
        plans = []                      # (task, gid, sample, path, EpisodeLog | None, force replay)
        for task, gid in zip(tasks, group_ids):
            for s in range(cfg.group_size):
                own = st.episodes.get((gid, (s,)))
                kids = {p[1]: e for (g, p), e in st.episodes.items() if g == gid and len(p) == 2 and p[0] == s}
                if kids or (forking and own is not None and not own.done and len(own.turns) == cfg.branch_turn):
                    for k in range(cfg.branch_factor):
                        plans.append((task, gid, s, (s, k), kids.get(k) or own, k not in kids))
                else:
                    plans.append((task, gid, s, (s,), own, False))
        todo = []
        for task, gid, s, path, elog, replay in plans:
            if elog is not None and elog.done:
                finished.append(self._finished_episode(elog.copy_as(path)))
                if self.break_resume != "rerun_finished":
                    continue
                elog = None
            todo.append((task, gid, s, path, elog, replay))

        def build(plan) -> tuple[Episode, int]:
            task, gid, s, path, elog, replay = plan
            ep = self._new_episode(task, gid, s)
            ep.path = path
            if elog is None or not elog.turns:
                return ep, 0
            try:
                if elog.prompt != ep.tokens:
                    raise JournalError(f"{self._journal.path}:{elog.line}: field 'prompt': the journaled prompt of "
                                       f"{ep.traj_id} differs from the environment's ({len(elog.prompt)} vs "
                                       f"{len(ep.tokens)} ids): another task or tokenizer?")
                ep.tokens, ep.loss_mask, ep.logprobs, ep.turns = elog.episode_fields()
                ep.info["cuts"] = elog.cuts
                actions, results = elog.env_log()
                recovery = ep.env.recovery
                if replay:
                    ep.env.recovery = "replay"
                try:
                    reached = ep.env.resume_from(actions, results, resolve_ckpt(elog.ckpt, self._journal.root),
                                                 break_resume=self.break_resume)
                finally:
                    ep.env.recovery = recovery
            except BaseException:
                ep.env.close()
                raise
            cut = len(ep.turns) - reached
            if cut > 0:
                self._cut(ep, reached, "client crash: environment restored to an earlier turn")
            if cut > 0 or replay:         # the rebuilt state's first record (a branch: its own from now on)
                self._journal.write(episode_record("cut", ep, self._journal.root, keep=reached))
            return ep, cut

        built: list[tuple[Episode, int]] = []
        errors: list[BaseException] = []
        with ThreadPoolExecutor(max_workers=max(1, min(cfg.max_concurrency, len(todo)))) as pool:
            for f in [pool.submit(build, p) for p in todo]:
                try:
                    built.append(f.result())
                except BaseException as e:      # noqa: BLE001 - close what was built, then raise
                    errors.append(e)
        if errors:
            for ep, _ in built:
                ep.env.close()
            raise errors[0]
        self.resume_stats = {"finished_before_crash": len(finished),
                             "rebuilt": sum(1 for p in todo if p[4] is not None and p[4].turns),
                             "restarted": sum(1 for p in todo if p[4] is None or not p[4].turns),
                             "branches_from_parent": sum(1 for p in todo if p[5] and p[4] is not None),
                             "turns_restored": sum(len(ep.turns) for ep, _ in built),
                             "cuts_on_resume": sum(1 for _, c in built if c > 0),
                             "torn_line": st.torn, "rebuild_s": round(time.monotonic() - t0, 3)}
        log.info("journal resume: %s", self.resume_stats)
        return [ep for ep, _ in built], finished


logger_cut = logging.getLogger(__name__ + ".cut")
