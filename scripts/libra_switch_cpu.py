#!/usr/bin/env python
"""Time real role switches of the Libra elastic pool on CPU (Ray actors, gloo, the embedded engine,
the ``tiny`` Qwen3-Next model): a worker leaves the DP group and serves rollouts, the trainers
step, the engine gets the new weights, the worker returns. MEASURED, not simulated.

    python scripts/libra_switch_cpu.py --workers 3 --rounds 3 --out docs/benchmarks/libra_switch_cpu.json
    python scripts/libra_switch_cpu.py --workers 3 --rounds 3 --resident --trainer megatron   # Megatron-Core + DDP
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import platform
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

log = logging.getLogger("libra_switch_cpu")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--workers", type=int, default=3)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--model", default="tiny")
    ap.add_argument("--resident", action="store_true",
                    help="keep the engine process between switches (paused, memory released) instead of restarting it")
    ap.add_argument("--trainer", default="hf", choices=["hf", "megatron"],
                    help="the workers' trainer: transformers' model, or Megatron-Core's HybridModel in Megatron DDP")
    ap.add_argument("--out", default=None,
                    help="default docs/benchmarks/libra_switch_cpu[_megatron][_resident].json")
    ap.add_argument("--libra-json", default="docs/benchmarks/libra.json",
                    help="also put a simulated=false row into this results file when it exists")
    args = ap.parse_args(argv)
    if args.workers < 2:
        ap.error("--workers must be >= 2")
    if args.rounds < 1:
        ap.error("--rounds must be >= 1")
    if args.out is None:
        args.out = (f"docs/benchmarks/libra_switch_cpu{'_megatron' if args.trainer == 'megatron' else ''}"
                    f"{'_resident' if args.resident else ''}.json")
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    from megatron_harts.rollout.libra.pool import ElasticPool
    from megatron_harts.rollout.weight_sync import PRESETS, model_config
    if args.model not in PRESETS:
        ap.error(f"--model: one of {PRESETS}")
    batch = [[1, 5 + i, 9, 17 + 3 * i, 40, 41 + i, 2] for i in range(8)]
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory() as d:
        pool = ElasticPool(args.workers, model_config(args.model), d, trainer=args.trainer, seed=0,
                           resident_engines=args.resident)
        start_s = time.perf_counter() - t0
        rows = []
        try:
            leaver = args.workers - 1
            for r in range(args.rounds):
                g_before = pool.grads(batch)
                a_before = pool.grads(batch, mode="allreduce")        # the trainer's own reduction
                out = pool.to_rollout(leaver)
                g_during = pool.grads(batch)
                a_during = pool.grads(batch, mode="allreduce")
                t = time.perf_counter()
                gen = pool.generate(leaver, [[1, 70, 71, 72]], max_new_tokens=8)
                gen_s = time.perf_counter() - t
                pool.step()
                pub = pool.publish(leaver)
                back = pool.to_training(leaver)
                g_after = pool.grads(batch)
                a_after = pool.grads(batch, mode="allreduce")
                same = bool(np.array_equal(g_before, g_during))
                ref = np.abs(g_after).max()
                rows.append({"round": r, "to_rollout_s": round(out["total_s"], 3), "rebuild_out_s": round(out["rebuild_s"], 4),
                             "export_s": round(out["export_s"], 3), "engine_start_s": round(out["start_s"], 3),
                             "generate_8_tokens_s": round(gen_s, 3), "publish_export_s": round(pub["export_s"], 3),
                             "publish_push_s": round(pub["push_s"], 3), "to_training_s": round(back["total_s"], 3),
                             "engine_stop_s": round(back["stop_s"], 3), "rebuild_back_s": round(back["rebuild_s"], 4),
                             "state_sync_s": round(back["state_sync_s"], 4), "grads_bitwise_equal_across_switch": same,
                             "allreduce_vs_deterministic_rel": float(np.abs(a_after - g_after).max() / ref),
                             "allreduce_rel_diff_across_switch": float(np.abs(a_during - a_before).max()
                                                                       / np.abs(a_before).max()),
                             "weight_version_served": gen[0]["weight_version"], "resident_engine": out["resident"],
                             "simulated": False})
                pool.step()
                log.info("round %d: to rollout %.2f s (engine start %.2f), back %.2f s, grads equal %s", r,
                         out["total_s"], out["start_s"], back["total_s"], same)
                del g_after
        finally:
            pool.close()
            import ray
            ray.shutdown()
    res = {"meta": {"simulated": False, "workers": args.workers, "resident_engines": args.resident, "model": args.model, "cpu": platform.processor() or platform.machine(),
                    "cpus": os.cpu_count(), "pool_start_s": round(start_s, 2), "argv": sys.argv[1:] if argv is None else argv,
                    "trainer": args.trainer,
                    "note": "CPU, gloo, embedded transformers engine (not SGLang); includes engine process start; "
                            "trainer 'megatron': Megatron-Core HybridModel in Megatron DDP, rebuilt per switch"},
           "rows": rows,
           "median": {k: float(np.median([r[k] for r in rows])) for k in ("to_rollout_s", "to_training_s", "engine_start_s",
                                                                         "rebuild_out_s", "rebuild_back_s", "state_sync_s")}}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(res, indent=1))
    log.info("median: %s", res["median"])
    lj = Path(args.libra_json)
    if lj.exists():
        data = json.loads(lj.read_text())
        mode = "resident engine (pause + release)" if args.resident else "engine restarted"
        pol = f"elastic pool, Ray + gloo, {args.workers} workers, {mode}"
        if args.trainer == "megatron":
            pol += ", Megatron DDP trainer"
        data["rows"] = [r for r in data["rows"] if not (r.get("setting") == "role switch, CPU (real)" and r.get("policy") == pol)]
        data["rows"].append({"setting": "role switch, CPU (real)", "policy": pol,
                             "gpus": 0, "throughput": None, "step_s": None, "vs_static": None, "simulated": False,
                             "to_rollout_s": res["median"]["to_rollout_s"], "to_training_s": res["median"]["to_training_s"],
                             "source": str(args.out)})
        lj.write_text(json.dumps(data, indent=1, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
