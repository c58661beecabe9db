"""megatron_harts.rl: policy losses against a per-token Python reference, microbatch additivity,
gradients, KL estimators, clip fraction, missing-field errors, packed vs unpacked."""
from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from megatron_harts.ops import reference as ref
from megatron_harts.ops import tree_token_logprobs
from megatron_harts.packing import pack
from megatron_harts.rl import LOSS_AGG_MODES, RLBatch, kl_penalty, policy_loss
from megatron_harts.tree import RolloutTree, make_trajectory


def _random_trajs(seed, n=None, per_token_adv=None, with_ref=True):
    rng = np.random.default_rng(seed)
    n = int(rng.integers(1, 9)) if n is None else n
    trajs = []
    for i in range(n):
        L = int(rng.integers(1, 14))
        mask = rng.random(L) < 0.7
        mask[0] = False
        if i == 0 and n > 2:
            mask[:] = False  # a trajectory with no loss token
        ptok = rng.random() < 0.5 if per_token_adv is None else per_token_adv
        adv = rng.normal(size=L) if ptok else float(rng.normal())
        old = -rng.random(L) * 3
        trajs.append(make_trajectory(i, rng.integers(0, 50, L).tolist(), traj_id=f"t{i}", loss_mask=mask,
                                     old_logprobs=old, advantage=adv,
                                     ref_logprobs=(old + rng.normal(size=L) * 0.3) if with_ref else None))
    return trajs


def _random_logprobs(trajs, seed, scale=0.4):
    g = torch.Generator().manual_seed(seed + 1000)
    return [(torch.from_numpy(t.old_logprobs[1:]).double() + scale * torch.randn(len(t) - 1, generator=g,
             dtype=torch.float64)) for t in trajs]


def _reference(lps, trajs, mode, *, clip_eps=0.2, clip_eps_high=None, dual_clip_c=None, kl_coef=0.0,
               kl_estimator="k1", entropy=None, entropy_coef=0.0, T=None, S=None, M=None):
    """Per-token loop over 0-dim float64 tensors (differentiable), straight from the formulas."""
    eh = clip_eps if clip_eps_high is None else clip_eps_high
    seq_vals = []
    for i, t in enumerate(trajs):
        vals = []
        adv = np.broadcast_to(np.asarray(t.advantage, dtype=np.float64), (len(t),))
        for j in range(1, len(t)):
            if not t.loss_mask[j]:
                continue
            lp, old, a = lps[i][j - 1], float(t.old_logprobs[j]), float(adv[j])
            r = torch.exp(lp - old)
            pg = torch.maximum(-a * r, -a * r.clamp(1 - clip_eps, 1 + eh))
            if dual_clip_c is not None and a < 0:
                pg = torch.minimum(pg, torch.tensor(-a * dual_clip_c, dtype=torch.float64))
            v = pg
            if kl_coef:
                rf = float(t.ref_logprobs[j])
                kl = lp - rf if kl_estimator == "k1" else torch.exp(rf - lp) - (rf - lp) - 1
                v = v + kl_coef * kl
            if entropy is not None:
                v = v - entropy_coef * entropy[i][j - 1]
            vals.append(v)
        seq_vals.append(vals)
    T = sum(len(v) for v in seq_vals) if T is None else T
    S = sum(1 for v in seq_vals if v) if S is None else S
    M = max(len(t) - 1 for t in trajs) if M is None else M
    zero = torch.zeros((), dtype=torch.float64)
    if mode == "token-mean":
        return sum((x for v in seq_vals for x in v), zero) / max(T, 1)
    if mode == "seq-mean-token-mean":
        return sum((sum(v, zero) / len(v) for v in seq_vals if v), zero) / max(S, 1)
    if mode == "seq-mean-token-sum":
        return sum((sum(v, zero) for v in seq_vals), zero) / max(S, 1)
    return sum((sum(v, zero) for v in seq_vals), zero) / (max(S, 1) * M)


CONFIGS = [dict(), dict(clip_eps_high=0.28), dict(dual_clip_c=3.0, clip_eps=0.1),
           dict(kl_coef=0.1, kl_estimator="k1"), dict(kl_coef=0.05, kl_estimator="k3", clip_eps_high=0.3),
           dict(entropy_coef=0.01)]


@pytest.mark.parametrize("mode", LOSS_AGG_MODES)
@pytest.mark.parametrize("cfg", range(len(CONFIGS)))
@pytest.mark.parametrize("seed", range(4))
def test_matches_reference_and_gradient(mode, cfg, seed):
    cfg = dict(CONFIGS[cfg])
    trajs = _random_trajs(seed * 7 + 1)
    lps = _random_logprobs(trajs, seed)
    ent = [torch.rand(len(t) - 1, dtype=torch.float64) for t in trajs] if "entropy_coef" in cfg else None
    batch = RLBatch.from_trajectories(trajs)
    x = [lp.float().requires_grad_(True) for lp in lps]
    loss, metrics = policy_loss(x, batch, loss_agg_mode=mode, entropy=None if ent is None else [e.float() for e in ent],
                                **cfg)
    xr = [lp.clone().requires_grad_(True) for lp in lps]
    loss_r = _reference(xr, trajs, mode, entropy=ent, **cfg)
    assert abs(loss.item() - loss_r.item()) < 1e-5 * max(1, abs(loss_r.item()))
    # gradient w.r.t. per-trajectory logprobs vs autograd of the reference
    g = torch.autograd.grad(loss, x)
    gr = torch.autograd.grad(loss_r, xr, allow_unused=True)
    for a, b in zip(g, gr):
        b = torch.zeros_like(a, dtype=torch.float64) if b is None else b
        torch.testing.assert_close(a.double(), b, atol=1e-6, rtol=1e-4)
    # flat input gives the same loss
    loss_flat, _ = policy_loss(torch.cat(lps).float(), batch, loss_agg_mode=mode,
                               entropy=None if ent is None else torch.cat(ent).float(), **cfg)
    assert torch.allclose(loss_flat, loss.detach())
    assert all(v.dim() == 0 and not v.requires_grad for v in metrics.values())


@pytest.mark.parametrize("mode", LOSS_AGG_MODES)
@pytest.mark.parametrize("seed", range(5))
def test_microbatch_losses_sum_to_full_batch(mode, seed):
    trajs = _random_trajs(100 + seed, n=11)
    lps = [lp.float() for lp in _random_logprobs(trajs, seed)]
    cfg = dict(clip_eps_high=0.28, kl_coef=0.05, kl_estimator="k3", loss_agg_mode=mode)
    full = RLBatch.from_trajectories(trajs)
    loss_full, _ = policy_loss(lps, full, **cfg)
    rng = np.random.default_rng(seed)
    order = rng.permutation(len(trajs))  # arbitrary assignment to 4 "ranks x microbatches"
    parts = np.array_split(order, 4)
    mbs = [RLBatch.from_trajectories([trajs[i] for i in p]) for p in parts]
    glob = dict(global_num_tokens=sum(b.num_tokens for b in mbs),
                global_num_sequences=sum(b.num_sequences for b in mbs),
                global_max_len=max(b.max_len for b in mbs))
    assert glob == dict(global_num_tokens=full.num_tokens, global_num_sequences=full.num_sequences,
                        global_max_len=full.max_len)
    total = sum(policy_loss([lps[i] for i in p], b, **cfg, **glob)[0] for p, b in zip(parts, mbs))
    torch.testing.assert_close(total, loss_full, atol=1e-6, rtol=1e-5)


def test_kl_estimators():
    lp = torch.tensor([-1.0, -2.0, -0.5, -3.0], dtype=torch.float64)
    rf = torch.tensor([-1.5, -1.0, -0.5, -0.1], dtype=torch.float64)
    k1 = kl_penalty(lp, rf, "k1")
    k3 = kl_penalty(lp, rf, "k3")
    for i in range(4):
        d = rf[i].item() - lp[i].item()
        assert k1[i].item() == pytest.approx(lp[i].item() - rf[i].item())
        assert k3[i].item() == pytest.approx((math.exp(d) - 1) - d, rel=1e-12)
    assert (k3 >= 0).all() and k3[2] == 0
    big = kl_penalty(torch.tensor([0.0]), torch.tensor([30.0]), "low_var_kl")
    assert big.item() == 10.0
    with pytest.raises(ValueError, match="kl_estimator"):
        kl_penalty(lp, rf, "k2")


def test_clip_fraction_crafted():
    # token ratios exp(logp - old) = [1.0, 1.5, 0.5, 1.1, 0.7, 3.0]; the masked-out last one ignored
    ratios = [1.0, 1.5, 0.5, 1.1, 0.7, 3.0]
    adv = [1.0, 1.0, -1.0, -1.0, 1.0, 1.0]
    L = len(ratios) + 1
    old = np.full(L, -1.0)
    mask = np.array([0, 1, 1, 1, 1, 1, 0], dtype=bool)
    t = make_trajectory(0, list(range(L)), loss_mask=mask, old_logprobs=old, advantage=np.r_[0.0, adv])
    batch = RLBatch.from_trajectories([t])
    lp = torch.from_numpy(old[1:] + np.log(ratios)).float()
    # clipped (pg2 > pg1): ratio 1.5 with A>0 and ratio 0.5 with A<0 -> 2 of 5
    _, m = policy_loss(lp, batch, clip_eps=0.2)
    assert m["pg_clipfrac"].item() == pytest.approx(2 / 5)
    assert m["ratio_max"].item() == pytest.approx(1.5) and m["ratio_min"].item() == pytest.approx(0.5)
    # clip-higher 0.6: ratio 1.5 no longer clipped
    _, m = policy_loss(lp, batch, clip_eps=0.2, clip_eps_high=0.6)
    assert m["pg_clipfrac"].item() == pytest.approx(1 / 5)
    # dual clip: A<0 with ratio 4 -> -A*r = 4 > c = 3: lower clip
    lp2 = torch.from_numpy(old[1:] + np.log([1.0, 1.0, 4.0, 1.0, 1.0, 1.0])).float()
    loss, m = policy_loss(lp2, batch, dual_clip_c=3.0)
    assert m["pg_clipfrac_lower"].item() == pytest.approx(1 / 5)
    assert loss.item() == pytest.approx((-1 - 1 + 3 + 1 - 1) / 5, abs=1e-6)


def test_missing_fields_name_field_and_trajectory():
    good = make_trajectory(0, [1, 2, 3], loss_mask=[0, 1, 1], old_logprobs=[0, -1, -1], advantage=1.0)
    no_old = make_trajectory(1, [1, 2, 3], traj_id="b", loss_mask=[0, 1, 1], advantage=1.0)
    no_adv = make_trajectory(2, [1, 2], traj_id="c", loss_mask=[0, 1], old_logprobs=[0, -1])
    no_mask = make_trajectory(3, [1, 2], traj_id="d", old_logprobs=[0, -1], advantage=0.5)
    lp = lambda trajs: [torch.zeros(len(t) - 1) for t in trajs]
    b = RLBatch.from_trajectories([good, no_old])
    with pytest.raises(ValueError, match=r"'b'.*'old_logprobs'"):
        policy_loss(lp([good, no_old]), b, loss_type="ppo")
    policy_loss(lp([good, no_old]), b, loss_type="grpo")  # on-policy GRPO does not need them
    with pytest.raises(ValueError, match=r"trajectory 0.*'ref_logprobs'"):
        policy_loss(lp([good]), RLBatch.from_trajectories([good]), kl_coef=0.1)
    with pytest.raises(ValueError, match=r"'c'.*'advantage'"):
        policy_loss(lp([good, no_adv]), RLBatch.from_trajectories([good, no_adv]))
    with pytest.raises(ValueError, match=r"'d'.*'loss_mask'"):
        policy_loss(lp([no_mask]), RLBatch.from_trajectories([no_mask]))
    with pytest.raises(ValueError, match="logprobs"):
        policy_loss([torch.zeros(3)], RLBatch.from_trajectories([good]))
    with pytest.raises(ValueError, match="loss_agg_mode"):
        policy_loss(lp([good]), RLBatch.from_trajectories([good]), loss_agg_mode="mean")
    with pytest.raises(ValueError, match="clip_eps and clip_eps_high must be >= 0"):
        policy_loss(lp([good]), RLBatch.from_trajectories([good]), clip_eps=-0.2)
    with pytest.raises(ValueError, match="clip_eps and clip_eps_high must be >= 0"):
        policy_loss(lp([good]), RLBatch.from_trajectories([good]), clip_eps_high=-0.1)


def test_masked_garbage_gives_no_nan():
    t = make_trajectory(0, [1, 2, 3, 4], loss_mask=[0, 1, 0, 1], old_logprobs=[0, -1, -200, -1],
                        ref_logprobs=[0, -1, 300, -1], advantage=1.0)
    b = RLBatch.from_trajectories([t])
    x = torch.tensor([-1.0, 5.0, -1.2], requires_grad=True)
    loss, m = policy_loss(x, b, kl_coef=0.1, kl_estimator="k3")
    (g,) = torch.autograd.grad(loss, x)
    assert torch.isfinite(loss) and torch.isfinite(g).all() and g[1] == 0
    assert all(torch.isfinite(v) for v in m.values())


@pytest.mark.parametrize("mode", LOSS_AGG_MODES)
def test_tree_packed_equals_unpacked(mode):
    rng = np.random.default_rng(0)
    base = rng.integers(0, 9, 12).tolist()
    groups = [[base[:p] + rng.integers(0, 9, int(rng.integers(1, 6))).tolist() for p in (3, 3, 7, 12)]
              for _ in range(3)]
    trees = []
    for gi, toks in enumerate(groups):
        f = dict(loss_masks=[], old_logprobs=[], ref_logprobs=[], advantages=[])
        for tk in toks:
            m = np.zeros(len(tk), bool)
            m[3:] = True
            f["loss_masks"].append(m)
            f["old_logprobs"].append(-rng.random(len(tk)) * 2)
            f["ref_logprobs"].append(-rng.random(len(tk)) * 2)
            f["advantages"].append(float(rng.normal()))
        trees.append(RolloutTree.from_trajectories(toks, traj_ids=[f"{gi}.{j}" for j in range(4)], **f))
    cfg = dict(loss_agg_mode=mode, kl_coef=0.1, kl_estimator="k3")
    # packed: one pack per tree (microbatch), global normalisers from all trajectories
    all_trajs = [t for tree in trees for t in tree.records]
    full = RLBatch.from_trajectories(all_trajs)
    glob = dict(global_num_tokens=full.num_tokens, global_num_sequences=full.num_sequences,
                global_max_len=full.max_len)
    packed_loss, per_traj_logits = 0.0, []
    for tree in trees:
        p = pack([tree], chunk_size=4)
        logits = torch.randn(p.num_tokens, 9, generator=torch.Generator().manual_seed(len(per_traj_logits)))
        packed_loss = packed_loss + policy_loss(tree_token_logprobs(logits, p),
                                                RLBatch.from_trajectories(p.trajectories), **cfg, **glob)[0]
        per_traj_logits += [(logits[i], p.tokens[i]) for i in p.index_of_trajectory]
    # unpacked: each trajectory on its own, one batch
    lps = [ref.token_logprobs(lg, tk) for lg, tk in per_traj_logits]
    unpacked_loss, _ = policy_loss(lps, full, **cfg)
    torch.testing.assert_close(packed_loss, unpacked_loss, atol=1e-6, rtol=1e-5)
