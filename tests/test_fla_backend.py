"""fla backends (the GPU code path) against the torch backends, on the corner-case trees.

Without CUDA the fla kernels run in Triton's interpreter (``tests/fla_interpret.py``, enabled
by conftest), so CI on CPU checks the same kernel calls, round fusion and state handoffs the
H200 runs; inputs are fp32 and small (chunk 16, K=V=16) to keep the interpreter fast.
"""
import contextlib

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from megatron_harts.ops import chunk_plan, tree_causal_conv1d, tree_gated_delta_rule, tree_simple_gla
from megatron_harts.packing import pack, pack_trajectories
from megatron_harts.tree import RolloutTree
from trees import corner_cases, random_trees

DEV = "cuda" if torch.cuda.is_available() else "cpu"
C = 16
TOL = 1e-4 if DEV == "cuda" else 1e-5  # TF32 dots on GPU
CASES = ["on_boundary", "one_past", "one_before", "ends_inside", "duplicates", "multi_root", "long_chain"]


def _pack(trajs):
    return pack([RolloutTree.from_trajectories(trajs)], chunk_size=C).to(DEV)


def _rel(a, b):
    return float((a.double() - b.double()).abs().max() / b.double().abs().max().clamp(min=1e-6))


def _inputs(T, H, HV, K, V, seed):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(T, H, K, generator=g)
    k = F.normalize(torch.randn(T, H, K, generator=g), dim=-1)
    v = torch.randn(T, HV, V, generator=g)
    gate = F.logsigmoid(torch.randn(T, HV, generator=g) + 2)
    beta = torch.rand(T, HV, generator=g)
    return [x.to(DEV) for x in (q, k, v, gate, beta)]


def _check_backends(fn, inputs, seed=0):
    """Outputs and the gradients of every input under a random cotangent: fla vs torch."""
    res = []
    for backend in ("fla", "torch"):
        leaves = [x.detach().clone().requires_grad_(True) for x in inputs]
        out = fn(*leaves, backend=backend)
        do = torch.randn(out.shape, generator=torch.Generator().manual_seed(seed)).to(DEV)
        res.append([out.detach()] + list(torch.autograd.grad((out * do).sum(), leaves)))
    for n, (a, b) in enumerate(zip(*res)):
        assert _rel(a, b) < TOL, f"{'output' if n == 0 else f'grad of input {n - 1}'}: rel err {_rel(a, b):.2e}"


@pytest.mark.parametrize("case", CASES)
def test_gated_delta_rule_fla_rounds_fused(case):
    p = _pack(corner_cases(C)[case])
    _check_backends(lambda *x, backend: tree_gated_delta_rule(*x, p, chunk_size=C, backend=backend),
                    _inputs(p.num_tokens, 1, 2, 16, 16, seed=1))


@pytest.mark.parametrize("l2norm", [False, True])
def test_gated_delta_rule_fla_trajectory_pack(l2norm):
    """Trajectory packs (the THD baseline) take fla's own varlen ``chunk_gated_delta_rule``."""
    trees = [RolloutTree.from_trajectories(t) for t in random_trees(5, C, vocab=3, num_trees=2)]
    p = pack_trajectories(trees, chunk_size=C).to(DEV)
    assert p.is_chain and len(p.trajectories) > 2
    _check_backends(lambda *x, backend: tree_gated_delta_rule(*x, p, chunk_size=C, scale=0.3, backend=backend,
                                                              use_qk_l2norm_in_kernel=l2norm),
                    _inputs(p.num_tokens, 1, 2, 16, 16, seed=6))


def test_fla_many_rounds_l2norm_and_scale():
    """Several trees per pack, >= 3 rounds (GDN with qk l2-norm in the kernel and an explicit scale;
    simple GLA)."""
    base = list(range(4 * C))
    b1 = base[:C + 3] + [100 + i for i in range(2 * C)]
    nested = [base, b1, b1[:2 * C + 5] + [200 + i for i in range(C)], b1[:2 * C - 1] + [300, 301]]
    groups = [nested] + random_trees(3, C, vocab=3, num_trees=2, branches=(3, 6))
    p = pack([RolloutTree.from_trajectories(t) for t in groups], chunk_size=C).to(DEV)
    assert chunk_plan(p, C).num_rounds >= 3
    x = _inputs(p.num_tokens, 2, 2, 16, 16, seed=2)
    k_raw = 3 * torch.randn(x[1].shape, generator=torch.Generator().manual_seed(7)).to(DEV)   # not unit-norm
    _check_backends(lambda *x, backend: tree_gated_delta_rule(*x, p, chunk_size=C, scale=0.3, backend=backend,
                                                              use_qk_l2norm_in_kernel=True), [x[0], k_raw, *x[2:]])
    _check_backends(lambda *x, backend: tree_simple_gla(*x, p, chunk_size=C, backend=backend), x[:4])


def test_gated_delta_rule_fla_strided_gqa_l2norm():
    """What the GDN layer passes: q, k, v column slices of one projection (not contiguous), H < HV,
    q/k l2norm in the kernel, fp32 gate; gradients reach the projection through the slices."""
    p = _pack(corner_cases(C)["duplicates"])
    T, H, HV, K = p.num_tokens, 1, 2, 16
    g = torch.Generator().manual_seed(8)
    wide = torch.randn(T, 2 * H * K + HV * K + 3, generator=g).to(DEV)
    gate = F.logsigmoid(torch.randn(T, HV, generator=g) + 2).to(DEV)
    beta = torch.rand(T, HV, generator=g).to(DEV)

    def op(wide, gate, beta, backend):
        q, k = wide[:, :H * K].view(T, H, K), wide[:, H * K:2 * H * K].view(T, H, K)
        v = wide[:, 2 * H * K:2 * H * K + HV * K].view(T, HV, K)
        assert not q.is_contiguous()
        return tree_gated_delta_rule(q, k, v, gate, beta, p, chunk_size=C, backend=backend,
                                     use_qk_l2norm_in_kernel=True)
    _check_backends(op, [wide, gate, beta])


@pytest.mark.parametrize("case", ["on_boundary", "ends_inside", "multi_root"])
def test_simple_gla_fla(case):
    p = _pack(corner_cases(C)[case])
    q, k, v, g, _ = _inputs(p.num_tokens, 2, 2, 16, 16, seed=3)
    _check_backends(lambda *x, backend: tree_simple_gla(*x, p, chunk_size=C, backend=backend), [q, k, v, g])


@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("case", ["one_past", "duplicates", "multi_root", "trajectory_pack"])
def test_causal_conv1d_fla(case, bias):
    """Tree packs (fla conv patched after branch points) and a trajectory pack (fla's varlen conv);
    SiLU with and without bias (the GDN layer's conv has none)."""
    if case == "trajectory_pack":
        p = pack_trajectories([RolloutTree.from_trajectories(corner_cases(C)["multi_root"])], chunk_size=C).to(DEV)
    else:
        p = _pack(corner_cases(C)[case])
    g = torch.Generator().manual_seed(4)
    x, w, b = (torch.randn(*s, generator=g).to(DEV) for s in ((p.num_tokens, 8), (8, 4), (8,)))
    if bias:
        _check_backends(lambda *a, backend: tree_causal_conv1d(*a, p, activation="silu", backend=backend), [x, w, b])
    else:
        _check_backends(lambda *a, backend: tree_causal_conv1d(*a, None, p, activation="silu", backend=backend), [x, w])


class _Target:
    pass


def test_save_fla_autotune_writes_entries_fla_can_look_up(tmp_path, monkeypatch):
    """Every tuned (kernel, key) lands in ``{kernel}.json`` under the hash fla looks up. The
    interpreter keeps one config per kernel and so never tunes: two kernels get a tuning result
    the way Triton records one (``cache[key] = best config``, key = key args + arg dtypes)."""
    import gc
    import json
    import weakref

    from fla.ops.utils.cache import AutotuneKey, CachedAutotuner, KernelConfigFile

    from megatron_harts.ops.fla_autotune import save_fla_autotune

    def is_tuner(t):       # dead weakref proxies left by earlier tests raise on isinstance
        try:
            return isinstance(t, CachedAutotuner)
        except ReferenceError:
            return False
    tuners = {t.kernel_name: t for t in gc.get_objects() if is_tuner(t)}
    tuned = {"chunk_gated_delta_rule_fwd_kernel_h_blockdim64": (16, 128, 128, "torch.bfloat16", "torch.float32"),
             "chunk_local_cumsum_scalar_kernel": (4096, 16, "torch.float32")}
    for name, key in tuned.items():
        monkeypatch.setattr(tuners[name], "cache", {key: tuners[name].configs[0]})
    dead = [weakref.proxy(_Target())]         # gc-tracked dead proxy (isinstance on it raises ReferenceError)
    assert save_fla_autotune(str(tmp_path)) >= 2
    assert dead
    for name, key in tuned.items():
        path = tmp_path / f"{name}.json"
        entry = KernelConfigFile.from_dict(path, json.loads(path.read_text())).lookup_exact(AutotuneKey(key))
        assert entry is not None and entry["config"]["kwargs"] == tuners[name].configs[0].kwargs, name
        assert entry["config"]["num_warps"] == tuners[name].configs[0].num_warps


class _CountOps(TorchDispatchMode):
    """Counts aten ops by name (views included) while active."""

    def __init__(self):
        super().__init__()
        self.ops = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops[str(func)] = self.ops.get(str(func), 0) + 1
        return func(*args, **(kwargs or {}))


def _launches(fn, inputs) -> tuple[dict, int]:
    """aten ops and Triton kernel launches of one forward + backward of ``fn`` (plans prebuilt)."""
    import triton.runtime.interpreter as interpreter

    leaves = [x.detach().clone().requires_grad_(True) for x in inputs]
    fn(*leaves)                                        # builds and caches the pack's plans
    launches = []
    run = interpreter.InterpretedFunction.run

    def counted(self, *a, **k):
        launches.append(self)
        return run(self, *a, **k)
    interpreter.InterpretedFunction.run = counted
    try:
        with _CountOps() as ops:
            fn(*leaves).sum().backward()
    finally:
        interpreter.InterpretedFunction.run = run
    return ops.ops, len(launches)


@pytest.mark.skipif(DEV == "cuda", reason="counts launches through Triton's interpreter (CPU only)")
@pytest.mark.parametrize("op", ["gdn", "simple_gla", "conv"])
def test_fla_path_has_no_host_syncs_and_launches_per_round_not_per_token(op):
    """The layer-time contract (plans built once, then layers only index): no ``.item()`` /
    ``nonzero`` style host syncs in forward + backward, and the same aten ops and Triton launches
    for two packs with the same number of rounds but twice the tokens and trajectories."""
    from megatron_harts import workloads as W
    from megatron_harts.tree import trees_from_trajectories
    counts, rounds = [], set()
    for tokens in (1024, 2048):
        p = pack(trees_from_trajectories(W.sweep_batch(tokens, 4.0, tokens_per_group=512, vocab_size=64, seed=0)),
                 chunk_size=C)
        rounds.add(chunk_plan(p, C).num_rounds)
        x = _inputs(p.num_tokens, 1, 1, 16, 16, seed=5)
        if op == "gdn":
            ops, n = _launches(lambda *a: tree_gated_delta_rule(*a, p, chunk_size=C, backend="fla"), x)
        elif op == "conv":
            g = torch.Generator().manual_seed(6)
            xw = [torch.randn(*s, generator=g) for s in ((p.num_tokens, 8), (8, 4), (8,))]
            ops, n = _launches(lambda *a: tree_causal_conv1d(*a, p, activation="silu", backend="fla"), xw)
        else:
            ops, n = _launches(lambda *a: tree_simple_gla(*a, p, chunk_size=C, backend="fla"), x[:4])
        syncs = {k: v for k, v in ops.items() if any(s in k for s in ("_local_scalar_dense", "nonzero", "unique",
                                                                       "masked_select", "repeat_interleave"))}
        assert not syncs, syncs
        counts.append((ops, n))
    assert len(rounds) == 1 and rounds.pop() >= 2
    assert counts[0] == counts[1]


def test_causal_conv1d_fla_strided_input_no_bias_no_activation():
    """The layout the layers pass: x a column slice of a wider projection (row stride != D)."""
    p = _pack(corner_cases(C)["multi_root"])
    g = torch.Generator().manual_seed(7)
    wide = torch.randn(p.num_tokens, 20, generator=g).to(DEV)
    w = torch.randn(8, 4, generator=g).to(DEV)

    def fn(wide, w, backend):
        return tree_causal_conv1d(wide[:, 4:12], w, None, p, activation=None, backend=backend)
    _check_backends(fn, [wide, w])


@pytest.mark.parametrize("fast", [False, True], ids=["launch", "fast_launch"])
@pytest.mark.parametrize("op", ["gdn", "gdn_l2norm", "simple_gla"])
def test_round_loops_bitwise_equal_to_reference_loops(op, fast, monkeypatch):
    """The round loops on the all-rounds tensors (one buffer per call for the states, cached
    launch resolution) give bitwise the outputs and gradients of the previous loops (per-round
    slices and allocations, every launch through fla's heuristics and autotuner), on a pack of
    several rounds with fan-out; every cached launch is checked against a fresh resolution."""
    from megatron_harts import workloads as W
    from megatron_harts.ops import fla_rounds
    from megatron_harts.tree import trees_from_trajectories
    monkeypatch.setattr(fla_rounds._Launch, "check", True)
    monkeypatch.setattr(fla_rounds, "FAST_LAUNCH", fast)        # off by default (HARTS_FLA_FAST_LAUNCH=1)
    import dataclasses
    cfg = dataclasses.replace(W.TAU_BENCH_LIKE, num_groups=2, group_size=(3, 4), turns=(2, 4), system_tokens=(20, 40),
                              task_tokens_median=10, task_tokens_max=20, assistant_tokens_median=8,
                              assistant_tokens_range=(2, 20), env_tokens_median=12, env_tokens_range=(2, 40),
                              max_tokens=200, vocab_size=64, seed=3)       # bench_e2e's tiny tau-like batch
    p = pack(trees_from_trajectories(W.rollout_trees(cfg)), chunk_size=C).to(DEV)
    assert chunk_plan(p, C).num_rounds >= 3
    x = _inputs(p.num_tokens, 1, 2, 16, 16, seed=9)
    if op == "simple_gla":
        x = [x[0], x[1], x[2][:, :1].contiguous(), x[3][:, :1].contiguous()]
        fn = lambda *a: tree_simple_gla(*a, p, chunk_size=C, backend="fla")   # noqa: E731
    else:
        fn = lambda *a: tree_gated_delta_rule(*a, p, chunk_size=C, backend="fla",   # noqa: E731
                                              use_qk_l2norm_in_kernel=op == "gdn_l2norm")
    res = []
    for ref in (True, False, False):                  # the second new run: every launch on the cached path
        with fla_rounds.reference_round_loops() if ref else contextlib.nullcontext():
            leaves = [t.detach().clone().requires_grad_(True) for t in x]
            out = fn(*leaves)
            do = torch.randn(out.shape, generator=torch.Generator().manual_seed(2)).to(DEV)
            res.append([out.detach()] + list(torch.autograd.grad((out * do).sum(), leaves)))
    for got in res[1:]:
        for n, (a, b) in enumerate(zip(got, res[0])):
            assert torch.equal(a, b), f"{op}: {'output' if n == 0 else f'grad {n - 1}'} differs"


def test_fast_launch_finds_the_autotuners_config_by_flas_own_key(monkeypatch):
    """``_Launch.resolve`` builds the tuning key as fla's autotuner does (heuristics first, then
    key ints and every tensor's dtype): with two configs and one tuned key, a call with that key
    gets its config, a call with another dtype or without ``h0`` (another heuristic, another key)
    gets None (the normal path, which tunes)."""
    import triton

    from megatron_harts.ops import fla_rounds
    launch = fla_rounds.install_fast_launches()["chunk_gated_delta_rule_fwd_kernel_h_blockdim64"]
    tuner = launch.tuner
    two = [triton.Config({"BV": 32}, num_warps=2), triton.Config({"BV": 64}, num_warps=4)]
    x = lambda dt=torch.bfloat16: torch.zeros(1, 4, 2, 16, dtype=dt)   # noqa: E731
    kw = dict(k=x(), v=x(), w=x(), v_new=x(), g=torch.zeros(1, 4, 2), gk=None, h=x(), h0=torch.zeros(1, 2, 16, 16),
              ht=None, cu_seqlens=torch.zeros(2, dtype=torch.long), chunk_offsets=torch.zeros(2, dtype=torch.long),
              T=4, H=2, HV=2, K=16, V=16, BT=16, STATE_V_FIRST=False)
    monkeypatch.setattr(tuner, "configs", two)
    monkeypatch.setattr(tuner, "cache", {launch._fla_key(kw): two[1]})
    cfg, kwargs = launch.resolve(dict(kw))
    assert cfg is two[1] and kwargs["BV"] == 64 and kwargs["num_warps"] == 4
    assert launch.resolve(dict(kw, k=x(torch.float32))) is None
    assert launch.resolve(dict(kw, h0=None)) is None


def _tiny_tau_pack(seed: int, turns=(2, 6), max_tokens=300):
    import dataclasses

    from megatron_harts import workloads as W
    from megatron_harts.tree import trees_from_trajectories
    cfg = dataclasses.replace(W.TAU_BENCH_LIKE, num_groups=2, group_size=(3, 4), turns=turns, system_tokens=(20, 40),
                              task_tokens_median=10, task_tokens_max=20, assistant_tokens_median=8,
                              assistant_tokens_range=(2, 20), env_tokens_median=12, env_tokens_range=(2, 40),
                              max_tokens=max_tokens, vocab_size=64, seed=seed)
    return pack(trees_from_trajectories(W.rollout_trees(cfg)), chunk_size=C)


@pytest.mark.skipif(DEV == "cuda", reason="counts launches through Triton's interpreter (CPU only)")
@pytest.mark.parametrize("op", ["gdn", "simple_gla"])
def test_host_work_per_round_is_the_launch_and_one_state_op(op):
    """One more round costs, per layer: forward one Triton launch and one aten op (the initial
    states' gather), backward two launches (the recomputed states, the state gradients) and two
    aten ops (the gather, the scatter-add of ``dh0`` into the previous round's ``dht``); no
    per-round slices, allocations or fills (before: 8 aten ops forward, 19 backward)."""
    import collections

    import triton.runtime.interpreter as interpreter
    from torch.utils._python_dispatch import _disable_current_modes

    class Count(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.n, self.phase = collections.Counter(), "fwd"

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.n[(self.phase, "aten")] += 1
            return func(*args, **(kwargs or {}))

    def counts(p):
        x = _inputs(p.num_tokens, 1, 1, 16, 16, seed=4)
        x = x[:4] if op == "simple_gla" else x
        fn = (lambda *a: tree_simple_gla(*a, p, chunk_size=C, backend="fla")) if op == "simple_gla" else \
            (lambda *a: tree_gated_delta_rule(*a, p, chunk_size=C, backend="fla"))
        fn(*[t.clone().requires_grad_() for t in x]).sum().backward()     # plans built, launches resolved
        leaves = [t.clone().requires_grad_() for t in x]
        run = interpreter.InterpretedFunction.run

        def counted(self, *a, **k):
            c.n[(c.phase, "triton")] += 1
            with _disable_current_modes():            # the interpreter's own torch work is not the host's
                return run(self, *a, **k)
        interpreter.InterpretedFunction.run = counted
        try:
            with Count() as c:
                out = fn(*leaves)
                c.phase = "bwd"
                out.sum().backward()
        finally:
            interpreter.InterpretedFunction.run = run
        return c.n

    by_rounds = {}
    for seed in (1, 2, 3, 4):
        p = _tiny_tau_pack(seed)
        by_rounds.setdefault(chunk_plan(p, C).num_rounds, p)
    assert len(by_rounds) >= 2, sorted(by_rounds)
    (r0, p0), (r1, p1) = sorted(by_rounds.items())[:2]
    a, b = counts(p0), counts(p1)
    per_round = {k: (b[k] - a[k]) / (r1 - r0) for k in set(a) | set(b)}
    assert per_round == {("fwd", "aten"): 1, ("fwd", "triton"): 1, ("bwd", "aten"): 2, ("bwd", "triton"): 2}, per_round


@pytest.mark.skipif(DEV == "cuda", reason="counts launches through Triton's interpreter (CPU only)")
def test_tree_conv_and_layout_backward_launch_counts():
    """Kernel launches (``scripts.moe_op_counts.OpCounter``: aten ops that launch on CUDA) of the
    tree conv's fla path and of the all-rounds layout's backward, pinned (fewer only on purpose,
    with the counts in ``docs/benchmarks/e2e_notes.md``). Conv fix-up forward: one gather of the
    taps from x and one fill past the roots (``plan.conv_fix_taps``; before: gather of the source
    rows, ``new_zeros`` + ``cat`` of a zero row, gather of the taps: +2); backward: the forward's
    tap weights and one ``index_add_`` of the weight gradient (before: flip + copy of the weight,
    flip + add of the gradient: +3). ``rounds_grad_to_compact`` of an fp32 gradient (the GDN gate):
    2 launches (before 4); other dtypes keep the fp32 sum of the replays (6 in bf16)."""
    from megatron_harts import workloads as W
    from megatron_harts.ops.gather import rounds_grad_to_compact
    from megatron_harts.tree import trees_from_trajectories
    from scripts.tree_op_counts import counting

    def n(c, phase, kind="launches", source=None):
        return sum(v for (ph, src, k), v in c.counts.items() if ph == phase and k == kind and source in (None, src))

    p = pack(trees_from_trajectories(W.sweep_batch(1024, 4.0, tokens_per_group=512, vocab_size=64, seed=0)),
             chunk_size=C)
    g = torch.Generator().manual_seed(6)
    xwb = [torch.randn(*s, generator=g) for s in ((p.num_tokens, 8), (8, 4), (8,))]
    tree_causal_conv1d(*[t.clone().requires_grad_() for t in xwb], p, activation="silu", backend="fla").sum().backward()
    leaves = [t.clone().requires_grad_() for t in xwb]     # plans built above; fresh leaves: no grad accumulation
    with counting() as c:
        c.phase = "fwd"
        y = tree_causal_conv1d(*leaves, p, activation="silu", backend="fla")
        c.phase = "bwd"
        y.sum().backward()
    # aten launches of ops/conv.py and fla's conv (with the bias: + add forward, + sum and add backward)
    got = {ph: (n(c, ph, source="conv"), n(c, ph, "triton"), n(c, ph, "syncs")) for ph in ("fwd", "bwd")}
    assert got == {"fwd": (8, 1, 0), "bwd": (19, 2, 0)}, (got, dict(c.ops))

    plan = chunk_plan(p, C)
    assert plan.replay_pos.numel()
    for dtype, launches in ((torch.float32, 2), (torch.bfloat16, 6)):
        gy = torch.randn(plan.gather_all.shape[0], 2, 3, generator=g).to(dtype)
        with counting() as c:
            c.phase = "fwd"
            rounds_grad_to_compact(gy, plan)
        assert (n(c, "fwd"), n(c, "fwd", "syncs")) == (launches, 0), (dtype, dict(c.counts))
