"""Per-trajectory RL fields flattened once, aligned with ``tree_token_logprobs`` output.

A trajectory of length ``L`` contributes its tokens ``1..L-1`` (``n = L - 1`` entries; entry 0 of
every per-token field is dropped). All trajectories are concatenated into flat ``[N]`` tensors,
``N = sum(n_i)``, with ``offsets [B+1]`` and ``seq_index [N]`` to find trajectory boundaries.
Nothing here depends on how (or whether) the batch was tree-packed.
"""
from __future__ import annotations

from dataclasses import dataclass, field, fields, replace
from typing import Sequence

import numpy as np
import torch

from ..tree.trajectory import Trajectory

# RLBatch field -> Trajectory field (for error messages).
_SOURCE = {"loss_mask": "loss_mask", "old_logprobs": "old_logprobs", "ref_logprobs": "ref_logprobs",
           "advantages": "advantage"}


def _where(i: int, t: Trajectory) -> str:
    return f"trajectory {i}" + (f" (id {t.traj_id!r})" if t.traj_id is not None else "")


@dataclass(eq=False)
class RLBatch:
    """Flat per-token RL fields of ``B`` trajectories; ``N = sum(lengths)``.

    loss_mask ``[N]`` bool; old_logprobs / ref_logprobs / advantages ``[N]`` fp32 or None when some
    trajectory lacks them (``missing`` then names the field and the first such trajectory);
    lengths ``[B]`` int64 (``L_i - 1``); offsets ``[B+1]`` int64; seq_index ``[N]`` int64.
    Host-side counts (no device sync): ``num_tokens`` = masked tokens, ``num_sequences`` =
    trajectories with at least one masked token, ``max_len`` = ``max(lengths)``. For losses
    that are exact across microbatches / DP ranks, sum these (max for ``max_len``) globally and
    pass them to :func:`policy_loss`.
    """

    loss_mask: torch.Tensor | None
    old_logprobs: torch.Tensor | None
    ref_logprobs: torch.Tensor | None
    advantages: torch.Tensor | None
    lengths: torch.Tensor
    offsets: torch.Tensor
    seq_index: torch.Tensor
    num_tokens: int
    num_sequences: int
    max_len: int
    missing: dict[str, str] = field(default_factory=dict)

    @property
    def batch_size(self) -> int:
        return int(self.lengths.shape[0])

    @property
    def total_len(self) -> int:
        """``N``: all entries, masked or not."""
        return int(self.seq_index.shape[0])

    @classmethod
    def from_trajectories(cls, trajs: Sequence[Trajectory], device: torch.device | str | None = None) -> "RLBatch":
        """Build from Trajectory records (e.g. ``TreePack.trajectories``, in pack order)."""
        if len(trajs) == 0:
            raise ValueError("RLBatch.from_trajectories: empty list of trajectories")
        lengths = np.array([len(t) - 1 for t in trajs], dtype=np.int64)
        missing: dict[str, str] = {}
        cols: dict[str, list[np.ndarray]] = {k: [] for k in _SOURCE}
        for i, t in enumerate(trajs):
            n = int(lengths[i])
            for name, src in _SOURCE.items():
                if name in missing:
                    continue
                val = getattr(t, src)
                if val is None:
                    missing[name] = _where(i, t)
                    continue
                arr = np.asarray(val)
                if name == "advantages" and arr.ndim == 0:
                    arr = np.full(n, float(arr), dtype=np.float32)
                else:
                    if arr.ndim != 1 or arr.shape[0] != n + 1:
                        raise ValueError(f"{_where(i, t)}: field '{src}' has shape {arr.shape}, "
                                         f"but 'tokens' has length {n + 1}")
                    arr = arr[1:]
                cols[name].append(arr.astype(bool if name == "loss_mask" else np.float32))
        out: dict[str, torch.Tensor | None] = {}
        for name in _SOURCE:
            out[name] = None if name in missing else torch.from_numpy(np.concatenate(cols[name])).to(device)
        if "loss_mask" in missing:
            num_tokens, num_sequences = 0, 0
        else:
            seq = np.repeat(np.arange(len(trajs)), lengths)
            weights = np.concatenate(cols["loss_mask"]).astype(np.float64)
            per_seq = np.bincount(seq, weights=weights, minlength=len(trajs))
            num_tokens, num_sequences = int(per_seq.sum()), int((per_seq > 0).sum())
        offsets = np.r_[0, np.cumsum(lengths)].astype(np.int64)
        return cls(**out,
                   lengths=torch.from_numpy(lengths).to(device),
                   offsets=torch.from_numpy(offsets).to(device),
                   seq_index=torch.repeat_interleave(torch.arange(len(trajs)), torch.from_numpy(lengths)).to(device),
                   num_tokens=num_tokens, num_sequences=num_sequences, max_len=int(lengths.max()),
                   missing=missing)

    def require(self, *names: str) -> None:
        """Raise ValueError naming the field and the first trajectory lacking it."""
        for name in names:
            if getattr(self, name) is None:
                who = self.missing.get(name, "some trajectory")
                raise ValueError(f"{who}: field '{_SOURCE.get(name, name)}' is missing "
                                 f"but needed by the chosen loss")

    def split(self, per_token: torch.Tensor) -> list[torch.Tensor]:
        """Flat ``[N, ...]`` -> per-trajectory list of ``[n_i, ...]``."""
        return list(torch.split(per_token, self.lengths.tolist()))

    def flatten(self, per_traj: Sequence[torch.Tensor] | torch.Tensor, name: str = "tensor") -> torch.Tensor:
        """Per-trajectory list of ``[n_i]`` (or flat ``[N]``) -> flat ``[N]``, shape-checked."""
        if isinstance(per_traj, torch.Tensor):
            if per_traj.dim() != 1 or per_traj.shape[0] != self.total_len:
                raise ValueError(f"{name}: expected flat [{self.total_len}], got {tuple(per_traj.shape)}")
            return per_traj
        if len(per_traj) != self.batch_size:
            raise ValueError(f"{name}: expected {self.batch_size} per-trajectory tensors, got {len(per_traj)}")
        for i, (x, n) in enumerate(zip(per_traj, self.lengths.tolist())):
            if x.dim() != 1 or x.shape[0] != n:
                raise ValueError(f"{name}: trajectory {i} expected shape [{n}], got {tuple(x.shape)}")
        return torch.cat(list(per_traj))

    def to(self, device: torch.device | str) -> "RLBatch":
        moved = {f.name: getattr(self, f.name).to(device) for f in fields(self)
                 if isinstance(getattr(self, f.name), torch.Tensor)}
        return replace(self, **moved)
