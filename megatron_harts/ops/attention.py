"""Tree-aware softmax attention: q attends kv iff kv is an ancestor-or-self of q.

``allowed(q, kv) = kv <= q < subtree_end[kv]`` (DFS layout). Backends: ``torch`` (boolean
mask in SDPA, O(T^2) memory: CPU and tests), ``flex`` (FlexAttention block mask built once
per pack, GPU) and ``varlen`` (FlashAttention varlen through ``torch.nn.attention.varlen``, GPU,
bf16/fp16, only for packs without branches, where the ancestor mask is the document-causal mask:
the trajectory-wise THD baseline gets the kernel Megatron/TE users run). ``auto`` on CUDA picks
``varlen`` where it applies, else ``flex``.

FlexAttention is compiled for static shapes, so the flex path pads each pack to
:func:`flex_length` tokens (less than 1/8 more, or a multiple of 128 below 1K tokens): packs
of similar size share one compiled kernel instead of recompiling for every microbatch. Pad tokens attend only themselves and nobody
attends them; their rows are dropped from the output.
"""
from __future__ import annotations

import functools
import inspect
import logging

import torch
import torch.nn.functional as F

from ..packing import TreePack

logger = logging.getLogger(__name__)

BACKENDS = ("auto", "torch", "flex", "varlen")


def ancestor_mask(pack: TreePack) -> torch.Tensor:
    """bool ``[T, T]``: row q, column kv allowed."""
    def build():
        idx = torch.arange(pack.num_tokens, device=pack.device)
        return (idx[None, :] <= idx[:, None]) & (idx[:, None] < pack.subtree_end[None, :])
    return pack.cached(("ancestor_mask", str(pack.device)), build)


_flex = None
#: FlexAttention compilations one process may make (dynamo's default is 8). Each padded length
#: compiles once with grad and once without; past the limit dynamo would silently fall back to
#: eager FlexAttention, which materialises [H, T, T] scores. 8 lengths per octave x 2 modes over
#: 128 .. 2M tokens stay below it.
FLEX_RECOMPILE_LIMIT = 256


def _flex_attention():
    global _flex
    if _flex is None:
        import torch._dynamo as dynamo
        from torch.nn.attention.flex_attention import flex_attention
        for key in ("recompile_limit", "cache_size_limit"):     # name differs across torch versions
            if hasattr(dynamo.config, key):
                setattr(dynamo.config, key, max(getattr(dynamo.config, key), FLEX_RECOMPILE_LIMIT))
        _flex = torch.compile(flex_attention, dynamic=False)
    return _flex


def flex_length(T: int, min_step: int = 128) -> int:
    """T rounded up to a multiple of ``max(min_step, 2**floor(log2 T) / 8)``: 8 padded lengths
    per octave, each less than T/8 (or ``min_step``) above T."""
    step = max(min_step, (1 << (max(T, 1).bit_length() - 1)) // 8)
    return -(-T // step) * step


_block_mask_builder = None
_block_mask_dynamic_failed: str | None = None     # first error of the dynamic builder: later masks per length


def _compiled_create_block_mask():
    """``torch.compile(create_block_mask, dynamic=True)``: one graph for every pack length. Its
    ``_compile=True`` flag compiles with automatic dynamic shapes instead, the first length static: on
    the H200 / H100 (2026-12-06) a process's first mask build then took 130-200 s (watchdog stacks
    inside that compile, three times), the dynamic recompile at the second length < 6 s."""
    global _block_mask_builder
    if _block_mask_builder is None:
        from torch.nn.attention.flex_attention import create_block_mask
        _block_mask_builder = torch.compile(create_block_mask, dynamic=True)
    return _block_mask_builder


def _make_block_mask(mask_mod, length: int, device: torch.device, block_size: int, compiled: bool):
    """``create_block_mask`` of ``mask_mod`` over ``length`` x ``length``, without grad (dynamo guards on
    grad mode: a mask built in a forward with grad, i.e. without recomputation, would compile a second
    graph beside the no-grad one of recomputation's forward and ``precompile_tree_attention``).
    ``compiled`` (GPU: fused, no [T, T] mask in memory): through :func:`_compiled_create_block_mask`, or,
    if that ever fails (non-OOM), per length through ``_compile=True`` for the rest of the process."""
    from torch.nn.attention.flex_attention import create_block_mask
    global _block_mask_dynamic_failed
    args = (mask_mod, None, None, length, length)
    with torch.no_grad():
        if not compiled:
            return create_block_mask(*args, device=device, BLOCK_SIZE=block_size)
        if _block_mask_dynamic_failed is None:
            try:
                return _compiled_create_block_mask()(*args, device=device, BLOCK_SIZE=block_size)
            except torch.OutOfMemoryError:
                raise
            except Exception as e:
                _block_mask_dynamic_failed = f"{type(e).__name__}: {e}"
                logger.warning("dynamic block-mask compile failed (%s); compiling per length instead", e)
        return create_block_mask(*args, device=device, BLOCK_SIZE=block_size, _compile=True)


def block_mask(pack: TreePack, block_size: int = 128):
    """FlexAttention BlockMask of the ancestor predicate over :func:`flex_length` tokens (pad
    token j: ``subtree_end = j + 1``, i.e. itself only); cached on the pack. Compiled on GPU, eager
    on CPU (:func:`_make_block_mask`)."""
    def build():
        T = pack.num_tokens
        Tp = flex_length(T)
        end = torch.cat([pack.subtree_end, torch.arange(T + 1, Tp + 1, device=pack.device)])

        def mask_mod(b, h, q_idx, kv_idx):
            return (kv_idx <= q_idx) & (q_idx < end[kv_idx])
        return _make_block_mask(mask_mod, Tp, pack.device, block_size, compiled=pack.device.type == "cuda")
    return pack.cached(("block_mask", block_size, str(pack.device)), build)


def _segments(pack: TreePack) -> tuple[torch.Tensor, int]:
    """int32 ``cu_seqlens`` ``[R + 1]`` of the root segments and the longest one (host int)."""
    def build():
        cu_cpu = pack.root_segments[1]                  # host copy: no second device read
        return pack.root_cu_seqlens, int((cu_cpu[1:] - cu_cpu[:-1]).max())
    return pack.cached(("attention_segments", str(pack.device)), build)


def _varlen_attn():
    """``torch.nn.attention.varlen.varlen_attn`` (torch >= 2.10) or None."""
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return None
    return varlen_attn


_varlen_failed: str | None = None     # first error of varlen under ``auto``: later calls use flex


def chain_pack_backend(device: torch.device) -> str:
    """The kernel ``auto`` runs on trajectory (branch-free) packs in bf16 on ``device``: ``varlen``
    (FlashAttention) where torch has it and it has not failed, else ``flex``; ``torch`` on CPU."""
    if device.type != "cuda":
        return "torch"
    return "varlen" if _varlen_failed is None and _varlen_attn() is not None else "flex"


def varlen_applies(q: torch.Tensor, pack: TreePack) -> bool:
    """Whether the ``varlen`` backend can run these inputs (see module docstring)."""
    return (q.is_cuda and q.dtype in (torch.bfloat16, torch.float16) and _varlen_failed is None
            and _varlen_attn() is not None and pack.is_chain)


@functools.lru_cache(maxsize=None)
def _parameters(fn) -> frozenset:
    return frozenset(inspect.signature(fn).parameters)


def _causal_varlen(q, k, v, cu: torch.Tensor, max_len: int, scale: float | None) -> torch.Tensor:
    """Document-causal attention over segments ``cu``; q ``[T, Hq, D]``, k/v ``[T, Hkv, D]``.
    Bridges the ``varlen_attn`` signatures of torch 2.10 (``is_causal``) and later (``window_size``,
    ``scale``, ``enable_gqa``)."""
    fn = _varlen_attn()
    params = _parameters(fn)
    kw = dict(window_size=(-1, 0)) if "window_size" in params else dict(is_causal=True)
    if q.shape[1] != k.shape[1]:
        if "enable_gqa" in params:
            kw["enable_gqa"] = True
        else:
            rep = q.shape[1] // k.shape[1]
            k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
    if scale is not None:
        if "scale" in params:
            kw["scale"] = scale
        else:
            q = q * (scale * q.shape[-1] ** 0.5)
    return fn(q, k, v, cu, cu, max_len, max_len, **kw)


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
        if q.device.type != "cuda":
            backend = "torch"
        elif varlen_applies(q, pack):
            try:
                return _causal_varlen(q, k, v, *_segments(pack), scale)
            except torch.OutOfMemoryError:
                raise
            except (RuntimeError, NotImplementedError) as e:   # e.g. no FlashAttention build for this GPU
                global _varlen_failed
                _varlen_failed = f"{type(e).__name__}: {e}"
                logger.warning("FlashAttention varlen failed (%s); trajectory packs use FlexAttention", e)
                backend = "flex"
        else:
            backend = "flex"
    if backend == "varlen":
        if not pack.is_chain:
            raise ValueError("backend='varlen' needs a pack without branches (pack_trajectories); "
                             "tree packs need 'flex' or 'torch'")
        if _varlen_attn() is None:
            raise RuntimeError("backend='varlen' needs torch.nn.attention.varlen (torch >= 2.10)")
        return _causal_varlen(q, k, v, *_segments(pack), scale)
    qh, kh, vh = (x.transpose(0, 1).unsqueeze(0) for x in (q, k, v))
    gqa = q.shape[1] != k.shape[1]
    if backend == "torch":
        o = F.scaled_dot_product_attention(qh, kh, vh, attn_mask=ancestor_mask(pack), scale=scale, enable_gqa=gqa)
    else:
        pad = flex_length(T) - T
        if pad:
            qh, kh, vh = (F.pad(x, (0, 0, 0, pad)) for x in (qh, kh, vh))
        o = _flex_attention()(qh, kh, vh, block_mask=block_mask(pack), scale=scale, enable_gqa=gqa)[:, :, :T]
    return o.squeeze(0).transpose(0, 1)
