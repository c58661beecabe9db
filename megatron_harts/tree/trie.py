"""Vectorised token-trie construction: identical prefixes of trajectories become one node.

The trie is returned in DFS pre-order so that every subtree is a contiguous index range.
Children are ordered by token id (the lexicographic order of the trajectories), which makes
the layout a pure function of the set of token lists.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class Trie:
    """Compact DFS layout of a token trie (N nodes, n trajectories).

    tokens, position, parent, subtree_end, multiplicity: int64 ``[N]``; ``parent`` is -1 at a
    root, ``[u, subtree_end[u])`` is the subtree of ``u``, ``multiplicity[u]`` counts the
    trajectories through ``u``. ``traj_index``: int64 ``[sum L]``, for each trajectory in input
    order its node indices; ``traj_cu``: int64 ``[n + 1]`` offsets into it.
    """

    tokens: np.ndarray
    position: np.ndarray
    parent: np.ndarray
    subtree_end: np.ndarray
    multiplicity: np.ndarray
    traj_index: np.ndarray
    traj_cu: np.ndarray

    @property
    def num_nodes(self) -> int:
        return int(self.tokens.shape[0])

    @property
    def num_trajectories(self) -> int:
        return int(self.traj_cu.shape[0] - 1)

    def trajectory_index(self, i: int) -> np.ndarray:
        return self.traj_index[self.traj_cu[i]:self.traj_cu[i + 1]]


def _segment_ids(lengths: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(segment id, offset within segment) of every element of concatenated segments."""
    total = int(lengths.sum())
    seg = np.repeat(np.arange(len(lengths), dtype=np.int64), lengths)
    starts = np.zeros(len(lengths), dtype=np.int64)
    np.cumsum(lengths[:-1], out=starts[1:])
    return seg, np.arange(total, dtype=np.int64) - starts[seg]


def build_trie(seqs: list[np.ndarray], merge_prefixes: bool = True) -> Trie:
    """Build the trie of ``seqs`` (non-empty int64 arrays of non-negative ids).

    With ``merge_prefixes=False`` every trajectory stays its own chain (the trajectory-wise
    layout, in input order). Time is linear in the total number of tokens plus one sort of the
    trajectories; the Python loops run over trajectories (numpy slices), never over tokens.
    """
    n = len(seqs)
    lens = np.fromiter((len(s) for s in seqs), dtype=np.int64, count=n)
    if merge_prefixes:
        # Big-endian unsigned bytes compare like the id sequences, and a prefix sorts first.
        keys = [np.asarray(s, dtype=">u8").tobytes() for s in seqs]
        order = np.array(sorted(range(n), key=keys.__getitem__), dtype=np.int64)
    else:
        order = np.arange(n, dtype=np.int64)
    s_lens = lens[order]
    flat = np.concatenate([np.asarray(seqs[i], dtype=np.int64) for i in order])
    off = np.zeros(n + 1, dtype=np.int64)
    np.cumsum(s_lens, out=off[1:])

    # lcp[j]: longest common prefix of sorted trajectories j-1 and j (0 for j = 0): the first
    # mismatch of each neighbouring pair, one vectorised comparison per pair.
    lcp = np.zeros(n, dtype=np.int64)
    if merge_prefixes and n > 1:
        m = np.minimum(s_lens[:-1], s_lens[1:]).tolist()
        o = off.tolist()
        for j in range(1, n):
            a, b, k = o[j - 1], o[j], m[j - 1]
            d = flat[a:a + k] != flat[b:b + k]
            first = int(d.argmax())
            lcp[j] = first if d[first] else k

    seg, p = _segment_ids(s_lens)
    own = p >= lcp[seg]  # this trajectory creates the node at position p
    # Own positions number the nodes in order; a shared position (p < lcp[j]) has the node of the
    # same position of the previous sorted trajectory, already resolved when trajectories are
    # filled in sorted order: one slice copy per trajectory (n - 1 copies of sum(lcp) tokens).
    node = np.cumsum(own) - 1
    for j in np.flatnonzero(lcp).tolist():
        node[off[j]:off[j] + lcp[j]] = node[off[j - 1]:off[j - 1] + lcp[j]]

    tokens = flat[own]
    position = p[own]
    num_nodes = tokens.shape[0]
    prev = np.concatenate([[-1], node[:-1]])
    parent = np.where(p == 0, -1, prev)[own]
    multiplicity = np.bincount(node, minlength=num_nodes).astype(np.int64)
    # Trajectories through a node are contiguous in sorted order, and its subtree ends where
    # the last of them stops creating nodes.
    new_counts = np.bincount(seg[own], minlength=n).astype(np.int64)
    new_end = np.cumsum(new_counts)
    owner = seg[own]
    subtree_end = new_end[owner + multiplicity - 1]

    # Back to input order.
    rank = np.empty(n, dtype=np.int64)
    rank[order] = np.arange(n, dtype=np.int64)
    traj_cu = np.zeros(n + 1, dtype=np.int64)
    np.cumsum(lens, out=traj_cu[1:])
    o = off.tolist()
    traj_index = np.concatenate([node[o[r]:o[r + 1]] for r in rank.tolist()])
    return Trie(tokens, position, parent, subtree_end, multiplicity, traj_index, traj_cu)
