"""MoE token permutation with one device->host copy per layer (``megatron_harts.moe.dispatch``)
against Megatron's own (the ``reference`` backend): plan, dispatcher outputs and gradients on corner
cases (an expert without tokens, a single token, top-k > 1, all tokens on one expert, no tokens),
a tree-packed model with multiplicity-weighted router losses (SequentialMLP and grouped experts),
and the number of host syncs / host->device copies of one MoE layer (``scripts/moe_op_counts.py``'s
counter): at most 1 sync per layer forward, none in its backward, no offsets copied to the device."""
import os
import sys

import pytest
import torch
from megatron.core.transformer.moe.moe_utils import permute

from megatron_harts import verify
from megatron_harts.megatron import cpu_shim, tree_hybrid_stack_spec
from megatron_harts.moe.dispatch import (CountsOnceAllGatherDispatcher, DeviceCounts, device_offsets,
                                         dispatch_plan, use_counts_once_dispatcher)
from megatron_harts.packing import pack, pack_trajectories
from megatron_harts.tree import RolloutTree
from trees import corner_cases

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from scripts.moe_op_counts import counting  # noqa: E402

VOCAB, C, E = 64, 8, 4


def _map(rows, e=E):
    m = torch.zeros(len(rows), e, dtype=torch.bool)
    for i, r in enumerate(rows):
        m[i, list(r)] = True
    return m


MAPS = {
    "expert_without_tokens": _map([(0, 2), (2, 3), (0, 3), (3, 2), (0, 2)]),      # expert 1 gets none
    "single_token": _map([(1,)]),
    "single_token_top2": _map([(3, 0)]),
    "one_expert_takes_all": _map([(2,)] * 7),
    "top3": _map([(0, 1, 2), (1, 2, 3), (0, 2, 3), (0, 1, 3)]),
    "no_tokens": torch.zeros(0, E, dtype=torch.bool),
}


@pytest.mark.parametrize("name", list(MAPS))
def test_plan_is_megatrons_permutation(name):
    m = MAPS[name]
    plan = dispatch_plan(m)
    want_counts = m.sum(0).long()
    assert plan.counts == want_counts.tolist() and torch.equal(plan.tokens_per_expert, want_counts)
    assert plan.tokens_per_expert.device.type == "cpu"
    x = torch.randn(m.shape[0], 3)
    _, _, sorted_idx, _, _ = permute(x, m, num_out_tokens=int(want_counts.sum()))
    assert torch.equal(plan.token_index, sorted_idx)
    probs = torch.rand(m.shape[0], E)
    assert torch.equal(probs.T.reshape(-1)[plan.flat_index], probs.T.contiguous().masked_select(m.T.contiguous()))
    assert torch.equal(plan.offsets, want_counts.cumsum(0).int())
    assert device_offsets(plan.counts, "cpu") is plan.offsets


def _build(grouped, **kw):
    return cpu_shim.build_tiny_hybrid_model("*EGE", vocab_size=VOCAB, init_method_std=0.1,
                                            hybrid_stack_spec=tree_hybrid_stack_spec(E, grouped_experts=grouped),
                                            num_moe_experts=E, moe_ffn_hidden_size=32, **kw)


def _moe_layers(model):
    from megatron.core.transformer.moe.moe_layer import MoELayer
    return [m for m in model.modules() if isinstance(m, MoELayer)]


def _set_backend(model, backend):
    for layer in _moe_layers(model):
        use_counts_once_dispatcher(layer, backend)
        assert isinstance(layer.token_dispatcher, CountsOnceAllGatherDispatcher)
        assert layer.token_dispatcher.backend == backend


def _uniform_topk(m):
    k = m.sum(1)
    return int(k[0]) if m.shape[0] and bool((k == k[0]).all()) else None


# tree mode only for maps whose rows have exactly top-k experts (what tree routing produces)
CASES = [(name, tree_mode) for name in MAPS for tree_mode in (False, True)
         if not tree_mode or _uniform_topk(MAPS[name]) is not None]


@pytest.mark.parametrize("grouped", [False, True])
@pytest.mark.parametrize("name,tree_mode", CASES)
def test_dispatcher_fast_equals_reference(name, grouped, tree_mode):
    """A MoE layer's dispatcher + experts + combine, routing map and probs given: outputs and the
    gradients of hidden states, probs and expert weights, fast vs Megatron's reference. In tree mode
    (rows of exactly top-k experts) grouped experts get the counts on the device (DeviceCounts)."""
    m = MAPS[name]
    topk = _uniform_topk(m)
    g = torch.Generator().manual_seed(0)
    with cpu_shim.cpu_megatron(seed=0):
        layer = _moe_layers(_build(grouped))[0]
        if tree_mode:
            layer.token_dispatcher.router_topk = topk
            layer.router._tree_pack = pack(_trees(), chunk_size=C)     # what tree_routing(pack) sets
        h = torch.randn(m.shape[0], 1, layer.config.hidden_size, generator=g)
        p = torch.rand(m.shape[0], E, generator=g) * m
        dy = torch.randn_like(h)
        res = {}
        for backend in ("reference", "fast"):
            use_counts_once_dispatcher(layer, backend)
            layer.zero_grad(set_to_none=True)
            hb, pb = h.clone().requires_grad_(), p.clone().requires_grad_()
            d = layer.token_dispatcher
            x, probs = d.dispatch_preprocess(hb, m, pb)
            x, probs = d.token_dispatch(x, probs)
            x, tpe, probs = d.dispatch_postprocess(x, probs)
            if backend == "fast" and tree_mode and grouped:
                assert isinstance(tpe, DeviceCounts) and tpe.host() == m.sum(0).tolist()
            else:
                assert tpe.device.type == "cpu" and tpe.tolist() == m.sum(0).tolist()
            y, _ = layer.experts(x, tpe, probs)
            y = d.combine_postprocess(d.token_combine(d.combine_preprocess(y)))
            (y * dy).sum().backward()
            res[backend] = [y.detach(), hb.grad, pb.grad] + [q.grad for q in layer.experts.parameters()]
        for a, b in zip(res["fast"], res["reference"]):
            assert (a is None and b is None) or torch.equal(a, b)


def _trees():
    cases = corner_cases(C)
    return [RolloutTree.from_trajectories([[t % VOCAB for t in tr] for tr in cases[n]])
            for n in ("duplicates", "one_past", "multi_root")]


@pytest.mark.parametrize("grouped", [False, True])
def test_model_fast_equals_reference_tree_and_trajectory_wise(grouped):
    """Tree-packed (multiplicity-weighted aux / seq-aux / z-loss, top-2) and trajectory-wise, full
    recomputation: log-probs, loss and every gradient bitwise equal between the two backends."""
    aux = dict(moe_router_load_balancing_type=["aux_loss", "seq_aux_loss"], moe_aux_loss_coeff=[0.1, 0.1],
               moe_z_loss_coeff=0.01, moe_router_topk=2, recompute_granularity="full", recompute_method="uniform",
               recompute_num_layers=1)
    trees = _trees()
    g = torch.Generator().manual_seed(1)
    ws = [torch.randn(len(r) - 1, generator=g) for t in trees for r in t.records]
    with cpu_shim.cpu_megatron(seed=0):
        model = _build(grouped, **aux)
        for layout in (pack, pack_trajectories):
            out = {}
            for backend in ("reference", "fast"):
                _set_backend(model, backend)
                out[backend] = verify.run_packed(model, trees, layout, ws, chunk_size=C)
            (lf, lossf, gf), (lr, lossr, gr) = out["fast"], out["reference"]
            assert all(torch.equal(a, b) for a, b in zip(lf, lr)) and torch.equal(lossf, lossr)
            assert gf.keys() == gr.keys() and all(torch.equal(gf[k], gr[k]) for k in gf), layout.__name__


@pytest.mark.parametrize("grouped", [False, True])
def test_one_moe_layer_syncs_once(grouped):
    """Forward + backward of one MoE layer on a tree pack (router in tree mode, aux losses on):
    1 host sync in the forward with SequentialMLP (its split needs host counts), none with grouped
    experts, 0 in the backward, no host->device copies; Megatron's path (``reference``) takes 2
    syncs (counts, masked_select) and, with grouped experts, copies the offsets to the device for
    fc1 and fc2."""
    trees = _trees()
    p = pack(trees, chunk_size=C)
    aux = dict(moe_router_load_balancing_type=["aux_loss", "seq_aux_loss"], moe_aux_loss_coeff=[0.1, 0.1],
               moe_z_loss_coeff=0.01, moe_router_topk=2)
    with cpu_shim.cpu_megatron(seed=0):
        model = _build(grouped, **aux)
        layer = _moe_layers(model)[0]
        h = torch.randn(p.num_tokens, 1, layer.config.hidden_size)
        counts = {}
        for backend in ("reference", "fast"):
            use_counts_once_dispatcher(layer, backend)
            for _ in range(2):                  # the second run: caches of the pack built
                hb = h.clone().requires_grad_()
                with counting(layer) as c:
                    with layer.router.tree_routing(p):
                        y, _ = layer(hb)
                    c.phase = "bwd"
                    y.square().sum().backward()
            counts[backend] = {(ph, k): sum(v for (ph2, _, k2), v in c.counts.items() if ph2 == ph and k2 == k)
                               for ph in ("fwd", "bwd") for k in ("syncs", "h2d")}
    fast, ref = counts["fast"], counts["reference"]
    assert fast[("fwd", "syncs")] == (0 if grouped else 1) and fast[("bwd", "syncs")] == 0, fast
    assert fast[("fwd", "h2d")] == 0 and fast[("bwd", "h2d")] == 0, fast
    assert ref[("fwd", "syncs")] == 2, ref                                # the counter sees the old path's syncs
    assert ref[("fwd", "h2d")] == (2 if grouped else 0), ref


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA sync check")
def test_permutation_does_not_sync_on_cuda():
    m = MAPS["expert_without_tokens"].cuda()
    total = int(m.sum())
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        flat = torch.nonzero_static(m.T.reshape(-1), size=total).view(-1)
        offs = m.sum(0).cumsum(0).to(torch.int32)
        probs = torch.rand(m.shape, device="cuda").T.reshape(-1)[flat]
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert flat.shape == (total,) and probs.shape == (total,) and offs.shape == (E,)


def test_device_plan_checks_the_row_count_on_the_device():
    """Rows with other than top-k experts trip the device-side assert (on CPU: at once)."""
    from megatron_harts.moe.dispatch import device_plan
    flat, token_index, counts = device_plan(MAPS["top3"], 3)
    assert counts.total == 12 and counts.host() == MAPS["top3"].sum(0).tolist()
    assert torch.equal(counts.offsets, MAPS["top3"].sum(0).cumsum(0).int()) and counts.tolist() is counts
    with pytest.raises(RuntimeError, match="top-k"):
        device_plan(MAPS["expert_without_tokens"], 3)
