"""scripts/gpu_plan.sh + gpu_run.sh on CPU, through a step that needs no GPU (``verify --help``): the
plan's archives come back the way the device returns files (results.tgz with the step's log; the
inductor cache restored from configs/inductor/<GPU>.tgz before the step, packed beside results.tgz
after it, not inside it)."""
import os
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

pytestmark = pytest.mark.timeout(300)


def _names(tgz):
    with tarfile.open(tgz) as t:
        return {n.lstrip("./") for n in t.getnames()}


def test_plan_packs_results_and_the_inductor_cache_beside_them(tmp_path):
    if shutil.which("bash") is None:
        pytest.fail("bash is needed")
    repo = tmp_path / "repo"          # a copy of the scripts (configs/inductor/TEST.tgz is written in it)
    shutil.copytree(ROOT / "scripts", repo / "scripts")
    (repo / "configs" / "inductor").mkdir(parents=True)
    seed = tmp_path / "seed"
    (seed / "fxgraph").mkdir(parents=True)
    (seed / "fxgraph" / "entry_from_configs").write_text("x")
    with tarfile.open(repo / "configs" / "inductor" / "TEST.tgz", "w:gz") as t:
        t.add(seed, arcname=".")
    cache, out = tmp_path / "inductor", tmp_path / "out"
    cache.mkdir()
    (cache / "made_on_the_machine").write_text("y")
    env = dict(os.environ, HARTS_GPU="TEST", OUT=str(out), TORCHINDUCTOR_CACHE_DIR=str(cache),
               TRITON_CACHE_DIR=str(tmp_path / "triton"), PYTHONPATH=str(ROOT),
               PATH=f"{Path(sys.executable).parent}:{os.environ['PATH']}")
    r = subprocess.run(["bash", "scripts/gpu_plan.sh", "verify:120:--help"], cwd=repo, env=env,
                       capture_output=True, text=True, timeout=240)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "verify rc=0" in (out / "plan.log").read_text()
    assert sorted(p.name for p in out.iterdir()) == ["inductor_cache.tgz", "plan.log", "results.tgz"]
    results = _names(out / "results.tgz")
    assert "verify/verify.log" in results and not any("inductor_cache" in n for n in results), results
    assert {"fxgraph/entry_from_configs", "made_on_the_machine"} <= _names(out / "inductor_cache.tgz")


def test_tracked_tree_leaves_room_for_a_triton_part():
    """A device call carries the working tree plus its carry paths, at most 64 MiB; the Triton install
    calls carry 50 MiB parts (.tw1-.tw3, shared/device/prepare_wheels.sh). A tracked tree over ~12 MiB
    (e.g. a committed inductor archive: 13 MiB on 2026-12-06) makes every such call refused."""
    if not (ROOT / ".git").exists():
        pytest.skip("not a git checkout: the tracked tree is unknown")
    names = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True).stdout.split(b"\0")
    sizes = {n.decode(): (ROOT / n.decode()).stat().st_size for n in names if n and (ROOT / n.decode()).is_file()}
    total = sum(sizes.values())
    biggest = sorted(sizes.items(), key=lambda kv: -kv[1])[:3]
    assert total <= 64 * 2**20 - 50 * 2**20 - 2 * 2**20, f"tracked files take {total / 2**20:.1f} MiB; largest: {biggest}"
