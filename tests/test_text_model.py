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
