"""A durable journal of a rollout's episodes, so a new process can resume after the client crashed.

The process that runs the agent loop (the driver) holds every in-flight trajectory in memory; the
token log (:class:`~.engine.TokenLog`) and the environment checkpoints (:class:`~.env.CheckpointedEnv`)
survive an *engine* or *sandbox* failure, not a crash of that process. With
``BelayerAgentLoop(..., journal=DIR)`` the loop appends, at every turn boundary, what a new process
needs to rebuild each episode to ``DIR/journal.jsonl`` (write-ahead, append-only, one JSON object
per line) and keeps the environments' checkpoint copies under ``DIR/snapshots/``;
``loop.rollout(tasks, group_ids, resume=True)`` in a fresh process reads it back, rebuilds the
unfinished episodes and returns every trajectory, those finished before the crash included.

Records (``kind``):

* ``header`` (line 1): format ``version``, the rollout's ``config`` (:class:`RolloutConfig` fields
  that shape trajectories), ``tasks`` (``repr`` of each) and ``group_ids``; a resume with another
  config or other tasks is refused with the file, line and field (:class:`JournalError`);
* ``turn``: one model turn of episode ``traj`` (``group``, ``path``) and the environment's answer:
  ``n`` (turns after it, 1-based), ``start`` (context length before it), ``out`` / ``lp`` (the
  generated ids and their log-probs ``[n_out]``), ``fin``, ``engine``, ``wv`` (weight version),
  ``lat`` (seconds), ``obs`` (the observation's ids appended to the context, ``[n_obs]``; loss
  mask 0, log-prob 0.0), ``act`` (the action text the environment ran) and ``res`` (its
  observation text, ``done``, ``reward``); ``prompt`` (ids) on an episode's first turn;
* ``cut``: the environment was restored to turn ``keep`` and the context cut back to it;
* ``end``: the episode ended without a new turn (context budget);
* every ``turn`` / ``cut`` / ``end`` also carries ``done``, ``reward``, ``truncated``, ``cuts`` and
  ``ckpt``: the environment's newest complete checkpoint (:meth:`CheckpointedEnv.durable_checkpoint`:
  its turn, the copy's path under ``snapshots/``, a digest of the copy, the runtime state);
* ``complete``: the rollout finished (``failed``: the episodes that failed); the snapshots are
  then deleted and a resume returns the journaled trajectories without running anything.

Durability: each record is one ``write`` of a whole line to a file opened ``O_APPEND`` (it is in
the kernel's page cache once written: a SIGKILL of the process loses nothing written); ``fsync``
after the header, after every record that ends an episode and the ``complete`` record, and at most
every ``fsync_s`` seconds otherwise (an OS crash or power loss can lose the last ``fsync_s`` of
turns, which are then regenerated, and the checkpoint copies are not synced: a copy found
incomplete after a reboot fails its digest and the episode is restored from turn 0 + replay).
A torn last line (a write cut short) is ignored and truncated away; a corrupt line before the end
is an error.

What a resume does per episode (``task``, sample ``s`` and, for trees, branch ``k``): finished in
the journal -> its trajectory as journaled; journaled turns -> a fresh environment from the
factory, the checkpoint's copy and state restored and the logged actions since replayed
(``CheckpointedEnv.resume_from``; with ``recovery="checkpoint"`` nothing is replayed), and the
context cut back to the turn the environment reached, exactly as a restore during the rollout
(``BelayerAgentLoop`` prefix consistency); nothing journaled -> started afresh. A turn in flight at
the crash is generated again from the journaled context with its per-turn seed (the same tokens
with deterministic sampling); tokens the engine had streamed for it are not reused.
"""
from __future__ import annotations

import dataclasses
import json
import logging
import os
import shutil
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

from ..agent_loop import Episode, RolloutConfig, Turn
from ..types import StepResult

log = logging.getLogger(__name__)
VERSION = 1
# RolloutConfig fields that do not change what a trajectory is (scheduling only): not compared
_RUNTIME_FIELDS = ("max_concurrency", "engine_retries", "engine_cooldown_s")


class JournalError(ValueError):
    """A journal that cannot be used: corrupt, of another rollout, or inconsistent. The message
    names the file, the line (1-based) and the field."""


def config_fields(cfg: RolloutConfig) -> dict:
    return {k: v for k, v in dataclasses.asdict(cfg).items() if k not in _RUNTIME_FIELDS}


def _jsonable(x: Any) -> Any:
    return json.loads(json.dumps(x, default=repr))


@dataclass
class EpisodeLog:
    """What the journal holds of one episode (one ``path`` of a group): ``prompt`` ids, ``turns``
    (the ``turn`` records' fields, in order; a ``cut`` truncates them), the end and the newest
    checkpoint; ``line``: the line of its newest record (for errors)."""

    group: str
    path: tuple[int, ...]
    prompt: list[int] | None = None
    turns: list[dict] = field(default_factory=list)
    done: bool = False
    reward: float | None = None
    truncated: str | None = None
    cuts: int = 0
    ckpt: dict | None = None
    line: int = 0

    def copy_as(self, path: tuple[int, ...]) -> "EpisodeLog":
        return dataclasses.replace(self, path=path, turns=list(self.turns))

    def episode_fields(self) -> tuple[list[int], list[int], list[float], list[Turn]]:
        """``(tokens, loss_mask, logprobs, turns)`` rebuilt from the records (each ``[L]``)."""
        tokens, mask, lps, turns = list(self.prompt), [0] * len(self.prompt), [0.0] * len(self.prompt), []
        for t in self.turns:
            turns.append(Turn(len(tokens), list(t["out"]), list(t["lp"]), t["fin"], t["engine"], t["wv"], t["lat"]))
            tokens += t["out"] + t["obs"]
            mask += [1] * len(t["out"]) + [0] * len(t["obs"])
            lps += list(t["lp"]) + [0.0] * len(t["obs"])
        return tokens, mask, lps, turns

    def env_log(self) -> tuple[list[str], list[StepResult]]:
        return ([t["act"] for t in self.turns],
                [StepResult(t["res"]["obs"], t["res"]["done"], t["res"]["reward"], {}) for t in self.turns])


@dataclass
class JournalState:
    """A journal read back: the header, each episode's log keyed by ``(group, path)``, whether the
    rollout completed (and its failed list), the byte length of the valid part, the record count."""

    header: dict | None
    episodes: dict[tuple[str, tuple[int, ...]], EpisodeLog]
    complete: dict | None
    good_bytes: int
    records: int
    torn: bool


class Journal:
    """The journal of one rollout in directory ``root`` (``journal.jsonl``, ``snapshots/``)."""

    def __init__(self, root: str | os.PathLike, fsync_s: float = 1.0):
        self.root = Path(root)
        self.path = self.root / "journal.jsonl"
        self.snapshots = self.root / "snapshots"
        self.fsync_s = fsync_s
        self._fd: int | None = None
        self._lock = threading.Lock()
        self._last_sync = 0.0
        self.n_written = 0

    # -- writing ----------------------------------------------------------------------------------
    def open(self, cfg: RolloutConfig, tasks: Sequence[object], group_ids: Sequence[str],
             resume: bool) -> JournalState | None:
        """Open for appending. A new (or empty) journal gets its header; an existing one is refused
        unless ``resume``, then read back, checked against ``cfg`` / ``tasks`` / ``group_ids``
        (:class:`JournalError`) and its torn last line, if any, truncated away. Returns the state
        read (None for a new journal)."""
        self.root.mkdir(parents=True, exist_ok=True)
        self.snapshots.mkdir(exist_ok=True)
        header = {"kind": "header", "version": VERSION, "config": _jsonable(config_fields(cfg)),
                  "tasks": [repr(t) for t in tasks], "group_ids": list(group_ids)}
        state = None
        if self.path.exists() and self.path.stat().st_size > 0:
            if not resume:
                raise JournalError(f"{self.path}: a journal exists already; pass resume=True to continue it, "
                                   f"or use an empty directory")
            state = read_journal(self.path)
            self._check_header(state, header)
            if state.torn:
                log.warning("%s: torn last line (a write cut short by the crash) ignored and truncated at byte %d",
                            self.path, state.good_bytes)
                os.truncate(self.path, state.good_bytes)
        self._fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        if state is None:
            self.write(header, sync=True)
        return state

    def write(self, rec: dict, sync: bool = False) -> None:
        """Append one record as one line (one ``write``); ``fsync`` if ``sync`` or ``fsync_s``
        passed since the last one."""
        data = (json.dumps(rec, separators=(",", ":")) + "\n").encode()
        with self._lock:
            if self._fd is None:
                raise JournalError(f"{self.path}: journal is closed")
            n = os.write(self._fd, data)
            if n != len(data):                       # regular files: only on a full disk
                raise OSError(f"{self.path}: short write ({n} of {len(data)} bytes)")
            self.n_written += 1
            now = time.monotonic()
            if sync or now - self._last_sync >= self.fsync_s:
                os.fsync(self._fd)
                self._last_sync = now

    def complete(self, failed: list[tuple[str, str]]) -> None:
        """Mark the rollout complete (fsync'd) and delete the checkpoint copies."""
        self.write({"kind": "complete", "failed": [list(f) for f in failed]}, sync=True)
        shutil.rmtree(self.snapshots, ignore_errors=True)

    def close(self) -> None:
        with self._lock:
            if self._fd is not None:
                os.fsync(self._fd)
                os.close(self._fd)
                self._fd = None

    def _check_header(self, state: JournalState, want: dict) -> None:
        got = state.header
        if got is None:
            raise JournalError(f"{self.path}:1: field 'kind': the first record is not a header")
        for key in ("version", "config", "tasks", "group_ids"):
            a, b = got.get(key), want[key]
            if key == "config" and isinstance(a, dict):
                for k in sorted(set(a) | set(b)):
                    if a.get(k) != b.get(k):
                        raise JournalError(f"{self.path}:1: field 'config.{k}': the journal has {a.get(k)!r}, "
                                           f"this rollout has {b.get(k)!r} (a journal of another rollout?)")
            elif a != b:
                if isinstance(a, list) and isinstance(b, list) and len(a) == len(b):
                    i = next(i for i, (x, y) in enumerate(zip(a, b)) if x != y)
                    raise JournalError(f"{self.path}:1: field '{key}[{i}]': the journal has {a[i]!r}, "
                                       f"this rollout has {b[i]!r} (a journal of another rollout?)")
                raise JournalError(f"{self.path}:1: field '{key}': the journal has {_short(a)}, this rollout has "
                                   f"{_short(b)} (a journal of another rollout?)")


def _short(x: Any, n: int = 120) -> str:
    s = repr(x)
    return s if len(s) <= n else s[:n] + "..."


def read_journal(path: str | os.PathLike) -> JournalState:
    """Read a journal back (see the module doc): a torn last line (no newline) is ignored
    (``torn``); any other line that is not a valid record raises :class:`JournalError` naming
    the file, line and field."""
    path = Path(path)
    data = path.read_bytes()
    lines = data.split(b"\n")
    tail = lines.pop()               # after the last newline: b"" unless the last write was cut short
    header, complete, eps, pos, n = None, None, {}, 0, 0
    for i, raw in enumerate(lines, 1):
        where = f"{path}:{i}"
        try:
            rec = json.loads(raw)
        except ValueError as e:
            raise JournalError(f"{where}: field '(line)': not valid JSON ({e}); the journal is corrupt") from None
        if not isinstance(rec, dict) or "kind" not in rec:
            raise JournalError(f"{where}: field 'kind': missing")
        kind = rec["kind"]
        if i == 1:
            if kind != "header":
                raise JournalError(f"{where}: field 'kind': the first record is {kind!r}, not a header")
            header = rec
        elif kind in ("turn", "cut", "end"):
            _apply(eps, rec, where, header)
        elif kind == "complete":
            complete = rec
        else:
            raise JournalError(f"{where}: field 'kind': unknown record kind {kind!r}")
        pos += len(raw) + 1
        n += 1
    return JournalState(header, eps, complete, pos, n, torn=bool(tail))


def _need(rec: dict, key: str, where: str, types) -> Any:
    if key not in rec or not isinstance(rec[key], types):
        raise JournalError(f"{where}: field '{key}': missing or of the wrong type ({_short(rec.get(key))})")
    return rec[key]


def _apply(eps: dict, rec: dict, where: str, header: dict | None) -> None:
    group = _need(rec, "group", where, str)
    if header is not None and group not in header.get("group_ids", []):
        raise JournalError(f"{where}: field 'group': {group!r} is not a group of this journal's header")
    path = tuple(_need(rec, "path", where, list))
    key = (group, path)
    ep = eps.get(key)
    if ep is None:
        # a fork's first record: it starts from its parent's log (path without the branch index)
        parent = eps.get((group, path[:-1])) if len(path) > 1 else None
        ep = parent.copy_as(path) if parent is not None else EpisodeLog(group, path)
        eps[key] = ep
    if ep.done:
        raise JournalError(f"{where}: field 'kind': a {rec['kind']} record after {group}/{path} ended")
    kind = rec["kind"]
    if kind == "turn":
        n = _need(rec, "n", where, int)
        if n != len(ep.turns) + 1:
            raise JournalError(f"{where}: field 'n': turn {n} of {group}/{path} follows {len(ep.turns)} turns")
        if "prompt" in rec:
            ep.prompt = list(rec["prompt"])
        if ep.prompt is None:
            raise JournalError(f"{where}: field 'prompt': the first turn of {group}/{path} has no prompt")
        t = {k: rec.get(k) for k in ("start", "out", "lp", "fin", "engine", "wv", "lat", "obs", "act", "res")}
        for k in ("out", "lp", "obs"):
            _need(rec, k, where, list)
        if len(t["out"]) != len(t["lp"]):
            raise JournalError(f"{where}: field 'lp': {len(t['lp'])} log-probs for {len(t['out'])} ids")
        _need(rec, "act", where, str)
        _need(rec, "res", where, dict)
        ep.turns.append(t)
    elif kind == "cut":
        keep = _need(rec, "keep", where, int)
        if keep > len(ep.turns):
            raise JournalError(f"{where}: field 'keep': cut to {keep} of {len(ep.turns)} turns")
        del ep.turns[keep:]
    ep.done = bool(rec.get("done"))
    ep.reward, ep.truncated = rec.get("reward"), rec.get("truncated")
    ep.cuts, ep.ckpt, ep.line = int(rec.get("cuts", 0)), rec.get("ckpt"), int(where.rsplit(":", 1)[1])


def episode_record(kind: str, ep: Episode, root: Path, **extra) -> dict:
    """A ``turn`` / ``cut`` / ``end`` record of ``ep`` (its newest turn for ``turn``); checkpoint
    copies under the journal's ``root`` are named relative to it (the directory can be moved)."""
    rec = {"kind": kind, "traj": ep.traj_id, "group": ep.group_id, "path": list(ep.path)}
    if kind == "turn":
        t = ep.turns[-1]
        env = ep.env
        if len(env.actions) != len(ep.turns):
            raise RuntimeError(f"{ep.traj_id}: the environment logged {len(env.actions)} actions for "
                               f"{len(ep.turns)} turns: cannot journal it")
        res = env.results[-1]
        rec.update(n=len(ep.turns), start=t.start, out=t.output_ids, lp=t.logprobs, fin=t.finish_reason,
                   engine=t.engine, wv=t.weight_version, lat=t.latency_s,
                   obs=ep.tokens[t.start + len(t.output_ids):], act=env.actions[-1],
                   res={"obs": res.observation, "done": bool(res.done),
                        "reward": None if res.reward is None else float(res.reward)})
        if len(ep.turns) == 1:
            rec["prompt"] = ep.tokens[:t.start]
    rec.update(extra)
    rec.update(done=ep.done, reward=ep.reward, truncated=ep.info.get("truncated"), cuts=ep.info.get("cuts", 0),
               ckpt=ep.env.durable_checkpoint())
    files = rec["ckpt"].get("files")
    if files is not None and Path(files).is_relative_to(root):
        rec["ckpt"] = dict(rec["ckpt"], files=str(Path(files).relative_to(root)))
    return rec


def resolve_ckpt(ckpt: dict | None, root: Path) -> dict | None:
    """A journaled checkpoint with its copy's path made absolute (relative ones: under ``root``)."""
    if ckpt is None or not ckpt.get("files") or Path(ckpt["files"]).is_absolute():
        return ckpt
    return dict(ckpt, files=str(root / ckpt["files"]))
