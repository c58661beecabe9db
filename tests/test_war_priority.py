"""WAR progress priority inside the engine (issue 19).

The embedded engine started for real (a random tiny Qwen3-Next, one request at a time, so the
order in which it takes its waiting queue is the order requests finish): with
``--enable-priority-scheduling`` it serves queued requests by ``priority`` (larger first, ties in
arrival order, none last: SGLang 0.5.17's default direction), without the flag FIFO as before.
The priority reaches it end to end from :class:`WarScheduler` / :func:`with_progress_priority`
through :class:`HttpEngine`'s ``/generate`` payload. Payload shape against a stdlib stub that
records request bodies (named as such: no model needed to read a body).
"""
import json
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from megatron_harts.rollout.engines import EmbeddedServer, HttpEngine
from megatron_harts.rollout.types import EngineError, SamplingParams
from megatron_harts.rollout.war.scheduler import (SchedulerConfig, WarScheduler, progress_priority, turns_of,
                                                   with_progress_priority)

MAKE = r'''
import sys
sys.modules["fla"] = None
sys.modules["causal_conv1d"] = None
import torch
from transformers import Qwen3NextConfig, Qwen3NextForCausalLM
from megatron_harts.rollout.weight_sync import tiny_qwen3_next_config
torch.manual_seed(0)
Qwen3NextForCausalLM(Qwen3NextConfig(**tiny_qwen3_next_config())).float().eval().save_pretrained(sys.argv[1])
'''
PROMPT = list(range(3, 19))


@pytest.fixture(scope="module")
def servers(tmp_path_factory):
    """(priority server, FIFO server) on the same model."""
    d = tmp_path_factory.mktemp("war_prio")
    subprocess.run([sys.executable, "-c", MAKE, str(d / "model")], check=True)
    prio = EmbeddedServer(str(d / "model"), threads=1, log_path=str(d / "prio.log"),
                          extra_args=["--enable-priority-scheduling"])
    fifo = EmbeddedServer(str(d / "model"), threads=1, log_path=str(d / "fifo.log"))
    try:
        prio.start()
        fifo.start()
        yield prio, fifo
    finally:
        prio.stop()
        fifo.stop()


def _served_order(srv, engines, jobs):
    """Block the one-slot server with a long request, queue ``jobs`` (rid, priority or None) one
    after another behind it (each seen waiting before the next is sent), return the rids in the
    order they finished. ``engines``: the engine each job is sent through."""
    plain = srv.engine(timeout=300)
    blocker = threading.Thread(target=plain.generate, args=(
        PROMPT, SamplingParams(max_new_tokens=400, temperature=0.0)), kwargs={"rid": "blocker"})
    blocker.start()
    deadline = time.monotonic() + 60
    while plain.load()["running"] < 1:
        assert time.monotonic() < deadline, "the long request never started"
        time.sleep(0.01)
    done, lock, threads = [], threading.Lock(), []

    def one(eng, rid, prio):
        # 16 tokens, not 1-2: the order is read on the client side, so each request must take far
        # longer than a loaded machine's thread wake-up, or two quick finishes could swap there
        eng.generate(PROMPT, SamplingParams(max_new_tokens=16, temperature=0.0, priority=prio), rid=rid)
        with lock:
            done.append(rid)

    for k, (eng, (rid, prio)) in enumerate(zip(engines, jobs)):
        threads.append(threading.Thread(target=one, args=(eng, rid, prio)))
        threads[-1].start()
        while plain.load()["queued"] < k + 1:
            assert plain.load()["running"] == 1, "the long request ended before the queue was built"
            time.sleep(0.005)
    assert plain.load()["running"] == 1, "the long request ended before the queue was built"
    for t in threads + [blocker]:
        t.join(300)
    return done


JOBS = [("a", 1), ("b", None), ("c", 5), ("d", 3), ("e", 5), ("f", 0)]


@pytest.mark.timeout(300)
def test_embedded_server_serves_the_waiting_queue_by_priority_and_fifo_without_the_flag(servers):
    prio, fifo = servers
    eng = prio.engine(timeout=300)
    # larger first; equal priorities (c, e) in arrival order; no priority (b) last
    assert _served_order(prio, [eng] * len(JOBS), JOBS) == ["c", "e", "d", "a", "f", "b"]
    # a server without --enable-priority-scheduling ignores the field: arrival order, as before
    eng = fifo.engine(timeout=300)
    assert _served_order(fifo, [eng] * len(JOBS), [(r + "2", p) for r, p in JOBS]) == \
        ["a2", "b2", "c2", "d2", "e2", "f2"]


@pytest.mark.timeout(300)
def test_scheduler_progress_priority_reaches_the_engine_and_late_trajectories_go_first(servers):
    prio, _ = servers
    sch = WarScheduler(1, SchedulerConfig(priority="progress"))
    wrapped = sch.wrap([prio.engine(timeout=300)])[0]
    turns = {"t0": 0, "t1": 2, "t2": 1, "t3": 4}
    for t, n in turns.items():
        sch.place(t, PROMPT, n, [0])
    # agent-loop rids (traj#turns-n~tag); the scheduler's own record of each trajectory decides
    jobs = [(f"{t}#{n}-{i}~x", None) for i, (t, n) in enumerate(turns.items())]
    order = _served_order(prio, [wrapped] * len(jobs), jobs)
    assert [r.split("#")[0] for r in order] == ["t3", "t1", "t2", "t0"]
    # sticky placement + progress priority (the bench's sticky_prio): the turn count from the rid
    eng = with_progress_priority([prio.engine(timeout=300)])[0]
    jobs = [("u0#0-0~y", None), ("u1#3-1~y", None), ("u2#1-2~y", None)]
    assert _served_order(prio, [eng] * 3, jobs) == ["u1#3-1~y", "u2#1-2~y", "u0#0-0~y"]


def test_scheduler_assigns_more_priority_to_more_progress():
    sch = WarScheduler(2, SchedulerConfig(priority="progress"))
    sch.place("early", PROMPT, 0, [0, 0])
    sch.place("late", PROMPT * 4, 5, [0, 0])
    assert sch.engine_priority("late#5-1~x") > sch.engine_priority("early#0-0~x") == 0
    assert sch.engine_priority("unknown#2-0~x") == 2              # not placed here: the rid's count
    assert sch.engine_priority("no-agent-loop-rid") is None
    assert WarScheduler(2).engine_priority("late#5-1~x") is None   # off by default: nothing is sent
    assert turns_of("t/0#12-7~ab") == 12 and turns_of(None) is None


class _BodyRecorder(BaseHTTPRequestHandler):
    """Stub (not SGLang): records each /generate body and answers one token."""
    bodies: list = []

    def log_message(self, *a):
        pass

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        self.bodies.append(body)
        out = json.dumps({"output_ids": [7], "meta_info": {"id": body["rid"], "finish_reason": {"type": "length"},
                                                           "output_token_logprobs": [[-0.5, 7, None]]}}).encode()
        self.send_response(200)
        self.send_header("Content-Length", str(len(out)))
        self.end_headers()
        self.wfile.write(out)


def test_payload_carries_priority_only_when_set():
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), _BodyRecorder)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    try:
        eng = HttpEngine(f"http://127.0.0.1:{httpd.server_address[1]}", retries=0)
        eng.generate([1, 2], SamplingParams(max_new_tokens=1), rid="p0")
        eng.generate([1, 2], SamplingParams(max_new_tokens=1, priority=7), rid="p1")
        eng.generate([1, 2], SamplingParams(max_new_tokens=1, priority=0), rid="p2")
        plain, with_p, zero = _BodyRecorder.bodies[-3:]
        assert "priority" not in plain and "priority" not in plain["sampling_params"]
        assert with_p["priority"] == 7 and "priority" not in with_p["sampling_params"]   # top level, as SGLang
        assert zero["priority"] == 0
        assert set(plain) == {"input_ids", "sampling_params", "return_logprob", "rid"}    # as before
    finally:
        httpd.shutdown()
        httpd.server_close()


@pytest.mark.timeout(120)
def test_bad_priorities_are_refused_with_a_clear_error(servers):
    for bad in (1.5, "high", True):
        with pytest.raises(ValueError, match="SamplingParams.priority must be an int or None"):
            SamplingParams(priority=bad)
    with pytest.raises(ValueError, match="SchedulerConfig.priority must be one of"):
        SchedulerConfig(priority="fast")
    with pytest.raises(ValueError, match="turns_done must be >= 0"):
        progress_priority(-1)
    prio, _ = servers
    body = {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 1}, "priority": "high"}
    with pytest.raises(EngineError, match="priority must be an integer"):
        prio.engine(retries=0)._json("POST", "/generate", body)
