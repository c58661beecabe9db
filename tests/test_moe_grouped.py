"""Grouped-GEMM MoE experts (``megatron_harts.moe.grouped``): ``TorchGroupedLinear`` in Megatron's
``TEGroupedMLP`` (torch's ``_grouped_mm``) against the per-expert reference and against Megatron's
own ``SequentialMLP`` experts with the same weights, in a tree-packed model; tree == trajectory-wise
with grouped experts; unsupported settings refused."""
import pytest
import torch

from megatron_harts import verify
from megatron_harts.megatron import cpu_shim, tree_hybrid_stack_spec
from megatron_harts.moe.grouped import (TorchGroupedLinear, grouped_applies, grouped_linear,
                                        sequential_to_grouped)
from megatron_harts.packing import pack, pack_trajectories
from megatron_harts.tree import RolloutTree
from trees import corner_cases

VOCAB, C, E = 64, 8, 4


@pytest.mark.parametrize("counts", [[8, 0, 24, 16], [0, 0, 0, 48], [1, 2, 3, 42]])
def test_grouped_linear_equals_the_per_expert_loop(counts):
    """Outputs and both gradients, empty experts and an empty batch included (fp32, CPU kernel)."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(sum(counts), 16, generator=g, dtype=torch.float64).float()
    w = torch.randn(E, 32, 16, generator=g)
    dy = torch.randn(sum(counts), 32, generator=g)
    outs = {}
    for backend in ("grouped", "loop"):
        xb, wb = x.clone().requires_grad_(), w.clone().requires_grad_()
        y = grouped_linear(xb, wb, counts, backend=backend if sum(counts) else "auto")
        (y * dy).sum().backward()
        outs[backend] = (y.detach(), xb.grad, wb.grad)
    assert grouped_applies(x, w)
    for a, b in zip(outs["grouped"], outs["loop"]):
        assert a.shape == b.shape and torch.allclose(a, b, atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError, match="does not match"):
        grouped_linear(x, w, counts[:-1])


def test_empty_batch_keeps_the_weight_in_the_graph():
    w = torch.randn(E, 32, 16, requires_grad=True)
    y = grouped_linear(torch.zeros(0, 16), w, [0] * E)
    assert y.shape == (0, 32)
    y.sum().backward()
    assert w.grad is not None and not w.grad.any()


def test_grouped_applies_only_to_aligned_rows():
    assert not grouped_applies(torch.zeros(4, 6), torch.zeros(2, 8, 6))        # 24-byte rows
    assert grouped_applies(torch.zeros(4, 8), torch.zeros(2, 12, 8))
    x64, w64 = torch.randn(6, 8, dtype=torch.float64), torch.randn(2, 12, 8, dtype=torch.float64)
    assert not grouped_applies(x64, w64)                                        # torch's kernel has no fp64
    want = torch.cat([x64[:2] @ w64[0].t(), x64[2:] @ w64[1].t()])
    assert torch.equal(grouped_linear(x64, w64, [2, 4]), want)                # the loop runs instead


def _trees():
    cases = corner_cases(C)
    return [RolloutTree.from_trajectories([[t % VOCAB for t in tr] for tr in cases[n]])
            for n in ("duplicates", "one_past", "multi_root")]


def _build(grouped, **kw):
    return cpu_shim.build_tiny_hybrid_model("*EGE", vocab_size=VOCAB, init_method_std=0.1,
                                            hybrid_stack_spec=tree_hybrid_stack_spec(E, grouped_experts=grouped),
                                            num_moe_experts=E, moe_ffn_hidden_size=32, **kw)


def _weights(trees):
    g = torch.Generator().manual_seed(1)
    return [torch.randn(len(r) - 1, generator=g) for t in trees for r in t.records]


def test_grouped_experts_equal_sequential_mlp_and_trees_equal_trajectories():
    """Same weights (SequentialMLP's stacked into [E, out, in]): the grouped model's tree-packed
    log-probs and every gradient equal SequentialMLP's; and the grouped model tree-packed equals
    itself trajectory-wise (multiplicity-weighted router losses on)."""
    aux = dict(moe_router_load_balancing_type=["aux_loss", "seq_aux_loss"], moe_aux_loss_coeff=[0.1, 0.1],
               moe_z_loss_coeff=0.01)
    trees = _trees()
    ws = _weights(trees)
    with cpu_shim.cpu_megatron(seed=0):
        seq = _build(False, **aux)
        grp = _build(True, **aux)
        from megatron.core.transformer.moe.experts import SequentialMLP, TEGroupedMLP
        assert any(isinstance(m, SequentialMLP) for m in seq.modules())
        assert any(isinstance(m, TEGroupedMLP) for m in grp.modules())
        assert all(isinstance(m.linear_fc1, TorchGroupedLinear) for m in grp.modules() if isinstance(m, TEGroupedMLP))
        missing, unexpected = grp.load_state_dict(sequential_to_grouped(seq.state_dict()), strict=False)
        assert not unexpected and all(k.endswith("_extra_state") for k in missing), (missing, unexpected)
        s_lp, s_loss, s_g = verify.run_packed(seq, trees, pack, ws, chunk_size=C)
        g_lp, g_loss, g_g = verify.run_packed(grp, trees, pack, ws, chunk_size=C)
        assert max(verify.rel_diff(a, b) for a, b in zip(g_lp, s_lp) if b.numel()) < 1e-5
        assert verify.rel_diff(g_loss, s_loss) < 1e-5
        g_as_seq = {k: v for k, v in sequential_to_grouped(s_g).items()}
        bad = {k: verify.rel_diff(g_g[k], g_as_seq[k]) for k in g_g if verify.rel_diff(g_g[k], g_as_seq[k]) > 1e-5}
        assert not bad, bad
        t_lp, t_loss, t_g = verify.run_packed(grp, trees, pack_trajectories, ws, chunk_size=C)
        assert max(verify.rel_diff(a, b) for a, b in zip(g_lp, t_lp) if b.numel()) < 1e-5
        tol = lambda k: 1e-4 if k.endswith(verify.DECAY_PARAMS) else 1e-5  # noqa: E731
        bad = {k: e for k in t_g if (e := verify.rel_diff(g_g[k], t_g[k])) > tol(k)}
        assert not bad, bad
        with pytest.raises(NotImplementedError, match="distributed checkpoints"):
            grp.sharded_state_dict()


def test_unsupported_settings_are_refused():
    import copy
    cfg = cpu_shim.tiny_hybrid_config("*E", num_moe_experts=E)
    w = TorchGroupedLinear(E, 16, 32, config=cfg, init_method=torch.nn.init.zeros_, bias=False, skip_bias_add=False,
                           is_expert=True)
    assert w.weight.tensor_model_parallel and w.weight.partition_dim == 0 and w.weight.allreduce
    with pytest.raises(NotImplementedError, match="biases"):
        TorchGroupedLinear(E, 16, 32, config=cfg, init_method=torch.nn.init.zeros_, bias=True, skip_bias_add=False,
                           is_expert=True)
    etp = copy.copy(cfg)
    etp.expert_tensor_parallel_size = 2
    with pytest.raises(NotImplementedError, match="expert tensor parallelism 2"):
        TorchGroupedLinear(E, 16, 32, config=etp, init_method=torch.nn.init.zeros_, bias=False, skip_bias_add=False,
                           is_expert=True)
