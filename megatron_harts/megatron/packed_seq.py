"""``TreePackedSeqParams``: a ``PackedSeqParams`` that carries a :class:`TreePack` through
``HybridModel.forward`` -> ``HybridStack`` -> every layer (Megatron passes ``packed_seq_params``
by reference to all layer types, see ``docs/megatron_internals.md`` §1, §5).

Megatron's THD convention holds: activations are ``[T, 1, h]`` (s = the T compact tokens, b = 1).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from megatron.core.packed_seq_params import PackedSeqParams

from ..packing import TreePack


@dataclass
class TreePackedSeqParams(PackedSeqParams):
    """THD packed-sequence params of a tree pack.

    ``tree_pack``: the microbatch's :class:`TreePack` (its ``chunk_size`` is the chunk size of the
    tree linear-attention ops). Tree-aware layers (``megatron_harts.megatron.layers``) dispatch on
    this type; stock layers only see ordinary THD fields.
    """

    tree_pack: TreePack | None = None


def tree_packed_seq_params(pack: TreePack) -> TreePackedSeqParams:
    """Params for running a model on ``pack``: ``qkv_format="thd"``; ``cu_seqlens_q/kv`` int32
    ``[R + 1]`` = offsets of the R root subtrees, the contiguous independent segments of the
    compact layout (for ``pack_trajectories`` output these are exactly the trajectories, i.e.
    ordinary THD ``cu_seqlens``); ``max_seqlen_q/kv`` = longest trajectory, which sizes the
    rotary table that RoPE gathers ``pack.position_ids`` from.

    ``cu_seqlens_q/kv_padded`` = ``[0, T]``: ``SelfAttention`` reads them (when set) only to apply
    RoPE, whose table :class:`~megatron_harts.megatron.layers.TreeHybridStack` has already gathered
    per token; one segment makes Megatron's THD RoPE a single op (instead of a Python loop with a
    host sync per segment), exact for trees and trajectories alike. They live on the host, where
    Megatron's unfused THD RoPE reads them (``.tolist()`` / ``.item()``) without a device sync.
    """
    T = pack.num_tokens
    cu = pack.root_cu_seqlens
    whole = torch.tensor([0, T], dtype=torch.int32)     # host: Megatron's THD RoPE reads it with .item()
    max_len = pack.cached(("host", "max_trajectory_length"), lambda: int(pack.trajectory_lengths.max()))
    return TreePackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, cu_seqlens_q_padded=whole,
                               cu_seqlens_kv_padded=whole, max_seqlen_q=max_len, max_seqlen_kv=max_len,
                               tree_pack=pack)
