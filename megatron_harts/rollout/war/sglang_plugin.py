"""SGLang plugin: ``HARTS_SUFFIX``, suffix speculation over completed trajectories.

Registration: SGLang (>= 0.5.17) loads the entry points of group ``sglang.srt.plugins`` in every
process (``sglang.srt.plugins.load_plugins``); this package declares
``harts_suffix = megatron_harts.rollout.war.sglang_plugin:register``, and :func:`register` calls
``SpeculativeAlgorithm.register("HARTS_SUFFIX", spec_class=SuffixSpecAlgo)``. Start a server with
``--speculative-algorithm HARTS_SUFFIX --speculative-num-draft-tokens 17 --disable-overlap-schedule``
(plus ``HARTS_SUFFIX_CORPUS=/path/feed.jsonl`` in its environment).

Algorithm: ``SuffixSpecAlgo.is_ngram()`` is true, so the scheduler, memory planning and the
verification path are SGLang's NGRAM ones (a draft tree of ``speculative_num_draft_tokens``
nodes, the root being the last verified token; greedy and sampled tree verification in
``eagle_sample``); the worker is ``NGRAMWorker`` with its ``ngram_corpus`` replaced by
:class:`SuffixCorpus` (a :class:`~.suffix.SuffixDrafter`; the draft is a chain, the unused
nodes are siblings under the root) and ``_prepare_draft_tokens`` passing each request's new
tokens so its whole context is drafted from (SGLang's n-gram corpus only sees the last
``max_trie_depth`` tokens). Per-step cost of the hook: ``scripts/bench_war_steps.py``
(docs/war.md).

Feed: completed trajectories reach the running server through a JSONL file
(:class:`TrajectoryFeed` appends ``{"group": ..., "tokens": [...]}`` lines; the corpus reads new
lines at most every ``poll_s`` and indexes them in the worker's ``_update_ngram_corpus`` hook,
which runs after the verify forward is launched, so the indexing overlaps the GPU's work). A
request's group is the prefix of its ``rid`` before the first ``/`` (the agent loop's rids are
``group/path#turn-n``).

Host time: the corpus adds up its host time per scheduler step (before the verify forward:
drafting; after its launch: the feed's indexing) and logs it every
``$HARTS_SUFFIX_TIMING_EVERY`` steps. The same entry point registers ``HARTS_NGRAM_TIMED``:
SGLang's NGRAM worker and C++ corpus unchanged, the corpus wrapped in :class:`TimedNgramCorpus`,
which logs the same line for the baseline.

On CPU (CI): the registration through SGLang's real entry-point loader, the corpus' draft/mask
format against SGLang's own mask reader, and the feed are tested; the worker class itself needs
``sgl_kernel`` (CUDA) and runs only on the GPU.

SGLang is not a dependency of the project's venv (0.5.17 pins another torch):
:func:`sglang_site` installs ``sglang==0.5.17`` without dependencies, plus the few pure-Python
modules its import needs, into a separate directory that is put on ``sys.path``.
"""
from __future__ import annotations

import json
import logging
import os
import re
import subprocess
import sys
import threading
import time
from collections import OrderedDict
from pathlib import Path
from typing import Hashable, Sequence

import numpy as np

from .suffix import ContextIndex, DrafterConfig, SuffixDrafter
from .suffix import native as suffix_native

log = logging.getLogger(__name__)

ALGO_NAME = "HARTS_SUFFIX"
# SGLang's NGRAM (its worker and C++ corpus unchanged) with the corpus' host time per scheduler
# step logged like HARTS_SUFFIX's: the baseline's side of the host-time comparison
TIMED_NGRAM_NAME = "HARTS_NGRAM_TIMED"
SGLANG_VERSION = "0.5.17"
# what ``import sglang.srt.speculative.spec_info`` / ``cpp_ngram.ngram_corpus`` need beyond the venv
# (the venv has torch, numpy, transformers, requests, pydantic, orjson, fastapi, uvicorn)
SGLANG_IMPORT_DEPS = ("apache-tvm-ffi==0.1.11", "psutil", "pybase64", "torchvision", "IPython", "traitlets",
                      "msgspec")
CORPUS_ENV = "HARTS_SUFFIX_CORPUS"
# draft shape of the server's drafter: "tree" (default; drafts up to twice the match length) or "chain".
# Offline, on 72 code_repair episodes sampled from the H200-trained text model, budget 16: tree 4.12,
# chain 3.72, SGLang's NGRAM 3.92 tokens per verification (docs/war.md); on the H200 the chain got
# 3.27 against NGRAM's 3.94; tree drafts on the GPU since run 4 (docs/war.md)
DRAFT_ENV = "HARTS_SUFFIX_DRAFT"
# scheduler steps between the worker's host-time log lines (SuffixCorpus.timing_line; default 2000)
TIMING_ENV = "HARTS_SUFFIX_TIMING_EVERY"


# a JSONL path: the suffix corpus appends every draft it makes (request, context length and tail, draft
# tokens and parents, source, match length) for offline checks of what the server drafted
# (``replay.draft_log_acceptance``); unset: nothing is written
DRAFT_LOG_ENV = "HARTS_SUFFIX_DRAFT_LOG"
# context tokens before each logged draft (enough to find the context in the fed trajectories)
DRAFT_LOG_TAIL = 24


# "1": the two workers also time each whole verify step (draft, launch, GPU, after-launch work) with a
# device synchronisation at its end, by batch size (StepWallTimes); honoured only with the overlap
# schedule off, where the scheduler reads the step's results back right after it anyway
STEP_WALL_ENV = "HARTS_SPEC_STEP_WALL"


def log_every_from_env() -> int:
    """``$HARTS_SUFFIX_TIMING_EVERY`` (default 2000): scheduler steps between the worker's host-time
    log lines; a value that is not a positive integer is refused in one line naming the variable."""
    raw = os.environ.get(TIMING_ENV, "2000").strip()
    if not raw.isdigit() or int(raw) < 1:
        raise ValueError(f"${TIMING_ENV} must be a positive integer (scheduler steps), got {raw!r}")
    return int(raw)


def draft_config(n: int, shape: str | None = None) -> DrafterConfig:
    """The plugin's drafter for ``n`` draft nodes (root + ``n - 1`` drafted tokens); ``shape``:
    ``"tree"`` or ``"chain"`` (default: ``$HARTS_SUFFIX_DRAFT`` or ``"tree"``)."""
    shape = (shape or os.environ.get(DRAFT_ENV) or "tree").strip().lower()
    if shape not in ("tree", "chain"):
        raise ValueError(f"${DRAFT_ENV} must be 'tree' or 'chain', got {shape!r}")
    # depth 32, not the library's 64: on the sampled code_repair streams the same acceptance
    # (4.017 vs 4.019 tokens per verification, tree, budget 16), on the scripted ones 1-3.5% less,
    # at half the indexing cost and 2.5x lower p99 draft latency (docs/war.md)
    depth = max(32, n + 15)
    if shape == "chain":
        return DrafterConfig(budget=n - 1, max_depth=depth)
    return DrafterConfig(budget=n - 1, max_depth=depth, tree=True, max_spec_factor=2.0)
SITE_ENV = "HARTS_SGLANG_SITE"


def sglang_site(path: str | os.PathLike | None = None, install: bool = True) -> Path:
    """A directory holding ``sglang==0.5.17`` (no dependencies) and its import-time modules, put
    first on ``sys.path``. ``path``: default ``$HARTS_SGLANG_SITE`` or
    ``~/.cache/megatron_harts/sglang-0.5.17``. Installs with pip (``--no-deps --target``, so the
    venv's torch is untouched) when missing and ``install``; raises ``RuntimeError`` otherwise."""
    site = Path(path or os.environ.get(SITE_ENV) or Path.home() / ".cache" / "megatron_harts" /
                f"sglang-{SGLANG_VERSION}").expanduser()
    marker = site / ".harts_complete"
    if not marker.is_file():
        if not install:
            raise RuntimeError(f"no SGLang {SGLANG_VERSION} at {site}; call sglang_site(install=True)")
        site.mkdir(parents=True, exist_ok=True)
        cmd = [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--upgrade", "--target", str(site),
               f"sglang=={SGLANG_VERSION}", *SGLANG_IMPORT_DEPS]
        log.info("installing SGLang %s into %s: %s", SGLANG_VERSION, site, " ".join(cmd))
        r = subprocess.run(cmd, capture_output=True, text=True)
        if r.returncode != 0:
            raise RuntimeError(f"pip could not install SGLang {SGLANG_VERSION} into {site}: {r.stderr[-2000:]}")
        marker.write_text(" ".join(cmd) + "\n")
    if str(site) not in sys.path:
        sys.path.insert(0, str(site))
    return site


ENTRY_POINT = "harts_suffix = megatron_harts.rollout.war.sglang_plugin:register"


def write_plugin_dist(directory: str | os.PathLike) -> Path:
    """A minimal installed-distribution record declaring our ``sglang.srt.plugins`` entry point
    in ``directory`` (put it on the server's ``PYTHONPATH``), for a checkout that is not
    ``pip install``-ed (the installed package declares it in setup.py)."""
    dist = Path(directory) / "harts_war_plugin-0.0.dist-info"
    dist.mkdir(parents=True, exist_ok=True)
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: harts-war-plugin\nVersion: 0.0\n")
    (dist / "entry_points.txt").write_text(f"[sglang.srt.plugins]\n{ENTRY_POINT}\n")
    return Path(directory)


def ngram_corpus_cls():
    """SGLang's ``NgramCorpus`` class (its C++ trie + suffix automaton, JIT-built by tvm-ffi on
    first use). SGLang 0.5.17's ``result.h`` uses ``size_t`` without ``<cstddef>``, which g++ 12
    rejects; the module is therefore built once here with ``-include cstddef`` (same module name
    and cache directory, so SGLang's own loader then finds the built library)."""
    from sglang.kernels.jit.utils import load_jit
    from sglang.srt.speculative.cpp_ngram.ngram_corpus import NgramCorpus

    files = [f"ngram_corpus/{f}" for f in ("result.cpp", "trie.cpp", "suffix_automaton.cpp", "ngram.cpp",
                                            "ngram_corpus_ffi.cpp")]
    load_jit("ngram_corpus", cpp_files=files, header_only=False, extra_cflags=["-include", "cstddef"])
    return NgramCorpus


def group_of(rid: str) -> str | None:
    """The group of an agent-loop request id (``group/path#turn-n`` -> ``group``)."""
    return rid.split("/", 1)[0] if "/" in rid else None


def traj_of(rid: str) -> str | None:
    """The trajectory of an agent-loop request id (``group/path#turn-n`` -> ``group/path``)."""
    return rid.split("#", 1)[0] if "#" in rid else None


class TrajectoryFeed:
    """The trainer/loop side of the feed: append completed trajectories to the JSONL file that
    :class:`SuffixCorpus` watches (one line each, written whole under a lock)."""

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)
        self._lock = threading.Lock()

    def add(self, tokens: Sequence[int], group: str | None = None, traj: str | None = None) -> None:
        """One trajectory; ``traj``: its id (the agent loop's ``traj_id``, the part of its requests'
        rids before ``#``), recorded for offline checks of the server's drafts; the corpus reads
        ``group`` and ``tokens`` only."""
        rec = {"group": group, "tokens": [int(t) for t in tokens]}
        if traj is not None:
            rec["traj"] = traj
        line = json.dumps(rec) + "\n"
        with self._lock, open(self.path, "a") as f:
            f.write(line)

    def add_trajectories(self, trajectories) -> int:
        """``megatron_harts.tree.Trajectory`` records (``tokens``, ``group_id``, ``traj_id``); returns
        the count."""
        n = 0
        for t in trajectories:
            self.add(list(np.asarray(t.tokens).tolist()), getattr(t, "group_id", None), getattr(t, "traj_id", None))
            n += 1
        return n


def _bits_to_mask(rows: list[int], n: int) -> np.ndarray:
    """Rows given as bit sets (bit ``j`` of ``rows[r]``: column ``j``) -> bool ``[len(rows) * n]``
    (row-major)."""
    if n <= 64:                               # each row's 8 bytes, least significant bit first
        raw = np.array(rows, dtype="<u8").view(np.uint8).reshape(len(rows), 8)
        return np.unpackbits(raw, axis=1, count=n, bitorder="little").astype(bool).reshape(-1)
    nbytes = (n + 7) // 8
    raw = np.frombuffer(b"".join(r.to_bytes(nbytes, "little") for r in rows), dtype=np.uint8)
    return np.unpackbits(raw.reshape(len(rows), nbytes), axis=1, bitorder="little")[:, :n].astype(bool).reshape(-1)


class GcPauses:
    """The process' garbage-collector pauses (``gc.callbacks``): per generation the collections and
    their seconds since :meth:`install` (idempotent). Process-wide: a server's own allocations
    trigger collections as much as a drafter's, which is what comparing two servers needs."""

    counts = [0, 0, 0]                    # collections per generation
    seconds = 0.0                          # their pauses in all
    _t0 = 0.0
    _installed = False

    @classmethod
    def install(cls) -> None:
        if not cls._installed:
            import gc

            gc.callbacks.append(cls._callback)
            cls._installed = True

    @classmethod
    def _callback(cls, phase: str, info: dict) -> None:
        if phase == "start":
            cls._t0 = time.perf_counter()
        else:
            g = info.get("generation", 2)
            cls.counts[g] += 1
            cls.seconds += time.perf_counter() - cls._t0

    @classmethod
    def snapshot(cls) -> tuple[int, int, float]:
        """``(collections, full collections, seconds)`` so far."""
        return sum(cls.counts), cls.counts[2], cls.seconds


def _new_timing() -> dict:
    """Host seconds per scheduler step of a corpus (see ``SuffixCorpus.timing``), and where the
    process' GC pauses stood when it started (``gc0``, :class:`GcPauses`)."""
    GcPauses.install()
    return {"steps": 0, "sync_s": 0.0, "draft_s": 0.0, "after_s": 0.0, "max_step_s": 0.0,
            "gc0": GcPauses.snapshot()}


def _timing_line(name: str, t: dict, after: str) -> str:
    """``<name> host time per step over N steps: before the forward draft X ms + sync Y ms (worst
    step W ms), after its launch <after> Z ms; gc C collections (F full), G ms per step`` (means
    over the steps, milliseconds; GC pauses of the whole process since the corpus started)."""
    k = max(1, t["steps"])
    n, full, sec = (a - b for a, b in zip(GcPauses.snapshot(), t["gc0"]))
    return (f"{name} host time per step over {t['steps']} steps: before the forward draft "
            f"{1e3 * t['draft_s'] / k:.3f} ms + sync {1e3 * t['sync_s'] / k:.3f} ms (worst step "
            f"{1e3 * t['max_step_s']:.2f} ms), after its launch {after} {1e3 * t['after_s'] / k:.3f} ms; "
            f"gc {n} collections ({full} full), {1e3 * sec / k:.3f} ms per step")


class StepWallTimes:
    """Wall seconds of whole verify steps by batch size (requests per step): ``add(bs, seconds)``;
    ``line(name)`` is ``<name> verify step wall time by batch size (synchronized): 1: N x M ms, ...``
    (count and mean milliseconds per batch size, ascending, then all steps). Comparing two servers
    at equal batch sizes shows whether one's verification steps cost more, whatever the cause
    (host work, launches or the GPU).

    ``add(..., pre, idle)`` also splits a step at the worker's ``_update_ngram_corpus`` hook (where
    SGLang's NGRAM inserts into its corpus and ours indexes its feed): ``pre`` seconds from the
    step's start to the hook, ``idle`` whether the GPU stream had already finished its work when the
    hook was entered (``torch.cuda.Stream.query()``, no synchronisation). If it mostly had, the host
    work after the hook does not overlap the GPU, whatever the cause (a synchronisation on the way,
    or a GPU faster than the host). ``prep``: seconds from the step's start to the end of the
    worker's ``_prepare_for_speculative_decoding`` (drafts and tree mask built and copied: the verify
    forward can be launched), so that ``pre - prep`` is the forward's launch and the sampling.
    ``split_line(name)`` is ``<name> verify step split at the update hook by batch size: 1: N x R ms
    prepared, P ms before, D done, ...`` (steps, mean ms to the end of the preparation, mean ms
    before the hook, steps with the GPU done at it; "R ms prepared, " only where measured)."""

    def __init__(self):
        self.count: dict[int, int] = {}
        self.seconds: dict[int, float] = {}
        # bs -> [steps, seconds before the hook, GPU done at it, seconds prepared, steps with it]
        self.split: dict[int, list] = {}

    def add(self, bs: int, seconds: float, pre: float | None = None, idle: bool | None = None,
            prep: float | None = None) -> None:
        self.count[bs] = self.count.get(bs, 0) + 1
        self.seconds[bs] = self.seconds.get(bs, 0.0) + seconds
        if pre is not None:
            s = self.split.setdefault(bs, [0, 0.0, 0, 0.0, 0])
            s[0] += 1
            s[1] += pre
            s[2] += int(bool(idle))
            if prep is not None:
                s[3] += prep
                s[4] += 1

    def split_line(self, name: str) -> str:
        parts = [f"{bs}: {n} x " + (f"{1e3 * psec / pn:.3f} ms prepared, " if pn == n else "") +
                 f"{1e3 * sec / n:.3f} ms before, {done} done"
                 for bs, (n, sec, done, psec, pn) in sorted(self.split.items())]
        return f"{name} verify step split at the update hook by batch size: " + ", ".join(parts)

    @property
    def steps(self) -> int:
        return sum(self.count.values())

    def line(self, name: str) -> str:
        parts = [f"{bs}: {self.count[bs]} x {1e3 * self.seconds[bs] / self.count[bs]:.3f} ms"
                 for bs in sorted(self.count)]
        total = sum(self.seconds.values())
        parts.append(f"all: {self.steps} x {1e3 * total / max(1, self.steps):.3f} ms")
        return f"{name} verify step wall time by batch size (synchronized): " + ", ".join(parts)


_HOST_LINE = re.compile(r"\S+ host time per step over (\d+) steps: before the forward draft ([\d.]+) ms \+ sync "
                        r"([\d.]+) ms \(worst step ([\d.]+) ms\), after its launch [^;]*? ([\d.]+) ms; gc (\d+) "
                        r"collections \((\d+) full\), ([\d.]+) ms per step")
_WALL_LINE = re.compile(r"\S+ verify step wall time by batch size \(synchronized\): (.*)$", re.M)
_SPLIT_LINE = re.compile(r"\S+ verify step split at the update hook by batch size: (.*)$", re.M)


def server_timing(log_text: str) -> dict:
    """The host-time lines (:func:`_timing_line`) and verify wall-time lines
    (:meth:`StepWallTimes.line`) of a server's log, parsed: ``{"host": {"steps", "draft_ms",
    "sync_ms", "worst_ms", "after_ms", "gc_collections", "gc_full", "gc_ms"}, "verify_wall":
    {"<bs>" | "all": [steps, mean ms]}, "host_lines": [...], "verify_wall_lines": [...]}``:
    ``host`` / ``verify_wall`` the last line (cumulative since the server started), the ``_lines``
    every line in order, so windows of steps (e.g. without the first RL step) can be told apart
    (milliseconds per scheduler step; a key is absent when its lines are); ``drafter``: which form
    of the suffix drafter the server loaded (``compiled`` or ``Python``); ``verify_split`` /
    ``verify_split_lines``: the steps split at the update hook (:class:`StepWallTimes`); empty when
    the server logged none of these."""
    out: dict = {}
    hosts = [{"steps": int(g[0]), "draft_ms": float(g[1]), "sync_ms": float(g[2]), "worst_ms": float(g[3]),
              "after_ms": float(g[4]), "gc_collections": int(g[5]), "gc_full": int(g[6]), "gc_ms": float(g[7])}
             for g in (m.groups() for m in _HOST_LINE.finditer(log_text))]
    if hosts:
        out["host"], out["host_lines"] = hosts[-1], hosts
    walls = [{k: [int(n), float(ms)] for k, n, ms in re.findall(r"(\w+): (\d+) x ([\d.]+) ms", m.group(1))}
             for m in _WALL_LINE.finditer(log_text)]
    if walls:
        out["verify_wall"], out["verify_wall_lines"] = walls[-1], walls
    forms = re.findall(r"HARTS suffix drafter: (compiled|Python) draft expansion", log_text)
    if forms:
        out["drafter"] = forms[-1]
    splits = [{k: [int(n), float(ms), int(d)] + ([float(pr)] if pr else []) for k, n, pr, ms, d in
               re.findall(r"(\w+): (\d+) x (?:([\d.]+) ms prepared, )?([\d.]+) ms before, (\d+) done",
                          m.group(1))}
              for m in _SPLIT_LINE.finditer(log_text)]
    if splits:
        out["verify_split"], out["verify_split_lines"] = splits[-1], splits
    return out


def verify_wall_window(earlier: dict, later: dict) -> dict:
    """The verify steps between two cumulative wall-time lines of one server (``server_timing``'s
    ``verify_wall_lines[i]`` and ``[j]``, ``i < j``; ``{}`` as ``earlier``: from the start):
    ``{"<bs>" | "all": [steps, mean ms]}`` of the steps logged after ``earlier`` up to ``later``
    (batch sizes with no step in the window left out)."""
    out = {}
    for k, (n1, ms1) in later.items():
        n0, ms0 = earlier.get(k, (0, 0.0))
        if n1 > n0:
            out[k] = [n1 - n0, (n1 * ms1 - n0 * ms0) / (n1 - n0)]
    return out


def _step_wall_from_env(worker, name: str) -> StepWallTimes | None:
    """A :class:`StepWallTimes` for ``worker`` when ``$HARTS_SPEC_STEP_WALL`` is ``1`` and the overlap
    schedule is off (with it on, a synchronisation per step would undo the overlap: refused with a
    warning), else ``None``."""
    raw = os.environ.get(STEP_WALL_ENV, "").strip()
    if raw not in ("", "0", "1"):
        raise ValueError(f"${STEP_WALL_ENV} must be 0 or 1, got {raw!r}")
    if raw != "1":
        return None
    if getattr(worker, "enable_overlap", False):
        log.warning("%s: $%s ignored: the overlap schedule is on", name, STEP_WALL_ENV)
        return None
    return StepWallTimes()


def _timed_verify_step(worker, name: str, forward, batch, on_publish):
    """``forward(batch, on_publish)`` (the parent worker's ``forward_batch_generation``); a verify
    step (the batch decodes) is timed to the end of its GPU work into ``worker._step_wall``, whose
    line is logged every ``worker.ngram_corpus.log_every`` timed steps."""
    walls = worker._step_wall
    if walls is None or not batch.forward_mode.is_decode():
        return forward(batch, on_publish)
    import torch

    bs = len(batch.reqs)
    worker._at_update = worker._at_prepared = None
    t0 = time.perf_counter()
    out = forward(batch, on_publish)
    if torch.cuda.is_available():          # (CPU: the tests' stand-in forward)
        torch.cuda.current_stream().synchronize()
    t1 = time.perf_counter()
    at, prep = worker._at_update, worker._at_prepared
    walls.add(bs, t1 - t0, *((at[0] - t0, at[1]) if at is not None else ()),
              prep=prep - t0 if prep is not None and at is not None else None)
    if walls.steps % worker.ngram_corpus.log_every == 0:
        log.info("%s", walls.line(name))
        if walls.split:
            log.info("%s", walls.split_line(name))
    return out


def _mark_update_hook(worker) -> None:
    """At the entry of the worker's ``_update_ngram_corpus`` in a timed step: when, and whether the
    GPU stream had finished its work then (a query, no synchronisation), for ``StepWallTimes``."""
    if getattr(worker, "_step_wall", None) is None:
        return
    import torch

    done = torch.cuda.current_stream().query() if torch.cuda.is_available() else False
    worker._at_update = (time.perf_counter(), done)


def _mark_prepared(worker) -> None:
    """At the end of the worker's ``_prepare_for_speculative_decoding`` in a timed step: when."""
    if getattr(worker, "_step_wall", None) is not None:
        worker._at_prepared = time.perf_counter()


class _HostTiming:
    """Host time per scheduler step of a corpus (``timing``, :func:`_new_timing`): ``_add_sync``
    for work before drafting, ``_end_step`` with each ``batch_get``'s seconds (a step), a log line
    (``timing_line``) every ``log_every`` steps."""

    timing: dict
    log_every: int
    _sync_dt: float

    def _init_timing(self, log_every: int | None) -> None:
        self.timing = _new_timing()
        # scheduler steps between timing lines in the server's log (None: $HARTS_SUFFIX_TIMING_EVERY)
        self.log_every = log_every if log_every is not None else log_every_from_env()
        self._sync_dt = 0.0

    def _add_sync(self, dt: float) -> None:
        self._sync_dt += dt
        self.timing["sync_s"] += dt

    def _end_step(self, dt: float) -> None:
        t = self.timing
        t["steps"] += 1
        t["draft_s"] += dt
        t["max_step_s"] = max(t["max_step_s"], dt + self._sync_dt)
        self._sync_dt = 0.0
        if t["steps"] % self.log_every == 0:
            log.info("%s", self.timing_line())

    def timing_line(self) -> str:
        raise NotImplementedError


class TimedNgramCorpus(_HostTiming):
    """SGLang's ``NgramCorpus`` (or any corpus with its interface) unchanged, its host time per
    scheduler step added up as :class:`SuffixCorpus` does: ``synchronize`` and ``batch_get`` before
    the verify forward (a step ends with ``batch_get``), ``batch_put`` after its launch (NGRAM's
    insertion, overlapping the GPU); a line in the log every ``log_every`` steps (default
    ``$HARTS_SUFFIX_TIMING_EVERY``). Every other attribute is the wrapped corpus'."""

    def __init__(self, inner, log_every: int | None = None):
        self.inner = inner
        self._init_timing(log_every)

    def synchronize(self) -> None:
        t0 = time.perf_counter()
        self.inner.synchronize()
        self._add_sync(time.perf_counter() - t0)

    def batch_get(self, req_ids, batch_tokens, total_lens):
        t0 = time.perf_counter()
        out = self.inner.batch_get(req_ids, batch_tokens, total_lens)
        self._end_step(time.perf_counter() - t0)
        return out

    def batch_put(self, batch_tokens) -> None:
        t0 = time.perf_counter()
        self.inner.batch_put(batch_tokens)
        self.timing["after_s"] += time.perf_counter() - t0

    def timing_line(self) -> str:
        return _timing_line("NGRAM", self.timing, "insertion")

    def __getattr__(self, name):
        if name == "inner":                # not set yet (copy / unpickling): no recursion
            raise AttributeError(name)
        return getattr(self.inner, name)


class SuffixCorpus(_HostTiming):
    """Drop-in for SGLang's ``NgramCorpus`` inside ``NGRAMWorker``, drafting with
    :class:`SuffixDrafter`.

    ``batch_get(req_ids, batch_tokens, total_lens)``: ``batch_tokens[i]`` ends at context length
    ``total_lens[i]`` and holds at least the tokens not seen yet for that request (all of them
    the first time); returns ``(ids [bs * n] int64, mask [bs * n * n] bool)`` in NGRAM's layout:
    node 0 is the last context token, ``mask[i, j]`` = node ``j`` is node ``i`` or its ancestor
    (a chain, or with ``DrafterConfig(tree=True)`` a tree whose parents precede their children).
    ``feed``: JSONL path of completed trajectories (``None``: ``$HARTS_SUFFIX_CORPUS``).
    """

    def __init__(self, draft_token_num: int, config: DrafterConfig | None = None, feed: str | None = None,
                 poll_s: float = 0.5, index_s: float = 0.004, log_every: int | None = None):
        if draft_token_num < 2:
            raise ValueError(f"draft_token_num must be >= 2 (root + drafts), got {draft_token_num}")
        self.n = int(draft_token_num)
        self._unused = [1 | (1 << i) for i in range(self.n)]     # mask row of an unused node i (bits)
        cfg = config or draft_config(self.n)
        # feed trajectories are queued and indexed at most ~index_s seconds per scheduler iteration
        # (synchronize), so a burst of finished trajectories never stalls the serving loop
        self.index_s = index_s
        self.drafter = SuffixDrafter(cfg)
        # the drafter's compiled parts (suffix_expand.c), built (once per machine, ~0.3 s) and loaded
        # here rather than inside the first verify step; None: all in Python (same drafts, slower)
        log.info("HARTS suffix drafter: %s draft expansion",
                 "compiled" if suffix_native() is not None else "Python")
        self.ctx: dict[str, ContextIndex] = {}
        self.feed = feed if feed is not None else os.environ.get(CORPUS_ENV)
        path = os.environ.get(DRAFT_LOG_ENV, "").strip()
        self._draft_log = open(path, "a", buffering=1 << 16) if path else None   # DRAFT_LOG_ENV
        self.poll_s, self._pos, self._last_poll = poll_s, 0, 0.0
        self.stats = {"calls": 0, "drafted": 0, "fed": 0, "reused": 0, "indexed": 0}
        # host time per scheduler step (perf_counter seconds). Before the verify forward, on the
        # critical path: drafting + mask layout (``batch_get``) and feed polling + indexing when
        # called there (``synchronize``, NgramCorpus's interface). After the forward's launch,
        # overlapping the GPU: feed polling + indexing from the worker's ``after_verify`` hook.
        self._init_timing(log_every)
        # a trajectory's next turn (a new rid whose context extends the last one's) takes over the
        # context trie of its previous turn instead of re-indexing the whole context (~50 ms per
        # 3K tokens in Python): parked tries of departed requests, and the live rid per trajectory
        self._parked: OrderedDict[str, ContextIndex] = OrderedDict()
        self._live: dict[str, str] = {}
        self.max_parked = 4096

    # -- NgramCorpus interface used by NGRAMWorker ------------------------------------------------
    def _index_feed(self) -> float:
        """Poll the feed (every ``poll_s``) and index queued trajectories for at most ~``index_s``;
        returns the seconds it took."""
        t0 = time.perf_counter()
        self.poll(force=False)
        if self.drafter._queue:
            self.stats["indexed"] += self.drafter.index_pending(max_s=self.index_s)
        return time.perf_counter() - t0

    def synchronize(self) -> None:
        """NgramCorpus's hook before drafting: the feed's polling and indexing, on the critical path
        (timed into the next ``batch_get``'s step)."""
        self._add_sync(self._index_feed())

    def after_verify(self) -> None:
        """The worker's hook after the verify forward is launched (where NGRAM inserts into its
        corpus): the feed's polling and indexing, overlapping the GPU's work instead of delaying
        the next forward's launch. Same drafts as :meth:`synchronize` before the next
        ``batch_get`` (the index gets the same trajectories, one call earlier)."""
        self.timing["after_s"] += self._index_feed()

    def timing_line(self) -> str:
        """One log line: the mean host milliseconds per scheduler step this corpus cost so far
        (before the verify forward: drafting and any ``synchronize``; after its launch: the feed
        and indexing), the worst step before the forward, and the drafting counters."""
        return (_timing_line(ALGO_NAME, self.timing, "feed + indexing") +
                f"; {self.stats['calls']} drafts of {self.stats['drafted']} tokens, {self.stats['fed']} fed "
                f"trajectories, {self.stats['indexed']} tokens indexed")

    def batch_put(self, batch_tokens) -> None:
        """NGRAM's online insertion; the suffix corpus indexes requests in ``batch_get``."""

    def reset(self) -> None:
        self.ctx.clear()
        self._parked.clear()
        self._live.clear()

    def erase_match_state(self, req_ids: list[str]) -> None:
        for rid in req_ids:
            c = self.ctx.pop(rid, None)
            traj = traj_of(rid)
            if traj is not None and self._live.get(traj) == rid:
                del self._live[traj]
                if c is not None:
                    self._park(traj, c)

    def _park(self, traj: str, c: ContextIndex) -> None:
        self._parked[traj] = c
        self._parked.move_to_end(traj)
        while len(self._parked) > self.max_parked:
            self._parked.popitem(last=False)

    def _takeover(self, rid: str, toks: list[int], total: int) -> ContextIndex | None:
        """The context trie of the same trajectory's previous turn, extended to ``toks`` (the whole
        context), if that turn's context is a prefix of it; else ``None``."""
        traj = traj_of(rid)
        if traj is None or len(toks) < total:
            return None
        old = self._live.pop(traj, None)
        c = self.ctx.pop(old, None) if old is not None and old != rid else None
        if c is None:
            c = self._parked.pop(traj, None)
        if c is None:
            return None
        n = len(c.tokens)
        if n == 0 or n > len(toks) or list(toks[:n]) != c.tokens:
            return None
        if len(toks) > n:
            c.extend(toks[n:])
        self.stats["reused"] += 1
        return c

    def known(self, rid: str) -> int:
        c = self.ctx.get(rid)
        return len(c.tokens) if c is not None else 0

    def batch_get(self, req_ids: list[str], batch_tokens: list[list[int]], total_lens: list[int]):
        t0 = time.perf_counter()
        out = self._batch_get(req_ids, batch_tokens, total_lens)
        self._end_step(time.perf_counter() - t0)
        return out

    def _batch_get(self, req_ids: list[str], batch_tokens: list[list[int]], total_lens: list[int]):
        n = self.n
        bs = len(req_ids)
        ids = [0] * (bs * n)                 # [bs, n] flat
        rows: list[int] = []                 # [bs * n]: mask row i of a request as bits (bit j: node j)
        nat = suffix_native()                # compiled: the drafts' parents (flat) and sizes instead
        parents: list[int] = []
        counts: list[int] = []
        for b, (rid, toks, total) in enumerate(zip(req_ids, batch_tokens, total_lens)):
            c = self.ctx.get(rid)
            if c is None:
                c = self._takeover(rid, toks, total)
                if c is None:
                    if len(toks) < total:
                        raise ValueError(f"request {rid}: first batch_get needs its whole context "
                                         f"({total} tokens), got {len(toks)}")
                    c = self.drafter.start(toks[:-1] if toks else [])
                    c.extend(toks[-1:])
                self.ctx[rid] = c
                traj = traj_of(rid)
                if traj is not None:
                    self._live[traj] = rid
            else:
                new = total - len(c.tokens)
                if new < 0 or new > len(toks):
                    raise ValueError(f"request {rid}: context went from {len(c.tokens)} to {total} tokens "
                                     f"but only {len(toks)} were passed")
                if new:
                    c.extend(toks[len(toks) - new:])
            d = self.drafter.draft(c, group_of(rid), budget=n - 1)
            k = len(d.tokens)
            if self._draft_log is not None:
                self._log_draft(rid, c.tokens, d)
            o = b * n
            ids[o] = c.tokens[-1] if c.tokens else 0
            ids[o + 1:o + k + 1] = d.tokens
            self.stats["calls"] += 1
            self.stats["drafted"] += k
            if nat is not None:                              # the masks in one compiled call below
                parents += range(-1, k - 1) if d.parents is None else d.parents
                counts.append(k)
                continue
            r = [1]                                          # node 0: itself
            if d.parents is None:                            # a chain: node i+1's parent is node i
                for i in range(1, k + 1):
                    r.append(r[-1] | (1 << i))
            else:                                            # node i+1: its parent's row and itself
                for i, par in enumerate(d.parents):
                    r.append(r[par + 1] | (1 << (i + 1)))
            r += self._unused[k + 1:]                        # unused nodes: leaves under the root
            rows += r
        mask = nat.tree_masks(parents, counts, n) if nat is not None else _bits_to_mask(rows, n)
        if self._draft_log is not None:
            self._draft_log.flush()          # a server is often ended by SIGKILL: nothing left buffered
        return np.array(ids, dtype=np.int64), mask

    def _log_draft(self, rid: str, tokens: list[int], d) -> None:
        """One line of ``$HARTS_SUFFIX_DRAFT_LOG``: ``{"rid", "n": context length, "tail": its last
        DRAFT_LOG_TAIL tokens, "draft": tokens, "parents": parent indices (-1: the root; null: a
        chain), "source", "match"}``."""
        self._draft_log.write(json.dumps({"rid": rid, "n": len(tokens), "tail": tokens[-DRAFT_LOG_TAIL:],
                                          "draft": list(d.tokens), "parents": d.parents, "source": d.source,
                                          "match": d.match_len}, separators=(",", ":")) + "\n")

    # external corpus API of NGRAMWorker (its HTTP endpoint is NGRAM-only; these index the same way)
    def load_external_corpus_named(self, corpus_id: str, chunks) -> int:
        n = 0
        for ch in chunks:
            self.drafter.add_trajectory(ch, None)
            n += len(ch)
        return n

    def commit_external_corpus_load(self, corpus_id: str, loaded: int) -> None:
        pass

    # -- the feed ----------------------------------------------------------------------------------
    def poll(self, force: bool = True) -> int:
        """Queue the trajectories appended to the feed since the last poll for indexing (``force``:
        index them all now; else :meth:`synchronize` indexes them a slice per call); returns how
        many."""
        if not self.feed:
            return 0
        now = time.monotonic()
        if not force and now - self._last_poll < self.poll_s:
            return 0
        self._last_poll = now
        try:
            with open(self.feed, "rb") as f:
                f.seek(self._pos)
                data = f.read()
        except FileNotFoundError:
            return 0
        end = data.rfind(b"\n") + 1          # a line being written is read next time
        count = 0
        for line in data[:end].splitlines():
            if line.strip():
                obj = json.loads(line)
                self.drafter.queue_trajectory(obj["tokens"], obj.get("group"))
                count += 1
        self._pos += end
        self.stats["fed"] += count
        if force:
            self.stats["indexed"] += self.drafter.index_pending()
        return count


def gather_draft_inputs(corpus: "SuffixCorpus", owner: dict, depth: int, reqs, prev_ids: list[int],
                        prev_lens: list[int], stride: int, use_prev: bool):
    """The per-step inputs of :meth:`SuffixCorpus.batch_get` for SGLang ``Req``s (``rid``,
    ``origin_input_ids``, ``output_ids``): ``(rids, toks, totals)``, ``toks[i]`` the request's
    last ``max(depth, new tokens)`` context tokens, ``totals[i]`` its context length (tokens).
    ``prev_ids`` ``[bs * stride]`` / ``prev_lens`` ``[bs]``: the last verify step's accepted tokens,
    spliced in when ``use_prev`` (overlap mode, as NGRAM does). ``owner``: rid -> ``id(req)``; a
    new ``Req`` object under a known rid (or a context shorter than indexed) starts afresh. This is
    ``HartsSuffixWorker._prepare_draft_tokens``' loop, here so it runs (and is timed) on CPU."""
    rids, toks, totals = [], [], []
    for i, req in enumerate(reqs):
        prev = prev_ids[i * stride: i * stride + prev_lens[i]] if use_prev else []
        total = len(req.origin_input_ids) + len(req.output_ids) + len(prev)
        rid = req.rid
        if owner.get(rid) != id(req) or corpus.known(rid) > total:   # a new request
            corpus.erase_match_state([rid])
            owner[rid] = id(req)
        need = max(depth, total - corpus.known(rid))
        tail = list(req.output_ids[-need:]) + prev
        if len(tail) > need:                  # NGRAM's _efficient_concat_last_n, without copying the prompt
            tail = tail[-need:]
        elif len(tail) < need:
            tail = list(req.origin_input_ids[-(need - len(tail)):]) + tail
        toks.append(tail)
        rids.append(rid)
        totals.append(total)
    return rids, toks, totals


def _concat_last_n(seq1: list[int], seq2: list[int], n: int) -> list[int]:
    """``NGRAMWorker._efficient_concat_last_n``: the last ``n`` tokens of ``seq1 + seq2``."""
    if len(seq2) >= n:
        return seq2[-n:]
    return seq1[-(n - len(seq2)):] + seq2


def _spec_class():
    from sglang.srt.speculative.spec_info import CustomSpecAlgo

    class SuffixSpecAlgo(CustomSpecAlgo):
        """Dispatches as NGRAM everywhere in SGLang (verify path, memory, no draft KV)."""

        def is_ngram(self) -> bool:
            return True

        def has_draft_kv(self) -> bool:
            return False

        # SGLang 0.5.17 calls these three enum-only methods on every algorithm (Scheduler.
        # init_disaggregation / init_overlap, FutureMap) but CustomSpecAlgo lacks them (its
        # conformance check covers is_* / supports_* only): without them the scheduler dies at
        # start-up with AttributeError. NGRAM's answers.
        def carries_draft_hidden_states(self) -> bool:
            return False

        def need_topk(self) -> bool:
            return False

        def create_future_map(self, device, req_to_token_pool, needs_cpu_seq_lens: bool = True,
                              needs_confidence_relay: bool = False):
            from sglang.srt.managers.overlap_utils import FutureMap

            return FutureMap(device, self, req_to_token_pool, needs_cpu_seq_lens, needs_confidence_relay)

        def handle_server_args(self, server_args) -> None:
            # NGRAM's own defaults and checks (max running requests, top-k = BFS breadth, steps)
            from sglang.srt.arg_groups.speculative_hook import _handle_ngram

            _handle_ngram(server_args)

    return SuffixSpecAlgo


def suffix_worker_class():
    """``NGRAMWorker`` with :class:`SuffixCorpus` (imports ``sgl_kernel``: GPU machines only).

    SGLang's ``NgramCorpus`` (C++, JIT-built by tvm-ffi with ``ninja`` and a C++ compiler) is never
    built: ``NGRAMWorker.__init__`` runs with the module's ``NgramCorpus`` name bound to a
    :class:`SuffixCorpus` factory, so the worker needs no compiler on the GPU machine."""
    import sglang.srt.speculative.ngram_worker as ngram_worker
    from sglang.srt.speculative.ngram_worker import NGRAMWorker

    class HartsSuffixWorker(NGRAMWorker):
        def __init__(self, server_args, *args, **kwargs):
            saved = ngram_worker.NgramCorpus
            n = server_args.speculative_num_draft_tokens
            ngram_worker.NgramCorpus = lambda **kw: SuffixCorpus(int(kw.get("draft_token_num") or n))
            try:
                super().__init__(server_args, *args, **kwargs)
            finally:
                ngram_worker.NgramCorpus = saved
            if not isinstance(self.ngram_corpus, SuffixCorpus):
                self.ngram_corpus = SuffixCorpus(n)
            self._suffix_depth = self.ngram_corpus.drafter.cfg.max_depth
            self._owner: dict[str, int] = {}      # rid -> id(req): a reused rid starts afresh
            self._step_wall = _step_wall_from_env(self, ALGO_NAME)
            log.info("HARTS_SUFFIX worker: %d draft tokens, feed %s", n, self.ngram_corpus.feed)

        def forward_batch_generation(self, batch, on_publish=None):
            return _timed_verify_step(self, ALGO_NAME, super().forward_batch_generation, batch, on_publish)

        def _prepare_for_speculative_decoding(self, batch):
            super()._prepare_for_speculative_decoding(batch)
            _mark_prepared(self)

        def _update_ngram_corpus(self, batch):
            """Called after the verify forward is launched (NGRAM's online insertion): the suffix
            corpus indexes the feed here, while the GPU works (a request's own tokens are indexed
            in ``batch_get``)."""
            _mark_update_hook(self)
            self.ngram_corpus.after_verify()

        def _prepare_draft_tokens(self, batch):
            bs, stride = len(batch.reqs), self.draft_token_num
            prev_ids, prev_lens = batch.spec_info.accept_tokens, batch.spec_info.accept_lens
            if not prev_ids.is_cpu:
                prev_ids, prev_lens = prev_ids.cpu(), prev_lens.cpu()
            self.prev_token_ids, self.prev_accept_lens = prev_ids.tolist(), prev_lens.tolist()
            corpus = self.ngram_corpus                # the feed is indexed in _update_ngram_corpus
            use_prev = self.enable_overlap and not batch.grammar_needs_sync()
            rids, toks, totals = gather_draft_inputs(corpus, self._owner, self._suffix_depth, batch.reqs,
                                                     self.prev_token_ids, self.prev_accept_lens, stride, use_prev)
            drafts, mask = corpus.batch_get(rids, toks, totals)
            if len(self._owner) > 8 * max(64, len(corpus.ctx)):             # bounded: keep the live ones
                self._owner = {r: self._owner[r] for r in corpus.ctx if r in self._owner}
            assert len(drafts) == bs * self.draft_token_num
            return drafts, mask

    return HartsSuffixWorker


def timed_ngram_worker_class():
    """``NGRAMWorker`` whose C++ ``NgramCorpus`` is wrapped in :class:`TimedNgramCorpus` (same
    drafts, same verification; imports ``sgl_kernel``: GPU machines only)."""
    from sglang.srt.speculative.ngram_worker import NGRAMWorker

    class HartsTimedNgramWorker(NGRAMWorker):
        def __init__(self, server_args, *args, **kwargs):
            super().__init__(server_args, *args, **kwargs)
            self.ngram_corpus = TimedNgramCorpus(self.ngram_corpus)
            self._step_wall = _step_wall_from_env(self, "NGRAM")
            log.info("%s: SGLang's NGRAM with its corpus' host time logged", TIMED_NGRAM_NAME)

        def forward_batch_generation(self, batch, on_publish=None):
            return _timed_verify_step(self, "NGRAM", super().forward_batch_generation, batch, on_publish)

        def _prepare_for_speculative_decoding(self, batch):
            super()._prepare_for_speculative_decoding(batch)
            _mark_prepared(self)

        def _update_ngram_corpus(self, batch):
            _mark_update_hook(self)
            super()._update_ngram_corpus(batch)

    return HartsTimedNgramWorker


_registered = False


def register() -> None:
    """Entry point of group ``sglang.srt.plugins``: registers ``HARTS_SUFFIX`` and
    ``HARTS_NGRAM_TIMED`` (idempotent)."""
    global _registered
    from sglang.srt.speculative.spec_info import SpeculativeAlgorithm

    if _registered:
        return

    @SpeculativeAlgorithm.register(ALGO_NAME, supports_overlap=True, spec_class=_spec_class())
    def _factory(server_args):
        return suffix_worker_class()

    @SpeculativeAlgorithm.register(TIMED_NGRAM_NAME, supports_overlap=True, spec_class=_spec_class())
    def _timed_ngram_factory(server_args):
        return timed_ngram_worker_class()

    _registered = True
    log.info("registered speculative algorithm %s", ALGO_NAME)
