"""``code_repair``: fix a one-token bug in a small standard-library function, graded by real tests.

Building a task (once per process per mutant, cached in :func:`~.base.task_dir`):
1. extract a pure function from the standard library's source (``CATALOG``) with the module-level
   names it uses: imports, literal constants, exception classes and same-module helper functions
   (copied unchanged), all through ``ast`` (comments are lost, docstrings kept);
2. run the original (on the host) on fixed inputs (a per-function seeded generator: the visible
   cases, then the held-out ones from another seed) and record the outputs (return value and the
   arguments after the call, for in-place functions, or the exception name); the visible cases go
   as literals into ``test_solution.py`` (feedback; imports only ``solution`` and the stdlib), the
   inputs of all cases into the runner ``run_cases.py``, the outputs stay on the host (Grading);
3. mutate one site of the target function (a comparison operator flipped ``<``/``<=``,
   ``==``/``!=``, ...; ``+``/``-`` swapped, also in ``+=``; ``and``/``or`` swapped; a numeric
   constant plus one). All mutants of a function are screened in one sandboxed process against
   the recorded cases under a budget of traced Python events (20x the original's), so which
   mutants are tasks never depends on machine load: a task is a mutant that fails some visible
   case and some held-out case within the budget (equivalent mutants and endless loops are
   dropped). The real grader then runs in a sandbox on the original (must pass) and on each
   chosen mutant (must fail).

Cost (2 busy cores): 0.3-0.7 s the first time a process meets a function, 0.1-0.2 s per new
mutant, ~10 ms per environment afterwards.

Task ``(seed, index)``: the function is ``CATALOG[perm[index % F]]`` (``perm`` a seeded permutation
of the ``F`` functions) and the mutant is its ``(index // F)``-th valid mutation in a seeded order
of its sites (wrapping around when there are fewer), so indices ``0 .. F-1`` are ``F`` different
functions and later indices other bugs in them.

Episode: ``/workspace`` holds ``solution.py`` (the mutant) and ``test_solution.py``; any shell
command runs via ``<call>CMD</call>``; a turn without a call ends the episode.

Grading (reward 1.0 or 0.0). The model's code and the grading code cannot be separated inside the
sandbox: whatever imports ``solution.py`` runs the model's code in its own process, which can exit
early with any status (``raise SystemExit(0)``, ``os._exit(0)``), print any text, write any file,
and read everything in the sandbox. So nothing the sandbox says is trusted except the *outputs*,
and the sandbox holds no expected value of a graded case it does not already show the model:
* ``/task/run_cases.py`` (read-only) is a *runner* holding inputs only: the visible cases (those
  of ``test_solution.py``) and as many *held-out* cases (other inputs drawn by the same generator,
  whose outputs appear nowhere in the sandbox). It imports ``solution`` (its stdout and stderr
  silenced), calls the function on deep copies of each case's arguments and prints one line:
  ``RESULTS_MARK`` + JSON of ``["return", value, args after the call]`` or ``["raise", exception
  type name]`` per case, values in a tagged JSON encoding (:func:`encode`: tuples, bytes,
  non-finite floats, ``Fraction``, ``Decimal``, dates, IP addresses, ...; anything else becomes an
  opaque tag that equals nothing), then ``os._exit(0)``.
* The host (:func:`judge`) keeps the expected outputs (computed from the original function,
  outside the sandbox). Reward 1.0 only when the command exited 0 within its time and output
  limits (a timeout or truncated output is a failure), printed exactly one results line, that line
  parses (``json.loads`` and the strict :func:`decode`, which builds only plain values; nothing is
  unpickled or evaluated), holds one well-formed result per case, and every result equals the
  expected one under ``same()`` (the equality of ``test_solution.py``: floats with ``isclose``,
  list vs tuple distinguished). Exiting early means no or an incomplete line: 0.0. Printing a fake
  line needs the held-out outputs, i.e. a correct function.
* ``/workspace/test_solution.py`` is feedback only (its exit status and text are never read by
  the grader). It shows the visible cases' expected values in its ``FAIL`` lines, by design: the
  task is to fix a bug from failing examples. That makes a lookup table of the visible cases
  possible, which is why the held-out cases exist; a function that special-cases the visible
  inputs gets 0.0. Known residual: ``/usr`` (the interpreter's standard library) is readable, so a
  solution may call or copy the original stdlib function; that yields correct outputs and is
  accepted.
Task building checks the grader itself: the original must pass it (all cases) and each chosen
mutant must fail it.
"""
from __future__ import annotations

import ast
import builtins
import copy
import heapq
import importlib
import inspect
import json
import logging
import random
import symtable
import threading
import types
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from ..sandbox import CommandResult, Sandbox, SandboxLimits
from .base import SandboxEnv, TaskFamily, register_family, task_dir

log = logging.getLogger(__name__)

FAMILY = "code_repair"
GRADE_COMMAND = "python3 -I -B /task/run_cases.py"  # -I: the workspace cannot shadow stdlib modules
RESULTS_MARK = "@@code_repair-results@@ "  # starts the runner's one results line
BUILD_TIMEOUT_S = 60.0  # wall-clock safety net for building a task (seconds)


def _a(*args, **kwargs) -> tuple[tuple, dict]:
    return args, kwargs


def _f(r: random.Random, lo: float = 0.0, hi: float = 1.0) -> float:
    return round(r.uniform(lo, hi), 3)


def _rgb(r: random.Random) -> tuple[tuple, dict]:
    return _a(_f(r), _f(r), _f(r))


def _ints(r: random.Random, n_max: int = 10, lo: int = 0, hi: int = 9) -> list[int]:
    return [r.randint(lo, hi) for _ in range(r.randint(0, n_max))]


def _heap(r: random.Random) -> list[int]:
    h = [r.randint(0, 50) for _ in range(r.randint(2, 12))]
    heapq.heapify(h)
    return h


def _bisect(r: random.Random) -> tuple[tuple, dict]:
    return _a(sorted(_ints(r)), r.randint(-1, 10))


def _hex(r: random.Random) -> tuple[tuple, dict]:
    return _a("".join(r.choice("0123456789abcdefABCDEF") for _ in range(r.randint(1, 6))).encode())


def _quantiles(r: random.Random) -> tuple[tuple, dict]:
    data = [_f(r, 0, 100) for _ in range(r.randint(2, 12))]
    return _a(data, n=r.choice((2, 4, 5, 10)), method=r.choice(("inclusive", "exclusive")))


def _lines(r: random.Random) -> tuple[tuple, dict]:
    text = "\n".join(r.choice(("alpha", "", "  ", "beta gamma", "x")) for _ in range(r.randint(1, 6)))
    return _a(text, r.choice(("> ", "    ", "#")))


@dataclass(frozen=True, eq=False)  # compared and hashed by identity: the catalog holds each once
class Function:
    """A catalogued function ``module.name``; its test inputs are ``n`` draws of ``draw(rng)`` (one
    ``(args, kwargs)`` each, ``rng`` seeded by the name) followed by the ``fixed`` edge cases."""

    module: str
    name: str
    draw: Callable[[random.Random], tuple[tuple, dict]]
    fixed: tuple = ()
    n: int = 14

    @property
    def qualname(self) -> str:
        return f"{self.module}.{self.name}"

    def cases(self) -> list[tuple[tuple, dict]]:
        """The visible cases (in ``test_solution.py``, expected values shown to the model)."""
        r = random.Random(f"{FAMILY}:cases:{self.qualname}")
        return [self.draw(r) for _ in range(self.n)] + list(self.fixed)

    def held_out(self) -> list[tuple[tuple, dict]]:
        """The held-out cases: graded, their inputs in the runner, their outputs only on the host."""
        r = random.Random(f"{FAMILY}:held-out:{self.qualname}")
        return [self.draw(r) for _ in range(max(6, self.n // 2))]


CATALOG: tuple[Function, ...] = (
    Function("colorsys", "rgb_to_hsv", _rgb, (_a(0.5, 0.5, 0.5), _a(0.0, 0.0, 0.0), _a(1.0, 0.0, 0.0),
                                              _a(0.0, 1.0, 0.0), _a(0.0, 0.0, 1.0))),
    Function("colorsys", "hsv_to_rgb", lambda r: _a(round(r.randrange(6) / 6 + r.uniform(0.01, 0.15), 3),
                                                    _f(r, 0.1), _f(r, 0.1)), (_a(0.3, 0.0, 0.7), _a(1.0, 0.5, 0.5))),
    Function("colorsys", "rgb_to_hls", _rgb, (_a(0.5, 0.5, 0.5), _a(1.0, 0.2, 0.2), _a(0.2, 0.9, 0.1),
                                              _a(0.9, 0.8, 0.7), _a(0.6, 0.9, 0.7))),
    Function("colorsys", "hls_to_rgb", _rgb, (_a(0.2, 0.5, 0.0), _a(0.9, 0.8, 0.6), _a(0.6, 0.3, 1.0))),
    Function("colorsys", "yiq_to_rgb", lambda r: _a(_f(r), _f(r, -0.6, 0.6), _f(r, -0.53, 0.53)),
             (_a(1.0, 0.5, 0.5), _a(0.0, -0.5, -0.5)), n=16),
    *(Function("bisect", name, _bisect, (_a([1, 2, 2, 2, 3], 2), _a([1, 2, 2, 2, 3], 2, 2),
                                         _a([1, 2, 2, 2, 3], 2, 1, 3), _a([0, 5], 3, -1)))
      for name in ("bisect_right", "bisect_left")),
    Function("heapq", "_siftdown", lambda r: (lambda h: _a(h + [r.randint(0, 50)], 0, len(h)))(_heap(r))),
    Function("heapq", "_siftup", lambda r: _a([r.randint(0, 60)] + _heap(r)[1:], 0)),
    Function("calendar", "isleap", lambda r: _a(r.randint(1, 3000)),
             tuple(_a(y) for y in (1, 4, 100, 400, 1600, 1700, 1900, 1996, 1999, 2000, 2024, 2100, 2400)), n=4),
    Function("calendar", "leapdays", lambda r: (lambda y: _a(y, y + r.randint(0, 900)))(r.randint(1, 2500)),
             (_a(2000, 2001), _a(1900, 1901), _a(1996, 2004), _a(1, 401))),
    Function("_pydatetime", "_ord2ymd", lambda r: _a(r.randint(1, 3_652_059)),
             tuple(_a(n) for n in (1, 31, 59, 60, 365, 366, 730_120, 730_179, 730_180, 3_652_059))),
    Function("_pydatetime", "_days_before_year", lambda r: _a(r.randint(1, 9999)),
             tuple(_a(y) for y in (1, 2, 5, 101, 401, 2000))),
    Function("ipaddress", "_count_righthand_zero_bits",
             lambda r: _a(r.randint(1, 2**16) << r.randint(0, 20), r.choice((8, 16, 32))),
             (_a(0, 32), _a(1, 32), _a(8, 32), _a(2**20, 16), _a(2**31, 32))),
    Function("quopri", "unhex", _hex, (_a(b""), _a(b"0"), _a(b"fF"), _a(b"9aA"))),
    Function("operator", "countOf", lambda r: _a(_ints(r, 12, 0, 4), r.randint(0, 5)), (_a("banana", "a"),)),
    Function("operator", "indexOf", lambda r: _a(_ints(r, 12, 0, 5), r.randint(0, 6)), (_a("banana", "n"),)),
    *(Function("statistics", name, lambda r: _a(_ints(r, 9, 0, 50)), (_a([]), _a([3]), _a([5, 1])))
      for name in ("median_low", "median")),
    Function("statistics", "quantiles", _quantiles,
             (_a([1.0], n=4), _a([1.0, 2.0], n=0), _a([1.0, 2.0, 3.0], n=4, method="other")), n=16),
    Function("fractions", "_round_to_exponent",
             lambda r: _a(r.randint(-10**6, 10**6), r.randint(1, 10**4), r.randint(-3, 3), r.random() < 0.5),
             (_a(5, 10, 0), _a(15, 10, 0), _a(25, 10, 0), _a(-5, 10, 0, True), _a(-5, 10, 0, False)), n=16),
    Function("textwrap", "indent", _lines, (_a("a\n\nb\n", "  "), _a("", "> ")), n=12),
)


# ----------------------------------------------------------------------------------- sources
def _globals_used(src: str) -> set[str]:
    def walk(t: symtable.SymbolTable) -> set[str]:
        names = {s.get_name() for s in t.get_symbols() if s.is_global() and s.is_referenced()}
        for child in t.get_children():
            names |= walk(child)
        return names
    return walk(symtable.symtable(src, "solution", "exec").get_children()[0])


def _is_literal(v: Any) -> bool:
    try:
        return ast.literal_eval(repr(v)) == v
    except (ValueError, SyntaxError, TypeError):
        return False


def extract(fn: Function) -> tuple[str, str]:
    """``(prelude, target)``: the module-level code ``fn`` needs, and ``fn``'s own source (unparsed)."""
    mod = importlib.import_module(fn.module)
    defs = {n.name: n for n in ast.parse(inspect.getsource(mod)).body if isinstance(n, ast.FunctionDef)}
    header: list[str] = []
    helpers: list[str] = []
    seen: set[str] = set()

    def need(name: str) -> None:
        for g in sorted(_globals_used(ast.unparse(defs[name]))):
            if g in seen or hasattr(builtins, g):
                continue
            seen.add(g)
            v = getattr(mod, g)
            if isinstance(v, types.ModuleType):
                header.append(f"import {v.__name__}" + (f" as {g}" if v.__name__ != g else ""))
            elif g in defs:
                need(g)
                helpers.append(ast.unparse(defs[g]))
            elif isinstance(v, type) and issubclass(v, Exception) and v.__bases__[0].__name__ in dir(builtins):
                header.append(f"class {g}({v.__bases__[0].__name__}):\n    pass")
            elif _is_literal(v):
                header.append(f"{g} = {v!r}")
            else:
                raise ValueError(f"{fn.qualname}: global {g!r} ({type(v).__name__}) cannot be copied into the task")

    if fn.name not in defs:
        raise ValueError(f"{fn.qualname} is not a top-level function of {fn.module}'s source")
    need(fn.name)
    prelude = "\n\n".join(header + helpers)
    return prelude, ast.unparse(defs[fn.name])


def _join(prelude: str, target: str) -> str:
    return (prelude + "\n\n\n" if prelude else "") + target + "\n"


# --------------------------------------------------------------------------------- mutations
_CMP = {ast.Lt: ast.LtE, ast.LtE: ast.Lt, ast.Gt: ast.GtE, ast.GtE: ast.Gt, ast.Eq: ast.NotEq,
        ast.NotEq: ast.Eq, ast.Is: ast.IsNot, ast.IsNot: ast.Is, ast.In: ast.NotIn, ast.NotIn: ast.In}
_ARITH = {ast.Add: ast.Sub, ast.Sub: ast.Add}
_BOOL = {ast.And: ast.Or, ast.Or: ast.And}


def _sites(tree: ast.AST) -> list[tuple[ast.AST, int]]:
    """Mutable sites in ``ast.walk`` order: ``(node, index of the operator in a Compare or 0)``."""
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Compare):
            out += [(node, i) for i, op in enumerate(node.ops) if type(op) in _CMP]
        elif isinstance(node, (ast.BinOp, ast.AugAssign)) and type(node.op) in _ARITH:
            out.append((node, 0))
        elif isinstance(node, ast.BoolOp):
            out.append((node, 0))
        elif isinstance(node, ast.Constant) and type(node.value) in (int, float):
            out.append((node, 0))
    return out


def num_sites(target: str) -> int:
    return len(_sites(ast.parse(target)))


def mutate(target: str, site: int) -> tuple[str, str]:
    """``(mutant source, description)`` of mutation ``site`` of ``target`` (a function's source)."""
    tree = ast.parse(target)
    node, i = _sites(tree)[site]
    before = ast.unparse(node)
    if isinstance(node, ast.Compare):
        node.ops[i] = _CMP[type(node.ops[i])]()
    elif isinstance(node, (ast.BinOp, ast.AugAssign)):
        node.op = _ARITH[type(node.op)]()
    elif isinstance(node, ast.BoolOp):
        node.op = _BOOL[type(node.op)]()
    else:
        node.value += 1
    return ast.unparse(tree), f"function line {node.lineno}: {before} -> {ast.unparse(node)}"


# ------------------------------------------------------------------------------------- tests
_SAME = """def same(a, b):
    if isinstance(a, float) or isinstance(b, float):
        numbers = isinstance(a, (int, float)) and isinstance(b, (int, float))
        return numbers and math.isclose(a, b, rel_tol=1e-9, abs_tol=1e-12)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    return a == b
"""

_TEST = '''"""Checks __FN__ in solution.py on recorded outputs of a reference implementation.

Run in the directory of solution.py: python3 test_solution.py (exit status 0: every case passes).
"""
import copy
import math
import os
import sys

sys.path.append(os.getcwd())
from solution import __FN__

# (args, kwargs, expected): expected is ("return", value, args after the call) or ("raise", exception name)
CASES = [
__CASES__
]


__SAME__

failed = 0
for i, (args, kwargs, want) in enumerate(CASES):
    call = "__FN__(" + ", ".join([repr(a) for a in args] + [f"{k}={v!r}" for k, v in kwargs.items()]) + ")"
    args = copy.deepcopy(args)
    try:
        value = __FN__(*args, **kwargs)
    except Exception as e:
        got, detail = ("raise", type(e).__name__), f"raised {type(e).__name__}: {e}"
    else:
        got, detail = ("return", value, args), f"returned {value!r}"
    if not same(got, want):
        failed += 1
        expected = f"return {want[1]!r}" if want[0] == "return" else f"raise {want[1]}"
        if got[0] == want[0] == "return" and same(got[1], want[1]):
            detail += f" but left the arguments as {args!r}"
            expected += f" and leave them as {want[2]!r}"
        print(f"FAIL case {i}: {call} {detail}; expected to {expected}")
print(f"{len(CASES) - failed}/{len(CASES)} cases passed")
sys.exit(1 if failed else 0)
'''

# Screens every mutant of one function in one sandboxed process. A deterministic budget of traced
# Python events (20x the original's, plus 10k) replaces a wall-clock limit, so which mutants are
# valid never depends on machine load; a mutant over budget (e.g. an endless loop) is rejected. A
# valid mutant fails some visible case (the model sees the bug) and some held-out case (a lookup
# table of the visible cases plus the mutant for the rest does not pass).
_CHECK = '''import copy
import json
import math
import sys

CASES = [
__CASES__
]
VISIBLE = __VISIBLE__  # CASES[:VISIBLE] are test_solution.py's, the rest held out
SOURCES = json.load(open("sources.json"))


class Budget(BaseException):
    pass


__SAME__

left = 0


def tracer(frame, event, arg):
    global left
    left -= 1
    if left < 0:
        raise Budget
    return tracer


def check(src, budget):
    global left
    ns = {"__name__": "solution"}
    exec(compile(src, "solution.py", "exec"), ns)
    left = budget
    sys.settrace(tracer)
    try:
        failed = [False, False]  # some visible case, some held-out case
        for i, (args, kwargs, want) in enumerate(CASES):  # all of them, as the grader does
            args = copy.deepcopy(args)
            try:
                got = ("return", ns["__FN__"](*args, **kwargs), args)
            except Exception as e:
                got = ("raise", type(e).__name__)
            if not same(got, want):
                failed[i >= VISIBLE] = True
        return "fail" if all(failed) else "partial" if any(failed) else "pass"
    except Budget:
        return "budget"
    finally:
        sys.settrace(None)


first = check(SOURCES[0], 10**8)
budget = 20 * (10**8 - left) + 10_000
print(json.dumps([first] + [check(src, budget) for src in SOURCES[1:]]))
'''


# The runner: the only grading code inside the sandbox. It holds inputs only (no expected value).
# Its encoder (ENCODER, also exec'd on the host to check the codec) tags what JSON cannot say.
_ENCODER = '''def encode(v, depth=0):
    """``v`` as JSON-able data: None, bool, int, str, finite floats and lists as themselves, any
    other value as a one-key dict ``{tag: payload}``; an unsupported type becomes ``{"?": name}``."""
    if depth > 200:
        raise RecursionError("value nested too deeply")
    t, d = type(v), depth + 1
    if v is None or t is bool or t is int or t is str:
        return v
    if t is float:
        return v if math.isfinite(v) else {"float": repr(v)}
    if t is list:
        return [encode(x, d) for x in v]
    if t is tuple or t is set or t is frozenset:
        return {t.__name__: [encode(x, d) for x in v]}
    if t is dict:
        return {"dict": [[encode(k, d), encode(x, d)] for k, x in v.items()]}
    if t is bytes or t is bytearray:
        return {t.__name__: v.hex()}
    if t is complex:
        return {"complex": [repr(v.real), repr(v.imag)]}
    name = t.__module__ + "." + t.__qualname__
    if name == "fractions.Fraction":
        return {"Fraction": [v.numerator, v.denominator]}
    if name == "datetime.timedelta":
        return {"timedelta": [v.days, v.seconds, v.microseconds]}
    if name in ("decimal.Decimal", "ipaddress.IPv4Address", "ipaddress.IPv6Address"):
        return {t.__qualname__: str(v)}
    if name in ("datetime.date", "datetime.datetime", "datetime.time"):
        return {t.__qualname__: v.isoformat()}
    return {"?": t.__qualname__}
'''

_RUNNER = '''"""Runs __FN__ from solution.py on the task's inputs and prints the results for the grader, which
compares them with the expected outputs outside the sandbox (this file holds inputs only)."""
import copy
import json
import math
import os
import sys

# (args, kwargs) of every graded case
CASES = [
__INPUTS__
]
MARK = __MARK__


__ENCODER__

def result(args, kwargs):
    args = copy.deepcopy(args)
    try:
        value = __FN__(*args, **kwargs)
    except Exception as e:
        return ["raise", type(e).__name__]
    try:
        return ["return", encode(value), encode(args)]
    except (RecursionError, ValueError):
        return ["return", {"?": "unencodable"}, {"?": "unencodable"}]


out = os.dup(1)
sys.stdout = sys.stderr = open(os.devnull, "w")  # solution.py's prints do not reach the grader
try:
    sys.path.append(os.getcwd())
    from solution import __FN__
    line = MARK + json.dumps([result(a, k) for a, k in CASES], separators=(",", ":"), allow_nan=False)
except BaseException as e:
    os.write(out, f"runner: {type(e).__name__}: {e}"[:500].encode("utf-8", "replace") + b"\\n")
    os._exit(1)
data = (line + "\\n").encode()
while data:
    data = data[os.write(out, data):]
os._exit(0)  # no atexit handler or finalizer of solution.py runs after the results
'''


class _Opaque:
    """A decoded value of a type the codec does not carry: equal to nothing (identity equality)."""

    def __init__(self, name: str):
        self.name = name

    def __repr__(self) -> str:
        return f"<{self.name}>"


def _decoders() -> dict[str, Callable[[Any, Callable[[Any], Any]], Any]]:
    import datetime
    import decimal
    import fractions
    import ipaddress

    def strs(p, n):
        if type(p) is not list or len(p) != n or any(type(x) is not str for x in p):
            raise ValueError("bad payload")
        return p

    def ints(p, n):
        if type(p) is not list or len(p) != n or any(type(x) is not int for x in p):
            raise ValueError("bad payload")
        return p

    def items(p, dec):
        if type(p) is not list:
            raise ValueError("bad payload")
        return [dec(x) for x in p]

    def fraction(p, dec):
        num, den = ints(p, 2)
        if den <= 0:
            raise ValueError("bad Fraction")
        return fractions.Fraction(num, den)

    def floatstr(s):
        if type(s) is not str or len(s) > 40:
            raise ValueError("bad float")
        return float(s)

    def text(p, limit=100):
        if type(p) is not str or len(p) > limit:
            raise ValueError("bad payload")
        return p

    def pairs(p, dec):
        if type(p) is not list or any(type(x) is not list or len(x) != 2 for x in p):
            raise ValueError("bad dict")
        return {dec(k): dec(v) for k, v in p}

    return {
        "tuple": lambda p, dec: tuple(items(p, dec)),
        "set": lambda p, dec: set(items(p, dec)),
        "frozenset": lambda p, dec: frozenset(items(p, dec)),
        "dict": pairs,
        "bytes": lambda p, dec: bytes.fromhex(text(p, 1 << 20)),
        "bytearray": lambda p, dec: bytearray.fromhex(text(p, 1 << 20)),
        "float": lambda p, dec: floatstr(p),
        "complex": lambda p, dec: complex(*map(floatstr, strs(p, 2))),
        "Fraction": fraction,
        "Decimal": lambda p, dec: decimal.Decimal(text(p)),
        "timedelta": lambda p, dec: datetime.timedelta(*ints(p, 3)),
        "date": lambda p, dec: datetime.date.fromisoformat(text(p)),
        "datetime": lambda p, dec: datetime.datetime.fromisoformat(text(p)),
        "time": lambda p, dec: datetime.time.fromisoformat(text(p)),
        "IPv4Address": lambda p, dec: ipaddress.IPv4Address(text(p)),
        "IPv6Address": lambda p, dec: ipaddress.IPv6Address(text(p)),
        "?": lambda p, dec: _Opaque(text(p)),
    }


_DECODERS = _decoders()


def decode(data: Any, depth: int = 0) -> Any:
    """The value :func:`encode` encoded as ``data`` (parsed JSON); raises ``ValueError`` (or
    ``TypeError`` for an unhashable set element or dict key) on anything it did not produce."""
    if depth > 200:
        raise ValueError("value nested too deeply")
    t = type(data)
    if data is None or t is bool or t is int or t is str or t is float:
        return data
    if t is list:
        return [decode(x, depth + 1) for x in data]
    if t is dict and len(data) == 1:
        ((tag, payload),) = data.items()
        if tag in _DECODERS:
            return _DECODERS[tag](payload, lambda x: decode(x, depth + 1))
    raise ValueError(f"not an encoded value: {str(data)[:80]}")


def _host_ns() -> dict[str, Any]:
    """``encode`` and ``same`` as the sandboxed code defines them, for the host."""
    import math
    ns: dict[str, Any] = {"math": math}
    exec(compile(_ENCODER + "\n\n" + _SAME, "<code_repair codec>", "exec"), ns)
    return ns


_HOST = _host_ns()
encode: Callable[[Any], Any] = _HOST["encode"]
same: Callable[[Any, Any], bool] = _HOST["same"]


def _reject_constant(name: str) -> Any:
    raise ValueError(f"JSON constant {name} (non-finite floats are tagged)")


def results_line(outcomes) -> str:
    """The line the runner prints for these outcomes (host side: for checks and tests)."""
    data = [["return", encode(o[1]), encode(o[2])] if o[0] == "return" else list(o) for o in outcomes]
    return RESULTS_MARK + json.dumps(data, separators=(",", ":"), allow_nan=False)


def judge(res: CommandResult, expected: tuple) -> tuple[bool, str]:
    """``(passed, what)``: does the runner's output ``res`` (a :class:`CommandResult`) hold results
    equal to ``expected`` (one ``("return", value, args)`` or ``("raise", name)`` per case)?"""
    if res.timed_out:
        return False, "timed out"
    if res.truncated:
        return False, "output truncated"
    if res.exit_code != 0:
        return False, f"runner exited {res.exit_code}"
    lines = [ln for ln in res.output.split("\n") if ln.startswith(RESULTS_MARK)]
    if len(lines) != 1:
        return False, f"{len(lines)} results lines (want 1)"
    try:
        raw = json.loads(lines[0][len(RESULTS_MARK):], parse_constant=_reject_constant)
        if type(raw) is not list or len(raw) != len(expected):
            raise ValueError(f"not a list of {len(expected)} results")
        got = []
        for r in raw:
            if type(r) is list and len(r) == 3 and r[0] == "return":
                value, args = decode(r[1]), decode(r[2])
                got.append(("return", value, args))
            elif type(r) is list and len(r) == 2 and r[0] == "raise" and type(r[1]) is str:
                got.append(("raise", r[1]))
            else:
                raise ValueError(f"malformed result {str(r)[:80]}")
    except (ValueError, TypeError, RecursionError) as e:
        return False, f"unparsable results: {e}"[:300]
    failed = [i for i, (g, w) in enumerate(zip(got, expected)) if not same(g, w)]
    if failed:
        return False, f"{len(failed)}/{len(expected)} cases differ (first: case {failed[0]})"
    return True, f"{len(expected)}/{len(expected)} cases match"


def _outcomes(fn: Function, source: str, cases: list[tuple[tuple, dict]]) -> list[tuple]:
    """The outputs of ``source`` (the original) on ``cases``: ``("return", value, args after the
    call)`` or ``("raise", exception name)`` each, computed on the host."""
    ns: dict[str, Any] = {"__name__": "reference"}
    exec(compile(source, f"<reference {fn.qualname}>", "exec"), ns)
    out = []
    for args, kwargs in cases:
        after = copy.deepcopy(args)
        try:
            out.append(("return", ns[fn.name](*after, **kwargs), after))
        except Exception as e:
            out.append(("raise", type(e).__name__))
    return out


def _case_lines(cases: list[tuple[tuple, dict]], outcomes: list[tuple] | None = None) -> str:
    """Literal lines of ``(args, kwargs, expected)`` (or ``(args, kwargs)`` without ``outcomes``)."""
    lines = []
    for i, (args, kwargs) in enumerate(cases):
        case = (args, kwargs, outcomes[i]) if outcomes is not None else (args, kwargs)
        if not _is_literal(case):
            raise ValueError(f"case {case!r} is not a Python literal")
        lines.append(f"    {case!r},")
    return "\n".join(lines)


def _fill(template: str, fn: Function, cases: str) -> str:
    return template.replace("__SAME__", _SAME).replace("__CASES__", cases).replace("__FN__", fn.name)


def _runner(fn: Function, inputs: str) -> str:
    return (_RUNNER.replace("__ENCODER__", _ENCODER).replace("__INPUTS__", inputs)
            .replace("__MARK__", repr(RESULTS_MARK)).replace("__FN__", fn.name))


# ----------------------------------------------------------------------------- task building
@dataclass(frozen=True)
class _Info:
    prelude: str
    target: str
    cases: str               # the visible CASES literal's lines (inputs and expected outputs)
    inputs: str              # the runner's CASES lines: inputs of the visible then held-out cases
    expected: tuple          # the expected outcome of each runner case (host only)
    valid_sites: tuple[int, ...]


_lock = threading.Lock()
_infos: dict[str, _Info] = {}
_verified: set[tuple[str, int]] = set()


def _run_in_sandbox(workspace: Path, command: str, grader: Path | None = None):
    binds = {"/task": grader} if grader is not None else None
    with Sandbox(workspace, limits=SandboxLimits(timeout_s=BUILD_TIMEOUT_S), ro_binds=binds) as sb:
        res = sb.run(command)
    if res.timed_out:
        raise RuntimeError(f"{FAMILY}: `{command}` on {workspace} timed out after {BUILD_TIMEOUT_S:g} s")
    return res


def _build(fn: Function, info: _Info, site: int | None) -> Path:
    """The task dir of ``fn`` mutated at ``site`` (``None``: unmutated): ``workspace/`` (solution.py,
    test_solution.py), ``grader/`` (run_cases.py: inputs only), ``reference.py``, ``mutation.txt``."""
    body, what = (info.target, "original") if site is None else mutate(info.target, site)

    def build(d: Path) -> None:
        (d / "workspace").mkdir()
        (d / "grader").mkdir()
        (d / "workspace" / "test_solution.py").write_text(_fill(_TEST, fn, info.cases))
        (d / "workspace" / "solution.py").write_text(_join(info.prelude, body))
        (d / "grader" / "run_cases.py").write_text(_runner(fn, info.inputs))
        (d / "reference.py").write_text(_join(info.prelude, info.target))
        (d / "mutation.txt").write_text(what + "\n")

    return task_dir(f"{FAMILY}:{fn.qualname}:{site}", build)


def _info(fn: Function) -> _Info:
    """Extract ``fn``, record its outputs, screen all its mutants (once per process)."""
    if fn.qualname in _infos:
        return _infos[fn.qualname]
    prelude, target = extract(fn)
    original = _join(prelude, target)
    visible, held_out = fn.cases(), fn.held_out()
    outcomes = _outcomes(fn, original, visible + held_out)
    try:
        cases = _case_lines(visible, outcomes[:len(visible)])
        inputs = _case_lines(visible + held_out)
    except ValueError as e:
        raise ValueError(f"{fn.qualname}: {e}") from None
    ok, what = judge(CommandResult(0, results_line(outcomes)), tuple(outcomes))
    if not ok:  # every expected outcome must survive the runner's encoding
        raise ValueError(f"{fn.qualname}: the expected outcomes do not survive the result encoding: {what}")
    sources = [original] + [_join(prelude, mutate(target, i)[0]) for i in range(num_sites(target))]

    def build(d: Path) -> None:
        (d / "check.py").write_text(_fill(_CHECK, fn, _case_lines(visible + held_out, outcomes))
                                    .replace("__VISIBLE__", str(len(visible))))
        (d / "sources.json").write_text(json.dumps(sources))

    res = _run_in_sandbox(task_dir(f"{FAMILY}:{fn.qualname}:check", build), "python3 -I -B check.py")
    try:
        status = json.loads(res.output.strip().splitlines()[-1])
    except (ValueError, IndexError):
        raise RuntimeError(f"{FAMILY}: screening the mutants of {fn.qualname} failed: {res.output[-500:]}") from None
    if status[0] != "pass":
        raise RuntimeError(f"{FAMILY}: the recorded cases of {fn.qualname} fail on the original ({status[0]})")
    info = _Info(prelude, target, cases, inputs, tuple(outcomes),
                 tuple(i for i, s in enumerate(status[1:]) if s == "fail"))
    if not info.valid_sites:
        raise RuntimeError(f"{FAMILY}: no mutation of {fn.qualname} fails its test")
    task = _build(fn, info, None)
    passed, what = judge(_run_in_sandbox(task / "workspace", GRADE_COMMAND, task / "grader"), info.expected)
    if not passed:
        raise RuntimeError(f"{FAMILY}: the grader of {fn.qualname} rejects the original: {what}")
    log.info("%s: %d of %d mutations are valid tasks", fn.qualname, len(info.valid_sites), len(sources) - 1)
    _infos[fn.qualname] = info
    return info


def select(seed: int, index: int) -> tuple[Function, int, Path]:
    """``(function, site, task dir)`` of task ``(seed, index)`` (see the module docstring)."""
    with _lock:
        order = list(range(len(CATALOG)))
        random.Random(f"{FAMILY}:{seed}").shuffle(order)
        fn = CATALOG[order[index % len(CATALOG)]]
        info = _info(fn)
        sites = list(info.valid_sites)
        random.Random(f"{FAMILY}:{seed}:{fn.qualname}").shuffle(sites)
        site = sites[(index // len(CATALOG)) % len(sites)]
        task = _build(fn, info, site)
        if (fn.qualname, site) not in _verified:  # the real grader must agree with the screening
            passed, _ = judge(_run_in_sandbox(task / "workspace", GRADE_COMMAND, task / "grader"), info.expected)
            if passed:
                raise RuntimeError(f"{FAMILY}: {fn.qualname} site {site} passed the grader but was screened as failing")
            _verified.add((fn.qualname, site))
        return fn, site, task


def expected_outcomes(fn: Function) -> tuple:
    """The host-side expected outcomes of ``fn``'s runner cases (visible, then held-out)."""
    with _lock:
        return _info(fn).expected


# ------------------------------------------------------------------------------- environment
class CodeRepairEnv(SandboxEnv):
    family = FAMILY

    def __init__(self, task_index: int, seed: int = 0, *, max_turns: int = 8,
                 limits: SandboxLimits = SandboxLimits()):
        self.function, self.site, task = select(seed, task_index)
        self._expected = expected_outcomes(self.function)              # host only, never in the sandbox
        need = len(results_line(self._expected))
        if 2 * need + 1024 > limits.max_output_bytes:  # margin: a fix may legitimately differ in size
            raise ValueError(f"{FAMILY}: limits.max_output_bytes={limits.max_output_bytes} is too small for "
                             f"the results of {self.function.qualname} (~{need} bytes)")
        self.mutation = (task / "mutation.txt").read_text().strip()   # for logs; not shown to the model
        self.reference_solution = (task / "reference.py").read_text()  # the fixed solution.py
        prompt = (f"The function `{self.function.name}` in solution.py has a bug. Fix solution.py so that "
                  f"`python3 test_solution.py` passes (it checks recorded examples; editing it does not count, "
                  f"and the fix is graded on further held-out examples too).\n"
                  f"Run one shell command per turn as <call>COMMAND</call>, e.g. <call>cat solution.py</call> or "
                  f"<call>python3 test_solution.py</call>; edit with sed -i, python3 or a heredoc. The output comes "
                  f"back as <obs>OUTPUT</obs>. You have {max_turns} turns; when done, reply <answer> and a short "
                  f"note without a call.\n")
        sandbox = Sandbox(task / "workspace", limits=limits, ro_binds={"/task": task / "grader"})
        super().__init__(f"{FAMILY}/{seed}/{task_index}", sandbox, prompt, max_turns)

    def score(self, answer: str | None) -> tuple[float, dict[str, Any]]:
        res = self.sandbox.run(GRADE_COMMAND)
        passed, what = judge(res, self._expected)
        return (1.0 if passed else 0.0), {"tests_passed": passed, "grade": what,
                                          "grader_output": res.output[-1000:]}


register_family(TaskFamily(FAMILY, CodeRepairEnv, None, "fix a mutated stdlib function until its tests pass"))
