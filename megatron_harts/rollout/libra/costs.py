"""Cost models fitted on the project's H200 measurements, and an online length estimator.

Every constant below comes from a file of the repository (or ``/work/shared/GPU.md``, quoted) or
is a named assumption with a parameter. Units: seconds, tokens, bytes, GPUs.

Measured (H200, see docs/libra.md "Calibration"):

* **Rollout decode** (SGLang 0.5.17): GPU.md, section "SGLang there", the Qwen3-Next-style hybrid
  (8 layers, 3 GDN : 1 attention, 16 experts top-2, hidden 1024): "321 tokens/s with 1 request,
  7,500 tokens/s with 64 concurrent (2,000-token prompts, 256 new tokens)". Fitted as a decode
  iteration time ``a + b * B`` (:data:`SGLANG_DECODE_POINTS`; the default of
  :func:`fit_rollout_cost`). The context dependence was not measured there, so the per
  context-token term ``c`` is an assumption: the KV bytes a decode iteration reads from the
  simulated model's attention layers at the measured HBM copy bandwidth (GPU.md "device copy
  about 4.3 TB/s").
  **Superseded for the simulation** by the H200 grid of ``scripts/libra_calibrate_h200.py``
  (2026-12-02, CUDA graphs, ``small-moe``: batch 1-128 x context 1K-16K,
  ``docs/benchmarks/libra_calibration_h200.json``), read by :func:`rollout_cost_from_calibration`:
  decode-only rates from the server log (:func:`decode_waves_from_log`), screened
  (:func:`screen_decode_points`) and fitted by non-negative least squares (:func:`nnls`); ``a``,
  ``b`` transferred, ``c`` at least the simulated model's KV-read floor.
* **Prefill**: not measured separately; assumed equal to the forward tokens/s of the same
  model's training forward (``docs/benchmarks/e2e_dense_sweep.json`` rows' ``baseline.compact_tokens
  / baseline.fwd_ms``). The H200 calibration's prefill (337.5K tokens/s, one 16K prompt) is the
  91.5M-parameter ``small-moe``'s, 16x fewer parameters than the simulated model: recorded, not used.
* **Training** (HARTS, 1.48B dense hybrid, recomputation, one H200): per-GPU compact-token rate
  vs mean trajectory length, fitted as ``1/rate = p + q * L`` on ``docs/benchmarks/e2e_dense_swe.json``,
  ``e2e_dense_tau.json`` and ``e2e_dense_sweep.json`` (fields ``harts.compact_tokens``,
  ``harts.grad_ms``, ``trajectory_tokens / trajectories``); the trajectory-wise baseline likewise from
  ``baseline.*``; optimizer step ``harts.opt_ms``. **Multi-GPU training scaling was never measured**:
  data parallelism is modelled as the per-GPU rate times GPUs divided by the HARTS planner's
  rank imbalance (``docs/benchmarks/planner.json`` rows' ``harts.imbalance``, CPU-planned) plus a
  ring all-reduce of the gradients at an assumed bus bandwidth (:attr:`TrainCost.allreduce_bytes_per_s`).
* **Weight sync**: ``docs/benchmarks/rollout.json`` ``runs.tree.rows[*].sync_export_s`` /
  ``sync_push_s`` / ``sync_bytes`` (91.5M-parameter ``small-moe``, disk path via /dev/shm).
* **Engine cold start**: ``rollout.json`` ``runs.tree.engine_start_s`` (173 s).
* **Role switch** (SGLang ``/release_memory_occupation`` + rejoin of training, or back): **not
  measured on the H200** (``scripts/libra_colocated_h200.py`` is written for it, not run); a
  parameter (``switch_s``) everywhere it is used.
"""
from __future__ import annotations

import itertools
import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable, Sequence

import numpy as np

REPO = Path(__file__).resolve().parents[3]
BENCH = REPO / "docs" / "benchmarks"

#: GPU.md "SGLang there": (concurrent requests, mean context tokens, decode tokens/s) of the
#: Qwen3-Next-style hybrid on SGLang 0.5.17, H200; context = 2,000 prompt + 128 (half of 256 new).
SGLANG_DECODE_POINTS: tuple[tuple[int, float, float], ...] = ((1, 2128.0, 321.0), (64, 2128.0, 7500.0))
#: GPU.md "Seen on that machine": device copy about 4.3 TB/s (the HBM read rate the context term uses).
HBM_BYTES_PER_S = 4.3e12
#: Simulated model: the 1.48B dense hybrid of the e2e benchmark (README "End to end": 6 GQA attention
#: layers with 4 KV heads of 128, bf16): K and V bytes per context token.
KV_BYTES_PER_TOKEN_1P5B = 6 * 2 * 4 * 128 * 2
PARAMS_1P5B = 1_482_314_560          # e2e_dense_*.json meta.params.dense


def _load(name: str) -> dict:
    path = BENCH / name
    with open(path) as f:
        return json.load(f)


@dataclass
class RolloutCost:
    """One rollout engine (one GPU). A decode iteration over ``B`` running requests whose contexts
    sum to ``C`` tokens takes ``a_s + b_s * B + c_s * C`` seconds and emits ``B`` tokens; prefilling
    ``n`` new tokens takes ``n / prefill_tok_s``."""

    a_s: float
    b_s: float
    c_s: float
    prefill_tok_s: float
    max_batch: int = 256                  # SGLang --max-running-requests (assumption: a common setting)
    kv_tokens: int = 8_000_000            # KV pool per engine in tokens (see :func:`kv_capacity`)
    source: str = ""
    fit: dict = field(default_factory=dict, repr=False)   # how the terms were fitted (points kept / dropped)

    def step_s(self, batch: int | np.ndarray, ctx_total: float | np.ndarray) -> float | np.ndarray:
        """Decode-iteration seconds for ``batch`` requests holding ``ctx_total`` context tokens."""
        return self.a_s + self.b_s * batch + self.c_s * ctx_total

    def tokens_per_s(self, batch: int, ctx_mean: float) -> float:
        """Decode tokens/s of the engine at ``batch`` concurrent requests of mean context ``ctx_mean``."""
        return batch / self.step_s(batch, batch * ctx_mean)

    def steps_time(self, n: int | np.ndarray, batch: int, ctx_total: float) -> float | np.ndarray:
        """Seconds of ``n`` consecutive decode iterations at a fixed ``batch`` (contexts grow by one
        token per request per iteration, so ``C`` grows by ``batch`` each iteration): exact for the
        linear model."""
        n = np.asarray(n, dtype=np.float64)
        return n * (self.a_s + self.b_s * batch + self.c_s * ctx_total) + self.c_s * batch * n * (n - 1) / 2

    def steps_within(self, dt: float, batch: int, ctx_total: float) -> int:
        """Largest number of decode iterations that fit in ``dt`` seconds (inverse of :meth:`steps_time`)."""
        if dt <= 0:
            return 0
        base = self.a_s + self.b_s * batch + self.c_s * ctx_total
        q = self.c_s * batch / 2
        if q <= 0:
            n = dt / base
        else:                              # q n^2 + (base - q) n - dt = 0
            bb = base - q
            n = (-bb + math.sqrt(bb * bb + 4 * q * dt)) / (2 * q)
        n = int(math.floor(n + 1e-9))
        while n > 0 and self.steps_time(n, batch, ctx_total) > dt + 1e-12:
            n -= 1
        return n


def kv_capacity(gpu_bytes: float = 139 * 2 ** 30, mem_fraction: float = 0.85, params: int = PARAMS_1P5B,
                kv_bytes_per_token: int = KV_BYTES_PER_TOKEN_1P5B) -> int:
    """KV tokens an engine holds: ``mem_fraction`` of the GPU minus bf16 weights over the bytes per
    context token (GDN states are per request and small; ignored)."""
    return int(max(0.0, gpu_bytes * mem_fraction - 2 * params) // kv_bytes_per_token)


def nnls(A, y) -> np.ndarray:
    """Non-negative least squares ``argmin |A x - y|, x >= 0``, exact: the unconstrained fit on every
    subset of columns, the best one whose coefficients are all >= 0 (the optimum is one of them; fine
    for the few columns of a cost model)."""
    A = np.asarray(A, dtype=np.float64)
    y = np.asarray(y, dtype=np.float64)
    n = A.shape[1]
    best, best_x = math.inf, np.zeros(n)
    for k in range(1, n + 1):
        for cols in itertools.combinations(range(n), k):
            x, *_ = np.linalg.lstsq(A[:, cols], y, rcond=None)
            if np.any(x < 0):
                continue
            r = float(np.sum((A[:, cols] @ x - y) ** 2))
            if r < best:
                best, best_x = r, np.zeros(n)
                best_x[list(cols)] = x
    return best_x


def _decode_fit(points, fit_context: bool) -> tuple[np.ndarray, np.ndarray]:
    """NNLS of the decode iteration ``B / tokens_per_s = a + b B (+ c B ctx)``, each point weighted by
    1 / its step (relative errors: a batch-1 point counts as much as a batch-128 one). Returns the
    coefficients and the relative residuals ``measured / fitted - 1`` of the step."""
    B = np.array([p[0] for p in points], dtype=np.float64)
    ctx = np.array([p[1] for p in points], dtype=np.float64)
    step = B / np.array([p[2] for p in points], dtype=np.float64)
    A = np.stack([np.ones_like(B), B] + ([B * ctx] if fit_context else []), axis=1)
    w = 1.0 / step
    coef = nnls(A * w[:, None], step * w)
    fitted = A @ coef
    with np.errstate(divide="ignore", invalid="ignore"):
        rel = np.where(fitted > 0, step / fitted - 1.0, np.inf)
    return coef, rel


def _step_rel(p, coef) -> float:
    """Relative deviation of point ``p``'s measured decode step from the fitted terms ``coef``."""
    fitted = coef[0] + coef[1] * p[0] + (coef[2] * p[0] * p[1] if len(coef) > 2 else 0.0)
    return p[0] / p[2] / fitted - 1.0 if fitted > 0 else math.inf


def _pt(p) -> dict:
    return {"batch": int(p[0]), "ctx": round(float(p[1]), 1), "tok_s": round(float(p[2]), 1),
            "step_ms": round(1e3 * p[0] / p[2], 4)}


def monotone_violations(points, tol: float = 0.2, same_ctx: float = 0.25) -> list[tuple[int, int]]:
    """Pairs ``(i, j)`` where point ``j`` has at least the batch and the context of point ``i`` (contexts
    within ``same_ctx`` relative count as equal), more of one of them, yet a decode iteration more than
    ``tol`` shorter: impossible for a decode (more requests or longer contexts never make an iteration
    faster), so one of the two measurements is wrong."""
    out = []
    for i, (bi, ci, ti) in enumerate(points):
        for j, (bj, cj, tj) in enumerate(points):
            if i == j or bj < bi or cj < ci * (1 - same_ctx):
                continue
            if bj == bi and cj <= ci * (1 + same_ctx):
                continue                                       # the same grid point (e.g. repeated waves)
            if bj / tj < (bi / ti) * (1 - tol):
                out.append((i, j))
    return out


def screen_decode_points(points, *, fit_context: bool = True, mono_tol: float = 0.2, outlier_rel: float = 0.5,
                         ) -> tuple[list[tuple[int, float, float]], list[dict]]:
    """Drop decode points a physical fit cannot use, in this order: non-finite or non-positive rates;
    **non-monotone** points (:func:`monotone_violations`; the point in most violating pairs goes first,
    ties: the one the fit of the other points predicts worst); then **outliers**: while the
    largest relative residual of the NNLS fit exceeds ``outlier_rel``, that point. Never below the
    3 (2 without ``fit_context``) points a fit needs. Returns ``(kept, dropped)``, each dropped point
    with its ``reason``."""
    need = 3 if fit_context else 2
    kept, dropped = [], []
    for p in points:
        p = (int(p[0]), float(p[1]), float(p[2]))
        if not (p[0] >= 1 and math.isfinite(p[2]) and p[2] > 0 and math.isfinite(p[1]) and p[1] >= 0):
            dropped.append({**_pt(p), "reason": "no decode rate (nan, zero or negative)"})
        else:
            kept.append(p)
    while len(kept) > need:
        viol = monotone_violations(kept, mono_tol)
        if not viol:
            break
        count = np.zeros(len(kept), dtype=int)
        for i, j in viol:
            count[i] += 1
            count[j] += 1
        cand = np.flatnonzero(count == count.max())
        if len(cand) > 1:                 # the candidate the other points predict worst
            rest = [p for i, p in enumerate(kept) if i not in set(cand.tolist())]
            coef, _ = _decode_fit(rest if len(rest) >= need else kept, fit_context)
            rel = [abs(_step_rel(kept[i], coef)) for i in cand]
            cand = [cand[int(np.argmax(rel))]]
        k = int(cand[0])
        others = [kept[j if i == k else i] for i, j in viol if k in (i, j)]
        dropped.append({**_pt(kept[k]), "reason": f"non-monotone: decode iteration {1e3 * kept[k][0] / kept[k][2]:.3f} ms "
                        f"against {', '.join(f'{1e3 * o[0] / o[2]:.3f} ms at B={o[0]} ctx={o[1]:.0f}' for o in others[:4])} "
                        f"(more requests or context never make an iteration > {mono_tol:.0%} faster)"})
        del kept[k]
    while len(kept) > need:
        _, rel = _decode_fit(kept, fit_context)
        k = int(np.argmax(np.abs(rel)))
        if not abs(rel[k]) > outlier_rel:
            break
        dropped.append({**_pt(kept[k]), "reason": f"outlier: measured step {rel[k]:+.0%} off the fit "
                        f"(> {outlier_rel:.0%})"})
        del kept[k]
    return kept, dropped


def fit_rollout_cost(points: Sequence[tuple[int, float, float]] = SGLANG_DECODE_POINTS, *,
                     kv_bytes_per_token: int = KV_BYTES_PER_TOKEN_1P5B, hbm_bytes_per_s: float = HBM_BYTES_PER_S,
                     prefill_tok_s: float | None = None, fit_context: bool = False, source: str | None = None,
                     robust: bool = True, mono_tol: float = 0.2, outlier_rel: float = 0.5,
                     dropped: Sequence[dict] = (), **kw) -> RolloutCost:
    """Non-negative least-squares fit (:func:`nnls`, relative errors) of the decode iteration
    ``step = B / tokens_per_s`` on ``points`` (``(B, mean context, tokens/s)``). Default: ``a + b B``
    on the points, and ``c = kv_bytes_per_token / hbm_bytes_per_s`` (assumption, see module doc) for
    the simulated model only (the measured points' own attention term is not subtracted: by the same
    estimate it is < 2% of the measured step). ``fit_context``: fit ``a + b B + c B ctx`` on points
    that vary the context (e.g. from ``scripts/libra_calibrate_h200.py``; needs >= 3 points).
    ``robust`` (default): first :func:`screen_decode_points` (nan, non-monotone, outliers); the
    points kept and dropped (plus ``dropped``, e.g. from :func:`screen_calibration_rows`) are in the
    result's ``fit``. Non-negative terms are guaranteed; a term at 0 means the points do not resolve
    it (``fit["at_bound"]``); ``a <= 0`` raises (a decode iteration has a fixed cost).
    ``prefill_tok_s`` defaults to :func:`measured_prefill_tok_s`."""
    need = 3 if fit_context else 2
    if len(points) < need:
        raise ValueError(f"fit_rollout_cost needs at least {need} (batch, ctx, tokens/s) points, got {len(points)}")
    dropped = list(dropped)
    if robust:
        points, more = screen_decode_points(points, fit_context=fit_context, mono_tol=mono_tol, outlier_rel=outlier_rel)
        dropped += more
        if len(points) < need:
            raise ValueError(f"fit_rollout_cost: {len(points)} usable points after screening (need {need}); dropped: "
                             + "; ".join(f"B={d.get('batch')} ctx={d.get('ctx')}: {d['reason']}" for d in dropped))
    coef, rel = _decode_fit(points, fit_context)
    a, b = coef[0], coef[1]
    c = coef[2] if fit_context else kv_bytes_per_token / hbm_bytes_per_s
    if not a > 0:
        raise ValueError(f"rollout fit gave non-physical terms a={a}, b={b}, c={c}: check the points")
    names = ["a", "b"] + (["c"] if fit_context else [])
    fit = {"method": "nnls, relative errors" + (", screened" if robust else ""), "fit_context": fit_context,
           "points": [{**_pt(p), "rel_residual": round(float(r), 4)} for p, r in zip(points, rel)],
           "dropped": dropped, "at_bound": [n for n, v in zip(names, coef) if v == 0.0],
           "max_abs_rel_residual": round(float(np.max(np.abs(rel))), 4) if len(rel) else None}
    return RolloutCost(a_s=float(a), b_s=float(b), c_s=float(c),
                       prefill_tok_s=prefill_tok_s if prefill_tok_s is not None else measured_prefill_tok_s(),
                       source=source or "GPU.md SGLang 0.5.17 Qwen3-Next hybrid: 321 tok/s @1, 7500 tok/s @64",
                       fit=fit, **kw)


def load_rollout_points(path) -> tuple[list[tuple[int, float, float]], float | None]:
    """``(points, prefill tokens/s)`` from a ``scripts/libra_calibrate_h200.py`` JSON
    (``{"points": [[batch, ctx, tokens/s], ...], "prefill_tok_s": ...}``), unscreened."""
    with open(path) as f:
        d = json.load(f)
    pts = [(int(p[0]), float(p[1]), float(p[2])) for p in d["points"]]
    return pts, d.get("prefill_tok_s")


# -- calibration files of scripts/libra_calibrate_h200.py ------------------------------------------

#: SGLang (0.5.x) scheduler log line of a decode batch: running requests, context tokens held
#: (``#full token`` for hybrid models, ``#token`` otherwise), the generation rate since the previous
#: decode log line (every ``--decode-log-interval`` iterations, default 40), queued requests.
_DECODE_LOG = re.compile(r"Decode batch, #running-req: (\d+), #(?:full )?token: (\d+).*?"
                         r"gen throughput \(token/s\): ([0-9.]+)(?:.*?#queue-req: (\d+))?")
_CAPACITY_LOG = re.compile(r"max_total_num_tokens=(\d+)(?:.*?max_running_requests=(\d+))?")


def decode_waves_from_log(text: str) -> tuple[list[dict], dict]:
    """Decode-only rates from an SGLang server log. A decode log line's rate covers the iterations
    since the previous decode line; it is kept when that previous line had the same running batch,
    nothing was prefilled in between (no ``Prefill batch`` line), nothing was queued, and the
    context grew by a multiple of the batch (one token per request per iteration). Consecutive kept
    intervals form a **wave** ``{"batch", "ctx" (token-weighted mean context per request), "tok_s"
    (tokens / seconds), "intervals", "tokens", "seconds", "line"}``: the same quantity as the
    short/long difference of ``libra_calibrate_h200.py`` without its prefill. Also returns the
    capacity the server logged (``{"max_total_num_tokens", "max_running_requests"}``, when found)."""
    waves: list[dict] = []
    cap: dict = {}
    cur = None
    prev = None                          # (batch, context tokens) of the last decode line, no prefill since
    for n, line in enumerate(text.split("\n"), 1):
        m = _DECODE_LOG.search(line)
        if m:
            B, full, rate = int(m[1]), int(m[2]), float(m[3])
            queued = int(m[4]) if m[4] is not None else 0
            grown = full - prev[1] if prev else 0
            if prev and prev[0] == B and B > 0 and queued == 0 and rate > 0 and grown > 0 and grown % B == 0:
                if cur is None or cur["batch"] != B:
                    cur = {"batch": B, "tokens": 0, "seconds": 0.0, "ctx_tok": 0.0, "intervals": 0, "line": n}
                    waves.append(cur)
                cur["tokens"] += grown
                cur["seconds"] += grown / rate
                cur["ctx_tok"] += grown * (full + prev[1]) / 2 / B
                cur["intervals"] += 1
            else:
                cur = None
            prev = (B, full)
            continue
        if "Prefill batch" in line:
            prev, cur = None, None
            continue
        c = _CAPACITY_LOG.search(line)
        if c:
            cap["max_total_num_tokens"] = int(c[1])
            if c[2] is not None:
                cap["max_running_requests"] = int(c[2])
    out = [{"batch": w["batch"], "ctx": round(w["ctx_tok"] / w["tokens"], 1), "tok_s": round(w["tokens"] / w["seconds"], 2),
            "intervals": w["intervals"], "tokens": w["tokens"], "seconds": round(w["seconds"], 5), "line": w["line"]}
           for w in waves]
    return out, cap


def calibration_capacity(res: dict) -> dict:
    """``max_total_num_tokens`` / ``max_running_requests`` of the measured server: ``server_info``,
    completed by what its log said (``res["log_capacity"]``)."""
    si = res.get("server_info") or {}
    cap = {k: si.get(k) for k in ("max_total_num_tokens", "max_running_requests") if si.get(k)}
    for k, v in (res.get("log_capacity") or {}).items():
        cap.setdefault(k, v)
    return cap


def measured_kv_bytes_per_token(res: dict) -> float | None:
    """KV bytes per context token of the measured model: SGLang's KV pool (``memory_usage.kvcache``,
    GiB) over its token capacity; None when the server did not say."""
    mu = (res.get("server_info") or {}).get("memory_usage") or {}
    gib, cap = mu.get("kvcache"), mu.get("token_capacity")
    if not gib or not cap:
        return None
    return float(round(gib * 2 ** 30 / cap))


def screen_calibration_rows(res: dict, *, min_decode_share: float = 0.2) -> tuple[list[tuple[int, float, float]], list[dict]]:
    """The short/long-difference points of a calibration JSON that can be decode rates at all:
    a row is dropped when it failed, when ``t_long <= t_short`` (nan / negative difference), when
    ``B x (prompt + long)`` tokens exceed the server's KV pool or ``B`` its running requests (the
    wave would queue), or when the decode difference ``t_long - t_short`` is under
    ``min_decode_share`` of the short wave: the short wave is then nearly all prefill of ``B x prompt``
    tokens, whose time varies between the two waves by more than the difference (the H200 run of
    2026-12-02 prefilled B=64 x 16K at 580K tokens/s in one wave and 370K in the other). Files
    without ``rows`` return their ``points`` as they are. Returns ``(points, dropped)``."""
    rows = res.get("rows") or []
    if not rows:
        return [(int(p[0]), float(p[1]), float(p[2])) for p in res.get("points", [])], []
    cap = calibration_capacity(res)
    long = res.get("long") or 0
    pts, dropped = [], []
    for r in rows:
        B, L = int(r["batch"]), int(r["prompt"])
        t_s, t_l, tps = r.get("t_short_s"), r.get("t_long_s"), r.get("decode_tok_s")
        info = {"batch": B, "prompt": L, "ctx": r.get("ctx"), "tok_s": tps, "t_short_s": t_s, "t_long_s": t_l}
        if "error" in r or t_s is None or t_l is None:
            reason = f"failed: {r.get('error', 'no timings')}"
        elif not (t_l > t_s) or tps is None or not math.isfinite(tps) or tps <= 0:
            reason = f"no decode rate: t_long - t_short = {t_l - t_s:+.3f} s"
        elif cap.get("max_total_num_tokens") and B * (L + long) > cap["max_total_num_tokens"]:
            reason = (f"KV pool: B x (prompt + long) = {B * (L + long):,} tokens > max_total_num_tokens "
                      f"{cap['max_total_num_tokens']:,} (requests queue)")
        elif cap.get("max_running_requests") and B > cap["max_running_requests"]:
            reason = f"B > max_running_requests {cap['max_running_requests']} (requests queue)"
        elif t_l - t_s < min_decode_share * t_s:
            reason = (f"prefill-dominated: decode difference {t_l - t_s:.3f} s < {min_decode_share:g} x short wave "
                      f"{t_s:.3f} s")
        else:
            pts.append((B, float(r["ctx"]), float(tps)))
            continue
        dropped.append({**info, "reason": reason})
    return pts, dropped


def load_calibration(path, log_path=None, *, decode_source: str = "auto", min_decode_share: float = 0.2) -> dict:
    """A ``scripts/libra_calibrate_h200.py`` JSON (a path, or the loaded dict) made ready to fit: ``{"points", "dropped",
    "decode_source", "prefill_tok_s", "kv_bytes_per_token", "capacity", "res"}``.

    ``decode_source``: ``"log"`` (the server log's decode-only waves, :func:`decode_waves_from_log`:
    the JSON's ``log_waves``, or parsed from ``log_path``), ``"waves"`` (the short/long differences,
    screened by :func:`screen_calibration_rows`), ``"auto"`` (the log when it has >= 3 waves)."""
    if isinstance(path, dict):
        res = path
    else:
        with open(path) as f:
            res = json.load(f)
    if log_path is not None:
        waves, cap = decode_waves_from_log(Path(log_path).read_text(errors="replace"))
        res = {**res, "log_waves": waves, "log_capacity": {**(res.get("log_capacity") or {}), **cap}}
    waves = res.get("log_waves") or []
    use_log = decode_source == "log" or (decode_source == "auto" and len(waves) >= 3)
    if decode_source not in ("auto", "log", "waves"):
        raise ValueError(f"decode_source: auto, log or waves, got {decode_source!r}")
    if use_log:
        if not waves:
            raise ValueError(f"{path}: no decode waves from a server log (give log_path)")
        pts, dropped, src = [(w["batch"], w["ctx"], w["tok_s"]) for w in waves], [], "server log decode intervals"
    else:
        pts, dropped = screen_calibration_rows(res, min_decode_share=min_decode_share)
        src = "short/long wave differences"
    return {"points": pts, "dropped": dropped, "decode_source": src, "prefill_tok_s": res.get("prefill_tok_s"),
            "kv_bytes_per_token": measured_kv_bytes_per_token(res), "capacity": calibration_capacity(res), "res": res}


def rollout_cost_from_calibration(path, log_path=None, *, decode_source: str = "auto",
                                  kv_bytes_per_token: int = KV_BYTES_PER_TOKEN_1P5B,
                                  hbm_bytes_per_s: float = HBM_BYTES_PER_S, prefill_tok_s: float | None = None,
                                  **kw) -> RolloutCost:
    """The simulated model's rollout cost from an H200 calibration of a (smaller) measured model:
    ``a`` and ``b`` as fitted (per-iteration and per-request overheads: transferred as they are, like
    GPU.md's points); ``c`` = the larger of the fitted ``c`` scaled by the KV bytes per token
    (simulated / measured model) and the simulated model's HBM read floor ``kv_bytes_per_token /
    hbm_bytes_per_s``; prefill: ``prefill_tok_s``, else :func:`measured_prefill_tok_s` (the calibration
    measured the small model's prefill, kept in ``fit["measured"]``). The measured model's own fit
    is in ``fit["measured"]``. ``decode_source="auto"`` falls back to the short/long differences when
    the log's waves do not give a fit."""
    cal = load_calibration(path, log_path, decode_source=decode_source)
    name = "calibration" if isinstance(path, dict) else str(path)

    def fit_measured(c):
        return fit_rollout_cost(c["points"], fit_context=True, prefill_tok_s=c["prefill_tok_s"] or math.nan,
                                dropped=c["dropped"], source=name, **kw)
    try:
        m = fit_measured(cal)
    except ValueError:
        if decode_source != "auto" or cal["decode_source"] != "server log decode intervals":
            raise
        cal = load_calibration(cal["res"], decode_source="waves")      # too few usable log waves
        m = fit_measured(cal)
    kvm = cal["kv_bytes_per_token"]
    scaled = m.c_s * kv_bytes_per_token / kvm if kvm else m.c_s
    floor = kv_bytes_per_token / hbm_bytes_per_s
    fit = {**m.fit, "decode_source": cal["decode_source"],
           "measured": {"a_s": m.a_s, "b_s": m.b_s, "c_s": m.c_s, "prefill_tok_s": cal["prefill_tok_s"],
                        "kv_bytes_per_token": kvm,
                        "c_hbm_floor_s": kvm / hbm_bytes_per_s if kvm else None},
           "c_scaled_s": scaled, "c_hbm_floor_s": floor, "c_from": "scaled fit" if scaled > floor else "HBM floor",
           "kv_bytes_per_token": kv_bytes_per_token}
    return RolloutCost(a_s=m.a_s, b_s=m.b_s, c_s=max(scaled, floor),
                       prefill_tok_s=prefill_tok_s if prefill_tok_s is not None else measured_prefill_tok_s(),
                       source=f"{name} ({cal['decode_source']})", fit=fit)


def measured_prefill_tok_s(files: Iterable[str] = ("e2e_dense_sweep.json",)) -> float:
    """Median forward tokens/s of the 1.48B model's trajectory-wise training forward
    (``baseline.compact_tokens / baseline.fwd_ms``): the prefill-rate assumption."""
    rates = [r["baseline"]["compact_tokens"] / (r["baseline"]["fwd_ms"] / 1e3)
             for name in files for r in _load(name)["rows"]]
    return float(np.median(rates))


@dataclass
class TrainCost:
    """Data-parallel training of one global batch. Per GPU, compact tokens are processed at
    ``1 / (p_s + q_s * L)`` tokens/s (``L`` = mean trajectory length in tokens); ``G`` GPUs split the
    compact tokens with ``imbalance`` (max rank / mean rank), then a ring all-reduce of
    ``grad_bytes`` at ``allreduce_bytes_per_s`` and the optimizer step ``opt_s``."""

    p_s: float
    q_s: float
    opt_s: float
    grad_bytes: float = 4.0 * PARAMS_1P5B            # fp32 gradients (Megatron's main grads)
    allreduce_bytes_per_s: float = 200e9             # ASSUMPTION: NCCL bus bandwidth (never measured here)
    imbalance: float = 1.0
    source: str = ""

    def rate(self, mean_len: float) -> float:
        """Compact tokens/s of one GPU at mean trajectory length ``mean_len``."""
        return 1.0 / (self.p_s + self.q_s * mean_len)

    def step_s(self, compact_tokens: float, mean_len: float, gpus: int) -> float:
        """Seconds of a training step of ``compact_tokens`` on ``gpus`` data-parallel GPUs."""
        if gpus < 1:
            return math.inf
        compute = compact_tokens / (self.rate(mean_len) * gpus) * (self.imbalance if gpus > 1 else 1.0)
        comm = 0.0 if gpus == 1 else 2 * (gpus - 1) / gpus * self.grad_bytes / self.allreduce_bytes_per_s
        return compute + comm + self.opt_s

    def gpu_seconds(self, compact_tokens: float, mean_len: float) -> float:
        """GPU-seconds of compute for ``compact_tokens`` (the part that divides among GPUs)."""
        return compact_tokens / self.rate(mean_len)


E2E_TRAIN_FILES = ("e2e_dense_swe.json", "e2e_dense_tau.json", "e2e_dense_sweep.json")


def train_points(side: str = "harts", files: Sequence[str] = E2E_TRAIN_FILES) -> list[tuple[float, float, float]]:
    """``(mean trajectory length, compact tokens/s, opt_s)`` of each e2e row (one H200)."""
    out = []
    for name in files:
        for r in _load(name)["rows"]:
            s = r[side]
            out.append((r["trajectory_tokens"] / r["trajectories"], s["compact_tokens"] / (s["grad_ms"] / 1e3),
                        s["opt_ms"] / 1e3))
    return out


def planner_imbalance(name: str = "planner.json") -> float:
    """Median rank imbalance of the HARTS planner's plans (``rows[*].harts.imbalance``)."""
    return float(np.median([r["harts"]["imbalance"] for r in _load(name)["rows"] if "harts" in r]))


def fit_train_cost(side: str = "harts", files: Sequence[str] = E2E_TRAIN_FILES, **kw) -> TrainCost:
    """Least squares of ``1/rate = p + q L`` on :func:`train_points`; ``opt_s`` their median."""
    pts = train_points(side, files)
    if len(pts) < 2:
        raise ValueError(f"fit_train_cost needs >= 2 rows in {files}")
    L = np.array([p[0] for p in pts])
    inv = 1.0 / np.array([p[1] for p in pts])
    (p, q), *_ = np.linalg.lstsq(np.stack([np.ones_like(L), L], 1), inv, rcond=None)
    kw.setdefault("imbalance", planner_imbalance())
    return TrainCost(p_s=float(p), q_s=float(max(q, 0.0)), opt_s=float(np.median([x[2] for x in pts])),
                     source=f"{side} rows of {', '.join(files)}", **kw)


@dataclass
class SyncCost:
    """Weight sync trainer -> engines: ``export_s_per_byte * bytes + push_s`` (disk path)."""

    export_s_per_byte: float
    push_s: float
    measured_bytes: float
    source: str = ""

    def seconds(self, nbytes: float | None = None) -> float:
        nbytes = self.measured_bytes if nbytes is None else nbytes
        return self.export_s_per_byte * nbytes + self.push_s


def fit_sync_cost(name: str = "rollout.json", run: str = "tree") -> SyncCost:
    """Medians of ``runs[run].rows[*].sync_export_s`` / ``sync_push_s`` / ``sync_bytes``."""
    rows = _load(name)["runs"][run]["rows"]
    exp = float(np.median([r["sync_export_s"] for r in rows]))
    push = float(np.median([r["sync_push_s"] for r in rows]))
    nbytes = float(np.median([r["sync_bytes"] for r in rows]))
    return SyncCost(export_s_per_byte=exp / nbytes, push_s=push, measured_bytes=nbytes,
                    source=f"{name} runs.{run}.rows: median export {exp:.2f} s + push {push:.3f} s, {nbytes / 1e6:.0f} MB")


def measured_engine_start_s(name: str = "rollout.json") -> float:
    """SGLang cold start on the H200 (``runs.tree.engine_start_s``)."""
    return float(np.median(_load(name)["runs"]["tree"]["engine_start_s"]))


# -- online, drift-aware length distribution --------------------------------------------------

@dataclass
class LengthEstimator:
    """Exponentially weighted distribution of per-trajectory quantities (e.g. generated tokens,
    turns) over recent RL steps: the samples of the step ``age`` steps ago weigh ``decay ** age``;
    steps older than ``window`` are dropped. ``quantile`` is the weighted empirical quantile
    (inverse of the weighted CDF, no interpolation), so a drift moves it within ~1/(1-decay) steps.

    ``drift(new)``: the relative change of the new step's median against the estimate before it
    exceeds ``drift_tol``.
    """

    decay: float = 0.7
    window: int = 8
    drift_tol: float = 0.15
    _steps: list[np.ndarray] = field(default_factory=list)

    def __post_init__(self):
        if not 0 < self.decay <= 1:
            raise ValueError(f"decay must be in (0, 1], got {self.decay}")
        if self.window < 1:
            raise ValueError(f"window must be >= 1, got {self.window}")

    @property
    def empty(self) -> bool:
        return not self._steps

    def update(self, samples: Sequence[float] | np.ndarray) -> bool:
        """Add one step's samples; returns whether they indicate drift (False on the first step)."""
        x = np.asarray(samples, dtype=np.float64).ravel()
        if x.size == 0:
            raise ValueError("LengthEstimator.update: empty step")
        drifted = (not self.empty) and self.drift(x)
        self._steps.append(x)
        del self._steps[:-self.window]
        return drifted

    def _weighted(self) -> tuple[np.ndarray, np.ndarray]:
        if self.empty:
            raise ValueError("LengthEstimator has no samples yet")
        n = len(self._steps)
        xs = np.concatenate(self._steps)
        ws = np.concatenate([np.full(s.size, self.decay ** (n - 1 - i) / s.size) for i, s in enumerate(self._steps)])
        return xs, ws

    def quantile(self, q: float | Sequence[float]) -> np.ndarray | float:
        xs, ws = self._weighted()
        order = np.argsort(xs, kind="stable")
        xs, cw = xs[order], np.cumsum(ws[order])
        cw /= cw[-1]
        qs = np.atleast_1d(np.asarray(q, dtype=np.float64))
        idx = np.minimum(np.searchsorted(cw, qs - 1e-12, side="left"), xs.size - 1)
        out = xs[idx]
        return float(out[0]) if np.ndim(q) == 0 else out

    def mean(self) -> float:
        xs, ws = self._weighted()
        return float(np.sum(xs * ws) / np.sum(ws))

    def sample(self, n: int, rng: np.random.Generator) -> np.ndarray:
        """``n`` draws from the weighted empirical distribution (for the planner's predictions)."""
        xs, ws = self._weighted()
        return rng.choice(xs, size=n, p=ws / ws.sum())

    def drift(self, new: np.ndarray) -> bool:
        med = self.quantile(0.5)
        return bool(abs(float(np.median(new)) / max(med, 1e-9) - 1.0) > self.drift_tol)
