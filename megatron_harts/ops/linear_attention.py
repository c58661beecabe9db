"""Tree-aware chunked linear attention: gated delta rule (GDN) and scalar-gated (Mamba2 SSD).

Contract: for every trajectory i with compact indices ``idx_i``, ``o[idx_i]`` equals the op run
on ``q[idx_i], k[idx_i], ...`` alone from a zero state. The chunk plan (``plan.chunk_plan``)
turns the tree into rounds; each round is one varlen kernel call whose initial states are
gathered from the previous round's final states (fp32, differentiable).
"""
from __future__ import annotations

import os
from typing import Callable

import torch

from ..packing import TreePack
from .chunk_torch import chunk_gated_delta_rule_torch, chunk_simple_gla_torch, l2norm
from .gather import gather_rounds, owned_outputs
from .plan import ChunkPlan, ChunkRound, chunk_plan

BACKENDS = ("auto", "torch", "fla")


def resolve_backend(backend: str, device: torch.device) -> str:
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    if backend == "auto":
        return "fla" if device.type == "cuda" else "torch"
    if backend == "fla" and device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        raise ValueError("backend='fla' needs CUDA tensors (fla's kernels are Triton); use backend='torch' on CPU")
    return backend


def run_rounds(plan: ChunkPlan, inputs: list[torch.Tensor],
               kernel: Callable[[list[torch.Tensor], ChunkRound, torch.Tensor | None, bool], tuple]) -> torch.Tensor:
    """Execute ``plan``: gather ``inputs`` (compact ``[T, ...]``) for all rounds at once, call
    ``kernel(xs, round, initial_state, output_final_state) -> (o, final_state)`` per round on
    its slice, and read the owned outputs back in compact order."""
    parts = [gather_rounds(x, plan).split(plan.round_sizes) for x in inputs]
    outs, final = [], None
    last = len(plan.rounds) - 1
    for r, rd in enumerate(plan.rounds):
        init = None if rd.init_from is None else final.index_select(0, rd.init_from)
        o, final = kernel([p[r] for p in parts], rd, init, r < last)
        outs.append(o)
    return owned_outputs(torch.cat(outs), plan)


def _scale(scale: float | None, q: torch.Tensor) -> float:
    return q.shape[-1] ** -0.5 if scale is None else scale


FLA_GDN_CHUNK_SIZES = (16, 32, 64)     # what fla's chunk_gated_delta_rule accepts


def _chain_gated_delta_rule(q, k, v, g, beta, pack: TreePack, chunk_size: int, scale: float | None,
                            use_qk_l2norm_in_kernel: bool):
    """A pack without branches (trajectory packs: the THD baseline) is one plain varlen call of
    fla's ``chunk_gated_delta_rule`` over its trajectories, exactly what a GDN layer on THD runs,
    without the all-rounds gathers (identities here). Varlen metadata cached per pack (no syncs)."""
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule
    from fla.ops.utils.index import prepare_chunk_indices

    cu, cu_cpu = pack.root_segments
    chunk_indices = pack.cached(("fla_chunk_indices", chunk_size, str(pack.device)),
                                lambda: prepare_chunk_indices(cu, chunk_size, cu_seqlens_cpu=cu_cpu))
    o, _ = chunk_gated_delta_rule(q[None], k[None], v[None], g[None], beta[None], scale=scale, cu_seqlens=cu,
                                  cu_seqlens_cpu=cu_cpu, chunk_indices=chunk_indices, chunk_size=chunk_size,
                                  use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel)
    return o[0].to(v.dtype)


def _check(pack: TreePack, name: str, x: torch.Tensor, ndim: int):
    if x.dim() != ndim or x.shape[0] != pack.num_tokens:
        raise ValueError(f"{name}: expected {ndim} dims with {pack.num_tokens} compact tokens first, "
                         f"got shape {tuple(x.shape)}")


def tree_gated_delta_rule(q, k, v, g, beta, pack: TreePack, *, chunk_size: int = 64, scale: float | None = None,
                          backend: str = "auto", use_qk_l2norm_in_kernel: bool = False) -> torch.Tensor:
    """Gated delta rule over the compact tokens of ``pack``.

    q, k ``[T, H, K]``; v ``[T, HV, V]`` (HV a multiple of H); g (log decay) and beta ``[T, HV]``.
    Returns o ``[T, HV, V]`` in v's dtype. ``use_qk_l2norm_in_kernel``: q and k are first normalised
    over their last dim as fla's ``l2norm`` does (``x / sqrt(sum(x^2) + 1e-6)``; fla's kernel on the
    fla backend, the same formula in torch otherwise).
    """
    for name, x, nd in (("q", q, 3), ("k", k, 3), ("v", v, 3), ("g", g, 2), ("beta", beta, 2)):
        _check(pack, name, x, nd)
    if v.shape[1] % q.shape[1]:
        raise ValueError(f"v has {v.shape[1]} heads, not a multiple of q's {q.shape[1]}")
    backend = resolve_backend(backend, q.device)
    if use_qk_l2norm_in_kernel and backend == "torch":
        q, k = l2norm(q), l2norm(k)
    if backend == "fla":
        from .fla_rounds import TreeGatedDeltaRuleFla, fused_rounds, install_fast_launches

        install_fast_launches()     # the recurrence kernels' launch path, the same for both branches
        if pack.is_chain and chunk_size in FLA_GDN_CHUNK_SIZES:
            return _chain_gated_delta_rule(q, k, v, g, beta, pack, chunk_size, scale, use_qk_l2norm_in_kernel)
        return TreeGatedDeltaRuleFla.apply(q, k, v, g, beta, fused_rounds(pack, chunk_size), _scale(scale, q),
                                           use_qk_l2norm_in_kernel)

    def kernel(xs, rd, init, want_final):
        return chunk_gated_delta_rule_torch(*xs, cu_seqlens_cpu=rd.cu_seqlens_cpu, chunk_size=chunk_size,
                                            scale=scale, initial_state=init, output_final_state=want_final)

    return run_rounds(chunk_plan(pack, chunk_size), [q, k, v, g, beta], kernel)


def tree_simple_gla(q, k, v, g, pack: TreePack, *, chunk_size: int = 64, scale: float | None = None,
                    backend: str = "auto") -> torch.Tensor:
    """Scalar-gated linear attention (Mamba2 SSD: q=C, k=B, v=x*dt, g=A*dt) over ``pack``.

    q, k ``[T, H, K]``; v ``[T, H, V]``; g ``[T, H]`` (log decay). Returns ``[T, H, V]``.
    """
    for name, x, nd in (("q", q, 3), ("k", k, 3), ("v", v, 3), ("g", g, 2)):
        _check(pack, name, x, nd)
    backend = resolve_backend(backend, q.device)
    if backend == "fla":
        from .fla_rounds import TreeSimpleGLAFla, fused_rounds

        return TreeSimpleGLAFla.apply(q, k, v, g, fused_rounds(pack, chunk_size), _scale(scale, q))

    def kernel(xs, rd, init, want_final):
        return chunk_simple_gla_torch(*xs, cu_seqlens_cpu=rd.cu_seqlens_cpu, chunk_size=chunk_size,
                                      scale=scale, initial_state=init, output_final_state=want_final)

    return run_rounds(chunk_plan(pack, chunk_size), [q, k, v, g], kernel)
