#!/usr/bin/env python
"""Belayer benchmark: recovery time of engine workers and environments vs their baselines, and the
failure-free overhead. Writes rows ``{fault, mechanism, recovery_s, baseline, baseline_s, speedup,
lost_trajectories, overhead_pct, reps, spread, device, note}`` (medians over ``--reps``; ``spread``:
min and max) to ``--out`` (JSON).

Engine rows (``--engine embedded``: the embedded transformers server on CPU with a tiny steered
random model; ``--engine sglang --model-path DIR``: SGLang on a GPU, not run yet): a long request
(``--kill-at`` tokens generated of ``--max-new-tokens``) whose server is SIGKILLed.

* recovery: SIGKILL -> first token of the request resumed from its logged prefix on the promoted
  shadow (the detection, promotion and one prefill of prompt + generated tokens included);
* baseline ``cold start``: the same without a shadow: a new server is started, then the prefix
  resume (what one would do without shadows);
* baseline ``abort-and-resubmit``: on the shadow, but the request starts over from its prompt:
  time until it has regenerated the lost tokens and produced the next one.

Environment rows (real bubblewrap + overlayfs sandboxes, scripted episodes of ``code_repair`` and
``lookup``): the sandbox is destroyed before the last action; recovery: restore from the newest
checkpoint + replay of the commands since (checkpoints every turn, overlapped); baseline: a fresh
environment and the whole episode replayed. Overhead rows: the same seeded rollout (24 lookup
episodes on the embedded engine) with plain engines and environments vs Belayer's (streaming
token log, resumable engine, checkpointed environments), alternated ``--reps`` times.

``python scripts/bench_belayer.py --reps 5 --out docs/benchmarks/belayer.json`` (CPU, ~5 min).
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import platform
import shlex
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tqdm import tqdm  # noqa: E402

log = logging.getLogger("bench_belayer")


def _summary(xs):
    xs = [x for x in xs if x is not None]
    if not xs:
        return None, None
    return statistics.median(xs), [min(xs), max(xs)]


def _row(fault, mechanism, rec, baseline, base, *, device, note="", lost=0, overhead=None, extra=None):
    r_med, r_spread = _summary(rec)
    b_med, b_spread = _summary(base)
    return {"fault": fault, "mechanism": mechanism, "recovery_s": r_med, "baseline": baseline, "baseline_s": b_med,
            "speedup": (b_med / r_med) if r_med and b_med else None, "lost_trajectories": lost,
            "overhead_pct": overhead, "reps": len([x for x in rec if x is not None]),
            "spread": {"recovery_s": r_spread, "baseline_s": b_spread}, "device": device, "note": note,
            **(extra or {})}


# ------------------------------------------------------------------------------------- engine
def _server_factory(args, workdir):
    from megatron_harts.rollout.engines import EmbeddedServer, SGLangServer

    extra = shlex.split(args.engine_args)
    if args.engine == "embedded" and "--enable-deterministic-inference" not in extra:
        extra.append("--enable-deterministic-inference")

    def start(path, version):
        logp = str(Path(workdir) / f"{args.engine}-{time.time_ns()}.log")
        if args.engine == "embedded":
            return EmbeddedServer(path, weight_version=version, threads=args.threads, log_path=logp,
                                  extra_args=extra).start()
        return SGLangServer(path, weight_version=version, log_path=logp, extra_args=extra).start()
    return start


def _killed_request(sup, eng, sp, prompt, kill_at, rid, target="group"):
    from megatron_harts.rollout.belayer.faults import kill_server

    out = {}
    th = threading.Thread(target=lambda: out.setdefault("g", eng.generate(prompt, sp, rid=rid)))
    th.start()
    while rid not in eng.log.records or len(eng.log.records[rid].output_ids) < kill_at:
        if not th.is_alive():
            raise RuntimeError(f"{rid} ended before {kill_at} tokens: use a longer --max-new-tokens or another seed")
        time.sleep(0.001)
    rec = eng.log.records[rid]
    k = len(rec.output_ids)
    f = kill_server(sup.worker(0).server, target)
    th.join()
    return out["g"], rec, k, f.t


def bench_engine(args, workdir, device):
    from megatron_harts.rollout.belayer import ResumableEngine, Supervisor
    from megatron_harts.rollout.types import SamplingParams

    start = _server_factory(args, workdir)
    prompt = [1] + [40 + i % 50 for i in range(args.prompt_len - 1)]
    sp = SamplingParams(max_new_tokens=args.max_new_tokens, stop_token_ids=[], seed=args.seed)
    rows, res = [], {"shadow": [], "cold": [], "restart": []}
    detail = []
    for mode in ("shadow", "restart", "cold"):
        reps = args.reps if mode != "cold" else max(1, args.cold_reps)
        sup = Supervisor(start, args.model_path, "v0", num_active=1, num_shadows=0 if mode == "cold" else 1,
                         health_interval_s=0.25, engine_kw={"timeout": 600.0, "retries": 0}).start()
        try:
            ref = sup.engine(0).generate(prompt, sp)
            for r in tqdm(range(reps), desc=f"engine {mode}", leave=False):
                if mode != "cold":                         # the shadow re-started by the last kill
                    while not sup.shadows:
                        time.sleep(0.1)
                eng = ResumableEngine(sup, 0, resume="restart" if mode == "restart" else "prefix")
                g, rec, k, t_kill = _killed_request(sup, eng, sp, prompt, args.kill_at, f"{mode}-{r}",
                                                     args.kill)
                if mode != "restart" and g.output_ids != ref.output_ids:
                    log.warning("%s rep %d: output differs from the uninterrupted one", mode, r)
                if mode == "restart":
                    seg = rec.segments[-1]
                    t = rec.times[k] if len(rec.times) > k else None        # the (k+1)-th token again
                    res[mode].append(None if t is None else t - t_kill)
                else:
                    res[mode].append(rec.segments[-1].t_first - t_kill)
                detail.append({"mode": mode, "rep": r, "tokens_at_kill": k, "recovery_s": res[mode][-1],
                               "same_output": g.output_ids == ref.output_ids,
                               "failover": [(e.how, round(e.seconds, 4)) for e in sup.events[-1:]]})
                log.info("%s rep %d: %d tokens at the kill, recovery %.3f s", mode, r, k, res[mode][-1])
            startups = list(sup.cold_starts)
        finally:
            sup.close()
    note = (f"{args.engine}; SIGKILL after {args.kill_at} of {args.max_new_tokens} tokens, prompt {args.prompt_len}; "
            f"server start-up {statistics.median(startups):.1f} s")
    fault = "engine worker SIGKILL (mid-request)" if args.kill == "group" else "engine scheduler SIGKILL (mid-request)"
    rows.append(_row(fault, "shadow promoted + prefix resume", res["shadow"],
                     "cold start + prefix resume", res["cold"], device=device, note=note))
    rows.append(_row(fault, "shadow promoted + prefix resume", res["shadow"],
                     "shadow promoted + abort-and-resubmit from scratch", res["restart"], device=device, note=note))
    rows.append({"fault": "engine worker SIGKILL", "mechanism": "GPU state reuse (torch_memory_saver / CUDA IPC)",
                 "recovery_s": None, "baseline": None, "baseline_s": None, "speedup": None, "lost_trajectories": None,
                 "overhead_pct": None, "reps": 0, "spread": None, "device": device,
                 "note": "not measurable on CPU (no GPU memory to keep); not built"})
    return rows, detail


# ---------------------------------------------------------------------------------- environment
CODE_ACTIONS = ["<call>head -3 solution.py</call>", "<call>echo a > notes.txt</call>",
                "<call>python3 test_solution.py | tail -1</call>", "<call>cp solution.py s2.py && wc -c s2.py</call>",
                "<call>python3 test_solution.py | tail -1</call>", "<call>echo b >> notes.txt; ls</call>",
                "<call>python3 test_solution.py | tail -1</call>", "<call>cat notes.txt</call>"]


def bench_env(args, device):
    from megatron_harts.rollout.belayer.env import CheckpointedEnv, CheckpointPolicy
    from megatron_harts.rollout.belayer.faults import SandboxFaultInjector, lose_sandbox
    from megatron_harts.rollout.envs import make_env
    from megatron_harts.rollout.sandbox import SandboxLimits

    cases = [("code_repair", lambda: make_env("code_repair", 3, seed=0, max_turns=10), CODE_ACTIONS, 1),
             ("code_repair", lambda: make_env("code_repair", 3, seed=0, max_turns=10), CODE_ACTIONS, 4),
             ("lookup", lambda: make_env("lookup", 7, seed=0, max_turns=8), [f"{c}</call>" for c in "abcdefg"], 1)]
    rows = []
    for name, mk, actions, every in cases:
        rec, base, over, replayed = [], [], [], []
        for r in tqdm(range(args.reps), desc=f"env {name} every {every}", leave=False):
            env = CheckpointedEnv(mk, policy=CheckpointPolicy(every=every))
            try:
                for a in actions[:-1]:
                    time.sleep(args.gen_gap_s)            # the model's turn: checkpoints overlap it
                    env.step(a)
                env._wait_checkpoint()
                lose_sandbox(env.env.sandbox)
                env.step(actions[-1])
                last = env.stats["restores"][-1]
                rec.append(last["seconds"])
                replayed.append(last["replayed"])
                base.append(env.recreate_and_replay(len(actions) - 1))
                over.append(env.stats["checkpoint_wait_s"] + sum(c.seconds for c in env.checkpoints
                                                                 if c.mode == "inline"))
            finally:
                env.close()
        rows.append(_row(f"sandbox lost before turn {len(actions)} ({name})",
                         f"restore newest checkpoint (every {every} turn{'s' if every > 1 else ''}) + replay since",
                         rec, "recreate environment + replay the episode", base, device=device,
                         note=f"scripted {len(actions)}-turn episode, {args.gen_gap_s * 1000:.0f} ms between turns; "
                              f"{statistics.median(replayed):g} commands replayed; checkpoint time on the critical "
                              f"path {statistics.median(over) * 1000:.1f} ms per episode"))
    # a command SIGKILLed while it runs (the in-turn fault): restore to the turn before + re-run
    rec, base = [], []
    mk = lambda: make_env("code_repair", 3, seed=0, max_turns=10, limits=SandboxLimits(timeout_s=5.0))  # noqa: E731
    for r in range(args.reps):
        env = CheckpointedEnv(mk)
        try:
            for a in CODE_ACTIONS[:-2]:
                time.sleep(args.gen_gap_s)
                env.step(a)
            env._wait_checkpoint()
            slow = "<call>python3 test_solution.py | tail -1; sleep 0.3</call>"
            with SandboxFaultInjector({"kill": 1.0}, rate=1.0, budget=1, seed=r, delay_s=(0.15, 0.15)) as inj:
                t0 = time.monotonic()
                env.step(slow)
                total = time.monotonic() - t0
            if not inj.landed():
                continue
            t_kill = inj.landed()[0].t
            rec.append(t0 + total - t_kill)         # kill -> the turn's (correct) observation
            n = len(env.actions)
            base.append(env.recreate_and_replay(n - 1) + _time_step(env, slow))
        finally:
            env.close()
    rows.append(_row("sandbox command SIGKILLed mid-turn (code_repair)",
                     "restore the turn's checkpoint + re-run the command", rec,
                     "recreate environment + replay the episode + re-run", base, device=device,
                     note="kill -> the turn's observation; both include re-running the 0.3 s command"))
    return rows


def _time_step(env, action):
    t0 = time.monotonic()
    env.env.step(action)
    return time.monotonic() - t0


# ------------------------------------------------------------------------------------ overhead
def bench_overhead(args, workdir, device):
    from megatron_harts.rollout.agent_loop import AgentLoop, RolloutConfig
    from megatron_harts.rollout.belayer import ResumableEngine, Supervisor
    from megatron_harts.rollout.belayer.env import BelayerAgentLoop, CheckpointedEnv
    from megatron_harts.rollout.engines import HttpEngine
    from megatron_harts.rollout.envs import make_env
    from megatron_harts.rollout.tokenizer import ByteTokenizer
    from megatron_harts.rollout.types import SamplingParams

    start = _server_factory(args, workdir)
    cfg = RolloutConfig(group_size=4, max_new_tokens=16, max_concurrency=8, seed=0)
    tasks = list(range(4))
    mk = lambda t: make_env("code_repair", int(t), seed=0, max_turns=3)     # noqa: E731
    sup = Supervisor(start, args.overhead_model_path, "v0", num_active=1, num_shadows=0, health_interval_s=0.5).start()
    kinds = ("plain", "engine", "env", "belayer")
    times = {k: [] for k in kinds}
    crit = {k: [] for k in kinds}
    envs: list = []

    def ckpt_env(t):
        env = CheckpointedEnv(lambda: mk(t))
        envs.append(env)
        return env
    try:
        url = sup.worker(0).engine.url
        for r in tqdm(range(args.overhead_reps + 1), desc="overhead rounds"):   # the first round warms up
            for kind in kinds:
                engines = [ResumableEngine(sup, 0)] if kind in ("engine", "belayer") else [HttpEngine(url)]
                factory = ckpt_env if kind in ("env", "belayer") else mk
                loop = (BelayerAgentLoop if kind in ("env", "belayer") else AgentLoop)(engines, ByteTokenizer(),
                                                                                      factory, cfg)
                envs.clear()
                t0 = time.monotonic()
                res = loop.rollout(tasks, [f"t{t}" for t in tasks])
                dt = time.monotonic() - t0
                if res.failed:
                    raise RuntimeError(f"{kind} rollout lost {len(res.failed)} episodes")
                if r:
                    times[kind].append(dt)
                    if envs:       # time in CheckpointedEnv.step outside the inner step, vs the inner steps
                        crit[kind].append(100 * sum(e.stats["wrapper_s"] for e in envs)
                                          / sum(e.stats["inner_s"] for e in envs))
        # the engine side alone, sequential requests (far less noisy than whole rollouts here)
        plain_e, res_e = HttpEngine(url), ResumableEngine(sup, 0)
        prompt = [1] + [40 + i % 50 for i in range(63)]
        pairs_e = []
        for i in tqdm(range(args.overhead_reps * 8), desc="engine requests"):
            sp = SamplingParams(max_new_tokens=16, stop_token_ids=[], seed=i)
            t0 = time.monotonic()
            a = plain_e.generate(prompt, sp)
            t1 = time.monotonic()
            b = res_e.generate(prompt, sp)
            t2 = time.monotonic()
            if a.output_ids != b.output_ids:
                raise RuntimeError("streamed and plain generations differ")
            pairs_e.append(100 * ((t2 - t1) - (t1 - t0)) / (t1 - t0))
    finally:
        sup.close()
    p = statistics.median(times["plain"])
    rows = []
    what = {"engine": "token log + streaming + resumable engine", "env": "checkpointed environments (+ cut-back loop)",
            "belayer": "both"}
    rows.append({"fault": "none (failure-free requests)", "mechanism": "ResumableEngine (streaming + token log)",
                 "recovery_s": None, "baseline": "HttpEngine.generate (one reply)", "baseline_s": None, "speedup": None,
                 "lost_trajectories": 0, "overhead_pct": statistics.median(pairs_e), "reps": len(pairs_e),
                 "spread": {"overhead_pct_paired": [min(pairs_e), max(pairs_e)]}, "device": device,
                 "note": "16-token requests with a 64-token prompt, one embedded server, plain and resumable "
                         "alternated; overhead_pct: median of the paired differences"})
    for kind in ("engine", "env", "belayer"):
        pairs = [100 * (y - x) / x for x, y in zip(times["plain"], times[kind])]
        b = statistics.median(times[kind])
        rows.append({"fault": "none (failure-free rollout)", "mechanism": what[kind], "recovery_s": None,
                     "baseline": "plain AgentLoop + HttpEngine + SandboxEnv", "baseline_s": p, "speedup": None,
                     "lost_trajectories": 0, "overhead_pct": statistics.median(pairs), "reps": len(pairs),
                     "env_wrapper_pct_of_env_steps": statistics.median(crit[kind]) if crit[kind] else None,
                     "spread": {"overhead_pct_paired": [min(pairs), max(pairs)],
                                "rollout_s": [min(times[kind]), max(times[kind])],
                                "baseline_rollout_s": [min(times["plain"]), max(times["plain"])]},
                     "device": device, "rollout_s": b,
                     "note": "16 code_repair episodes (tiny steered random model: random shell commands, <= 3 "
                             "turns, one embedded server), the four variants alternated each round; overhead_pct: "
                             "median of the paired differences"})
    return rows


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--engine", choices=["embedded", "sglang"], default="embedded")
    p.add_argument("--model-path", default=None, help="checkpoint (default: a tiny steered model made here)")
    p.add_argument("--engine-args", default="", help="extra server flags (SGLang: add --enable-deterministic-inference)")
    p.add_argument("--threads", type=int, default=1, help="torch threads of each embedded server")
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--cold-reps", type=int, default=3)
    p.add_argument("--overhead-reps", type=int, default=4)
    p.add_argument("--merge", action="store_true", help="keep the rows of the other parts already in --out")
    p.add_argument("--plot", default=None, help="also draw the rows of --out into this PNG")
    p.add_argument("--plot-only", action="store_true", help="only draw --plot from --out")
    p.add_argument("--kill-at", type=int, default=200)
    p.add_argument("--max-new-tokens", type=int, default=320)
    p.add_argument("--prompt-len", type=int, default=64)
    p.add_argument("--gen-gap-s", type=float, default=0.05, help="simulated generation time between env turns")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--kill", choices=["group", "child"], default="group",
                   help="SIGKILL the server's process group, or only its first child (SGLang's scheduler)")
    p.add_argument("--parts", default="engine,env,overhead")
    p.add_argument("--out", default="docs/benchmarks/belayer.json")
    args = p.parse_args(argv)
    if args.plot_only:
        if not args.plot:
            p.error("--plot-only needs --plot PNG")
        plot(args.out, args.plot)
        return 0
    parts = set(args.parts.split(","))
    if not parts <= {"engine", "env", "overhead"}:
        p.error(f"--parts: unknown part(s) {sorted(parts - {'engine', 'env', 'overhead'})}")
    if args.kill_at < 1 or args.kill_at >= args.max_new_tokens:
        p.error("--kill-at must be in [1, --max-new-tokens)")
    if args.engine == "sglang" and not args.model_path:
        p.error("--model-path is required with --engine sglang")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    for noisy in ("megatron_harts.rollout.engines", "megatron_harts.rollout.belayer", "megatron_harts.rollout.agent_loop"):
        logging.getLogger(noisy).setLevel(logging.ERROR)
    workdir = tempfile.mkdtemp(prefix="bench-belayer-")
    device = (f"CPU ({platform.processor() or platform.machine()}, {os.cpu_count()} cores, shared)"
              if args.engine == "embedded" else "GPU (SGLang)")
    from megatron_harts.rollout.belayer.tiny import make_tiny_checkpoint
    if args.model_path is None:      # long generations: </call> and <eos> nearly never sampled
        args.model_path = make_tiny_checkpoint(Path(workdir) / "long", call_prob=1e-4, eos_prob=1e-4)["path"]
    if "overhead" in parts:
        args.overhead_model_path = (make_tiny_checkpoint(Path(workdir) / "calls", call_prob=0.15, eos_prob=0.02)["path"]
                                    if args.engine == "embedded" else args.model_path)
    rows, detail = [], []
    if "engine" in parts:
        r, detail = bench_engine(args, workdir, device)
        for x in r:
            x["part"] = "engine"
        rows += r
    if "env" in parts:
        rows += [dict(x, part="env") for x in bench_env(args, device)]
    if "overhead" in parts:
        rows += [dict(x, part="overhead") for x in bench_overhead(args, workdir, device)]
    cmd = "python scripts/bench_belayer.py " + " ".join(argv or sys.argv[1:])
    out = {"device": device, "commands": {p_: cmd for p_ in parts}, "rows": rows, "engine_reps": detail}
    if args.merge and Path(args.out).is_file():
        old = json.loads(Path(args.out).read_text())
        keep = [x for x in old["rows"] if x.get("part") not in parts]
        order = ["engine", "env", "overhead"]
        out["rows"] = sorted(keep + rows, key=lambda x: order.index(x.get("part", "engine")))
        out["commands"] = {**old.get("commands", {}), **out["commands"]}
        if "engine" not in parts:
            out["engine_reps"] = old.get("engine_reps", [])
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=1) + "\n")
    if args.plot:
        plot(args.out, args.plot)
    for r in rows:
        log.info("%s | %s | recovery %s s | %s %s s | speedup %s | overhead %s %%", r["fault"], r["mechanism"],
                 _fmt(r["recovery_s"]), r["baseline"], _fmt(r["baseline_s"]), _fmt(r["speedup"]),
                 _fmt(r["overhead_pct"]))
    return 0


def plot(json_path, png_path):
    """Recovery vs baseline per fault (log scale, medians with min-max bars)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    d = json.loads(Path(json_path).read_text())
    rows = [r for r in d["rows"] if r.get("recovery_s") and r.get("baseline_s")]
    fig, ax = plt.subplots(figsize=(10, 0.9 * len(rows) + 1.2))
    for i, r in enumerate(rows):
        sp = r.get("spread") or {}
        for j, (key, color, label) in enumerate((("recovery_s", "tab:green", "Belayer"),
                                                 ("baseline_s", "tab:gray", "baseline"))):
            lo, hi = (sp.get(key) or [r[key], r[key]])
            y = i + (0.2 if j else -0.2)
            ax.barh(y, r[key], height=0.38, color=color, label=label if i == 0 else None)
            ax.plot([lo, hi], [y, y], color="black", lw=1)
        ax.text(max(r["baseline_s"], r["recovery_s"]) * 1.3, i, f"{r['speedup']:.1f}x", va="center", fontsize=8)
    ax.set_yticks(range(len(rows)))
    ax.set_yticklabels([f"{r['fault']}\n{r['mechanism']}\nvs {r['baseline']}" for r in rows], fontsize=6)
    ax.set_xscale("log")
    ax.set_xlabel("seconds: fault -> first resumed token / consistent observation (median, min-max)", fontsize=8)
    ax.set_title(f"Belayer recovery, {d['device']}", fontsize=9)
    ax.legend(loc="lower right", fontsize=8)
    ax.invert_yaxis()
    fig.tight_layout()
    fig.savefig(png_path, dpi=120)


def _fmt(x):
    return "-" if x is None else f"{x:.3g}"


if __name__ == "__main__":
    sys.exit(main())
