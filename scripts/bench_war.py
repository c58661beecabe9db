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
  0.3.2 round_robin / cache_aware / power_of_two). The embedded engine has no prefix cache and
  runs one request at a time, and a random model's outputs are not text (turns without a tool
  call are run as ``ls``: :class:`ForcedCall`): these rows check the mechanics and the overheads,
  not the GPU claims.
* ``h200``: the same step on SGLang 0.5.17 replicas sharing one GPU (``--mem-fraction-static``
  split): low load (<= 8 concurrent trajectories) none / NGRAM / HARTS_SUFFIX speculation, high
  load (>= 256) WAR vs round_robin vs cache_aware vs sticky; cache hits from SGLang's
  ``cached_tokens``. NOT RUN YET; the command is in docs/war.md.

Rows ``{part, load, concurrency, policy, tokens_per_s, makespan_s, cache_hit, accept_len, device}``
go to ``--out`` (default docs/benchmarks/war.json), the plot next to it.
"""
from __future__ import annotations

import argparse
import gzip
import json
import logging
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

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

    from megatron_harts.rollout.war.replay import Stream

    t0 = time.perf_counter()
    if args.load_streams:                      # the streams of an earlier run (--save-streams)
        try:
            streams = [Stream(d["tokens"], d["loss_mask"], d["group"], int(d["step"]), d["traj_id"])
                       for d in map(json.loads, (gzip.open(args.load_streams, "rt") if args.load_streams.endswith(".gz")
                                                 else open(args.load_streams)))]
        except (OSError, ValueError, KeyError, TypeError) as e:
            fail(f"--load-streams {args.load_streams}: {type(e).__name__}: {e}")
    else:
        if not args.model_path or not (Path(args.model_path) / "config.json").is_file():
            fail(f"--parts drafters_sampled needs --model-path to a checkpoint with config.json (or --load-streams), "
                 f"got {args.model_path!r}")
        tmp = Path(tempfile.mkdtemp(prefix="bench_war_sampled_"))
        with EmbeddedServer(args.model_path, threads=2, log_path=str(tmp / "engine.log")) as srv:
            streams = sampled_streams(srv.engine(timeout=600), "code_repair", args.tasks, args.samples, args.steps,
                                      max_new_tokens=args.sampled_max_new_tokens, max_turns=args.sampled_max_turns)
    log.info("%d sampled streams in %.1f s", len(streams), time.perf_counter() - t0)
    if args.save_streams:
        with open(args.save_streams, "w") as f:
            for st in streams:
                f.write(json.dumps({"traj_id": st.traj_id, "group": st.group, "step": st.step, "tokens": st.tokens,
                                    "loss_mask": st.loss_mask}) + "\n")
    src = args.load_streams or args.model_path
    rows = _replay_rows(args, streams, "drafters_sampled", f"code_repair sampled from {src}")
    return rows


# --------------------------------------------------------------------------------- rollouts
class Counting:
    """Counts prompt / cached tokens of the turns an engine serves (the agent loop's Turn does not
    keep ``cached_tokens``)."""

    def __init__(self, engine):
        self.engine, self.name = engine, engine.name
        self.prompt = self.cached = 0

    def __getattr__(self, k):
        return getattr(self.engine, k)

    def generate(self, input_ids, sampling, rid=None):
        g = self.engine.generate(input_ids, sampling, rid=rid)
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


def _step(engines, pick, args, concurrency: int, n_tasks: int, group: int, feed=None) -> dict:
    from megatron_harts.rollout.agent_loop import AgentLoop, RolloutConfig, sticky_least_loaded
    from megatron_harts.rollout.envs import make_env
    from megatron_harts.rollout.tokenizer import ByteTokenizer

    cfg = RolloutConfig(group_size=group, max_new_tokens=args.max_new_tokens, max_turns=args.max_turns,
                        temperature=1.0, max_concurrency=concurrency, seed=1)
    counted = [Counting(e) for e in engines]
    wrap = ForcedCall if args.force_calls else (lambda e: e)
    loop = AgentLoop(counted, ByteTokenizer(), lambda t: wrap(make_env(args.family, int(t), seed=0)), cfg,
                     pick_engine=pick or sticky_least_loaded)
    t0 = time.perf_counter()
    res = loop.rollout(list(range(n_tasks)))
    wall = time.perf_counter() - t0
    if res.failed:
        fail(f"{len(res.failed)} episodes failed: {res.failed[:2]}")
    if feed is not None:                      # completed trajectories -> the speculation corpus
        feed.add_trajectories(res.trajectories)
    prompt = sum(c.prompt for c in counted)
    return {"tokens_per_s": round(res.stats["generated_tokens"] / wall, 1), "makespan_s": round(wall, 2),
            "generated_tokens": res.stats["generated_tokens"], "trajectories": res.stats["trajectories"],
            "turns": res.stats["turns"], "cache_hit": round(sum(c.cached for c in counted) / max(prompt, 1), 4)}


def _spec_stats(url: str) -> dict | None:
    import urllib.request

    with urllib.request.urlopen(url + "/server_info", timeout=30) as r:
        return json.loads(r.read()).get("speculative")


def part_cpu(args) -> list[dict]:
    from megatron_harts.rollout.engines import EmbeddedServer
    from megatron_harts.rollout.war.router import RouterServer
    from megatron_harts.rollout.war.scheduler import SchedulerConfig, WarScheduler

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
    servers = [EmbeddedServer(str(model), threads=1, log_path=str(tmp / f"rep{i}.log")).start()
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
    import urllib.request

    with urllib.request.urlopen(url + "/server_info", timeout=30) as r:
        info = json.loads(r.read())
    states = info.get("internal_states") or [{}]
    return states[0].get("avg_spec_accept_length")


def part_h200(args) -> list[dict]:
    """SGLang 0.5.17 on the GPU (NOT RUN YET: see docs/war.md for the command)."""
    from megatron_harts.rollout.engines import SGLangServer
    from megatron_harts.rollout.war.router import RouterServer
    from megatron_harts.rollout.war.scheduler import SchedulerConfig, WarScheduler
    from megatron_harts.rollout.war.sglang_plugin import CORPUS_ENV, TrajectoryFeed, write_plugin_dist

    if not args.model_path or not Path(args.model_path, "config.json").is_file():
        fail("--model-path must be a Hugging Face checkpoint directory for the h200 part")
    tmp = Path(tempfile.mkdtemp(prefix="bench_war_h200_"))
    site = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    env = {"PYTHONPATH": os.pathsep.join([str(write_plugin_dist(tmp / "plugin")), str(ROOT), *site])}
    dev = "H200, SGLang 0.5.17"
    b = args.budgets[0]
    common = ["--disable-overlap-schedule"] + args.sglang_args.split()
    rows = []
    # low load: one replica; speculation none / NGRAM / HARTS_SUFFIX; step 1 warms the corpora, step 2 counts
    variants = {"none": [], "ngram": ["--speculative-algorithm", "NGRAM", "--speculative-num-draft-tokens", str(b + 1)],
                "suffix": ["--speculative-algorithm", "HARTS_SUFFIX", "--speculative-num-draft-tokens", str(b + 1)]}
    for policy, extra in variants.items():
        feed = tmp / f"feed_{policy}.jsonl"
        with SGLangServer(args.model_path, mem_fraction_static=args.mem_fraction, extra_args=common + extra,
                          env=dict(env, **{CORPUS_ENV: str(feed)}), log_path=str(tmp / f"low_{policy}.log")) as srv:
            for step in range(2):
                r = _step([srv.engine(timeout=1800)], None, args, args.low_tasks * args.group, args.low_tasks,
                          args.group, feed=TrajectoryFeed(feed))
            rows.append(dict(part="h200", load="low", concurrency=args.low_tasks * args.group, policy=policy,
                             accept_len=_sglang_accept(srv.url), device=dev, **r))
            log.info("%s", rows[-1])
    # high load: --replicas replicas sharing the GPU
    frac = args.mem_fraction / args.replicas
    servers = [SGLangServer(args.model_path, mem_fraction_static=round(frac, 3), extra_args=common, env=env,
                            log_path=str(tmp / f"rep{i}.log")).start() for i in range(args.replicas)]
    try:
        conc = args.high_tasks * args.group
        for policy in args.policies:
            if policy in ("round_robin", "cache_aware", "power_of_two"):
                with RouterServer([s.url for s in servers], policy, log_path=str(tmp / f"router_{policy}.log")) as rt:
                    r = _step([rt.engine(timeout=1800)], None, args, conc, args.high_tasks, args.group)
            elif policy == "sticky":
                r = _step([s.engine(timeout=1800) for s in servers], None, args, conc, args.high_tasks, args.group)
            else:
                sch = WarScheduler(len(servers), SchedulerConfig(max_running=args.max_running,
                                                                 expected_decode=args.max_new_tokens,
                                                                 load_weight=args.load_weight,
                                                                 cache_tokens=args.cache_tokens))
                r = _step(sch.wrap([s.engine(timeout=1800) for s in servers]), sch, args, conc, args.high_tasks,
                          args.group)
            for s in servers:
                s.engine().flush_cache()
            rows.append(dict(part="h200", load="high", concurrency=conc, policy=policy, accept_len=None,
                             device=dev + f", {len(servers)} replicas x mem {frac:.3f}", **r))
            log.info("%s", rows[-1])
    finally:
        for s in servers:
            s.stop()
    return rows


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    dr = [r for r in rows if r.get("part") == "drafters"]
    ds = [r for r in rows if r.get("part") == "drafters_sampled"]
    cpu = [r for r in rows if r.get("part") == "cpu"]
    fig, axes = plt.subplots(1, 4 if ds else 3, figsize=(20 if ds else 15, 4.2))
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
    ro = ["| part | load | concurrency | policy | tokens/s | makespan s | cache hit | accept len | device |",
          "|---|---|---|---|---|---|---|---|---|"]
    for r in (r for r in rows if r.get("part") in ("cpu", "h200")):
        ro.append(f"| {r['part']} | {r['load']} | {r['concurrency']} | {r['policy']} | {r['tokens_per_s']} | "
                  f"{r['makespan_s']} | {r['cache_hit']} | {r['accept_len']} | {r['device']} |")
    return "\n".join(dr), "\n".join(ro)


def write_md(rows: list[dict], path: Path, command: str) -> None:
    dr, ro = tables(rows)
    path.write_text(
        "# WAR benchmark\n\nWritten by `scripts/bench_war.py` (see docs/war.md for what the rows mean; the H200 part "
        "is not run yet).\n\n```\n" + command + "\n```\n\n"
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
    p.add_argument("--sglang-args", default="", help="h200: extra launch_server flags")
    p.add_argument("--max-running", type=int, default=0, help="WAR admission gate per replica (0: off)")
    p.add_argument("--load-weight", type=float, default=1.0, help="WAR cost of a queued token")
    p.add_argument("--cache-tokens", type=int, default=400_000, help="WAR prefix model capacity per replica")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    try:
        args.budgets = [int(b) for b in args.budgets.split(",")]
    except ValueError:
        fail(f"--budgets must be comma-separated integers, got {args.budgets!r}")
    if any(b < 1 for b in args.budgets):
        fail("--budgets must be >= 1")
    args.policies = [x for x in args.policies.split(",") if x]
    parts = [x for x in args.parts.split(",") if x]
    for x in parts:
        if x not in ("drafters", "drafters_sampled", "cpu", "h200"):
            fail(f"--parts: unknown part {x!r} (drafters, drafters_sampled, cpu, h200)")
    out = Path(args.out)
    rows = []
    if args.merge and out.is_file():
        rows = [r for r in json.loads(out.read_text())["rows"] if r.get("part") not in parts]
    if "drafters" in parts:
        rows += part_drafters(args)
    if "drafters_sampled" in parts:
        rows += part_drafters_sampled(args)
    if "cpu" in parts:
        rows += part_cpu(args)
    if "h200" in parts:
        rows += part_h200(args)
    out.parent.mkdir(parents=True, exist_ok=True)
    command = "python scripts/bench_war.py " + " ".join(argv or sys.argv[1:])
    if args.merge and out.is_file():
        command = json.loads(out.read_text()).get("command", "") + "; then " + command
    out.write_text(json.dumps({"command": command, "rows": rows}, indent=1) + "\n")
    write_md(rows, out.with_suffix(".md"), command)
    plot(rows, out.with_suffix(".png"))
    log.info("wrote %s and %s", out, out.with_suffix(".png"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
