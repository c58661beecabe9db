"""MoE under tree packing (docs/design.md#9-moe): multiplicity-weighted router objectives.

* Router level: ``TreeTopKRouter`` on the compact tokens of a pack (tree mode) == stock
  ``TopKRouter`` on the trajectory tokens (every compact token repeated once per trajectory through
  it): probs, routing, aux / seq (``"microbatch"``) / global aux losses, z-loss, expert-bias token
  counts and all gradients. ``seq_aux_loss`` per trajectory (default) == the mean of stock's
  ``seq_aux_loss`` over each trajectory run alone.
* Model level: tiny fp32 ``"*EGE"`` HybridModel, tree-packed vs trajectory-wise (``pack_trajectories``)
  with every router loss on: log-probs, all gradients, logged router losses, ``tokens_per_expert``
  and the expert-bias update; also with full activation recomputation.
* TP=2 (sequence parallel) and EP=2 under gloo with 2 processes (``torch.multiprocessing``; skipped
  only with ``HARTS_SKIP_DIST_TESTS=1``, ~35 s each).
* Token dropping / capacity factors / selective MoE recompute are refused for tree packs.
"""
import os
import socket

import numpy as np
import pytest
import torch
import torch.multiprocessing as mp

from megatron_harts import verify
from megatron_harts.megatron import cpu_shim, tree_hybrid_stack_spec, tree_packed_seq_params
from megatron_harts.moe import TreeTopKRouter
from megatron_harts.ops import tree_token_logprobs
from megatron_harts.packing import pack, pack_trajectories
from megatron_harts.tree import RolloutTree
from trees import corner_cases

VOCAB, C, E, TOL, DECAY_TOL = 64, 8, 8, 1e-5, 1e-4
ALL_AUX = dict(moe_router_load_balancing_type=["aux_loss", "seq_aux_loss", "global_aux_loss"],
               moe_aux_loss_coeff=[0.1, 0.2, 0.3], moe_z_loss_coeff=0.01)
BIAS = dict(moe_router_score_function="sigmoid", moe_router_enable_expert_bias=True,
            moe_router_bias_update_rate=1e-2, moe_router_load_balancing_type="aux_loss",
            moe_aux_loss_coeff=0.05, moe_z_loss_coeff=0.01)
METRICS = ("load_balancing_loss", "seq_load_balancing_loss", "global_load_balancing_loss", "z_loss")
_rel = verify.rel_diff


def _trees(name):
    cases = corner_cases(C)
    names = {"mixed": ["duplicates", "one_past", "multi_root"], "wide": ["wide", "multi_root"]}[name]
    return [RolloutTree.from_trajectories([[t % VOCAB for t in tr] for tr in cases[n]]) for n in names]


def _random_trees(seed, num_trees=2):
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(num_trees):
        trajs = [rng.integers(0, VOCAB, int(rng.integers(2, 3 * C))).tolist()]
        for _ in range(int(rng.integers(1, 5))):
            base = trajs[int(rng.integers(len(trajs)))]
            p = int(rng.integers(1, len(base) + 1))
            trajs.append(base[:p] + rng.integers(0, VOCAB, int(rng.integers(1, 2 * C))).tolist())
        out.append(RolloutTree.from_trajectories(trajs))
    return out


def _weights(trees, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(len(r) - 1, generator=g) for tree in trees for r in tree.records]


def _routers(model):
    return [layer.mlp.router for layer in model.decoder.layers if hasattr(layer.mlp, "router")]


def _metrics():
    from megatron.core.transformer.moe.moe_logging import get_moe_metrics_tracker
    return {k: v.values.clone() for k, v in get_moe_metrics_tracker().metrics.items()}


def _reset(model=None, routers=()):
    from megatron.core.transformer.moe.moe_logging import destroy_moe_metrics_tracker
    destroy_moe_metrics_tracker()
    for r in list(routers) + (_routers(model) if model is not None else []):
        r.reset_global_aux_loss_tracker()
        if r.local_tokens_per_expert is not None:
            r.local_tokens_per_expert.zero_()


def _assert_metrics(got, want, what):
    assert got.keys() == want.keys() and got, f"{what}: metrics {sorted(got)} vs {sorted(want)}"
    for k in want:
        assert _rel(got[k], want[k]) < TOL, f"{what}: {k} {got[k].tolist()} vs {want[k].tolist()}"


# ------------------------------------------------------------------------------------------
# Router level
# ------------------------------------------------------------------------------------------


def _router(pgs, seq_mode="microbatch", **cfg):
    config = cpu_shim.tiny_hybrid_config("E", num_moe_experts=E, **cfg)
    r = TreeTopKRouter(config=config, pg_collection=pgs, seq_aux_loss_sequence=seq_mode)
    r.set_layer_number(1)
    torch.nn.init.normal_(r.weight, std=0.3)
    return r.train()


@pytest.mark.parametrize("cfg", ["all_aux", "bias"])
def test_router_tree_equals_expanded(cfg):
    """Compact tokens weighted by multiplicity == stock router on every trajectory token."""
    with cpu_shim.cpu_megatron(seed=0) as pgs:
        router = _router(pgs, **(ALL_AUX if cfg == "all_aux" else BIAS))
        p = pack(_trees("wide") + _random_trees(3))
        assert p.compression > 3
        x = torch.randn(p.num_tokens, 1, 64, generator=torch.Generator().manual_seed(1), requires_grad=True)
        R = torch.randn(p.num_trajectory_tokens, E, generator=torch.Generator().manual_seed(2))
        out = {}
        for mode in ("tree", "stock"):
            _reset(routers=[router])
            router.zero_grad(set_to_none=True)
            x.grad = None
            if mode == "tree":
                with router.tree_routing(p):
                    probs, rmap = router(x)
                probs, rmap = probs[p.traj_index], rmap[p.traj_index]
            else:
                probs, rmap = router(x[p.traj_index])
            (probs * R).sum().backward()
            out[mode] = dict(probs=probs.detach(), rmap=rmap, metrics=_metrics(), wgrad=router.weight.grad.clone(),
                             xgrad=x.grad.clone(), tpe=None if router.local_tokens_per_expert is None
                             else router.local_tokens_per_expert.clone())
        t, s = out["tree"], out["stock"]
        assert torch.equal(t["rmap"], s["rmap"]) and _rel(t["probs"], s["probs"]) < TOL
        _assert_metrics(t["metrics"], s["metrics"], cfg)
        assert _rel(t["wgrad"], s["wgrad"]) < TOL and _rel(t["xgrad"], s["xgrad"]) < TOL
        if cfg == "bias":
            assert torch.equal(t["tpe"], s["tpe"].float()) and t["tpe"].sum() == 2 * p.num_trajectory_tokens
            assert torch.equal(router.tree_tokens_per_expert, t["tpe"])
        else:
            assert set(t["metrics"]) == set(METRICS)


def test_router_seq_aux_loss_per_trajectory():
    """Default ``seq_aux_loss``: mean over trajectories of stock's loss on each trajectory alone."""
    from megatron.core.transformer.moe.moe_utils import MoEAuxLossAutoScaler
    cfg = dict(moe_router_load_balancing_type="seq_aux_loss", moe_aux_loss_coeff=0.5)
    with cpu_shim.cpu_megatron(seed=0) as pgs:
        router = _router(pgs, "trajectory", **cfg)
        p = pack(_random_trees(5, 3))
        n = p.num_trajectories
        x = torch.randn(p.num_tokens, 1, 64, generator=torch.Generator().manual_seed(1))
        _reset(routers=[router])
        with router.tree_routing(p):
            probs, _ = router(x)
        (probs * 0).sum().backward()     # only the aux-loss gradient
        tree_loss, tree_grad = _metrics()["seq_load_balancing_loss"][0], router.weight.grad.clone()
        router.zero_grad(set_to_none=True)
        _reset(routers=[router])
        MoEAuxLossAutoScaler.set_loss_scale(torch.tensor(1.0 / n))
        try:
            for idx in p.index_of_trajectory:
                probs, _ = router(x[idx])
                (probs * 0).sum().backward()
        finally:
            MoEAuxLossAutoScaler.set_loss_scale(torch.tensor(1.0))
        stock_loss = _metrics()["seq_load_balancing_loss"][0] / n
        assert abs(float(tree_loss - stock_loss)) < TOL * float(stock_loss)
        assert _rel(tree_grad, router.weight.grad) < TOL


# ------------------------------------------------------------------------------------------
# Model level
# ------------------------------------------------------------------------------------------


def _build(pattern="*EGE", **kw):
    return cpu_shim.build_tiny_hybrid_model(pattern, vocab_size=VOCAB, init_method_std=0.1,
                                            hybrid_stack_spec=tree_hybrid_stack_spec(E), num_moe_experts=E, **kw)


def _run(model, trees, layout, ws, logprobs=None):
    _reset(model)
    if logprobs is None:
        out = verify.run_packed(model, trees, layout, ws, chunk_size=C)
    else:
        p = layout(trees, chunk_size=C)
        lps = logprobs(model, p)
        out = [lp.detach() for lp in lps], *verify.backward(model, lps, ws)
    stats = [(None if r.local_tokens_per_expert is None else r.local_tokens_per_expert.clone(),
              r.tree_tokens_per_expert.clone()) for r in _routers(model)]
    return out, _metrics(), stats


def _assert_run_close(got, want, what, grad_filter=None):
    (lps, loss, grads), mets, stats = got
    (lps_r, loss_r, grads_r), mets_r, stats_r = want
    err = max(_rel(a, b) for a, b in zip(lps, lps_r) if b.numel())
    assert err < TOL, f"{what}: log-prob rel err {err:.2e}"
    assert _rel(loss, loss_r) < TOL
    bad = {n: e for n in grads_r if (e := _rel(grads[n], grads_r[n]))
           >= (DECAY_TOL if n.endswith(verify.DECAY_PARAMS) else TOL)}
    assert not bad, f"{what}: grad rel errs {bad}"
    _assert_metrics(mets, mets_r, what)
    for (tpe, load), (tpe_r, load_r) in zip(stats, stats_r):
        assert torch.equal(load, load_r), f"{what}: tokens_per_expert {load} vs {load_r}"
        if tpe_r is not None:
            assert torch.equal(tpe, tpe_r)


@pytest.mark.parametrize("cfg,trees", [("all_aux", "mixed"), ("bias", "wide"), ("all_aux_recompute", "wide")])
def test_model_tree_equals_trajectory_wise(cfg, trees):
    from megatron.core.transformer.moe.moe_utils import get_updated_expert_bias
    kw = dict(BIAS) if cfg == "bias" else dict(ALL_AUX)
    if cfg.endswith("recompute"):
        kw.update(verify.RECOMPUTE)
    with cpu_shim.cpu_megatron(seed=0):
        model = _build(**kw)
        trees = _trees(trees)
        ws = _weights(trees)
        base = _run(model, trees, pack_trajectories, ws)
        tree = _run(model, trees, pack, ws)
        _assert_run_close(tree, base, cfg)
        assert set(tree[1]) == ({"load_balancing_loss", "z_loss"} if cfg == "bias" else set(METRICS))
        total = sum(len(r) for t in trees for r in t.records)
        for _, load in tree[2]:
            assert float(load.sum()) == 2 * total   # top-2, every trajectory token counted
        if cfg == "bias":
            for router, (tpe, _), (tpe_r, _) in zip(_routers(model), tree[2], base[2]):
                rate = model.config.moe_router_bias_update_rate
                b = get_updated_expert_bias(tpe.clone(), router.expert_bias, rate)
                b_r = get_updated_expert_bias(tpe_r.clone(), router.expert_bias, rate)
                assert torch.equal(b, b_r) and not torch.equal(b, router.expert_bias)


def test_tree_moe_refuses_token_dropping_and_selective_recompute():
    trees = _trees("mixed")[:1]
    p = pack(trees, chunk_size=C)
    with cpu_shim.cpu_megatron(seed=0):
        for kw, err, msg in [(dict(moe_expert_capacity_factor=1.0), ValueError, "no-drop"),
                             (dict(recompute_granularity="selective", recompute_modules=["moe"]),
                              NotImplementedError, "selective")]:
            model = _build("*E", **kw)
            with pytest.raises(err, match=msg):
                model(p.tokens[None], p.position_ids[None], None, packed_seq_params=tree_packed_seq_params(p))


# ------------------------------------------------------------------------------------------
# TP=2 (sequence parallel) and EP=2, 2 processes under gloo
# ------------------------------------------------------------------------------------------


def _gathered_logprobs(model, p):
    from megatron.core.tensor_parallel.mappings import gather_from_tensor_model_parallel_region
    logits = model(p.tokens[None], p.position_ids[None], None, packed_seq_params=tree_packed_seq_params(p))
    return tree_token_logprobs(gather_from_tensor_model_parallel_region(logits)[0], p)


def _even_trees(seed):
    """Random trees whose tree and trajectory-wise packs both have an even token count (SP=2)."""
    while True:
        trees = _random_trees(seed)
        if pack(trees).num_tokens % 2 == 0 and pack_trajectories(trees).num_tokens % 2 == 0:
            return trees
        seed += 1000


def _dist_worker(rank, port, tp, ep, queue):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE="2")
    torch.set_num_threads(1)
    try:
        import torch.distributed as dist
        from megatron.core import parallel_state as ps
        with cpu_shim.cpu_megatron(tensor_model_parallel_size=tp, expert_model_parallel_size=ep, seed=0):
            kw = dict(ALL_AUX, sequence_parallel=tp > 1)   # MoE under TP needs SP (cpu_shim.TorchNorm has it)
            model = _build("*EGE", **kw)
            # The same microbatch on both ranks: the allgather dispatcher (EP) and SP need equal token
            # counts per rank, and both ranks run the same layout at a time.
            trees = _even_trees(11)
            ws = _weights(trees)
            res = {}
            for name, layout in [("traj", pack_trajectories), ("tree", pack)]:
                (lps, loss, grads), mets, stats = _run(model, trees, layout, ws, logprobs=_gathered_logprobs)
                if tp > 1:   # per-rank values of SP slices: compare their TP sums (as Megatron reduces them)
                    group = ps.get_tensor_model_parallel_group()
                    for n, prm in model.named_parameters():   # replicated params: partial grads
                        if not getattr(prm, "tensor_model_parallel", False):
                            dist.all_reduce(grads[n], group=group)
                    for t in [*mets.values(), *(x for st in stats for x in st if x is not None)]:
                        dist.all_reduce(t, group=group)
                res[name] = ((lps, loss, grads), mets, stats)
            _assert_run_close(res["tree"], res["traj"], f"tp={tp} ep={ep} rank {rank}")
        queue.put((rank, None))
    except BaseException as e:  # noqa: BLE001 - report to the parent
        import traceback
        queue.put((rank, traceback.format_exc()))
        raise SystemExit(1) from e


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.skipif(os.environ.get("HARTS_SKIP_DIST_TESTS") == "1",
                    reason="HARTS_SKIP_DIST_TESTS=1 (2-process gloo tests, ~35 s each on 2 cores)")
@pytest.mark.parametrize("tp,ep", [(2, 1), (1, 2)], ids=["tp2_sp", "ep2"])
def test_distributed_tree_equals_trajectory_wise(tp, ep):
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=_dist_worker, args=(r, port, tp, ep, queue)) for r in range(2)]
    for pr in procs:
        pr.start()
    results = dict(queue.get(timeout=180) for _ in procs)
    for pr in procs:
        pr.join(timeout=60)
    errors = {r: e for r, e in results.items() if e}
    assert not errors, "\n".join(f"rank {r}:\n{e}" for r, e in errors.items())
