"""The text model maker (``rollout.text_model``): it learns, and its checkpoint is the model it trained.

A few steps on a slice of the standard library (and one scripted code_repair episode in the
batch, real sandbox): held-out bits per byte must fall well below the untrained model's, and
the exported checkpoint, loaded by transformers (the embedded engine's loader), must give the
same held-out bits per byte as the trainer measured: the export is exact, not merely loadable.
"""
import json
import math
import sys

import numpy as np
import pytest
import torch

sys.modules.setdefault("fla", None)            # transformers' torch path, as the embedded engine runs it

from megatron_harts.rollout import text_model as tm  # noqa: E402


def test_text_model_learns_and_exports_exactly(tmp_path):
    cfg = tm.TextModelConfig(hidden_size=64, num_layers=4, seq_len=96, batch=6, steps=12, minutes=0, lr=3e-3,
                             warmup_steps=1, agent_family="code_repair", agent_tasks=1, agent_samples=1,
                             agent_fraction=0.2, eval_windows=4, eval_every=6, max_files=40)
    r = tm.pretrain(cfg, tmp_path, progress=False)
    assert r["steps"] == 12 and r["agent_episodes"] == 1
    assert r["eval_bits_per_byte_before"] > 7.5              # untrained: about log2(264) = 8.04
    assert r["eval_bits_per_byte_after"] < r["eval_bits_per_byte_before"] - 1.5, r
    assert [x["step"] for x in r["log"] if "eval_bits_per_byte" in x] == [5, 11]
    saved = json.loads((tmp_path / "text_model.json").read_text())
    assert saved["eval_bits_per_byte_after"] == r["eval_bits_per_byte_after"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model", "text_model.json"]

    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(r["model"], dtype=torch.float32, local_files_only=True).eval()
    corpus = tm.TextCorpus(tm.stdlib_files(cfg.max_files), tm.ByteTokenizer())
    nll = []
    with torch.no_grad():
        for t in tm.held_out_set(corpus, cfg):
            ids = torch.as_tensor(np.asarray(t.tokens))[None]
            lp = torch.log_softmax(model(ids).logits[0, :-1].float(), -1)
            nll.append(-lp.gather(1, ids[0, 1:, None])[:, 0])
    bpb = float(torch.cat(nll).mean()) / math.log(2)
    assert bpb == pytest.approx(r["eval_bits_per_byte_after"], abs=2e-3)


def test_text_model_bad_config_is_one_line_error(capsys):
    assert tm.main(["--out", "/tmp/unused_text_model", "--steps", "0", "--minutes", "0"]) == 2
    assert "give --steps or --minutes" in capsys.readouterr().err


def test_h200_settings_are_sglang_servable():
    """The gpu_run.sh text-model shapes: head dims 64 (SGLang's kernels), GQA and GDN head groups
    that divide, 8K-token episodes within max_position_embeddings, every layer MoE."""
    from megatron_harts.rollout.weight_sync import hf_config_json, sglang_incompatibilities

    cfg = tm.TextModelConfig(hidden_size=512, num_layers=8, head_dim=64, moe=True, dtype="bfloat16")
    hf = tm.model_config(cfg)
    assert (hf["num_attention_heads"], hf["num_key_value_heads"], hf["head_dim"]) == (8, 4, 64)
    assert (hf["linear_num_key_heads"], hf["linear_num_value_heads"]) == (4, 8)
    assert hf["linear_key_head_dim"] == hf["linear_value_head_dim"] == 64
    assert hf["max_position_embeddings"] >= 16384 and hf["vocab_size"] == 264
    assert sglang_incompatibilities(hf) == []
    js = hf_config_json(dict(hf, dtype=cfg.dtype))
    assert js["full_attention_interval"] == 4 and js["torch_dtype"] == "bfloat16"
    assert js["layer_types"].count("full_attention") == 2 and js["num_experts"] > 0
    assert tm._heads(320, 64) == (5, 1)          # 5 heads: no 2-head grouping divides them


def _tiny(**kw):
    return tm.TextModelConfig(**{**dict(hidden_size=32, num_layers=4, head_dim=16, seq_len=48, batch=3, steps=6,
                                        minutes=0, warmup_steps=1, agent_family=None, eval_windows=2, eval_every=0,
                                        max_files=40), **kw})


def test_text_model_exports_when_a_step_fails(tmp_path, monkeypatch):
    """An error in a step ends training; the model of the last completed step is exported (also
    during training with export_every_minutes), text_model.json records the error, exit status 1."""
    from megatron_harts.rollout.trainer import HartsTrainer

    real, calls = HartsTrainer.train_step, []

    def flaky(self, batch):
        calls.append(1)
        if len(calls) == 4:
            raise RuntimeError("boom")
        return real(self, batch)

    monkeypatch.setattr(HartsTrainer, "train_step", flaky)
    r = tm.pretrain(_tiny(lr_decay="cosine", export_every_minutes=1e-6), tmp_path, progress=False)
    assert r["steps"] == 3 and r["stop_reason"] == "error" and "boom" in r["error"] and r["complete"]
    assert r["eval_bits_per_byte_after"] is not None
    lrs = [x["lr"] for x in r["log"]]
    assert lrs == sorted(lrs, reverse=True) and lrs[-1] < lrs[0]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model", "text_model.json"]
    assert json.loads((tmp_path / "model" / "config.json").read_text())["head_dim"] == 16
    assert json.loads((tmp_path / "text_model.json").read_text())["error"] == r["error"]


def test_text_model_wall_limit_keeps_time_for_the_export(tmp_path, monkeypatch):
    """wall_minutes counts from the process start: with less left than the final evaluation and
    export need, no step is taken and the model is still written."""
    monkeypatch.setattr(tm, "_process_age_s", lambda: 0.0)
    r = tm.pretrain(_tiny(steps=0, minutes=5, wall_minutes=0.1), tmp_path, progress=False)
    assert r["steps"] == 0 and r["stop_reason"] == "wall_minutes" and r["error"] is None
    assert (tmp_path / "model" / "config.json").exists()


def test_text_model_minutes_count_after_the_first_step(tmp_path, monkeypatch):
    """The first step compiles (115 s on a bare H100, ~1 s a step after): ``minutes`` of training
    count from its end, so a first step longer than the whole budget still leaves steps after it."""
    import time

    from megatron_harts.rollout.trainer import HartsTrainer

    real, calls = HartsTrainer.train_step, []

    def slow_first(self, batch):
        calls.append(len(calls))
        if len(calls) == 1:
            time.sleep(1.5)                    # the first step's compilation, longer than --minutes
        return real(self, batch)
    monkeypatch.setattr(HartsTrainer, "train_step", slow_first)
    r = tm.pretrain(_tiny(steps=0, minutes=0.5 / 60, lr_decay="cosine"), tmp_path, progress=False)
    assert r["stop_reason"] == "minutes" and r["steps"] >= 2 and len(calls) == r["steps"], r
    lrs = [x["lr"] for x in r["log"]]
    assert lrs[1] > 0.5 * max(lrs), lrs        # the time-based schedule starts after the first step


def test_wall_rule_predicts_the_next_step_from_the_steps_after_the_first():
    """No step may end past the wall; the next step's time is the slowest of the last five steps
    after the first (the first compiles)."""
    wall_end, reserve = 100.0, 20.0
    assert not tm._past_wall(40.0, [115.0], reserve, wall_end)            # only the compiling step: 30 s for
    assert tm._past_wall(60.0, [115.0], reserve, wall_end)                 # the next (60 + 30 + 20 > 100)
    assert not tm._past_wall(70.0, [5.0], reserve, wall_end)               # or the first's time if shorter
    assert not tm._past_wall(50.0, [115.0, 1.0, 2.0], reserve, wall_end)
    assert tm._past_wall(79.5, [115.0, 1.0, 2.0], reserve, wall_end)       # 79.5 + 2 + 20 > 100
    assert tm._past_wall(81.0, [], reserve, wall_end)                      # the reserve alone does not fit
    assert tm._past_wall(50.0, [1.0] + [1.0, 40.0, 1.0, 1.0, 1.0], reserve, wall_end)   # 40 s within the last five
    assert not tm._past_wall(50.0, [1.0] + [40.0, 1.0, 1.0, 1.0, 1.0, 1.0], reserve, wall_end)  # older than five
