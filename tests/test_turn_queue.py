"""Libra's queue policies in the real agent loop (``AgentLoop(turn_queue=TurnQueue(...))``): which
ready turn gets a free slot. In-process stand-ins (named as such) make the order exact: one slot,
an engine that answers every turn with a tool call, environments whose tool succeeds ("ok" tasks)
or fails ("err" tasks) and that end after three turns."""
import threading

import pytest

from megatron_harts.rollout.agent_loop import AgentLoop, RolloutConfig
from megatron_harts.rollout.libra.cmlfq import CMLFQ, TurnQueue
from megatron_harts.rollout.tokenizer import END_CALL, ByteTokenizer
from megatron_harts.rollout.types import Generation, StepResult


class ScriptedToolEnv:
    """Stand-in environment: the tool exits 0 for task "ok", 1 for "err"; done after 3 turns."""

    def __init__(self, task: str):
        self.task, self.turns = task, 0

    def prompt(self) -> str:
        return f"task {self.task}"

    def step(self, action: str) -> StepResult:
        self.turns += 1
        if self.turns >= 3:
            return StepResult(None, True, 1.0 if self.task == "ok" else 0.0, {})
        code = 0 if self.task == "ok" else 1
        return StepResult(f"exit {code}", False, None, {"tool": "run", "exit": code})

    def fork(self):
        raise NotImplementedError

    def close(self) -> None:
        pass


class OrderEngine:
    """Stand-in engine: records (episode, turn) in serving order, answers 3 tokens + </call>."""

    name = "order"

    def __init__(self, tok):
        self.order, self.lock, self.end = [], threading.Lock(), tok.token_id(END_CALL)

    def generate(self, input_ids, sampling, rid=None):
        with self.lock:
            self.order.append(rid.split("-")[0])             # "<traj>#<turn>"
        return Generation([65, 66, 67, self.end], [0.0] * 4, "stop")


def _order(turn_queue):
    tok = ByteTokenizer()
    eng = OrderEngine(tok)
    cfg = RolloutConfig(group_size=2, max_new_tokens=4, max_concurrency=1, temperature=0.0)
    loop = AgentLoop([eng], tok, ScriptedToolEnv, cfg, turn_queue=turn_queue)
    res = loop.rollout(["ok", "err"], ["ok", "err"])
    assert not res.failed and len(res.trajectories) == 4
    assert turn_queue is None or len(turn_queue) == 0
    return eng.order


def test_cmlfq_serves_programs_whose_tools_succeed_first():
    order = _order(TurnQueue("cmlfq"))
    # all first turns FCFS; then the ok programs (promoted after a success) finish before any err
    # program (demoted after an error) gets its second turn
    assert order[:4] == ["ok/0#0", "ok/1#0", "err/0#0", "err/1#0"]
    assert order[4:8] == ["ok/0#1", "ok/1#1", "ok/0#2", "ok/1#2"], order
    assert sorted(order[8:]) == ["err/0#1", "err/0#2", "err/1#1", "err/1#2"]


def test_fcfs_queue_serves_by_arrival_and_no_queue_still_runs():
    fcfs = _order(TurnQueue("fcfs"))
    assert fcfs == [f"{p}#{t}" for t in range(3) for p in ("ok/0", "ok/1", "err/0", "err/1")]
    assert sorted(_order(None)) == sorted(fcfs)              # without a queue: the executor's own order


def test_turn_queue_rejects_two_buckets_and_unknown_policies():
    with pytest.raises(ValueError, match="one-bucket"):
        TurnQueue(CMLFQ(buckets=2))
    with pytest.raises(ValueError, match="queue policy must be one of"):
        TurnQueue("lifo")
