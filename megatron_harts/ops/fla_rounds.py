"""Tree linear attention on fla's kernels with the chunk-local work fused across rounds.

fla's chunked GDN / simple GLA split into chunk-local kernels (gate cumsum, WY representation,
output, most of the backward) and two inter-chunk recurrences (forward states, backward state
gradients). Only the recurrences depend on a sequence's initial state, so a tree pack needs one
call per round for them alone; every chunk-local kernel runs once over all rounds' sequences
(one varlen layout, ``ChunkPlan.gather_all``). Each Function takes and returns compact tensors
(``[T, ...]``) and moves them to and from that layout inside its own forward / backward, so a
layer adds one autograd node, not one per input and output. Per layer: R recurrence launches
forward and 2R backward (the backward recomputes the states, as fla does) plus a fixed number of
fused ones, instead of R full fla calls each way.

States between rounds: round r's final states (fp32) are gathered by ``init_from`` into round
r+1's initial states; backward scatter-adds the initial-state gradients (``dh0``) back into the
previous round's final-state gradients (``dht``).

The recurrence kernels are launched here directly (fla's wrappers around them allocate per call
and, for simple GLA, read the chunk count with ``.item()``): each round writes its states and
outputs into its slice of one all-rounds buffer, with sizes and chunk offsets from the plan, so a
layer makes no host sync and no per-round copies.

Host work per round is kept to the launch and, between rounds, one state gather (forward) or one
scatter-add (backward). Each round's launch gets the whole all-rounds tensors (no per-round
slices): the kernels take every sequence's token and chunk offsets from ``cu_seqlens`` /
``chunk_offsets``, so the round passes its sequences' rows of the all-rounds ``cu_seqlens`` and
``chunk_offsets`` (precomputed once per pack, :class:`RoundArgs`) and reads and writes the same
addresses as a launch on its slices would. All rounds' final states (and, backward, initial-state
gradients and final-state gradients) live in one buffer per call, split once. The recurrence
launches go through :class:`_Launch` (fla's heuristics and tuned config looked up in one pass,
then the ``JITFunction``; the baseline's fla calls launch these kernels the same way).
``reference_round_loops()`` switches back to the previous round loops (per-round slices and
allocations, every launch through fla's heuristics and autotuner) for comparisons.
"""
from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass, field

import numpy as np
import torch
import triton

from ..packing import TreePack
from .gather import compact_grad_to_rounds, from_rounds, rounds_grad_to_compact, to_rounds
from .plan import ChunkPlan, chunk_plan


@dataclass
class VarlenChunks:
    """fla varlen metadata of S sequences: ``cu_seqlens`` ``[S+1]``, ``chunk_indices`` ``[NT, 2]``
    (sequence, chunk within it), ``chunk_offsets`` ``[S+1]`` (first chunk of each sequence), all
    int64 on the device; host ints: ``num_seqs`` (S), ``tokens`` / ``chunks`` (the token and chunk
    ranges in the all-rounds layout)."""

    cu_seqlens: torch.Tensor
    chunk_indices: torch.Tensor
    chunk_offsets: torch.Tensor
    num_seqs: int
    tokens: slice
    chunks: slice

    @staticmethod
    def build(cu: np.ndarray, chunk_size: int, device, start: int = 0, chunk_start: int = 0) -> "VarlenChunks":
        lens = np.diff(cu)
        chunks = (lens + chunk_size - 1) // chunk_size
        offsets = np.concatenate([[0], np.cumsum(chunks)]).astype(np.int64)
        seq = np.repeat(np.arange(len(lens), dtype=np.int64), chunks)
        within = np.arange(offsets[-1], dtype=np.int64) - offsets[seq]
        t = lambda a: torch.from_numpy(np.ascontiguousarray(a, dtype=np.int64)).to(device)
        return VarlenChunks(t(cu), t(np.stack([seq, within], 1)), t(offsets), len(lens),
                            slice(start, start + int(cu[-1])), slice(chunk_start, chunk_start + int(offsets[-1])))


@dataclass
class RoundArgs:
    """Launch arguments of one round on the whole all-rounds tensors: ``cu_seqlens`` ``[S+1]`` and
    ``chunk_offsets`` ``[S+1]`` are the round's rows of ``FusedRounds.all``'s (global token and
    chunk offsets; views of one device buffer, each 16-byte aligned); ``num_seqs`` S."""

    cu_seqlens: torch.Tensor
    chunk_offsets: torch.Tensor
    num_seqs: int


@dataclass
class FusedRounds:
    """``all``: the rounds' sequences as one varlen batch; ``rounds[r]``: round r alone (its
    own token offsets, zero-based); ``init_from[r]``: rows of round r-1's final states; ``plan``:
    the chunk plan they come from (its layout indices); ``args[r]``: round r's launch arguments on
    the all-rounds tensors; ``seq_counts``: sequences per round (host ints)."""

    plan: ChunkPlan
    all: VarlenChunks
    rounds: list[VarlenChunks]
    init_from: list[torch.Tensor | None]
    chunk_size: int
    args: list[RoundArgs] = field(default_factory=list)
    seq_counts: list[int] = field(default_factory=list)


def _round_args(cu_all: np.ndarray, chunk_size: int, seq_counts: list[int], device) -> list[RoundArgs]:
    """Each round's rows of the all-rounds ``cu_seqlens`` / ``chunk_offsets`` (S+1 each), in one
    host->device copy; every segment starts at a multiple of 2 int64 (16 bytes), as a fresh tensor
    would, so Triton specialises the pointers alike."""
    lens = np.diff(cu_all)
    offsets = np.concatenate([[0], np.cumsum((lens + chunk_size - 1) // chunk_size)]).astype(np.int64)
    segs, s0 = [], 0
    for n in seq_counts:
        segs += [cu_all[s0:s0 + n + 1], offsets[s0:s0 + n + 1]]
        s0 += n
    starts = np.concatenate([[0], np.cumsum([len(x) + len(x) % 2 for x in segs])]).astype(np.int64)
    host = np.zeros(int(starts[-1]), np.int64)
    for x, st in zip(segs, starts):
        host[st:st + len(x)] = x
    dev = torch.from_numpy(host).to(device)
    views = [dev[int(st):int(st) + len(x)] for x, st in zip(segs, starts)]
    return [RoundArgs(views[2 * r], views[2 * r + 1], n) for r, n in enumerate(seq_counts)]


def fused_rounds(pack: TreePack, chunk_size: int) -> FusedRounds:
    """:class:`FusedRounds` of ``pack`` (cached per chunk size and device)."""

    def build():
        plan: ChunkPlan = chunk_plan(pack, chunk_size)
        dev = plan.gather_all.device
        cus = [rd.cu_seqlens_cpu.numpy() for rd in plan.rounds]
        starts = np.concatenate([[0], np.cumsum([int(c[-1]) for c in cus])])
        cu_all = np.concatenate([[0]] + [c[1:] + s for c, s in zip(cus, starts)])
        rounds, chunk_start = [], 0
        for c, s in zip(cus, starts):
            rounds.append(VarlenChunks.build(c, chunk_size, dev, int(s), chunk_start))
            chunk_start = rounds[-1].chunks.stop
        counts = [len(c) - 1 for c in cus]
        return FusedRounds(plan, VarlenChunks.build(cu_all, chunk_size, dev), rounds,
                           [rd.init_from for rd in plan.rounds], chunk_size,
                           _round_args(cu_all, chunk_size, counts, dev), counts)

    return pack.cached(("fla_fused_rounds", chunk_size, str(pack.device)), build)


def _prev_final_grad(fr: FusedRounds, r: int, dh0: torch.Tensor) -> torch.Tensor:
    """Gradient of round r-1's final states from round r's initial-state gradient ``dh0``."""
    return dh0.new_zeros((fr.rounds[r - 1].num_seqs, *dh0.shape[1:])).index_add_(0, fr.init_from[r], dh0)


def _init_state(fr: FusedRounds, r: int, final: torch.Tensor | None) -> torch.Tensor | None:
    return None if r == 0 else final.index_select(0, fr.init_from[r])


def _round_states_reference(k, w, u, gc, fr: FusedRounds, keep_inits: bool):
    """GDN forward recurrence (fla ``chunk_gated_delta_rule_fwd_kernel_h_blockdim64``) round by
    round. Returns h ``[1, NT, HV, K, V]``, v_new like u, and each round's initial states (None for
    round 0, and for all rounds unless ``keep_inits``)."""
    kernel = _original("fla.ops.common.chunk_delta_h", "chunk_gated_delta_rule_fwd_kernel_h_blockdim64")

    H, K, HV, V = k.shape[2], k.shape[3], u.shape[2], u.shape[3]
    h = k.new_empty(1, fr.all.chunks.stop, HV, K, V)
    v_new = torch.empty_like(u)
    inits, final, last = [], None, len(fr.rounds) - 1
    for r, vc in enumerate(fr.rounds):
        t = vc.tokens
        init = _init_state(fr, r, final)
        # written whole by the kernel (every sequence x head x K x V block, empty sequences too): no zero-fill
        final = k.new_empty(vc.num_seqs, HV, K, V, dtype=torch.float32) if r < last else None
        kernel[lambda meta, n=vc.num_seqs: (triton.cdiv(V, meta["BV"]) * n * HV,)](
            k=k[:, t], v=u[:, t], w=w[:, t], v_new=v_new[:, t], g=gc[:, t], gk=None, h=h[:, vc.chunks],
            h0=init, ht=final, cu_seqlens=vc.cu_seqlens, chunk_offsets=vc.chunk_offsets,
            T=t.stop - t.start, H=H, HV=HV, K=K, V=V, BT=fr.chunk_size, STATE_V_FIRST=False)
        inits.append(init if keep_inits else None)
    return h, v_new, inits


def _round_state_grads_reference(q, k, w, do, dv, gc, inits, fr: FusedRounds, scale: float):
    """GDN backward recurrence (fla ``chunk_gated_delta_rule_bwd_kernel_dhu_blockdim64``), last
    round first, each round's ``dh0`` feeding the previous round's ``dht``. Returns dh
    ``[1, NT, HV, K, V]`` and dv2 like dv."""
    kernel = _original("fla.ops.common.chunk_delta_h", "chunk_gated_delta_rule_bwd_kernel_dhu_blockdim64")

    H, K, HV, V = q.shape[2], q.shape[3], do.shape[2], do.shape[3]
    dh = q.new_empty(1, fr.all.chunks.stop, HV, K, V)
    dv2 = torch.empty_like(dv)
    dht = None
    for r in reversed(range(len(fr.rounds))):
        vc, t = fr.rounds[r], fr.rounds[r].tokens
        dh0 = torch.empty_like(inits[r], dtype=torch.float32) if r > 0 else None
        kernel[lambda meta, n=vc.num_seqs: (triton.cdiv(V, meta["BV"]) * n * HV,)](
            q=q[:, t], k=k[:, t], w=w[:, t], g=gc[:, t], gk=None, dht=dht, dh0=dh0, do=do[:, t], dh=dh[:, vc.chunks],
            dv=dv[:, t], dv2=dv2[:, t], cu_seqlens=vc.cu_seqlens, chunk_offsets=vc.chunk_offsets, scale=scale,
            T=t.stop - t.start, H=H, HV=HV, K=K, V=V, BT=fr.chunk_size, STATE_V_FIRST=False)
        if r > 0:
            dht = _prev_final_grad(fr, r, dh0)
    return dh, dv2

# ------------------------------------------------------------------------------------------------ launches

#: ``HARTS_FLA_FAST_LAUNCH=1``: the recurrence launches through :class:`_Launch`, on both sides
#: (fla's own modules then hold the wrappers). Off by default: it re-implements the lookup of
#: Triton's autotuner (checked against fla's key code on CPU in Triton's interpreter, with Triton 3.8
#: and with the H200's 3.7.1) and gave no end-to-end gain on the H200 (4021add, docs/benchmarks);
#: ``scripts/bench_tree_gdn_host.py`` measures the op's host time there.
FAST_LAUNCH = os.environ.get("HARTS_FLA_FAST_LAUNCH", "0") == "1"
_REFERENCE = False


@contextlib.contextmanager
def reference_round_loops():
    """Run the previous round loops (per-round slices and allocations, launches through fla's
    heuristics and autotuner): the baseline of ``scripts/bench_tree_gdn_host.py`` and the tests."""
    global _REFERENCE
    saved, _REFERENCE = _REFERENCE, True
    try:
        yield
    finally:
        _REFERENCE = saved


class _Launch:
    """``kernel[grid](**kw)`` for one fla kernel (``triton.heuristics`` over an autotuner over a
    Triton ``JITFunction``), with what those two wrappers do on an already tuned key done in one
    pass: the heuristics evaluated on one copy of the call's kwargs (Triton's ``Heuristics.run``
    rebuilds the argument dict once per heuristic), the tuning key built once the way
    ``Autotuner.run`` builds it (fla's ``CachedAutotuner`` builds it twice) and looked up in the
    autotuner's cache, then ``JITFunction.run`` with that config: Triton's own binder,
    specialisation and kernel cache, so pointer alignment and the like are checked every call as
    before. The decisions are the wrappers' own, made per call; a key not tuned yet, a config
    with a pre-hook, positional arguments, or fla's ``FLA_CACHE_MODE=always`` (configs re-read
    every call) take the normal path. ``check`` (tests): also compare each call's config with the
    one fla's own key code finds."""

    check = False

    def __init__(self, kernel):
        from triton.runtime.autotuner import Autotuner, Heuristics
        from triton.runtime.interpreter import InterpretedFunction
        from triton.runtime.jit import JITFunction

        self.kernel = kernel
        tuner = getattr(kernel, "fn", None)
        ok = (isinstance(kernel, Heuristics) and isinstance(tuner, Autotuner)
              and isinstance(tuner.fn, (JITFunction, InterpretedFunction)))
        self.heur = tuple(kernel.values.items()) if ok else ()
        self.tuner = tuner if ok else None
        self.names = frozenset(tuner.arg_names) if ok else frozenset()
        self._kwargs = {}                   # id(config) -> (config, config.all_kwargs())
        from fla.ops.utils import cache as fla_cache
        self._fla_cache = fla_cache         # its FLA_CACHE_MODE, read per call

    def __getitem__(self, grid):
        return lambda *args, **kw: self(grid, *args, **kw)

    def fast(self) -> bool:
        if not FAST_LAUNCH or self.tuner is None:
            return False
        return getattr(getattr(self._fla_cache, "FLA_CACHE_MODE", None), "value", None) != "always"

    def resolve(self, kw: dict):
        """(config, its kwargs) for ``kw`` (the heuristics' values are added to it), or None: not
        tuned yet or a config with a pre-hook (the normal path)."""
        for name, fn in self.heur:          # as Heuristics.run: in order, each sees the previous
            kw[name] = fn(kw)
        tuner = self.tuner
        if len(tuner.configs) > 1:          # the tuning key as Autotuner.run builds it
            names = self.names
            key = [kw[k] for k in tuner.keys if k in kw and k in names]
            key += [str(v.dtype) for k, v in kw.items()
                    if k in names and type(v) not in _NO_DTYPE and hasattr(v, "dtype")]
            cfg = tuner.cache.get(tuple(key))
            if cfg is None:
                return None
        else:
            cfg = tuner.configs[0]
        if cfg.pre_hook is not None:
            return None
        got = self._kwargs.get(id(cfg))
        if got is None or got[0] is not cfg:
            got = self._kwargs[id(cfg)] = (cfg, cfg.all_kwargs())
        return got

    def __call__(self, grid, *args, **kw):
        if args or not self.fast():
            return self.kernel[grid](*args, **kw)
        call = dict(kw)
        got = self.resolve(call)
        if got is None:
            return self.kernel[grid](**kw)
        if self.check:
            assert got[0] is (self.tuner.cache.get(self._fla_key(kw)) if len(self.tuner.configs) > 1
                              else self.tuner.configs[0])
        return self.tuner.fn.run(grid=grid, warmup=False, **call, **got[1])

    def _fla_key(self, kw):
        """The tuning key by fla's own code (``AutotuneKey.build``, after the heuristics as
        ``Heuristics.run`` runs them)."""
        from fla.ops.utils.cache import AutotuneKey
        args = dict(kw)
        for name, fn in self.heur:
            args[name] = fn({**args})
        return AutotuneKey.build(self.tuner.arg_names, self.tuner.keys, (), args).autotune_key


_NO_DTYPE = (type(None), bool, int, float, str)      # no ``dtype`` attribute: skip the hasattr

#: fla kernels launched through :class:`_Launch` (module, name): the GDN and simple-GLA recurrences
FAST_KERNELS = (("fla.ops.common.chunk_delta_h", "chunk_gated_delta_rule_fwd_kernel_h_blockdim64"),
                ("fla.ops.common.chunk_delta_h", "chunk_gated_delta_rule_bwd_kernel_dhu_blockdim64"),
                ("fla.ops.common.chunk_h", "chunk_fwd_kernel_h"),
                ("fla.ops.common.chunk_h", "chunk_bwd_kernel_dh"))
_LAUNCHES: dict[str, _Launch] = {}


def _original(module: str, name: str):
    """fla's kernel object ``module.name`` (not the :class:`_Launch` that may stand in for it)."""
    import importlib
    kernel = getattr(importlib.import_module(module), name)
    return kernel.kernel if isinstance(kernel, _Launch) else kernel


def install_fast_launches(into_fla: bool | None = None) -> dict[str, _Launch]:
    """The :class:`_Launch` of each kernel of :data:`FAST_KERNELS` (name -> launch; this module's
    round loops call them; each takes the fast path only while :data:`FAST_LAUNCH` is on).
    ``into_fla`` (default: :data:`FAST_LAUNCH`): also put them in fla's modules, whose wrappers look
    the kernel up at each call (``chunk_gated_delta_rule_fwd_h`` / ``_bwd_dhu``: the
    trajectory-wise baseline's ``chunk_gated_delta_rule``; ``chunk_fwd_h`` / ``chunk_bwd_dh``), so
    both sides of a benchmark launch these kernels the same way. Off (the default), fla is left
    untouched. Idempotent."""
    import importlib
    into_fla = FAST_LAUNCH if into_fla is None else into_fla
    for module, name in FAST_KERNELS:
        mod = importlib.import_module(module)
        launch = _LAUNCHES.get(name)
        if launch is None:
            launch = _LAUNCHES[name] = _Launch(_original(module, name))
        if into_fla and getattr(mod, name) is not launch:
            setattr(mod, name, launch)
    return _LAUNCHES


def _round_buffers(x: torch.Tensor, counts: list[int], tail: tuple, *, zero: bool = False) -> list[torch.Tensor]:
    """Views ``[counts[i], *tail]`` (fp32, on x's device) of one new buffer; zero-filled if ``zero``."""
    shape = (sum(counts), *tail)
    buf = x.new_zeros(shape, dtype=torch.float32) if zero else x.new_empty(shape, dtype=torch.float32)
    return list(buf.split(counts)) if len(counts) > 1 else [buf]


def _round_states(k, w, u, gc, fr: FusedRounds):
    """GDN forward recurrence (fla ``chunk_gated_delta_rule_fwd_kernel_h_blockdim64``) round by
    round on the all-rounds tensors. Returns h ``[1, NT, HV, K, V]`` and v_new like u."""
    if _REFERENCE:
        h, v_new, _ = _round_states_reference(k, w, u, gc, fr, keep_inits=False)
        return h, v_new
    launch = install_fast_launches()["chunk_gated_delta_rule_fwd_kernel_h_blockdim64"]
    N, H, K, HV, V = k.shape[1], k.shape[2], k.shape[3], u.shape[2], u.shape[3]
    h = k.new_empty(1, fr.all.chunks.stop, HV, K, V)
    v_new = torch.empty_like(u)
    R, C = len(fr.args), fr.chunk_size
    # every round's final states but the last's, written whole by the kernel (every sequence x head
    # x K x V block, empty sequences too): no zero-fill
    finals = _round_buffers(k, fr.seq_counts[:-1], (HV, K, V)) if R > 1 else []
    init = None
    for r, ra in enumerate(fr.args):
        if r:
            init = finals[r - 1].index_select(0, fr.init_from[r])
        launch(lambda meta, n=ra.num_seqs: (triton.cdiv(V, meta["BV"]) * n * HV,),
               k=k, v=u, w=w, v_new=v_new, g=gc, gk=None, h=h, h0=init, ht=finals[r] if r < R - 1 else None,
               cu_seqlens=ra.cu_seqlens, chunk_offsets=ra.chunk_offsets, T=N, H=H, HV=HV, K=K, V=V, BT=C,
               STATE_V_FIRST=False)
    return h, v_new


def _round_state_grads(q, k, w, do, dv, gc, fr: FusedRounds, scale: float):
    """GDN backward recurrence (fla ``chunk_gated_delta_rule_bwd_kernel_dhu_blockdim64``), last
    round first on the all-rounds tensors, each round's ``dh0`` scatter-added into the previous
    round's ``dht`` (one zeroed buffer for all rounds). Returns dh ``[1, NT, HV, K, V]`` and dv2
    like dv."""
    launch = install_fast_launches()["chunk_gated_delta_rule_bwd_kernel_dhu_blockdim64"]
    N, H, K, HV, V = q.shape[1], q.shape[2], q.shape[3], do.shape[2], do.shape[3]
    dh = q.new_empty(1, fr.all.chunks.stop, HV, K, V)
    dv2 = torch.empty_like(dv)
    R, C = len(fr.args), fr.chunk_size
    if R > 1:
        dh0s = [None] + _round_buffers(q, fr.seq_counts[1:], (HV, K, V))          # written whole by the kernel
        dhts = _round_buffers(q, fr.seq_counts[:-1], (HV, K, V), zero=True) + [None]
    else:
        dh0s = dhts = [None]
    for r in reversed(range(R)):
        ra = fr.args[r]
        launch(lambda meta, n=ra.num_seqs: (triton.cdiv(V, meta["BV"]) * n * HV,),
               q=q, k=k, w=w, g=gc, gk=None, dht=dhts[r], dh0=dh0s[r], do=do, dh=dh, dv=dv, dv2=dv2,
               cu_seqlens=ra.cu_seqlens, chunk_offsets=ra.chunk_offsets, scale=scale, T=N, H=H, HV=HV, K=K, V=V,
               BT=C, STATE_V_FIRST=False)
        if r:
            dhts[r - 1].index_add_(0, fr.init_from[r], dh0s[r])
    return dh, dv2


def _simple_gla_states(k, v, gc, fr: FusedRounds, fp32: bool):
    """Simple-GLA forward recurrence (fla ``chunk_fwd_kernel_h``) round by round on the all-rounds
    tensors: h ``[1, NT, H, K, V]`` (fp32 if ``fp32``)."""
    if _REFERENCE:
        return _simple_gla_states_reference(k, v, gc, fr, fp32=fp32, keep_inits=False)[0]
    launch = install_fast_launches()["chunk_fwd_kernel_h"]
    N, H, K, V = k.shape[1], k.shape[2], k.shape[3], v.shape[3]
    h = k.new_empty(1, fr.all.chunks.stop, H, K, V, dtype=torch.float32 if fp32 else k.dtype)
    R, C = len(fr.args), fr.chunk_size
    finals = _round_buffers(k, fr.seq_counts[:-1], (H, K, V)) if R > 1 else []
    init = None
    for r, ra in enumerate(fr.args):
        if r:
            init = finals[r - 1].index_select(0, fr.init_from[r])
        launch(lambda meta, n=ra.num_seqs: (triton.cdiv(K, meta["BK"]) * triton.cdiv(V, meta["BV"]) * n * H,),
               k=k, v=v, h=h, g=gc, g_gamma=None, gk=None, gv=None, h0=init, ht=finals[r] if r < R - 1 else None,
               cu_seqlens=ra.cu_seqlens, split_offsets=ra.chunk_offsets, T=N, H=H, K=K, V=V, BT=C, BS=C,
               USE_G=True, USE_G_GAMMA=False, USE_GK=False, USE_GV=False, STATE_V_FIRST=False)
    return h


def _simple_gla_state_grads(q, k, do, gc, fr: FusedRounds, scale: float):
    """Simple-GLA backward recurrence (fla ``chunk_bwd_kernel_dh``), last round first on the
    all-rounds tensors: dh ``[1, NT, H, K, V]`` fp32."""
    launch = install_fast_launches()["chunk_bwd_kernel_dh"]
    N, H, K, V = q.shape[1], q.shape[2], q.shape[3], do.shape[3]
    dh = q.new_empty(1, fr.all.chunks.stop, H, K, V, dtype=torch.float32)
    R, C = len(fr.args), fr.chunk_size
    if R > 1:
        dh0s = [None] + _round_buffers(q, fr.seq_counts[1:], (H, K, V))
        dhts = _round_buffers(q, fr.seq_counts[:-1], (H, K, V), zero=True) + [None]
    else:
        dh0s = dhts = [None]
    for r in reversed(range(R)):
        ra = fr.args[r]
        launch(lambda meta, n=ra.num_seqs: (triton.cdiv(K, meta["BK"]) * triton.cdiv(V, meta["BV"]) * n * H,),
               q=q, g=gc, g_gamma=None, gk=None, gv=None, do=do, dh=dh, dht=dhts[r], dh0=dh0s[r],
               cu_seqlens=ra.cu_seqlens, split_offsets=ra.chunk_offsets, scale=scale, T=N, HQ=H, H=H, K=K, V=V,
               BT=C, BS=C, NG=1, USE_G=True, USE_G_GAMMA=False, USE_GK=False, USE_GV=False, STATE_V_FIRST=False)
        if r:
            dhts[r - 1].index_add_(0, fr.init_from[r], dh0s[r])
    return dh


def _to_rounds(fr: FusedRounds, *xs: torch.Tensor) -> list[torch.Tensor]:
    """Compact ``[T, ...]`` -> all-rounds ``[1, N, ...]``, contiguous."""
    return [to_rounds(x, fr.plan).unsqueeze(0) for x in xs]


def _to_compact(fr: FusedRounds, grads, dtypes) -> list[torch.Tensor]:
    """All-rounds gradients ``[1, N, ...]`` -> compact ``[T, ...]``, each in its dtype."""
    return [rounds_grad_to_compact(g[0].to(dt), fr.plan) for g, dt in zip(grads, dtypes)]


class TreeGatedDeltaRuleFla(torch.autograd.Function):
    """Compact q, k ``[T, H, K]``, v ``[T, HV, V]``, g, beta ``[T, HV]`` -> o ``[T, HV, V]``; inside,
    the all-rounds layout of ``fr`` (``ChunkPlan.gather_all`` order). ``l2norm``: q and k are
    L2-normalised in the kernel (fla's ``use_qk_l2norm_in_kernel``)."""

    @staticmethod
    def forward(ctx, q, k, v, g, beta, fr: FusedRounds, scale: float, l2norm: bool):
        from fla.modules.norm.l2norm import l2norm_fwd
        from fla.ops.common.chunk_o import chunk_fwd_o
        from fla.ops.gated_delta_rule.chunk_fwd import chunk_gated_delta_rule_fwd_intra
        from fla.ops.utils import chunk_local_cumsum
        from fla.ops.utils.constant import RCP_LN2

        dtypes = [x.dtype for x in (q, k, v, g, beta)]
        q, k, v, g, beta = _to_rounds(fr, q, k, v, g, beta)
        a, C = fr.all, fr.chunk_size
        with torch.cuda.device(q.device) if q.is_cuda else contextlib.nullcontext():
            q_rstd = k_rstd = None
            if l2norm:
                (q, q_rstd), (k, k_rstd) = l2norm_fwd(q), l2norm_fwd(k)
            gc = chunk_local_cumsum(g, chunk_size=C, scale=RCP_LN2, cu_seqlens=a.cu_seqlens,
                                    chunk_indices=a.chunk_indices)
            w, u, A = chunk_gated_delta_rule_fwd_intra(k=k, v=v, g=gc, beta=beta, cu_seqlens=a.cu_seqlens,
                                                       chunk_indices=a.chunk_indices, chunk_size=C)
            h, v_new = _round_states(k, w, u, gc, fr)
            o = chunk_fwd_o(q=q, k=k, v=v_new, h=h, g=gc, scale=scale, cu_seqlens=a.cu_seqlens,
                            chunk_indices=a.chunk_indices, chunk_size=C)
        ctx.save_for_backward(q, k, v, gc, beta, A, q_rstd, k_rstd)
        ctx.fr, ctx.scale, ctx.dtypes = fr, scale, dtypes
        return from_rounds(o[0].to(v.dtype), fr.plan)

    @staticmethod
    def backward(ctx, do):
        from fla.modules.norm.l2norm import l2norm_bwd
        from fla.ops.common.chunk_o import chunk_bwd_dqkwg, chunk_bwd_dv_local
        from fla.ops.gated_delta_rule.wy_fast import prepare_wy_repr_bwd, recompute_w_u_fwd
        from fla.ops.utils import chunk_local_cumsum

        q, k, v, gc, beta, A, q_rstd, k_rstd = ctx.saved_tensors
        fr, scale = ctx.fr, ctx.scale
        a, C = fr.all, fr.chunk_size
        do = compact_grad_to_rounds(do, fr.plan).unsqueeze(0)
        with torch.cuda.device(q.device) if q.is_cuda else contextlib.nullcontext():
            w, u = recompute_w_u_fwd(k=k, v=v, beta=beta, A=A, g=gc, cu_seqlens=a.cu_seqlens,
                                     chunk_indices=a.chunk_indices)
            if _REFERENCE:
                h, v_new, inits = _round_states_reference(k, w, u, gc, fr, keep_inits=True)
            else:
                h, v_new = _round_states(k, w, u, gc, fr)
            dv = chunk_bwd_dv_local(q=q, k=k, g=gc, do=do, scale=scale, cu_seqlens=a.cu_seqlens,
                                    chunk_indices=a.chunk_indices, chunk_size=C)
            if _REFERENCE:
                dh, dv = _round_state_grads_reference(q, k, w, do, dv, gc, inits, fr, scale)
            else:
                dh, dv = _round_state_grads(q, k, w, do, dv, gc, fr, scale)
            dq, dk, dw, dg = chunk_bwd_dqkwg(q=q, k=k, v=v_new, w=w, g=gc, h=h, dv=dv, do=do, dh=dh, scale=scale,
                                             cu_seqlens=a.cu_seqlens, chunk_indices=a.chunk_indices, chunk_size=C)
            dk2, dv, db, dg2 = prepare_wy_repr_bwd(k=k, v=v, beta=beta, g=gc, A=A, dw=dw, du=dv,
                                                   cu_seqlens=a.cu_seqlens, chunk_indices=a.chunk_indices)
            dk.add_(dk2)
            dg.add_(dg2)
            dg = chunk_local_cumsum(dg, chunk_size=C, reverse=True, cu_seqlens=a.cu_seqlens,
                                    chunk_indices=a.chunk_indices)
            if q_rstd is not None:
                dq, dk = l2norm_bwd(q, q_rstd, dq), l2norm_bwd(k, k_rstd, dk)
        grads = _to_compact(fr, (dq, dk, dv, dg, db), ctx.dtypes)
        return (*grads, None, None, None)


def _simple_gla_states_reference(k, v, gc, fr: FusedRounds, fp32: bool, keep_inits: bool):
    """Simple-GLA forward recurrence (fla ``chunk_fwd_kernel_h``) round by round: h
    ``[1, NT, H, K, V]`` (fp32 if ``fp32``) and each round's initial states (as ``_round_states``)."""
    kernel = _original("fla.ops.common.chunk_h", "chunk_fwd_kernel_h")

    H, K, V = k.shape[2], k.shape[3], v.shape[3]
    h = k.new_empty(1, fr.all.chunks.stop, H, K, V, dtype=torch.float32 if fp32 else k.dtype)
    inits, final, last = [], None, len(fr.rounds) - 1
    for r, vc in enumerate(fr.rounds):
        t = vc.tokens
        init = _init_state(fr, r, final)
        final = k.new_empty(vc.num_seqs, H, K, V, dtype=torch.float32) if r < last else None
        kernel[lambda meta, n=vc.num_seqs: (triton.cdiv(K, meta["BK"]) * triton.cdiv(V, meta["BV"]) * n * H,)](
            k=k[:, t], v=v[:, t], h=h[:, vc.chunks], g=gc[:, t], g_gamma=None, gk=None, gv=None, h0=init, ht=final,
            cu_seqlens=vc.cu_seqlens, split_offsets=vc.chunk_offsets, T=t.stop - t.start, H=H, K=K, V=V,
            BT=fr.chunk_size, BS=fr.chunk_size, USE_G=True, USE_G_GAMMA=False, USE_GK=False, USE_GV=False,
            STATE_V_FIRST=False)
        inits.append(init if keep_inits else None)
    return h, inits


def _simple_gla_state_grads_reference(q, k, do, gc, inits, fr: FusedRounds, scale: float):
    """Simple-GLA backward recurrence (fla ``chunk_bwd_kernel_dh``), last round first: dh
    ``[1, NT, H, K, V]`` fp32."""
    kernel = _original("fla.ops.common.chunk_h", "chunk_bwd_kernel_dh")

    H, K, V = q.shape[2], q.shape[3], do.shape[3]
    dh = q.new_empty(1, fr.all.chunks.stop, H, K, V, dtype=torch.float32)
    dht = None
    for r in reversed(range(len(fr.rounds))):
        vc, t = fr.rounds[r], fr.rounds[r].tokens
        dh0 = torch.empty_like(inits[r], dtype=torch.float32) if r > 0 else None
        kernel[lambda meta, n=vc.num_seqs: (triton.cdiv(K, meta["BK"]) * triton.cdiv(V, meta["BV"]) * n * H,)](
            q=q[:, t], g=gc[:, t], g_gamma=None, gk=None, gv=None, do=do[:, t], dh=dh[:, vc.chunks], dht=dht, dh0=dh0,
            cu_seqlens=vc.cu_seqlens, split_offsets=vc.chunk_offsets, scale=scale, T=t.stop - t.start, HQ=H, H=H,
            K=K, V=V, BT=fr.chunk_size, BS=fr.chunk_size, NG=1, USE_G=True, USE_G_GAMMA=False, USE_GK=False,
            USE_GV=False, STATE_V_FIRST=False)
        if r > 0:
            dht = _prev_final_grad(fr, r, dh0)
    return dh


class TreeSimpleGLAFla(torch.autograd.Function):
    """Compact q, k ``[T, H, K]``, v ``[T, H, V]``, g ``[T, H]`` -> o ``[T, H, V]`` (fla
    ``chunk_simple_gla`` with the rounds' state handoffs, in the all-rounds layout inside)."""

    @staticmethod
    def forward(ctx, q, k, v, g, fr: FusedRounds, scale: float):
        from fla.ops.common.chunk_o import chunk_fwd_o
        from fla.ops.utils import chunk_local_cumsum
        from fla.ops.utils.constant import RCP_LN2

        dtypes = [x.dtype for x in (q, k, v, g)]
        q, k, v, g = _to_rounds(fr, q, k, v, g)
        a, C = fr.all, fr.chunk_size
        with torch.cuda.device(q.device) if q.is_cuda else contextlib.nullcontext():
            gc = chunk_local_cumsum(g, chunk_size=C, scale=RCP_LN2, cu_seqlens=a.cu_seqlens,
                                    chunk_indices=a.chunk_indices)
            h = _simple_gla_states(k, v, gc, fr, fp32=False)
            o = chunk_fwd_o(q=q, k=k, v=v, g=gc, h=h, scale=scale, cu_seqlens=a.cu_seqlens, chunk_size=C,
                            chunk_indices=a.chunk_indices)
        ctx.save_for_backward(q, k, v, gc)
        ctx.fr, ctx.scale, ctx.dtypes = fr, scale, dtypes
        return from_rounds(o[0].to(v.dtype), fr.plan)

    @staticmethod
    def backward(ctx, do):
        from fla.ops.common.chunk_o import chunk_bwd_dqkwg, chunk_bwd_dv
        from fla.ops.utils import chunk_local_cumsum

        q, k, v, gc = ctx.saved_tensors
        fr, scale = ctx.fr, ctx.scale
        a, C = fr.all, fr.chunk_size
        do = compact_grad_to_rounds(do, fr.plan).unsqueeze(0)
        with torch.cuda.device(q.device) if q.is_cuda else contextlib.nullcontext():
            if _REFERENCE:
                h, inits = _simple_gla_states_reference(k, v, gc, fr, fp32=True, keep_inits=True)
                dh = _simple_gla_state_grads_reference(q, k, do, gc, inits, fr, scale)
            else:
                h = _simple_gla_states(k, v, gc, fr, fp32=True)
                dh = _simple_gla_state_grads(q, k, do, gc, fr, scale)
            dq, dk, _, dg = chunk_bwd_dqkwg(q=q, k=k, v=v, g=gc, h=h, do=do, dh=dh, scale=scale,
                                            cu_seqlens=a.cu_seqlens, chunk_size=C, chunk_indices=a.chunk_indices)
            dv = chunk_bwd_dv(q=q, k=k, g=gc, do=do, dh=dh, scale=scale, cu_seqlens=a.cu_seqlens, chunk_size=C,
                              chunk_indices=a.chunk_indices)
            dg = chunk_local_cumsum(dg, chunk_size=C, reverse=True, cu_seqlens=a.cu_seqlens,
                                    chunk_indices=a.chunk_indices)
        grads = _to_compact(fr, (dq, dk, dv, dg), ctx.dtypes)
        return (*grads, None, None)
