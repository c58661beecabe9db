"""Task families over real sandboxes: scripted agents (right and wrong) get the rewards they should."""
import shutil

import pytest

from megatron_harts.rollout.envs import code_repair, list_families, make_env, parse_turn
from megatron_harts.rollout.tokenizer import ByteTokenizer
from megatron_harts.rollout.types import Environment


@pytest.fixture(autouse=True, scope="module")
def _need_bwrap():
    if shutil.which("bwrap") is None:
        pytest.fail("bwrap (bubblewrap) is not installed: apt-get install -y bubblewrap", pytrace=False)


@pytest.mark.parametrize("turn, kind, text", [
    ("c</call>", "call", "c"),                                  # <call> pre-filled by the prompt
    ("thinking <call>ls -l</call>", "call", "ls -l"),
    ("<call>a</call> <call>cat b</call>trailing", "call", "cat b"),  # the last call; text after it ignored
    ("</call>", "malformed", "empty command in <call></call>"),
    ("<call>  </call>", "malformed", "empty command in <call></call>"),
    ("<call>cat <obs>x</call>", "malformed", "markup token <obs> inside the command"),
    ("7<eos>", "answer", "7"),
    ("I think <answer> 42 <eos>junk", "answer", "42"),
    ("no markup at all", "answer", "no markup at all"),
])
def test_parse_turn(turn, kind, text):
    t = parse_turn(turn)
    assert (t.kind, t.text) == (kind, text)


def test_registry():
    assert {"lookup", "code_repair"} <= set(list_families())
    with pytest.raises(KeyError, match="unknown task family 'nope'"):
        make_env("nope", 0)
    with pytest.raises(IndexError):
        make_env("lookup", -1)


# ------------------------------------------------------------------------------------ lookup
def test_lookup_scripted_agents():
    tok = ByteTokenizer()
    with make_env("lookup", 3, seed=7) as env:
        assert isinstance(env, Environment)
        assert env.prompt() == f"find {env.target}\n<call>cat "
        r = env.step(f"{env.target}</call>")
        assert r.observation == f"<obs>{env.expected}</obs>\n<answer>" and not r.done
        assert r.info["command"] == f"cat {env.target}" and r.info["exit"] == 0
        assert tok.encode(r.observation)[-1] == tok.token_id("<answer>")
        r = env.step(f"{env.expected}<eos>")
        assert (r.done, r.reward, r.observation) == (True, 1.0, None)
        assert env.step("again").info["error"] == "episode is over"
    with make_env("lookup", 3, seed=7) as env:                  # wrong answer
        env.step(f"{env.target}</call>")
        assert env.step(f"{(int(env.expected) + 1) % 10}<eos>").reward == 0.0
    with make_env("lookup", 3, seed=7, open_bonus=0.1) as env:  # wrong file, then the right digit: no credit
        other = next(n for n in env.files if n != env.target)
        env.step(f"{other}</call>")
        assert env.step(f"{env.expected}<eos>").reward == 0.0
    with make_env("lookup", 3, seed=7, open_bonus=0.1) as env:  # right file, wrong answer: the shaping bonus
        env.step(f"{env.target}</call>")
        assert env.step("x<eos>").reward == pytest.approx(0.1)


def test_lookup_without_a_call_or_with_too_many():
    with make_env("lookup", 0, seed=0) as env:                   # answering without looking: 0
        r = env.step(f"{env.expected}<eos>")
        assert r.done and r.reward == 0.0 and r.info["kind"] == "answer"
    with make_env("lookup", 0, seed=0) as env:                   # two calls spend the budget
        env.step(f"{env.target}</call>")
        r = env.step(f"{env.target}</call>")
        assert r.done and r.reward == 0.0 and r.info["reason"] == "max_turns"


def test_lookup_is_deterministic_and_varied():
    def task(seed, i):
        with make_env("lookup", i, seed=seed) as e:
            return e.target, e.files
    assert task(1, 2) == task(1, 2)
    assert len({str(task(s, i)) for s in range(3) for i in range(5)}) == 15


def test_malformed_call_is_an_error_observation_and_counts_a_turn():
    with make_env("lookup", 1, seed=0, max_turns=3) as env:
        r = env.step("</call>")
        assert not r.done and r.observation.startswith("<obs>error: empty command") and env.turns == 1
        r = env.step(f"{env.target}</call>")
        assert r.observation.endswith("</obs>\n<answer>")      # the last turn is pre-filled with <answer>
        assert env.step(f"{env.expected}<eos>").reward == 1.0


def test_lookup_fork_branches_independently():
    with make_env("lookup", 2, seed=3) as env:
        env.step(f"{env.target}</call>")
        with env.fork() as branch:
            assert branch.turns == 1 and branch.calls == env.calls
            assert branch.step("wrong<eos>").reward == 0.0
            assert env.step(f"{env.expected}<eos>").reward == 1.0


def test_tool_output_cannot_inject_markup():
    with make_env("lookup", 0, seed=0, max_turns=3) as env:
        r = env.step("a; printf '<%s><%s>' /obs eos</call>")        # the tool prints markup
        assert "<eos>" not in r.observation and "&lt;/obs>&lt;eos>" in r.observation
        r = env.step("<call>a<eos></call>")                          # an error message quoting it
        assert r.info["error"] == "markup token <eos> inside the command" and "<eos>" not in r.observation


# ------------------------------------------------------------------------------- code repair
def _heredoc(content: str) -> str:
    return f"<call>cat > solution.py <<'HARTS_EOF'\n{content}HARTS_EOF</call>"


@pytest.mark.parametrize("index", [0, 1, 5, 9])
def test_code_repair_fix_gets_reward_noop_does_not(index):
    with make_env("code_repair", index, seed=0) as env:
        assert "solution.py" in env.prompt() and "python3 test_solution.py" in env.prompt()
        assert env.function.name in env.prompt()
        with env.fork() as noop:
            r = noop.step("<call>python3 test_solution.py</call>")
            assert r.info["exit"] == 1 and "FAIL case" in r.observation
            r = noop.step("<answer>nothing to fix<eos>")
            assert (r.done, r.reward, r.info["tests_passed"]) == (True, 0.0, False)
        with env.fork() as cheat:                               # editing the test does not help
            cheat.step("<call>echo 'raise SystemExit(0)' > test_solution.py && python3 test_solution.py</call>")
            assert cheat.step("<answer>done<eos>").reward == 0.0
        r = env.step(_heredoc(env.reference_solution))          # the inverse mutation, through a real shell
        assert r.info["exit"] == 0 and not r.done
        r = env.step("<call>python3 test_solution.py</call>")
        assert r.info["exit"] == 0 and "cases passed" in r.observation
        r = env.step("<answer>fixed<eos>")
        assert (r.done, r.reward) == (True, 1.0)


def test_code_repair_budget_end_is_graded():
    with make_env("code_repair", 2, seed=0, max_turns=1) as env:
        r = env.step(_heredoc(env.reference_solution))
        assert r.done and r.reward == 1.0 and r.info["reason"] == "max_turns"


def test_code_repair_tasks_are_deterministic_and_distinct():
    tasks = [code_repair.select(0, i)[:2] for i in range(24)]
    assert len(set(tasks)) == 24
    assert len({fn for fn, _ in tasks}) == len(code_repair.CATALOG)
    assert code_repair.select(0, 5)[:2] == tasks[5]
    assert [code_repair.select(1, i)[:2] for i in range(4)] != tasks[:4]
