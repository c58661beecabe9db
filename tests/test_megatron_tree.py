"""Tree-packed HybridModel == trajectory-wise THD baseline == each trajectory alone
(docs/design.md#12-numerical-contract-and-verification).

A tiny fp32 ``HybridModel`` ("G*-G-": GDN, attention, MLP) built on CPU through ``cpu_shim`` with
``tree_hybrid_stack_spec``. The same weights run (a) ``pack_trajectories`` (every trajectory its
own chain: plain THD varlen packing), (b) ``pack`` (tree-packed) and, for a few cases, (c) every
trajectory alone as an ordinary unpacked batch of 1 (stock Megatron path, torch kernels via
``deterministic_mode``). Per-trajectory log-probs, the loss and every parameter gradient must
agree within 1e-5 relative.

Exception, measured: the gradients of the GDN decay parameters ``A_log`` / ``dt_bias`` (``[HV]``,
a sum over every token with heavy cancellation) carry fp32 noise of the trajectory-wise baseline
itself of up to 7.7e-5 relative (baseline with chunk size 8 vs 64, ``deep`` case; Megatron's own
unpacked torch path vs the baseline: up to 3.5e-5). They are held to DECAY_TOL = 1e-4. (With the
GDN core in fp64 the tree-vs-baseline error of these grads drops to 3e-7, the rest being
Megatron's fp32 casts of ``gate``/``alpha``.)
"""
import math

import pytest
import torch

from megatron_harts import verify
from megatron_harts.megatron import cpu_shim, tree_hybrid_stack_spec
from megatron_harts.packing import pack, pack_trajectories
from megatron_harts.tree import RolloutTree
from trees import corner_cases, random_trees

PATTERN, VOCAB, C, TOL, DECAY_TOL = "G*-G-", 64, 8, 1e-5, 1e-4


def _random_trees(seed, num_trees=3):
    return random_trees(seed, C, VOCAB, num_trees)


CASES = {name: [[[t % VOCAB for t in traj] for traj in trajs]] for name, trajs in corner_cases(C).items()}
CASES.update({f"random{s}": _random_trees(s) for s in range(2)})


@pytest.fixture(scope="module")
def models():
    """Models with the same weights: {"plain", "recompute", "unpacked"}."""
    with cpu_shim.cpu_megatron(seed=0):
        def build(**kw):
            return cpu_shim.build_tiny_hybrid_model(PATTERN, vocab_size=VOCAB, init_method_std=0.1,
                                                    hybrid_stack_spec=tree_hybrid_stack_spec(), **kw)
        out = {"plain": build(), "recompute": build(**verify.RECOMPUTE), "unpacked": build(deterministic_mode=True)}
        for m in out.values():
            m.load_state_dict(out["plain"].state_dict())
        yield out


def _weights(trees, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(len(r) - 1, generator=g) for tree in trees for r in tree.records]


def run_packed(model, trees, layout, ws):
    return verify.run_packed(model, trees, layout, ws, chunk_size=C)


def run_unpacked(model, trees, ws):
    """The same, every trajectory alone as an ordinary ``[1, L]`` sequence without packed params."""
    lps = []
    for tree in trees:
        for r in tree.records:
            ids = torch.as_tensor(r.tokens, dtype=torch.long)[None]
            logits = model(ids, torch.arange(ids.shape[1])[None], None)[0, :-1]
            lps.append(torch.log_softmax(logits.float(), -1).gather(1, ids[0, 1:, None])[:, 0])
    return [lp.detach() for lp in lps], *verify.backward(model, lps, ws)


_rel = verify.rel_diff


def _grad_tol(name):
    return DECAY_TOL if name.endswith(verify.DECAY_PARAMS) else TOL


def assert_close(got, want, what):
    """Log-probs and loss within TOL, grads within ``_grad_tol`` relative."""
    lps, loss, grads = got
    lps_r, loss_r, grads_r = want
    assert [x.shape for x in lps] == [x.shape for x in lps_r]
    err = max(_rel(a, b) for a, b in zip(lps, lps_r) if b.numel())
    assert err < TOL, f"{what}: log-prob rel err {err:.2e}"
    assert _rel(loss, loss_r) < TOL, f"{what}: loss {loss} vs {loss_r}"
    assert grads.keys() == grads_r.keys()
    errs = {n: _rel(grads[n], grads_r[n]) for n in grads}
    bad = {n: e for n, e in errs.items() if e >= _grad_tol(n)}
    assert not bad, f"{what}: grad rel errs {bad}"


@pytest.mark.parametrize("recompute", [False, True], ids=["plain", "recompute"])
@pytest.mark.parametrize("case", sorted(CASES))
def test_tree_packed_equals_trajectory_packed(models, case, recompute):
    model = models["recompute" if recompute else "plain"]
    trees = [RolloutTree.from_trajectories(t) for t in CASES[case]]
    ws = _weights(trees)
    base = run_packed(model, trees, pack_trajectories, ws)
    tree = run_packed(model, trees, pack, ws)
    assert_close(tree, base, f"{case}: tree vs trajectory-wise")


@pytest.mark.parametrize("case", ["one_past", "multi_root", "deep", "random1"])
def test_trajectory_packed_equals_unpacked(models, case):
    trees = [RolloutTree.from_trajectories(t) for t in CASES[case]]
    ws = _weights(trees)
    base = run_packed(models["plain"], trees, pack_trajectories, ws)
    alone = run_unpacked(models["unpacked"], trees, ws)
    assert_close(base, alone, f"{case}: trajectory-wise vs unpacked")


def test_verify_cli(capsys):
    assert verify.main(["--pattern", "G*-G-", "--seed", "0"]) == 0
    assert '"max_grad_rel_diff"' in capsys.readouterr().out


def test_verify_reversed_rerun_maps_back_to_the_original_order(models):
    """``verify.run_reversed`` (the bf16 noise floor on CUDA): same results as ``run_packed`` in fp32,
    with trees of different sizes so a wrong mapping would pair different trajectories."""
    trees = [RolloutTree.from_trajectories(t) for t in _random_trees(5, num_trees=4)]
    assert len({len(t.records) for t in trees}) > 1
    ws = _weights(trees, seed=3)
    with cpu_shim.cpu_megatron(seed=0):
        base = run_packed(models["plain"], trees, pack_trajectories, ws)
        rev = verify.run_reversed(models["plain"], trees, pack_trajectories, ws, C, "cpu")
    assert [len(x) for x in rev[0]] == [len(x) for x in base[0]]
    diff = verify.compare(rev, base)
    assert diff["max_logprob_abs_diff"] < 1e-5 and diff["loss_rel_diff"] < TOL, diff
    assert diff["max_grad_rel_diff_non_decay"] < TOL, diff


def test_verify_permuted_reruns_map_back_to_the_original_order(models):
    """``verify.run_permuted`` in every order of ``verify.noise_orders`` (the CUDA noise floor's reruns):
    the same log-probs, loss and gradients as ``run_packed`` in fp32, with trees of different sizes
    so a wrong mapping would pair different trajectories; ``run_side(order=...)`` is the same run."""
    trees = [RolloutTree.from_trajectories(t) for t in _random_trees(7, num_trees=4)]
    assert len({len(t.records) for t in trees}) > 1
    ws = _weights(trees, seed=5)
    orders = verify.noise_orders(len(trees), 4, seed=1)
    assert orders[0] == [3, 2, 1, 0] and len(orders) == 4
    with cpu_shim.cpu_megatron(seed=0):
        base = run_packed(models["plain"], trees, pack_trajectories, ws)
        for order in orders:
            got = verify.run_permuted(models["plain"], trees, pack_trajectories, ws, C, "cpu", order)
            assert [len(x) for x in got[0]] == [len(x) for x in base[0]]
            diff = verify.compare(got, base)
            assert diff["max_logprob_abs_diff"] < 1e-5 and diff["loss_rel_diff"] < TOL, (order, diff)
            assert diff["max_grad_rel_diff_non_decay"] < TOL, (order, diff)
        side = verify.run_side(models["plain"], trees, pack_trajectories, ws, C, order=orders[1])
        assert verify.compare(side[:3], base)["max_logprob_abs_diff"] < 1e-5


def test_noise_orders_are_distinct_non_identity_and_seeded():
    """Reversed first, then distinct shuffles; never the identity (that would rerun the baseline's own
    order: no noise); deterministic per seed; capped by the orders that exist; none for one tree."""
    for n, k in ((2, 4), (3, 4), (3, 9), (6, 4), (12, 6)):
        orders = verify.noise_orders(n, k, seed=0)
        ident = list(range(n))
        assert orders[0] == ident[::-1]
        assert len(orders) == min(k, math.factorial(n) - 1), (n, k, orders)
        assert all(sorted(o) == ident and o != ident for o in orders)
        assert len({tuple(o) for o in orders}) == len(orders)
        assert verify.noise_orders(n, k, seed=0) == orders
    assert verify.noise_orders(6, 4, seed=0) != verify.noise_orders(6, 4, seed=1)
    assert verify.noise_orders(1, 4) == [] and verify.noise_orders(5, 0) == []


def test_verify_noise_reruns_argument(capsys):
    """``--noise-reruns 0`` is refused at parse time with a one-line message, exit 2."""
    with pytest.raises(SystemExit) as e:
        verify.main(["--noise-reruns", "0"])
    assert e.value.code == 2 and "--noise-reruns must be >= 1, got 0" in capsys.readouterr().err


def test_verify_cuda_gate_uses_the_largest_noise_comparison():
    """The bf16 gate of ``verify --device cuda`` on H200 numbers (1.48B model): the tree vs the
    FlexAttention baseline (fifth session) against the reversed reruns of the FlashAttention varlen
    baseline (fifth session: log-probs reproduced exactly, 0.0) and of a FlexAttention baseline
    (third session). The varlen rerun alone is no floor for a FlexAttention tree; a tree 10x outside
    every floor fails, naming the keys."""
    keys = ("max_logprob_abs_diff", "loss_rel_diff", "max_grad_rel_diff")
    tree = dict(zip(keys, (0.1013, 1.03e-3, 0.163)))
    varlen_rerun = dict(zip(keys, (0.0, 2.3e-7, 0.0373)))
    flex_rerun = dict(zip(keys, (0.094, 1.2e-3, 0.114)))
    assert verify.within_noise(tree, [varlen_rerun, flex_rerun], 3.0) == []
    assert verify.within_noise(tree, [varlen_rerun], 3.0) == ["max_logprob_abs_diff", "max_grad_rel_diff"]
    bad = {k: 10 * v for k, v in tree.items()}
    assert verify.within_noise(bad, [varlen_rerun, flex_rerun], 3.0) == list(keys)
    nan = dict(tree, max_logprob_abs_diff=float("nan"))
    assert verify.within_noise(nan, [varlen_rerun, flex_rerun], 3.0) == [keys[0]]


def test_fused_rope_is_refused_for_tree_packs(models, monkeypatch):
    """TE's fused THD RoPE is not validated with the per-token rotary table of tree packs (no TE
    here), so a model configured with RoPE fusion must refuse them rather than risk mis-rotating."""
    model = models["plain"]
    trees = [RolloutTree.from_trajectories(t) for t in CASES["multi_root"]]
    monkeypatch.setattr(model.config, "apply_rope_fusion", True)
    with cpu_shim.cpu_megatron(seed=0), pytest.raises(ValueError, match="apply_rope_fusion=False"):
        run_packed(model, trees, pack, _weights(trees))


def test_te_spec_needs_transformer_engine():
    from megatron.core.extensions.transformer_engine import HAVE_TE
    from megatron_harts.megatron import tree_te_hybrid_stack_spec
    if HAVE_TE:
        pytest.skip("Transformer Engine is installed: the missing-TE error cannot be provoked")
    with pytest.raises(ImportError, match="needs Transformer Engine.*tree_hybrid_stack_spec"):
        tree_te_hybrid_stack_spec()


def test_te_spec_swaps_in_the_tree_layers_and_keeps_te_modules(monkeypatch):
    """Structure of the TE spec (its numerics need TE on a GPU: ``verify --device cuda --spec te``).
    Without TE, Megatron's TE classes are placeholders, which is enough to check the wiring."""
    import megatron.core.extensions.transformer_engine as te
    from megatron.core.models.hybrid import hybrid_layer_specs as megatron_specs
    from megatron.core.models.hybrid.hybrid_block import HybridStack
    from megatron_harts.megatron import (TreeCoreAttention, TreeGatedDeltaNet, TreeHybridStack,
                                         tree_te_hybrid_stack_spec)
    from megatron_harts.megatron.mamba import TreeMambaMixer

    monkeypatch.setattr(te, "HAVE_TE", True)
    spec = tree_te_hybrid_stack_spec()
    s = spec.submodules
    assert spec.module is TreeHybridStack and spec.params["final_norm"] is te.TENorm
    gdn = s.gdn_layer.submodules.self_attention
    assert gdn.module is TreeGatedDeltaNet and gdn.submodules.in_proj is te.TELayerNormColumnParallelLinear
    att = s.attention_layer.submodules.self_attention.submodules
    assert att.core_attention is TreeCoreAttention and att.linear_qkv is te.TELayerNormColumnParallelLinear
    assert s.mamba_layer.submodules.mixer.module is TreeMambaMixer
    assert s.mamba_layer.submodules.mixer.submodules.in_proj is te.TELayerNormColumnParallelLinear
    from megatron_harts.moe import TreeMoETransformerLayer, TreeTopKRouter
    assert s.moe_layer.module is TreeMoETransformerLayer
    mlp = s.moe_layer.submodules.mlp
    router = mlp.keywords["submodules"].router if hasattr(mlp, "keywords") else mlp.submodules.router
    assert router is TreeTopKRouter
    ref = megatron_specs.hybrid_stack_spec.submodules          # Megatron's own spec is left alone
    assert megatron_specs.hybrid_stack_spec.module is HybridStack
    assert ref.attention_layer.submodules.self_attention.submodules.core_attention is te.TEDotProductAttention
    assert ref.gdn_layer.submodules.self_attention.module is not TreeGatedDeltaNet
    assert ref.mamba_layer.submodules.mixer.module is not TreeMambaMixer
    assert ref.moe_layer.module is not TreeMoETransformerLayer


def test_attention_backend_reaches_the_core_attention(models):
    """``tree_hybrid_stack_spec(attention_backend=...)`` binds the backend into every '*' layer and
    ``attention_backend(model, ...)`` switches a built model for a block: 'varlen' on a tree pack then
    fails with the backend's own error (so the setting is what ``tree_attention`` receives), and the
    previous backend is back afterwards (same log-probs as before)."""
    from megatron_harts.megatron import TreeCoreAttention, attention_backend
    spec = tree_hybrid_stack_spec(attention_backend="torch")
    core = spec.submodules.attention_layer.submodules.self_attention.submodules.core_attention
    assert core.func is TreeCoreAttention and core.keywords == {"tree_attention_backend": "torch"}
    assert tree_hybrid_stack_spec().submodules.attention_layer.submodules.self_attention.submodules \
        .core_attention is TreeCoreAttention
    with pytest.raises(ValueError, match="attention_backend must be one of"):
        tree_hybrid_stack_spec(attention_backend="flash")
    model = models["plain"]
    trees = [RolloutTree.from_trajectories(t) for t in CASES["multi_root"]]
    ws = _weights(trees)
    with cpu_shim.cpu_megatron(seed=0):
        before = run_packed(model, trees, pack, ws)[0]
        with pytest.raises(ValueError, match="backend='varlen' needs a pack without branches"):
            with attention_backend(model, "varlen"):
                assert {m.tree_attention_backend for m in model.modules() if isinstance(m, TreeCoreAttention)} \
                    == {"varlen"}
                run_packed(model, trees, pack, ws)
        assert {m.tree_attention_backend for m in model.modules() if isinstance(m, TreeCoreAttention)} == {"auto"}
        after = run_packed(model, trees, pack, ws)[0]
        bound = cpu_shim.build_tiny_hybrid_model(PATTERN, vocab_size=VOCAB, init_method_std=0.1,
                                                 hybrid_stack_spec=tree_hybrid_stack_spec(attention_backend="varlen"))
        with pytest.raises(ValueError, match="backend='varlen' needs a pack without branches"):
            run_packed(bound, trees, pack, ws)          # the spec's backend reaches tree_attention
    assert all(torch.equal(a, b) for a, b in zip(before, after))
