"""Weight sync Megatron -> Hugging Face (``convert.megatron_to_hf``, ``rollout.weight_sync``), fp32 on CPU.

* round trips: HF -> Megatron -> HF is bit-exact (zero-centered norms snapped to values whose
  ``1 + w`` is exact; unsnapped ones come back as ``fl(1 + w) - 1``), Megatron -> HF -> Megatron
  is bit-exact, for the two models of ``test_hf_parity`` (MoE + shared expert +
  ``mlp_only_layers``; tied embeddings, MQA, 2:2) and the tiny presets;
* the checkpoint directory written by ``WeightSync.export`` loads with
  ``Qwen3NextForCausalLM.from_pretrained`` (subprocess ``hf_ckpt_ref.py``, fla blocked), holds
  exactly the weights of ``megatron_to_hf``, and its log-probs equal the tree-packed Megatron
  model's within 1e-4: rollout-train consistency at the weights level;
* sharding / index, atomic writes and the version file, keep / LATEST, push to engines, and
  clear errors on bad state dicts.
"""
from __future__ import annotations

import io
import json
import os
import re
import subprocess
import sys

import pytest
import torch

from megatron_harts.megatron import convert, cpu_shim, tree_packed_seq_params
from megatron_harts.ops import tree_token_logprobs
from megatron_harts.packing import pack
from megatron_harts.rollout import weight_sync as ws
from megatron_harts.tree import RolloutTree
from trees import corner_cases, random_trees


from test_hf_parity import MODELS  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
C, TOL, VOCAB = 8, 1e-4, 128           # trajectories use ids < 128: valid for every model here
ZC = ("input_layernorm.weight", "post_attention_layernorm.weight", "q_norm.weight", "k_norm.weight",
      "model.norm.weight")
CONFIGS = {"qwen3next": MODELS["qwen3next"], "mix22": MODELS["mix22"],
           "tiny": ws.tiny_qwen3_next_config(), "tiny_moe": ws.tiny_qwen3_next_config(moe=True, initializer_range=0.1)}


def _is_zc(name: str) -> bool:
    return name.endswith(ZC) and "linear_attn" not in name


def _hf_state_dict(cfg: dict, seed: int = 0, snap: bool = True) -> dict[str, torch.Tensor]:
    """Random ``Qwen3NextForCausalLM`` weights (built, never run) with norms and ``dt_bias``
    perturbed by N(0, 0.1); ``snap``: zero-centered norms replaced by ``fl(1 + w) - 1`` (the
    values ``hf_to_megatron`` can represent exactly)."""
    from transformers import Qwen3NextConfig, Qwen3NextForCausalLM

    torch.manual_seed(seed)
    model = Qwen3NextForCausalLM(Qwen3NextConfig(**cfg)).float()
    sd = {k: v.detach().clone() for k, v in model.state_dict().items()}
    if cfg.get("tie_word_embeddings"):
        sd["lm_head.weight"] = sd["model.embed_tokens.weight"]
    g = torch.Generator().manual_seed(seed + 1)
    for k, v in sd.items():
        if k.endswith("norm.weight") or k.endswith("dt_bias"):
            v.add_(torch.randn(v.shape, generator=g) * 0.1)
            if snap and _is_zc(k):
                v.copy_((1.0 + v) - 1.0)
    return sd


def _perturb_megatron(model, seed: int = 0) -> None:
    """Norm weights (Megatron initialises them to 1) and ``dt_bias`` += N(0, 0.1)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if n.endswith("layernorm.weight") or n.endswith("norm.weight") or n.endswith("dt_bias"):
                p.add_(torch.randn(p.shape, generator=g) * 0.1)


def _plain(sd) -> dict[str, torch.Tensor]:
    return {k: v for k, v in sd.items() if not k.endswith("_extra_state")}


def _assert_bit_exact(got: dict, want: dict, what: str) -> None:
    assert sorted(got) == sorted(want), f"{what}: keys differ: {sorted(set(got) ^ set(want))[:6]}"
    for k in want:
        assert got[k].dtype == want[k].dtype and got[k].shape == want[k].shape, f"{what}: {k}"
        assert torch.equal(got[k], want[k]), f"{what}: {k} differs (max {float((got[k] - want[k]).abs().max()):.2e})"


# ---------------------------------------------------------------------------------------------
# (a) round trips
# ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("name", ["qwen3next", "mix22"])
def test_hf_megatron_hf_bit_exact(name):
    cfg = CONFIGS[name]
    hf = _hf_state_dict(cfg)
    _, meg = convert.hf_to_megatron(hf, cfg)
    back = convert.megatron_to_hf(meg, cfg)
    _assert_bit_exact(back, hf, f"{name} HF->Megatron->HF")
    if cfg.get("tie_word_embeddings"):
        assert back["lm_head.weight"] is back["model.embed_tokens.weight"]
    # the on-disk layout (per-expert Linear, no tied lm_head) is read back by hf_to_megatron too
    ck = convert.megatron_to_hf(meg, cfg, layout="checkpoint")
    assert not any("gate_up_proj" in k for k in ck) and "lm_head.weight" in ck     # also when tied: SGLang
    _assert_bit_exact(convert.hf_to_megatron(ck, cfg)[1], meg, f"{name} checkpoint layout")


@pytest.mark.parametrize("name", ["qwen3next", "mix22"])
def test_hf_megatron_hf_unsnapped_norms(name):
    """Arbitrary fp32 norm weights: everything is bit-exact except the zero-centered norms, which
    come back as ``fl(1 + w) - 1`` (the rounding is hf_to_megatron's, within 2^-24)."""
    cfg = CONFIGS[name]
    hf = _hf_state_dict(cfg, seed=3, snap=False)
    back = convert.megatron_to_hf(convert.hf_to_megatron(hf, cfg)[1], cfg)
    inexact = 0
    for k, w in hf.items():
        if _is_zc(k):
            assert torch.equal(back[k], (1.0 + w) - 1.0), k
            assert float((back[k] - w).abs().max()) <= 2.0 ** -24
            inexact += int(not torch.equal(back[k], w))
        else:
            assert torch.equal(back[k], w), k
    assert inexact > 0, "the unsnapped case should exercise the rounding"


def test_hf_megatron_hf_bf16_keeps_dtype():
    cfg = CONFIGS["qwen3next"]
    hf = {k: v.to(torch.bfloat16) for k, v in _hf_state_dict(cfg).items()}
    back = convert.megatron_to_hf(convert.hf_to_megatron(hf, cfg)[1], cfg)
    for k, w in hf.items():
        assert back[k].dtype == torch.bfloat16
        if not _is_zc(k):
            assert torch.equal(back[k], w), k


@pytest.fixture(scope="module")
def megatron_models():
    """{name: tree-spec HybridModel with random weights and perturbed norms} for every config."""
    with cpu_shim.cpu_megatron(seed=0):
        models = {}
        for i, (name, cfg) in enumerate(CONFIGS.items()):
            m = convert.build_megatron_model(convert.hf_config_to_megatron(cfg)).eval()
            _perturb_megatron(m, seed=i)
            models[name] = m
        yield models


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_megatron_hf_megatron_bit_exact(megatron_models, name):
    cfg, model = CONFIGS[name], megatron_models[name]
    sd = model.state_dict()                       # with _extra_state entries (None here)
    assert any(k.endswith("_extra_state") for k in sd)
    hf = convert.megatron_to_hf(sd, cfg)
    from transformers import Qwen3NextConfig, Qwen3NextForCausalLM

    with torch.device("meta"):                    # names and shapes are transformers' own
        ref = Qwen3NextForCausalLM(Qwen3NextConfig(**cfg)).state_dict()
    assert sorted(hf) == sorted(ref)
    assert all(hf[k].shape == ref[k].shape for k in ref)
    args, back = convert.hf_to_megatron(hf, cfg)
    _assert_bit_exact(back, {k: v.detach() for k, v in _plain(sd).items()}, f"{name} Megatron->HF->Megatron")
    fresh = convert.build_megatron_model(args)     # (the fixture's CPU Megatron setup is still up)
    convert.load_megatron_state_dict(fresh, back)


def test_iterator_streams_per_layer(megatron_models):
    cfg, model = CONFIGS["qwen3next"], megatron_models["qwen3next"]
    params = list(model.named_parameters())
    consumed = []

    def source():
        for i, item in enumerate(params):
            consumed.append(i)
            yield item

    it = convert.iter_megatron_to_hf(source(), cfg)
    first = next(it)
    assert first[0] == "model.embed_tokens.weight" and len(consumed) == 1
    seen = dict([first])
    for name, t in it:
        seen[name] = t
        if name == "model.layers.0.mlp.experts.down_proj":
            assert len(consumed) < len(params) // 2        # layer 0 done long before the end
    _assert_bit_exact(seen, convert.megatron_to_hf(model.state_dict(), cfg), "iterator vs dict")


def test_wrapped_te_and_padded_names(megatron_models):
    """``module.`` prefixes, TE spec names (fused layer-norm weights, grouped-GEMM experts) and a
    padded vocabulary give the same HF weights."""
    cfg, model = CONFIGS["qwen3next"], megatron_models["qwen3next"]
    sd = _plain(model.state_dict())
    want = convert.megatron_to_hf(sd, cfg)
    te = {}
    for k, v in sd.items():
        k2 = re.sub(r"(layers\.0\.)input_layernorm\.weight", r"\1self_attention.in_proj.layer_norm_weight", k)
        k2 = re.sub(r"(layers\.6\.)input_layernorm\.weight", r"\1self_attention.linear_qkv.layer_norm_weight", k2)
        k2 = re.sub(r"(layers\.3\.)pre_mlp_layernorm\.weight", r"\1mlp.linear_fc1.layer_norm_weight", k2)
        k2 = re.sub(r"experts\.local_experts\.(\d+)\.linear_fc(\d)\.weight", r"experts.linear_fc\2.weight\1", k2)
        if k2.startswith(("embedding.", "output_layer.")) and v.dim() == 2:
            v = torch.cat([v, torch.randn(5, v.shape[1])])          # vocabulary padded by 5 rows
        te["module.module." + k2] = v
    te["module.module.output_layer._extra_state"] = io.BytesIO(b"te metadata")
    _assert_bit_exact(convert.megatron_to_hf(te, cfg), want, "TE / wrapped names")


# ---------------------------------------------------------------------------------------------
# (e) bad inputs
# ---------------------------------------------------------------------------------------------

def test_bad_state_dicts(megatron_models):
    cfg, model = CONFIGS["mix22"], megatron_models["mix22"]
    sd = _plain(model.state_dict())
    key = "decoder.layers.6.self_attention.linear_qkv.weight"
    with pytest.raises(ValueError) as e:
        convert.megatron_to_hf({k: v for k, v in sd.items() if k != key}, cfg)
    msg = str(e.value)
    assert "\n" not in msg and key in msg and "missing 1 weight" in msg
    with pytest.raises(ValueError, match=r"unknown Megatron weight 'decoder\.layers\.9\.foo\.weight'"):
        convert.megatron_to_hf(dict(sd, **{"decoder.layers.9.foo.weight": torch.zeros(1)}), cfg)
    with pytest.raises(ValueError, match=re.escape(key) + r".*shape \[80, 64\], expected \[160, 64\]"):
        convert.megatron_to_hf(dict(sd, **{key: sd[key][:80]}), cfg)
    with pytest.raises(ValueError, match="given twice"):
        list(convert.iter_megatron_to_hf(list(sd.items()) + [(key, sd[key])], cfg))
    with pytest.raises(ValueError, match="layout"):
        convert.megatron_to_hf(sd, cfg, layout="fused")
    with pytest.raises(ValueError, match="not a tensor"):
        convert.megatron_to_hf(dict(sd, **{key: [1, 2]}), cfg)


# ---------------------------------------------------------------------------------------------
# configs
# ---------------------------------------------------------------------------------------------

def test_presets():
    from transformers import Qwen3NextConfig, Qwen3NextForCausalLM

    for moe, (lo, hi) in ((False, (50e6, 100e6)), (True, (50e6, 100e6))):
        cfg = ws.small_qwen3_next_config(moe=moe)
        assert 512 <= cfg["hidden_size"] <= 768 and 8 <= cfg["num_hidden_layers"] <= 12
        with torch.device("meta"):
            n = sum(p.numel() for p in Qwen3NextForCausalLM(Qwen3NextConfig(**cfg)).parameters())
        assert lo < n < hi, f"small moe={moe}: {n / 1e6:.1f}M parameters"
    tiny = ws.tiny_qwen3_next_config(moe=True, hidden_size=32)
    assert tiny["layer_types"] == ["linear_attention"] * 3 + ["full_attention"] and tiny["full_attention_interval"] == 4
    assert convert.hf_config_to_megatron(tiny).pattern == "GEGEGE*E"
    assert convert.hf_config_to_megatron(ws.tiny_qwen3_next_config()).pattern == "G-G-G-*-"
    types2 = ws.tiny_qwen3_next_config(full_attention_interval=2)["layer_types"]
    assert types2 == ["linear_attention", "full_attention"] * 2
    assert ws.qwen3_next_preset("small", moe=True) == ws.small_qwen3_next_config(moe=True)
    assert ws.model_config("small-moe") == ws.small_qwen3_next_config(moe=True)
    assert ws.model_config("tiny", hidden_size=32) == ws.tiny_qwen3_next_config(hidden_size=32)
    with pytest.raises(ValueError, match="preset"):
        ws.model_config("huge")
    assert ws.sglang_incompatibilities(tiny) == []
    assert ws.sglang_incompatibilities(ws.small_qwen3_next_config(moe=True)) == []
    assert ws.sglang_incompatibilities(ws.tiny_qwen3_next_config())               # dense: SGLang builds MoE
    assert ws.sglang_incompatibilities(MODELS["qwen3next"])                       # mlp_only_layers
    assert ws.sglang_incompatibilities(dict(tiny, layer_types=["full_attention"] + ["linear_attention"] * 3))


# ---------------------------------------------------------------------------------------------
# (b) the checkpoint loads in transformers and equals the tree-packed Megatron model
# ---------------------------------------------------------------------------------------------

LOAD_MODELS = ("tiny_moe", "qwen3next", "mix22")


def _trajectories() -> list[list[list[int]]]:
    """Trees (lists of trajectories): corner cases plus random ones."""
    cases = corner_cases(C)
    trees = [cases[k] for k in sorted(cases) if k not in ("deep", "wide")]
    return trees + random_trees(0, C, VOCAB, num_trees=2, branches=(1, 4))


@pytest.fixture(scope="module")
def exported(megatron_models, tmp_path_factory):
    """Each LOAD_MODELS model exported by ``WeightSync`` (fp32) and loaded back by
    ``hf_ckpt_ref.py``: {name: {"path", "stats", "ref"}}."""
    root = tmp_path_factory.mktemp("ckpt")
    out = {}
    for name in LOAD_MODELS:
        sync = ws.WeightSync(dict(CONFIGS[name], dtype="float32"), root / name, keep=2)
        path, stats = sync.export(megatron_models[name], version=f"{name}-v1")
        out[name] = {"path": path, "stats": stats}
    trajs = [t for tree in _trajectories() for t in tree]
    (root / "in.json").write_text(json.dumps({"checkpoints": [out[n]["path"] for n in LOAD_MODELS],
                                              "trajectories": trajs}))
    env = dict(os.environ, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "2"))
    proc = subprocess.run([sys.executable, os.path.join(HERE, "hf_ckpt_ref.py"), str(root / "in.json"),
                           str(root / "out.pt")], capture_output=True, text=True, timeout=600, env=env)
    assert proc.returncode == 0, proc.stderr[-4000:]
    for name, ref in zip(LOAD_MODELS, torch.load(root / "out.pt")):
        out[name]["ref"] = ref
    return out


@pytest.mark.parametrize("name", LOAD_MODELS)
def test_checkpoint_loads_in_transformers(exported, megatron_models, name):
    ref = exported[name]["ref"]
    info = ref["loading_info"]
    assert not any(info.get(k) for k in ("missing_keys", "unexpected_keys", "mismatched_keys", "error_msgs")), info
    # fp32, one trajectory alone vs in a padded batch: other GEMM shapes and thread splits (1.5e-5 seen
    # on a loaded machine); a layout bug (padding attended, positions shifted) is O(1)
    assert ref["torch_path"] and ref["alone_vs_batched"] < 1e-4
    want = convert.megatron_to_hf(megatron_models[name].state_dict(), CONFIGS[name])
    _assert_bit_exact({k: v for k, v in ref["state_dict"].items()}, want, f"{name}: from_pretrained")
    cfg = CONFIGS[name]
    for k in ("layer_types", "rope_parameters", "tie_word_embeddings", "mlp_only_layers", "num_experts"):
        if k in cfg:
            assert ref["config"][k] == cfg[k], k


@pytest.mark.parametrize("name", LOAD_MODELS)
def test_checkpoint_logprobs_equal_tree_packed_megatron(exported, megatron_models, name):
    """Rollout-train consistency at the weights level: the engine's model loaded from the
    exported checkpoint and the trainer's tree-packed model give the same log-probs."""
    trees = [RolloutTree.from_trajectories(t) for t in _trajectories()]
    p = pack(trees, chunk_size=C)
    with torch.no_grad():
        logits = megatron_models[name](p.tokens[None], p.position_ids[None], None,
                                       packed_seq_params=tree_packed_seq_params(p))
    got = tree_token_logprobs(logits[0], p)
    want = exported[name]["ref"]["logprobs"]
    assert [g.shape for g in got] == [w.shape for w in want]
    err = max(float((g - w).abs().max()) for g, w in zip(got, want) if w.numel())
    assert err < TOL, f"{name}: max |log-prob diff| {err:.2e}"
    assert max(float(w.std()) for w in want if w.numel() > 1) > 0.3, "log-probs too flat to mean much"


def test_config_json(exported):
    path = exported["mix22"]["path"]
    cj = json.loads(open(os.path.join(path, "config.json")).read())
    assert cj["architectures"] == ["Qwen3NextForCausalLM"] and cj["model_type"] == "qwen3_next"
    assert cj["dtype"] == cj["torch_dtype"] == "float32"
    assert cj["full_attention_interval"] == 2 and cj["layer_types"] == MODELS["mix22"]["layer_types"]
    assert cj["rope_theta"] == 5000.0 and cj["partial_rotary_factor"] == 0.5      # what SGLang reads
    assert cj["tie_word_embeddings"] is True
    cj = json.loads(open(os.path.join(exported["tiny_moe"]["path"], "config.json")).read())
    assert cj["full_attention_interval"] == 4 and cj["layer_types"][3] == "full_attention"
    again = ws.model_config(exported["tiny_moe"]["path"])            # a checkpoint dir as the model spec
    assert convert.hf_config_to_megatron(again) == convert.hf_config_to_megatron(CONFIGS["tiny_moe"])


# ---------------------------------------------------------------------------------------------
# (c) sharding
# ---------------------------------------------------------------------------------------------

def test_sharding_and_index(megatron_models, tmp_path):
    from safetensors import safe_open

    cfg = CONFIGS["tiny_moe"]
    hf = convert.megatron_to_hf(megatron_models["tiny_moe"].state_dict(), cfg, layout="checkpoint")
    bucket_mb = 0.1
    stats = ws.save_hf_checkpoint(tmp_path / "ck", hf, cfg, bucket_mb=bucket_mb, version="s1")
    d = tmp_path / "ck"
    index = json.loads((d / ws.INDEX_FILE).read_text())
    files = sorted(f.name for f in d.glob("*.safetensors"))
    n = stats.num_buckets
    assert n >= 4 and files == [f"model-{k:05d}-of-{n:05d}.safetensors" for k in range(1, n + 1)]
    assert sorted(os.listdir(d)) == sorted(files + [ws.INDEX_FILE, "config.json", ws.VERSION_FILE])
    assert sorted(index["weight_map"]) == sorted(hf) and sorted(set(index["weight_map"].values())) == files
    total = 0
    limit = bucket_mb * 2 ** 20
    for f in files:
        with safe_open(str(d / f), framework="pt") as sf:
            keys = sorted(sf.keys())
            assert keys == sorted(k for k, v in index["weight_map"].items() if v == f)
            assert sf.metadata()["format"] == "pt" and sf.metadata()["harts_version"] == "s1"
            sizes = [sf.get_tensor(k).numel() * 4 for k in keys]
            for k in keys:
                assert torch.equal(sf.get_tensor(k), hf[k]), k
        assert sum(sizes) <= limit or len(keys) == 1, f"{f}: {sum(sizes)} bytes in {len(keys)} tensors"
        total += sum(sizes)
    assert index["metadata"]["total_size"] == total == stats.bytes
    # the model layout (fused experts, tied lm_head) is written in the same on-disk layout
    fused = convert.megatron_to_hf(megatron_models["tiny_moe"].state_dict(), cfg)
    ws.save_hf_checkpoint(tmp_path / "ck2", fused, cfg, bucket_mb=bucket_mb, version="s1")
    index2 = json.loads((tmp_path / "ck2" / ws.INDEX_FILE).read_text())
    assert sorted(index2["weight_map"]) == sorted(index["weight_map"])
    assert index2["metadata"]["total_size"] == total


def test_bf16_checkpoint(megatron_models, tmp_path):
    from safetensors.torch import load_file

    cfg = dict(CONFIGS["tiny_moe"], dtype="bfloat16")
    path, stats = ws.WeightSync(cfg, tmp_path, keep=1).export(megatron_models["tiny_moe"], "b1")
    hf = convert.megatron_to_hf(megatron_models["tiny_moe"].state_dict(), cfg, layout="checkpoint")
    got = {}
    for f in sorted(os.listdir(path)):
        if f.endswith(".safetensors"):
            got.update(load_file(os.path.join(path, f)))
    assert sorted(got) == sorted(hf) and all(v.dtype == torch.bfloat16 for v in got.values())
    assert all(torch.equal(got[k], hf[k].to(torch.bfloat16)) for k in hf)   # norm shift in fp32, then cast
    assert stats.bytes == sum(v.numel() * 2 for v in got.values())
    assert json.loads(open(os.path.join(path, "config.json")).read())["torch_dtype"] == "bfloat16"


# ---------------------------------------------------------------------------------------------
# (d) atomicity, version file, keep, push
# ---------------------------------------------------------------------------------------------

def test_atomic_write_and_version(megatron_models, tmp_path):
    cfg = CONFIGS["tiny"]
    hf = convert.megatron_to_hf(megatron_models["tiny"].state_dict(), cfg)
    out = tmp_path / "ck"
    seen_during = []

    def slow():
        for i, item in enumerate(hf.items()):
            if i == 5:   # mid-write: the final directory must not exist yet, only a temporary one
                seen_during.append((out.exists(), [p.name for p in tmp_path.iterdir()]))
            yield item

    ws.save_hf_checkpoint(out, slow(), cfg, bucket_mb=0.02, version="step-7")
    exists, names = seen_during[0]
    assert not exists and len(names) == 1 and names[0].startswith(".ck.tmp-")
    assert os.listdir(tmp_path) == ["ck"]
    assert ws.read_version(out) == "step-7"
    meta = json.loads((out / ws.VERSION_FILE).read_text())
    assert meta["num_shards"] > 1 and meta["dtype"] == "float32" and meta["bytes"] > 0

    with pytest.raises(FileExistsError):
        ws.save_hf_checkpoint(out, hf, cfg, version="step-8")

    def failing():
        yield from list(hf.items())[:7]
        raise RuntimeError("trainer died mid-export")

    with pytest.raises(RuntimeError, match="mid-export"):
        ws.save_hf_checkpoint(tmp_path / "ck2", failing(), cfg, version="x")
    with pytest.raises(RuntimeError, match="mid-export"):
        ws.save_hf_checkpoint(out, failing(), cfg, version="x", overwrite=True)
    assert os.listdir(tmp_path) == ["ck"] and ws.read_version(out) == "step-7"   # untouched, no leftovers
    ws.save_hf_checkpoint(out, hf, cfg, version="step-8", overwrite=True)
    assert ws.read_version(out) == "step-8" and os.listdir(tmp_path) == ["ck"]


class FakeEngine:
    def __init__(self, name, fail=False):
        self.name, self.fail, self.calls = name, fail, []

    def update_weights_from_disk(self, path, version):
        self.calls.append((path, version, ws.read_version(path)))
        if self.fail:
            raise ConnectionError("engine down")
        return 0.25


def test_weight_sync_keep_latest_push(megatron_models, tmp_path):
    cfg = CONFIGS["tiny"]
    model = megatron_models["tiny"]
    sync = ws.WeightSync(cfg, tmp_path / "root", keep=2)
    engines = [FakeEngine("a"), FakeEngine("b")]
    paths = []
    for step in range(3):
        st = sync.sync(model, f"step/{step}", engines)          # the version becomes a safe dir name
        paths.append(st.path)
        assert st.bytes > 0 and st.seconds >= st.write_s > 0 and st.push_s > 0
        assert st.engine_s == {"a": 0.25, "b": 0.25}
    assert [os.path.basename(p) for p in paths] == ["step_0", "step_1", "step_2"]
    assert [p.name for p in sync.checkpoints()] == ["step_1", "step_2"]            # keep=2
    assert (tmp_path / "root" / "LATEST").read_text().strip() == "step_2"
    assert engines[0].calls[-1] == (paths[-1], "step/2", "step/2")
    # an exported state dict (no model) works too; re-exporting a version replaces it
    path, st = sync.export(model.state_dict(), "step/2")
    assert path == paths[-1] and [p.name for p in sync.checkpoints()] == ["step_1", "step_2"]
    bad = [FakeEngine("ok"), FakeEngine("down", fail=True)]
    with pytest.raises(RuntimeError, match=r"1/2 engine\(s\): down: ConnectionError: engine down"):
        sync.push(bad, path, "step/2")
    assert bad[0].calls and sync.push(bad, path, "step/2", raise_on_error=False) == {"ok": 0.25}
    with pytest.raises(ValueError, match="keep"):
        ws.WeightSync(cfg, tmp_path, keep=0)
    from transformers import Qwen3NextConfig

    obj = ws.WeightSync(Qwen3NextConfig(**cfg), tmp_path / "obj")      # a config object works too
    path, st = obj.export(model, "o1")
    assert st.bytes == sum(p.numel() * 4 for p in model.parameters()) and ws.read_version(path) == "o1"
