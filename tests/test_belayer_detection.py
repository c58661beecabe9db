"""Belayer: a server whose scheduler child dies while its HTTP process lives on (SGLang's case).

SGLang does not run on CPU, so the server here is a **stub** (named as such), started as a real
process tree by the same launcher (``_ServerProcess``) and shaped like SGLang 0.5.17 where it
matters (``python tests/test_belayer_detection.py --serve``):

* the HTTP process forks a first child that only waits (multiprocessing's resource tracker, which
  SGLang's spawn start launches before the scheduler), then the "scheduler" child, which names
  itself ``sglang::schedul`` (``/proc/self/comm``; SGLang uses setproctitle) and makes the tokens:
  a deterministic function of (seed, the whole context), so a resume from prompt + generated
  tokens continues exactly as the uninterrupted request;
* ``/generate`` (plain and streamed, SGLang's SSE form) and ``/health`` (~0.3 s: a round trip
  through the scheduler, as SGLang's one-token health generation) go through the scheduler; once
  it is dead, both stay silent (SGLang's event loop blocks in its SIGQUIT handler);
* its subprocess watchdog polls the scheduler every 1 s and, when it died, "runs crash
  diagnostics" for ``--diag-s`` (5 s: SGLang's sleep before py-spy / CUDA core dump) before it
  kills its tree; SIGTERM only asks for a drain that never completes (SGLang's handler), so only
  SIGKILL or that self-kill ends it.

The test: a resumable request on a supervisor (active stub + shadow stub) whose scheduler is
SIGKILLed mid-request fails over within well under 2 s (measured; the old behaviour, ``/health``
timeouts and a SIGTERM to the failed worker, took ~6 s: the stream stayed open until the stub's
self-kill), through the detection path asserted here (the monitor's ``alive()`` saw the dead
child; the failed worker was SIGKILLed, not ended by its own watchdog), and its tokens equal the
uninterrupted run's.
"""
import json
import logging
import os
import select
import signal
import sys
import threading
import time

if __name__ != "__main__":
    import pytest

    from megatron_harts.rollout.belayer import ResumableEngine, Supervisor
    from megatron_harts.rollout.belayer.faults import kill_server
    from megatron_harts.rollout.engines.launch import SGLangServer, _ServerProcess
    from megatron_harts.rollout.types import SamplingParams

    pytestmark = pytest.mark.timeout(300)

STUB_TITLE = "sglang::scheduler"
TOKEN_S = 0.005                       # the stub scheduler's time per token


# ------------------------------------------------------------------------------ the stub server
def _next_token(seed: int, ctx: list) -> tuple[int, float]:
    h = (seed * 1_000_003 + len(ctx) * 7919) % 2_147_483_647
    for t in ctx[-6:]:
        h = (h * 31 + int(t) + 1) % 2_147_483_647
    tok = 3 + h % 250
    return tok, -0.1 * (1 + h % 37)


def _scheduler(rfd: int, wfd: int) -> None:
    """The forked scheduler: requests in as JSON lines, one token per active request per step out."""
    try:
        with open("/proc/self/comm", "w") as f:
            f.write(STUB_TITLE)
    except OSError:
        pass
    inp, out = os.fdopen(rfd, "rb", buffering=0), os.fdopen(wfd, "wb", buffering=0)
    active: dict = {}
    buf = b""
    while True:
        r, _, _ = select.select([inp], [], [], 0 if active else None)
        if r:
            chunk = os.read(rfd, 65536)
            if not chunk:
                os._exit(0)                     # the HTTP process is gone
            buf += chunk
            while b"\n" in buf:
                line, buf = buf.split(b"\n", 1)
                m = json.loads(line)
                if m["op"] == "ping":
                    out.write(json.dumps({"rid": m["rid"], "pong": True}).encode() + b"\n")
                elif m["op"] == "gen":
                    active[m["rid"]] = {"ctx": list(m["ids"]), "left": int(m["max_new"]), "seed": int(m["seed"])}
                elif m["op"] == "abort" and m["rid"] in active:
                    del active[m["rid"]]
                    out.write(json.dumps({"rid": m["rid"], "done": "abort"}).encode() + b"\n")
        for rid in list(active):
            a = active[rid]
            tok, lp = _next_token(a["seed"], a["ctx"])
            a["ctx"].append(tok)
            a["left"] -= 1
            done = "length" if a["left"] <= 0 else None
            out.write(json.dumps({"rid": rid, "tok": tok, "lp": lp, "done": done}).encode() + b"\n")
            if done:
                del active[rid]
        if active:
            time.sleep(TOKEN_S)


def serve(argv: list) -> None:
    import argparse
    import queue
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    ap = argparse.ArgumentParser()
    ap.add_argument("--serve", action="store_true")
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--parent-pid", type=int, required=True)
    ap.add_argument("--diag-s", type=float, default=5.0)
    ap.add_argument("--health-s", type=float, default=0.3)
    ap.add_argument("--slow-health-file", default="", help="while this file exists, /health replies take 5 s")
    args = ap.parse_args(argv)

    def say(msg):
        print(f"[stub {time.monotonic():.3f}] {msg}", flush=True)

    me = os.getpid()
    tracker = os.fork()                          # first child: waits, like the resource tracker
    if tracker == 0:
        while os.getppid() == me:                # until the HTTP process is gone
            time.sleep(0.2)
        os._exit(0)
    to_sched_r, to_sched_w = os.pipe()
    from_sched_r, from_sched_w = os.pipe()
    sched = os.fork()
    if sched == 0:
        os.close(to_sched_w)
        os.close(from_sched_r)
        _scheduler(to_sched_r, from_sched_w)
        os._exit(0)
    os.close(to_sched_r)
    os.close(from_sched_w)
    say(f"tracker {tracker}, scheduler {sched}")
    to_sched = os.fdopen(to_sched_w, "wb", buffering=0)
    send_lock = threading.Lock()
    queues: dict = {}
    qlock = threading.Lock()
    dead = threading.Event()

    def send(m) -> bool:
        try:
            with send_lock:
                to_sched.write(json.dumps(m).encode() + b"\n")
            return True
        except OSError:
            return False

    def reader():
        for line in os.fdopen(from_sched_r, "rb"):
            m = json.loads(line)
            with qlock:
                q = queues.get(m["rid"])
            if q is not None:
                q.put(m)
        # EOF: the scheduler is dead; the queues stay silent (SGLang's streams do)

    def end_tree(why):
        say(f"killing the tree ({why})")
        for pid in (tracker, sched):
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass
        os._exit(1)

    def watchdog():                              # SGLang's SubprocessWatchdog + SIGQUIT handler
        while True:
            time.sleep(1.0)
            if os.getppid() != args.parent_pid:
                end_tree("parent gone")
            pid, status = os.waitpid(sched, os.WNOHANG)
            if pid:
                dead.set()
                say(f"scheduler {sched} died (status {status}); crash diagnostics for {args.diag_s:g} s")
                time.sleep(args.diag_s)
                end_tree("after crash diagnostics")

    signal.signal(signal.SIGTERM, lambda *a: say("SIGTERM: draining (never completes with a dead scheduler)"))

    class H(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *a):
            pass

        def _reply(self, code, obj):
            body = json.dumps(obj).encode()
            self.send_response(code)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def _hang(self):
            while True:
                time.sleep(3600)

        def _open(self, rid):
            q = queue.Queue()
            with qlock:
                queues[rid] = q
            return q

        def do_GET(self):
            if self.path not in ("/health", "/health_generate"):
                return self._reply(404, {"error": self.path})
            rid = f"health-{threading.get_ident()}-{time.monotonic_ns()}"
            q = self._open(rid)
            if dead.is_set() or not send({"op": "ping", "rid": rid}):
                self._hang()
            q.get()                                # silent forever if the scheduler died meanwhile
            time.sleep(5.0 if args.slow_health_file and os.path.exists(args.slow_health_file) else args.health_s)
            with qlock:
                queues.pop(rid, None)
            self._reply(200, {})

        def do_POST(self):
            body = json.loads(self.rfile.read(int(self.headers.get("Content-Length") or 0)) or b"{}")
            if self.path == "/abort_request":
                send({"op": "abort", "rid": body.get("rid")})
                return self._reply(200, {})
            if self.path != "/generate":
                return self._reply(404, {"error": self.path})
            rid, sp = body["rid"], body["sampling_params"]
            q = self._open(rid)
            if dead.is_set() or not send({"op": "gen", "rid": rid, "ids": body["input_ids"],
                                          "max_new": sp["max_new_tokens"], "seed": sp.get("sampling_seed") or 0}):
                self._hang()
            ids, lps = [], []
            stream = bool(body.get("stream"))
            if stream:
                self.send_response(200)
                self.send_header("Content-Type", "text/event-stream")
                self.end_headers()
            while True:
                m = q.get()
                if "tok" in m:
                    ids.append(m["tok"])
                    lps.append(m["lp"])
                fr = {"type": m["done"]} if m.get("done") else None
                meta = {"completion_tokens": len(ids), "finish_reason": fr, "prompt_tokens": len(body["input_ids"]),
                        "output_token_logprobs": [[lp, t, None] for lp, t in zip(lps, ids)]}
                if stream:
                    self.wfile.write(b"data: " + json.dumps({"output_ids": ids, "meta_info": meta}).encode() + b"\n\n")
                    self.wfile.flush()
                if fr:
                    break
            with qlock:
                queues.pop(rid, None)
            if stream:
                self.wfile.write(b"data: [DONE]\n\n")
                self.close_connection = True
            else:
                self._reply(200, {"output_ids": ids, "meta_info": meta})

    httpd = ThreadingHTTPServer(("127.0.0.1", args.port), H)
    httpd.daemon_threads = True
    threading.Thread(target=reader, daemon=True).start()
    threading.Thread(target=watchdog, daemon=True).start()
    say(f"serving on {args.port}")
    httpd.serve_forever()


if __name__ == "__main__":
    serve(sys.argv[1:])
    sys.exit(0)


# ---------------------------------------------------------------------------------------- tests
class StubServer(_ServerProcess):
    """The stub above in its own process group, watched like SGLangServer (``sglang::`` children)."""

    kind = "stub-sglang"
    watch_children = ("sglang::",)              # as SGLangServer

    def __init__(self, diag_s: float = 5.0, slow_health_file: str = "", **kw):
        kw.setdefault("startup_timeout", 60.0)
        kw.setdefault("grace", 3.0)                 # as the benchmark's --grace-s
        super().__init__(**kw)
        self.diag_s, self.slow_health_file = diag_s, slow_health_file

    def command(self):
        return [self.python, os.path.abspath(__file__), "--serve", "--port", str(self.port),
                "--parent-pid", str(os.getpid()), "--diag-s", str(self.diag_s),
                "--slow-health-file", self.slow_health_file]


PROMPT = [1, 40, 41, 42, 9]


def test_sglang_server_turns_crash_diagnostics_off_unless_asked(monkeypatch):
    """The two variables SGLang 0.5.17 reads in ``dump_requests_before_crash``: off by default,
    kept when the caller (``env`` or this process's environment) or ``crash_diagnostics`` says so."""
    names = ("SGLANG_PYSPY_DUMP_BEFORE_CRASH", "SGLANG_CUDA_COREDUMP_BEFORE_CRASH")
    for n in names:
        monkeypatch.delenv(n, raising=False)
    assert all(SGLangServer("/m").env[n] == "0" for n in names)
    assert not any(n in SGLangServer("/m", crash_diagnostics=True).env for n in names)
    assert SGLangServer("/m", env={names[0]: "1"}).env[names[0]] == "1"
    monkeypatch.setenv(names[1], "true")
    assert SGLangServer("/m").env[names[1]] == "true" and SGLangServer("/m").env[names[0]] == "0"


def test_alive_sees_a_dead_scheduler_child_and_kill_server_picks_it(tmp_path):
    """``kill_server(.., "child")`` kills the scheduler (by title), not the lowest-pid child; the
    HTTP process lives on, yet ``alive()`` is False at once; ``kill()`` ends the group at once."""
    s = StubServer(log_path=str(tmp_path / "stub.log")).start()
    try:
        assert [t for t, _ in s.watched.values()] == ["sglang::schedul"] and s.alive(), s.watched
        sched = next(iter(s.watched))
        f = kill_server(s, "child")
        assert f.landed and f.target.endswith(f"child {sched} (sglang::schedul)"), f.target
        t0 = time.monotonic()
        while s.alive():
            assert time.monotonic() - t0 < 1.0, "alive() did not notice the dead scheduler"
            time.sleep(0.01)
        assert s.proc.poll() is None and "sglang::schedul" in s.dead_reason, s.dead_reason
        assert s.kill()
        s.proc.wait(5.0)
        assert s.proc.returncode == -signal.SIGKILL
    finally:
        s.stop()


@pytest.fixture
def sup(tmp_path):
    logs = []

    def start(path, version):
        server = StubServer(log_path=str(tmp_path / f"stub-{time.time_ns()}.log"))
        logs.append(server)
        return server.start()

    s = Supervisor(start, "stub-model", "v0", num_active=1, num_shadows=1, health_interval_s=0.25,
                   engine_kw={"timeout": 60.0, "retries": 0}).start()
    s.servers = logs
    yield s
    s.close()


def test_scheduler_kill_fails_over_at_once_and_resumes_exactly(sup):
    sp = SamplingParams(max_new_tokens=300, stop_token_ids=[], seed=7)
    ref = sup.engine(0).generate(PROMPT, sp)
    assert len(ref.output_ids) == 300
    eng = ResumableEngine(sup, 0)
    victim = sup.worker(0)
    out = {}
    th = threading.Thread(target=lambda: out.setdefault("gen", eng.generate(PROMPT, sp, rid="sched-kill")))
    th.start()
    deadline = time.monotonic() + 60
    while "sched-kill" not in eng.log.records or len(eng.log.records["sched-kill"].output_ids) < 40:
        assert time.monotonic() < deadline and th.is_alive(), "the request never reached the kill point"
        time.sleep(0.002)
    rec = eng.log.records["sched-kill"]
    t_kill = time.monotonic()
    f = kill_server(victim.server, "child")
    th.join(120)
    assert "gen" in out, "the request did not complete"
    assert f.landed and "sglang::schedul" in f.target, f.target
    gen = out["gen"]
    assert gen.output_ids == ref.output_ids and gen.logprobs == ref.logprobs          # exact resume
    assert len(rec.segments) == 2 and rec.segments[0].error and rec.segments[1].worker != victim.name
    ev = [e for e in sup.events if e.failed == victim.name]
    detect, recovery = ev[0].t_detect - t_kill, rec.segments[1].t_first - t_kill
    print(f"scheduler kill: detected +{detect:.3f} s ({ev[0].cause}), promoted +{ev[0].t_ready - t_kill:.3f} s, "
          f"first resumed token +{recovery:.3f} s; stream error: {rec.segments[0].error[:100]}")
    # the detection path: the monitor's alive() saw the dead child (not /health timeouts, not the stream)
    assert len(ev) == 1 and ev[0].how == "shadow" and "sglang::schedul" in ev[0].cause, ev
    assert ev[0].cause.startswith("monitor: child"), ev[0].cause
    # the failed worker was SIGKILLed by the supervisor, not ended by its own watchdog after the diagnostics
    log_text = open(victim.server.log_path).read()
    assert "after crash diagnostics" not in log_text, log_text[-2000:]
    assert detect < 3.0 and recovery < 4.0, (detect, recovery)     # old behaviour: ~6 s (the stub's self-kill)


def test_a_slow_health_with_live_processes_is_not_a_failure_within_the_grace(tmp_path, caplog):
    """H200, 2026-12-03: an SGLang server busy compiling on its first request answered no /health
    for > 4 s and the old rule (two failed 2 s calls in a row) SIGKILLed it with requests in flight.
    Here every /health reply takes 5 s (> the monitor's 2 s timeout) while the processes live:
    within the grace the worker is kept and generates; the old rule failed it over after ~4 s."""
    slow = tmp_path / "slow-health"
    server = StubServer(slow_health_file=str(slow), log_path=str(tmp_path / "slow.log"))
    s = Supervisor(lambda p, v: server.start(), "stub-model", "v0", num_active=1, num_shadows=0,
                   health_interval_s=0.1, health_grace_s=30.0, engine_kw={"timeout": 60.0, "retries": 0})
    with caplog.at_level(logging.WARNING, logger="megatron_harts.rollout.belayer.engine"):
        s.start()
        try:
            w = s.worker(0)
            slow.touch()                                     # from now on /health replies take 5 s
            time.sleep(7.0)                                  # >= 3 failed /health calls
            assert s.events == [] and s.worker(0) is w and server.alive()
            out = s.engine(0).generate(PROMPT, SamplingParams(max_new_tokens=5, stop_token_ids=[], seed=1))
            assert len(out.output_ids) == 5
        finally:
            s.close()
    assert any("/health failed 2 time(s)" in r.getMessage() for r in caplog.records), \
        "the /health calls did not fail: the test would not see the old rule's failover"
