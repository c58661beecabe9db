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
"""
from __future__ import annotations

import argparse
import json
import logging
import math
import shutil
import sys
import sysconfig
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

from ..tree import Trajectory, make_trajectory
from .tokenizer import BOS, SPECIALS, ByteTokenizer

logger = logging.getLogger(__name__)


@dataclass
class TextModelConfig:
    """``hidden_size`` / ``num_layers``: the model (:func:`~.weight_sync.tiny_qwen3_next_config`
    shapes otherwise, vocabulary 264); ``seq_len``: bytes per text window; ``batch``: windows (and
    episodes) per step; ``steps`` and/or ``minutes`` (whichever ends first; 0 = no limit);
    ``agent_family``: ``code_repair`` or ``None``; ``agent_tasks`` x ``agent_samples`` scripted
    episodes, ``agent_fraction`` of each batch; ``eval_windows`` held-out windows; ``moe``: every
    layer MoE (SGLang 0.5.17 serves only those); ``dtype``: of the checkpoint (``bfloat16`` for
    SGLang; training is fp32 either way)."""

    hidden_size: int = 128
    num_layers: int = 4
    seq_len: int = 256
    batch: int = 16
    steps: int = 0
    minutes: float = 10.0
    lr: float = 2e-3
    warmup_steps: int = 20
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


def pretrain(cfg: TextModelConfig, out: str | Path, *, progress: bool = True) -> dict:
    """Train and write ``<out>/model`` (an HF checkpoint with ``config.json``); returns (and
    writes to ``<out>/text_model.json``) the config, the per-step log, held-out bits per byte
    before and after and the wall time."""
    from .trainer import HartsTrainer
    from .weight_sync import WeightSync, tiny_qwen3_next_config

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    tok = ByteTokenizer()
    bos = tok.token_id(BOS)
    t_data = time.perf_counter()
    corpus = TextCorpus(stdlib_files(cfg.max_files), tok)
    episodes = agent_episodes(cfg.agent_family, cfg.agent_tasks, cfg.agent_samples, cfg.seed) if cfg.agent_family \
        else []
    t_data = time.perf_counter() - t_data
    logger.info("text model: %d files (%.1f MB) for training, %d held out, %d agent episodes (%.1f s)",
                len(corpus.train), corpus.bytes / 1e6, len(corpus.held_out), len(episodes), t_data)
    heads = max(1, cfg.hidden_size // 32)
    hf = tiny_qwen3_next_config(hidden_size=cfg.hidden_size, num_layers=cfg.num_layers,
                                num_attention_heads=heads, num_key_value_heads=max(1, heads // 2), head_dim=32,
                                linear_key_head_dim=32, linear_value_head_dim=32, linear_num_key_heads=max(1, heads // 2),
                                linear_num_value_heads=heads, moe=cfg.moe, **cfg.overrides)
    trainer = HartsTrainer(hf, tree=False, lr=cfg.lr, device=cfg.device, seed=cfg.seed, chunk_size=64,
                           microbatch_tokens=2048)
    params = sum(p.numel() for p in trainer.model.parameters())
    rng = np.random.default_rng(cfg.seed)
    eval_set = held_out_set(corpus, cfg)

    def bits_per_byte() -> float:
        lps = trainer.logprobs(eval_set)
        return float(-np.concatenate(lps).mean() / math.log(2))

    bpb0 = bits_per_byte()
    n_agent = int(round(cfg.batch * cfg.agent_fraction)) if episodes else 0
    log, t0, step = [], time.perf_counter(), 0
    deadline = t0 + cfg.minutes * 60 if cfg.minutes > 0 else math.inf
    bar = None
    if progress:
        from tqdm import tqdm
        bar = tqdm(total=cfg.steps or None, desc="text model", unit="step", file=sys.stderr)
    try:
        while (cfg.steps <= 0 or step < cfg.steps) and time.perf_counter() < deadline:
            lr = cfg.lr * min(1.0, (step + 1) / max(1, cfg.warmup_steps))
            trainer.set_lr(lr)
            batch = [_text_trajectory(i, w, bos)
                     for i, w in enumerate(corpus.windows(rng, cfg.batch - n_agent, cfg.seq_len))]
            for j in rng.choice(len(episodes), size=n_agent, replace=n_agent > len(episodes)) if n_agent else []:
                toks, mask = episodes[int(j)]
                batch.append(make_trajectory(len(batch), toks, traj_id=f"agent{len(batch)}", group_id=f"agent{len(batch)}",
                                             loss_mask=mask, advantage=1.0))
            m = trainer.train_step(batch)
            row = {"step": step, "nll": round(m["nll"], 4), "lr": lr, "train_s": round(m["train_s"], 3),
                   "tokens": m["trajectory_tokens"]}
            if cfg.eval_every and (step + 1) % cfg.eval_every == 0:
                row["eval_bits_per_byte"] = round(bits_per_byte(), 4)
            log.append(row)
            step += 1
            if bar is not None:
                bar.update(1)
                bar.set_postfix(nll=f"{m['nll']:.3f}")
        wall = time.perf_counter() - t0
        bpb1 = bits_per_byte()
        path, _ = WeightSync(dict(hf, dtype=cfg.dtype), out / "weights").export(trainer.model, "text")
    finally:
        if bar is not None:
            bar.close()
        trainer.close()
    model_dir = out / "model"
    shutil.rmtree(model_dir, ignore_errors=True)
    Path(path).rename(model_dir)
    shutil.rmtree(out / "weights", ignore_errors=True)      # the export's version directory root
    result = {"config": asdict(cfg), "hf_config": hf, "params": params, "steps": step, "wall_s": round(wall, 1),
              "data_s": round(t_data, 1), "train_files": len(corpus.train), "train_bytes": corpus.bytes,
              "agent_episodes": len(episodes), "eval_bits_per_byte_before": round(bpb0, 4),
              "eval_bits_per_byte_after": round(bpb1, 4), "model": str(model_dir), "log": log}
    (out / "text_model.json").write_text(json.dumps(result, indent=1))
    logger.info("text model: %.2fM params, %d steps in %.0f s, held-out %.3f -> %.3f bits/byte; %s",
                params / 1e6, step, wall, bpb0, bpb1, model_dir)
    return result


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m megatron_harts.rollout.text_model",
                                 description=__doc__.split("\n\n")[0])
    d = TextModelConfig()
    ap.add_argument("--out", required=True, help="output directory (model in <out>/model)")
    for name in ("hidden_size", "num_layers", "seq_len", "batch", "steps", "agent_tasks", "agent_samples",
                 "eval_windows", "eval_every", "max_files", "seed", "warmup_steps"):
        ap.add_argument("--" + name.replace("_", "-"), type=int, default=getattr(d, name))
    for name in ("minutes", "lr", "agent_fraction"):
        ap.add_argument("--" + name.replace("_", "-"), type=float, default=getattr(d, name))
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
    print(json.dumps({k: r[k] for k in ("params", "steps", "wall_s", "eval_bits_per_byte_before",
                                        "eval_bits_per_byte_after", "model")}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
