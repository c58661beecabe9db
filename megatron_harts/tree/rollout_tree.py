"""Rollout trees: trajectories with shared prefixes merged into a token trie."""
from __future__ import annotations

from typing import Iterable, Sequence


from .trajectory import Trajectory, TreeValidationError, make_trajectory
from .trie import Trie, build_trie

_FIELDS = ("traj_ids", "group_ids", "loss_masks", "old_logprobs", "ref_logprobs", "advantages", "rewards")
_SINGULAR = {"traj_ids": "traj_id", "group_ids": "group_id", "loss_masks": "loss_mask",
             "old_logprobs": "old_logprobs", "ref_logprobs": "ref_logprobs",
             "advantages": "advantage", "rewards": "reward"}


class RolloutTree:
    """Trajectories (in input order) and the trie of their tokens.

    Build with :meth:`from_trajectories`; ``trie`` holds the compact DFS layout
    (see :class:`~megatron_harts.tree.trie.Trie`).
    """

    def __init__(self, trajectories: list[Trajectory], merge_prefixes: bool = True):
        if not trajectories:
            raise TreeValidationError("a rollout tree needs at least one trajectory")
        ids = [t.traj_id for t in trajectories if t.traj_id is not None]
        if len(set(ids)) != len(ids):
            seen, dup = set(), None
            for x in ids:
                if x in seen:
                    dup = x
                    break
                seen.add(x)
            raise TreeValidationError(f"field 'traj_id': duplicate trajectory id {dup!r}")
        self._trajectories = list(trajectories)
        self.trie: Trie = build_trie([t.tokens for t in trajectories], merge_prefixes=merge_prefixes)

    @classmethod
    def from_trajectories(cls, token_lists: Sequence[Sequence[int]], *, vocab_size: int | None = None,
                          merge_prefixes: bool = True, **fields) -> "RolloutTree":
        """Merge trajectories into one tree.

        token_lists: one id list per trajectory (alone sufficient). Optional per-trajectory
        lists, same length as ``token_lists``: ``traj_ids``, ``group_ids``, ``loss_masks``,
        ``old_logprobs``, ``ref_logprobs``, ``advantages`` (float or per-token), ``rewards``.
        """
        n = len(token_lists)
        for k, v in fields.items():
            if k not in _FIELDS:
                raise TypeError(f"unknown field {k!r}; expected one of {', '.join(_FIELDS)}")
            if v is not None and len(v) != n:
                raise TreeValidationError(f"field '{k}' has {len(v)} entries for {n} trajectories")
        trajs = [make_trajectory(i, toks, vocab_size,
                                 **{_SINGULAR[k]: v[i] for k, v in fields.items() if v is not None})
                 for i, toks in enumerate(token_lists)]
        return cls(trajs, merge_prefixes=merge_prefixes)

    def __len__(self) -> int:
        return len(self._trajectories)

    def trajectories(self) -> list[Trajectory]:
        """The trajectories in input order; tokens are read back from the trie."""
        out = []
        for i, t in enumerate(self._trajectories):
            toks = self.trie.tokens[self.trie.trajectory_index(i)]
            out.append(Trajectory(toks, t.traj_id, t.group_id, t.loss_mask, t.old_logprobs, t.ref_logprobs,
                                  t.advantage, t.reward, dict(t.extra)))
        return out

    @property
    def records(self) -> list[Trajectory]:
        """The stored trajectory records (no copy)."""
        return self._trajectories

    @property
    def num_tokens(self) -> int:
        """Compact (distinct trie) tokens."""
        return self.trie.num_nodes

    @property
    def num_trajectory_tokens(self) -> int:
        return int(self.trie.traj_cu[-1])

    @property
    def compression(self) -> float:
        return self.num_trajectory_tokens / self.num_tokens

    def __repr__(self) -> str:
        return (f"RolloutTree({len(self)} trajectories, {self.num_trajectory_tokens} trajectory tokens, "
                f"{self.num_tokens} compact tokens, {self.compression:.2f}x)")


def trees_from_trajectories(trajectories: Iterable[Trajectory], merge_prefixes: bool = True) -> list[RolloutTree]:
    """One tree per ``group_id`` (in order of first appearance); trajectories without a group
    form one tree each."""
    groups: dict[object, list[Trajectory]] = {}
    for i, t in enumerate(trajectories):
        key = ("group", t.group_id) if t.group_id is not None else ("single", i)
        groups.setdefault(key, []).append(t)
    return [RolloutTree(g, merge_prefixes=merge_prefixes) for g in groups.values()]
