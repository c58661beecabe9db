"""TreePack: the compact DFS layout of one microbatch of rollout trees."""
from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any, Callable, Sequence

import numpy as np
import torch

from ..tree import RolloutTree, Trajectory


@dataclass
class TreePack:
    """Compact tokens of a microbatch (T tokens, n trajectories), trees laid out one after another.

    tokens, position_ids, parent, subtree_end, multiplicity: int64 ``[T]``. ``parent`` is -1 at a
    root; ``[u, subtree_end[u])`` is the subtree of ``u``; ``position_ids[u]`` is the index of ``u``
    in its trajectories (for RoPE); ``multiplicity[u]`` counts the trajectories through ``u``.
    ``traj_index``: int64 ``[sum L]``, the compact indices of every trajectory in order, with
    offsets ``traj_cu_seqlens`` ``[n + 1]``; ``index_of_trajectory[i]`` is trajectory i's slice.
    ``tree_cu``: ``[num_trees + 1]`` compact offsets of the trees. Derived plans (chunk rounds,
    conv ancestors, attention masks) are cached per pack by :meth:`cached`.
    """

    tokens: torch.Tensor
    position_ids: torch.Tensor
    parent: torch.Tensor
    subtree_end: torch.Tensor
    multiplicity: torch.Tensor
    traj_index: torch.Tensor
    traj_cu_seqlens: torch.Tensor
    tree_cu: torch.Tensor
    chunk_size: int = 64
    trajectories: list[Trajectory] = field(default_factory=list, repr=False)
    _cache: dict = field(default_factory=dict, repr=False)

    @property
    def num_tokens(self) -> int:
        return int(self.tokens.shape[0])

    @property
    def num_trajectories(self) -> int:
        return int(self.traj_cu_seqlens.shape[0] - 1)

    @property
    def num_trajectory_tokens(self) -> int:
        return int(self.traj_index.shape[0])

    @property
    def compression(self) -> float:
        return self.num_trajectory_tokens / max(self.num_tokens, 1)

    @property
    def trajectory_lengths(self) -> torch.Tensor:
        return self.traj_cu_seqlens[1:] - self.traj_cu_seqlens[:-1]

    @property
    def index_of_trajectory(self) -> list[torch.Tensor]:
        """Per trajectory, the LongTensor of its compact token indices (views of ``traj_index``)."""
        return list(torch.split(self.traj_index, self.trajectory_lengths_host))

    @property
    def max_token(self) -> int:
        """The largest token id (a host int; cached under a ``"host"`` key, so a pack moved by
        :meth:`to` from the host reads nothing back from the device)."""
        return self.cached(("host", "max_token"), lambda: int(self.tokens.max()) if self.num_tokens else -1)

    @property
    def trajectory_lengths_host(self) -> list[int]:
        """``trajectory_lengths`` as a host list (cached like :attr:`max_token`)."""
        return self.cached(("host", "trajectory_lengths"), lambda: self.trajectory_lengths.tolist())

    @property
    def device(self) -> torch.device:
        return self.tokens.device

    @property
    def root_cu_seqlens(self) -> torch.Tensor:
        """int32 ``[R + 1]`` offsets of the R root subtrees, the contiguous independent segments of
        the layout (for ``pack_trajectories`` output: the trajectories). Cached."""
        def build():
            roots = torch.nonzero(self.parent < 0).flatten()
            return torch.cat([roots, roots.new_tensor([self.num_tokens])]).to(torch.int32)
        return self.cached(("root_cu_seqlens", str(self.device)), build)

    @property
    def root_segments(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``root_cu_seqlens`` as int64 on the pack's device and on the host (fla's varlen
        ``cu_seqlens`` / ``cu_seqlens_cpu``). Cached: one device-to-host copy per pack."""
        def build():
            cu = self.root_cu_seqlens.long()
            return cu, cu.cpu()
        return self.cached(("root_segments", str(self.device)), build)

    @property
    def is_chain(self) -> bool:
        """Every root subtree is a single path (no branches): the layout of ``pack_trajectories``,
        where tree ops reduce to their varlen (THD) kernels. Cached."""
        def build():
            idx = torch.arange(self.num_tokens, device=self.parent.device)
            return bool(((self.parent == idx - 1) | (self.parent < 0)).all())
        return self.cached(("host", "is_chain"), build)

    def cached(self, key: Any, build: Callable[[], Any]) -> Any:
        """Return the plan stored under ``key``, building it once with ``build()``."""
        if key not in self._cache:
            self._cache[key] = build()
        return self._cache[key]

    def to(self, device: torch.device | str) -> "TreePack":
        """A copy on ``device``; device-independent cached plans (numpy, host values: ``"host"`` keys)
        are shared. Moving from the host first caches :attr:`max_token`, :attr:`trajectory_lengths_host`
        and :attr:`is_chain`, whose reads on the device would wait for the GPU (in the log-probs, after
        the whole forward had been issued)."""
        device = torch.device(device)
        if device == self.device:
            return self
        if self.device.type == "cpu":   # host values the ops read, taken here instead of from the device mid-step
            self.max_token, self.trajectory_lengths_host, self.is_chain   # noqa: B018 (cached)
        moved = {k: getattr(self, k).to(device) for k in
                 ("tokens", "position_ids", "parent", "subtree_end", "multiplicity", "traj_index",
                  "traj_cu_seqlens", "tree_cu")}
        host = {k: v for k, v in self._cache.items() if isinstance(k, tuple) and k and k[0] == "host"}
        return replace(self, **moved, _cache=host)


def pack(trees: Sequence[RolloutTree], chunk_size: int = 64) -> TreePack:
    """Concatenate the tries of ``trees`` into one :class:`TreePack` (linear time, vectorised)."""
    if not trees:
        raise ValueError("pack() needs at least one tree")
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
    tries = [t.trie for t in trees]
    sizes = np.array([t.num_nodes for t in tries], dtype=np.int64)
    tree_cu = np.zeros(len(tries) + 1, dtype=np.int64)
    np.cumsum(sizes, out=tree_cu[1:])
    node_off = np.repeat(tree_cu[:-1], sizes)
    parent = np.concatenate([t.parent for t in tries])
    parent = np.where(parent >= 0, parent + node_off, -1)
    traj_sizes = np.array([t.traj_index.shape[0] for t in tries], dtype=np.int64)
    traj_index = np.concatenate([t.traj_index for t in tries]) + np.repeat(tree_cu[:-1], traj_sizes)
    lengths = np.concatenate([np.diff(t.traj_cu) for t in tries])
    traj_cu = np.zeros(lengths.shape[0] + 1, dtype=np.int64)
    np.cumsum(lengths, out=traj_cu[1:])
    t = torch.from_numpy
    return TreePack(
        tokens=t(np.concatenate([x.tokens for x in tries])),
        position_ids=t(np.concatenate([x.position for x in tries])),
        parent=t(parent),
        subtree_end=t(np.concatenate([x.subtree_end for x in tries]) + node_off),
        multiplicity=t(np.concatenate([x.multiplicity for x in tries])),
        traj_index=t(traj_index),
        traj_cu_seqlens=t(traj_cu),
        tree_cu=t(tree_cu),
        chunk_size=chunk_size,
        trajectories=[r for tree in trees for r in tree.records],
    )


def pack_trajectories(trees: Sequence[RolloutTree], chunk_size: int = 64) -> TreePack:
    """The trajectory-wise baseline layout: every trajectory its own chain (THD packing)."""
    return pack([RolloutTree(tree.records, merge_prefixes=False) for tree in trees], chunk_size=chunk_size)
