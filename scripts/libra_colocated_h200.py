#!/usr/bin/env python
"""Libra's role switch on ONE GPU, colocated: SGLang and the Megatron trainer time-share the H200
through SGLang's ``/release_memory_occupation`` / ``/resume_memory_occupation`` (torch_memory_saver,
``--enable-memory-saver``). WRITTEN FOR THE H200, NOT RUN YET (no GPU in the session that wrote it).

Per round: rollout (``--requests`` concurrent ``/generate`` of ``--new-tokens``) -> switch to
training (wait until the server is idle, ``/pause_generation`` in place, ``/release_memory_occupation``
of all tags; optionally the trainer's parameters and AdamW state back from host memory,
``--offload``) -> check: the trainer's log-probs of 8 of the round's generations against the
engine's (a resumed engine serving garbage weights shows here) -> one HARTS train step on a
synthetic agentic batch -> weight export (``WeightSync``) -> switch back (trainer offloaded if
``--offload``, the trainer's cached blocks returned to the driver, ``/resume_memory_occupation``,
``/update_weights_from_disk`` (SGLang 0.5.17 does not keep the weights across a release without
``--enable-weights-cpu-backup``: they must be pushed again), ``/continue_generation``).
Records the seconds of every part and the free GPU memory around each switch
(``torch.cuda.mem_get_info``) in ``<out>/libra_colocated.json``, rewritten after every round (a run
cut by ``--deadline-s`` or killed keeps the rounds so far; ``"complete": true`` when all ran).
``--calibrate-batches B,..`` then measures decode tokens/s vs batch x context on the same server
(``libra_calibrate_h200.calibrate``, into ``<out>/libra_calibration.json``): one SGLang start for both.

    bash scripts/gpu_run.sh libra --rounds 3 --deadline-s 270 --calibrate-batches 1,16,64,128 \
        --calibrate-contexts 1024,8192 --engine-env PYTHONPATH=/tmp/site
    # = PYTHONPATH=/tmp/harts_site:$PWD python3 scripts/libra_colocated_h200.py --out out ...
    #   (after scripts/device/install_{harts,sglang}.sh)
    python3 scripts/libra_colocated_h200.py --device cpu --engine embedded --model tiny-moe --rounds 2 \
        --requests 4 --new-tokens 8 --out /tmp/libra_dry      # CPU dry run of the control flow
"""
from __future__ import annotations

import argparse
import logging
import shlex
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import libra_calibrate_h200 as calib  # noqa: E402  (Deadline, engine_env, calibrate, write_json)

log = logging.getLogger("libra_colocated")

MEDIAN_KEYS = ("to_training_s", "to_rollout_s", "drain_s", "pause_s", "release_s", "onload_s", "offload_s",
               "trainer_free_s", "resume_s", "push_s", "continue_s", "rollout_s", "train_s", "export_s", "round_s")


def _mem(device: str) -> dict:
    """Free GPU memory (device-wide, GiB) and this process's reserved / allocated (GiB)."""
    if device == "cpu":
        return {}
    import torch
    torch.cuda.synchronize()
    return {"free": torch.cuda.mem_get_info()[0] / 2 ** 30, "reserved": torch.cuda.memory_reserved() / 2 ** 30,
            "allocated": torch.cuda.memory_allocated() / 2 ** 30}


def _sync(device: str) -> None:
    if device != "cpu":
        import torch
        torch.cuda.synchronize()


def _move_trainer(trainer, device: str) -> None:
    """Parameters, gradients and AdamW state of ``trainer`` to ``device`` (offload / onload). AdamW's
    ``step`` counters stay where torch keeps them (host, for the non-capturable optimizer)."""
    import torch
    trainer.model.to(device)
    for st in trainer.opt.state.values():
        for k, v in st.items():
            if torch.is_tensor(v) and k != "step":
                st[k] = v.to(device, non_blocking=False)
    if device == "cpu":
        torch.cuda.empty_cache()
    torch.cuda.synchronize()


def _wait_idle(engine, timeout: float = 60.0) -> None:
    """Until ``/flush_cache`` succeeds (the scheduler is fully idle). SGLang's release asserts an
    idle scheduler and the assertion kills the scheduler process; an in-place pause freezes the
    loop before it clears its last (finished) batch, so this must come before the pause."""
    from megatron_harts.rollout.types import EngineError
    t_end = time.monotonic() + timeout
    while True:
        try:
            engine._call("POST", "/flush_cache?timeout=10", timeout=30.0, retries=0)
            return
        except EngineError as e:
            if time.monotonic() > t_end:
                raise EngineError(f"server not idle after {timeout:g} s: {e}") from None
            time.sleep(0.05)


def _mismatch(trainer, prompts, gens, n: int = 8) -> dict:
    """|trainer - engine| log-probs (nats) over the generated tokens of the first ``n`` generations."""
    import numpy as np

    from megatron_harts.tree import make_trajectory
    trajs, spans = [], []
    for i, (p, g) in enumerate(zip(prompts, gens)):
        if len(trajs) == n:
            break
        if not g.output_ids or len(g.logprobs) != len(g.output_ids):
            continue
        toks = list(p) + list(g.output_ids)
        mask = np.zeros(len(toks), dtype=bool)
        mask[len(p):] = True
        trajs.append(make_trajectory(i, toks, traj_id=f"chk{i}", group_id=f"chk{i}", loss_mask=mask, advantage=0.0))
        spans.append((len(p), np.asarray(g.logprobs, dtype=np.float64)))
    if not trajs:
        return {"logprob_mismatch_mean": None, "logprob_mismatch_max": None}
    lps = trainer.logprobs(trajs)
    d = np.concatenate([np.abs(lp[P - 1:P - 1 + len(e)].astype(np.float64) - e) for lp, (P, e) in zip(lps, spans)])
    return {"logprob_mismatch_mean": float(np.mean(d)), "logprob_mismatch_max": float(np.max(d)),
            "logprob_mismatch_tokens": int(d.size)}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="out")
    ap.add_argument("--model", default="small-moe")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--prompt-tokens", type=int, default=256)
    ap.add_argument("--mem-fraction-static", type=float, default=0.5)
    ap.add_argument("--engine-args", default="--disable-cuda-graph")
    ap.add_argument("--engine-env", action="append", default=[], help="KEY=VALUE for the SGLang process")
    ap.add_argument("--release-tags", default="", help="comma-separated (weights,kv_cache,cuda_graph); default all")
    ap.add_argument("--offload", action="store_true", help="move the trainer's state to host memory while rolling out")
    ap.add_argument("--weights-dir", default="/dev/shm/libra_colocated")
    ap.add_argument("--deadline-s", type=float, default=0.0,
                    help="wall-time budget of this process: no new round / calibration point once it would not "
                         "fit; the JSON is complete up to there (0: none)")
    ap.add_argument("--startup-timeout", type=float, default=600.0)
    ap.add_argument("--calibrate-batches", default="", help="after the rounds, calibrate on this server (e.g. 1,16,64)")
    ap.add_argument("--calibrate-contexts", default="1024,8192")
    ap.add_argument("--calibrate-short", type=int, default=16)
    ap.add_argument("--calibrate-long", type=int, default=144)
    ap.add_argument("--engine", default="sglang", choices=["sglang", "embedded"], help="embedded: CPU dry run")
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    args = ap.parse_args(argv)
    if args.rounds < 1 or args.requests < 1 or args.new_tokens < 1 or args.prompt_tokens < 2:
        ap.error("--rounds, --requests, --new-tokens >= 1 and --prompt-tokens >= 2")
    if not 0 < args.mem_fraction_static < 1:
        ap.error("--mem-fraction-static must be in (0, 1)")
    if args.offload and args.device == "cpu":
        ap.error("--offload needs --device cuda")
    try:
        cal_batches = calib.parse_ints(args.calibrate_batches)
        cal_contexts = calib.parse_ints(args.calibrate_contexts)
    except ValueError:
        ap.error("--calibrate-batches / --calibrate-contexts: comma-separated integers")
    given = {}
    for kv in args.engine_env:
        if "=" not in kv:
            ap.error(f"--engine-env: KEY=VALUE, got {kv!r}")
        k, v = kv.split("=", 1)
        given[k] = v
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s", datefmt="%H:%M:%S")
    dl = calib.Deadline(args.deadline_s, log)
    calib.sigterm_raises()
    argv_rec = sys.argv[1:] if argv is None else list(argv)
    dl.phase("start", argv=" ".join(argv_rec))
    import numpy as np
    import torch
    dev = args.device
    if dev == "cuda" and not torch.cuda.is_available():
        print("libra_colocated_h200: needs a CUDA GPU (this script is for the H200; --device cpu --engine "
              "embedded is the dry run)", file=sys.stderr)
        return 2
    try:
        import triton
        triton_version = triton.__version__
    except ImportError:
        triton_version = None
    if dev == "cuda" and triton_version and tuple(int(x) for x in triton_version.split(".")[:2]) < (3, 7):
        log.warning("trainer runs on Triton %s: fla needs >= 3.7.1 on Hopper (PYTHONPATH=/tmp/harts_site first?)",
                    triton_version)

    from megatron_harts.rollout.engines import EmbeddedServer, SGLangServer
    from megatron_harts.rollout.trainer import HartsTrainer
    from megatron_harts.rollout.types import EngineError, SamplingParams
    from megatron_harts.rollout.weight_sync import WeightSync, model_config
    from megatron_harts.workloads import AgenticConfig, agentic_batch

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    json_path = out / "libra_colocated.json"
    hf = model_config(args.model)
    vocab = int(hf["vocab_size"])
    tags = [t for t in args.release_tags.split(",") if t] or None
    meta = {"simulated": False, "device": torch.cuda.get_device_name() if dev == "cuda" else "cpu",
            "model": args.model, "offload": args.offload, "argv": argv_rec, "engine": args.engine,
            "engine_args": args.engine_args, "release_tags": tags or "all", "torch": torch.__version__,
            "trainer_triton": triton_version, "requests": args.requests, "new_tokens": args.new_tokens}
    rows: list[dict] = []
    res = {"meta": meta, "rows": rows, "median": {}, "complete": False, "stopped": None}

    def save() -> None:
        if rows:
            res["median"] = {k: statistics.median(r[k] for r in rows) for k in MEDIAN_KEYS
                             if all(k in r for r in rows)}
        res["phase_s"] = round(dl.elapsed(), 2)
        calib.write_json(json_path, res)

    server = None
    try:
        dl.phase("trainer build")
        trainer = HartsTrainer(hf, device=dev, attention_backend="torch", lr=1e-5)
        sync = WeightSync(hf, args.weights_dir, keep=2)
        trajs = agentic_batch(AgenticConfig(num_groups=4, group_size=8, vocab_size=vocab, seed=0))
        dl.phase("trainer warm-up step (kernels, allocator)")
        t = time.perf_counter()
        trainer.train_step(trajs)
        _sync(dev)
        meta["warmup_train_s"] = time.perf_counter() - t
        t = time.perf_counter()
        path, _ = sync.export(trainer.model, "v0")     # after the warm-up: the engine starts on the trainer's weights
        meta["first_export_s"] = time.perf_counter() - t
        if args.offload:
            _move_trainer(trainer, "cpu")
        if dev == "cuda":
            torch.cuda.empty_cache()       # SGLang sizes its KV pool from the free memory at its start
        meta["mem_before_engine"] = _mem(dev)
        save()
        if args.engine == "sglang":
            env = calib.engine_env(given, memory_saver=True)
            meta["engine_env"] = env
            dl.phase("sglang start (--enable-memory-saver)", engine_args=args.engine_args)
            server = SGLangServer(path, mem_fraction_static=args.mem_fraction_static, weight_version="v0",
                                  enable_memory_saver=True, extra_args=shlex.split(args.engine_args), env=env,
                                  startup_timeout=max(60.0, min(args.startup_timeout, dl.left() - 30)),
                                  log_path=str(out / "sglang_colocated.log"))
        else:       # the CPU dry run: the embedded engine imports this repo (not pip-installed)
            import os
            root = str(Path(__file__).resolve().parents[1])
            env = {"PYTHONPATH": os.pathsep.join(x for x in (root, os.environ.get("PYTHONPATH")) if x), **given}
            server = EmbeddedServer(path, weight_version="v0", env=env, log_path=str(out / "embedded_colocated.log"))
        rounds = args.rounds
        try:
            server.start()
        except EngineError as e:
            res["error"] = f"engine start: {e}"[:4000]
            save()
            if not (cal_batches and args.engine == "sglang" and dl.left() > 150):
                raise
            # e.g. torch_memory_saver failing in the scheduler: the calibration needs no memory saver
            log.error("SGLang with --enable-memory-saver did not start (%s); calibration only, without it", e)
            dl.phase("fallback: sglang start without memory saver (no rounds)")
            rounds, meta["fallback"] = 0, "memory saver start failed; no rounds, calibration on a plain server"
            server = SGLangServer(path, mem_fraction_static=args.mem_fraction_static, weight_version="v0",
                                  extra_args=shlex.split(args.engine_args),
                                  env=calib.engine_env(given, memory_saver=False),
                                  startup_timeout=max(60.0, min(args.startup_timeout, dl.left() - 60)),
                                  log_path=str(out / "sglang_plain.log")).start()
        meta["engine_start_s"] = server.startup_s
        meta["mem_engine_up"] = _mem(dev)
        dl.phase("engine up", startup_s=f"{server.startup_s:.1f}")
        engine = server.engine(timeout=max(60.0, min(600.0, dl.left())))
        rng = np.random.default_rng(0)
        prompts = [[int(x) for x in rng.integers(10, vocab - 10, size=args.prompt_tokens)]
                   for _ in range(args.requests)]
        save()
        st = {"paused": False, "released": False, "version": "v0", "path": path}   # the engine's state

        def one_round(r: int) -> dict:
            dl.phase("round", r=r)
            t_round = time.perf_counter()
            row = {"round": r, "simulated": False}
            t = time.perf_counter()
            with ThreadPoolExecutor(args.requests) as ex:
                gens = list(ex.map(lambda p: engine.generate(
                    p, SamplingParams(max_new_tokens=args.new_tokens, temperature=1.0)), prompts))
            row["rollout_s"] = time.perf_counter() - t
            row["rollout_tokens"] = sum(len(g.output_ids) for g in gens)
            row["served_version"] = sorted({str(g.weight_version) for g in gens})
            row["served_expected"] = row["served_version"] == [st["version"]]
            # -> training
            row["mem_before_release"] = _mem(dev)
            t = time.perf_counter()
            _wait_idle(engine)
            row["drain_s"] = time.perf_counter() - t
            t = time.perf_counter()
            engine.pause("in_place")
            st["paused"] = True
            row["pause_s"] = time.perf_counter() - t
            t = time.perf_counter()
            engine.release_memory(tags)
            st["released"] = True
            row["release_s"] = time.perf_counter() - t
            row["mem_after_release"] = _mem(dev)
            if dev == "cuda":
                row["release_freed_gib"] = row["mem_after_release"]["free"] - row["mem_before_release"]["free"]
                if row["release_freed_gib"] < 1.0:
                    log.warning("release freed only %.2f GiB: is torch_memory_saver active in SGLang? (its log: %s)",
                                row["release_freed_gib"], server.log_path)
            t = time.perf_counter()
            if args.offload:
                _move_trainer(trainer, "cuda")
            row["onload_s"] = time.perf_counter() - t
            row["to_training_s"] = row["drain_s"] + row["pause_s"] + row["release_s"] + row["onload_s"]
            t = time.perf_counter()
            row.update(_mismatch(trainer, prompts, gens))
            row["check_s"] = time.perf_counter() - t
            t = time.perf_counter()
            m = trainer.train_step(trajs)
            _sync(dev)
            row["train_s"] = time.perf_counter() - t
            row["loss"] = float(m["loss"])
            row["mem_after_train"] = _mem(dev)
            version = f"v{r + 1}"
            t = time.perf_counter()
            path, stats = sync.export(trainer.model, version)
            st["path"] = path
            row["export_s"] = time.perf_counter() - t
            row["export_bytes"] = getattr(stats, "bytes", None)
            # -> rollout
            t = time.perf_counter()
            if args.offload:
                _move_trainer(trainer, "cpu")
            row["offload_s"] = time.perf_counter() - t
            t = time.perf_counter()
            if dev == "cuda":
                torch.cuda.empty_cache()   # the trainer's cached blocks back to the driver before SGLang remaps
            _sync(dev)
            row["trainer_free_s"] = time.perf_counter() - t
            row["mem_before_resume"] = _mem(dev)
            t = time.perf_counter()
            engine.resume_memory(tags)
            st["released"] = False
            row["resume_s"] = time.perf_counter() - t
            t = time.perf_counter()
            engine.update_weights_from_disk(path, version)
            st["version"] = version
            row["push_s"] = time.perf_counter() - t
            t = time.perf_counter()
            engine.resume()
            st["paused"] = False
            row["continue_s"] = time.perf_counter() - t
            row["to_rollout_s"] = (row["offload_s"] + row["trainer_free_s"] + row["resume_s"] + row["push_s"]
                                   + row["continue_s"])
            row["mem_after_resume"] = _mem(dev)
            served = engine.weight_version()
            if served != version:
                raise RuntimeError(f"engine serves {served!r} after pushing {version!r}")
            row["round_s"] = time.perf_counter() - t_round
            return row

        for r in range(rounds):
            est = max((x["round_s"] for x in rows), default=15.0)    # the first round: a guess
            if est > dl.left() - 15:        # 15 s kept for the engine's stop and the JSON
                res["stopped"] = "deadline"
                dl.phase("rounds: stop (deadline)", next_round=r, est_s=f"{est:.0f}")
                break
            try:
                row = one_round(r)
            except Exception as e:      # noqa: BLE001 - keep what ran, bring the engine back for the calibration
                res["round_error"] = f"round {r}: {type(e).__name__}: {e}"[:2000]
                res["stopped"] = "error"
                res["engine_log_tail"] = server.log_tail(40) if hasattr(server, "log_tail") else ""
                log.error("%s", res["round_error"])
                save()
                for what, fn in (("resume_memory", lambda: st["released"] and engine.resume_memory(tags)),
                                 ("push", lambda: engine.update_weights_from_disk(st["path"], st["version"])),
                                 ("continue", lambda: st["paused"] and engine.resume())):
                    try:
                        fn()
                    except Exception as e2:      # noqa: BLE001
                        log.error("recovery %s failed: %s", what, e2)
                res["engine_healthy_after_error"] = engine.health(timeout=30.0)
                break
            rows.append(row)
            save()
            fr = lambda k: row.get(k, {}).get("free", float("nan"))
            log.info("round %d: to training %.3f s (release %.3f), to rollout %.3f s (resume %.3f, push %.3f), "
                     "free %.1f -> %.1f -> %.1f GiB, mismatch mean %s max %s, round %.1f s", r, row["to_training_s"],
                     row["release_s"], row["to_rollout_s"], row["resume_s"], row["push_s"], fr("mem_before_release"),
                     fr("mem_after_release"), fr("mem_after_resume"), row["logprob_mismatch_mean"],
                     row["logprob_mismatch_max"], row["round_s"])
        else:
            res["complete"] = rounds == args.rounds
        save()
        if cal_batches and res.get("engine_healthy_after_error", True):
            dl.phase("calibration on this server", batches=cal_batches, contexts=cal_contexts)
            cap = int(hf.get("max_position_embeddings") or 0) - args.calibrate_long - 8
            ctxs = sorted({min(c, cap) for c in cal_contexts}) if cap > 0 else cal_contexts
            cmeta = {"model": args.model, "argv": argv_rec, "batches": cal_batches, "contexts": ctxs,
                     "from": "libra_colocated_h200 (its server, after the rounds)",
                     "engine_start_s": server.startup_s, "engine_args": args.engine_args,
                     "enable_memory_saver": args.engine == "sglang" and rounds > 0}
            try:
                cres = calib.calibrate(server.url, vocab, batches=cal_batches, contexts=ctxs,
                                       short=args.calibrate_short, long=args.calibrate_long,
                                       out_path=out / "libra_calibration.json", deadline=dl, meta=cmeta)
                calib.fit_and_print(cres, str(out / "libra_calibration.json"))
            except Exception as e:      # noqa: BLE001 - the switch results stand on their own
                log.error("calibration failed: %s: %s", type(e).__name__, e)
                res["calibration_error"] = f"{type(e).__name__}: {e}"[:500]
    except BaseException as e:
        res["error"] = f"{type(e).__name__}: {e}"[:2000]
        if server is not None and hasattr(server, "log_tail"):
            res["engine_log_tail"] = server.log_tail(40)
        raise
    finally:
        if server is not None:
            dl.phase("engine stop")
            server.stop()
        save()
        dl.phase("end", rounds=len(rows), complete=res["complete"])
    if rows:
        print(f"{'part':<16}{'median s':>10}")
        for k, v in res["median"].items():
            print(f"{k:<16}{v:>10.3f}")
    return 0 if rows else 1


if __name__ == "__main__":
    sys.exit(main())
