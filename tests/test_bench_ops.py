"""scripts/bench_ops.py needs CUDA to measure; its rendering (``--plot``) runs anywhere: the ops.md
table (GPU-time column only where a row was profiled) and the plot, from a results JSON."""
import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _row(op, tokens, compression, tree_ms, traj_ms, **extra):
    return dict(op=op, trajectory_tokens=tokens, compact_tokens=int(tokens / compression), compression=compression,
                tree_ms=tree_ms, traj_ms=traj_ms, speedup=traj_ms / tree_ms, target=0.9 * compression, plan_ms=1.0,
                rounds=3, replay_tokens=10, meets_target=traj_ms / tree_ms >= 0.9 * compression, **extra)


def test_bench_ops_plot_renders_table_and_png(tmp_path):
    rows = [_row("gdn", 32540, 2.0, 5.0, 4.0, tree_gpu_ms=2.0, traj_gpu_ms=4.0, gpu_speedup=2.0, run="r1"),
            _row("conv", 264133, 2.0, 10.0, 20.0), _row("conv", 266207, 4.0, 6.0, 21.0)]
    src = tmp_path / "in.json"
    src.write_text(json.dumps({"meta": {"device": "X", "torch": "t", "heads": 16, "dim": 128, "reps": 10,
                                        "notes": ["a note"]}, "rows": rows}))
    res = subprocess.run([sys.executable, os.path.join(ROOT, "scripts", "bench_ops.py"), "--plot", str(src),
                          "--out", str(tmp_path)], capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    md = (tmp_path / "ops.md").read_text().splitlines()
    assert "Note: a note" in md
    table = [line for line in md if line.startswith("| gdn") or line.startswith("| conv")]
    assert table[0].split(" | ")[7:9] == ["2.00", "3"]         # GPU-time speedup, rounds
    assert table[1].split(" | ")[5:9] == ["2.00", "1.80", "-", "3"]   # wall speedup, target, no GPU time
    assert "yes" in table[1] and "no" in table[0] and table[0].endswith("| r1 |")
    assert (tmp_path / "ops.png").stat().st_size > 10_000
