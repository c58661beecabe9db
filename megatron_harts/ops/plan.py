"""Plans derived once per TreePack: chunk rounds for linear attention, conv ancestors.

Chunk plan (docs/design.md#4-chunked-linear-attention, §4.1). Trajectory-wise training cuts every
trajectory into chunks ``[kC, (k+1)C)``; the plan keeps that partition:

* a *chunk leaf* is a compact token at a chunk's last position or without children. Each one
  closes one *instance*: the path from the chunk's first token (the chunk root, position kC)
  to the leaf. The instance owns the tokens after the previous chunk leaf in DFS order (a
  contiguous range ``[own_start, leaf]``) and *replays* the shared tokens before it
  (``own_start``'s ancestors inside the chunk, fewer than C);
* an instance's initial state is the final state of the instance closed by its chunk root's
  parent; maximal unary chains of instances are *sequences* (contiguous in DFS order);
* sequences at the same depth of the sequence tree form one *round*: one varlen call.

Everything is vectorised numpy over tokens (one bounded loop over replay depth < C and one
pointer-jumping loop of log2(depth) steps), then moved to the pack's device once.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from ..packing import TreePack


@dataclass
class ChunkRound:
    """One varlen call over S sequences and N tokens.

    gather: int64 ``[N]`` compact index of each packed position (replay first in a sequence).
    cu_seqlens: int64 ``[S + 1]`` (device), ``cu_seqlens_cpu`` the same on the host.
    init_from: int64 ``[S]`` row of the previous round's final states each sequence starts
    from (None in round 0: zero states). keep: int64 ``[M]`` packed positions that are owned
    (not replay); their outputs are the round's results.
    """

    gather: torch.Tensor
    cu_seqlens: torch.Tensor
    cu_seqlens_cpu: torch.Tensor
    init_from: torch.Tensor | None
    keep: torch.Tensor


@dataclass
class ChunkPlan:
    """Rounds plus two whole-plan indices, so a layer does one gather per input and one per
    output (their backward is one scatter each, not one per round):

    gather_all: int64 ``[sum N_r]``, the rounds' ``gather`` concatenated (``round_sizes`` on the host);
    out_index: int64 ``[T]``, where compact token u's owned output sits in ``cat(o_r)``;
    replay_pos: int64 ``[P]``, the other (replayed) positions of ``cat(o_r)``; replay_rows: int64
    ``[U]``, the distinct compact tokens they hold, and replay_slot ``[P]`` which of those each holds;
    so the gather's backward is a gather plus P accumulations into U rows. replay_gather: int64
    ``[U + P]`` = ``cat(out_index[replay_rows], replay_pos)``, the owned positions of those U
    tokens then the replayed positions, so the backward reads both with one gather.
    owned_then_replay: int64 ``[T + P]`` = ``cat(out_index, replay_pos)`` and replay_token: int64
    ``[P]`` = ``gather_all[replay_pos]``, the compact token of each replayed position: the fp32
    backward gathers every row it needs at once and adds the P replayed rows into their owned rows
    in place (the same fp32 additions in the same order as through ``replay_gather``).
    """

    rounds: list[ChunkRound]
    gather_all: torch.Tensor
    round_sizes: list[int]
    out_index: torch.Tensor
    replay_pos: torch.Tensor
    replay_rows: torch.Tensor
    replay_slot: torch.Tensor
    chunk_size: int
    num_sequences: int
    num_replay_tokens: int
    replay_gather: torch.Tensor
    owned_then_replay: torch.Tensor
    replay_token: torch.Tensor

    @property
    def num_rounds(self) -> int:
        return len(self.rounds)


def _depth_in_forest(parent: np.ndarray) -> np.ndarray:
    """Depth of every node of a forest given by ``parent`` (-1 at roots), by pointer jumping."""
    dist = (parent >= 0).astype(np.int64)
    jump = parent.copy()
    while (jump >= 0).any():
        live = jump >= 0
        tgt = jump[live]
        dist[live] = dist[live] + dist[tgt]
        jump[live] = jump[tgt]
    return dist


def build_chunk_plan_host(parent: np.ndarray, position: np.ndarray, chunk_size: int) -> dict:
    """The chunk plan as numpy arrays (see module docstring)."""
    C = chunk_size
    T = parent.shape[0]
    has_child = np.zeros(T, dtype=bool)
    has_child[parent[parent >= 0]] = True
    leaves = np.flatnonzero((position % C == C - 1) | ~has_child)
    n_inst = leaves.shape[0]
    own_start = np.concatenate([[0], leaves[:-1] + 1]).astype(np.int64)
    replay_len = position[own_start] % C

    # Replay tokens of each instance: ancestors of own_start inside its chunk, root first.
    rep_off = np.zeros(n_inst + 1, dtype=np.int64)
    np.cumsum(replay_len, out=rep_off[1:])
    replay = np.empty(int(rep_off[-1]), dtype=np.int64)
    cur = own_start.copy()
    chunk_root = own_start.copy()
    for j in range(int(replay_len.max(initial=0))):
        act = np.flatnonzero(replay_len > j)
        cur[act] = parent[cur[act]]
        replay[rep_off[act] + replay_len[act] - 1 - j] = cur[act]
        chunk_root[act] = cur[act]

    # Instance graph: predecessor closes at the chunk root's parent.
    leaf_to_inst = np.full(T, -1, dtype=np.int64)
    leaf_to_inst[leaves] = np.arange(n_inst)
    root_parent = parent[chunk_root]
    pred = np.where(root_parent >= 0, leaf_to_inst[np.maximum(root_parent, 0)], -1)
    n_succ = np.bincount(pred[pred >= 0], minlength=n_inst)
    idx = np.arange(n_inst)
    continues = np.zeros(n_inst, dtype=bool)
    continues[1:] = (pred[1:] == idx[1:] - 1) & (n_succ[:-1] == 1)
    first_inst = np.flatnonzero(~continues)
    last_inst = np.concatenate([first_inst[1:] - 1, [n_inst - 1]])
    seq_of_inst = np.cumsum(~continues) - 1
    n_seq = first_inst.shape[0]
    seq_parent = np.where(pred[first_inst] >= 0, seq_of_inst[np.maximum(pred[first_inst], 0)], -1)
    depth = _depth_in_forest(seq_parent)

    seq_own_start = own_start[first_inst]
    seq_own_len = leaves[last_inst] + 1 - seq_own_start
    seq_rep_len = replay_len[first_inst]
    seq_rep_off = rep_off[first_inst]

    order = np.argsort(depth, kind="stable")
    rank = np.empty(n_seq, dtype=np.int64)
    n_rounds = int(depth.max()) + 1
    bounds = np.searchsorted(depth[order], np.arange(n_rounds + 1))
    rounds = []
    for r in range(n_rounds):
        seqs = order[bounds[r]:bounds[r + 1]]
        rank[seqs] = np.arange(seqs.shape[0])
        rl, ol = seq_rep_len[seqs], seq_own_len[seqs]
        lens = rl + ol
        cu = np.zeros(seqs.shape[0] + 1, dtype=np.int64)
        np.cumsum(lens, out=cu[1:])
        seg = np.repeat(np.arange(seqs.shape[0]), lens)
        off = np.arange(int(cu[-1]), dtype=np.int64) - cu[seg]
        is_rep = off < rl[seg]
        gather = seq_own_start[seqs][seg] + off - rl[seg]
        gather[is_rep] = replay[seq_rep_off[seqs][seg][is_rep] + off[is_rep]]
        init_from = rank[seq_parent[seqs]] if r > 0 else None
        rounds.append(dict(gather=gather, cu_seqlens=cu, init_from=init_from, keep=np.flatnonzero(~is_rep)))
    sizes = [rd["gather"].shape[0] for rd in rounds]
    starts = np.concatenate([[0], np.cumsum(sizes)[:-1]]).astype(np.int64)
    out_index = np.empty(T, dtype=np.int64)
    for rd, st in zip(rounds, starts):
        out_index[rd["gather"][rd["keep"]]] = st + rd["keep"]
    return dict(rounds=rounds, gather_all=np.concatenate([rd["gather"] for rd in rounds]), round_sizes=sizes,
                out_index=out_index, num_sequences=n_seq, num_replay_tokens=int(rep_off[-1]))


def chunk_plan(pack: TreePack, chunk_size: int | None = None) -> ChunkPlan:
    """The chunk plan of ``pack`` (built once, cached on the pack per chunk size and device)."""
    C = chunk_size or pack.chunk_size

    def host():
        return build_chunk_plan_host(pack.parent.cpu().numpy(), pack.position_ids.cpu().numpy(), C)

    def device():
        h = pack.cached(("host", "chunk_plan", C), host)
        dev = pack.device
        t = lambda a: torch.from_numpy(a).to(dev)
        rounds = [ChunkRound(gather=t(rd["gather"]), cu_seqlens=t(rd["cu_seqlens"]),
                             cu_seqlens_cpu=torch.from_numpy(rd["cu_seqlens"]),
                             init_from=None if rd["init_from"] is None else t(rd["init_from"]),
                             keep=t(rd["keep"]))
                  for rd in h["rounds"]]
        owned = np.zeros(len(h["gather_all"]), dtype=bool)
        owned[h["out_index"]] = True
        replay_pos = np.flatnonzero(~owned)
        rows, slot = np.unique(h["gather_all"][replay_pos], return_inverse=True)
        return ChunkPlan(rounds, t(h["gather_all"]), h["round_sizes"], t(h["out_index"]), t(replay_pos), t(rows),
                         t(slot.astype(np.int64)), C, h["num_sequences"], h["num_replay_tokens"],
                         t(np.concatenate([h["out_index"][rows], replay_pos]).astype(np.int64)),
                         t(np.concatenate([h["out_index"], replay_pos]).astype(np.int64)),
                         t(h["gather_all"][replay_pos].astype(np.int64)))

    return pack.cached(("chunk_plan", C, str(pack.device)), device)


def _conv_ancestors_host(pack: TreePack, width: int) -> np.ndarray:
    def build():
        parent = pack.parent.cpu().numpy()
        T = parent.shape[0]
        padded = np.concatenate([np.where(parent >= 0, parent, T), [T]])
        rows = [np.arange(T, dtype=np.int64)]
        for _ in range(width - 1):
            rows.append(padded[rows[-1]])
        return np.stack(rows)
    return pack.cached(("host", "conv_ancestors", width), build)


def _conv_fix_rows_host(pack: TreePack, width: int) -> np.ndarray:
    """Tokens whose W-1 ancestors are not simply the W-1 previous compact tokens (zero-padded
    before index 0), i.e. the rows a plain causal conv over the compact array gets wrong."""
    def build():
        anc = _conv_ancestors_host(pack, width)
        T = anc.shape[1]
        u = np.arange(T)
        bad = np.zeros(T, dtype=bool)
        for j in range(1, width):
            plain = np.where(u - j >= 0, u - j, T)
            bad |= anc[j] != plain
        return np.flatnonzero(bad)
    return pack.cached(("host", "conv_fix_rows", width), build)


def conv_ancestors(pack: TreePack, width: int) -> torch.Tensor:
    """int64 ``[width, T]``: row j holds the j-th ancestor of every token (row 0 = itself),
    ``T`` (a zero pad row) past a root."""
    return pack.cached(("conv_ancestors", width, str(pack.device)),
                       lambda: torch.from_numpy(_conv_ancestors_host(pack, width)).to(pack.device))


def conv_fix_plan(pack: TreePack, width: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(rows [R], sources [U], local [width, R])`` for patching a plain causal conv over the compact
    array: ``rows`` the tokens it gets wrong (their W-1 ancestors are not the W-1 previous compact
    tokens: after a branch point or a root); ``sources`` the distinct tokens their ancestor windows
    read; ``local[j, i]`` the position in ``sources`` of row i's j-th ancestor (``U`` past a root).
    Lets the fix-up gather U rows instead of reading, and back-propagating into, all T."""

    def host():
        anc, rows = _conv_ancestors_host(pack, width), _conv_fix_rows_host(pack, width)
        window = anc[:, rows]
        sources, local = np.unique(window, return_inverse=True)
        local = local.reshape(window.shape).astype(np.int64)
        if sources.size and sources[-1] == anc.shape[1]:     # the past-a-root sentinel: keep it past the end
            sources = sources[:-1]
        return rows, sources.astype(np.int64), local

    def device():
        return tuple(torch.from_numpy(a).to(pack.device) for a in pack.cached(("host", "conv_fix_plan", width), host))

    return pack.cached(("conv_fix_plan", width, str(pack.device)), device)


def conv_fix_taps(pack: TreePack, width: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(index [width * R], past_root [width, R, 1] bool, reverse [width])``: the fix-up rows'
    ancestor windows of :func:`conv_fix_plan` as row indices into the whole compact array, so a
    layer gathers its W taps with one ``index_select`` of x and zeroes the taps past a root with one
    ``masked_fill_`` (``index`` holds 0 there), instead of gathering ``sources``, appending a zero
    row and gathering again; ``reverse`` = ``[W-1, ..., 0]``, the tap order of the conv weight
    (``weight[:, W-1-j]`` multiplies ancestor j). Built once per pack, like the plan it restates:
    ``x[index].view(W, R, D)`` with ``past_root`` zeroed equals ``cat([x[sources], 0])[local]``."""

    def host():
        anc, rows = _conv_ancestors_host(pack, width), _conv_fix_rows_host(pack, width)
        window = anc[:, rows]                               # [W, R], anc.shape[1] = past a root
        past = window == anc.shape[1]
        return (np.where(past, 0, window).reshape(-1).astype(np.int64), past[:, :, None],
                np.arange(width - 1, -1, -1, dtype=np.int64))

    def device():
        return tuple(torch.from_numpy(a).to(pack.device) for a in pack.cached(("host", "conv_fix_taps", width), host))

    return pack.cached(("conv_fix_taps", width, str(pack.device)), device)
