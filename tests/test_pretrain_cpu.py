"""The training entry point end to end: ``scripts/launch_torchrun.sh`` -> Megatron's ``pretrain``
loop -> this package's data iterator, ``forward_step`` and ``loss_func``, on CPU (gloo, CUDA calls
faked by ``tests/megatron_cpu_launch.py``), tree-packed and trajectory-wise from one seed. The
first iteration's gradient norm must agree: the two layouts compute the same gradient."""
import os
import re
import shlex
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _free_port() -> int:
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _train(tmp_path, data, tree: str) -> str:
    env = dict(os.environ, TORCHRUN="echo", NPROC="1", ITERS="2", PATTERN="G*-G-", HIDDEN="64", HEADS="2",
               FFN="128", SEQ="1024", VOCAB="32768", MBS_PER_STEP="2", GROUPS_PER_STEP="4", TREE=tree)
    line = subprocess.run(["bash", os.path.join(ROOT, "scripts", "launch_torchrun.sh"), data, "--transformer-impl",
                           "local", "--no-persist-layer-norm", "--no-gradient-accumulation-fusion", "--seed", "1",
                           "--distributed-backend", "gloo"], env=env, capture_output=True, text=True,
                          check=True).stdout
    argv = shlex.split(line)
    i = next(i for i, a in enumerate(argv) if a.endswith("pretrain_hybrid_harts.py"))
    launcher = [a if a != "29500" else str(_free_port()) for a in argv[:i]]
    cmd = [sys.executable, "-m", "torch.distributed.run", *launcher, os.path.join(ROOT, "tests", "megatron_cpu_launch.py"),
           *argv[i:]]
    run_env = dict(os.environ, OMP_NUM_THREADS="2", CUDA_VISIBLE_DEVICES="", PYTHONWARNINGS="ignore")
    res = subprocess.run(cmd, env=run_env, cwd=tmp_path, capture_output=True, text=True, timeout=900)
    out = res.stdout + res.stderr
    assert res.returncode == 0, out[-4000:]
    return out


@pytest.mark.skipif(os.environ.get("HARTS_SKIP_DIST_TESTS") == "1", reason="HARTS_SKIP_DIST_TESTS=1: no multi-process tests")
def test_pretrain_entry_point_tree_and_baseline(tmp_path):
    data = str(tmp_path / "rollouts.jsonl")
    subprocess.run([sys.executable, "-m", "megatron_harts.workloads", "tau", "--groups", "4", "--max-tokens", "256",
                    "--out", data], check=True, cwd=ROOT)
    norms = {}
    for tree in ("1", "0"):
        out = _train(tmp_path, data, tree)
        iters = re.findall(r"iteration\s+(\d+)/\s*2 \|.*", out)
        assert iters == ["1", "2"], out[-4000:]
        first = re.search(r"iteration\s+1/\s*2 \|(.*)", out).group(1)
        assert re.search(r"rl loss( negated)?: ", first) and "compression" in first, first
        norms[tree] = float(re.search(r"grad norm: ([0-9.]+)", first).group(1))
        compression = float(re.search(r"compression: ([0-9.E+-]+)", first).group(1))
        assert (compression > 1.5) == (tree == "1"), first
    assert norms["1"] == pytest.approx(norms["0"], rel=2e-2), norms       # bf16 model, 3-digit log
