"""The training entry point end to end: ``scripts/launch_torchrun.sh`` -> Megatron's ``pretrain``
loop -> this package's data iterator, ``forward_step`` and ``loss_func``, on CPU (gloo, fp32, CUDA
calls faked by ``tests/megatron_cpu_launch.py``), tree-packed and trajectory-wise from one seed.
The first step's reduced gradients must agree tensor by tensor: the two layouts compute the same
gradient through Megatron's schedules, DDP buffers and loss normalisation."""
import os
import re
import shlex
import socket
import subprocess
import sys

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TOL, DECAY_TOL = 1e-4, 1e-3          # fp32; GDN A_log / dt_bias grads are cancelling sums (see verify.py)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _train(tmp_path, data: str, tree: str) -> tuple[str, dict]:
    grads = tmp_path / f"grads{tree}.pt"
    env = dict(os.environ, TORCHRUN="echo", NPROC="1", ITERS="2", PATTERN="G*-G-", HIDDEN="64", HEADS="2",
               FFN="128", SEQ="1024", VOCAB="32768", MBS_PER_STEP="2", GROUPS_PER_STEP="4", TREE=tree,
               PRECISION="", MASTER_PORT=str(_free_port()))
    line = subprocess.run(["bash", os.path.join(ROOT, "scripts", "launch_torchrun.sh"), data, "--transformer-impl",
                           "local", "--no-persist-layer-norm", "--no-gradient-accumulation-fusion", "--seed", "1",
                           "--distributed-backend", "gloo", "--init-method-std", "0.1"], env=env,
                          capture_output=True, text=True, check=True).stdout
    argv = shlex.split(line)
    i = next(i for i, a in enumerate(argv) if a.endswith("pretrain_hybrid_harts.py"))
    cmd = [sys.executable, "-m", "torch.distributed.run", *argv[:i], os.path.join(ROOT, "tests", "megatron_cpu_launch.py"),
           *argv[i:]]
    run_env = dict(os.environ, OMP_NUM_THREADS="2", CUDA_VISIBLE_DEVICES="", PYTHONWARNINGS="ignore",
                   HARTS_GRADS_OUT=str(grads))
    res = subprocess.run(cmd, env=run_env, cwd=tmp_path, capture_output=True, text=True, timeout=900)
    out = res.stdout + res.stderr
    assert res.returncode == 0, out[-4000:]
    return out, torch.load(grads)


@pytest.mark.skipif(os.environ.get("HARTS_SKIP_DIST_TESTS") == "1", reason="HARTS_SKIP_DIST_TESTS=1: no multi-process tests")
def test_pretrain_entry_point_tree_and_baseline(tmp_path):
    data = str(tmp_path / "rollouts.jsonl")
    subprocess.run([sys.executable, "-m", "megatron_harts.workloads", "tau", "--groups", "4", "--max-tokens", "256",
                    "--out", data], check=True, cwd=ROOT)
    grads = {}
    for tree in ("1", "0"):
        out, grads[tree] = _train(tmp_path, data, tree)
        assert re.findall(r"iteration\s+(\d+)/\s*2 \|", out) == ["1", "2"], out[-4000:]
        first = re.search(r"iteration\s+1/\s*2 \|(.*)", out)
        assert first and re.search(r"rl loss( negated)?: ", first.group(1)), out[-4000:]
        compression = re.search(r"compression: ([0-9.E+-]+)", first.group(1))
        assert compression and (float(compression.group(1)) > 1.5) == (tree == "1"), first.group(1)
    assert grads["1"].keys() == grads["0"].keys() and len(grads["1"]) > 10
    for name, want in grads["0"].items():
        err = float((grads["1"][name] - want).abs().max() / want.abs().max().clamp(min=1e-12))
        assert err < (DECAY_TOL if name.endswith(("A_log", "dt_bias")) else TOL), (name, err)
