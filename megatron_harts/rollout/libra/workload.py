"""Synthetic long-tailed, drifting agentic rollout traces for the Libra simulator (simulation input,
not measured data).

A step's batch is ``groups`` tasks x ``group_size`` samples sharing the task's prompt (GRPO
groups). A sample is a multi-turn program: each turn generates ``gen`` tokens (log-normal, heavy
tail), then the tool runs for ``tool_s`` seconds (log-normal) and returns an observation of
``obs`` tokens with a causal signal: *success* (then the program ends after the next turn with
probability ``p_end_success``), *error* (a retry: its observation is ``error_obs_factor`` times
larger) or neutral (the program ends with probability ``p_end_neutral``). ``max_turns`` caps it.

Drift: at training progress ``x = step / (steps - 1)`` the median generated tokens per turn are
``gen_median * (1 + gen_growth * x)``, both end probabilities are divided by
``1 + turn_growth * x`` (more turns) and observations grow by ``1 + obs_growth * x``: lengths grow
over training, as agentic RL runs report.
The defaults are a setting, not a measurement; docs/libra.md lists them.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from .cmlfq import SIGNAL_ERROR, SIGNAL_NONE, SIGNAL_SUCCESS


@dataclass(frozen=True)
class WorkloadConfig:
    groups: int = 32
    group_size: int = 8
    prompt_tokens: tuple[int, int] = (500, 2000)
    gen_median: float = 300.0
    gen_sigma: float = 1.0
    gen_max: int = 8192
    obs_median: float = 300.0
    obs_sigma: float = 1.0
    obs_max: int = 16384
    error_obs_factor: float = 3.0
    tool_median_s: float = 0.5
    tool_sigma: float = 1.0
    tool_max_s: float = 60.0
    p_success: float = 0.25
    p_error: float = 0.2
    p_end_success: float = 0.8
    p_end_neutral: float = 0.05
    max_turns: int = 30
    gen_growth: float = 1.5
    turn_growth: float = 1.0
    obs_growth: float = 0.0
    steps: int = 20
    seed: int = 0


@dataclass
class Program:
    """One sample: ``gen[i]`` tokens generated at turn ``i``; ``obs[i]``, ``tool_s[i]``, ``signal[i]``
    of the tool after turn ``i`` (the last turn has none: its entries are 0)."""

    group: int
    prompt: int
    gen: np.ndarray
    obs: np.ndarray
    tool_s: np.ndarray
    signal: np.ndarray
    extra: dict = field(default_factory=dict)

    @property
    def turns(self) -> int:
        return int(self.gen.size)

    @property
    def generated(self) -> int:
        return int(self.gen.sum())

    @property
    def tokens(self) -> int:
        """Trajectory tokens: prompt, every turn's generation and every observation."""
        return int(self.prompt + self.gen.sum() + self.obs.sum())

    def ctx_before(self, turn: int) -> int:
        """Context at the start of ``turn`` (prompt plus earlier turns and observations)."""
        return int(self.prompt + self.gen[:turn].sum() + self.obs[:turn].sum())


def _lognormal(rng, median, sigma, hi, size=None):
    return np.clip(np.rint(rng.lognormal(np.log(median), sigma, size)), 1, hi).astype(np.int64)


def sample_program(rng: np.random.Generator, cfg: WorkloadConfig, group: int, prompt: int, x: float) -> Program:
    """One program at training progress ``x`` in [0, 1]."""
    slow = 1.0 + cfg.turn_growth * x
    gen_med = cfg.gen_median * (1.0 + cfg.gen_growth * x)
    gens, obss, tools, sigs = [], [], [], []
    end_next = False
    for t in range(cfg.max_turns):
        gens.append(int(_lognormal(rng, gen_med, cfg.gen_sigma, cfg.gen_max)))
        last = end_next or t == cfg.max_turns - 1
        if not last:
            u = rng.random()
            sig = SIGNAL_SUCCESS if u < cfg.p_success else SIGNAL_ERROR if u < cfg.p_success + cfg.p_error else SIGNAL_NONE
            obs = int(_lognormal(rng, cfg.obs_median * (1.0 + cfg.obs_growth * x)
                                 * (cfg.error_obs_factor if sig == SIGNAL_ERROR else 1.0),
                                 cfg.obs_sigma, cfg.obs_max))
            p_end = (cfg.p_end_success if sig == SIGNAL_SUCCESS else cfg.p_end_neutral if sig == SIGNAL_NONE else 0.0) / slow
            end_next = rng.random() < p_end
            obss.append(obs)
            tools.append(float(min(cfg.tool_max_s, rng.lognormal(np.log(cfg.tool_median_s), cfg.tool_sigma))))
            sigs.append(sig)
        else:
            obss.append(0), tools.append(0.0), sigs.append(SIGNAL_NONE)
            break
    return Program(group, prompt, np.array(gens, np.int64), np.array(obss, np.int64), np.array(tools), np.array(sigs, np.int8))


def step_batch(cfg: WorkloadConfig, step: int, *, groups: int | None = None, group_offset: int = 0) -> list[Program]:
    """The batch of RL step ``step`` (deterministic in ``cfg.seed`` and ``step``); group ids start at
    ``group_offset``."""
    if not 0 <= step:
        raise ValueError(f"step must be >= 0, got {step}")
    rng = np.random.default_rng([cfg.seed, step, group_offset])
    x = step / max(1, cfg.steps - 1)
    out = []
    for g in range(groups if groups is not None else cfg.groups):
        prompt = int(rng.integers(cfg.prompt_tokens[0], cfg.prompt_tokens[1] + 1))
        out += [sample_program(rng, cfg, group_offset + g, prompt, x) for _ in range(cfg.group_size)]
    return out


def compact_tokens(programs: list[Program]) -> int:
    """Tokens of the step's rollout trees: each group's prompt once, every sample's own turns."""
    prompts = {p.group: p.prompt for p in programs}
    return int(sum(prompts.values()) + sum(p.tokens - p.prompt for p in programs))


def summary(programs: list[Program]) -> dict:
    gen = np.array([p.generated for p in programs])
    turns = np.array([p.turns for p in programs])
    toks = np.array([p.tokens for p in programs])
    return {"programs": len(programs), "generated_mean": float(gen.mean()), "generated_p99": float(np.quantile(gen, 0.99)),
            "turns_mean": float(turns.mean()), "turns_max": int(turns.max()), "tokens_mean": float(toks.mean()),
            "tokens": int(toks.sum()), "compact_tokens": compact_tokens(programs),
            "compression": float(toks.sum() / compact_tokens(programs))}
