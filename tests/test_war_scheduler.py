"""WAR scheduling (rollout/war/scheduler.py, router.py).

Policy unit tests of :class:`WarScheduler` (prefix locality, stickiness, load, progress, the LRU
prefix model, the progress-ordered admission gate), then real HTTP: sglang-router 0.3.2 started for
real (``RouterServer``) in front of local HTTP worker stubs (stdlib servers answering SGLang's
``/generate`` with a fixed turn; named stubs: no model is needed to test routing), and the agent
loop driving the stubs through the scheduler.
"""
import json
import threading
import time
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from megatron_harts.rollout.agent_loop import AgentLoop, RolloutConfig
from megatron_harts.rollout.engines import HttpEngine
from megatron_harts.rollout.types import Generation, SamplingParams, StepResult
from megatron_harts.rollout.war.router import RouterServer
from megatron_harts.rollout.war.scheduler import (PrefixModel, SchedulerConfig, ScheduledEngine, SpecSwitch,
                                                   WarScheduler)

P = list(range(100, 164))          # a 64-token task prompt


def test_prefix_locality_stickiness_and_load():
    s = WarScheduler(3, SchedulerConfig(block=8, expected_decode=16, load_weight=0.5))
    a = s.place("g1/0", P, 0, [0, 0, 0])
    s.started(a, "g1/0#0", P, 16)
    # a sample of the same task (same prompt) goes where the prompt is cached, despite that load
    assert s.place("g1/1", P, 0, [1, 0, 0]) == a
    # a different task goes to an idle replica
    b = s.place("g2/0", [7] * 64, 0, [1, 0, 0])
    assert b != a
    s.finished(a, "g1/0#0", P, Generation([1, 2, 3], [0.0] * 3, "stop"))
    # the next turn of g1/0 returns to its replica (its whole context is cached there) ...
    assert s.place("g1/0", P + [1, 2, 3] + [9] * 13, 1, [0, 0, 0]) == a
    # ... unless that replica is far more loaded than the prefix is worth
    for i in range(4):
        s.started(a, f"x#{i}", [50 + i] * 200, 16)
    assert s.place("g1/0", P + [1, 2, 3] + [9] * 13, 1, [4, 0, 0]) != a
    assert s.stats["moves"] == 1
    # engines the loop marks as unusable are never picked
    assert s.place("g3/0", [5] * 64, 0, [1 << 20, 1 << 20, 0]) == 2


def test_placed_turns_count_before_they_start():
    """A turn waiting between placement and start (admission gate, HTTP) is load on its replica, and its
    context counts as cached there: a group's samples placed before any starts stay together. Before
    this, they were placed on the prefix models of started turns only and scattered whenever another
    turn started in between (seen as a flaky 0.67 hit rate in the agent-loop test under CPU load)."""
    long_prompt = P * 8                                  # 512 tokens
    s = WarScheduler(3, SchedulerConfig(block=8, expected_decode=16, load_weight=0.5))
    a = s.place("g/0", long_prompt, 0, [0, 0, 0])
    assert s.load[a] == len(long_prompt) + 16            # queued work from its placement on
    s.started(a, "x#0", [7] * 200, 16)                   # another turn starts there meanwhile
    assert [s.place(f"g/{i}", long_prompt, 0, [0, 0, 0]) for i in (1, 2, 3)] == [a, a, a]
    assert s.stats["predicted_cached"] == 3 * len(long_prompt)
    h = s.place("h/0", [5] * 64, 0, [0, 0, 0])           # another task avoids the queued replica
    assert h != a
    assert s.place("h/0", [5] * 64, 0, [0, 1 << 20, 1 << 20]) == 0 and s.load[h] == 0.0   # placed again: moved
    for i in range(4):                                   # started: the estimate becomes the turn's own work
        s.started(a, f"g/{i}#0", long_prompt, 16)
    assert s.stats["started_cached"] == 3 * len(long_prompt)      # the first prefill fills the others
    s.started(0, "h/0#0", [5] * 64, 16)
    for rid, toks in [(f"g/{i}#0", long_prompt) for i in range(4)] + [("x#0", [7] * 200), ("h/0#0", [5] * 64)]:
        s.finished(a if rid != "h/0#0" else 0, rid, toks, Generation([1], [0.0], "stop"))
    assert s.load == [0.0, 0.0, 0.0] and not s._pending


def test_trajectory_records_are_bounded_least_recently_placed_first():
    s = WarScheduler(2, SchedulerConfig(block=8, max_trajectories=3))
    for t in ("a", "b", "c"):
        s.place(t, P, 0, [0, 0])
    s.place("a", P + [1] * 8, 1, [0, 0])          # a placed again: b is now the least recent
    s.place("d", P, 0, [0, 0])
    assert list(s._traj) == ["c", "a", "d"]
    assert s.priority("a") == (-1, -(len(P) + 8)) and s.priority("b") == (0, 0)
    with pytest.raises(ValueError, match="max_trajectories"):
        SchedulerConfig(max_trajectories=0)


def test_progress_moves_late_trajectories_first():
    cfg = SchedulerConfig(block=8, expected_decode=0, progress_weight=4.0)
    s = WarScheduler(2, cfg)
    ctx_early, ctx_late = [1] * 160, [2] * 160
    for tid, ctx in (("e/0", ctx_early), ("l/0", ctx_late)):
        s.started(0, f"{tid}#prev", ctx, 0)     # both contexts cached on replica 0
        s.finished(0, f"{tid}#prev", ctx, Generation([], [], "stop"))
    s.place("l/0", ctx_late, 9, [0, 0])          # the late one has done 9 turns
    s.started(0, "busy#0", [3] * 100, 0)         # replica 0 now has 100 tokens of work queued
    assert s.place("e/0", ctx_early, 0, [1, 0]) == 0     # early: 100 < 160 uncached -> stays
    assert s.place("l/0", ctx_late, 9, [1, 0]) == 1      # late: waiting weighs (1 + 4 * 0.9)x -> moves
    assert s.priority("l/0") < s.priority("e/0")


def test_prefix_model_lru_eviction():
    m = PrefixModel(capacity=32, block=8)                # 4 blocks
    a, b = m.block_hashes(list(range(24))), m.block_hashes(list(range(100, 124)))
    assert len(a) == 3 and m.block_hashes(list(range(27)), a[:2]) == m.block_hashes(list(range(27)))
    m.insert(a)
    assert m.match(a) == 24 and m.match(b) == 0
    m.insert(b)                                          # 6 blocks > 4: a's oldest (its root) goes first
    assert m.match(b) == 24 and m.match(a) == 0 and len(m) == 32
    with pytest.raises(ValueError, match="block"):
        SchedulerConfig(block=0)


def test_hybrid_prefix_model_credits_only_whole_earlier_sequences():
    """With ``checkpoints`` (a recurrent-state hybrid's cache) a replica that holds a sibling's
    longer sequence is credited only up to the shared prompt it stored a state for, not up to the
    last shared token; the token-level model credits the shared tokens. Eviction drops the state."""
    tok, hyb = PrefixModel(1 << 20, block=8), PrefixModel(1 << 20, block=8, checkpoints=True)
    prompt = P                                            # 64 tokens: 8 blocks
    sib = prompt + [1] * 40 + [2] * 24                   # a sibling's finished turn: prompt + output
    me = prompt + [1] * 40 + [3] * 24                    # my context shares 40 more tokens with it
    for m in (tok, hyb):
        m.insert(m.block_hashes(prompt))                 # the prompt was prefilled (a state at its end)
        m.insert(m.block_hashes(sib))                    # the sibling finished (a state at its end)
    h = tok.block_hashes(me)
    assert tok.match(h) == 64 + 40 and hyb.match(h) == 64
    assert hyb.match(hyb.block_hashes(sib + [5] * 16)) == len(sib)     # my own previous turn: all of it
    small = PrefixModel(capacity=64, block=8, checkpoints=True)      # 8 blocks
    small.insert(small.block_hashes(prompt))
    small.insert(small.block_hashes(list(range(500, 564))))          # evicts the whole prompt
    assert small.match(small.block_hashes(prompt)) == 0 and len(small._ckpt) == 1
    # the scheduler with hybrid_cache: a turn stays where its whole previous sequence is
    s = WarScheduler(2, SchedulerConfig(block=8, expected_decode=16, hybrid_cache=True))
    a = s.place("g/0", prompt, 0, [0, 0])
    s.started(a, "g/0#0", prompt, 16)
    s.finished(a, "g/0#0", prompt, Generation([1] * 40, [0.0] * 40, "stop"))
    assert s.models[a].match(s.models[a].block_hashes(prompt + [1] * 40 + [9] * 8)) == 104
    assert s.models[1 - a].match(s.models[a].block_hashes(prompt)) == 0


class FakeEngine:
    """A named in-process stand-in (the gate's order is what is tested): blocks until released."""

    name = "fake"

    def __init__(self):
        self.order, self.gate = [], threading.Event()

    def generate(self, input_ids, sampling, rid=None):
        self.order.append(rid)
        self.gate.wait(10)
        return Generation([4], [0.0], "stop")


@pytest.mark.timeout(30)
def test_admission_gate_orders_by_progress():
    s = WarScheduler(1, SchedulerConfig(block=8, max_running=1))
    fake = FakeEngine()
    eng = s.wrap([fake])[0]
    assert isinstance(eng, ScheduledEngine) and eng.name == "fake"
    for tid, turns in (("a/0", 0), ("b/0", 5), ("c/0", 2), ("d/0", 9)):
        s.place(tid, [1] * 16, turns, [0])
    threads = [threading.Thread(target=eng.generate, args=([1] * 16, SamplingParams(), f"{t}#1-{i}"))
               for i, t in enumerate(["a/0", "b/0", "c/0", "d/0"])]
    threads[0].start()
    while not fake.order:
        time.sleep(0.01)
    for t in threads[1:]:
        t.start()
    time.sleep(0.3)                                       # all three wait at the gate
    fake.gate.set()
    for t in threads:
        t.join(10)
    assert [r.split("#")[0] for r in fake.order] == ["a/0", "d/0", "b/0", "c/0"]
    assert SpecSwitch(8).speculate(8) and not SpecSwitch(8).speculate(9)


# ------------------------------------------------------------------------------ real HTTP
END_CALL = 4


class Stub:
    """A local HTTP worker stub: SGLang's /generate shape, a fixed 4-token turn ending </call>."""

    def __init__(self, tag: int):
        self.tag, self.rids = tag, []
        stub = self

        class H(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *a):
                pass

            def _send(self, obj):
                d = json.dumps(obj).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(d)))
                self.end_headers()
                self.wfile.write(d)

            def do_GET(self):
                self._send({"model_path": "stub", "weight_version": "v0"})

            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers.get("Content-Length") or 0)) or b"{}")
                if self.path != "/generate":
                    return self._send({})
                stub.rids.append(body.get("rid"))
                out = [8 + stub.tag, 8 + stub.tag, 8 + stub.tag, END_CALL]
                self._send({"text": "", "output_ids": out, "meta_info": {
                    "id": body.get("rid"), "finish_reason": {"type": "stop", "matched": END_CALL},
                    "prompt_tokens": len(body["input_ids"]), "completion_tokens": 4, "cached_tokens": 0,
                    "weight_version": "v0", "output_token_logprobs": [[-0.5, t, None] for t in out]}})

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), H)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def close(self):
        self.httpd.shutdown()
        self.httpd.server_close()


@pytest.fixture(scope="module")
def stubs():
    ws = [Stub(i) for i in range(3)]
    yield ws
    for w in ws:
        w.close()


@pytest.mark.timeout(120)
@pytest.mark.parametrize("policy", ["round_robin", "cache_aware"])
def test_sglang_router_for_real(stubs, policy, tmp_path):
    with RouterServer([w.url for w in stubs], policy, log_path=str(tmp_path / "router.log")) as router:
        eng = router.engine(timeout=30, retries=1)
        for w in stubs:
            w.rids.clear()
        sp = SamplingParams(max_new_tokens=4, stop_token_ids=[END_CALL])
        for i in range(6):
            g = eng.generate(P + [i % 2] * 40, sp, rid=f"t{i % 2}/0#{i}")
            assert g.output_ids[-1] == END_CALL and len(g.logprobs) == 4
        seen = [len(w.rids) for w in stubs]
        assert sum(seen) == 6 and all(r is not None and r.startswith("t") for w in stubs for r in w.rids)
        if policy == "round_robin":
            assert seen == [2, 2, 2], seen
        else:   # cache_aware: a repeated prompt goes back to the worker that has it
            where = {r.split("#")[0]: {k for k, w in enumerate(stubs) for q in w.rids if q.split("#")[0] ==
                                       r.split("#")[0]} for w in stubs for r in w.rids}
            assert all(len(v) == 1 for v in where.values()), where


@pytest.mark.timeout(60)
def test_router_start_waits_until_every_worker_is_registered(stubs):
    """sglang-router answers /health before its workers are registered; start() waits for /workers."""
    from megatron_harts.rollout.engines.launch import EngineError, free_port

    dead = f"http://127.0.0.1:{free_port()}"
    with pytest.raises(EngineError, match="not healthy after 8 s"):
        RouterServer([stubs[0].url, dead], "round_robin", startup_timeout=8).start().stop()
    with RouterServer([w.url for w in stubs], "round_robin") as router:
        with urllib.request.urlopen(f"{router.url}/workers", timeout=5) as r:
            listed = {w["url"] for w in json.loads(r.read())["workers"] if w["is_healthy"]}
        assert listed == {w.url for w in stubs}


@pytest.mark.timeout(90)
def test_two_routers_at_once(stubs):
    """Each router binds its own Prometheus exporter port: with sglang-router's default (29000 for
    every router) the second of two routers alive at the same time panicked "Address already in
    use" at start-up (seen in CI, one router shutting down while the next started)."""
    with RouterServer([w.url for w in stubs], "round_robin") as a, RouterServer([w.url for w in stubs], "random") as b:
        for router in (a, b):
            with urllib.request.urlopen(f"{router.url}/workers", timeout=5) as r:
                assert {w["url"] for w in json.loads(r.read())["workers"] if w["is_healthy"]} == {w.url for w in stubs}
    ports = [RouterServer([stubs[0].url]).command() for _ in range(2)]
    metrics = [c[c.index("--prometheus-port") + 1] for c in ports]
    assert all(m.isdigit() for m in metrics)
    named = RouterServer([stubs[0].url], extra_args=["--prometheus-port", "29123"]).command()
    assert named.count("--prometheus-port") == 1 and named[named.index("--prometheus-port") + 1] == "29123"


class ThreeTurns:
    """A text environment of three tool turns (no sandbox: routing is what is tested)."""

    task_id = "three"

    def __init__(self, task):
        self.n, self.task = 0, task

    def prompt(self):          # long enough that moving a trajectory costs more than waiting
        return f"task {self.task}: count to three. " + "Context. " * 60

    def step(self, action):
        self.n += 1
        if self.n >= 3:
            return StepResult(None, True, 1.0)
        return StepResult(f"turn {self.n}", False)

    def fork(self):
        return self

    def close(self):
        pass


def _rollout(stubs, pick):
    from megatron_harts.rollout.tokenizer import ByteTokenizer

    for w in stubs:
        w.rids.clear()
    # a replica caches one task: its 4 samples share a ~565-token prompt, contexts grow to ~590
    s = WarScheduler(3, SchedulerConfig(block=4, max_running=2, cache_tokens=800, load_weight=0.5))
    engines = s.wrap([HttpEngine(w.url, timeout=30, retries=0) for w in stubs])
    loop = AgentLoop(engines, ByteTokenizer(), ThreeTurns, RolloutConfig(group_size=4, max_new_tokens=8),
                     pick_engine=pick or s)
    res = loop.rollout([0, 1, 2])
    assert len(res.trajectories) == 12 and not res.failed
    assert s.stats["started_prompt"] > 0 and s.load == [0.0, 0.0, 0.0]
    return s, [len(w.rids) for w in stubs]


@pytest.mark.timeout(60)
def test_agent_loop_through_the_scheduler(stubs):
    s, per = _rollout(stubs, None)
    assert s.stats["turns"] == 36 and all(per), per       # every replica is used (the stubs answer at once)
    rr = iter(range(10 ** 6))
    base, _ = _rollout(stubs, lambda ep, engines, load: next(rr) % len(engines))   # round robin
    # the same accounting on the replicas actually used: prefix locality pays
    assert s.cache_hit() > 0.8 > base.cache_hit() + 0.2, (s.cache_hit(), base.cache_hit())


def test_bench_script_rejects_bad_input():
    import subprocess
    import sys
    from pathlib import Path

    script = Path(__file__).resolve().parents[1] / "scripts" / "bench_war.py"
    for args, word in ((["--parts", "gpu"], "--parts"), (["--budgets", "8,x"], "--budgets"),
                       (["--parts", "h200"], "--model-path"), (["--policies", "sticky_prio,bogus"], "--policies"),
                       (["--low-variants", "suffix,eagle"], "eagle"), (["--low-variants", "none@8", "--low-reps", "2"], "none@8"),
                       (["--low-variants", "suffix@0", "--low-reps", "2"], "positive integer"),
                       (["--low-variants", "suffix@x", "--low-reps", "2"], "positive integer"),
                       (["--low-variants", "suffix@8,suffix@8", "--low-reps", "2"], "named twice"),
                       (["--low-variants", "suffix@8,none"], "--low-reps")):
        r = subprocess.run([sys.executable, str(script), *args, "--out", "/nonexistent/x.json"], capture_output=True,
                           text=True, timeout=120)
        assert r.returncode == 2 and word in r.stderr and "Traceback" not in r.stderr, r.stderr
        assert len(r.stderr.strip().splitlines()) == 1, r.stderr


def test_bench_add_rows_tags_another_runs_h200_rows(tmp_path):
    """``--add-rows`` appends only the other run's h200 rows, tagged, replaces an earlier add of the
    same tag, keeps every other row, and names a bad file in one line."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    script = Path(__file__).resolve().parents[1] / "scripts" / "bench_war.py"
    out, run2 = tmp_path / "war.json", tmp_path / "run2.json"
    cpu = dict(part="cpu", load="low", concurrency=4, policy="none", tokens_per_s=1.0, makespan_s=1.0, cache_hit=0.0)
    h1 = dict(part="h200", load="high", concurrency=256, policy="war", tokens_per_s=2.0, makespan_s=3.0, cache_hit=0.5)
    out.write_text(json.dumps({"command": "first", "rows": [cpu, h1]}))
    h2 = dict(h1, tokens_per_s=5.0)
    run2.write_text(json.dumps({"command": "second", "rows": [dict(cpu, tokens_per_s=9.0), h2]}))
    for _ in range(2):                      # twice: the second add replaces the first
        r = subprocess.run([sys.executable, str(script), "--out", str(out), "--add-rows", str(run2), "--run-tag", "2"],
                           capture_output=True, text=True, timeout=120)
        assert r.returncode == 0, r.stderr
    d = json.loads(out.read_text())
    assert [(x["part"], x.get("run"), x["tokens_per_s"]) for x in d["rows"]] == \
        [("cpu", None, 1.0), ("h200", None, 2.0), ("h200", "2", 5.0)]
    assert d["command"] == "first; then (run 2) second"
    md = out.with_suffix(".md").read_text()
    assert "| h200 | 2 | high | 256 | war | 5.0 |" in md and "| h200 | 1 | high | 256 | war | 2.0 |" in md
    bad = tmp_path / "bad.json"
    bad.write_text("[1, 2]")
    r = subprocess.run([sys.executable, str(script), "--out", str(out), "--add-rows", str(bad)],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and str(bad) in r.stderr and "Traceback" not in r.stderr, r.stderr


def test_spec_switch_places_by_load_and_takes_its_crossover_from_measured_rows():
    # replica 0 speculates, replica 1 does not; speculation while at most 1 turn is in flight
    s = WarScheduler(2, SchedulerConfig(block=8, spec_replicas=(0,), spec_crossover=1))
    assert s.place("a/0", [1] * 32, 0, [0, 0]) == 0                  # idle: the speculating replica
    s.started(0, "a/0#0", [1] * 32, 16)
    s.started(0, "x#0", [2] * 32, 16)                               # 2 turns in flight: over the crossover
    assert s.place("b/0", [3] * 32, 0, [2, 0]) == 1
    assert s.place("c/0", [4] * 32, 0, [2, 1 << 20]) == 0           # the plain replica is down: fall back
    assert s.stats["spec_turns"] == 1
    with pytest.raises(ValueError, match="out of range"):
        WarScheduler(2, SchedulerConfig(spec_replicas=(2,)))
    rows = [dict(concurrency=8, policy="none", tokens_per_s=100.0), dict(concurrency=8, policy="suffix", tokens_per_s=150.0),
            dict(concurrency=64, policy="none", tokens_per_s=900.0), dict(concurrency=64, policy="suffix", tokens_per_s=700.0),
            dict(concurrency=256, policy="none", tokens_per_s=2000.0), dict(concurrency=256, policy="suffix", tokens_per_s=2500.0)]
    assert SpecSwitch.from_rows(rows).crossover == 8                # the first loss ends it
    assert SpecSwitch.from_rows(rows[2:]).crossover == 0
    # the H200 rows with decode CUDA graphs (run 3): NGRAM below none at 8 -> never speculate
    import json
    from pathlib import Path
    h200 = [r for r in json.loads((Path(__file__).parents[1] / "docs/benchmarks/war.json").read_text())["rows"]
            if r.get("part") == "h200" and r.get("run") == "3"]
    assert SpecSwitch.from_rows(h200, "ngram").crossover == 0


def test_bench_rows_name_the_gpu_they_ran_on(tmp_path, monkeypatch):
    """The GPU rows' ``device`` names the card the run got (an ``nvidia-h200`` call may run on an H100):
    from CUDA where it is available, else from ``nvidia-smi``, else says it is unknown, never "H200"."""
    import importlib.util
    import os
    from pathlib import Path

    import torch

    script = Path(__file__).resolve().parents[1] / "scripts" / "bench_war.py"
    spec = importlib.util.spec_from_file_location("bench_war_for_test", script)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    fake = tmp_path / "nvidia-smi"
    fake.write_text("#!/bin/sh\necho 'NVIDIA H100 80GB HBM3'\n")
    fake.chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}{os.pathsep}{os.environ['PATH']}")
    assert bench.gpu_name() == "NVIDIA H100 80GB HBM3"
    fake.write_text("#!/bin/sh\nexit 9\n")                    # the driver tool fails
    assert bench.gpu_name() == "GPU of unknown name"
    fake.unlink()
    monkeypatch.setenv("PATH", str(tmp_path))                  # no nvidia-smi at all
    assert bench.gpu_name() == "GPU of unknown name"
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda i=0: "NVIDIA H200")
    assert bench.gpu_name() == "NVIDIA H200"


def test_bench_low_variants_carry_their_own_draft_budget():
    """``--low-variants suffix@8,ngram@8,suffix,ngram,none``: the budgets of one side-by-side run."""
    import importlib.util
    from pathlib import Path

    script = Path(__file__).resolve().parents[1] / "scripts" / "bench_war.py"
    spec = importlib.util.spec_from_file_location("bench_war_for_test", script)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    got = {v: (bench.variant_kind(v), bench.variant_budget(v, 16)) for v in ("suffix@8", "ngram@12", "suffix", "none")}
    assert got == {"suffix@8": ("suffix", 8), "ngram@12": ("ngram", 12), "suffix": ("suffix", 16), "none": ("none", 16)}
    for bad in ("none@4", "suffix@", "suffix@-1", "ngram@1.5", "medusa@8"):
        with pytest.raises(ValueError):
            bench.variant_budget(bad, 16)
    assert bench.speculation_flags("suffix@8", 16) == ["--speculative-algorithm", "HARTS_SUFFIX",
                                                       "--speculative-num-draft-tokens", "9"]
    assert bench.speculation_flags("ngram", 16)[1::2] == ["NGRAM", "17"]
    assert bench.speculation_flags("none", 16) == []
    assert bench.speculation_flags("ngram@8", 16, timed_ngram=True)[1::2] == ["HARTS_NGRAM_TIMED", "9"]
    assert bench.speculation_flags("suffix", 16, timed_ngram=True)[1] == "HARTS_SUFFIX"
    rows = [dict(part="h200", load="low", concurrency=8, policy="suffix", variant="suffix@8", budget=8,
                 tokens_per_s=1.0, makespan_s=1.0, cache_hit=0.0)]
    assert "| suffix@8 |" in bench.tables(rows)[1]


def test_bench_py_spy_samples_each_low_load_server_and_stops_with_the_reps(tmp_path, caplog):
    """``--py-spy BIN``: one sampler per live server (its pid, children, no pauses, collapsed
    stacks into ``py_spy_<variant>.txt``), stopped by SIGINT once the reps end; a binary that
    cannot start is logged and skipped."""
    import importlib.util
    import subprocess
    import sys
    import time
    from pathlib import Path
    from types import SimpleNamespace

    script = Path(__file__).resolve().parents[1] / "scripts" / "bench_war.py"
    spec = importlib.util.spec_from_file_location("bench_war_for_test", script)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    fake = tmp_path / "py-spy"                 # writes its argv to -o, then waits for SIGINT as py-spy does
    fake.write_text(f"#!{sys.executable}\nimport sys, signal, time\na = sys.argv[1:]\n"
                    "def out(*_):\n    open(a[a.index('-o') + 1], 'w').write(' '.join(a)); sys.exit(0)\n"
                    "signal.signal(signal.SIGINT, out)\ntime.sleep(30)\nout()\n")
    fake.chmod(0o755)
    server = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        live = {"suffix": SimpleNamespace(proc=server), "ngram@8": SimpleNamespace(proc=server)}
        args = SimpleNamespace(py_spy=str(fake), py_spy_s=45.0, py_spy_rate=250)
        spies = bench._start_py_spy(args, live, tmp_path)
        assert len(spies) == 2
        time.sleep(0.5)
        t0 = time.monotonic()
        bench._stop_py_spy(spies)
        assert time.monotonic() - t0 < 10                        # SIGINT, not the 45 s duration
        for slug in ("suffix", bench.variant_slug("ngram@8")):
            argv = (tmp_path / f"py_spy_{slug}.txt").read_text().split()
            assert argv[0] == "record" and {"--nonblocking", "--subprocesses", "--threads"} <= set(argv)
            assert argv[argv.index("-p") + 1] == str(server.pid) and argv[argv.index("-d") + 1] == "45"
            assert argv[argv.index("--format") + 1] == "raw" and argv[argv.index("-r") + 1] == "250"
        assert bench._start_py_spy(SimpleNamespace(py_spy=None), live, tmp_path) == []
        args.py_spy = str(tmp_path / "missing")
        with caplog.at_level("WARNING"):
            assert bench._start_py_spy(args, live, tmp_path) == []
        assert "py-spy not started on suffix" in caplog.text
    finally:
        server.kill()


def test_py_spy_summary_attributes_samples_to_the_busiest_thread(tmp_path, capsys):
    """``scripts/py_spy_summary.py``: inclusive seconds per matched name (once per sample), self time
    by innermost frame, on the thread with the most samples; a process command spanning lines."""
    import importlib.util
    from pathlib import Path

    script = Path(__file__).resolve().parents[1] / "scripts" / "py_spy_summary.py"
    spec = importlib.util.spec_from_file_location("py_spy_summary_for_test", script)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    proc = 'process 7:"sglang::scheduler_TP0"'
    main = "thread (11): MainThread"
    loop = "event_loop_normal (sglang/srt/managers/scheduler.py:1)"
    fwd = "forward_batch_generation (sglang/srt/speculative/ngram_worker.py:9)"
    get = "batch_get (megatron_harts/rollout/war/sglang_plugin.py:3)"
    text = "\n".join([
        f"{proc};{main};{loop};{fwd};{get};draft (megatron_harts/rollout/war/suffix.py:5) 30",
        f"{proc};{main};{loop};{fwd};{get} 10",
        f"{proc};{main};{loop};{fwd};forward_batch_generation (x/model_runner.py:2) 50",
        f"{proc};{main};{loop} 10",
        'process 8:"python -c \nimport time\nwhile 1: pass";thread (12): Thread-1;run (threading.py:1) 40',
    ])
    f = tmp_path / "py_spy_suffix.txt"
    f.write_text(text + "\n")
    r = mod.summarise(f, 100.0, ["forward_batch_generation", "batch_get", "draft", "absent"], 2)
    assert r["thread"] == main and r["samples"] == 100 and r["seconds"] == 1.0
    assert r["other_threads_s"] == 0.4
    assert r["inclusive_s"] == {"forward_batch_generation": 0.9, "batch_get": 0.4, "draft": 0.3, "absent": 0.0}
    assert r["self_s"] == [("forward_batch_generation (x/model_runner.py)", 0.5),
                           ("draft (war/suffix.py)", 0.3)]
    assert mod.main([str(f), "--rate", "100", "--match", "batch_get"]) == 0
    assert "| batch_get | 0.40 |" in capsys.readouterr().out


def test_py_spy_summary_splits_a_function_by_the_frames_it_calls(tmp_path):
    import importlib.util
    from pathlib import Path

    script = Path(__file__).resolve().parents[1] / "scripts" / "py_spy_summary.py"
    spec = importlib.util.spec_from_file_location("py_spy_summary_for_test", script)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    t = "thread (1): MainThread"
    f = tmp_path / "s.txt"
    f.write_text("\n".join([f"{t};Sched.loop (s.py:1);W.forward (w.py:2);W.prepare (w.py:3);x (x.py:1) 6",
                            f"{t};Sched.loop (s.py:1);W.forward (w.py:2);run (m.py:4) 3",
                            f"{t};Sched.loop (s.py:1);W.forward (w.py:2) 1",
                            f"{t};Sched.loop (s.py:1);idle (s.py:9) 10"]) + "\n")
    tot, split = mod.children(f, 10.0, "W.forward", 5)
    assert tot == 1.0 and split == [("W.prepare (w.py)", 0.6), ("run (m.py)", 0.3), ("(self)", 0.1)]
    assert mod.children(f, 10.0, "absent", 5) == (0.0, [])


def test_bench_draft_log_row_checks_the_suffix_servers_drafts(tmp_path):
    """``--log-drafts``: the row's ``draft_log`` from ``drafts_low_<variant>.jsonl`` and the variant's
    feed (None where the server wrote none, e.g. NGRAM); ``--timing-every 0`` is refused in one line."""
    import importlib.util
    import json
    import subprocess
    import sys
    from pathlib import Path

    from megatron_harts.rollout.war.sglang_plugin import TrajectoryFeed

    script = Path(__file__).resolve().parents[1] / "scripts" / "bench_war.py"
    spec = importlib.util.spec_from_file_location("bench_war_for_test", script)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    traj = list(range(10, 40))
    TrajectoryFeed(tmp_path / "feed_suffix.jsonl").add(traj, "g", "g/0")
    rows = [{"rid": "g/0#1-1~x", "n": 8, "tail": traj[4:8], "draft": traj[8:11] + [99], "parents": [-1, 0, 1, -1],
             "source": "group", "match": 3},
            {"rid": "g/0#1-1~x", "n": 12, "tail": traj[8:12], "draft": [5], "parents": None, "source": "context",
             "match": 1}]
    (tmp_path / "drafts_low_suffix.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    got = bench._draft_log_row(tmp_path, "suffix")
    assert got["placed"] == 2 and got["steps"] == 1 and got["short"] == 0 and got["long"] == 0
    assert got["accepted_mean"] == 1.5 and got["by_source"] == {"context": [1, 0.0], "group": [1, 3.0]}
    assert bench._draft_log_row(tmp_path, "ngram") is None
    r = subprocess.run([sys.executable, str(script), "--parts", "h200", "--timing-every", "0"],
                       capture_output=True, text=True)
    assert r.returncode != 0 and "--timing-every must be >= 1" in r.stderr and "Traceback" not in r.stderr


def test_bench_step_samples_with_the_seed_it_is_given(monkeypatch):
    """``_step(..., seed=k)`` is the loop's sampling seed (``--rep-seeds new`` gives each measured rep
    its own, the same for every variant; runs 1-18 used 1 for every rep), default 1 for the parts
    that do not pass one."""
    import importlib.util
    from pathlib import Path
    from types import SimpleNamespace

    import megatron_harts.rollout.agent_loop as agent_loop

    script = Path(__file__).resolve().parents[1] / "scripts" / "bench_war.py"
    spec = importlib.util.spec_from_file_location("bench_war_for_test", script)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    seen = []

    class FakeLoop:
        def __init__(self, engines, tok, env_factory, cfg, pick_engine=None):
            seen.append(cfg.seed)

        def rollout(self, tasks):
            return SimpleNamespace(failed=[], trajectories=[], stats={"generated_tokens": 10, "trajectories": 0,
                                                                       "turns": 0, "reward_mean": 0.0})

    monkeypatch.setattr(agent_loop, "AgentLoop", FakeLoop)
    args = SimpleNamespace(max_new_tokens=8, max_turns=2, force_calls=0, family="lookup", max_context=None)
    bench._step([], None, args, 2, 1, 2)
    bench._step([], None, args, 2, 1, 2, seed=1003)
    assert seen == [1, 1003]
