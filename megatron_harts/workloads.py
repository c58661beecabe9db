"""Deterministic synthetic agentic rollout batches (multi-turn, branching, heavy-tailed tools).

A group is one task: a shared prompt, then ``group_size`` samples. Sample 0 runs ``turns``
turns (assistant message, then tool output); every later sample copies the first b turns of
an earlier sample (a retry / branch at turn b, b = 0 is plain group sampling) and continues
on its own. Tool outputs are log-normal (heavy tail); only assistant tokens are trained.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .tree import Trajectory, make_trajectory


@dataclass(frozen=True)
class AgenticConfig:
    num_groups: int = 4
    group_size: int = 8
    turns: tuple[int, int] = (4, 10)         # turns per sample, inclusive range
    prompt_tokens: tuple[int, int] = (200, 600)
    assistant_tokens: tuple[int, int] = (20, 120)
    tool_tokens_median: float = 150.0
    tool_tokens_sigma: float = 1.0           # log-normal shape: heavy tail
    tool_tokens_max: int = 4000
    branch_prob: float = 0.9                 # a sample branches off an earlier one (else from the prompt)
    vocab_size: int = 1024
    seed: int = 0


def _turn(rng: np.random.Generator, cfg: AgenticConfig) -> tuple[np.ndarray, np.ndarray]:
    a = int(rng.integers(cfg.assistant_tokens[0], cfg.assistant_tokens[1] + 1))
    t = int(min(cfg.tool_tokens_max, max(1, rng.lognormal(np.log(cfg.tool_tokens_median), cfg.tool_tokens_sigma))))
    toks = rng.integers(1, cfg.vocab_size, size=a + t)
    mask = np.concatenate([np.ones(a, dtype=bool), np.zeros(t, dtype=bool)])
    return toks, mask


def agentic_batch(cfg: AgenticConfig = AgenticConfig()) -> list[Trajectory]:
    """Trajectories of ``cfg.num_groups`` groups with GRPO-style group-normalised advantages."""
    rng = np.random.default_rng(cfg.seed)
    out: list[Trajectory] = []
    for gid in range(cfg.num_groups):
        prompt = rng.integers(1, cfg.vocab_size, size=int(rng.integers(*cfg.prompt_tokens)))
        samples: list[list[tuple[np.ndarray, np.ndarray]]] = []
        for s in range(cfg.group_size):
            n_turns = int(rng.integers(cfg.turns[0], cfg.turns[1] + 1))
            if samples and rng.random() < cfg.branch_prob:
                base = samples[int(rng.integers(len(samples)))]
                b = int(rng.integers(len(base) // 2, len(base) + 1))
                turns = list(base[:b])
            else:
                turns = []
            while len(turns) < max(n_turns, 1):
                turns.append(_turn(rng, cfg))
            samples.append(turns)
        rewards = rng.normal(size=cfg.group_size)
        adv = (rewards - rewards.mean()) / (rewards.std() + 1e-6)
        for s, turns in enumerate(samples):
            tokens = np.concatenate([prompt] + [t for t, _ in turns])
            mask = np.concatenate([np.zeros(len(prompt), dtype=bool)] + [m for _, m in turns])
            old = np.where(mask, -rng.exponential(1.0, size=len(tokens)), 0.0)
            out.append(make_trajectory(len(out), tokens, cfg.vocab_size, traj_id=f"g{gid}-s{s}", group_id=f"g{gid}",
                                       loss_mask=mask, old_logprobs=old, ref_logprobs=old, advantage=float(adv[s]),
                                       reward=float(rewards[s])))
    return out


def sweep_trees(total_tokens: int, compression: float, *, group_size: int = 16, branches: int = 4,
                tokens_per_group: int = 65536, vocab_size: int = 32000, seed: int = 0) -> list[list[list[int]]]:
    """Token lists of groups with about ``total_tokens`` trajectory tokens and the target
    compression (1 < compression < group_size).

    Each group: a prompt of P tokens, ``branches`` mid branches of M tokens, each split into
    ``group_size / branches`` leaves of S tokens, with M = S, so
    ``compression = n (P + 2S) / (P + (b + n) S)``. Lengths are jittered by +-10% and never
    aligned to chunk boundaries on purpose.
    """
    n, b = group_size, branches
    if not 1 < compression < n:
        raise ValueError(f"compression must be in (1, {n}) for groups of {n}, got {compression}")
    groups = max(1, round(total_tokens / tokens_per_group))
    L = total_tokens // (groups * n)
    S = L * (n / compression - 1) / (b + n - 2)      # from c = nL / (L - 2S + (b + n) S)
    P = max(1.0, L - 2 * S)
    rng = np.random.default_rng(seed)
    jit = lambda x: max(1, int(x * rng.uniform(0.9, 1.1)))
    out = []
    for _ in range(groups):
        prompt = rng.integers(0, vocab_size, size=jit(P)).tolist()
        trajs = []
        for _ in range(b):
            mid = rng.integers(0, vocab_size, size=jit(S)).tolist()
            for _ in range(n // b):
                trajs.append(prompt + mid + rng.integers(0, vocab_size, size=jit(S)).tolist())
        out.append(trajs)
    return out
