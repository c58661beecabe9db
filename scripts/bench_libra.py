#!/usr/bin/env python
"""Libra SIMULATION benchmark: GPU-split policies and request-queue policies on synthetic drifting,
long-tailed agentic workloads, with cost models fitted on the project's H200 measurements
(megatron_harts/rollout/libra/costs.py). Nothing here runs on a GPU; every row says
``simulated: true``.

Writes ``<out>/libra.json`` (rows ``{setting, policy, gpus, throughput, step_s, vs_static,
simulated, ...}`` plus the queue comparison and the planner's prediction check), ``<out>/libra.md``
(tables) and ``<out>/libra.png``.

    python scripts/bench_libra.py                     # docs/benchmarks/, ~5 min on 2 CPU cores
    python scripts/bench_libra.py --quick --out /tmp/libra
    python scripts/bench_libra.py --static-oracle drift:16:1,drift:64:2   # hindsight batch-async static split only
    python scripts/bench_libra.py --stream-k 1,4 --hindsight drift       # the defaults: streaming rows

Rollout costs: ``--calibration`` (default ``docs/benchmarks/libra_calibration_h200.json``, the H200
decode grid, through ``costs.rollout_cost_from_calibration``); ``--calibration gpu.md``: GPU.md's two
decode points (the costs before 2026-12-02).
"""
from __future__ import annotations

import argparse
import json
import logging
import sys
import time
from dataclasses import asdict, replace
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from megatron_harts.rollout.libra import costs, planner, sim, workload  # noqa: E402

log = logging.getLogger("bench_libra")

SETTINGS = {
    # lengths grow over training: generated tokens per turn x2.5, turns x~2 (default WorkloadConfig)
    "drift": {},
    "no-drift": {"gen_growth": 0.0, "turn_growth": 0.0},
    # tool observations grow x9 (e.g. longer files / test logs): training tokens grow faster than decode
    "obs-drift": {"gen_growth": 0.0, "turn_growth": 0.0, "obs_growth": 8.0},
}
RUNS = [  # (label, policy, staleness)
    ("static (sync)", "static", 0),
    ("colocated (sync)", "colocated", 0),
    ("tail batching (sync)", "tail", 0),
    ("elastic pool (sync)", "elastic", 0),
    ("libra planner (sync)", "libra", 0),
    ("static (async k=1)", "static", 1),
    ("libra (async k=1)", "libra", 1),
    ("static (async k=2)", "static", 2),
    ("libra (async k=2)", "libra", 2),
]
# streaming bounded staleness (sim.run_stream): (label, policy, staleness, run_stream kwargs); the
# hindsight rows (sim.hindsight_static_split) are added for --hindsight settings at the largest k
STREAM_RUNS = [
    ("static (stream k={k})", "static", {}),
    ("libra (stream k={k})", "libra", {}),     # planner.StreamPlanner: measured rates, bottleneck rule, hysteresis
    # the earlier variant: the bulk cost model (plan_async) x the measured correction, and without it
    ("libra, bulk model + correction (stream k={k})", "libra", {"planner_mode": "model"}),
    ("libra, cost model only (stream k={k})", "libra", {"planner_mode": "model", "feedback": False}),
]
HINDSIGHT = "static hindsight (stream k={k})"


def stream_labels(ks: list[int]) -> list[str]:
    """Row labels of the streaming runs for staleness values ``ks`` (hindsight rows not included)."""
    return [lab.format(k=k) for k in ks for lab, _, kw in STREAM_RUNS if k == max(ks) or not kw]


def _row(setting: str, label: str, gpus: int, k: int, out: dict, wall: float) -> dict:
    row = {"setting": setting, "policy": label, "gpus": gpus, "staleness": k,
           "throughput": round(out["throughput"], 1), "step_s": round(out["step_s"], 2),
           "simulated": True, "sim_wall_s": round(wall, 2),
           "rollout_gpus": [r.get("rollout_gpus") for r in out["rows"]]}
    if out.get("mode") == "stream":
        row.update(mode="stream", static_split=out["static_split"], dropped_groups=out["dropped_groups"],
                   aborted_groups=out["aborted_groups"], discarded_tokens=out["discarded_tokens"],
                   generated_tokens=out["generated_tokens"], max_staleness=out["max_staleness"],
                   mean_staleness=round(out["mean_staleness"], 2),
                   rollout_scale=round(out["rollout_scale"], 3), planner_mode=out.get("planner_mode"))
        if out.get("decisions"):
            row["decisions"] = [{k: (round(v, 2) if isinstance(v, float) else v) for k, v in d.items() if k != "measure"}
                                for d in out["decisions"]]
    return row


def split_rows(args, rc, tc) -> list[dict]:
    from tqdm import tqdm
    jobs = [(s, g) for s in args.settings for g in args.gpus if s == "drift" or g in (args.gpus[0], args.gpus[-1])]
    rows = []
    kmax = max(args.stream_k) if args.stream_k else None
    for setting, gpus in tqdm(jobs, desc="split policies", disable=args.quiet):
        w = workload.WorkloadConfig(steps=args.steps, groups=2 * gpus, **SETTINGS[setting])
        res = {}
        for label, pol, k in RUNS:
            cfg = sim.SimConfig(gpus=gpus, steps=args.steps, staleness=k, sync_s=args.sync_s, switch_s=args.switch_s,
                                switch_back_s=args.switch_back_s)
            t0 = time.perf_counter()
            out = sim.run_policy(pol, w, cfg, rc, tc)
            res[label] = out
            rows.append(_row(setting, label, gpus, k, out, time.perf_counter() - t0))
        for k in args.stream_k:
            cfg = sim.SimConfig(gpus=gpus, steps=args.steps, staleness=k, sync_s=args.sync_s, switch_s=args.switch_s,
                                switch_back_s=args.switch_back_s)
            for lab, pol, kw in STREAM_RUNS:
                if kw and k != kmax:
                    continue
                label = lab.format(k=k)
                t0 = time.perf_counter()
                out = sim.run_stream(pol, w, cfg, rc, tc, **kw)
                res[label] = out
                rows.append(_row(setting, label, gpus, k, out, time.perf_counter() - t0))
            if k == kmax and setting in args.hindsight:
                t0 = time.perf_counter()
                h = sim.hindsight_static_split(w, cfg, rc, tc)
                label = HINDSIGHT.format(k=k)
                out = h["runs"][h["best_r"]]
                res[label] = out
                row = _row(setting, label, gpus, k, out, time.perf_counter() - t0)
                row.update(hindsight_r=h["best_r"], throughput_by_r={r: round(v, 1) for r, v in h["throughput_by_r"].items()})
                rows.append(row)
                log.info("hindsight %s %d GPUs k=%d: R=%d of %d searched", setting, gpus, k, h["best_r"], len(h["runs"]))
        base = res["static (sync)"]["throughput"]
        for row in rows:
            if row["setting"] == setting and row["gpus"] == gpus:
                row["vs_static"] = round(row["throughput"] / base, 3)
                k = row["staleness"]
                same = res[f"static (stream k={k})" if row.get("mode") == "stream"
                           else f"static ({'sync' if k == 0 else 'async k=%d' % k})"]
                row["vs_static_same_staleness"] = round(row["throughput"] / same["throughput"], 3)
    return rows


def static_oracle_rows(args, rc, tc, cases) -> list[dict]:
    """The static asynchronous split with hindsight: every candidate R of ``sim.tune_static_split``'s
    grid simulated over the whole run, the best one, against the step-0-tuned static split and
    ``libra (async k)``. Not a deployable baseline (it sees the run); a bound for any fixed split."""
    out = []
    for setting, gpus, k in cases:
        w = workload.WorkloadConfig(steps=args.steps, groups=2 * gpus, **SETTINGS[setting])
        cfg = sim.SimConfig(gpus=gpus, steps=args.steps, staleness=k, sync_s=args.sync_s, switch_s=args.switch_s,
                            switch_back_s=args.switch_back_s)
        tuned_r = sim.tune_static_split(workload.step_batch(w, 0), rc, tc, cfg)
        res = {r: sim.run_policy("static", w, replace(cfg, static_split=r), rc, tc)["throughput"]
               for r in sorted(set(list(range(1, gpus, max(1, gpus // 16))) + [gpus - 1]))}
        libra = sim.run_policy("libra", w, cfg, rc, tc)["throughput"]
        best = max(res, key=res.get)
        out.append({"setting": setting, "gpus": gpus, "k": k, "static_tuned_r": tuned_r, "tuned": round(res[tuned_r]),
                    "best_r": best, "best": round(res[best]), "libra": round(libra),
                    "libra_vs_tuned": round(libra / res[tuned_r], 3), "libra_vs_oracle": round(libra / res[best], 3),
                    "throughput_by_r": {r: round(v) for r, v in res.items()}, "simulated": True})
        log.info("static oracle %s %d GPUs k=%d: tuned R=%d %.0f, best R=%d %.0f, libra %.0f (%.3fx of the best)",
                 setting, gpus, k, tuned_r, res[tuned_r], best, res[best], libra, libra / res[best])
    return out


def queue_rows(args, rc) -> list[dict]:
    """C-MLFQ vs FCFS / SPF / PLAS on one saturated synchronous rollout (memory-tight engines)."""
    rows = []
    w = workload.WorkloadConfig(steps=args.steps, groups=args.queue_groups)
    step = args.steps // 2                                      # mid-training lengths
    progs = workload.step_batch(w, step)
    tight = replace(rc, max_batch=args.queue_max_batch, kv_tokens=args.queue_kv_tokens)
    variants = [("fcfs", "fcfs", {}, 0), ("spf (predictor sigma 0.5)", "spf", {"pred_sigma": 0.5}, 0),
                ("spf (predictor sigma 1.0)", "spf", {"pred_sigma": 1.0}, 0), ("plas (Autellix)", "plas", {}, 0),
                ("c-mlfq, one bucket", "cmlfq1", {}, 0), ("c-mlfq, short/long buckets", "cmlfq", {}, args.long_engines)]
    for label, name, extra, nl in variants:
        cfg = sim.SimConfig(gpus=args.queue_engines, long_bucket=nl, **extra)
        # the long bucket: engines set up for long contexts (x4 KV pool, e.g. a higher
        # --mem-fraction-static / TP 2 in SGLang; same per-iteration costs)
        long = replace(tight, kv_tokens=4 * tight.kv_tokens)
        engines = [(tight, 0)] * (args.queue_engines - nl) + [(long, 1)] * nl
        from megatron_harts.rollout.libra import cmlfq
        pol = cmlfq.CMLFQ(buckets=1) if name == "cmlfq1" else cmlfq.make_policy(name)
        pool = sim.EnginePool(engines, pol, pred_sigma=cfg.pred_sigma, seed=0)
        pool.add_programs(progs, 0.0)
        pool.run()
        done = np.array(pool.done_at)
        groups = {}
        for p, d in zip(progs, done):
            groups[p.group] = max(groups.get(p.group, 0.0), d)
        g = np.array(list(groups.values()))
        rows.append({"setting": f"queue, step {step} of drift", "policy": label, "engines": args.queue_engines,
                     "long_engines": nl, "programs": len(progs), "makespan_s": round(float(done.max()), 1),
                     "mean_s": round(float(done.mean()), 1), "p50_s": round(float(np.median(done)), 1),
                     "p99_s": round(float(np.quantile(done, 0.99)), 1),
                     "group_mean_s": round(float(g.mean()), 1), "group_p50_s": round(float(np.median(g)), 1),
                     "cache_misses": pool.cache_misses, "simulated": True})
    return rows


def planner_check(args, rc, tc) -> list[dict]:
    """Predicted (planner) vs simulated synchronous rollout makespan."""
    out = []
    w = workload.WorkloadConfig(steps=args.steps, groups=32)
    for step in (0, args.steps - 1):
        progs = workload.step_batch(w, step)
        est = planner.ProgramEstimator()
        est.update(progs)
        pl = planner.Planner(rc, tc, 16)
        for r in (2, 8, 16):
            pred = pl.rollout_s(est, len(progs), r)["sync"]
            simd = sim.rollout_once(progs, rc, r, sim.SimConfig(gpus=16))["makespan"]
            out.append({"step": step, "engines": r, "predicted_s": round(pred, 1), "simulated_s": round(simd, 1),
                        "ratio": round(pred / simd, 3)})
    return out


def write_md(path: Path, meta: dict, rows: list[dict], qrows: list[dict], pcheck: list[dict]) -> None:
    lines = ["# Libra: SIMULATED rollout/training GPU planning and request queues", "",
             "**Every number on this page is a simulation** (`scripts/bench_libra.py`, the discrete-event "
             "simulator `megatron_harts/rollout/libra/sim.py`), with cost models fitted on the H200 "
             "measurements listed in [../libra.md](../libra.md#calibration). Nothing here ran on a GPU.", "",
             f"Costs: rollout decode `a={meta['rollout']['a_s'] * 1e3:.3f} ms + b={meta['rollout']['b_s'] * 1e3:.4f} ms x batch "
             f"+ c={meta['rollout']['c_s'] * 1e9:.2f} ns x context tokens` per iteration ({_decode_note(meta['rollout'])}), prefill "
             f"{meta['rollout']['prefill_tok_s'] / 1e3:.0f}K tok/s; training 1/({meta['train']['p_s'] * 1e6:.2f} us + "
             f"{meta['train']['q_s'] * 1e12:.3f} ps x mean length) compact tok/s per GPU; weight sync {meta['sync_s']} s; "
             f"role switch {meta['switch_s']} s to rollout, {meta['switch_back_s']} s back to training (assumed). "
             f"{meta['steps']} RL steps; batch = 2 x GPUs groups of 8 samples.", "",
             "Throughput = trained trajectory tokens / simulated wall seconds. `vs_static` = against the "
             "synchronous static split (the verl-style baseline) of the same setting and GPUs; `same k` = "
             "against the static split at the same staleness and mode (batch-async rows against `static (async k)`, "
             "streaming rows against `static (stream k)`). `async k`: batch b rolled out with weights >= b - k "
             "(sim.run_async); `stream k`: continuous rollout, per-trajectory staleness (oldest version used by any "
             "turn) <= k checked when training consumes it, too-stale groups dropped or aborted and regenerated "
             "(sim.run_stream); `static hindsight`: the best fixed split over the whole run, searched "
             "(sim.hindsight_static_split: not deployable). R = rollout GPUs (static split / per step).", "",
             "| setting | GPUs | policy | throughput (tok/s) | step s | vs_static | same k | R | dropped + aborted groups |",
             "|---|---:|---|---:|---:|---:|---:|---|---:|"]
    for r in rows:
        if r.get("simulated") is False:
            continue
        rg = r.get("rollout_gpus") or []
        rs = str(rg[0]) if rg and len(set(rg)) == 1 else f"{min(rg)}-{max(rg)}" if rg else ""
        disc = f"{r['dropped_groups']} + {r['aborted_groups']}" if r.get("mode") == "stream" else ""
        lines.append(f"| {r['setting']} | {r['gpus']} | {r['policy']} | {r['throughput']:,.0f} | {r['step_s']:.1f} | "
                     f"{r['vs_static']:.2f} | {r['vs_static_same_staleness']:.2f} | {rs} | {disc} |")
    real = [r for r in rows if r.get("simulated") is False]
    if real:
        lines += ["", "Measured rows (`simulated: false`, CPU, from `scripts/libra_switch_cpu.py`; see ../libra.md):", "",
                  "| setting | policy | to rollout s (median) | to training s (median) |", "|---|---|---:|---:|"]
        lines += [f"| {r['setting']} | {r['policy']} | {r['to_rollout_s']:.3f} | {r['to_training_s']:.3f} |" for r in real]
    lines += ["", "## Request queues (one synchronous rollout, saturated engines)", "",
              f"{qrows[0]['programs']} programs (step {args_step(qrows)} of the drift setting) on "
              f"{qrows[0]['engines']} engines with at most {meta['queue_max_batch']} running requests and "
              f"{meta['queue_kv_tokens']:,} KV tokens each; completion times from release (s).", "",
              "| policy | long engines | makespan | mean | p50 | p99 | group mean | cache misses |",
              "|---|---:|---:|---:|---:|---:|---:|---:|"]
    for r in qrows:
        lines.append(f"| {r['policy']} | {r['long_engines']} | {r['makespan_s']} | {r['mean_s']} | {r['p50_s']} | "
                     f"{r['p99_s']} | {r['group_mean_s']} | {r['cache_misses']} |")
    lines += ["", "## Planner: predicted vs simulated synchronous rollout makespan", "",
              "| step | engines | predicted s | simulated s | ratio |", "|---:|---:|---:|---:|---:|"]
    for r in pcheck:
        lines.append(f"| {r['step']} | {r['engines']} | {r['predicted_s']} | {r['simulated_s']} | {r['ratio']} |")
    path.write_text("\n".join(lines) + "\n")


def _decode_note(r: dict) -> str:
    f = r.get("fit") or {}
    if "measured" not in f:
        return r.get("source") or "GPU.md"
    return (f"a, b fitted on `{r.get('source')}`, {len(f.get('points', []))} points kept of "
            f"{len(f.get('points', [])) + len(f.get('dropped', []))}; c = {f.get('c_from')} for the simulated model")


def args_step(qrows):
    return qrows[0]["setting"].split()[2]


def plot(path: Path, rows: list[dict], qrows: list[dict]) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(1, 2, figsize=(12, 4.5))
    drift = [r for r in rows if r["setting"] == "drift"]
    colors = plt.get_cmap("tab20").colors
    for n, label in enumerate(dict.fromkeys(r["policy"] for r in drift)):
        pts = sorted((r["gpus"], r["throughput"]) for r in drift if r["policy"] == label)
        ax[0].plot([p[0] for p in pts], [p[1] / 1e3 for p in pts], marker="o", label=label, color=colors[n % 20],
                   linestyle="-" if "libra" in label else ":" if "hindsight" in label else "--")
    ax[0].set_xscale("log", base=2)
    ax[0].set_xlabel("GPUs")
    ax[0].set_ylabel("trained tokens/s (x1000)")
    ax[0].set_title("SIMULATION: drifting agentic workload")
    ax[0].legend(fontsize=7)
    labels = [r["policy"] for r in qrows]
    x = np.arange(len(labels))
    ax[1].bar(x - 0.2, [r["p99_s"] for r in qrows], 0.4, label="p99 program")
    ax[1].bar(x + 0.2, [r["makespan_s"] for r in qrows], 0.4, label="makespan")
    ax[1].set_xticks(x, labels, rotation=30, ha="right", fontsize=7)
    ax[1].set_ylabel("seconds")
    ax[1].set_title("SIMULATION: queue policies, saturated rollout")
    ax[1].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default="docs/benchmarks")
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--gpus", default="8,16,32,64")
    ap.add_argument("--settings", default=",".join(SETTINGS))
    ap.add_argument("--sync-s", type=float, default=None, help="weight sync s (default: rollout.json's median)")
    ap.add_argument("--switch-s", type=float, default=10.0, help="one role switch to rollout, s (assumption)")
    ap.add_argument("--switch-back-s", type=float, default=None,
                    help="one switch from rollout back to training, s (default: --switch-s)")
    ap.add_argument("--stream-k", default="1,4",
                    help="staleness values of the streaming rows (sim.run_stream); '' for none")
    ap.add_argument("--hindsight", default="drift",
                    help="settings that get the hindsight static split at the largest --stream-k ('' for none; "
                         "~6 min at 64 GPUs on 2 cores)")
    ap.add_argument("--calibration", default=str(costs.BENCH / "libra_calibration_h200.json"),
                    help="libra_calibration.json of scripts/libra_calibrate_h200.py (decode vs batch x context; "
                         "default: the H200 one in docs/benchmarks); 'gpu.md': GPU.md's two decode points instead")
    ap.add_argument("--queue-engines", type=int, default=16)
    ap.add_argument("--long-engines", type=int, default=4)
    ap.add_argument("--queue-groups", type=int, default=128)
    ap.add_argument("--queue-max-batch", type=int, default=32)
    ap.add_argument("--queue-kv-tokens", type=int, default=400_000)
    ap.add_argument("--static-oracle", default=None, metavar="CASES",
                    help="only the hindsight static split: SETTING:GPUS:K,... (e.g. drift:16:1,drift:64:2) -> "
                         "<out>/libra_static_oracle.json")
    ap.add_argument("--quick", action="store_true", help="3 steps, 8 and 16 GPUs, small queue run")
    ap.add_argument("--quiet", action="store_true")
    args = ap.parse_args(argv)
    try:
        args.gpus = [int(g) for g in args.gpus.split(",")]
    except ValueError:
        ap.error(f"--gpus: comma-separated integers, got {args.gpus!r}")
    args.settings = args.settings.split(",")
    try:
        args.stream_k = [int(k) for k in args.stream_k.split(",") if k.strip()]
    except ValueError:
        ap.error(f"--stream-k: comma-separated integers, got {args.stream_k!r}")
    if any(k < 0 for k in args.stream_k):
        ap.error("--stream-k: staleness must be >= 0")
    args.hindsight = [s for s in args.hindsight.split(",") if s]
    if any(s not in SETTINGS for s in args.hindsight):
        ap.error(f"--hindsight: settings from {list(SETTINGS)}, got {args.hindsight}")
    bad = [s for s in args.settings if s not in SETTINGS]
    if bad:
        ap.error(f"--settings: unknown {bad}; choose from {list(SETTINGS)}")
    if any(g < 2 for g in args.gpus):
        ap.error("--gpus: every pool needs >= 2 GPUs")
    if args.steps < 2:
        ap.error("--steps must be >= 2")
    if args.quick:
        args.steps, args.gpus, args.queue_groups = 3, [8, 16], 48
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    if args.calibration and args.calibration.lower() != "gpu.md":
        if not Path(args.calibration).is_file():
            ap.error(f"--calibration: no such file {args.calibration}")
        # a, b measured (screened NNLS fit); c and prefill for the simulated 1.48B model (costs.py)
        rc = costs.rollout_cost_from_calibration(args.calibration)
        try:
            rc.source = f"{Path(args.calibration).resolve().relative_to(costs.REPO)} ({rc.fit['decode_source']})"
        except ValueError:
            pass
    else:
        rc = costs.fit_rollout_cost()
    tc = costs.fit_train_cost()
    args.sync_s = costs.fit_sync_cost().seconds() if args.sync_s is None else args.sync_s
    t0 = time.perf_counter()
    if args.static_oracle:
        try:
            cases = [(c.split(":")[0], int(c.split(":")[1]), int(c.split(":")[2])) for c in args.static_oracle.split(",")]
        except (IndexError, ValueError):
            ap.error(f"--static-oracle: SETTING:GPUS:K,..., got {args.static_oracle!r}")
        if any(c[0] not in SETTINGS or c[1] < 2 or c[2] < 1 for c in cases):
            ap.error(f"--static-oracle: settings from {list(SETTINGS)}, GPUS >= 2, K >= 1")
        orows = static_oracle_rows(args, rc, tc, cases)
        meta = {"simulated": True, "what": static_oracle_rows.__doc__.split("\n\n")[0].replace("\n    ", " "),
                "rollout": asdict(rc), "sync_s": round(args.sync_s, 3), "switch_s": args.switch_s,
                "switch_back_s": args.switch_back_s if args.switch_back_s is not None else args.switch_s, "steps": args.steps,
                "argv": sys.argv[1:] if argv is None else list(argv), "wall_s": round(time.perf_counter() - t0, 1)}
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "libra_static_oracle.json").write_text(json.dumps({"meta": meta, "rows": orows}, indent=1, default=str))
        return 0
    rows = split_rows(args, rc, tc)
    qrows = queue_rows(args, rc)
    pcheck = planner_check(args, rc, tc)
    meta = {"simulated": True, "rollout": asdict(rc), "train": asdict(tc), "sync_s": round(args.sync_s, 3),
            "switch_s": args.switch_s,
            "switch_back_s": args.switch_back_s if args.switch_back_s is not None else args.switch_s,
            "stream_k": args.stream_k, "hindsight": args.hindsight, "steps": args.steps, "queue_max_batch": args.queue_max_batch,
            "queue_kv_tokens": args.queue_kv_tokens, "workload_defaults": asdict(workload.WorkloadConfig()),
            "settings": SETTINGS, "argv": sys.argv[1:] if argv is None else list(argv),
            "wall_s": round(time.perf_counter() - t0, 1)}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    old = out / "libra.json"
    if old.exists():                      # keep measured rows (scripts/libra_switch_cpu.py)
        rows += [r for r in json.loads(old.read_text()).get("rows", []) if r.get("simulated") is False]
    (out / "libra.json").write_text(json.dumps({"meta": meta, "rows": rows, "queues": qrows, "planner_check": pcheck},
                                               indent=1, default=str))
    write_md(out / "libra.md", meta, rows, qrows, pcheck)
    plot(out / "libra.png", rows, qrows)
    best = max((r for r in rows if r["setting"] == "drift" and r.get("simulated") and "hindsight" not in r["policy"]),
               key=lambda r: r["vs_static"])
    log.info("SIMULATION: best deployable vs static under drift: %s at %d GPUs, %.2fx", best["policy"], best["gpus"],
             best["vs_static"])
    for r in qrows:
        log.info("%-28s makespan %7.1f  p99 %7.1f  mean %7.1f", r["policy"], r["makespan_s"], r["p99_s"], r["mean_s"])
    return 0


if __name__ == "__main__":
    sys.exit(main())
