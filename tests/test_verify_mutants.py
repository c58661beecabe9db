"""``megatron_harts.verify`` rejects broken trees: mutation tests of the checker (CPU, fp32).

Each mutant of ``megatron_harts.verify_mutants`` breaks the tree side in one way (an ancestor mask
that lets a token see a sibling-branch token, a state handoff at a branch dropped, RoPE positions
off by one below branch points, MoE multiplicity ignored by the router); ``verify --mutant NAME``
must exit 1 on a workload that exercises it, and the unmutated run must exit 0 on the same
workload. The margins (difference over gate) are printed; ``docs/benchmarks/verify_mutants.md``
records them. Also: ``--dtype float64`` (every class, decay included, within 1e-6), the error for an
``E`` pattern without ``--num-moe-experts``, and the per-class noise gate of ``--device cuda``.
"""
import contextlib
import dataclasses
import io
import json
import os

import pytest
import torch
from hypothesis import given, settings
from trees import corner_cases, trajectory_sets

from megatron_harts import verify, verify_mutants
from megatron_harts.ops.attention import ancestor_mask, block_mask
from megatron_harts.ops.plan import chunk_plan
from megatron_harts.packing import pack, pack_trajectories
from megatron_harts.tree import trees_from_trajectories
from megatron_harts.tree.io import write_jsonl
from megatron_harts.workloads import AgenticConfig, agentic_batch

C = 8
#: Small agentic batch (2 groups x 4 samples, 222 compact / 410 trajectory tokens): with C = 8 it
#: has branch points inside chunks and at a chunk boundary, and handoffs with and without replay.
CONFIG = AgenticConfig(num_groups=2, group_size=4, turns=(2, 5), vocab_size=64, prompt_tokens=(8, 16),
                       assistant_tokens=(3, 8), tool_tokens_median=5, tool_tokens_max=12, seed=1)
MODEL = ["--pattern", "G*E", "--num-moe-experts", "4", "--chunk-size", str(C), "--seed", "1"]


@pytest.fixture(scope="module")
def workload(tmp_path_factory):
    path = tmp_path_factory.mktemp("verify") / "small.jsonl"
    trajs = agentic_batch(CONFIG)
    write_jsonl(path, trajs)
    return str(path), trees_from_trajectories(trajs)


def _verify(*args):
    """``verify.main(args)``: (exit status, its JSON line or None)."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        rc = verify.main(list(args))
    lines = out.getvalue().strip().splitlines()
    return rc, (json.loads(lines[-1]) if lines else None)


def _show(capsys, what, res):
    grads = {k: g["margin"] for k, g in res["gates"].items() if k.startswith("grad/")}
    worst_grad = max(grads, key=grads.get)
    with capsys.disabled():
        print(f"\n  verify {what}: margin {res['margin']:.3g} at {res['worst_gate']} (largest gradient class: "
              f"{worst_grad} {grads[worst_grad]:.3g})", end="")


def test_workload_exercises_every_mutant(workload):
    _, trees = workload
    cov = verify_mutants.branch_coverage(pack(trees, chunk_size=C))
    assert cov["at_chunk_boundary"] > 0 and cov["inside_chunk"] > 0, cov
    assert cov["handoff_with_replay"] > 0 and cov["handoff_sequences"] > cov["handoff_with_replay"], cov


def test_unmutated_passes(workload, capsys):
    rc, res = _verify("--trajectories", workload[0], *MODEL)
    _show(capsys, "unmutated", res)
    assert rc == 0 and res["margin"] < 1, res
    classes = {"decay", "gdn_in_proj", "attention_qkv", "router", "experts", "embedding", "output"}
    assert classes <= set(res["per_class"])
    assert {"moe_losses_rel_diff", "moe_counts_rel_diff"} <= set(res["gates"])
    assert res["moe_counts_rel_diff"] == 0.0       # expert-bias token counts are exact sums


@pytest.mark.parametrize("mutant", sorted(verify_mutants.MUTANTS))
def test_mutant_is_rejected(workload, mutant, capsys):
    rc, res = _verify("--trajectories", workload[0], *MODEL, "--mutant", mutant)
    _show(capsys, mutant, res)
    assert res["mutant"]["name"] == mutant and res["mutant"]["exercised"] > 0
    assert rc == 1 and res["margin"] > 1, res
    assert res["numeric_margin"] > 1, res          # the numeric gates alone reject it too (fp32)
    plan_check = {"sibling_visible": "plan/attention_mask", "position_off_by_one": "plan/positions",
                  "moe_multiplicity_ignored": "plan/moe_multiplicity",
                  "state_handoff_dropped": "plan/linear_attention"}[mutant]
    for k, v in res["plan"].items():              # each exact plan check fires on its mutant only
        assert (v > 0) == (k == plan_check), (mutant, res["plan"])


def test_mutant_all_runs_every_mutant_in_one_process(workload):
    """``--mutant all``: unmutated passes (plan checks all 0), every mutant rejected, exit 0."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        rc = verify.main(["--trajectories", workload[0], *MODEL, "--mutant", "all"])
    res = json.loads(out.getvalue().strip().splitlines()[-1])
    assert rc == 0 and res["all_rejected"], res["summary"]
    assert set(res["summary"]) == set(verify_mutants.MUTANTS)
    assert res["unmutated"]["plan"] == {"plan/attention_mask": 0, "plan/linear_attention": 0, "plan/positions": 0,
                                        "plan/moe_multiplicity": 0}
    assert all(s["rejected"] and s["numeric_margin"] > 1 for s in res["summary"].values()), res["summary"]


def test_plan_errors_count_exactly_the_broken_rows(workload):
    """``plan_errors`` on hand-broken packs: one widened mask entry is one bad row; a position shift
    of k tokens is k bad tokens; and the branch windows cover each branch start's first entries."""
    _, trees = workload
    p = pack(trees, chunk_size=C)
    assert verify.plan_errors(p) == {"plan/attention_mask": 0, "plan/linear_attention": 0, "plan/positions": 0}
    bad, n = verify_mutants.sibling_visible(pack(trees, chunk_size=C), masks=("dense",))
    assert verify.plan_errors(bad)["plan/attention_mask"] == n > 0
    shifted = pack(trees, chunk_size=C)
    shifted.position_ids = shifted.position_ids.clone()
    shifted.position_ids[[3, 7]] += 1
    assert verify.plan_errors(shifted)["plan/positions"] == 2
    kids = torch.bincount(p.parent[p.parent >= 0], minlength=p.num_tokens)
    cu = p.traj_cu_seqlens.tolist()
    for window in (1, 3):
        w = verify.branch_windows(p, window=window)
        assert [x.numel() for x in w] == [len(r) - 1 for r in p.trajectories]
        for i, x in enumerate(w):
            idx = p.traj_index[cu[i]:cu[i + 1]]
            starts = [j for j in range(1, len(idx)) if kids[p.parent[idx[j]]] >= 2]
            want = torch.zeros(len(idx) - 1, dtype=torch.bool)
            for j in starts:
                want[j:j + window] = True
            assert torch.equal(x, want), (i, window)
    assert sum(int(x.sum()) for x in verify.branch_windows(p)) > 0


def test_documented_mutant_command_fails_on_the_default_workload():
    """``python -m megatron_harts.verify --mutant sibling_visible`` (README) exits 1."""
    rc, res = _verify("--mutant", "sibling_visible")
    assert rc == 1 and res["margin"] > 10, res


@pytest.mark.parametrize("mutant", sorted(verify_mutants.MUTANTS))
def test_mutant_changes_only_the_tree_side(workload, mutant):
    """A mutant returns a copy (the pack it gets is left alone), is a no-op on the trajectory-wise
    (baseline) layout, and on the tree changes only what it names."""
    _, trees = workload
    base = pack_trajectories(trees, chunk_size=C)
    same, n = verify_mutants.apply(mutant, base)
    assert n == 0, f"{mutant} changed the baseline layout"
    p = pack(trees, chunk_size=C)
    fields = {k: getattr(p, k).clone() for k in ("position_ids", "subtree_end", "multiplicity", "parent")}
    bad, n = verify_mutants.apply(mutant, p)
    assert n > 0 and bad is not p
    for k, v in fields.items():
        assert torch.equal(getattr(p, k), v), f"{mutant} modified the input pack's {k}"
    fresh = pack(trees, chunk_size=C)
    assert torch.equal(ancestor_mask(p), ancestor_mask(fresh))
    plan, want = chunk_plan(p, C), chunk_plan(fresh, C)
    assert len(plan.rounds) == len(want.rounds) > 1
    changed_mask = not torch.equal(ancestor_mask(bad), ancestor_mask(fresh))
    changed_plan = len(chunk_plan(bad, C).rounds) != len(want.rounds)
    changed_pos = not torch.equal(bad.position_ids, fresh.position_ids)
    assert (changed_mask, changed_plan, changed_pos) == {
        "sibling_visible": (True, False, False), "state_handoff_dropped": (False, True, False),
        "position_off_by_one": (False, False, True), "moe_multiplicity_ignored": (False, False, False)}[mutant]
    if mutant == "position_off_by_one":      # the chunk plan still follows the true positions
        assert chunk_plan(bad, C).gather_all.equal(want.gather_all)


def test_sibling_visible_widens_exactly_one_entry_per_later_sibling(workload):
    """The dense (SDPA) and block (FlexAttention) masks of the mutant: the ancestor mask plus, for
    each first token of a later sibling, the first token of the previous sibling."""
    _, trees = workload
    p = pack(trees, chunk_size=C)
    bad, n = verify_mutants.sibling_visible(p, masks=("dense", "block"))
    extra = ancestor_mask(bad) & ~ancestor_mask(p)
    assert int(extra.sum()) == n > 0 and not (ancestor_mask(p) & ~ancestor_mask(bad)).any()
    q, kv = torch.nonzero(extra, as_tuple=True)
    assert torch.equal(p.parent[q], p.parent[kv]) and torch.equal(p.subtree_end[kv], q)
    T = p.num_tokens
    grid = torch.arange(T)
    dense = block_mask(bad).mask_mod(0, 0, grid[:, None].expand(T, T), grid[None, :].expand(T, T))
    assert torch.equal(dense, ancestor_mask(bad))


def test_state_handoff_dropped_reaches_the_fla_rounds(workload):
    """The merged one-round plan is what fla's fused rounds (the CUDA path) are built from."""
    from megatron_harts.ops.fla_rounds import fused_rounds
    _, trees = workload
    bad, n = verify_mutants.apply("state_handoff_dropped", pack(trees, chunk_size=C))
    fr = fused_rounds(bad, C)
    assert n > 0 and len(fr.rounds) == 1 and fr.init_from == [None]


def test_mutant_that_the_workload_cannot_show_exits_2(tmp_path):
    """Unrelated trajectories: no branch point, so no sibling to reveal."""
    path = tmp_path / "chains.jsonl"
    path.write_text("".join(json.dumps({"tokens": [i + 1] + list(range(2, 12))}) + "\n" for i in range(3)))
    rc, _ = _verify("--trajectories", str(path), "--pattern", "G*", "--mutant", "sibling_visible")
    assert rc == 2
    rc, _ = _verify("--trajectories", str(path), "--pattern", "G*", "--mutant", "all")
    assert rc == 2                      # nothing tested is not a pass


def test_float64_layouts_agree_to_1e_6_decay_included(workload, capsys):
    rc, res = _verify("--trajectories", workload[0], *MODEL, "--dtype", "float64")
    _show(capsys, "float64", res)
    assert rc == 0 and res["dtype"] == "float64", res
    assert res["gates"]["grad/decay"]["gate"] == 1e-6 and max(res["per_class"].values()) < 1e-6, res


def test_float64_refuses_mamba():
    with pytest.raises(SystemExit) as e:
        verify.main(["--pattern", "GM*", "--dtype", "float64"])
    assert e.value.code == 2


@pytest.mark.parametrize("argv,msg", [
    (["--pattern", "G*E-"], "has MoE layers ('E'): give their expert count with --num-moe-experts N"),
    (["--pattern", "G*-", "--num-moe-experts", "4"], "--num-moe-experts needs MoE layers ('E')"),
    (["--mutant", "moe_multiplicity_ignored"], "needs a layer of type 'E'"),
    (["--pattern", "GX-"], "--pattern 'GX-': layer symbols must be from"),
    (["--pattern", ""], "--pattern '': layer symbols must be from"),
    (["--chunk-size", "0"], "--chunk-size must be >= 1, got 0"),
    (["--pattern", "G*E", "--num-moe-experts", "-2"], "--num-moe-experts must be >= 1, got -2"),
    (["--tol", "-1"], "--tol must be > 0, got -1.0"),
    (["--trajectories", "/nonexistent/x.jsonl"], "--trajectories: [Errno 2] No such file or directory"),
])
def test_argument_errors_are_one_line(argv, msg, capsys):
    with pytest.raises(SystemExit) as e:
        verify.main(argv)
    err = capsys.readouterr().err
    assert e.value.code == 2 and msg in err, err


@pytest.mark.parametrize("text,msg", [
    ('{"tokens": [1, 2]}\n{"tokens": [1, 2,\n', "bad.jsonl:2: not valid JSON"),
    ('{"tokens": [1, 2], "old_logprobs": [0, "x"]}\n', "bad.jsonl:1: trajectory 0: field 'old_logprobs'"),
    ("\n", "--trajectories: the file holds no trajectories"),
])
def test_trajectory_file_errors_are_one_line(tmp_path, text, msg, capsys):
    path = tmp_path / "bad.jsonl"
    path.write_text(text)
    with pytest.raises(SystemExit) as e:
        verify.main(["--trajectories", str(path)])
    err = capsys.readouterr().err
    assert e.value.code == 2 and msg in err and "Traceback" not in err, err


def test_cuda_gate_is_per_class():
    """``noise_gates``: a noisy decay class in the rerun raises the decay bar only; a class whose own
    noise is small fails at a difference the decay noise would have hidden."""
    rerun = {"max_logprob_abs_diff": 0.09, "loss_rel_diff": 1e-3,
             "per_class": {"decay": 0.15, "attention_qkv": 0.004, "mlp": 0.02}}
    ok = {"max_logprob_abs_diff": 0.1, "loss_rel_diff": 1e-3,
          "per_class": {"decay": 0.4, "attention_qkv": 0.02, "mlp": 0.05}}
    assert verify.within_noise(ok, [rerun], 3.0) == []
    gates = verify.noise_gates(ok, [rerun], 3.0)
    assert gates["grad/attention_qkv"][1] == pytest.approx(0.03)     # its BF16 floor (1e-2) x 3
    assert gates["grad/decay"][1] == pytest.approx(0.45)
    bad = dict(ok, per_class=dict(ok["per_class"], attention_qkv=0.2))   # < 3 x the decay noise, > its own
    assert verify.within_noise(bad, [rerun], 3.0) == ["grad/attention_qkv"]
    nan = dict(ok, per_class=dict(ok["per_class"], mlp=float("nan")))
    assert verify.within_noise(nan, [rerun], 3.0) == ["grad/mlp"]


def _tree_pack(token_lists, C_):
    from megatron_harts.tree import RolloutTree, make_trajectory
    trajs = [make_trajectory(i, t, traj_id=f"t{i}", group_id="g") for i, t in enumerate(token_lists)]
    return pack([RolloutTree(trajs)], chunk_size=C_)


@pytest.mark.parametrize("case", sorted(corner_cases(4)))
def test_plan_checks_hold_on_corner_case_trees(case):
    """The exact plan checks are 0 on every corner-case tree (chunk-boundary branches, duplicates,
    several roots, deep and wide trees), and a chunk plan with one handoff pointed at another state,
    or one sequence started from zero, is caught."""
    p = _tree_pack(corner_cases(4)[case], 4)
    assert verify.plan_errors(p) == {"plan/attention_mask": 0, "plan/linear_attention": 0, "plan/positions": 0}
    plan = chunk_plan(p, 4)
    later = [r for r, rd in enumerate(plan.rounds) if r and rd.init_from is not None and len(rd.init_from) > 0]
    if later:
        rd = plan.rounds[later[0]]
        prev = plan.rounds[later[0] - 1]
        n_prev = len(prev.cu_seqlens_cpu) - 1
        if n_prev > 1:                              # point the first handoff at another state
            rd.init_from = rd.init_from.clone()
            rd.init_from[0] = (rd.init_from[0] + 1) % n_prev
            assert verify.chunk_plan_errors(p) >= 1
        rd.init_from = None                         # the whole round from zero states
        assert verify.chunk_plan_errors(p) >= len(rd.cu_seqlens_cpu) - 1


@given(trajectory_sets(chunk_size=4))
@settings(max_examples=40, deadline=None)
def test_plan_checks_hold_on_random_trees(token_lists):
    p = _tree_pack(token_lists, 4)
    assert verify.plan_errors(p) == {"plan/attention_mask": 0, "plan/linear_attention": 0, "plan/positions": 0}


def test_mutants_rejected_with_grouped_experts(workload):
    """The same checks with the MoE experts on torch's grouped GEMM (``--grouped-experts``)."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        rc = verify.main(["--trajectories", workload[0], *MODEL, "--grouped-experts", "--mutant", "all"])
    res = json.loads(out.getvalue().strip().splitlines()[-1])
    assert rc == 0 and res["all_rejected"] and res["unmutated"]["margin"] < 1, res["summary"]
    assert "experts" in res["unmutated"]["per_class"]
    from megatron_harts.megatron import cpu_shim, tree_hybrid_stack_spec
    with cpu_shim.cpu_megatron(seed=0):                       # the flag reaches the model: grouped weights
        m = cpu_shim.build_tiny_hybrid_model("G*E", vocab_size=64, num_moe_experts=4,
                                             hybrid_stack_spec=tree_hybrid_stack_spec(4, grouped_experts=True))
    names = [n for n, _ in m.named_parameters()]
    assert any(n.endswith("mlp.experts.linear_fc1.weight") for n in names)
    assert not any("local_experts" in n for n in names)


def test_cuda_check_flow_on_cpu(workload, monkeypatch):
    """``verify --device cuda`` end to end without a GPU: the model built through ``cpu_shim`` (fp32, torch
    backends) instead of ``megatron.gpu``, ``"cuda"`` tensors kept on the CPU, the FlashAttention-varlen
    branch taken (its FlexAttention baseline on the same kernel here). Checks the flow the H200 runs:
    ``--noise-reruns`` reruns of each baseline in ``noise_orders`` (reversed first), every rerun's
    difference in the floor, the JSON keys, a correct tree passing and a mutant rejected by its plan
    check; one tree (no other order exists) is a clear error, exit 2."""
    from megatron_harts.megatron import cpu_shim, gpu, tree_hybrid_stack_spec
    from megatron_harts.megatron.cpu_shim import build_tiny_hybrid_model
    from megatron_cpu_launch import CudaToCpu

    def build(pattern, vocab, max_len, spec="local", grouped_experts=False, hidden_size=64, **over):
        return build_tiny_hybrid_model(pattern, vocab_size=vocab, max_sequence_length=max_len, init_method_std=0.1,
                                       hybrid_stack_spec=tree_hybrid_stack_spec(over.get("num_moe_experts"),
                                                                                grouped_experts=grouped_experts),
                                       **{k: v for k, v in over.items() if k != "moe_router_dtype"})
    monkeypatch.setattr(gpu, "init_single_gpu", lambda seed: cpu_shim.cpu_manual_seed(seed))
    monkeypatch.setattr(gpu, "build_gpu_hybrid_model", build)
    monkeypatch.setattr(verify, "chain_pack_backend", lambda device: "varlen")
    monkeypatch.setattr(verify, "attention_backend", lambda model, kind: contextlib.nullcontext())
    orders = []
    real_side = verify.run_side

    def run_side(*a, **k):
        orders.append(k.get("order"))
        return real_side(*a, **k)
    monkeypatch.setattr(verify, "run_side", run_side)
    floors = []                 # the noise comparisons each gate is taken over
    real_gates = verify.noise_gates

    def noise_gates(diff, noise, factor):
        floors.append(len(noise))
        return real_gates(diff, noise, factor)
    monkeypatch.setattr(verify, "noise_gates", noise_gates)
    four = os.path.join(os.path.dirname(workload[0]), "four_trees.jsonl")     # 4 trees: 23 other orders
    write_jsonl(four, agentic_batch(dataclasses.replace(CONFIG, num_groups=4)))
    with cpu_shim.cpu_megatron(seed=1), CudaToCpu():
        rc, res = _verify("--trajectories", four, *MODEL, "--device", "cuda", "--noise-reruns", "3")
        assert rc == 0, res
        want = verify.noise_orders(4, 3, seed=1)
        assert len(want) == 3
        assert orders == [None] + want + [None] + want + [None], orders      # base, reruns, flex, reruns, tree
        assert res["noise_reruns"] == 3 and {"baseline_rerun", "baseline_flex_rerun", "tree_vs_baseline_flex"} <= set(res)
        assert floors == [6]                    # every rerun of both baselines is in the floor
        # every rerun's difference is reported, the reversed one first, and the gates are recomputable from them
        assert len(res["baseline_reruns"]) == len(res["baseline_flex_reruns"]) == 3
        assert res["baseline_reruns"][0] == res["baseline_rerun"]
        assert res["baseline_flex_reruns"][0] == res["baseline_flex_rerun"]
        again = real_gates(res["tree_vs_baseline_flex"], res["baseline_reruns"] + res["baseline_flex_reruns"],
                            3.0)                                    # --noise-factor default; unrecorded
        assert {k: bar for k, (_, bar) in again.items()} == {k: g["gate"] for k, g in res["gates"].items()
                                                            if not k.startswith("plan/")}
        orders.clear()
        rc, res = _verify("--trajectories", four, *MODEL, "--device", "cuda", "--noise-reruns", "2",
                          "--mutant", "sibling_visible")
        assert rc == 1 and res["plan"]["plan/attention_mask"] > 0 and res["noise_reruns"] == 2
        want = verify.noise_orders(4, 2, seed=1)
        assert orders == [None] + want + [None] + want + [None] and floors == [6, 4], (orders, floors)
    one = os.path.join(os.path.dirname(workload[0]), "one_tree.jsonl")
    write_jsonl(one, agentic_batch(dataclasses.replace(CONFIG, num_groups=1)))
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        assert verify.main(["--trajectories", one, *MODEL, "--device", "cuda"]) == 2
    assert "needs at least 2 trees" in err.getvalue()
    err = io.StringIO()                         # 2 trees: one other order only, said on stderr
    with cpu_shim.cpu_megatron(seed=1), CudaToCpu(), contextlib.redirect_stderr(err):
        rc, res = _verify("--trajectories", workload[0], *MODEL, "--device", "cuda")
    assert rc == 0 and res["noise_reruns"] == 1
    assert "2 trees have only 1 other order(s): the noise floor comes from 1 rerun(s) per baseline, not 4" in err.getvalue()
