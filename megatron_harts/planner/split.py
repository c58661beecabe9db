"""Tree statistics for planning and splitting of trees over capacity at branch nodes.

A tree is described by its trajectories in DFS (lexicographic) order: lengths ``L_t`` and
``lcp_t``, the longest common prefix with the previous trajectory (0 for the first). Any
contiguous range of that order is a sub-tree cut at branch nodes, and its numbers follow from
prefix sums (all counts in tokens):

* compact tokens: ``L_i + sum_{t>i} (L_t - lcp_t)``;
* attention pairs: ``sum_u (position(u) + 1)``, per trajectory ``(L(L+1) - lcp(lcp+1)) / 2``;
* replay tokens of the chunk plan (chunk C): a trajectory that creates a non-first child at
  depth ``lcp`` (``L_t > lcp_t`` and ``L_{t-1} > lcp_t``) replays ``lcp_t mod C`` tokens. This is
  exact: such children are exactly the chunk instances that start inside a chunk;
* rounds: 1 + the max over paths of the number of distinct chunk indices ``(p + 1) // C >= 1``
  over the branch nodes (depth p) on the path (exact for the chunk plan of ops/plan.py; a part
  is charged its whole tree's rounds, an upper bound).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np


@dataclass
class TreeStats:
    """Per-trajectory statistics of ``n`` trees, trajectories of tree i at ``[cu[i], cu[i+1])``
    in DFS order. length, lcp, index (the trajectory's input index in its tree): int64 ``[sum n_i]``;
    rounds: int64 ``[n]``; chunk_size: C of the chunk plan."""

    cu: np.ndarray
    length: np.ndarray
    lcp: np.ndarray
    index: np.ndarray
    rounds: np.ndarray
    chunk_size: int = 64

    def __len__(self) -> int:
        return int(self.cu.shape[0] - 1)

    @classmethod
    def from_arrays(cls, cu, length, lcp, index=None, chunk_size: int = 64) -> "TreeStats":
        """From DFS-ordered lengths and lcps (validated); rounds computed here."""
        cu, length, lcp = (np.asarray(a, dtype=np.int64) for a in (cu, length, lcp))
        if index is None:
            index = np.arange(length.shape[0], dtype=np.int64) - np.repeat(cu[:-1], np.diff(cu))
        first = np.zeros(length.shape[0], dtype=bool)
        first[cu[:-1][np.diff(cu) > 0]] = True
        prev = np.concatenate([[0], length[:-1]])
        if (length < 1).any() or (lcp < 0).any() or (lcp[first] != 0).any() or \
                (lcp > np.minimum(length, np.where(first, 0, prev))).any():
            raise ValueError("invalid tree statistics: need length >= 1, lcp = 0 at a tree's first "
                             "trajectory and 0 <= lcp <= min(length, previous length)")
        st = cls(cu, length, lcp, np.asarray(index, dtype=np.int64), np.zeros(len(cu) - 1, np.int64), chunk_size)
        st.rounds = _rounds(st)
        return st

    # Per-trajectory increments (what trajectory t adds after t-1 of the same tree).
    def increments(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(new compact tokens, new attention pairs, replay tokens) of every trajectory."""
        L, p = self.length, self.lcp
        prev = np.concatenate([[0], L[:-1]])
        nonfirst_child = (p > 0) & (L > p) & (prev > p)
        return L - p, (L * (L + 1) - p * (p + 1)) // 2, np.where(nonfirst_child, p % self.chunk_size, 0)


def _rounds(st: TreeStats) -> np.ndarray:
    """Rounds of the chunk plan of every tree: the tree of deepest common nodes of consecutive
    DFS-ordered trajectories (an LCP-interval stack), then distinct chunk indices of branch nodes
    counted root to leaf. Python loop over the trajectories of trees with shared prefixes."""
    C = st.chunk_size
    L, P = st.length.tolist(), st.lcp.tolist()
    out = np.ones(len(st), dtype=np.int64)
    has = np.zeros(len(st), dtype=bool)
    nz = st.lcp > 0
    if nz.any():
        has[np.searchsorted(st.cu, np.flatnonzero(nz), side="right") - 1] = True
    for i in np.flatnonzero(has).tolist():
        a, b = int(st.cu[i]), int(st.cu[i + 1])
        depth: list[int] = []
        parent: list[int] = []
        branch: list[bool] = []
        stack: list[int] = []
        for t in range(a + 1, b):
            d = P[t] - 1
            last = -1
            while stack and depth[stack[-1]] > d:
                last = stack.pop()
                if stack and depth[stack[-1]] > d:
                    parent[last] = stack[-1]
            if d < 0:
                continue
            if stack and depth[stack[-1]] == d:
                node = stack[-1]
            else:
                node = len(depth)
                depth.append(d)
                parent.append(stack[-1] if stack else -1)
                branch.append(False)
                stack.append(node)
            if last >= 0:
                parent[last] = node
            if L[t] > P[t] and L[t - 1] > P[t]:
                branch[node] = True
        for j in range(1, len(stack)):
            parent[stack[j]] = stack[j - 1]
        count = [0] * len(depth)
        kk = [0] * len(depth)
        best = 0
        for v in sorted(range(len(depth)), key=depth.__getitem__):
            q = parent[v]
            c, k = (count[q], kk[q]) if q >= 0 else (0, 0)
            if branch[v]:
                kv = (depth[v] + 1) // C
                c += kv >= 1 and kv != k
                k = kv
            count[v], kk[v] = c, k
            best = max(best, c)
        out[i] = best + 1
    return out


def tree_stats(trees: Sequence, chunk_size: int = 64) -> TreeStats:
    """Statistics of RolloutTrees in time linear in trajectories (plus one copy of the node
    positions): in DFS pre-order the first node trajectory t does not share with t-1 is the node
    right after t-1's last node, so ``lcp_t = position(last(t-1) + 1)`` (``L_t`` for a duplicate)."""
    if len(trees) == 0:
        raise ValueError("empty batch: plan() needs at least one tree")
    tries = [t.trie for t in trees]
    n_nodes = np.array([t.num_nodes for t in tries], dtype=np.int64)
    node_off = np.concatenate([[0], np.cumsum(n_nodes)])
    n_traj = np.array([t.num_trajectories for t in tries], dtype=np.int64)
    cu = np.concatenate([[0], np.cumsum(n_traj)])
    lens = np.concatenate([np.diff(t.traj_cu) for t in tries])
    last = np.concatenate([t.traj_index[t.traj_cu[1:] - 1] + o for t, o in zip(tries, node_off[:-1].tolist())])
    position = np.concatenate([t.position for t in tries] + [np.zeros(1, np.int64)])
    order = np.argsort(last, kind="stable")  # offsets keep trees apart; a prefix sorts first
    last_o, L = last[order], lens[order]
    prev = np.concatenate([[-1], last_o[:-1]])
    lcp = np.where(last_o == prev, L, position[prev + 1])
    lcp[cu[:-1][n_traj > 0]] = 0
    index = order - np.repeat(cu[:-1], n_traj)
    return TreeStats.from_arrays(cu, L, lcp, index, chunk_size)


@dataclass
class Parts:
    """Planning units: whole trees or contiguous DFS ranges ``[start, stop)`` of their
    trajectories (global trajectory indices of the TreeStats). tokens: compact tokens; replay:
    replay tokens (memory = tokens + replay); ancestors: attention pairs; rounds: chunk-plan
    rounds (a split part gets its tree's, an upper bound); traj_tokens: trajectory tokens."""

    tree: np.ndarray
    start: np.ndarray
    stop: np.ndarray
    tokens: np.ndarray
    replay: np.ndarray
    ancestors: np.ndarray
    rounds: np.ndarray
    traj_tokens: np.ndarray
    whole: np.ndarray

    @property
    def memory(self) -> np.ndarray:
        return self.tokens + self.replay

    def __len__(self) -> int:
        return int(self.tree.shape[0])


def split_parts(st: TreeStats, capacity: int) -> Parts:
    """Whole trees that fit ``capacity`` (compact + replay tokens), greedy contiguous DFS ranges
    for those that do not; the shared prefix of a range is charged to it in full."""
    new, att, rep = st.increments()
    L = st.length
    if L.max() > capacity:
        t = int(np.argmax(L))
        tree = int(np.searchsorted(st.cu, t, side="right") - 1)
        raise ValueError(f"trajectory {int(st.index[t])} of tree {tree} has {int(L[t])} tokens, more than "
                         f"microbatch_capacity={capacity}; raise the capacity or drop/truncate it")
    z = lambda a: np.concatenate([[0], np.cumsum(a)])
    P_new, P_att, P_rep, P_len = z(new), z(att), z(rep), z(L)
    cu = st.cu
    mem_whole = (P_new[cu[1:]] - P_new[cu[:-1]]) + (P_rep[cu[1:]] - P_rep[cu[:-1]])
    big = mem_whole > capacity
    starts, stops, trees = [cu[:-1][~big]], [cu[1:][~big]], [np.flatnonzero(~big)]
    # Memory of [i, j): L_i + (P_new + P_rep)[j] - (P_new + P_rep)[i + 1]  (trajectory i starts fresh).
    P_mem = P_new + P_rep
    for i in np.flatnonzero(big).tolist():
        a, b = int(cu[i]), int(cu[i + 1])
        s, ss = [], []
        while a < b:
            j = int(np.searchsorted(P_mem, capacity - L[a] + P_mem[a + 1], side="right")) - 1
            j = min(max(j, a + 1), b)
            s.append(a)
            ss.append(j)
            a = j
        starts.append(np.array(s, np.int64))
        stops.append(np.array(ss, np.int64))
        trees.append(np.full(len(s), i, np.int64))
    start, stop, tree = (np.concatenate(x) for x in (starts, stops, trees))
    o = np.lexsort((start, tree))
    start, stop, tree = start[o], stop[o], tree[o]
    tokens = L[start] + P_new[stop] - P_new[start + 1]
    replay = P_rep[stop] - P_rep[start + 1]
    anc = L[start] * (L[start] + 1) // 2 + P_att[stop] - P_att[start + 1]
    whole = (start == cu[tree]) & (stop == cu[tree + 1])
    return Parts(tree, start, stop, tokens, replay, anc, st.rounds[tree], P_len[stop] - P_len[start], whole)
