"""The deepened checkpoint (megatron_harts.rollout.deepen): same logits bit for bit, factor x layers
that really compute, and one-line errors for checkpoints it cannot deepen."""
import json
import subprocess
import sys

import pytest

from megatron_harts.rollout.deepen import OUTPUT_PROJECTIONS, DeepenError, deepen_checkpoint

# transformers' torch path of Qwen3-Next (no fla): a tiny MoE model with random weights, every
# output projection nonzero, saved through the loop's checkpoint writer.
CHECK = r'''
import sys, json
sys.modules["fla"] = None
sys.modules["causal_conv1d"] = None
import torch
from transformers import AutoModelForCausalLM, Qwen3NextConfig, Qwen3NextForCausalLM
from megatron_harts.rollout.weight_sync import tiny_qwen3_next_config, save_hf_checkpoint
from megatron_harts.rollout.deepen import deepen_checkpoint
src, dst, factor, zero_pattern = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4]
torch.manual_seed(0)
cfg = tiny_qwen3_next_config(moe=True, num_layers=4, initializer_range=0.2)
m = Qwen3NextForCausalLM(Qwen3NextConfig(**cfg)).float().eval()
save_hf_checkpoint(src, m.state_dict(), cfg, version="v0", warn_sglang=False)
if zero_pattern != "default":           # a deliberately incomplete list of output projections
    import re, megatron_harts.rollout.deepen as d
    d.OUTPUT_PROJECTIONS = re.compile(zero_pattern)
info = deepen_checkpoint(src, dst, factor)
a = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32).eval()
b = AutoModelForCausalLM.from_pretrained(dst, dtype=torch.float32).eval()
ids = torch.randint(3, 260, (2, 37))
with torch.no_grad():
    la, lb = a(ids).logits, b(ids).logits
    # the appended layers compute: layer n's attention/GDN mixer output before its zero projection
    h = {}
    blk = b.model.layers[4]
    mixer = blk.linear_attn if hasattr(blk, "linear_attn") else blk.self_attn
    proj = mixer.out_proj if hasattr(mixer, "out_proj") else mixer.o_proj
    hook = proj.register_forward_hook(lambda mod, inp, out: h.update(inp=inp[0].abs().max().item()))
    b(ids)
    hook.remove()
    # greedy decoding through the cache, token by token
    ga = a.generate(ids[:1, :9], max_new_tokens=12, do_sample=False)
    gb = b.generate(ids[:1, :9], max_new_tokens=12, do_sample=False)
print(json.dumps(dict(info, equal=bool(torch.equal(la, lb)), max_diff=(la - lb).abs().max().item(),
                      mixer_in=h["inp"], layers_b=len(b.model.layers), generate_equal=bool(torch.equal(ga, gb)))))
'''


def _run(tmp_path, factor, zero_pattern="default"):
    out = subprocess.run([sys.executable, "-c", CHECK, str(tmp_path / "src"), str(tmp_path / "dst"), str(factor),
                          zero_pattern], capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.timeout(600)
def test_deepened_model_has_the_same_logits_and_computes(tmp_path):
    r = _run(tmp_path, 3)
    assert r["layers"] == [4, 12] and r["layers_b"] == 12
    # embeddings, final norm and lm_head once; every layer tensor three times
    assert r["params"][1] > 2.5 * r["params"][0]
    # per appended layer: mixer out projection, shared expert and 4 experts' down projections
    assert r["zeroed"] == 8 * (1 + 1 + 4)
    assert r["equal"], r["max_diff"]
    assert r["generate_equal"]
    assert r["mixer_in"] > 0          # the appended layers run on real activations


@pytest.mark.timeout(600)
def test_a_missed_output_projection_changes_the_logits(tmp_path):
    # without the shared expert's down projection zeroed the appended layers leak into the stream:
    # the equality above is what detects it
    pattern = r"\.(self_attn\.o_proj|linear_attn\.out_proj|mlp\.experts(\.\d+)?\.down_proj)(\.weight)?$"
    r = _run(tmp_path, 2, pattern)
    assert not r["equal"] and r["max_diff"] > 1e-4


def test_output_projection_names():
    for name in ("model.layers.9.self_attn.o_proj.weight", "model.layers.9.linear_attn.out_proj.weight",
                 "model.layers.9.mlp.down_proj.weight", "model.layers.9.mlp.experts.3.down_proj.weight",
                 "model.layers.9.mlp.shared_expert.down_proj.weight", "model.layers.9.mlp.experts.down_proj"):
        assert OUTPUT_PROJECTIONS.search(name), name
    for name in ("model.layers.9.self_attn.q_proj.weight", "model.layers.9.linear_attn.in_proj_qkvz.weight",
                 "model.layers.9.mlp.shared_expert_gate.weight", "model.layers.9.mlp.experts.3.up_proj.weight",
                 "model.layers.9.mlp.gate.weight"):
        assert not OUTPUT_PROJECTIONS.search(name), name


def test_bad_checkpoints_get_one_line_errors(tmp_path):
    d = tmp_path / "m"
    d.mkdir()
    with pytest.raises(DeepenError, match="config.json"):
        deepen_checkpoint(d, tmp_path / "o", 2)
    (d / "config.json").write_text(json.dumps({"model_type": "qwen3_next", "num_hidden_layers": 6,
                                               "full_attention_interval": 4}))
    with pytest.raises(DeepenError, match="num_hidden_layers 6 is not a multiple of full_attention_interval 4"):
        deepen_checkpoint(d, tmp_path / "o", 2)
    (d / "config.json").write_text(json.dumps({"model_type": "llama", "num_hidden_layers": 4}))
    with pytest.raises(DeepenError, match="model_type 'llama'"):
        deepen_checkpoint(d, tmp_path / "o", 2)
    (d / "config.json").write_text(json.dumps({"model_type": "qwen3_next", "num_hidden_layers": 4}))
    with pytest.raises(DeepenError, match="no \\*.safetensors"):
        deepen_checkpoint(d, tmp_path / "o", 2)
    from megatron_harts.rollout.deepen import main
    assert main([str(d), str(tmp_path / "o"), "--factor", "0"]) == 2
