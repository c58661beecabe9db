"""Belayer: resuming a rollout after a crash of the *client* process (the one running the agent
loop), on real parts: an embedded engine server started here (deterministic, position-keyed
sampling), real bubblewrap + overlayfs sandboxes, and the client in its own process
(``tests/belayer_journal_driver.py``), SIGKILLed mid-rollout after some turns were journaled and
some episodes finished, then resumed by a new process from the journal.

Checked: every trajectory of the rollout comes back (0 lost), none twice, each equals the fault-free
rollout token for token (same seeds) and replays exactly in a fresh environment of its task
(``faults.replay_check``); a torn last journal line is tolerated; a journal of another config or
other tasks, a corrupt line and a record of an unknown group are refused with the file, line and
field. Shown to fail: a resume that rebuilds the environments without their checkpoint's files
(``break_resume="ignore_snapshot"``) and one that runs again the episodes finished before the crash
(``"rerun_finished"``).
"""
import collections
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from megatron_harts.rollout.agent_loop import RolloutConfig
from megatron_harts.rollout.belayer.env import BelayerAgentLoop
from megatron_harts.rollout.belayer.faults import compare_rollouts, replay_check
from megatron_harts.rollout.belayer.journal import Journal, JournalError, read_journal
from megatron_harts.rollout.belayer.tiny import make_tiny_checkpoint
from megatron_harts.rollout.engines import EmbeddedServer
from megatron_harts.rollout.tokenizer import ByteTokenizer
from megatron_harts.tree import make_trajectory

pytestmark = pytest.mark.timeout(300)
ROOT = Path(__file__).resolve().parents[1]
DRIVER = ROOT / "tests" / "belayer_journal_driver.py"
sys.path.insert(0, str(DRIVER.parent))
import belayer_journal_driver as drv  # noqa: E402


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    if shutil.which("bwrap") is None:
        pytest.fail("bubblewrap is needed (apt-get install -y bubblewrap)")
    d = tmp_path_factory.mktemp("journal-engine")
    ck = make_tiny_checkpoint(d / "ckpt", call_prob=0.15, eos_prob=0.02)
    s = EmbeddedServer(ck["path"], weight_version="v0", threads=1, log_path=str(d / "engine.log"),
                       extra_args=["--enable-deterministic-inference"]).start()
    yield s
    s.stop()


def _client(server, journal, out, *args, wait=True):
    cmd = [sys.executable, str(DRIVER), "--url", server.url, "--journal", str(journal), "--out", str(out), *args]
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    if not wait:
        return subprocess.Popen(cmd, env=env, stderr=subprocess.PIPE, text=True)
    r = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=240)
    assert r.returncode == 0, f"client {args} failed:\n{r.stderr[-4000:]}"
    return _load(out)


def _load(path):
    d = json.loads(Path(path).read_text())
    trajs = [make_trajectory(i, t["tokens"], traj_id=t["traj_id"], group_id=t["group_id"], loss_mask=t["loss_mask"],
                             old_logprobs=t["old_logprobs"], reward=t["reward"], **t["extra"])
             for i, t in enumerate(d["trajectories"])]
    return trajs, d


def _problems(trajs, reference) -> list[str]:
    """Everything wrong with a resumed rollout: lost or duplicated trajectories, differences from
    the fault-free rollout, observations that a fresh replay of the actions does not give."""
    counts = collections.Counter(t.traj_id for t in trajs)
    bad = [f"duplicated: {k} x{n}" for k, n in sorted(counts.items()) if n > 1]
    lost = sorted({t.traj_id for t in reference} - set(counts))
    bad += [f"lost: {lost}"] if lost else []
    unique = list({t.traj_id: t for t in trajs}.values())
    bad += compare_rollouts(unique, reference)
    bad += replay_check(unique, lambda task: drv.make_inner(task, timeout_s=30.0), lambda t: int(t.group_id[1:]),
                        ByteTokenizer())
    return bad


def _crash(server, journal, out) -> list[str]:
    """Run the client, SIGKILL it once >= 3 episodes finished and >= 20 records are in the journal;
    returns the journal's lines at the kill."""
    p = _client(server, journal, out, "--slow", "0.05", wait=False)
    path = Path(journal) / "journal.jsonl"
    deadline = time.monotonic() + 120
    lines: list[str] = []
    while time.monotonic() < deadline and p.poll() is None:
        if path.exists():
            lines = path.read_text().splitlines()
            if sum('"done":true' in ln for ln in lines) >= 3 and len(lines) >= 20:
                break
        time.sleep(0.003)
    assert p.poll() is None, f"the client ended before the kill: {p.communicate()[1][-3000:]}"
    os.kill(p.pid, signal.SIGKILL)
    p.wait()
    p.stderr.close()
    return Path(path).read_text().splitlines()


def test_resume_after_the_client_is_sigkilled(server, tmp_path):
    t0 = time.monotonic()
    reference, ref_d = _client(server, tmp_path / "ref", tmp_path / "ref.json")
    assert not ref_d["failed"] and len(reference) > 2 * len(drv.TASKS), len(reference)
    assert max(len(t.extra["turns"]) for t in reference) >= 3
    assert not (tmp_path / "ref" / "snapshots").exists()         # deleted once the rollout completed

    journal = tmp_path / "crash"
    lines = _crash(server, journal, tmp_path / "never.json")
    recs = [json.loads(ln) for ln in lines]
    done = {r["traj"] for r in recs if r.get("done")}
    assert not any(r["kind"] == "complete" for r in recs) and not (tmp_path / "never.json").exists()
    assert 3 <= len(done) < len(reference), (len(done), len(reference))      # killed mid-rollout
    assert any(r.get("ckpt", {}).get("files") for r in recs)                   # checkpoint copies journaled
    with open(journal / "journal.jsonl", "ab") as f:                           # a write cut short by the kill
        f.write(b'{"kind":"turn","traj":"t1/0","group":"t1","pa')

    # the injected bugs, each on its own copy of the crashed journal (paths in it are relative)
    caught = {}
    for bug in ("ignore_snapshot", "rerun_finished"):
        shutil.copytree(journal, tmp_path / bug, symlinks=True)
        trajs, _ = _client(server, tmp_path / bug, tmp_path / f"{bug}.json", "--resume", "--break-resume", bug)
        caught[bug] = _problems(trajs, reference)
    print("injected bugs:", {k: v[:3] for k, v in caught.items()})
    assert caught["ignore_snapshot"], "a resume without the checkpoint's files went unnoticed"
    assert any("replay" in p or "differ" in p for p in caught["ignore_snapshot"]), caught["ignore_snapshot"]
    assert any(p.startswith("duplicated") for p in caught["rerun_finished"]), caught["rerun_finished"]

    t_res = time.monotonic()
    trajs, d = _client(server, journal, tmp_path / "resumed.json", "--resume")
    resume_s = time.monotonic() - t_res
    st = d["stats"]["journal"]
    print("resume:", st, f"{resume_s:.1f} s; test so far {time.monotonic() - t0:.1f} s")
    assert not d["failed"]
    assert st["torn_line"] and st["finished_before_crash"] == len(done) and st["rebuilt"] >= 1, st
    assert _problems(trajs, reference) == []
    assert not (journal / "snapshots").exists()

    # the completed journal: a further resume returns the same trajectories and runs nothing
    again, d2 = _client(server, journal, tmp_path / "again.json", "--resume")
    assert d2["stats"]["journal"]["already_complete"] and compare_rollouts(again, trajs) == []
    assert read_journal(journal / "journal.jsonl").complete is not None


def _loop(tmp_path, cfg=drv.CFG):
    return BelayerAgentLoop([object()], ByteTokenizer(), drv.make_env, cfg, journal=tmp_path / "j")


def test_a_journal_of_another_rollout_or_a_corrupt_one_is_refused(tmp_path):
    j = Journal(tmp_path / "j")
    j.open(drv.CFG, drv.TASKS, drv.GROUPS, resume=False)
    j.write({"kind": "turn", "traj": "t0/0", "group": "t0", "path": [0], "n": 1, "prompt": [1, 2], "start": 2,
             "out": [5], "lp": [-1.0], "fin": "stop", "engine": "e", "wv": "v0", "lat": 0.1, "obs": [], "act": "x",
             "res": {"obs": None, "done": True, "reward": 0.0}, "done": True, "reward": 0.0, "ckpt": None})
    j.close()
    path = tmp_path / "j" / "journal.jsonl"
    with pytest.raises(JournalError, match="a journal exists already"):
        _loop(tmp_path).rollout(drv.TASKS, drv.GROUPS)
    other = RolloutConfig(**{**drv.CFG.__dict__, "max_new_tokens": 13})
    with pytest.raises(JournalError, match=rf"^{path}:1: field 'config.max_new_tokens': the journal has 12, "
                                           rf"this rollout has 13"):
        _loop(tmp_path, other).rollout(drv.TASKS, drv.GROUPS, resume=True)
    with pytest.raises(JournalError,
                       match=rf"^{path}:1: field 'tasks\[2\]': the journal has '2', this rollout has '7'"):
        _loop(tmp_path).rollout([0, 1, 7, 3, 4, 5], drv.GROUPS, resume=True)
    with pytest.raises(JournalError,
                       match=rf"^{path}:1: field 'group_ids\[5\]': the journal has 't5', this rollout has 'x'"):
        _loop(tmp_path).rollout(drv.TASKS, drv.GROUPS[:-1] + ["x"], resume=True)

    good = path.read_bytes()
    path.write_bytes(good + b'{"kind":"turn","tra')                     # torn tail: ignored
    st = read_journal(path)
    assert st.torn and st.good_bytes == len(good) and st.episodes[("t0", (0,))].done
    lines = good.splitlines(keepends=True)
    path.write_bytes(lines[0] + b'{"kind":"turn", broken\n' + lines[1])    # corrupt line 2: refused
    with pytest.raises(JournalError, match=rf"^{path}:2: field '\(line\)': not valid JSON"):
        read_journal(path)
    path.write_bytes(lines[0] + lines[1].replace(b'"group":"t0"', b'"group":"zz"'))
    with pytest.raises(JournalError, match=rf"^{path}:2: field 'group': 'zz' is not a group"):
        read_journal(path)
