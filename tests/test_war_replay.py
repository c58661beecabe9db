"""The offline replay (``war.replay``): its accounting, and streams sampled from a served model.

A drafter that knows the stream (oracle) must reach budget + 1 tokens per verification exactly as
often as the turn lengths allow; one that never drafts, or drafts the stream shifted by one
token, must get 1.0; every model token is emitted exactly once. ``sampled_streams`` runs the
agent loop on the embedded engine (a tiny checkpoint, real sandboxes) and yields one stream per
episode, labelled by round and task, whose model turns are the engine's own tokens.
"""
import math

import pytest

from megatron_harts.rollout.war.replay import (OursMethod, Stream, accepted, load_streams, replay, sampled_streams,
                                              save_streams)
from megatron_harts.rollout.war.suffix import DrafterConfig


class _Known:
    """Drafts from the stream itself: ``shift`` 0 is an oracle, 1 drafts the wrong tokens."""

    def __init__(self, budget, shift=0, name="oracle"):
        self.name, self.budget, self.shift, self.st = name, budget, shift, None

    def start(self, stream, prompt_end):
        self.st = stream

    def draft(self, context):
        p = len(context) + self.shift
        return [list(self.st.tokens[p:p + self.budget])] if self.budget else []

    def accept(self, context, new):
        pass

    def stop(self):
        pass

    def finish(self, stream):
        pass


def _streams():
    a = Stream([1, 5, 6, 7, 8, 9, 10, 11, 12, 3, 3, 4, 13, 14], [0, 0, 1, 1, 1, 1, 1, 1, 1, 0, 0, 1, 1, 1], "g", 0, "a")
    b = Stream([1, 5, 20, 21, 22, 23, 24], [0, 0, 1, 1, 1, 1, 1], "g", 1, "b")
    return [a, b]


def test_replay_accounting_oracle_null_and_shifted():
    streams = _streams()
    model_tokens = sum(sum(s.loss_mask) for s in streams)
    turns = [b - a for s in streams for a, b in s.turns()]
    assert turns == [7, 3, 5]
    for budget in (1, 2, 4):
        r = replay(_Known(budget), streams)
        assert r.emitted == model_tokens
        assert r.steps == sum(math.ceil(n / (budget + 1)) for n in turns)
    for m in (_Known(0, name="null"), _Known(3, shift=1, name="shifted")):
        r = replay(m, streams)
        assert r.emitted == model_tokens and r.accept_len == 1.0 and r.steps == model_tokens
    assert accepted([[1, 2, 9], [1, 2, 3, 4]], [1, 2, 3]) == 3 and accepted([], [1]) == 0


def test_sampled_streams_from_the_embedded_engine(tmp_path):
    from megatron_harts.rollout.belayer.tiny import make_tiny_checkpoint
    from megatron_harts.rollout.engines import EmbeddedServer

    ck = make_tiny_checkpoint(tmp_path / "ckpt", call_prob=0.2, eos_prob=0.05)
    with EmbeddedServer(ck["path"], threads=1, log_path=str(tmp_path / "engine.log")) as srv:
        streams = sampled_streams(srv.engine(timeout=300), "lookup", n_tasks=2, samples=2, steps=2,
                                  max_new_tokens=10, max_turns=2)
    assert len(streams) == 8
    assert sorted({(s.step, s.group) for s in streams}) == [(0, "t0"), (0, "t1"), (1, "t0"), (1, "t1")]
    assert len({s.traj_id for s in streams}) == 8
    for s in streams:
        assert len(s.tokens) == len(s.loss_mask) and 1 <= len(s.turns()) <= 2 and sum(s.loss_mask) >= 1
    r = replay(OursMethod(DrafterConfig(max_depth=16, budget=4)), streams)
    assert r.emitted == sum(sum(s.loss_mask) for s in streams) and r.accept_len >= 1.0


@pytest.mark.parametrize("name", ["streams.jsonl", "streams.jsonl.gz"])
def test_saved_streams_load_back_equal_and_gz_is_gzip(tmp_path, name):
    """``save_streams`` -> ``load_streams`` is the identity; a ``.gz`` name gets a real gzip file
    (``--save-streams`` once wrote plain JSONL under a ``.gz`` name, which ``load_streams`` rejects)."""
    streams = [Stream([5, 6, 7, 8], [0, 0, 1, 1], "t0", 0, "s0/a"), Stream([5, 9], [0, 1], "t1", 2, "s2/b")]
    path = tmp_path / name
    save_streams(streams, str(path))
    assert (path.read_bytes()[:2] == b"\x1f\x8b") == name.endswith(".gz")
    back = load_streams(str(path))
    assert [(s.tokens, s.loss_mask, s.group, s.step, s.traj_id) for s in back] == \
        [(s.tokens, s.loss_mask, s.group, s.step, s.traj_id) for s in streams]
    plain = tmp_path / "plain.jsonl.gz"
    plain.write_text(path.read_text() if not name.endswith(".gz") else "{}\n")
    with pytest.raises(ValueError, match="plain.jsonl.gz"):
        load_streams(str(plain))
