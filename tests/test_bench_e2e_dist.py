"""CPU tests of scripts/bench_e2e_dist.py: HARTS vs the trajectory-wise baseline under Megatron's
parallel state, 2 processes under ``torch.distributed.run`` with gloo, tiny fp32 models.

One launch runs four configurations (``--configs``): dense at DP=2, TP=2 and PP=2 (1F1B), moe at
EP=2 (DP=2, the all-to-all dispatcher; on batch seed 4 the plan gives the two ranks 4 and 3
microbatches, so one rank runs a pad microbatch: all-to-all needs equal counts), two timed fresh
batches each (seeds 4, 5; numerics on 4); the tests read its JSON:
structure, fresh batches (a new seed per step, the same trajectories on both sides), numerics
(tree vs baseline within fp32 rounding, next to the baseline rerun), and the imbalance fields
against the per-rank times they summarise. Refused combinations (moe at TP>1, dense at EP>1,
world not divisible, ...) are one-line errors (in-process, no launch). The launchers
(``scripts/launch_bench_dist.sh``, ``scripts/launch_slurm.sbatch`` with ``LAUNCH=``) are checked by
printing their torchrun line (``TORCHRUN=echo``; SLURM's ``srun``/``scontrol`` are shell stubs)
and parsing it with the driver's own parser.
"""
from __future__ import annotations

import importlib.util
import json
import os
import shlex
import socket
import stat
import subprocess
import sys

import numpy as np
import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "scripts", "bench_e2e_dist.py")
CONFIGS = {"TP1 PP1 DP2": "dense", "TP2 PP1 DP1": "dense", "TP1 PP2 DP1": "dense", "TP1 PP1 DP2 EP2": "moe"}
SIDES = ("baseline", "harts")


def _module():
    spec = importlib.util.spec_from_file_location("bench_e2e_dist", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    out = tmp_path_factory.mktemp("e2e_dist")
    env = dict(os.environ, OMP_NUM_THREADS="1", TORCHDYNAMO_DISABLE="1",
               PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    cmd = [sys.executable, "-W", "ignore", "-m", "torch.distributed.run", "--nproc-per-node", "2",
           "--master-addr", "127.0.0.1", "--master-port", str(_free_port()), SCRIPT, "--device", "cpu", "--tiny",
           "--tiny-groups", "4", "--models", "dense,moe",
           "--configs", "1x1x1:dense,2x1x1:dense,1x2x1:dense,1x1x2:moe", "--max-steps", "2", "--seed", "4",
           "--warmup-batches", "1", "--watchdog", "300", "--out", str(out)]
    res = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=330)
    assert res.returncode == 0, res.stderr[-4000:]
    return json.loads((out / "e2e_dist.json").read_text()), out


@pytest.mark.timeout(400)
def test_every_configuration_row_and_its_fields(run):
    data, _ = run
    rows = data["rows"]
    assert {(r["config"], r["model"]) for r in rows} == set(CONFIGS.items())
    assert data["skipped"] == [] and data["meta"]["world"] == 2 and data["meta"]["correctness_only"]
    assert "DistributedDataParallel" in data["meta"]["grad_allreduce"]
    for r in rows:
        assert r["tp"] * r["pp"] * r["dp"] == r["world"] == 2 and r["steps"] == 2 and r["warmup_batches"] == 1
        assert r["ep"] == (2 if r["model"] == "moe" else 1)
        assert r["rank_dp"] == ([0, 1] if r["dp"] == 2 else [0, 0])
        for s in SIDES:
            x = r[s]
            for k in ("wall_ms", "grad_ms", "host_ms"):
                assert x[k]["min"] <= x[k]["median"] <= x[k]["max"] and x[k]["min"] > 0, (s, k)
            assert len(x["rank_grad_ms"]) == len(x["rank_wall_ms"]) == 2 and len(x["replica_grad_ms"]) == r["dp"]
            assert abs(sum(x["predicted_share"]) - 1) < 1e-9 and abs(sum(x["measured_share"]) - 1) < 1e-9
            assert x["peak_gib"] is None and x["rank_peak_gib"] == [None, None]      # CPU: no CUDA allocator
            for st in x["steps"]:
                assert st["wall_ms"] >= st["grad_ms"] > 0 and st["host_ms"] > 0
                assert min(st["microbatches"]) >= 1 and st["planned_microbatches"] >= r["pp"]
                if r["ep"] > 1:      # every rank runs the same number (pads included)
                    assert len(set(st["microbatches"])) == 1
                else:
                    assert st["pad_microbatches"] == [0] * r["dp"]
        if r["ep"] > 1:              # the pad path ran (seed 4: 4 and 3 non-empty microbatches)
            assert r["harts"]["steps"][0]["pad_microbatches"] in ([0, 1], [1, 0]), r["harts"]["steps"][0]
        # compression and speedup from the recorded numbers
        h, b = r["harts"]["steps"], r["baseline"]["steps"]
        assert abs(r["compression"] - sum(x["traj_tokens"] for x in b) / sum(x["compact_tokens"] for x in h)) < 1e-9
        assert r["compression"] > 1 and all(x["compact_tokens"] == x["traj_tokens"] for x in b)
        assert abs(r["speedup"] - r["baseline"]["wall_ms"]["median"] / r["harts"]["wall_ms"]["median"]) < 1e-9
        assert r["target"] == pytest.approx(0.9 * r["compression"])
        assert r["meets_imbalance_target"] == (r["imbalance_gap"] <= 0.05)


def test_every_timed_step_is_a_new_batch_shared_by_both_sides(run):
    for r in run[0]["rows"]:
        b, h = r["baseline"]["steps"], r["harts"]["steps"]
        assert [x["seed"] for x in b] == [x["seed"] for x in h] == [4, 5]
        assert [x["traj_tokens"] for x in b] == [x["traj_tokens"] for x in h]     # all trajectories, both sides
        assert b[0]["traj_tokens"] != b[1]["traj_tokens"]                        # different batches
        for x in b + h:      # the DP replicas together hold the whole batch
            assert sum(x["replica_traj_tokens"]) == x["traj_tokens"]
        if r["dp"] == 2:     # each replica trains a part of it
            assert all(0 < t < x["traj_tokens"] for x in b + h for t in x["replica_traj_tokens"])


def test_tree_equals_baseline_within_fp32_rounding(run):
    for r in run[0]["rows"]:
        n, what = r["numerics"], f"{r['config']} {r['model']}"
        assert n["trajectories"] == r["trajectories"] and n["grad_norm_baseline"] > 0, what
        for side in ("harts", "rerun"):
            assert n[f"lp_diff_{side}"]["max"] < 1e-4, (what, side, n[f"lp_diff_{side}"])
            assert n[f"loss_rel_diff_{side}"] < 1e-5, (what, side)
            assert n[f"grad_norm_rel_diff_{side}"] < 1e-5, (what, side)
            assert n[f"grad_max_rel_diff_{side}"] < 1e-4, (what, side, n[f"grad_max_rel_diff_{side}"])
            # GDN decay grads (A_log, dt_bias) are sums with cancellation: looser (verify.py's 5e-4 x 10)
            assert n[f"grad_max_rel_diff_decay_{side}"] < 5e-3, (what, side)


def test_imbalance_fields_follow_the_rank_times(run):
    for r in run[0]["rows"]:
        for s in SIDES:
            x = r[s]
            for st in x["steps"]:
                rep = [max(t for t, d in zip(st["rank_grad_ms"], r["rank_dp"]) if d == j) for j in range(r["dp"])]
                assert st["replica_grad_ms"] == rep
                assert st["wall_ms"] == max(st["rank_wall_ms"]) and st["grad_ms"] == max(st["rank_grad_ms"])
                assert st["measured_imbalance"] == pytest.approx(max(rep) / np.mean(rep) - 1)
                pred = st["predicted_cost"]
                assert len(pred) == r["dp"] and st["predicted_imbalance"] == pytest.approx(max(pred) / np.mean(pred) - 1)
            assert x["measured_imbalance"] == pytest.approx(np.median([st["measured_imbalance"] for st in x["steps"]]))
            assert x["predicted_imbalance"] == pytest.approx(np.median([st["predicted_imbalance"] for st in x["steps"]]))
            assert x["rank_grad_ms"] == pytest.approx(np.median([st["rank_grad_ms"] for st in x["steps"]], axis=0))
            if r["dp"] == 1:
                assert x["measured_imbalance"] == x["predicted_imbalance"] == 0
        assert r["imbalance_gap"] == pytest.approx(abs(r["harts"]["measured_imbalance"] - r["harts"]["predicted_imbalance"]))


@pytest.mark.timeout(200)
def test_dp2_gradient_equals_one_process_gradient(run, tmp_path):
    """Megatron's DDP all-reduce (1/DP pre-scaled) and the loss scaling (x M x DP, Megatron divides
    by M) give the whole batch's gradient: the DP=2 run's global loss and gradient norm equal those
    of one process on the same batch and weights (a uniform mis-scaling would pass the tree vs
    baseline comparison, not this one)."""
    env = dict(os.environ, OMP_NUM_THREADS="1", TORCHDYNAMO_DISABLE="1",
               PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    cmd = [sys.executable, "-W", "ignore", "-m", "torch.distributed.run", "--nproc-per-node", "1",
           "--master-addr", "127.0.0.1", "--master-port", str(_free_port()), SCRIPT, "--device", "cpu", "--tiny",
           "--tiny-groups", "4", "--models", "dense", "--max-steps", "1", "--seed", "4", "--warmup-batches", "0",
           "--no-rerun", "--watchdog", "150", "--out", str(tmp_path)]
    res = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=180)
    assert res.returncode == 0, res.stderr[-4000:]
    (one,) = json.loads((tmp_path / "e2e_dist.json").read_text())["rows"]
    (dp2,) = [r for r in run[0]["rows"] if r["config"] == "TP1 PP1 DP2" and r["model"] == "dense"]
    assert one["config"] == "TP1 PP1 DP1" and one["numerics"]["trajectories"] == dp2["numerics"]["trajectories"]
    for k in ("loss_baseline", "grad_norm_baseline", "loss_harts", "grad_norm_harts"):
        assert dp2["numerics"][k] == pytest.approx(one["numerics"][k], rel=1e-5), k


def test_plot_renders_table_and_figure(run, tmp_path):
    _, out = run
    run_md = (out / "e2e_dist.md").read_text()           # written by rank 0 at the end of the run
    assert all(f"| {cfg} | {model} | swe |" in run_md for cfg, model in CONFIGS.items())
    mod = _module()
    assert mod.main(["--plot", str(out / "e2e_dist.json"), "--out", str(tmp_path)]) == 0
    md = (tmp_path / "e2e_dist.md").read_text()
    for cfg, model in CONFIGS.items():
        assert f"| {cfg} | {model} | swe |" in md
    assert "## Per rank" in md and (tmp_path / "e2e_dist.png").stat().st_size > 0


@pytest.mark.parametrize("argv, env, message", [
    (["--tp", "3"], {}, "world size 2 is not a multiple of TP x PP = 3"),
    (["--models", "dense", "--ep", "2"], {}, "the dense model has no experts"),
    (["--models", "moe", "--tp", "2"], {}, "refuses tensor parallelism without sequence parallelism"),
    (["--configs", "2x1"], {}, "is not TPxPPxEP"),
    (["--configs", "1x1x2:moe", "--models", "dense"], {}, "models must be among --models"),
    (["--ep", "2", "--models", "moe", "--pp", "2"], {}, "expert parallelism must divide DP = 1"),
    (["--workloads", "swe,foo"], {}, "unknown workload 'foo'"),
    (["--max-steps", "0"], {}, "--max-steps must be >= 1"),
    ([], {"RANK": None}, "launch with torchrun"),
], ids=["tp3", "dense-ep", "moe-tp", "config-syntax", "config-model", "ep-dp", "workload", "steps", "no-torchrun"])
def test_refused_combinations_are_one_line_errors(argv, env, message, monkeypatch, capsys):
    mod = _module()
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "2")
    for k, v in env.items():
        monkeypatch.delenv(k) if v is None else monkeypatch.setenv(k, v)
    assert mod.main(["--device", "cpu", "--tiny"] + argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("bench_e2e_dist.py: error: ") and message in err[0], err


def test_stage_pattern_cuts_at_layer_pairs():
    mod = _module()
    assert mod.stage_pattern("G-G-*-", 1) == "G-G-*-"
    assert mod.stage_pattern("G-G-*-", 2) == "G-|G-*-"
    assert mod.stage_pattern("GE*E", 2) == "GE|*E"
    dense = "G-G-G-*-" * 6
    assert mod.stage_pattern(dense, 2) == "G-G-G-*-" * 3 + "|" + "G-G-G-*-" * 3
    assert [len(p) for p in mod.stage_pattern(dense, 4).split("|")] == [12] * 4
    with pytest.raises(mod.ConfigError, match="only 2 layer pairs"):
        mod.stage_pattern("GE*E", 3)


def _driver_args(line: str, mod):
    argv = shlex.split(line)
    i = next(k for k, a in enumerate(argv) if a.endswith("bench_e2e_dist.py"))
    return argv[:i], mod.parser().parse_args(argv[i + 1:])


def test_launch_bench_dist_passes_the_configuration():
    mod = _module()
    env = dict(os.environ, TORCHRUN="echo", NPROC="4", TP="2", PP="2", MODELS="dense", STEPS="6",
               COST_MODEL="/x/cost_model.json", OUT="/o", NAME="x4.json")
    line = subprocess.run(["bash", os.path.join(ROOT, "scripts", "launch_bench_dist.sh"), "--no-rerun"], env=env,
                          capture_output=True, text=True, check=True).stdout
    launcher, args = _driver_args(line, mod)
    assert launcher[launcher.index("--nproc-per-node") + 1] == "4"
    assert (args.tp, args.pp, args.ep, args.models, args.max_steps, args.cost_model, args.out, args.name) == \
        (2, 2, 1, "dense", 6, "/x/cost_model.json", "/o", "x4.json")
    assert not args.rerun and args.configs is None and args.device == "cuda"
    cfgs = mod.parse_configs(args, world=4)
    assert [(c["tp"], c["pp"], c["dp"]) for c in cfgs] == [(2, 2, 1)]


def test_launch_slurm_runs_the_benchmark_launcher(tmp_path):
    """sbatch script with LAUNCH=scripts/launch_bench_dist.sh: no trajectory file, the benchmark's
    knobs reach the driver (srun / scontrol are stubs: srun drops its options and runs the command)."""
    mod = _module()
    for name, body in {"srun": 'while [ "${1#--}" != "$1" ]; do shift; done; exec "$@"',
                       "scontrol": "echo node-a; echo node-b"}.items():
        p = tmp_path / name
        p.write_text("#!/usr/bin/env bash\n" + body + "\n")
        p.chmod(p.stat().st_mode | stat.S_IEXEC)
    env = dict(os.environ, PATH=f"{tmp_path}{os.pathsep}{os.environ['PATH']}", SLURM_SUBMIT_DIR=ROOT,
               SLURM_NNODES="1", SLURM_JOB_NODELIST="node-a", SLURM_NODEID="0", GPUS_PER_NODE="2",
               LAUNCH="scripts/launch_bench_dist.sh", TORCHRUN="echo", CONFIGS="2x1x1,1x2x1,1x1x2:moe",
               MODELS="dense,moe")
    line = subprocess.run(["bash", os.path.join(ROOT, "scripts", "launch_slurm.sbatch"), "--max-steps", "7"],
                          env=env, capture_output=True, text=True, check=True).stdout
    launcher, args = _driver_args(line, mod)
    assert launcher[launcher.index("--nproc-per-node") + 1] == "2"
    assert launcher[launcher.index("--master-addr") + 1] == "node-a"
    assert args.configs == "2x1x1,1x2x1,1x1x2:moe" and args.max_steps == 7
    cfgs = mod.parse_configs(args, world=2)
    assert [(c["tp"], c["pp"], c["ep"], c["dp"], c["models"]) for c in cfgs] == [
        (2, 1, 1, 1, ["dense", "moe"]), (1, 2, 1, 1, ["dense", "moe"]), (1, 1, 2, 2, ["moe"])]
    # training (the default LAUNCH) still needs the trajectory file first
    env.pop("LAUNCH")
    res = subprocess.run(["bash", os.path.join(ROOT, "scripts", "launch_slurm.sbatch")], env=env,
                         capture_output=True, text=True)
    assert res.returncode != 0 and "TRAJECTORIES.jsonl" in res.stderr
    line = subprocess.run(["bash", os.path.join(ROOT, "scripts", "launch_slurm.sbatch"), "r.jsonl"], env=env,
                          capture_output=True, text=True, check=True).stdout
    argv = shlex.split(line)
    assert argv[argv.index("--tree-trajectories") + 1] == "r.jsonl"


# ------------------------------------------------------------------------------------------------
# Found in the Megatron path while building the driver
# ------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("cp", [1, 2])
def test_tree_gdn_input_split_matches_megatron_under_context_parallelism(cp):
    """``TreeGatedDeltaNet._prepare_input_for_gated_delta_rule`` serves the stock (non-tree) path
    too; under CP Megatron's all-to-all leaves each rank 1/cp of the heads, so the q|k / v split is
    ``// cp_size`` as in Megatron's own method (it used the TP-local sizes and failed at CP=2)."""
    from types import SimpleNamespace

    import torch
    from megatron.core.ssm.gated_delta_net import GatedDeltaNet
    from megatron_harts.megatron.layers import TreeGatedDeltaNet

    H, HV, D = 4, 8, 16                                  # key heads, value heads, head dim (TP-local)
    me = SimpleNamespace(qk_dim_local_tp=H * D, v_dim_local_tp=HV * D, cp_size=cp, key_head_dim=D,
                         value_head_dim=D, num_key_heads=H, num_value_heads=HV, use_qk_l2norm=False)
    g = torch.Generator().manual_seed(0)
    qkv = torch.randn(1, 5, (2 * H * D + HV * D) // cp, generator=g)
    gate, beta = torch.randn(1, 5, HV // cp, D, generator=g), torch.randn(1, 5, HV // cp, generator=g)
    ours = TreeGatedDeltaNet._prepare_input_for_gated_delta_rule(me, qkv, gate, 1, 5, beta)
    ref = GatedDeltaNet._prepare_input_for_gated_delta_rule.__wrapped__(me, qkv, gate, 1, 5, beta) \
        if hasattr(GatedDeltaNet._prepare_input_for_gated_delta_rule, "__wrapped__") else \
        GatedDeltaNet._prepare_input_for_gated_delta_rule(me, qkv, gate, 1, 5, beta)
    assert len(ours) == len(ref) == 5
    for a, b in zip(ours, ref):
        assert a.shape == b.shape and torch.equal(a, b)


def test_tree_packing_args_refuse_expert_parallel_allgather():
    """Under EP the DP ranks of an expert group hold packs of different lengths; Megatron's allgather
    dispatcher gathers equal token counts (on gloo the 2-process EP=2 run of this driver aborted with
    it), so ``--tree-packing`` with EP > 1 asks for the all-to-all dispatcher, as under PP."""
    from megatron_harts.megatron.arguments import TreePackingArgumentError, validate_tree_packing_args
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from test_megatron_dist import BASE, _megatron_args

    ep = ["--num-experts", "4", "--expert-model-parallel-size", "2"]
    with pytest.raises(TreePackingArgumentError, match="expert-model-parallel-size 2 needs --moe-token-dispatcher"):
        validate_tree_packing_args(_megatron_args(BASE + ep))
    validate_tree_packing_args(_megatron_args(BASE + ep + ["--moe-token-dispatcher-type", "alltoall"]))
    validate_tree_packing_args(_megatron_args(BASE + ["--num-experts", "4"]))          # EP=1: allgather is fine
