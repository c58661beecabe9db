"""scripts/calibrate_cost.py: the NNLS fit recovers known coefficients on the script's own pack
design; the CPU smoke mode (``--device cpu --tiny``) runs end to end and writes a JSON that
``CostModel.from_json`` loads and ``plan`` accepts."""
import importlib.util
import json
import os
import subprocess
import sys
import time

import numpy as np
import pytest

from megatron_harts.packing import pack
from megatron_harts.planner import CostModel, plan
from megatron_harts.tree import RolloutTree

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
SCRIPT = os.path.join(ROOT, "scripts", "calibrate_cost.py")


def _load_script():
    spec = importlib.util.spec_from_file_location("calibrate_cost", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


cc = _load_script()


@pytest.fixture(scope="module")
def design_features():
    """Features (tokens, ancestors, rounds) of the packs the script would time at 4096 tokens."""
    rows = [cc.features(pack([RolloutTree.from_trajectories(t) for t in trees], chunk_size=64))
            for _, trees in cc.design(4096, 64, 1000, seed=0)]
    return {k: np.array([r[k] for r in rows], np.float64) for k in cc.FEATURES}


@pytest.mark.parametrize("intercept", [True, False])
def test_fit_recovers_known_coefficients(design_features, intercept):
    f = design_features
    assert len(np.unique(f["rounds"])) >= 5 and f["rounds"].max() >= 20   # rounds are varied
    true = CostModel(per_token=2e-7, per_ancestor=3e-11, per_round=4e-4)  # seconds; all terms matter
    d = 2e-3 if intercept else 0.0
    clean = true.tree_cost(f["tokens"], f["ancestors"]) + true.per_round * f["rounds"] + d
    rng = np.random.default_rng(0)
    times = clean * (1 + 0.01 * rng.standard_normal(clean.shape))     # 1% timing noise
    cm, info = cc.fit_cost_model(f["tokens"], f["ancestors"], f["rounds"], times, intercept=intercept)
    for k in ("per_token", "per_ancestor", "per_round"):
        assert getattr(cm, k) == pytest.approx(getattr(true, k), rel=0.1), k
    if intercept:
        assert info["intercept"] == pytest.approx(d, rel=0.2)
    assert info["r2"] > 0.99 and info["median_abs_rel_err"] < 0.02
    assert len(info["rel_err"]) == len(times)
    # Exact data: exact coefficients, for both weightings.
    for w in ("relative", "absolute"):
        cm, info = cc.fit_cost_model(f["tokens"], f["ancestors"], f["rounds"], clean, intercept=intercept, weighting=w)
        assert cm.per_token == pytest.approx(true.per_token, rel=1e-6)
        assert cm.per_ancestor == pytest.approx(true.per_ancestor, rel=1e-6)
        assert cm.per_round == pytest.approx(true.per_round, rel=1e-6)
        assert info["max_abs_rel_err"] < 1e-8


def test_fit_is_non_negative_and_checks_inputs():
    rng = np.random.default_rng(1)
    tok, anc, rnd = rng.integers(100, 1000, 20), rng.integers(1000, 10 ** 6, 20), rng.integers(1, 10, 20)
    times = 1e-6 * tok - 1e-4 * rnd + 1.0          # a negative true round term is clipped to 0
    cm, _ = cc.fit_cost_model(tok, anc, rnd, times)
    assert min(cm.per_token, cm.per_ancestor, cm.per_round) >= 0
    with pytest.raises(ValueError, match="at least 4 samples"):
        cc.fit_cost_model(tok[:3], anc[:3], rnd[:3], times[:3])


def test_cost_model_json_roundtrip(tmp_path):
    cm = CostModel(1.5, 2.5e-3, 7.0)
    cm.to_json(tmp_path / "c.json", units="seconds", note=[1, 2])
    assert CostModel.from_json(tmp_path / "c.json") == cm


def test_cpu_smoke(tmp_path):
    """--device cpu --tiny end to end on 2 cores within 60 s; the JSON loads and plans."""
    out = tmp_path / "cost.json"
    env = dict(os.environ, PYTHONWARNINGS="ignore")
    cmd = [sys.executable, SCRIPT, "--device", "cpu", "--tiny", "--reps", "2", "--out", str(out), "--watchdog", "120"]
    if hasattr(os, "sched_getaffinity") and len(os.sched_getaffinity(0)) > 2:
        cmd = ["taskset", "-c", ",".join(map(str, sorted(os.sched_getaffinity(0))[:2]))] + cmd
    t = time.perf_counter()
    res = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=180)
    wall = time.perf_counter() - t
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    assert wall < 120, f"CPU smoke took {wall:.1f} s"     # ~25 s alone; CI runs 2 loaded cores
    assert "R^2" in res.stdout and "per_round" in res.stdout
    cm = CostModel.from_json(out)
    d = json.loads(out.read_text())
    assert d["units"] == "seconds" and len(d["samples"]) >= 20 and all(s["time_s"] > 0 for s in d["samples"])
    assert min(cm.per_token, cm.per_ancestor, cm.per_round) >= 0 and cm.per_token + cm.per_ancestor > 0
    with open(str(out)[:-5] + ".samples.jsonl") as f:         # incremental output
        assert len(f.readlines()) == len(d["samples"])
    trees = [RolloutTree.from_trajectories([[1, 2, 3, 4], [1, 2, 5]]), RolloutTree.from_trajectories([[7, 8, 9]])]
    p = plan(trees, dp_size=2, microbatch_capacity=16, cost_model=cm)
    assert sorted(x.tree for r in p.ranks for mb in r for x in mb) == [0, 1]
    # --refit fits the saved samples again without a model
    res = subprocess.run([sys.executable, SCRIPT, "--refit", str(out)[:-5] + ".samples.jsonl", "--tiny",
                          "--out", str(tmp_path / "refit.json")], cwd=ROOT, env=env, capture_output=True, text=True,
                         timeout=120)
    assert res.returncode == 0, res.stderr[-3000:]
    assert CostModel.from_json(tmp_path / "refit.json") == cm


@pytest.mark.parametrize("text,msg", [
    (None, "--refit: [Errno 2] No such file or directory"),
    ('{"tokens": 1, "ancestors": 2, "rounds": 3, "time_s": 0.1}\n{"tokens": 1,\n', "s.jsonl:2: not valid JSON"),
    ('{"tokens": 1, "ancestors": "2", "rounds": 3}\n', "s.jsonl:1: field(s) ['ancestors', 'time_s'] missing"),
    ("\n", "s.jsonl: no samples"),
])
def test_refit_input_errors_name_the_line(tmp_path, text, msg):
    path = tmp_path / "s.jsonl"
    if text is not None:
        path.write_text(text)
    with pytest.raises(SystemExit) as e:
        cc.read_samples(str(path))
    assert msg in str(e.value.code), e.value.code


def test_refit_missing_file_exits_without_traceback(tmp_path):
    res = subprocess.run([sys.executable, SCRIPT, "--refit", str(tmp_path / "none.jsonl"), "--tiny", "--out",
                          str(tmp_path / "x.json")], cwd=ROOT, capture_output=True, text=True, timeout=120,
                         env=dict(os.environ, PYTHONPATH=ROOT))
    assert res.returncode == 1 and "--refit: [Errno 2]" in res.stderr and "Traceback" not in res.stderr, res.stderr
