"""What every sandboxed task family shares: parsing a model turn, the episode loop, the registry.

A model turn (decoded text, markup included) is one of
* a **tool call**: it contains ``</call>``; the command is the text between the last ``</call>``
  and the last ``<call>`` before it (or the turn's start when the ``<call>`` was pre-filled by the
  previous observation or the prompt); text after ``</call>`` is ignored;
* a **malformed call**: such a command that is blank or holds markup tokens: the episode goes on
  with an error observation, and the turn counts;
* a **final answer**: anything without ``</call>``; the answer is the text after the last
  ``<answer>`` (or all of it), cut at ``<eos>``, stripped.

Observations are ``<obs>OUTPUT</obs>\\n`` plus what the family pre-fills for the next turn; markup
strings inside the output are escaped (``<eos>`` -> ``&lt;eos>``) so a tool cannot end a turn.
"""
from __future__ import annotations

import copy
import hashlib
import logging
import shutil
import tempfile
import threading
import weakref
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from ..sandbox import CommandResult, Sandbox
from ..tokenizer import ANSWER, CALL, END_CALL, EOS, SPECIALS
from ..types import Environment, StepResult

log = logging.getLogger(__name__)


# ------------------------------------------------------------------------------- turn parsing
@dataclass(frozen=True)
class Turn:
    """A parsed model turn: ``kind`` is ``"call"`` (``text`` = command), ``"answer"`` (``text`` =
    the answer) or ``"malformed"`` (``text`` = what is wrong)."""

    kind: str
    text: str


def parse_turn(text: str) -> Turn:
    """Split a model turn into a tool call, a malformed call or a final answer (never raises)."""
    end = text.rfind(END_CALL)
    if end < 0:
        answer = text[text.rfind(ANSWER) + len(ANSWER):] if ANSWER in text else text
        return Turn("answer", answer.split(EOS, 1)[0].strip())
    start = text.rfind(CALL, 0, end)
    command = text[start + len(CALL) if start >= 0 else 0:end]
    if not command.strip():
        return Turn("malformed", "empty command in <call></call>")
    bad = [s for s in SPECIALS if s in command]
    if bad:
        return Turn("malformed", f"markup token {bad[0]} inside the command")
    if "\x00" in command:                       # sampled byte 0: no shell command can hold it
        return Turn("malformed", "NUL byte inside the command")
    return Turn("call", command.strip())


def escape_markup(text: str) -> str:
    """Replace markup strings in tool output so the tokenizer sees plain bytes (``<x>`` -> ``&lt;x>``)."""
    for s in SPECIALS:
        if s in text:
            text = text.replace(s, "&lt;" + s[1:])
    return text


def format_output(res: CommandResult) -> str:
    """A command's output for an observation, with a note for a non-zero exit or a timeout."""
    out = res.output
    if res.exit_code != 0 and not res.timed_out:
        out += ("" if not out or out.endswith("\n") else "\n") + f"[exit code {res.exit_code}]"
    return escape_markup(out)


# ----------------------------------------------------------------------------- the episode loop
class SandboxEnv:
    """A task over one :class:`Sandbox`: subclasses set the prompt and define :meth:`command`,
    :meth:`prefill` and :meth:`score`.

    Turns: each model turn counts (calls, malformed calls, the answer). A final answer ends the
    episode with ``reward = score(answer)``; when ``max_turns`` turns pass without one, the turn
    that spends the budget ends it with ``reward = score(None)`` (``info["reason"] =
    "max_turns"``). Steps after the end return ``done`` with the same reward and an error in
    ``info``. ``info`` of a call: ``tool, command, exit, timed_out, truncated, seconds``.
    """

    family = ""

    def __init__(self, task_id: str, sandbox: Sandbox, prompt: str, max_turns: int):
        if max_turns < 1:
            raise ValueError(f"{task_id}: max_turns must be >= 1, got {max_turns}")
        self.task_id, self.sandbox, self._prompt, self.max_turns = task_id, sandbox, prompt, max_turns
        self.turns = 0
        self.calls: list[str] = []     # commands run, in order
        self.done = False
        self.reward: float | None = None

    # -- hooks ---------------------------------------------------------------------------------
    def command(self, call_text: str) -> str:
        """The shell command a call runs (default: the call text itself)."""
        return call_text

    def prefill(self) -> str:
        """Text appended after an observation, opening the next turn (default: none)."""
        return ""

    def score(self, answer: str | None) -> tuple[float, dict[str, Any]]:
        """``(reward, info)`` at the end of the episode; ``answer`` is None when the budget ran out."""
        raise NotImplementedError

    # -- Environment protocol -------------------------------------------------------------------
    def prompt(self) -> str:
        return self._prompt

    def step(self, action: str) -> StepResult:
        if self.done:
            return StepResult(None, True, self.reward, {"error": "episode is over"})
        turn = parse_turn(action)
        self.turns += 1
        info: dict[str, Any] = {"turn": self.turns, "kind": turn.kind}
        if turn.kind == "answer":
            return self._finish(turn.text, info)
        if turn.kind == "malformed":
            info["error"] = turn.text
            obs = escape_markup(f"error: {turn.text}")
        else:
            cmd = self.command(turn.text)
            self.calls.append(cmd)
            res = self.sandbox.run(cmd)
            self.on_result(turn.text, res)
            info.update(tool="run", command=cmd, exit=res.exit_code, timed_out=res.timed_out,
                        truncated=res.truncated, seconds=res.seconds)
            obs = format_output(res)
        if self.turns >= self.max_turns:
            info["reason"] = "max_turns"
            return self._finish(None, info)
        return StepResult(f"<obs>{obs}</obs>\n{self.prefill()}", False, None, info)

    def on_result(self, call_text: str, res: CommandResult) -> None:
        """Called after each tool call (for families that track what the agent looked at)."""

    def _finish(self, answer: str | None, info: dict[str, Any]) -> StepResult:
        self.done = True
        self.reward, extra = self.score(answer)
        info.update(extra, answer=answer)
        return StepResult(None, True, self.reward, info)

    def fork(self) -> "SandboxEnv":
        """An independent copy: files (a sandbox fork), turn count, calls made."""
        new = copy.copy(self)
        new.sandbox = self.sandbox.fork()
        new.calls = list(self.calls)
        return new

    def close(self) -> None:
        self.sandbox.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.task_id}, turn {self.turns}/{self.max_turns}, done={self.done})"


# --------------------------------------------------------------------------- task-file cache
class _CacheRoot:
    """The per-process directory of task base dirs, deleted at exit (after the sandboxes: their
    finalizers are created later and run first)."""

    def __init__(self):
        self.path = Path(tempfile.mkdtemp(prefix="harts-tasks-"))
        self.lock = threading.Lock()
        weakref.finalize(self, shutil.rmtree, self.path, True)


_cache: _CacheRoot | None = None
_cache_lock = threading.Lock()


def task_dir(key: str, build: Callable[[Path], None]) -> Path:
    """The directory of a task's files, built once per process by ``build(empty_dir)`` and shared
    (read-only: it is the sandboxes' lower layer) by every environment of that task and its forks.
    ``key`` names the task and everything its files depend on."""
    global _cache
    with _cache_lock:
        if _cache is None:
            _cache = _CacheRoot()
        cache = _cache
    path = cache.path / hashlib.sha1(key.encode()).hexdigest()[:16]
    with cache.lock:
        if not path.exists():
            tmp = cache.path / f".building-{path.name}"
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir()
            build(tmp)
            tmp.rename(path)
    return path


# -------------------------------------------------------------------------------- registry
@dataclass(frozen=True)
class TaskFamily:
    """A family of tasks: ``factory(task_index, seed, **kw)`` makes an :class:`Environment`;
    ``num_tasks``: the valid indices are ``range(num_tasks)``, or any index >= 0 when None (tasks
    generated from ``(seed, index)``)."""

    name: str
    factory: Callable[..., Environment]
    num_tasks: int | None = None
    description: str = ""


_FAMILIES: dict[str, TaskFamily] = {}


def register_family(family: TaskFamily) -> TaskFamily:
    if family.name in _FAMILIES and _FAMILIES[family.name] is not family:
        raise ValueError(f"task family {family.name!r} is already registered")
    _FAMILIES[family.name] = family
    return family


def list_families() -> list[str]:
    return sorted(_FAMILIES)


def get_family(name: str) -> TaskFamily:
    if name not in _FAMILIES:
        raise ValueError(f"unknown task family {name!r}; known: {', '.join(list_families())}")
    return _FAMILIES[name]


def make_env(family: str, task_index: int, seed: int = 0, **kw) -> Environment:
    """The environment of task ``task_index`` of ``family`` (deterministic in ``(seed, task_index)``);
    ``kw`` goes to the family's factory (e.g. ``max_turns``, ``limits``)."""
    fam = get_family(family)
    if task_index < 0 or (fam.num_tasks is not None and task_index >= fam.num_tasks):
        raise IndexError(f"task index {task_index} outside family {family!r} "
                         f"({fam.num_tasks if fam.num_tasks is not None else 'unbounded'} tasks)")
    return fam.factory(task_index, seed, **kw)
