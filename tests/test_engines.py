"""Rollout engines: the embedded transformers engine, served over real HTTP from its own process,
driven through :class:`HttpEngine` (the client SGLang is driven through on the GPU).

A tiny random Qwen3-Next (3 GDN : 1 attention layers, small MoE) is made and saved, and reference
log-probs are computed, by a helper process with fla blocked (this process imports fla for
Megatron's GDN; transformers would pick fla's GPU kernels). The reference is a plain teacher-forced
fp32 forward of prompt + output (no cache); the engine's cached incremental decoding must match it
within 1e-5.
"""
import importlib.util
import json
import os
import subprocess
import sys
import threading
import time

import pytest
import torch

from megatron_harts.rollout.engines import EmbeddedServer, HttpEngine, SGLangServer, free_port, start_engine
from megatron_harts.rollout.types import Engine, EngineError, SamplingParams


#: fp32: cached decoding and the full forward sum in different orders (log-probs of a few nats, whose
#: fp32 spacing is ~5e-7; 1.0e-5 was seen once on a loaded 2-core machine, over an older 1e-5 bar).
TOL = 3e-5
CONFIG = dict(vocab_size=264, hidden_size=64, intermediate_size=96, num_hidden_layers=4, num_attention_heads=4,
              num_key_value_heads=2, head_dim=16, linear_conv_kernel_dim=4, linear_key_head_dim=16,
              linear_value_head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4, num_experts=4,
              num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=48,
              initializer_range=0.1, rms_norm_eps=1e-6, max_position_embeddings=4096,
              layer_types=["linear_attention"] * 3 + ["full_attention"])
PROMPT = [1, 40, 41, 42, 9, 100, 101, 7]

# The helper: JSON lines on stdin -> JSON lines on stdout; fla blocked before transformers loads.
HELPER = r'''
import json, sys
sys.modules["fla"] = None
sys.modules["causal_conv1d"] = None
import torch
torch.set_num_threads(1)
from transformers import AutoModelForCausalLM, Qwen3NextConfig, Qwen3NextForCausalLM
models = {}
def make(d, config, seed):
    torch.manual_seed(seed)
    model = Qwen3NextForCausalLM(Qwen3NextConfig(**config)).float().eval()
    with torch.no_grad():   # HF initialises the zero-centred norms to 0: perturb them (as tests/hf_qwen3_next_ref.py)
        for name, p in model.named_parameters():
            if name.endswith("norm.weight") or name.endswith("dt_bias"):
                p.add_(torch.randn_like(p) * 0.1)
    model.save_pretrained(d)
    return {}
def logprobs(d, prompt, output):
    if d not in models:
        models[d] = AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32, local_files_only=True).eval()
    ids = torch.tensor([prompt + output])
    with torch.no_grad():
        lp = torch.log_softmax(models[d](input_ids=ids, use_cache=False).logits[0].float(), -1)
    lp = lp[len(prompt) - 1:-1]
    return {"logprobs": lp.gather(1, torch.tensor(output)[:, None])[:, 0].tolist(), "max": lp.max(-1).values.tolist()}
for line in sys.stdin:
    req = json.loads(line)
    try:
        out = {"make": make, "logprobs": logprobs}[req.pop("op")](**req)
    except Exception as e:
        out = {"error": f"{type(e).__name__}: {e}"}
    print(json.dumps(out), flush=True)
'''


class _Ref:
    """The helper process (one transformers import for the whole module)."""

    def __init__(self):
        self.proc = subprocess.Popen([sys.executable, "-c", HELPER], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=subprocess.PIPE, text=True)
        self.lock = threading.Lock()

    def __call__(self, op, **kw):
        with self.lock:
            self.proc.stdin.write(json.dumps(dict(kw, op=op)) + "\n")
            self.proc.stdin.flush()
            line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"reference helper died: {self.proc.stderr.read()[-3000:]}")
        out = json.loads(line)
        assert "error" not in out, out["error"]
        return out

    def close(self):
        self.proc.stdin.close()
        self.proc.wait(30)


@pytest.fixture(scope="module")
def ref():
    r = _Ref()
    yield r
    r.close()


@pytest.fixture(scope="module")
def models(tmp_path_factory, ref):
    """{"v0": checkpoint dir, "v1": the same with perturbed weights written with safetensors}."""
    from safetensors.torch import load_file, save_file

    root = tmp_path_factory.mktemp("engines")
    v0, v1 = root / "v0", root / "v1"
    ref("make", d=str(v0), config=CONFIG, seed=0)
    sd = load_file(v0 / "model.safetensors")
    g = torch.Generator().manual_seed(1)
    sd = {k: (t + 0.05 * torch.randn(t.shape, generator=g) if t.is_floating_point() else t) for k, t in sd.items()}
    v1.mkdir()
    save_file(sd, v1 / "model.safetensors", metadata={"format": "pt"})
    (v1 / "config.json").write_text((v0 / "config.json").read_text())
    return {"v0": str(v0), "v1": str(v1)}


@pytest.fixture(scope="module")
def server(models, tmp_path_factory):
    log_path = str(tmp_path_factory.mktemp("server") / "embedded.log")
    srv = EmbeddedServer(models["v0"], weight_version="v0", threads=1, log_path=log_path)
    t0 = time.perf_counter()
    srv.start()
    print(f"embedded server up in {time.perf_counter() - t0:.1f} s")
    yield srv
    srv.stop()
    assert not srv.alive()


@pytest.fixture
def engine(server):
    return server.engine(timeout=60.0, retries=1, backoff=0.1)


def _check_logprobs(ref, model_dir, prompt, gen):
    want = ref("logprobs", d=model_dir, prompt=prompt, output=gen.output_ids)
    err = max(abs(a - b) for a, b in zip(gen.logprobs, want["logprobs"]))
    assert err < TOL, f"cached decoding vs full forward: max |log-prob diff| {err:.2e}"
    return want


def _wait_for(cond, timeout=30.0):
    t0 = time.monotonic()
    while not cond():
        assert time.monotonic() - t0 < timeout, "condition not met in time"
        time.sleep(0.02)


def test_protocol_and_info(engine):
    assert isinstance(engine, Engine)
    assert engine.health() and engine.alive()
    assert engine.weight_version() == "v0"
    info = engine.model_info()
    assert info["architectures"] == ["Qwen3NextForCausalLM"] and "not SGLang" in info["engine"]
    load = engine.load()
    assert (load["running"], load["queued"], load["tokens_in_flight"]) == (0, 0, 0)
    assert load["raw"][0]["num_reqs"] == 0
    engine.flush_cache()
    engine.release_memory(["kv_cache"])
    engine.resume_memory()


def test_generate_logprobs_equal_full_forward(engine, ref, models):
    t0 = time.perf_counter()
    gen = engine.generate(PROMPT, SamplingParams(max_new_tokens=32, seed=5))
    dt = time.perf_counter() - t0
    print(f"embedded engine: {len(gen.output_ids) / dt:.0f} tokens/s (tiny model, 1 thread, incl. HTTP)")
    assert gen.finish_reason == "length" and len(gen.output_ids) == len(gen.logprobs) == 32
    assert gen.weight_version == "v0" and gen.prompt_tokens == len(PROMPT) and gen.cached_tokens == 0
    want = _check_logprobs(ref, models["v0"], PROMPT, gen)
    assert torch.tensor(want["logprobs"]).std() > 0.3, "log-probs too flat for the comparison to mean much"
    # temperature / top-k / top-p change the sampling, not the reported (temperature 1) log-probs
    gen = engine.generate(PROMPT, SamplingParams(max_new_tokens=24, temperature=0.7, top_p=0.8, top_k=20, seed=1))
    _check_logprobs(ref, models["v0"], PROMPT, gen)
    # greedy: every token is the argmax
    gen = engine.generate(PROMPT, SamplingParams(max_new_tokens=16, temperature=0.0))
    want = _check_logprobs(ref, models["v0"], PROMPT, gen)
    assert max(abs(a - b) for a, b in zip(gen.logprobs, want["max"])) < TOL


def test_stop_tokens_and_max_new_tokens(engine):
    greedy = SamplingParams(max_new_tokens=20, temperature=0.0)
    full = engine.generate(PROMPT, greedy).output_ids
    k = next(i for i in range(3, len(full)) if full[i] not in full[:i])    # first occurrence of its token
    stop = SamplingParams(max_new_tokens=20, temperature=0.0, stop_token_ids=[full[k]])
    gen = engine.generate(PROMPT, stop)
    assert gen.finish_reason == "stop" and gen.output_ids == full[:k + 1] and len(gen.logprobs) == k + 1
    assert engine.generate(PROMPT, SamplingParams(max_new_tokens=1, temperature=0.0)).output_ids == full[:1]
    gen = engine.generate(PROMPT, SamplingParams(max_new_tokens=0))
    assert (gen.output_ids, gen.logprobs, gen.finish_reason) == ([], [], "length")
    # a stop token that is also the last allowed token: length is checked first (as SGLang)
    gen = engine.generate(PROMPT, SamplingParams(max_new_tokens=k + 1, temperature=0.0, stop_token_ids=[full[k]]))
    assert gen.finish_reason == "length" and gen.output_ids == full[:k + 1]


def test_seed_reproducible(engine):
    sp = SamplingParams(max_new_tokens=24, seed=123)
    a, b = engine.generate(PROMPT, sp), engine.generate(PROMPT, sp)
    assert a.output_ids == b.output_ids and a.logprobs == b.logprobs
    c = engine.generate(PROMPT, SamplingParams(max_new_tokens=24, seed=124))
    assert c.output_ids != a.output_ids


def test_concurrent_generates(engine):
    prompts = [PROMPT[:3 + i] + [50 + i] for i in range(8)]
    results = [None] * 8

    def one(i):
        results[i] = engine.generate(prompts[i], SamplingParams(max_new_tokens=12, seed=i), rid=f"conc-{i}")

    threads = [threading.Thread(target=one, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert all(r is not None and len(r.output_ids) == 12 for r in results)
    for i in (0, 7):      # each is the request alone, whatever ran beside it
        again = engine.generate(prompts[i], SamplingParams(max_new_tokens=12, seed=i))
        assert again.output_ids == results[i].output_ids and again.logprobs == results[i].logprobs
    assert engine.load()["running"] == 0


def _background(engine, prompt, sp, rid):
    box = {}

    def run():
        try:
            box["gen"] = engine.generate(prompt, sp, rid=rid)
        except Exception as e:       # noqa: BLE001 - reported by the test
            box["error"] = e

    t = threading.Thread(target=run)
    t.start()
    return t, box


def test_abort_running_and_queued(engine):
    long_sp = SamplingParams(max_new_tokens=100_000)
    t1, b1 = _background(engine, PROMPT, long_sp, "long-1")
    _wait_for(lambda: engine.load()["running"] == 1)
    t2, b2 = _background(engine, PROMPT, long_sp, "long-2")
    _wait_for(lambda: engine.load()["queued"] == 1)
    t0 = time.monotonic()
    engine.abort("long-2")
    t2.join(30)
    assert b2["gen"].finish_reason == "abort" and b2["gen"].output_ids == []
    # long-1 has tokens to hand back once it has decoded some (a slow CI core may not have yet)
    _wait_for(lambda: engine.load()["tokens_in_flight"] > len(PROMPT) + 2)
    engine.abort("long-1")
    t1.join(30)
    assert time.monotonic() - t0 < 10.0
    gen = b1["gen"]
    assert gen.finish_reason == "abort" and len(gen.output_ids) == len(gen.logprobs) > 0
    engine.abort("no-such-request")                 # a no-op, as in SGLang
    load = engine.load()
    assert (load["running"], load["queued"], load["tokens_in_flight"]) == (0, 0, 0)


def test_pause_continue(engine):
    t1, b1 = _background(engine, PROMPT, SamplingParams(max_new_tokens=100_000), "paused-1")
    _wait_for(lambda: engine.load()["tokens_in_flight"] > len(PROMPT) + 2)
    engine.pause()                                   # in_place: the request waits
    n = engine.load()["tokens_in_flight"]
    time.sleep(0.3)
    assert engine.load()["tokens_in_flight"] == n and engine.health()
    engine.resume()
    _wait_for(lambda: engine.load()["tokens_in_flight"] > n)
    engine.pause("abort")                            # SGLang's default mode aborts what is in flight
    t1.join(30)
    assert b1["gen"].finish_reason == "abort"
    t2, b2 = _background(engine, PROMPT, SamplingParams(max_new_tokens=4), "after-pause")
    _wait_for(lambda: engine.load()["queued"] == 1)
    time.sleep(0.3)
    assert "gen" not in b2 and engine.load()["queued"] == 1       # nothing is scheduled while paused
    engine.resume()
    t2.join(30)
    assert b2["gen"].finish_reason == "length"


def test_update_weights_from_disk(engine, ref, models):
    sp = SamplingParams(max_new_tokens=16, seed=9)
    before = engine.generate(PROMPT, sp)
    secs = engine.update_weights_from_disk(models["v1"], "v1")
    print(f"update_weights_from_disk: {secs:.2f} s")
    assert engine.weight_version() == "v1"
    after = engine.generate(PROMPT, sp)
    assert after.weight_version == "v1"
    want1 = _check_logprobs(ref, models["v1"], PROMPT, after)
    want0 = ref("logprobs", d=models["v0"], prompt=PROMPT, output=after.output_ids)
    assert max(abs(a - b) for a, b in zip(want0["logprobs"], want1["logprobs"])) > 1e-2, "weights did not change"
    assert before.logprobs != after.logprobs
    # while paused the update applies at once, and the paused request continues on the new weights
    t1, b1 = _background(engine, PROMPT, SamplingParams(max_new_tokens=100_000), "across-update")
    _wait_for(lambda: engine.load()["running"] == 1)
    engine.pause()
    engine.update_weights_from_disk(models["v0"], "v0")
    engine.resume()
    engine.abort("across-update")
    t1.join(30)
    assert b1["gen"].weight_version == "v0" and b1["gen"].finish_reason == "abort"
    # a bad path: a one-line error naming the endpoint; the served weights stay
    with pytest.raises(EngineError, match="update_weights_from_disk") as e:
        engine.update_weights_from_disk(models["v0"] + "-missing", "v2")
    assert "\n" not in str(e.value)
    assert engine.weight_version() == "v0"
    assert engine.generate(PROMPT, sp).output_ids == before.output_ids


def test_bad_request(engine):
    with pytest.raises(EngineError, match=r"/generate: HTTP 400: token id 999 outside the vocabulary of 264$"):
        engine.generate([1, 999], SamplingParams(max_new_tokens=2))


def test_dead_url():
    url = f"http://127.0.0.1:{free_port()}"
    eng = HttpEngine(url, timeout=2.0, retries=2, backoff=0.05)
    t0 = time.monotonic()
    assert not eng.health(timeout=1.0)
    with pytest.raises(EngineError) as e:
        eng.generate([1, 2, 3], SamplingParams(max_new_tokens=2))
    msg = str(e.value)
    assert msg.startswith(f"{url}/generate: ConnectionRefusedError") and "after 3 attempts" in msg and "\n" not in msg
    with pytest.raises(EngineError, match=f"{url}/get_load"):
        eng.load()
    assert time.monotonic() - t0 < 10.0


def test_startup_failure_shows_log_tail(tmp_path):
    with pytest.raises(EngineError, match=r"(?s)exited with code 2 during startup.*no config\.json"):
        start_engine("embedded", str(tmp_path / "missing"), threads=1, log_path=str(tmp_path / "1.log"))
    bad = tmp_path / "bad"       # a config transformers cannot build: the process dies after its imports
    bad.mkdir()
    (bad / "config.json").write_text(json.dumps({"model_type": "no-such-model-type"}))
    with pytest.raises(EngineError, match=r"(?s)exited with code 1 during startup.*no-such-model-type"):
        EmbeddedServer(str(bad), threads=1, log_path=str(tmp_path / "2.log")).start()
    with pytest.raises(ValueError, match="engine kind"):
        start_engine("vllm", str(bad))


def test_sglang_server_command_and_crash(tmp_path):
    srv = SGLangServer("/ckpt", port=31000, mem_fraction_static=0.6, weight_version="v3", extra_args=["--tp-size", "2"])
    cmd = srv.command()
    assert cmd[1:] == ["-m", "sglang.launch_server", "--model-path", "/ckpt", "--skip-tokenizer-init", "--host",
                       "127.0.0.1", "--port", "31000", "--mem-fraction-static", "0.6", "--weight-version", "v3",
                       "--tp-size", "2"]
    assert srv.env["SGLANG_RETURN_ORIGINAL_LOGPROB"] == "1" and srv.url == "http://127.0.0.1:31000"
    if importlib.util.find_spec("sglang") is None:      # not installed on CPU: the launch fails at once
        with pytest.raises(EngineError, match=r"(?s)sglang at http://127\.0\.0\.1:\d+ exited.*"
                                              r"No module named 'sglang'"):
            start_engine("sglang", str(tmp_path), startup_timeout=30, log_path=str(tmp_path / "sglang.log"))


class _FlakyServer:
    """A stand-in server for the client's failure paths (no SGLang here): ``/get_load`` answers 503
    ``fails`` times, ``/generate`` never answers in time; every request path is recorded."""

    def __init__(self, fails: int):
        from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

        outer = self
        self.fails, self.paths = fails, []

        class H(BaseHTTPRequestHandler):
            def log_message(self, *a):
                pass

            def _reply(self, status, body):
                data = json.dumps(body).encode()
                try:
                    self.send_response(status)
                    self.send_header("Content-Length", str(len(data)))
                    self.end_headers()
                    self.wfile.write(data)
                except OSError:      # the client gave up (the timeout case)
                    pass

            def do_GET(self):
                outer.paths.append(self.path)
                if outer.fails > 0:
                    outer.fails -= 1
                    return self._reply(503, {"error": {"message": "busy"}})
                self._reply(200, [{"dp_rank": 0, "num_reqs": 3, "num_waiting_reqs": 1, "num_tokens": 40}])

            def do_POST(self):
                outer.paths.append(self.path)
                self.rfile.read(int(self.headers["Content-Length"]))
                if self.path == "/generate":
                    time.sleep(1.0)
                self._reply(200, {})

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), H)
        self.httpd.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def close(self):
        self.httpd.shutdown()
        self.httpd.server_close()


def test_retries_on_5xx_and_generate_timeout():
    srv = _FlakyServer(fails=2)
    try:
        eng = HttpEngine(srv.url, timeout=0.3, retries=2, backoff=0.01)
        assert eng.load()["running"] == 2 and srv.paths == ["/get_load"] * 3
        srv.fails = 5
        with pytest.raises(EngineError, match=r"/get_load: HTTP 503: busy \(after 3 attempts\)"):
            eng.load()
        srv.paths.clear()
        with pytest.raises(EngineError, match=r"/generate: no reply within 0.3 s$"):
            eng.generate([1, 2], SamplingParams(max_new_tokens=2), rid="slow")
        assert srv.paths == ["/generate", "/abort_request"]      # not resubmitted; aborted by rid
    finally:
        srv.close()
