"""Sandboxes for tool calls: bubblewrap over an overlayfs copy-on-write work tree.

A :class:`Sandbox` owns one private tmpfs (``limits.disk_mb``) holding the overlay's ``upper/`` and
``work/`` and mounts ``lower = base_dir`` (the task's files, never written) + ``upper`` at
``merged/``. Each :meth:`Sandbox.run` executes ``sh -c COMMAND`` under ``bwrap`` with no
network and fresh IPC/PID/UTS namespaces, all capabilities dropped, read-only ``/usr`` (and
``/bin``, ``/lib*`` as the host has them), a few ``/etc`` files, private ``/proc``, ``/dev``,
``/tmp``, and ``merged`` read-write at ``/workspace`` (the working directory). ``python3`` inside is
the host's base interpreter (``sys.base_prefix``, bound read-only at its own path and first on
``PATH``) with its standard library only: the project's virtualenv is not bound, tasks need no
third-party packages and must not see the trainer's code.

Limits per command: wall clock (the process group is killed; bwrap's ``--die-with-parent`` takes
the whole PID namespace with it), address space per process (``ulimit -v``), tasks per sandbox
(a pids cgroup when one is writable here, else unenforced: ``RLIMIT_NPROC`` does not bind root)
and output (read incrementally; the head and tail are kept, the middle is counted and dropped; a
command keeps running while its output is drained, up to ``max_drain_bytes``, then it is killed).

:meth:`Sandbox.fork` copies the upper dir (``cp -a``: overlay whiteouts and opaque-dir xattrs
included) into a new sandbox on the same lower dir; :meth:`Sandbox.snapshot` / :meth:`restore` do
the same to and from a directory. Needs root (mounts) and ``bwrap`` (``apt-get install
bubblewrap``); failures raise :class:`SandboxError` naming the step.
"""
from __future__ import annotations

import ctypes
import logging
import os
import re
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import uuid
import weakref
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger(__name__)

WORKSPACE = "/workspace"
_ETC_FILES = ("ld.so.cache", "ld.so.conf", "passwd", "group", "nsswitch.conf", "localtime", "alternatives")
_MNT_DETACH = 2


class SandboxError(RuntimeError):
    """A sandbox could not be set up, run or torn down; the message names the step that failed."""


@dataclass(frozen=True)
class SandboxLimits:
    """Per-sandbox limits.

    ``timeout_s``: wall clock per command (seconds); ``memory_mb``: address space per process
    (MiB, ``ulimit -v``); ``max_output_bytes``: output kept per command (bytes, head + tail);
    ``max_processes``: tasks (processes + threads, bwrap's own 2-3 included) alive at once in the
    sandbox; ``disk_mb``: size of the tmpfs holding the written files (MiB); ``max_drain_bytes``:
    output read and dropped before the command is killed (bytes).
    """

    timeout_s: float = 10.0
    memory_mb: int = 512
    max_output_bytes: int = 16384
    max_processes: int = 64
    disk_mb: int = 256
    max_drain_bytes: int = 64 << 20


@dataclass
class CommandResult:
    """One command's outcome. ``output``: stdout and stderr interleaved, decoded as UTF-8 (errors
    replaced), with ``[... N bytes dropped ...]`` in the middle when ``truncated``; ``exit_code``:
    the shell's status (negative: killed by that signal, e.g. -9 after a timeout); ``seconds``:
    wall time including sandbox start-up."""

    exit_code: int
    output: str
    timed_out: bool = False
    truncated: bool = False
    seconds: float = 0.0


# --------------------------------------------------------------------------------- host helpers
_libc = ctypes.CDLL(None, use_errno=True)


def _mount(source: str, target: Path, fstype: str, options: str) -> None:
    if _libc.mount(source.encode(), str(target).encode(), fstype.encode(), 0, options.encode()) != 0:
        errno = ctypes.get_errno()
        hint = " (sandboxes need root to mount)" if errno == 1 else ""
        raise SandboxError(f"mount -t {fstype} at {target} failed: {os.strerror(errno)}{hint}; options {options}")


def _umount(target: Path) -> None:
    if _libc.umount2(str(target).encode(), 0) != 0 and _libc.umount2(str(target).encode(), _MNT_DETACH) != 0:
        log.warning("sandbox: umount %s failed: %s", target, os.strerror(ctypes.get_errno()))


def _copy_tree(src: Path, dst: Path) -> None:
    """``cp -a src/. dst`` (device-node whiteouts, xattrs, ownership, links)."""
    dst.mkdir(parents=True, exist_ok=True)
    r = subprocess.run(["cp", "-a", "--", f"{src}/.", str(dst)], capture_output=True, text=True)
    if r.returncode != 0:
        raise SandboxError(f"cp -a {src} -> {dst} failed: {r.stderr.strip()}")


def _teardown(root: Path, merged: Path, fs: Path, cgroup: Path | None) -> None:
    """Unmount and delete a sandbox (the finalizer: holds no reference to the object)."""
    if os.path.ismount(merged):
        _umount(merged)
    if os.path.ismount(fs):
        _umount(fs)
    shutil.rmtree(root, ignore_errors=True)
    for attempt in range(10 if cgroup is not None else 0):  # exited tasks can take a moment to leave
        try:
            cgroup.rmdir()
            break
        except OSError as e:
            if attempt == 9:
                log.warning("sandbox: rmdir cgroup %s failed: %s", cgroup, e)
            time.sleep(0.02 * (attempt + 1))


_swept: set[str] = set()
_swept_lock = threading.Lock()


def sweep_stale(parent: str | Path | None = None) -> int:
    """Unmount and delete the sandboxes under ``parent`` (default: the temp dir) left by processes
    that no longer exist (killed before their finalizers ran; the roots are named
    ``harts-sbx-<pid>-*``). Runs once per directory and process before the first sandbox there;
    returns how many were removed."""
    parent = Path(parent or tempfile.gettempdir())
    with _swept_lock:
        if str(parent) in _swept:
            return 0
        _swept.add(str(parent))
    removed = 0
    for d in parent.glob("harts-sbx-*-*"):
        try:
            pid = int(d.name.split("-")[2])
        except (IndexError, ValueError):
            continue
        try:
            os.kill(pid, 0)
            continue                      # its owner is alive
        except ProcessLookupError:
            pass
        except PermissionError:
            continue
        log.warning("sandbox: removing %s left by process %d", d, pid)
        _teardown(d, d / "merged", d / "fs", None)
        removed += 1
    return removed


_pids_parent: Path | None | bool = False  # False: not looked up yet
_pids_lock = threading.Lock()


def _pids_cgroup_parent() -> Path | None:
    """This process's pids-controller cgroup directory when children can be made there, else None."""
    global _pids_parent
    with _pids_lock:
        if _pids_parent is not False:
            return _pids_parent
        found = None
        try:
            own = dict(line.strip().split(":", 2)[1:] for line in open("/proc/self/cgroup"))
            for line in open("/proc/self/mounts"):
                _, mnt, fstype, opts = line.split()[:4]
                if fstype == "cgroup" and "pids" in opts.split(",") and "pids" in own:
                    found = Path(mnt) / own["pids"].lstrip("/")
                elif fstype == "cgroup2" and "" in own:
                    d = Path(mnt) / own[""].lstrip("/")
                    if "pids" in (d / "cgroup.subtree_control").read_text().split():
                        found = d
                if found is not None and os.access(found, os.W_OK):
                    break
                found = None
        except OSError:
            found = None
        if found is None:
            log.warning("sandbox: no writable pids cgroup; max_processes is not enforced")
        _pids_parent = found
        return found


def _bwrap_base_args() -> list[str]:
    """The bwrap arguments every sandbox shares (file system outside /workspace, environment)."""
    if shutil.which("bwrap") is None:
        raise SandboxError("bwrap (bubblewrap) not found on PATH; install it: apt-get install -y bubblewrap")
    args = ["--unshare-all", "--die-with-parent", "--new-session", "--cap-drop", "ALL",
            "--hostname", "sandbox", "--ro-bind", "/usr", "/usr"]
    for d in ("bin", "sbin", "lib", "lib32", "lib64", "libx32"):
        p = Path("/") / d
        if p.is_symlink():
            args += ["--symlink", os.readlink(p), str(p)]
        elif p.is_dir():
            args += ["--ro-bind", str(p), str(p)]
    for name in _ETC_FILES:
        if (Path("/etc") / name).exists():
            args += ["--ro-bind", f"/etc/{name}", f"/etc/{name}"]
    prefix = Path(sys.base_prefix).resolve()
    path = "/usr/local/bin:/usr/bin:/bin"
    if not str(prefix).startswith("/usr/"):
        args += ["--ro-bind", str(prefix), str(prefix)]
        path = f"{prefix}/bin:{path}"
    args += ["--proc", "/proc", "--dev", "/dev", "--clearenv", "--setenv", "PATH", path,
             "--setenv", "HOME", "/tmp", "--setenv", "LANG", "C.UTF-8", "--setenv", "TERM", "dumb",
             "--setenv", "PYTHONDONTWRITEBYTECODE", "1", "--setenv", "PYTHONUNBUFFERED", "1"]
    return args


class _Capped:
    """Keeps the first ``cap // 2`` and last ``cap - cap // 2`` bytes of a stream, counts the rest."""

    def __init__(self, cap: int):
        self.cap, self.head, self.tail, self.dropped = cap, bytearray(), bytearray(), 0

    def add(self, chunk: bytes) -> None:
        if self.dropped:
            self.tail += chunk
        else:
            self.head += chunk
            if len(self.head) <= self.cap:
                return
            keep = self.cap // 2  # first overflow: split into head and tail
            self.tail = self.head[keep:]
            del self.head[keep:]
        over = len(self.tail) - (self.cap - self.cap // 2)
        if over > 0:
            self.dropped += over
            del self.tail[:over]

    def text(self) -> str:
        if not self.dropped:
            return self.head.decode("utf-8", "replace")
        return (self.head.decode("utf-8", "replace") + f"\n[... {self.dropped} bytes dropped ...]\n"
                + self.tail.decode("utf-8", "replace"))


# ------------------------------------------------------------------------------------ Sandbox
class Sandbox:
    """One copy-on-write work tree over ``base_dir`` and the commands run in it.

    ``base_dir``: the read-only lower layer (must not change while any sandbox uses it);
    ``ro_binds``: extra host directories bound read-only, ``{path inside: host path}`` (e.g. a
    grader's files the commands must not modify); ``root``: where the private directory is made
    (default: the temp dir). Use as a context manager or call :meth:`close`; a leaked sandbox is
    unmounted when garbage-collected or at interpreter exit.
    """

    def __init__(self, base_dir: str | Path, *, limits: SandboxLimits = SandboxLimits(),
                 ro_binds: dict[str, str | Path] | None = None, root: str | Path | None = None,
                 _upper_from: Path | None = None):
        self.base_dir = Path(base_dir).resolve()
        self.limits = limits
        self.ro_binds = {k: Path(v).resolve() for k, v in (ro_binds or {}).items()}
        self._root_parent = root
        if not self.base_dir.is_dir():
            raise SandboxError(f"sandbox base dir {self.base_dir} is not a directory")
        for what, p in (("base dir", self.base_dir), ("root", Path(root or tempfile.gettempdir()).resolve())):
            if any(c in str(p) for c in ",:"):
                raise SandboxError(f"sandbox {what} {p} contains ',' or ':' (overlay option syntax)")
        for inside, host in self.ro_binds.items():
            if not host.exists() or not inside.startswith("/"):
                raise SandboxError(f"sandbox ro_binds: {host} does not exist or {inside!r} is not absolute")
        self._bwrap = _bwrap_base_args()
        sweep_stale(root)
        self.root = Path(tempfile.mkdtemp(prefix=f"harts-sbx-{os.getpid()}-", dir=root))
        self._fs, self.merged = self.root / "fs", self.root / "merged"
        self.upper, self._work = self._fs / "upper", self._fs / "work"
        self._snapshots = self.root / "snapshots"
        self._cgroup: Path | None = None
        parent = _pids_cgroup_parent()
        if parent is not None:
            try:
                self._cgroup = parent / f"harts-sbx-{uuid.uuid4().hex[:12]}"
                self._cgroup.mkdir()
                (self._cgroup / "pids.max").write_text(str(limits.max_processes))
            except OSError as e:
                log.warning("sandbox: pids cgroup %s not usable (%s); max_processes not enforced", self._cgroup, e)
                self._cgroup = None
        self._finalizer = weakref.finalize(self, _teardown, self.root, self.merged, self._fs, self._cgroup)
        try:
            self._fs.mkdir()
            self.merged.mkdir()
            _mount("tmpfs", self._fs, "tmpfs", f"size={limits.disk_mb}m,mode=0755")
            self._mount_overlay(_upper_from)
        except BaseException:
            self.close()
            raise

    # -- file system ------------------------------------------------------------------------
    def _mount_overlay(self, upper_from: Path | None) -> None:
        if upper_from is not None:
            _copy_tree(upper_from, self.upper)
        else:
            self.upper.mkdir()
        self._work.mkdir()
        _mount("overlay", self.merged, "overlay",
               f"lowerdir={self.base_dir},upperdir={self.upper},workdir={self._work}")

    def _check_open(self) -> None:
        if not self._finalizer.alive:
            raise SandboxError(f"sandbox {self.root} is closed")

    def fork(self) -> "Sandbox":
        """An independent sandbox with this one's current files (same lower dir, copied upper).
        Do not call while a command is running here."""
        self._check_open()
        return Sandbox(self.base_dir, limits=self.limits, ro_binds=self.ro_binds, root=self._root_parent,
                       _upper_from=self.upper)

    def snapshot(self, dest: str | Path | None = None) -> Path:
        """Copy the written state (the upper dir) to ``dest`` (default: a new directory inside this
        sandbox's private root, deleted by :meth:`close`) and return it."""
        self._check_open()
        dest = Path(dest) if dest is not None else self._snapshots / uuid.uuid4().hex[:12]
        _copy_tree(self.upper, dest)
        return dest

    def restore(self, snapshot: str | Path) -> None:
        """Reset the files to a :meth:`snapshot` (of a sandbox over the same base dir)."""
        self._check_open()
        snapshot = Path(snapshot)
        if not snapshot.is_dir():
            raise SandboxError(f"sandbox restore: snapshot {snapshot} is not a directory")
        _umount(self.merged)
        shutil.rmtree(self.upper)
        shutil.rmtree(self._work)
        self._mount_overlay(snapshot)

    def diff(self) -> list[tuple[str, str]]:
        """Paths written since the base, from the upper dir: ``(path, "changed" | "deleted")``,
        sorted; directories end with ``/`` and are listed only when new or replaced (opaque)."""
        self._check_open()
        out = []
        for dirpath, dirnames, filenames in os.walk(self.upper):
            rel_dir = Path(dirpath).relative_to(self.upper)
            for name in dirnames:
                rel = rel_dir / name
                opaque = _getxattr(Path(dirpath) / name, "trusted.overlay.opaque") == b"y"
                if opaque or not (self.base_dir / rel).is_dir():
                    out.append((f"{rel}/", "changed"))
            for name in filenames:
                st = os.lstat(Path(dirpath) / name)
                whiteout = (st.st_mode & 0o170000) == 0o020000 and st.st_rdev == 0
                out.append((str(rel_dir / name), "deleted" if whiteout else "changed"))
        return sorted(out)

    def close(self) -> None:
        """Unmount and delete everything (idempotent)."""
        self._finalizer()

    @property
    def closed(self) -> bool:
        return not self._finalizer.alive

    def __enter__(self) -> "Sandbox":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # -- commands ---------------------------------------------------------------------------
    def run(self, command: str, timeout: float | None = None) -> CommandResult:
        """Run ``sh -c command`` in ``/workspace``; never raises for the command's own failures.

        ``timeout``: seconds (default ``limits.timeout_s``); at the deadline every process of the
        command is killed and ``timed_out`` is set.
        """
        self._check_open()
        lim = self.limits
        timeout = lim.timeout_s if timeout is None else float(timeout)
        binds = []
        for inside, host in self.ro_binds.items():
            binds += ["--ro-bind", str(host), inside]
        status_r, status_w = os.pipe()  # bwrap reports {"child-pid": N} there once the sandbox is up
        argv = ["bwrap", "--json-status-fd", str(status_w), *self._bwrap, "--size", str(lim.disk_mb << 20),
                "--tmpfs", "/tmp",
                # /dev/shm is a tmpfs of its own under --dev (host-sized, not counted by ulimit -v):
                # cap it like /tmp
                "--size", str(lim.disk_mb << 20), "--tmpfs", "/dev/shm", *binds, "--bind", str(self.merged), WORKSPACE, "--chdir", WORKSPACE,
                "/bin/sh", "-c", command]
        # The outer shell joins the pids cgroup and sets the address-space limit, then becomes bwrap.
        join = 'echo $$ > "$0" && ' if self._cgroup is not None else ""
        wrapper = ["/bin/sh", "-c", f'{join}ulimit -v {lim.memory_mb << 10} && exec "$@"',
                   str(self._cgroup / "cgroup.procs") if self._cgroup is not None else "sh", *argv]
        t0 = time.monotonic()
        deadline = t0 + timeout
        out, timed_out, flooded = _Capped(lim.max_output_bytes), False, False
        try:
            proc = subprocess.Popen(wrapper, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                    stderr=subprocess.STDOUT, start_new_session=True, pass_fds=(status_w,))
        except OSError as e:
            os.close(status_r)
            raise SandboxError(f"sandbox: starting bwrap failed: {e}") from e
        finally:
            os.close(status_w)
        with proc:
            fd = proc.stdout.fileno()
            poller = select.poll()
            poller.register(fd, select.POLLIN | select.POLLHUP)
            while True:
                left = deadline - time.monotonic()
                if left <= 0:
                    timed_out = True
                    break
                if not poller.poll(left * 1000):
                    continue
                chunk = os.read(fd, 1 << 20 if out.dropped else 1 << 16)
                if not chunk:
                    break
                out.add(chunk)
                if out.dropped > lim.max_drain_bytes:
                    flooded = True
                    break
            if timed_out or flooded:
                try:
                    os.killpg(proc.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            code = proc.wait()
        with os.fdopen(status_r, "rb") as f:
            status = f.read()
        pid = child_pid(status)
        started = pid is not None
        if started:  # bwrap's monitor exits on the command's status, before the namespace is torn down
            _wait_gone(pid)
        seconds = time.monotonic() - t0
        text = out.text()
        if timed_out:
            text += f"\n[killed: timed out after {timeout:g} s]"
        elif flooded:
            text += f"\n[killed: more than {lim.max_drain_bytes} bytes of output]"
        if not started and not timed_out:
            raise SandboxError(f"sandbox: bwrap failed to start (exit {code}): {text.strip()[:500]}")
        return CommandResult(exit_code=code, output=text, timed_out=timed_out,
                             truncated=bool(out.dropped) or flooded, seconds=seconds)

    def __repr__(self) -> str:
        return f"Sandbox(base={self.base_dir}, root={self.root}, closed={self.closed})"


def child_pid(status: bytes) -> int | None:
    """The sandboxed command's pid from bwrap's ``--json-status-fd`` output (``{"child-pid": N,
    ...namespaces}`` once the sandbox is up), or None if it never started. A bwrap killed while
    writing the line (fault injection kills sandbox processes at random) leaves it partial, which
    ``json.loads`` rejects (seen: "Expecting ',' delimiter" lost a trajectory): the pid alone is read."""
    m = re.search(rb'"child-pid"\s*:\s*(\d+)', status)
    return int(m.group(1)) if m else None


def _wait_gone(pid: int, grace_s: float = 5.0) -> None:
    """Wait until the sandbox's PID-1 (``pid``, host numbering) has exited: the kernel ends a PID
    namespace's init only after every process in it is gone, so the overlay is no longer busy."""
    try:
        fd = os.pidfd_open(pid)
    except (OSError, AttributeError):  # already gone (or a kernel without pidfd: nothing to wait on)
        return
    try:
        if not select.select([fd], [], [], grace_s)[0]:
            log.warning("sandbox: processes of a killed command still alive after %.0f s (pid %d)", grace_s, pid)
    finally:
        os.close(fd)


def _getxattr(path: Path, name: str) -> bytes | None:
    try:
        return os.getxattr(path, name, follow_symlinks=False)
    except OSError:
        return None
