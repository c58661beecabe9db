"""scripts/bench_alloc.py on a machine without CUDA: a one-line error and exit 1 (the measurement
itself needs the GPU: docs/benchmarks/README.md, pending list); bad arguments: argparse's exit 2."""
import os
import subprocess
import sys

import pytest
import torch

SCRIPT = os.path.join(os.path.dirname(__file__), "..", "scripts", "bench_alloc.py")


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the one-line error of a machine without CUDA; where CUDA exists the script measures instead (its GPU path runs only on the device, docs/benchmarks/README.md pending list)")
def test_bench_alloc_without_cuda_says_so(tmp_path):
    p = subprocess.run([sys.executable, SCRIPT, "--out", str(tmp_path / "a.json"), "--gib", "0.1", "--reps", "1"],
                       capture_output=True, text=True, timeout=300)
    assert p.returncode == 1 and not (tmp_path / "a.json").exists()
    assert p.stderr.strip().splitlines()[-1] == "bench_alloc.py: needs a CUDA device (torch.cuda.is_available() is False)"


def test_bench_alloc_rejects_bad_sizes(tmp_path):
    p = subprocess.run([sys.executable, SCRIPT, "--out", str(tmp_path / "a.json"), "--gib", "0"],
                       capture_output=True, text=True, timeout=300)
    assert p.returncode == 2 and "--gib and --tensor-mib must be > 0" in p.stderr
