"""One trajectory as RL frameworks hand it over, and its validation."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Sequence

import numpy as np


class TreeValidationError(ValueError):
    """Malformed rollout input; the message names the trajectory and the field."""


PER_TOKEN_FIELDS = ("loss_mask", "old_logprobs", "ref_logprobs")


@dataclass(eq=False)
class Trajectory:
    """A root-to-leaf token sequence and its RL fields.

    tokens: int64 ``[L]``. Per-token fields are ``[L]`` and aligned with ``tokens``: entry t
    refers to token t (so ``old_logprobs[t] = log p(tokens[t] | tokens[:t])``; entry 0 is
    unused and ``loss_mask[0]`` must be 0). ``advantage`` is a float or a ``[L]`` array.
    """

    tokens: np.ndarray
    traj_id: str | None = None
    group_id: str | None = None
    loss_mask: np.ndarray | None = None
    old_logprobs: np.ndarray | None = None
    ref_logprobs: np.ndarray | None = None
    advantage: float | np.ndarray | None = None
    reward: float | None = None
    extra: dict[str, Any] = field(default_factory=dict)

    def __len__(self) -> int:
        return int(self.tokens.shape[0])

    @property
    def name(self) -> str:
        return repr(self.traj_id) if self.traj_id is not None else "<unnamed>"


def make_trajectory(i: int, tokens: Sequence[int], vocab_size: int | None = None, **fields) -> Trajectory:
    """Convert and validate one trajectory; ``i`` is its index, used in error messages."""
    where = f"trajectory {i}" + (f" (id {fields['traj_id']!r})" if fields.get("traj_id") is not None else "")
    try:
        tok = np.asarray(tokens)
    except Exception as e:  # ragged nested lists and the like
        raise TreeValidationError(f"{where}: field 'tokens' is not a 1-D list of ints ({e})") from e
    if tok.ndim != 1:
        raise TreeValidationError(f"{where}: field 'tokens' must be 1-D, got shape {tok.shape}")
    if tok.shape[0] == 0:
        raise TreeValidationError(f"{where}: field 'tokens' is empty")
    if not np.issubdtype(tok.dtype, np.integer):
        raise TreeValidationError(f"{where}: field 'tokens' must hold integer ids, got dtype {tok.dtype}")
    tok = tok.astype(np.int64)
    if (tok < 0).any():
        j = int(np.flatnonzero(tok < 0)[0])
        raise TreeValidationError(f"{where}: field 'tokens' has a negative id {tok[j]} at position {j}")
    if vocab_size is not None and (tok >= vocab_size).any():
        j = int(np.flatnonzero(tok >= vocab_size)[0])
        raise TreeValidationError(
            f"{where}: field 'tokens' has id {tok[j]} at position {j}, outside the vocabulary of size {vocab_size}")
    L = tok.shape[0]
    out = {}
    for name in PER_TOKEN_FIELDS:
        val = fields.get(name)
        if val is None:
            out[name] = None
            continue
        try:
            arr = np.asarray(val, dtype=np.float32 if name != "loss_mask" else None)
        except (TypeError, ValueError) as e:  # strings, ragged lists
            raise TreeValidationError(f"{where}: field '{name}' is not a list of numbers ({e})") from e
        if arr.ndim != 1 or arr.shape[0] != L:
            raise TreeValidationError(
                f"{where}: field '{name}' has length {arr.shape[0] if arr.ndim == 1 else arr.shape}, "
                f"but 'tokens' has length {L}")
        if name == "loss_mask":
            if not (np.issubdtype(arr.dtype, np.bool_) or np.issubdtype(arr.dtype, np.number)):
                raise TreeValidationError(f"{where}: field 'loss_mask' must be 0/1 values, got dtype {arr.dtype}")
            if not np.isin(arr, (0, 1)).all():
                raise TreeValidationError(f"{where}: field 'loss_mask' must hold only 0 and 1")
            arr = arr.astype(bool)
            if arr[0]:
                raise TreeValidationError(
                    f"{where}: field 'loss_mask' is set at position 0, but the first token has no prefix "
                    "to predict it from")
        elif not np.isfinite(arr[1:]).all():
            raise TreeValidationError(f"{where}: field '{name}' has NaN or infinite values")
        out[name] = arr
    adv = fields.get("advantage")
    if adv is not None:
        try:
            a = np.asarray(adv, dtype=np.float32)
        except (TypeError, ValueError) as e:
            raise TreeValidationError(f"{where}: field 'advantage' must be a number or a per-token list ({e})") from e
        if a.ndim == 1 and a.shape[0] != L:
            raise TreeValidationError(f"{where}: field 'advantage' has length {a.shape[0]}, but 'tokens' has length {L}")
        if a.ndim > 1:
            raise TreeValidationError(f"{where}: field 'advantage' must be a number or a per-token list")
        if not np.isfinite(a).all():
            raise TreeValidationError(f"{where}: field 'advantage' has NaN or infinite values")
        adv = float(a) if a.ndim == 0 else a
    reward = fields.get("reward")
    if reward is not None:
        try:
            reward = float(reward)
        except (TypeError, ValueError) as e:
            raise TreeValidationError(f"{where}: field 'reward' must be a number, got {reward!r}") from e
        if not np.isfinite(reward):
            raise TreeValidationError(f"{where}: field 'reward' is NaN or infinite")
    known = {"traj_id", "group_id", "advantage", "reward", *PER_TOKEN_FIELDS}
    return Trajectory(tokens=tok, traj_id=fields.get("traj_id"), group_id=fields.get("group_id"),
                      advantage=adv, reward=reward,
                      extra={k: v for k, v in fields.items() if k not in known and v is not None}, **out)
