"""The client process of tests/test_belayer_journal.py: one journaled Belayer rollout against an
engine server the test started (``--url``), trajectories written as JSON to ``--out``. The test
SIGKILLs it mid-rollout and runs it again with ``--resume``.

Tasks: ``Notebook``, a lookup variant whose every call *appends* the call text to
``notes.txt`` in the sandbox and shows the file's size, so each observation depends on every
earlier turn's files (a resume that loses the files is visible). Trees: 2 samples per task, each
forked into 2 after turn 2. Even tasks recover by replay, odd ones by checkpoint + context cut
(checkpoints every 2 turns)."""
import argparse
import json
import logging
import shlex
import sys
import time

from megatron_harts.rollout.agent_loop import RolloutConfig
from megatron_harts.rollout.belayer.env import BelayerAgentLoop, CheckpointedEnv, CheckpointPolicy
from megatron_harts.rollout.engines.http import HttpEngine
from megatron_harts.rollout.envs import LookupEnv
from megatron_harts.rollout.sandbox import SandboxLimits
from megatron_harts.rollout.tokenizer import ByteTokenizer

TASKS = list(range(6))
GROUPS = [f"t{t}" for t in TASKS]
CFG = RolloutConfig(group_size=2, branch_turn=2, branch_factor=2, max_new_tokens=12, max_concurrency=4, seed=0)


class Notebook(LookupEnv):
    """lookup whose calls append their text to notes.txt and print its size (stateful files)."""

    slow_s = 0.0

    def command(self, call_text: str) -> str:
        text = shlex.quote(call_text.replace("\0", ""))
        pause = f"sleep {self.slow_s}; " if self.slow_s else ""
        return f"{pause}printf %s {text} >> notes.txt; wc -c < notes.txt"


def make_inner(task, timeout_s=10.0):
    return Notebook(int(task), seed=0, max_turns=5, limits=SandboxLimits(timeout_s=timeout_s))


def make_env(task):
    odd = int(task) % 2 == 1
    return CheckpointedEnv(lambda: make_inner(task), recovery="checkpoint" if odd else "replay",
                           policy=CheckpointPolicy(every=2 if odd else 1))


def dump(res, path):
    out = {"stats": {k: v for k, v in res.stats.items() if k != "weight_versions"}, "failed": res.failed,
           "trajectories": [{"traj_id": t.traj_id, "group_id": t.group_id, "tokens": t.tokens.tolist(),
                             "loss_mask": t.loss_mask.tolist(), "old_logprobs": t.old_logprobs.tolist(),
                             "reward": t.reward, "extra": t.extra} for t in res.trajectories]}
    with open(path, "w") as f:
        json.dump(out, f)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--url", required=True)
    ap.add_argument("--journal", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--resume", action="store_true")
    ap.add_argument("--slow", type=float, default=0.0)
    ap.add_argument("--break-resume", default=None)
    a = ap.parse_args()
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    Notebook.slow_s = a.slow
    loop = BelayerAgentLoop([HttpEngine(a.url, timeout=120)], ByteTokenizer(), make_env, CFG, journal=a.journal,
                            break_resume=a.break_resume)
    t0 = time.monotonic()
    res = loop.rollout(TASKS, GROUPS, resume=a.resume)
    res.stats["wall_s"] = round(time.monotonic() - t0, 2)
    dump(res, a.out)
    print(json.dumps(res.stats.get("journal")), file=sys.stderr)


if __name__ == "__main__":
    main()
