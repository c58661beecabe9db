"""Belayer, environment side: checkpoint / restore of real bubblewrap + overlayfs sandboxes under
real faults (SIGKILLed, SIGSTOPped (hung) and garbage-fed tool processes, sandboxes destroyed
behind their owner's back), prefix consistency (a restore to an earlier turn is reported so the
context is cut back), and the checker's sensitivity (a recovery that hides the cut is caught).

Reference for every check: the same scripted actions in a fresh environment without faults.
"""
import shutil
import time

import pytest

from megatron_harts.rollout.belayer.env import CheckpointedEnv, CheckpointPolicy, PrefixCut, suspect
from megatron_harts.rollout.belayer.faults import SandboxFaultInjector, lose_sandbox
from megatron_harts.rollout.envs import make_env
from megatron_harts.rollout.sandbox import SandboxError, SandboxLimits
from megatron_harts.rollout.types import StepResult

pytestmark = pytest.mark.timeout(120)

# a stateful code_repair episode: reads, writes, appends, copies, deletes, runs the tests
ACTIONS = ["<call>head -3 solution.py</call>", "<call>echo a > notes.txt</call>",
           "<call>echo b >> notes.txt; sleep 0.05</call>",
           "<call>cp solution.py s2.py && sed -i 's/def /def  /' s2.py && wc -c s2.py</call>",
           "<call>cat notes.txt; ls</call>", "<call>rm notes.txt; ls</call>",
           "<call>python3 test_solution.py | tail -2</call>", "<call>ls; cat notes.txt</call>"]


@pytest.fixture(autouse=True, scope="module")
def _needs_bwrap():
    if shutil.which("bwrap") is None:
        pytest.fail("bubblewrap is needed (apt-get install -y bubblewrap)")


def _make():
    return make_env("code_repair", 3, seed=0, max_turns=10, limits=SandboxLimits(timeout_s=1.5))


@pytest.fixture(scope="module")
def reference():
    env = _make()
    try:
        return [env.step(a).observation for a in ACTIONS]
    finally:
        env.close()


def _run(env, actions, gap_s=0.0):
    """Step through ``actions`` like an agent: on a PrefixCut(k) go back to action k."""
    obs, cuts, i = [], [], 0
    while i < len(actions):
        time.sleep(gap_s)
        try:
            obs[i:] = [env.step(actions[i]).observation]
            i += 1
        except PrefixCut as cut:
            cuts.append((i, cut.turn))
            del obs[cut.turn:]
            i = cut.turn
    return obs, cuts


@pytest.mark.parametrize("kind", ["kill", "hang", "garbage"])
def test_process_faults_are_recovered_with_identical_observations(kind, reference):
    env = CheckpointedEnv(_make)
    try:
        with SandboxFaultInjector({kind: 1.0}, rate=0.6, budget=2, seed=3) as inj:
            obs, cuts = _run(env, ACTIONS, gap_s=0.01)
        landed = inj.landed()
        assert landed, "no fault landed (the check would be vacuous)"
        assert obs == reference and not cuts
        seen = [f["why"] for f in env.stats["faults"]]
        assert seen, "faults landed but none was detected"
        want = {"kill": ("sandbox error", "killed"), "hang": ("hang",), "garbage": ("garbage",)}[kind]
        assert any(w.startswith(want) for w in seen), seen
        # a loaded machine can add a real timeout of a slow command: also a fault, also recovered
        assert all(w.startswith(want + ("hang",)) for w in seen), seen
        assert len(env.stats["restores"]) == len(seen)
    finally:
        env.close()


def test_lost_sandbox_is_restored_from_checkpoint_and_replay(reference):
    env = CheckpointedEnv(_make, policy=CheckpointPolicy(every=3))     # sparse: restores replay commands
    try:
        obs = []
        for i, a in enumerate(ACTIONS):
            if i in (2, 5, 7):
                assert lose_sandbox(env.env.sandbox)
            obs.append(env.step(a).observation)
        assert obs == reference
        restores = env.stats["restores"]
        assert [r["to"] for r in restores] == [2, 5, 7]
        assert all(r["reached"] == r["to"] for r in restores)
        assert sum(r["replayed"] for r in restores) > 0            # replay of logged commands happened
        assert all(r["from_checkpoint"] % 3 == 0 for r in restores)
        assert env.stats["modes"].get("empty") == 1          # nothing written at the start: no copy
    finally:
        env.close()


def test_checkpoint_recovery_cuts_the_context_back(reference):
    """``recovery="checkpoint"``: no replay, the environment goes back to its last checkpoint and
    step raises PrefixCut with that turn; redoing the actions from there ends consistent."""
    env = CheckpointedEnv(_make, recovery="checkpoint", policy=CheckpointPolicy(every=3))
    try:
        obs, cuts, i = [], [], 0
        lost = {4}
        while i < len(ACTIONS):
            if i in lost:
                lost.discard(i)
                lose_sandbox(env.env.sandbox)
            try:
                obs[i:] = [env.step(ACTIONS[i]).observation]
                i += 1
            except PrefixCut as cut:
                cuts.append((i, cut.turn))
                del obs[cut.turn:]
                i = cut.turn
        assert cuts == [(4, 3)]
        assert obs == reference
    finally:
        env.close()


def test_hiding_the_cut_is_caught(reference):
    """The deliberately broken recovery (restore to the checkpoint but keep the context) makes the
    observations disagree with the fault-free episode: the check can fail."""
    env = CheckpointedEnv(_make, recovery="checkpoint", policy=CheckpointPolicy(every=4), break_recovery="no_cut")
    try:
        obs = []
        for i, a in enumerate(ACTIONS):
            if i == 6:
                lose_sandbox(env.env.sandbox)
            obs.append(env.step(a).observation)
        assert obs != reference
    finally:
        env.close()


def test_replay_divergence_cuts_at_the_first_differing_turn():
    """A nondeterministic command's output cannot be replayed: the restore stops before it and
    the caller is told to cut the context there."""
    acts = ["<call>echo x > a</call>", "<call>head -c 8 /dev/urandom | od -An -tx1 | tee r</call>",
            "<call>cat a</call>", "<call>cat r</call>"]
    env = CheckpointedEnv(_make, policy=CheckpointPolicy(enabled=False))
    try:
        for a in acts[:3]:
            env.step(a)
        lose_sandbox(env.env.sandbox)
        with pytest.raises(PrefixCut) as e:
            env.step(acts[3])
        assert e.value.turn == 1 and len(env.actions) == 1
        assert env.step("<call>cat a</call>").observation.startswith("<obs>x")
    finally:
        env.close()


def test_checkpoint_policy_overlaps_skips_unchanged_and_goes_inline():
    env = CheckpointedEnv(_make, policy=CheckpointPolicy(ema=1.0))     # predict from the last interval only
    try:
        env.step(ACTIONS[0])                     # reads only: the upper dir is unchanged
        assert env.checkpoints[-1].mode == "unchanged" and env.checkpoints[-1].files == env.checkpoints[0].files
        time.sleep(0.2)
        env.step(ACTIONS[1])                     # writes; nothing predicted yet / long gap: overlapped
        assert env.checkpoints[-1].mode == "background"
        time.sleep(0.2)
        env.step(ACTIONS[2])
        assert env.checkpoints[-1].mode == "background"
        env.step(ACTIONS[3])                     # no generation gap: the copy cannot overlap
        assert env.checkpoints[-1].mode == "inline"
        assert (env.checkpoints[-1].files / "s2.py").is_file()
    finally:
        env.close()
    env = CheckpointedEnv(_make, policy=CheckpointPolicy(inline=False, ema=1.0))
    try:
        env.step(ACTIONS[1])
        env.step(ACTIONS[2])
        env.step(ACTIONS[3])
        assert env.stats["modes"].get("skipped", 0) >= 1 and "inline" not in env.stats["modes"]
    finally:
        env.close()


def test_state_copies_share_only_unchanged_immutable_attributes():
    """The checkpoint's state copy skips the deep copy of an attribute whose deep copy was the
    object itself while the attribute still holds it; anything mutable, or reassigned, is copied."""
    env = CheckpointedEnv(_make)
    try:
        inner = env.env
        assert env.checkpoints[0].state["_expected"] is inner._expected      # immutable: shared
        inner.calls.append("x")
        inner.extra = (1, [2])                       # a tuple holding a list: not immutable
        inner.consts = (1, ("a", 2.5))
        s1 = env._state()
        inner.calls.append("y")
        inner.extra[1].append(3)
        s2 = env._state()
        assert s1["calls"] == ["x"] and s2["calls"] == ["x", "y"] and s1["calls"] is not inner.calls
        assert s1["extra"] == (1, [2]) and s2["extra"] == (1, [2, 3]) and s2["extra"] is not inner.extra
        assert s1["consts"] is inner.consts and s2["consts"] is inner.consts
        inner.consts = (2, ("b", 0.5))               # reassigned: the new value, not the old one
        assert env._state()["consts"] == (2, ("b", 0.5))
        env.step(ACTIONS[1])
        env.restore(0)                               # a restore brings the copied values back
        assert env.env.calls == [] and env.env._expected is inner._expected
    finally:
        env.close()


def test_baseline_recreate_and_replay_reaches_the_same_state(reference):
    env = CheckpointedEnv(_make)
    try:
        for a in ACTIONS[:6]:
            env.step(a)
        assert env.recreate_and_replay() > 0
        assert env.step(ACTIONS[6]).observation == reference[6]
    finally:
        env.close()


def test_suspect_rules():
    assert suspect(StepResult("<obs>ok</obs>", False, info={"tool": "run", "exit": 0})) is None
    assert suspect(StepResult("<obs>x</obs>", False, info={"tool": "run", "exit": -9})) == "killed"
    assert suspect(StepResult("<obs>x</obs>", False, info={"tool": "run", "exit": 1, "timed_out": True})) == "hang"
    assert suspect(StepResult("<obs>a\ufffdb</obs>", False, info={"tool": "run", "exit": 0})) == "garbage"
    assert suspect(StepResult("<obs>exit 137</obs>", False, info={"tool": "run", "exit": 137})) is None


def _scripted(env, outcomes):
    """Replace ``env``'s tool runs by ``outcomes``: ``(why, observation)`` per run, in order."""
    runs = iter(outcomes)

    def _try(action):
        why, obs = next(runs)
        return why, StepResult(obs, False, info={"tool": "run", "exit": 0})
    env._try = _try


def test_mixed_fault_kinds_are_retried_and_one_kind_in_a_row_is_the_tools_behaviour():
    """A kill, a hang and garbage on three runs of one step are independent faults: the step is
    run again until a clean result comes (accepting the garbage, as before, let an injected fault
    into a trajectory: CI failure of stop 38). The same kind on max_retries + 1 runs in a row is the
    tool's own behaviour and accepted; more than max_attempts faulty runs fail the step. Each case
    is the first step of a fresh environment (a restore goes back to the empty sandbox)."""
    def first_step(outcomes, action="<call>ls</call>"):
        env = CheckpointedEnv(_make, policy=CheckpointPolicy(enabled=False), max_retries=2, max_attempts=6)
        try:
            _scripted(env, outcomes)
            return env.step(action).observation, [f["why"] for f in env.stats["faults"]]
        finally:
            env.close()

    assert first_step([("killed", "<obs>k</obs>"), ("hang", "<obs>h</obs>"), ("garbage", "<obs>\ufffd1</obs>"),
                       (None, "<obs>clean</obs>")]) == ("<obs>clean</obs>", ["killed", "hang", "garbage"])
    obs, whys = first_step([("killed", "<obs>k</obs>")] + [("garbage", f"<obs>\ufffd{i}</obs>") for i in range(3)],
                           "<call>head -c 9 /dev/urandom</call>")
    assert obs == "<obs>\ufffd2</obs>" and whys == ["killed"] + ["garbage"] * 3
    with pytest.raises(SandboxError, match="failed 6 times"):
        first_step([("killed", "<obs>k</obs>"), ("hang", "<obs>h</obs>")] * 3)
