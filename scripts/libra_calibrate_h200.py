#!/usr/bin/env python
"""Measure SGLang decode tokens/s vs batch and context (and the prefill rate) for Libra's rollout
cost model. Ran on the H200 on 2026-12-02 (docs/benchmarks/libra_calibration_h200.json).

For each (batch B, prompt length L): a warm-up wave of B short prompts (new shapes compile
outside the timed waves), then B concurrent ``/generate`` requests of random prompts with
``ignore_eos``, once with ``--short`` and once with ``--long`` new tokens; the decode rate is
``B x (long - short) / (t_long - t_short)`` (the prefill and request overheads cancel), at mean
context ``L + (short + long) / 2``. Prefill (measured first): one request of the longest prompt
with 1 new token. Writes ``<out>/libra_calibration.json`` after every point (a run cut short by
``--deadline-s`` or a kill still leaves the points so far; ``"complete": true`` at the end):
``{"points": [[B, ctx, tokens/s], ...], "prefill_tok_s", "rows", "server_info"}``; when this
script started the server, also ``"log_waves"``: the decode-only rates of the server's own log
(``costs.decode_waves_from_log``: SGLang logs the generation rate every 40 decode iterations; the
intervals with no prefill in between). Contexts are capped at the model's
``max_position_embeddings - long`` (SGLang rejects longer).

**Reading it** (``costs.load_calibration`` / ``costs.rollout_cost_from_calibration``): the
short/long difference is exact only if both waves prefill ``B x L`` tokens in the same time. At
large ``B x L`` the prefill is most of the wave and varies between waves by more than the decode
difference (H200, B=64 x 16K: 580K tokens/s in one wave, 370K in the other: 6.5K "decode
tokens/s" against the log's 20.5K; B=128 x 16K: long wave faster than the short one), so the fit
prefers the log's decode waves, and otherwise drops rows with no positive difference, rows whose
``B x (L + long)`` exceeds the server's KV pool or running-request limit, and rows whose
difference is under 20% of the short wave (prefill-dominated); then, on either source,
non-monotone points (a larger batch or context measured > 20% faster) and outliers, and fits
``a + b B + c B ctx`` by non-negative least squares (``costs.fit_rollout_cost``).

``--refit FILE`` (no GPU): fit an existing JSON again (``--log`` its ``sglang_calibrate.log``,
default: the one next to it), print the fits and, with ``--refit-out``, write the JSON with the
log's waves and a ``"fit"`` section (an existing different measurement there is kept under
``"history"``)::

    python scripts/libra_calibrate_h200.py --refit out/libra_calibration.json \
        --refit-out docs/benchmarks/libra_calibration_h200.json

    PYTHONPATH=/tmp/harts_site:$PWD python3 scripts/libra_calibrate_h200.py --out out \
        --engine-env PYTHONPATH=/tmp/site --model small-moe --deadline-s 280
    bash scripts/gpu_run.sh libra-calibrate --engine-env PYTHONPATH=/tmp/site --deadline-s 280   # the same
    python scripts/bench_libra.py --calibration out/libra_calibration.json

``--url`` measures a server that is already running (nothing started or stopped);
``scripts/libra_colocated_h200.py --calibrate-batches ...`` calls :func:`calibrate` on its own
server after its rounds, which saves a second SGLang start (that server runs without CUDA graphs
and with ``--enable-memory-saver``; the JSON's ``server_info`` says so).
"""
from __future__ import annotations

import argparse
import glob
import json
import logging
import math
import os
import shlex
import signal
import sys
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

log = logging.getLogger("libra_calibrate")

# server_info keys kept in the JSON (they decide how to read the numbers); missing ones are skipped
SERVER_INFO_KEYS = ("version", "max_total_num_tokens", "max_running_requests", "context_length", "chunked_prefill_size",
                    "mem_fraction_static", "disable_cuda_graph", "cuda_graph_max_bs", "enable_memory_saver",
                    "attention_backend", "disable_overlap_schedule", "max_mamba_cache_size", "mamba_ssm_dtype")


class Deadline:
    """Seconds left of a self-imposed wall-time budget counted from construction (``seconds`` <= 0:
    no budget). ``phase(name)`` logs a timestamped phase marker with the elapsed seconds."""

    def __init__(self, seconds: float = 0.0, logger: logging.Logger | None = None):
        self.log = logger or log
        self.t0 = time.monotonic()
        self.end = self.t0 + seconds if seconds and seconds > 0 else math.inf

    def elapsed(self) -> float:
        return time.monotonic() - self.t0

    def left(self) -> float:
        return self.end - time.monotonic()

    def phase(self, name: str, **info) -> None:
        extra = " ".join(f"{k}={v}" for k, v in info.items())
        left = "" if self.end == math.inf else f", {self.left():.0f} s left"
        self.log.info("[phase +%.1f s%s] %s %s", self.elapsed(), left, name, extra)


def write_json(path: Path, obj: dict) -> None:
    """Atomic write (a kill mid-write never leaves a truncated file)."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(obj, indent=1, default=str))
    os.replace(tmp, path)


def sigterm_raises() -> None:
    """SIGTERM (``timeout``, the device's limit) -> SystemExit, so ``finally`` blocks run (server
    stopped, JSON written)."""
    def handler(signum, frame):
        signal.signal(signal.SIGTERM, signal.SIG_DFL)      # a second SIGTERM kills at once
        raise SystemExit(128 + signum)
    signal.signal(signal.SIGTERM, handler)


def _cudart_dir() -> str | None:
    """Directory of the CUDA runtime (``libcudart.so.<major>``) torch uses: from this process's
    maps after CUDA is initialised, else from the pip wheels (``nvidia/cu13/lib``,
    ``nvidia/cuda_runtime/lib``) on ``sys.path``."""
    try:
        with open("/proc/self/maps") as f:
            for line in f:
                p = line.split()[-1]
                if "/libcudart.so" in p and os.path.exists(p):
                    return os.path.dirname(os.path.realpath(p))
    except OSError:
        pass
    try:
        import torch
        major = (torch.version.cuda or "").split(".")[0]
    except Exception:       # noqa: BLE001
        major = ""
    for root in sys.path:
        for sub in ("nvidia/cu*/lib", "nvidia/cuda_runtime/lib"):
            hits = sorted(glob.glob(os.path.join(root, sub, f"libcudart.so.{major or '*'}")))
            if hits:
                return os.path.dirname(os.path.realpath(hits[-1]))
    return None


def engine_env(given: dict[str, str], *, memory_saver: bool) -> dict[str, str]:
    """The SGLang process's extra environment: ``given`` (``--engine-env``) wins; otherwise
    ``PYTHONPATH=/tmp/site`` when that exists (SGLang's packages, NOT the trainer's
    /tmp/harts_site with Triton 3.7.1), offline Hugging Face, and for ``--enable-memory-saver``:
    ``PYTORCH_CUDA_ALLOC_CONF`` without ``expandable_segments:True`` (torch_memory_saver raises
    on it; gpu_run.sh exports it for the trainer) and the CUDA runtime's directory on
    ``LD_LIBRARY_PATH`` (torch_memory_saver's LD_PRELOAD hook needs ``libcudart.so.13`` before
    torch loads; pip's CUDA 13 wheels keep it under ``site-packages/nvidia/cu13/lib``, so without
    this every scheduler process exits with code 127: sglang issue 36533)."""
    env = dict(given)
    if "PYTHONPATH" not in env:
        if os.path.isdir("/tmp/site"):
            env["PYTHONPATH"] = "/tmp/site"
            log.info("engine env: PYTHONPATH=/tmp/site (default; give --engine-env PYTHONPATH=... to change)")
        else:
            log.warning("engine env: no PYTHONPATH given and no /tmp/site: SGLang inherits %r",
                        os.environ.get("PYTHONPATH"))
    env.setdefault("HF_HUB_OFFLINE", "1")
    env.setdefault("TRANSFORMERS_OFFLINE", "1")
    if memory_saver:
        for var in ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF"):     # torch >= 2.9 reads both
            conf = env.get(var, os.environ.get(var, ""))
            if "expandable_segments:True" in conf:
                kept = [o for o in conf.split(",") if o.strip() and not o.strip().startswith("expandable_segments")]
                env[var] = ",".join(kept + ["expandable_segments:False"])
        if "LD_LIBRARY_PATH" not in given:
            d = _cudart_dir()
            if d:
                cur = os.environ.get("LD_LIBRARY_PATH", "")
                env["LD_LIBRARY_PATH"] = d + (os.pathsep + cur if cur else "")
            else:
                log.warning("engine env: libcudart not found; torch_memory_saver's preload may fail (exit 127)")
    return env


def server_info(url: str) -> dict:
    """Selected ``/server_info`` fields (``/get_server_info`` before 0.5.1x); {} on failure."""
    for path in ("/server_info", "/get_server_info"):
        try:
            with urllib.request.urlopen(url + path, timeout=10) as r:
                d = json.loads(r.read())
            out = {k: d[k] for k in SERVER_INFO_KEYS if k in d}
            st = (d.get("internal_states") or [{}])[0] or {}
            for k in ("memory_usage", "max_total_num_tokens", "max_running_requests"):
                if k in st:
                    out.setdefault(k, st[k])
            return out
        except Exception as e:      # noqa: BLE001 - best effort, only for the record
            err = e
    log.warning("server_info unavailable: %s", err)
    return {}


def _post(url: str, body: dict, timeout: float = 600.0) -> dict:
    req = urllib.request.Request(url + "/generate", data=json.dumps(body).encode(), method="POST",
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return json.loads(r.read())
    except urllib.error.HTTPError as e:
        raise RuntimeError(f"/generate: HTTP {e.code}: {e.read()[:300]!r}") from None


def _wave(url: str, prompts: list[list[int]], new_tokens: int, timeout: float = 600.0) -> float:
    """Seconds for all ``prompts`` generating ``new_tokens`` each, concurrently."""
    sp = {"max_new_tokens": new_tokens, "ignore_eos": True, "temperature": 1.0}
    t = time.perf_counter()
    with ThreadPoolExecutor(len(prompts)) as ex:
        outs = list(ex.map(lambda p: _post(url, {"input_ids": p, "sampling_params": sp}, timeout), prompts))
    dt = time.perf_counter() - t
    got = [len(o.get("output_ids") or []) for o in outs]
    if min(got) != new_tokens or max(got) != new_tokens:
        raise RuntimeError(f"expected {new_tokens} tokens per request, got {min(got)}..{max(got)}")
    return dt


def plan_points(batches: list[int], contexts: list[int]) -> list[tuple[int, int]]:
    """(B, L) in an order that makes a cut-short run still fittable (``a + b B + c B ctx`` needs
    batch and context both varying): the smallest context over all batches, then each larger
    context from the largest batch down."""
    bs, cs = sorted(set(batches)), sorted(set(contexts))
    pts = [(b, cs[0]) for b in bs]
    for c in cs[1:]:
        pts += [(b, c) for b in reversed(bs)]
    return pts


def calibrate(url: str, vocab: int, *, batches: list[int], contexts: list[int], short: int, long: int,
              out_path: Path, deadline: Deadline | None = None, meta: dict | None = None, seed: int = 0,
              reserve_s: float = 15.0) -> dict:
    """Run the measurement against the server at ``url``; rewrites ``out_path`` after each point and
    returns the result dict. Stops early (``"stopped": "deadline"``) when the next point's
    estimated seconds (the last point's, scaled by its work) exceed ``deadline.left() - reserve_s``.
    A failing point is recorded with its error and skipped."""
    import numpy as np

    deadline = deadline or Deadline()
    rng = np.random.default_rng(seed)
    rand = lambda n: [int(x) for x in rng.integers(10, vocab - 10, n)]
    res = {"simulated": False, **(meta or {}), "url": url, "short": short, "long": long, "points": [], "rows": [],
           "prefill_tok_s": None, "server_info": server_info(url), "complete": False, "stopped": None}
    write_json(out_path, res)
    timeout = lambda: max(30.0, min(600.0, deadline.left()))
    deadline.phase("calibrate: warm-up")
    _wave(url, [rand(256)], 8, timeout())
    L = max(contexts)
    deadline.phase("calibrate: prefill", prompt=L)
    _wave(url, [rand(L)], 1, timeout())                 # the same shapes once, untimed (compilation)
    t1 = _wave(url, [rand(L)], 1, timeout())
    res["prefill_tok_s"], res["prefill_s"] = L / t1, t1
    write_json(out_path, res)
    log.info("prefill: %d tokens in %.3f s = %.0f tokens/s (one request, includes its overhead)", L, t1, L / t1)
    last = None                       # (seconds, batch) of the last point
    warmed: set[int] = set()
    for B, L in plan_points(batches, contexts):
        # the next point's seconds: its two timed prefills at the one-request rate (conservative) plus
        # the last point's time scaled by the batch
        est = 2 * B * L / res["prefill_tok_s"] + (3.0 if last is None else last[0] * max(1.0, B / last[1]))
        if est > deadline.left() - reserve_s:
            res["stopped"] = "deadline"
            deadline.phase("calibrate: stop (deadline)", next_point=f"B={B} L={L}", est_s=f"{est:.0f}")
            break
        deadline.phase("calibrate: point", B=B, L=L)
        t0 = time.perf_counter()
        row = {"batch": B, "prompt": L}
        try:
            if B not in warmed:       # kernels for this batch size (and the thread pool) outside the timing
                _wave(url, [rand(256) for _ in range(B)], short, timeout())
                warmed.add(B)
            t_s = _wave(url, [rand(L) for _ in range(B)], short, timeout())
            t_l = _wave(url, [rand(L) for _ in range(B)], long, timeout())     # fresh prompts: no prefix-cache reuse
            tps = B * (long - short) / (t_l - t_s) if t_l > t_s else float("nan")
            row.update(t_short_s=t_s, t_long_s=t_l, decode_tok_s=tps, ctx=L + (short + long) / 2)
            if tps > 0:
                res["points"].append([B, row["ctx"], tps])
            log.info("B=%4d L=%6d: short %.3f s, long %.3f s -> %.0f decode tokens/s", B, L, t_s, t_l, tps)
        except Exception as e:      # noqa: BLE001 - record, go on with the next point
            row["error"] = f"{type(e).__name__}: {e}"[:500]
            log.warning("B=%d L=%d failed: %s", B, L, row["error"])
            try:
                urllib.request.urlopen(url + "/health", timeout=10).read()
            except Exception:       # noqa: BLE001
                res["rows"].append(row)
                res["stopped"] = "server down"
                break
        row["point_s"] = time.perf_counter() - t0
        last = (row["point_s"], B)
        res["rows"].append(row)
        write_json(out_path, res)
    else:
        res["complete"] = True
    write_json(out_path, res)
    deadline.phase("calibrate: done", points=len(res["points"]), complete=res["complete"])
    return res


def refit(res: dict, source: str = "calibration", log_path: str | Path | None = None) -> dict:
    """Fit ``res`` (a calibration result) again, offline: ``{"log": ..., "waves": ...}`` (the measured
    model's decode terms from the server log's decode waves / from the screened short-long
    differences, with the points kept and dropped) and ``"simulated_model"`` (what
    ``bench_libra.py --calibration`` uses). ``log_path``: parse this server log into
    ``res["log_waves"]`` / ``res["log_capacity"]`` first (``res`` is updated)."""
    from megatron_harts.rollout.libra import costs
    if log_path is not None:
        waves, cap = costs.decode_waves_from_log(Path(log_path).read_text(errors="replace"))
        res["log_waves"], res["log_capacity"] = waves, cap
    fits: dict = {}
    for src in ("log", "waves"):
        if src == "log" and len(res.get("log_waves") or []) < 3:
            continue
        try:
            cal = costs.load_calibration(res, decode_source=src)
            rc = costs.fit_rollout_cost(cal["points"], fit_context=True, prefill_tok_s=res.get("prefill_tok_s") or math.nan,
                                        dropped=cal["dropped"], source=source)
            fits[src] = {"decode_source": cal["decode_source"], "a_s": rc.a_s, "b_s": rc.b_s, "c_s": rc.c_s,
                         "kv_bytes_per_token": cal["kv_bytes_per_token"], **rc.fit}
        except ValueError as e:
            fits[src] = {"error": str(e)}
    try:
        rc = costs.rollout_cost_from_calibration(res)
        fits["simulated_model"] = {"a_s": rc.a_s, "b_s": rc.b_s, "c_s": rc.c_s, "prefill_tok_s": rc.prefill_tok_s,
                                   "decode_source": rc.fit["decode_source"], "c_from": rc.fit["c_from"],
                                   "c_scaled_s": rc.fit["c_scaled_s"], "c_hbm_floor_s": rc.fit["c_hbm_floor_s"],
                                   "kv_bytes_per_token": rc.fit["kv_bytes_per_token"]}
    except ValueError as e:
        fits["simulated_model"] = {"error": str(e)}
    return fits


def fit_and_print(res: dict, source: str, log_path: str | Path | None = None) -> dict:
    """:func:`refit` and print each fit (terms, points kept, why points were dropped)."""
    fits = refit(res, source, log_path)
    for src, f in fits.items():
        if "error" in f:
            print(f"{src}: no context fit from {len(res.get('points', []))} points: {f['error']}")
            continue
        if src == "simulated_model":
            print(f"simulated 1.48B model (bench_libra --calibration): a = {f['a_s'] * 1e3:.3f} ms, "
                  f"b = {f['b_s'] * 1e3:.4f} ms/request, c = {f['c_s'] * 1e9:.3f} ns/context token ({f['c_from']}), "
                  f"prefill {f['prefill_tok_s']:.0f} tokens/s")
            continue
        print(f"{src} ({f['decode_source']}, {len(f['points'])} points kept, {len(f['dropped'])} dropped): "
              f"a = {f['a_s'] * 1e3:.3f} ms, b = {f['b_s'] * 1e3:.4f} ms/request, c = {f['c_s'] * 1e9:.3f} ns/context "
              f"token{' (at its bound: ' + ', '.join(f['at_bound']) + ' = 0)' if f['at_bound'] else ''}, "
              f"largest residual {f['max_abs_rel_residual']:.0%}, prefill {res.get('prefill_tok_s') or float('nan'):.0f} tokens/s")
        for d in f["dropped"]:
            print(f"  dropped B={d.get('batch')} ctx={d.get('ctx')}: {d['reason']}")
    return fits


def write_refit(res: dict, fits: dict, dst: Path, meta: dict) -> None:
    """``res`` + ``"fit"`` to ``dst``; a different measurement already at ``dst`` (other ``rows``) is kept,
    newest first, under ``"history"``."""
    out = {**res, "fit": {**meta, **fits}}
    history = list(res.get("history") or [])
    if dst.exists():
        old = json.loads(dst.read_text())
        if old.get("rows") != res.get("rows") or old.get("points") != res.get("points"):
            old_hist = old.pop("history", [])
            history = [old] + old_hist
        elif not history:
            history = old.get("history", [])
    if history:
        out["history_note"] = "earlier calibrations this file replaced, newest first (their own points and fits)"
        out["history"] = history
    write_json(dst, out)


def parse_ints(s: str) -> list[int]:
    return [int(x) for x in s.split(",") if x.strip()]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="out")
    ap.add_argument("--model", default="small-moe", help="weight_sync preset (random weights) or a checkpoint dir")
    ap.add_argument("--batches", default="1,16,64,128")
    ap.add_argument("--contexts", default="1024,8192,16384")
    ap.add_argument("--short", type=int, default=16)
    ap.add_argument("--long", type=int, default=144)
    ap.add_argument("--mem-fraction-static", type=float, default=0.8)
    ap.add_argument("--engine-args", default="", help='e.g. "--disable-cuda-graph" (faster start, slower decode)')
    ap.add_argument("--engine-env", action="append", default=[], help="KEY=VALUE for the SGLang process")
    ap.add_argument("--url", default=None, help="measure this running server (nothing started or stopped)")
    ap.add_argument("--deadline-s", type=float, default=0.0,
                    help="wall-time budget of this process: no new point once it would not fit (0: none)")
    ap.add_argument("--startup-timeout", type=float, default=600.0)
    ap.add_argument("--refit", default=None, metavar="JSON",
                    help="no measurement: fit this libra_calibration.json again (offline, no GPU) and print the fits")
    ap.add_argument("--log", default=None, help="--refit: the server log of that run (default: sglang_calibrate.log "
                                                 "next to the JSON, if there)")
    ap.add_argument("--refit-out", default=None, help="--refit: write the JSON with the log's waves and the fits here")
    ap.add_argument("--note", default=None, help="--refit-out: a line on where the measurement ran (kept in fit.note)")
    args = ap.parse_args(argv)
    if args.refit:
        logging.basicConfig(level=logging.INFO, format="%(message)s")
        src = Path(args.refit)
        if not src.is_file():
            ap.error(f"--refit: no such file {src}")
        log_path = Path(args.log) if args.log else src.with_name("sglang_calibrate.log")
        if args.log and not log_path.is_file():
            ap.error(f"--log: no such file {log_path}")
        if not log_path.is_file():
            log_path = None
        try:
            res = json.loads(src.read_text())
        except json.JSONDecodeError as e:
            ap.error(f"--refit: {src}: not JSON (line {e.lineno}, column {e.colno}: {e.msg})")
        if not isinstance(res, dict) or not isinstance(res.get("rows", res.get("points")), list):
            ap.error(f"--refit: {src}: no 'rows' / 'points' list (not a libra_calibration.json)")
        fits = fit_and_print(res, str(src), log_path)
        if args.refit_out:
            from subprocess import run
            head = run(["git", "describe", "--always", "--dirty"], capture_output=True, text=True,
                       cwd=Path(__file__).resolve().parents[1]).stdout.strip()
            meta = {"refit": f"scripts/libra_calibrate_h200.py --refit {src.name}"
                             + (f" --log {log_path.name}" if log_path else ""), "refit_commit": head or None}
            if args.note:
                meta["note"] = args.note
            write_refit(res, fits, Path(args.refit_out), meta)
            print(f"wrote {args.refit_out}")
        return 0
    try:
        batches, contexts = parse_ints(args.batches), parse_ints(args.contexts)
    except ValueError:
        ap.error("--batches / --contexts: comma-separated integers")
    if not batches or not contexts or min(batches) < 1 or min(contexts) < 1 or not 0 < args.short < args.long:
        ap.error("--batches, --contexts >= 1 and 0 < --short < --long")
    given = {}
    for kv in args.engine_env:
        if "=" not in kv:
            ap.error(f"--engine-env: KEY=VALUE, got {kv!r}")
        k, v = kv.split("=", 1)
        given[k] = v
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s", datefmt="%H:%M:%S")
    deadline = Deadline(args.deadline_s)
    sigterm_raises()
    deadline.phase("start", argv=" ".join(sys.argv[1:] if argv is None else argv))

    from megatron_harts.rollout.engines import SGLangServer
    from megatron_harts.rollout.weight_sync import PRESETS, model_config, save_hf_checkpoint

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if args.model in PRESETS:
        hf = model_config(args.model)
        vocab, max_pos = int(hf["vocab_size"]), int(hf.get("max_position_embeddings") or 0)
        path = str(out / f"calib_{args.model}")
    else:
        path = args.model
        cfg = json.loads((Path(path) / "config.json").read_text())
        vocab, max_pos = int(cfg["vocab_size"]), int(cfg.get("max_position_embeddings") or 0)
    if max_pos:
        cap = max_pos - args.long - 8
        if max(contexts) > cap:
            log.warning("contexts above %d dropped/capped (max_position_embeddings %d - long %d)", cap, max_pos,
                        args.long)
            contexts = sorted({min(c, cap) for c in contexts})
    meta = {"model": args.model, "argv": sys.argv[1:] if argv is None else argv, "batches": batches,
            "contexts": contexts}
    json_path = out / "libra_calibration.json"
    server = None
    try:
        url = args.url
        if url is None:
            if args.model in PRESETS:
                deadline.phase("checkpoint (random weights)", path=path)
                sys.modules.setdefault("fla", None)      # transformers' torch path; fla is not needed here
                import torch
                from transformers import Qwen3NextConfig, Qwen3NextForCausalLM
                torch.manual_seed(0)
                model = Qwen3NextForCausalLM(Qwen3NextConfig(**hf))
                save_hf_checkpoint(path, model.state_dict(), hf, version="calib", overwrite=True, dtype="bfloat16")
                del model
            env = engine_env(given, memory_saver="--enable-memory-saver" in args.engine_args)
            deadline.phase("sglang start", engine_args=args.engine_args)
            server = SGLangServer(path, mem_fraction_static=args.mem_fraction_static,
                                  extra_args=shlex.split(args.engine_args), env=env,
                                  startup_timeout=max(60.0, min(args.startup_timeout, deadline.left() - 30)),
                                  log_path=str(out / "sglang_calibrate.log")).start()
            meta["engine_start_s"] = server.startup_s
            url = server.url
            deadline.phase("sglang up", startup_s=f"{server.startup_s:.1f}")
        res = calibrate(url, vocab, batches=batches, contexts=contexts, short=args.short, long=args.long,
                        out_path=json_path, deadline=deadline, meta=meta)
    finally:
        if server is not None:
            deadline.phase("sglang stop")
            server.stop()
    log_path = out / "sglang_calibrate.log" if server is not None else None
    if log_path is not None and not log_path.is_file():
        log_path = None
    fit_and_print(res, str(json_path), log_path)       # adds the log's decode waves to res
    write_json(json_path, res)
    deadline.phase("end")
    return 0


if __name__ == "__main__":
    sys.exit(main())
