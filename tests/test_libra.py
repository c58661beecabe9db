"""Libra: cost-model fits, the length estimator, the planner, C-MLFQ's rules and the simulator on
cases with closed-form answers."""
import math
from dataclasses import replace

import numpy as np
import pytest

from megatron_harts.rollout.libra import cmlfq, costs, planner, sim, workload
from megatron_harts.rollout.libra.cmlfq import SIGNAL_ERROR, SIGNAL_NONE, SIGNAL_SUCCESS, Request
from megatron_harts.rollout.libra.workload import Program

# -- cost models ------------------------------------------------------------------------------


def test_rollout_fit_passes_through_the_measured_points():
    rc = costs.fit_rollout_cost(kv_bytes_per_token=0)          # c = 0: the fitted terms alone
    for b, ctx, tps in costs.SGLANG_DECODE_POINTS:
        assert rc.tokens_per_s(b, ctx) == pytest.approx(tps, rel=1e-9)
    full = costs.fit_rollout_cost()
    assert full.c_s == pytest.approx(costs.KV_BYTES_PER_TOKEN_1P5B / costs.HBM_BYTES_PER_S)
    # context costs throughput: 32K contexts at batch 64 are slower than 2K ones
    assert full.tokens_per_s(64, 32768) < full.tokens_per_s(64, 2128)
    assert 100e3 < full.prefill_tok_s < 150e3                     # e2e_dense_sweep.json forward rates


def test_train_fit_reproduces_the_e2e_rows():
    tc = costs.fit_train_cost()
    pts = costs.train_points()
    assert len(pts) == 7
    for mean_len, rate, _ in pts:
        assert tc.rate(mean_len) == pytest.approx(rate, rel=0.07)
    assert tc.rate(25000) < tc.rate(4000)                       # longer trajectories: slower per token
    one = tc.step_s(1e6, 5000, 1)
    eight = tc.step_s(1e6, 5000, 8)
    assert one / eight == pytest.approx(8, rel=0.05)            # data parallel + all-reduce + optimizer
    assert tc.step_s(1e6, 5000, 0) == math.inf


def test_sync_and_start_costs_from_rollout_json():
    sc = costs.fit_sync_cost()
    assert sc.seconds() == pytest.approx(0.39, abs=0.02)        # median export 0.30 + push 0.09 (rollout.md, H200 2026-12-02)
    assert costs.measured_engine_start_s() == pytest.approx(173.3, abs=0.1)


@pytest.mark.parametrize("batch,ctx", [(1, 0.0), (7, 1e4), (256, 3e6)])
def test_steps_within_inverts_steps_time(batch, ctx):
    rc = costs.fit_rollout_cost()
    for n in (0, 1, 2, 17, 1000):
        t = float(rc.steps_time(n, batch, ctx))
        assert rc.steps_within(t, batch, ctx) == n
        if n:
            assert rc.steps_within(t * (1 - 1e-6), batch, ctx) == n - 1
    # exact sum of per-iteration times (contexts grow by `batch` every iteration)
    n = 50
    assert float(rc.steps_time(n, batch, ctx)) == pytest.approx(sum(rc.step_s(batch, ctx + batch * i) for i in range(n)))


def test_length_estimator_weights_recent_steps_and_detects_drift():
    est = costs.LengthEstimator(decay=0.5, window=4, drift_tol=0.2)
    rng = np.random.default_rng(0)
    x = rng.lognormal(5, 1, 501)
    assert est.update(x) is False
    # one step alone: the weighted quantile is the inverted-CDF quantile
    for q in (0.1, 0.5, 0.9, 0.99):
        assert est.quantile(q) == np.quantile(x, q, method="inverted_cdf")
    assert est.update(x * 1.05) is False
    assert est.update(x * 3) is True                              # the median tripled
    # after the jump the estimate sits between old and new, nearer the new (weights 1/4, 1/2, 1 -> 4/7)
    med = est.quantile(0.5)
    assert np.median(x) * 1.05 < med <= np.median(x) * 3
    for _ in range(4):
        est.update(x * 3)
    assert est.quantile(0.5) == pytest.approx(np.median(x * 3), rel=0.01)   # window dropped the old steps
    with pytest.raises(ValueError, match="decay"):
        costs.LengthEstimator(decay=0)
    # exact weights: steps of constant 1, 2, 10 at decay 0.5 weigh 1/7, 2/7, 4/7
    e = costs.LengthEstimator(decay=0.5, window=3)
    for v in (1.0, 2.0, 10.0):
        e.update(np.full(3 + int(v), v))
    assert [e.quantile(q) for q in (0.1, 0.2, 0.42, 0.5)] == [1.0, 2.0, 2.0, 10.0]
    assert e.mean() == pytest.approx(45 / 7)


# -- queue policies ---------------------------------------------------------------------------

def _req(program, turn=0, attained=0, signal=SIGNAL_NONE, obs=0, ctx=1000, arrival=0.0, pred=0.0):
    return Request(program=program, turn=turn, ctx=ctx, attained=attained, signal=signal, obs_tokens=obs,
                   arrival=arrival, predicted_remaining=pred)


def _drain(policy, bucket=0, now=0.0):
    out = []
    while len(policy):
        out.append(policy.pop(bucket, now).program)
    return out


def test_fcfs_and_spf_orders():
    f = cmlfq.FCFS()
    for i, t in enumerate([3.0, 1.0, 2.0]):
        f.push(_req(i, arrival=t), t)
    assert _drain(f) == [1, 2, 0]
    s = cmlfq.SPF()
    for i, p in enumerate([500, 10, 90]):
        s.push(_req(i, pred=p), 0.0)
    assert _drain(s) == [1, 2, 0]


def test_plas_levels_by_attained_service():
    p = cmlfq.PLAS(base=100, ratio=2, levels=4)
    assert [p.level(_req(0, attained=a)) for a in (0, 99, 100, 199, 200, 399, 400, 10 ** 6)] == [0, 0, 1, 1, 2, 2, 3, 3]
    for i, a in enumerate([1000, 10, 150, 10]):
        p.push(_req(i, attained=a, arrival=float(i)), float(i))
    assert _drain(p) == [1, 3, 2, 0]                 # level, then FCFS within the level


def test_cmlfq_promotion_demotion_routing_and_aging():
    c = cmlfq.CMLFQ(base=100, ratio=2, levels=6, success_boost=2, error_penalty=1, turn_demote=5, age_s=10.0,
                    long_ctx=8000, long_obs=1000)
    plain = c.level(_req(0, attained=450))                     # PLAS level 3
    assert plain == 3
    assert c.level(_req(0, attained=450, signal=SIGNAL_SUCCESS)) == 1
    assert c.level(_req(0, attained=450, signal=SIGNAL_ERROR)) == 4
    assert c.level(_req(0, attained=450, turn=5)) == 4
    assert c.level(_req(0, attained=0, signal=SIGNAL_SUCCESS)) == 0            # clamped
    assert c.level(_req(0, attained=10 ** 9, signal=SIGNAL_ERROR, turn=9)) == 5
    assert c.route(_req(0, ctx=100)) == 0
    assert c.route(_req(0, ctx=8000)) == 1
    assert c.route(_req(0, ctx=100, obs=1000)) == 1
    # a success jumps the queue ahead of an older request of the same attained service
    c.push(_req(1, attained=450, arrival=0.0), 0.0)
    c.push(_req(2, attained=450, signal=SIGNAL_SUCCESS, arrival=1.0), 1.0)
    assert c.pop(0, 2.0).program == 2
    # aging: a demoted request that waited age_s goes first
    c.push(_req(3, attained=0, arrival=5.0), 5.0)
    assert c.pop(0, 10.5).program == 1                          # waited 10.5 s >= 10
    assert c.pop(0, 10.5).program == 3
    assert len(c) == 0 and c.pop(0, 11.0) is None
    # buckets: a long-context engine serves its own bucket first and steals when it is empty
    c.push(_req(4, ctx=100), 0.0)
    c.push(_req(5, ctx=9000), 0.0)
    assert c.pop(1, 0.0).program == 5
    assert c.pop(1, 0.0).program == 4
    assert c.pop(1, 0.0) is None


def test_make_policy_rejects_unknown_names():
    with pytest.raises(ValueError, match="queue policy"):
        cmlfq.make_policy("lifo")


# -- simulator on closed-form cases ------------------------------------------------------------

def _rc(**kw):
    base = dict(a_s=0.003, b_s=0.0001, c_s=1e-8, prefill_tok_s=1e5, max_batch=64, kv_tokens=10 ** 9)
    base.update(kw)
    return costs.RolloutCost(**base)


def _prog(gen, prompt=100, obs=(), tool=(), signal=(), group=0):
    gen = np.array(gen, np.int64)
    pad = len(gen) - len(obs)
    return Program(group, prompt, gen, np.array(list(obs) + [0] * pad, np.int64),
                   np.array(list(tool) + [0.0] * pad), np.array(list(signal) + [0] * pad, np.int8))


def _decode(rc, n, batch, ctx):
    return sum(rc.step_s(batch, ctx + batch * i) for i in range(n))


def test_one_engine_one_program():
    rc = _rc()
    pool = sim.EnginePool([(rc, 0)], cmlfq.FCFS())
    pool.add_programs([_prog([40], prompt=300)], 0.0)
    pool.run()
    assert pool.done_at[0] == pytest.approx(300 / rc.prefill_tok_s + _decode(rc, 40, 1, 300), rel=1e-12)


def test_fcfs_batch_of_one_runs_in_arrival_order():
    rc = _rc(max_batch=1)
    gens, prompt = [30, 5, 80, 12], 50
    pool = sim.EnginePool([(rc, 0)], cmlfq.FCFS())
    pool.add_programs([_prog([g], prompt=prompt) for g in gens], 0.0)
    pool.run()
    each = [prompt / rc.prefill_tok_s + _decode(rc, g, 1, prompt) for g in gens]
    np.testing.assert_allclose(pool.done_at, np.cumsum(each), rtol=1e-12)
    # SPF with an exact predictor (pred_sigma 0): program 0 reaches the idle engine first and keeps
    # it (non-preemptive); the others then run shortest first
    pool = sim.EnginePool([(rc, 0)], cmlfq.SPF(), pred_sigma=0.0)
    pool.add_programs([_prog([g], prompt=prompt) for g in gens], 0.0)
    pool.run()
    order = [0, 1, 3, 2]
    np.testing.assert_allclose(np.array(pool.done_at)[order], np.cumsum(np.array(each)[order]), rtol=1e-12)


def test_concurrent_requests_share_decode_iterations():
    rc = _rc()
    pool = sim.EnginePool([(rc, 0)], cmlfq.FCFS())
    pool.add_programs([_prog([20], prompt=100), _prog([50], prompt=100)], 0.0)
    pool.run()
    pre = 200 / rc.prefill_tok_s
    t1 = pre + _decode(rc, 20, 2, 200)
    t2 = t1 + _decode(rc, 30, 1, 120)
    assert pool.done_at == pytest.approx([t1, t2], rel=1e-12)


def test_multi_turn_program_with_tool_and_prefix_cache():
    rc = _rc()
    p = _prog([10, 7], prompt=100, obs=[25], tool=[1.5], signal=[SIGNAL_SUCCESS])
    pool = sim.EnginePool([(rc, 0)], cmlfq.FCFS())
    pool.add_programs([p], 0.0)
    pool.run()
    t = 100 / rc.prefill_tok_s + _decode(rc, 10, 1, 100)     # turn 0
    t += 1.5 + 25 / rc.prefill_tok_s                         # tool, then only the observation is prefilled
    t += _decode(rc, 7, 1, 135)
    assert pool.done_at[0] == pytest.approx(t, rel=1e-12)
    assert pool.prefill_tokens == 125 and pool.cache_misses == 0


def test_two_engines_split_programs_and_drain():
    rc = _rc()
    pool = sim.EnginePool([(rc, 0), (rc, 0)], cmlfq.FCFS())
    pool.add_programs([_prog([30]), _prog([30])], 0.0)
    left = []
    pool.on_engine_left = lambda eid, t: left.append((eid, t))
    pool.run()
    one = 100 / rc.prefill_tok_s + _decode(rc, 30, 1, 100)
    assert pool.done_at == pytest.approx([one, one], rel=1e-12)     # least-loaded routing: one each
    pool.drain(1, pool.now)
    assert left == [(1, pool.now)] and len(pool.active_engines) == 1


def test_fluid_finish_closed_forms():
    # 10 GPU-s released at 0 on 2 GPUs from 0: 5 s
    assert sim.fluid_finish([(0.0, 10.0)], [(0.0, 2)]) == pytest.approx(5.0)
    # GPUs arrive later: 1 GPU from t=1, 3 GPUs from t=2: 1 s of work done by t=2, 9 left / 3
    assert sim.fluid_finish([(0.0, 10.0)], [(1.0, 1), (2.0, 3)]) == pytest.approx(5.0)
    # 2 GPUs for 1 s, then 4: 8 left at t=1, done at 3
    assert sim.fluid_finish([(0.0, 10.0)], [(0.0, 2), (1.0, 4)]) == pytest.approx(3.0)
    # work released later than the GPUs: idle until then
    assert sim.fluid_finish([(0.0, 2.0), (10.0, 4.0)], [(0.0, 2)]) == pytest.approx(12.0)
    with pytest.raises(ValueError, match="no GPU"):
        sim.fluid_finish([(0.0, 1.0)], [(0.0, 0)])


# -- planner and the step drivers --------------------------------------------------------------

def _small():
    w = workload.WorkloadConfig(groups=6, group_size=4, steps=3, max_turns=8, gen_median=200)
    cfg = sim.SimConfig(gpus=4, steps=3, sync_s=1.0, switch_s=2.0)
    return w, cfg, costs.fit_rollout_cost(), costs.fit_train_cost()


def test_planner_prefers_balanced_async_split_and_respects_switch_cost():
    w, cfg, rc, tc = _small()
    progs = workload.step_batch(w, 0)
    est = planner.ProgramEstimator()
    est.update(progs)
    pl = planner.Planner(rc, tc, 8, sync_s=1.0, switch_s=2.0)
    plan = pl.plan_async(est, len(progs), 1)
    costs_ = plan.detail["costs"]
    assert plan.predicted_step_s == min(costs_.values())
    # rollout per batch falls with engines, training rises: the choice is where they cross
    assert pl.async_step_s(est, len(progs), 1, 1) >= plan.predicted_step_s
    # a huge switch cost keeps the current split
    sticky = planner.Planner(rc, tc, 8, sync_s=1.0, switch_s=1e9)
    other = 1 if plan.rollout_gpus != 1 else 2
    assert sticky.plan_async(est, len(progs), 1, current=other).rollout_gpus == other
    # synchronous: an elastic step pays two switches, so a huge switch cost means a split; with free
    # switches and a tail much longer than the bulk, the elastic pool
    assert planner.Planner(rc, tc, 8, sync_s=1.0, switch_s=1e6).plan_sync(est, len(progs)).mode == "split"
    free = planner.Planner(rc, tc, 8, sync_s=1.0, switch_s=0.0).plan_sync(est, len(progs))
    ro = free.detail
    assert ro["rollout_critical"] > 2 * ro["rollout_bulk"] and free.mode == "elastic"
    assert free.predicted_step_s == min(ro["split_s"], ro["elastic_s"])


@pytest.mark.parametrize("policy", ["static", "colocated", "tail", "elastic", "libra"])
def test_sync_drivers_account_every_step(policy):
    w, cfg, rc, tc = _small()
    out = sim.run_policy(policy, w, cfg, rc, tc)
    assert out["simulated"] is True and len(out["rows"]) == 3
    assert out["throughput"] == pytest.approx(out["tokens"] / out["total_s"])
    for r in out["rows"]:
        assert r["step_s"] >= r["rollout_s"] > 0
    if policy != "tail":
        assert out["tokens"] == sum(sum(p.tokens for p in workload.step_batch(w, s)) for s in range(3))


def test_colocated_step_is_rollout_plus_switches_plus_train_plus_sync():
    w, cfg, rc, tc = _small()
    progs = workload.step_batch(w, 1)
    ro = sim.rollout_once(progs, rc, cfg.gpus, cfg)["makespan"]
    out = sim.run_policy("colocated", w, cfg, rc, tc)["rows"][1]
    comp = workload.compact_tokens(progs)
    tr = tc.step_s(comp, np.mean([p.tokens for p in progs]), cfg.gpus)
    assert out["step_s"] == pytest.approx(ro + 2 * cfg.switch_s + tr + cfg.sync_s)


@pytest.mark.parametrize("policy", ["static", "libra"])
def test_async_respects_staleness(policy):
    w, cfg, rc, tc = _small()
    cfg = sim.SimConfig(gpus=4, steps=3, sync_s=1.0, switch_s=2.0, staleness=1)
    out = sim.run_policy(policy, w, cfg, rc, tc)
    rows = out["rows"]
    assert [r["step"] for r in rows] == [0, 1, 2]
    ends = [r["train_end"] for r in rows]
    assert ends == sorted(ends) and out["total_s"] == ends[-1]
    for r in rows:
        assert r["train_end"] >= r["batch_done"] + r["train_s"] + cfg.sync_s - 1e-9
    # batch b is released when training step b - 2 (staleness 1) and its sync end; 0 and 1 at once
    assert out["release"] == {0: 0.0, 1: 0.0, 2: rows[0]["train_end"]}
    assert rows[2]["batch_done"] > rows[0]["train_end"]
    with pytest.raises(ValueError, match="asynchronous"):
        sim.run_policy("tail", w, cfg, rc, tc)


def _bench():
    import importlib.util
    from pathlib import Path
    path = Path(__file__).resolve().parents[1] / "scripts" / "bench_libra.py"
    spec = importlib.util.spec_from_file_location("bench_libra", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_bench_script_small_run_and_bad_input(tmp_path, capsys):
    import json
    bench = _bench()
    assert bench.main(["--out", str(tmp_path), "--steps", "2", "--gpus", "4", "--settings", "drift", "--queue-groups", "6",
                       "--queue-engines", "4", "--long-engines", "1", "--quiet"]) == 0
    data = json.loads((tmp_path / "libra.json").read_text())
    rows = data["rows"]
    assert {r["policy"] for r in rows} == ({label for label, _, _ in bench.RUNS} | set(bench.stream_labels([1, 4]))
                                           | {bench.HINDSIGHT.format(k=4)})
    stream = [r for r in rows if r.get("mode") == "stream"]
    assert stream and all(r["max_staleness"] <= r["staleness"] for r in stream)
    hs = [r for r in rows if "hindsight" in r["policy"]]
    assert len(hs) == 1 and hs[0]["throughput"] == max(hs[0]["throughput_by_r"].values())
    for r in rows:
        assert r["simulated"] is True and r["gpus"] == 4 and r["throughput"] > 0
        assert set(r) >= {"setting", "policy", "gpus", "throughput", "step_s", "vs_static", "simulated"}
    assert [r["vs_static"] for r in rows if r["policy"] == "static (sync)"] == [1.0]
    assert len(data["queues"]) == 6 and "SIMULATED" in (tmp_path / "libra.md").read_text()
    assert (tmp_path / "libra.png").stat().st_size > 0
    with pytest.raises(SystemExit) as e:
        bench.main(["--gpus", "x"])
    assert e.value.code == 2 and "--gpus" in capsys.readouterr().err


def test_rollout_fit_with_context_recovers_the_terms(tmp_path):
    import json
    a, b, c = 0.004, 0.00007, 3e-9
    pts = [(B, ctx, B / (a + b * B + c * B * ctx)) for B in (1, 16, 128) for ctx in (2000, 16000, 64000)]
    rc = costs.fit_rollout_cost(pts, fit_context=True, prefill_tok_s=5e4)
    assert (rc.a_s, rc.b_s, rc.c_s) == pytest.approx((a, b, c), rel=1e-6)
    (tmp_path / "cal.json").write_text(json.dumps({"points": pts, "prefill_tok_s": 5e4}))
    loaded, pre = costs.load_rollout_points(tmp_path / "cal.json")
    assert pre == 5e4 and len(loaded) == 9
    with pytest.raises(ValueError, match="at least 3"):
        costs.fit_rollout_cost(pts[:2], fit_context=True)


# -- the H200 calibration of 2026-12-02 (docs/benchmarks/libra_calibration_h200.json) -------------
# (batch, prompt, t_short_s, t_long_s) of `scripts/libra_calibrate_h200.py` on SGLang 0.5.17 (CUDA
# graphs, small-moe, 16 / 144 new tokens): decode tokens/s = B x 128 / (t_long - t_short) at context
# prompt + 80. B=128 x 8K and B=64 x 16K are prefill-dominated (their short wave is 1-3 s of
# prefill that varied by more than the 0.3 s decode difference); B=128 x 16K ran its long wave faster.
H200_ROWS = [(1, 1024, 0.057296, 0.357224), (16, 1024, 0.161539, 0.505315), (64, 1024, 0.388449, 0.735217),
             (128, 1024, 0.620126, 1.047651), (128, 8192, 3.046383, 3.336566), (64, 8192, 1.456201, 1.780539),
             (16, 8192, 0.408620, 0.727395), (1, 8192, 0.076916, 0.363880), (128, 16384, 4.985285, 4.899814),
             (64, 16384, 1.999255, 3.264657), (16, 16384, 0.770911, 1.139334), (1, 16384, 0.100148, 0.427133)]
H200_LOG = """\
[2026-12-02 16:36:20] max_total_num_tokens=40867151, chunked_prefill_size=8192, max_prefill_tokens=16384, max_running_requests=4096, context_len=32768, available_gpu_mem=24.49 GB
[2026-12-02 16:36:54] Prefill batch, #new-seq: 1, #new-token: 8192, #cached-token: 0, full token usage: 0.03, mamba usage: 0.01, #running-req: 63, #queue-req: 0, #pending-token: 0, cuda graph: True, input throughput (token/s): 1004468.86
[2026-12-02 16:36:54] Decode batch, #running-req: 64, #full token: 1049976, full token usage: 0.03, mamba num: 256, mamba usage: 0.01, cuda graph: True, gen throughput (token/s): 535.81, #queue-req: 0
[2026-12-02 16:36:54] Decode batch, #running-req: 64, #full token: 1052536, full token usage: 0.03, mamba num: 256, mamba usage: 0.01, cuda graph: True, gen throughput (token/s): 20889.38, #queue-req: 0
[2026-12-02 16:36:54] Decode batch, #running-req: 64, #full token: 1055096, full token usage: 0.03, mamba num: 256, mamba usage: 0.01, cuda graph: True, gen throughput (token/s): 19722.42, #queue-req: 0
[2026-12-02 16:36:55] Decode batch, #running-req: 64, #full token: 1057656, full token usage: 0.03, mamba num: 256, mamba usage: 0.01, cuda graph: True, gen throughput (token/s): 20815.40, #queue-req: 0
[2026-12-02 16:36:55] Prefill batch, #new-seq: 1, #new-token: 8192, #cached-token: 0, full token usage: 0.00, mamba usage: 0.00, #running-req: 4, #queue-req: 11, #pending-token: 188416, cuda graph: True, input throughput (token/s): 373914.96
[2026-12-02 16:36:57] Decode batch, #running-req: 1, #full token: 16406, full token usage: 0.00, mamba num: 4, mamba usage: 0.00, cuda graph: True, gen throughput (token/s): 342.08, #queue-req: 0
[2026-12-02 16:36:57] Decode batch, #running-req: 1, #full token: 16446, full token usage: 0.00, mamba num: 4, mamba usage: 0.00, cuda graph: True, gen throughput (token/s): 386.81, #queue-req: 0
[2026-12-02 16:36:57] Decode batch, #running-req: 1, #full token: 16486, full token usage: 0.00, mamba num: 4, mamba usage: 0.00, cuda graph: True, gen throughput (token/s): 414.81, #queue-req: 0
[2026-12-02 16:36:57] Decode batch, #running-req: 1, #full token: 16526, full token usage: 0.00, mamba num: 4, mamba usage: 0.00, cuda graph: True, gen throughput (token/s): 421.92, #queue-req: 0
"""


def _h200_result(max_total_num_tokens=40867151):
    rows, points = [], []
    for B, L, ts, tl in H200_ROWS:
        tps = B * 128 / (tl - ts) if tl > ts else float("nan")
        rows.append({"batch": B, "prompt": L, "t_short_s": ts, "t_long_s": tl, "decode_tok_s": tps, "ctx": L + 80.0})
        if tps > 0:
            points.append([B, L + 80.0, tps])
    return {"short": 16, "long": 144, "points": points, "rows": rows, "prefill_tok_s": 337514.56,
            "server_info": {"max_total_num_tokens": max_total_num_tokens,
                            "memory_usage": {"kvcache": 58.461, "token_capacity": 40867151}}}


def test_nnls_is_exact_against_scipy():
    from scipy.optimize import nnls as scipy_nnls
    rng = np.random.default_rng(3)
    for _ in range(50):
        A, y = rng.normal(size=(9, 3)), rng.normal(size=9)
        x = costs.nnls(A, y)
        assert (x >= 0).all()
        ref = scipy_nnls(A, y)[0]
        assert np.linalg.norm(A @ x - y) == pytest.approx(np.linalg.norm(A @ ref - y), rel=1e-9, abs=1e-12)


def test_h200_calibration_points_fit_physically():
    """The H200 grid's 11 points made the unconstrained 3-term fit fail (a=0.0026, b=-1.2e-5,
    c=4.1e-9: "non-physical terms"); screened + NNLS it fits, and the two bad points are named."""
    res = _h200_result()
    assert len(res["points"]) == 11
    rc = costs.fit_rollout_cost(res["points"], fit_context=True, prefill_tok_s=res["prefill_tok_s"])
    assert 2.2e-3 < rc.a_s < 2.7e-3 and 0 <= rc.b_s < 2e-5 and rc.c_s >= 0
    dropped = {(d["batch"], d["ctx"]): d["reason"] for d in rc.fit["dropped"]}
    assert dropped.keys() == {(128, 8272.0), (64, 16464.0)}
    assert dropped[(128, 8272.0)].startswith("non-monotone") and dropped[(64, 16464.0)].startswith("outlier")
    assert rc.fit["max_abs_rel_residual"] < 0.2
    # the server log's decode-only rate of B=64 x 16K (20.5K tokens/s) within 15%; the short/long
    # difference said 6.5K
    assert rc.tokens_per_s(64, 16466) == pytest.approx(20462, rel=0.15)
    # unscreened, NNLS alone still gives non-negative terms (the constraint binds: b = 0 or c = 0)
    raw = costs.fit_rollout_cost(res["points"], fit_context=True, prefill_tok_s=1.0, robust=False)
    assert min(raw.a_s, raw.b_s, raw.c_s) >= 0 and raw.fit["at_bound"]


def test_h200_calibration_rows_screened():
    pts, dropped = costs.screen_calibration_rows(_h200_result())
    why = {(d["batch"], d["prompt"]): d["reason"] for d in dropped}
    assert why.keys() == {(128, 16384), (128, 8192)} and len(pts) == 10
    assert why[(128, 16384)].startswith("no decode rate") and why[(128, 8192)].startswith("prefill-dominated")
    # a KV pool smaller than B x (prompt + long) tokens: those waves queue, not decode
    _, dropped = costs.screen_calibration_rows(_h200_result(max_total_num_tokens=1_000_000))
    kv = {(d["batch"], d["prompt"]) for d in dropped if d["reason"].startswith("KV pool")}
    assert kv == {(128, 8192), (64, 16384)}                          # 1.07M and 1.06M tokens > 1M
    assert costs.measured_kv_bytes_per_token(_h200_result()) == 1536.0    # 3 attention layers x K,V x 2 x 64 x bf16


def test_decode_waves_from_the_sglang_log():
    waves, cap = costs.decode_waves_from_log(H200_LOG)
    assert cap == {"max_total_num_tokens": 40867151, "max_running_requests": 4096}
    # the first decode line after a prefill covers the prefill: left out; then one wave per batch
    assert [(w["batch"], w["intervals"], w["tokens"]) for w in waves] == [(64, 3, 7680), (1, 3, 120)]
    secs = 2560 / 20889.38 + 2560 / 19722.42 + 2560 / 20815.40
    assert waves[0]["tok_s"] == pytest.approx(7680 / secs, rel=1e-4)
    assert waves[0]["ctx"] == pytest.approx((1049976 + 1057656) / 2 / 64, abs=0.1)
    assert waves[1]["tok_s"] == pytest.approx(120 / (40 / 386.81 + 40 / 414.81 + 40 / 421.92), rel=1e-4)


def test_committed_h200_calibration_and_the_simulated_model():
    rc = costs.rollout_cost_from_calibration(costs.BENCH / "libra_calibration_h200.json")
    f = rc.fit
    assert f["decode_source"] == "server log decode intervals" and len(f["points"]) == 11
    assert [(d["batch"], round(d["ctx"])) for d in f["dropped"]] == [(128, 16466)]
    m = f["measured"]
    assert 2.2e-3 < m["a_s"] < 2.7e-3 and 0 < m["b_s"] < 2e-5 and 0 <= m["c_s"] < m["c_hbm_floor_s"]
    assert (rc.a_s, rc.b_s) == (m["a_s"], m["b_s"])
    # the 1.48B model reads 8x the KV bytes per token: c at least its HBM read floor
    assert rc.c_s == pytest.approx(max(costs.KV_BYTES_PER_TOKEN_1P5B / costs.HBM_BYTES_PER_S,
                                       m["c_s"] * costs.KV_BYTES_PER_TOKEN_1P5B / 1536))
    assert rc.prefill_tok_s == pytest.approx(costs.measured_prefill_tok_s())
    both = costs.load_calibration(costs.BENCH / "libra_calibration_h200.json", decode_source="waves")
    assert len(both["points"]) == 10 and len(both["dropped"]) == 2


def test_calibrate_script_refit_offline(tmp_path, capsys):
    import importlib.util
    import json
    from pathlib import Path
    path = Path(__file__).resolve().parents[1] / "scripts" / "libra_calibrate_h200.py"
    spec = importlib.util.spec_from_file_location("libra_calibrate_h200", path)
    cal = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(cal)
    (tmp_path / "libra_calibration.json").write_text(json.dumps(_h200_result()))
    (tmp_path / "sglang_calibrate.log").write_text(H200_LOG)
    dst = tmp_path / "out.json"
    dst.write_text(json.dumps({"points": [[1, 1104.0, 39.9]], "rows": [{"batch": 1}], "from": "old"}))
    assert cal.main(["--refit", str(tmp_path / "libra_calibration.json"), "--refit-out", str(dst)]) == 0
    out = capsys.readouterr().out
    assert "waves (short/long wave differences, 9 points kept, 3 dropped)" in out and "non-physical" not in out
    assert "log" not in json.loads(dst.read_text())["fit"]            # 2 waves in the excerpt: too few for a fit
    d = json.loads(dst.read_text())
    assert len(d["log_waves"]) == 2 and d["log_capacity"]["max_running_requests"] == 4096
    assert d["history"][0]["from"] == "old" and d["fit"]["waves"]["a_s"] > 0
    assert d["fit"]["simulated_model"]["c_from"] == "HBM floor"


@pytest.mark.parametrize("staleness", [0, 1])
def test_static_split_override_is_the_split_used(staleness):
    """``SimConfig.static_split`` replaces the step-0 tuning: the tuned value gives the tuned run,
    another value a different run (the hindsight split of bench_libra --static-oracle)."""
    w, _, rc, tc = _small()
    cfg = sim.SimConfig(gpus=4, steps=3, sync_s=1.0, switch_s=2.0, staleness=staleness)
    tuned = sim.tune_static_split(workload.step_batch(w, 0), rc, tc, cfg)
    base = sim.run_policy("static", w, cfg, rc, tc)["total_s"]
    assert sim.run_policy("static", w, replace(cfg, static_split=tuned), rc, tc)["total_s"] == base
    other = [r for r in (1, 2, 3) if r != tuned]
    assert any(sim.run_policy("static", w, replace(cfg, static_split=r), rc, tc)["total_s"] != base for r in other)


# -- streaming bounded-staleness driver ----------------------------------------------------------

def test_abort_frees_the_slot_at_once():
    """One slot: the second program starts when the first is aborted (not when its turn would end)."""
    rc = _rc(max_batch=1)
    pool = sim.EnginePool([(rc, 0)], cmlfq.FCFS())
    a, b = pool.add_programs([_prog([1000], prompt=100), _prog([50], prompt=200)], 0.0)
    t_abort = 100 / rc.prefill_tok_s + _decode(rc, 10, 1, 100)            # after 10 of its 1,000 tokens
    pool.call_at(t_abort, lambda t: pool.abort(a, t))
    pool.run()
    assert a in pool.aborted and np.isnan(pool.done_at[a]) and pool.started[a] == 0.0
    assert pool.started[b] == pytest.approx(t_abort)
    assert pool.done_at[b] == pytest.approx(t_abort + 200 / rc.prefill_tok_s + _decode(rc, 50, 1, 200))


def test_group_source_chunk_zero_is_the_step_batch():
    w = workload.WorkloadConfig(groups=3, group_size=2, steps=4, max_turns=5)
    src = sim.GroupSource(w)
    drawn = [src.draw(2) for _ in range(4)]              # 3 groups of chunk 0, then chunk 1
    ref = workload.step_batch(w, 2)
    assert [p.group for g in drawn for p in g] == [0, 0, 1, 1, 2, 2, 3, 3]
    assert all(np.array_equal(p.gen, q.gen) and p.prompt == q.prompt for p, q in zip([p for g in drawn[:3] for p in g], ref))
    other = workload.step_batch(w, 2, group_offset=3)[:2]
    assert all(np.array_equal(p.gen, q.gen) for p, q in zip(drawn[3], other))


def test_stream_with_staleness_zero_is_the_synchronous_static_run():
    """k = 0: release a batch at version v, wait for all of it, train, sync: run_sync('static')."""
    w, cfg, rc, tc = _small()
    sync = sim.run_policy("static", w, cfg, rc, tc)
    st = sim.run_stream("static", w, cfg, rc, tc)
    assert st["tokens"] == sync["tokens"] and st["static_split"] == sync["rows"][0]["rollout_gpus"]
    assert st["total_s"] == pytest.approx(sync["total_s"], rel=1e-9)
    assert [r["step_s"] for r in st["rows"]] == pytest.approx([r["step_s"] for r in sync["rows"]], rel=1e-9)
    assert st["max_staleness"] == 0 and st["dropped_groups"] == st["aborted_groups"] == 0


def _tailed(steps=6, gen_median=150):
    """A long-tailed workload whose tails outlive k = 1 versions (some groups must be discarded)."""
    return workload.WorkloadConfig(groups=6, group_size=4, steps=steps, max_turns=12, gen_median=gen_median,
                                   gen_sigma=1.5, tool_median_s=2.0, tool_sigma=1.5)


@pytest.mark.parametrize("policy,k", [("static", 1), ("static", 2), ("libra", 1)])
def test_stream_staleness_bound_per_trajectory_at_consumption(policy, k):
    """Every consumed group's version (the version published when its first turn was admitted, recomputed
    here from the training ends) is at most k behind the step that trains on it; the bound bites."""
    w = _tailed(gen_median=400)
    _, _, rc, tc = _small()
    # one slot per engine and a short sync: programs of one group queue across a publish, so their
    # first turns run at different versions (2 consumed groups for static k=1: the oldest one counts)
    rc = replace(rc, max_batch=1)
    cfg = sim.SimConfig(gpus=4, steps=w.steps, sync_s=0.2, switch_s=2.0, staleness=k)
    out = sim.run_stream(policy, w, cfg, rc, tc)
    ends = [r["train_end"] for r in out["rows"]]
    assert ends == sorted(ends) and out["total_s"] == ends[-1] and len(out["rows"]) == w.steps
    assert len(out["consumed"]) == w.steps * w.groups
    for c in out["consumed"]:
        version = sum(1 for e in ends if e <= c["first_start_s"])       # publishes before its first turn
        assert version == c["version"] and 0 <= c["step"] - version <= k
        row = out["rows"][c["step"]]
        assert c["first_start_s"] <= row["start"]
    assert out["max_staleness"] <= k
    assert out["tokens"] == sum(r["tokens"] for r in out["rows"])
    if k == 1:
        assert out["dropped_groups"] + out["aborted_groups"] > 0 and out["discarded_tokens"] > 0
    # groups released and not discarded never exceed (published version + k + 1) batches
    assert out["released_groups"] - out["dropped_groups"] - out["aborted_groups"] <= (w.steps + k) * w.groups


def test_stream_larger_staleness_is_not_slower_here():
    w = _tailed()
    _, _, rc, tc = _small()
    cfg = sim.SimConfig(gpus=4, steps=w.steps, sync_s=1.0, switch_s=2.0, static_split=2)
    t = [sim.run_stream("static", w, replace(cfg, staleness=k), rc, tc)["total_s"] for k in (0, 1, 3)]
    assert t[0] > t[1] >= t[2] * 0.99


def test_hindsight_split_is_at_least_every_fixed_split_searched():
    w, _, rc, tc = _small()
    cfg = sim.SimConfig(gpus=6, steps=3, sync_s=1.0, switch_s=2.0, staleness=1)
    h = sim.hindsight_static_split(w, cfg, rc, tc)
    assert set(h["throughput_by_r"]) == {1, 2, 3, 4, 5}
    assert all(h["best"] >= v for v in h["throughput_by_r"].values())
    assert h["best"] == sim.run_stream("static", w, replace(cfg, static_split=h["best_r"]), rc, tc)["throughput"]
    tuned = sim.run_stream("static", w, cfg, rc, tc)
    assert h["best"] >= tuned["throughput"]


def test_switch_back_s_is_the_rollout_to_training_switch():
    w, cfg, rc, tc = _small()
    cfg = replace(cfg, switch_s=3.0, switch_back_s=0.5)
    progs = workload.step_batch(w, 1)
    ro = sim.rollout_once(progs, rc, cfg.gpus, cfg)["makespan"]
    out = sim.run_policy("colocated", w, cfg, rc, tc)["rows"][1]
    tr = tc.step_s(workload.compact_tokens(progs), np.mean([p.tokens for p in progs]), cfg.gpus)
    assert out["step_s"] == pytest.approx(ro + 3.0 + 0.5 + tr + cfg.sync_s)
    assert sim.SimConfig(switch_s=7.0).back_s == 7.0


# -- streaming planner from measured rates ----------------------------------------------------------

def _measure(**kw):
    base = dict(rollout_tok_s=1000.0, batch_tokens=80_000.0, train_s=10.0, train_gpus=8, idle_frac=0.0,
                intervals=3, drain_s=0.0)
    return planner.StreamMeasure(**{**base, **kw})


def _work():
    return 2e6, 4000.0


def test_stream_planner_balances_the_measured_rates():
    """With both rates measured, the unconstrained choice is where rollout per batch and training +
    sync cross, and the prediction at the current split is the measured bottleneck."""
    tc = costs.fit_train_cost()
    sp = planner.StreamPlanner(tc, 16, sync_s=0.5, switch_s=0.0, switch_back_s=0.0, margin=0.0)
    m = _measure()
    # calibrated: the training time on the measured GPUs is the measured one, + sync
    assert sp.train_step_s(m, 8, _work()) == pytest.approx(10.0 + 0.5)
    assert sp.rollout_step_s(m, 8) == pytest.approx(80_000 / (1000 * 8))
    costs_ = {r: sp.step_s(m, r, _work()) for r in range(1, 16)}
    best = min(costs_, key=costs_.get)
    ro = [sp.rollout_step_s(m, r) for r in range(1, 16)]
    tr = [sp.train_step_s(m, 16 - r, _work()) for r in range(1, 16)]
    assert all(a >= b for a, b in zip(ro, ro[1:])) and all(a <= b for a, b in zip(tr, tr[1:]))
    # the crossing: one more rollout GPU makes training the bottleneck, one fewer the rollout
    assert sp.rollout_step_s(m, best - 1) > sp.train_step_s(m, 16 - best + 1, _work()) or best == 1
    # free switches, no margin: a training-bound pipeline (idle 0) far from the crossing moves to it
    start = 15 if best < 15 else 1
    plan = sp.plan(m, start, _work(), steps_left=5)
    assert plan.rollout_gpus == best and plan.detail["why"] == "move"


def test_stream_planner_never_moves_against_the_measured_bottleneck():
    tc = costs.fit_train_cost()
    sp = planner.StreamPlanner(tc, 16, sync_s=0.5, switch_s=0.0, switch_back_s=0.0, margin=0.0)
    # the rate model says rollout is cheap (move GPUs to training) but training waited for data
    fast = _measure(rollout_tok_s=1e6, idle_frac=0.3)
    assert sp.plan(fast, 12, _work(), 5).rollout_gpus >= 12
    assert sp.plan(replace(fast, idle_frac=0.0), 12, _work(), 5).rollout_gpus < 12    # the rule, not the model
    # the rate model says rollout is slow (move GPUs to rollout) but training never waited
    slow = _measure(rollout_tok_s=10.0, idle_frac=0.0)
    assert sp.plan(slow, 4, _work(), 5).rollout_gpus <= 4
    assert sp.plan(replace(slow, idle_frac=0.3), 4, _work(), 5).rollout_gpus > 4


def test_stream_planner_hysteresis_blocks_a_switch_below_its_cost():
    tc = costs.fit_train_cost()
    m = _measure(rollout_tok_s=1e6)              # training-bound: fewer rollout GPUs are better
    free = planner.StreamPlanner(tc, 16, sync_s=0.5, switch_s=0.0, switch_back_s=0.0, margin=0.0)
    moved = free.plan(m, 12, _work(), 5)
    assert moved.rollout_gpus < 12
    gain = moved.detail["gain_s"]
    # a switch whose two-way cost x margin exceeds the predicted gain keeps the split
    for kw in ({"switch_s": 1e4, "switch_back_s": 1e4}, {"switch_s": 1.0, "switch_back_s": 1.0, "margin": 1e6}):
        sp = planner.StreamPlanner(tc, 16, sync_s=0.5, **kw)
        plan = sp.plan(m, 12, _work(), 5)
        assert plan.rollout_gpus == 12 and plan.detail["why"] == "hysteresis"
        assert plan.detail["gain_s"] <= sp.margin * plan.detail["switch_cost_s"]
    # the cost counts both ways: moving 4 GPUs to training costs 4 x 10 s / 8 trainers + 4 x 10 s / 8 engines
    sp = planner.StreamPlanner(tc, 16, switch_s=10.0, switch_back_s=10.0)
    assert sp.switch_cost_s(12, 8) == pytest.approx(4 * 10 / 8 + 4 * 10 / 8)
    assert sp.switch_cost_s(12, 12) == 0.0
    # no steps left, or a drain that outlasts the horizon: no gain, no move
    assert free.plan(m, 12, _work(), 0).rollout_gpus == 12
    long_drain = replace(m, drain_s=1e6)
    assert planner.StreamPlanner(tc, 16, switch_s=0.0, switch_back_s=0.0, margin=0.0).plan(
        long_drain, 12, _work(), 5).rollout_gpus == 12
    assert gain > 0


def test_stream_planner_waits_for_a_converged_estimate():
    tc = costs.fit_train_cost()
    sp = planner.StreamPlanner(tc, 16, switch_s=0.0, switch_back_s=0.0, margin=0.0)
    m = _measure(rollout_tok_s=1e6)
    assert sp.plan(None, 12, _work(), 5).detail["why"] == "not converged"
    assert sp.plan(replace(m, intervals=1), 12, _work(), 5).rollout_gpus == 12
    assert sp.plan(replace(m, intervals=2), 12, _work(), 5).rollout_gpus < 12


def test_stream_libra_measured_decisions_follow_the_rules():
    """In the driver: no re-split before 2 measured steps, never toward training when training
    waited for data nor toward rollout when it did not; a measured window exists from step 1."""
    w = _tailed(steps=8)
    _, _, rc, tc = _small()
    cfg = sim.SimConfig(gpus=6, steps=w.steps, sync_s=0.5, switch_s=1.0, staleness=2)
    out = sim.run_stream("libra", w, cfg, rc, tc)
    assert out["planner_mode"] == "measured" and len(out["decisions"]) == w.steps - 1
    d = out["decisions"]
    assert d[0]["why"] == d[1]["why"] == "not converged" and d[0]["measure"] is None
    for x in d[2:]:
        m = x["measure"]
        assert m is not None and m["intervals"] == min(3, x["step"]) and m["rollout_tok_s"] > 0
        if x["rollout_bound"]:
            assert x["target"] >= x["current"]
        else:
            assert x["target"] <= x["current"]
    assert [r["rollout_gpus"] for r in out["rows"]][:3] == [out["static_split"]] * 3
    # a starved rollout (1 of 6 GPUs): training waits, the planner moves GPUs to rollout, only that
    # way, and beats the fixed split it started from
    starved = replace(cfg, static_split=1)
    lib = sim.run_stream("libra", w, starved, rc, tc)
    moves = [x for x in lib["decisions"] if x["target"] != x["current"]]
    assert moves and all(x["rollout_bound"] and x["target"] > x["current"] for x in moves)
    assert lib["throughput"] > sim.run_stream("static", w, starved, rc, tc)["throughput"]
    # the earlier variant is still there, and a bad mode is refused
    old = sim.run_stream("libra", w, cfg, rc, tc, planner_mode="model")
    assert old["planner_mode"] == "model" and old["decisions"] == []
    with pytest.raises(ValueError):
        sim.run_stream("libra", w, cfg, rc, tc, planner_mode="bulk")


def test_turn_log_records_admission_to_completion():
    rc = _rc()
    pool = sim.EnginePool([(rc, 0)], cmlfq.FCFS())
    pool.add_programs([_prog([100, 50], prompt=300, obs=[5], tool=[3.0])], 0.0)
    pool.run()
    assert len(pool.turn_log) == 2
    (e1, d1), (e2, d2) = pool.turn_log
    # the first turn: admitted at 0; the second: admitted when the tool returns
    assert d1 == pytest.approx(e1) and e2 - d2 == pytest.approx(e1 + 3.0)
    assert e2 == pool.done_at[0]


def test_stream_planner_latency_bound_rollout_scales_like_an_iteration():
    """A rollout whose iterations are all fixed cost (load 0) is not sped up by engines; one whose
    iterations are all load scales as 1 / engines; the capacity model always as 1 / engines."""
    tc = costs.fit_train_cost()
    sp = planner.StreamPlanner(tc, 16)
    for load, want in ((0.0, 1.0), (1.0, 0.5), (0.25, 0.875)):
        m = _measure(current=8, load_frac=load)
        assert sp.rollout_step_s(m, 16) / sp.rollout_step_s(m, 8) == pytest.approx(want)
    cap = planner.StreamPlanner(tc, 16, latency_bound=False)
    assert cap.rollout_step_s(_measure(current=8, load_frac=0.0), 16) == pytest.approx(80_000 / (1000 * 16))
    # rollout-bound with no load share: more engines predict no gain, so the planner keeps its split
    m = _measure(current=8, load_frac=0.0, idle_frac=0.5, rollout_tok_s=100.0)
    assert planner.StreamPlanner(tc, 16, switch_s=0.0, switch_back_s=0.0, margin=0.0).plan(m, 8, _work(), 5).rollout_gpus == 8
    assert cap.plan(m, 8, _work(), 5).rollout_gpus > 8
