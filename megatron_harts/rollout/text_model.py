"""A small model that writes text like a trained one, made here: no weights can be downloaded.

Speculation needs outputs that repeat like real text (a random model accepts nothing), and reward
curves need a policy that starts somewhere. :func:`pretrain` trains a byte-level Qwen3-Next from
its config (random initialisation, seeded) by next-token prediction on two corpora that ship on
every machine:

* **Python sources** of the running interpreter's standard library (``sysconfig``'s ``stdlib``
  directory, ``*.py`` files in sorted order, test packages excluded), cut into ``seq_len``-byte
  windows; a fixed, seeded set of windows from files not used for training is held out
  (bits per byte on it is the reported quality);
* **agent episodes** of a task family (optional, ``agent_fraction`` of each batch): scripted
  episodes run on the real environment (for ``code_repair``:
  :func:`~megatron_harts.rollout.war.replay.code_repair_streams`, sandboxed), trained on the model
  turns only, so the model learns the markup and the shape of tool use.

The trainer is :class:`~megatron_harts.rollout.trainer.HartsTrainer` (the RL loop's Megatron
model, trajectory-wise packs: these windows share no prefix) with advantage 1 and on-policy
ratios, whose gradient is the supervised one; the checkpoint is written by
:class:`~megatron_harts.rollout.weight_sync.WeightSync` (the loop's Megatron -> Hugging Face
export), so the embedded engine and SGLang load it as they load a synced policy.

    python -m megatron_harts.rollout.text_model --out out/text_model --minutes 10

On a GPU (``--device cuda``) the trainer keeps fp32 parameters and AdamW state (``--dtype`` is the
checkpoint's: the export casts), with TF32 matmuls, 8K-token microbatches and the ``torch``
(dense-mask SDPA) attention backend, which compiles nothing (FlexAttention would recompile per
pack length, and FlashAttention varlen needs bf16 activations). ``--wall-minutes`` bounds the
whole process (imports included): training stops early enough for the final evaluation and the
export; ``--export-every-minutes`` also writes ``<out>/model`` during training, and SIGTERM /
SIGINT or an error in a step stop training and export what was trained (exit status 1 on an
error), so an interrupted run still leaves a model.
"""
from __future__ import annotations

import argparse
import json
import logging
import math
import os
import shutil
import signal
import sys
import threading
import sysconfig
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

from ..tree import Trajectory, make_trajectory
from .tokenizer import BOS, SPECIALS, ByteTokenizer

logger = logging.getLogger(__name__)

_T_IMPORT = time.perf_counter()


def _process_age_s() -> float:
    """Seconds since this process started (Linux ``/proc``; else since this module's import)."""
    try:
        start_ticks = float(Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()[19])
        uptime = float(Path("/proc/uptime").read_text().split()[0])
        age = uptime - start_ticks / os.sysconf("SC_CLK_TCK")
        if 0.0 <= age < 1e7:
            return age
    except (OSError, ValueError, IndexError):
        pass
    return time.perf_counter() - _T_IMPORT


@dataclass
class TextModelConfig:
    """``hidden_size`` / ``num_layers``: the model (:func:`~.weight_sync.tiny_qwen3_next_config`
    shapes otherwise, vocabulary 264, ``max_position_embeddings`` 32768: the episodes reach 8K
    tokens); ``head_dim``: of attention and GDN heads (``hidden_size // head_dim`` query and GDN
    value heads, half as many KV and GDN key heads; SGLang's kernels are exercised at 64 / 128,
    so use 64 for a checkpoint it serves); ``seq_len``: bytes per text window; ``batch``: windows
    (and episodes) per step; ``steps`` and/or ``minutes`` of training after the setup (whichever
    ends first; 0 = no limit; ``minutes`` count from the end of the first step, which compiles,
    as does a time-based lr schedule); ``wall_minutes``: the whole process (imports, data, training, final
    evaluation, export) ends within this (0 = no limit); ``lr_decay``: ``none`` or ``cosine`` (to
    ``min_lr_ratio`` at the step / time budget's end); ``agent_family``: ``code_repair`` or
    ``None``; ``agent_tasks`` x ``agent_samples`` scripted episodes, ``agent_fraction`` of each
    batch; ``eval_windows`` held-out windows; ``moe``: every layer MoE (SGLang 0.5.17 serves only
    those); ``dtype``: of the checkpoint (``bfloat16`` for SGLang; training is fp32 either way);
    ``microbatch_tokens`` (0: 2048 on CPU, 8192 on a GPU) and ``attention_backend`` (``auto``:
    ``torch``) go to :class:`~.trainer.HartsTrainer`; ``export_every_minutes``: also export during
    training (0 = at the end only)."""

    hidden_size: int = 128
    num_layers: int = 4
    head_dim: int = 32
    seq_len: int = 256
    batch: int = 16
    steps: int = 0
    minutes: float = 10.0
    wall_minutes: float = 0.0
    lr: float = 2e-3
    warmup_steps: int = 20
    lr_decay: str = "none"
    min_lr_ratio: float = 0.1
    agent_family: str | None = "code_repair"
    agent_tasks: int = 6
    agent_samples: int = 4
    agent_fraction: float = 0.25
    eval_windows: int = 32
    eval_every: int = 50
    max_files: int = 0
    seed: int = 0
    device: str = "cpu"
    moe: bool = False
    dtype: str = "float32"
    microbatch_tokens: int = 0
    attention_backend: str = "auto"
    export_every_minutes: float = 0.0
    overrides: dict = field(default_factory=dict)

    def __post_init__(self):
        if self.steps <= 0 and self.minutes <= 0:
            raise ValueError("text model: give --steps or --minutes (> 0)")
        if not 0.0 <= self.agent_fraction < 1.0:
            raise ValueError(f"text model: agent_fraction must be in [0, 1), got {self.agent_fraction}")
        if self.dtype not in ("float32", "bfloat16"):
            raise ValueError(f"text model: dtype must be float32 or bfloat16, got {self.dtype!r}")
        if self.seq_len < 16 or self.batch < 1:
            raise ValueError(f"text model: need seq_len >= 16 and batch >= 1, got {self.seq_len}, {self.batch}")
        if self.head_dim < 8 or self.head_dim % 8 or self.head_dim > self.hidden_size:
            raise ValueError(f"text model: head_dim must be a multiple of 8 in [8, hidden_size], got {self.head_dim}")
        if self.agent_family not in (None, "code_repair"):
            raise ValueError(f"text model: scripted agent episodes exist for code_repair only, "
                             f"got {self.agent_family!r}")
        if self.lr_decay not in ("none", "cosine"):
            raise ValueError(f"text model: lr_decay must be none or cosine, got {self.lr_decay!r}")
        if self.attention_backend not in ("auto", "torch", "flex", "varlen"):
            raise ValueError(f"text model: attention_backend must be auto, torch, flex or varlen, "
                             f"got {self.attention_backend!r}")
        if self.wall_minutes < 0 or self.export_every_minutes < 0 or self.microbatch_tokens < 0:
            raise ValueError("text model: wall_minutes, export_every_minutes and microbatch_tokens must be >= 0")


def stdlib_files(max_files: int = 0) -> list[Path]:
    """The standard library's ``*.py`` files (sorted; ``test``/``tests``/``idle_test`` and
    ``site-packages`` excluded); ``max_files`` > 0 keeps every k-th file to that many."""
    root = Path(sysconfig.get_paths()["stdlib"])
    skip = {"test", "tests", "idle_test", "site-packages", "__pycache__"}
    files = sorted(p for p in root.rglob("*.py") if not skip & set(p.relative_to(root).parts))
    if not files:
        raise RuntimeError(f"text model: no Python sources under {root}")
    if max_files and len(files) > max_files:
        files = files[:: math.ceil(len(files) / max_files)][:max_files]
    return files


class TextCorpus:
    """Byte tokens of the source files, one array per file; ``held_out`` files (every 20th) give
    the evaluation windows."""

    def __init__(self, files: list[Path], tok: ByteTokenizer):
        self.train: list[np.ndarray] = []
        self.held_out: list[np.ndarray] = []
        for i, p in enumerate(files):
            try:
                text = p.read_text(encoding="utf-8")
            except (UnicodeDecodeError, OSError):
                continue
            # raw UTF-8 bytes: markup strings inside a source stay bytes, never special tokens
            ids = np.frombuffer(text.encode("utf-8"), dtype=np.uint8).astype(np.int64) + len(SPECIALS)
            (self.held_out if i % 20 == 19 else self.train).append(ids)
        self.train = [a for a in self.train if len(a) > 64]
        self.held_out = [a for a in self.held_out if len(a) > 64]
        self.bytes = int(sum(len(a) for a in self.train))
        w = np.asarray([len(a) for a in self.train], dtype=np.float64)
        self._p = w / w.sum()

    def windows(self, rng: np.random.Generator, n: int, seq_len: int, held_out: bool = False) -> list[np.ndarray]:
        """``n`` windows of ``seq_len - 1`` bytes (files drawn by size), each after a ``<bos>``."""
        pool = self.held_out if held_out else self.train
        p = None if held_out else self._p
        out = []
        for f in rng.choice(len(pool), size=n, p=p):
            a = pool[int(f)]
            s = int(rng.integers(0, max(1, len(a) - seq_len + 1)))
            out.append(a[s:s + seq_len - 1])
        return out


def agent_episodes(family: str, n_tasks: int, samples: int, seed: int = 0) -> list[tuple[list[int], list[int]]]:
    """Scripted episodes ``(tokens, loss_mask)`` of ``family`` run on its real environment."""
    if family != "code_repair":
        raise ValueError(f"text model: scripted agent episodes exist for code_repair only, got {family!r}")
    from .war.replay import code_repair_streams

    return [(s.tokens, s.loss_mask) for s in code_repair_streams(n_tasks, samples, 1, seed=seed)]


def _text_trajectory(i: int, ids: np.ndarray, bos: int) -> Trajectory:
    tokens = np.concatenate([[bos], ids])
    mask = np.ones(len(tokens), dtype=np.int64)
    mask[0] = 0
    return make_trajectory(i, tokens, traj_id=f"text{i}", group_id=f"text{i}", loss_mask=mask, advantage=1.0)


def held_out_set(corpus: TextCorpus, cfg: TextModelConfig) -> list[Trajectory]:
    """The evaluation windows (fixed seed, held-out files) as trajectories ``[seq_len]``."""
    bos = ByteTokenizer().token_id(BOS)
    return [_text_trajectory(i, w, bos) for i, w in
            enumerate(corpus.windows(np.random.default_rng(12345), cfg.eval_windows, cfg.seq_len, held_out=True))]


class _StopSignals:
    """While training: SIGTERM or SIGINT ends training after the current step (the model is then
    evaluated and exported); a second SIGINT interrupts at once. Main thread only."""

    def __init__(self):
        self.reason: str | None = None
        self._old: dict = {}

    def __enter__(self) -> "_StopSignals":
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGTERM, signal.SIGINT):
                self._old[sig] = signal.signal(sig, self._handle)
        return self

    def _handle(self, signum, frame):
        if self.reason is not None and signum == signal.SIGINT:
            raise KeyboardInterrupt
        self.reason = signal.Signals(signum).name
        logger.warning("text model: %s: training stops after this step, then evaluation and export", self.reason)

    def __exit__(self, *exc) -> None:
        for sig, handler in self._old.items():
            signal.signal(sig, handler)
        self._old.clear()


def _heads(hidden_size: int, head_dim: int) -> tuple[int, int]:
    """(query / GDN value heads, KV / GDN key heads): ``hidden // head_dim`` and half as many
    (a divisor, as GQA and GDN's head grouping need)."""
    heads = max(1, hidden_size // head_dim)
    kv = max(1, heads // 2)
    return heads, kv if heads % kv == 0 else 1


def model_config(cfg: TextModelConfig) -> dict:
    """The ``Qwen3NextConfig`` kwargs of ``cfg``'s model (float32; the export sets ``dtype``)."""
    from .weight_sync import tiny_qwen3_next_config

    heads, kv = _heads(cfg.hidden_size, cfg.head_dim)
    return tiny_qwen3_next_config(hidden_size=cfg.hidden_size, num_layers=cfg.num_layers, num_attention_heads=heads,
                                  num_key_value_heads=kv, head_dim=cfg.head_dim, linear_key_head_dim=cfg.head_dim,
                                  linear_value_head_dim=cfg.head_dim, linear_num_key_heads=kv,
                                  linear_num_value_heads=heads, moe=cfg.moe,
                                  **{"max_position_embeddings": 32768, **cfg.overrides})


def pretrain(cfg: TextModelConfig, out: str | Path, *, progress: bool = True) -> dict:
    """Train and write ``<out>/model`` (an HF checkpoint with ``config.json``); returns (and
    writes to ``<out>/text_model.json``) the config, the per-step log, held-out bits per byte
    before and after, the wall times and, when training stopped on an error, ``error`` (the model
    of the last completed step is exported all the same)."""
    import torch

    from .trainer import HartsTrainer
    from .weight_sync import WeightSync

    t_enter = time.perf_counter()
    wall_end = t_enter - _process_age_s() + cfg.wall_minutes * 60 if cfg.wall_minutes > 0 else math.inf
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    cuda = str(cfg.device).startswith("cuda")
    if cuda:
        torch.set_float32_matmul_precision("high")      # TF32 tensor cores for the fp32 matmuls
    tok = ByteTokenizer()
    bos = tok.token_id(BOS)
    timing: dict[str, float] = {}

    # scripted episodes (sandboxed subprocesses) run in a thread while the model is built and evaluated
    pool = fut = None
    if cfg.agent_family:
        from concurrent.futures import ThreadPoolExecutor

        def run_episodes():
            t = time.perf_counter()
            eps = agent_episodes(cfg.agent_family, cfg.agent_tasks, cfg.agent_samples, cfg.seed)
            return eps, time.perf_counter() - t

        pool = ThreadPoolExecutor(1, thread_name_prefix="text-model-episodes")
        fut = pool.submit(run_episodes)
    t = time.perf_counter()
    corpus = TextCorpus(stdlib_files(cfg.max_files), tok)
    timing["corpus_s"] = time.perf_counter() - t
    logger.info("text model: %d files (%.1f MB) for training, %d held out (%.1f s)", len(corpus.train),
                corpus.bytes / 1e6, len(corpus.held_out), timing["corpus_s"])
    hf = model_config(cfg)
    if cfg.dtype == "bfloat16" and cfg.head_dim not in (64, 128, 256):
        logger.warning("text model: head_dim %d: SGLang's attention and GDN kernels are used at 64 / 128 "
                       "(--head-dim 64 for a checkpoint SGLang serves)", cfg.head_dim)
    mb_tokens = cfg.microbatch_tokens or (8192 if cuda else 2048)
    backend = "torch" if cuda and cfg.attention_backend == "auto" else cfg.attention_backend
    try:
        trainer = HartsTrainer(hf, tree=False, lr=cfg.lr, device=cfg.device, seed=cfg.seed, chunk_size=64,
                               microbatch_tokens=mb_tokens, attention_backend=backend)
    except BaseException:
        if pool is not None:
            pool.shutdown(wait=True, cancel_futures=True)
        raise
    bar = None
    try:
        params = sum(p.numel() for p in trainer.model.parameters())
        rng = np.random.default_rng(cfg.seed)
        eval_set = held_out_set(corpus, cfg)

        def bits_per_byte() -> float:
            t = time.perf_counter()
            lps = trainer.logprobs(eval_set)
            v = float(-np.concatenate(lps).mean() / math.log(2))
            timing["eval_s"] = time.perf_counter() - t
            return v

        bpb0 = bits_per_byte()
        timing["eval0_s"] = timing["eval_s"]             # cold: includes kernel compilation
        if wall_end < math.inf:
            bits_per_byte()                              # warm: what the final evaluation will take
        episodes, agent_error = [], None
        if fut is not None:
            try:
                episodes, timing["episodes_s"] = fut.result()
            except Exception as e:                       # noqa: BLE001 - e.g. no bubblewrap on this machine
                agent_error = f"{type(e).__name__}: {e}"
                logger.error("text model: no agent episodes (%s); training on text only", agent_error)
            pool.shutdown(wait=False)
        logger.info("text model: %d agent episodes (%.1f s, beside the setup)", len(episodes),
                    timing.get("episodes_s", 0.0))

        sync = WeightSync(dict(hf, dtype=cfg.dtype), out / "weights", keep=1)
        model_dir = out / "model"

        def export() -> None:
            t = time.perf_counter()
            path, _ = sync.export(trainer.model, "text")
            old = out / ".model.old"
            shutil.rmtree(old, ignore_errors=True)
            if model_dir.exists():
                model_dir.rename(old)
            Path(path).rename(model_dir)
            shutil.rmtree(old, ignore_errors=True)
            timing["export_s"] = time.perf_counter() - t

        n_agent = int(round(cfg.batch * cfg.agent_fraction)) if episodes else 0
        log, step, step_times = [], 0, []
        t0 = time.perf_counter()
        timing["setup_s"] = t0 - t_enter
        # ``minutes`` of training count from the end of the first step: on a bare GPU machine that step
        # builds fla's Triton kernels (115 s on an H100 on 2026-12-07, against ~1 s a step after)
        deadline, t_sched = math.inf, t0          # t_sched: where the time-based lr schedule starts

        def reserve() -> float:
            """Seconds kept for the final evaluation and export (their last measured times)."""
            return 1.5 * timing["eval_s"] + 1.5 * timing.get("export_s", 10.0) + 5.0

        def lr_at(step: int, now: float) -> float:
            lr = cfg.lr * min(1.0, (step + 1) / max(1, cfg.warmup_steps))
            if cfg.lr_decay == "none":
                return lr
            frac = step / cfg.steps if cfg.steps > 0 else 0.0
            end = min(deadline, wall_end - reserve())
            if end < math.inf:
                frac = max(frac, (now - t_sched) / max(1e-9, end - t_sched))
            frac = min(1.0, frac)
            return lr * (cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * frac)))

        if progress:
            from tqdm import tqdm
            bar = tqdm(total=cfg.steps or None, desc="text model", unit="step", file=sys.stderr,
                       mininterval=0.5 if sys.stderr.isatty() else 30.0)
        error, stop_reason, last_export = None, "steps", t0
        with _StopSignals() as stop:
            while True:
                now = time.perf_counter()
                if stop.reason:
                    stop_reason = stop.reason
                    break
                if cfg.steps > 0 and step >= cfg.steps:
                    break
                if now >= deadline:
                    stop_reason = "minutes"
                    break
                if _past_wall(now, step_times, reserve(), wall_end):   # no step past the wall
                    stop_reason = "wall_minutes"
                    break
                lr = lr_at(step, now)
                trainer.set_lr(lr)
                batch = [_text_trajectory(i, w, bos)
                         for i, w in enumerate(corpus.windows(rng, cfg.batch - n_agent, cfg.seq_len))]
                for j in rng.choice(len(episodes), size=n_agent, replace=n_agent > len(episodes)) if n_agent else []:
                    toks, mask = episodes[int(j)]
                    batch.append(make_trajectory(len(batch), toks, traj_id=f"agent{len(batch)}",
                                                 group_id=f"agent{len(batch)}", loss_mask=mask, advantage=1.0))
                try:
                    m = trainer.train_step(batch)
                except Exception as e:               # noqa: BLE001 - the model of the last step is still exported
                    if step == 0:
                        raise
                    error, stop_reason = f"{type(e).__name__}: {e}", "error"
                    logger.exception("text model: step %d failed; exporting the model of step %d", step, step)
                    break
                row = {"step": step, "nll": round(m["nll"], 4), "lr": lr, "train_s": round(m["train_s"], 3),
                       "tokens": m["trajectory_tokens"]}
                step += 1
                if cfg.eval_every and step % cfg.eval_every == 0:
                    row["eval_bits_per_byte"] = round(bits_per_byte(), 4)
                    el = time.perf_counter() - t0
                    logger.info("text model: step %d, nll %.3f, held-out %.3f bits/byte, %.2f steps/s, "
                                "%.0f tokens/s", step, m["nll"], row["eval_bits_per_byte"], step / el,
                                sum(r["tokens"] for r in log + [row]) / el)
                log.append(row)
                if bar is not None:
                    bar.update(1)
                    bar.set_postfix(nll=f"{m['nll']:.3f}")
                if cfg.export_every_minutes > 0 and time.perf_counter() - last_export >= cfg.export_every_minutes * 60:
                    export()
                    _write_result(out, _result(cfg, hf, params, step, time.perf_counter() - t0, corpus, episodes,
                                               bpb0, None, model_dir, log, timing, stop_reason="running",
                                               error=None, agent_error=agent_error, complete=False))
                    last_export = time.perf_counter()
                step_times.append(time.perf_counter() - now)
                if step == 1:        # the first step compiled: budget and schedule start after it
                    t_sched = time.perf_counter()
                    deadline = t_sched + cfg.minutes * 60 if cfg.minutes > 0 else math.inf
            wall = time.perf_counter() - t0
            bpb1 = None
            try:
                bpb1 = bits_per_byte()
            except Exception as e:                   # noqa: BLE001 - e.g. the GPU failed in the last step
                error = error or f"final evaluation: {type(e).__name__}: {e}"
                logger.exception("text model: final evaluation failed")
            try:
                export()
            except Exception as e:
                if not (model_dir / "config.json").exists():
                    raise
                error = error or f"final export: {type(e).__name__}: {e}"
                logger.exception("text model: final export failed; %s holds an earlier export", model_dir)
    finally:
        if bar is not None:
            bar.close()
        trainer.close()
        shutil.rmtree(out / "weights", ignore_errors=True)      # the export's version directory root
    timing["process_s"] = _process_age_s()
    result = _result(cfg, hf, params, step, wall, corpus, episodes, bpb0, bpb1, model_dir, log, timing,
                     stop_reason=stop_reason, error=error, agent_error=agent_error, complete=True)
    _write_result(out, result)
    logger.info("text model: %.2fM params, %d steps in %.0f s (%s), held-out %.3f -> %s bits/byte; %s "
                "(process %.0f s)%s", params / 1e6, step, wall, stop_reason, bpb0,
                "?" if bpb1 is None else f"{bpb1:.3f}", model_dir, timing["process_s"],
                f"; ERROR {error}" if error else "")
    return result


def _past_wall(now: float, step_times: list[float], reserve_s: float, wall_end: float) -> bool:
    """Whether one more step would end past ``wall_end`` (seconds, ``perf_counter``) with ``reserve_s``
    kept for the final evaluation and export. The next step is predicted by the slowest of the last
    five steps after the first: the first builds the kernels, and its time (115 s on a bare H100
    on 2026-12-07, against ~1 s after) would stop training after one step. With only the first
    timed, the second is taken as up to 30 s (it may compile too: a new pack length)."""
    later = step_times[1:][-5:]
    predicted = max(later) if later else min(step_times[0], 30.0) if step_times else 0.0
    return now + predicted + reserve_s > wall_end


def _result(cfg, hf, params, steps, wall, corpus, episodes, bpb0, bpb1, model_dir, log, timing, *, stop_reason,
            error, agent_error, complete) -> dict:
    tokens = sum(r["tokens"] for r in log)
    return {"config": asdict(cfg), "hf_config": hf, "params": params, "steps": steps, "wall_s": round(wall, 1),
            "steps_per_s": round(steps / max(wall, 1e-9), 3), "tokens_per_s": round(tokens / max(wall, 1e-9)),
            "stop_reason": stop_reason, "error": error, "complete": complete,
            "data_s": round(timing.get("corpus_s", 0.0) + timing.get("episodes_s", 0.0), 1),
            "timing": {k: round(v, 2) for k, v in timing.items()},
            "train_files": len(corpus.train), "train_bytes": corpus.bytes, "agent_episodes": len(episodes),
            "agent_error": agent_error, "eval_bits_per_byte_before": round(bpb0, 4),
            "eval_bits_per_byte_after": None if bpb1 is None else round(bpb1, 4), "model": str(model_dir),
            "log": log}


def _write_result(out: Path, result: dict) -> None:
    tmp = out / ".text_model.json.tmp"
    tmp.write_text(json.dumps(result, indent=1))
    os.replace(tmp, out / "text_model.json")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m megatron_harts.rollout.text_model",
                                 description=__doc__.split("\n\n")[0])
    d = TextModelConfig()
    ap.add_argument("--out", required=True, help="output directory (model in <out>/model)")
    for name in ("hidden_size", "num_layers", "head_dim", "seq_len", "batch", "steps", "agent_tasks", "agent_samples",
                 "eval_windows", "eval_every", "max_files", "seed", "warmup_steps", "microbatch_tokens"):
        ap.add_argument("--" + name.replace("_", "-"), type=int, default=getattr(d, name))
    for name in ("minutes", "wall_minutes", "lr", "min_lr_ratio", "agent_fraction", "export_every_minutes"):
        ap.add_argument("--" + name.replace("_", "-"), type=float, default=getattr(d, name))
    ap.add_argument("--lr-decay", default=d.lr_decay, help="none or cosine")
    ap.add_argument("--attention-backend", default=d.attention_backend,
                    help="auto (torch: dense-mask SDPA), torch, flex or varlen")
    ap.add_argument("--agent-family", default=d.agent_family, help="code_repair or none")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--moe", action="store_true", help="MoE layers (SGLang-servable)")
    ap.add_argument("--dtype", default="float32", help="checkpoint dtype: float32 or bfloat16 (SGLang)")
    a = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s", datefmt="%H:%M:%S")
    kw = {k: v for k, v in vars(a).items() if k != "out"}
    if kw["agent_family"] in ("none", "", None):
        kw["agent_family"] = None
    try:
        cfg = TextModelConfig(**kw)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    r = pretrain(cfg, a.out)
    print(json.dumps({k: r[k] for k in ("params", "steps", "wall_s", "steps_per_s", "tokens_per_s", "stop_reason",
                                        "eval_bits_per_byte_before", "eval_bits_per_byte_after", "model", "error")}
                     | {"process_s": r["timing"]["process_s"], "agent_episodes": r["agent_episodes"]}))
    return 1 if r["error"] else 0


if __name__ == "__main__":
    raise SystemExit(main())
