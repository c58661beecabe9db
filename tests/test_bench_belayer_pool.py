"""scripts/bench_belayer.py --pool-engine-reps: engine rows rebuilt from the per-step records of
several raw runs (medians and spreads over every repetition, a step filter, clear errors)."""
import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
GPU = "GPU (NVIDIA H200, SGLang)"
CMD = "python scripts/bench_belayer.py --engine sglang --kill-at 200 --max-new-tokens 320 --parts engine"


def _raw(path, reps, device=GPU, cmd=CMD, starts=(60.0,)):
    path.write_text(json.dumps({
        "device": device, "commands": {"engine": cmd}, "rows": [],
        "engine_run": {"engine_args": "--flags", "server_starts_s": list(starts)},
        "engine_reps": [{"mode": m, "kill": k, "recovery_s": s, "same_output": same} for m, k, s, same in reps]}))
    return str(path)


def _pool(args, out):
    return subprocess.run([sys.executable, os.path.join(ROOT, "scripts", "bench_belayer.py"), "--pool-engine-reps",
                           *args, "--out", str(out)], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PYTHONPATH": ROOT})


def test_pools_repetitions_across_runs_and_keeps_other_rows(tmp_path):
    a = _raw(tmp_path / "a.json", [("shadow", "group", 0.10, True), ("cold", "group", 60.0, True),
                                   ("restart", "group", 0.50, True), ("shadow", "child", 6.0, True)])
    b = _raw(tmp_path / "b.json", [("shadow", "group", 0.30, False), ("cold", "group", 80.0, True),
                                   ("shadow", "child", 0.2, True)])
    c = _raw(tmp_path / "c.json", [("shadow", "group", 0.20, True), ("restart", "group", 0.70, True)])
    out = tmp_path / "out.json"
    keep = [{"fault": "f", "mechanism": "cpu row", "part": "engine", "device": "CPU (x86_64)"},
            {"fault": "none", "mechanism": "gpu overhead", "part": "overhead", "device": GPU},
            {"fault": "old", "mechanism": "old gpu engine row", "part": "engine", "device": GPU}]
    out.write_text(json.dumps({"rows": keep}))
    # run a's scheduler kill (before some fix) is left out by the filter
    res = _pool([a + "@shadow:group,cold:group,restart:group", b, c], out)
    assert res.returncode == 0, res.stderr
    d = json.loads(out.read_text())
    mechs = [r["mechanism"] for r in d["rows"]]
    assert "cpu row" in mechs and "gpu overhead" in mechs and "old gpu engine row" not in mechs
    eng = {(r["fault"], r["baseline"]): r for r in d["rows"] if r.get("part") == "engine" and r["device"] == GPU}
    g_cold = eng[("engine worker SIGKILL (mid-request)", "cold start + prefix resume")]
    assert g_cold["recovery_s"] == pytest.approx(0.20) and g_cold["reps"] == 3
    assert g_cold["spread"]["recovery_s"] == pytest.approx([0.10, 0.30])
    assert g_cold["baseline_s"] == pytest.approx(70.0) and g_cold["speedup"] == pytest.approx(350.0)
    assert g_cold["same_output"].startswith("2 of 3")
    g_re = eng[("engine worker SIGKILL (mid-request)", "shadow promoted + abort-and-resubmit from scratch")]
    assert g_re["baseline_s"] == pytest.approx(0.60) and g_re["spread"]["baseline_s"] == pytest.approx([0.5, 0.7])
    child = eng[("engine scheduler SIGKILL (mid-request)", "cold start + prefix resume")]
    assert child["recovery_s"] == pytest.approx(0.2) and child["reps"] == 1      # a's 6.0 s filtered out
    assert "other kill target" in child["note"] and "3 runs" in child["note"]
    assert d["merged"]["pooled engine_reps"]["steps"]["shadow:child"] == [0.2]


@pytest.mark.parametrize("case", ["missing", "no_match", "devices", "shape"])
def test_bad_input_is_one_line_and_non_zero(tmp_path, case):
    a = _raw(tmp_path / "a.json", [("shadow", "group", 0.1, True)])
    args = {"missing": [str(tmp_path / "nope.json")],
            "no_match": [a + "@cold:group"],
            "devices": [a, _raw(tmp_path / "b.json", [("shadow", "group", 0.2, True)], device="CPU (x86_64)")],
            "shape": [a, _raw(tmp_path / "b.json", [("shadow", "group", 0.2, True)], cmd=CMD.replace("200", "100"))],
            }[case]
    out = tmp_path / "out.json"
    res = _pool(args, out)
    assert res.returncode != 0 and len(res.stderr.strip().splitlines()) == 1, res.stderr
    assert "--pool-engine-reps" in res.stderr and not out.exists()
