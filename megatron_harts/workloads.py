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
    id_prefix: str = "g"                     # trajectory ids f"{id_prefix}{group}-s{sample}", groups f"{id_prefix}{group}"


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
            out.append(make_trajectory(len(out), tokens, cfg.vocab_size, traj_id=f"{cfg.id_prefix}{gid}-s{s}",
                                       group_id=f"{cfg.id_prefix}{gid}",
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


# ------------------------------------------------------------------------------------------------
# Benchmark workloads: SWE-bench-like and tau-bench-like rollout trees, sweep batches, CLI
# ------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class TreeWorkloadConfig:
    """Agentic rollout trees of tool-using agents. Lengths are in tokens; ranges are inclusive.

    A group (one task) has a prompt (system prompt + task text) and ``group_size`` samples. A turn
    is an assistant message (trained) followed by an environment message (tool output or simulated
    user reply, not trained). Sample 0 starts from the prompt; every later sample starts from the
    prompt with probability ``root_prob`` (branching at the root: independent GRPO samples), else
    it branches off an earlier sample after a fraction ``branch_keep`` of that sample's turns and
    runs ``branch_turns`` more turns (branching at intermediate turns: retries / tree search from
    a shared state); turns counts the turns of samples from the prompt. A trajectory
    ends after its turn count or when the next turn would pass ``max_tokens`` (context limit).

    Provenance (defaults are the SWE-bench-like values; "assumed" = not taken from a statistic):
    num_groups        4 tasks per global batch: assumed (benchmark sizing).
    group_size        8-16 samples per task: GRPO group sizes used for SWE agents (8 in DeepSWE /
                      SkyRL-style setups, 16 in larger runs); assumed range.
    turns             10-50 turns: SWE-agent caps episodes by cost, typical resolved runs take
                      tens of steps (SWE-agent paper, arXiv 2405.15793; SWE-bench Pro trajectory
                      analyses report medians of 29-78 steps for stronger models); 10-50 assumed.
    system_tokens     1,500-2,500: SWE-agent / OpenHands system prompt with tool (ACI) docs and a
                      demonstration; assumed.
    task_tokens_*     median 600, log-normal sigma 0.8, capped 4,000: GitHub issue text; assumed.
    assistant_*       median 150, sigma 0.7, 20..2,000: thought + one action; assumed.
    env_*             median 400, sigma 1.2, 10..8,000: heavy-tailed tool outputs (file views of
                      100 lines ~ 1-2K tokens, test logs up to thousands, short ls/edit acks);
                      assumed log-normal.
    root_prob         0.05: fraction of samples that restart from the prompt (independent
                      samples); the rest branch off an earlier sample. Assumed.
    branch_keep       0.7-1.0 of the parent's turns kept at a branch: assumed uniform.
    branch_turns      1-2 new turns after a branch point (retries / alternative actions explored
                      from a shared state, then the episode ends): assumed. root_prob, branch_keep
                      and branch_turns are chosen so that the trees compress about 5-6x, the regime
                      of the published HARTS end-to-end figure; they are not measured statistics.
    max_tokens        65,536: context limit of long-context SWE RL runs (32K-64K); assumed.
    vocab_size        32,000 (token ids are random: values do not matter for cost).
    """

    num_groups: int = 4
    group_size: tuple[int, int] = (8, 16)
    turns: tuple[int, int] = (10, 50)
    system_tokens: tuple[int, int] = (1500, 2500)
    task_tokens_median: float = 600.0
    task_tokens_sigma: float = 0.8
    task_tokens_max: int = 4000
    assistant_tokens_median: float = 150.0
    assistant_tokens_sigma: float = 0.7
    assistant_tokens_range: tuple[int, int] = (20, 2000)
    env_tokens_median: float = 400.0
    env_tokens_sigma: float = 1.2
    env_tokens_range: tuple[int, int] = (10, 8000)
    root_prob: float = 0.05
    branch_keep: tuple[float, float] = (0.7, 1.0)
    branch_turns: tuple[int, int] = (1, 2)
    max_tokens: int = 65536
    vocab_size: int = 32000
    seed: int = 0


SWE_BENCH_LIKE = TreeWorkloadConfig()

# tau-bench (Yao et al. 2024, arXiv 2406.12045): a simulated user and an agent with domain tools
# (retail / airline) under a written policy. Values assumed from the benchmark's format: a long
# policy + tool schema prompt (2-4K), 5-20 short turns, JSON tool results and user replies
# (median 120 tokens, lighter tail), groups of 4-8, trajectories well under 16K tokens.
TAU_BENCH_LIKE = TreeWorkloadConfig(
    num_groups=8, group_size=(4, 8), turns=(5, 20), system_tokens=(2000, 4000), task_tokens_median=80.0,
    task_tokens_sigma=0.5, task_tokens_max=400, assistant_tokens_median=60.0, assistant_tokens_sigma=0.6,
    assistant_tokens_range=(10, 400), env_tokens_median=120.0, env_tokens_sigma=0.8, env_tokens_range=(5, 2000),
    root_prob=0.25, branch_keep=(0.3, 1.0), branch_turns=(1, 4), max_tokens=16384)


def _lognormal(rng: np.random.Generator, median: float, sigma: float, lo: int, hi: int) -> int:
    return int(min(hi, max(lo, rng.lognormal(np.log(median), sigma))))


def rollout_trees(cfg: TreeWorkloadConfig) -> list[Trajectory]:
    """Trajectories of ``cfg.num_groups`` branching groups (see :class:`TreeWorkloadConfig`), ids
    ``g{group}-s{sample}``, loss mask on assistant tokens, GRPO advantages; deterministic in
    ``cfg.seed``."""
    rng = np.random.default_rng(cfg.seed)
    out: list[Trajectory] = []
    for gid in range(cfg.num_groups):
        n = int(rng.integers(cfg.group_size[0], cfg.group_size[1] + 1))
        p_len = int(rng.integers(*cfg.system_tokens, endpoint=True)) + _lognormal(
            rng, cfg.task_tokens_median, cfg.task_tokens_sigma, 1, cfg.task_tokens_max)
        prompt = rng.integers(1, cfg.vocab_size, size=min(p_len, cfg.max_tokens // 2))
        samples: list[list[tuple[np.ndarray, int]]] = []   # per sample: turns (tokens, assistant length)
        for _ in range(n):
            want = int(rng.integers(cfg.turns[0], cfg.turns[1] + 1))
            turns: list[tuple[np.ndarray, int]] = []
            if samples and rng.random() >= cfg.root_prob:
                base = samples[int(rng.integers(len(samples)))]
                keep = int(round(len(base) * rng.uniform(*cfg.branch_keep)))
                turns = list(base[:keep])
                want = keep + int(rng.integers(cfg.branch_turns[0], cfg.branch_turns[1] + 1))
            used = len(prompt) + sum(len(t) for t, _ in turns)
            while len(turns) < want:
                a = _lognormal(rng, cfg.assistant_tokens_median, cfg.assistant_tokens_sigma, *cfg.assistant_tokens_range)
                e = _lognormal(rng, cfg.env_tokens_median, cfg.env_tokens_sigma, *cfg.env_tokens_range)
                if used + a + e > cfg.max_tokens:
                    break
                turns.append((rng.integers(1, cfg.vocab_size, size=a + e), a))
                used += a + e
            samples.append(turns)
        rewards = rng.normal(size=n)
        adv = (rewards - rewards.mean()) / (rewards.std() + 1e-6)
        for s, turns in enumerate(samples):
            tokens = np.concatenate([prompt] + [t for t, _ in turns])
            mask = np.concatenate([np.zeros(len(prompt), bool)] +
                                  [np.arange(len(t)) < a for t, a in turns])
            out.append(make_trajectory(len(out), tokens, cfg.vocab_size, traj_id=f"g{gid}-s{s}", group_id=f"g{gid}",
                                       loss_mask=mask, advantage=float(adv[s]), reward=float(rewards[s])))
    return out


def swe_bench_like(cfg: TreeWorkloadConfig = SWE_BENCH_LIKE) -> list[Trajectory]:
    """SWE-bench-like agentic trees (defaults: :data:`SWE_BENCH_LIKE`; 10-50 turns, heavy-tailed
    tool outputs, up to 64K tokens). Override with ``dataclasses.replace(SWE_BENCH_LIKE, ...)``."""
    return rollout_trees(cfg)


def tau_bench_like(cfg: TreeWorkloadConfig = TAU_BENCH_LIKE) -> list[Trajectory]:
    """tau-bench-like conversational trees (defaults: :data:`TAU_BENCH_LIKE`; shorter turns and
    trajectories, long policy prompt)."""
    return rollout_trees(cfg)


def sweep_batch(total_tokens: int, compression: float, *, seed: int = 0, **kw) -> list[Trajectory]:
    """:func:`sweep_trees` as Trajectories (ids ``c{compression}-g{group}-s{i}``, loss mask on all
    tokens after the prompt-free first one, advantage +-1)."""
    out: list[Trajectory] = []
    for g, trajs in enumerate(sweep_trees(total_tokens, compression, seed=seed, **kw)):
        for i, toks in enumerate(trajs):
            mask = np.ones(len(toks), bool)
            mask[0] = False
            out.append(make_trajectory(len(out), toks, traj_id=f"c{compression:g}-g{g}-s{i}", group_id=f"c{compression:g}-g{g}",
                                       loss_mask=mask, advantage=1.0 if i % 2 else -1.0))
    return out


def summary(trajs: list[Trajectory]) -> dict:
    """Trajectory count, groups, trajectory / compact tokens, compression, longest trajectory."""
    from .tree import trees_from_trajectories
    trees = trees_from_trajectories(trajs)
    traj_tok = sum(len(t) for t in trajs)
    compact = sum(t.num_tokens for t in trees)
    return dict(trajectories=len(trajs), groups=len(trees), trajectory_tokens=traj_tok, compact_tokens=compact,
                compression=traj_tok / compact, max_len=max(len(t) for t in trajs))


def main(argv: list[str] | None = None) -> int:
    import argparse
    import dataclasses
    import json

    from .tree import write_jsonl

    ap = argparse.ArgumentParser(description="Write a synthetic rollout batch as trajectory JSONL.")
    ap.add_argument("kind", choices=["swe", "tau", "sweep"])
    ap.add_argument("--out", required=True, help="JSONL file")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--groups", type=int, help="tasks (swe/tau)")
    ap.add_argument("--max-tokens", type=int, help="context limit per trajectory (swe/tau)")
    ap.add_argument("--compression", type=float, default=4.0, help="target compression (sweep)")
    ap.add_argument("--total-tokens", type=int, default=131072, help="trajectory tokens (sweep)")
    a = ap.parse_args(argv)
    for name in ("groups", "max_tokens", "total_tokens"):
        if getattr(a, name) is not None and getattr(a, name) < 1:
            ap.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(a, name)}")
    try:
        if a.kind == "sweep":
            trajs = sweep_batch(a.total_tokens, a.compression, seed=a.seed)
        else:
            cfg = SWE_BENCH_LIKE if a.kind == "swe" else TAU_BENCH_LIKE
            over = {k: v for k, v in (("num_groups", a.groups), ("max_tokens", a.max_tokens)) if v is not None}
            trajs = rollout_trees(dataclasses.replace(cfg, seed=a.seed, **over))
        write_jsonl(a.out, trajs)
    except (ValueError, OSError) as e:      # e.g. --compression out of range, --max-tokens below the prompt
        ap.error(str(e))
    print(json.dumps(summary(trajs)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
