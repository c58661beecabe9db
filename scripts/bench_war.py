#!/usr/bin/env python
"""WAR benchmark: suffix speculation and global scheduling, side by side with the anchors.

Parts (``--parts``, default ``drafters,cpu``):

* ``drafters`` (CPU, offline): code_repair trajectories (scripted agent turns on the real
  environment; see ``megatron_harts.rollout.war.replay``) replayed token by token through our
  suffix drafter, arctic-inference's ``SuffixDecodingCache`` and SGLang 0.5.17's ``NgramCorpus``
  (plain, and with completed trajectories as an external corpus) at equal draft budgets:
  accepted tokens per verification step and drafter latency per call.
* ``drafters_sampled`` (CPU, offline): the same replay on code_repair episodes *sampled* from a
  trained model (``--model-path``; ``python -m megatron_harts.rollout.text_model`` makes one
  here) by the agent loop on the embedded engine: the model's own turns.
* ``cpu``: a small synchronous RL step of agentic trajectories (``--family``, random tiny
  Qwen3-Next, the embedded engine) on CPU: low load (one replica, speculation off vs on) and
  "high" load (``--replicas`` replicas, WAR scheduler vs sticky least-loaded vs sglang-router
  0.3.2 round_robin / cache_aware / power_of_two; ``sticky_prio``: sticky least-loaded placement
  with every turn's ``priority`` = its trajectory's turns done, served by engines started with
  ``--enable-priority-scheduling``; with that policy listed every replica gets the flag, and the
  other policies, which send no priority, tie and are served in arrival order as without it). The embedded engine has no prefix cache and
  runs one request at a time, and a random model's outputs are not text (turns without a tool
  call are run as ``ls``: :class:`ForcedCall`): these rows check the mechanics and the overheads,
  not the GPU claims.
* ``h200``: the same step on SGLang 0.5.17 replicas sharing one GPU (``--mem-fraction`` split
  over ``--replicas``): low load (``--low-tasks x --group`` trajectories, one server) HARTS_SUFFIX /
  NGRAM / no speculation, high load (``--high-tasks x --group``) WAR vs sticky vs sglang-router
  policies; cache hits from SGLang's ``cached_tokens``, accept length from its per-request
  ``spec_verify_ct``. Every server gets the same flags (no overlap schedule, Triton attention,
  CUDA graphs off unless ``--cuda-graph``); rows are written as they come (``"partial": true``
  until the end), ``--deadline-s`` bounds the run (phases that would not fit are skipped, and the
  rows say so); server logs go to ``war_h200/`` next to ``--out``, packed into ``war_h200.tgz`` at
  the end. Runs 1-4 are in docs/war.md with their commands (write ``--out`` under ``$OUT`` on the lent GPU, or the rows do not come back).

Rows ``{part, load, concurrency, policy, tokens_per_s, makespan_s, cache_hit, accept_len, device}``
go to ``--out`` (default docs/benchmarks/war.json), the plot next to it.
"""
from __future__ import annotations

import argparse
import itertools
import json
import logging
import os
import shlex
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

# sticky_prio's replicas: SGLang 0.5.17 orders its waiting queue by the request's priority (larger
# first); preemption off so a late turn never evicts a running one (recompute) - only the order changes
SGLANG_PRIO_FLAGS = ["--enable-priority-scheduling", "--disable-priority-preemption"]
HIGH_POLICIES = ("war", "war_open", "sticky", "sticky_prio", "round_robin", "cache_aware", "power_of_two")
ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
log = logging.getLogger("bench_war")

MAKE = r'''
import sys
sys.modules["fla"] = None
sys.modules["causal_conv1d"] = None
import json, torch
from transformers import Qwen3NextConfig, Qwen3NextForCausalLM
from megatron_harts.rollout.weight_sync import tiny_qwen3_next_config
torch.manual_seed(0)
cfg = tiny_qwen3_next_config(hidden_size=int(sys.argv[2]))
m = Qwen3NextForCausalLM(Qwen3NextConfig(**cfg)).float().eval()
m.save_pretrained(sys.argv[1])
c = json.load(open(sys.argv[1] + "/config.json")); c["full_attention_interval"] = 4
json.dump(c, open(sys.argv[1] + "/config.json", "w"), indent=1)
'''


def fail(msg: str) -> None:
    print(f"bench_war: {msg}", file=sys.stderr)
    sys.exit(2)


# ------------------------------------------------------------------------------------ drafters
def _replay_rows(args, streams, part: str, label: str) -> list[dict]:
    from megatron_harts.rollout.war.replay import ArcticMethod, OursMethod, SGLangNgramMethod, replay
    from megatron_harts.rollout.war.sglang_plugin import sglang_site
    from megatron_harts.rollout.war.suffix import DrafterConfig

    sglang_site()
    n_tok = sum(len(s.tokens) for s in streams)
    n_gen = sum(sum(s.loss_mask) for s in streams)
    rows = []
    for budget in args.budgets:
        methods = [OursMethod(DrafterConfig(max_depth=args.depth, budget=budget)),
                   OursMethod(DrafterConfig(max_depth=args.depth, budget=budget, use_global=False), "ours_group_only"),
                   OursMethod(DrafterConfig(max_depth=args.depth, budget=budget, tree=True), "ours_tree"),
                   # drafts up to twice the match length: chosen on the sampled streams (a weak
                   # model's short matches), checked on the scripted ones
                   OursMethod(DrafterConfig(max_depth=args.depth, budget=budget, tree=True, max_spec_factor=2.0),
                              "ours_tree_f2"),
                   ArcticMethod(args.depth, budget), ArcticMethod(args.depth, budget, tree=True), SGLangNgramMethod(budget),
                   SGLangNgramMethod(budget, external=True)]
        for m in methods:
            r = replay(m, streams)
            row = {"part": part, "method": r.method, "budget": budget, "accept_len": round(r.accept_len, 3),
                   "accepted_per_step": round(r.accept_len - 1, 3), "verify_steps": r.steps,
                   "model_tokens": r.emitted, "draft_us_mean": round(r.draft_us_mean, 1),
                   "draft_us_median": round(r.draft_us_median, 1),
                   "draft_us_p99": round(r.draft_us_p99, 1), "index_s": round(r.update_s, 2),
                   "accept_len_by_step": {str(k): round(v, 3) for k, v in r.accept_len_by_step.items()},
                   "streams": f"{label} x{len(streams)} ({args.tasks} tasks x {args.samples} samples x "
                              f"{args.steps} steps), {n_tok} byte tokens, {n_gen} model tokens",
                   "device": "cpu (2 shared cores)"}
            log.info("%s", row)
            rows.append(row)
    return rows


def part_drafters(args) -> list[dict]:
    """Scripted code_repair episodes (real sandboxes) replayed through every drafter."""
    from megatron_harts.rollout.war.replay import code_repair_streams

    t0 = time.perf_counter()
    streams = code_repair_streams(args.tasks, args.samples, args.steps, seed=0)
    log.info("%d scripted streams in %.1f s", len(streams), time.perf_counter() - t0)
    return _replay_rows(args, streams, "drafters", "code_repair scripted")


def part_drafters_sampled(args) -> list[dict]:
    """code_repair episodes sampled from a trained model (``--model-path``, e.g. made by
    ``python -m megatron_harts.rollout.text_model``) on the embedded engine, then replayed
    through every drafter: the model's own turns, not scripted ones."""
    from megatron_harts.rollout.engines import EmbeddedServer
    from megatron_harts.rollout.war.replay import sampled_streams

    from megatron_harts.rollout.war.replay import load_streams, save_streams

    t0 = time.perf_counter()
    if args.load_streams:                      # the streams of an earlier run (--save-streams)
        try:
            streams = load_streams(args.load_streams)
        except ValueError as e:
            fail(f"--load-streams: {e}")
    else:
        if not args.model_path or not (Path(args.model_path) / "config.json").is_file():
            fail(f"--parts drafters_sampled needs --model-path to a checkpoint with config.json (or --load-streams), "
                 f"got {args.model_path!r}")
        tmp = Path(tempfile.mkdtemp(prefix="bench_war_sampled_"))
        with EmbeddedServer(args.model_path, threads=2, log_path=str(tmp / "engine.log")) as srv:
            streams = sampled_streams(srv.engine(timeout=600), "code_repair", args.tasks, args.samples, args.steps,
                                      max_new_tokens=args.sampled_max_new_tokens, max_turns=args.sampled_max_turns)
    log.info("%d sampled streams in %.1f s", len(streams), time.perf_counter() - t0)
    if args.save_streams:                      # gzip when the name ends in .gz (it wrote plain JSONL before)
        save_streams(streams, args.save_streams)
    src = args.load_streams or args.model_path
    rows = _replay_rows(args, streams, "drafters_sampled", f"code_repair sampled from {src}")
    return rows


# --------------------------------------------------------------------------------- rollouts
class Counting:
    """Counts prompt / cached tokens of the turns an engine serves (the agent loop's Turn does not
    keep ``cached_tokens``); on an :class:`HttpEngine` also SGLang's per-request speculation
    counters (``meta_info.spec_verify_ct``, ``completion_tokens``: the accept length of exactly
    these turns). Called from the loop's threads at once: the counters take a lock."""

    def __init__(self, engine):
        self.engine, self.name = engine, engine.name
        self.prompt = self.cached = 0
        self.verify_ct = self.spec_tokens = self.logprob_fixups = 0
        self._lock = threading.Lock()
        orig = getattr(type(engine), "_json", None)
        if orig is not None and "_json" not in vars(engine):   # an HttpEngine: tap /generate replies
            def tap(method, path, body=None, **kw):
                d = orig(engine, method, path, body, **kw)
                meta = d.get("meta_info") if isinstance(d, dict) else None
                if path != "/generate" or not isinstance(meta, dict):
                    return d
                if meta.get("spec_verify_ct"):
                    with self._lock:
                        self.verify_ct += int(meta["spec_verify_ct"])
                        # tokens of verify steps: all but the first (the prefill's)
                        self.spec_tokens += max(0, int(meta.get("completion_tokens") or 0) - 1)
                # bench harness: the rows use no log-probs, so a reply whose log-probs do not line up
                # with its tokens (a speculative-path quirk) is padded rather than failing the
                # episode; counted in the row as logprob_fixups
                out, lps = d.get("output_ids"), meta.get("output_token_logprobs") or []
                if isinstance(out, list) and isinstance(lps, list) and (
                        len(lps) != len(out) or any(not isinstance(x, (list, tuple)) or not x or x[0] is None
                                                    for x in lps)):
                    with self._lock:
                        self.logprob_fixups += 1
                    lps = [x if isinstance(x, (list, tuple)) and x and x[0] is not None else [0.0, None, None]
                           for x in lps]
                    meta["output_token_logprobs"] = (lps + [[0.0, None, None]] * len(out))[:len(out)]
                return d
            engine._json = tap

    def __getattr__(self, k):
        return getattr(self.engine, k)

    def generate(self, input_ids, sampling, rid=None):
        g = self.engine.generate(input_ids, sampling, rid=rid)
        with self._lock:
            self.prompt += len(input_ids)
            self.cached += g.cached_tokens
        return g


class ForcedCall:
    """Bench harness (labelled as such): a random model rarely writes ``<call>``, which would end
    every episode after one turn; a turn without a call is handed to the environment as
    ``<call>ls</call>`` (the trajectory keeps the model's own tokens), so episodes run their
    ``max_turns`` turns with real sandbox observations and growing contexts."""

    def __init__(self, env):
        self.env, self.task_id = env, env.task_id

    def prompt(self):
        return self.env.prompt()

    def step(self, action):
        if "<call>" not in action or "</call>" not in action:
            action = "<call>ls</call>"
        return self.env.step(action)

    def fork(self):
        return ForcedCall(self.env.fork())

    def close(self):
        self.env.close()


_RID_BASE = itertools.count(1)


def _step(engines, pick, args, concurrency: int, n_tasks: int, group: int, feed=None, strict: bool = True,
          max_turns: int | None = None, seed: int = 1) -> dict:
    """One rollout step; ``strict``: exit on a failed episode (else the row counts them); ``seed``: the
    loop's sampling seed (each request's is derived from it, its trajectory and turn)."""
    from megatron_harts.rollout.agent_loop import AgentLoop, RolloutConfig, sticky_least_loaded
    from megatron_harts.rollout.envs import make_env
    from megatron_harts.rollout.tokenizer import ByteTokenizer

    cfg = RolloutConfig(group_size=group, max_new_tokens=args.max_new_tokens, max_turns=max_turns or args.max_turns,
                        temperature=1.0, max_concurrency=concurrency, seed=seed,
                        max_context_tokens=getattr(args, "max_context", None) or 4096)
    counted = [Counting(e) for e in engines]
    wrap = ForcedCall if args.force_calls else (lambda e: e)
    loop = AgentLoop(counted, ByteTokenizer(), lambda t: wrap(make_env(args.family, int(t), seed=0)), cfg,
                     pick_engine=pick or sticky_least_loaded)
    # request ids unique across steps (each loop counts from 0): a server never sees a finished
    # request's id again (SGLang's NGRAM and our corpus keep per-rid match state)
    loop._rid = itertools.count(next(_RID_BASE) * 10_000_000)
    t0 = time.perf_counter()
    res = loop.rollout(list(range(n_tasks)))
    wall = time.perf_counter() - t0
    if res.failed and strict:
        fail(f"{len(res.failed)} episodes failed: {res.failed[:2]}")
    if feed is not None:                      # completed trajectories -> the speculation corpus
        feed.add_trajectories(res.trajectories)
    prompt = sum(c.prompt for c in counted)
    row = {"tokens_per_s": round(res.stats["generated_tokens"] / wall, 1), "makespan_s": round(wall, 2),
           "generated_tokens": res.stats["generated_tokens"], "trajectories": res.stats["trajectories"],
           "turns": res.stats["turns"], "cache_hit": round(sum(c.cached for c in counted) / max(prompt, 1), 4),
           "reward_mean": round(res.stats["reward_mean"], 4) if res.trajectories else None}
    fixups = sum(c.logprob_fixups for c in counted)
    if fixups:
        row["logprob_fixups"] = fixups
    verify = sum(c.verify_ct for c in counted)
    if verify:
        row["spec_accept_len"] = round(sum(c.spec_tokens for c in counted) / verify, 3)
        row["spec_verify_steps"] = verify
    if res.failed:
        row["failed"] = len(res.failed)
        row["failed_first"] = [f"{t}: {why[:300]}" for t, why in res.failed[:3]]
    return row


def _spec_stats(url: str) -> dict | None:
    import urllib.request

    with urllib.request.urlopen(url + "/server_info", timeout=30) as r:
        return json.loads(r.read()).get("speculative")


def part_cpu(args) -> list[dict]:
    from megatron_harts.rollout.engines import EmbeddedServer
    from megatron_harts.rollout.war.router import RouterServer
    from megatron_harts.rollout.war.scheduler import SchedulerConfig, WarScheduler, with_progress_priority

    tmp = Path(tempfile.mkdtemp(prefix="bench_war_"))
    model = tmp / "model"
    subprocess.run([sys.executable, "-c", MAKE, str(model), str(args.hidden)], check=True, cwd=ROOT,
                   env=dict(os.environ, PYTHONPATH=str(ROOT)))
    dev = "cpu (2 shared cores), embedded engine, random tiny Qwen3-Next"
    rows = []
    # low load: one replica, speculation off / on (separate servers: the switch is per server in SGLang)
    for policy, extra in (("none", []), ("suffix", ["--speculative-algorithm", "suffix",
                                                    "--speculative-num-draft-tokens", str(args.budgets[0])])):
        with EmbeddedServer(str(model), threads=1, extra_args=extra, log_path=str(tmp / f"low_{policy}.log")) as srv:
            before = _spec_stats(srv.url)
            r = _step([srv.engine(timeout=600)], None, args, args.low_concurrency, args.low_tasks, args.group)
            after = _spec_stats(srv.url)
            acc = None
            if after:
                steps = after["verify_steps"] - before["verify_steps"]
                acc = round((after["emitted"] - before["emitted"]) / max(steps, 1), 3)
            rows.append(dict(part="cpu", load="low", concurrency=args.low_tasks * args.group, policy=policy,
                             accept_len=acc, device=dev, **r))
            log.info("%s", rows[-1])
    # high load: several replicas, placement policies
    rep_extra = ["--enable-priority-scheduling"] if "sticky_prio" in args.policies else []
    servers = [EmbeddedServer(str(model), threads=1, extra_args=rep_extra, log_path=str(tmp / f"rep{i}.log")).start()
               for i in range(args.replicas)]
    try:
        conc = args.high_tasks * args.group
        runs: dict[str, list[dict]] = {p: [] for p in args.policies}
        for rep in range(args.repeats):           # interleaved repeats: the shared cores drift
            for policy in args.policies:
                if policy in ("round_robin", "cache_aware", "power_of_two"):
                    with RouterServer([s.url for s in servers], policy,
                                      log_path=str(tmp / f"router_{policy}.log")) as rt:
                        r = _step([rt.engine(timeout=600)], None, args, conc, args.high_tasks, args.group)
                elif policy == "sticky":
                    r = _step([s.engine(timeout=600) for s in servers], None, args, conc, args.high_tasks, args.group)
                elif policy == "sticky_prio":
                    r = _step(with_progress_priority([s.engine(timeout=600) for s in servers]), None, args, conc,
                              args.high_tasks, args.group)
                elif policy == "war":
                    sch = WarScheduler(len(servers), SchedulerConfig(max_running=args.max_running,
                                                                     expected_decode=args.max_new_tokens,
                                                                     load_weight=args.load_weight))
                    r = _step(sch.wrap([s.engine(timeout=600) for s in servers]), sch, args, conc, args.high_tasks,
                              args.group)
                    r["modelled_cache_hit"] = round(sch.cache_hit(), 4)
                else:
                    fail(f"--policies: unknown policy {policy!r}")
                runs[policy].append(r)
                log.info("%s repeat %d: %s", policy, rep, r)
        for policy, rs in runs.items():
            rs = sorted(rs, key=lambda r: r["makespan_s"])
            med = dict(rs[len(rs) // 2])
            med["makespan_s_all"] = [r["makespan_s"] for r in rs]
            rows.append(dict(part="cpu", load="high", concurrency=conc, policy=policy, accept_len=None,
                             device=dev + f", {len(servers)} replicas; median of {len(rs)} interleaved runs", **med))
            log.info("%s", rows[-1])
    finally:
        for s in servers:
            s.stop()
    return rows


def _sglang_accept(url: str) -> float | None:
    """SGLang's ``avg_spec_accept_length`` (``/server_info`` -> ``internal_states[0]``): accepted
    tokens (bonus included) per verify forward over the server's life, folded in every
    ``--decode-log-interval`` decode iterations (so it lags the last window)."""
    import urllib.request

    with urllib.request.urlopen(url + "/server_info", timeout=30) as r:
        info = json.loads(r.read())
    states = info.get("internal_states") or [{}]
    v = states[0].get("avg_spec_accept_length") if isinstance(states[0], dict) else None
    return round(float(v), 3) if v is not None else None


class _Clock:
    """Phase log with timestamps and the deadline (``--deadline-s`` from the script's start)."""

    def __init__(self, t0: float, deadline_s: float):
        self.t0 = t0
        self.deadline = t0 + deadline_s if deadline_s > 0 else float("inf")

    def left(self) -> float:
        return self.deadline - time.monotonic()

    def phase(self, msg: str, *a) -> None:
        left = self.left()
        log.info("[h200 t=%5.0fs%s] " + msg, time.monotonic() - self.t0,
                 "" if left == float("inf") else f", {left:4.0f}s left", *a)


def _kill_live_servers() -> None:
    """SIGKILL every server this process started (their HTTP calls then fail at once)."""
    from megatron_harts.rollout.engines.launch import _LIVE

    for srv in list(_LIVE):
        proc = srv.proc
        if proc is not None:
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass


def _prebuild_envs(family: str, n: int, out: dict) -> None:
    """Build the tasks' files once (code_repair screens mutants and checks its grader in
    sandboxes, serially: 10-60 s for 128 tasks), so no timed step pays for it."""
    from megatron_harts.rollout.envs import make_env

    t0 = time.perf_counter()
    try:
        for t in range(n):
            make_env(family, t, seed=0).close()
        out["ok"] = True
    except Exception as e:         # noqa: BLE001 - reported, and the steps then fail the same way
        out["ok"], out["error"] = False, f"{type(e).__name__}: {e}"
    out["s"] = round(time.perf_counter() - t0, 1)


def _prebuild_ngram(env: dict, out: dict, timeout: float) -> None:
    """SGLang's C++ NgramCorpus (tvm-ffi JIT: ninja + c++) built once with ``-include cstddef``
    (0.5.17's result.h misses it) into the cache the NGRAM server then loads from."""
    t0 = time.perf_counter()
    code = "from megatron_harts.rollout.war.sglang_plugin import ngram_corpus_cls; ngram_corpus_cls(); print('ok')"
    try:
        r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=timeout,
                           env=dict(os.environ, **env), cwd=ROOT)
        out["ok"] = r.returncode == 0
        if not out["ok"]:
            out["error"] = (r.stderr or r.stdout)[-1500:]
    except subprocess.TimeoutExpired:
        out["ok"], out["error"] = False, f"timed out after {timeout:g} s"
    out["s"] = round(time.perf_counter() - t0, 1)


LOW_KINDS = ("suffix", "ngram", "none")


def variant_slug(variant: str) -> str:
    """A variant as a file-name part: ``suffix@8`` -> ``suffix_b8``."""
    return variant.replace("@", "_b")


def variant_kind(variant: str) -> str:
    """``suffix@8`` -> ``suffix``; a plain kind is itself."""
    return variant.split("@", 1)[0]


def variant_budget(variant: str, default: int) -> int:
    """A low-load variant's draft budget (draft tokens per verification step, the verified tokens
    being one more): ``kind@N`` gives N, a plain kind ``default`` (``--budgets``' first). Raises
    ValueError with a one-line message for an unknown kind or a bad N; ``none@N`` is refused."""
    kind, _, n = variant.partition("@")
    if kind not in LOW_KINDS:
        raise ValueError(f"unknown variant {variant!r} (kinds: {', '.join(LOW_KINDS)}, optionally kind@budget)")
    if not _:
        return default
    if kind == "none":
        raise ValueError(f"{variant!r}: 'none' has no draft budget")
    if not n.isdigit() or int(n) < 1:
        raise ValueError(f"{variant!r}: the budget after '@' must be a positive integer")
    return int(n)


def speculation_flags(variant: str, default_budget: int, timed_ngram: bool = False) -> list[str]:
    """A low-load variant's SGLang flags: HARTS_SUFFIX or NGRAM verifying its draft budget plus
    one tokens per step (``suffix@8``: 9), none for ``none``. ``timed_ngram``: NGRAM as
    HARTS_NGRAM_TIMED (the same worker and C++ corpus, its host time per step logged)."""
    kind, budget = variant_kind(variant), variant_budget(variant, default_budget)
    algo = {"suffix": "HARTS_SUFFIX", "ngram": "HARTS_NGRAM_TIMED" if timed_ngram else "NGRAM"}.get(kind)
    return ["--speculative-algorithm", algo, "--speculative-num-draft-tokens", str(budget + 1)] if algo else []


def gpu_name() -> str:
    """The GPU the rows ran on, as CUDA names it (e.g. ``NVIDIA H100 80GB HBM3``): the part is named
    after the target machine, but the device lent may be an H100; rows must say which."""
    try:
        import torch
        if torch.cuda.is_available():
            return torch.cuda.get_device_name(0)
    except Exception as e:                  # a broken torch install: say so rather than guess a GPU
        log.warning("cannot read the GPU's name through torch: %s", e)
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"], capture_output=True,
                             text=True, timeout=30)
        name = out.stdout.strip().splitlines()[0] if out.returncode == 0 and out.stdout.strip() else ""
    except (OSError, subprocess.SubprocessError):
        name = ""
    return name or "GPU of unknown name"


def _sglang_version() -> str:
    try:
        import sglang
        return str(sglang.__version__)
    except Exception:                       # the preflight already failed clearly when sglang is missing
        return "(version unknown)"


def part_h200(args, sink) -> None:
    """SGLang 0.5.17 on the GPU (see docs/war.md for the command). Rows go to ``sink.add`` as
    they are measured (the JSON is rewritten after each), so a run cut short keeps its rows.

    Order (most novel first, the deadline trims the tail): HARTS_SUFFIX low load; then the
    ``--replicas`` high-load replicas (started one after another: each sizes its KV pool from
    the memory free when it starts), low load without speculation on replica 0, an unmeasured
    warm-up step on all replicas, the placement policies; then NGRAM low load. Low-load rows:
    step 1 fills the corpora and warms the kernels, step 2 is measured (``spec_accept_len``:
    tokens per verify step of step 2 from SGLang's per-request counters; ``accept_len``:
    SGLang's lifetime ``avg_spec_accept_length``)."""
    if not args.model_path or not Path(args.model_path, "config.json").is_file():
        fail("--model-path must be a Hugging Face checkpoint directory for the h200 part")
    import importlib.util

    from megatron_harts.rollout.engines import SGLangServer
    from megatron_harts.rollout.war.router import RouterServer
    from megatron_harts.rollout.war.scheduler import SchedulerConfig, WarScheduler, with_progress_priority
    from megatron_harts.rollout.war.sglang_plugin import (CORPUS_ENV, DRAFT_ENV, STEP_WALL_ENV, TIMED_NGRAM_NAME,
                                                          TIMING_ENV, TrajectoryFeed, server_timing, write_plugin_dist,
                                                          DRAFT_LOG_ENV)

    clock = _Clock(args.t0, args.deadline_s)
    # -- preflight: what would make every server or step fail, before any GPU time is spent
    hf = json.loads(Path(args.model_path, "config.json").read_text())
    if "full_attention_interval" not in hf or hf.get("architectures") != ["Qwen3NextForCausalLM"]:
        fail(f"{args.model_path}/config.json: SGLang's Qwen3-Next needs architectures [Qwen3NextForCausalLM] and "
             f"full_attention_interval (got {hf.get('architectures')}, {hf.get('full_attention_interval')})")
    if importlib.util.find_spec("sglang") is None:
        fail("sglang is not importable: put SGLang 0.5.17 on PYTHONPATH (export PYTHONPATH=/tmp/site:$PWD)")
    if shutil.which("bwrap") is None:
        fail(f"bwrap not on PATH: the {args.family} sandboxes need bubblewrap (dpkg -x .bw/*.deb /tmp/bw; "
             f"export PATH=/tmp/bw/usr/bin:$PATH)")
    args.max_context = min(4096, int(hf.get("max_position_embeddings") or 4096))
    if args.deepen > 1:
        # the same logits with --deepen x the layers (megatron_harts.rollout.deepen): decode-bound turns
        from megatron_harts.rollout.deepen import DeepenError, deepen_checkpoint
        # beside the temporary files, not in --out (a device call returns what is under $OUT)
        deep = Path(tempfile.gettempdir()) / f"harts_model_deepened_x{args.deepen}"
        try:
            info = deepen_checkpoint(args.model_path, deep, args.deepen, overwrite=True)
        except DeepenError as e:
            fail(f"--deepen: {e}")
        log.info("--deepen %d: %s -> %s (layers %s, parameters %s)", args.deepen, args.model_path, deep,
                 info["layers"], info["params"])
        args.model_path = str(deep)
    policies = list(args.policies)
    bad = [p for p in policies if p not in HIGH_POLICIES]
    if bad:
        fail(f"--policies: unknown policy {bad[0]!r}")
    variants = [v for v in args.low_variants.split(",") if v]      # checked in main()
    budget_of = {v: variant_budget(v, args.budgets[0]) for v in variants}
    if args.replicas < 1:
        fail("--replicas must be >= 1")
    t = time.perf_counter()
    from megatron_harts.rollout.envs import make_env
    try:
        make_env(args.family, 0, seed=0).close()          # sandbox + task build work here at all
    except Exception as e:                                 # noqa: BLE001
        fail(f"{args.family} task 0 cannot be built here: {type(e).__name__}: {str(e)[:300]}")
    clock.phase("preflight ok (task 0 in %.1f s); model %s, context %d", time.perf_counter() - t, args.model_path,
                args.max_context)
    routed = [p for p in policies if p in ("round_robin", "cache_aware", "power_of_two")]
    if routed and importlib.util.find_spec("sglang_router") is None:
        log.warning("sglang_router not importable: skipping %s", routed)
        for p in routed:
            sink.add(dict(part="h200", load="high", policy=p, skipped="sglang_router not importable"))
        policies = [p for p in policies if p not in routed]

    logs = Path(args.out).resolve().parent / "war_h200"
    shutil.rmtree(logs, ignore_errors=True)
    logs.mkdir(parents=True, exist_ok=True)
    site = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    env = {"PYTHONPATH": os.pathsep.join([str(write_plugin_dist(logs / "plugin")), str(ROOT), *site]),
           "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    b = args.budgets[0]
    # the same flags on every server (parity): no overlap (the hybrid model's no_buffer mamba cache),
    # Triton attention (head_dim 32; FlashInfer would JIT-compile with nvcc; NGRAM's tree verify
    # needs topk > 1 support), CUDA graphs off unless --cuda-graph (what ran on this machine before)
    common = ["--disable-overlap-schedule", "--attention-backend", "triton"]
    common += ["--cuda-graph-max-bs-decode", str(args.cuda_graph_max_bs)] if args.cuda_graph else ["--disable-cuda-graph"]
    common += shlex.split(args.sglang_args)
    frac = round(args.mem_fraction / max(1, args.replicas), 4)
    spec = {v: speculation_flags(v, b, args.time_ngram) for v in {"suffix", "ngram", "none", *variants}}
    # sticky_prio: every replica with priority scheduling (requests without a priority all tie: arrival order)
    rep_extra = list(SGLANG_PRIO_FLAGS) if "sticky_prio" in policies else []
    dev = f"{gpu_name()}, SGLang {_sglang_version()}, {' '.join(common + rep_extra)}"
    tag = dict(part="h200", max_new_tokens=args.max_new_tokens, max_turns=args.max_turns, family=args.family,
               model=str(args.model_path), deepen=args.deepen)

    # -- background: the tasks' files and NGRAM's C++ corpus, while the first server starts
    envs_state, ngram_state = {}, {}
    bg = [threading.Thread(target=_prebuild_envs, args=(args.family, max(args.high_tasks, args.low_tasks),
                                                        envs_state), daemon=True)]
    if any(variant_kind(v) == "ngram" for v in variants):
        bg.append(threading.Thread(target=_prebuild_ngram, args=(env, ngram_state, 300.0), daemon=True))
    for th in bg:
        th.start()

    def wait_bg() -> None:
        for th in bg:
            th.join()
        if envs_state and not envs_state.get("ok"):
            raise RuntimeError(f"building the {args.family} tasks failed: {envs_state.get('error')}")

    starts: list[float] = []
    steps_low: list[float] = []
    steps_high: list[float] = []

    warm_start = 1.15 * 30.0 + 3             # a later start on the same machine: 20-40 s expected

    def est_start() -> float:                # the first (cold) start compiles kernels: 55-180 s seen
        return 200.0 if not starts else (1.15 * max(starts[1:]) + 3 if starts[1:] else warm_start)

    def est_starts(k: int) -> float:
        if args.parallel_start:
            return est_start() if k else 0.0
        return k * est_start() if starts or k == 0 else 200.0 + (k - 1) * warm_start

    def est(steps: list[float], default: float) -> float:
        return 1.3 * max(steps) + 5 if steps else default

    def timeout() -> float:                 # an engine call never outlives the deadline by much
        return max(60.0, min(1800.0, clock.left() + 30))

    def server(extra: list[str], name: str, feed: Path | None = None, mem: float | None = None) -> SGLangServer:
        # the suffix server logs its host time per scheduler step every --timing-every steps (drafting vs
        # verify cost); with --time-ngram both it and the timed NGRAM also log their whole verify steps'
        # wall time by batch size (synchronized at each step's end, as the scheduler without overlap does
        # right after); --log-drafts: the suffix server also writes every draft (drafts_<name>.jsonl)
        timed = {TIMING_ENV: str(args.timing_every), **({STEP_WALL_ENV: "1"} if args.time_ngram else {})}
        drafts = {DRAFT_LOG_ENV: str(logs / f"drafts_{name}.jsonl")} if args.log_drafts else {}
        e = dict(env, **({CORPUS_ENV: str(feed), DRAFT_ENV: args.suffix_draft, **timed, **drafts}
                         if feed is not None else timed if TIMED_NGRAM_NAME in extra else {}))
        srv = SGLangServer(args.model_path, mem_fraction_static=mem or frac, extra_args=common + extra, env=e,
                           log_path=str(logs / f"{name}.log"),
                           startup_timeout=max(60.0, min(400.0, clock.left() - 20)))
        clock.phase("starting %s", name)
        try:
            srv.start()
        except Exception:
            clock.phase("%s failed to start; log tail:\n%s", name, srv.log_tail(40))
            raise
        starts.append(srv.startup_s)
        clock.phase("%s up in %.1f s", name, srv.startup_s)
        return srv

    def flush(servers) -> None:
        for s_ in servers:
            for attempt in range(5):
                try:
                    s_.engine(timeout=30).flush_cache()
                    break
                except Exception as e:                      # noqa: BLE001 - 400 while requests drain
                    if attempt == 4:
                        log.warning("flush_cache on %s failed: %s", s_.url, e)
                    time.sleep(1.0)

    def rep_seed(k: int) -> int:
        """The sampling seed of measured rep ``k`` (the same for every variant in a rep, so the reps pair):
        ``--rep-seeds new`` a new one per rep, as each RL step samples afresh; ``same``: the first RL
        step's, as runs 1-18 did. (Their reps did not repeat step 1's trajectories: the servers' sampled
        tokens do not follow the request seed; a rep's trajectory shares ~the prompt with step 1's, as
        with a sibling's.)"""
        return 1 if args.rep_seeds == "same" else 1001 + k

    def low(policy: str, srv: SGLangServer, feed: Path) -> None:
        """Step 1 (corpora, kernels), then the measured step 2 on one server."""
        conc = args.low_tasks * args.group
        need = 2 * est(steps_low, 45.0)
        if clock.left() < need:
            clock.phase("skip low %s: %.0f s left, ~%.0f s needed", policy, clock.left(), need)
            sink.add(dict(tag, load="low", policy=policy, concurrency=conc, skipped="deadline"))
            return
        flush([srv])
        r1 = _step([srv.engine(timeout=timeout())], None, args, conc, args.low_tasks, args.group,
                   feed=TrajectoryFeed(feed), strict=False)
        clock.phase("low %s step 1: %s", policy, r1)
        steps_low.append(r1["makespan_s"])
        r = _step([srv.engine(timeout=timeout())], None, args, conc, args.low_tasks, args.group,
                  feed=TrajectoryFeed(feed), strict=False, seed=rep_seed(0))
        steps_low.append(r["makespan_s"])
        try:
            acc = _sglang_accept(srv.url)
        except Exception as e:                              # noqa: BLE001
            acc = None
            log.warning("/server_info: %s", e)
        sink.add(dict(tag, load="low", concurrency=conc, policy=policy, algorithm=spec[policy][1] if spec[policy] else None,
                      accept_len=acc, device=dev,
                      **({"suffix_draft": args.suffix_draft} if policy == "suffix" else {}),
                      startup_s=round(srv.startup_s or 0, 1), step1=r1, **r))
        clock.phase("row low %s: %s", policy, sink.rows[-1])

    def low_alone(policy: str) -> None:
        need = est_start() + 2 * est(steps_low, 45.0)
        if clock.left() < need:
            clock.phase("skip low %s: %.0f s left, ~%.0f s needed", policy, clock.left(), need)
            sink.add(dict(tag, load="low", policy=policy, skipped="deadline"))
            return
        if policy == "ngram" and ngram_state and not ngram_state.get("ok"):
            clock.phase("skip low ngram: SGLang's C++ NgramCorpus did not build: %s", ngram_state.get("error"))
            sink.add(dict(tag, load="low", policy=policy, error="NgramCorpus JIT build failed: "
                                                                 + str(ngram_state.get("error"))[-300:]))
            return
        feed = logs / f"feed_{policy}.jsonl"
        srv = None
        try:
            srv = server(spec[policy], f"low_{policy}", feed if policy == "suffix" else None)
            if policy == "suffix" or len(starts) == 1:
                wait_bg()
            low(policy, srv, feed)
        except Exception as e:                              # noqa: BLE001 - the next phases still run
            log.exception("low %s failed", policy)
            sink.add(dict(tag, load="low", policy=policy, error=f"{type(e).__name__}: {str(e)[:1500]}"))
        finally:
            if srv is not None:
                srv.stop()

    def greedy_check(live: dict, n: int = 8, tokens: int = 96) -> dict:
        """Lossless speculation, token by token: the first turn of ``n`` low-load episodes decoded
        greedily (temperature 0) on every server; per variant, how many outputs equal the
        no-speculation server's and the first differing position of those that do not (bf16: a
        verify pass scores several tokens at once and can flip a near-tie, so a late difference
        is rounding, an early one a bug)."""
        from megatron_harts.rollout.envs import make_env
        from megatron_harts.rollout.tokenizer import BOS, ByteTokenizer
        from megatron_harts.rollout.types import SamplingParams

        tok = ByteTokenizer()
        prompts = []
        for t in range(n):
            env = make_env(args.family, t % max(1, args.low_tasks), seed=t)
            try:
                prompts.append([tok.token_id(BOS)] + tok.encode(env.prompt()))
            finally:
                env.close()
        sp = SamplingParams(max_new_tokens=tokens, temperature=0.0, stop_token_ids=[])
        outs = {v: [srv.engine(timeout=timeout()).generate(p_, sp).output_ids for p_ in prompts]
                for v, srv in live.items()}
        ref = outs.get("none")
        if ref is None:
            return {"skipped": "no 'none' server to compare with"}
        res = {}
        for v, o in outs.items():
            if v == "none":
                continue
            diffs = [next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None if len(a) == len(b)
                          else min(len(a), len(b))) for a, b in zip(o, ref)]
            res[v] = {"equal": sum(d is None for d in diffs), "of": len(diffs),
                      "first_diff": [d for d in diffs if d is not None]}
        return res

    def low_together() -> None:
        """``--low-reps``: every low-load variant's server started, overlapping but staggered (each
        ``--mem-fraction`` / number of variants; a start waits for the previous one's memory pools),
        one unmeasured step per server (corpora, kernels), then ``--low-reps`` measured steps per
        variant with the variants' order rotated every rep, one server stepping at a time; one row
        per variant: medians, spread and every rep; then the greedy losslessness check."""
        conc = args.low_tasks * args.group
        mem = round(args.mem_fraction / len(variants), 4)
        got: dict = {}
        done = {v: threading.Event() for v in variants}

        def pools_allocated(v: str) -> bool:
            try:
                return "Memory pool end" in (logs / f"low_{variant_slug(v)}.log").read_text(errors="replace")
            except OSError:
                return False

        def one(v: str) -> None:
            # staggered: SGLang sizes its pools from the memory free when *it* initialised, less what
            # was allocated since, so a server starting while another allocates its pools fails
            # (H200: "Not enough GPU memory for hybrid state cache", rest -0.21 GB at 3 x 0.15); each
            # start waits for the previous server's "Memory pool end" (then its init sees that memory)
            i = variants.index(v)
            if i:
                prev = variants[i - 1]
                t_w = time.monotonic()
                while not done[prev].is_set() and not pools_allocated(prev) and time.monotonic() - t_w < 400:
                    time.sleep(0.5)
            try:
                if variant_kind(v) == "ngram":
                    bg[-1].join()
                    if not ngram_state.get("ok"):
                        raise RuntimeError(f"NgramCorpus JIT build failed: {str(ngram_state.get('error'))[-300:]}")
                got[v] = server(spec[v], f"low_{variant_slug(v)}",
                                logs / f"feed_{variant_slug(v)}.jsonl" if variant_kind(v) == "suffix" else None,
                                mem=mem)
            except Exception as e:                          # noqa: BLE001 - recorded as the variant's row
                got[v] = e
            finally:
                done[v].set()
        ths = [threading.Thread(target=one, args=(v,), daemon=True) for v in variants]
        for th in ths:
            th.start()
        for th in ths:
            th.join()
        live = {v: got[v] for v in variants if isinstance(got.get(v), SGLangServer)}
        for v in variants:
            if not isinstance(got.get(v), SGLangServer):
                sink.add(dict(tag, load="low", policy=v, error=f"start: {type(got.get(v)).__name__}: "
                                                               f"{str(got.get(v))[:1000]}"))
        try:
            wait_bg()
            feeds = {v: TrajectoryFeed(logs / f"feed_{variant_slug(v)}.jsonl") for v in live}
            first = {}
            for v, srv in live.items():
                first[v] = _step([srv.engine(timeout=timeout())], None, args, conc, args.low_tasks, args.group,
                                 feed=feeds[v], strict=False)
                steps_low.append(first[v]["makespan_s"])
                clock.phase("low %s step 1: %s", v, first[v])
            reps: dict[str, list[dict]] = {v: [] for v in live}
            order = list(live)
            spies = _start_py_spy(args, live, logs)
            for k in range(args.low_reps):
                # a rep's cost from the measured reps once there are some (step 1 also warms kernels
                # and fills corpora: 2x longer, it would stop the reps early)
                seen = [r["makespan_s"] for rs in reps.values() for r in rs] or steps_low
                if clock.left() < len(order) * est(seen, 45.0) + 60:
                    clock.phase("deadline: %d measured reps instead of %d", k, args.low_reps)
                    break
                for v in order[k % len(order):] + order[:k % len(order)]:
                    r = _step([live[v].engine(timeout=timeout())], None, args, conc, args.low_tasks, args.group,
                              feed=feeds[v], strict=False, seed=rep_seed(k))
                    steps_low.append(r["makespan_s"])
                    reps[v].append(r)
                    clock.phase("low %s rep %d: %s", v, k, r)
            _stop_py_spy(spies)
            check = {}
            try:
                check = greedy_check(live)
                clock.phase("greedy check: %s", check)
            except Exception as e:                          # noqa: BLE001
                log.exception("greedy check failed")
                check = {"error": f"{type(e).__name__}: {str(e)[:300]}"}
            for v, rs in reps.items():
                if not rs:
                    sink.add(dict(tag, load="low", policy=v, skipped="deadline"))
                    continue
                med = lambda key: statistics.median(x[key] for x in rs if x.get(key) is not None) \
                    if any(x.get(key) is not None for x in rs) else None          # noqa: E731
                try:
                    acc = _sglang_accept(live[v].url)
                except Exception as e:                      # noqa: BLE001
                    acc = None
                    log.warning("/server_info: %s", e)
                sink.add(dict(tag, load="low", concurrency=conc, policy=variant_kind(v), variant=v,
                              algorithm=spec[v][1] if spec[v] else None,
                              budget=budget_of[v] if variant_kind(v) != "none" else None, accept_len=acc,
                              **({"suffix_draft": args.suffix_draft} if variant_kind(v) == "suffix" else {}),
                              device=dev + f", {len(live)} servers x mem {mem} started staggered, one stepping at a time",
                              startup_s=round(live[v].startup_s or 0, 1), step1=first[v], reps=len(rs),
                              tokens_per_s=round(med("tokens_per_s"), 1), makespan_s=round(med("makespan_s"), 2),
                              cache_hit=round(med("cache_hit"), 4),
                              spec_accept_len=None if med("spec_accept_len") is None else round(med("spec_accept_len"), 3),
                              spread={"tokens_per_s": [min(x["tokens_per_s"] for x in rs),
                                                       max(x["tokens_per_s"] for x in rs)],
                                      "makespan_s": [min(x["makespan_s"] for x in rs), max(x["makespan_s"] for x in rs)]},
                              rep_rows=rs, rep_seeds=args.rep_seeds,
                              greedy_check=check.get(v) if v != "none" else None,
                              draft_log=_draft_log_row(logs, v),
                              # the server's host-time / verify wall-time lines (every --timing-every steps)
                              server_timing=server_timing((logs / f"low_{variant_slug(v)}.log").read_text(
                                  errors="replace")) or None))
                clock.phase("row low %s: %s", v, {k_: sink.rows[-1].get(k_) for k_ in
                                                  ("tokens_per_s", "makespan_s", "spec_accept_len", "spread")})
        finally:
            for srv in live.values():
                srv.stop()

    beside: dict[str, SGLangServer] = {}

    def start_parallel(n_rep: int) -> list[SGLangServer]:
        """The ``n_rep`` replicas (and, with ``--ngram-beside``, the NGRAM low-load server) started
        at once: a start is mostly Python imports and kernel JIT on the host (~85 s each seen
        one after another); every server reserves its own ``--mem-fraction-static`` share."""
        jobs = [(list(rep_extra), f"rep{i}", None, None) for i in range(n_rep)]
        if args.ngram_beside and "ngram" in variants:
            jobs.append((spec["ngram"], "low_ngram", None, args.ngram_beside))
        got: list = [None] * len(jobs)

        def one(i: int) -> None:
            try:
                if jobs[i][1] == "low_ngram":
                    bg[-1].join()                 # SGLang's C++ NgramCorpus, built in the background
                    if not ngram_state.get("ok"):
                        raise RuntimeError(f"NgramCorpus JIT build failed: {str(ngram_state.get('error'))[-300:]}")
                got[i] = server(*jobs[i])
            except Exception as e:                          # noqa: BLE001
                got[i] = e
        ths = [threading.Thread(target=one, args=(i,), daemon=True) for i in range(len(jobs))]
        for th in ths:
            th.start()
        for th in ths:
            th.join()
        errs = [g for g in got if isinstance(g, Exception)]
        live = [g for g in got if isinstance(g, SGLangServer)]
        for (_, name, _, _), g in zip(jobs, got):
            if isinstance(g, Exception):
                log.warning("%s did not start: %s: %s", name, type(g).__name__, str(g)[:500])
        if errs and len([g for g in got[:n_rep] if isinstance(g, SGLangServer)]) < min(2, n_rep):
            for g in live:
                g.stop()
            raise errs[0]
        if len(jobs) > n_rep:
            if isinstance(got[-1], SGLangServer):
                beside["ngram"] = got[-1]
            else:
                sink.add(dict(tag, load="low", policy="ngram", error=f"start: {type(got[-1]).__name__}: "
                                                                         f"{str(got[-1])[:1000]}"))
            variants.remove("ngram")              # measured (or failed) here, not again at the end
        return [g for g in got[:n_rep] if isinstance(g, SGLangServer)]

    def high() -> None:
        conc = args.high_tasks * args.group
        after = (est(steps_high, 60.0) if policies else 0.0) + (2 * est(steps_low, 45.0) if "none" in variants else 0)
        n_rep = args.replicas if policies else 1   # fewer (down to 2) when the deadline cannot fit them all
        while n_rep > min(2, args.replicas) and clock.left() < est_starts(n_rep) + after:
            n_rep -= 1
        if clock.left() < est_starts(n_rep) + after:
            clock.phase("skip high load: %.0f s left, ~%.0f s needed", clock.left(), est_starts(n_rep) + after)
            for p in policies:
                sink.add(dict(tag, load="high", policy=p, concurrency=conc, skipped="deadline"))
            if "none" in variants:
                sink.add(dict(tag, load="low", policy="none", skipped="deadline"))
            return
        if n_rep < args.replicas:
            clock.phase("deadline: %d replicas instead of %d", n_rep, args.replicas)
        servers = []
        try:
            if args.parallel_start:
                servers = start_parallel(n_rep)
            else:
                for i in range(n_rep):
                    if i >= 2 and clock.left() < est_start() + after:     # the starts ran slower than expected
                        clock.phase("deadline: %d replicas instead of %d", i, args.replicas)
                        break
                    servers.append(server(list(rep_extra), f"rep{i}"))
            wait_bg()
            if "none" in variants:
                low("none", servers[0], logs / "feed_none.jsonl")
            if beside.get("ngram") is not None:       # NGRAM's low-load steps while the replicas are idle
                try:
                    low("ngram", beside["ngram"], logs / "feed_ngram.jsonl")
                except Exception as e:                      # noqa: BLE001
                    log.exception("low ngram failed")
                    sink.add(dict(tag, load="low", policy="ngram", error=f"{type(e).__name__}: {str(e)[:1500]}"))
                finally:
                    beside.pop("ngram").stop()
            # unmeasured: first requests of each replica (kernel autotuning, allocator growth)
            wt = min(args.high_tasks, 2 * len(servers))
            w = _step([s_.engine(timeout=timeout()) for s_ in servers], None, args, wt * args.group, wt, args.group,
                      strict=False, max_turns=2)
            clock.phase("warm-up on %d replicas: %s", len(servers), w)
            flush(servers)
            for policy in policies:
                need = est(steps_high, 60.0)
                if clock.left() < need:
                    clock.phase("skip %s: %.0f s left, ~%.0f s needed", policy, clock.left(), need)
                    sink.add(dict(tag, load="high", policy=policy, concurrency=conc, skipped="deadline"))
                    continue
                clock.phase("high %s", policy)
                try:
                    extra = {}
                    if policy in ("round_robin", "cache_aware", "power_of_two"):
                        with RouterServer([s_.url for s_ in servers], policy,
                                          log_path=str(logs / f"router_{policy}.log")) as rt:
                            r = _step([rt.engine(timeout=timeout())], None, args, conc, args.high_tasks, args.group,
                                      strict=False)
                    elif policy == "sticky":
                        r = _step([s_.engine(timeout=timeout()) for s_ in servers], None, args, conc, args.high_tasks,
                                  args.group, strict=False)
                    elif policy == "sticky_prio":
                        r = _step(with_progress_priority([s_.engine(timeout=timeout()) for s_ in servers]), None,
                                  args, conc, args.high_tasks, args.group, strict=False)
                        extra["engine_priority"] = "progress (turns done)"
                    else:
                        # the gate is a per-replica share of the admitted turns: with fewer replicas than
                        # asked for (deadline) each admits proportionally more; war_open: no gate at all
                        gate = 0 if policy == "war_open" else -(-args.max_running * args.replicas // len(servers))
                        extra["max_running"] = gate
                        sch = WarScheduler(len(servers), SchedulerConfig(max_running=gate,
                                                                         expected_decode=args.max_new_tokens,
                                                                         load_weight=args.load_weight,
                                                                         cache_tokens=args.cache_tokens,
                                                                         hybrid_cache=args.hybrid_cache))
                        r = _step(sch.wrap([s_.engine(timeout=timeout()) for s_ in servers]), sch, args, conc,
                                  args.high_tasks, args.group, strict=False)
                        extra["modelled_cache_hit"] = round(sch.cache_hit(), 4)
                        extra["moves"] = sch.stats["moves"]      # turns placed off their trajectory's replica
                        extra["hybrid_cache"] = args.hybrid_cache
                    steps_high.append(r["makespan_s"])
                    sink.add(dict(tag, load="high", concurrency=conc, policy=policy, accept_len=None,
                                  device=dev + f", {len(servers)} replicas x mem {frac}", **r, **extra))
                    clock.phase("row high %s: %s", policy, sink.rows[-1])
                except Exception as e:                      # noqa: BLE001
                    log.exception("high %s failed", policy)
                    sink.add(dict(tag, load="high", policy=policy, concurrency=conc,
                                  error=f"{type(e).__name__}: {str(e)[:1500]}"))
                    if not all(s_.alive() for s_ in servers):
                        clock.phase("a replica died: the remaining policies are skipped")
                        return
                flush(servers)
        except Exception as e:                              # noqa: BLE001
            log.exception("high load failed")
            sink.add(dict(tag, load="high", error=f"{type(e).__name__}: {str(e)[:1500]}",
                          replicas_started=len(servers)))
        finally:
            for s_ in servers:
                s_.stop()

    # a hard stop a little after the deadline: kill the servers so a running step fails fast
    if clock.deadline != float("inf"):
        def watchdog():
            while clock.left() > -args.deadline_grace_s:
                time.sleep(1.0)
            log.error("deadline + %g s passed: killing the servers", args.deadline_grace_s)
            _kill_live_servers()
        threading.Thread(target=watchdog, daemon=True).start()

    if args.low_reps:
        if policies:
            fail("--low-reps measures the low-load variants alone: give --policies '' (no high-load step)")
        low_together()
        variants = []
    if "suffix" in variants:
        low_alone("suffix")
    if policies or "none" in variants:
        high()
    if "ngram" in variants:
        low_alone("ngram")
    clock.phase("h200 done: %d rows", sum(1 for r in sink.rows if r.get("part") == "h200"))


def _draft_log_row(logs: Path, variant: str) -> dict | None:
    """``--log-drafts``: the suffix server's drafts checked against its trajectories (the feed), all
    steps of the run (``replay.draft_log_acceptance``); ``None`` without a log."""
    from megatron_harts.rollout.war.replay import draft_log_acceptance

    slug = variant_slug(variant)
    path, feed = logs / f"drafts_low_{slug}.jsonl", logs / f"feed_{slug}.jsonl"
    if not path.is_file() or not feed.is_file():
        return None
    try:
        return draft_log_acceptance(str(path), str(feed))
    except (OSError, ValueError, KeyError) as e:
        log.warning("draft log of %s: %s", variant, e)
        return {"error": f"{type(e).__name__}: {str(e)[:300]}"}


def _start_py_spy(args, live: dict, logs: Path) -> list[subprocess.Popen]:
    """``--py-spy``: sample every live low-load server (its process and children: the scheduler)
    for ``--py-spy-s`` seconds from the first measured rep, ``--nonblocking`` (no pauses) at
    ``--py-spy-rate`` Hz, as collapsed stacks (``--format raw``, idle threads left out) into
    ``py_spy_<variant>.txt`` beside the server logs; the servers step one at a time, so each
    file holds its own server's steps. A py-spy that cannot attach (no ptrace) logs and is
    skipped: the rows do not depend on it."""
    out = []
    if not args.py_spy:
        return out
    for v, srv in live.items():
        proc = getattr(srv, "proc", None)
        if proc is None:
            continue
        dst = logs / f"py_spy_{variant_slug(v)}.txt"
        cmd = [args.py_spy, "record", "--nonblocking", "--subprocesses", "--threads", "-r", str(args.py_spy_rate),
               "-d", str(int(args.py_spy_s)), "--format", "raw", "-o", str(dst), "-p", str(proc.pid)]
        try:
            out.append(subprocess.Popen(cmd, stdout=open(logs / f"py_spy_{variant_slug(v)}.log", "w"),
                                        stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL))
            log.info("py-spy on %s (pid %d) for %d s: %s", v, proc.pid, int(args.py_spy_s), dst)
        except OSError as e:
            log.warning("py-spy not started on %s: %s", v, e)
    return out


def _stop_py_spy(spies: list[subprocess.Popen]) -> None:
    """Wait briefly for the samplers to write their files (SIGINT makes py-spy write early)."""
    for sp in spies:
        if sp.poll() is None:
            sp.send_signal(signal.SIGINT)
    for sp in spies:
        try:
            sp.wait(timeout=20)
        except subprocess.TimeoutExpired:
            sp.kill()


def _pack_server_logs(folder: Path) -> None:
    """``folder`` (server logs, feeds, the plugin's install) as ``folder.tgz``, then removed: the lent
    GPU returns at most 8 files per call, and run 4's suffix server log was left out that way."""
    import tarfile

    if not folder.is_dir():
        return
    with tarfile.open(folder.with_suffix(".tgz"), "w:gz") as tar:
        tar.add(folder, arcname=folder.name)
    shutil.rmtree(folder)
    log.info("server logs packed into %s", folder.with_suffix(".tgz"))


class _Sink:
    """The rows of this run (plus the kept ones of ``--merge``), rewritten to ``out`` (atomically)
    after each h200 row, with ``"partial": true`` until the run ends."""

    def __init__(self, out: Path, rows: list[dict], command: str):
        self.out, self.rows, self.command = out, list(rows), command

    def add(self, row: dict) -> None:
        self.rows.append(row)
        self.save(partial=True)

    def save(self, partial: bool = False) -> None:
        self.out.parent.mkdir(parents=True, exist_ok=True)
        d = {"command": self.command, "rows": self.rows}
        if partial:
            d["partial"] = True
        tmp = self.out.with_name(self.out.name + ".tmp")
        tmp.write_text(json.dumps(d, indent=1) + "\n")
        os.replace(tmp, self.out)


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    dr = [r for r in rows if r.get("part") == "drafters"]
    ds = [r for r in rows if r.get("part") == "drafters_sampled"]
    cpu = [r for r in rows if r.get("part") == "cpu"]
    hw = [r for r in rows if r.get("part") == "h200" and r.get("tokens_per_s")]
    n_ax = 3 + bool(ds) + bool(hw)
    fig, axes = plt.subplots(1, n_ax, figsize=(5 * n_ax, 4.2))
    budgets = sorted({r["budget"] for r in dr})
    methods = list(dict.fromkeys(r["method"] for r in dr))
    w = 0.8 / max(len(methods), 1)
    for j, m in enumerate(methods):
        acc = [next((r["accept_len"] for r in dr if r["method"] == m and r["budget"] == b), 0) for b in budgets]
        lat = [next((r["draft_us_median"] for r in dr if r["method"] == m and r["budget"] == b), 0) for b in budgets]
        xs = [i + j * w for i in range(len(budgets))]
        axes[0].bar(xs, acc, w, label=m)
        axes[1].bar(xs, lat, w, label=m)
    for ax, t in ((axes[0], "tokens per verification step (accept length)"),
                  (axes[1], "drafter latency per call, median (us, shared CPU)")):
        ax.set_xticks([i + 0.4 - w / 2 for i in range(len(budgets))], [f"budget {b}" for b in budgets])
        ax.set_title(t, fontsize=10)
    axes[0].legend(fontsize=7)
    axes[0].set_xlabel("offline replay, code_repair streams (CPU)")
    if ds:
        b_s = sorted({r["budget"] for r in ds})
        m_s = list(dict.fromkeys(r["method"] for r in ds))
        ws = 0.8 / max(len(m_s), 1)
        for j, m in enumerate(m_s):
            acc = [next((r["accept_len"] for r in ds if r["method"] == m and r["budget"] == b), 0) for b in b_s]
            axes[3].bar([i + j * ws for i in range(len(b_s))], acc, ws, label=m)
        axes[3].set_xticks([i + 0.4 - ws / 2 for i in range(len(b_s))], [f"budget {b}" for b in b_s])
        axes[3].set_title("accept length, episodes sampled from the trained text model", fontsize=10)
        axes[3].legend(fontsize=7, loc="lower right")
    if cpu:
        labels = [f"{r['load']}\n{r['policy']}" for r in cpu]
        axes[2].bar(range(len(cpu)), [r["tokens_per_s"] for r in cpu], color=["C0" if r["load"] == "low" else "C1"
                                                                               for r in cpu])
        axes[2].set_xticks(range(len(cpu)), labels, fontsize=7)
        axes[2].set_title("CPU rollout step: generated tokens/s (embedded engine, random model)", fontsize=9)
    if hw:
        ax = axes[-1]
        labels = [f"{r['load']} {r.get('variant', r['policy'])}\nrun {r.get('run', '1')}" for r in hw]
        ax.bar(range(len(hw)), [r["tokens_per_s"] for r in hw],
               color=["C0" if r["load"] == "low" else "C1" for r in hw])
        ax.set_xticks(range(len(hw)), labels, fontsize=6, rotation=60)
        gpus = sorted({str(r.get("device", "?")).split(",")[0].replace("NVIDIA ", "").split(" ")[0] for r in hw})
        ax.set_title(f"{' / '.join(gpus)} rollout step: tokens/s (SGLang)", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def tables(rows: list[dict]) -> tuple[str, str]:
    """Markdown tables of the drafter rows and of the rollout rows."""
    dr = ["| streams | budget | method | tokens / verification | accepted / step | verify steps | draft us (median / mean / p99) "
          "| indexing s | accept len by RL step |", "|---|---|---|---|---|---|---|---|---|"]
    for r in (r for r in rows if r.get("part") in ("drafters", "drafters_sampled")):
        kind = "sampled" if r["part"] == "drafters_sampled" else "scripted"
        dr.append(f"| {kind} | {r['budget']} | {r['method']} | {r['accept_len']:.2f} | {r['accepted_per_step']:.2f} | "
                  f"{r['verify_steps']} | {r.get('draft_us_median', float('nan')):.0f} / {r['draft_us_mean']:.0f} / "
                  f"{r['draft_us_p99']:.0f} | {r['index_s']:.1f} | "
                  + ", ".join(f"{v:.2f}" for v in r["accept_len_by_step"].values()) + " |")
    ro = ["| part | run | load | concurrency | policy | tokens/s | makespan s | cache hit | accept len | device |",
          "|---|---|---|---|---|---|---|---|---|---|"]
    for r in (r for r in rows if r.get("part") in ("cpu", "h200")):
        acc = r.get("accept_len")
        if r.get("spec_accept_len") is not None:       # h200: this step's, then SGLang's lifetime figure
            acc = f"{r['spec_accept_len']} (server {acc})"
        note = r.get("skipped") and f"skipped: {r['skipped']}" or r.get("error") and f"error: {r['error'][:120]}"
        if r.get("failed"):
            note = f"{r['failed']} episodes failed"
        dev = r.get("device", "") + (f"; {note}" if note else "")
        run = r.get("run", "1" if r["part"] == "h200" else "-")
        ro.append(f"| {r['part']} | {run} | {r.get('load')} | {r.get('concurrency')} | {r.get('variant', r.get('policy'))} | "
                  f"{r.get('tokens_per_s')} | {r.get('makespan_s')} | {r.get('cache_hit')} | {acc} | {dev} |")
    return "\n".join(dr), "\n".join(ro)


def write_md(rows: list[dict], path: Path, command: str) -> None:
    dr, ro = tables(rows)
    path.write_text(
        "# WAR benchmark\n\nWritten by `scripts/bench_war.py` (see docs/war.md for what the rows mean and for the "
        "H200 runs' conditions).\n\n```\n" + command + "\n```\n\n"
        "## Drafters, offline replay (CPU, 2 shared cores; latencies noisy)\n\n" + dr +
        "\n\n## Rollout steps\n\n" + ro + "\n\n![war](war.png)\n")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--parts", default="drafters,cpu", help="comma list of drafters, drafters_sampled, cpu, h200")
    p.add_argument("--out", default=str(ROOT / "docs" / "benchmarks" / "war.json"))
    p.add_argument("--tasks", type=int, default=6, help="drafters: code_repair tasks")
    p.add_argument("--samples", type=int, default=4, help="drafters: samples per task and step")
    p.add_argument("--steps", type=int, default=3, help="drafters: RL steps replayed")
    p.add_argument("--depth", type=int, default=64, help="drafters: suffix tree depth (ours, arctic)")
    p.add_argument("--budgets", default="8,16", help="draft tokens per verification step")
    p.add_argument("--family", default="lookup")
    p.add_argument("--group", type=int, default=2)
    p.add_argument("--low-tasks", type=int, default=2)
    p.add_argument("--low-concurrency", type=int, default=4)
    p.add_argument("--high-tasks", type=int, default=6)
    p.add_argument("--replicas", type=int, default=2)
    p.add_argument("--policies", default="war,sticky,round_robin,cache_aware,power_of_two")
    p.add_argument("--max-new-tokens", type=int, default=24)
    p.add_argument("--max-turns", type=int, default=3)
    p.add_argument("--hidden", type=int, default=64)
    p.add_argument("--repeats", type=int, default=3, help="cpu: interleaved repeats of the high-load policies")
    p.add_argument("--merge", action="store_true", help="keep rows of parts not rerun from --out")
    p.add_argument("--force-calls", type=int, default=1, help="1: run call-less turns as `ls` (random models)")
    p.add_argument("--model-path", default=None, help="h200, drafters_sampled: the served checkpoint")
    p.add_argument("--sampled-max-new-tokens", type=int, default=256, help="drafters_sampled: tokens per turn")
    p.add_argument("--sampled-max-turns", type=int, default=6, help="drafters_sampled: model turns per episode")
    p.add_argument("--save-streams", default=None, help="drafters_sampled: write the sampled streams (JSONL)")
    p.add_argument("--load-streams", default=None, help="drafters_sampled: replay streams saved by --save-streams")
    p.add_argument("--mem-fraction", type=float, default=0.85, help="h200: GPU memory split over the replicas")
    p.add_argument("--deepen", type=int, default=1,
                   help="h200: serve the model with this many times its layers, the appended ones adding zero "
                        "(same outputs, decode cost of a deeper model; megatron_harts.rollout.deepen)")
    p.add_argument("--sglang-args", default="", help="h200: extra launch_server flags")
    p.add_argument("--max-running", type=int, default=0, help="WAR admission gate per replica (0: off)")
    p.add_argument("--load-weight", type=float, default=1.0, help="WAR cost of a queued token")
    p.add_argument("--cache-tokens", type=int, default=400_000, help="WAR prefix model capacity per replica")
    p.add_argument("--hybrid-cache", action="store_true",
                   help="h200: WAR's prefix model credits only whole earlier sequences (SGLang's cache on a "
                        "Mamba / GDN hybrid keeps a state per cached request, not per token)")
    p.add_argument("--suffix-draft", default="tree", choices=("tree", "chain"),
                   help="h200: the HARTS_SUFFIX server's draft shape ($HARTS_SUFFIX_DRAFT; run 1 of 2026-12-03 "
                        "drafted chains)")
    p.add_argument("--parallel-start", action="store_true",
                   help="h200: start the high-load replicas at once (default: one after another). SGLang 0.5.17 sizes "
                        "a hybrid model's state pool from the memory free when it starts, so servers allocating "
                        "together undercount each other (2 of 4 failed on the H200); the run goes on with those up")
    p.add_argument("--ngram-beside", type=float, default=0.0,
                   help="h200 with --parallel-start: start the NGRAM low-load server with this memory fraction "
                        "beside the replicas and run its low-load steps before the high-load policies (0: after)")
    p.add_argument("--low-variants", default="suffix,ngram,none",
                   help="h200 low load: speculation variants (suffix = HARTS_SUFFIX, ngram = SGLang NGRAM, none); with "
                        "--low-reps, kind@N gives a variant its own draft budget N (e.g. suffix@8,ngram@8,suffix,ngram,none)")
    p.add_argument("--low-reps", type=int, default=0,
                   help="h200, low load only (--policies ''): start the --low-variants servers together and measure "
                        "this many steps per variant, alternated, plus a greedy losslessness check (0: the older "
                        "one-server-at-a-time order)")
    p.add_argument("--cuda-graph", action="store_true",
                   help="h200: keep SGLang's CUDA graphs (default: --disable-cuda-graph, as the H200 RL runs)")
    p.add_argument("--cuda-graph-max-bs", type=int, default=128, help="h200 with --cuda-graph: largest captured batch")
    p.add_argument("--deadline-s", type=float, default=0.0,
                   help="h200: wall seconds from the start for the whole run (0: none); phases that would not fit "
                        "are skipped (rows say so), replicas reduced down to 2")
    p.add_argument("--add-rows", default=None,
                   help="add the h200 rows of another run's JSON to --out (tagged with --run-tag) and rewrite md/png")
    p.add_argument("--run-tag", default="2", help="with --add-rows: the added rows' 'run' field")
    p.add_argument("--time-ngram", action="store_true",
                   help="h200: run NGRAM as HARTS_NGRAM_TIMED (SGLang's NGRAM worker and C++ corpus, its host time "
                        "per scheduler step logged every 500 steps like HARTS_SUFFIX's); both speculating servers "
                        "then also log their verify steps' wall time by batch size ($HARTS_SPEC_STEP_WALL=1)")
    p.add_argument("--rep-seeds", choices=("new", "same"), default="new",
                   help="h200 low load: a new sampling seed per measured rep (as RL steps; default), or the first "
                        "step's seed every rep (runs 1-18)")
    p.add_argument("--timing-every", type=int, default=100,
                   help="h200: scheduler steps between the servers' host-time / verify-step timing lines")
    p.add_argument("--log-drafts", action="store_true",
                   help="h200 low load: the suffix server logs every draft (a JSON line per draft: host time, so "
                        "not for the timing comparison); each row gets draft_log, the drafts checked against the "
                        "trajectories it generated (replay.draft_log_acceptance)")
    p.add_argument("--py-spy", default=None, metavar="BIN",
                   help="h200 low load (--low-reps): a py-spy binary sampling each server from the first rep")
    p.add_argument("--py-spy-s", type=float, default=60.0, help="with --py-spy: seconds sampled")
    p.add_argument("--py-spy-rate", type=int, default=250, help="with --py-spy: samples per second")
    p.add_argument("--deadline-grace-s", type=float, default=20.0,
                   help="h200: past the deadline by this much, the servers are killed (a running step then fails)")
    args = p.parse_args(argv)
    args.t0 = time.monotonic()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    try:
        args.budgets = [int(b) for b in args.budgets.split(",")]
    except ValueError:
        fail(f"--budgets must be comma-separated integers, got {args.budgets!r}")
    if any(b < 1 for b in args.budgets):
        fail("--budgets must be >= 1")
    if args.low_reps < 0:
        fail(f"--low-reps must be >= 0, got {args.low_reps}")
    if args.timing_every < 1:
        fail(f"--timing-every must be >= 1 (scheduler steps), got {args.timing_every}")
    variants = [v for v in args.low_variants.split(",") if v]
    for v in variants:
        try:
            variant_budget(v, args.budgets[0])
        except ValueError as e:
            fail(f"--low-variants: {e}")
    if len(set(variants)) != len(variants):
        fail(f"--low-variants: a variant named twice in {args.low_variants!r}")
    if any("@" in v for v in variants) and not args.low_reps:
        fail("--low-variants: kind@budget variants need --low-reps (their servers are measured side by side)")
    args.policies = [x for x in args.policies.split(",") if x]
    bad = [x for x in args.policies if x not in HIGH_POLICIES]
    if bad:
        fail(f"--policies: unknown policy {bad[0]!r} ({', '.join(HIGH_POLICIES)})")
    parts = [x for x in args.parts.split(",") if x]
    for x in parts:
        if x not in ("drafters", "drafters_sampled", "cpu", "h200"):
            fail(f"--parts: unknown part {x!r} (drafters, drafters_sampled, cpu, h200)")
    out = Path(args.out)
    rows = []
    command = "python scripts/bench_war.py " + " ".join(argv or sys.argv[1:])
    if args.merge and out.is_file():
        old = json.loads(out.read_text())
        rows = [r for r in old["rows"] if r.get("part") not in parts]
        if old.get("command"):
            command = old["command"] + "; then " + command
    sink = _Sink(out, rows, command)
    if args.add_rows:                        # another run's h200 rows beside these (its own command kept)
        if not out.is_file():
            fail(f"--add-rows needs an existing --out to add to: {out} does not exist")
        try:
            extra = json.loads(Path(args.add_rows).read_text())
            new = [dict(r, run=args.run_tag) for r in extra["rows"] if r.get("part") == "h200"]
        except (OSError, ValueError, KeyError, TypeError) as e:
            fail(f"{args.add_rows}: not a bench_war JSON with a 'rows' list ({type(e).__name__}: {e})")
        old = json.loads(out.read_text())
        sink.rows = [r for r in old["rows"] if not (r.get("part") == "h200" and r.get("run") == args.run_tag)] + new
        sep = f"; then (run {args.run_tag}) "
        sink.command = command = (old.get("command", "").split(sep)[0] + sep + extra.get("command", "?")).lstrip("; ")
        parts = []

    def on_term(signum, frame):             # a timeout's SIGTERM: keep the rows, free the GPU
        log.error("signal %d: stopping the servers, keeping %d rows", signum, len(sink.rows))
        _kill_live_servers()
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, on_term)
    rc = 0
    try:
        if "drafters" in parts:
            sink.rows += part_drafters(args)
        if "drafters_sampled" in parts:
            sink.rows += part_drafters_sampled(args)
        if "cpu" in parts:
            sink.rows += part_cpu(args)
        if "h200" in parts:
            try:
                part_h200(args, sink)
            finally:
                _pack_server_logs(Path(args.out).resolve().parent / "war_h200")
    except KeyboardInterrupt:
        rc = 130
    sink.save(partial=rc != 0)
    write_md(sink.rows, out.with_suffix(".md"), command)
    try:
        plot(sink.rows, out.with_suffix(".png"))
    except Exception as e:                  # noqa: BLE001 - e.g. no matplotlib on the GPU machine
        log.warning("no plot: %s: %s", type(e).__name__, e)
    log.info("wrote %s and %s", out, out.with_suffix(".md"))
    return rc


if __name__ == "__main__":
    sys.exit(main())
