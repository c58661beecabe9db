#!/usr/bin/env python
"""Measure SGLang decode tokens/s vs batch and context (and the prefill rate) for Libra's rollout
cost model. WRITTEN FOR THE H200, NOT RUN YET.

For each (batch B, prompt length L): B concurrent ``/generate`` requests of random prompts with
``ignore_eos``, once with ``--short`` and once with ``--long`` new tokens; the decode rate is
``B x (long - short) / (t_long - t_short)`` (the prefill and request overheads cancel), at mean
context ``L + (short + long) / 2``. Prefill: one request of the longest prompt with 1 new token.
Writes ``<out>/libra_calibration.json`` (``{"points": [[B, ctx, tokens/s], ...], "prefill_tok_s"}``),
which ``costs.load_rollout_points`` + ``costs.fit_rollout_cost(points, fit_context=True)`` read:

    PYTHONPATH=/tmp/harts_site:$PWD python3 scripts/libra_calibrate_h200.py --out out \
        --engine-env PYTHONPATH=/tmp/site --model small-moe
    python scripts/bench_libra.py --calibration out/libra_calibration.json
"""
from __future__ import annotations

import argparse
import json
import logging
import shlex
import sys
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

log = logging.getLogger("libra_calibrate")


def _post(url: str, body: dict, timeout: float = 600.0) -> dict:
    req = urllib.request.Request(url + "/generate", data=json.dumps(body).encode(), method="POST",
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return json.loads(r.read())


def _wave(url: str, prompts: list[list[int]], new_tokens: int) -> float:
    """Seconds for all ``prompts`` generating ``new_tokens`` each, concurrently."""
    sp = {"max_new_tokens": new_tokens, "ignore_eos": True, "temperature": 1.0}
    t = time.perf_counter()
    with ThreadPoolExecutor(len(prompts)) as ex:
        outs = list(ex.map(lambda p: _post(url, {"input_ids": p, "sampling_params": sp}), prompts))
    dt = time.perf_counter() - t
    got = [len(o.get("output_ids", [])) for o in outs]
    if min(got) != new_tokens:
        raise RuntimeError(f"expected {new_tokens} tokens per request, got {min(got)}..{max(got)}")
    return dt


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="out")
    ap.add_argument("--model", default="small-moe", help="weight_sync preset (random weights) or a checkpoint dir")
    ap.add_argument("--batches", default="1,8,32,64,128,256")
    ap.add_argument("--contexts", default="2048,8192,32768")
    ap.add_argument("--short", type=int, default=16)
    ap.add_argument("--long", type=int, default=144)
    ap.add_argument("--mem-fraction-static", type=float, default=0.8)
    ap.add_argument("--engine-args", default="")
    ap.add_argument("--engine-env", action="append", default=[], help="KEY=VALUE for the SGLang process")
    args = ap.parse_args(argv)
    try:
        batches = [int(x) for x in args.batches.split(",")]
        contexts = [int(x) for x in args.contexts.split(",")]
    except ValueError:
        ap.error("--batches / --contexts: comma-separated integers")
    if min(batches) < 1 or min(contexts) < 1 or not 0 < args.short < args.long:
        ap.error("--batches, --contexts >= 1 and 0 < --short < --long")
    env = {}
    for kv in args.engine_env:
        if "=" not in kv:
            ap.error(f"--engine-env: KEY=VALUE, got {kv!r}")
        k, v = kv.split("=", 1)
        env[k] = v
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    import numpy as np

    from megatron_harts.rollout.engines import SGLangServer
    from megatron_harts.rollout.weight_sync import PRESETS, model_config, save_hf_checkpoint

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if args.model in PRESETS:
        sys.modules.setdefault("fla", None)
        import torch
        from transformers import Qwen3NextConfig, Qwen3NextForCausalLM
        hf = model_config(args.model)
        torch.manual_seed(0)
        model = Qwen3NextForCausalLM(Qwen3NextConfig(**hf))
        path = str(out / f"calib_{args.model}")
        save_hf_checkpoint(path, model.state_dict(), hf, version="calib", overwrite=True, dtype="bfloat16")
        vocab = int(hf["vocab_size"])
        del model
    else:
        path = args.model
        vocab = int(json.loads((Path(path) / "config.json").read_text())["vocab_size"])
    server = SGLangServer(path, mem_fraction_static=args.mem_fraction_static, extra_args=shlex.split(args.engine_args),
                          env=env, log_path=str(out / "sglang_calibrate.log")).start()
    rng = np.random.default_rng(0)
    points, rows = [], []
    try:
        url = server.url
        _wave(url, [list(map(int, rng.integers(10, vocab - 10, 256)))], 8)          # warm-up
        for L in contexts:
            for B in batches:
                prompts = [list(map(int, rng.integers(10, vocab - 10, L))) for _ in range(B)]
                t_s = _wave(url, prompts, args.short)
                prompts = [list(map(int, rng.integers(10, vocab - 10, L))) for _ in range(B)]   # no prefix-cache reuse
                t_l = _wave(url, prompts, args.long)
                tps = B * (args.long - args.short) / max(t_l - t_s, 1e-9)
                ctx = L + (args.short + args.long) / 2
                points.append([B, ctx, tps])
                rows.append({"batch": B, "prompt": L, "t_short_s": t_s, "t_long_s": t_l, "decode_tok_s": tps})
                log.info("B=%4d L=%6d: %.0f decode tokens/s", B, L, tps)
        L = max(contexts)
        t1 = _wave(url, [list(map(int, rng.integers(10, vocab - 10, L)))], 1)
        prefill = L / t1
    finally:
        server.stop()
    res = {"simulated": False, "model": args.model, "points": points, "prefill_tok_s": prefill, "rows": rows,
           "argv": sys.argv[1:] if argv is None else argv}
    (out / "libra_calibration.json").write_text(json.dumps(res, indent=1))
    from megatron_harts.rollout.libra.costs import fit_rollout_cost
    rc = fit_rollout_cost(points, fit_context=True, prefill_tok_s=prefill, source=str(out / "libra_calibration.json"))
    print(f"a = {rc.a_s * 1e3:.3f} ms, b = {rc.b_s * 1e3:.4f} ms/request, c = {rc.c_s * 1e9:.3f} ns/context token, "
          f"prefill {prefill:.0f} tokens/s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
