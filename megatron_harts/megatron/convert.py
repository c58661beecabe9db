"""Hugging Face Qwen3-Next (``Qwen3NextForCausalLM``) -> Megatron-Core ``HybridModel`` conversion.

Usage (CPU, tests; on GPU build the model the usual way with ``megatron_args``)::

    from megatron_harts.megatron import convert, cpu_shim

    args, sd = convert.hf_to_megatron(hf_model_or_state_dict, hf_config)
    with cpu_shim.cpu_megatron():
        model = convert.build_megatron_model(args)      # tree spec, TP=1
        convert.load_megatron_state_dict(model, sd)
    # or in one go: model = convert.load_hf_into_megatron(hf_model, hf_config)

One HF decoder layer (token mixer + MLP/MoE) becomes two Megatron layers: ``G`` (Gated DeltaNet,
``linear_attention``) or ``*`` (gated self-attention, ``full_attention``), followed by ``E``
(MoE with shared expert) or ``-`` (dense SwiGLU MLP, ``mlp_only_layers`` / ``decoder_sparse_step``).
So the 48-layer Qwen3-Next-80B becomes a 96-symbol pattern ``GEGEGE*E...``.

Weight mapping (see ``docs/hf_conversion.md`` for the exactness of every piece):

* Zero-centered RMSNorms (``input_layernorm``, ``post_attention_layernorm``, ``q_norm``,
  ``k_norm``, ``model.norm``; HF computes ``x_hat * (1 + w)``) become plain RMSNorm weights
  ``1 + w``. The GDN gated norm (``linear_attn.norm``, ``x_hat * w * silu(z)``) is copied as is.
* GDN ``in_proj_qkvz`` / ``in_proj_ba`` are grouped per key head (``[q k v z]`` and ``[b a]`` of
  each key head); Megatron's single ``in_proj`` is blocked ``[q | k | v | z | beta | alpha]``.
* Attention ``q_proj`` holds ``[q_h, gate_h]`` per head; Megatron's ``linear_qkv`` (with
  ``attention_output_gate``) holds ``[q heads, gate heads, k, v]`` per query group.
* MoE: ``experts.gate_up_proj[e]`` -> ``local_experts.e.linear_fc1`` (``[gate; up]``, Megatron's
  GLU order), ``experts.down_proj[e]`` -> ``linear_fc2``; ``gate`` -> ``router``; shared expert
  ``[gate_proj; up_proj]`` -> ``shared_experts.linear_fc1``, ``shared_expert_gate`` ->
  ``shared_experts.gate_weight``.

Only TP = PP = EP = 1 state dicts are produced (shard them with Megatron's dist-checkpointing
for parallel runs). The MTP head of released checkpoints (``mtp.*``) is not converted.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Mapping

import torch
import torch.nn.functional as F

from . import cpu_shim

__all__ = ["MegatronArgs", "hf_config_to_megatron", "hf_to_megatron", "build_megatron_model",
           "load_megatron_state_dict", "load_hf_into_megatron"]


@dataclass
class MegatronArgs:
    """What is needed to build the Megatron model matching an HF config.

    ``pattern``: hybrid layer pattern (one symbol per Megatron layer); ``config``: kwargs of
    ``TransformerConfig``; ``model``: kwargs of ``HybridModel`` besides config/spec/pattern.
    """

    pattern: str
    config: dict[str, Any] = field(default_factory=dict)
    model: dict[str, Any] = field(default_factory=dict)


def _get(cfg, name, default=None):
    if isinstance(cfg, Mapping):
        return cfg.get(name, default)
    return getattr(cfg, name, default)


def _layer_types(cfg) -> list[str]:
    types = _get(cfg, "layer_types")
    if types is None:
        n, interval = _get(cfg, "num_hidden_layers"), _get(cfg, "full_attention_interval", 4)
        types = ["linear_attention" if (i + 1) % interval else "full_attention" for i in range(n)]
    return list(types)


def _is_moe_layer(cfg, i: int) -> bool:
    return (i not in (_get(cfg, "mlp_only_layers") or []) and (_get(cfg, "num_experts") or 0) > 0
            and (i + 1) % _get(cfg, "decoder_sparse_step", 1) == 0)


def _rope(cfg) -> tuple[float, float]:
    """(rope_theta, partial_rotary_factor); only the default (unscaled) RoPE is supported."""
    rp = _get(cfg, "rope_parameters") or {}
    rope_type = rp.get("rope_type", rp.get("type", "default"))
    if rope_type != "default":
        raise NotImplementedError(f"RoPE type {rope_type!r} is not converted (only 'default')")
    theta = rp.get("rope_theta", _get(cfg, "rope_theta", 10000.0))
    partial = rp.get("partial_rotary_factor", _get(cfg, "partial_rotary_factor", 1.0))
    return float(theta), float(partial)


def hf_config_to_megatron(hf_config) -> MegatronArgs:
    """Megatron pattern / ``TransformerConfig`` kwargs / ``HybridModel`` kwargs of a
    ``Qwen3NextConfig`` (object or ``to_dict()``). fp32, no dropout, no fusions (CPU-safe); change
    ``params_dtype``/fusions for GPU training."""
    cfg = hf_config
    model_type = _get(cfg, "model_type", "qwen3_next")
    if model_type != "qwen3_next":
        raise NotImplementedError(f"model_type {model_type!r}: only 'qwen3_next' is converted")
    if _get(cfg, "hidden_act", "silu") != "silu":
        raise NotImplementedError("only hidden_act='silu' is expressible (Megatron GDN asserts silu)")
    if _get(cfg, "attention_bias", False):
        raise NotImplementedError("attention_bias=True is not converted")
    L = _get(cfg, "num_hidden_layers")
    types = _layer_types(cfg)
    pattern = ""
    for i in range(L):
        if types[i] not in ("linear_attention", "full_attention"):
            raise NotImplementedError(f"layer type {types[i]!r}")
        pattern += "G" if types[i] == "linear_attention" else "*"
        pattern += "E" if _is_moe_layer(cfg, i) else "-"
    hidden = _get(cfg, "hidden_size")
    heads = _get(cfg, "num_attention_heads")
    head_dim = _get(cfg, "head_dim") or hidden // heads
    theta, partial = _rope(cfg)
    conf = dict(
        num_layers=len(pattern),
        hidden_size=hidden,
        ffn_hidden_size=_get(cfg, "intermediate_size"),
        num_attention_heads=heads,
        num_query_groups=_get(cfg, "num_key_value_heads"),
        kv_channels=head_dim,
        qk_layernorm=True,
        attention_output_gate=True,
        normalization="RMSNorm",
        layernorm_epsilon=_get(cfg, "rms_norm_eps"),
        activation_func=F.silu,
        gated_linear_unit=True,
        add_bias_linear=False,
        add_qkv_bias=False,
        hidden_dropout=0.0,
        attention_dropout=float(_get(cfg, "attention_dropout", 0.0)),
        init_method_std=_get(cfg, "initializer_range", 0.02),
        **cpu_shim.UNFUSED_FP32,
        linear_conv_kernel_dim=_get(cfg, "linear_conv_kernel_dim"),
        linear_key_head_dim=_get(cfg, "linear_key_head_dim"),
        linear_value_head_dim=_get(cfg, "linear_value_head_dim"),
        linear_num_key_heads=_get(cfg, "linear_num_key_heads"),
        linear_num_value_heads=_get(cfg, "linear_num_value_heads"),
    )
    if "E" in pattern:
        conf.update(
            num_moe_experts=_get(cfg, "num_experts"),
            moe_router_topk=_get(cfg, "num_experts_per_tok"),
            moe_ffn_hidden_size=_get(cfg, "moe_intermediate_size"),
            # HF: softmax over all experts, top-k, renormalise (norm_topk_prob) == Megatron's
            # top-k of the logits then softmax over the k (pre_softmax=False).
            moe_router_pre_softmax=not _get(cfg, "norm_topk_prob", True),
            moe_router_score_function="softmax",
            moe_token_dispatcher_type="allgather",
            moe_grouped_gemm=False,
            moe_aux_loss_coeff=0.0,      # router losses: see docs/hf_conversion.md
        )
        shared = _get(cfg, "shared_expert_intermediate_size") or 0
        if shared:
            conf.update(moe_shared_expert_intermediate_size=shared, moe_shared_expert_gate=True)
    model = dict(
        vocab_size=_get(cfg, "vocab_size"),
        max_sequence_length=_get(cfg, "max_position_embeddings"),
        position_embedding_type="rope",
        rotary_percent=partial,
        rotary_base=theta,
        share_embeddings_and_output_weights=bool(_get(cfg, "tie_word_embeddings", False)),
    )
    return MegatronArgs(pattern=pattern, config=conf, model=model)


def _plain_state_dict(hf) -> dict[str, torch.Tensor]:
    sd = hf.state_dict() if hasattr(hf, "state_dict") else dict(hf)
    return {k: v.detach() for k, v in sd.items()}


def hf_to_megatron(hf_model_or_state_dict, hf_config=None) -> tuple[MegatronArgs, dict[str, torch.Tensor]]:
    """Convert a ``Qwen3NextForCausalLM`` (or its state dict) to ``(MegatronArgs, state_dict)``.

    ``hf_config`` defaults to ``hf_model.config``. The returned state dict has Megatron's
    ``HybridModel`` names (TP=1, no ``_extra_state`` entries); load it with
    :func:`load_megatron_state_dict`.
    """
    if hf_config is None:
        hf_config = getattr(hf_model_or_state_dict, "config", None)
        if hf_config is None:
            raise ValueError("hf_config is required when converting a bare state dict")
    args = hf_config_to_megatron(hf_config)
    src = _plain_state_dict(hf_model_or_state_dict)
    used: set[str] = set()

    def take(name: str) -> torch.Tensor:
        used.add(name)
        return src[name]

    def zc(name: str) -> torch.Tensor:           # zero-centered RMSNorm weight -> plain weight
        w = take(name)
        return (1.0 + w.float()).to(w.dtype)

    c = args.config
    H, HV = c["linear_num_key_heads"], c["linear_num_value_heads"]
    Dk, Dv = c["linear_key_head_dim"], c["linear_value_head_dim"]
    r = HV // H
    nq, ng, hd = c["num_attention_heads"], c["num_query_groups"], c["kv_channels"]
    hid = c["hidden_size"]
    out: dict[str, torch.Tensor] = {}
    out["embedding.word_embeddings.weight"] = take("model.embed_tokens.weight")
    mi = 0
    for i in range(_get(hf_config, "num_hidden_layers")):
        p, mixer, mlp = f"model.layers.{i}.", args.pattern[2 * i], args.pattern[2 * i + 1]
        q = f"decoder.layers.{mi}."
        out[q + "input_layernorm.weight"] = zc(p + "input_layernorm.weight")
        if mixer == "G":
            a = p + "linear_attn."
            qkvz = take(a + "in_proj_qkvz.weight").reshape(H, 2 * Dk + 2 * r * Dv, hid)
            wq, wk, wv, wz = torch.split(qkvz, [Dk, Dk, r * Dv, r * Dv], dim=1)
            ba = take(a + "in_proj_ba.weight").reshape(H, 2 * r, hid)
            wb, wa = torch.split(ba, [r, r], dim=1)
            out[q + "self_attention.in_proj.weight"] = torch.cat(
                [w.reshape(-1, hid) for w in (wq, wk, wv, wz, wb, wa)], 0).contiguous()
            out[q + "self_attention.conv1d.weight"] = take(a + "conv1d.weight")
            if a + "conv1d.bias" in src:
                raise NotImplementedError("GDN conv1d bias (Qwen3-Next has none)")
            out[q + "self_attention.dt_bias"] = take(a + "dt_bias")
            out[q + "self_attention.A_log"] = take(a + "A_log")
            out[q + "self_attention.out_norm.weight"] = take(a + "norm.weight")
            out[q + "self_attention.out_proj.weight"] = take(a + "out_proj.weight")
        else:
            a = p + "self_attn."
            wqg = take(a + "q_proj.weight").reshape(ng, nq // ng, 2, hd, hid)
            wq, wg = wqg[:, :, 0], wqg[:, :, 1]                       # [ng, nq/ng, hd, hid]
            wk = take(a + "k_proj.weight").reshape(ng, 1, hd, hid)
            wv = take(a + "v_proj.weight").reshape(ng, 1, hd, hid)
            out[q + "self_attention.linear_qkv.weight"] = torch.cat(
                [wq, wg, wk, wv], 1).reshape(-1, hid).contiguous()
            out[q + "self_attention.q_layernorm.weight"] = zc(a + "q_norm.weight")
            out[q + "self_attention.k_layernorm.weight"] = zc(a + "k_norm.weight")
            out[q + "self_attention.linear_proj.weight"] = take(a + "o_proj.weight")
        q = f"decoder.layers.{mi + 1}."
        out[q + "pre_mlp_layernorm.weight"] = zc(p + "post_attention_layernorm.weight")
        m = p + "mlp."
        if mlp == "-":
            out[q + "mlp.linear_fc1.weight"] = torch.cat([take(m + "gate_proj.weight"), take(m + "up_proj.weight")], 0)
            out[q + "mlp.linear_fc2.weight"] = take(m + "down_proj.weight")
        else:
            out[q + "mlp.router.weight"] = take(m + "gate.weight")
            E = c["num_moe_experts"]
            if m + "experts.gate_up_proj" in src:                    # transformers >= 5: fused 3-D
                gate_up, down = take(m + "experts.gate_up_proj"), take(m + "experts.down_proj")
                fc1 = [gate_up[e] for e in range(E)]
                fc2 = [down[e] for e in range(E)]
            else:                                                     # per-expert nn.Linear
                e_ = m + "experts.{}."
                fc1 = [torch.cat([take(e_.format(e) + "gate_proj.weight"), take(e_.format(e) + "up_proj.weight")], 0)
                       for e in range(E)]
                fc2 = [take(e_.format(e) + "down_proj.weight") for e in range(E)]
            for e in range(E):
                out[q + f"mlp.experts.local_experts.{e}.linear_fc1.weight"] = fc1[e].contiguous()
                out[q + f"mlp.experts.local_experts.{e}.linear_fc2.weight"] = fc2[e].contiguous()
            if c.get("moe_shared_expert_intermediate_size"):
                s = m + "shared_expert."
                out[q + "mlp.shared_experts.linear_fc1.weight"] = torch.cat(
                    [take(s + "gate_proj.weight"), take(s + "up_proj.weight")], 0)
                out[q + "mlp.shared_experts.linear_fc2.weight"] = take(s + "down_proj.weight")
                out[q + "mlp.shared_experts.gate_weight"] = take(m + "shared_expert_gate.weight")
        mi += 2
    out["decoder.final_norm.weight"] = zc("model.norm.weight")
    if not args.model["share_embeddings_and_output_weights"]:
        out["output_layer.weight"] = take("lm_head.weight")
    left = sorted(k for k in src if k not in used and not k.startswith("mtp.")
                  and not (k == "lm_head.weight" and args.model["share_embeddings_and_output_weights"]))
    if left:
        raise ValueError(f"unconverted HF weights: {left[:8]}{' ...' if len(left) > 8 else ''}")
    return args, out


def build_megatron_model(args: MegatronArgs, tree: bool = True, **config_overrides):
    """Build the ``HybridModel`` of ``args`` on the current Megatron setup (e.g. inside
    ``cpu_shim.cpu_megatron()``). ``tree=True``: ``tree_hybrid_stack_spec`` (runs tree packs and,
    unchanged, ordinary batches); ``False``: ``cpu_shim.local_hybrid_stack_spec``."""
    from megatron.core import parallel_state as ps
    from megatron.core.models.hybrid.hybrid_model import HybridModel
    from megatron.core.transformer import TransformerConfig

    from .specs import tree_hybrid_stack_spec

    if not torch.cuda.is_available():
        cpu_shim.enable_cpu_megatron()
    conf = dict(args.config, **config_overrides)
    if ps.model_parallel_is_initialized():
        conf.setdefault("tensor_model_parallel_size", ps.get_tensor_model_parallel_world_size())
    config = TransformerConfig(**conf)
    spec_fn = tree_hybrid_stack_spec if tree else cpu_shim.local_hybrid_stack_spec
    spec = spec_fn(config.num_moe_experts, qk_layernorm=config.qk_layernorm)
    return HybridModel(config=config, hybrid_stack_spec=spec, hybrid_layer_pattern=args.pattern, **args.model)


def load_megatron_state_dict(model, state_dict: Mapping[str, torch.Tensor]) -> None:
    """``model.load_state_dict(state_dict)``, strict except for Megatron's ``_extra_state``
    entries (TE/fp8 metadata, ``None`` for the local modules)."""
    missing, unexpected = model.load_state_dict(dict(state_dict), strict=False)
    missing = [k for k in missing if not k.endswith("_extra_state")]
    if missing or unexpected:
        raise ValueError(f"state dict mismatch: missing {missing[:8]}, unexpected {unexpected[:8]}")


def load_hf_into_megatron(hf_model_or_state_dict, hf_config=None, tree: bool = True, **config_overrides):
    """:func:`hf_to_megatron` + :func:`build_megatron_model` + :func:`load_megatron_state_dict`."""
    args, sd = hf_to_megatron(hf_model_or_state_dict, hf_config)
    model = build_megatron_model(args, tree=tree, **config_overrides)
    load_megatron_state_dict(model, sd)
    return model
