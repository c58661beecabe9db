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

The inverse, :func:`megatron_to_hf` / :func:`iter_megatron_to_hf` (streaming, one HF layer at a
time), turns a trained ``HybridModel`` back into an HF state dict (``layout="model"``: the names of
``Qwen3NextForCausalLM.state_dict()``; ``"checkpoint"``: the on-disk layout of released checkpoints,
one ``Linear`` per expert, which SGLang loads); ``megatron_harts.rollout.weight_sync`` writes it as
a sharded safetensors checkpoint for the rollout engines.

Only TP = PP = EP = 1 state dicts are produced (shard them with Megatron's dist-checkpointing
for parallel runs). The MTP head of released checkpoints (``mtp.*``) is not converted.
"""
from __future__ import annotations

import logging
import re
from dataclasses import dataclass, field
from typing import Any, Iterable, Iterator, Mapping

import torch
import torch.nn.functional as F

from . import cpu_shim

__all__ = ["MegatronArgs", "hf_config_to_megatron", "hf_to_megatron", "build_megatron_model",
           "load_megatron_state_dict", "load_hf_into_megatron", "megatron_to_hf", "iter_megatron_to_hf"]

logger = logging.getLogger(__name__)


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


# ---------------------------------------------------------------------------------------------
# Megatron -> Hugging Face (the inverse of hf_to_megatron), used by rollout weight sync
# ---------------------------------------------------------------------------------------------

HF_LAYOUTS = ("model", "checkpoint")


@dataclass
class _Group:
    """Megatron weights that map together (the embedding, one HF decoder layer, the final norm,
    the output layer): ``shapes`` {Megatron name: expected shape}, ``convert`` maps
    {Megatron name: tensor} to ``[(HF name, tensor)]``."""

    label: str
    shapes: dict[str, tuple[int, ...]]
    convert: Any


_TE_RENAMES = (   # TE spec names (fused LayerNorm+Linear, grouped-GEMM experts) -> local spec names
    (re.compile(r"\.self_attention\.(?:linear_qkv|in_proj)\.layer_norm_weight$"), ".input_layernorm.weight"),
    (re.compile(r"\.mlp\.linear_fc1\.layer_norm_weight$"), ".pre_mlp_layernorm.weight"),
    (re.compile(r"\.mlp\.experts\.linear_fc([12])\.weight(\d+)$"), r".mlp.experts.local_experts.\2.linear_fc\1.weight"),
)


def _megatron_name(name: str) -> str:
    """Strip wrapper prefixes (``module.`` of DDP / ``Float16Module``) and map TE spec names to
    the local spec's."""
    while name.startswith("module."):
        name = name[len("module."):]
    for pat, rep in _TE_RENAMES:
        name = pat.sub(rep, name)
    return name


def _from_zero_centered(w: torch.Tensor) -> torch.Tensor:
    """Plain RMSNorm weight ``1 + w`` -> HF's zero-centered ``w`` (in at least fp32, then back to
    ``w``'s dtype). Exact for weights in ``[0.5, 2^24)`` (Sterbenz), so Megatron -> HF ->
    Megatron is bit-exact there; HF -> Megatron -> HF is exact wherever ``1 + w`` was."""
    return (w.to(torch.promote_types(w.dtype, torch.float32)) - 1.0).to(w.dtype)


def _megatron_groups(args: MegatronArgs, layout: str) -> list[_Group]:
    """The Megatron weights of ``args`` grouped by what must be converted together, in
    Megatron's parameter order."""
    c, pat = args.config, args.pattern
    tied = args.model["share_embeddings_and_output_weights"]
    H, HV = c["linear_num_key_heads"], c["linear_num_value_heads"]
    Dk, Dv, K = c["linear_key_head_dim"], c["linear_value_head_dim"], c["linear_conv_kernel_dim"]
    nq, ng, hd, hid = c["num_attention_heads"], c["num_query_groups"], c["kv_channels"], c["hidden_size"]
    V = args.model["vocab_size"]
    groups: list[_Group] = []

    def embed(t):
        w = t["embedding.word_embeddings.weight"][:V]
        out = [("model.embed_tokens.weight", w)]
        if tied:       # Qwen3NextForCausalLM.state_dict() lists both; SGLang never ties (loads lm_head)
            out.append(("lm_head.weight", w))
        return out

    groups.append(_Group("embedding", {"embedding.word_embeddings.weight": (V, hid)}, embed))
    for i in range(len(pat) // 2):
        mixer, mlp, p = pat[2 * i], pat[2 * i + 1], f"model.layers.{i}."
        q0, q1 = f"decoder.layers.{2 * i}.", f"decoder.layers.{2 * i + 1}."
        shapes = {q0 + "input_layernorm.weight": (hid,)}
        if mixer == "G":
            a = q0 + "self_attention."
            shapes.update({a + "in_proj.weight": (2 * H * Dk + 2 * HV * Dv + 2 * HV, hid),
                           a + "conv1d.weight": (2 * H * Dk + HV * Dv, 1, K), a + "dt_bias": (HV,),
                           a + "A_log": (HV,), a + "out_norm.weight": (Dv,), a + "out_proj.weight": (hid, HV * Dv)})
        else:
            a = q0 + "self_attention."
            shapes.update({a + "linear_qkv.weight": ((2 * nq + 2 * ng) * hd, hid), a + "q_layernorm.weight": (hd,),
                           a + "k_layernorm.weight": (hd,), a + "linear_proj.weight": (hid, nq * hd)})
        shapes[q1 + "pre_mlp_layernorm.weight"] = (hid,)
        m = q1 + "mlp."
        if mlp == "-":
            F_ = c["ffn_hidden_size"]
            shapes.update({m + "linear_fc1.weight": (2 * F_, hid), m + "linear_fc2.weight": (hid, F_)})
        else:
            E, Fm, S = c["num_moe_experts"], c["moe_ffn_hidden_size"], c.get("moe_shared_expert_intermediate_size")
            shapes[m + "router.weight"] = (E, hid)
            for e in range(E):
                shapes[m + f"experts.local_experts.{e}.linear_fc1.weight"] = (2 * Fm, hid)
                shapes[m + f"experts.local_experts.{e}.linear_fc2.weight"] = (hid, Fm)
            if S:
                shapes.update({m + "shared_experts.linear_fc1.weight": (2 * S, hid),
                               m + "shared_experts.linear_fc2.weight": (hid, S),
                               m + "shared_experts.gate_weight": (1, hid)})

        def layer(t, mixer=mixer, mlp=mlp, p=p, q0=q0, q1=q1):
            out = [(p + "input_layernorm.weight", _from_zero_centered(t[q0 + "input_layernorm.weight"]))]
            a = q0 + "self_attention."
            if mixer == "G":
                r = HV // H
                wq, wk, wv, wz, wb, wa = torch.split(t[a + "in_proj.weight"],
                                                     [H * Dk, H * Dk, HV * Dv, HV * Dv, HV, HV], 0)
                qkvz = torch.cat([wq.reshape(H, Dk, hid), wk.reshape(H, Dk, hid),
                                  wv.reshape(H, r * Dv, hid), wz.reshape(H, r * Dv, hid)], 1)
                ba = torch.cat([wb.reshape(H, r, hid), wa.reshape(H, r, hid)], 1)
                h = p + "linear_attn."
                out += [(h + "in_proj_qkvz.weight", qkvz.reshape(-1, hid)),
                        (h + "in_proj_ba.weight", ba.reshape(-1, hid)),
                        (h + "conv1d.weight", t[a + "conv1d.weight"]),
                        (h + "dt_bias", t[a + "dt_bias"]), (h + "A_log", t[a + "A_log"]),
                        (h + "norm.weight", t[a + "out_norm.weight"]),
                        (h + "out_proj.weight", t[a + "out_proj.weight"])]
            else:
                g = nq // ng
                wq, wg, wk, wv = torch.split(t[a + "linear_qkv.weight"].reshape(ng, 2 * g + 2, hd, hid),
                                             [g, g, 1, 1], 1)
                h = p + "self_attn."
                out += [(h + "q_proj.weight", torch.stack([wq, wg], 2).reshape(-1, hid)),
                        (h + "k_proj.weight", wk.reshape(-1, hid)), (h + "v_proj.weight", wv.reshape(-1, hid)),
                        (h + "o_proj.weight", t[a + "linear_proj.weight"]),
                        (h + "q_norm.weight", _from_zero_centered(t[a + "q_layernorm.weight"])),
                        (h + "k_norm.weight", _from_zero_centered(t[a + "k_layernorm.weight"]))]
            out.append((p + "post_attention_layernorm.weight", _from_zero_centered(t[q1 + "pre_mlp_layernorm.weight"])))
            m, h = q1 + "mlp.", p + "mlp."

            def swiglu(prefix, fc1, fc2):        # Megatron [gate; up] -> HF gate_proj / up_proj
                gate, up = fc1.chunk(2, 0)
                return [(prefix + "gate_proj.weight", gate), (prefix + "up_proj.weight", up),
                        (prefix + "down_proj.weight", fc2)]

            if mlp == "-":
                out += swiglu(h, t[m + "linear_fc1.weight"], t[m + "linear_fc2.weight"])
                return out
            out.append((h + "gate.weight", t[m + "router.weight"]))
            E = c["num_moe_experts"]
            fc1 = [t[m + f"experts.local_experts.{e}.linear_fc1.weight"] for e in range(E)]
            fc2 = [t[m + f"experts.local_experts.{e}.linear_fc2.weight"] for e in range(E)]
            if layout == "model":                  # transformers 5.x: fused 3-D expert weights
                out += [(h + "experts.gate_up_proj", torch.stack(fc1, 0)),
                        (h + "experts.down_proj", torch.stack(fc2, 0))]
            else:                                  # released checkpoints / SGLang: one Linear per expert
                for e in range(E):
                    out += swiglu(h + f"experts.{e}.", fc1[e], fc2[e])
            if c.get("moe_shared_expert_intermediate_size"):
                out += swiglu(h + "shared_expert.", t[m + "shared_experts.linear_fc1.weight"],
                              t[m + "shared_experts.linear_fc2.weight"])
                out.append((h + "shared_expert_gate.weight", t[m + "shared_experts.gate_weight"]))
            return out

        groups.append(_Group(f"layer {i}", shapes, layer))
    groups.append(_Group("final norm", {"decoder.final_norm.weight": (hid,)},
                         lambda t: [("model.norm.weight", _from_zero_centered(t["decoder.final_norm.weight"]))]))
    if not tied:
        groups.append(_Group("output layer", {"output_layer.weight": (V, hid)},
                             lambda t: [("lm_head.weight", t["output_layer.weight"][:V])]))
    return groups


def iter_megatron_to_hf(named_tensors: Iterable[tuple[str, Any]], hf_config, *,
                        layout: str = "model") -> Iterator[tuple[str, torch.Tensor]]:
    """Streaming :func:`megatron_to_hf`: consume ``(Megatron name, tensor)`` pairs (e.g.
    ``model.named_parameters()`` or ``state_dict().items()``) and yield ``(HF name, tensor)`` as
    soon as every Megatron weight of a group (the embedding, one HF decoder layer = two Megatron
    layers, the final norm, the output layer) has arrived; so at most one layer's weights are
    held when the input comes in Megatron's order. Tensors stay on their device and dtype; the
    results may be views of the inputs.

    ``layout``: ``"model"`` gives ``Qwen3NextForCausalLM.state_dict()`` names (transformers 5.x:
    fused 3-D ``mlp.experts.gate_up_proj`` ``[E, 2I, H]`` / ``mlp.experts.down_proj``
    ``[E, H, I]``; ``lm_head.weight`` also when tied, the same tensor as the embedding);
    ``"checkpoint"`` gives the on-disk layout of released checkpoints and of
    ``save_pretrained`` (``mlp.experts.{e}.{gate,up,down}_proj.weight``): what SGLang loads and
    what ``from_pretrained`` converts to the fused layout. Both layouts hold ``lm_head.weight``
    when tied (the embedding tensor itself): ``save_pretrained`` would drop it, but SGLang's
    Qwen3-Next allocates its own ``lm_head`` and would leave it unloaded.

    Names may carry ``module.`` prefixes (DDP, ``Float16Module``) and TE spec names (fused
    ``layer_norm_weight``, grouped-GEMM ``experts.linear_fc1.weight{e}``). ``_extra_state``
    entries and ``None`` values are ignored; a tied model's ``output_layer.weight`` (pipeline
    copies) is ignored. A Megatron embedding / output layer with a padded vocabulary (more rows
    than ``vocab_size``) is cut to ``vocab_size``. Unknown names, duplicates and wrong shapes
    raise ``ValueError`` when they arrive; missing weights raise ``ValueError`` at the end.
    Only TP = PP = EP = 1 (full) weights are accepted.
    """
    if layout not in HF_LAYOUTS:
        raise ValueError(f"layout must be one of {HF_LAYOUTS}, got {layout!r}")
    args = hf_config_to_megatron(hf_config)
    tied = args.model["share_embeddings_and_output_weights"]
    groups = _megatron_groups(args, layout)
    owner = {k: gi for gi, g in enumerate(groups) for k in g.shapes}
    pending: dict[int, dict[str, torch.Tensor]] = {}
    done: set[int] = set()
    padded: set[str] = set()
    for raw, t in named_tensors:
        if t is None or raw.endswith("_extra_state"):
            continue
        name = _megatron_name(raw)
        gi = owner.get(name)
        if gi is None:
            if tied and name == "output_layer.weight":
                logger.debug("tied embeddings: ignoring %s", raw)
                continue
            raise ValueError(f"unknown Megatron weight {raw!r} for pattern {args.pattern!r} "
                             f"(expected names like {next(iter(owner))!r})")
        if gi in done or name in pending.get(gi, {}):
            raise ValueError(f"Megatron weight {raw!r} given twice")
        if not isinstance(t, torch.Tensor):
            raise ValueError(f"Megatron weight {raw!r} is a {type(t).__name__}, not a tensor")
        t = t.detach()
        want = groups[gi].shapes[name]
        shape = tuple(t.shape)
        if shape != want:
            vocab_rows = name in ("embedding.word_embeddings.weight", "output_layer.weight")
            if not (vocab_rows and len(shape) == 2 and shape[1] == want[1] and shape[0] > want[0]):
                raise ValueError(f"Megatron weight {raw!r} has shape {list(shape)}, expected {list(want)} "
                                 f"(TP/EP-sharded weights must be gathered first)")
            padded.add(name)
        slot = pending.setdefault(gi, {})
        slot[name] = t
        if len(slot) == len(groups[gi].shapes):
            del pending[gi]
            done.add(gi)
            yield from groups[gi].convert(slot)
    if padded:
        logger.info("padded vocabulary cut to %d rows: %s", args.model["vocab_size"], sorted(padded))
    missing = [k for gi, g in enumerate(groups) if gi not in done for k in g.shapes if k not in pending.get(gi, {})]
    if missing:
        raise ValueError(f"Megatron state dict is missing {len(missing)} weight(s): "
                         f"{', '.join(missing[:4])}{' ...' if len(missing) > 4 else ''}")


def megatron_to_hf(megatron_state_dict: Mapping[str, Any], hf_config, *,
                   layout: str = "model") -> dict[str, torch.Tensor]:
    """Convert a Megatron ``HybridModel`` state dict (TP=1; e.g. ``model.state_dict()``, with or
    without ``_extra_state`` entries) to a Hugging Face ``Qwen3NextForCausalLM`` state dict: the
    exact inverse of :func:`hf_to_megatron`.

    * plain RMSNorm weights become zero-centered ``w - 1`` (``input_layernorm``,
      ``post_attention_layernorm``, ``q_norm``, ``k_norm``, ``model.norm``); the GDN gated norm is
      copied;
    * GDN ``in_proj`` (blocked ``[q | k | v | z | beta | alpha]``) is regrouped per key head into
      ``in_proj_qkvz`` / ``in_proj_ba``;
    * ``linear_qkv`` (``[q heads, gate heads, k, v]`` per query group) becomes ``q_proj``
      (``[q_h, gate_h]`` per head), ``k_proj``, ``v_proj``;
    * MoE experts are stacked into transformers 5.x's fused ``experts.gate_up_proj`` /
      ``experts.down_proj`` (``layout="model"``) or written per expert
      (``layout="checkpoint"``, see :func:`iter_megatron_to_hf`); the shared expert's
      ``[gate; up]`` is split; ``router`` -> ``gate``; ``gate_weight`` -> ``shared_expert_gate``.

    Dtype and device are kept (no copies beyond what the regrouping needs). Bit-exact as an
    inverse, except the zero-centered norms: ``(1 + w) - 1`` is exact for Megatron weights in
    ``[0.5, 2^24)``, so Megatron -> HF -> Megatron is bit-exact there; the HF -> Megatron
    direction rounds ``1 + w`` (an HF norm weight of ``1e-9`` has no fp32 ``1 + w`` distinct
    from 1), so HF -> Megatron -> HF returns ``fl(1 + w) - 1``, within ``2^-24`` of ``w``.
    Raises ``ValueError`` naming unknown, duplicate, mis-shaped or missing weights.
    """
    return dict(iter_megatron_to_hf(megatron_state_dict.items(), hf_config, layout=layout))
