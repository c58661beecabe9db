"""The SGLang plugin HARTS_SUFFIX (rollout/war/sglang_plugin.py) with SGLang 0.5.17 imported on CPU.

SGLang is installed without dependencies into its own directory (``sglang_site``; the venv's
torch is untouched) and imported in a subprocess: its import patches transformers. There, SGLang's
own plugin loader (``sglang.srt.plugins.load_plugins``) discovers our entry point of group
``sglang.srt.plugins`` and ``SpeculativeAlgorithm.from_string("HARTS_SUFFIX")`` resolves to our
class; the corpus' draft/mask layout is read back with SGLang's own ``leaf_paths_from_mask``.
"""
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from megatron_harts.rollout.war.sglang_plugin import (ALGO_NAME, DRAFT_ENV, ENTRY_POINT, SuffixCorpus, TrajectoryFeed,
                                                      draft_config, group_of, sglang_site, write_plugin_dist)

ROOT = Path(__file__).resolve().parents[1]
ENTRY = "harts_suffix = megatron_harts.rollout.war.sglang_plugin:register"
assert ENTRY == ENTRY_POINT

CHECK = r'''
import json, sys
from sglang.srt.plugins import load_plugins
from sglang.srt.speculative import spec_registry
from sglang.srt.speculative.spec_info import SpeculativeAlgorithm
assert spec_registry.get_spec("HARTS_SUFFIX") is None          # nothing before the loader runs
load_plugins()
algo = SpeculativeAlgorithm.from_string("harts_suffix")
out = {"repr": repr(algo), "registered": spec_registry.get_spec("HARTS_SUFFIX") is algo,
       "is_ngram": algo.is_ngram(), "is_speculative": algo.is_speculative(), "is_eagle": algo.is_eagle(),
       "has_draft_kv": algo.has_draft_kv(), "overlap": algo.supports_overlap,
       "ngram_args": "_handle_ngram" in type(algo).handle_server_args.__code__.co_names}
from sglang.srt.arg_groups.speculative_hook import _handle_ngram   # the hook it delegates to exists
class SA:                                                         # the worker needs sgl_kernel (GPU)
    disable_overlap_schedule = True
try:
    algo.create_worker(SA())
    out["worker"] = "built"
except ImportError as e:
    out["worker"] = f"ImportError: {e}"
timed = SpeculativeAlgorithm.from_string("HARTS_NGRAM_TIMED")
out["timed"] = {"registered": spec_registry.get_spec("HARTS_NGRAM_TIMED") is timed, "is_ngram": timed.is_ngram(),
                "has_draft_kv": timed.has_draft_kv()}
try:
    timed.create_worker(SA())
    out["timed"]["worker"] = "built"
except ImportError as e:
    out["timed"]["worker"] = f"ImportError: {e}"
from sglang.srt.speculative.cpp_ngram.ngram_corpus import NgramCorpus
from megatron_harts.rollout.war.sglang_plugin import SuffixCorpus, draft_config
c = SuffixCorpus(6, draft_config(6, "chain"))
c.drafter.add_trajectory([5, 6, 7, 8, 9, 10, 11], "g")
ids, mask = c.batch_get(["g/0#1", "x/0#1"], [[1, 5, 6], [3, 3]], [3, 2])
n = 6
out["paths"] = [NgramCorpus.leaf_paths_from_mask(None, ids[b * n:(b + 1) * n].tolist(),
                mask[b * n * n:(b + 1) * n * n].reshape(n, n).astype(int).tolist()) for b in range(2)]
from megatron_harts.rollout.war.suffix import DrafterConfig
t = SuffixCorpus(6, DrafterConfig(budget=5, tree=True, min_token_prob=0.0))
t.drafter.add_trajectory([1, 2, 3, 4, 5], "g")
t.drafter.add_trajectory([1, 2, 9, 8], "g")
ids, mask = t.batch_get(["g/0#1"], [[7, 1, 2]], [3])
out["tree_paths"] = NgramCorpus.leaf_paths_from_mask(None, ids.tolist(), mask.reshape(n, n).astype(int).tolist())
print("RESULT " + json.dumps(out))
'''


@pytest.fixture(scope="module")
def site():
    return sglang_site()         # installed once (scripts/setup.sh does it in CI)


@pytest.mark.timeout(300)
def test_registration_through_sglangs_plugin_loader(site, tmp_path):
    # a distribution declaring our entry point, as `pip install megatron_harts` does (setup.py)
    write_plugin_dist(tmp_path)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(tmp_path), str(site), str(ROOT)]))
    r = subprocess.run([sys.executable, "-c", CHECK], capture_output=True, text=True, env=env, timeout=240)
    line = [ln for ln in r.stdout.splitlines() if ln.startswith("RESULT ")]
    assert r.returncode == 0 and line, r.stderr[-3000:]
    out = json.loads(line[0][7:])
    assert out["repr"].endswith(f"('{ALGO_NAME}')") and out["registered"]
    assert out["is_ngram"] and out["is_speculative"] and not out["is_eagle"] and not out["has_draft_kv"]
    assert out["overlap"] is True and out["ngram_args"]
    assert "sgl_kernel" in out["worker"], out["worker"]           # the factory reaches NGRAMWorker
    # SGLang's NGRAM with its corpus timed: registered by the same entry point, dispatched as NGRAM
    assert out["timed"]["registered"] and out["timed"]["is_ngram"] and not out["timed"]["has_draft_kv"]
    assert "sgl_kernel" in out["timed"]["worker"], out["timed"]
    # SGLang reads our chain: root (the last context token) -> group g's continuation (a match
    # of 2 tokens earns 2 draft tokens), the unused nodes as leaves under the root
    assert out["paths"][0] == [[6, 7, 8], [6, 0], [6, 0], [6, 0]], out["paths"]
    # no group index: the request's own context ([3, 3] repeats 3) drafts one token
    assert out["paths"][1] == [[3, 3], [3, 0], [3, 0], [3, 0], [3, 0]], out["paths"]
    # a tree draft (two continuations of "1 2" in the group) reads back as both branches
    tree = [p for p in out["tree_paths"] if p[1:] != [0]]
    assert sorted(tree) == [[2, 3, 4], [2, 9, 8]], out["tree_paths"]


def test_setup_py_declares_the_entry_point():
    text = (ROOT / "setup.py").read_text()
    assert re.search(r'"sglang\.srt\.plugins":\s*\[\s*"' + re.escape(ENTRY) + '"', text), \
        "setup.py must declare the sglang.srt.plugins entry point"


def test_corpus_layout_feed_and_errors(tmp_path):
    feed = tmp_path / "feed.jsonl"
    c = SuffixCorpus(5, draft_config(5, "chain"), feed=str(feed), poll_s=0.0)
    TrajectoryFeed(feed).add([1, 2, 3, 4, 5, 6], "grp")
    with open(feed, "a") as f:
        f.write('{"group": "grp", "tokens": [9, 9')          # a line still being written
    assert c.poll() == 1 and c.drafter.indexed_tokens == 6
    with open(feed, "a") as f:
        f.write(', 9]}\n')
    assert c.poll() == 1
    ids, mask = c.batch_get(["grp/0.1#2-7"], [[7, 1, 2]], [3])
    ids, mask = ids.reshape(5), mask.reshape(5, 5)
    assert ids.tolist() == [2, 3, 4, 0, 0]      # root = last token, the draft (2-token match: 2 tokens)
    assert (mask[:3, :3] == np.tril(np.ones((3, 3), bool))).all() and not mask[:3, 3:].any()   # a chain
    assert (mask[3:] == np.array([[1, 0, 0, 1, 0], [1, 0, 0, 0, 1]], bool)).all()  # unused: leaves of the root
    # the next call passes only what is new (plus a tail), as the worker does
    ids, mask = c.batch_get(["grp/0.1#2-7"], [[2, 3, 4]], [5])
    assert c.known("grp/0.1#2-7") == 5 and ids.tolist() == [4, 5, 6, 0, 0]
    with pytest.raises(ValueError, match="whole context"):
        c.batch_get(["new"], [[1, 2]], [10])
    with pytest.raises(ValueError, match="only 1 were passed"):
        c.batch_get(["grp/0.1#2-7"], [[2]], [9])
    c.erase_match_state(["grp/0.1#2-7"])
    assert c.known("grp/0.1#2-7") == 0
    assert group_of("t3/0.2#1-5") == "t3" and group_of("plain") is None


def test_feed_is_indexed_a_slice_per_scheduler_call(tmp_path):
    """``synchronize`` (called by the worker every scheduler iteration) indexes the feed within its
    time budget, so a burst of long trajectories is spread over many iterations; ``poll()``
    (forced) indexes everything at once."""
    feed = tmp_path / "feed.jsonl"
    c = SuffixCorpus(5, feed=str(feed), poll_s=0.0, index_s=0.0)       # one 256-token slice per call
    TrajectoryFeed(feed).add(list(range(100)) * 20, "grp")              # 2,000 tokens
    c.synchronize()
    assert c.stats["fed"] == 1 and c.stats["indexed"] == 256 and c.drafter.pending_tokens == 2000 - 256
    calls = 1
    while c.drafter.pending_tokens:
        c.synchronize()
        calls += 1
    assert calls == 8 and c.drafter.indexed_tokens == 2000            # ceil(2000 / 256)
    TrajectoryFeed(feed).add(list(range(7)), "grp")
    assert c.poll() == 1 and c.drafter.pending_tokens == 0 and c.drafter.indexed_tokens == 2007
    assert c.drafter.cfg.max_depth == 32                               # the plugin's depth (docs/war.md)


def test_server_drafter_shape_tree_by_default_chain_on_request(monkeypatch):
    """The server's drafter drafts trees (up to twice the match length) unless
    ``$HARTS_SUFFIX_DRAFT=chain``; another value is a one-line error."""
    monkeypatch.delenv(DRAFT_ENV, raising=False)
    cfg = SuffixCorpus(17).drafter.cfg
    assert cfg.tree and cfg.max_spec_factor == 2.0 and cfg.budget == 16 and cfg.max_depth == 32
    monkeypatch.setenv(DRAFT_ENV, "chain")
    cfg = SuffixCorpus(17).drafter.cfg
    assert not cfg.tree and cfg.max_spec_factor == 1.0
    monkeypatch.setenv(DRAFT_ENV, "bush")
    with pytest.raises(ValueError, match="HARTS_SUFFIX_DRAFT"):
        SuffixCorpus(17)


def test_corpus_times_its_host_work_per_scheduler_step(tmp_path):
    """``timing`` adds up the host seconds per scheduler step before the verify forward (``batch_get``
    and any ``synchronize``: the worst step includes both) apart from the feed's indexing after the
    forward's launch (``after_verify``, which overlaps the GPU), and ``timing_line`` reports them:
    what the GPU runs' server logs show to tell drafting cost from verification cost."""
    feed = tmp_path / "feed.jsonl"
    c = SuffixCorpus(9, feed=str(feed), poll_s=0.0, index_s=1.0)
    TrajectoryFeed(feed).add(list(range(50)) * 40, "grp")              # 2,000 tokens to index
    assert {k: v for k, v in c.timing.items() if k != "gc0"} == \
        {"steps": 0, "sync_s": 0.0, "draft_s": 0.0, "after_s": 0.0, "max_step_s": 0.0}
    c.synchronize()
    sync_first = c.timing["sync_s"]
    assert sync_first > 0 and c.stats["indexed"] == 2000
    ids, mask = c.batch_get(["grp/0.1#1-1"], [list(range(50)) * 2], [100])
    assert ids.shape == (9,) and mask.shape == (81,)
    t = c.timing
    assert t["steps"] == 1 and t["draft_s"] > 0
    assert t["max_step_s"] >= sync_first + t["draft_s"] - 1e-12       # the step = its sync + its draft
    worst = t["max_step_s"]
    TrajectoryFeed(feed).add(list(range(60, 90)) * 200, "grp")         # 6,000 more, indexed after verify
    c.after_verify()
    assert c.stats["indexed"] == 8000 and c.timing["after_s"] > 0 and c.timing["sync_s"] == sync_first
    for k in range(2, 5):                                              # steps without a sync: draft only
        d0 = c.timing["draft_s"]
        c.batch_get(["grp/0.1#1-1"], [[k]], [100 + k - 1])
        worst = max(worst, c.timing["draft_s"] - d0)                   # after_verify is in no step's time
        assert c.timing["max_step_s"] == worst
    assert c.timing["steps"] == 4 and c.timing["sync_s"] == sync_first
    line = c.timing_line()
    assert line.startswith("HARTS_SUFFIX host time per step over 4 steps: before the forward draft ")
    assert "8000 tokens indexed" in line
    assert f"draft {1e3 * c.timing['draft_s'] / 4:.3f} ms" in line
    assert f"feed + indexing {1e3 * c.timing['after_s'] / 4:.3f} ms" in line
    # the process' GC pauses since the corpus started: a full collection shows up
    import gc

    full = int(re.search(r"gc \d+ collections \((\d+) full\)", line).group(1))
    gc.collect()
    line = c.timing_line()
    assert int(re.search(r"gc \d+ collections \((\d+) full\)", line).group(1)) == full + 1, line
    assert re.search(r"full\), \d+\.\d{3} ms per step; 4 drafts", line), line


def test_corpus_logs_its_timing_every_n_steps(caplog, monkeypatch):
    """The server's log gets a timing line every ``log_every`` scheduler steps (from
    ``$HARTS_SUFFIX_TIMING_EVERY`` unless given), and none in between."""
    import logging

    from megatron_harts.rollout.war.sglang_plugin import TIMING_ENV

    monkeypatch.setenv(TIMING_ENV, "3")
    c = SuffixCorpus(5, feed="")
    assert c.log_every == 3
    with caplog.at_level(logging.INFO, logger="megatron_harts.rollout.war.sglang_plugin"):
        c.batch_get(["g/0#1-1"], [list(range(20))], [20])
        for k in range(1, 7):
            c.batch_get(["g/0#1-1"], [[k]], [20 + k])
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("HARTS_SUFFIX host time")]
    assert [x.split(" steps:")[0].rsplit(" ", 1)[1] for x in lines] == ["3", "6"]
    monkeypatch.setenv(TIMING_ENV, "zero")
    with pytest.raises(ValueError, match=TIMING_ENV):
        SuffixCorpus(5, feed="")
    assert SuffixCorpus(5, feed="", log_every=1).log_every == 1    # an explicit value skips the variable


def test_timing_interval_env_is_checked(monkeypatch):
    from megatron_harts.rollout.war.sglang_plugin import TIMING_ENV, log_every_from_env

    monkeypatch.delenv(TIMING_ENV, raising=False)
    assert log_every_from_env() == 2000
    monkeypatch.setenv(TIMING_ENV, "50")
    assert log_every_from_env() == 50
    for bad in ("0", "-3", "ten", "1.5"):
        monkeypatch.setenv(TIMING_ENV, bad)
        with pytest.raises(ValueError, match=f"\\${TIMING_ENV} must be a positive integer"):
            log_every_from_env()


def test_timed_ngram_corpus_changes_nothing_but_counts_host_time(tmp_path, caplog):
    """``TimedNgramCorpus`` (HARTS_NGRAM_TIMED's corpus) returns the wrapped corpus' drafts
    unchanged, adds up ``synchronize`` + ``batch_get`` as a step before the forward and
    ``batch_put`` after it, logs every ``log_every`` steps and passes other attributes through.
    Wrapped here: a SuffixCorpus (the NgramCorpus interface; the C++ one needs a compiler)."""
    import logging

    from megatron_harts.rollout.war.sglang_plugin import TimedNgramCorpus

    plain, inner = SuffixCorpus(6, feed=""), SuffixCorpus(6, feed="")
    for c in (plain, inner):
        c.drafter.add_trajectory([5, 6, 7, 8, 9, 10, 11] * 3, "g")
    timed = TimedNgramCorpus(inner, log_every=2)
    assert timed.n == 6 and {k: v for k, v in timed.timing.items() if k != "gc0"} == \
        {"steps": 0, "sync_s": 0.0, "draft_s": 0.0, "after_s": 0.0, "max_step_s": 0.0}
    calls = [(["g/0#1"], [[1, 5, 6]], [3]), (["g/0#1"], [[7]], [4]), (["g/0#1"], [[8, 9]], [6])]
    with caplog.at_level(logging.INFO, logger="megatron_harts.rollout.war.sglang_plugin"):
        for args in calls:
            timed.synchronize()
            a, b = timed.batch_get(*args), plain.batch_get(*args)
            assert np.array_equal(a[0], b[0]) and np.array_equal(a[1], b[1])
            timed.batch_put([args[1][0]])
    t = timed.timing
    assert t["steps"] == 3 and t["draft_s"] > 0 and t["sync_s"] > 0 and t["after_s"] > 0
    assert t["max_step_s"] <= t["draft_s"] + t["sync_s"] + 1e-12
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("NGRAM host time")]
    assert len(lines) == 1 and lines[0].startswith("NGRAM host time per step over 2 steps: before the forward draft ")
    timed.erase_match_state(["g/0#1"])                              # passed through to the corpus
    assert "g/0#1" not in inner.ctx


def test_verify_step_wall_times_by_batch_size(monkeypatch, caplog):
    """``$HARTS_SPEC_STEP_WALL=1`` times whole verify steps (decode batches) by batch size, logs the
    line every ``log_every`` timed steps, leaves prefill batches untimed, refuses a bad value in one
    line and is ignored (with a warning) when the overlap schedule is on."""
    import logging
    import time
    from types import SimpleNamespace

    from megatron_harts.rollout.war.sglang_plugin import (STEP_WALL_ENV, StepWallTimes, _step_wall_from_env,
                                                          _timed_verify_step)

    class Mode:
        def __init__(self, decode):
            self.decode = decode

        def is_decode(self):
            return self.decode

    worker = SimpleNamespace(enable_overlap=False, ngram_corpus=SimpleNamespace(log_every=3))
    monkeypatch.delenv(STEP_WALL_ENV, raising=False)
    assert _step_wall_from_env(worker, "X") is None
    monkeypatch.setenv(STEP_WALL_ENV, "yes")
    with pytest.raises(ValueError, match=r"\$HARTS_SPEC_STEP_WALL must be 0 or 1, got 'yes'"):
        _step_wall_from_env(worker, "X")
    monkeypatch.setenv(STEP_WALL_ENV, "1")
    with caplog.at_level(logging.WARNING, logger="megatron_harts.rollout.war.sglang_plugin"):
        assert _step_wall_from_env(SimpleNamespace(enable_overlap=True), "X") is None
    assert any("ignored: the overlap schedule is on" in r.getMessage() for r in caplog.records)
    worker._step_wall = _step_wall_from_env(worker, "X")
    assert isinstance(worker._step_wall, StepWallTimes)

    calls = []

    def forward(batch, on_publish):
        calls.append((len(batch.reqs), on_publish))
        time.sleep(0.002 * len(batch.reqs))
        return "result"

    caplog.clear()
    with caplog.at_level(logging.INFO, logger="megatron_harts.rollout.war.sglang_plugin"):
        for bs, decode in [(1, True), (2, True), (3, False), (2, True), (1, True)]:
            batch = SimpleNamespace(reqs=[None] * bs, forward_mode=Mode(decode))
            assert _timed_verify_step(worker, "X", forward, batch, "cb") == "result"
    assert calls == [(1, "cb"), (2, "cb"), (3, "cb"), (2, "cb"), (1, "cb")]    # every batch forwarded once
    walls = worker._step_wall
    assert walls.count == {1: 2, 2: 2} and walls.steps == 4                      # the prefill batch untimed
    assert 0.004 <= walls.seconds[1] < walls.seconds[2]
    lines = [r.getMessage() for r in caplog.records if "verify step wall time" in r.getMessage()]
    assert len(lines) == 1 and lines[0].startswith("X verify step wall time by batch size (synchronized): 1: 1 x ")
    assert re.fullmatch(r"X verify step wall time by batch size \(synchronized\): 1: 2 x [\d.]+ ms, "
                        r"2: 2 x [\d.]+ ms, all: 4 x [\d.]+ ms", walls.line("X"))


def test_server_timing_reads_the_last_lines_of_a_log():
    """``server_timing`` parses the last host-time and wall-time lines as the two corpora and
    ``StepWallTimes`` write them (bench_war puts them in each low-load row)."""
    from megatron_harts.rollout.war.sglang_plugin import (StepWallTimes, TimedNgramCorpus, server_timing,
                                                          verify_wall_window)

    c = SuffixCorpus(6, feed="")
    c.drafter.add_trajectory([5, 6, 7, 8, 9, 10, 11] * 3, "g")
    for args in [(["g/0#1"], [[1, 5, 6]], [3]), (["g/0#1"], [[7]], [4])]:
        c.synchronize()
        c.batch_get(*args)
        c.after_verify()
    first = c.timing_line()
    c.batch_get(["g/0#1"], [[8, 9]], [6])
    last = c.timing_line()
    walls = StepWallTimes()
    for bs, dt in [(1, 0.010), (1, 0.012), (3, 0.020)]:
        walls.add(bs, dt)
    text = "\n".join(["noise", f"[t] INFO {first}", f"x {walls.line('HARTS_SUFFIX')}", f"[t] INFO {last}", "tail"])
    got = server_timing(text)
    t = c.timing
    assert got["host"]["steps"] == 3 == t["steps"]
    assert got["host"]["draft_ms"] == pytest.approx(1e3 * t["draft_s"] / 3, abs=6e-4)
    assert got["host"]["after_ms"] == pytest.approx(1e3 * t["after_s"] / 3, abs=6e-4)
    assert got["host"]["sync_ms"] == pytest.approx(1e3 * t["sync_s"] / 3, abs=6e-4)
    assert set(got["host"]) == {"steps", "draft_ms", "sync_ms", "worst_ms", "after_ms", "gc_collections",
                                "gc_full", "gc_ms"}
    assert got["verify_wall"] == {"1": [2, 11.0], "3": [1, 20.0], "all": [3, 14.0]}
    assert got["verify_wall_lines"] == [got["verify_wall"]]
    later = StepWallTimes()
    for bs, dt in [(1, 0.010), (1, 0.012), (3, 0.020), (1, 0.020), (2, 0.004)]:
        later.add(bs, dt)
    two = server_timing(walls.line("X") + "\n" + later.line("X"))["verify_wall_lines"]
    window = verify_wall_window(*two)                   # the steps after the first line: 1 x 20 ms, 1 x 4 ms
    assert window.keys() == {"1", "2", "all"} and window["1"][0] == 1 and window["2"] == [1, 4.0]
    assert window["1"][1] == pytest.approx(20.0) and window["all"][0] == 2 and window["all"][1] == pytest.approx(12.0)
    assert verify_wall_window({}, two[0]) == two[0]
    assert [h["steps"] for h in got["host_lines"]] == [2, 3] and got["host_lines"][-1] == got["host"]
    ngram = TimedNgramCorpus(SuffixCorpus(6, feed=""), log_every=10)
    ngram.batch_get(["g/0#1"], [[1, 5, 6]], [3])
    assert server_timing(ngram.timing_line())["host"]["steps"] == 1
    assert server_timing("no timing here") == {}


def test_verify_step_split_at_the_update_hook(monkeypatch, caplog):
    """A timed step whose forward enters the update hook is split there: time before the hook and
    whether the GPU was done (CPU: never), logged next to the wall line and parsed back by
    ``server_timing``; a step that never reaches the hook is timed but not split."""
    import logging
    import time
    from types import SimpleNamespace

    from megatron_harts.rollout.war.sglang_plugin import (STEP_WALL_ENV, _mark_prepared, _mark_update_hook,
                                                          _step_wall_from_env, _timed_verify_step, server_timing)

    class Mode:
        def is_decode(self):
            return True

    monkeypatch.setenv(STEP_WALL_ENV, "1")
    worker = SimpleNamespace(enable_overlap=False, ngram_corpus=SimpleNamespace(log_every=4))
    worker._step_wall = _step_wall_from_env(worker, "X")

    def forward(batch, on_publish):
        time.sleep(0.002)
        if len(batch.reqs) != 3:                 # batches of 3: prepared time not taken
            _mark_prepared(worker)
        time.sleep(0.001)
        if len(batch.reqs) != 4:                 # batches of 4 never reach the hook
            _mark_update_hook(worker)
        time.sleep(0.002)

    with caplog.at_level(logging.INFO, logger="megatron_harts.rollout.war.sglang_plugin"):
        for bs in (2, 2, 4, 3):
            _timed_verify_step(worker, "X", forward, SimpleNamespace(reqs=[None] * bs, forward_mode=Mode()), None)
    walls = worker._step_wall
    assert walls.count == {2: 2, 3: 1, 4: 1} and list(walls.split) == [2, 3]
    n, pre, done, prep, pn = walls.split[2]
    assert n == pn == 2 and done == 0 and 0.004 <= prep < pre - 0.002 and pre < walls.seconds[2] - 0.004
    assert walls.split[3][4] == 0
    text = "\n".join(r.getMessage() for r in caplog.records)
    got = server_timing(text)
    assert got["verify_split"] == {"2": [2, round(1e3 * pre / 2, 3), 0, round(1e3 * prep / 2, 3)],
                                   "3": [1, round(1e3 * walls.split[3][1], 3), 0]}
    assert got["verify_wall"]["4"][0] == 1
    old = "X verify step split at the update hook by batch size: 1: 68 x 27.022 ms before, 1 done"
    assert server_timing(old)["verify_split"] == {"1": [68, 27.022, 1]}       # runs 14-15's lines
    assert "drafter" not in got
    assert server_timing("[t] HARTS suffix drafter: compiled draft expansion\n")["drafter"] == "compiled"
    assert server_timing("[t] HARTS suffix drafter: Python draft expansion\n")["drafter"] == "Python"
    _mark_update_hook(SimpleNamespace(_step_wall=None))      # untimed workers: a no-op


def test_server_timing_reads_which_drafter_form_the_corpus_loaded(caplog, monkeypatch):
    """The line ``SuffixCorpus`` logs when it starts is the one ``server_timing`` reads back into a
    row: ``compiled`` by default here (CI has a C compiler), ``Python`` with the compiled parts off."""
    import logging

    from megatron_harts.rollout.war import suffix
    from megatron_harts.rollout.war.sglang_plugin import SuffixCorpus, server_timing

    for form, nat in (("compiled", suffix.native()), ("Python", None)):
        monkeypatch.setattr(suffix, "_NATIVE", nat)
        caplog.clear()
        with caplog.at_level(logging.INFO, logger="megatron_harts.rollout.war.sglang_plugin"):
            SuffixCorpus(17, feed="")
        assert server_timing("\n".join(r.getMessage() for r in caplog.records))["drafter"] == form
