"""The elastic pool with the Megatron trainer (``ElasticPool(..., trainer="megatron")``), on CPU:
three Ray actors each hold a Megatron-Core ``HybridModel`` (the ``tiny`` Qwen3-Next preset's
``G-G-G-*-``) wrapped in Megatron's ``DistributedDataParallel`` over the pool's DP subgroup. One
worker leaves (the DP wrapper and grad buffer are rebuilt for the two that stay), serves the
exported Megatron weights with the embedded engine, and comes back (a new wrapper for three,
parameters and AdamW state by broadcast).

Tolerances: ``mode="deterministic"`` (per-sample gradients summed in sample order) is compared
bitwise; Megatron's own reduction (``mode="allreduce"``: grad-buffer all-reduce over gloo and
``finalize_model_grads`` scaling by 1 / global tokens) within 1e-6 of the largest gradient entry
(fp32: the shard sums and the ring reduction add in an order that depends on the rank set; the
measured difference is ~2e-7 of it). Engine vs Megatron log-probs: within 1e-4 nats (transformers'
torch GDN / attention vs Megatron's tree layers on the same fp32 weights; measured <= 1e-6)."""
import numpy as np
import pytest

from megatron_harts.rollout.weight_sync import model_config

BATCH = [[1, 5 + i, 9, 17 + 3 * i, 40, 41 + i, 2] + [100 + i] * (i % 3) for i in range(7)]   # 7 samples, uneven
PROMPTS = [[1, 70, 71, 72], [1, 80, 81]]
NEW = 4


@pytest.fixture(scope="module")
def pool(tmp_path_factory):
    import ray  # noqa: F401  (a test dependency: an ImportError if missing, never a skip)

    from megatron_harts.rollout.libra.pool import ElasticPool

    p = ElasticPool(3, model_config("tiny", num_layers=4), str(tmp_path_factory.mktemp("mpool")),
                    trainer="megatron", seed=0, resident_engines=True, timeout_s=60)
    yield p
    p.close()
    import ray
    ray.shutdown()


def _close(a, b):
    np.testing.assert_allclose(a, b, rtol=0, atol=1e-6 * np.abs(b).max())


def _check_ddp(pool, builds=None):
    """Every training worker's Megatron DDP (wrapper, every grad bucket group, the grad buffers'
    DP size) reduces over exactly the current training ranks; serving workers hold none."""
    info = pool.dp_info()
    for r, i in enumerate(info):
        if r in pool.training:
            assert i["ranks"] == pool.training and i["ddp"], (r, i)
            assert i["dp_ranks"] == i["dp_cp_ranks"] == pool.training, (r, i)
            assert i["bucket_dp_ranks"] and all(b == pool.training for b in i["bucket_dp_ranks"]), (r, i)
            assert set(i["buffer_dp_sizes"]) == {len(pool.training)} and i["main_grad_in_buffer"], (r, i)
        else:
            assert i["ranks"] == [] and not i["ddp"], (r, i)
        if builds is not None:
            assert i["ddp_builds"] == builds[r], (r, i, builds)


def _served_matches_trainer(pool, rank_engine, rank_trainer, version):
    """Greedy generation on ``rank_engine``'s engine serves ``version``, and its log-probs equal the
    Megatron forward of ``rank_trainer`` on the same tokens. Returns the engine's answers."""
    gen = pool.generate(rank_engine, PROMPTS, max_new_tokens=NEW, temperature=0.0)
    assert [len(g["output_ids"]) for g in gen] == [NEW] * len(PROMPTS)
    assert {g["weight_version"] for g in gen} == {version}
    lps = pool.logprobs(rank_trainer, [p + g["output_ids"] for p, g in zip(PROMPTS, gen)])
    for lp, g in zip(lps, gen):
        np.testing.assert_allclose(lp[-NEW:], g["logprobs"], rtol=0, atol=1e-4)
    return gen


@pytest.mark.timeout(420)
def test_megatron_role_switch_keeps_gradients(pool):
    p0 = pool.params(0)
    assert all(np.array_equal(pool.params(r), p0) for r in (1, 2)), "same seed: same initial weights"
    _check_ddp(pool, builds=[1, 1, 1])
    g3 = pool.grads(BATCH)                            # DP = {0, 1, 2}, per-sample reference
    a3 = pool.grads(BATCH, mode="allreduce")          # Megatron DDP + finalize_model_grads
    assert np.abs(g3).max() > 0
    _close(a3, g3)
    # worker 2 leaves: DDP rebuilt on {0, 1}; it exports the Megatron weights (HF layout) and serves them
    out = pool.to_rollout(2)
    assert out["url"].startswith("http://") and pool.training == [0, 1] and out["resident"] is False
    _check_ddp(pool, builds=[2, 2, 1])
    g2 = pool.grads(BATCH)
    a2 = pool.grads(BATCH, mode="allreduce")
    assert np.array_equal(g2, g3), "deterministic reduction: bitwise equal across rank sets"
    _close(a2, a3)
    _close(a2, g2)
    gen0 = _served_matches_trainer(pool, 2, 0, "v0")   # trainers still hold v0
    # the trainers step on Megatron's reduced gradient (a2); the engine gets v1 through the sync path
    pool.step()
    assert not np.array_equal(pool.params(0), pool.params(2))
    assert np.array_equal(pool.params(0), pool.params(1))
    assert pool.publish(2)["version"] == "v1"
    gen1 = _served_matches_trainer(pool, 2, 0, "v1")
    assert not np.allclose([g["logprobs"] for g in gen1], [g["logprobs"] for g in gen0], atol=1e-6)
    g2b = pool.grads(BATCH)
    a2b = pool.grads(BATCH, mode="allreduce")
    # worker 2 comes back: a new DDP (fresh grad buffer) on {0, 1, 2}, parameters and AdamW state broadcast
    back = pool.to_training(2)
    assert pool.training == [0, 1, 2] and back["total_s"] > 0
    _check_ddp(pool, builds=[3, 3, 2])
    assert all(np.array_equal(pool.params(r), pool.params(0)) for r in (1, 2))
    g3b = pool.grads(BATCH)
    assert np.array_equal(g3b, g2b)
    assert not np.array_equal(g3b, g3)                # the step moved the weights
    a3b = pool.grads(BATCH, mode="allreduce")
    _close(a3b, a2b)
    _close(a3b, g3b)
    # the next step (on Megatron's reduction over three) is bitwise the same on every rank
    pool.step()
    p0 = pool.params(0)
    assert all(np.array_equal(pool.params(r), p0) for r in (1, 2))
    # a second switch reuses the kept engine (paused, memory released), serving the new weights (v2)
    again = pool.to_rollout(2)
    assert again["resident"] is True and again["url"] == out["url"]
    _check_ddp(pool, builds=[4, 4, 2])
    _served_matches_trainer(pool, 2, 0, "v2")
    pool.to_training(2)
    _check_ddp(pool, builds=[5, 5, 3])
    _close(pool.grads(BATCH, mode="allreduce"), pool.grads(BATCH))


@pytest.mark.timeout(120)
def test_megatron_pool_rejects_bad_switches(pool):
    with pytest.raises(ValueError, match="already training"):
        pool.to_training(1)
    with pytest.raises(ValueError, match="cannot leave"):
        pool.to_rollout(5)
