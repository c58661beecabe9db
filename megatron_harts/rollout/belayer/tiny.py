"""A tiny random Qwen3-Next checkpoint for the fault-tolerance tests and the CPU benchmark.

:func:`make_tiny_checkpoint` writes a Hugging Face checkpoint (``save_pretrained``, fp32 by default) of
the ``tiny`` preset (or another, e.g. ``small-moe`` in bf16 for SGLang) (:func:`~megatron_harts.rollout.weight_sync.tiny_qwen3_next_config`, byte
tokenizer vocabulary 264), made in a helper process with fla blocked (transformers' torch path,
as the embedded engine uses). With ``call_prob > 0`` the untrained model is *steered*, not
trained: every token embedding gets one shared direction (so the final hidden state is nearly the
same at every position) and the ``lm_head`` rows of ``</call>`` and ``<eos>`` are set so that
these tokens are sampled with about ``call_prob`` / ``eos_prob`` at every step. A rollout then
has multi-turn episodes with tool calls (turns of ~1/``call_prob`` tokens) without a training
run (the warm-up of ``tests/test_rollout_loop.py`` takes ~80 s on 2 cores); the tokens are noise,
which is all a fault-tolerance test needs. Not a model of anything.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

_HELPER = r'''
import json, math, sys
sys.modules["fla"] = None
sys.modules["causal_conv1d"] = None
import torch
torch.set_num_threads(1)
from transformers import Qwen3NextConfig, Qwen3NextForCausalLM
a = json.loads(sys.argv[1])
cfg = dict(a["config"]); cfg.pop("model_type", None)
torch.manual_seed(a["seed"])
model = Qwen3NextForCausalLM(Qwen3NextConfig(**cfg)).float().eval()
stats = {}
if a["call_prob"] > 0:
    with torch.no_grad():
        emb = model.model.embed_tokens.weight
        emb.add_(torch.ones(emb.shape[1]) * a["shared"])
        ids = torch.randint(8, cfg["vocab_size"], (4, 64))
        out = model(input_ids=ids, output_hidden_states=True, use_cache=False)
        h = out.hidden_states[-1].reshape(-1, emb.shape[1])
        v = h.mean(0)
        W = model.lm_head.weight
        others = torch.logsumexp(out.logits.reshape(-1, W.shape[0]), -1).mean()
        for tok, p in ((a["end_call"], a["call_prob"]), (a["eos"], a["eos_prob"])):
            target = float(others) + math.log(p / (1 - p))
            cur = float((h @ W[tok]).mean())
            W[tok] += (target - cur) * v / float(v @ v)
        probs = torch.softmax(model(input_ids=ids, use_cache=False).logits.float(), -1).reshape(-1, W.shape[0])
        stats = {"p_end_call": float(probs[:, a["end_call"]].mean()), "p_eos": float(probs[:, a["eos"]].mean())}
model.to(getattr(torch, a["dtype"]))
if a["call_prob"] > 0 and a["dtype"] != "float32":      # the probabilities the saved weights give
    with torch.no_grad():
        probs = torch.softmax(model(input_ids=ids, use_cache=False).logits.float(), -1).reshape(-1, W.shape[0])
    stats.update(p_end_call_saved=float(probs[:, a["end_call"]].mean()), p_eos_saved=float(probs[:, a["eos"]].mean()))
model.save_pretrained(a["out"])
cfg_file = a["out"] + "/config.json"
saved = json.load(open(cfg_file))
saved.setdefault("full_attention_interval", a["config"].get("full_attention_interval", 4))   # SGLang reads it
json.dump(saved, open(cfg_file, "w"), indent=1)
print(json.dumps(stats))
'''


def make_tiny_checkpoint(out: str | os.PathLike, *, seed: int = 0, call_prob: float = 0.0, eos_prob: float = 0.01,
                         shared: float = 1.0, python: str | None = None, preset: str = "tiny",
                         dtype: str = "float32") -> dict:
    """Write the checkpoint to ``out`` (a new directory); returns ``{"path", "p_end_call",
    "p_eos"}`` (the measured mean per-step probabilities when steered, in fp32; with another
    ``dtype`` also ``p_end_call_saved`` / ``p_eos_saved``, measured with the saved weights). Takes
    the helper's transformers import (~5-20 s on a loaded CPU). ``preset``: a
    :func:`~megatron_harts.rollout.weight_sync.model_config` preset (``small-moe`` for SGLang);
    ``dtype``: of the saved tensors (``bfloat16`` for SGLang); ``config.json`` gets
    ``full_attention_interval`` (SGLang's Qwen3-Next reads it; transformers 5 drops it).

    SGLang stops a request at the config's ``eos_token_id`` (2, the byte tokenizer's ``<eos>``)
    whatever its ``stop_token_ids``: an unsteered random model samples it with p ~ 1/264 per
    token, so long generations for the fault benchmarks need ``call_prob > 0`` (which turns the
    steering on) and a small ``eos_prob``."""
    from ..tokenizer import END_CALL, EOS, ByteTokenizer
    from ..weight_sync import model_config

    tok = ByteTokenizer()
    args = {"config": model_config(preset), "seed": int(seed), "call_prob": float(call_prob), "dtype": dtype,
            "eos_prob": float(eos_prob), "shared": float(shared), "out": str(out),
            "end_call": tok.token_id(END_CALL), "eos": tok.token_id(EOS)}
    r = subprocess.run([python or sys.executable, "-c", _HELPER, json.dumps(args)], capture_output=True, text=True,
                       env=dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1"))
    if r.returncode != 0 or not (Path(out) / "config.json").is_file():
        raise RuntimeError(f"making the tiny checkpoint failed (exit {r.returncode}): {r.stderr.strip()[-2000:]}")
    stats = json.loads(r.stdout.strip().splitlines()[-1])
    return {"path": str(out), **stats}
