"""Parity with Hugging Face: tiny ``Qwen3NextForCausalLM`` (random weights) vs the converted
tree-packed Megatron ``HybridModel`` (``megatron_harts.megatron.convert``), fp32 on CPU.

The HF side runs in a subprocess (``hf_qwen3_next_ref.py``) where ``import fla`` is blocked, so
transformers takes its torch GDN path (fla's kernels need a GPU; this session imports fla for
Megatron's GDN). It builds each model and returns its state dict and every trajectory's per-token
log-probs, each trajectory a plain causal forward of its own (as its own right-padded batch row,
checked there against single ``[1, L]`` forwards). Here the state dict is converted, loaded into a
``HybridModel`` built with ``tree_hybrid_stack_spec``, and the log-probs of ``pack(trees)``
(tree-packed, chunk size 8 so branches fall on/around chunk boundaries) must equal HF's within
1e-4.

Two models, every HF piece active (nothing is neutralised, see docs/hf_conversion.md):
* ``qwen3next``: 4 HF layers, 3 GDN : 1 gated attention (the released ratio), layer 1 dense MLP
  (``mlp_only_layers``), the others MoE 8 experts top-2 (renormalised) + gated shared expert,
  GDN 2 key / 4 value heads, GQA 4:2, partial RoPE 0.25 -> pattern ``GEG-GE*E``;
* ``mix22``: 2:2 GDN/attention, GDN key = value heads with Dk != Dv, MQA, partial RoPE 0.5,
  unnormalised top-2 (``norm_topk_prob=False``), tied embeddings -> ``GE*EGE*E``.
Norm weights and ``dt_bias`` are randomised (HF initialises the zero-centered norms to 0).
"""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from megatron_harts.megatron import convert, cpu_shim, tree_packed_seq_params
from megatron_harts.ops import tree_token_logprobs
from megatron_harts.packing import pack
from megatron_harts.tree import RolloutTree
from trees import corner_cases, deep_tree, random_trees, wide_tree


HERE = os.path.dirname(os.path.abspath(__file__))
VOCAB, C, TOL = 128, 8, 1e-4

_BASE = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=4, num_attention_heads=4,
             head_dim=16, linear_conv_kernel_dim=4, linear_key_head_dim=16, num_experts=8, num_experts_per_tok=2,
             moe_intermediate_size=32, shared_expert_intermediate_size=48, initializer_range=0.1,
             rms_norm_eps=1e-6, max_position_embeddings=512)
MODELS = {
    "qwen3next": dict(_BASE, num_key_value_heads=2, linear_num_key_heads=2, linear_num_value_heads=4,
                      linear_value_head_dim=16, mlp_only_layers=[1],
                      rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25}),
    "mix22": dict(_BASE, num_key_value_heads=1, linear_num_key_heads=2, linear_num_value_heads=2,
                  linear_value_head_dim=8, layer_types=["linear_attention", "full_attention"] * 2,
                  norm_topk_prob=False, tie_word_embeddings=True,
                  rope_parameters={"rope_type": "default", "rope_theta": 5000.0, "partial_rotary_factor": 0.5}),
}
PATTERNS = {"qwen3next": "GEG-GE*E", "mix22": "GE*EGE*E"}


def _random_trees(seed: int, num_trees: int = 2) -> list[list[list[int]]]:
    return random_trees(seed, C, VOCAB, num_trees, branches=(1, 6))


CASES = {name: [trajs] for name, trajs in corner_cases(C).items() if name not in ("deep", "wide")}
CASES["deep"] = [deep_tree(C, levels=10)]        # (24 levels in test_megatron_tree; slow here)
CASES["wide"] = [wide_tree(C, children=24)]
CASES["random"] = _random_trees(0)


def _all_trajectories() -> list[list[int]]:
    return [t for name in sorted(CASES) for tree in CASES[name] for t in tree]


@pytest.fixture(scope="module")
def hf_ref(tmp_path_factory):
    """{model name: {"config", "state_dict", "logprobs" {case: [per trajectory]}, "torch_path"}}."""
    d = tmp_path_factory.mktemp("hf")
    trajs = _all_trajectories()
    spec = {"models": [{"config": MODELS[n], "seed": i, "norm_std": 0.1} for i, n in enumerate(MODELS)],
            "trajectories": trajs}
    (d / "in.json").write_text(json.dumps(spec))
    env = dict(os.environ, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "2"))
    proc = subprocess.run([sys.executable, os.path.join(HERE, "hf_qwen3_next_ref.py"), str(d / "in.json"),
                           str(d / "out.pt")], capture_output=True, text=True, timeout=600, env=env)
    assert proc.returncode == 0, proc.stderr[-4000:]
    results = torch.load(d / "out.pt")
    out = {}
    for name, res in zip(MODELS, results):
        lps, k = {}, 0
        for case in sorted(CASES):
            n = sum(len(tree) for tree in CASES[case])
            lps[case] = res["logprobs"][k:k + n]
            k += n
        out[name] = dict(res, logprobs=lps)
    return out


@pytest.fixture(scope="module")
def megatron_models(hf_ref):
    """{model name: converted tree-spec HybridModel (eval)}; the CPU Megatron setup stays up."""
    with cpu_shim.cpu_megatron(seed=0):
        models = {}
        for name, ref in hf_ref.items():
            models[name] = convert.load_hf_into_megatron(ref["state_dict"], ref["config"]).eval()
        yield models


def _tree_logprobs(model, trees, chunk_size=C) -> list[torch.Tensor]:
    p = pack(trees, chunk_size=chunk_size)
    with torch.no_grad():
        logits = model(p.tokens[None], p.position_ids[None], None, packed_seq_params=tree_packed_seq_params(p))
    return tree_token_logprobs(logits[0], p)


def _max_err(got, want) -> float:
    assert [g.shape for g in got] == [w.shape for w in want]
    return max((float((g - w).abs().max()) for g, w in zip(got, want) if w.numel()), default=0.0)


def test_hf_reference(hf_ref):
    """The HF side ran transformers' torch GDN path, and its batched rows equal single forwards."""
    for name, ref in hf_ref.items():
        assert ref["torch_path"], f"{name}: transformers did not take its torch GDN path"
        assert ref["alone_vs_batched"] < 1e-5, f"{name}: batched vs alone {ref['alone_vs_batched']:.2e}"


@pytest.mark.parametrize("name", sorted(MODELS))
def test_conversion_layout(hf_ref, name):
    ref = hf_ref[name]
    args, sd = convert.hf_to_megatron(ref["state_dict"], ref["config"])
    assert args.pattern == PATTERNS[name]
    assert args.config["attention_output_gate"] and args.config["qk_layernorm"]
    assert args.config["moe_shared_expert_gate"]
    assert args.model["rotary_percent"] == MODELS[name]["rope_parameters"]["partial_rotary_factor"]
    # zero-centered norms become 1 + w; the GDN gated norm is copied
    hf_sd = ref["state_dict"]
    torch.testing.assert_close(sd["decoder.final_norm.weight"], 1 + hf_sd["model.norm.weight"])
    torch.testing.assert_close(sd["decoder.layers.0.self_attention.out_norm.weight"],
                               hf_sd["model.layers.0.linear_attn.norm.weight"])
    from transformers import Qwen3NextConfig     # config only: does not import the modeling code

    obj = convert.hf_config_to_megatron(Qwen3NextConfig(**MODELS[name]))
    assert (obj.pattern, obj.config, obj.model) == (args.pattern, args.config, args.model)
    with pytest.raises(ValueError, match="unconverted"):
        convert.hf_to_megatron(dict(hf_sd, **{"model.extra.weight": torch.zeros(1)}), ref["config"])


@pytest.mark.parametrize("name", sorted(MODELS))
@pytest.mark.parametrize("case", sorted(CASES))
def test_tree_packed_megatron_equals_hf(hf_ref, megatron_models, name, case):
    trees = [RolloutTree.from_trajectories(t) for t in CASES[case]]
    got = _tree_logprobs(megatron_models[name], trees)
    want = hf_ref[name]["logprobs"][case]
    err = _max_err(got, want)
    assert err < TOL, f"{name}/{case}: max |log-prob diff| {err:.2e}"


@pytest.mark.parametrize("name", sorted(MODELS))
def test_all_trees_in_one_pack(hf_ref, megatron_models, name):
    """Every case's trees in a single microbatch (several roots), default chunk size 64."""
    trees = [RolloutTree.from_trajectories(t) for case in sorted(CASES) for t in CASES[case]]
    got = _tree_logprobs(megatron_models[name], trees, chunk_size=64)
    want = [lp for case in sorted(CASES) for lp in hf_ref[name]["logprobs"][case]]
    err = _max_err(got, want)
    assert err < TOL, f"{name}: max |log-prob diff| {err:.2e}"
    spread = max(float(w.std()) for w in want if w.numel() > 1)
    assert spread > 0.3, "log-probs too flat for the comparison to mean much"
