"""Belayer's weight keeper on real parts: a keeper process holding a tiny checkpoint in CPU shared
memory, embedded engine servers (own processes) started with ``--load-format dummy`` and re-armed
through ``/update_weights_from_tensor``, a supervisor using both.

* a re-armed worker (and a shadow promoted after the active worker is SIGKILLed) produces the
  greedy tokens and log-probs of a worker that loaded the checkpoint, bit for bit, and a dummy
  worker refuses to generate before it is re-armed;
* a SIGKILLed keeper is detected (``health`` raises), a worker re-armed before keeps serving, and
  the next replacement loads the checkpoint instead; weights changed in the keeper's shared memory
  fail its health check;
* a keeper at another weight version is refused (no dummy server is even started); after
  ``update_weights_from_disk`` the keeper follows and re-arms at the new version.
"""
import signal
import time

import pytest

from megatron_harts.rollout.belayer import KeeperError, StaleWeights, Supervisor, start_keeper
from megatron_harts.rollout.belayer.faults import kill_server
from megatron_harts.rollout.belayer.tiny import make_tiny_checkpoint
from megatron_harts.rollout.engines import EmbeddedServer
from megatron_harts.rollout.types import SamplingParams

pytestmark = pytest.mark.timeout(300)
PROMPT = [1, 40, 41, 42, 9, 77]
GREEDY = SamplingParams(max_new_tokens=16, temperature=0.0, stop_token_ids=[])


def _start(path, version, calls=None):
    if calls is not None:
        calls.append(("checkpoint", version))
    return EmbeddedServer(path, weight_version=version, threads=1).start()


def _dummy(calls=None):
    def start(path, version):
        if calls is not None:
            calls.append(("dummy", version))
        return EmbeddedServer(path, weight_version=version, threads=1, load_format="dummy").start()
    return start


def _gen(engine):
    g = engine.generate(PROMPT, GREEDY)
    return g.output_ids, g.logprobs


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return make_tiny_checkpoint(tmp_path_factory.mktemp("keeper") / "ck", seed=3, call_prob=1e-4,
                                eos_prob=1e-4)["path"]   # <eos> ~never: 16 tokens


@pytest.fixture(scope="module")
def reference(ckpt):
    """Greedy tokens and log-probs of a server that read the checkpoint."""
    with EmbeddedServer(ckpt, weight_version="v1", threads=1) as s:
        return _gen(s.engine())


@pytest.fixture
def keeper(ckpt):
    k = start_keeper(ckpt, "v1")
    yield k
    k.stop()


def test_rearmed_workers_match_the_checkpoint_worker(ckpt, reference, keeper):
    assert len(reference[0]) == 16
    calls = []
    sup = Supervisor(lambda p, v: _start(p, v, calls), ckpt, "v1", num_shadows=1, health_interval_s=0,
                     keeper=keeper, start_dummy=_dummy(calls), parallel_start=False)
    with sup:
        assert [r["how"] for r in sup.rearms] == ["keeper", "keeper"], sup.rearms
        assert all(c[0] == "dummy" for c in calls), calls
        w = sup.worker(0)
        assert w.engine.weight_version() == "v1"
        assert _gen(w.engine) == reference                   # tokens and log-probs, bit for bit
        kill_server(w.server, "group")
        eng = sup.failover(0, w.engine, "test: SIGKILL")
        assert sup.events[-1].how == "shadow"
        assert _gen(eng) == reference
    # a dummy server refuses to generate until weights arrive
    with EmbeddedServer(ckpt, threads=1, load_format="dummy") as s:
        with pytest.raises(Exception, match="no weights loaded"):
            s.engine(retries=0).generate(PROMPT, GREEDY)
        phases = keeper.rearm(s.engine(), "v1")
        assert set(phases) == {"health_s", "handles_s", "update_s", "rearm_s"}
        assert _gen(s.engine()) == reference


def test_keeper_death_is_detected_and_the_checkpoint_is_loaded(ckpt, reference, keeper):
    rep = keeper.health()
    assert rep["ok"] and rep["checksum_ok"] and rep["weight_version"] == "v1"
    calls = []
    sup = Supervisor(lambda p, v: _start(p, v, calls), ckpt, "v1", num_shadows=0, health_interval_s=0,
                     keeper=keeper, start_dummy=_dummy(calls))
    with sup:
        assert sup.rearms[-1]["how"] == "keeper"
        keeper.proc.send_signal(signal.SIGKILL)
        deadline = time.monotonic() + 10
        while keeper.alive() and time.monotonic() < deadline:
            time.sleep(0.05)
        with pytest.raises(KeeperError, match="not running"):
            keeper.health()
        w = sup.worker(0)
        assert _gen(w.engine) == reference                   # its weights are its own copy
        kill_server(w.server, "group")
        eng = sup.failover(0, w.engine, "test: SIGKILL")
        assert sup.events[-1].how == "cold"
        assert sup.rearms[-1]["how"] == "checkpoint" and "not running" in sup.rearms[-1]["reason"]
        assert calls[-1] == ("checkpoint", "v1")
        assert _gen(eng) == reference


def test_changed_shared_weights_fail_the_health_check(keeper):
    from megatron_harts.rollout.engines.tensor_ipc import deserialize_named_tensors

    named = deserialize_named_tensors(keeper.handles("v1")[0])     # maps the keeper's shared memory
    name, t = named[len(named) // 2]
    t.view(-1)[0] += 1.0
    with pytest.raises(KeeperError, match="changed since load"):
        keeper.health()


def test_a_stale_keeper_is_refused_then_follows_weight_updates(ckpt, reference, keeper, tmp_path):
    with pytest.raises(StaleWeights, match="'v1'.*'v2'"):
        keeper.handles("v2")
    calls = []
    sup = Supervisor(lambda p, v: _start(p, v, calls), ckpt, "v2", num_shadows=0, health_interval_s=0,
                     keeper=keeper, start_dummy=_dummy(calls))
    with sup:
        assert calls == [("checkpoint", "v2")]             # no dummy server started for a stale keeper
        assert sup.rearms[0]["how"] == "checkpoint" and "'v1'" in sup.rearms[0]["reason"]
        sup.update_weights_from_disk(ckpt, "v3")
        assert keeper.health()["weight_version"] == "v3"
        w = sup.worker(0)
        kill_server(w.server, "group")
        eng = sup.failover(0, w.engine, "test: SIGKILL")
        assert sup.rearms[-1]["how"] == "keeper" and calls[-1] == ("dummy", "v3")
        assert eng.weight_version() == "v3"
        assert _gen(eng) == reference
