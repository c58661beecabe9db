"""End-to-end HARTS vs trajectory-wise training step of a Megatron-Core HybridModel, one process.

Both sides run the same model and weights on the same global batch (GRPO-style rollout groups):
  harts     trees packed per microbatch by ``megatron_harts.planner.plan`` (compact + replay tokens
            <= --capacity), ``pack`` layout (shared prefixes computed once)
  baseline  the same trajectories, each its own chain (``pack`` of un-merged trees = THD packing
            through the same tree layers, which reduce to varlen GDN and, for attention,
            FlashAttention varlen where torch has it, else FlexAttention with the document-causal
            mask), balanced into microbatches of <= --capacity trajectory tokens by LPT on tokens
Every timed step is a new global batch (``--warmup-batches`` batches of other seeds first, then
``--max-steps`` steps of seeds --seed, --seed+1, ...; both sides get the same trajectories): the
step's wall time holds planning, packing, host-to-device copies, per-pack plans / block masks and
forward + backward, reported as min / median / max with the host part separately; speedup from the
medians. ``--same-batch`` is the older protocol (one batch packed before the timing, reused).
Per (model, workload, recompute): forward / backward ms summed over microbatches (gradient time,
optimizer excluded; ``step`` adds one fused AdamW step, lr 0 so weights stay put), trajectory
tokens/s, peak memory (GiB), linear-attention rounds (sum over microbatches of each GDN layer's
varlen calls), per-token log-prob differences HARTS vs baseline and baseline vs a rerun of itself
(trajectories reshuffled across microbatches, forward only) and, when the baseline ran FlashAttention
varlen, baseline vs the baseline on FlexAttention (``flex-b``: the share of the HARTS-baseline
difference that is only the attention kernel, since tree packs run FlexAttention). Targets: speedup >= 0.9 x compression;
>= 5x on swe with recomputation.

Models (bf16, local non-TE ``tree_hybrid_stack_spec``): ``dense`` ~1.5B, hidden 2048,
'G-G-G-*-' x 6 (48 Megatron layers = 24 mixer + 24 MLP, GDN 16/16 heads x 128, GQA 16/4 x 128,
SwiGLU 6144, vocab 32768); ``moe`` hidden 1024, 'GEGEGE*E' x 3, 16 experts top-2 x 1024.
Workloads: ``swe`` (``swe_bench_like``, --swe-groups tasks, trajectories <= --swe-max-tokens),
``tau`` (``tau_bench_like``), ``sweep`` (``sweep_batch`` at --compressions, --sweep-tokens each).
FlexAttention (compiled for static shapes) pads each pack internally to ``ops.attention.flex_length``
tokens (< 1/8 more above 1K tokens) on both sides. ``--pad-multiple N`` instead pads whole packs with a dummy chain
to a multiple of N tokens through every layer (computed, not counted; the runs of 2026-11-29 used
8192, which cost the 10x sweep point 24% of its HARTS time).

    python scripts/bench_e2e.py --out $OUT --models dense --workloads swe --recompute on
    python scripts/bench_e2e.py --plot $OUT/e2e.json [more.json ...] --out docs/benchmarks
    python scripts/bench_e2e.py --device cpu --tiny --out /tmp/e2e     # CPU smoke (fp32, cpu_shim)
"""
from __future__ import annotations

import argparse
import atexit
import collections
import contextlib
import dataclasses
import faulthandler
import gc
import json
import os
import random
import shutil
import statistics
import subprocess
import sys
import threading
import time
import traceback
import warnings

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megatron_harts.megatron import (attention_backend, precompile_tree_attention, tree_hybrid_stack_spec,  # noqa: E402
                                     tree_packed_seq_params)
from megatron_harts.megatron.gpu import HYBRID_1P5B, build_gpu_hybrid_model, init_single_gpu  # noqa: E402
from megatron_harts.ops import chunk_plan, tree_token_logprobs  # noqa: E402
from megatron_harts.ops.fla_autotune import add_save_fla_configs_arg, save_fla_autotune  # noqa: E402
from megatron_harts.packing import pack  # noqa: E402
from megatron_harts.planner import plan  # noqa: E402
from megatron_harts.planner.cost import CostModel  # noqa: E402
from megatron_harts.planner.plan import assign  # noqa: E402
from megatron_harts.tree import RolloutTree, make_trajectory, trees_from_trajectories  # noqa: E402
from megatron_harts import workloads as W  # noqa: E402

RECOMPUTE = dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1)
# name -> (pattern, config overrides); heads/dims of GDN and attention, MLP / MoE widths.
MODELS = {
    "dense": HYBRID_1P5B,
    "moe": ("GEGEGE*E" * 3, dict(hidden_size=1024, ffn_hidden_size=3072, num_attention_heads=8, num_query_groups=2,
                                 kv_channels=128, linear_key_head_dim=128, linear_value_head_dim=128,
                                 linear_num_key_heads=8, linear_num_value_heads=8, num_moe_experts=16,
                                 moe_router_topk=2, moe_ffn_hidden_size=1024, moe_token_dispatcher_type="allgather",
                                 moe_grouped_gemm=False, moe_aux_loss_coeff=1e-3)),
}
TINY = {"dense": ("G-G-*-", dict(hidden_size=64)), "moe": ("GE*E", dict(hidden_size=64, num_moe_experts=4))}


# ------------------------------------------------------------------------------------------------ data

def workload(name: str, args) -> list:
    """Trajectories of a workload name: swe, tau, sweep:<compression>."""
    if args.tiny:
        tiny = dict(num_groups=getattr(args, "tiny_groups", 2), group_size=(3, 4), turns=(2, 4), system_tokens=(20, 40), task_tokens_median=10,
                    task_tokens_max=20, assistant_tokens_median=8, assistant_tokens_range=(2, 20),
                    env_tokens_median=12, env_tokens_range=(2, 40), max_tokens=200, vocab_size=64, seed=args.seed)
        if name.startswith("sweep:"):
            return W.sweep_batch(1024, float(name[6:]), tokens_per_group=512, vocab_size=64, seed=args.seed)
        base = W.SWE_BENCH_LIKE if name == "swe" else W.TAU_BENCH_LIKE
        return W.rollout_trees(dataclasses.replace(base, **tiny))
    if name == "swe":
        return W.swe_bench_like(dataclasses.replace(W.SWE_BENCH_LIKE, num_groups=args.swe_groups,
                                                    max_tokens=args.swe_max_tokens, seed=args.seed))
    if name == "tau":
        return W.tau_bench_like(dataclasses.replace(W.TAU_BENCH_LIKE, num_groups=args.tau_groups, seed=args.seed))
    if name.startswith("sweep:"):
        return W.sweep_batch(args.sweep_tokens, float(name[6:]), seed=args.seed)
    raise ValueError(f"unknown workload {name!r}")


def pad_to(trees: list, multiple: int, vocab: int, rng: np.random.Generator, chains: bool,
           residue: int = 0) -> tuple[list, int]:
    """Trees (a microbatch) plus a dummy chain (loss weight 0) of the fewest tokens that make its token
    count ``residue`` modulo ``multiple`` (default: round it up to a multiple; 0: no padding)."""
    T = sum(t.num_tokens for t in trees) if not chains else sum(len(r) for t in trees for r in t.records)
    pad = (residue - T) % multiple if multiple else 0
    if pad == 0:
        return trees, 0
    dummy = make_trajectory(0, rng.integers(1, vocab, size=pad), traj_id="__pad__", loss_mask=np.zeros(pad, bool))
    return trees + [RolloutTree([dummy], merge_prefixes=not chains)], pad


def plan_side(trajs: list, side: str, args, cost_model, shuffle: int | None = None) -> list[list]:
    """The trees of each microbatch of one side: ``harts`` (planner) or ``baseline`` (chains, LPT on
    tokens; ``shuffle`` = seed of a random trajectory order for the rerun). Empty microbatches left out."""
    if side == "harts":
        trees = trees_from_trajectories(trajs)
        p = plan(trees, dp_size=1, microbatch_capacity=args.capacity, cost_model=cost_model, chunk_size=args.chunk_size)
        return list(filter(None, p.microbatches(trees, 0)))     # the planner may leave a microbatch empty
    order = list(range(len(trajs)))
    if shuffle is not None:
        random.Random(shuffle).shuffle(order)
    lens = np.array([len(trajs[i]) for i in order], np.int64)
    if lens.max() > args.capacity:
        raise ValueError(f"a trajectory of {lens.max()} tokens exceeds --capacity {args.capacity}")
    _, mb, M = assign(lens.astype(np.float64), lens, dp_size=1, capacity=args.capacity, refine=shuffle is None)
    if shuffle is not None:          # rerun: a different composition (round robin of the shuffled order)
        mb = np.arange(len(order)) % M
    return [[RolloutTree([trajs[order[i]] for i in np.flatnonzero(mb == m)], merge_prefixes=False)]
            for m in range(M) if (mb == m).any()]


def device_pack(trees: list, side: str, args, rng: np.random.Generator, device, multiple: int | None = None,
                residue: int = 0) -> tuple[dict, float]:
    """One microbatch's device pack and loss weights: (microbatch dict, seconds of host-to-device
    copies). Padded by :func:`pad_to` to ``residue`` modulo ``multiple`` tokens (default
    ``--pad-multiple``)."""
    multiple = args.pad_multiple if multiple is None else multiple
    trees, pad = pad_to(trees, multiple, args.vocab, rng, chains=side != "harts", residue=residue)
    pk = pack(trees, chunk_size=args.chunk_size)
    rounds = chunk_plan(pk, args.chunk_size).num_rounds      # host plan, shared by the device copy
    real = [r for r in pk.trajectories if r.traj_id != "__pad__"]
    w = [torch.from_numpy(np.asarray(r.loss_mask[1:], np.float32) * np.float32(r.advantage or 0.0))
         for r in pk.trajectories]
    t_copy = time.perf_counter()
    pk, w = pk.to(device), [x.to(device) for x in w]
    copy_s = time.perf_counter() - t_copy
    return dict(pack=pk, weights=w, pad=pad, ids=[r.traj_id for r in pk.trajectories],
                traj_tokens=sum(len(r) for r in real), compact=pk.num_tokens - pad, rounds=rounds), copy_s


def microbatches(trajs: list, side: str, args, cost_model, device, shuffle: int | None = None,
                 times: dict | None = None) -> list[dict]:
    """Device packs of one side (:func:`plan_side`, :func:`device_pack`). ``times`` (if given) gets
    the host milliseconds of ``plan`` (planner / LPT), ``pack`` (tree layout + chunk plans, numpy)
    and ``copy`` (host-to-device copies of packs and loss weights)."""
    rng = np.random.default_rng(args.seed)
    t_plan = time.perf_counter()
    mbs = plan_side(trajs, side, args, cost_model, shuffle)
    t_pack = time.perf_counter()
    out, copy_s = [], 0.0
    for trees in mbs:
        mb, s = device_pack(trees, side, args, rng, device)
        out.append(mb)
        copy_s += s
    if times is not None:
        t_sync = time.perf_counter()
        if device.type == "cuda":
            torch.cuda.synchronize()
        t_end = time.perf_counter()
        copy_s += t_end - t_sync
        times.update(plan=1e3 * (t_pack - t_plan), pack=1e3 * (t_end - t_pack - copy_s), copy=1e3 * copy_s)
    return out


#: Triton specialises a kernel's integer arguments on divisibility by 16 (one compiled variant per
#: class); fla's conv kernels take a pack's token count ``T`` (and multiples of it) as such.
SPECIALISE_MOD = 16
#: the token-count classes warmed up: 0 and 1 mod 16 (an odd ``T`` keeps every ``k * T`` with
#: ``k`` not a multiple of 16 undivisible too; ``T`` >= 17, so never Triton's ``== 1`` case)
SPECIALISE_RESIDUES = (0, 1)


def specialisation_packs(trajs: list, side: str, args, cost_model, device) -> list[dict]:
    """The first microbatch of ``side`` on batch ``trajs``, packed once per residue class of its token
    count that Triton tells apart (``T % 16 == 0`` and ``!= 0``: :data:`SPECIALISE_RESIDUES`), by
    appending a dummy chain (loss weight 0) of the tokens that put ``T`` in that class. A
    warm-up on these compiles both variants of every kernel whose arguments carry ``T``: training
    meets both classes within its first steps, the timed steps of a bench with one warm-up batch of
    one or two HARTS microbatches otherwise might not (the H100 run of 206002d compiled fla's
    ``causal_conv1d_fwd_kernel`` inside a timed HARTS step: 2.7 s against 0.76 s)."""
    rng = np.random.default_rng(args.seed)
    trees = plan_side(trajs, side, args, cost_model)[0]
    return [device_pack(trees, side, args, rng, device, multiple=SPECIALISE_MOD, residue=r)[0]
            for r in SPECIALISE_RESIDUES]


# ------------------------------------------------------------------------------------------------ model

def build_model(name: str, recompute: bool, args, max_len: int):
    """HybridModel with ``tree_hybrid_stack_spec``; bf16 on CUDA, fp32 tiny through cpu_shim on CPU."""
    from megatron_harts.megatron import cpu_shim

    from megatron_harts.moe.layer import TreeMoETransformerLayer

    TreeMoETransformerLayer.dispatcher_backend = getattr(args, "moe_dispatcher", "fast")   # both sides: one model
    pattern, over = (TINY if args.tiny else MODELS)[name]
    over = dict(over, **(RECOMPUTE if recompute else {}))
    if args.device == "cpu":
        cpu_shim.cpu_manual_seed(args.seed)
        spec = tree_hybrid_stack_spec(over.get("num_moe_experts"), grouped_experts=args.grouped_experts)
        return cpu_shim.build_tiny_hybrid_model(pattern, vocab_size=args.vocab, max_sequence_length=max_len,
                                                hybrid_stack_spec=spec, init_method_std=0.1, **over)
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed
    model_parallel_cuda_manual_seed(args.seed)
    return build_gpu_hybrid_model(pattern, args.vocab, max_len, grouped_experts=args.grouped_experts, **over)


def baseline_attention(device) -> str:
    """Attention kernel of the trajectory-wise packs (``ops.attention.chain_pack_backend``)."""
    from megatron_harts.ops.attention import chain_pack_backend

    return chain_pack_backend(device)


def cost_model_for(name: str, args) -> CostModel:
    pattern, o = (TINY if args.tiny else MODELS)[name]
    return CostModel.from_pattern(pattern, o["hidden_size"], ffn_hidden=o.get("ffn_hidden_size"),
                                  moe_ffn_hidden=o.get("moe_ffn_hidden_size"), moe_topk=o.get("moe_router_topk", 2),
                                  num_experts=o.get("num_moe_experts", 0), vocab_size=args.vocab,
                                  chunk_size=args.chunk_size)


# ------------------------------------------------------------------------------------------------ timing

class Clock:
    """CUDA events on GPU, perf_counter on CPU; ``ms(a, b)`` after ``sync()``."""

    def __init__(self, device):
        self.cuda = device.type == "cuda"

    def mark(self):
        if self.cuda:
            e = torch.cuda.Event(enable_timing=True)
            e.record()
            return e
        return time.perf_counter()

    def sync(self):
        if self.cuda:
            torch.cuda.synchronize()

    def ms(self, a, b) -> float:
        return a.elapsed_time(b) if self.cuda else 1e3 * (b - a)


def run_mb(model, mb: dict, norm: float, grad: bool = True):
    """Forward (model + log-probs + loss) of one microbatch; returns (loss, log-probs list)."""
    p = mb["pack"]
    logits = model(p.tokens[None], p.position_ids[None], None, packed_seq_params=tree_packed_seq_params(p))
    lps = tree_token_logprobs(logits[0], p)
    loss = -sum((lp.float() * w).sum() for lp, w in zip(lps, mb["weights"])) / norm
    return loss, lps


def train_step(model, mbs: list[dict], norm: float, clock: Clock, keep_logprobs: bool = False,
               times: dict | None = None):
    """Gradient of one global batch (accumulated over microbatches). Returns fwd ms, bwd ms, and
    {trajectory id: fp32 log-probs} when ``keep_logprobs``. ``times["issued"]``: ``perf_counter``
    seconds when the host had issued the last kernel (before the final device sync)."""
    model.zero_grad(set_to_none=True)
    marks, lp_out = [], {}
    for mb in mbs:
        a = clock.mark()
        loss, lps = run_mb(model, mb, norm)
        b = clock.mark()
        loss.backward()
        marks.append((a, b, clock.mark()))
        if keep_logprobs:
            lp_out.update({i: lp.detach().float() for i, lp in zip(mb["ids"], lps) if i != "__pad__"})
    if times is not None:
        times["issued"] = time.perf_counter()
    clock.sync()
    return (sum(clock.ms(a, b) for a, b, _ in marks), sum(clock.ms(b, c) for _, b, c in marks), lp_out)


@torch.no_grad()
def forward_logprobs(model, mbs: list[dict]) -> dict:
    out = {}
    for mb in mbs:
        _, lps = run_mb(model, mb, 1.0)
        out.update({i: lp.float() for i, lp in zip(mb["ids"], lps) if i != "__pad__"})
    return out


def log(msg: str) -> None:
    """One progress line on stderr (a step stopped by its watchdog still says how far it got)."""
    print(f"[e2e {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def warmup(model, sides: dict[str, list[dict]], norm: float) -> None:
    """fwd+bwd once per distinct microbatch size (compiles fla / FlexAttention for that shape) and a
    forward of every other microbatch (builds its cached plans and block masks). Logs the seconds
    of each first fwd+bwd (compilation shows up there)."""
    seen = set()
    for side, mbs in sides.items():
        for mb in mbs:
            T = mb["pack"].num_tokens
            if T in seen:
                with torch.no_grad():
                    run_mb(model, mb, norm)
            else:
                seen.add(T)
                t0 = time.perf_counter()
                run_mb(model, mb, norm)[0].backward()
                if torch.cuda.is_available():
                    torch.cuda.synchronize()
                log(f"warm-up {side}: {T} tokens fwd+bwd {time.perf_counter() - t0:.1f} s")
    model.zero_grad(set_to_none=True)


def lp_diff(a: dict, b: dict) -> dict:
    """max / mean |a - b| over all tokens of the trajectories in both (nats)."""
    d = torch.cat([(a[k] - b[k]).abs().flatten() for k in b if k in a and b[k].numel()])
    return {"max": float(d.max()), "mean": float(d.mean())}


def opt_ms(model, clock: Clock, reps: int = 3) -> float:
    """Median ms of one AdamW step over all parameters (fused on CUDA; lr 0: weights unchanged)."""
    params = list(model.parameters())
    for p in params:            # a step that failed part way (the sync audit) may have left some without one
        if p.grad is None:
            p.grad = torch.zeros_like(p)
    opt = torch.optim.AdamW(params, lr=0.0, weight_decay=0.0, fused=clock.cuda)
    times = []
    for _ in range(reps + 1):
        a = clock.mark()
        opt.step()
        b = clock.mark()
        clock.sync()
        times.append(clock.ms(a, b))
    del opt
    return statistics.median(times[1:])


def peak_gib(device) -> float:
    return torch.cuda.max_memory_allocated() / 2**30 if device.type == "cuda" else float("nan")


def alloc_counts(device) -> dict:
    """The CUDA caching allocator's running counts (host-side, no sync): ``alloc_retries`` (allocations
    that failed, freed the cached blocks and retried: a synchronising flush) and ``device_allocs`` (new
    segments asked of the driver); a step's delta tells whether it mapped memory anew. ``{}`` on CPU."""
    if device.type != "cuda":
        return {}
    st = torch.cuda.memory_stats(device)
    return dict(alloc_retries=st.get("num_alloc_retries", 0), device_allocs=st.get("num_device_alloc", 0))


_GC = dict(start=0.0, ms=0.0, full=0)     # the interpreter's garbage collections: time in them (ms), full ones


def _gc_clock(phase: str, info: dict) -> None:
    if phase == "start":
        _GC["start"] = time.perf_counter()
    else:
        _GC["ms"] += 1e3 * (time.perf_counter() - _GC["start"])
        _GC["full"] += info.get("generation") == 2


gc.callbacks.append(_gc_clock)


#: Names of the Triton kernels compiled in this process, in order (:func:`count_triton_compiles`).
TRITON_COMPILED: list[str] = []


def count_triton_compiles() -> bool:
    """Record every Triton JIT compilation (a kernel-cache miss of a ``@triton.jit`` function: a new
    kernel, a new specialisation of its arguments, or an autotuner trying its configs; loading a
    kernel from Triton's disk cache counts too) in :data:`TRITON_COMPILED`, through Triton's
    ``knobs.runtime.jit_post_compile_hook``, chained after any hook already set. torch.compile's
    graph count (``compiles``) does not see these: fla's kernels are plain Triton. Returns False
    where this Triton has no such hook (nothing recorded then)."""
    try:
        from triton import knobs
        runtime = knobs.runtime
        prev = runtime.jit_post_compile_hook
    except Exception:                 # no Triton, or one without knobs
        return False
    if getattr(prev, "_harts_counter", False):
        return True

    def hook(*args, **kw):
        TRITON_COMPILED.append(str(getattr(kw.get("fn"), "name", "?")))
        return prev(*args, **kw) if prev is not None else None

    hook._harts_counter = True
    runtime.jit_post_compile_hook = hook
    return True


def stall_counts() -> dict:
    """Host-side running counts of what can stall a step besides the GPU: ``compiles`` (graphs that
    torch.compile / dynamo compiled: FlexAttention, block masks, Megatron's ``jit_fuser`` functions;
    a new one inside a timed step is compilation, not training), ``triton_compiles`` (Triton kernels
    compiled, :func:`count_triton_compiles`: fla's kernels meeting a new specialisation), ``gc_ms`` /
    ``gc_full`` (time in and number of full Python garbage collections), ``thread_cpu_ms`` (CPU time
    of the issuing thread: near the step's wall time, the host computed all along; far below it while
    ``issue_ms`` is near the wall, the host was blocked, e.g. on a full launch queue behind a slow GPU,
    descheduled, or waiting on a compiler's child process such as ``ptxas``).
    A step's delta says which one it met."""
    try:
        from torch._dynamo.utils import counters
        compiles = counters["stats"]["unique_graphs"]
    except Exception:                # dynamo unavailable: not counted
        compiles = 0
    return dict(compiles=compiles, triton_compiles=len(TRITON_COMPILED), gc_ms=_GC["ms"], gc_full=_GC["full"],
                thread_cpu_ms=1e3 * time.thread_time())


# Clock-event ("throttle") reason bits of nvidia-smi's clocks_throttle_reasons.active / clocks_event_reasons.active
CLOCK_EVENTS = {0x1: "idle", 0x2: "app_clocks", 0x4: "sw_power_cap", 0x8: "hw_slowdown", 0x10: "sync_boost",
                0x20: "sw_thermal", 0x40: "hw_thermal", 0x80: "hw_power_brake", 0x100: "display_clocks"}


class GpuSampler:
    """The GPU's SM clock (MHz), temperature (C), power draw (W) and active clock-event ("throttle")
    reasons, sampled every ``period_ms`` by ``nvidia-smi -lms`` in a child process (no NVML binding is
    installed on the device machines) and stamped with ``time.perf_counter()`` as each line arrives.
    :meth:`window` summarises the samples of one timed step: a step slowed by a clocked-down GPU shows
    it (``sm_mhz_min`` low, ``clock_events`` such as ``sw_power_cap`` or ``hw_slowdown``); one that ran
    at full clocks rules the GPU out and leaves the host. ``cmd``: the sampling argv (default
    nvidia-smi; the CPU tests give a stand-in that prints the same CSV lines)."""

    REASON_FIELDS = ("clocks_throttle_reasons.active", "clocks_event_reasons.active")   # older / newer drivers

    def __init__(self, gpu: str = "0", period_ms: int = 100, cmd: list[str] | None = None):
        if cmd is None:
            fields = self.query_fields(gpu)
            cmd = ["nvidia-smi", f"--query-gpu={','.join(fields)}", "--format=csv,noheader,nounits",
                   "-lms", str(period_ms), "-i", gpu]
        self.samples: list[tuple] = []     # (perf_counter s, sm MHz, temperature C, power W, reason bits)
        self._proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, bufsize=1)
        self._thread = threading.Thread(target=self._read, name="gpu-sampler", daemon=True)
        self._thread.start()

    @classmethod
    def query_fields(cls, gpu: str) -> list[str]:
        """The fields this driver's nvidia-smi answers: SM clock, temperature, power and the first
        clock-event field it knows (none if neither)."""
        base = ["clocks.sm", "temperature.gpu", "power.draw"]
        for reasons in cls.REASON_FIELDS:
            r = subprocess.run(["nvidia-smi", f"--query-gpu={','.join(base + [reasons])}",
                                "--format=csv,noheader,nounits", "-i", gpu], capture_output=True, text=True, timeout=30)
            if r.returncode == 0:
                return base + [reasons]
        return base

    @staticmethod
    def parse(line: str) -> tuple | None:
        """``'1980, 45, 312.5, 0x0000000000000004'`` -> (1980.0, 45.0, 312.5, 4); ``[N/A]`` -> None
        for that field; a line that is not such a record -> None."""
        parts = [p.strip() for p in line.strip().split(",")]
        if len(parts) not in (3, 4):
            return None

        def num(p: str) -> float | None:
            try:
                return float(p)
            except ValueError:
                return None
        vals = [num(p) for p in parts[:3]]
        if vals[0] is None and vals[1] is None:
            return None
        reasons = None
        if len(parts) == 4 and parts[3].lower().startswith("0x"):
            try:
                reasons = int(parts[3], 16)
            except ValueError:
                reasons = None
        return (*vals, reasons)

    def _read(self) -> None:
        for line in self._proc.stdout:
            rec = self.parse(line)
            if rec is not None:
                self.samples.append((time.perf_counter(), *rec))

    def window(self, t0: float, t1: float) -> dict:
        """Summary of the samples stamped in [t0, t1] (``perf_counter`` seconds): ``gpu_samples``,
        ``sm_mhz_min`` / ``sm_mhz_max``, ``temp_c_max``, ``power_w_max``, and ``clock_events``: the
        names of every reason active in any sample except ``idle`` (a host-bound step idles the GPU)."""
        xs = [s for s in list(self.samples) if t0 <= s[0] <= t1]
        out: dict = dict(gpu_samples=len(xs))
        for key, i, agg in (("sm_mhz_min", 1, min), ("sm_mhz_max", 1, max), ("temp_c_max", 2, max),
                            ("power_w_max", 3, max)):
            vals = [s[i] for s in xs if s[i] is not None]
            if vals:
                out[key] = agg(vals)
        bits = 0
        for s in xs:
            bits |= s[4] or 0
        out["clock_events"] = [name for bit, name in CLOCK_EVENTS.items() if bits & bit and bit != 0x1]
        return out

    def close(self) -> None:
        if self._proc.poll() is None:
            self._proc.terminate()
            try:
                self._proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                self._proc.kill()
        self._thread.join(timeout=5)


class HostStackSampler:
    """Where the issuing thread is, every ``period_s``: a daemon thread reads that thread's current Python
    frame (``sys._current_frames``) and keeps ``'file:line function'`` of its innermost frame, plus the
    innermost frame in this project's, Megatron's or the bench's own code when that is a different one
    (``'torch/cuda/__init__.py:1040 synchronize < megatron_harts/ops/tree_gdn.py:210 forward'``),
    stamped with ``perf_counter``. :meth:`window` gives a step's most frequent places: a step whose host
    sat blocked (a launch behind a full queue, an allocation, a sync) shows the line it waited on. One
    frame read per period (~tens of microseconds holding the GIL: ~0.1% of a step at 50 ms)."""

    OWN = ("megatron_harts" + os.sep, "megatron" + os.sep, "scripts" + os.sep)

    def __init__(self, thread_id: int | None = None, period_s: float = 0.05):
        self.tid = thread_id if thread_id is not None else threading.main_thread().ident
        self.period_s = period_s
        self.samples: list[tuple[float, str]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="host-stack-sampler", daemon=True)
        self._thread.start()

    @classmethod
    def place(cls, frame) -> str:
        """``'file:line function'`` of ``frame`` (path from its package folder on), and of the innermost
        frame below it in our / Megatron's code if that is another frame."""
        def name(f) -> str:
            path = f.f_code.co_filename
            for marker in ("site-packages" + os.sep, "harts_site" + os.sep):
                if marker in path:
                    path = path.split(marker, 1)[1]
                    break
            else:
                path = os.path.relpath(path) if os.path.isabs(path) else path
            return f"{path}:{f.f_lineno} {f.f_code.co_name}"
        inner, own = frame, None
        f = frame
        while f is not None:
            if any(m in f.f_code.co_filename for m in cls.OWN) and "torch" + os.sep not in f.f_code.co_filename:
                own = f
                break
            f = f.f_back
        return name(inner) if own is None or own is inner else f"{name(inner)} < {name(own)}"

    def _run(self) -> None:
        while not self._stop.wait(self.period_s):
            frame = sys._current_frames().get(self.tid)
            if frame is not None:
                self.samples.append((time.perf_counter(), self.place(frame)))
            del frame

    def window(self, t0: float, t1: float, top: int = 3) -> list[list]:
        """The ``top`` most frequent places among the samples stamped in [t0, t1], as [place, count]."""
        places = collections.Counter(p for t, p in list(self.samples) if t0 <= t <= t1)
        return [[p, n] for p, n in places.most_common(top)]

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)


def slow_step_places(steps: list[dict], factor: float = 1.5) -> list[str]:
    """One line per step slower than ``factor`` x its side's median wall time that has sampled host
    places (``host_places``): ``'step 2: 2036 ms vs median 1206: <place> x12, ...'``."""
    if not steps:
        return []
    med = statistics.median(st["wall_ms"] for st in steps)
    return [f"step {k + 1}: {st['wall_ms']:.0f} ms vs median {med:.0f}: "
            + ", ".join(f"{p} x{n}" for p, n in st["host_places"])
            for k, st in enumerate(steps) if st["wall_ms"] > factor * med and st.get("host_places")]


_SAMPLER: GpuSampler | None = None     # set by main() on CUDA when nvidia-smi is there (--no-step-samplers: off)
_STACKS: HostStackSampler | None = None   # set by main() (--no-step-samplers: off)


def close_step_samplers() -> None:
    """Stop both samplers (the nvidia-smi child too) and forget them; run at the end of ``main`` and at exit."""
    global _SAMPLER, _STACKS
    for sampler in (_SAMPLER, _STACKS):
        if sampler is not None:
            sampler.close()
    _SAMPLER = _STACKS = None


# a run that raises leaves no nvidia-smi behind; after the watchdog's os._exit (no atexit) the child dies
# of SIGPIPE at its next line, its reader gone
atexit.register(close_step_samplers)


def start_gpu_sampler(device) -> GpuSampler | None:
    """A :class:`GpuSampler` for ``device``'s GPU, or None (CPU, no nvidia-smi, or it failed to start;
    logged: the steps then carry no clock fields)."""
    if device.type != "cuda" or shutil.which("nvidia-smi") is None:
        return None
    gpu = os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",")[0].strip() or str(torch.cuda.current_device())
    try:
        return GpuSampler(gpu=gpu)
    except (OSError, subprocess.SubprocessError) as e:
        log(f"GPU clock sampling off: {e}")
        return None


def reset_peak(device, empty_cache: bool = True):
    """Restart the peak-memory count (``max_memory_allocated``: live tensors, not the cache); with
    ``empty_cache`` also hand the allocator's cached blocks back to the driver first."""
    if device.type == "cuda":
        if empty_cache:
            torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()


def profile_step(model, mbs: list[dict], norm: float, clock: Clock, path: str) -> None:
    """torch.profiler table of one global-batch step (kernels and ops by total CUDA time)."""
    from torch.profiler import ProfilerActivity, profile

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if clock.cuda else [])
    with profile(activities=acts) as prof:
        train_step(model, mbs, norm, clock)
    sort = "cuda_time_total" if clock.cuda else "cpu_time_total"
    with open(path, "w") as f:
        f.write(prof.key_averages().table(sort_by=sort, row_limit=40))


def _short_path(path: str) -> str:
    """``.../site-packages/megatron/core/x.py`` -> ``megatron/core/x.py``; this repository's files relative to it."""
    if "site-packages/" in path:
        return path.rsplit("site-packages/", 1)[1]
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    return os.path.relpath(path, root) if path.startswith(root) else path


def sync_sites(fn, cuda: bool = True) -> dict:
    """The host-device synchronisations of ``fn()`` as CUDA reports them
    (``torch.cuda.set_sync_debug_mode("warn")``; ``cuda=False`` only collects the warnings, for tests):
    ``{"count": n, "sites": {"file:line function": n, ...}}``, most frequent first, each site the innermost
    frame outside torch's own Python (this repository, Megatron, fla: the code that asked for the sync)."""
    torch_dir = os.path.dirname(torch.__file__)
    sites: collections.Counter = collections.Counter()

    def show(message, category, filename, lineno, file=None, line=None):
        if "synchroniz" not in str(message).lower():
            return
        frames = [f for f in traceback.extract_stack()[:-1]
                  if not f.filename.startswith(torch_dir) and not f.filename.endswith("warnings.py")]
        f = frames[-1] if frames else None
        sites[f"{_short_path(f.filename)}:{f.lineno} {f.name}" if f else f"{_short_path(filename)}:{lineno}"] += 1

    with warnings.catch_warnings():
        warnings.simplefilter("always")
        warnings.showwarning = show
        if cuda:
            torch.cuda.set_sync_debug_mode("warn")
        try:
            fn()
        finally:
            if cuda:
                torch.cuda.set_sync_debug_mode("default")
    return {"count": sum(sites.values()), "sites": dict(sites.most_common())}


def bench_row(model, model_name: str, recompute: bool, wl: str, trajs: list, args, device) -> dict:
    clock = Clock(device)
    cm = cost_model_for(model_name, args)
    t0 = time.perf_counter()
    sides = {s: microbatches(trajs, s, args, cm, device) for s in ("baseline", "harts")}
    host_s = time.perf_counter() - t0
    norm = float(sum(max(int(np.sum(t.loss_mask)), 0) for t in trajs)) or 1.0
    log(f"{model_name} {wl}: packed in {host_s:.1f} s, microbatches " +
        ", ".join(f"{s} {len(m)}" for s, m in sides.items()))
    warmup(model, sides, norm)
    row = dict(model=model_name, workload=wl, recompute=recompute, trajectories=len(trajs),
               trajectory_tokens=sum(len(t) for t in trajs), host_pack_s=host_s)
    lps = {}
    for side, mbs in sides.items():
        reset_peak(device)
        f, b = [], []
        for step in range(args.max_steps):
            fm, bm, lp = train_step(model, mbs, norm, clock, keep_logprobs=step == 0)
            f.append(fm)
            b.append(bm)
            lps.setdefault(side, lp)
        fwd, bwd = statistics.median(f), statistics.median(b)
        log(f"{model_name} {wl} {side}: fwd {fwd:.0f} ms, bwd {bwd:.0f} ms (median of {len(f)})")
        row[side] = dict(microbatches=len(mbs), compact_tokens=sum(m["compact"] for m in mbs),
                         pad_tokens=sum(m["pad"] for m in mbs), fwd_ms=fwd, bwd_ms=bwd, grad_ms=fwd + bwd,
                         tokens_per_s=row["trajectory_tokens"] / ((fwd + bwd) / 1e3), peak_gib=peak_gib(device),
                         rounds=sum(m["rounds"] for m in mbs), max_rounds=max(m["rounds"] for m in mbs))
    if args.profile:
        for side, mbs in sides.items():
            profile_step(model, mbs, norm, clock, os.path.join(
                args.out, f"profile_{model_name}_{wl.replace(':', '')}_{'rc' if recompute else 'norc'}_{side}.txt"))
    o = opt_ms(model, clock)
    for side in sides:
        row[side]["opt_ms"] = o
        row[side]["step_ms"] = row[side]["grad_ms"] + o
    model.zero_grad(set_to_none=True)
    if args.rerun:
        rerun = forward_logprobs(model, microbatches(trajs, "baseline", args, cm, device, shuffle=args.seed + 1))
        row["lp_diff_rerun"] = lp_diff(rerun, lps["baseline"])
        if baseline_attention(device) == "varlen":       # the tree side runs FlexAttention: kernel noise
            try:
                with attention_backend(model, "flex"):
                    flex = forward_logprobs(model, sides["baseline"])
                row["lp_diff_baseline_flex"] = lp_diff(flex, lps["baseline"])
            except Exception as e:                        # keep the timed row
                row["lp_diff_baseline_flex_error"] = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
                print(f"[e2e] {model_name} {wl}: baseline on FlexAttention failed: {row['lp_diff_baseline_flex_error']}",
                      file=sys.stderr, flush=True)
    row["lp_diff_harts"] = lp_diff(lps["harts"], lps["baseline"])
    row["compression"] = row["trajectory_tokens"] / row["harts"]["compact_tokens"]
    row["speedup"] = row["baseline"]["grad_ms"] / row["harts"]["grad_ms"]
    row["speedup_with_opt"] = row["baseline"]["step_ms"] / row["harts"]["step_ms"]
    row["target"] = 0.9 * row["compression"]
    row["meets_target"] = row["speedup"] >= row["target"] and (wl != "swe" or not recompute or row["speedup"] >= 5)
    return row


def spread(xs: list[float]) -> dict:
    return dict(min=min(xs), median=statistics.median(xs), max=max(xs))


def batch_seeds(args) -> tuple[list[int], list[int]]:
    """Workload seeds of the warm-up batches and of the timed steps (all different: every timed
    step is a new global batch; the first timed batch is the ``--seed`` batch of same-batch runs)."""
    return ([args.seed + 10_000 + i for i in range(args.warmup_batches)],
            [args.seed + k for k in range(args.max_steps)])


def _step_note(st: dict) -> str:
    """``'705 ms (host 9)'``, plus what stalled the step if anything did (compiles, Triton kernels
    compiled, gc, allocator retries, GPU clock events such as a power cap)."""
    extra = [f"{st[k]} {k}" for k in ("compiles", "alloc_retries") if st.get(k)]
    if st.get("triton_compiles"):
        extra.append(f"{st['triton_compiles']} triton_compiles ({', '.join(st.get('triton_kernels') or [])})")
    if st.get("gc_ms", 0) >= 1:
        extra.append(f"gc {st['gc_ms']:.0f} ms")
    if st.get("clock_events"):
        extra.append(f"GPU clocks {st.get('sm_mhz_min', 0):.0f}-{st.get('sm_mhz_max', 0):.0f} MHz, "
                     + "+".join(st["clock_events"]))
    return f"{st['wall_ms']:.0f} ms (host {st['host_ms']:.0f}{'; ' + ', '.join(extra) if extra else ''})"


def timed_steps(model, label: str, batches: dict[int, list], timed: list[int], args, cm, device, clock: "Clock",
                norm_of, empty_cache: bool, side_order: str = "alternate",
                rewarm_seed: int | None = None) -> tuple[dict, dict, dict]:
    """The timed global-batch steps of a fresh-batch row: for each seed of ``timed``, both sides plan,
    pack, copy and run forward + backward on that batch. ``side_order``: ``alternate`` (step by step,
    the side that goes first alternates; both sides' cached blocks share the allocator) or
    ``blocked`` (all of the baseline's steps, then all of HARTS's, as two training jobs would run:
    before each side the cache is emptied and one untimed step on the ``rewarm_seed`` batch refills
    it with that side's blocks alone). ``empty_cache``: return the allocator's cached blocks to the
    driver before each side's step (every step then allocates its activations anew). Each step records
    the allocator's ``alloc_retries`` and ``device_allocs`` during it (CUDA, :func:`alloc_counts`), and
    the graphs compiled, garbage-collection time and the issuing thread's CPU time in it
    (:func:`stall_counts`), where the host thread was (:class:`HostStackSampler`; a step over 1.5x its
    side's median logs them) and, on CUDA, the GPU's clocks during it (:class:`GpuSampler`). A
    step's ``issue_ms``: from its start until the host had issued its last kernel (close to ``wall_ms``:
    the host binds; well below: the GPU's queue was ahead).
    Returns (per-side lists of step dicts with times in ms,
    the first step's log-probs per side, peak GiB per side)."""
    if side_order not in ("alternate", "blocked"):
        raise ValueError(f"side_order must be 'alternate' or 'blocked', got {side_order!r}")
    steps = {s: [] for s in ("baseline", "harts")}
    lps, peak = {}, {s: 0.0 for s in steps}

    def one(side: str, k: int, seed: int) -> None:
        trajs = batches[seed]
        a = argparse.Namespace(**{**vars(args), "seed": seed})
        reset_peak(device, empty_cache=empty_cache)
        times: dict = {}
        clock.sync()
        alloc0, stall0 = alloc_counts(device), stall_counts()
        t0 = time.perf_counter()
        mbs = microbatches(trajs, side, a, cm, device, times=times)
        fm, bm, lp = train_step(model, mbs, norm_of(trajs), clock, keep_logprobs=k == 0, times=times)
        t1 = time.perf_counter()
        wall = 1e3 * (t1 - t0)                             # train_step ends with a device sync
        allocs = {name: n - alloc0[name] for name, n in alloc_counts(device).items()}
        allocs.update({name: n - stall0[name] for name, n in stall_counts().items()})
        allocs["triton_kernels"] = sorted(set(TRITON_COMPILED[stall0["triton_compiles"]:]))
        if _SAMPLER is not None:                           # the GPU's clocks during the step
            allocs.update(_SAMPLER.window(t0, t1))
        if _STACKS is not None:                            # where the host thread was during it
            allocs["host_places"] = _STACKS.window(t0, t1)
        peak[side] = max(peak[side], peak_gib(device))
        if k == 0:
            lps[side] = lp
        steps[side].append(dict(seed=seed, wall_ms=wall, fwd_ms=fm, bwd_ms=bm, grad_ms=fm + bm,
                                issue_ms=1e3 * (times["issued"] - t0),
                                host_ms=times["plan"] + times["pack"] + times["copy"], plan_ms=times["plan"],
                                pack_ms=times["pack"], copy_ms=times["copy"], microbatches=len(mbs),
                                traj_tokens=sum(len(t) for t in trajs),
                                compact_tokens=sum(m["compact"] for m in mbs),
                                pad_tokens=sum(m["pad"] for m in mbs), rounds=sum(m["rounds"] for m in mbs),
                                **allocs))
        del mbs

    note = " (cache emptied per step)" if empty_cache else ""
    if side_order == "blocked":
        seed0 = timed[0] if rewarm_seed is None else rewarm_seed
        for side in ("baseline", "harts"):
            reset_peak(device, empty_cache=True)    # the other side's blocks go, as in a job of this side alone
            a = argparse.Namespace(**{**vars(args), "seed": seed0})
            train_step(model, microbatches(batches[seed0], side, a, cm, device), norm_of(batches[seed0]), clock)
            for k, seed in enumerate(timed):
                one(side, k, seed)
                log(f"{label} {side} step {k + 1}/{len(timed)}{note}: {_step_note(steps[side][-1])}")
        _log_slow_steps(label, steps)
        return steps, lps, peak
    for k, seed in enumerate(timed):
        for side in (("baseline", "harts") if k % 2 == 0 else ("harts", "baseline")):
            one(side, k, seed)
        log(f"{label} step {k + 1}/{len(timed)}{note}: " + ", ".join(
            f"{s} {_step_note(steps[s][-1])}" for s in steps))
    _log_slow_steps(label, steps)
    return steps, lps, peak


def _log_slow_steps(label: str, steps: dict) -> None:
    for side, st in steps.items():
        for line in slow_step_places(st):
            log(f"{label} {side} slow {line}")


def bench_row_fresh(model, model_name: str, recompute: bool, wl: str, batches: dict[int, list], args, device) -> dict:
    """One row as training meets it: ``--warmup-batches`` global batches (compile / autotune on
    other data), then ``--max-steps`` timed steps per side, each on a new global batch (both sides
    get the same trajectories, the side that goes first alternates). A step's wall time holds
    planning, packing, host-to-device copies, every per-pack plan / block-mask build and the
    forward + backward of all microbatches; those parts are reported too. Speedup from medians."""
    clock = Clock(device)
    cm = cost_model_for(model_name, args)
    warm, timed = batch_seeds(args)
    norm_of = lambda trajs: float(sum(max(int(np.sum(t.loss_mask)), 0) for t in trajs)) or 1.0  # noqa: E731
    reset_peak(device)          # each row starts from an empty cache, as a new job does (earlier rows' blocks go)
    for i, seed in enumerate(warm):
        trajs = batches[seed]
        took = {}
        for side in ("baseline", "harts"):
            t0 = time.perf_counter()
            a = argparse.Namespace(**{**vars(args), "seed": seed})
            train_step(model, microbatches(trajs, side, a, cm, device), norm_of(trajs), clock)
            took[side] = time.perf_counter() - t0
        log(f"{model_name} {wl}: warm-up batch {i + 1}/{len(warm)}: " +    # compilation / autotuning: which side
            ", ".join(f"{s} {t:.1f} s" for s, t in took.items()))
    if warm:      # both classes of Triton's integer specialisation of the token count, both sides alike
        t0, n0 = time.perf_counter(), len(TRITON_COMPILED)
        a = argparse.Namespace(**{**vars(args), "seed": warm[-1]})
        for side in ("baseline", "harts"):
            for mb in specialisation_packs(batches[warm[-1]], side, a, cm, device):
                run_mb(model, mb, norm_of(batches[warm[-1]]))[0].backward()
        clock.sync()
        log(f"{model_name} {wl}: warm-up of token counts = 0 / 1 mod {SPECIALISE_MOD}: "
            f"{time.perf_counter() - t0:.1f} s, {len(TRITON_COMPILED) - n0} Triton kernels compiled")
    # FlexAttention compiles per padded pack length; training has compiled every length it meets
    # after its first steps, so the timed batches' lengths are compiled here, on packs of a planning
    # pass that is thrown away (the timed steps plan, pack and build block masks again).
    # A baseline that fell back from FlashAttention varlen to FlexAttention compiles too: its packs as well.
    t0, compiled = time.perf_counter(), 0
    sides = ("harts",) if baseline_attention(device) == "varlen" else ("harts", "baseline")
    for seed in timed:
        a = argparse.Namespace(**{**vars(args), "seed": seed})
        for side in sides:
            mbs = microbatches(batches[seed], side, a, cm, device)
            compiled += precompile_tree_attention(model, [mb["pack"] for mb in mbs])
            del mbs
    precompile_s = time.perf_counter() - t0
    log(f"{model_name} {wl}: tree attention compiled for {compiled} new pack lengths in {precompile_s:.1f} s")
    model.zero_grad(set_to_none=True)
    # Megatron keeps the allocator's cache across iterations (--empty-unused-memory-level 0, its default);
    # rows before 2026-12-05 emptied it before every timed step of each side (--empty-cache step)
    steps, lps, peak = timed_steps(model, f"{model_name} {wl}", batches, timed, args, cm, device, clock, norm_of,
                                   empty_cache=args.empty_cache == "step", side_order=args.side_order,
                                   rewarm_seed=warm[-1] if warm else None)
    tok = sum(st["traj_tokens"] for st in steps["baseline"])
    row = dict(model=model_name, workload=wl, recompute=recompute, fresh_batches=True, steps=len(timed),
               warmup_batches=len(warm), trajectories=len(batches[timed[0]]), trajectory_tokens=tok // len(timed),
               precompiled_lengths=compiled, precompile_s=precompile_s)
    for side, st in steps.items():
        wall = [x["wall_ms"] for x in st]
        row[side] = dict(steps=st, wall_ms=spread(wall), grad_ms_spread=spread([x["grad_ms"] for x in st]),
                         host_ms=spread([x["host_ms"] for x in st]), plan_ms=statistics.median(x["plan_ms"] for x in st),
                         pack_ms=statistics.median(x["pack_ms"] for x in st),
                         copy_ms=statistics.median(x["copy_ms"] for x in st),
                         fwd_ms=statistics.median(x["fwd_ms"] for x in st), bwd_ms=statistics.median(x["bwd_ms"] for x in st),
                         grad_ms=statistics.median(x["grad_ms"] for x in st),
                         issue_ms=statistics.median(x["issue_ms"] for x in st),
                         microbatches=statistics.mean(x["microbatches"] for x in st),      # per step
                         compact_tokens=sum(x["compact_tokens"] for x in st) // len(st),
                         pad_tokens=sum(x["pad_tokens"] for x in st) // len(st),
                         rounds=statistics.mean(x["rounds"] for x in st),
                         max_rounds=max(x["rounds"] for x in st), peak_gib=peak[side],
                         tokens_per_s=tok / (sum(wall) / 1e3))
    if args.profile:
        trajs = batches[timed[-1]]
        for side in steps:
            profile_step(model, microbatches(trajs, side, args, cm, device), norm_of(trajs), clock, os.path.join(
                args.out, f"profile_{model_name}_{wl.replace(':', '')}_{'rc' if recompute else 'norc'}_{side}.txt"))
    if args.sync_audit:       # one more step per side on the last batch, planning and packing included
        trajs = batches[timed[-1]]
        a = argparse.Namespace(**{**vars(args), "seed": timed[-1]})
        for side in steps:
            try:            # an audit that fails must not cost the timed row
                row[side]["sync_audit"] = sync_sites(lambda: train_step(
                    model, microbatches(trajs, side, a, cm, device), norm_of(trajs), clock))
            except Exception as e:
                row[side]["sync_audit_error"] = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
                log(f"{model_name} {wl} {side}: sync audit failed: {row[side]['sync_audit_error']}")
                continue
            top = list(row[side]["sync_audit"]["sites"].items())[:3]
            log(f"{model_name} {wl} {side}: {row[side]['sync_audit']['count']} host syncs in a step; "
                + "; ".join(f"{k} x{n}" for k, n in top))
    o = opt_ms(model, clock)
    for side in steps:
        row[side]["opt_ms"] = o
        row[side]["step_ms"] = row[side]["wall_ms"]["median"] + o
    model.zero_grad(set_to_none=True)
    trajs0 = batches[timed[0]]
    a0 = argparse.Namespace(**{**vars(args), "seed": timed[0]})
    if args.rerun:
        rerun = forward_logprobs(model, microbatches(trajs0, "baseline", a0, cm, device, shuffle=timed[0] + 1))
        row["lp_diff_rerun"] = lp_diff(rerun, lps["baseline"])
        if baseline_attention(device) == "varlen":       # the tree side runs FlexAttention: kernel noise
            try:
                with attention_backend(model, "flex"):
                    flex = forward_logprobs(model, microbatches(trajs0, "baseline", a0, cm, device))
                row["lp_diff_baseline_flex"] = lp_diff(flex, lps["baseline"])
            except Exception as e:                        # keep the timed row
                row["lp_diff_baseline_flex_error"] = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
    row["lp_diff_harts"] = lp_diff(lps["harts"], lps["baseline"])
    # compression pooled over the timed batches; speedups from the medians of the per-step times
    row["compression"] = tok / sum(x["compact_tokens"] for x in steps["harts"])
    row["speedup"] = row["baseline"]["wall_ms"]["median"] / row["harts"]["wall_ms"]["median"]
    row["speedup_gpu"] = row["baseline"]["grad_ms"] / row["harts"]["grad_ms"]
    row["speedup_range"] = [row["baseline"]["wall_ms"]["min"] / row["harts"]["wall_ms"]["max"],
                            row["baseline"]["wall_ms"]["max"] / row["harts"]["wall_ms"]["min"]]
    row["speedup_with_opt"] = row["baseline"]["step_ms"] / row["harts"]["step_ms"]
    row["speedup_per_step"], row["speedup_total"] = paired_speedups(row)
    row["target"] = 0.9 * row["compression"]
    row["meets_target"] = row["speedup"] >= row["target"] and (wl != "swe" or not recompute or row["speedup"] >= 5)
    row["empty_cache"] = args.empty_cache == "step"
    row["side_order"] = args.side_order
    if args.empty_cache == "both":      # the same timed batches again (planned and packed again), cache emptied per step
        alt, _, _ = timed_steps(model, f"{model_name} {wl}", batches, timed, args, cm, device, clock, norm_of,
                                empty_cache=True, side_order=args.side_order, rewarm_seed=warm[-1] if warm else None)
        row["empty_cache_step"] = {s: dict(wall_ms=spread([x["wall_ms"] for x in st]),
                                           grad_ms=statistics.median(x["grad_ms"] for x in st), steps=st)
                                   for s, st in alt.items()}
        row["empty_cache_step"]["speedup"] = (row["empty_cache_step"]["baseline"]["wall_ms"]["median"] /
                                              row["empty_cache_step"]["harts"]["wall_ms"]["median"])
        log(f"{model_name} {wl}: speedup {row['speedup']:.2f} with the cache kept, "
            f"{row['empty_cache_step']['speedup']:.2f} with it emptied before every step")
    return row


# ------------------------------------------------------------------------------------------------ output

def model_label(r: dict) -> str:
    """Model column: ``moe grouped`` for MoE rows run with ``--grouped-experts`` (torch grouped GEMM
    experts on both sides), else the model name (MoE rows before it ran ``SequentialMLP`` experts)."""
    return r["model"] + (" grouped" if r.get("grouped_experts") else "")


def table(rows: list[dict]) -> list[str]:
    head = ("| model | workload | recompute | traj tokens | compression | base ms | harts ms | speedup | target "
            "| w/ opt | base GiB | harts GiB | rounds b/h | lp diff h-b max/mean | lp diff rerun max/mean "
            "| lp diff flex-b max/mean | base attn | met |")
    rows = [r for r in rows if not r.get("fresh_batches")]
    if not rows:
        return []
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for r in rows:
        b, h = r["baseline"], r["harts"]
        rr, fb = (f"{d['max']:.2e}/{d['mean']:.1e}" if d else "-"
                  for d in (r.get("lp_diff_rerun"), r.get("lp_diff_baseline_flex")))
        lines.append(f"| {model_label(r)} | {r['workload']} | {'on' if r['recompute'] else 'off'} | {r['trajectory_tokens']} "
                     f"| {r['compression']:.2f} | {b['grad_ms']:.1f} | {h['grad_ms']:.1f} | {r['speedup']:.2f} "
                     f"| {r['target']:.2f} | {r['speedup_with_opt']:.2f} | {b['peak_gib']:.1f} | {h['peak_gib']:.1f} "
                     f"| {b['rounds']}/{h['rounds']} | {r['lp_diff_harts']['max']:.2e}/{r['lp_diff_harts']['mean']:.1e} "
                     f"| {rr} | {fb} "
                     f"| {r.get('baseline_attention', 'flex')} | {'yes' if r['meets_target'] else 'no'} |")
    return lines


def paired_speedups(row: dict) -> tuple[dict, float]:
    """Of a fresh-batch row: the per-step speedups (baseline / HARTS wall time of the same batch)
    as min / median / max, and the total speedup (sum of baseline step times / sum of HARTS ones,
    the throughput ratio over the timed batches). With batches of varying size (swe, tau) the ratio
    of the two medians can pair different batches; these two cannot."""
    b, h = row["baseline"]["steps"], row["harts"]["steps"]
    if [x["seed"] for x in b] != [x["seed"] for x in h]:
        raise ValueError(f"{row['workload']}: the two sides' steps are not the same batches")
    return (spread([x["wall_ms"] / y["wall_ms"] for x, y in zip(b, h)]),
            sum(x["wall_ms"] for x in b) / sum(y["wall_ms"] for y in h))


def table_fresh(rows: list[dict]) -> list[str]:
    """Rows measured on a new global batch every step: step wall time (plan + pack + copies +
    forward/backward) median [min-max] per side, its host part, HARTS's time until its last kernel
    was issued, the forward/backward part."""
    rows = [r for r in rows if r.get("fresh_batches")]
    if not rows:
        return []
    head = ("| model | workload | recompute | steps | traj tokens/step | compression | base step ms med [min-max] "
            "| harts step ms med [min-max] | base host ms | harts host ms | harts issued ms | speedup [range] | per-step speedup med "
            "[min-max] | total speedup | fwd+bwd speedup | target | base GiB | harts GiB | lp diff h-b max | lp diff rerun max | lp diff flex-b max | allocator cache | met |")
    head += " json |" * any("file" in r for r in rows)
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for r in rows:
        b, h = r["baseline"], r["harts"]
        w = lambda d: f"{d['median']:.1f} [{d['min']:.1f}-{d['max']:.1f}]"  # noqa: E731
        ps, tot = paired_speedups(r) if "steps" in b and "steps" in h else (None, None)
        rr, fb = (f"{d['max']:.2e}" if d else "-" for d in (r.get("lp_diff_rerun"), r.get("lp_diff_baseline_flex")))
        issued = f"{h['issue_ms']:.1f}" if "issue_ms" in h else "-"        # rows before 2026-12-06 lack it
        lines.append(f"| {model_label(r)} | {r['workload']} | {'on' if r['recompute'] else 'off'} | {r['steps']} "
                     f"| {r['trajectory_tokens']} | {r['compression']:.2f} | {w(b['wall_ms'])} | {w(h['wall_ms'])} "
                     f"| {b['host_ms']['median']:.1f} | {h['host_ms']['median']:.1f} | {issued} "
                     f"| {r['speedup']:.2f} [{r['speedup_range'][0]:.2f}-{r['speedup_range'][1]:.2f}] "
                     + (f"| {ps['median']:.2f} [{ps['min']:.2f}-{ps['max']:.2f}] | {tot:.2f} " if ps else "| - | - ") +
                     f"| {r['speedup_gpu']:.2f} | {r['target']:.2f} | {b['peak_gib']:.1f} | {h['peak_gib']:.1f} "
                     f"| {r['lp_diff_harts']['max']:.2e} | {rr} | {fb} | {cache_label(r)} "
                     f"| {'yes' if r['meets_target'] else 'no'} |"
                     + (f" {r.get('file', '-')} |" if "json |" in head else ""))
    return lines


def cache_label(r: dict) -> str:
    """Allocator column of a fresh-batch row: ``kept`` (cached blocks reused across steps, as in Megatron)
    or ``emptied`` (before every timed step of each side: rows before 2026-12-05 have no such key), and
    with ``--empty-cache both`` the speedup of the same batches with the cache emptied; ``, sides
    blocked`` for ``--side-order blocked`` rows (each side's steps alone, not interleaved)."""
    label = "emptied" if r.get("empty_cache", True) else "kept"
    e = r.get("empty_cache_step")
    blocked = ", sides blocked" if r.get("side_order") == "blocked" else ""
    return label + blocked + (f" (emptied: {e['speedup']:.2f})" if e else "")


def command_line(argv: list[str]) -> str:
    """The benchmark's arguments without those that only name machine paths or limits."""
    drop, out, skip = {"--out", "--save-fla-configs", "--watchdog"}, [], False
    for a in argv:
        if skip or a in drop:
            skip = a in drop
            continue
        if a.split("=", 1)[0] not in drop:
            out.append(a)
    return " ".join(["scripts/bench_e2e.py"] + out)


def gpu_word(device: str) -> str:
    """The model word of a device name: ``NVIDIA H100 80GB HBM3`` -> ``H100``, ``NVIDIA H200`` -> ``H200``."""
    words = [w for w in device.split() if w.upper() != "NVIDIA"]
    return words[0] if words else device


def render(rows: list[dict], metas: list[dict], out_dir: str, failed: list[dict] = ()) -> None:
    """``e2e.md`` (table) + ``e2e.png`` (speedup vs compression, ideal and 0.9x lines)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    m = next((x for x in metas if x.get("fresh_batches")), metas[0] if metas else {})
    gpus = sorted({gpu_word(x.get("device", "?")) for x in metas}) or ["?"]   # one table per machine kind
    lines = [f"# End-to-end: HARTS vs trajectory-wise training step ({' and '.join(gpus)})", "",
             f"Machine: {m.get('device', '?')}; torch {m.get('torch', '?')}; bf16; chunk {m.get('chunk_size')}; "
             f"median of {m.get('max_steps')} steps after warm-up. Times are forward + backward over all "
             "microbatches of the global batch (gradient, optimizer excluded; `w/ opt` adds one AdamW step to "
             "both sides). `base attn`: the baseline's attention kernel (`varlen` = FlashAttention varlen, "
             "`flex` = FlexAttention with the document mask). Produced by `scripts/bench_e2e.py`; raw numbers in "
             "the JSONs next to this file:", ""]
    lines += [(f"- {x['file']}: " if x.get("file") else "- ") + f"`{command_line(x.get('argv', []))}`: microbatch capacity "
              f"{x.get('capacity')} tokens" + (f", packs padded to a multiple of {x['pad_multiple']} tokens"
                                               if x.get("pad_multiple") else "") for x in metas]
    fresh = table_fresh(rows)
    if fresh:
        ws = sorted({r.get("warmup_batches", m.get("warmup_batches", "?")) for r in rows if r.get("fresh_batches")},
                    key=str)
        warm = (f"{ws[0]} warm-up batches" if len(ws) == 1 else
                f"{' or '.join(map(str, ws))} warm-up batches (`--warmup-batches` of each row's command above)")
        lines += ["", "## New global batch every step (as training meets it)", "",
                  f"{warm}, then each timed step on a new batch (same "
                  "trajectories on both sides). Step ms = wall clock of planning, packing, host-to-device copies, "
                  "per-pack plans / block masks and forward + backward of all microbatches; host ms = the planning, "
                  "packing and copy part; harts issued ms = from the step's start until the host had issued its "
                  "last kernel (median; close to the step ms: the host binds; rows before 2026-12-06: -); "
                  "speedup from the median step times, [range] = min/max ratio over steps. "
                  "Allocator cache: `kept` across steps as in Megatron (`--empty-unused-memory-level 0`), or "
                  "`emptied` before every timed step of each side (rows before 2026-12-05; every step then "
                  "allocates its memory anew); `(emptied: x)` = the same batches timed again that way.",
                  ""] + fresh
    if len(fresh) < len(rows):
        lines += ["", "## Same batch every step (history: packs built once, outside the timing)", ""] + table(rows)
    fig, ax = plt.subplots(figsize=(5.5, 4.2))
    for key in sorted({(model_label(r), r["recompute"], bool(r.get("fresh_batches"))) for r in rows}):
        pts = sorted((r["compression"], r["speedup"], r["workload"]) for r in rows
                     if (model_label(r), r["recompute"], bool(r.get("fresh_batches"))) == key)
        # several runs of one workload (one JSON each): every run a marker, the line through their median
        runs = {}
        for c, s, w in pts:
            runs.setdefault((w, c), []).append(s)
        line = sorted((c, statistics.median(v)) for (w, c), v in runs.items())
        (h,) = ax.plot([c for c, _ in line], [s for _, s in line], "-" if key[2] else "--",
                       label=f"{key[0]}, recompute {'on' if key[1] else 'off'}" + (", new batch/step" if key[2] else ", same batch"))
        ax.plot([p[0] for p in pts], [p[1] for p in pts], "o" if key[2] else "x", color=h.get_color(), ms=4)
        for (w, c), v in runs.items():
            if not w.startswith("sweep"):
                ax.annotate(w, (c, max(v)), fontsize=7)
    hi = max([r["compression"] for r in rows] + [2]) * 1.05
    ax.plot([1, hi], [1, hi], "k--", lw=0.8, label="ideal (= compression)")
    ax.plot([1, hi], [0.9, 0.9 * hi], "k:", lw=0.8, label="target 0.9x")
    ax.set_xlabel("compression (trajectory tokens / compact tokens)")
    ax.set_ylabel("speedup (baseline ms / HARTS ms)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(os.path.join(out_dir, "e2e.png"), dpi=120)
    lines += [""] * bool(failed) + [f"Not measured: {f['model']} {f['workload']} recompute {'on' if f['recompute'] else 'off'} "
              f"(out of memory at microbatch capacity {f['capacity']} tokens)." for f in failed]
    lines += ["", "![speedup vs compression](e2e.png)", ""]
    with open(os.path.join(out_dir, "e2e.md"), "w") as f:
        f.write("\n".join(lines))


def main(argv: list[str] | None = None) -> int:
    global _SAMPLER, _STACKS
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=os.environ.get("OUT", "."), help="folder for e2e.json (or e2e.md/png)")
    ap.add_argument("--name", default="e2e.json", help="JSON file name inside --out")
    ap.add_argument("--plot", nargs="+", metavar="JSON", help="render e2e.md/e2e.png from result JSONs and exit")
    ap.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    ap.add_argument("--tiny", action="store_true", help="tiny fp32 models and workloads (smoke test)")
    ap.add_argument("--models", default="dense,moe")
    ap.add_argument("--workloads", default="swe,tau,sweep", help="swe, tau, sweep (= every --compressions), sweep:C")
    ap.add_argument("--recompute", choices=["on", "off", "both"], default="both")
    ap.add_argument("--compressions", default="2,4,6,8,10")
    ap.add_argument("--max-steps", type=int, default=None, help="timed global-batch steps per side (median; "
                    "default 5, or 2 with --same-batch)")
    ap.add_argument("--warmup-batches", type=int, default=2, help="global batches run before the timed steps "
                    "(compilation, autotuning; other seeds than the timed ones)")
    ap.add_argument("--same-batch", action="store_true", help="the old protocol: one batch, packed once outside "
                    "the timing, every timed step reuses it (rows of docs/benchmarks before 2026-12-01)")
    ap.add_argument("--capacity", type=int, default=0, help="max tokens per microbatch (0: 65536 with "
                    "recompute, 32768 without; tiny: 256)")
    ap.add_argument("--pad-multiple", type=int, default=0, help="pad whole packs to a multiple of this many "
                    "tokens with a dummy chain (0: off; attention pads itself, see flex_length)")
    ap.add_argument("--grouped-experts", action="store_true", help="MoE experts as TEGroupedMLP on torch's grouped "
                    "GEMM (megatron_harts.moe.grouped) instead of SequentialMLP, on both sides")
    ap.add_argument("--moe-dispatcher", choices=["fast", "reference"], default="fast",
                    help="MoE token permutation on both sides: megatron_harts.moe.dispatch (one device->host copy "
                    "per layer, none with --grouped-experts) or Megatron's own (two syncs per layer)")
    ap.add_argument("--chunk-size", type=int, default=64)
    ap.add_argument("--vocab", type=int, default=32768)
    ap.add_argument("--swe-groups", type=int, default=2)
    ap.add_argument("--swe-max-tokens", type=int, default=32768)
    ap.add_argument("--tau-groups", type=int, default=8)
    ap.add_argument("--sweep-tokens", type=int, default=131072)
    ap.add_argument("--empty-cache", choices=["never", "step", "both"], default="never",
                    help="fresh-batch rows: keep the CUDA caching allocator's blocks across steps as Megatron does "
                    "(never; its --empty-unused-memory-level 0), empty it before every timed step of each side "
                    "(step; the protocol of rows before 2026-12-05), or time both (both: the row keeps the cache, "
                    "its empty_cache_step holds the same batches with the cache emptied)")
    ap.add_argument("--side-order", choices=["alternate", "blocked"], default="alternate",
                    help="fresh-batch rows: the sides' timed steps interleaved step by step, the first side "
                    "alternating (alternate; one allocator holds both sides' cached blocks: on an 80 GB H100 the "
                    "no-recomputation rows had single steps of 2-3 s), or all baseline steps, then all HARTS "
                    "steps, each side after an emptied cache and one untimed step (blocked: as separate jobs)")
    ap.add_argument("--profile", action="store_true", help="write a torch.profiler table per side and row")
    ap.add_argument("--sync-audit", action="store_true", help="after the timed steps, one more step per side "
                    "under torch.cuda.set_sync_debug_mode('warn'): its host-device syncs by call site (CUDA; "
                    "the bench's own end-of-step synchronize may be listed too, as bench_e2e.py sync)")
    ap.add_argument("--no-rerun", dest="rerun", action="store_false", help="skip the baseline rerun")
    ap.add_argument("--seed", type=int, default=1)
    add_save_fla_configs_arg(ap)
    ap.add_argument("--watchdog", type=float, default=0, help="dump all stacks and exit after this many seconds")
    ap.add_argument("--no-step-samplers", action="store_true", help="do not sample, during the timed steps, the "
                    "GPU's clocks, temperature, power and clock-event reasons (CUDA: nvidia-smi -lms 100 in a child "
                    "process) nor where the host thread is (every 50 ms; slow steps' places are logged)")
    args = ap.parse_args(argv)
    if args.max_steps is None:
        args.max_steps = 2 if args.same_batch else 5
    if args.max_steps < 1 or args.warmup_batches < 0:
        ap.error("--max-steps must be >= 1 and --warmup-batches >= 0")
    if args.sync_audit and (args.device != "cuda" or args.same_batch):
        ap.error("--sync-audit needs --device cuda and the fresh-batch rows (CUDA reports the syncs)")
    if args.watchdog:
        faulthandler.dump_traceback_later(args.watchdog, exit=True)
    os.makedirs(args.out, exist_ok=True)
    if args.plot:
        rows, metas, failed = [], [], []
        for path in args.plot:
            with open(path) as f:
                d = json.load(f)
            grouped = bool(d["meta"].get("grouped_experts"))     # a run-wide flag: tag its MoE rows
            name = os.path.basename(path)                         # each row names its JSON (several runs per row kind)
            rows += [{**r, "file": name, **({"grouped_experts": True} if grouped and r["model"] == "moe" else {})}
                     for r in d["rows"]]
            failed += d.get("failed", [])
            metas.append({**d["meta"], "file": name})
        render(rows, metas, args.out, failed)
        print("\n".join(table_fresh(rows) + table(rows)))
        return 0
    if args.tiny:
        args.vocab, args.pad_multiple = 64, (args.pad_multiple if args.device == "cuda" else 0)
    wls = []
    for w in args.workloads.split(","):
        wls += [f"sweep:{c}" for c in args.compressions.split(",")] if w == "sweep" else [w]
    recs = {"on": [True], "off": [False], "both": [True, False]}[args.recompute]
    device = torch.device(args.device)
    if device.type == "cuda":
        import torch._dynamo as dynamo
        for k in ("cache_size_limit", "recompile_limit", "accumulated_cache_size_limit", "accumulated_recompile_limit"):
            if hasattr(dynamo.config, k):
                setattr(dynamo.config, k, 256)
        init_single_gpu(args.seed)
        ctx = contextlib.nullcontext()
        if not args.no_step_samplers:
            _SAMPLER = start_gpu_sampler(device)
    else:
        import torch._dynamo as dynamo
        from megatron_harts.megatron import cpu_shim
        dynamo.config.disable = True        # Megatron's torch.compile'd fusions: minutes of C++ builds on CPU
        ctx = cpu_shim.cpu_megatron(seed=args.seed)
    if not args.no_step_samplers:
        _STACKS = HostStackSampler()
    triton_counted = count_triton_compiles()      # steps' triton_compiles (fla's kernels are plain Triton)
    meta = dict(triton_compiles_counted=triton_counted,
                device=torch.cuda.get_device_name() if device.type == "cuda" else "cpu", torch=torch.__version__,
                chunk_size=args.chunk_size, max_steps=args.max_steps, pad_multiple=args.pad_multiple,
                vocab=args.vocab, argv=sys.argv[1:] if argv is None else argv, fresh_batches=not args.same_batch,
                grouped_experts=args.grouped_experts, moe_dispatcher=args.moe_dispatcher,
                warmup_batches=0 if args.same_batch else args.warmup_batches, empty_cache=args.empty_cache)
    if args.same_batch:
        data = {wl: workload(wl, args) for wl in wls}
        all_trajs = [t for ts in data.values() for t in ts]
    else:                      # {workload: {seed: trajectories}}, warm-up and timed batches
        seeds = sum(batch_seeds(args), [])
        data = {wl: {sd: workload(wl, argparse.Namespace(**{**vars(args), "seed": sd})) for sd in seeds} for wl in wls}
        all_trajs = [t for d in data.values() for ts in d.values() for t in ts]
    max_len = max([len(t) for t in all_trajs] + [args.pad_multiple])   # RoPE table (pad chain too)
    rows, failed, path = [], [], os.path.join(args.out, args.name)
    try:
        from tqdm import tqdm
    except ImportError:
        tqdm = lambda x, **k: x  # noqa: E731
    todo = [(m, r, w) for m in args.models.split(",") for r in recs for w in wls]
    with ctx:
        model, key = None, None
        for m, rc, wl in tqdm(todo, desc="e2e", file=sys.stderr):
            cap = args.capacity or (256 if args.tiny else 65536 if rc else 32768)
            args_c = argparse.Namespace(**{**vars(args), "capacity": cap})
            if key != (m, rc):
                model = None
                reset_peak(device)
                t0 = time.perf_counter()
                model, key = build_model(m, rc, args, max_len), (m, rc)
                log(f"built {m} (recompute {'on' if rc else 'off'}) in {time.perf_counter() - t0:.1f} s")
                meta.setdefault("params", {})[m] = sum(p.numel() for p in model.parameters())
            meta["capacity"] = cap
            t0 = time.perf_counter()
            try:
                row = (bench_row(model, m, rc, wl, data[wl], args_c, device) if args.same_batch
                       else bench_row_fresh(model, m, rc, wl, data[wl], args_c, device))
            except torch.cuda.OutOfMemoryError as e:     # recorded (e.g. no recomputation), next row runs
                row = None
                failed.append(dict(model=m, workload=wl, recompute=rc, capacity=cap, error=str(e).splitlines()[0]))
            if row is None:                              # outside the except: its traceback's tensors are gone
                model.zero_grad(set_to_none=True)
                gc.collect()
                reset_peak(device)
                print(f"[e2e] {m} {wl} recompute={rc}: out of memory at capacity {cap}", file=sys.stderr, flush=True)
                with open(path, "w") as f:
                    json.dump({"meta": meta, "rows": rows, "failed": failed}, f, indent=1)
                continue
            row.update(capacity=cap, wall_s=time.perf_counter() - t0, baseline_attention=baseline_attention(device))
            rows.append(row)
            with open(path, "w") as f:
                json.dump({"meta": meta, "rows": rows, "failed": failed}, f, indent=1)
            if args.save_fla_configs:
                save_fla_autotune(args.save_fla_configs)
            print(f"[e2e] {m} {wl} recompute={rc}: compression {row['compression']:.2f} speedup "
                  f"{row['speedup']:.2f} ({row['wall_s']:.0f} s)", file=sys.stderr, flush=True)
    close_step_samplers()
    print("\n".join(table_fresh(rows) + table(rows)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
