"""The fast drafting path of HARTS_SUFFIX (rollout/war/suffix.py ``ContextIndex``,
sglang_plugin.py ``SuffixCorpus.batch_get`` / ``gather_draft_inputs``) against the path it
replaced (rollout/war/suffix_ref.py: a suffix trie per request's context, per-row masks): the
same inputs must give bitwise the same draft tokens and tree masks, per scheduler step of a
batched replay of the H200 model's sampled streams and on random cases."""
import functools
import shutil
from pathlib import Path

import numpy as np
import pytest
from hypothesis import example, given, settings, strategies as st

from megatron_harts.rollout.war import suffix_ref
from megatron_harts.rollout.war.replay import Req, SuffixStep, load_streams, replay_steps, tree_accept
from megatron_harts.rollout.war.sglang_plugin import SuffixCorpus, draft_config, gather_draft_inputs
from megatron_harts.rollout.war.suffix import ContextIndex, CorpusIndex, DrafterConfig, SuffixDrafter

ROOT = Path(__file__).resolve().parents[1]
STREAMS = ROOT / "docs" / "benchmarks" / "war_sampled_streams_h200model.jsonl.gz"


def _same(a, b):
    return len(a) == len(b) and all(np.array_equal(x[0], y[0]) and np.array_equal(x[1], y[1]) for x, y in zip(a, b))


def _replay_ref_and_new(streams, shape):
    """The reference path and the plugin's hook (batch of 8, draft budget 16) replayed on
    ``streams``, step for step; asserts equal steps and bitwise equal drafts (ids and masks)."""
    n = 17
    ref = replay_steps(SuffixStep(suffix_ref.RefSuffixCorpus(n, draft_config(n, shape), feed=""), "ref",
                                  suffix_ref.ref_gather_draft_inputs), streams, keep=True)
    new = replay_steps(SuffixStep(SuffixCorpus(n, draft_config(n, shape), feed="")), streams, keep=True)
    assert ref.steps > 100 and new.steps == ref.steps
    assert _same(ref.drafts, new.drafts)
    return ref, new


@pytest.mark.parametrize("shape", ["tree", "chain"])
def test_fast_path_drafts_bitwise_equal_to_reference_on_replayed_streams(shape):
    """Tasks t0/t1 of the sampled streams (24 trajectories, 3 RL steps) at batch 8 through the
    plugin's hook: every step's ids and mask equal the reference path's, so the replays agree."""
    streams = [s for s in load_streams(str(STREAMS)) if s.group in ("t0", "t1")]
    assert len(streams) == 24
    ref, new = _replay_ref_and_new(streams, shape)
    assert new.emitted == ref.emitted and new.accept_len == ref.accept_len > 2.0
    assert sum(int((d[0][:, 1:] != 0).sum()) for d in new.drafts) > 1000        # it did draft


STREAMS_SMALL_MODEL = ROOT / "docs" / "benchmarks" / "war_sampled_streams.jsonl.gz"


@functools.lru_cache(maxsize=1)
def _scripted():
    from megatron_harts.rollout.war.replay import code_repair_streams

    return tuple(code_repair_streams(n_tasks=2, samples=4, steps=3, seed=0))


def _scripted_streams():
    """Scripted code_repair episodes of tasks 0-1 (as ``bench_war.py --parts drafters`` makes them,
    real sandboxes: needs bubblewrap); made once per session."""
    if shutil.which("bwrap") is None:
        pytest.skip("the scripted streams run real sandboxes: bubblewrap is needed (apt-get install bubblewrap)")
    return list(_scripted())


def _stream_set(name):
    if name == "scripted":
        return _scripted_streams()
    path, groups = {"h200_model": (STREAMS, ("t2", "t3")), "small_model": (STREAMS_SMALL_MODEL, ("t4", "t5"))}[name]
    return [s for s in load_streams(str(path)) if s.group in groups]


@pytest.mark.parametrize("streams", ["h200_model", "small_model", "scripted"])
@pytest.mark.parametrize("shape", ["tree", "chain"])
def test_plugin_drafts_bitwise_equal_to_reference_on_every_stream_set(streams, shape):
    """The plugin's hook (batch of 8, the server's drafter: depth 32, budget 16) drafts, step by
    step, the same ids and masks as the reference path on two more tasks of the H200 model's
    streams, two tasks of the 0.73M model's and the scripted episodes of two tasks."""
    ss = _stream_set(streams)
    assert len(ss) == 24
    ref, new = _replay_ref_and_new(ss, shape)
    assert new.emitted == ref.emitted
    assert sum(int((d[0][:, 1:] != 0).sum()) for d in new.drafts) > 1000        # it did draft


class _Recorded:
    """``replay.OursMethod`` around a given drafter (ours or the reference), recording every draft
    field by field."""

    def __init__(self, drafter, cfg):
        from megatron_harts.rollout.war.replay import OursMethod

        self.m = OursMethod(cfg)
        self.m.d, self.name, self.drafts = drafter, "rec", []

    def start(self, stream, prompt_end):
        self.m.start(stream, prompt_end)

    def draft(self, context):
        d = self.m.d.draft(self.m._ctx, self.m._stream.group)
        self.drafts.append(_key(d))
        return d.paths()

    def accept(self, context, new):
        self.m.accept(context, new)

    def stop(self):
        self.m.stop()

    def finish(self, stream):
        self.m.finish(stream)


@pytest.mark.parametrize("cfg", [dict(max_depth=64, budget=8), dict(max_depth=64, budget=16, tree=True),
                                 dict(max_depth=32, budget=16, tree=True, max_spec_factor=2.0),
                                 dict(max_depth=64, budget=8, use_global=False)],
                         ids=["chain64_b8", "tree64_b16", "tree32_b16_f2", "group_only64_b8"])
def test_offline_replay_drafts_equal_reference_field_by_field(cfg):
    """``bench_war.py``'s offline replay (one request per turn, greedy verification) of two tasks
    of the H200 model's streams, with the drafter configurations of its tables: every draft
    (tokens, probabilities, parents, match length, score, source) equals the reference's."""
    from megatron_harts.rollout.war.replay import replay

    ss = _stream_set("h200_model")
    c = DrafterConfig(**cfg)
    new, ref = _Recorded(SuffixDrafter(c), c), _Recorded(suffix_ref.SuffixDrafter(c), c)
    rn, rr = replay(new, ss), replay(ref, ss)
    assert len(new.drafts) == len(ref.drafts) > 1000 and rn.emitted == rr.emitted
    bad = next((i for i, (x, y) in enumerate(zip(new.drafts, ref.drafts)) if x != y), None)
    assert bad is None, f"draft {bad} differs: {new.drafts[bad]} vs reference {ref.drafts[bad]}"
    assert sum(1 for d in new.drafts if d[0]) > 500


def _ref_context_draft(tokens, cfg, budget):
    trie = suffix_ref.SuffixTrie(cfg.max_depth)
    trie.add(tokens)
    return trie.draft(tokens, cfg, budget, "context")


def _key(d):
    return (d.tokens, d.probs, d.parents, d.match_len, d.score, d.source)


@settings(max_examples=200, deadline=None)
@given(pieces=st.lists(st.lists(st.integers(0, 4), min_size=0, max_size=40), min_size=1, max_size=6),
       depth=st.integers(2, 12), budget=st.integers(1, 8), minp=st.sampled_from([0.0, 0.1, 0.3]),
       factor=st.sampled_from([1.0, 2.0]), offset=st.sampled_from([0.0, 1.5, -2.5]), min_match=st.integers(1, 3),
       tree=st.booleans(), small=st.sampled_from([0, 3, 32]))
def test_context_index_draft_equals_a_trie_of_the_context(pieces, depth, budget, minp, factor, offset, min_match, tree,
                                                         small):
    """``ContextIndex.draft`` (occurrence positions) equals ``SuffixTrie.draft`` of a trie holding
    the context, after every extension (its match-length bound carried across calls), on the numpy
    (``small`` 0) and the Python paths; ``beat`` skips only drafts scoring below it."""
    cfg = DrafterConfig(max_depth=depth, budget=budget, min_token_prob=minp, max_spec_factor=factor,
                        max_spec_offset=offset, min_match=min_match, tree=tree)
    ctx = ContextIndex(depth)
    ctx._SMALL = small
    toks = []
    for i, p in enumerate(pieces):
        ctx.extend(p)
        toks += p
        b = budget if i % 2 == 0 else max(1, budget - 1)      # the cap changes: the bound must not leak
        want = _ref_context_draft(toks, cfg, b)
        assert _key(ctx.draft(cfg, b)) == _key(want)
        got = ctx.draft(cfg, b, beat=want.score + 1e-3 if i % 3 == 0 else 0.5)
        assert got is None or _key(got) == _key(want)


@settings(max_examples=100, deadline=None)
@given(trajs=st.lists(st.tuples(st.lists(st.integers(0, 3), min_size=1, max_size=30), st.sampled_from(["a", "b", None])),
                      min_size=0, max_size=5),
       pieces=st.lists(st.lists(st.integers(0, 3), min_size=1, max_size=8), min_size=1, max_size=5),
       group=st.sampled_from(["a", "b", None]), tree=st.booleans(), budget=st.integers(1, 6))
def test_drafter_choice_among_sources_equals_reference(trajs, pieces, group, tree, budget):
    """The best of (context, group, global) -- the context now last, skipped when it cannot win --
    is the reference's choice (ties to the more local source), field by field."""
    cfg = DrafterConfig(max_depth=8, budget=budget, tree=tree, max_spec_factor=2.0, min_token_prob=0.05)
    new, ref = SuffixDrafter(cfg), suffix_ref.SuffixDrafter(cfg)
    for t, g in trajs:
        new.add_trajectory(t, g)
        ref.add_trajectory(t, g)
    c_new, c_ref = new.start(), ref.start()
    for p in pieces:
        c_new.extend(p)
        c_ref.extend(p)
        assert _key(new.draft(c_new, group)) == _key(ref.draft(c_ref, group))
        assert _key(new.draft(list(c_new.tokens), group)) == _key(ref.draft(list(c_ref.tokens), group))


@pytest.mark.parametrize("n", [5, 17, 63, 70])
def test_batch_get_layout_equals_reference_any_width(n):
    """ids and masks of a batch (new, continuing, taken-over and empty-draft requests), narrow and
    wide (> 63 nodes: the unpackbits path), equal the reference corpus' per-row build."""
    out = []
    for cls in (SuffixCorpus, suffix_ref.RefSuffixCorpus):
        for shape in ("tree", "chain"):
            c = cls(n, draft_config(n, shape), feed="")
            c.drafter.add_trajectory(list(range(40)) * 3, "g")
            c.drafter.add_trajectory([1, 2, 3, 9, 9, 1, 2, 4, 9], "g")
            a = c.batch_get(["g/x#1", "h/y#1", "g/z#1"], [[7, 1, 2], [5], list(range(30))], [3, 1, 30])
            b = c.batch_get(["g/x#1", "h/y#1"], [[1, 2, 3, 4], [5, 6]], [5, 2])
            c.erase_match_state(["g/x#1"])
            d = c.batch_get(["g/x#2"], [[1, 2, 3, 4, 9, 1, 2]], [7])       # the next turn takes over
            out.append([a, b, d])
    half = len(out) // 2
    for x, y in zip(out[:half], out[half:]):
        for (ia, ma), (ib, mb) in zip(x, y):
            assert ia.dtype == ib.dtype and ma.dtype == mb.dtype and np.array_equal(ia, ib) and np.array_equal(ma, mb)
    assert np.asarray(out[0][0][0]).reshape(3, n)[:, 1].any()


def test_gather_inputs_equal_reference_without_copying_the_prompt():
    corpus, ref = SuffixCorpus(9, feed=""), suffix_ref.RefSuffixCorpus(9, feed="")
    reqs = [Req("g/a#1", list(range(100)), [7, 8]), Req("g/b#1", [1, 2], list(range(50))), Req("g/c#1", [], [3])]
    own_a, own_b = {}, {}
    for step in range(3):
        prev = [5, 6, 0, 0, 0, 0, 0, 0, 0] * 3
        for use_prev in (False, True):
            got = gather_draft_inputs(corpus, own_a, 32, reqs, prev, [2, 1, 0], 9, use_prev)
            want = suffix_ref.ref_gather_draft_inputs(ref, own_b, 32, reqs, prev, [2, 1, 0], 9, use_prev)
            assert got == want
        corpus.batch_get(*gather_draft_inputs(corpus, own_a, 32, reqs, prev, [0, 0, 0], 9, False))
        ref.batch_get(*suffix_ref.ref_gather_draft_inputs(ref, own_b, 32, reqs, prev, [0, 0, 0], 9, False))
        for r in reqs:
            r.output_ids.append(step)


def test_tree_accept_walks_the_mask():
    ids = [9, 1, 2, 3, 0]                 # root 9; 1 -> 2, 1 -> 3; an unused leaf 0 under the root
    mask = np.array([[1, 0, 0, 0, 0], [1, 1, 0, 0, 0], [1, 1, 1, 0, 0], [1, 1, 0, 1, 0], [1, 0, 0, 0, 1]], bool)
    assert tree_accept(ids, mask, [1, 3, 5]) == 2 and tree_accept(ids, mask, [1, 2]) == 2
    assert tree_accept(ids, mask, [2]) == 0 and tree_accept(ids, mask, [1]) == 1 and tree_accept(ids, mask, []) == 0


@settings(max_examples=200, deadline=None)
@given(trajs=st.lists(st.lists(st.integers(-1, 3), min_size=1, max_size=40), min_size=1, max_size=6),
       pieces=st.lists(st.lists(st.integers(-1, 3), min_size=0, max_size=12), min_size=1, max_size=6),
       depth=st.integers(2, 12), budget=st.integers(1, 8), minp=st.sampled_from([0.0, 0.1, 0.3]),
       factor=st.sampled_from([1.0, 2.0]), offset=st.sampled_from([0.0, 1.5, -2.5]), min_match=st.integers(1, 3),
       tree=st.booleans(), small=st.sampled_from([0, 3, 32]), chunk=st.integers(1, 50), evict=st.integers(0, 3),
       by_ptr=st.booleans())
# found by hypothesis (2026-12-03): a match state holding a Python list of more than _SMALL occurrences
# was filtered as a numpy array (TypeError)
@example(trajs=[[0, 0, 0, 0]], pieces=[[0]], depth=5, budget=1, minp=0.0, factor=1.0, offset=0.0, min_match=1,
         tree=False, small=0, chunk=1, evict=0, by_ptr=False)
def test_corpus_index_draft_equals_a_trie_of_the_trajectories(trajs, pieces, depth, budget, minp, factor, offset,
                                                             min_match, tree, small, chunk, evict, by_ptr):
    """``CorpusIndex.draft`` (occurrence positions over the concatenated trajectories) equals
    ``SuffixTrie.draft`` of a trie holding the same trajectories, with the last one partly indexed
    (streamed in chunks), after FIFO removals (and a compaction), for a query extended between
    calls (its match state carried across calls and index changes), on the numpy (``small`` 0) and
    the Python paths (tokens may be negative: the separator is none of them); ``by_ptr``: the query
    also passed as a ``ContextIndex``'s buffer (the compiled trigram match, when built)."""
    cfg = DrafterConfig(max_depth=depth, budget=budget, min_token_prob=minp, max_spec_factor=factor,
                        max_spec_offset=offset, min_match=min_match, tree=tree)
    idx, trie = CorpusIndex(depth), suffix_ref.SuffixTrie(depth)
    idx._SMALL, idx._COMPACT = small, (0 if chunk % 2 else 4096)     # compaction on removal, or not
    s_idx, s_trie = [-1, 0, 0, 0, 0], [-1, 0, 0, 0, 0]
    query: list[int] = []

    def check(i):
        b = budget if i % 2 == 0 else max(1, budget - 1)      # the cap changes: the bound must not leak
        ptr = None
        if by_ptr:
            qc = ContextIndex(depth, query)
            ptr = qc._ptr
        assert (_key(idx.draft(query, cfg, b, "group", s_idx, ctx_ptr=ptr)) ==
                _key(trie.draft(query, cfg, b, "group", s_trie)))

    for i, t in enumerate(trajs):
        fi, ft = None, None
        for j in range(0, len(t), chunk):                     # streamed: drafts see the indexed prefix
            fi, ft = idx.extend(t[j:j + chunk], fi), trie.extend(t[j:j + chunk], ft)
            query += pieces[(i + j) % len(pieces)]
            check(i + j)
    for i, p in enumerate(pieces):
        query += p
        check(i)
    if evict:
        idx._compact()                                         # re-indexing keeps the content
    for t in trajs[:evict]:
        idx.remove(t)
        trie.remove(t)
        check(0)
        query += pieces[0]
        check(1)
    assert idx.num_tokens == trie.count[0]


def test_bench_war_steps_rejects_bad_streams_and_methods_with_one_line(tmp_path):
    """A missing file, a record without a field, non-JSON, an unknown method and a before_* method
    without (or with a bad) ``--before``: one line naming the file, line and field, exit 2, no
    traceback."""
    import subprocess
    import sys

    script = Path(__file__).resolve().parents[1] / "scripts" / "bench_war_steps.py"
    (tmp_path / "nofield.jsonl").write_text('{"tokens": [1, 2], "group": "t0", "step": 0, "traj_id": "a"}\n')
    (tmp_path / "notjson.jsonl").write_text('{"tokens": [1, 2], "loss_mask": [0, 1], "group": "t0", "step": 0, '
                                            '"traj_id": "a"}\nnot json\n')
    cases = [(["--streams", str(tmp_path / "missing.jsonl")], "missing.jsonl: cannot read"),
             (["--streams", str(tmp_path / "nofield.jsonl")], "nofield.jsonl:1: field 'loss_mask' missing"),
             (["--streams", str(tmp_path / "notjson.jsonl")], "notjson.jsonl:2: not JSON"),
             (["--methods", "ours_tree,bogus"], "--methods: unknown bogus"),
             (["--methods", "before_tree"], "needs --before REV"),
             (["--methods", "before_tree", "--before", "no-such-revision"], "--before no-such-revision:"),
             (["--rl-steps", "0,x"], "--rl-steps: comma list of integers"),
             (["--rl-steps", "7"], "--rl-steps 7: no stream")]
    for argv, want in cases:
        r = subprocess.run([sys.executable, str(script), *argv], capture_output=True, text=True, timeout=120)
        assert r.returncode == 2, (argv, r.stderr)
        assert want in r.stderr and "Traceback" not in r.stderr, (argv, r.stderr)


def test_queued_feed_is_indexed_after_verification_and_timed_apart():
    """With the feed queued (as the server's), the replay's suffix hook indexes finished
    trajectories in ``after_verify`` (the worker's hook after the verify forward's launch), never
    before drafting: the corpus' ``sync_s`` stays 0, its ``after_s`` and indexed tokens grow, and
    the replay splits each step's host time into the part before verification and after it."""
    streams = [s for s in load_streams(str(STREAMS)) if s.group in ("t0", "t1")]
    corpus = SuffixCorpus(17, draft_config(17, "tree"), feed="")
    r = replay_steps(SuffixStep(corpus, queued=True), streams, batch=8)
    assert corpus.stats["indexed"] > 10_000 and corpus.timing["after_s"] > 0 and corpus.timing["sync_s"] == 0.0
    assert len(r.before_us) == len(r.step_us) == r.steps
    assert all(b <= s for b, s in zip(r.before_us, r.step_us))
    assert r.after_us_mean == pytest.approx(r.step_us_mean - r.before_us_mean) and r.after_us_mean > 0
    assert r.accept_len > 2.0                     # the indexed trajectories are drafted from


def test_bench_war_steps_compares_the_compiled_parts_in_one_run(tmp_path):
    """``--methods ours_tree,py_tree``: the drafter with and without its compiled parts in one run,
    drafts checked bitwise equal (exit 0), the compiled parts restored after the Python method."""
    import importlib.util
    import json

    from megatron_harts.rollout.war import suffix

    streams = [s for s in load_streams(str(STREAMS)) if s.group in ("t0",)]
    path = tmp_path / "s.jsonl"
    path.write_text("".join(json.dumps({"tokens": s.tokens, "loss_mask": s.loss_mask, "group": s.group,
                                        "step": s.step, "traj_id": s.traj_id}) + "\n" for s in streams))
    spec = importlib.util.spec_from_file_location("bench_war_steps", Path(__file__).resolve().parents[1] /
                                                  "scripts" / "bench_war_steps.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    before = suffix.native()
    assert before is not None
    out = tmp_path / "rows.json"
    assert bench.main(["--streams", str(path), "--repeats", "1", "--methods", "ours_tree,py_tree,ours_chain,py_chain",
                       "--out", str(out)]) == 0
    assert suffix.native() is before
    rows = json.loads(out.read_text())["summary"]
    assert [r["method"] for r in rows] == ["ours_tree", "py_tree", "ours_chain", "py_chain"]
    assert rows[0]["accept_len"] == rows[1]["accept_len"] and rows[2]["accept_len"] == rows[3]["accept_len"]


@pytest.mark.parametrize("shape", ["tree", "chain"])
def test_draft_log_places_every_server_draft_and_explains_every_step(tmp_path, monkeypatch, shape):
    """``$HARTS_SUFFIX_DRAFT_LOG`` on a replay (the worker's path on CPU): every draft is found in
    its trajectory (the feed's ``traj`` ids), and each step's advance equals the draft's accepted
    tokens + 1 (nothing lost, nothing unexplained); a log whose drafts lose a matching token, or
    whose contexts are shifted by one, is caught."""
    import json

    from megatron_harts.rollout.war.replay import draft_log_acceptance
    from megatron_harts.rollout.war.sglang_plugin import DRAFT_LOG_ENV, TrajectoryFeed

    streams = load_streams(str(STREAMS))[:12]
    log_path = tmp_path / "drafts.jsonl"
    monkeypatch.setenv(DRAFT_LOG_ENV, str(log_path))
    n = 17
    res = replay_steps(SuffixStep(SuffixCorpus(n, draft_config(n, shape), feed=""), "ours"), streams, batch=4)
    feed = TrajectoryFeed(tmp_path / "feed.jsonl")
    for s in streams:                      # the replay's rids are group/traj_id#turn-k
        feed.add(s.tokens, s.group, f"{s.group}/{s.traj_id}")
    got = draft_log_acceptance(str(log_path), str(feed.path))
    assert got["drafts"] == res.verifies and got["placed"] == got["drafts"] and got["unplaced"] == 0
    assert got["steps"] > 0 and got["short"] == 0 and got["long"] == 0
    assert got["accepted_mean"] > 0.5 and sum(c for c, _ in got["by_source"].values()) == got["drafts"]
    rows = [json.loads(x) for x in log_path.read_text().splitlines()]
    nxt = {}
    for i in range(len(rows) - 1, -1, -1):                 # row -> the same rid's next row
        nxt[i] = nxt.get(rows[i]["rid"])
        nxt[rows[i]["rid"]] = i
    k = next(i for i in range(len(rows)) if nxt.get(i) is not None and rows[nxt[i]]["n"] - rows[i]["n"] >= 2)
    bad = tmp_path / "bad.jsonl"

    def check(rs):
        bad.write_text("".join(json.dumps(r) + "\n" for r in rs))
        return draft_log_acceptance(str(bad), str(feed.path))

    lost = [dict(r) for r in rows]         # the server advanced by 1 where the draft matched more
    lost[nxt[k]]["n"] = rows[k]["n"] + 1
    assert check(lost)["short"] >= 1
    wrong = [dict(r) for r in rows]        # a step advanced by more than its logged draft explains
    wrong[k]["draft"] = [-7] * len(rows[k]["draft"])
    assert check(wrong)["long"] >= 1
    assert check([dict(r, n=r["n"] + 1) for r in rows])["placed"] < got["placed"]      # contexts shifted
