"""Libra in the real loop: ``RLLoop`` on an :class:`~.pool.ElasticPool` (``LoopConfig.libra_pool``).

The pool's ``n`` workers (Ray actors, Megatron trainer, the embedded engine) are split every step:
``R`` serve rollouts with their embedded engines (the loop's rollout workers use their URLs) and
``n - R`` train the step through Megatron DDP over the pool's DP group (``ElasticPool.train_step``:
``HartsTrainer``'s tree-packed RL step, data-parallel). Workers ``n - R .. n - 1`` serve, so rank 0
always trains (it is the source of the state broadcast and of the exported checkpoints), and a
change of ``R`` only moves workers one way: ``to_rollout`` (export of the worker's own weights,
tagged with the version the loop serves, engine started or resumed) or ``to_training`` (engine
paused and released, DP group rebuilt, parameters and AdamW state broadcast from rank 0). Engines
that keep serving receive each new version through the loop's own export + push
(``ElasticPool.export`` + ``weight_sync.push_weights``), as with fixed engines.

Split policies (:class:`LibraSplit`):

* ``schedule``: ``schedule[step % len(schedule)]`` rollout workers at step ``step`` (tests, and
  forcing switches);
* ``planner``: :meth:`~.planner.StreamPlanner.plan_sync` fed with the loop's last measured step
  (``rollout_s``, generated tokens, ``train_s`` on its training workers, ``sync_s``) and the
  switch seconds measured in this run. ``StreamPlanner`` rather than ``Planner``: ``Planner``
  predicts both sides from the H200 cost models and a distribution of simulated programs
  (``ProgramEstimator``), while ``StreamPlanner`` re-plans from measured rates, which is what a
  real loop has; its synchronous objective is rollout + training (a sum: nothing overlaps in a
  synchronous step), not the streaming max. The embedded CPU engine serves one request at a time,
  so the rollout is modelled capacity-bound (``latency_bound=False``: seconds ~ 1 / engines);
  training seconds are rescaled to other worker counts as ``1 / workers``
  (:data:`CPU_TRAIN_SHAPE`: no all-reduce or optimizer term measured on CPU).
"""
from __future__ import annotations

import logging
import math
import time
from typing import Sequence

from .costs import TrainCost
from .planner import StreamMeasure, StreamPlanner

logger = logging.getLogger(__name__)

POLICIES = ("planner", "schedule")

#: training-seconds shape used to rescale the measured training time to other worker counts:
#: pure 1 / workers (the scale factor comes from the measurement; only the shape matters)
CPU_TRAIN_SHAPE = TrainCost(p_s=1.0, q_s=0.0, opt_s=0.0, grad_bytes=0.0, source="CPU loop: 1 / workers")


def check_split_config(n: int, policy: str, schedule: Sequence[int]) -> None:
    """One-line ``ValueError`` for a bad pool size, policy or schedule (``LoopConfig`` calls it)."""
    if n < 2:
        raise ValueError(f"LoopConfig.libra_pool must be 0 (off) or >= 2 workers (one serving, one training), got {n}")
    if policy not in POLICIES:
        raise ValueError(f"LoopConfig.libra_policy must be one of {POLICIES}, got {policy!r}")
    if policy == "schedule":
        if not schedule:
            raise ValueError("LoopConfig.libra_policy='schedule' needs libra_schedule (rollout workers per step)")
        bad = [r for r in schedule if not 1 <= int(r) <= n - 1]
        if bad:
            raise ValueError(f"LoopConfig.libra_schedule entries must be rollout workers in 1..{n - 1} "
                             f"(libra_pool={n}), got {bad[0]}")
    elif schedule:
        raise ValueError("LoopConfig.libra_schedule is for libra_policy='schedule' only")


class LibraSplit:
    """How many of the pool's ``n`` workers serve rollouts at each step.

    ``policy``: ``schedule`` (``schedule[step % len]``) or ``planner`` (starts at ``n // 2``,
    then :meth:`StreamPlanner.plan_sync` from the previous step's row and the measured switch
    seconds). :meth:`plan` returns ``(R, detail)``; ``detail['why']`` says what decided."""

    def __init__(self, n: int, policy: str, schedule: Sequence[int] = (), *, min_intervals: int = 1,
                 horizon: int = 5, margin: float = 1.5):
        check_split_config(n, policy, schedule)
        self.n, self.policy, self.schedule = n, policy, [int(r) for r in schedule]
        self.planner_kw = dict(min_intervals=min_intervals, horizon=horizon, margin=margin)

    def initial(self) -> int:
        return self.schedule[0] if self.policy == "schedule" else max(1, self.n // 2)

    def plan(self, step: int, steps: int, rows: Sequence[dict], switches: Sequence[dict]) -> tuple[int, dict]:
        """Rollout workers for ``step`` (of ``steps``) from the loop's previous ``rows`` and the
        measured ``switches`` (``{"to": "rollout"|"training", "seconds"}``)."""
        if self.policy == "schedule":
            return self.schedule[step % len(self.schedule)], {"why": "schedule"}
        last = rows[-1]
        current, train_gpus = len(last["rollout_ranks"]), len(last["train_ranks"])

        def mean_s(to: str) -> float:
            xs = [s["seconds"] for s in switches if s["to"] == to]
            return sum(xs) / len(xs) if xs else math.nan

        to_r, to_t = mean_s("rollout"), mean_s("training")
        to_r = to_r if math.isfinite(to_r) else (to_t if math.isfinite(to_t) else 0.0)
        to_t = to_t if math.isfinite(to_t) else to_r
        planner = StreamPlanner(train=CPU_TRAIN_SHAPE, gpus=self.n, sync_s=last["sync_s"], switch_s=to_r,
                                switch_back_s=to_t, latency_bound=False, **self.planner_kw)
        gen = max(1, last["generated_tokens"])
        m = StreamMeasure(rollout_tok_s=gen / (last["rollout_s"] * current), batch_tokens=gen,
                          train_s=last["train_s"], train_gpus=train_gpus, idle_frac=0.0, intervals=len(rows),
                          current=current)
        work = (last["packed_tokens"], last["trajectory_tokens"] / max(1, last["trajectories"]))
        plan = planner.plan_sync(m, current, work, steps - step)
        detail = {k: v for k, v in plan.detail.items() if k != "costs"}
        detail["predicted_step_s"] = {str(r): round(c, 4) for r, c in plan.detail.get("costs", {}).items()}
        return plan.rollout_gpus, detail


class PoolTrainer:
    """The loop's trainer on an :class:`~.pool.ElasticPool`: the calls ``RLLoop`` makes on a
    ``TrainerWorker`` (``train_step``, ``export``, ``set_lr``), run on the pool's training workers."""

    def __init__(self, pool):
        self.pool = pool

    def train_step(self, trajectories) -> dict:
        return self.pool.train_step(trajectories)

    def export(self, version: str) -> tuple[str, dict]:
        path, seconds = self.pool.export(version)
        return path, {"seconds": seconds}

    def set_lr(self, lr: float) -> None:
        self.pool.set_lr(lr)


class LibraController:
    """The pool, its trainer facade and the role switches of one loop run.

    Args:
        n: workers; hf_config: the model (``weight_sync.model_config``); work_dir: checkpoints and
            engine logs; split: a :class:`LibraSplit`; seed / lr / chunk_size: as the loop's
            trainer; rl: ``MegatronReplica``'s RL settings (``tree``, ``old_logprobs``, ...).
    """

    def __init__(self, n: int, hf_config: dict, work_dir: str, split: LibraSplit, *, seed: int = 0,
                 lr: float = 1e-3, chunk_size: int = 16, rl: dict | None = None, timeout_s: float = 120.0):
        import ray

        from ..trainer import ADAM_BETAS
        from .pool import ElasticPool

        self._owns_ray = not ray.is_initialized()
        t0 = time.perf_counter()
        self.pool = ElasticPool(n, hf_config, work_dir, trainer="megatron", seed=seed, lr=lr, resident_engines=True,
                                timeout_s=timeout_s,
                                replica=dict(chunk_size=chunk_size, betas=ADAM_BETAS, rl=dict(rl or {})))
        self.start_s = time.perf_counter() - t0
        self.split, self.n = split, n
        self.trainer = PoolTrainer(self.pool)
        self.switches: list[dict] = []
        logger.info("libra: pool of %d Megatron workers up in %.1f s", n, self.start_s)

    @property
    def rollout_ranks(self) -> list[int]:
        return [r for r in range(self.n) if r not in self.pool.training]

    def urls(self) -> list[str]:
        """Engine URLs of the serving workers, by rank."""
        return [self.pool.urls[r] for r in self.rollout_ranks]

    def switch(self, rollout: int, version: str) -> dict:
        """Move workers until ``rollout`` of them (ranks ``n - rollout .. n - 1``) serve, the
        newcomers serving their weights tagged ``version``. Returns ``{"switch_s", "moves"}``
        (each move: rank, direction, seconds and the pool's parts)."""
        if not 1 <= rollout <= self.n - 1:
            raise ValueError(f"rollout workers must be in 1..{self.n - 1}, got {rollout}")
        want = set(range(self.n - rollout, self.n))
        moves, t0 = [], time.perf_counter()
        for r in sorted(set(self.rollout_ranks) - want):            # back to training
            out = self.pool.to_training(r)
            moves.append({"rank": r, "to": "training", "seconds": out["total_s"],
                          **{k: round(v, 4) for k, v in out.items() if k.endswith("_s")}})
        for r in sorted(want - set(self.rollout_ranks), reverse=True):   # to rollout
            out = self.pool.to_rollout(r, version)
            moves.append({"rank": r, "to": "rollout", "seconds": out["total_s"], "resident": out["resident"],
                          **{k: round(v, 4) for k, v in out.items() if k.endswith("_s")}})
        self.switches += moves
        return {"switch_s": time.perf_counter() - t0, "moves": moves}

    def close(self) -> None:
        try:
            self.pool.close()
        finally:
            if self._owns_ray:
                import ray
                ray.shutdown()
