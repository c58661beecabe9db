"""Tree linear attention on fla's kernels with the chunk-local work fused across rounds.

fla's chunked GDN / simple GLA split into chunk-local kernels (gate cumsum, WY representation,
output, most of the backward) and two inter-chunk recurrences (forward states, backward state
gradients). Only the recurrences depend on a sequence's initial state, so a tree pack needs one
call per round for them alone; every chunk-local kernel runs once over all rounds' sequences
(one varlen layout, ``ChunkPlan.gather_all``). Each Function takes and returns compact tensors
(``[T, ...]``) and moves them to and from that layout inside its own forward / backward, so a
layer adds one autograd node, not one per input and output. Per layer: R recurrence launches
forward and 2R backward (the backward recomputes the states, as fla does) plus a fixed number of
fused ones, instead of R full fla calls each way.

States between rounds: round r's final states (fp32) are gathered by ``init_from`` into round
r+1's initial states; backward scatter-adds the initial-state gradients (``dh0``) back into the
previous round's final-state gradients (``dht``).

The recurrence kernels are launched here directly (fla's wrappers around them allocate per call
and, for simple GLA, read the chunk count with ``.item()``): each round writes its states and
outputs into its slice of one all-rounds buffer, with sizes and chunk offsets from the plan, so a
layer makes no host sync and no per-round copies.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass

import numpy as np
import torch
import triton

from ..packing import TreePack
from .gather import compact_grad_to_rounds, from_rounds, rounds_grad_to_compact, to_rounds
from .plan import ChunkPlan, chunk_plan


@dataclass
class VarlenChunks:
    """fla varlen metadata of S sequences: ``cu_seqlens`` ``[S+1]``, ``chunk_indices`` ``[NT, 2]``
    (sequence, chunk within it), ``chunk_offsets`` ``[S+1]`` (first chunk of each sequence), all
    int64 on the device; host ints: ``num_seqs`` (S), ``tokens`` / ``chunks`` (the token and chunk
    ranges in the all-rounds layout)."""

    cu_seqlens: torch.Tensor
    chunk_indices: torch.Tensor
    chunk_offsets: torch.Tensor
    num_seqs: int
    tokens: slice
    chunks: slice

    @staticmethod
    def build(cu: np.ndarray, chunk_size: int, device, start: int = 0, chunk_start: int = 0) -> "VarlenChunks":
        lens = np.diff(cu)
        chunks = (lens + chunk_size - 1) // chunk_size
        offsets = np.concatenate([[0], np.cumsum(chunks)]).astype(np.int64)
        seq = np.repeat(np.arange(len(lens), dtype=np.int64), chunks)
        within = np.arange(offsets[-1], dtype=np.int64) - offsets[seq]
        t = lambda a: torch.from_numpy(np.ascontiguousarray(a, dtype=np.int64)).to(device)
        return VarlenChunks(t(cu), t(np.stack([seq, within], 1)), t(offsets), len(lens),
                            slice(start, start + int(cu[-1])), slice(chunk_start, chunk_start + int(offsets[-1])))


@dataclass
class FusedRounds:
    """``all``: the rounds' sequences as one varlen batch; ``rounds[r]``: round r alone (its
    own token offsets, zero-based); ``init_from[r]``: rows of round r-1's final states; ``plan``:
    the chunk plan they come from (its layout indices)."""

    plan: ChunkPlan
    all: VarlenChunks
    rounds: list[VarlenChunks]
    init_from: list[torch.Tensor | None]
    chunk_size: int


def fused_rounds(pack: TreePack, chunk_size: int) -> FusedRounds:
    """:class:`FusedRounds` of ``pack`` (cached per chunk size and device)."""

    def build():
        plan: ChunkPlan = chunk_plan(pack, chunk_size)
        dev = plan.gather_all.device
        cus = [rd.cu_seqlens_cpu.numpy() for rd in plan.rounds]
        starts = np.concatenate([[0], np.cumsum([int(c[-1]) for c in cus])])
        cu_all = np.concatenate([[0]] + [c[1:] + s for c, s in zip(cus, starts)])
        rounds, chunk_start = [], 0
        for c, s in zip(cus, starts):
            rounds.append(VarlenChunks.build(c, chunk_size, dev, int(s), chunk_start))
            chunk_start = rounds[-1].chunks.stop
        return FusedRounds(plan, VarlenChunks.build(cu_all, chunk_size, dev), rounds,
                           [rd.init_from for rd in plan.rounds], chunk_size)

    return pack.cached(("fla_fused_rounds", chunk_size, str(pack.device)), build)


def _prev_final_grad(fr: FusedRounds, r: int, dh0: torch.Tensor) -> torch.Tensor:
    """Gradient of round r-1's final states from round r's initial-state gradient ``dh0``."""
    return dh0.new_zeros((fr.rounds[r - 1].num_seqs, *dh0.shape[1:])).index_add_(0, fr.init_from[r], dh0)


def _init_state(fr: FusedRounds, r: int, final: torch.Tensor | None) -> torch.Tensor | None:
    return None if r == 0 else final.index_select(0, fr.init_from[r])


def _round_states(k, w, u, gc, fr: FusedRounds, keep_inits: bool):
    """GDN forward recurrence (fla ``chunk_gated_delta_rule_fwd_kernel_h_blockdim64``) round by
    round. Returns h ``[1, NT, HV, K, V]``, v_new like u, and each round's initial states (None for
    round 0, and for all rounds unless ``keep_inits``)."""
    from fla.ops.common.chunk_delta_h import chunk_gated_delta_rule_fwd_kernel_h_blockdim64 as kernel

    H, K, HV, V = k.shape[2], k.shape[3], u.shape[2], u.shape[3]
    h = k.new_empty(1, fr.all.chunks.stop, HV, K, V)
    v_new = torch.empty_like(u)
    inits, final, last = [], None, len(fr.rounds) - 1
    for r, vc in enumerate(fr.rounds):
        t = vc.tokens
        init = _init_state(fr, r, final)
        # written whole by the kernel (every sequence x head x K x V block, empty sequences too): no zero-fill
        final = k.new_empty(vc.num_seqs, HV, K, V, dtype=torch.float32) if r < last else None
        kernel[lambda meta, n=vc.num_seqs: (triton.cdiv(V, meta["BV"]) * n * HV,)](
            k=k[:, t], v=u[:, t], w=w[:, t], v_new=v_new[:, t], g=gc[:, t], gk=None, h=h[:, vc.chunks],
            h0=init, ht=final, cu_seqlens=vc.cu_seqlens, chunk_offsets=vc.chunk_offsets,
            T=t.stop - t.start, H=H, HV=HV, K=K, V=V, BT=fr.chunk_size, STATE_V_FIRST=False)
        inits.append(init if keep_inits else None)
    return h, v_new, inits


def _round_state_grads(q, k, w, do, dv, gc, inits, fr: FusedRounds, scale: float):
    """GDN backward recurrence (fla ``chunk_gated_delta_rule_bwd_kernel_dhu_blockdim64``), last
    round first, each round's ``dh0`` feeding the previous round's ``dht``. Returns dh
    ``[1, NT, HV, K, V]`` and dv2 like dv."""
    from fla.ops.common.chunk_delta_h import chunk_gated_delta_rule_bwd_kernel_dhu_blockdim64 as kernel

    H, K, HV, V = q.shape[2], q.shape[3], do.shape[2], do.shape[3]
    dh = q.new_empty(1, fr.all.chunks.stop, HV, K, V)
    dv2 = torch.empty_like(dv)
    dht = None
    for r in reversed(range(len(fr.rounds))):
        vc, t = fr.rounds[r], fr.rounds[r].tokens
        dh0 = torch.empty_like(inits[r], dtype=torch.float32) if r > 0 else None
        kernel[lambda meta, n=vc.num_seqs: (triton.cdiv(V, meta["BV"]) * n * HV,)](
            q=q[:, t], k=k[:, t], w=w[:, t], g=gc[:, t], gk=None, dht=dht, dh0=dh0, do=do[:, t], dh=dh[:, vc.chunks],
            dv=dv[:, t], dv2=dv2[:, t], cu_seqlens=vc.cu_seqlens, chunk_offsets=vc.chunk_offsets, scale=scale,
            T=t.stop - t.start, H=H, HV=HV, K=K, V=V, BT=fr.chunk_size, STATE_V_FIRST=False)
        if r > 0:
            dht = _prev_final_grad(fr, r, dh0)
    return dh, dv2


def _to_rounds(fr: FusedRounds, *xs: torch.Tensor) -> list[torch.Tensor]:
    """Compact ``[T, ...]`` -> all-rounds ``[1, N, ...]``, contiguous."""
    return [to_rounds(x, fr.plan).unsqueeze(0) for x in xs]


def _to_compact(fr: FusedRounds, grads, dtypes) -> list[torch.Tensor]:
    """All-rounds gradients ``[1, N, ...]`` -> compact ``[T, ...]``, each in its dtype."""
    return [rounds_grad_to_compact(g[0].to(dt), fr.plan) for g, dt in zip(grads, dtypes)]


class TreeGatedDeltaRuleFla(torch.autograd.Function):
    """Compact q, k ``[T, H, K]``, v ``[T, HV, V]``, g, beta ``[T, HV]`` -> o ``[T, HV, V]``; inside,
    the all-rounds layout of ``fr`` (``ChunkPlan.gather_all`` order). ``l2norm``: q and k are
    L2-normalised in the kernel (fla's ``use_qk_l2norm_in_kernel``)."""

    @staticmethod
    def forward(ctx, q, k, v, g, beta, fr: FusedRounds, scale: float, l2norm: bool):
        from fla.modules.norm.l2norm import l2norm_fwd
        from fla.ops.common.chunk_o import chunk_fwd_o
        from fla.ops.gated_delta_rule.chunk_fwd import chunk_gated_delta_rule_fwd_intra
        from fla.ops.utils import chunk_local_cumsum
        from fla.ops.utils.constant import RCP_LN2

        dtypes = [x.dtype for x in (q, k, v, g, beta)]
        q, k, v, g, beta = _to_rounds(fr, q, k, v, g, beta)
        a, C = fr.all, fr.chunk_size
        with torch.cuda.device(q.device) if q.is_cuda else contextlib.nullcontext():
            q_rstd = k_rstd = None
            if l2norm:
                (q, q_rstd), (k, k_rstd) = l2norm_fwd(q), l2norm_fwd(k)
            gc = chunk_local_cumsum(g, chunk_size=C, scale=RCP_LN2, cu_seqlens=a.cu_seqlens,
                                    chunk_indices=a.chunk_indices)
            w, u, A = chunk_gated_delta_rule_fwd_intra(k=k, v=v, g=gc, beta=beta, cu_seqlens=a.cu_seqlens,
                                                       chunk_indices=a.chunk_indices, chunk_size=C)
            h, v_new, _ = _round_states(k, w, u, gc, fr, keep_inits=False)
            o = chunk_fwd_o(q=q, k=k, v=v_new, h=h, g=gc, scale=scale, cu_seqlens=a.cu_seqlens,
                            chunk_indices=a.chunk_indices, chunk_size=C)
        ctx.save_for_backward(q, k, v, gc, beta, A, q_rstd, k_rstd)
        ctx.fr, ctx.scale, ctx.dtypes = fr, scale, dtypes
        return from_rounds(o[0].to(v.dtype), fr.plan)

    @staticmethod
    def backward(ctx, do):
        from fla.modules.norm.l2norm import l2norm_bwd
        from fla.ops.common.chunk_o import chunk_bwd_dqkwg, chunk_bwd_dv_local
        from fla.ops.gated_delta_rule.wy_fast import prepare_wy_repr_bwd, recompute_w_u_fwd
        from fla.ops.utils import chunk_local_cumsum

        q, k, v, gc, beta, A, q_rstd, k_rstd = ctx.saved_tensors
        fr, scale = ctx.fr, ctx.scale
        a, C = fr.all, fr.chunk_size
        do = compact_grad_to_rounds(do, fr.plan).unsqueeze(0)
        with torch.cuda.device(q.device) if q.is_cuda else contextlib.nullcontext():
            w, u = recompute_w_u_fwd(k=k, v=v, beta=beta, A=A, g=gc, cu_seqlens=a.cu_seqlens,
                                     chunk_indices=a.chunk_indices)
            h, v_new, inits = _round_states(k, w, u, gc, fr, keep_inits=True)
            dv = chunk_bwd_dv_local(q=q, k=k, g=gc, do=do, scale=scale, cu_seqlens=a.cu_seqlens,
                                    chunk_indices=a.chunk_indices, chunk_size=C)
            dh, dv = _round_state_grads(q, k, w, do, dv, gc, inits, fr, scale)
            dq, dk, dw, dg = chunk_bwd_dqkwg(q=q, k=k, v=v_new, w=w, g=gc, h=h, dv=dv, do=do, dh=dh, scale=scale,
                                             cu_seqlens=a.cu_seqlens, chunk_indices=a.chunk_indices, chunk_size=C)
            dk2, dv, db, dg2 = prepare_wy_repr_bwd(k=k, v=v, beta=beta, g=gc, A=A, dw=dw, du=dv,
                                                   cu_seqlens=a.cu_seqlens, chunk_indices=a.chunk_indices)
            dk.add_(dk2)
            dg.add_(dg2)
            dg = chunk_local_cumsum(dg, chunk_size=C, reverse=True, cu_seqlens=a.cu_seqlens,
                                    chunk_indices=a.chunk_indices)
            if q_rstd is not None:
                dq, dk = l2norm_bwd(q, q_rstd, dq), l2norm_bwd(k, k_rstd, dk)
        grads = _to_compact(fr, (dq, dk, dv, dg, db), ctx.dtypes)
        return (*grads, None, None, None)


def _simple_gla_states(k, v, gc, fr: FusedRounds, fp32: bool, keep_inits: bool):
    """Simple-GLA forward recurrence (fla ``chunk_fwd_kernel_h``) round by round: h
    ``[1, NT, H, K, V]`` (fp32 if ``fp32``) and each round's initial states (as ``_round_states``)."""
    from fla.ops.common.chunk_h import chunk_fwd_kernel_h as kernel

    H, K, V = k.shape[2], k.shape[3], v.shape[3]
    h = k.new_empty(1, fr.all.chunks.stop, H, K, V, dtype=torch.float32 if fp32 else k.dtype)
    inits, final, last = [], None, len(fr.rounds) - 1
    for r, vc in enumerate(fr.rounds):
        t = vc.tokens
        init = _init_state(fr, r, final)
        final = k.new_empty(vc.num_seqs, H, K, V, dtype=torch.float32) if r < last else None
        kernel[lambda meta, n=vc.num_seqs: (triton.cdiv(K, meta["BK"]) * triton.cdiv(V, meta["BV"]) * n * H,)](
            k=k[:, t], v=v[:, t], h=h[:, vc.chunks], g=gc[:, t], g_gamma=None, gk=None, gv=None, h0=init, ht=final,
            cu_seqlens=vc.cu_seqlens, split_offsets=vc.chunk_offsets, T=t.stop - t.start, H=H, K=K, V=V,
            BT=fr.chunk_size, BS=fr.chunk_size, USE_G=True, USE_G_GAMMA=False, USE_GK=False, USE_GV=False,
            STATE_V_FIRST=False)
        inits.append(init if keep_inits else None)
    return h, inits


def _simple_gla_state_grads(q, k, do, gc, inits, fr: FusedRounds, scale: float):
    """Simple-GLA backward recurrence (fla ``chunk_bwd_kernel_dh``), last round first: dh
    ``[1, NT, H, K, V]`` fp32."""
    from fla.ops.common.chunk_h import chunk_bwd_kernel_dh as kernel

    H, K, V = q.shape[2], q.shape[3], do.shape[3]
    dh = q.new_empty(1, fr.all.chunks.stop, H, K, V, dtype=torch.float32)
    dht = None
    for r in reversed(range(len(fr.rounds))):
        vc, t = fr.rounds[r], fr.rounds[r].tokens
        dh0 = torch.empty_like(inits[r], dtype=torch.float32) if r > 0 else None
        kernel[lambda meta, n=vc.num_seqs: (triton.cdiv(K, meta["BK"]) * triton.cdiv(V, meta["BV"]) * n * H,)](
            q=q[:, t], g=gc[:, t], g_gamma=None, gk=None, gv=None, do=do[:, t], dh=dh[:, vc.chunks], dht=dht, dh0=dh0,
            cu_seqlens=vc.cu_seqlens, split_offsets=vc.chunk_offsets, scale=scale, T=t.stop - t.start, HQ=H, H=H,
            K=K, V=V, BT=fr.chunk_size, BS=fr.chunk_size, NG=1, USE_G=True, USE_G_GAMMA=False, USE_GK=False,
            USE_GV=False, STATE_V_FIRST=False)
        if r > 0:
            dht = _prev_final_grad(fr, r, dh0)
    return dh


class TreeSimpleGLAFla(torch.autograd.Function):
    """Compact q, k ``[T, H, K]``, v ``[T, H, V]``, g ``[T, H]`` -> o ``[T, H, V]`` (fla
    ``chunk_simple_gla`` with the rounds' state handoffs, in the all-rounds layout inside)."""

    @staticmethod
    def forward(ctx, q, k, v, g, fr: FusedRounds, scale: float):
        from fla.ops.common.chunk_o import chunk_fwd_o
        from fla.ops.utils import chunk_local_cumsum
        from fla.ops.utils.constant import RCP_LN2

        dtypes = [x.dtype for x in (q, k, v, g)]
        q, k, v, g = _to_rounds(fr, q, k, v, g)
        a, C = fr.all, fr.chunk_size
        with torch.cuda.device(q.device) if q.is_cuda else contextlib.nullcontext():
            gc = chunk_local_cumsum(g, chunk_size=C, scale=RCP_LN2, cu_seqlens=a.cu_seqlens,
                                    chunk_indices=a.chunk_indices)
            h, _ = _simple_gla_states(k, v, gc, fr, fp32=False, keep_inits=False)
            o = chunk_fwd_o(q=q, k=k, v=v, g=gc, h=h, scale=scale, cu_seqlens=a.cu_seqlens, chunk_size=C,
                            chunk_indices=a.chunk_indices)
        ctx.save_for_backward(q, k, v, gc)
        ctx.fr, ctx.scale, ctx.dtypes = fr, scale, dtypes
        return from_rounds(o[0].to(v.dtype), fr.plan)

    @staticmethod
    def backward(ctx, do):
        from fla.ops.common.chunk_o import chunk_bwd_dqkwg, chunk_bwd_dv
        from fla.ops.utils import chunk_local_cumsum

        q, k, v, gc = ctx.saved_tensors
        fr, scale = ctx.fr, ctx.scale
        a, C = fr.all, fr.chunk_size
        do = compact_grad_to_rounds(do, fr.plan).unsqueeze(0)
        with torch.cuda.device(q.device) if q.is_cuda else contextlib.nullcontext():
            h, inits = _simple_gla_states(k, v, gc, fr, fp32=True, keep_inits=True)
            dh = _simple_gla_state_grads(q, k, do, gc, inits, fr, scale)
            dq, dk, _, dg = chunk_bwd_dqkwg(q=q, k=k, v=v, g=gc, h=h, do=do, dh=dh, scale=scale,
                                            cu_seqlens=a.cu_seqlens, chunk_size=C, chunk_indices=a.chunk_indices)
            dv = chunk_bwd_dv(q=q, k=k, g=gc, do=do, dh=dh, scale=scale, cu_seqlens=a.cu_seqlens, chunk_size=C,
                              chunk_indices=a.chunk_indices)
            dg = chunk_local_cumsum(dg, chunk_size=C, reverse=True, cu_seqlens=a.cu_seqlens,
                                    chunk_indices=a.chunk_indices)
        grads = _to_compact(fr, (dq, dk, dv, dg), ctx.dtypes)
        return (*grads, None, None)
