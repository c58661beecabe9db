"""Host (Python + torch dispatch) cost of the tree GDN op on CPU, kernels as no-ops (bench only).

Triton's real GPU launch path runs, up to the C launcher: fla's ``triton.heuristics`` and
autotuners, ``JITFunction.run`` (binder, specialisation, kernel cache), with a fake CUDA driver
whose compiled kernels do nothing (``kernel.run`` is a no-op, autotuning picks the first config
without benchmarking). torch ops run on CPU tensors for real (small sizes, so mostly dispatch).
Outputs are garbage; only the host time counts. Must run in a fresh process (fla must not be
imported before, nor ``TRITON_INTERPRET=1``).

    PYTHONPATH=. python scripts/tree_gdn_host_cpu.py [--reps 50] [--json out.json]

Round loops: the forward recurrence (``fwd``), and the backward's recomputed states plus the
state gradients (``bwd``), reference (previous) loops vs the current ones; whole op: one
``TreeGatedDeltaRuleFla`` forward + backward (its CPU gathers at these tiny widths included).
``launch=no_fast``: the current loops with every launch through fla's heuristics and autotuner.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def install_fake_triton_driver() -> None:
    """Triton's launch path as on an sm90 GPU, with no-op kernels (no compilation, no GPU)."""
    if os.environ.get("TRITON_INTERPRET") == "1":
        raise RuntimeError("unset TRITON_INTERPRET: the fake driver replaces the compiled launch path")
    import fla.modules  # noqa: F401  (imported on the CPU first: fla reads the platform at import)
    import fla.ops  # noqa: F401
    from triton.backends.compiler import GPUTarget
    from triton.runtime import autotuner, jit
    from triton.runtime.driver import driver

    class _Kernel:
        def launch_metadata(self, *a):
            return None

        def run(self, *a):
            return None

        function = packed_metadata = None

    class _Driver:
        def get_current_device(self):
            return 0

        def get_current_stream(self, device=None):
            return 0

        def get_current_target(self):
            return GPUTarget("cuda", 90, 32)

        def get_active_torch_device(self):
            import torch
            return torch.device("cpu")

    driver.set_active(_Driver())

    def do_compile(self, key, signature, device, constexprs, options, attrs, warmup):
        k = _Kernel()
        self.device_caches[device][0][key] = k
        return k
    jit.JITFunction._do_compile = do_compile
    autotuner.Autotuner.prune_configs = lambda self, kwargs: self.configs[:1]


def tau_like_pack(seed: int = 1, chunk_size: int = 64, capacity: int = 65536, which: int = 0):
    """HARTS microbatch ``which`` of bench_e2e's tau-like batch (8 tasks), on the host."""
    from scripts.bench_tree_gdn_host import tau_like_packs
    return tau_like_packs(seed, chunk_size, capacity, which)[0]


def _median_ms(fn, reps: int) -> dict:
    for _ in range(3):
        fn()
    ts = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        ts.append(1e3 * (time.perf_counter() - t0))
    return dict(median=statistics.median(ts), min=min(ts), max=max(ts))


def measure(pk, reps: int, heads: int = 1, dim: int = 16, fast_launch: bool = True) -> dict:
    """Host ms (median / min / max of ``reps``) of the tree GDN op's round loops and of the whole
    op forward / backward, new and reference, on ``pk`` (kernels are no-ops: shapes barely matter,
    tiny ones keep the CPU torch ops to dispatch)."""
    import torch

    from megatron_harts.ops import fla_rounds as F
    fr = F.fused_rounds(pk, 64)
    F.FAST_LAUNCH = fast_launch
    N, T, H, D = int(fr.all.tokens.stop), pk.num_tokens, heads, dim
    mk = lambda *s, dt=torch.bfloat16: torch.randn(*s, dtype=dt)   # noqa: E731
    q, k, w, u, do, dv = (mk(1, N, H, D) for _ in range(6))
    gc = mk(1, N, H, dt=torch.float32)
    scale = D ** -0.5
    def new_bwd():
        F._round_states(k, w, u, gc, fr)
        F._round_state_grads(q, k, w, do, dv, gc, fr, scale)

    def reference_bwd():
        inits = F._round_states_reference(k, w, u, gc, fr, keep_inits=True)[2]
        F._round_state_grads_reference(q, k, w, do, dv, gc, inits, fr, scale)
    loops = {"new": {"fwd": lambda: F._round_states(k, w, u, gc, fr), "bwd": new_bwd},
             "reference": {"fwd": lambda: F._round_states_reference(k, w, u, gc, fr, keep_inits=False),
                           "bwd": reference_bwd}}
    res = {"rounds": len(fr.rounds), "sequences": fr.seq_counts, "tokens": T, "fast_launch": fast_launch}
    for side, fns in loops.items():
        res[f"loops_{side}"] = {ph: _median_ms(fn, reps) for ph, fn in fns.items()}
    xs = [mk(T, H, D), mk(T, H, D), mk(T, H, D), mk(T, H, dt=torch.float32), torch.rand(T, H).to(torch.bfloat16)]
    dy = mk(T, H, D)
    for side in ("new", "reference"):
        leaves = [x.clone().requires_grad_() for x in xs]

        def op():
            with F.reference_round_loops() if side == "reference" else contextlib.nullcontext():
                F.TreeGatedDeltaRuleFla.apply(*leaves, fr, scale, True).backward(dy)
        res[f"op_fwd_bwd_{side}"] = _median_ms(op, reps)
    return res


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--reps", type=int, default=50)
    ap.add_argument("--json")
    args = ap.parse_args(argv)
    install_fake_triton_driver()
    import torch
    torch.set_num_threads(1)
    torch.manual_seed(0)
    out = {}
    for which in (0, 1):
        pk = tau_like_pack(which=which)
        out[f"tau_mb{which}"] = {fl: measure(pk, args.reps, fast_launch=fl == "fast")
                                 for fl in ("fast", "no_fast")}
    for name, r in out.items():
        for fl, m in r.items():
            R = m["rounds"]
            f = lambda d: f"{d['min']:.3f} ({d['median']:.3f})"    # noqa: E731
            print(f"{name} ({m['tokens']} tokens, {R} rounds) launch={fl}: round loops ms/call, min (median), "
                  f"reference -> new: fwd {f(m['loops_reference']['fwd'])} -> {f(m['loops_new']['fwd'])}, "
                  f"bwd (recomputed states + grads) {f(m['loops_reference']['bwd'])} -> {f(m['loops_new']['bwd'])}"
                  f"; whole op fwd+bwd {f(m['op_fwd_bwd_reference'])} -> {f(m['op_fwd_bwd_new'])}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)
    return out


if __name__ == "__main__":
    main()
