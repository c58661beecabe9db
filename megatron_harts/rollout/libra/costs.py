"""Cost models fitted on the project's H200 measurements, and an online length estimator.

Every constant below comes from a file of the repository (or ``/work/shared/GPU.md``, quoted) or
is a named assumption with a parameter. Units: seconds, tokens, bytes, GPUs.

Measured (H200, see docs/libra.md "Calibration"):

* **Rollout decode** (SGLang 0.5.17): GPU.md, section "SGLang there", the Qwen3-Next-style hybrid
  (8 layers, 3 GDN : 1 attention, 16 experts top-2, hidden 1024): "321 tokens/s with 1 request,
  7,500 tokens/s with 64 concurrent (2,000-token prompts, 256 new tokens)". Fitted as a decode
  iteration time ``a + b * B`` (:data:`SGLANG_DECODE_POINTS`). These are the only two batch points
  measured; the context dependence was **not** measured (both at ~2.1K context), so the per
  context-token term ``c`` is an assumption: the KV bytes a decode iteration reads from the
  simulated model's attention layers at the measured HBM copy bandwidth (GPU.md "device copy
  about 4.3 TB/s").
* **Prefill**: not measured separately; assumed equal to the forward tokens/s of the same
  model's training forward (``docs/benchmarks/e2e_dense_sweep.json`` rows' ``baseline.compact_tokens
  / baseline.fwd_ms``).
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
* **Engine cold start**: ``rollout.json`` ``runs.tree.engine_start_s`` (176 s).
* **Role switch** (SGLang ``/release_memory_occupation`` + rejoin of training, or back): **not
  measured on the H200** (``scripts/libra_colocated_h200.py`` is written for it, not run); a
  parameter (``switch_s``) everywhere it is used.
"""
from __future__ import annotations

import json
import math
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


def fit_rollout_cost(points: Sequence[tuple[int, float, float]] = SGLANG_DECODE_POINTS, *,
                     kv_bytes_per_token: int = KV_BYTES_PER_TOKEN_1P5B, hbm_bytes_per_s: float = HBM_BYTES_PER_S,
                     prefill_tok_s: float | None = None, fit_context: bool = False, source: str | None = None,
                     **kw) -> RolloutCost:
    """Least-squares fit of the decode iteration ``step = B / tokens_per_s`` on ``points`` (``(B,
    mean context, tokens/s)``). Default: ``a + b B`` on the points, and ``c = kv_bytes_per_token /
    hbm_bytes_per_s`` (assumption, see module doc) for the simulated model only (the measured
    points' own attention term is not subtracted: by the same estimate it is < 2% of the measured
    step). ``fit_context``: fit ``a + b B + c B ctx`` on points that vary the context (e.g. from
    ``scripts/libra_calibrate_h200.py``; needs >= 3 points). ``prefill_tok_s`` defaults to
    :func:`measured_prefill_tok_s`."""
    need = 3 if fit_context else 2
    if len(points) < need:
        raise ValueError(f"fit_rollout_cost needs at least {need} (batch, ctx, tokens/s) points, got {len(points)}")
    B = np.array([p[0] for p in points], dtype=np.float64)
    ctx = np.array([p[1] for p in points], dtype=np.float64)
    step = B / np.array([p[2] for p in points], dtype=np.float64)
    cols = [np.ones_like(B), B] + ([B * ctx] if fit_context else [])
    coef, *_ = np.linalg.lstsq(np.stack(cols, axis=1), step, rcond=None)
    a, b = coef[0], coef[1]
    c = coef[2] if fit_context else kv_bytes_per_token / hbm_bytes_per_s
    if a <= 0 or b <= 0 or c < 0:
        raise ValueError(f"rollout fit gave non-physical terms a={a}, b={b}, c={c}: check the points")
    return RolloutCost(a_s=float(a), b_s=float(b), c_s=float(c),
                       prefill_tok_s=prefill_tok_s if prefill_tok_s is not None else measured_prefill_tok_s(),
                       source=source or "GPU.md SGLang 0.5.17 Qwen3-Next hybrid: 321 tok/s @1, 7500 tok/s @64", **kw)


def load_rollout_points(path) -> tuple[list[tuple[int, float, float]], float | None]:
    """``(points, prefill tokens/s)`` from a ``scripts/libra_calibrate_h200.py`` JSON
    (``{"points": [[batch, ctx, tokens/s], ...], "prefill_tok_s": ...}``)."""
    with open(path) as f:
        d = json.load(f)
    pts = [(int(p[0]), float(p[1]), float(p[2])) for p in d["points"]]
    return pts, d.get("prefill_tok_s")


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
