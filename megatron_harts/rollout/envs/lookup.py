"""``lookup``: read a file with ``cat`` and repeat its content; learnable by a small model from scratch.

Task ``(seed, index)``: files ``a``, ``b``, ... (``num_files``, default 8) each holding a random
string of ``digits`` decimal digits (no newline); one of them is requested. An episode with the
default ``max_turns=2``::

    prompt            find c\\n<call>cat            (the call is pre-filled up to the file name)
    model turn 1      c</call>                      -> runs `cat c` in the sandbox
    observation       <obs>7</obs>\\n<answer>        (pre-fills the answer on the last turn)
    model turn 2      7<eos>                        -> reward 1.0

In this family the text of every call is the argument list of ``cat``: the command run is ``"cat "
+ call_text`` (stripped; so ``<call>c</call>`` on a later turn runs ``cat c``; ``c; ls`` runs
both, inside the sandbox). The requested file counts as *opened* when a call's text is exactly its
name and ``cat`` succeeded. Reward: 1.0 when it was opened and the final answer equals its
content (a right digit after reading another file, or without reading, earns nothing: with one
digit per file guesses would often be right); ``open_bonus`` (default 0.0, e.g. 0.1 for shaping)
when it was opened but the answer is wrong or missing; else 0.0. A first turn without
``</call>`` is a final answer given without looking (reward 0.0); a second call when the budget is
2 turns ends the episode with ``score(None)``.
"""
from __future__ import annotations

import random
import string
from pathlib import Path
from typing import Any

from ..sandbox import CommandResult, Sandbox, SandboxLimits
from ..tokenizer import ANSWER
from .base import SandboxEnv, TaskFamily, register_family, task_dir

CALL_PREFIX = "cat "
FAMILY = "lookup"


class LookupEnv(SandboxEnv):
    family = FAMILY

    def __init__(self, task_index: int, seed: int = 0, *, num_files: int = 8, digits: int = 1,
                 max_turns: int = 2, open_bonus: float = 0.0,
                 limits: SandboxLimits = SandboxLimits(timeout_s=5.0)):
        if not 1 <= num_files <= 26 or digits < 1:
            raise ValueError(f"lookup: need 1 <= num_files <= 26 and digits >= 1, got {num_files}, {digits}")
        rng = random.Random(f"{FAMILY}:{seed}:{task_index}")
        names = string.ascii_lowercase[:num_files]
        self.files = {n: "".join(rng.choice(string.digits) for _ in range(digits)) for n in names}
        self.target = rng.choice(names)
        self.open_bonus = open_bonus
        self.opened = False

        def build(d: Path) -> None:
            for n, content in self.files.items():
                (d / n).write_text(content)

        key = f"{FAMILY}:" + ",".join(f"{n}={c}" for n, c in self.files.items())
        base = task_dir(key, build)
        super().__init__(f"{FAMILY}/{seed}/{task_index}", Sandbox(base, limits=limits),
                         f"find {self.target}\n<call>{CALL_PREFIX}", max_turns)

    @property
    def expected(self) -> str:
        """The content of the requested file (the correct answer)."""
        return self.files[self.target]

    def solution(self) -> list[str]:
        """The model turns of a correct episode (scripted demonstrations for a warm-up)."""
        return [f"{self.target}</call>", f"{self.expected}<eos>"]

    def command(self, call_text: str) -> str:
        return CALL_PREFIX + call_text

    def on_result(self, call_text: str, res: CommandResult) -> None:
        if call_text == self.target and res.exit_code == 0:
            self.opened = True

    def prefill(self) -> str:
        return ANSWER if self.turns == self.max_turns - 1 else ""

    def score(self, answer: str | None) -> tuple[float, dict[str, Any]]:
        correct = self.opened and answer == self.expected
        reward = 1.0 if correct else (self.open_bonus if self.opened else 0.0)
        return reward, {"correct": correct, "opened": self.opened, "expected": self.expected}


register_family(TaskFamily(FAMILY, LookupEnv, None, "cat the requested file and repeat its content"))
