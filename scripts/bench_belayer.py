#!/usr/bin/env python
"""Belayer benchmark: recovery time of engine workers and environments vs their baselines, and the
failure-free overhead. Writes rows ``{fault, mechanism, recovery_s, baseline, baseline_s, speedup,
lost_trajectories, overhead_pct, reps, spread, device, note}`` (medians over ``--reps``; ``spread``:
min and max) to ``--out`` (JSON).

Engine rows (``--engine embedded``: the embedded transformers server on CPU with a tiny steered
random model; ``--engine sglang --model-path DIR``: SGLang on a GPU, run once on the H200 by
``scripts/gpu_belayer.sh``: docs/benchmarks/belayer_h200.json): a long request
(``--kill-at`` tokens generated of ``--max-new-tokens``) whose server is SIGKILLed. The steps
(``--plan``, or ``--reps`` / ``--cold-reps``) run on one supervisor, servers started one at a time
(SGLang servers sharing a GPU must not profile their memory together); a shadow is started after a
kill only when the next step needs one; every new server gets a short sampled warm-up (SGLang:
``torch.compile`` of the seeded sampler, Triton tuning) before it serves; ``--deadline-s`` skips
the steps that would not fit; ``--out`` is rewritten after every step.

* recovery: SIGKILL -> first token of the request resumed from its logged prefix on the promoted
  shadow (the detection, promotion and one prefill of prompt + generated tokens included);
* baseline ``cold start``: the same without a shadow: a new server is started, then the prefix
  resume (what one would do without shadows);
* baseline ``abort-and-resubmit``: on the shadow, but the request starts over from its prompt:
  time until it has regenerated the lost tokens and produced the next one.

Re-arm rows (``--parts rearm``; GPU state reuse, the weight keeper of ``belayer/keeper.py``): a
replacement worker started from the checkpoint vs one started with ``--load-format dummy`` and
re-armed from a keeper process that owns the weights (CPU shared memory with the embedded engine;
CUDA IPC with SGLang), ``--rearm-reps`` of each alternated, per model (``--rearm-presets`` on CPU,
``--model-path`` with SGLang); phases: process start (with the server's own weight load), keeper
health check + handles + ``/update_weights_from_tensor``, first token; every re-armed worker's
greedy tokens and log-probs are compared with a checkpoint worker's. Detail: ``rearm_reps``.

Environment rows (real bubblewrap + overlayfs sandboxes, scripted episodes of ``code_repair`` and
``lookup``): the sandbox is destroyed before the last action; recovery: restore from the newest
checkpoint + replay of the commands since (checkpoints every turn, overlapped); baseline: a fresh
environment and the whole episode replayed. Overhead rows: the same seeded rollout (24 lookup
episodes on the embedded engine) with plain engines and environments vs Belayer's (streaming
token log, resumable engine, checkpointed environments), alternated ``--reps`` times.

``python scripts/bench_belayer.py --reps 5 --out docs/benchmarks/belayer.json`` (CPU, ~5 min);
``bash scripts/gpu_belayer.sh`` (H200, SGLang: one device call, see there); its rows go into the CPU file
with ``--merge-rows docs/benchmarks/belayer_h200.json --out docs/benchmarks/belayer.json --plot
docs/benchmarks/belayer.png`` (rows carry ``device``; ``--merge`` keeps the other device kind's rows).
``--pool-engine-reps RUN.json[@mode:target,...] ...`` instead rebuilds the engine rows from the
per-step records of several such runs (medians and ranges over all their repetitions).
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import platform
import re
import shlex
import signal
import statistics
import sys
import tempfile
import threading
import time
from collections import defaultdict
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tqdm import tqdm  # noqa: E402

log = logging.getLogger("bench_belayer")


def _summary(xs):
    xs = [x for x in xs if x is not None]
    if not xs:
        return None, None
    return statistics.median(xs), [min(xs), max(xs)]


def _row(fault, mechanism, rec, baseline, base, *, device, note="", lost=0, overhead=None, extra=None):
    r_med, r_spread = _summary(rec)
    b_med, b_spread = _summary(base)
    return {"fault": fault, "mechanism": mechanism, "recovery_s": r_med, "baseline": baseline, "baseline_s": b_med,
            "speedup": (b_med / r_med) if r_med and b_med else None, "lost_trajectories": lost,
            "overhead_pct": overhead, "reps": len([x for x in rec if x is not None]),
            "spread": {"recovery_s": r_spread, "baseline_s": b_spread}, "device": device, "note": note,
            **(extra or {})}


# ------------------------------------------------------------------------------------- engine
_MODES = ("shadow", "restart", "cold")
_TARGETS = ("group", "child")


def _plan(args):
    """The engine steps ``[(mode, kill target)]``: ``--plan`` (``mode[:target],...``) or ``--reps``
    shadow and restart steps (alternated) then ``--cold-reps`` cold ones, all killing ``--kill``."""
    if args.plan:
        steps = []
        for spec in args.plan.split(","):
            mode, _, target = spec.strip().partition(":")
            target = target or args.kill
            if mode not in _MODES or target not in _TARGETS:
                raise SystemExit(f"--plan: bad step {spec!r} (mode in {_MODES}, target in {_TARGETS})")
            steps.append((mode, target))
        return steps
    return ([(m, args.kill) for _ in range(args.reps) for m in ("shadow", "restart")]
            + [("cold", args.kill)] * max(1, args.cold_reps))


def _server_factory(args, workdir, state=None, registry=None, load_format=None):
    """``start(path, version)`` for the Supervisor. ``state["engine_args"]``: the SGLang flags now
    in use (the fallback may replace them); ``registry``: every server made, to stop at the end
    those still starting; ``load_format``: ``dummy`` for a server that does not read the checkpoint
    (re-armed from a weight keeper)."""
    from megatron_harts.rollout.engines import EmbeddedServer

    state = state if state is not None else {"engine_args": args.engine_args}
    logdir = Path(args.log_dir or workdir)
    logdir.mkdir(parents=True, exist_ok=True)

    def start(path, version):
        extra = shlex.split(state["engine_args"])
        logp = str(logdir / f"{args.engine}-{time.time_ns()}.log")
        if args.engine == "embedded":
            if "--enable-deterministic-inference" not in extra:
                extra.append("--enable-deterministic-inference")
            server = EmbeddedServer(path, weight_version=version, threads=args.threads, log_path=logp,
                                    extra_args=extra, load_format=load_format)
        else:
            server = _TrackedSGLang(path, weight_version=version, log_path=logp, extra_args=extra,
                                    grace=args.grace_s, startup_timeout=args.startup_timeout_s,
                                    load_format=load_format)
        if registry is not None:
            registry.append(server)
        return server.start()
    return start


def _tracked_sglang_class():
    from megatron_harts.rollout.engines import SGLangServer

    class Tracked(SGLangServer):
        """Remembers its process group: a server that exits during start-up forgets its process
        (``proc = None``) without signalling the group, whose children (SGLang's scheduler)
        could keep GPU memory."""

        pgid = None

        @property
        def proc(self):
            return self.__dict__.get("_proc")

        @proc.setter
        def proc(self, p):
            if p is not None:
                self.pgid = p.pid
            self.__dict__["_proc"] = p
    return Tracked


def _TrackedSGLang(*a, **kw):  # noqa: N802 - a class made on first use (imports stay lazy)
    global _TRACKED
    if _TRACKED is None:
        _TRACKED = _tracked_sglang_class()
    return _TRACKED(*a, **kw)


_TRACKED = None


def _reap(registry):
    """Stop every server made (one still starting included) and SIGKILL what is left of each
    process group."""
    for server in registry:
        try:
            if server.proc is not None:
                server.stop()
        except Exception as e:  # noqa: BLE001 - best effort
            log.warning("stopping %s: %s", server, e)
        pgid = getattr(server, "pgid", None)
        if pgid:
            try:
                os.killpg(pgid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass


def _kill(args, sup, target):
    """SIGKILL the active worker: its process group, or only SGLang's scheduler child (found by its
    process title, ``faults.kill_server``). Returns (time of the kill, what was killed)."""
    from megatron_harts.rollout.belayer.faults import SCHEDULER_TITLES, kill_server
    from megatron_harts.rollout.engines.launch import find_children

    server = sup.worker(0).server
    if target == "child" and args.engine == "sglang" and not find_children(server.proc.pid, SCHEDULER_TITLES):
        log.warning("--kill child: no sglang::scheduler among the server's children; killing the process group instead")
        target = "group"
    f = kill_server(server, target)
    return f.t, f"{f.target}{'' if f.landed else ' (did not land)'}"


def _killed_request(args, sup, eng, sp, prompt, rid, target, timeout):
    """Stream ``prompt`` through ``eng`` and kill the worker once ``--kill-at`` tokens are logged.
    Returns (generation or None, record, tokens at the kill, time of the kill, what, error)."""
    out = {}

    def run():
        try:
            out["g"] = eng.generate(prompt, sp, rid=rid)
        except Exception as e:  # noqa: BLE001 - reported in the step's row
            out["e"] = f"{type(e).__name__}: {e}"
    th = threading.Thread(target=run, daemon=True)
    th.start()
    deadline = time.monotonic() + timeout
    while rid not in eng.log.records or len(eng.log.records[rid].output_ids) < args.kill_at:
        if not th.is_alive() or time.monotonic() > deadline:
            th.join(1.0)
            rec = eng.log.records.get(rid)
            n = len(rec.output_ids) if rec else 0
            return None, rec, n, None, None, out.get("e") or f"the request ended (or stalled) after {n} tokens, " \
                f"before --kill-at {args.kill_at}"
        time.sleep(0.001)
    rec = eng.log.records[rid]
    k = len(rec.output_ids)
    t_kill, what = _kill(args, sup, target)
    th.join(max(1.0, deadline - time.monotonic()))
    if th.is_alive():
        return None, rec, k, t_kill, what, f"the request did not finish within {timeout:g} s of its start"
    return out.get("g"), rec, k, t_kill, what, out.get("e")


def _first_diff(got, ref, resumed_at=None, around=8):
    """Where a resumed output first differs from the uninterrupted one: ``{"pos", "resumed_at"
    (the output offset the last attempt started from), "lengths", "got", "ref"}`` (``got`` /
    ``ref``: the tokens from ``around`` before that position to ``around`` after, and ``from``:
    the position of their first token), or None when they are equal."""
    got, ref = [int(t) for t in got], [int(t) for t in ref]
    if got == ref:
        return None
    pos = next((i for i, (a, b) in enumerate(zip(got, ref)) if a != b), min(len(got), len(ref)))
    lo = max(0, pos - around)
    return {"pos": pos, "resumed_at": resumed_at, "lengths": [len(got), len(ref)], "from": lo,
            "got": got[lo:pos + around + 1], "ref": ref[lo:pos + around + 1]}


def _warmup_fn(args):
    """A sampled generation at the resumed request's prefill length and one at the prompt's, with
    token ids unlike the benchmark prompt's (no prefix-cache help): SGLang compiles its seeded
    sampler (torch.compile) and Triton tunes kernels on first use, which would otherwise land
    in the first resumed request of every shadow."""
    from megatron_harts.rollout.types import SamplingParams

    def warm(engine):
        for n in (args.prompt_len + args.kill_at, args.prompt_len):
            ids = [3] + [50 + (7 * i) % 200 for i in range(n - 1)]
            engine.generate(ids, SamplingParams(max_new_tokens=4, stop_token_ids=[], seed=12345))
        # prefix-cache hits, alone and 4 at once (an agent's next turn): on the H200 the first batched
        # extend over cached GDN states stalled SGLang's scheduler for > 30 s (kernel compile/tuning)
        base = [3] + [60 + (11 * i) % 190 for i in range(args.prompt_len + args.kill_at - 1)]
        sp = SamplingParams(max_new_tokens=4, stop_token_ids=[], seed=12345)
        engine.generate(base, sp)
        engine.generate(base + [70, 71, 72], sp)
        with ThreadPoolExecutor(4) as pool:
            list(pool.map(lambda j: engine.generate(base + [80 + j] * (5 + 7 * j), sp), range(4)))
    return warm


def _engine_rows(args, res, steps_meta, device):
    """Rows from the steps done so far (any subset: a run cut short still has rows)."""
    rows = []
    starts = steps_meta["server_starts_s"]
    det = "--enable-deterministic-inference" in steps_meta["engine_args"] or args.engine == "embedded"
    base_note = (f"{args.engine} ({'deterministic sampling' if det else 'NOT deterministic'}; flags "
                 f"{steps_meta['engine_args']!r}); SIGKILL after {args.kill_at} of {args.max_new_tokens} tokens, "
                 f"prompt {args.prompt_len}; server start-up (warm-up included) median "
                 f"{statistics.median(starts) if starts else float('nan'):.1f} s of {len(starts)}")
    for target in _TARGETS:
        if not res[("shadow", target)] and not res[("restart", target)]:
            continue
        fault = ("engine worker SIGKILL (mid-request)" if target == "group"
                 else "engine scheduler SIGKILL (mid-request)")
        for base_mode, baseline in (("cold", "cold start + prefix resume"),
                                    ("restart", "shadow promoted + abort-and-resubmit from scratch")):
            base, note = res[(base_mode, target)], base_note
            if not base:
                other = [x for t in _TARGETS for x in res[(base_mode, t)]]
                if other:
                    base, note = other, base_note + f"; baseline measured with the other kill target"
            rows.append(_row(fault, "shadow promoted + prefix resume", res[("shadow", target)], baseline, base,
                             device=device, note=note))
    return rows        # GPU state reuse (the weight keeper): --parts rearm


def bench_engine(args, workdir, device, save=None):
    """The engine steps (:func:`_plan`) on one supervisor: an active worker and, when the next
    step needs one, a shadow (started in the background after each kill; a cold step has none).
    ``save(rows, detail, meta)`` is called after every step. Returns (rows, detail, meta)."""
    from megatron_harts.rollout.belayer import ResumableEngine, Supervisor
    from megatron_harts.rollout.types import SamplingParams

    steps = _plan(args)
    t0 = time.monotonic()
    deadline = t0 + args.deadline_s if args.deadline_s else None
    state = {"engine_args": args.engine_args}
    registry = []
    start = _server_factory(args, workdir, state, registry)
    warm = _warmup_fn(args) if (args.warmup == "on" or (args.warmup == "auto" and args.engine == "sglang")) else None
    needs_shadow = {"shadow": True, "restart": True, "cold": False}
    prompt = [1] + [40 + i % 50 for i in range(args.prompt_len - 1)]
    res = {(m, t): [] for m in _MODES for t in _TARGETS}
    detail = []
    meta = {"plan": [f"{m}:{t}" for m, t in steps], "engine_args": state["engine_args"], "server_starts_s": [],
            "warmups_s": [], "fallback": None, "complete": False, "skipped": []}
    if args.engine == "sglang":        # what SGLangServer sets unless told otherwise (crash diagnostics off)
        from megatron_harts.rollout.engines import SGLangServer
        meta["sglang_env"] = {n: os.environ.get(n, "0 (SGLangServer default)")
                              for n in SGLangServer.CRASH_DIAGNOSTICS_ENV}

    def phase(msg, *a):
        log.info("[+%6.1f s] " + msg, time.monotonic() - t0, *a)

    def est_start():               # the first start fills the compile caches: later ones are what steps wait for
        with sup._lock:
            later = list(sup.cold_starts[1:])
        return max(later or [args.startup_estimate_s])

    def fits(extra_s):
        return deadline is None or time.monotonic() + extra_s < deadline

    def snapshot():
        with sup._lock:
            meta["server_starts_s"] = [round(x, 2) for x in sup.cold_starts]
            meta["warmups_s"] = [round(x, 2) for x in sup.warmups]
        meta["engine_args"] = state["engine_args"]
        if save is not None:
            save(_engine_rows(args, res, meta, device), detail, meta)

    def make_sup():
        return Supervisor(start, args.model_path, "v0", num_active=1, num_shadows=1 if needs_shadow[steps[0][0]] else 0,
                          health_interval_s=0.25, engine_kw={"timeout": args.request_timeout_s, "retries": 0},
                          parallel_start=args.engine == "embedded", warmup=warm)

    phase("starting %s worker(s) with %r", 1 + needs_shadow[steps[0][0]], state["engine_args"])
    sup = make_sup()
    try:
        try:
            sup.start()
        except Exception as e:  # noqa: BLE001 - EngineError from a start, anything from a warm-up
            if not args.fallback_engine_args:
                raise
            log.error("starting with %r failed after %.0f s; retrying with --fallback-engine-args %r:\n%s",
                      state["engine_args"], time.monotonic() - t0, args.fallback_engine_args, str(e)[-3000:])
            meta["fallback"] = {"failed_args": state["engine_args"], "error": str(e)[-3000:],
                                "after_s": round(time.monotonic() - t0, 1)}
            _reap(registry)
            state["engine_args"] = args.fallback_engine_args
            sup = make_sup()
            sup.start()
    except Exception as e:
        meta["error"] = f"{type(e).__name__}: {str(e)[-3000:]}"
        _reap(registry)
        snapshot()
        raise
    phase("workers up: start-up %s s", [round(x, 1) for x in sup.cold_starts])
    try:
        ref, sp = None, None
        for seed in range(args.seed, args.seed + 5):    # a seed whose generation runs to the budget (no <eos>)
            sp = SamplingParams(max_new_tokens=args.max_new_tokens, stop_token_ids=[], seed=seed,
                                temperature=args.temperature)
            ref = sup.engine(0).generate(prompt, sp)
            if len(ref.output_ids) >= args.max_new_tokens:
                break
            log.warning("seed %d: the reference stopped after %d tokens (%s); trying the next", seed,
                        len(ref.output_ids), ref.finish_reason)
        meta["seed"], meta["temperature"], meta["reference_tokens"] = sp.seed, sp.temperature, len(ref.output_ids)
        phase("reference: %d tokens in %.2f s (seed %d)", len(ref.output_ids), ref.latency_s, sp.seed)
        for i, (mode, target) in enumerate(steps):
            if sup.worker(0) is None:
                meta["skipped"] = meta["plan"][i:]
                phase("the slot has no worker (a failed start?); skipping %s", meta["skipped"])
                break
            # -- precondition: a ready shadow (shadow, restart) or none (cold)
            if needs_shadow[mode]:
                if not sup.shadows and not sup._starting:
                    if not fits(1.2 * est_start() + args.step_margin_s):
                        meta["skipped"] = meta["plan"][i:]
                        phase("deadline: not starting a shadow for step %d; skipping %s", i, meta["skipped"])
                        break
                    with sup._lock:
                        sup.num_shadows = 1
                    sup._refill()
                t_w = time.monotonic()
                while not sup.shadows and sup._starting and (deadline is None or time.monotonic() < deadline):
                    time.sleep(0.05)
                if not sup.shadows:
                    meta["skipped"] = meta["plan"][i:]
                    phase("no shadow ready for step %d (start failed or deadline); skipping %s", i, meta["skipped"])
                    break
                if time.monotonic() - t_w > 0.5:
                    phase("shadow ready after %.1f s of waiting", time.monotonic() - t_w)
            else:
                if sup.shadows or sup._starting:
                    log.warning("step %d (cold): a shadow is ready or starting; the failover will use it", i)
                if not fits(1.2 * est_start() + args.step_margin_s):
                    meta["skipped"] = meta["plan"][i:]
                    phase("deadline: no time for a cold start at step %d; skipping %s", i, meta["skipped"])
                    break
            # -- after this step's kill: a new shadow only if the next step needs one and it fits
            nxt = steps[i + 1] if i + 1 < len(steps) else None
            refill = nxt is not None and needs_shadow[nxt[0]] and \
                fits(1.2 * est_start() + (1.2 * est_start() if mode == "cold" else 0) + args.step_margin_s)
            with sup._lock:
                sup.num_shadows = 1 if refill else 0
            phase("step %d/%d: %s, kill %s%s", i + 1, len(steps), mode, target,
                  "" if refill or nxt is None else " (no shadow refill after it)")
            eng = ResumableEngine(sup, 0, resume="restart" if mode == "restart" else "prefix")
            n_ev = len(sup.events)
            victim = sup.worker(0)
            timeout = args.request_timeout_s + (1.5 * est_start() if mode == "cold" else 0)
            if deadline is not None:
                timeout = max(30.0, min(timeout, deadline - time.monotonic()))
            g, rec, k, t_kill, what, err = _killed_request(args, sup, eng, sp, prompt, f"{mode}-{target}-{i}",
                                                           target, timeout)
            segs = rec.segments if rec is not None else []
            interrupted = len(segs) >= 2 and segs[0].error is not None
            rec_s = None
            if err is None and not interrupted:
                err = f"the kill ({what}) did not interrupt the request ({len(segs)} segment(s))"
            lost = segs[0].tokens if segs else k          # logged when the stream broke (k at the signal)
            if err is None:
                if mode == "restart":
                    rec_s = rec.times[lost] - t_kill if len(rec.times) > lost else None   # the lost ones again + 1
                elif segs[-1].t_first is not None:
                    rec_s = segs[-1].t_first - t_kill
            if rec_s is not None:
                res[(mode, target)].append(rec_s)
            evs = sup.events[n_ev:]
            same = g is not None and g.output_ids == ref.output_ids
            diff = _first_diff(g.output_ids, ref.output_ids, resumed_at=segs[-1].offset if segs else None) \
                if g is not None and not same else None
            detail.append({"step": i, "mode": mode, "kill": target, "killed": what, "tokens_at_kill": k,
                           "tokens_before_failure": lost,
                           "recovery_s": rec_s, "same_output": same, "first_diff": diff, "error": err,
                           "detect_s": round(evs[0].t_detect - t_kill, 4) if evs and t_kill else None,
                           "failover": [(e.how, e.cause[:80], round(e.seconds, 4)) for e in evs],
                           "segments": [{"worker": s_.worker, "offset": s_.offset, "tokens": s_.tokens,
                                         "first_token_s": None if s_.t_first is None or t_kill is None
                                         else round(s_.t_first - t_kill, 4), "error": s_.error and s_.error[:120]}
                                        for s_ in segs]})
            if err:
                log.error("step %d (%s, kill %s): %s", i + 1, mode, target, err)
                if t_kill is not None:     # killed but not noticed by the request: let the monitor replace it
                    t_w = time.monotonic()
                    while (sup.worker(0) is victim or sup.worker(0) is None) and \
                            time.monotonic() - t_w < 1.5 * est_start() + 10:
                        time.sleep(0.05)
                    phase("step %d: the slot's worker is %s", i + 1, getattr(sup.worker(0), "name", None))
            else:
                if mode != "restart" and not same:
                    log.warning("step %d: output differs from the uninterrupted one: %s", i + 1, diff)
                phase("step %d: %d tokens at the kill (%s), recovery %s s, failover %s", i + 1, k, what,
                      _fmt(rec_s), [(e.how, round(e.seconds, 3)) for e in evs])
            snapshot()
        else:
            meta["complete"] = True
    finally:
        phase("stopping the workers")
        sup.close(wait=False)
        _reap(registry)                    # a shadow still starting (cut short), leftovers of dead ones
        snapshot()
        phase("engine part done")
    return _engine_rows(args, res, meta, device), detail, meta


# ---------------------------------------------------------------------------------- re-arm (keeper)
REARM_MECHANISM = ("GPU state reuse (torch_memory_saver / CUDA IPC): weight keeper + dummy start + "
                   "update_weights_from_tensor")


def _server_weights_s(server):
    """Seconds the server itself reports for building the model and loading its weights: the
    embedded server's ``/server_info`` ``weights_load_s``; SGLang's log line ``Load weight end.
    elapsed=X s`` (None when the version does not print it)."""
    import re
    try:
        if getattr(server, "kind", "") == "embedded":
            import http.client
            conn = http.client.HTTPConnection(server.host, server.port, timeout=10)
            conn.request("GET", "/server_info")
            info = json.loads(conn.getresponse().read())
            conn.close()
            return info.get("weights_load_s")
        text = Path(server.log_path).read_text(errors="replace") if server.log_path else ""
        m = re.findall(r"Load weight end\..*?elapsed=([0-9.]+) s", text)
        return float(m[-1]) if m else None
    except Exception as e:  # noqa: BLE001 - a missing phase is recorded as None
        log.warning("weight-load time of %s not available: %s", server.url, e)
        return None


def _drop_page_cache(path):
    """Evict the checkpoint's safetensors files from the OS page cache (``posix_fadvise``
    ``DONTNEED``, unprivileged, this file only): the next read comes from the disk, as for a
    worker on a node that has not read the checkpoint recently."""
    for f in Path(path).glob("*.safetensors"):
        fd = os.open(f, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def _ckpt_bytes(path):
    return sum(f.stat().st_size for f in Path(path).glob("*.safetensors"))


def _rearm_models(args, workdir):
    """``[(label, checkpoint)]``: ``--model-path`` (SGLang), else the tiny model already made and
    the CPU ``--rearm-presets`` beyond it (a bigger checkpoint: a weight load that is not noise)."""
    from megatron_harts.rollout.belayer.tiny import make_tiny_checkpoint

    if args.engine == "sglang":
        return [(Path(args.model_path).name, args.model_path)]
    out = []
    for preset in args.rearm_presets.split(","):
        if preset == "tiny":
            out.append(("tiny", args.model_path))
        else:
            out.append((preset, make_tiny_checkpoint(Path(workdir) / f"rearm-{preset}", preset=preset, call_prob=1e-4,
                                                     eos_prob=1e-4)["path"]))
    return out


def bench_rearm(args, workdir, device, save=None):
    """A replacement worker started from the checkpoint vs started with ``--load-format dummy``
    and re-armed from a weight keeper, alternated ``--rearm-reps`` times per model. Phases (s):
    ``start_s`` (process start until ``/health``: for the checkpoint start it includes the
    server's own weight load, ``server_weights_s``), ``rearm_s`` (keeper health check + handles +
    ``/update_weights_from_tensor``: ``health_s``, ``handles_s``, ``update_s``), ``first_token_s``
    (a one-token greedy request of ``--prompt-len`` tokens); ``total_s`` = their sum. Every re-armed
    worker's greedy 16 tokens and log-probs are compared with those of a checkpoint worker started
    first, unmeasured (on a GPU it also fills the compile caches a first start pays for). With
    ``--rearm-cold-cache`` a third mode, ``checkpoint_cold``, evicts the checkpoint from the page
    cache before its start (a second baseline). The modes take turns going first. Returns (rows,
    detail)."""
    from megatron_harts.rollout.belayer.keeper import start_keeper
    from megatron_harts.rollout.types import SamplingParams

    t0 = time.monotonic()
    deadline = t0 + args.deadline_s if args.deadline_s else None
    registry = []
    state = {"engine_args": args.engine_args}
    start_ck = _server_factory(args, workdir, state, registry)
    start_dm = _server_factory(args, workdir, state, registry, load_format="dummy")
    prompt = [1] + [40 + i % 50 for i in range(args.prompt_len - 1)]
    first = SamplingParams(max_new_tokens=1, temperature=0.0, stop_token_ids=[])
    check = SamplingParams(max_new_tokens=16, temperature=0.0, stop_token_ids=[])
    keeper_device = "cpu" if args.engine == "embedded" else "cuda:0"
    rows, detail = [], []
    ekw = {"timeout": args.request_timeout_s, "retries": 0}

    def phase(msg, *a):
        log.info("[rearm +%6.1f s] " + msg, time.monotonic() - t0, *a)

    for label, path in _rearm_models(args, workdir):
        keeper = None
        modes = ["checkpoint", "keeper"] + (["checkpoint_cold"] if args.rearm_cold_cache else [])
        res = {m: [] for m in modes}
        ref = None
        longest = {m: args.startup_estimate_s for m in modes}
        try:
            tk = time.monotonic()
            keeper = start_keeper(path, "v0", device=keeper_device, log_path=str(Path(args.log_dir or workdir)
                                                                               / f"keeper-{time.time_ns()}.log"))
            keeper_start_s = time.monotonic() - tk
            kh = keeper.health()
            phase("%s: keeper up in %.2f s (%d tensors, %.1f MiB on %s, health check %.4f s)", label, keeper_start_s,
                  kh["num_tensors"], kh["bytes"] / 2**20, kh["device"], kh["check_s"])
            srv = start_ck(path, "v0")      # unmeasured: fills compile caches (SGLang), gives the reference
            try:
                ref = srv.engine(**ekw).generate(prompt, check)
            finally:
                srv.stop()
            phase("%s: reference worker (checkpoint, not measured): %d greedy tokens", label, len(ref.output_ids))
            for rep in range(args.rearm_reps):
                for mode in modes[rep % len(modes):] + modes[:rep % len(modes)]:     # each first in turn
                    if deadline is not None and time.monotonic() + 1.3 * longest[mode] + 10 > deadline:
                        phase("%s: deadline: skipping %s rep %d and the rest", label, mode, rep)
                        break
                    if mode == "checkpoint_cold":
                        _drop_page_cache(path)
                    ts = time.monotonic()
                    server = (start_dm if mode == "keeper" else start_ck)(path, "v0")
                    try:
                        r = {"model": label, "mode": mode, "rep": rep, "start_s": time.monotonic() - ts,
                             "server_weights_s": _server_weights_s(server)}
                        eng = server.engine(**ekw)
                        if mode == "keeper":
                            r.update(keeper.rearm(eng, "v0"))
                        t1 = time.monotonic()
                        eng.generate(prompt, first)
                        r["first_token_s"] = time.monotonic() - t1
                        r["total_s"] = time.monotonic() - ts
                        g = eng.generate(prompt, check)
                        r["same_tokens"] = g.output_ids == ref.output_ids
                        r["max_abs_logprob_diff"] = (max(abs(a - b) for a, b in zip(g.logprobs, ref.logprobs))
                                                     if r["same_tokens"] and g.logprobs else None)
                    finally:
                        server.stop()
                    longest[mode] = max(longest[mode], r["total_s"]) if rep else r["total_s"]
                    res[mode].append(r)
                    detail.append(r)
                    phase("%s rep %d %s: start %.2f s (server weights %s s)%s, first token %.3f s, total %.2f s, "
                          "output %s", label, rep, mode, r["start_s"], _fmt(r["server_weights_s"]),
                          f", re-arm {r['rearm_s']:.3f} s" if mode == "keeper" else "", r["first_token_s"],
                          r["total_s"], "equal" if r["same_tokens"] and not r["max_abs_logprob_diff"] else
                          f"tokens {'equal' if r['same_tokens'] else 'DIFFER'}, max |dlogprob| "
                          f"{_fmt(r['max_abs_logprob_diff'])}")
                else:
                    continue
                break
        finally:
            if keeper is not None:
                keeper.stop()
            _reap(registry)
        for base in modes[:1] + modes[2:]:
            if res["keeper"] and res[base]:
                rows.append(_rearm_row(args, device, label, path, res, keeper_start_s, kh, base))
        if save is not None:
            save(rows, detail)
    return rows, detail


def _rearm_row(args, device, label, path, res, keeper_start_s, kh, base="checkpoint"):
    def med(mode, key):
        xs = [r[key] for r in res[mode] if r.get(key) is not None]
        return statistics.median(xs) if xs else None
    paired = [c["total_s"] - k["total_s"] for c, k in zip(res[base], res["keeper"])]
    equal = all(r["same_tokens"] for r in res["keeper"])
    exact = equal and all(not r["max_abs_logprob_diff"] for r in res["keeper"])
    transport = "CPU shared memory" if args.engine == "embedded" else "CUDA IPC"
    row = _row("engine worker SIGKILL (replacement start, no shadow)", REARM_MECHANISM,
               [r["total_s"] for r in res["keeper"]],
               "restart loading the checkpoint" + (" (its page cache dropped first)" if base == "checkpoint_cold" else
                                                   " (in the page cache)"),
               [r["total_s"] for r in res[base]], device=device,
               note=(f"{args.engine}, model {label} ({_ckpt_bytes(path) / 2**20:.1f} MiB of safetensors); transport "
                     f"{transport}; recovery_s / baseline_s: server start -> first token (detection not included); "
                     f"re-armed outputs {'bit-identical' if exact else 'same tokens' if equal else 'DIFFERENT'} "
                     f"(greedy 16 tokens and log-probs vs the checkpoint worker)"),
               extra={"model": label, "checkpoint_bytes": _ckpt_bytes(path),
                      "saved_s": statistics.median(paired) if paired else None,
                      "saved_s_spread": [min(paired), max(paired)] if paired else None,
                      "outputs_equal": equal, "outputs_bit_identical": exact,
                      "max_abs_logprob_diff": max((r["max_abs_logprob_diff"] or 0.0) for r in res["keeper"]),
                      "keeper": {"start_s": keeper_start_s, "device": kh["device"], "bytes": kh["bytes"],
                                 "health_check_s": kh["check_s"]},
                      "phases_s": {m: {k: med(m, k) for k in ("start_s", "server_weights_s", "health_s", "handles_s",
                                                              "update_s", "rearm_s", "first_token_s", "total_s")
                                       if med(m, k) is not None} for m in ("keeper", base)}})
    row["reps"] = min(len(res["keeper"]), len(res[base]))
    return row


# ---------------------------------------------------------------------------------- environment
CODE_ACTIONS = ["<call>head -3 solution.py</call>", "<call>echo a > notes.txt</call>",
                "<call>python3 test_solution.py | tail -1</call>", "<call>cp solution.py s2.py && wc -c s2.py</call>",
                "<call>python3 test_solution.py | tail -1</call>", "<call>echo b >> notes.txt; ls</call>",
                "<call>python3 test_solution.py | tail -1</call>", "<call>cat notes.txt</call>"]


def bench_env(args, device):
    from megatron_harts.rollout.belayer.env import CheckpointedEnv, CheckpointPolicy
    from megatron_harts.rollout.belayer.faults import SandboxFaultInjector, lose_sandbox
    from megatron_harts.rollout.envs import make_env
    from megatron_harts.rollout.sandbox import SandboxLimits

    cases = [("code_repair", lambda: make_env("code_repair", 3, seed=0, max_turns=10), CODE_ACTIONS, 1),
             ("code_repair", lambda: make_env("code_repair", 3, seed=0, max_turns=10), CODE_ACTIONS, 4),
             ("lookup", lambda: make_env("lookup", 7, seed=0, max_turns=8), [f"{c}</call>" for c in "abcdefg"], 1)]
    rows = []
    for name, mk, actions, every in cases:
        rec, base, over, replayed = [], [], [], []
        for r in tqdm(range(args.reps), desc=f"env {name} every {every}", leave=False):
            env = CheckpointedEnv(mk, policy=CheckpointPolicy(every=every))
            try:
                for a in actions[:-1]:
                    time.sleep(args.gen_gap_s)            # the model's turn: checkpoints overlap it
                    env.step(a)
                env._wait_checkpoint()
                lose_sandbox(env.env.sandbox)
                env.step(actions[-1])
                last = env.stats["restores"][-1]
                rec.append(last["seconds"])
                replayed.append(last["replayed"])
                base.append(env.recreate_and_replay(len(actions) - 1))
                over.append(env.stats["checkpoint_wait_s"] + sum(c.seconds for c in env.checkpoints
                                                                 if c.mode == "inline"))
            finally:
                env.close()
        rows.append(_row(f"sandbox lost before turn {len(actions)} ({name})",
                         f"restore newest checkpoint (every {every} turn{'s' if every > 1 else ''}) + replay since",
                         rec, "recreate environment + replay the episode", base, device=device,
                         note=f"scripted {len(actions)}-turn episode, {args.gen_gap_s * 1000:.0f} ms between turns; "
                              f"{statistics.median(replayed):g} commands replayed; checkpoint time on the critical "
                              f"path {statistics.median(over) * 1000:.1f} ms per episode"))
    # a command SIGKILLed while it runs (the in-turn fault): restore to the turn before + re-run
    rec, base = [], []
    mk = lambda: make_env("code_repair", 3, seed=0, max_turns=10, limits=SandboxLimits(timeout_s=5.0))  # noqa: E731
    for r in range(args.reps):
        env = CheckpointedEnv(mk)
        try:
            for a in CODE_ACTIONS[:-2]:
                time.sleep(args.gen_gap_s)
                env.step(a)
            env._wait_checkpoint()
            slow = "<call>python3 test_solution.py | tail -1; sleep 0.3</call>"
            with SandboxFaultInjector({"kill": 1.0}, rate=1.0, budget=1, seed=r, delay_s=(0.15, 0.15)) as inj:
                t0 = time.monotonic()
                env.step(slow)
                total = time.monotonic() - t0
            if not inj.landed():
                continue
            t_kill = inj.landed()[0].t
            rec.append(t0 + total - t_kill)         # kill -> the turn's (correct) observation
            n = len(env.actions)
            base.append(env.recreate_and_replay(n - 1) + _time_step(env, slow))
        finally:
            env.close()
    rows.append(_row("sandbox command SIGKILLed mid-turn (code_repair)",
                     "restore the turn's checkpoint + re-run the command", rec,
                     "recreate environment + replay the episode + re-run", base, device=device,
                     note="kill -> the turn's observation; both include re-running the 0.3 s command"))
    return rows


def _time_step(env, action):
    t0 = time.monotonic()
    env.env.step(action)
    return time.monotonic() - t0


# ------------------------------------------------------------------------------------ overhead
def bench_overhead(args, workdir, device):
    from megatron_harts.rollout.agent_loop import AgentLoop, RolloutConfig
    from megatron_harts.rollout.belayer import ResumableEngine, Supervisor
    from megatron_harts.rollout.belayer.env import BelayerAgentLoop, CheckpointedEnv
    from megatron_harts.rollout.engines import HttpEngine
    from megatron_harts.rollout.envs import make_env
    from megatron_harts.rollout.tokenizer import ByteTokenizer
    from megatron_harts.rollout.types import SamplingParams

    every = args.overhead_stream_interval
    start = _server_factory(args, workdir, state={"engine_args": f"{args.engine_args} --stream-interval {every}"
                                                  if every > 1 else args.engine_args})
    cfg = RolloutConfig(group_size=4, max_new_tokens=args.overhead_max_new_tokens, max_concurrency=8, seed=0,
                        temperature=args.overhead_temperature)
    tasks = list(range(4))
    mk = lambda t: make_env("code_repair", int(t), seed=0, max_turns=3)     # noqa: E731
    warm = _warmup_fn(args) if (args.warmup == "on" or (args.warmup == "auto" and args.engine == "sglang")) else None
    # no faults are injected here: a long grace keeps a slow first compile from counting as a failure
    sup = Supervisor(start, args.overhead_model_path, "v0", num_active=1, num_shadows=0, health_interval_s=0.5,
                     health_grace_s=120.0, warmup=warm).start()
    kinds = ("plain", "engine", "env", "belayer")
    times = {k: [] for k in kinds}
    crit = {k: [] for k in kinds}
    envs: list = []

    def ckpt_env(t):
        env = CheckpointedEnv(lambda: mk(t))
        envs.append(env)
        return env
    try:
        url = sup.worker(0).engine.url
        for r in tqdm(range(args.overhead_reps + 1), desc="overhead rounds"):   # the first round warms up
            for kind in kinds[r % 4:] + kinds[:r % 4]:      # rotated: no variant always runs after the same one
                engines = [ResumableEngine(sup, 0)] if kind in ("engine", "belayer") else [HttpEngine(url)]
                factory = ckpt_env if kind in ("env", "belayer") else mk
                loop = (BelayerAgentLoop if kind in ("env", "belayer") else AgentLoop)(engines, ByteTokenizer(),
                                                                                      factory, cfg)
                envs.clear()
                t0 = time.monotonic()
                res = loop.rollout(tasks, [f"t{t}" for t in tasks])
                dt = time.monotonic() - t0
                if res.failed:
                    raise RuntimeError(f"{kind} rollout lost {len(res.failed)} episodes")
                if r:
                    times[kind].append(dt)
                    if envs:       # time in CheckpointedEnv.step outside the inner step, vs the inner steps
                        crit[kind].append(100 * sum(e.stats["wrapper_s"] for e in envs)
                                          / sum(e.stats["inner_s"] for e in envs))
        # the engine side alone, sequential requests (far less noisy than whole rollouts here)
        plain_e, res_e = HttpEngine(url), ResumableEngine(sup, 0)
        prompt = [1] + [40 + i % 50 for i in range(63)]
        pairs_e = []
        # equal outputs are expected where sampling is reproducible: greedy, the embedded engine, or
        # SGLang with deterministic inference (without it SGLang does not honour sampling_seed)
        greedy = args.overhead_temperature == 0
        same_expected = greedy or args.engine == "embedded" or "--enable-deterministic-inference" in args.engine_args
        differ = 0
        for i in tqdm(range(args.overhead_reps * 8), desc="engine requests"):
            sp = SamplingParams(max_new_tokens=args.overhead_max_new_tokens, stop_token_ids=[], seed=None if greedy else i,
                                temperature=args.overhead_temperature)
            t0 = time.monotonic()
            a = plain_e.generate(prompt, sp)
            t1 = time.monotonic()
            b = res_e.generate(prompt, sp)
            t2 = time.monotonic()
            differ += a.output_ids != b.output_ids
            pairs_e.append(100 * ((t2 - t1) - (t1 - t0)) / (t1 - t0))
        if differ and same_expected:
            raise RuntimeError(f"streamed and plain generations differ ({differ} of {len(pairs_e)} requests)")
    finally:
        sup.close()
    p = statistics.median(times["plain"])
    rows = []
    what = {"engine": "token log + streaming + resumable engine", "env": "checkpointed environments (+ cut-back loop)",
            "belayer": "both"}
    rows.append({"fault": "none (failure-free requests)", "mechanism": "ResumableEngine (streaming + token log)",
                 "recovery_s": None, "baseline": "HttpEngine.generate (one reply)", "baseline_s": None, "speedup": None,
                 "lost_trajectories": 0, "overhead_pct": statistics.median(pairs_e), "reps": len(pairs_e),
                 "spread": {"overhead_pct_paired": [min(pairs_e), max(pairs_e)]}, "device": device,
                 "stream_interval": every, "outputs_differ": differ, "outputs_must_match": same_expected,
                 "max_new_tokens": args.overhead_max_new_tokens,
                 "note": f"{args.overhead_max_new_tokens}-token requests with a 64-token prompt, one server (--stream-interval {every}), plain and "
                         "resumable alternated; overhead_pct: median of the paired differences"})
    for kind in ("engine", "env", "belayer"):
        pairs = [100 * (y - x) / x for x, y in zip(times["plain"], times[kind])]
        b = statistics.median(times[kind])
        rows.append({"fault": "none (failure-free rollout)", "mechanism": what[kind], "recovery_s": None,
                     "baseline": "plain AgentLoop + HttpEngine + SandboxEnv", "baseline_s": p, "speedup": None,
                     "lost_trajectories": 0, "overhead_pct": statistics.median(pairs), "reps": len(pairs),
                     "env_wrapper_pct_of_env_steps": statistics.median(crit[kind]) if crit[kind] else None,
                     "spread": {"overhead_pct_paired": [min(pairs), max(pairs)],
                                "rollout_s": [min(times[kind]), max(times[kind])],
                                "baseline_rollout_s": [min(times["plain"]), max(times["plain"])]},
                     "device": device, "rollout_s": b, "stream_interval": every,
                     "overhead_pct_of_medians": 100 * (b - p) / p,
                     # per round, in round order (paired by index): runs can be pooled later
                     "rounds_s": times[kind], "baseline_rounds_s": times["plain"],
                     "max_new_tokens": args.overhead_max_new_tokens,
                     "note": "16 code_repair episodes (tiny steered random model: random shell commands, <= 3 "
                             f"turns of <= {args.overhead_max_new_tokens} tokens, one server with --stream-interval "
                             f"{every}), the four variants alternated each round, order rotated; overhead_pct: median of the paired differences"})
    return rows


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--engine", choices=["embedded", "sglang"], default="embedded")
    p.add_argument("--model-path", default=None, help="checkpoint (default: a tiny steered model made here)")
    p.add_argument("--engine-args", default="", help="extra server flags (SGLang: add --enable-deterministic-inference)")
    p.add_argument("--threads", type=int, default=1, help="torch threads of each embedded server")
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--cold-reps", type=int, default=3)
    p.add_argument("--overhead-reps", type=int, default=4)
    p.add_argument("--overhead-temperature", type=float, default=1.0,
                   help="overhead part: sampling temperature of the rollouts (0: greedy, no per-request seeds; on the "
                        "H200 SGLang 0.5.17 stalled its scheduler for ~80 s compiling the seeded sampler for new "
                        "batch sizes)")
    p.add_argument("--overhead-max-new-tokens", type=int, default=16,
                   help="overhead part: new tokens per turn and per engine-side request (16: the rows before 2026-12-03's "
                        "fourth session; agentic turns are longer, which dilutes per-turn costs)")
    p.add_argument("--overhead-stream-interval", type=int, default=8,
                   help="overhead part: the server's --stream-interval (tokens per streamed event; 1: an event per "
                        "token, the setting of the rows recorded before 2026-12-02 18:00)")
    p.add_argument("--merge", action="store_true",
                   help="keep the rows already in --out of the other parts, and those of another device kind (CPU / "
                        "GPU) of any part")
    p.add_argument("--merge-rows", default=None, metavar="JSON",
                   help="run nothing: put the rows of another output of this script (e.g. the H200 record "
                        "docs/benchmarks/belayer_h200.json) into --out, replacing --out's rows of the same part and "
                        "device kind; with --plot, redraw")
    p.add_argument("--pool-engine-reps", nargs="+", default=None, metavar="FILE[@mode:target,...]",
                   help="run nothing: rebuild --out's engine rows of the runs' device kind from the per-step records "
                        "of several raw runs (FILE@steps keeps only those steps of FILE); with --plot, redraw")
    p.add_argument("--plot", default=None, help="also draw the rows of --out into this PNG")
    p.add_argument("--plot-only", action="store_true", help="only draw --plot from --out")
    p.add_argument("--kill-at", type=int, default=200)
    p.add_argument("--max-new-tokens", type=int, default=320)
    p.add_argument("--prompt-len", type=int, default=64)
    p.add_argument("--gen-gap-s", type=float, default=0.05, help="simulated generation time between env turns")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--temperature", type=float, default=1.0,
                   help="engine part: the killed request's temperature (0: greedy, so the resumed output can be "
                        "compared with the reference without SGLang's --enable-deterministic-inference)")
    p.add_argument("--kill", choices=["group", "child"], default="group",
                   help="SIGKILL the server's process group, or only SGLang's scheduler child (found by its process "
                        "title sglang::scheduler; the embedded server has no children: its group)")
    p.add_argument("--plan", default=None,
                   help="engine steps mode[:target],... (mode shadow|restart|cold, target group|child, default "
                        "--kill), all on one supervisor, e.g. shadow:group,cold:group,shadow:child,restart:group; "
                        "default: --reps shadow/restart pairs, then --cold-reps cold steps")
    p.add_argument("--fallback-engine-args", default=None,
                   help="if the first server start with --engine-args fails, start again with these flags instead "
                        "(recorded in the JSON); e.g. the flags a previous run is known to work with")
    p.add_argument("--deadline-s", type=float, default=None,
                   help="engine part: start no step (and no server for one) that would not end within this many "
                        "seconds of the part's start; the rows so far are kept")
    p.add_argument("--startup-estimate-s", type=float, default=60.0,
                   help="server start-up time assumed for --deadline-s before one was measured")
    p.add_argument("--step-margin-s", type=float, default=20.0, help="time a step takes besides server starts")
    p.add_argument("--startup-timeout-s", type=float, default=600.0, help="SGLang: give up a server start after this")
    p.add_argument("--request-timeout-s", type=float, default=120.0,
                   help="client timeout (per stream event; whole reply otherwise) of the engine requests")
    p.add_argument("--grace-s", type=float, default=3.0,
                   help="SGLang: SIGTERM -> SIGKILL of a stopped server's process group (its graceful exit polls "
                        "every 5 s; the GPU memory is only free once every process is gone)")
    p.add_argument("--warmup", choices=["auto", "on", "off"], default="auto",
                   help="a short sampled generation on every new worker before it is used (auto: on for SGLang)")
    p.add_argument("--log-dir", default=None, help="server logs (default: a temporary directory)")
    p.add_argument("--rearm-reps", type=int, default=3, help="rearm part: restarts per mode and model")
    p.add_argument("--rearm-cold-cache", action=argparse.BooleanOptionalAction, default=True,
                   help="rearm part: also restarts whose checkpoint was evicted from the page cache first "
                        "(posix_fadvise DONTNEED): a second baseline row")
    p.add_argument("--rearm-presets", default="tiny,small",
                   help="rearm part, embedded engine: checkpoints (tiny: the steered tiny model; small: 77M "
                        "parameters, 296 MiB fp32, made here)")
    p.add_argument("--parts", default="engine,env,overhead", help="any of engine, env, overhead, rearm")
    p.add_argument("--out", default="docs/benchmarks/belayer.json")
    args = p.parse_args(argv)
    if args.merge_rows:
        merge_rows(args.merge_rows, args.out)
        if args.plot:
            plot(args.out, args.plot)
        return 0
    if args.pool_engine_reps:
        pool_engine_reps(args.pool_engine_reps, args.out)
        if args.plot:
            plot(args.out, args.plot)
        return 0
    if args.plot_only:
        if not args.plot:
            p.error("--plot-only needs --plot PNG")
        plot(args.out, args.plot)
        return 0
    parts = set(args.parts.split(","))
    if not parts <= set(_PARTS):
        p.error(f"--parts: unknown part(s) {sorted(parts - set(_PARTS))} (known: {', '.join(_PARTS)})")
    if args.kill_at < 1 or args.kill_at >= args.max_new_tokens:
        p.error("--kill-at must be in [1, --max-new-tokens)")
    if args.engine == "sglang" and not args.model_path:
        p.error("--model-path is required with --engine sglang")
    if "engine" in parts:
        _plan(args)                   # a bad --plan fails here, before anything starts
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    for noisy in ("megatron_harts.rollout.engines", "megatron_harts.rollout.belayer", "megatron_harts.rollout.agent_loop"):
        # on the GPU the server starts, failovers and stops are the record of the run
        logging.getLogger(noisy).setLevel(logging.INFO if args.engine == "sglang" and noisy != "megatron_harts.rollout"
                                          ".agent_loop" else logging.ERROR)
    # `timeout` sends SIGTERM: exit through Python so the finally blocks and atexit stop the servers
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    workdir = tempfile.mkdtemp(prefix="bench-belayer-")
    device = (f"CPU ({platform.processor() or platform.machine()}, {os.cpu_count()} cores, shared)"
              if args.engine == "embedded" else f"GPU ({_gpu_name()}, SGLang)")
    from megatron_harts.rollout.belayer.tiny import make_tiny_checkpoint
    if args.model_path is None:      # long generations: </call> and <eos> nearly never sampled
        args.model_path = make_tiny_checkpoint(Path(workdir) / "long", call_prob=1e-4, eos_prob=1e-4)["path"]
    if "overhead" in parts:
        args.overhead_model_path = (make_tiny_checkpoint(Path(workdir) / "calls", call_prob=0.15, eos_prob=0.02)["path"]
                                    if args.engine == "embedded" else args.model_path)
    cmd = "python scripts/bench_belayer.py " + " ".join(argv or sys.argv[1:])
    state = {"rows": [], "detail": [], "meta": None, "rearm_reps": None}

    def save(engine_rows=None, detail=None, meta=None):
        """Write --out with everything measured so far (after every engine step and every part)."""
        if engine_rows is not None:
            state["rows"] = [dict(x, part="engine") for x in engine_rows] + \
                [x for x in state["rows"] if x.get("part") != "engine"]
            state["detail"], state["meta"] = detail, meta
        _write(args, parts, cmd, device, state["rows"], state["detail"], state["meta"], state["rearm_reps"])

    if "engine" in parts:
        save(*bench_engine(args, workdir, device, save=save))
    if "env" in parts:
        state["rows"] += [dict(x, part="env") for x in bench_env(args, device)]
        save()
    if "overhead" in parts:
        state["rows"] += [dict(x, part="overhead") for x in bench_overhead(args, workdir, device)]
        save()
    if "rearm" in parts:
        def save_rearm(rows, detail):
            state["rows"] = ([x for x in state["rows"] if x.get("part") != "rearm"]
                             + [dict(x, part="rearm") for x in rows])
            state["rearm_reps"] = detail
            save()
        save_rearm(*bench_rearm(args, workdir, device, save=save_rearm))
    if args.plot:
        plot(args.out, args.plot)
    for r in state["rows"]:
        log.info("%s | %s | recovery %s s | %s %s s | speedup %s | overhead %s %%", r["fault"], r["mechanism"],
                 _fmt(r["recovery_s"]), r["baseline"], _fmt(r["baseline_s"]), _fmt(r["speedup"]),
                 _fmt(r["overhead_pct"]))
    return 0


def _write(args, parts, cmd, device, rows, detail, meta, rearm_detail=None):
    out = {"device": device, "commands": {p_: cmd for p_ in parts}, "rows": rows, "engine_reps": detail}
    if meta is not None:
        out["engine_run"] = meta
    if rearm_detail is not None:
        out["rearm_reps"] = rearm_detail
    if args.merge and Path(args.out).is_file():
        old = json.loads(Path(args.out).read_text())
        kind = _device_kind(device)
        keep = [x for x in old["rows"]
                if x.get("part") not in parts or _device_kind(x.get("device") or old.get("device")) != kind]
        out["rows"] = _sorted_rows(keep + rows)
        out["commands"] = {**old.get("commands", {}), **out["commands"]}
        if "merged" in old:
            out["merged"] = old["merged"]
        if "engine" not in parts:
            out["engine_reps"] = old.get("engine_reps", [])
            if "engine_run" in old:
                out["engine_run"] = old["engine_run"]
        if "rearm" not in parts and "rearm_reps" in old:
            out["rearm_reps"] = old["rearm_reps"]
    out["rows"] = _sorted_rows([r for r in out["rows"] if not _placeholder(r)])
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(str(args.out) + ".tmp")
    tmp.write_text(json.dumps(out, indent=1) + "\n")
    os.replace(tmp, args.out)          # a reader (or a kill) never sees half a file


_PARTS = ["engine", "env", "overhead", "rearm"]


def _placeholder(r):
    """The empty "GPU state reuse" row the engine part wrote before the rearm part existed."""
    return r.get("part", "engine") == "engine" and str(r.get("mechanism", "")).startswith("GPU state reuse") \
        and not r.get("reps")


def _device_kind(device):
    """``CPU`` or ``GPU``: rows of one kind replace each other on a merge, the other kind's stay."""
    return "GPU" if str(device or "").startswith("GPU") else "CPU"


def _sorted_rows(rows):
    """By part (engine, env, overhead), CPU rows before GPU rows within a part; stable otherwise."""
    return sorted(rows, key=lambda x: (_PARTS.index(x.get("part", "engine")), _device_kind(x.get("device")) == "GPU"))


def merge_rows(src, out):
    """Put the rows of ``src`` (an output of this script, e.g. from another device) into ``out``,
    replacing the rows of ``out`` with the same part and device kind; ``src``'s run details
    (device, commands, ``engine_run``) are kept under ``merged[src]`` (its ``engine_reps`` stay in
    ``src``, the raw record)."""
    s = json.loads(Path(src).read_text())
    d = json.loads(Path(out).read_text())
    new = [dict(r, device=r.get("device") or s.get("device"), part=r.get("part", "engine"), source=str(src))
           for r in s["rows"]]
    replaced = {(r["part"], _device_kind(r["device"])) for r in new}
    keep = [r for r in d["rows"]
            if (r.get("part", "engine"), _device_kind(r.get("device") or d.get("device"))) not in replaced]
    d["rows"] = _sorted_rows([r for r in keep + new if not _placeholder(r)])
    d.setdefault("merged", {})[str(src)] = {"merged_by": f"python scripts/bench_belayer.py --merge-rows {src} --out {out}",
                                            **{k: s[k] for k in ("device", "commands", "engine_run", "rearm_reps")
                                               if k in s}}
    tmp = Path(str(out) + ".tmp")
    tmp.write_text(json.dumps(d, indent=1) + "\n")
    os.replace(tmp, out)


def pool_engine_reps(specs, out):
    """Rebuild ``out``'s engine rows of one device kind from the per-step records (``engine_reps``) of
    several raw runs of this script, so that each row's median and spread cover every repetition.

    ``specs``: ``FILE`` (all its steps) or ``FILE@mode:target,...`` (only those steps, e.g. to leave
    out a step measured before a fix). The rows replace ``out``'s rows of part ``engine`` and the
    runs' device kind; ``merged["pooled engine_reps"]`` records the specs, and each row counts its
    steps whose output equalled the uninterrupted one (``same_output``)."""
    res, starts, flags, devices, shape = defaultdict(list), [], [], set(), set()
    same = defaultdict(lambda: [0, 0])
    for spec in specs:
        path, _, keep = spec.partition("@")
        try:
            s = json.loads(Path(path).read_text())
        except (OSError, json.JSONDecodeError) as e:
            raise SystemExit(f"--pool-engine-reps: {path}: cannot read ({e})")
        wanted = {tuple(x.split(":")) for x in keep.split(",")} if keep else None
        reps = s.get("engine_reps") or []
        if not reps:
            raise SystemExit(f"--pool-engine-reps: {path}: no engine_reps")
        run = s.get("engine_run") or {}
        starts += run.get("server_starts_s", [])
        flags.append(run.get("engine_args", "?") if not run.get("fallback") else
                     f"{run['engine_args']} (fell back from {run['fallback'].get('failed_args')!r})")
        cmd = (s.get("commands") or {}).get("engine", "")
        shape.add((int(re.search(r"--kill-at (\d+)", cmd).group(1)) if "--kill-at" in cmd else 200,
                   int(re.search(r"--max-new-tokens (\d+)", cmd).group(1)) if "--max-new-tokens" in cmd else 320,
                   int(re.search(r"--prompt-len (\d+)", cmd).group(1)) if "--prompt-len" in cmd else 64))
        devices.add(s.get("device"))
        used = 0
        for r in reps:
            key = (r.get("mode"), r.get("kill"))
            if (wanted is not None and key not in wanted) or r.get("recovery_s") is None:
                continue
            res[key].append(r["recovery_s"])
            same[key][0] += bool(r.get("same_output"))
            same[key][1] += 1
            used += 1
        if wanted is not None and not used:
            raise SystemExit(f"--pool-engine-reps: {path}: no step matches {keep!r}")
    if len(devices) != 1:
        raise SystemExit(f"--pool-engine-reps: the runs are from different devices: {sorted(map(str, devices))}")
    if len(shape) != 1:
        raise SystemExit(f"--pool-engine-reps: the runs differ in (kill at, new tokens, prompt): {sorted(shape)}")
    device, (kill_at, new_tokens, prompt_len) = devices.pop(), shape.pop()
    ns = argparse.Namespace(engine="sglang" if "SGLang" in str(device) else "embedded", kill_at=kill_at,
                            max_new_tokens=new_tokens, prompt_len=prompt_len)
    rows = _engine_rows(ns, res, {"server_starts_s": starts, "engine_args": " | ".join(dict.fromkeys(flags))}, device)
    for r in rows:
        target = "child" if "scheduler" in r["fault"] else "group"
        k, n = same[("shadow", target)]
        base_note = r["note"].split("; ")[-1] if r["note"].endswith("kill target") else ""
        r.update(part="engine", device=device, source="pooled: " + "; ".join(specs),
                 same_output=f"{k} of {n} prefix resumes equal to the uninterrupted output",
                 note=f"repetitions pooled from {len(specs)} runs (engine flags per run: {' | '.join(flags)}); "
                      f"SIGKILL after {kill_at} of {new_tokens} tokens, prompt {prompt_len}; server start-up "
                      f"(warm-up included) median {statistics.median(starts) if starts else float('nan'):.1f} s "
                      f"of {len(starts)}" + (f"; {base_note}" if base_note else ""))
    d = json.loads(Path(out).read_text()) if Path(out).exists() else {"device": device, "rows": []}
    d["rows"] = _sorted_rows([r for r in d["rows"] if (r.get("part", "engine"), _device_kind(r.get("device") or d.get(
        "device"))) != ("engine", _device_kind(device))] + rows)
    d.setdefault("merged", {})["pooled engine_reps"] = {
        "merged_by": "python scripts/bench_belayer.py --pool-engine-reps " + " ".join(specs) + f" --out {out}",
        "steps": {f"{m}:{t}": v for (m, t), v in sorted(res.items()) if v}}
    tmp = Path(str(out) + ".tmp")
    tmp.write_text(json.dumps(d, indent=1) + "\n")
    os.replace(tmp, out)


def _gpu_name():
    import subprocess
    try:
        r = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"], capture_output=True,
                           text=True, timeout=20)
        return r.stdout.strip().splitlines()[0] if r.returncode == 0 and r.stdout.strip() else "unknown GPU"
    except (OSError, subprocess.SubprocessError, IndexError):
        return "unknown GPU"


def plot(json_path, png_path):
    """Recovery vs baseline per fault (log scale, medians with min-max bars)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    d = json.loads(Path(json_path).read_text())
    rows = [r for r in d["rows"] if r.get("recovery_s") and r.get("baseline_s")]
    devices = list(dict.fromkeys(r.get("device") or d["device"] for r in rows))

    def tag(r):                    # which device, when the file holds more than one
        if len(devices) < 2:
            return ""
        dev = r.get("device") or d["device"]
        if _device_kind(dev) == "CPU" or "(" not in dev:
            return _device_kind(dev) + ": "
        return dev.split("(", 1)[1].split(",")[0].replace("NVIDIA ", "") + ": "      # "H200: "

    def row_label(r):
        other = " (baseline: other kill target)" if "baseline measured with the other kill target" in \
            (r.get("note") or "") else ""
        model = f", model {r['model']}" if r.get("model") else ""
        return f"{tag(r)}{r['fault']}{model}\n{r['mechanism']}\nvs {r['baseline']}{other} [{r.get('reps')} rep(s)]"

    def times(x):
        return f"{x:.0f}x" if x >= 100 else f"{x:.1f}x" if x >= 1 else f"{x:.2f}x"
    fig, ax = plt.subplots(figsize=(10, 0.9 * len(rows) + 1.2))
    for i, r in enumerate(rows):
        sp = r.get("spread") or {}
        for j, (key, color, label) in enumerate((("recovery_s", "tab:green", "Belayer"),
                                                 ("baseline_s", "tab:gray", "baseline"))):
            lo, hi = (sp.get(key) or [r[key], r[key]])
            y = i + (0.2 if j else -0.2)
            ax.barh(y, r[key], height=0.38, color=color, label=label if i == 0 else None)
            ax.plot([lo, hi], [y, y], color="black", lw=1)
        ax.text(max(r["baseline_s"], r["recovery_s"]) * 1.3, i, times(r["speedup"]), va="center", fontsize=8)
    ax.set_yticks(range(len(rows)))
    ax.set_yticklabels([row_label(r) for r in rows], fontsize=6)
    ax.set_xscale("log")
    ax.set_xlim(right=max(max(r["baseline_s"], r["recovery_s"]) for r in rows) * 8)    # room for the ratios
    ax.set_xlabel("seconds: fault -> first resumed token / consistent observation (median, min-max)", fontsize=8)
    ax.set_title("Belayer recovery, " + "; ".join(devices), fontsize=9)
    ax.legend(loc="lower right", fontsize=8)
    ax.invert_yaxis()
    fig.tight_layout()
    fig.savefig(png_path, dpi=120)


def _fmt(x):
    return "-" if x is None else f"{x:.3g}"


if __name__ == "__main__":
    sys.exit(main())
