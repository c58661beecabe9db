"""Tree-aware Megatron-Core layers, selected through ModuleSpec (``specs.tree_hybrid_stack_spec``).

Each layer behaves exactly like its parent unless ``packed_seq_params`` is a
:class:`~megatron_harts.megatron.packed_seq.TreePackedSeqParams`; then it runs the tree ops of
``megatron_harts.ops`` over the compact tokens (activations ``[T, 1, h]``, Megatron's THD layout).

* :class:`TreeHybridStack`: gathers the rotary table at ``pack.position_ids`` once per forward,
  so RoPE in every stock ``SelfAttention`` uses each token's trajectory position.
* :class:`TreeGatedDeltaNet` (``G``): fla's ``causal_conv1d`` / ``chunk_gated_delta_rule`` become
  ``tree_causal_conv1d`` / ``tree_gated_delta_rule``; projections, gates, gated norm, out_proj
  are the parent's.
* :class:`TreeCoreAttention` (``*``, the ``core_attention`` of ``SelfAttention``):
  ``tree_attention`` (ancestor mask) with its ``tree_attention_backend`` (``--tree-attention-backend``;
  :func:`attention_backend` switches a built model temporarily).

Mamba2 (``M``): ``mamba.TreeMambaMixer`` (a tree pack through any other Mamba mixer raises).

MoE (``E``): ``megatron_harts.moe`` (multiplicity-weighted router, swapped in by ``specs.treeify``).

Not covered: context parallelism, GDN ``recompute_norm_out``, attention dropout in tree mode.
"""
from __future__ import annotations

import contextlib
from typing import Optional

import torch
from megatron.core.ssm.gated_delta_net import GatedDeltaNet
from megatron.core.ssm.mamba_layer import MambaLayer
from megatron.core.transformer.dot_product_attention import DotProductAttention

from ..ops import tree_attention, tree_causal_conv1d, tree_gated_delta_rule
from ..ops.chunk_torch import l2norm
from ..ops.attention import BACKENDS as ATTENTION_BACKENDS
from .cpu_shim import LocalHybridStack
from .packed_seq import TreePackedSeqParams


class TreeHybridStack(LocalHybridStack):
    """``LocalHybridStack`` that, for a tree pack, replaces the rotary table ``[max_len, 1, 1, d]``
    by its rows at ``pack.position_ids`` (``[T, 1, 1, d]``). ``SelfAttention`` then takes the THD
    RoPE path with ``freqs.size(0) == cu_seqlens_q[-1] == T``, i.e. token i uses ``freqs[i]``
    (``rope_utils._apply_rotary_pos_emb_thd``)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        from .mamba import TreeMambaMixer
        self._has_mamba = any(isinstance(layer, MambaLayer) and not isinstance(layer.mixer, TreeMambaMixer)
                              for layer in self.layers)

    def forward(self, hidden_states, attention_mask, inference_context=None, rotary_pos_emb=None, *,
                packed_seq_params=None, **kwargs):
        if isinstance(packed_seq_params, TreePackedSeqParams):
            if rotary_pos_emb is not None and self.config.apply_rope_fusion:
                raise ValueError("tree packs need apply_rope_fusion=False (--no-rope-fusion): TE's fused THD RoPE "
                                 "is not validated with the per-token rotary table of tree packs")
            if self._has_mamba:
                raise NotImplementedError("tree packs through Mamba2 ('M') layers need mamba.TreeMambaMixer")
            if rotary_pos_emb is not None:
                pos = packed_seq_params.tree_pack.position_ids.to(rotary_pos_emb.device)
                rotary_pos_emb = rotary_pos_emb.index_select(0, pos)
        return super().forward(hidden_states, attention_mask, inference_context, rotary_pos_emb,
                               packed_seq_params=packed_seq_params, **kwargs)


class TreeGatedDeltaNet(GatedDeltaNet):
    """``GatedDeltaNet`` with a tree path.

    Tree path (``[T, 1, h] -> ([T, 1, h], bias)``): ``in_proj`` -> split ``[q|k|v, z, beta,
    alpha]`` -> ``tree_causal_conv1d`` (SiLU) on the q|k|v channels ->
    ``_prepare_input_for_gated_delta_rule`` (head split, GQA repeat) and parent's
    ``_compute_g_and_beta`` -> ``tree_gated_delta_rule`` (chunk size ``pack.chunk_size``, q/k
    l2norm in the op: fla's kernel on GPU, the same formula in torch on CPU) ->
    parent's gated norm -> ``out_proj``.
    """

    def forward(self, hidden_states: torch.Tensor, attention_mask: torch.Tensor, inference_context=None,
                packed_seq_params=None, sequence_len_offset: Optional[int] = None, *, inference_params=None,
                **kwargs):
        if not isinstance(packed_seq_params, TreePackedSeqParams):
            return super().forward(hidden_states, attention_mask, inference_context, packed_seq_params,
                                   sequence_len_offset, inference_params=inference_params, **kwargs)
        if inference_context is not None or inference_params is not None:
            raise NotImplementedError("tree GDN: inference is not supported")
        if self.cp_size > 1 or self.recompute_norm_out:
            raise NotImplementedError("tree GDN: context parallelism / recompute_norm_out are not supported")
        pack = packed_seq_params.tree_pack
        qkvzba, _ = self.in_proj(hidden_states)                      # [T, 1, F/tp] (SP: gathered)
        T, batch, _ = qkvzba.shape
        if batch != 1 or T != pack.num_tokens:
            raise ValueError(f"tree GDN expects [{pack.num_tokens}, 1, h] activations, got {tuple(qkvzba.shape)}")
        qkv, gate, beta, alpha = torch.split(qkvzba.transpose(0, 1), self.feat_dim_split, dim=-1)  # [1, T, .]
        gate = gate.reshape(1, T, -1, self.value_head_dim)
        qkv = tree_causal_conv1d(qkv[0], self.conv1d.weight.squeeze(1), self.conv1d.bias if self.conv_bias else None,
                                 pack, activation=self.activation)[None]   # [1, T, 2H*Dk + HV*Dv]
        q, k, v, gate, beta, alpha = self._prepare_input_for_gated_delta_rule(qkv, gate, 1, T, beta, alpha,
                                                                                     tree=True)
        g, beta = self._compute_g_and_beta(self.A_log, self.dt_bias, alpha, beta)  # [1, T, HV] (g fp32)
        o = tree_gated_delta_rule(q[0], k[0], v[0], g[0], beta[0], pack, chunk_size=pack.chunk_size,
                                   use_qk_l2norm_in_kernel=self.use_qk_l2norm)  # [T, HV, Dv]
        norm_out = self._gated_norm_and_a2a(o[None], gate, None, 1, T, packed_seq_params)  # [T, 1, HV*Dv]
        return self.out_proj(norm_out)

    def _prepare_input_for_gated_delta_rule(self, qkv, gate, batch, seq_len, *gate_feats, tree=False):
        """Parent's split/reshape/l2norm/repeat with the torch :func:`l2norm` (so the parent's
        path also runs on CPU). ``tree``: no l2norm (the tree op applies it in its kernel) and
        no contiguous copies (the op gathers its inputs anyway). qkv ``[b, s, C]`` -> q, k
        ``[b, s, HV, Dk]``, v ``[b, s, HV, Dv]``, gate, ``*gate_feats``."""
        cp = self.cp_size        # the stock (non-tree) THD path under context parallelism: heads split over CP
        query_key, value = torch.split(qkv, [2 * self.qk_dim_local_tp // cp, self.v_dim_local_tp // cp], dim=-1)
        query_key = query_key.reshape(batch, seq_len, -1, self.key_head_dim)
        value = value.reshape(batch, seq_len, -1, self.value_head_dim)
        if self.use_qk_l2norm and not tree:
            query_key = l2norm(query_key)
        query, key = query_key.chunk(2, dim=2)
        repeat = self.num_value_heads // self.num_key_heads
        if repeat > 1:
            query, key = query.repeat_interleave(repeat, dim=2), key.repeat_interleave(repeat, dim=2)
        if tree:
            return (query, key, value, gate.contiguous(), *gate_feats)
        return (query.contiguous(), key.contiguous(), value.contiguous(), gate.contiguous(),
                *(t.contiguous() for t in gate_feats))


class TreeCoreAttention(DotProductAttention):
    """Core attention for ``*`` layers: ``tree_attention`` for tree packs, the local
    ``DotProductAttention`` otherwise.

    Tree path: q ``[T, np, hn]``, k/v ``[T, ng, hn]`` (THD, GQA not expanded) -> ``[T, np*hn]``.
    ``tree_attention_backend``: ``tree_attention``'s ``backend`` (``auto``: FlashAttention varlen for
    trajectory packs and FlexAttention for tree packs on CUDA, masked SDPA on CPU).
    """

    def __init__(self, *args, tree_attention_backend: str = "auto", **kwargs):
        if tree_attention_backend not in ATTENTION_BACKENDS:
            raise ValueError(f"tree_attention_backend must be one of {ATTENTION_BACKENDS}, "
                             f"got {tree_attention_backend!r}")
        super().__init__(*args, **kwargs)
        self.tree_attention_backend = tree_attention_backend

    def forward(self, query, key, value, attention_mask, attn_mask_type=None, attention_bias=None,
                packed_seq_params=None):
        if not isinstance(packed_seq_params, TreePackedSeqParams):
            return super().forward(query, key, value, attention_mask, attn_mask_type=attn_mask_type,
                                   attention_bias=attention_bias, packed_seq_params=packed_seq_params)
        if attention_bias is not None or (self.training and self.attention_dropout.p > 0):
            raise NotImplementedError("tree attention: attention_bias / attention dropout are not supported")
        o = tree_attention(query, key, value, packed_seq_params.tree_pack, scale=self.softmax_scale,
                           backend=self.tree_attention_backend)
        return o.reshape(o.shape[0], -1)


def precompile_tree_attention(model: torch.nn.Module, packs, dtype: torch.dtype | None = None) -> int:
    """Compile what ``model``'s tree attention layers will need for ``packs`` (device
    :class:`TreePack` s) before those packs are trained on: per distinct FlexAttention length
    (``ops.attention.flex_length``), ``tree_attention`` on random q/k/v of the layers' head shapes,
    once without grad (the forward of full recomputation) and once with grad and backward. Packs of
    a length seen before cost nothing. Training is in this state after its first steps (every pack
    length of the run compiled once); a benchmark that times later steps calls this on packs of the
    batches it will time, from a planning pass it then discards (the block masks built here are
    cached on the packs given, so timed steps that plan and pack again build their own).
    Returns the number of lengths compiled now."""
    from ..ops.attention import flex_length
    mods = [m for m in model.modules() if isinstance(m, TreeCoreAttention)]
    if not mods:
        return 0
    seen = {(m.num_attention_heads_per_partition, m.num_query_groups_per_partition, m.hidden_size_per_attention_head,
             m.softmax_scale, m.tree_attention_backend) for m in mods}
    dtype = dtype or next(model.parameters()).dtype
    done = getattr(model, "_harts_precompiled", set())
    n = 0
    for p in packs:
        for hq, hkv, d, scale, backend in seen:
            key = (flex_length(p.num_tokens), p.is_chain, hq, hkv, d, scale, backend)
            if key in done:
                continue
            done.add(key)
            n += 1
            T = p.num_tokens
            q, k, v = (torch.randn(T, h, d, device=p.device, dtype=dtype) for h in (hq, hkv, hkv))
            with torch.no_grad():
                tree_attention(q, k, v, p, scale=scale, backend=backend)
            q, k, v = (x.requires_grad_() for x in (q, k, v))
            tree_attention(q, k, v, p, scale=scale, backend=backend).sum().backward()
    model._harts_precompiled = done
    return n


@contextlib.contextmanager
def attention_backend(model: torch.nn.Module, backend: str):
    """Run every :class:`TreeCoreAttention` of ``model`` with ``backend`` inside the block (e.g. the
    trajectory-wise baseline on FlexAttention instead of FlashAttention varlen, to measure what the
    kernel choice alone changes); restores the previous backends on exit."""
    if backend not in ATTENTION_BACKENDS:
        raise ValueError(f"backend must be one of {ATTENTION_BACKENDS}, got {backend!r}")
    mods = [m for m in model.modules() if isinstance(m, TreeCoreAttention)]
    old = [m.tree_attention_backend for m in mods]
    for m in mods:
        m.tree_attention_backend = backend
    try:
        yield
    finally:
        for m, b in zip(mods, old):
            m.tree_attention_backend = b
