"""Request ids are prefix-free across agent loops. SGLang 0.5.17's scheduler aborts every request
whose rid *starts with* an aborted rid, and its HTTP server aborts a streamed request's rid 2 s
after the stream ends (``create_abort_task``). With ids counted from 0 per loop, the next loop's
(or the next RL step's) first turns reused the finished ones' ids and were aborted mid-turn: seen on
the H200 as every streamed request of a rollout aborted after ~13 of 16 tokens."""
import threading

from megatron_harts.rollout.agent_loop import AgentLoop, RolloutConfig
from megatron_harts.rollout.envs import make_env
from megatron_harts.rollout.tokenizer import EOS, ByteTokenizer
from megatron_harts.rollout.types import Generation


class RecordingEngine:
    """In-process stand-in (named as such): records each rid and ends every turn with <eos>."""

    name = "recording"

    def __init__(self, eos: int):
        self.eos, self.rids, self.lock = eos, [], threading.Lock()

    def generate(self, input_ids, sampling, rid=None):
        with self.lock:
            self.rids.append(rid)
        return Generation([self.eos], [0.0], "stop")


def test_request_ids_are_prefix_free_within_and_across_loops():
    tok = ByteTokenizer()
    eng = RecordingEngine(tok.token_id(EOS))
    cfg = RolloutConfig(group_size=4, max_new_tokens=4, max_turns=1, max_concurrency=4, seed=0)
    for _ in range(2):                                   # two loops, as two RL steps on one server
        loop = AgentLoop([eng], tok, lambda t: make_env("lookup", int(t), seed=0), cfg)
        res = loop.rollout([0, 1, 2])
        assert not res.failed and len(res.trajectories) == 12
    rids = sorted(eng.rids)
    assert len(rids) == 24 and len(set(rids)) == 24
    # sorted order puts any prefix right before an id it prefixes
    clash = [(a, b) for a, b in zip(rids, rids[1:]) if b.startswith(a)]
    assert not clash, clash[:3]
