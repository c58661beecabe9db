"""Fault injection on real processes, and the checker of a rollout that survived it.

:class:`SandboxFaultInjector` is a thread that watches this process's children for sandbox
commands (``bwrap ... --bind <merged> /workspace``: one per tool call) and, at random, picks a
running one and

* ``kill``: SIGKILLs it (the sandbox's runner sees a command killed from outside);
* ``hang``: SIGSTOPs it (the command never finishes: the sandbox's timeout kills it);
* ``garbage``: writes random bytes into its stdout pipe (``/proc/PID/fd/1``: the tool "prints
  garbage" into the real output stream);

and between commands may ``lose`` a sandbox (unmounts its overlay and tmpfs and deletes its
directory, as a crashed container). Every injected fault is recorded with its time and target.
Engine faults: :func:`kill_server` SIGKILLs an engine server's process group, or only its
scheduler child (SGLang's ``sglang::scheduler``, found by process title).

The checker (:func:`replay_check`): each final trajectory is cut into its model turns and
observations (``Trajectory.extra["turns"]``), the actions are replayed in a fresh environment of
the same task, and every observation (as tokens) and the final reward must equal the
trajectory's; :func:`compare_rollouts` compares the trajectories of a faulted rollout with those
of a fault-free one (same seeds, deterministic sampling: they must be identical).
"""
from __future__ import annotations

import logging
import os
import random
import signal
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Sequence

from ..engines.launch import proc_descendants
from ..sandbox import _umount
from ..tokenizer import END_OBS, OBS, Tokenizer

log = logging.getLogger(__name__)


@dataclass
class Fault:
    """One injected fault: ``kind``, ``target`` (a pid, a sandbox root, a server URL), ``t``
    (monotonic seconds) and whether it landed (the target existed when hit)."""

    kind: str
    target: str
    t: float
    landed: bool = True


def _children() -> list[int]:
    pids = []
    for task in Path("/proc/self/task").iterdir():
        try:
            pids += [int(p) for p in (task / "children").read_text().split()]
        except (OSError, ValueError):
            continue
    return pids


def _cmdline(pid: int) -> list[str]:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace").split("\0")
    except OSError:
        return []


def sandbox_commands() -> dict[int, str]:
    """Running sandbox commands started by this process: ``{pid of bwrap: merged dir}``."""
    out = {}
    for pid in _children():
        argv = _cmdline(pid)
        if "bwrap" in argv and "/workspace" in argv:
            i = argv.index("/workspace")
            if i > 0 and argv[i - 1] != "--chdir":
                out[pid] = argv[i - 1]
    return out


class SandboxFaultInjector:
    """Random faults on the sandbox commands of this process (see the module doc).

    ``kinds``: weights per kind (``kill``, ``hang``, ``garbage``, ``lose``); ``rate``: probability
    that a newly seen command gets a fault; ``budget``: at most this many faults; ``lose_targets``:
    ``() -> list of Sandbox`` to pick lost sandboxes from (live ones, between their commands);
    ``poll_s``: how often the process table is read; ``seed``: the random choices.
    """

    def __init__(self, kinds: dict[str, float] | None = None, rate: float = 0.3, budget: int = 8,
                 lose_targets: Callable[[], list] | None = None, poll_s: float = 0.002, seed: int = 0,
                 delay_s: tuple[float, float] = (0.0, 0.01)):
        self.kinds = kinds or {"kill": 1.0, "hang": 1.0, "garbage": 1.0}
        self.rate, self.budget, self.poll_s = rate, budget, poll_s
        self.lose_targets, self.delay_s = lose_targets, delay_s
        self.rng = random.Random(seed)
        self.faults: list[Fault] = []
        self._seen: set[int] = set()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()

    def __enter__(self):
        self._thread = threading.Thread(target=self._run, name="belayer-faults", daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        if self._thread is not None:
            self._thread.join(5.0)

    def landed(self) -> list[Fault]:
        return [f for f in self.faults if f.landed]

    def _pick(self) -> str:
        kinds = list(self.kinds)
        return self.rng.choices(kinds, [self.kinds[k] for k in kinds])[0]

    def _run(self) -> None:
        while not self._stop.wait(self.poll_s):
            if len(self.landed()) >= self.budget:
                continue
            for pid, merged in sandbox_commands().items():
                if pid in self._seen:
                    continue
                self._seen.add(pid)
                if self.rng.random() >= self.rate:
                    continue
                kind = self._pick()
                if kind == "lose":
                    self._lose()
                    continue
                time.sleep(self.rng.uniform(*self.delay_s))
                self.faults.append(Fault(kind, f"{pid}:{merged}", time.monotonic(), self._hit(kind, pid)))

    def _hit(self, kind: str, pid: int) -> bool:
        deadline = time.monotonic() + 0.2      # the runner's shell becomes bwrap (exec) after joining its cgroup
        while True:
            try:
                if Path(f"/proc/{pid}/comm").read_text().strip() == "bwrap" and \
                        os.readlink(f"/proc/{pid}/fd/1").startswith("pipe:"):
                    break
            except OSError:
                return False
            if time.monotonic() > deadline:
                return False
            time.sleep(0.0005)
        try:
            if kind == "kill":
                # the sandbox dies as a whole (an OOM kill of its cgroup): bwrap alone killed after it
                # forked left the sandboxed command holding stdout, which the runner then read as a hang
                for p in [pid] + proc_descendants(pid):
                    try:
                        os.kill(p, signal.SIGKILL)
                    except ProcessLookupError:
                        pass
            elif kind == "hang":
                os.kill(pid, signal.SIGSTOP)
            elif kind == "garbage":
                fd = os.open(f"/proc/{pid}/fd/1", os.O_WRONLY | os.O_NONBLOCK)
                try:
                    os.write(fd, bytes(self.rng.randrange(256) for _ in range(48)))
                finally:
                    os.close(fd)
            else:
                raise ValueError(f"unknown fault kind {kind!r}")
            return True
        except (ProcessLookupError, FileNotFoundError, PermissionError, BrokenPipeError, BlockingIOError, OSError):
            return False

    def _lose(self) -> None:
        targets = [s for s in (self.lose_targets() if self.lose_targets else []) if not s.closed]
        if not targets:
            return
        sb = self.rng.choice(targets)
        self.faults.append(Fault("lose", str(sb.root), time.monotonic(), lose_sandbox(sb)))


def lose_sandbox(sb) -> bool:
    """Destroy a sandbox behind its owner's back: unmount the overlay and the tmpfs and delete the
    directory (the object still thinks it is open). Returns whether it existed."""
    if not sb.root.is_dir():
        return False
    if os.path.ismount(sb.merged):
        _umount(sb.merged)
    if os.path.ismount(sb._fs):
        _umount(sb._fs)
    import shutil
    shutil.rmtree(sb.root, ignore_errors=True)
    return True


SCHEDULER_TITLES = ("sglang::scheduler",)


def kill_server(server, target: str = "group") -> Fault:
    """SIGKILL an engine server (a started ``_ServerProcess``): ``group``: its whole process group
    (the server and every child); ``child``: only one child process: SGLang's scheduler, found by
    its process title (``sglang::scheduler...``, set by SGLang with setproctitle; the server
    process itself stays up until SGLang's subprocess watchdog notices), else the lowest-pid
    child (for SGLang that would be multiprocessing's resource tracker, started before the
    scheduler: hence the title), the whole group when there is no child. ``Fault.target`` names
    the pid and title killed."""
    from ..engines.launch import _proc_stat, find_children, proc_descendants, proc_title

    if target not in ("group", "child"):
        raise ValueError(f"kill_server: target must be 'group' or 'child', got {target!r}")
    proc = server.proc
    landed = proc is not None and proc.poll() is None
    what = server.url
    if landed:
        try:
            victim = None
            if target == "child":
                sched = find_children(proc.pid, SCHEDULER_TITLES)
                if sched:
                    victim = sched[0]
                else:
                    direct = [p for p in proc_descendants(proc.pid) if (_proc_stat(p) or (None,))[0] == proc.pid]
                    if direct:
                        victim = (direct[0], proc_title(direct[0]) or "?")
            if victim is not None:
                os.kill(victim[0], signal.SIGKILL)
                what = f"{server.url} child {victim[0]} ({victim[1][:60]})"
            else:
                os.killpg(proc.pid, signal.SIGKILL)
        except (ProcessLookupError, FileNotFoundError):
            landed = False
    return Fault("engine_kill", what, time.monotonic(), landed)


# ------------------------------------------------------------------------------------ checker
def trajectory_turns(traj) -> list[tuple[list[int], list[int]]]:
    """``[(action ids, observation ids)]`` of a trajectory from ``extra["turns"]`` (the last
    observation is empty when the episode ended on that turn)."""
    toks = [int(t) for t in traj.tokens]
    turns = traj.extra["turns"]
    out = []
    for i, (start, n, *_rest) in enumerate(turns):
        end = turns[i + 1][0] if i + 1 < len(turns) else len(toks)
        out.append((toks[start:start + n], toks[start + n:end]))
    return out


def replay_check(trajectories: Sequence, make_env: Callable[[Any], Any], task_of: Callable[[Any], Any],
                 tokenizer: Tokenizer) -> list[str]:
    """Replay every trajectory's actions in a fresh environment of its task and compare each
    observation (as the agent loop tokenises it) and the final reward; returns the mismatches
    (empty: every trajectory is consistent with its environment)."""
    bad = []
    for t in trajectories:
        env = make_env(task_of(t))
        try:
            turns = trajectory_turns(t)
            done, reward = False, None
            for i, (act, obs_ids) in enumerate(turns):
                if done:
                    bad.append(f"{t.traj_id}: turn {i + 1} after the episode ended")
                    break
                res = env.step(tokenizer.decode(act))
                if res.done:
                    done, reward = True, float(res.reward or 0.0)
                    if obs_ids:
                        bad.append(f"{t.traj_id}: turn {i + 1} ended the episode in the replay but the trajectory "
                                   f"has an observation")
                        break
                    continue
                obs = res.observation or ""
                want = tokenizer.encode(obs if obs.startswith(OBS) else f"{OBS}{obs}{END_OBS}")
                if want != obs_ids:
                    bad.append(f"{t.traj_id}: turn {i + 1} observation differs: replay {tokenizer.decode(want)!r}, "
                               f"trajectory {tokenizer.decode(obs_ids)!r}")
                    break
            else:
                if not done and "truncated" not in t.extra:
                    bad.append(f"{t.traj_id}: the replay did not end the episode")
                elif done and abs(reward - float(t.reward)) > 1e-9:
                    bad.append(f"{t.traj_id}: reward {t.reward} but the replay gives {reward}")
        finally:
            env.close()
    return bad


def compare_rollouts(faulted: Sequence, reference: Sequence, logprob_tol: float = 1e-4) -> list[str]:
    """The trajectories of a faulted rollout against a fault-free one with the same seeds: the
    same ids, identical tokens, loss masks and rewards, log-probs within ``logprob_tol``."""
    import numpy as np

    bad = []
    ref = {t.traj_id: t for t in reference}
    got = {t.traj_id: t for t in faulted}
    if set(ref) != set(got):
        bad.append(f"trajectory ids differ: missing {sorted(set(ref) - set(got))[:5]}, "
                   f"extra {sorted(set(got) - set(ref))[:5]}")
    for k in sorted(set(ref) & set(got)):
        a, b = got[k], ref[k]
        if a.tokens.tolist() != b.tokens.tolist():
            n = next((i for i, (x, y) in enumerate(zip(a.tokens, b.tokens)) if x != y), min(len(a), len(b)))
            bad.append(f"{k}: tokens differ from position {n} (lengths {len(a)} vs {len(b)})")
            continue
        if a.loss_mask.tolist() != b.loss_mask.tolist() or a.reward != b.reward:
            bad.append(f"{k}: loss mask or reward differs")
            continue
        d = float(np.abs(np.asarray(a.old_logprobs) - np.asarray(b.old_logprobs)).max())
        if d > logprob_tol:
            bad.append(f"{k}: log-probs differ by {d:.2e}")
    return bad
