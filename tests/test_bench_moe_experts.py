"""CPU smoke run of scripts/bench_moe_experts.py: both expert modules, same weights, JSON rows."""
import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_bench_moe_experts_cpu(tmp_path):
    cmd = [sys.executable, "-W", "ignore", os.path.join(ROOT, "scripts", "bench_moe_experts.py"), "--device", "cpu",
           "--tokens", "64,256", "--hidden", "32", "--ffn", "32", "--experts", "4", "--reps", "2", "--warmup", "1",
           "--watchdog", "300", "--out", str(tmp_path)]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=600,
                         env=dict(os.environ, OMP_NUM_THREADS="2", MASTER_PORT="29731"))
    assert res.returncode == 0, res.stderr[-3000:]
    rows = json.loads((tmp_path / "moe_experts.json").read_text())["rows"]
    assert [r["tokens"] for r in rows] == [64, 256]
    for r in rows:
        assert max(r["grouped_rel_err"]) < 1e-5          # fp32: grouped GEMM == per-expert loop
        assert r["sequential_ms"]["median"] > 0 and r["grouped_ms"]["median"] > 0 and r["speedup"] > 0
