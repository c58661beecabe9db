"""Trajectory JSONL: one trajectory a line.

``{"id": "t0", "group": "task-17", "tokens": [1, 2, 3], "loss_mask": [0, 1, 1],
"old_logprobs": [0.0, -1.2, -0.3], "ref_logprobs": [...], "advantage": 0.5, "reward": 1.0}``

Only ``tokens`` is required. ``advantage`` may be a number or a per-token list; unknown keys
are kept in ``Trajectory.extra``.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Iterable

import numpy as np

from .trajectory import Trajectory, TreeValidationError, make_trajectory

_KEYS = {"id": "traj_id", "group": "group_id", "tokens": "tokens", "loss_mask": "loss_mask",
         "old_logprobs": "old_logprobs", "ref_logprobs": "ref_logprobs", "advantage": "advantage",
         "reward": "reward"}


def read_jsonl(path: str | Path, vocab_size: int | None = None) -> list[Trajectory]:
    out = []
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                rec = json.loads(line)
            except json.JSONDecodeError as e:
                raise TreeValidationError(f"{path}:{lineno}: not valid JSON ({e})") from e
            if not isinstance(rec, dict):
                raise TreeValidationError(f"{path}:{lineno}: expected a JSON object, got {type(rec).__name__}")
            if "tokens" not in rec:
                raise TreeValidationError(f"{path}:{lineno}: field 'tokens' is missing")
            fields = {_KEYS.get(k, k): v for k, v in rec.items() if k != "tokens"}
            try:
                out.append(make_trajectory(len(out), rec["tokens"], vocab_size, **fields))
            except TreeValidationError as e:
                raise TreeValidationError(f"{path}:{lineno}: {e}") from e
    return out


def _plain(x):
    if isinstance(x, np.ndarray):
        return x.astype(int).tolist() if x.dtype == bool else x.tolist()
    return x


def write_jsonl(path: str | Path, trajectories: Iterable[Trajectory]) -> None:
    with open(path, "w", encoding="utf-8") as f:
        for t in trajectories:
            rec = {"id": t.traj_id, "group": t.group_id, "tokens": t.tokens.tolist(), "loss_mask": t.loss_mask,
                   "old_logprobs": t.old_logprobs, "ref_logprobs": t.ref_logprobs, "advantage": t.advantage,
                   "reward": t.reward, **t.extra}
            f.write(json.dumps({k: _plain(v) for k, v in rec.items() if v is not None}) + "\n")
