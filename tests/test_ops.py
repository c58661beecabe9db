"""Tree ops against each trajectory computed alone with the plain recurrent / dense forms."""
import numpy as np
import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, strategies as st

from megatron_harts.ops import (chunk_plan, tree_attention, tree_causal_conv1d, tree_gated_delta_rule,
                                tree_simple_gla, tree_token_logprobs)
from megatron_harts.ops import reference as ref
from megatron_harts.packing import pack
from megatron_harts.tree import RolloutTree
from trees import corner_cases, trajectory_sets

TOL = 1e-5
ATOL = 1e-6  # absolute floor for entries whose reference is ~0 (e.g. a one-token softmax)


def _pack(trajs, C):
    return pack([RolloutTree.from_trajectories(trajs)], chunk_size=C)


def _rel(a, b):
    """max|a - b| / max|b|, with max|b| floored at ATOL / TOL."""
    a, b = a.detach(), b.detach()
    return float((a.double() - b.double()).abs().max() / b.double().abs().max().clamp(min=ATOL / TOL))


def _compare(pack_, inputs, tree_fn, traj_fn, seed=0, per_token=None):
    """Run ``tree_fn`` on compact leaves and ``traj_fn`` per trajectory (float64 copies of the same
    leaves; the first ``per_token`` inputs are per compact token and get gathered, the rest are
    parameters); compare outputs and the gradients of a random per-trajectory-token loss."""
    per_token = len(inputs) if per_token is None else per_token
    g = torch.Generator().manual_seed(seed)
    leaves = [x.detach().clone().requires_grad_(True) for x in inputs]
    out = tree_fn(*leaves)
    ws = [torch.randn((len(i),) + tuple(out.shape[1:]), generator=g, dtype=torch.float64)
          for i in pack_.index_of_trajectory]
    loss = sum((out[i].double() * w).sum() for i, w in zip(pack_.index_of_trajectory, ws))
    grads = torch.autograd.grad(loss, leaves)

    leaves_r = [x.detach().clone().requires_grad_(True) for x in inputs]
    outs_r = [traj_fn(*(x.double()[i] if n < per_token else x.double() for n, x in enumerate(leaves_r)))
              for i in pack_.index_of_trajectory]
    loss_r = sum((o * w).sum() for o, w in zip(outs_r, ws))
    grads_r = torch.autograd.grad(loss_r, leaves_r)
    for i, o_r in zip(pack_.index_of_trajectory, outs_r):
        assert _rel(out[i], o_r) < TOL, f"output rel err {_rel(out[i], o_r):.2e}"
    for n, (a, b) in enumerate(zip(grads, grads_r)):
        assert _rel(a, b) < TOL, f"grad of input {n}: rel err {_rel(a, b):.2e}"


def _gdn_inputs(T, H=2, HV=4, K=8, V=8, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = F.normalize(torch.randn(T, H, K, generator=g), dim=-1)
    k = F.normalize(torch.randn(T, H, K, generator=g), dim=-1)
    v = torch.randn(T, HV, V, generator=g)
    gate = F.logsigmoid(torch.randn(T, HV, generator=g) + 2)
    beta = torch.rand(T, HV, generator=g)
    return [q, k, v, gate, beta]


def _check_gdn(trajs, C, seed=0):
    p = _pack(trajs, C)
    _compare(p, _gdn_inputs(p.num_tokens, seed=seed),
             lambda *x: tree_gated_delta_rule(*x, p, chunk_size=C, backend="torch"),
             lambda *x: ref.recurrent_gated_delta_rule(*x)[0], seed)


def _check_gla(trajs, C, seed=0):
    p = _pack(trajs, C)
    q, k, v, gate, _ = _gdn_inputs(p.num_tokens, H=3, HV=3, seed=seed)
    _compare(p, [q, k, v, gate], lambda *x: tree_simple_gla(*x, p, chunk_size=C, backend="torch"),
             lambda *x: ref.recurrent_simple_gla(*x)[0], seed)


@given(trajectory_sets(chunk_size=4), st.integers(0, 3))
def test_gated_delta_rule_random_trees(trajs, seed):
    _check_gdn(trajs, 4, seed)


@given(trajectory_sets(chunk_size=4), st.integers(0, 3))
def test_simple_gla_random_trees(trajs, seed):
    _check_gla(trajs, 4, seed)


@pytest.mark.parametrize("case", list(corner_cases(8)))
def test_gated_delta_rule_corner_cases(case):
    _check_gdn(corner_cases(8)[case], 8)


@pytest.mark.parametrize("case", ["on_boundary", "one_past", "one_before", "deep", "wide"])
def test_simple_gla_corner_cases(case):
    _check_gla(corner_cases(8)[case], 8)


def test_gated_delta_rule_fla_chunk_size():
    """fla's chunk size (64) with branch points around 64 and 128."""
    rng = np.random.default_rng(3)
    base = rng.integers(0, 30, size=200).tolist()
    trajs = [base, base[:64] + [31] * 10, base[:65] + [32] * 70, base[:127] + [33] * 3, base[:150]]
    _check_gdn(trajs, 64)


def test_plan_matches_trajectory_partition():
    """Every trajectory chunk [kC, (k+1)C) is computed in exactly one sequence, starting on a
    chunk boundary of it; replay is < C tokens per sequence."""
    C = 4
    trajs = corner_cases(C)["deep"] + corner_cases(C)["one_before"]
    p = _pack(trajs, C)
    plan = chunk_plan(p, C)
    pos = p.position_ids
    for rd in plan.rounds:
        starts = rd.cu_seqlens_cpu[:-1]
        assert (pos[rd.gather[starts]] % C == 0).all()
        lens = rd.cu_seqlens_cpu.diff()
        kept = torch.zeros(len(rd.gather), dtype=torch.bool)
        kept[rd.keep] = True
        seg = torch.repeat_interleave(torch.arange(len(lens)), lens)
        replay = torch.bincount(seg[~kept], minlength=len(lens))
        assert (replay < C).all()
    owned = torch.cat([rd.gather[rd.keep] for rd in plan.rounds])
    assert sorted(owned.tolist()) == list(range(p.num_tokens))


@pytest.mark.parametrize("trajs, C, rounds, sequences, replay", [
    ([[1] * 10], 4, 1, 1, 0),                                    # one chain: one call
    ([[1] * 8 + [2] * 4, [1] * 8 + [3] * 4], 4, 2, 3, 0),        # branch on a boundary
    ([[1] * 9 + [2] * 3, [1] * 9 + [3] * 3], 4, 2, 3, 1),        # one past: replay 1
    ([[1] * 7 + [2] * 5, [1] * 7 + [3] * 5], 4, 2, 3, 3),        # one before: replay 3
    ([[1] * 6, [1] * 5 + [2]], 4, 2, 3, 1),                      # branch inside chunk 1
    ([[1, 2, 3, 4, 5], [1, 2, 3]], 4, 1, 1, 0),                  # prefix leaf absorbed
    ([[1] * 12, [1] * 4 + [2] * 8, [1] * 4 + [2] * 4 + [3] * 4], 4, 3, 5, 0),  # height 3
    ([[1] * 4 + [k] * 2 for k in range(2, 7)], 4, 2, 6, 0),      # 5 children: one round
    ([[1], [2], [3]], 4, 1, 3, 0),                               # three roots
])
def test_round_count_equals_sequence_tree_height(trajs, C, rounds, sequences, replay):
    plan = chunk_plan(_pack(trajs, C), C)
    assert (plan.num_rounds, plan.num_sequences, plan.num_replay_tokens) == (rounds, sequences, replay)


# ---- short conv, attention, log-probs -------------------------------------------------------------

@given(trajectory_sets(chunk_size=4), st.integers(2, 5), st.booleans(), st.integers(0, 3))
def test_causal_conv1d_random_trees(trajs, W, silu, seed):
    p = _pack(trajs, 4)
    g = torch.Generator().manual_seed(seed)
    D = 6
    act = "silu" if silu else None
    inputs = [torch.randn(p.num_tokens, D, generator=g), torch.randn(D, W, generator=g), torch.randn(D, generator=g)]
    _compare(p, inputs, lambda x, w, b: tree_causal_conv1d(x, w, b, p, activation=act),
             lambda x, w, b: ref.causal_conv1d(x, w, b, act), seed, per_token=1)


@pytest.mark.parametrize("case", list(corner_cases(8)))
def test_attention_corner_cases(case):
    p = _pack(corner_cases(8)[case], 8)
    g = torch.Generator().manual_seed(0)
    T = p.num_tokens
    inputs = [torch.randn(T, 4, 8, generator=g), torch.randn(T, 2, 8, generator=g), torch.randn(T, 2, 8, generator=g)]
    _compare(p, inputs, lambda q, k, v: tree_attention(q, k, v, p, backend="torch"),
             lambda q, k, v: ref.causal_attention(q, k, v))


@given(st.lists(trajectory_sets(chunk_size=4), min_size=1, max_size=3), st.integers(0, 3))
def test_attention_random_multi_tree_packs(trees, seed):
    p = pack([RolloutTree.from_trajectories(t) for t in trees])
    g = torch.Generator().manual_seed(seed)
    T = p.num_tokens
    inputs = [torch.randn(T, 2, 4, generator=g), torch.randn(T, 2, 4, generator=g), torch.randn(T, 2, 4, generator=g)]
    _compare(p, inputs, lambda q, k, v: tree_attention(q, k, v, p, backend="torch"),
             lambda q, k, v: ref.causal_attention(q, k, v), seed)


def test_flex_length_buckets():
    from megatron_harts.ops import attention
    from megatron_harts.ops.attention import flex_length
    Ts = np.arange(1, 300_000, 97)
    Tp = np.array([flex_length(int(t)) for t in Ts])
    assert (Tp >= Ts).all() and (Tp % 128 == 0).all() and (Tp - Ts < np.maximum(128, Ts / 8)).all()
    assert len(set(Tp[(Ts >= 32768) & (Ts < 65536)])) <= 9           # ~8 compiled shapes per octave
    lengths = {flex_length(t) for t in range(1, 2**21 + 1, 61)}          # up to 2M tokens
    assert 2 * len(lengths) <= attention.FLEX_RECOMPILE_LIMIT           # compiled with and without grad
    assert flex_length(65536) == 65536 and flex_length(13166) == 13312


@pytest.mark.parametrize("case", ["multi_root", "deep", "wide", "one_past"])
def test_attention_flex_path_forward(case, monkeypatch):
    """The flex path (padding to ``flex_length``, pad tokens isolated by the block mask) against the
    trajectory-wise reference, forward only: FlexAttention has no CPU backward; run eagerly."""
    from torch.nn.attention.flex_attention import flex_attention
    from megatron_harts.ops import attention
    monkeypatch.setattr(attention, "_flex", flex_attention)
    p = _pack(corner_cases(8)[case], 8)
    assert attention.flex_length(p.num_tokens) > p.num_tokens       # the pad rows are exercised
    g = torch.Generator().manual_seed(1)
    T = p.num_tokens
    q, k, v = torch.randn(T, 4, 8, generator=g), torch.randn(T, 2, 8, generator=g), torch.randn(T, 2, 8, generator=g)
    out = tree_attention(q, k, v, p, backend="flex")
    assert out.shape == (T, 4, 8)
    for idx in p.index_of_trajectory:
        want = ref.causal_attention(q[idx].double(), k[idx].double(), v[idx].double())
        assert _rel(out[idx], want) < TOL


def test_block_mask_is_built_without_grad(monkeypatch):
    """dynamo guards on grad mode: a block mask built inside a forward with grad (no recomputation)
    must reuse the graphs compiled for no-grad forwards (recomputation, precompile_tree_attention)."""
    import torch.nn.attention.flex_attention as fa
    from megatron_harts.ops import attention
    seen = []
    real = fa.create_block_mask

    def recording(*a, **kw):
        seen.append(torch.is_grad_enabled())
        return real(*a, **kw)
    monkeypatch.setattr(fa, "create_block_mask", recording)
    for grad in (True, False):
        p = _pack(corner_cases(8)["wide"], 8)               # a new pack: no cached mask
        with torch.set_grad_enabled(grad):
            m = attention.block_mask(p)
        assert m.shape[-2:] == (attention.flex_length(p.num_tokens),) * 2
    assert seen == [False, False]


def test_compiled_block_mask_builder_one_graph_for_all_lengths():
    """The GPU path's mask builder (``torch.compile(create_block_mask, dynamic=True)``), run on CPU:
    the same block masks as eager ``create_block_mask`` at every length, from one compiled graph."""
    from torch._dynamo.utils import counters
    from torch.nn.attention.flex_attention import create_block_mask
    from megatron_harts.ops import attention
    build = attention._compiled_create_block_mask()
    graphs = []
    for T in (384, 1024, 1280):
        end = torch.arange(1, T + 1)
        end[::7] = torch.clamp(torch.arange(0, T, 7) + 50, max=T)      # subtrees of 50 tokens

        def mask_mod(b, h, q, kv):
            return (kv <= q) & (q < end[kv])
        with torch.no_grad():
            got, want = (f(mask_mod, None, None, T, T, device="cpu", BLOCK_SIZE=128) for f in (build, create_block_mask))
        for x, y in zip(got.as_tuple()[2:6], want.as_tuple()[2:6]):     # (full) kv block counts and indices
            assert torch.equal(x, y)
        graphs.append(counters["stats"]["unique_graphs"])
    assert graphs[0] == graphs[1] == graphs[2], f"recompiled for a new length: graphs after each {graphs}"


def test_block_mask_falls_back_to_per_length_compile(monkeypatch, caplog):
    """If the dynamic builder fails on some torch, masks still come (``_compile=True``, per length),
    with one warning, and the dynamic builder is not tried again."""
    import torch.nn.attention.flex_attention as fa
    from megatron_harts.ops import attention
    calls, real = [], fa.create_block_mask

    def broken():
        def build(*a, **kw):
            calls.append("dynamic")
            raise RuntimeError("no dynamic shapes here")
        return build

    def recording(*a, _compile=False, **kw):
        calls.append("per-length" if _compile else "eager")
        return real(*a, **kw)
    monkeypatch.setattr(attention, "_compiled_create_block_mask", broken)
    monkeypatch.setattr(attention, "_block_mask_dynamic_failed", None)
    monkeypatch.setattr(fa, "create_block_mask", recording)
    p = _pack(corner_cases(8)["wide"], 8)
    Tp = attention.flex_length(p.num_tokens)
    end = torch.cat([p.subtree_end, torch.arange(p.num_tokens + 1, Tp + 1)])

    def mask_mod(b, h, q, kv):
        return (kv <= q) & (q < end[kv])
    with caplog.at_level("WARNING"):
        masks = [attention._make_block_mask(mask_mod, Tp, torch.device("cpu"), 128, compiled=True) for _ in range(2)]
    want = attention._make_block_mask(mask_mod, Tp, torch.device("cpu"), 128, compiled=False)
    assert calls == ["dynamic", "per-length", "per-length", "eager"]
    assert sum("dynamic block-mask compile failed" in r.message for r in caplog.records) == 1
    for m in masks:
        assert all(torch.equal(x, y) for x, y in zip(m.as_tuple()[2:6], want.as_tuple()[2:6]))


def _fake_varlen(new_api: bool):
    """CPU stand-in for ``torch.nn.attention.varlen.varlen_attn`` (FlashAttention, CUDA only) with the
    signature of torch >= 2.11 (``window_size``, ``scale``, ``enable_gqa``) or 2.10 (``is_causal``):
    causal SDPA per segment, so the glue (segments, GQA, scale, layout) is what gets tested."""
    def attend(q, k, v, cu_q, cu_k, max_q, max_k, scale, gqa, causal):
        assert causal and cu_q.dtype == torch.int32 and torch.equal(cu_q, cu_k)
        assert max_q == max_k == int((cu_q[1:] - cu_q[:-1]).max())
        if not gqa:
            assert q.shape[1] == k.shape[1], "GQA must be expanded without enable_gqa"
        out = []
        for a, b in zip(cu_q[:-1].tolist(), cu_q[1:].tolist()):
            qs, ks, vs = (x[a:b].transpose(0, 1) for x in (q, k, v))
            out.append(F.scaled_dot_product_attention(qs, ks, vs, is_causal=True, scale=scale,
                                                      enable_gqa=gqa).transpose(0, 1))
        return torch.cat(out)
    if new_api == "window_only":
        def varlen_attn(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, *, return_aux=None,
                        window_size=(-1, -1)):
            return attend(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, None, False,
                          tuple(window_size) == (-1, 0))
    elif new_api:
        def varlen_attn(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, *, return_aux=None, scale=None,
                        window_size=(-1, -1), enable_gqa=False):
            return attend(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, scale, enable_gqa,
                          tuple(window_size) == (-1, 0))
    else:
        def varlen_attn(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, is_causal=False, return_aux=None):
            return attend(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, None, False, is_causal)
    return varlen_attn


@pytest.mark.parametrize("new_api", [True, "window_only", False], ids=["torch2.14", "window-only", "torch2.10"])
def test_attention_varlen_path_on_trajectory_packs(new_api, monkeypatch):
    """The ``varlen`` backend (THD baseline) through a CPU stand-in of ``varlen_attn``: trajectory-wise
    packs match each trajectory alone; tree packs are refused."""
    from megatron_harts.ops import attention
    from megatron_harts.packing import pack_trajectories
    monkeypatch.setattr(attention, "_varlen_attn", lambda: _fake_varlen(new_api))
    trees = [RolloutTree.from_trajectories(t) for t in (corner_cases(8)["deep"], corner_cases(8)["multi_root"])]
    pt = pack_trajectories(trees, chunk_size=8)
    assert pt.is_chain and not pack(trees, chunk_size=8).is_chain
    g = torch.Generator().manual_seed(2)
    T = pt.num_tokens
    q, k, v = torch.randn(T, 4, 8, generator=g), torch.randn(T, 2, 8, generator=g), torch.randn(T, 2, 8, generator=g)
    out = tree_attention(q, k, v, pt, scale=0.3, backend="varlen")
    assert out.shape == (T, 4, 8)
    for idx in pt.index_of_trajectory:
        want = ref.causal_attention(q[idx].double(), k[idx].double(), v[idx].double(), scale=0.3)
        assert _rel(out[idx], want) < TOL
    p = pack(trees, chunk_size=8)
    with pytest.raises(ValueError, match="without branches"):
        tree_attention(q[:p.num_tokens], k[:p.num_tokens], v[:p.num_tokens], p, backend="varlen")
    assert not attention.varlen_applies(q, pt)          # CPU fp32: auto keeps the torch path


@given(trajectory_sets(chunk_size=4), st.integers(0, 3))
def test_token_logprobs_random_trees(trajs, seed):
    p = _pack(trajs, 4)
    g = torch.Generator().manual_seed(seed)
    logits = (3 * torch.randn(p.num_tokens, 7, generator=g)).requires_grad_(True)
    lps = tree_token_logprobs(logits, p)
    ws = [torch.randn(len(x), generator=g) for x in lps]
    grad = torch.autograd.grad(sum((x * w).sum() for x, w in zip(lps, ws)), logits)[0]
    logits_r = logits.detach().clone().requires_grad_(True)
    refs = [ref.token_logprobs(logits_r.double()[i], p.tokens[i]) for i in p.index_of_trajectory]
    grad_r = torch.autograd.grad(sum((x * w).sum() for x, w in zip(refs, ws)), logits_r)[0]
    for a, b in zip(lps, refs):
        torch.testing.assert_close(a.detach().double(), b.detach(), atol=1e-5, rtol=0)
    assert _rel(grad, grad_r) < TOL


def test_bad_inputs_raise_clear_errors(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)  # CPU fla runs only in Triton's interpreter
    p = _pack([[1, 2, 3]], 4)
    x = _gdn_inputs(3)
    with pytest.raises(ValueError, match="q: expected"):
        tree_gated_delta_rule(x[0][:2], *x[1:], p)
    with pytest.raises(ValueError, match="multiple of"):
        tree_gated_delta_rule(x[0], x[1], x[2][:, :3], x[3][:, :3], x[4][:, :3], p)
    with pytest.raises(ValueError, match="backend"):
        tree_gated_delta_rule(*x, p, backend="cuda-magic")
    with pytest.raises(ValueError, match="fla"):
        tree_gated_delta_rule(*x, p, backend="fla")
    with pytest.raises(ValueError, match="outside the logits"):
        tree_token_logprobs(torch.randn(3, 2), p)
    with pytest.raises(ValueError, match="weight"):
        tree_causal_conv1d(torch.randn(3, 4), torch.randn(5, 4), None, p)


@pytest.mark.parametrize("case", list(corner_cases(8)))
def test_conv_fix_rows_patch_a_plain_conv(case):
    """The fla conv backend = plain causal conv over the compact array + fix rows recomputed from
    their source rows (``conv_fix_plan``); emulated here with the reference conv on every corner
    case (test_fla_backend runs fla's kernel)."""
    from megatron_harts.ops.conv import _gather_conv
    from megatron_harts.ops.plan import conv_fix_plan
    p = _pack(corner_cases(8)[case], 8)
    g = torch.Generator().manual_seed(0)
    x, w, b = torch.randn(p.num_tokens, 5, generator=g), torch.randn(5, 4, generator=g), torch.randn(5, generator=g)
    rows, sources, local = conv_fix_plan(p, 4)
    y = ref.causal_conv1d(x, w, b, "silu")
    y = y.index_copy(0, rows, _gather_conv(x[sources], w, b, local, "silu"))
    for i in p.index_of_trajectory:
        torch.testing.assert_close(y[i], ref.causal_conv1d(x[i], w, b, "silu"), rtol=1e-5, atol=1e-5)



@pytest.mark.parametrize("case", ["wide", "duplicates", "one_past"])
def test_plan_gather_backward_equals_index_select(case):
    """gather_rounds / owned_outputs: same values and gradients as plain index_select."""
    from megatron_harts.ops.gather import gather_rounds, owned_outputs
    p = _pack(corner_cases(8)[case], 8)
    plan = chunk_plan(p, 8)
    assert plan.replay_pos.numel() == plan.num_replay_tokens > 0
    g = torch.Generator().manual_seed(0)
    x = torch.randn(p.num_tokens, 3, generator=g, requires_grad=True)
    w = torch.randn(len(plan.gather_all), 3, generator=g)

    def run(gather, owned):
        y = gather(x)
        z = owned(y * w)
        (gx,) = torch.autograd.grad((z.sin().sum() + y.sum()), x)
        return y.detach(), z.detach(), gx

    got = run(lambda x: gather_rounds(x, plan), lambda o: owned_outputs(o, plan))
    want = run(lambda x: x.index_select(0, plan.gather_all), lambda o: o.index_select(0, plan.out_index))
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)


def test_chain_pack_backend(monkeypatch):
    """The kernel ``auto`` uses on trajectory packs (what benchmarks report as the baseline's
    attention): torch on CPU; on CUDA varlen where torch has it and it has not failed, else flex."""
    from megatron_harts.ops import attention
    cuda = torch.device("cuda")
    assert attention.chain_pack_backend(torch.device("cpu")) == "torch"
    monkeypatch.setattr(attention, "_varlen_attn", lambda: object())
    assert attention.chain_pack_backend(cuda) == "varlen"
    monkeypatch.setattr(attention, "_varlen_failed", "RuntimeError: no FlashAttention build")
    assert attention.chain_pack_backend(cuda) == "flex"
    monkeypatch.setattr(attention, "_varlen_failed", None)
    monkeypatch.setattr(attention, "_varlen_attn", lambda: None)
    assert attention.chain_pack_backend(cuda) == "flex"


def test_token_logprobs_no_host_sync_after_the_first_call():
    """The vocabulary check and the trajectory lengths are read from the device once per pack."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Syncs(TorchDispatchMode):
        n = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            Syncs.n += "_local_scalar_dense" in str(func) or "nonzero" in str(func)
            return func(*args, **(kwargs or {}))

    p = _pack(corner_cases(8)["multi_root"], 8)
    logits = torch.randn(p.num_tokens, int(p.tokens.max()) + 1, requires_grad=True)
    tree_token_logprobs(logits, p)
    with Syncs():
        sum(lp.sum() for lp in tree_token_logprobs(logits, p)).backward()
    assert Syncs.n == 0
