"""Tree packing under TP=2 / DP=2 (2 CPU processes, gloo), selective recompute, Megatron's loss
contract, and the argument validation of ``--tree-packing``.

* TP=2: per-token log-probs (vocab-parallel log-softmax over the TP group), RL loss and every
  local gradient shard of the tree-packed run equal the trajectory-wise (THD) run.
* DP=2: the step's trees are split over 2 ranks x 2 microbatches (``build_step``); each
  microbatch's ``rl_loss`` goes through Megatron's own ``forward_step_calc_loss`` (division by
  num_tokens and microbatches, or none under ``calculate_per_token_loss``), gradients are
  all-reduced as Megatron's DDP / ``finalize_model_grads`` do; the result equals a single process
  running the whole batch trajectory-wise in one microbatch.
Tolerances: 1e-5 relative; GDN decay grads (``A_log``/``dt_bias``) 5e-4 (verify.py default; 1.0e-4 seen
under TP=2), see
``tests/test_megatron_tree.py`` and ``verify.py`` for the measured fp32 noise of the baseline itself.
"""
from __future__ import annotations

import argparse
import os
import socket
import sys
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from megatron_harts import verify
from megatron_harts.megatron import cpu_shim, tree_hybrid_stack_spec
from megatron_harts.megatron.arguments import (TREE_SUPPORTED_LAYER_SYMBOLS, TreePackingArgumentError,
                                               add_tree_packing_args, validate_tree_packing_args)
from megatron_harts.megatron.batch import GlobalNormalisers, TreeMicrobatch, build_step, model_inputs, rl_loss
from megatron_harts.packing import pack, pack_trajectories
from megatron_harts.rl import RLBatch
from megatron_harts.tree import trees_from_trajectories
from megatron_harts.workloads import AgenticConfig, agentic_batch

PATTERN, VOCAB, C, TOL, DECAY_TOL = "G*-G-", 64, 8, 1e-5, 5e-4
LOSS_KW = dict(loss_type="ppo", loss_agg_mode="seq-mean-token-mean", clip_eps=0.2, kl_coef=0.1, kl_estimator="k3")


def _trajectories(num_groups=4):
    """Small agentic batch: groups of 3 branching samples; old/ref log-probs, advantages, masks."""
    return agentic_batch(AgenticConfig(num_groups=num_groups, group_size=3, turns=(1, 3), vocab_size=VOCAB,
                                       prompt_tokens=(5, 20), assistant_tokens=(3, 12), tool_tokens_median=6,
                                       tool_tokens_max=20, seed=3))


def _model(**kw):
    cpu_shim.cpu_manual_seed(0)
    return cpu_shim.build_tiny_hybrid_model(PATTERN, vocab_size=VOCAB, init_method_std=0.1,
                                            hybrid_stack_spec=tree_hybrid_stack_spec(), **kw)


def _microbatch(trajs, layout, M=1, dp=1) -> TreeMicrobatch:
    p = layout(trees_from_trajectories(trajs), chunk_size=C)
    return TreeMicrobatch(p, RLBatch.from_trajectories(p.trajectories), GlobalNormalisers.of(trajs), M, dp)


def _run(model, mb, tp_group=None):
    """forward + ``rl_loss`` + backward -> (per-trajectory log-probs by traj id, loss, grads)."""
    from megatron_harts.ops import tree_token_logprobs
    model.zero_grad(set_to_none=True)
    tokens, pos, psp = model_inputs(mb)
    logits = model(tokens, pos, None, packed_seq_params=psp)
    loss, _, report = rl_loss(logits, mb, tp_group=tp_group, **LOSS_KW)
    loss.backward()
    lps = tree_token_logprobs(logits.detach()[0], mb.pack, tp_group=tp_group)
    return ({t.traj_id: lp for t, lp in zip(mb.pack.trajectories, lps)}, loss.detach(),
            {n: p.grad.clone() for n, p in model.named_parameters()})


def _assert_close(got, want, what):
    lps, loss, grads = got
    lps_r, loss_r, grads_r = want
    assert lps.keys() == lps_r.keys()
    scale = max(float(v.abs().max()) for v in lps_r.values() if v.numel())
    err = max(float((lps[k] - lps_r[k]).abs().max()) for k in lps_r if lps_r[k].numel())
    assert err <= TOL * scale, f"{what}: log-prob abs err {err:.2e} (scale {scale:.2f})"
    assert verify.rel_diff(loss, loss_r) < TOL, f"{what}: loss {float(loss)} vs {float(loss_r)}"
    errs = {n: verify.rel_diff(grads[n], grads_r[n]) for n in grads_r}
    bad = {n: e for n, e in errs.items() if e >= (DECAY_TOL if n.endswith(verify.DECAY_PARAMS) else TOL)}
    assert not bad, f"{what}: grad rel errs {bad}"


# ---------------------------------------------------------------------------- 2-process workers


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank, world, port, fn_name):
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port))
    torch.set_num_threads(1)
    globals()[fn_name](rank)


def _spawn(fn_name):
    mp.spawn(_worker, args=(2, _free_port(), fn_name), nprocs=2, join=True)


def _tp2(rank):
    from megatron.core import parallel_state as ps
    with cpu_shim.cpu_megatron(tensor_model_parallel_size=2, seed=0):
        model = _model()
        trajs = _trajectories()
        tp = ps.get_tensor_model_parallel_group()
        tree = _run(model, _microbatch(trajs, pack), tp)
        base = _run(model, _microbatch(trajs, pack_trajectories), tp)
        _assert_close(tree, base, f"TP=2 rank {rank}: tree vs trajectory-wise")


def _dp2(rank):
    """Megatron's loss contract: forward_step_calc_loss + DDP/finalize gradient reduction."""
    from megatron.core import parallel_state as ps
    from megatron.core.pipeline_parallel.schedules import forward_step_calc_loss
    with cpu_shim.cpu_megatron(tensor_model_parallel_size=1, seed=0):
        dp, M = ps.get_data_parallel_world_size(), 2
        assert dp == 2
        model, trajs = _model(), _trajectories(num_groups=4)
        base = _run(model, _microbatch(trajs, pack_trajectories))      # one process, whole batch
        for per_token in (False, True):
            cfg = SimpleNamespace(calculate_per_token_loss=per_token, timers=None, num_moe_experts=None,
                                  mtp_num_layers=None)
            model.zero_grad(set_to_none=True)
            lps, total, ntok = {}, torch.zeros(()), torch.zeros((), dtype=torch.int)
            for mb in build_step(trajs, dp_size=dp, dp_rank=rank, num_microbatches=M, chunk_size=C):
                tokens, pos, psp = model_inputs(mb)
                logits = model(tokens, pos, None, packed_seq_params=psp)
                store = []
                out, n = forward_step_calc_loss(model, logits, lambda x, mb=mb: rl_loss(x, mb, **LOSS_KW), cfg,
                                                None, False, M, store, cp_group_size=1, is_last_stage=True)
                out.backward()
                total, ntok = total + out.detach(), ntok + n
                lps.update(_run_lps(logits, mb))
            grads = {n: p.grad.clone() for n, p in model.named_parameters()}
            for g in grads.values():
                dist.all_reduce(g)          # DDP: sum over DP ...
                if not per_token:
                    g /= dp                 # ... with 1/dp pre-scaling (average_in_collective=False)
            if per_token:                   # finalize_model_grads: / num_tokens summed over DP
                dist.all_reduce(ntok)
                for g in grads.values():
                    g /= ntok.clamp(min=1)
                total = total / ntok
            else:
                total = total / dp
            dist.all_reduce(total)
            all_lps = [None, None]
            dist.all_gather_object(all_lps, lps)
            merged = {**all_lps[0], **all_lps[1]}
            _assert_close((merged, total, grads), base, f"DP=2 rank {rank} per_token_loss={per_token}")


def _run_lps(logits, mb):
    from megatron_harts.ops import tree_token_logprobs
    lps = tree_token_logprobs(logits.detach()[0], mb.pack)
    return {t.traj_id: lp for t, lp in zip(mb.pack.trajectories, lps)}


def test_tp2_tree_equals_trajectory_wise():
    _spawn("_tp2")


def test_dp2_split_equals_full_batch():
    _spawn("_dp2")


# ---------------------------------------------------------------------------- single process


@pytest.mark.parametrize("recompute", [
    dict(recompute_granularity="selective"),                                   # core_attn (default)
    dict(recompute_granularity="selective", recompute_modules=["core_attn", "mlp"]),
], ids=["core_attn", "core_attn+mlp"])  # "layernorm" needs Transformer Engine (FP8GlobalStateManager)
def test_selective_recompute(recompute):
    with cpu_shim.cpu_megatron(seed=0):
        trajs = _trajectories()
        plain = _model()
        model = _model(**recompute)
        model.load_state_dict(plain.state_dict())
        base = _run(plain, _microbatch(trajs, pack_trajectories))
        tree = _run(model, _microbatch(trajs, pack))
        _assert_close(tree, base, f"selective recompute {recompute}: tree vs trajectory-wise")


@pytest.mark.parametrize("planner", ["greedy", "harts"])
def test_build_step_partitions_and_global_norms(planner):
    trajs = _trajectories(num_groups=5)
    ids = []
    for r in range(2):
        mbs = build_step(trajs, dp_size=2, dp_rank=r, num_microbatches=2, chunk_size=C, planner=planner)
        assert len(mbs) == 2 and all(mb.norms == GlobalNormalisers.of(trajs) for mb in mbs)
        ids += [t.traj_id for mb in mbs for t in mb.pack.trajectories]
    assert sorted(ids) == sorted(t.traj_id for t in trajs)
    with pytest.raises(ValueError, match="at least one tree" if planner == "greedy" else "empty"):
        build_step(trajs, dp_size=2, dp_rank=0, num_microbatches=4, planner=planner)


def test_microbatch_iterator_steps_and_logs(caplog):
    from megatron_harts.megatron.batch import TreeMicrobatchIterator, group_trajectories
    groups = group_trajectories(_trajectories(num_groups=5))
    it = TreeMicrobatchIterator(groups, groups_per_step=4, dp_size=2, dp_rank=1, num_microbatches=2, chunk_size=C)
    with caplog.at_level("INFO", logger="megatron_harts.megatron.batch"):
        mbs = [next(it) for _ in range(4)]          # two steps
    assert [mb.step for mb in mbs] == [0, 0, 1, 1] and all(mb.pack.compression >= 1 for mb in mbs)
    assert "compression" in caplog.text and "trajectory tokens/s" in caplog.text
    step0 = [t for g in groups[:4] for t in g]      # the log counts all ranks' compact tokens of the step
    assert f"{pack(trees_from_trajectories(step0)).num_tokens} compact tokens" in caplog.text


# ---------------------------------------------------------------------------- arguments


def _megatron_args(argv):
    """Megatron 0.19.2's real parser with our extra_args_provider (no validate_args: it needs GPUs)."""
    from megatron.training.arguments import parse_args
    old = sys.argv
    sys.argv = ["pretrain_hybrid_harts.py", *argv]
    try:
        return parse_args(extra_args_provider=add_tree_packing_args)
    finally:
        sys.argv = old


BASE = ["--tree-packing", "--hybrid-layer-pattern", "G*-E", "--micro-batch-size", "1"]


def test_args_valid_and_defaults():
    args = _megatron_args(BASE)
    assert (args.tree_chunk_size, args.tree_planner, args.rl_loss_type) == (64, "harts", "grpo")
    validate_tree_packing_args(args)
    validate_tree_packing_args(_megatron_args(["--hybrid-layer-pattern", "D+M"]))   # off: no checks
    assert set("G*-E") <= TREE_SUPPORTED_LAYER_SYMBOLS and not set("D+") & TREE_SUPPORTED_LAYER_SYMBOLS


@pytest.mark.parametrize("extra, message", [
    (["--context-parallel-size", "2"], "context parallelism"),
    (["--mtp-num-layers", "1"], "multi-token prediction"),
    (["--hybrid-layer-pattern", "G*-D"], r"\['D'\].*no tree path"),
    (["--hybrid-layer-pattern", "G+-"], r"\['\+'\].*no tree path"),
    (["--hybrid-layer-pattern", "G*-G/GG"], "multi-token prediction"),
    (["--num-experts", "4", "--moe-expert-capacity-factor", "1.0"], "token-dropping MoE"),
    (["--moe-pad-expert-input-to-capacity"], "capacity"),
    (["--micro-batch-size", "2"], "micro-batch-size 1"),
    (["--tree-chunk-size", "0"], "tree-chunk-size must be >= 1"),
    (["--tree-spec", "te"], "needs Transformer Engine"),
    (["--tree-attention-backend", "varlen"], "varlen only covers trajectory packs"),
    (["--rl-clip-eps=-0.2"], "--rl-clip-eps must be >= 0, got -0.2"),
    (["--rl-clip-eps-high=-0.1"], "--rl-clip-eps-high must be >= 0, got -0.1"),
    (["--tree-groups-per-step", "0"], "--tree-groups-per-step must be >= 1, got 0"),
], ids=["cp", "mtp", "dsa", "mla", "mtp-pattern", "capacity", "pad-capacity", "mbs", "chunk", "te-spec", "varlen",
        "clip-eps", "clip-eps-high", "groups-per-step"])
def test_args_unsupported_combinations(extra, message):
    from megatron.core.extensions.transformer_engine import HAVE_TE
    if "--tree-spec" in extra and HAVE_TE:
        pytest.skip("Transformer Engine is installed: --tree-spec te is valid")
    args = _megatron_args(BASE + extra)
    with pytest.raises(TreePackingArgumentError, match=message):
        validate_tree_packing_args(args)


@pytest.mark.parametrize("argv", [BASE, ["--tree-trajectories", "x.jsonl", "--hybrid-layer-pattern", "G*-"]],
                         ids=["tree-packing", "thd-baseline"])
def test_args_turn_rope_fusion_off_for_tree_packs(argv, caplog):
    args = _megatron_args(argv)
    assert args.apply_rope_fusion          # Megatron's default
    with caplog.at_level("WARNING", logger="megatron_harts.megatron.arguments"):
        validate_tree_packing_args(args)
    assert not args.apply_rope_fusion and "RoPE fusion turned off" in caplog.text
    other = _megatron_args(["--hybrid-layer-pattern", "G*-"])
    validate_tree_packing_args(other)
    assert other.apply_rope_fusion         # Megatron runs without this package's packs: untouched


@pytest.mark.parametrize("argv", [BASE, ["--tree-trajectories", "x.jsonl", "--hybrid-layer-pattern", "G*-"]],
                         ids=["tree-packing", "thd-baseline"])
def test_args_turn_attention_dropout_off_for_tree_packs(argv, caplog):
    """Megatron's default --attention-dropout 0.1 would make TreeCoreAttention raise on the first
    forward (tree and THD baseline alike): it is turned off with a warning; hidden dropout warns."""
    args = _megatron_args(argv)
    assert args.attention_dropout == args.hidden_dropout == 0.1          # Megatron's defaults
    with caplog.at_level("WARNING", logger="megatron_harts.megatron.arguments"):
        validate_tree_packing_args(args)
    assert args.attention_dropout == 0.0 and "attention dropout 0.1 turned off" in caplog.text
    assert args.hidden_dropout == 0.1
    assert ("one dropout mask" in caplog.text) == ("--tree-packing" in argv)


def test_args_layers_without_tree_path():
    with pytest.raises(TreePackingArgumentError, match=r"\['\+', 'D'\]"):
        validate_tree_packing_args(argparse.Namespace(tree_packing=True, hybrid_layer_pattern="GD*+-"))
    ok = add_tree_packing_args(argparse.ArgumentParser()).parse_args(["--tree-packing"])
    ok.hybrid_layer_pattern = "GM*E-"
    validate_tree_packing_args(ok)


def test_prebuilt_dataset_helpers_skip_the_make_step(monkeypatch, tmp_path):
    """The wheel has helpers_cpp but no Makefile: Megatron's rank-0 ``make`` (which exits on failure)
    is replaced by a no-op; with a Makefile present (a source checkout) nothing changes."""
    from megatron.core.datasets import utils as dataset_utils
    from megatron_harts.megatron.training import use_prebuilt_dataset_helpers
    original = dataset_utils.compile_helpers
    monkeypatch.setattr(dataset_utils, "compile_helpers", original)
    (tmp_path / "Makefile").write_text("all:\n")
    monkeypatch.setattr(dataset_utils, "__file__", str(tmp_path / "utils.py"))
    assert not use_prebuilt_dataset_helpers() and dataset_utils.compile_helpers is original
    (tmp_path / "Makefile").unlink()
    assert use_prebuilt_dataset_helpers() and dataset_utils.compile_helpers is not original
    dataset_utils.compile_helpers()                 # no make, no SystemExit


@pytest.mark.parametrize("tree", ["1", "0"])
def test_launch_script_flags_parse_and_size_the_run(tree, monkeypatch):
    """scripts/launch_torchrun.sh's command line (printed through TORCHRUN=echo) goes through
    Megatron's own parser and the sample counting ``pretrain`` does before the first iteration."""
    import shlex
    import subprocess
    from megatron.training import training as megatron_training
    from megatron_harts.megatron.arguments import validate_tree_packing_args
    root = os.path.join(os.path.dirname(__file__), "..")
    env = dict(os.environ, TORCHRUN="echo", NPROC="2", ITERS="3", TREE=tree)
    line = subprocess.run(["bash", os.path.join(root, "scripts", "launch_torchrun.sh"), "r.jsonl"], env=env,
                          capture_output=True, text=True, check=True).stdout
    argv = shlex.split(line)
    argv = argv[next(i for i, a in enumerate(argv) if a.endswith("pretrain_hybrid_harts.py")) + 1:]
    args = _megatron_args(argv)
    validate_tree_packing_args(args)
    assert args.tree_packing == (tree == "1") and args.tree_trajectories == "r.jsonl"
    assert (args.micro_batch_size, args.global_batch_size, args.dataloader_type) == (1, 2, "external")
    assert not args.apply_rope_fusion
    assert (args.attention_dropout, args.hidden_dropout) == (0.0, 0.0)   # tree attention has no dropout
    for k, v in dict(iteration=0, skip_train=False, full_validation=False,    # set by validate_args (needs GPUs)
                     eval_global_batch_size=args.global_batch_size).items():
        if getattr(args, k, None) is None:
            setattr(args, k, v)
    monkeypatch.setattr(megatron_training, "get_args", lambda: args)
    assert megatron_training.get_train_valid_test_num_samples()[:2] == (3 * 2, 0)   # 3 steps, no eval


@pytest.mark.parametrize("extra,msg", [
    (["--tree-chunk-size", "0"], "--tree-chunk-size must be >= 1, got 0"),
    (["--tree-trajectories", "missing.jsonl"], "--tree-trajectories missing.jsonl: no such file"),
], ids=["chunk", "missing-file"])
def test_entry_point_argument_errors_exit_without_traceback(extra, msg, tmp_path):
    """scripts/pretrain_hybrid_harts.py refuses bad flags and a missing trajectory file before
    Megatron initialises: the message and a non-zero exit, no traceback."""
    import shlex
    import subprocess
    root = os.path.join(os.path.dirname(__file__), "..")
    (tmp_path / "r.jsonl").write_text('{"tokens": [1, 2, 3]}\n')
    line = subprocess.run(["bash", os.path.join(root, "scripts", "launch_torchrun.sh"), "r.jsonl"],
                          env=dict(os.environ, TORCHRUN="echo", NPROC="1"), capture_output=True, text=True,
                          check=True).stdout
    argv = shlex.split(line)
    argv = argv[next(i for i, a in enumerate(argv) if a.endswith("pretrain_hybrid_harts.py")):]
    res = subprocess.run([sys.executable, *argv, "--transformer-impl", "local", *extra], cwd=tmp_path,
                         capture_output=True, text=True, timeout=300,
                         env=dict(os.environ, CUDA_VISIBLE_DEVICES="", PYTHONWARNINGS="ignore"))
    assert res.returncode == 1 and msg in res.stderr and "Traceback" not in res.stderr, res.stderr[-3000:]


@pytest.mark.parametrize("text,msg", [
    (None, "--tree-trajectories: [Errno 2] No such file or directory"),
    ('{"tokens": [1, 2]}\n{"tokens": [1, 2, 99]}\n',
     "--tree-trajectories: {path}:2: trajectory 1: field 'tokens' has id 99"),
])
def test_data_provider_exits_with_the_file_line_and_field(text, msg, tmp_path, monkeypatch):
    from megatron_harts.megatron import training
    path = tmp_path / "r.jsonl"
    if text is not None:
        path.write_text(text)
    monkeypatch.setattr(training, "get_args", lambda: SimpleNamespace(tree_trajectories=str(path),
                                                                      padded_vocab_size=64))
    with pytest.raises(SystemExit) as e:
        training.train_valid_test_datasets_provider(None)
    assert msg.format(path=path) in str(e.value.code), e.value.code


def test_launch_validation_exits_with_the_message_not_a_traceback():
    """``validate_tree_packing_args_or_exit`` (the launch script's and the Megatron patch's call):
    an unsupported combination ends the process with the message (SystemExit), a valid one passes."""
    from megatron_harts.megatron.arguments import validate_tree_packing_args_or_exit
    with pytest.raises(SystemExit) as e:
        validate_tree_packing_args_or_exit(_megatron_args(BASE + ["--context-parallel-size", "2"]))
    assert "invalid arguments for tree packing" in str(e.value.code) and "context parallelism" in str(e.value.code)
    validate_tree_packing_args_or_exit(_megatron_args(BASE))


@pytest.mark.parametrize("per_step,flag", [(3, "--tree-groups-per-step 3"), (None, "--global-batch-size (groups per step) 5")])
def test_data_provider_exits_when_a_step_needs_more_groups_than_the_file_has(per_step, flag, tmp_path, monkeypatch):
    from megatron.core import mpu

    from megatron_harts.megatron import training
    path = tmp_path / "r.jsonl"
    path.write_text('{"tokens": [1, 2], "group_id": "a"}\n{"tokens": [1, 3], "group_id": "b"}\n')
    monkeypatch.setattr(training, "get_args", lambda: SimpleNamespace(
        tree_trajectories=str(path), padded_vocab_size=64, tree_shuffle_seed=None, tree_groups_per_step=per_step,
        global_batch_size=5, tree_packing=True, tree_chunk_size=16, tree_planner="greedy", tree_max_tokens=None))
    monkeypatch.setattr(mpu, "get_data_parallel_world_size", lambda: 1)
    monkeypatch.setattr(mpu, "get_data_parallel_rank", lambda: 0)
    monkeypatch.setattr(training, "get_num_microbatches", lambda: 1)
    monkeypatch.setattr(torch.distributed, "get_rank", lambda: 0)
    with pytest.raises(SystemExit) as e:
        training.train_valid_test_datasets_provider(None)
    msg = str(e.value.code)
    assert msg.startswith(flag) and "exceeds the 2 groups" in msg and str(path) in msg, msg


def test_configure_model_passes_the_attention_backend():
    from megatron_harts.megatron.training import configure_model
    args = _megatron_args(BASE + ["--tree-attention-backend", "flex"])
    cfg = configure_model(args, SimpleNamespace(hybrid_stack_spec=None))
    core = cfg.hybrid_stack_spec.submodules.attention_layer.submodules.self_attention.submodules.core_attention
    assert core.keywords == {"tree_attention_backend": "flex"}


def test_rl_loss_report_shows_negative_losses():
    """Megatron's iteration line prints only non-negative averages: the report carries the loss and
    its negation (each as [value, count]), so a negative policy loss is visible too."""
    with cpu_shim.cpu_megatron(seed=0):
        model, mb = _model(), _microbatch(_trajectories(), pack)
        tokens, pos, psp = model_inputs(mb)
        loss, _, report = rl_loss(model(tokens, pos, None, packed_seq_params=psp), mb, **LOSS_KW)
    assert torch.equal(report["rl loss negated"], torch.stack([-report["rl loss"][0], report["rl loss"][1]]))
    assert float(report["rl loss"][0]) == pytest.approx(float(loss)) and float(report["rl loss"][1]) == 1.0
