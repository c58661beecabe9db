"""What emptying the CUDA caching allocator before a training step costs: the time to allocate a
step's activation footprint anew (the driver maps new memory) against taking it from the cache.

bench_e2e's fresh-batch rows before 2026-12-05 called ``torch.cuda.empty_cache()`` before every timed
step of each side; Megatron keeps the cache across iterations (``--empty-unused-memory-level 0``).
This measures the difference without a model: ``--gib`` GiB in tensors of ``--tensor-mib`` MiB each
(activations of a 13K-token pack of the 1.48B model are ~50 MiB tensors, 54 GiB at peak without
recomputation), each written once (a kernel per tensor, as the forward would), then freed; pass 1
after ``empty_cache()``, pass 2 from the cache. One subprocess per allocator setting (the setting is
read at CUDA initialisation).

    python3 scripts/bench_alloc.py --out alloc.json [--gib 54 --tensor-mib 50 --reps 3]

JSON: per setting (``expandable_segments:True`` / ``False``), per repetition, ms of the cold pass
(after ``empty_cache``) and of the warm pass (cache kept), and their medians.
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import time


def one_setting(gib: float, tensor_mib: int, reps: int) -> dict:
    import torch

    if not torch.cuda.is_available():
        raise SystemExit("bench_alloc.py: needs a CUDA device (torch.cuda.is_available() is False)")
    n = max(1, int(gib * 1024 / tensor_mib))
    numel = tensor_mib * 2**20 // 2                       # bf16 elements

    def fill() -> float:
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        xs = []
        for _ in range(n):
            x = torch.empty(numel, dtype=torch.bfloat16, device="cuda")
            x.fill_(1.0)
            xs.append(x)
        torch.cuda.synchronize()
        ms = 1e3 * (time.perf_counter() - t0)
        del xs
        return ms

    fill()                                                 # CUDA context, kernels loaded
    cold, warm = [], []
    for _ in range(reps):
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        cold.append(fill())
        warm.append(fill())
    return dict(tensors=n, tensor_mib=tensor_mib, gib=n * tensor_mib / 1024, cold_ms=cold, warm_ms=warm,
                cold_ms_median=statistics.median(cold), warm_ms_median=statistics.median(warm),
                reserved_gib=torch.cuda.memory_reserved() / 2**30, device=torch.cuda.get_device_name())


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True, help="JSON file to write")
    ap.add_argument("--gib", type=float, default=54.0, help="footprint per pass, GiB")
    ap.add_argument("--tensor-mib", type=int, default=50, help="size of each tensor, MiB")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--child", choices=["True", "False"], help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.gib <= 0 or args.tensor_mib <= 0 or args.reps < 1:
        ap.error("--gib and --tensor-mib must be > 0, --reps >= 1")
    if args.child:
        print(json.dumps(one_setting(args.gib, args.tensor_mib, args.reps)))
        return 0
    res = {}
    for setting in ("True", "False"):
        env = dict(os.environ, PYTORCH_CUDA_ALLOC_CONF=f"expandable_segments:{setting}")
        p = subprocess.run([sys.executable, __file__, "--out", args.out, "--gib", str(args.gib), "--tensor-mib",
                            str(args.tensor_mib), "--reps", str(args.reps), "--child", setting],
                           env=env, capture_output=True, text=True)
        if p.returncode != 0:
            print(p.stderr.strip().splitlines()[-1] if p.stderr.strip() else f"child exit {p.returncode}",
                  file=sys.stderr)
            return 1
        r = json.loads(p.stdout.strip().splitlines()[-1])
        res[f"expandable_segments:{setting}"] = r
        print(f"expandable_segments:{setting}: {r['gib']:.1f} GiB in {r['tensors']} tensors: "
              f"after empty_cache {r['cold_ms_median']:.1f} ms, from the cache {r['warm_ms_median']:.1f} ms "
              f"(median of {args.reps})", flush=True)
    with open(args.out, "w") as f:
        json.dump(res, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
