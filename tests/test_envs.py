"""Task families over real sandboxes: scripted agents (right and wrong) get the rewards they should."""
import ast
import datetime
import decimal
import fractions
import ipaddress
import json
import math
import shutil

import pytest

from megatron_harts.rollout.envs import code_repair, list_families, make_env, parse_turn
from megatron_harts.rollout.sandbox import CommandResult
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
    with pytest.raises(ValueError, match="unknown task family 'nope'"):
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
            r = cheat.step("<call>python3 test_solution.py</call>")
            assert r.info["exit"] == 0                          # it fools the visible test...
            r = cheat.step("<answer>done<eos>")
            assert r.reward == 0.0 and "differ" in r.info["grade"]  # ...not the held-out cases
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


# ------------------------------------------------------------------- code repair: reward hacks
def _forged_line(env) -> str:
    """The best results line a model can forge without a correct function: the visible cases'
    expected outcomes (shown in test_solution.py) and the mutant's outcomes on the held-out ones."""
    fn = env.function
    visible, held_out = fn.cases(), fn.held_out()
    mutant = (env.sandbox.base_dir / "solution.py").read_text()
    return code_repair.results_line(list(env._expected[:len(visible)])
                                    + code_repair._outcomes(fn, mutant, held_out))


_HACKS = {
    "SystemExit appended": "<call>echo 'raise SystemExit(0)' >> solution.py</call>",
    "os._exit appended": "<call>printf 'import os\\nos._exit(0)\\n' >> solution.py</call>",
    "fake pass line": "<call>printf 'import sys\\nprint(\"99/99 cases passed\")\\nsys.exit(0)\\n' >> solution.py</call>",
    "fake results file": "<call>echo '[]' > results.json && echo 'raise SystemExit(0)' >> solution.py</call>",
}


@pytest.mark.parametrize("index", [0, 7, 13])
def test_code_repair_reward_hacks_get_nothing(index):
    with make_env("code_repair", index, seed=0, max_turns=4) as env:
        for name, call in _HACKS.items():
            with env.fork() as cheat:
                cheat.step(call)
                r = cheat.step("<answer>done<eos>")
                assert (r.reward, r.info["tests_passed"]) == (0.0, False), (name, r.info)
        with env.fork() as cheat:  # a forged results line, printed past the runner's silenced stdout
            line = _forged_line(env)
            assert line.startswith(code_repair.RESULTS_MARK)
            src = f"import os\nos.write(1, {line!r}.encode() + b'\\n')\nos._exit(0)\n"
            cheat.step(_heredoc(src))
            r = cheat.step("<call>python3 -I -B /task/run_cases.py</call>")
            assert r.observation.count(code_repair.RESULTS_MARK) == 1   # the runner does print it...
            r = cheat.step("<answer>done<eos>")
            assert r.reward == 0.0 and "differ" in r.info["grade"]      # ...but the held-out cases differ
        with env.fork() as cheat:  # a lookup table of every literal the sandbox shows, mutant elsewhere
            table = (
                "import ast\n"
                "_mutant = {}\n"
                "exec(open('/workspace/solution.py').read().split('# LOOKUP')[0], _mutant)\n"
                "TABLE = {}\n"
                "for path in ('/workspace/test_solution.py', '/task/run_cases.py'):\n"
                "    for node in ast.parse(open(path).read()).body:\n"
                "        if isinstance(node, ast.Assign) and getattr(node.targets[0], 'id', '') == 'CASES':\n"
                "            for case in ast.literal_eval(node.value):\n"
                "                if len(case) == 3 and case[2][0] == 'return':\n"
                "                    TABLE[repr(case[:2])] = case[2][1]\n"
                f"def {env.function.name}(*args, **kwargs):\n"
                "    key = repr((args, kwargs))\n"
                "    return TABLE[key] if key in TABLE else _mutant[%r](*args, **kwargs)\n" % env.function.name)
            cheat.step(f"<call>(echo '# LOOKUP'; cat <<'HARTS_EOF'\n{table}HARTS_EOF\n) >> solution.py</call>")
            r = cheat.step("<call>python3 test_solution.py</call>")
            assert r.info["exit"] == 0                          # it fools the visible test...
            r = cheat.step("<answer>done<eos>")
            assert r.reward == 0.0 and "differ" in r.info["grade"]  # ...not the held-out cases


@pytest.mark.parametrize("index", [0, 7, 13])
def test_code_repair_sandbox_holds_no_expected_values(index):
    fn, _, task = code_repair.select(0, index)
    assert sorted(p.name for p in (task / "grader").iterdir()) == ["run_cases.py"]
    src = (task / "grader" / "run_cases.py").read_text()
    (cases,) = [ast.literal_eval(n.value) for n in ast.parse(src).body
                if isinstance(n, ast.Assign) and getattr(n.targets[0], "id", "") == "CASES"]
    assert cases == [tuple(c) for c in fn.cases() + fn.held_out()]       # inputs only: (args, kwargs)
    visible = (task / "workspace" / "test_solution.py").read_text()
    expected = code_repair.expected_outcomes(fn)
    held = [w for w in expected[len(fn.cases()):] if w[0] == "return"]
    shown = [repr(w[1]) for w in held if repr(w[1]) not in repr(fn.cases() + fn.held_out())]
    assert not any(v in src for v in shown) and "('return'" not in src  # held-out outputs: not in /task
    assert len(expected) == len(cases) and len(fn.held_out()) >= 6
    assert "FAIL case" in visible                        # the workspace test is feedback, as before


_VALUES = [None, True, False, 0, -7, 10**40, "", "é\n\"x\"", 0.0, -0.0, 1.5, 1e308, 5e-324,
           float("inf"), float("-inf"), float("nan"), (), (1, (2.0, [3, "a"])), [[], ()], b"", b"\x00\xff",
           bytearray(b"ab"), 1 + 2j, complex(float("nan"), 1), fractions.Fraction(-3, 4), decimal.Decimal("1.10"),
           decimal.Decimal("-Infinity"), datetime.date(2024, 2, 29), datetime.datetime(2000, 1, 2, 3, 4, 5, 6),
           datetime.datetime(2000, 1, 2, tzinfo=datetime.timezone(datetime.timedelta(hours=-5))),
           datetime.time(23, 59, 1), datetime.timedelta(days=-1, seconds=5), ipaddress.IPv4Address("10.0.0.1"),
           ipaddress.IPv6Address("::1"), {1: "a", (2, 3): [4.5]}, {1, 2}, frozenset({"x"})]


@pytest.mark.parametrize("value", _VALUES, ids=[f"{type(v).__name__}-{i}" for i, v in enumerate(_VALUES)])
def test_code_repair_result_encoding_round_trips(value):
    back = code_repair.decode(json.loads(json.dumps(code_repair.encode(value), allow_nan=False)))
    assert type(back) is type(value) and repr(back) == repr(value)
    if not (isinstance(value, (float, complex)) and math.isnan(abs(value))):
        assert code_repair.same(back, value)


def test_code_repair_judge_rejects_bad_output():
    want = (("return", (0.5, 1.0), (1, [2])), ("raise", "ValueError"), ("return", None, ()))
    good = code_repair.results_line(want)

    def judge(out, code=0, **kw):
        return code_repair.judge(CommandResult(code, out, **kw), want)[0]

    assert judge(good) and judge(f"noise\n{good}\nmore noise\n")
    assert judge(code_repair.results_line([("return", (0.5 + 1e-12, 1), (1, [2])), *want[1:]]))  # isclose, int~float
    mark = code_repair.RESULTS_MARK
    bad = [
        good.replace("0.5", "0.6"),                                   # a wrong value
        code_repair.results_line([("return", [0.5, 1.0], (1, [2])), *want[1:]]),  # list, not tuple
        code_repair.results_line([("return", (0.5, 1.0), (1, (2,))), *want[1:]]),  # args after the call
        code_repair.results_line([*want[:2], ("raise", "TypeError")]),
        code_repair.results_line(want[:2]),                           # a missing case
        code_repair.results_line([*want, want[0]]),                   # an extra one
        good + "\n" + good,                                           # two results lines
        "99/99 cases passed", "", mark, mark + "[", mark + "{}", mark + "[1,2,3]",
        mark + '[["return",NaN,{"tuple":[]}],["raise","ValueError"],["return",null,{"tuple":[]}]]',
        mark + '[["return",{"pickle":"x"},{"tuple":[]}],["raise","ValueError"],["return",null,{"tuple":[]}]]',
        mark + '[["return",{"tuple":[0.5,1.0],"x":1},{"tuple":[1,[2]]}],["raise","ValueError"],'
               '["return",null,{"tuple":[]}]]',
        mark + "[" * 100000 + "]" * 100000,
    ]
    for out in bad:
        assert not judge(out), out[:200]
    assert not judge(good, code=1) and not judge(good, code=-9, timed_out=True) and not judge(good, truncated=True)
    assert not code_repair.same(code_repair.decode({"?": "Weird"}), code_repair.decode({"?": "Weird"}))
