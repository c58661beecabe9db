"""The on-policy RL loop: rollouts on engines -> HARTS training step -> weight sync, repeated.

Pieces (each small and replaceable, composed here):

* engines: SGLang servers (GPU) or the embedded transformers server (CPU default), reached
  through one HTTP client (:mod:`.engines`);
* :class:`RolloutWorker`: an :class:`~.agent_loop.AgentLoop` over sandboxed environments of one
  task family (:mod:`.envs`), on the engines' URLs;
* :class:`TrainerWorker`: the Megatron trainer (:class:`~.trainer.HartsTrainer`) and the export of
  its weights as a Hugging Face checkpoint (:class:`~.weight_sync.WeightSync`);
* :class:`EngineWorker`: one engine server it starts and owns;
* :class:`RLLoop`: the driver. With ``use_ray=True`` engines, rollout workers and the trainer are
  Ray actors (``ray.remote`` of the same classes); without Ray they are plain objects in this
  process (tests, debugging). Engine URLs are loopback addresses and checkpoints reach engines as
  a path: one node today (across nodes: servers bound to the node's address and a shared file
  system, not done).

Companions, switched on in :class:`LoopConfig`: ``router="war"`` places turns with WAR's
cache/progress/load-aware :class:`~.war.scheduler.WarScheduler` (default ``sticky``: sticky
least-loaded); ``shadows=N`` (local path, started engines) runs the engines under Belayer's
:class:`~.belayer.engine.Supervisor` with ``N`` pre-started shadow workers, and the agent loop's
engines are :class:`~.belayer.engine.ResumableEngine` s: a server that dies mid-step is replaced by
a shadow and its requests continue from their logged tokens (rows count ``failovers``);
``turn_queue="cmlfq"`` (or ``plas``, ``fcfs``) orders the turns waiting for one of the rollout's
``max_concurrency`` slots with Libra's queue policy (:class:`~.libra.cmlfq.TurnQueue`);
``libra_pool=N`` runs an elastic pool of ``N`` Ray workers (Megatron trainer, embedded engines)
instead of the trainer and the engines: each step a split policy (``libra_policy``: Libra's
planner on the measured step times, or a fixed ``libra_schedule``) decides how many serve rollouts
and how many train, and workers switch roles between steps (:mod:`.libra.elastic_loop`); rows
then also record ``libra_split`` ([rollout, training] workers), ``rollout_ranks``, ``train_ranks``,
``switch_s`` (the switch before the step's rollout) and ``libra_moves`` / ``libra_plan``.

Per step the driver records ``{step, engine, trainer, rollout_s, train_s, sync_s, compression,
reward_mean, logprob_mismatch_max, ...}``; ``logprob_mismatch_*`` compares the engine's log-probs
of the sampled tokens (weights of version ``step``, pushed after the previous step) with the
trainer's tree-packed log-probs of the same tokens under the same weights.
"""
from __future__ import annotations

import itertools
import json
import logging
import os
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from ..tree import trees_from_trajectories, write_jsonl
from .agent_loop import AgentLoop, RolloutConfig
from .tokenizer import ByteTokenizer

logger = logging.getLogger(__name__)
NUM_TASK_INDICES = 10_000      # steps draw their tasks from indices 0..NUM_TASK_INDICES-1 of the family


@dataclass
class LoopConfig:
    """What one run of the loop does. ``engine``: ``embedded`` (CPU default) or ``sglang``;
    ``engine_urls``: use running servers instead of starting ``num_engines``; ``family``: task
    family of :func:`~.envs.make_env`; ``tasks_per_step`` tasks (groups) a step, each
    ``rollout.group_size`` episodes (+ forks); ``trainer``: ``tree`` (HARTS) or ``traj``
    (trajectory-wise baseline, same code otherwise); ``model``: a preset of
    :func:`~.weight_sync.model_config` or a path to a config.json; ``out``: run directory
    (checkpoints, engine logs, ``rollout.json`` rows); ``engine_env``: environment of started
    servers (e.g. SGLang's ``PYTHONPATH``); ``keep_engines``: leave started servers running after
    ``run()`` (in ``RLLoop.servers``, for a next run on the same engines); ``weights_dir``: where
    checkpoints are written (default ``<out>/weights``; a RAM disk such as ``/dev/shm`` saves the
    disk write); ``save_rollouts``: each step's trajectories as ``<out>/rollouts/step_NNNN.jsonl``
    (the trajectory JSONL format, readable by ``megatron_harts.tree.read_jsonl``);
    ``sft_warmup_steps`` supervised steps on scripted episodes first, at ``warmup_lr`` (default
    ``lr``); ``warmup_target_reward``: stop the warm-up early, once a probe rollout (every
    ``warmup_probe_every`` warm-up steps, on tasks no RL step uses, not trained on) reaches this mean
    reward: a warm-up that is too long solves the task and leaves GRPO without reward variance, one
    that is too short leaves too few rewards; ``sft_warmup_steps`` is then the most it runs (the
    probes are in ``RLLoop.warmup``: steps done, probe rewards); ``router``: ``sticky`` (sticky least-loaded) or ``war`` (WAR's scheduler, per rollout
    worker; ``router_cache_hit`` per step: WAR's modelled prefix-cache hit rate of that step's turns);
    ``shadows``: Belayer shadow workers beside the ``num_engines`` serving ones (0: off; needs started
    engines and the local path; the supervisor stops its servers at the end, ``keep_engines`` or not;
    a row's ``failovers`` are those since the previous row: its rollout, training and weight push);
    ``turn_queue``: Libra's queue policy for turns waiting for a concurrency slot (``fcfs``, ``plas``,
    ``cmlfq``; None: the loop's own first-come order); ``libra_pool``: workers of an elastic pool
    that replaces the trainer and the engines (0: off; >= 2; Megatron trainer, embedded engines,
    the local path: not with ``engine='sglang'``, ``engine_urls``, ``shadows``, ``use_ray`` (the pool's
    workers are Ray actors already), ``device='cuda'`` or ``num_engines`` other than 1: the split
    decides the engines); ``libra_policy``: ``planner`` (``StreamPlanner.plan_sync`` on the
    measured step) or ``schedule`` (``libra_schedule[step % len]`` rollout workers per step)."""

    steps: int = 2
    engine: str = "embedded"
    engine_urls: list[str] = field(default_factory=list)
    num_engines: int = 1
    engine_args: list[str] = field(default_factory=list)
    engine_env: dict[str, str] = field(default_factory=dict)
    keep_engines: bool = False
    family: str = "lookup"
    tasks_per_step: int = 4
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    rollout_workers: int = 1
    trainer: str = "tree"
    model: str = "tiny"
    lr: float = 1e-3
    chunk_size: int = 16
    attention_backend: str = "auto"
    old_logprobs: str = "trainer"
    device: str = "cpu"
    seed: int = 0
    use_ray: bool = False
    out: str = "out/rl"
    sft_warmup_steps: int = 0
    warmup_lr: float | None = None
    warmup_target_reward: float | None = None
    warmup_probe_every: int = 2
    weights_dir: str | None = None
    save_rollouts: bool = True
    router: str = "sticky"
    shadows: int = 0
    turn_queue: str | None = None
    libra_pool: int = 0
    libra_policy: str = "planner"
    libra_schedule: list[int] = field(default_factory=list)

    def __post_init__(self):
        if self.router not in ROUTERS:
            raise ValueError(f"LoopConfig.router must be one of {ROUTERS}, got {self.router!r}")
        if self.shadows < 0:
            raise ValueError(f"LoopConfig.shadows must be >= 0, got {self.shadows}")
        if self.turn_queue is not None and self.turn_queue not in TURN_QUEUES:
            raise ValueError(f"LoopConfig.turn_queue must be one of {TURN_QUEUES} or None, got {self.turn_queue!r}")
        if self.warmup_probe_every < 1:
            raise ValueError(f"LoopConfig.warmup_probe_every must be >= 1, got {self.warmup_probe_every}")
        if self.warmup_target_reward is not None and not self.sft_warmup_steps:
            raise ValueError("LoopConfig.warmup_target_reward needs sft_warmup_steps > 0 (the most warm-up steps)")
        if self.shadows and (self.use_ray or self.engine_urls):
            raise ValueError("LoopConfig.shadows (Belayer shadow workers) needs engines started by the loop on the "
                             "local path: not with use_ray or engine_urls")
        if self.libra_pool or self.libra_schedule:
            self._check_libra()

    def _check_libra(self) -> None:
        from .libra.elastic_loop import check_split_config

        if self.libra_pool == 0:
            raise ValueError("LoopConfig.libra_schedule needs libra_pool >= 2")
        check_split_config(self.libra_pool, self.libra_policy, self.libra_schedule)
        bad = [(name, why) for name, on, why in [
            ("engine", self.engine != "embedded", f"engine={self.engine!r}: the pool serves with its workers' "
                                                 "embedded engines"),
            ("engine_urls", bool(self.engine_urls), "engine_urls: the pool's workers are the engines"),
            ("shadows", bool(self.shadows), "shadows (Belayer): not with an elastic pool"),
            ("use_ray", self.use_ray, "use_ray: the pool's workers are Ray actors already, the driver runs locally"),
            ("device", self.device != "cpu", f"device={self.device!r}: the pool runs on CPU (gloo)"),
            ("num_engines", self.num_engines != 1, "num_engines: the split decides the engines"),
        ] if on]
        if bad:
            raise ValueError(f"LoopConfig.libra_pool does not support {bad[0][1]}")


ROUTERS = ("sticky", "war")
TURN_QUEUES = ("fcfs", "plas", "cmlfq")


class RolloutWorker:
    """Runs the agent loop of one task family on the engines at ``urls`` (HTTP clients), or on
    ``engines`` given as objects (e.g. Belayer's resumable engines; local path only). ``router``:
    ``sticky`` (sticky least-loaded) or ``war`` (a :class:`~.war.scheduler.WarScheduler` of its own,
    whose gate wraps the engines); its prefix-cache hit estimate is ``stats["router_cache_hit"]``."""

    def __init__(self, urls: list[str], family: str, rollout: RolloutConfig, seed: int = 0,
                 router: str = "sticky", engines: list | None = None, turn_queue: str | None = None):
        from .agent_loop import sticky_least_loaded
        from .engines import HttpEngine
        from .envs import make_env

        self.family, self.seed = family, seed
        turns = {"max_turns": rollout.max_turns} if rollout.max_turns else {}     # else the family's own
        engines = list(engines) if engines is not None else [HttpEngine(u) for u in urls]
        self.scheduler = None
        pick = sticky_least_loaded
        if router == "war":
            from .war.scheduler import WarScheduler
            self.scheduler = pick = WarScheduler(len(engines))
            engines = self.scheduler.wrap(engines)
        elif router != "sticky":
            raise ValueError(f"router must be one of {ROUTERS}, got {router!r}")
        queue = None
        if turn_queue is not None:
            from .libra.cmlfq import TurnQueue
            queue = TurnQueue(turn_queue)
        self.loop = AgentLoop(engines, ByteTokenizer(), lambda task: make_env(family, int(task), seed=seed, **turns),
                              rollout, pick_engine=pick, turn_queue=queue)

    def rollout(self, tasks: list[int], group_ids: list[str]):
        st = self.scheduler.stats if self.scheduler is not None else None
        before = (st["started_cached"], st["started_prompt"]) if st is not None else None
        res = self.loop.rollout(tasks, group_ids)
        if st is not None:                  # this call's turns only (the scheduler's counters are cumulative)
            res.stats["router_cache_hit"] = (st["started_cached"] - before[0]) / max(1, st["started_prompt"] - before[1])
        return res

    def demonstrations(self, tasks: list[int], group_ids: list[str]):
        return demonstrations(self.family, tasks, group_ids, seed=self.seed)


def demonstrations(family: str, tasks: list[int], group_ids: list[str], seed: int = 0):
    """One scripted correct episode per task (the environment's ``solution()``, run in its
    sandbox), advantage 1 and no ``old_logprobs``: a supervised warm-up batch (cold start)."""
    from .agent_loop import scripted_trajectory
    from .envs import make_env
    out = []
    for t, g in zip(tasks, group_ids):
        env = make_env(family, int(t), seed=seed)
        if not hasattr(env, "solution"):
            env.close()
            raise ValueError(f"task family {family!r} has no scripted solution for a warm-up")
        out.append(scripted_trajectory(env, env.solution(), ByteTokenizer(), traj_id=f"{g}/demo", group_id=g))
    return out


class EngineWorker:
    """One engine server (``sglang`` or ``embedded``) owned by this object's process: with Ray an
    actor, placed by Ray (the server runs on that actor's node and dies with it). Methods, not
    attributes, so the same calls work on the actor handle."""

    def __init__(self, kind: str, model_path: str, *, log_path: str, extra_args: list[str], env: dict[str, str],
                 weight_version: str):
        from .engines import start_engine
        self.server = start_engine(kind, model_path, log_path=log_path, extra_args=list(extra_args),
                                   weight_version=weight_version, env=dict(env))

    def url(self) -> str:
        return self.server.url

    def startup_s(self) -> float | None:
        return self.server.startup_s

    def stop(self) -> None:
        self.server.stop()


class TrainerWorker:
    """The trainer and its weight export; lives where the training GPU is."""

    def __init__(self, hf_config: dict, out_root: str, *, tree: bool, lr: float, chunk_size: int, device: str,
                 seed: int, attention_backend: str = "auto", old_logprobs: str = "trainer"):
        from .trainer import HartsTrainer
        from .weight_sync import WeightSync

        self.trainer = HartsTrainer(hf_config, tree=tree, lr=lr, chunk_size=chunk_size, device=device, seed=seed,
                                    attention_backend=attention_backend, old_logprobs=old_logprobs)
        self.sync = WeightSync(hf_config, out_root)

    def export(self, version: str) -> tuple[str, dict]:
        path, stats = self.sync.export(self.trainer.model, version)
        return str(path), stats.to_dict()

    def train_step(self, trajectories) -> dict:
        return self.trainer.train_step(trajectories)

    def logprobs(self, trajectories):
        return self.trainer.logprobs(trajectories)

    def set_lr(self, lr: float) -> None:
        self.trainer.set_lr(lr)


def _remote(cls, use_ray: bool, **options):
    if not use_ray:
        return cls
    import ray
    return ray.remote(**options)(cls)


def _call(obj, method: str, *args, use_ray: bool):
    return getattr(obj, method).remote(*args) if use_ray else getattr(obj, method)(*args)


def _get(x, use_ray: bool):
    if not use_ray:
        return x
    import ray
    return ray.get(x)


class RLLoop:
    """Driver of :class:`LoopConfig` runs; ``run()`` returns the per-step rows (also written to
    ``<out>/rollout.json``)."""

    def __init__(self, cfg: LoopConfig):
        from .weight_sync import model_config

        self.cfg = cfg
        self.out = Path(cfg.out)
        self.out.mkdir(parents=True, exist_ok=True)
        self.hf_config = model_config(cfg.model)
        self.servers: list[Any] = []
        self.rows: list[dict] = []
        self.warmup: dict = {"steps": 0, "target_reward": cfg.warmup_target_reward, "probes": [], "train": []}
        if cfg.use_ray:
            import ray
            if not ray.is_initialized():
                ray.init(_node_ip_address="127.0.0.1", include_dashboard=False, log_to_driver=True,
                         runtime_env={"env_vars": {"PYTHONPATH": os.pathsep.join(
                             [str(Path(__file__).resolve().parents[2]), os.environ.get("PYTHONPATH", "")])}})

    # -- setup / teardown ------------------------------------------------------------------------
    def _start_libra(self):
        """The elastic pool replaces the trainer and the engines; the first split is taken here."""
        from .libra.elastic_loop import LibraController, LibraSplit

        cfg = self.cfg
        split = LibraSplit(cfg.libra_pool, cfg.libra_policy, cfg.libra_schedule)
        self.libra = LibraController(cfg.libra_pool, self.hf_config, cfg.weights_dir or str(self.out / "weights"),
                                     split, seed=cfg.seed, lr=cfg.lr, chunk_size=cfg.chunk_size,
                                     rl=dict(tree=cfg.trainer == "tree", old_logprobs=cfg.old_logprobs))
        self.trainer = self.libra.trainer
        self.supervisor = None
        self._libra_switch(split.initial(), "v0", {"why": "initial"})

    def _libra_switch(self, rollout: int, version: str, plan: dict) -> None:
        """Switch the pool to ``rollout`` serving workers (newcomers serve ``version``) and point the
        rollout workers at their engines; what it did goes into the next row (``_libra_row``)."""
        sw = self.libra.switch(rollout, version)
        self.urls = self.libra.urls()
        cfg = self.cfg
        self.workers = [RolloutWorker(self.urls, cfg.family, cfg.rollout, cfg.seed, router=cfg.router,
                                      turn_queue=cfg.turn_queue) for _ in range(cfg.rollout_workers)]
        self._libra_row = {"libra_split": [rollout, cfg.libra_pool - rollout],
                           "rollout_ranks": self.libra.rollout_ranks, "switch_s": sw["switch_s"],
                           "libra_moves": sw["moves"], "libra_plan": plan}
        logger.info("libra: %d serving %s, %d training; switch %.2f s (%s)", rollout, self.libra.rollout_ranks,
                    cfg.libra_pool - rollout, sw["switch_s"], plan.get("why"))

    def _start(self):
        cfg, ray_ = self.cfg, self.cfg.use_ray
        self.libra = None
        if cfg.libra_pool:
            return self._start_libra()
        Trainer = _remote(TrainerWorker, ray_, num_cpus=0, num_gpus=0.5 if cfg.device == "cuda" and ray_ else 0)
        kw = dict(tree=cfg.trainer == "tree", lr=cfg.lr, chunk_size=cfg.chunk_size, device=cfg.device, seed=cfg.seed,
                  attention_backend=cfg.attention_backend, old_logprobs=cfg.old_logprobs)
        weights = cfg.weights_dir or str(self.out / "weights")
        self.trainer = Trainer.remote(self.hf_config, weights, **kw) if ray_ else Trainer(self.hf_config, weights, **kw)
        path, stats = _get(_call(self.trainer, "export", "v0", use_ray=ray_), ray_)
        logger.info("initial weights v0 exported to %s (%.2f s)", path, stats.get("seconds", float("nan")))
        urls = list(cfg.engine_urls)
        self.supervisor, engines = None, None
        if cfg.shadows:
            from .belayer.engine import ResumableEngine, Supervisor
            from .engines import start_engine
            logs = itertools.count()

            # Belayer streams every request: events of 8 tokens (SGLang's and the embedded server's
            # --stream-interval, unless engine_args set it) keep the failure-free overhead within 3 %
            # on CPU (docs/benchmarks/belayer.md); a failure regenerates at most 7 unstreamed tokens
            extra = list(cfg.engine_args)
            if not any(a.split("=")[0] == "--stream-interval" for a in extra):
                extra += ["--stream-interval", "8"]

            def start_server(model_path, version):
                return start_engine(cfg.engine, model_path, log_path=str(self.out / f"engine{next(logs)}.log"),
                                    extra_args=extra, env=dict(cfg.engine_env), weight_version=version)
            self.supervisor = Supervisor(start_server, path, "v0", num_active=cfg.num_engines,
                                         num_shadows=cfg.shadows).start()
            engines = [ResumableEngine(self.supervisor, slot=i) for i in range(cfg.num_engines)]
            urls = [self.supervisor.engine(i).url for i in range(cfg.num_engines)]
        elif not urls:
            gpu = 0.5 if cfg.engine == "sglang" and ray_ else 0       # colocated with the trainer on one GPU
            Engine = _remote(EngineWorker, ray_, num_cpus=0, num_gpus=gpu)
            for i in range(cfg.num_engines):
                ekw = dict(log_path=str(self.out / f"engine{i}.log"), extra_args=list(cfg.engine_args),
                           env=dict(cfg.engine_env), weight_version="v0")
                self.servers.append(Engine.remote(cfg.engine, path, **ekw) if ray_ else Engine(cfg.engine, path, **ekw))
            urls = _get([_call(e, "url", use_ray=ray_) for e in self.servers], ray_)
        else:
            self._push(path, "v0", urls)
        self.urls = urls
        Worker = _remote(RolloutWorker, ray_, num_cpus=0)
        wkw = dict(router=cfg.router, engines=engines, turn_queue=cfg.turn_queue)
        self.workers = [Worker(urls, cfg.family, cfg.rollout, cfg.seed, **wkw) if not ray_ else
                        Worker.remote(urls, cfg.family, cfg.rollout, cfg.seed, router=cfg.router,
                                      turn_queue=cfg.turn_queue)
                        for _ in range(cfg.rollout_workers)]

    def _push(self, path: str, version: str, urls: list[str] | None = None) -> float:
        """Every engine loads the checkpoint at ``path`` (in parallel); returns seconds."""
        from .engines import HttpEngine
        from .weight_sync import push_weights
        t0 = time.perf_counter()
        if getattr(self, "supervisor", None) is not None and urls is None:
            self.supervisor.update_weights_from_disk(path, version)        # serving workers and shadows
        else:
            push_weights([HttpEngine(u) for u in urls or self.urls], path, version)
        return time.perf_counter() - t0

    def close(self):
        if getattr(self, "libra", None) is not None:
            self.libra.close()
            self.libra = None
            return
        if getattr(self, "supervisor", None) is not None:
            self.supervisor.close()
            self.supervisor = None
        if not self.cfg.keep_engines:
            _get([_call(s, "stop", use_ray=self.cfg.use_ray) for s in self.servers], self.cfg.use_ray)
            self.servers = []
        if self.cfg.use_ray:
            import ray
            ray.shutdown()
        elif hasattr(self, "trainer"):
            self.trainer.trainer.close()

    # -- the loop --------------------------------------------------------------------------------
    def _tasks(self, step: int, n: int | None = None) -> tuple[list[int], list[str]]:
        """``n`` (default ``tasks_per_step``) distinct task indices of step ``step``, seeded."""
        rng = np.random.default_rng([self.cfg.seed, step])
        idx = rng.choice(NUM_TASK_INDICES, size=n or self.cfg.tasks_per_step, replace=False)
        return [int(i) for i in idx], [f"s{step}-{self.cfg.family}-{int(i)}" for i in idx]

    def _rollout(self, step: int):
        tasks, gids = self._tasks(step)
        ray_ = self.cfg.use_ray
        shards = [(tasks[i::len(self.workers)], gids[i::len(self.workers)]) for i in range(len(self.workers))]
        results = _get([_call(w, "rollout", t, g, use_ray=ray_) for w, (t, g) in zip(self.workers, shards) if t],
                       ray_)
        trajs = [t for r in results for t in r.trajectories]
        failed = [f for r in results for f in r.failed]
        stats = {k: sum(r.stats[k] for r in results) for k in ("trajectories", "failed", "generated_tokens",
                                                                "trajectory_tokens", "turns", "groups",
                                                                "zero_variance_groups")}
        stats["rollout_s"] = max(r.stats["rollout_s"] for r in results)
        stats["reward_mean"] = float(np.mean([t.reward for t in trajs])) if trajs else float("nan")
        stats["weight_versions"] = sorted({v for r in results for v in r.stats["weight_versions"]})
        hits = [r.stats["router_cache_hit"] for r in results if "router_cache_hit" in r.stats]
        stats["router_cache_hit"] = float(np.mean(hits)) if hits else None
        trees = trees_from_trajectories(trajs) if trajs else []
        stats["data_compression"] = (sum(t.num_trajectory_tokens for t in trees) / max(1, sum(t.num_tokens for t in trees)))
        return trajs, failed, stats

    def _warmup_probe(self, done: int) -> float:
        """Push the warm-up's weights after ``done`` steps and return the mean reward of one probe
        rollout on tasks of their own (step index 2_000_000 + done: no RL step draws them)."""
        ray_ = self.cfg.use_ray
        version = f"v0w{done}"
        path, _ = _get(_call(self.trainer, "export", version, use_ray=ray_), ray_)
        self._push(path, version)
        trajs, _, rs = self._rollout(2_000_000 + done)
        reward = rs["reward_mean"] if trajs else 0.0
        self.warmup["probes"].append({"after_steps": done, "reward_mean": reward,
                                      "zero_variance_groups": rs["zero_variance_groups"], "groups": rs["groups"]})
        logger.info("warm-up probe after %d steps: reward %.3f (target %.3f)", done, reward,
                    self.cfg.warmup_target_reward)
        return reward

    def run(self) -> list[dict]:
        cfg, ray_ = self.cfg, self.cfg.use_ray
        try:
            self._start()
            if cfg.sft_warmup_steps and cfg.warmup_lr is not None:
                _get(_call(self.trainer, "set_lr", cfg.warmup_lr, use_ray=ray_), ray_)
            self.warmup = {"steps": 0, "target_reward": cfg.warmup_target_reward, "probes": [], "train": []}
            for w in range(cfg.sft_warmup_steps):
                tasks, gids = self._tasks(1_000_000 + w, cfg.tasks_per_step * cfg.rollout.group_size)
                demos = _get(_call(self.workers[0], "demonstrations", tasks, gids, use_ray=ray_), ray_)
                m = _get(_call(self.trainer, "train_step", demos, use_ray=ray_), ray_)
                self.warmup["steps"] = w + 1
                self.warmup["train"].append({k: m[k] for k in ("loss", "grad_norm", "nll", "train_ranks") if k in m})
                logger.info("warm-up %d/%d: nll %.4f", w + 1, cfg.sft_warmup_steps, m["nll"])
                if cfg.warmup_target_reward is not None and (w + 1) % cfg.warmup_probe_every == 0 \
                        and w + 1 < cfg.sft_warmup_steps and self._warmup_probe(w + 1) >= cfg.warmup_target_reward:
                    break
            served = "v0"
            if cfg.sft_warmup_steps:
                _get(_call(self.trainer, "set_lr", cfg.lr, use_ray=ray_), ray_)
                path, _ = _get(_call(self.trainer, "export", "v0w", use_ray=ray_), ray_)
                self._push(path, "v0w")
                served = "v0w"
            events_seen = 0          # failovers are counted in the row of the step they fell in (or before)
            for step in range(cfg.steps):
                if self.libra is not None and step > 0:
                    r, plan = self.libra.split.plan(step, cfg.steps, self.rows, self.libra.switches)
                    self._libra_switch(r, served, plan)
                trajs, failed, rs = self._rollout(step)
                if not trajs:
                    raise RuntimeError(f"step {step}: every episode failed ({failed[:3]})")
                if rs["weight_versions"] != [served]:     # on-policy: every turn on the pushed weights
                    raise RuntimeError(f"step {step}: rollouts used weight versions {rs['weight_versions']}, "
                                       f"expected only {served!r} (an engine did not load the update)")
                if cfg.save_rollouts:
                    (self.out / "rollouts").mkdir(exist_ok=True)
                    write_jsonl(self.out / "rollouts" / f"step_{step:04d}.jsonl", trajs)
                m = _get(_call(self.trainer, "train_step", trajs, use_ray=ray_), ray_)
                version = f"v{step + 1}"
                t0 = time.perf_counter()
                path, ws = _get(_call(self.trainer, "export", version, use_ray=ray_), ray_)
                export_s = time.perf_counter() - t0
                push_s = self._push(path, version)
                served = version
                events = self.supervisor.events[events_seen:] if self.supervisor is not None else []
                events_seen += len(events)
                row = {"step": step, "engine": cfg.engine, "trainer": cfg.trainer, "rollout_s": rs["rollout_s"],
                       "train_s": m["train_s"], "sync_s": export_s + push_s, "sync_export_s": export_s,
                       "sync_push_s": push_s, "sync_bytes": ws.get("bytes"),
                       "sync_wait_s": ws.get("wait_s"), "sync_gather_s": ws.get("gather_s"), "compression": m["compression"],
                       "data_compression": rs["data_compression"],
                       "reward_mean": rs["reward_mean"], "logprob_mismatch_max": m.get("logprob_mismatch_max"),
                       "logprob_mismatch_mean": m.get("logprob_mismatch_mean"),
                       "logprob_mismatch_p99": m.get("logprob_mismatch_p99"), "loss": m["loss"],
                       "grad_norm": m["grad_norm"], "nll": m["nll"], "trajectories": rs["trajectories"], "failed": rs["failed"],
                       "generated_tokens": rs["generated_tokens"], "trajectory_tokens": rs["trajectory_tokens"],
                       "packed_tokens": m["packed_tokens"], "rollout_weight_versions": rs["weight_versions"],
                       "groups": rs["groups"], "zero_variance_groups": rs["zero_variance_groups"],
                       "router": cfg.router, "router_cache_hit": rs["router_cache_hit"],
                       "failovers": len(events), "failover_s": [round(e.seconds, 3) for e in events]}
                if self.libra is not None:
                    row.update(self._libra_row, train_ranks=m["train_ranks"])
                self.rows.append(row)
                logger.info("step %d: reward %.3f, compression %.2fx, rollout %.2f s, train %.2f s, sync %.2f s, "
                            "mismatch max %.2e", step, row["reward_mean"], row["compression"], row["rollout_s"],
                            row["train_s"], row["sync_s"], row["logprob_mismatch_max"] or float("nan"))
                with open(self.out / "rollout.json", "w") as f:
                    json.dump({"config": _jsonable(asdict(cfg)), "hf_config": self.hf_config, "warmup": self.warmup,
                               "rows": self.rows},
                              f, indent=1)
        finally:
            self.close()
        return self.rows


def _jsonable(x):
    return json.loads(json.dumps(x, default=str))
