"""Start inference servers as subprocesses: SGLang on a GPU, the embedded transformers engine on CPU.

Both come up the same way: a free port on ``host``, the process in its own process group with
stdout and stderr in a log file, then ``GET /health`` until it answers 200 or ``startup_timeout``
seconds pass; if the process exits first, the :class:`EngineError` carries the tail of its log.
:meth:`stop` sends SIGTERM to the process group, then SIGKILL after ``grace`` seconds; :meth:`kill`
SIGKILLs the group at once (a failed worker: its open streams break now). Each server is a context
manager and hands out :class:`~.http.HttpEngine` clients via :meth:`engine`.

Liveness (:meth:`_ServerProcess.alive`): the server process runs and, for a server started with
``watch_children`` (process-title prefixes; SGLang: ``("sglang::",)``), every descendant process
with such a title seen once the server was healthy (SGLang's ``sglang::scheduler...`` and
``sglang::detokenizer``) still runs: a SIGKILLed scheduler (gone, or a zombie not yet reaped)
makes ``alive()`` False at once, while SGLang's HTTP process stays up (until its subprocess
watchdog ends it, >= 1 s later) with its streams open and silent. Processes are read from
``/proc/*/stat`` (parent pid, state, start time: a reused pid is not mistaken for the child).

SGLang runs with ``--skip-tokenizer-init`` (token ids in and out; the agent loop tokenises) and
``SGLANG_RETURN_ORIGINAL_LOGPROB=1`` (and the pre-0.5.3 spelling ``RETURN_ORIGINAL_LOGPROB=1``) so
returned log-probs are the model's own, before temperature. ``/release_memory_occupation`` on
SGLang needs ``enable_memory_saver=True`` (``--enable-memory-saver``).

SGLang's crash diagnostics are off by default here (``crash_diagnostics=False``):
``SGLANG_PYSPY_DUMP_BEFORE_CRASH=0`` and ``SGLANG_CUDA_COREDUMP_BEFORE_CRASH=0`` (SGLang 0.5.17,
``sglang/srt/environ.py``, both default true). With either on, the HTTP process's SIGQUIT handler
(sent by its subprocess watchdog when a child such as the scheduler died:
``TokenizerManager.dump_requests_before_crash`` in ``sglang/srt/managers/tokenizer_manager.py``)
sleeps 5 s "to let GPU activity settle" and runs py-spy / a CUDA core dump before it kills its
process tree, and the requests' streams stay open and silent meanwhile. The price of turning them
off: no py-spy stack dump of the schedulers (and no CUDA core dump) in the log of a crashed
server. ``crash_diagnostics=True``, or either variable set in ``env`` or in this process's
environment, keeps SGLang's own setting.
"""
from __future__ import annotations

import atexit
import logging
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import weakref
from typing import Any, Sequence

from ..types import EngineError
from .http import HttpEngine

log = logging.getLogger(__name__)

_LIVE: "weakref.WeakSet[_ServerProcess]" = weakref.WeakSet()


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that was free on ``host`` a moment ago (the OS picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def _tail(path: str, lines: int = 30) -> str:
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(0, f.tell() - 16384))
            text = f.read().decode("utf-8", errors="replace")
    except OSError as e:
        return f"(log {path} unreadable: {e})"
    return "\n".join(text.splitlines()[-lines:])


def _proc_stat(pid: int) -> tuple[int, str, int] | None:
    """(parent pid, state letter, start time in clock ticks) of ``pid`` from ``/proc/PID/stat``,
    or None when there is no such process."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read().decode(errors="replace")
        fields = stat.rsplit(")", 1)[1].split()
        return int(fields[1]), fields[0], int(fields[19])
    except (OSError, ValueError, IndexError):
        return None


def _proc_read(pid: int, name: str) -> str:
    try:
        with open(f"/proc/{pid}/{name}", "rb") as f:
            return f.read().replace(b"\0", b" ").decode(errors="replace").strip()
    except OSError:
        return ""


def proc_title(pid: int, prefixes: Sequence[str] = ()) -> str | None:
    """The process title of ``pid`` that starts with one of ``prefixes``, or None: its command
    line (setproctitle rewrites it, e.g. SGLang's ``sglang::scheduler``) or its ``comm`` name
    (15 characters: compared with that much of each prefix). Without ``prefixes``: the command
    line, else ``comm`` ("" when gone)."""
    cmdline, comm = _proc_read(pid, "cmdline"), _proc_read(pid, "comm")
    if not prefixes:
        return cmdline or comm
    for p in prefixes:
        if cmdline.startswith(p):
            return cmdline
        if comm and comm.startswith(p[:15]):
            return comm
    return None


def proc_descendants(pid: int) -> list[int]:
    """Every descendant of ``pid`` (zombies included; children first, by pid), from the parent pids in
    ``/proc/*/stat`` (``/proc/PID/task/*/children`` is missing on some kernels and sandboxes)."""
    parent: dict[int, int] = {}
    for d in os.listdir("/proc"):
        if d.isdigit():
            st = _proc_stat(int(d))
            if st is not None:
                parent[int(d)] = st[0]
    out, frontier = [], [pid]
    while frontier:
        front = set(frontier)
        kids = sorted(p for p, pp in parent.items() if pp in front)
        out += kids
        frontier = kids
    return out


def find_children(pid: int, prefixes: Sequence[str]) -> list[tuple[int, str]]:
    """``[(pid, title)]`` of the descendants of ``pid`` whose process title starts with one of
    ``prefixes`` (children first, by pid)."""
    out = []
    for p in proc_descendants(pid):
        title = proc_title(p, prefixes)
        if title is not None:
            out.append((p, title))
    return out


class _ServerProcess:
    """A server subprocess with a URL, a log file, readiness and shutdown (see the module doc).

    ``watch_children``: process-title prefixes of the descendants that :meth:`alive` also
    requires (recorded once the server is healthy; ``()``: the server process only)."""

    kind = "server"
    watch_children: tuple[str, ...] = ()

    def __init__(self, *, host: str = "127.0.0.1", port: int | None = None, log_path: str | None = None,
                 env: dict[str, str] | None = None, startup_timeout: float = 600.0, grace: float = 10.0,
                 python: str | None = None, watch_children: Sequence[str] | None = None):
        if watch_children is not None:
            self.watch_children = tuple(watch_children)
        self.watched: dict[int, tuple[str, int]] = {}     # pid -> (title, start time) of the watched children
        self.dead_reason: str | None = None               # why alive() last said False
        self.host, self.port = host, port or free_port(host)
        self.python = python or sys.executable
        self.startup_timeout, self.grace = float(startup_timeout), float(grace)
        self.env = dict(os.environ, **(env or {}))
        self.log_path = log_path            # default: a fresh temporary file at start()
        self.proc: subprocess.Popen | None = None
        self.startup_s: float | None = None

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def command(self) -> list[str]:
        raise NotImplementedError

    def start(self) -> "_ServerProcess":
        """Launch and wait until ``/health`` answers 200; raises :class:`EngineError` (with the log
        tail) if the process exits or ``startup_timeout`` passes first."""
        if self.proc is not None:
            raise RuntimeError(f"{self.kind} at {self.url} already started")
        if self.log_path is None:
            fd, self.log_path = tempfile.mkstemp(prefix=f"harts-{self.kind}-{self.port}-", suffix=".log")
            os.close(fd)
        cmd = self.command()
        log.info("starting %s at %s: %s (log %s)", self.kind, self.url, " ".join(cmd), self.log_path)
        t0 = time.monotonic()
        with open(self.log_path, "ab") as logf:
            self.proc = subprocess.Popen(cmd, stdout=logf, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                         env=self.env, start_new_session=True)
        _LIVE.add(self)
        probe = HttpEngine(self.url, timeout=5.0, retries=0)
        deadline = t0 + self.startup_timeout
        while True:
            rc = self.proc.poll()
            if rc is not None:
                self.proc = None
                _LIVE.discard(self)
                raise EngineError(f"{self.kind} at {self.url} exited with code {rc} during startup "
                                  f"(log {self.log_path}); last lines:\n{_tail(self.log_path)}")
            if probe.alive(timeout=2.0) and self._ready():
                break
            if time.monotonic() > deadline:
                self.stop()
                raise EngineError(f"{self.kind} at {self.url} not healthy after {self.startup_timeout:g} s "
                                  f"(log {self.log_path}); last lines:\n{_tail(self.log_path)}")
            time.sleep(0.2)
        self.startup_s = time.monotonic() - t0
        self._record_children()
        log.info("%s at %s up in %.1f s%s", self.kind, self.url, self.startup_s,
                 f"; watching {sorted(t for t, _ in self.watched.values())}" if self.watched else "")
        return self

    def _ready(self) -> bool:
        """Beyond ``/health``: whether the server can take work (subclasses; the router's workers)."""
        return True

    def _record_children(self) -> None:
        self.watched = {}
        if not self.watch_children or self.proc is None:
            return
        for pid, title in find_children(self.proc.pid, self.watch_children):
            st = _proc_stat(pid)
            if st is not None and st[1] not in "ZX":
                self.watched[pid] = (title, st[2])

    def alive(self) -> bool:
        """The process is running and so is every watched child (see the module doc; says nothing
        about health: see ``engine().health()``). When False, ``dead_reason`` says why."""
        if self.proc is None:
            self.dead_reason = "not running"
            return False
        rc = self.proc.poll()
        if rc is not None:
            self.dead_reason = f"process exited ({rc})"
            return False
        for pid, (title, started) in self.watched.items():
            st = _proc_stat(pid)
            if st is None or st[2] != started or st[1] in "ZX":
                self.dead_reason = (f"child {title} (pid {pid}) "
                                    f"{'is a zombie' if st is not None and st[2] == started else 'is gone'}")
                return False
        self.dead_reason = None
        return True

    def kill(self) -> bool:
        """SIGKILL the whole process group now (no grace: open connections break at once); the
        exit is reaped by :meth:`stop`. Returns whether a process was there to kill."""
        if self.proc is None:
            return False
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
            return True
        except (ProcessLookupError, PermissionError):
            return False

    def engine(self, **kw: Any) -> HttpEngine:
        """A client for this server (``HttpEngine`` keyword arguments pass through)."""
        kw.setdefault("name", f"{self.kind}@{self.host}:{self.port}")
        return HttpEngine(self.url, **kw)

    def stop(self) -> int | None:
        """SIGTERM to the process group, SIGKILL after ``grace`` seconds; returns the exit code."""
        proc, self.proc = self.proc, None
        if proc is None:
            return None
        _LIVE.discard(self)
        for sig, wait in ((signal.SIGTERM, self.grace), (signal.SIGKILL, 5.0)):
            try:
                os.killpg(proc.pid, sig)
            except (ProcessLookupError, PermissionError):
                pass
            try:
                rc = proc.wait(wait)
                log.info("%s at %s stopped (exit %s)", self.kind, self.url, rc)
                if sig == signal.SIGTERM:   # children of the group may outlive the leader
                    try:
                        os.killpg(proc.pid, signal.SIGKILL)
                    except (ProcessLookupError, PermissionError):
                        pass
                return rc
            except subprocess.TimeoutExpired:
                log.warning("%s at %s did not exit %g s after %s", self.kind, self.url, wait, sig.name)
        return None

    def log_tail(self, lines: int = 30) -> str:
        """The last ``lines`` lines of the server's log ("" before :meth:`start`)."""
        return _tail(self.log_path, lines) if self.log_path else ""

    def __enter__(self):
        if self.proc is None:
            self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.url!r}, running={self.alive()})"


class SGLangServer(_ServerProcess):
    """``python -m sglang.launch_server --model-path DIR --skip-tokenizer-init --host H --port P``.

    ``mem_fraction_static``: SGLang's fraction of GPU memory for weights + KV cache;
    ``weight_version``: tag of the initial weights; ``enable_memory_saver``: allow
    ``release_memory``/``resume_memory``; ``load_format``: SGLang's ``--load-format`` (``dummy``:
    random weights, no checkpoint read, for a worker re-armed by a weight keeper through
    ``/update_weights_from_tensor``); ``extra_args``: more ``launch_server`` flags verbatim;
    ``return_original_logprob``, ``crash_diagnostics``: see the module doc. ``alive()`` also
    watches the ``sglang::`` children (scheduler, detokenizer). Other keywords:
    :class:`_ServerProcess`.
    """

    kind = "sglang"
    watch_children = ("sglang::",)
    CRASH_DIAGNOSTICS_ENV = ("SGLANG_PYSPY_DUMP_BEFORE_CRASH", "SGLANG_CUDA_COREDUMP_BEFORE_CRASH")

    def __init__(self, model_path: str, *, mem_fraction_static: float | None = None,
                 weight_version: str | None = None, enable_memory_saver: bool = False,
                 extra_args: Sequence[str] = (), return_original_logprob: bool = True,
                 crash_diagnostics: bool = False, load_format: str | None = None, **kw: Any):
        env = dict(kw.pop("env", None) or {})
        if return_original_logprob:
            env.setdefault("SGLANG_RETURN_ORIGINAL_LOGPROB", "1")
            env.setdefault("RETURN_ORIGINAL_LOGPROB", "1")
        if not crash_diagnostics:          # a value set by the caller or in our environment wins
            for name in self.CRASH_DIAGNOSTICS_ENV:
                if name not in env and name not in os.environ:
                    env[name] = "0"
        super().__init__(env=env, **kw)
        self.model_path, self.mem_fraction_static = str(model_path), mem_fraction_static
        self.weight_version, self.enable_memory_saver = weight_version, enable_memory_saver
        self.load_format = load_format
        self.extra_args = [str(a) for a in extra_args]

    def command(self) -> list[str]:
        cmd = [self.python, "-m", "sglang.launch_server", "--model-path", self.model_path, "--skip-tokenizer-init",
               "--host", self.host, "--port", str(self.port)]
        if self.mem_fraction_static is not None:
            cmd += ["--mem-fraction-static", str(self.mem_fraction_static)]
        if self.weight_version is not None:
            cmd += ["--weight-version", str(self.weight_version)]
        if self.enable_memory_saver:
            cmd += ["--enable-memory-saver"]
        if self.load_format is not None:
            cmd += ["--load-format", str(self.load_format)]
        return cmd + self.extra_args


class EmbeddedServer(_ServerProcess):
    """``python -m megatron_harts.rollout.engines.embedded_server --model-path DIR --port P``: the
    embedded transformers engine (CPU default, not SGLang) in its own process.

    ``threads``: torch intra-op threads of the server; ``weight_version``: tag of the initial
    weights; ``load_format``: ``dummy`` builds the model without reading the checkpoint (a worker
    re-armed by a weight keeper); ``extra_args``: more flags verbatim. The server exits by itself
    when this process is gone. Other keywords: :class:`_ServerProcess` (``startup_timeout`` defaults to 300 s).
    """

    kind = "embedded"

    def __init__(self, model_path: str, *, weight_version: str | None = None, threads: int | None = None,
                 extra_args: Sequence[str] = (), load_format: str | None = None, **kw: Any):
        kw.setdefault("startup_timeout", 300.0)
        env = dict(kw.pop("env", None) or {})
        env.setdefault("HF_HUB_OFFLINE", "1")
        env.setdefault("TRANSFORMERS_OFFLINE", "1")
        super().__init__(env=env, **kw)
        self.model_path, self.weight_version, self.threads = str(model_path), weight_version, threads
        self.load_format = load_format
        self.extra_args = [str(a) for a in extra_args]

    def command(self) -> list[str]:
        cmd = [self.python, "-m", "megatron_harts.rollout.engines.embedded_server", "--model-path", self.model_path,
               "--host", self.host, "--port", str(self.port), "--parent-pid", str(os.getpid())]
        if self.weight_version is not None:
            cmd += ["--weight-version", str(self.weight_version)]
        if self.threads:
            cmd += ["--threads", str(self.threads)]
        if self.load_format is not None:
            cmd += ["--load-format", str(self.load_format)]
        return cmd + self.extra_args


def start_engine(kind: str, model_path: str, **kw: Any) -> _ServerProcess:
    """Start ``kind`` (``"sglang"`` or ``"embedded"``) serving ``model_path``; returns the running
    server (a context manager; ``.engine()`` gives its :class:`HttpEngine`). Keywords go to
    :class:`SGLangServer` or :class:`EmbeddedServer`."""
    classes = {"sglang": SGLangServer, "embedded": EmbeddedServer}
    if kind not in classes:
        raise ValueError(f"engine kind must be one of {sorted(classes)}, got {kind!r}")
    return classes[kind](model_path, **kw).start()


@atexit.register
def _stop_all() -> None:
    for server in list(_LIVE):
        try:
            server.stop()
        except Exception:        # noqa: BLE001 - best effort at exit
            pass
