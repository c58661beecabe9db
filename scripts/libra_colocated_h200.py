#!/usr/bin/env python
"""Libra's role switch on ONE GPU, colocated: SGLang and the Megatron trainer time-share the H200
through SGLang's ``/release_memory_occupation`` / ``/resume_memory_occupation`` (torch_memory_saver,
``--enable-memory-saver``). WRITTEN FOR THE H200, NOT RUN YET (no GPU in the session that wrote it).

Per round: rollout (``--requests`` concurrent ``/generate`` of ``--new-tokens``) -> switch to
training (``/pause_generation`` in place, ``/release_memory_occupation``; optionally the trainer's
parameters and AdamW state back from host memory, ``--offload``) -> one HARTS train step on a
synthetic agentic batch -> weight export (``WeightSync``) -> switch back (trainer offloaded if
``--offload``, ``/resume_memory_occupation``, ``/update_weights_from_disk``, ``/continue_generation``).
Records the seconds of every part and the free GPU memory around each switch
(``torch.cuda.mem_get_info``), to ``<out>/libra_colocated.json``.

    bash scripts/gpu_run.sh libra --rounds 5 --engine-env PYTHONPATH=/tmp/site
    # = PYTHONPATH=/tmp/harts_site:$PWD python3 scripts/libra_colocated_h200.py --out out --rounds 5 \
    #     --engine-env PYTHONPATH=/tmp/site   (after scripts/device/install_{harts,sglang}.sh)
"""
from __future__ import annotations

import argparse
import json
import logging
import shlex
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

log = logging.getLogger("libra_colocated")


def _free_gib() -> float:
    import torch
    torch.cuda.synchronize()
    return torch.cuda.mem_get_info()[0] / 2 ** 30


def _move_trainer(trainer, device: str) -> None:
    """Parameters, gradients and AdamW state of ``trainer`` to ``device`` (offload / onload)."""
    import torch
    trainer.model.to(device)
    for st in trainer.opt.state.values():
        for k, v in st.items():
            if torch.is_tensor(v):
                st[k] = v.to(device, non_blocking=False)
    if device == "cpu":
        torch.cuda.empty_cache()
    torch.cuda.synchronize()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="out")
    ap.add_argument("--model", default="small-moe")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--mem-fraction-static", type=float, default=0.5)
    ap.add_argument("--engine-args", default="--disable-cuda-graph")
    ap.add_argument("--engine-env", action="append", default=[], help="KEY=VALUE for the SGLang process")
    ap.add_argument("--offload", action="store_true", help="move the trainer's state to host memory while rolling out")
    ap.add_argument("--weights-dir", default="/dev/shm/libra_colocated")
    args = ap.parse_args(argv)
    if args.rounds < 1 or args.requests < 1 or args.new_tokens < 1:
        ap.error("--rounds, --requests and --new-tokens must be >= 1")
    if not 0 < args.mem_fraction_static < 1:
        ap.error("--mem-fraction-static must be in (0, 1)")
    env = {}
    for kv in args.engine_env:
        if "=" not in kv:
            ap.error(f"--engine-env: KEY=VALUE, got {kv!r}")
        k, v = kv.split("=", 1)
        env[k] = v
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    import numpy as np
    import torch
    if not torch.cuda.is_available():
        print("libra_colocated_h200: needs a CUDA GPU (this script is for the H200)", file=sys.stderr)
        return 2

    from megatron_harts.rollout.engines import SGLangServer
    from megatron_harts.rollout.trainer import HartsTrainer
    from megatron_harts.rollout.types import SamplingParams
    from megatron_harts.rollout.weight_sync import WeightSync, model_config
    from megatron_harts.workloads import AgenticConfig, agentic_batch

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    hf = model_config(args.model)
    trainer = HartsTrainer(hf, device="cuda", attention_backend="torch", lr=1e-5)
    sync = WeightSync(hf, args.weights_dir, keep=2)
    path, _ = sync.export(trainer.model, "v0")
    trajs = agentic_batch(AgenticConfig(num_groups=4, group_size=8, vocab_size=int(hf["vocab_size"]), seed=0))
    trainer.train_step(trajs)                   # warm-up (kernels, allocator) before any timing
    if args.offload:
        _move_trainer(trainer, "cpu")
    t0 = time.perf_counter()
    server = SGLangServer(path, mem_fraction_static=args.mem_fraction_static, weight_version="v0",
                          enable_memory_saver=True, extra_args=shlex.split(args.engine_args), env=env,
                          log_path=str(out / "sglang_colocated.log")).start()
    start_s = time.perf_counter() - t0
    engine = server.engine(timeout=600.0)
    rng = np.random.default_rng(0)
    prompts = [list(map(int, rng.integers(10, int(hf["vocab_size"]) - 10, size=256))) for _ in range(args.requests)]
    rows = []
    try:
        for r in range(args.rounds):
            row = {"round": r, "simulated": False}
            t = time.perf_counter()
            with ThreadPoolExecutor(args.requests) as ex:
                gens = list(ex.map(lambda ip: engine.generate(
                    ip[1], SamplingParams(max_new_tokens=args.new_tokens, temperature=1.0, seed=ip[0])),
                    enumerate(prompts)))
            row["rollout_s"] = time.perf_counter() - t
            row["rollout_tokens"] = sum(len(g.output_ids) for g in gens)
            row["served_version"] = sorted({g.weight_version for g in gens})
            # -> training
            row["free_gib_before_release"] = _free_gib()
            t = time.perf_counter()
            engine.pause("in_place")
            engine.release_memory()
            row["release_s"] = time.perf_counter() - t
            row["free_gib_after_release"] = _free_gib()
            t = time.perf_counter()
            if args.offload:
                _move_trainer(trainer, "cuda")
            row["onload_s"] = time.perf_counter() - t
            row["to_training_s"] = row["release_s"] + row["onload_s"]
            t = time.perf_counter()
            m = trainer.train_step(trajs)
            torch.cuda.synchronize()
            row["train_s"] = time.perf_counter() - t
            row["loss"] = float(m["loss"])
            version = f"v{r + 1}"
            t = time.perf_counter()
            path, stats = sync.export(trainer.model, version)
            row["export_s"] = time.perf_counter() - t
            # -> rollout
            t = time.perf_counter()
            if args.offload:
                _move_trainer(trainer, "cpu")
            row["offload_s"] = time.perf_counter() - t
            t = time.perf_counter()
            engine.resume_memory()
            row["resume_s"] = time.perf_counter() - t
            t = time.perf_counter()
            engine.update_weights_from_disk(path, version)
            engine.resume()
            row["push_s"] = time.perf_counter() - t
            row["to_rollout_s"] = row["offload_s"] + row["resume_s"] + row["push_s"]
            row["free_gib_after_resume"] = _free_gib()
            if engine.weight_version() != version:
                raise RuntimeError(f"engine serves {engine.weight_version()!r} after pushing {version!r}")
            rows.append(row)
            log.info("round %d: to training %.3f s, to rollout %.3f s (resume %.3f, push %.3f), free %.1f -> %.1f GiB",
                     r, row["to_training_s"], row["to_rollout_s"], row["resume_s"], row["push_s"],
                     row["free_gib_before_release"], row["free_gib_after_release"])
    finally:
        server.stop()
    med = {k: statistics.median(r[k] for r in rows) for k in
           ("to_training_s", "to_rollout_s", "release_s", "resume_s", "push_s", "rollout_s", "train_s", "export_s")}
    res = {"meta": {"simulated": False, "device": torch.cuda.get_device_name(), "model": args.model,
                    "engine_start_s": start_s, "offload": args.offload, "argv": sys.argv[1:] if argv is None else argv},
           "rows": rows, "median": med}
    (out / "libra_colocated.json").write_text(json.dumps(res, indent=1))
    print(f"{'part':<16}{'median s':>10}")
    for k, v in med.items():
        print(f"{k:<16}{v:>10.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
