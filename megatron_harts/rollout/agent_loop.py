"""Multi-turn agentic rollouts with tools, as rollout trees.

One *episode* alternates model turns (sampled by an :class:`~.types.Engine` until a stop token:
``</call>`` ends a tool call, ``<eos>`` an answer; or ``max_new_tokens``) and environment
observations (the tool's output, tokenised and appended). Per trajectory it records the token ids,
the engine's log-probs of the generated tokens (``old_logprobs``), a loss mask that is 1 exactly
on generated tokens, the group (task) id and the final reward.

Trees: ``group_size`` episodes start from each task's prompt (they share it), and with
``branch_turn=t, branch_factor=K`` every episode that is still running after its turn ``t`` is
forked into ``K`` continuations: the environment's state is forked (``Environment.fork``: the
sandbox's file system is copied) and the token prefix is shared, so the group's trajectories
form a real rollout tree that HARTS packs with every shared token once.

Scheduling: every model turn is one engine request; a pool of threads runs turns of many
episodes concurrently (``max_concurrency``). Which engine serves a turn is decided by
``pick_engine(episode, engines, load)`` (default: sticky, the episode keeps its engine, new
episodes go to the engine with the fewest turns in flight); the scheduling issue replaces it.
Which waiting turn gets a free slot is first come, first served, unless a ``turn_queue`` orders
them (e.g. Libra's C-MLFQ, :class:`~.libra.cmlfq.TurnQueue`): every turn that is ready is pushed
with its :class:`TurnSignals`, and a turn is popped whenever fewer than ``max_concurrency`` run.

Faults: an engine error is retried on the same or another engine (``engine_retries``) from the
logged prefix (the prompt of a turn is the whole context so far, so nothing generated is lost);
an episode that still fails is returned in :attr:`RolloutResult.failed` with its reason and
logged, never dropped silently. Environment problems (hung or chatty tools, malformed calls) are
answered by the environment itself (timeouts, truncated output, error observations).
"""
from __future__ import annotations

import itertools
import logging
import threading
import time
import uuid
import zlib
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from typing import Callable, Sequence

import numpy as np

from ..tree import Trajectory, make_trajectory
from .tokenizer import BOS, END_CALL, EOS, OBS, END_OBS, Tokenizer
from .types import Engine, EngineError, Environment, SamplingParams

logger = logging.getLogger(__name__)
SAFETY_TURNS = 64           # the loop ends an episode after this many turns whatever its environment says


@dataclass
class RolloutConfig:
    """Sampling and tree shape of one rollout step.

    ``group_size``: episodes per task started from its prompt; ``branch_turn``/``branch_factor``:
    fork every running episode after that turn (1-based) into ``branch_factor`` continuations;
    ``max_turns``: model turns per episode (``None``: the environment's own budget; the loop
    stops an episode after ``SAFETY_TURNS`` in any case); ``max_new_tokens``: per turn; ``max_context_tokens``:
    an episode whose context would exceed it ends (reward 0, ``truncated``); ``engine_retries``:
    other engines tried for a failed turn, and a failed engine is skipped for
    ``engine_cooldown_s`` while another is up; ``adv_norm``: GRPO
    advantage = reward - group mean, divided by the group std if ``"std"``.
    """

    group_size: int = 4
    branch_turn: int | None = None
    branch_factor: int = 1
    max_turns: int | None = None
    max_new_tokens: int = 64
    max_context_tokens: int = 4096
    temperature: float = 1.0
    top_p: float = 1.0
    max_concurrency: int = 16
    engine_retries: int = 2
    engine_cooldown_s: float = 30.0
    adv_norm: str = "std"
    seed: int = 0


@dataclass
class Turn:
    """One engine request of an episode, as logged for replay: the context length it started
    from, the generated ids and their log-probs, which engine and weight version served it."""

    start: int
    output_ids: list[int]
    logprobs: list[float]
    finish_reason: str
    engine: str
    weight_version: str | None
    latency_s: float


@dataclass
class Episode:
    """A running trajectory: its context (``tokens``, ``loss_mask``, ``logprobs`` aligned with it),
    its environment, and the turns so far. ``path`` names its position in the group's tree
    (sample index, then the branch index at each fork)."""

    group_id: str
    path: tuple[int, ...]
    env: Environment
    tokens: list[int]
    loss_mask: list[int]
    logprobs: list[float]
    turns: list[Turn] = field(default_factory=list)
    engine_index: int | None = None
    reward: float | None = None
    done: bool = False
    info: dict = field(default_factory=dict)

    @property
    def traj_id(self) -> str:
        return f"{self.group_id}/" + ".".join(map(str, self.path))

    def fork(self, k: int) -> "Episode":
        return Episode(self.group_id, self.path + (k,), self.env.fork(), list(self.tokens), list(self.loss_mask),
                       list(self.logprobs), list(self.turns), self.engine_index,
                       info={k: v for k, v in self.info.items() if k != "program"})     # a fork is its own program


@dataclass
class RolloutResult:
    """The step's finished trajectories (advantages set per group), the failed episodes
    (``traj_id``, reason) and timing / size statistics."""

    trajectories: list[Trajectory]
    failed: list[tuple[str, str]]
    stats: dict


@dataclass
class TurnSignals:
    """What a turn queue sees of a ready turn (what a serving system could see): ``program``: the
    episode's number in this rollout (forks get their own); ``turn``: 0-based index of the turn;
    ``ctx``: context tokens; ``attained``: tokens the episode generated so far; ``tool_ok``: the
    last tool return (True: exit 0, False: non-zero exit or an error, None: no tool ran yet or
    the environment does not say); ``obs_tokens``: tokens of that observation."""

    program: int
    turn: int
    ctx: int
    attained: int
    tool_ok: bool | None
    obs_tokens: int


def sticky_least_loaded(episode: Episode, engines: Sequence[Engine], in_flight: Sequence[int]) -> int:
    """Keep an episode on its engine (its prefix is cached there); place new ones on the engine
    with the fewest turns in flight."""
    if episode.engine_index is not None:
        return episode.engine_index
    return int(np.argmin(in_flight))


class AgentLoop:
    """Runs episodes of ``tasks`` on ``engines``; see the module docstring.

    ``env_factory(task) -> Environment`` makes a fresh environment of one task (a task is whatever
    the factory takes, e.g. ``("lookup", 3)``); ``tokenizer`` maps text to the engines' ids.
    """

    def __init__(self, engines: Engine | Sequence[Engine], tokenizer: Tokenizer,
                 env_factory: Callable[[object], Environment], config: RolloutConfig | None = None,
                 pick_engine: Callable[[Episode, Sequence[Engine], Sequence[int]], int] = sticky_least_loaded,
                 turn_queue=None):
        self.engines = [engines] if isinstance(engines, Engine) else list(engines)
        if not self.engines:
            raise ValueError("AgentLoop needs at least one engine")
        self.tok, self.env_factory = tokenizer, env_factory
        self.cfg = config or RolloutConfig()
        if self.cfg.branch_factor < 1 or self.cfg.group_size < 1:
            raise ValueError("group_size and branch_factor must be >= 1")
        self.pick_engine = pick_engine
        self.turn_queue = turn_queue                     # push(episode, TurnSignals, now) / pop(now) / len()
        self._programs = itertools.count()
        self._in_flight = [0] * len(self.engines)
        self._down_until = [0.0] * len(self.engines)     # monotonic time until which an engine is skipped
        self._lock = threading.Lock()
        self._rid = itertools.count()
        self._rid_tag = uuid.uuid4().hex[:8]
        self._stop_ids = [tokenizer.token_id(END_CALL), tokenizer.token_id(EOS)]

    # -- one model turn + environment step -------------------------------------------------------
    def _generate(self, ep: Episode, sampling: SamplingParams):
        """Serve one turn: first on the engine ``pick_engine`` chooses, after an error on the
        least-loaded engine not tried yet for this turn (all tried: any, least loaded)."""
        errors, tried = [], set()
        for attempt in range(self.cfg.engine_retries + 1):
            with self._lock:
                now = time.monotonic()
                up = [j for j in range(len(self.engines)) if self._down_until[j] <= now]
                # engines that failed recently are skipped (while any other is up), as are those
                # tried for this turn already
                load = [n if j in up else n + (1 << 20) for j, n in enumerate(self._in_flight)]
                if attempt == 0 and (ep.engine_index is None or ep.engine_index in up):
                    i = self.pick_engine(ep, self.engines, load)
                else:
                    free = [j for j in range(len(self.engines)) if j not in tried] or list(range(len(self.engines)))
                    i = min(free, key=lambda j: load[j])
                self._in_flight[i] += 1
            tried.add(i)
            engine = self.engines[i]
            try:
                # prefix-free: SGLang's scheduler aborts every request whose rid *starts with* the aborted
                # one ("t0/0#0-1" would take "t0/0#0-10" with it); the loop tag keeps loops apart
                gen = engine.generate(ep.tokens, sampling,
                                      rid=f"{ep.traj_id}#{len(ep.turns)}-{next(self._rid)}~{self._rid_tag}")
                if gen.finish_reason == "abort":
                    raise EngineError(f"{engine.name}: request aborted by the engine")
                if len(gen.logprobs) != len(gen.output_ids):
                    raise EngineError(f"{engine.name}: {len(gen.output_ids)} output ids but "
                                      f"{len(gen.logprobs)} logprobs")
                ep.engine_index = i
                return gen, engine
            except EngineError as e:
                errors.append(str(e))
                with self._lock:
                    self._down_until[i] = time.monotonic() + self.cfg.engine_cooldown_s
                logger.warning("%s: turn %d failed on %s (attempt %d): %s", ep.traj_id, len(ep.turns) + 1,
                               engine.name, attempt + 1, e)
            finally:
                with self._lock:
                    self._in_flight[i] -= 1
        raise EngineError("; ".join(errors))

    def _advance(self, ep: Episode) -> Episode:
        """Run one model turn of ``ep`` and the environment's answer to it (mutates ``ep``)."""
        cfg = self.cfg
        budget = min(cfg.max_new_tokens, cfg.max_context_tokens - len(ep.tokens))
        if budget <= 0:
            ep.done, ep.reward, ep.info["truncated"] = True, 0.0, "context budget"
            return ep
        seed = None if cfg.temperature == 0 else zlib.crc32(f"{cfg.seed}/{ep.traj_id}/{len(ep.turns)}".encode())
        sampling = SamplingParams(max_new_tokens=budget, temperature=cfg.temperature, top_p=cfg.top_p,
                                  stop_token_ids=self._stop_ids, seed=seed)
        gen, engine = self._generate(ep, sampling)
        ep.turns.append(Turn(len(ep.tokens), list(gen.output_ids), list(gen.logprobs), gen.finish_reason,
                             engine.name, gen.weight_version, gen.latency_s))
        ep.tokens += gen.output_ids
        ep.loss_mask += [1] * len(gen.output_ids)
        ep.logprobs += gen.logprobs
        res = ep.env.step(self.tok.decode(gen.output_ids))
        info = res.info or {}              # the last tool return, for a turn queue (TurnSignals.tool_ok)
        ep.info["tool_ok"] = False if info.get("error") else (info["exit"] == 0) if "exit" in info else None
        if res.done or len(ep.turns) >= (cfg.max_turns or SAFETY_TURNS):
            ep.done = True
            ep.reward = float(res.reward) if res.reward is not None else 0.0
            if not res.done:
                ep.info["truncated"] = "max turns"
            return ep
        obs = res.observation or ""
        if not obs.startswith(OBS):      # environments may pre-fill markup themselves
            obs = f"{OBS}{obs}{END_OBS}"
        ids = self.tok.encode(obs)
        ep.info["obs_tokens"] = len(ids)
        ep.tokens += ids
        ep.loss_mask += [0] * len(ids)
        ep.logprobs += [0.0] * len(ids)
        return ep

    # -- a whole step -----------------------------------------------------------------------------
    def rollout(self, tasks: Sequence[object], group_ids: Sequence[str] | None = None) -> RolloutResult:
        """``group_size`` episodes (plus forks) per task; returns when all have finished or failed."""
        cfg = self.cfg
        t0 = time.perf_counter()
        group_ids = list(group_ids) if group_ids is not None else [f"task{i}" for i in range(len(tasks))]
        running, finished = self._initial_episodes(tasks, group_ids)
        failed: list[tuple[str, str]] = []
        pending: dict[Future, Episode] = {}
        queue = self.turn_queue
        if queue is not None and len(queue):
            raise ValueError("turn_queue must be empty at the start of a rollout")
        with ThreadPoolExecutor(max_workers=cfg.max_concurrency, thread_name_prefix="agent") as pool:
            def submit(ep: Episode):
                if queue is None:
                    pending[pool.submit(self._advance, ep)] = ep
                else:
                    queue.push(ep, self._signals(ep), time.monotonic())

            def refill():                    # the queue's choice of waiting turns into the free slots
                while queue is not None and len(pending) < cfg.max_concurrency and len(queue):
                    ep = queue.pop(time.monotonic())
                    if ep is None:
                        break
                    pending[pool.submit(self._advance, ep)] = ep

            for ep in running:
                submit(ep)
            try:
                env_s = self._drain(pending, submit, finished, failed, refill)
            finally:                                       # an unexpected error: free every sandbox
                for f, ep in pending.items():
                    f.cancel()
                    ep.env.close()
                while queue is not None and len(queue):
                    ep = queue.pop(time.monotonic())
                    if ep is None:
                        break
                    ep.env.close()
        trajs = self._trajectories(finished)
        n_gen = sum(int(np.sum(t.loss_mask)) for t in trajs)
        versions = sorted({str(t_.weight_version) for e in finished for t_ in e.turns})
        by_group: dict[str, list[float]] = {}
        for t in trajs:
            by_group.setdefault(t.group_id, []).append(t.reward)
        stats = {"rollout_s": time.perf_counter() - t0, "trajectories": len(trajs), "failed": len(failed),
                 "groups": len(by_group),
                 "zero_variance_groups": sum(1 for r in by_group.values() if max(r) == min(r)),
                 "generated_tokens": n_gen, "trajectory_tokens": int(sum(len(t) for t in trajs)),
                 "turns": sum(len(e.turns) for e in finished), "fork_s": env_s,
                 "reward_mean": float(np.mean([t.reward for t in trajs])) if trajs else float("nan"),
                 "weight_versions": versions}
        if failed:
            logger.error("%d of %d episodes failed (kept in RolloutResult.failed): %s", len(failed),
                         len(failed) + len(finished), failed[:3])
        return RolloutResult(trajs, failed, stats)

    def _new_episode(self, task: object, gid: str, sample: int) -> Episode:
        """A fresh episode of ``task``: its environment and the prompt's tokens."""
        env = self.env_factory(task)
        prompt = [self.tok.token_id(BOS)] + self.tok.encode(env.prompt())
        return Episode(gid, (sample,), env, prompt, [0] * len(prompt), [0.0] * len(prompt))

    def _initial_episodes(self, tasks: Sequence[object], group_ids: list[str]) -> tuple[list[Episode], list[Episode]]:
        """``(episodes to run, episodes already finished)`` at the start of a rollout: here
        ``group_size`` fresh episodes per task and none finished (a journaled loop resuming after a
        crash returns the rebuilt and the finished ones, ``belayer.journal``)."""
        return [self._new_episode(task, gid, s) for task, gid in zip(tasks, group_ids)
                for s in range(self.cfg.group_size)], []

    def _signals(self, ep: Episode) -> TurnSignals:
        if "program" not in ep.info:
            ep.info["program"] = next(self._programs)
        return TurnSignals(ep.info["program"], len(ep.turns), len(ep.tokens),
                           sum(len(t.output_ids) for t in ep.turns), ep.info.get("tool_ok"),
                           int(ep.info.get("obs_tokens", 0)))

    def _drain(self, pending: dict, submit, finished: list, failed: list, refill=lambda: None) -> float:
        """Collect finished turns until no episode runs or waits: finished episodes to ``finished``,
        failed ones (and failed forks) to ``failed`` with the reason, running ones resubmitted
        (forked after ``branch_turn``); ``refill()`` moves waiting turns into free slots. Returns the
        seconds spent forking environments."""
        cfg, fork_s = self.cfg, 0.0
        while True:
            refill()
            if not pending:
                break
            done, _ = wait(list(pending), return_when=FIRST_COMPLETED)
            for fut in done:
                ep = pending.pop(fut)
                try:
                    fut.result()
                except Exception as e:       # engine down after retries, env crash: keep the record
                    logger.error("%s failed at turn %d: %s", ep.traj_id, len(ep.turns) + 1, e)
                    failed.append((ep.traj_id, f"{type(e).__name__}: {e}"))
                    ep.env.close()
                    continue
                if ep.done:
                    finished.append(ep)
                    ep.env.close()
                    continue
                forks = []
                if cfg.branch_factor > 1 and len(ep.turns) == cfg.branch_turn and len(ep.path) == 1:
                    tf = time.perf_counter()
                    for k in range(1, cfg.branch_factor):
                        try:
                            forks.append(ep.fork(k))
                        except Exception as e:      # sandbox copy failed: that branch is lost, reported
                            logger.error("%s: fork %d failed: %s", ep.traj_id, k, e)
                            failed.append((f"{ep.traj_id}.{k}", f"fork: {type(e).__name__}: {e}"))
                    fork_s += time.perf_counter() - tf
                    ep.path = ep.path + (0,)
                for e in [ep, *forks]:
                    submit(e)
        return fork_s

    def _trajectories(self, episodes: list[Episode]) -> list[Trajectory]:
        """Trajectories in (group, path) order with GRPO advantages per group."""
        episodes = sorted(episodes, key=lambda e: (e.group_id, e.path))
        rewards: dict[str, list[float]] = {}
        for e in episodes:
            rewards.setdefault(e.group_id, []).append(float(e.reward))
        out = []
        for i, e in enumerate(episodes):
            r = np.asarray(rewards[e.group_id])
            adv = float(e.reward) - float(r.mean())
            if self.cfg.adv_norm == "std":
                adv /= float(r.std()) + 1e-6
            out.append(make_trajectory(i, e.tokens, traj_id=e.traj_id, group_id=e.group_id,
                                       loss_mask=e.loss_mask, old_logprobs=e.logprobs, advantage=adv,
                                       reward=float(e.reward),
                                       turns=[(t.start, len(t.output_ids), t.engine, t.weight_version)
                                              for t in e.turns],
                                       **({"truncated": e.info["truncated"]} if "truncated" in e.info else {})))
        return out


def scripted_trajectory(env: Environment, actions: Sequence[str], tokenizer: Tokenizer, *, traj_id: str,
                        group_id: str, advantage: float = 1.0) -> Trajectory:
    """A trajectory whose model turns are the given texts, run through the real environment (tool
    calls execute in its sandbox): loss mask on the action tokens, no ``old_logprobs`` (so the
    clipped objective is on-policy: with ``advantage`` 1 its gradient is the supervised one).
    Used for warm-up demonstrations (e.g. ``LookupEnv.solution()``); closes ``env``."""
    tokens = [tokenizer.token_id(BOS)] + tokenizer.encode(env.prompt())
    mask = [0] * len(tokens)
    reward = 0.0
    try:
        for text in actions:
            ids = tokenizer.encode(text)
            tokens += ids
            mask += [1] * len(ids)
            res = env.step(text)
            if res.done:
                reward = float(res.reward or 0.0)
                break
            obs = res.observation or ""
            ids = tokenizer.encode(obs if obs.startswith(OBS) else f"{OBS}{obs}{END_OBS}")
            tokens += ids
            mask += [0] * len(ids)
    finally:
        env.close()
    return make_trajectory(0, tokens, traj_id=traj_id, group_id=group_id, loss_mask=mask, advantage=advantage,
                           reward=reward)
