"""Tree-aware softmax attention: q attends kv iff kv is an ancestor-or-self of q.

``allowed(q, kv) = kv <= q < subtree_end[kv]`` (DFS layout). Backends: ``torch`` (boolean
mask in SDPA, O(T^2) memory: CPU and tests) and ``flex`` (FlexAttention block mask built once
per pack, GPU).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from ..packing import TreePack

BACKENDS = ("auto", "torch", "flex")


def ancestor_mask(pack: TreePack) -> torch.Tensor:
    """bool ``[T, T]``: row q, column kv allowed."""
    def build():
        idx = torch.arange(pack.num_tokens, device=pack.device)
        return (idx[None, :] <= idx[:, None]) & (idx[:, None] < pack.subtree_end[None, :])
    return pack.cached(("ancestor_mask", str(pack.device)), build)


_flex = None


def _flex_attention():
    global _flex
    if _flex is None:
        from torch.nn.attention.flex_attention import flex_attention
        _flex = torch.compile(flex_attention, dynamic=False)
    return _flex


def block_mask(pack: TreePack, block_size: int = 128):
    """FlexAttention BlockMask of the ancestor predicate (cached on the pack)."""
    from torch.nn.attention.flex_attention import create_block_mask

    def build():
        end = pack.subtree_end

        def mask_mod(b, h, q_idx, kv_idx):
            return (kv_idx <= q_idx) & (q_idx < end[kv_idx])
        T = pack.num_tokens
        # _compile: evaluate the predicate block by block instead of materialising [T, T].
        return create_block_mask(mask_mod, None, None, T, T, device=pack.device, BLOCK_SIZE=block_size, _compile=True)
    return pack.cached(("block_mask", block_size, str(pack.device)), build)


def tree_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, pack: TreePack, *,
                   scale: float | None = None, backend: str = "auto") -> torch.Tensor:
    """q ``[T, Hq, D]``, k/v ``[T, Hkv, D]`` (Hq a multiple of Hkv) -> ``[T, Hq, Dv]``."""
    T = pack.num_tokens
    for name, x in (("q", q), ("k", k), ("v", v)):
        if x.dim() != 3 or x.shape[0] != T:
            raise ValueError(f"{name}: expected [{T}, heads, dim], got {tuple(x.shape)}")
    if q.shape[1] % k.shape[1]:
        raise ValueError(f"q has {q.shape[1]} heads, not a multiple of k's {k.shape[1]}")
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    if backend == "auto":
        backend = "flex" if q.device.type == "cuda" else "torch"
    qh, kh, vh = (x.transpose(0, 1).unsqueeze(0) for x in (q, k, v))
    gqa = q.shape[1] != k.shape[1]
    if backend == "torch":
        o = F.scaled_dot_product_attention(qh, kh, vh, attn_mask=ancestor_mask(pack), scale=scale, enable_gqa=gqa)
    else:
        o = _flex_attention()(qh, kh, vh, block_mask=block_mask(pack), scale=scale, enable_gqa=gqa)
    return o.squeeze(0).transpose(0, 1)
