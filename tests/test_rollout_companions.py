"""The RL loop with its companions switched on, on real parts (embedded engine servers in their own
processes, bubblewrap sandboxes, the Megatron trainer): WAR's scheduler places the turns
(``router="war"``), Libra's C-MLFQ orders the waiting turns (``turn_queue="cmlfq"``) and Belayer's
supervisor keeps a shadow worker (``shadows=1``). An engine server
SIGKILLed at the start of step 1 is replaced by the shadow; the step loses no trajectory, every
turn still runs on the pushed weights, and the row counts the failover."""
import shutil

import pytest

from megatron_harts.rollout.agent_loop import RolloutConfig
from megatron_harts.rollout.belayer.faults import kill_server
from megatron_harts.rollout.cli import parse_args
from megatron_harts.rollout.loop import LoopConfig, RLLoop

pytestmark = pytest.mark.timeout(600)


class _KillAtStep(RLLoop):
    """Kills the server serving slot 0 right before step ``kill_step``'s rollout."""
    kill_step = 1

    def _rollout(self, step):
        if step == self.kill_step:
            self.killed = kill_server(self.supervisor.worker(0).server)
        return super()._rollout(step)


def test_loop_with_war_router_and_shadow_survives_a_killed_engine(tmp_path):
    if shutil.which("bwrap") is None:
        pytest.fail("bubblewrap is needed (apt-get install -y bubblewrap)")
    cfg = LoopConfig(steps=2, engine="embedded", num_engines=1, shadows=1, router="war", turn_queue="cmlfq",
                     model="tiny",
                     tasks_per_step=2, out=str(tmp_path), seed=0,
                     rollout=RolloutConfig(group_size=2, branch_turn=1, branch_factor=2, max_turns=2,
                                           max_new_tokens=6, max_concurrency=4))
    loop = _KillAtStep(cfg)
    rows = loop.run()
    assert [r["step"] for r in rows] == [0, 1]
    assert [r["failovers"] for r in rows] == [0, 1], rows
    assert rows[1]["failed"] == 0 and rows[1]["trajectories"] == rows[0]["trajectories"] >= 4
    assert rows[1]["rollout_weight_versions"] == ["v1"]          # the shadow got the step-0 update
    assert all(r["router"] == "war" and 0.0 <= r["router_cache_hit"] <= 1.0 for r in rows), rows
    assert rows[1]["failover_s"][0] < 5.0                        # a promotion, not a cold start
    assert loop.supervisor is None                               # closed: every server stopped


@pytest.mark.parametrize("argv,msg", [
    (["--shadows", "1", "--ray"], "--shadows needs engines started by the loop"),
    (["--shadows", "1", "--engine-urls", "http://127.0.0.1:1"], "--shadows needs engines started by the loop"),
    (["--shadows", "-1"], "--shadows must be >= 0"),
    (["--router", "magic"], "invalid choice: 'magic'"),
    (["--turn-queue", "lifo"], "invalid choice: 'lifo'"),
])
def test_companion_flags_are_validated(argv, msg, capsys):
    with pytest.raises(SystemExit) as e:
        parse_args(argv)
    assert e.value.code == 2 and msg in capsys.readouterr().err


@pytest.mark.parametrize("argv,msg", [
    (["--warmup-target-reward", "0.5"], "--warmup-target-reward needs --sft-warmup-steps N > 0"),
    (["--branch-turn", "-1"], "--branch-turn must be >= 0, got -1"),
    (["--temperature", "-0.5"], "--temperature must be >= 0, got -0.5"),
    (["--sft-warmup-steps", "-3"], "--sft-warmup-steps must be >= 0, got -3"),
    (["--sft-warmup-steps", "2", "--warmup-lr", "-0.001"], "--warmup-lr must be > 0, got -0.001"),
])
def test_loop_flags_are_validated(argv, msg, capsys):
    with pytest.raises(SystemExit) as e:
        parse_args(argv)
    err = capsys.readouterr().err
    assert e.value.code == 2 and msg in err and "Traceback" not in err, err


def test_companion_flags_reach_the_config():
    cfg = parse_args(["--router", "war", "--shadows", "2", "--num-engines", "2", "--turn-queue", "cmlfq"])
    assert (cfg.router, cfg.shadows, cfg.num_engines, cfg.turn_queue) == ("war", 2, 2, "cmlfq")
    with pytest.raises(ValueError, match="turn_queue must be one of"):
        LoopConfig(turn_queue="lifo")
    with pytest.raises(ValueError, match="router must be one of"):
        LoopConfig(router="random")
