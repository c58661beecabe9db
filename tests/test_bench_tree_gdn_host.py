"""scripts/bench_tree_gdn_host.py: refuses without CUDA (exit 2, one line); its measuring code runs
on CPU with fla in Triton's interpreter and torch.cuda's timing calls stubbed (tiny tau-like pack)."""
import json
import os
import subprocess
import sys

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="CPU behaviour of a GPU benchmark")


def test_refuses_without_cuda(tmp_path):
    res = subprocess.run([sys.executable, os.path.join(ROOT, "scripts", "bench_tree_gdn_host.py"), "--out",
                          str(tmp_path / "x.json")], capture_output=True, text=True, timeout=300,
                         env={**os.environ, "PYTHONPATH": ROOT})
    assert res.returncode == 2 and len(res.stderr.strip().splitlines()) == 1 and "CUDA" in res.stderr
    assert not (tmp_path / "x.json").exists()


def test_measures_and_checks_equality_on_cpu_stubs(tmp_path, monkeypatch):
    import scripts.bench_tree_gdn_host as B
    from megatron_harts.packing import pack
    from megatron_harts.tree import RolloutTree

    from test_fla_backend import _tiny_tau_pack

    class Event:
        def __init__(self, **kw):
            pass

        def record(self):
            pass

        def elapsed_time(self, other):
            return 1.0

    def packs(seed, which=0, device="cpu", **kw):
        pk = _tiny_tau_pack(1, turns=(2, 4), max_tokens=200)
        return pk, pack([RolloutTree(list(pk.trajectories), merge_prefixes=False)], chunk_size=64)

    for name, fn in (("is_available", lambda: True), ("synchronize", lambda *a: None), ("_sleep", lambda n: None),
                     ("Event", Event), ("get_device_name", lambda *a: "cpu stub")):
        monkeypatch.setattr(torch.cuda, name, fn)
    monkeypatch.setattr(B, "DEVICE", "cpu")
    monkeypatch.setattr(B, "tau_like_packs", packs)
    out = tmp_path / "r.json"
    assert B.main(["--out", str(out), "--reps", "1", "--heads", "1", "--dim", "16"]) == 0
    res = json.loads(out.read_text())
    assert set(res["paths"]) == {"reference", "new_no_fast", "new", "chain_no_fast", "chain"}
    assert res["rounds"] >= 2 and res["paths"]["new"]["loops_host_ms"]["n"] == 1
    assert all(v["bitwise_equal"] for v in res["equality"].values()), res["equality"]
