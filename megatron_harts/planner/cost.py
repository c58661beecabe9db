"""Cost model of one microbatch of tree work (docs/design.md#10-planner).

Units: FLOPs of forward + backward (about 3x forward) for the whole model, replay excluded:

    cost = per_token * compact_tokens + per_ancestor * sum_u (position(u) + 1) + per_round * rounds

``sum_u (position(u) + 1)`` counts the (query, key) pairs of full attention over the tree (the
ancestors-or-self of every compact token); ``rounds`` is the number of varlen calls of each
linear-attention layer (the height of the chunk plan's sequence tree, max over the microbatch's
trees). ``per_round`` is a launch/latency overhead in FLOP-equivalents (seconds x FLOP/s);
its default is a guess until fitted from measured layer times.
"""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass

import numpy as np

ATTENTION, LINEAR, MLP, MOE = "*", "GM", "-", "E"


@dataclass(frozen=True)
class CostModel:
    """per_token: FLOPs per compact token (all layers); per_ancestor: FLOPs per (token,
    ancestor) pair summed over attention layers; per_round: FLOP-equivalents per round of the
    linear-attention layers (all of them together)."""

    per_token: float = 1.0
    per_ancestor: float = 0.0
    per_round: float = 0.0

    @classmethod
    def from_pattern(cls, pattern: str, hidden: int, *, head_dim: int = 128, ffn_hidden: int | None = None,
                     moe_ffn_hidden: int | None = None, moe_topk: int = 8, num_experts: int = 0,
                     kv_fraction: float = 1.0, vocab_size: int = 0, chunk_size: int = 64,
                     round_latency_s: float = 2e-4, flops_per_s: float = 4e14) -> "CostModel":
        """FLOP-based coefficients for a Megatron hybrid layer pattern (``G`` GDN, ``M`` Mamba2,
        ``*`` attention, ``-`` MLP, ``E`` MoE; other symbols such as ``|`` ignored).

        hidden: model width h; ffn_hidden: MLP width (default 4h, gated: 3 matrices);
        kv_fraction: K/V width over h (GQA); round_latency_s x flops_per_s: overhead of one
        round of one linear-attention layer (fwd + bwd), in FLOP-equivalents.
        """
        h = float(hidden)
        ffn = float(ffn_hidden or 4 * hidden)
        moe_ffn = float(moe_ffn_hidden or ffn)
        fwd = {
            "*": 2 * h * h * (2 + 2 * kv_fraction),                     # q, o + k, v projections
            "G": 2 * 5 * h * h + 4 * chunk_size * h + 4 * h * head_dim,  # q,k,v,z,o + chunked core
            "M": 2 * 5 * h * h + 4 * chunk_size * h + 4 * h * head_dim,  # Mamba2 as scalar-gated GLA
            "-": 2 * 3 * h * ffn,
            "E": 2 * 3 * h * moe_ffn * moe_topk + 2 * h * num_experts,
        }
        per_token = sum(fwd.get(s, 0.0) for s in pattern) + 2 * h * vocab_size
        n_att = sum(s in ATTENTION for s in pattern)
        n_lin = sum(s in LINEAR for s in pattern)
        return cls(per_token=3 * per_token, per_ancestor=3 * 4 * h * n_att,
                   per_round=n_lin * round_latency_s * flops_per_s)

    def to_json(self, path, **extra) -> None:
        """Write the coefficients (and ``extra`` keys, e.g. fit statistics) as one JSON object."""
        with open(path, "w") as f:
            json.dump({**asdict(self), **extra}, f, indent=1)

    @classmethod
    def from_json(cls, path) -> "CostModel":
        """Coefficients ``per_token``, ``per_ancestor``, ``per_round`` of a JSON object (other keys
        ignored), e.g. written by ``scripts/calibrate_cost.py``:
        ``plan(trees, ..., cost_model=CostModel.from_json(path))``."""
        with open(path) as f:
            d = json.load(f)
        return cls(**{k: float(d[k]) for k in ("per_token", "per_ancestor", "per_round")})

    def tree_cost(self, tokens, ancestors) -> np.ndarray:
        """Additive part of the cost (FLOPs) for arrays of compact tokens and ancestor pairs."""
        return self.per_token * np.asarray(tokens, dtype=np.float64) + \
            self.per_ancestor * np.asarray(ancestors, dtype=np.float64)

    def microbatch_cost(self, tokens: float, ancestors: float, rounds: int) -> float:
        """Cost (FLOPs) of one microbatch; ``rounds`` is the max over its trees (0 if empty)."""
        return float(self.tree_cost(tokens, ancestors)) + self.per_round * rounds
