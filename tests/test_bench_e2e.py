"""CPU smoke test of scripts/bench_e2e.py: the whole pipeline (workloads, planner, both layouts,
timing, numerics, JSON, plot) on tiny fp32 models through cpu_shim."""
import json
import os
import subprocess
import sys

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_bench_e2e_cpu_smoke(tmp_path):
    env = dict(os.environ, OMP_NUM_THREADS="2", TORCHDYNAMO_DISABLE="1")
    cmd = [sys.executable, "-W", "ignore", os.path.join(ROOT, "scripts", "bench_e2e.py"), "--device", "cpu", "--tiny",
           "--models", "dense,moe", "--workloads", "swe", "--recompute", "both", "--max-steps", "2",
           "--warmup-batches", "1", "--empty-cache", "both", "--out", str(tmp_path)]
    res = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stderr[-3000:]
    data = json.loads((tmp_path / "e2e.json").read_text())
    rows = data["rows"]
    assert {(r["model"], r["recompute"]) for r in rows} == {("dense", True), ("dense", False), ("moe", True), ("moe", False)}
    for r in rows:
        for side in ("baseline", "harts"):
            s = r[side]
            for k in ("fwd_ms", "bwd_ms", "grad_ms", "opt_ms", "step_ms", "tokens_per_s", "rounds", "microbatches",
                      "compact_tokens", "peak_gib"):
                assert k in s, (side, k)
            assert s["grad_ms"] > 0 and s["rounds"] >= s["microbatches"] >= 1
        assert r["harts"]["compact_tokens"] < r["baseline"]["compact_tokens"] == r["trajectory_tokens"]
        assert r["compression"] > 1 and r["speedup"] > 0 and "meets_target" in r
        # fp32 on CPU: tree-packed log-probs equal the trajectory-wise ones up to rounding
        assert r["lp_diff_harts"]["max"] < 1e-4 and r["lp_diff_rerun"]["max"] < 1e-4
        # every timed step is a new batch, the same one for both sides, and its time holds the host work
        assert r["fresh_batches"] and r["steps"] == 2
        assert r["precompiled_lengths"] >= 1 and r["precompile_s"] >= 0   # a new model per row here
        b, h = r["baseline"]["steps"], r["harts"]["steps"]
        assert [x["seed"] for x in b] == [x["seed"] for x in h] and len({x["seed"] for x in b}) == 2
        assert [x["traj_tokens"] for x in b] == [x["traj_tokens"] for x in h] == [x["compact_tokens"] for x in b]
        assert b[0]["traj_tokens"] != b[1]["traj_tokens"]          # different batches
        for x in b + h:
            assert x["wall_ms"] >= x["host_ms"] + x["grad_ms"] > 0 and x["plan_ms"] >= 0 and x["pack_ms"] > 0
            assert x["host_ms"] < x["issue_ms"] <= x["wall_ms"]     # the host issued after it packed, before the sync
            assert x["compiles"] == 0 and 0 <= x["gc_ms"] <= x["wall_ms"] and x["gc_full"] >= 0  # dynamo off here
            assert x["triton_compiles"] == len(x["triton_kernels"]) == 0   # warmed up (and interpreted on CPU)
            assert 0 < x["thread_cpu_ms"]
            assert all(n >= 1 and ":" in p for p, n in x["host_places"])  # sampled places (none if under 50 ms)
        for side in ("baseline", "harts"):
            w = r[side]["wall_ms"]
            assert w["min"] <= w["median"] <= w["max"]
        assert abs(r["speedup"] - r["baseline"]["wall_ms"]["median"] / r["harts"]["wall_ms"]["median"]) < 1e-9
        ratios = sorted(x["wall_ms"] / y["wall_ms"] for x, y in zip(b, h))
        assert r["speedup_per_step"]["min"] == ratios[0] and r["speedup_per_step"]["max"] == ratios[-1]
        assert abs(r["speedup_total"] - sum(x["wall_ms"] for x in b) / sum(y["wall_ms"] for y in h)) < 1e-9
        assert abs(r["compression"] - sum(x["traj_tokens"] for x in b) / sum(x["compact_tokens"] for x in h)) < 1e-9
        # --empty-cache both: the row keeps the allocator's cache (as Megatron does); the same batches again with
        # the cache emptied before every step are beside it
        assert data["meta"]["empty_cache"] == "both" and r["empty_cache"] is False
        e = r["empty_cache_step"]
        for side, main in (("baseline", b), ("harts", h)):
            assert [x["seed"] for x in e[side]["steps"]] == [x["seed"] for x in main]
            assert [x["compact_tokens"] for x in e[side]["steps"]] == [x["compact_tokens"] for x in main]
        assert abs(e["speedup"] - e["baseline"]["wall_ms"]["median"] / e["harts"]["wall_ms"]["median"]) < 1e-9
    # both classes of Triton's specialisation of the token count were warmed up, on both sides, per row
    assert res.stderr.count("warm-up of token counts = 0 / 1 mod 16") == len(rows)
    # the host sampler ran through the steps (every 50 ms): the longer steps name where the host was
    assert any(x["host_places"] for r in rows for side in ("baseline", "harts") for x in r[side]["steps"])
    plot = subprocess.run([sys.executable, os.path.join(ROOT, "scripts", "bench_e2e.py"), "--plot",
                           str(tmp_path / "e2e.json"), "--out", str(tmp_path)], capture_output=True, text=True)
    assert plot.returncode == 0, plot.stderr[-3000:]
    md = (tmp_path / "e2e.md").read_text()
    assert md.count("| dense |") == 2 and "New global batch every step" in md and "Same batch" not in md
    # each row names its JSON (several runs of one row kind sit in one table), columns aligned with the header
    head = next(line for line in md.splitlines() if line.startswith("| model |"))
    rows = [line for line in md.splitlines() if line.startswith("| dense |")]
    assert head.endswith(" json |") and all(r.endswith(" e2e.json |") and r.count("|") == head.count("|") for r in rows)
    assert "- e2e.json: `scripts/bench_e2e.py" in md
    assert (tmp_path / "e2e.png").stat().st_size > 0


def test_bench_e2e_records_an_out_of_memory_row_and_goes_on(tmp_path, monkeypatch):
    """A row that raises CUDA's OutOfMemoryError lands under ``failed`` (and in e2e.md); the next row runs."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("bench_e2e", os.path.join(ROOT, "scripts", "bench_e2e.py"))
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    real = bench.bench_row

    def bench_row(model, model_name, recompute, wl, *a, **k):
        if recompute:
            raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 80 GiB")
        return real(model, model_name, recompute, wl, *a, **k)

    monkeypatch.setattr(bench, "bench_row", bench_row)
    dynamo_disabled = torch._dynamo.config.disable          # main() turns dynamo off on CPU: restore it
    try:
        assert bench.main(["--device", "cpu", "--tiny", "--models", "dense", "--workloads", "tau", "--recompute",
                           "both", "--max-steps", "1", "--no-rerun", "--same-batch", "--out", str(tmp_path)]) == 0
    finally:
        torch._dynamo.config.disable = dynamo_disabled
    data = json.loads((tmp_path / "e2e.json").read_text())
    assert [r["recompute"] for r in data["rows"]] == [False]
    assert data["failed"] == [dict(model="dense", workload="tau", recompute=True, capacity=256,
                                   error="CUDA out of memory. Tried to allocate 80 GiB")]
    assert bench.main(["--plot", str(tmp_path / "e2e.json"), "--out", str(tmp_path)]) == 0
    md = (tmp_path / "e2e.md").read_text()
    assert "Not measured: dense tau recompute on (out of memory" in md and "Same batch every step" in md


def test_bench_e2e_measures_the_attention_kernel_share(tmp_path, monkeypatch):
    """With a FlashAttention-varlen baseline, each row also compares the baseline against itself on
    FlexAttention (the tree side's kernel). On CPU the baseline runs the torch reference, so the
    difference is fp32 rounding; the column reaches the JSON and the table."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("bench_e2e", os.path.join(ROOT, "scripts", "bench_e2e.py"))
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    from torch.nn.attention.flex_attention import flex_attention
    from megatron_harts.ops import attention
    monkeypatch.setattr(bench, "baseline_attention", lambda device: "varlen")

    def eager_flex(*args, **kwargs):          # main() turns dynamo off on CPU; eager FlexAttention needs it
        with torch._dynamo.config.patch(disable=False):
            return flex_attention(*args, **kwargs)
    monkeypatch.setattr(attention, "_flex", eager_flex)
    dynamo_disabled = torch._dynamo.config.disable
    try:
        assert bench.main(["--device", "cpu", "--tiny", "--models", "dense", "--workloads", "tau", "--recompute",
                           "off", "--max-steps", "1", "--warmup-batches", "0", "--out", str(tmp_path)]) == 0
    finally:
        torch._dynamo.config.disable = dynamo_disabled
    (row,) = json.loads((tmp_path / "e2e.json").read_text())["rows"]
    assert row["lp_diff_baseline_flex"]["max"] < 1e-4 and row["lp_diff_baseline_flex"]["mean"] >= 0
    assert bench.main(["--plot", str(tmp_path / "e2e.json"), "--out", str(tmp_path)]) == 0
    md = (tmp_path / "e2e.md").read_text()
    head = next(line for line in md.splitlines() if line.startswith("| model |")).split("|")
    row_line = next(line for line in md.splitlines() if line.startswith("| dense |")).split("|")
    assert row_line[head.index(" lp diff flex-b max ")].strip() not in ("", "-")


def test_stall_counts_see_a_compile_and_a_full_collection():
    """What a timed step's stall counters record: a graph that torch.compile compiles, a full garbage
    collection (time and count), and CPU time spent by this thread (not by sleeping)."""
    import gc
    import time
    sys.path.insert(0, ROOT)
    from scripts.bench_e2e import stall_counts
    s0 = stall_counts()
    torch.compile(lambda x: x * 3 + 1, backend="eager")(torch.ones(3))
    gc.collect()
    s1 = stall_counts()
    assert s1["compiles"] - s0["compiles"] == 1
    assert s1["gc_full"] - s0["gc_full"] == 1 and s1["gc_ms"] > s0["gc_ms"]
    assert s1["thread_cpu_ms"] > s0["thread_cpu_ms"]            # compiling took this thread's CPU
    time.sleep(0.3)                                               # a blocked host: wall time, no CPU time
    assert stall_counts()["thread_cpu_ms"] - s1["thread_cpu_ms"] < 100


def test_sync_sites_groups_syncs_by_the_calling_frame_outside_torch():
    """The aggregation of --sync-audit (CUDA raises the warnings on the GPU; here they are raised directly):
    only synchronisation warnings count, each at the frame that asked for it."""
    import warnings
    sys.path.insert(0, ROOT)
    from scripts.bench_e2e import sync_sites

    def layer():
        warnings.warn("called a synchronizing CUDA operation")       # line A

    def step():
        for _ in range(3):
            layer()
        warnings.warn("some other warning")
        warnings.warn("called a synchronizing CUDA operation")       # line B

    out = sync_sites(step, cuda=False)
    assert out["count"] == 4
    (a, na), (b, nb) = out["sites"].items()
    assert (na, nb) == (3, 1)
    assert a.startswith("tests/test_bench_e2e.py:") and a.endswith(" layer") and b.endswith(" step")
    src = open(os.path.join(ROOT, "tests", "test_bench_e2e.py")).read().splitlines()
    assert "line A" in src[int(a.split(":")[1].split()[0]) - 1] and "line B" in src[int(b.split(":")[1].split()[0]) - 1]
    with warnings.catch_warnings(record=True) as caught:     # the caller's warning filters are restored
        warnings.simplefilter("always")
        warnings.warn("after")
    assert len(caught) == 1


def test_sync_audit_needs_cuda(tmp_path):
    res = subprocess.run([sys.executable, os.path.join(ROOT, "scripts", "bench_e2e.py"), "--device", "cpu", "--tiny",
                          "--sync-audit", "--out", str(tmp_path)], capture_output=True, text=True, timeout=300)
    assert res.returncode == 2 and "--sync-audit needs --device cuda" in res.stderr.strip().splitlines()[-1]


def test_a_failing_sync_audit_keeps_the_timed_row(tmp_path, monkeypatch):
    """--sync-audit runs after the timed steps; if it raises (first run on a GPU on 2026-12-06),
    the row is still written, with the error in place of the audit, and the other side's audit kept."""
    import argparse
    import importlib.util

    spec = importlib.util.spec_from_file_location("bench_e2e", os.path.join(ROOT, "scripts", "bench_e2e.py"))
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    error = argparse.ArgumentParser.error      # CPU reports no syncs: let the CUDA-only flag through here

    def allow_sync_audit(self, message):
        if "--sync-audit" not in message:
            error(self, message)
    monkeypatch.setattr(argparse.ArgumentParser, "error", allow_sync_audit)
    calls = []

    def sync_sites(fn, cuda=True):
        calls.append(len(calls))
        fn()
        if len(calls) == 2:
            raise RuntimeError("set_sync_debug_mode failed\nsecond line")
        return {"count": 1, "sites": {"bench_e2e.py:1 sync": 1}}
    monkeypatch.setattr(bench, "sync_sites", sync_sites)
    dynamo_disabled = torch._dynamo.config.disable
    try:
        assert bench.main(["--device", "cpu", "--tiny", "--models", "dense", "--workloads", "tau", "--recompute",
                           "off", "--max-steps", "1", "--warmup-batches", "0", "--no-rerun", "--sync-audit",
                           "--out", str(tmp_path)]) == 0
    finally:
        torch._dynamo.config.disable = dynamo_disabled
    (row,) = json.loads((tmp_path / "e2e.json").read_text())["rows"]
    assert calls == [0, 1] and row["speedup"] > 0
    assert row["baseline"]["sync_audit"]["count"] == 1 and "sync_audit_error" not in row["baseline"]
    assert row["harts"]["sync_audit_error"] == "RuntimeError: set_sync_debug_mode failed" and "sync_audit" not in row["harts"]


def test_blocked_side_order_times_each_side_alone_after_a_rewarm_step(tmp_path, monkeypatch):
    """--side-order blocked: all baseline steps, then all HARTS steps, each side after an emptied
    cache and one untimed step on the last warm-up batch (as two separate jobs would run); the
    default interleaves the sides step by step."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("bench_e2e", os.path.join(ROOT, "scripts", "bench_e2e.py"))
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    calls = []
    real = bench.microbatches

    def microbatches(trajs, side, a, *rest, **kw):
        calls.append((side, a.seed))
        return real(trajs, side, a, *rest, **kw)
    monkeypatch.setattr(bench, "microbatches", microbatches)
    dynamo_disabled = torch._dynamo.config.disable
    rows = {}
    try:
        for order in ("blocked", "alternate"):
            calls.clear()
            out = tmp_path / order
            assert bench.main(["--device", "cpu", "--tiny", "--models", "dense", "--workloads", "tau", "--recompute",
                               "off", "--max-steps", "2", "--warmup-batches", "1", "--no-rerun", "--side-order", order,
                               "--out", str(out)]) == 0
            (rows[order],) = json.loads((out / "e2e.json").read_text())["rows"]
            rows[order]["calls"] = list(calls)
    finally:
        torch._dynamo.config.disable = dynamo_disabled
    warm = 1 + 10_000
    blocked = [("baseline", warm), ("baseline", 1), ("baseline", 2), ("harts", warm), ("harts", 1), ("harts", 2)]
    alternate = [("baseline", 1), ("harts", 1), ("harts", 2), ("baseline", 2)]

    def contains(seq, sub):
        return any(seq[i:i + len(sub)] == sub for i in range(len(seq)))
    assert contains(rows["blocked"]["calls"], blocked) and not contains(rows["blocked"]["calls"], alternate)
    assert contains(rows["alternate"]["calls"], alternate) and not contains(rows["alternate"]["calls"], blocked)
    for order, r in rows.items():
        assert r["side_order"] == order
        assert [x["seed"] for x in r["baseline"]["steps"]] == [x["seed"] for x in r["harts"]["steps"]] == [1, 2]


def test_gpu_sampler_parses_nvidia_smi_lines():
    """The CSV records of ``nvidia-smi --query-gpu=clocks.sm,temperature.gpu,power.draw,<reasons>
    --format=csv,noheader,nounits``: numbers, a hex reason mask, [N/A] fields, drivers without the reasons."""
    sys.path.insert(0, ROOT)
    from scripts.bench_e2e import GpuSampler
    assert GpuSampler.parse("1980, 45, 312.51, 0x0000000000000004\n") == (1980.0, 45.0, 312.51, 4)
    assert GpuSampler.parse("1755, 61, [N/A], 0x0000000000000000") == (1755.0, 61.0, None, 0)
    assert GpuSampler.parse("1980, 45, 300.0") == (1980.0, 45.0, 300.0, None)
    assert GpuSampler.parse("Field \"clocks_throttle_reasons.active\" is not a valid field to query.") is None
    assert GpuSampler.parse("[N/A], [N/A], [N/A], [N/A]") is None
    assert GpuSampler.parse("") is None


def test_gpu_sampler_reads_a_child_process_and_summarises_a_step_window():
    """A stand-in for nvidia-smi (named as such: the real one needs a GPU) prints four records; the
    sampler stamps them as they arrive, and a step's window reports the lowest clock and the clock
    events seen in it (idle left out), while samples outside the window do not count."""
    import time
    sys.path.insert(0, ROOT)
    from scripts.bench_e2e import GpuSampler, _step_note
    lines = ["1980, 40, 300.0, 0x0000000000000001", "1410, 70, 700.0, 0x0000000000000004",
             "garbage line", "1980, 44, 310.0, 0x0000000000000000", "1600, 80, 650.0, 0x0000000000000048"]
    script = "import sys, time\n" + "".join(f"print({l!r}, flush=True); time.sleep(0.05)\n" for l in lines)
    t0 = time.perf_counter()
    s = GpuSampler(cmd=[sys.executable, "-c", script])
    s._thread.join(timeout=30)                   # the stand-in exits after its lines
    s.close()
    t1 = time.perf_counter()
    assert [x[1:] for x in s.samples] == [(1980.0, 40.0, 300.0, 1), (1410.0, 70.0, 700.0, 4),
                                          (1980.0, 44.0, 310.0, 0), (1600.0, 80.0, 650.0, 0x48)]
    assert all(t0 <= x[0] <= t1 for x in s.samples) and [x[0] for x in s.samples] == sorted(x[0] for x in s.samples)
    w = s.window(t0, t1)
    assert w == dict(gpu_samples=4, sm_mhz_min=1410.0, sm_mhz_max=1980.0, temp_c_max=80.0, power_w_max=700.0,
                     clock_events=["sw_power_cap", "hw_slowdown", "hw_thermal"])
    first = s.samples[0][0]
    assert s.window(t0, first) == dict(gpu_samples=1, sm_mhz_min=1980.0, sm_mhz_max=1980.0, temp_c_max=40.0,
                                       power_w_max=300.0, clock_events=[])     # idle alone is no event
    assert s.window(t1 + 1, t1 + 2) == dict(gpu_samples=0, clock_events=[])
    note = _step_note(dict(wall_ms=1179.0, host_ms=7.0, **w))
    assert note == "1179 ms (host 7; GPU clocks 1410-1980 MHz, sw_power_cap+hw_slowdown+hw_thermal)"
    assert _step_note(dict(wall_ms=370.0, host_ms=7.0, **s.window(t0, first))) == "370 ms (host 7)"


def test_gpu_sampler_is_off_without_a_gpu():
    sys.path.insert(0, ROOT)
    from scripts.bench_e2e import start_gpu_sampler
    assert start_gpu_sampler(torch.device("cpu")) is None


def _wait_in_a_known_place(seconds: float) -> None:
    import time
    time.sleep(seconds)


def test_host_stack_sampler_names_where_the_thread_waited():
    """A step that sits in one place (here a sleep in a known function, as a blocked launch would sit in
    its call) is named by the window's top place, with the innermost frame first; samples outside the
    window do not count; slow_step_places reports only steps over 1.5x their side's median."""
    import time
    sys.path.insert(0, ROOT)
    from scripts.bench_e2e import HostStackSampler, slow_step_places
    s = HostStackSampler(period_s=0.01)
    try:
        time.sleep(0.05)
        t0 = time.perf_counter()
        _wait_in_a_known_place(0.6)
        t1 = time.perf_counter()
    finally:
        s.close()
    top = s.window(t0, t1)
    assert top and top[0][1] >= 5, top           # ~60 periods; CI's two loaded cores may starve a few
    place, n = top[0]
    assert place.endswith("_wait_in_a_known_place") and "test_bench_e2e.py:" in place, place
    assert sum(c for _, c in top) <= len(s.samples)
    assert s.window(t1 + 10, t1 + 20) == []
    steps = [dict(wall_ms=w, host_places=[[place, n]]) for w in (1190.0, 2036.0, 1205.0, 1244.0, 1206.0)]
    assert slow_step_places(steps) == [f"step 2: 2036 ms vs median 1206: {place} x{n}"]
    assert slow_step_places([dict(wall_ms=1000.0), dict(wall_ms=3000.0), dict(wall_ms=1000.0)]) == []  # no places


def test_host_stack_sampler_names_the_innermost_own_frame_under_library_frames():
    """Inside a library call the place names the library line and, after '<', the innermost frame of
    this project's, Megatron's or the bench's code below it (frames as stand-in objects with the
    attributes the sampler reads: a real stack's shape, fixed names)."""
    from types import SimpleNamespace as NS
    sys.path.insert(0, ROOT)
    from scripts.bench_e2e import HostStackSampler

    def frame(path, line, func, back=None):
        return NS(f_code=NS(co_filename=path, co_name=func), f_lineno=line, f_back=back)
    sp = "/opt/venv/lib/python3.12/site-packages/"
    bench = frame("scripts/bench_e2e.py", 300, "train_step")
    ours = frame("megatron_harts/ops/tree_gdn.py", 210, "forward", bench)
    module = frame(sp + "torch/nn/modules/module.py", 1750, "_call_impl", ours)
    sync = frame(sp + "torch/cuda/__init__.py", 1040, "synchronize", module)
    assert HostStackSampler.place(sync) == \
        "torch/cuda/__init__.py:1040 synchronize < megatron_harts/ops/tree_gdn.py:210 forward"
    mcore = frame("/tmp/harts_site/megatron/core/ssm/gated_delta_net/common.py", 432, "_compute_g_and_beta", ours)
    assert HostStackSampler.place(frame(sp + "torch/_ops.py", 1123, "__call__", mcore)) == \
        "torch/_ops.py:1123 __call__ < megatron/core/ssm/gated_delta_net/common.py:432 _compute_g_and_beta"
    assert HostStackSampler.place(ours) == "megatron_harts/ops/tree_gdn.py:210 forward"     # own and innermost
    assert HostStackSampler.place(frame(sp + "torch/_ops.py", 1, "f")) == "torch/_ops.py:1 f"  # no own frame


def test_specialisation_packs_put_the_token_count_in_each_class_with_a_weightless_dummy():
    """Triton compiles a kernel once per divisibility class (by 16) of each integer argument; the
    warm-up packs of each side are its first microbatch with a dummy chain that puts the pack's
    token count at 0 and at 1 mod 16; the real trajectories and their weights are unchanged."""
    import argparse

    import numpy as np

    from scripts.bench_e2e import SPECIALISE_MOD, cost_model_for, microbatches, specialisation_packs, workload

    a = argparse.Namespace(tiny=True, seed=3, capacity=4096, chunk_size=16, pad_multiple=0, vocab=64, tiny_groups=2)
    trajs = workload("tau", a)
    cm = cost_model_for("dense", a)
    for side in ("baseline", "harts"):
        first = microbatches(trajs, side, a, cm, torch.device("cpu"))[0]
        packs = specialisation_packs(trajs, side, a, cm, torch.device("cpu"))
        assert [mb["pack"].num_tokens % SPECIALISE_MOD for mb in packs] == [0, 1]
        for mb in packs:
            real = [i for i in mb["ids"] if i != "__pad__"]
            assert real == [i for i in first["ids"] if i != "__pad__"]
            assert mb["pack"].num_tokens - mb["pad"] == first["pack"].num_tokens - first["pad"]
            assert 0 <= mb["pad"] < SPECIALISE_MOD and mb["traj_tokens"] == first["traj_tokens"]
            weights = dict(zip(mb["ids"], mb["weights"]))
            for i, w in zip(first["ids"], first["weights"]):
                if i != "__pad__":
                    assert torch.equal(weights[i], w)
            if mb["pad"]:
                assert not weights["__pad__"].any()        # the dummy adds no loss
        assert np.unique([mb["pack"].num_tokens for mb in packs]).size == 2


def test_triton_compile_counter_chains_the_hook_and_names_kernels_per_step():
    """Triton calls ``knobs.runtime.jit_post_compile_hook`` after each JIT compilation through
    ``JITFunction._call_hook``. No kernel compiles on this CPU machine (fla's kernels run in
    Triton's interpreter), so Triton's own ``_call_hook`` of a ``@triton.jit`` function is called
    here with stand-in options and target: the counter takes Triton's arguments, keeps a hook
    already set, installs once, and a step's note names the kernels compiled in it."""
    import importlib.util
    from types import SimpleNamespace

    from triton import knobs
    from triton.runtime.jit import JitFunctionInfo

    spec = importlib.util.spec_from_file_location("bench_e2e_tc", os.path.join(ROOT, "scripts", "bench_e2e.py"))
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    saved = knobs.runtime.jit_post_compile_hook
    seen = []
    try:
        knobs.runtime.jit_post_compile_hook = lambda **kw: seen.append(kw["fn"].name)
        assert bench.count_triton_compiles() and bench.count_triton_compiles()     # the second is a no-op
        hook = knobs.runtime.jit_post_compile_hook
        before = bench.stall_counts()["triton_compiles"]
        opts = SimpleNamespace(num_warps=4, num_ctas=1, num_stages=3, enable_fp_fusion=True,
                               launch_cooperative_grid=False, extern_libs=None)
        target = SimpleNamespace(backend="cuda", arch=90, warp_size=32)
        for kernel in (_conv_stand_in, _chunk_stand_in, _conv_stand_in):   # as Triton calls it after a compile
            kernel._call_hook(hook, ("sig", ("*fp32", "i32")), {"x": "*fp32", "n": "i32"}, target, 0, {}, opts,
                              [{}], False)
        hook(key="k", repr="r", fn=JitFunctionInfo(None, "l2norm_fwd_kernel", None), compile={},
             is_manual_warmup=False, already_compiled=False)
        assert bench.stall_counts()["triton_compiles"] - before == 4
        names = ["_conv_stand_in", "_chunk_stand_in", "_conv_stand_in", "l2norm_fwd_kernel"]
        assert seen == names                                                  # chained, once
        kernels = sorted(set(bench.TRITON_COMPILED[before:]))
        note = bench._step_note(dict(wall_ms=2740.0, host_ms=12.0, triton_compiles=4, triton_kernels=kernels))
        assert note == "2740 ms (host 12; 4 triton_compiles (_chunk_stand_in, _conv_stand_in, l2norm_fwd_kernel))"
    finally:
        knobs.runtime.jit_post_compile_hook = saved


def _conv_stand_in_fn(x, n):
    pass


def _chunk_stand_in_fn(x, n):
    pass


def _stand_in_kernels():
    """Triton's compiled-kernel ``JITFunction``s (``triton.jit`` gives interpreted ones in this test
    process: ``TRITON_INTERPRET=1``), named as the hook sees them."""
    from triton.runtime.jit import JITFunction

    out = []
    for fn, name in ((_conv_stand_in_fn, "_conv_stand_in"), (_chunk_stand_in_fn, "_chunk_stand_in")):
        fn.__name__ = fn.__qualname__ = name
        out.append(JITFunction(fn))
    return out


_conv_stand_in, _chunk_stand_in = _stand_in_kernels()
