"""Lossless speculation (rollout/war/speculative.py) in the embedded engine.

* ``verify`` (speculative sampling for a deterministic draft) reproduces the target's joint
  distribution of two tokens (chi-square, 6000 samples, tiny vocabulary, fixed seeds); three
  mutant acceptance rules fail the same test.
* The embedded engine, served over real HTTP from its own process with ``--speculative-algorithm
  suffix``: greedy outputs and log-probs with speculation equal those without (same server,
  per-request switch), while drafts are both accepted and rejected; sampling runs through it.
"""
import json
import subprocess
import sys
import urllib.error
import urllib.request

import numpy as np
import pytest
import torch
from scipy.stats import chisquare

from megatron_harts.rollout.war.speculative import processed_probs, verify

V = 4


def _model(seed=0):
    """p(t_{n+1} | the last up to 3 tokens): one random table per context length."""
    g = torch.Generator().manual_seed(seed)
    tables = [torch.softmax(torch.randn(*(V,) * (n + 1), generator=g), -1) for n in range(4)]
    return lambda prefix: tables[min(len(prefix), 3)][tuple(prefix[-3:])]


def _joint(verify_fn, n=6000, seed=1):
    """Empirical joint of the first three emitted tokens, each step drafting two tokens from a
    skewed drafter, vs the exact chain; returns the chi-square p-value (64 cells)."""
    dist = _model()
    gen = torch.Generator().manual_seed(seed)
    rng = np.random.default_rng(seed)
    counts = np.zeros((V, V, V))
    for _ in range(n):
        out = []
        while len(out) < 3:
            d = [int(x) for x in rng.choice(V, 2, p=[0.7, 0.1, 0.1, 0.1])]
            probs = torch.stack([dist(out), dist(out + d[:1]), dist(out + d)])
            k, nxt = verify_fn(probs, d, False, gen)
            out += d[:k] + [nxt]
        counts[tuple(out[:3])] += 1
    want = np.array([[[float(dist([])[a] * dist([a])[b] * dist([a, b])[c]) for c in range(V)]
                      for b in range(V)] for a in range(V)]).ravel()
    return chisquare(counts.ravel(), want / want.sum() * counts.sum()).pvalue


def _residual_from_p(probs, draft, greedy, gen):        # mutant: on rejection sample from p itself
    for i, d in enumerate(draft):
        if float(torch.rand((), generator=gen)) < float(probs[i][d]):
            continue
        return i, int(torch.multinomial(probs[i], 1, generator=gen))
    return len(draft), int(torch.multinomial(probs[len(draft)], 1, generator=gen))


def _accept_sqrt(probs, draft, greedy, gen):            # mutant: too lenient acceptance
    for i, d in enumerate(draft):
        if float(torch.rand((), generator=gen)) < float(probs[i][d]) ** 0.5:
            continue
        res = probs[i].clone()
        res[d] = 0
        return i, int(torch.multinomial(res / res.sum(), 1, generator=gen))
    return len(draft), int(torch.multinomial(probs[len(draft)], 1, generator=gen))


def _bonus_from_last_draft_row(probs, draft, greedy, gen):   # mutant: bonus token from the wrong row
    k, nxt = verify(probs, draft, greedy, gen)
    if k == len(draft):
        nxt = int(torch.multinomial(probs[k - 1], 1, generator=gen))
    return k, nxt


def test_speculative_sampling_is_lossless_and_mutants_are_caught():
    assert _joint(verify) > 1e-3
    for mutant in (_residual_from_p, _accept_sqrt, _bonus_from_last_draft_row):
        assert _joint(mutant) < 1e-6, mutant.__name__


def test_greedy_verify_and_processed_probs():
    logits = torch.tensor([[0.0, 3.0, 1.0, 0.0], [2.0, 0.0, 0.0, 0.0], [0.0, 0.0, 0.0, 5.0]])
    assert verify(None, [1, 0], True, None, logits=logits) == (2, 3)
    assert verify(None, [1, 2], True, None, logits=logits) == (1, 0)
    assert verify(None, [2, 0], True, None, logits=logits) == (0, 1)
    # the engine's sampling distribution: temperature, top-k, then top-p (renormalised)
    p = processed_probs(torch.log(torch.tensor([0.5, 0.3, 0.15, 0.05])), 1.0, 3, 0.7)
    assert torch.allclose(p, torch.tensor([0.5, 0.3, 0.0, 0.0]) / 0.8)
    p = processed_probs(torch.tensor([1.0, 2.0, 3.0]), 0.5, -1, 1.0)
    assert torch.allclose(p, torch.softmax(torch.tensor([2.0, 4.0, 6.0]), -1))


# ---------------------------------------------------------------------------------- engine
MAKE = r'''
import sys
sys.modules["fla"] = None
sys.modules["causal_conv1d"] = None
import torch
from transformers import Qwen3NextConfig, Qwen3NextForCausalLM
from megatron_harts.rollout.weight_sync import tiny_qwen3_next_config
torch.manual_seed(0)
m = Qwen3NextForCausalLM(Qwen3NextConfig(**tiny_qwen3_next_config(initializer_range=0.2))).float().eval()
with torch.no_grad():
    for name, p in m.named_parameters():
        if name.endswith("norm.weight") or name.endswith("dt_bias"):
            p.add_(torch.randn_like(p) * 0.1)
m.save_pretrained(sys.argv[1])
'''


@pytest.fixture(scope="module")
def spec_server(tmp_path_factory):
    from megatron_harts.rollout.engines import EmbeddedServer

    d = tmp_path_factory.mktemp("war_spec")
    subprocess.run([sys.executable, "-c", MAKE, str(d / "model")], check=True)
    srv = EmbeddedServer(str(d / "model"), threads=1, log_path=str(d / "server.log"),
                         extra_args=["--speculative-algorithm", "suffix", "--speculative-num-draft-tokens", "6"])
    srv.start()
    yield srv
    srv.stop()


def _post(url, path, body):
    req = urllib.request.Request(url + path, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=120) as r:
        return json.loads(r.read() or b"null")


def _gen(url, prompt, rid, spec, **sp):
    sp = dict({"max_new_tokens": 32, "temperature": 0.0, "ignore_eos": True}, **sp)
    d = _post(url, "/generate", {"input_ids": prompt, "sampling_params": sp, "return_logprob": True, "rid": rid,
                                 "speculative": spec})
    return d["output_ids"], [x[0] for x in d["meta_info"]["output_token_logprobs"]], d["meta_info"]


@pytest.mark.timeout(300)
def test_engine_greedy_identical_with_and_without_speculation(spec_server):
    url = spec_server.url
    prompt = [1] + [8 + b for b in b"def f(x):\n    return x + 1\n"]
    base, base_lp, meta = _gen(url, prompt, "g/0#0-0", False)
    assert "spec_verify_ct" not in meta
    # index the greedy continuation and a corrupted copy: drafts get accepted and rejected
    bad = list(base)
    for i in range(5, len(bad), 9):
        bad[i] = (bad[i] - 1) % 264          # smaller id: wins the 1:1 tie -> drafted, rejected
    _post(url, "/war/add_trajectories", {"trajectories": [{"tokens": prompt + base, "group": "g"},
                                                          {"tokens": prompt + bad, "group": "g"}]})
    before = _post(url, "/server_info", {})["speculative"]
    out, lp, meta = _gen(url, prompt, "g/1#0-1", True)
    after = _post(url, "/server_info", {})["speculative"]
    assert out == base
    # fp32; a multi-token verify forward vs one-token steps (chunked vs recurrent GDN path)
    assert max(abs(a - b) for a, b in zip(lp, base_lp)) < 1e-4
    drafted, accepted = after["drafted"] - before["drafted"], after["accepted"] - before["accepted"]
    assert accepted > 0 and drafted > accepted, (drafted, accepted)
    assert meta["spec_verify_ct"] < len(out)              # fewer forwards than tokens
    print(f"greedy: accept length {meta['spec_accept_length']:.2f} tokens per verification")
    # no index for this group, a new prompt: speculation from the context alone, still identical
    p2 = [1] + [8 + b for b in b"abcabcabcabcabc"]
    assert _gen(url, p2, "h/0#0-0", True)[0] == _gen(url, p2, "h/0#0-1", False)[0]


@pytest.mark.timeout(300)
def test_engine_sampling_with_speculation(spec_server):
    """Sampling goes through the draft-verify path (its distribution is tested on ``verify``
    above; its log-prob rows are the greedy path's, tested against non-speculative decoding)."""
    url = spec_server.url
    prompt = [1] + [8 + b for b in b"for i in range(10):\n"]
    base, _, _ = _gen(url, prompt, "s/0#0-0", False)
    _post(url, "/war/add_trajectories", {"trajectories": [{"tokens": prompt + base, "group": "s"}]})
    out, lp, meta = _gen(url, prompt, "s/1#0-0", True, temperature=1.0, top_k=20, sampling_seed=3)
    assert len(out) == 32 and len(lp) == 32 and meta["spec_verify_ct"] >= 1
    assert all(-50 < x <= 0 for x in lp)
    with pytest.raises(urllib.error.HTTPError):
        _post(url, "/war/add_trajectories", {"trajectories": [{"group": "s"}]})
