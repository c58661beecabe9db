"""A real elastic pool: Ray actors that train data-parallel over gloo and switch roles without
restarting the job (CPU here; the same code on GPUs swaps gloo for NCCL).

Every worker joins one world process group at start (``torch.distributed``, gloo, rendezvous at a
free port on the node where Ray placed the rank-0 actor, so Ray may place workers on several
nodes; only one node was tried). The data-parallel group
of the *training* workers is a subgroup rebuilt with ``torch.distributed.new_group`` whenever the
set changes (a collective over the world: every worker calls it with the same ranks, members or
not) and handed to training code as Megatron's
``megatron.core.process_groups_config.ProcessGroupCollection`` (``pgc.dp`` / ``pgc.dp_cp``), the
object Megatron's DDP and ``finalize_model_grads`` take instead of the global ``parallel_state``.

A role switch (:meth:`ElasticPool.to_rollout`): the DP group is rebuilt without the worker; the
worker exports its weights through the existing sync path (``weight_sync.save_hf_checkpoint``,
the Hugging Face layout engines load) and starts the embedded engine (``engines.launch.EmbeddedServer``,
CPU; SGLang on a GPU) on them; it then serves ``/generate``, and later checkpoints reach it by
``/update_weights_from_disk`` (``weight_sync.push_weights``). Back (:meth:`ElasticPool.to_training`):
the engine stops, or (``resident_engines``) pauses in place and releases its memory
(``/pause_generation``, ``/release_memory_occupation``; on the H200 SGLang frees weights and KV cache
for the trainer, see ``scripts/libra_colocated_h200.py``) to be resumed and re-weighted on the next
switch; the DP group is rebuilt with the worker, and it receives the
current parameters and AdamW state from a training worker by broadcast.

The trainer (``trainer``):

* ``"hf"`` (default): the Hugging Face ``Qwen3NextForCausalLM`` of a config (e.g. ``weight_sync``'s
  ``tiny`` preset) on transformers' torch path, fp32, reduced with ``torch.distributed`` calls
  over ``pgc.dp``; the engine serves exactly these weights.
* ``"megatron"``: the Megatron-Core ``HybridModel`` of the same config
  (:class:`~megatron_harts.rollout.libra.megatron_replica.MegatronReplica`: ``megatron.convert``,
  ``cpu_shim``), wrapped in Megatron's ``DistributedDataParallel`` built with the collection; the
  wrapper (grad buffer, bucket groups) is rebuilt on every rank-set change, gradients are reduced
  by DDP's grad sync and ``finalize_model_grads``, and the engine serves the Megatron weights
  converted to the HF layout (``convert.iter_megatron_to_hf``, the ``WeightSync`` path).

The RL step (``train_step``, Megatron trainer; ``rl_grads`` without the optimizer step): every
training worker gets the step's trajectories and runs ``MegatronReplica.train_step`` on its share
(``RLLoop`` with ``libra_pool`` drives it, :mod:`.elastic_loop`).

Gradients of a global batch (``grads``): each DP rank takes samples ``i = rank (mod dp)``; the loss
is the global token-mean NLL. ``mode="deterministic"``: per-sample gradients are all-gathered and
summed in sample order, so the result is bitwise independent of how many ranks computed it;
``mode="allreduce"``: each rank sums its shard, then the sum is all-reduced (HF: ``all_reduce``;
Megatron: DDP's grad-buffer all-reduce in ``finalize_model_grads``, which also all-reduces the token
count and scales by its inverse): fp32 reduction order differs with the rank set, so equal within
rounding, not bitwise.
"""
from __future__ import annotations

import logging
import os
import sys
import time
from datetime import timedelta
from pathlib import Path
from typing import Any, Sequence

logger = logging.getLogger(__name__)

TRAINERS = ("hf", "megatron")


class PoolWorker:
    """One worker of the pool (a Ray actor in :class:`ElasticPool`). ``rank``/``world``: its place in
    the world group. :meth:`address` gives a rendezvous address on this worker's node; every
    worker then calls :meth:`setup` with rank 0's (``tcp://host:port``). ``trainer``: ``"hf"``
    (transformers' model, built here) or ``"megatron"`` (Megatron-Core, built in :meth:`setup`,
    which needs the world group for Megatron's ``parallel_state``)."""

    def __init__(self, rank: int, world: int, hf_config: dict, *, trainer: str = "hf", seed: int = 0,
                 threads: int = 1, lr: float = 1e-3, timeout_s: float = 120.0, replica: dict | None = None):
        if trainer not in TRAINERS:
            raise ValueError(f"trainer must be one of {TRAINERS}, got {trainer!r}")
        if replica and trainer != "megatron":
            raise ValueError("replica settings (the RL step's) need trainer='megatron'")
        import torch
        import torch.distributed as dist

        torch.set_num_threads(threads)
        self.torch, self.dist = torch, dist
        self.rank, self.world, self.hf_config, self.timeout_s = rank, world, dict(hf_config), timeout_s
        self.trainer, self.seed, self.lr, self.replica_kwargs = trainer, seed, lr, dict(replica or {})
        self.replica = None
        self.model = self.params = self.opt = None
        if trainer == "hf":
            sys.modules.setdefault("fla", None)          # transformers' torch path (as the embedded engine)
            sys.modules.setdefault("causal_conv1d", None)
            from transformers import Qwen3NextConfig, Qwen3NextForCausalLM

            torch.manual_seed(seed)
            self.model = Qwen3NextForCausalLM(Qwen3NextConfig(**hf_config)).float().train()
            self.params = [p for p in self.model.parameters() if p.requires_grad]
            self.opt = torch.optim.AdamW(self.params, lr=lr, weight_decay=0.0)
        self.pgc = None
        self.dp_ranks: list[int] = []
        self.server = None
        self.engine = None

    def address(self) -> str:
        """``tcp://<this node's IP>:<free port>`` (call on rank 0: the TCP store lives there)."""
        import ray

        from megatron_harts.rollout.engines import free_port
        ip = ray.util.get_node_ip_address()
        return f"tcp://{ip}:{free_port(ip)}"

    def setup(self, init_method: str) -> float:
        """Join the world process group (gloo); with the Megatron trainer, then initialise Megatron's
        ``parallel_state`` over it and build the model. Returns seconds."""
        t0 = time.perf_counter()
        self.dist.init_process_group("gloo", init_method=init_method, rank=self.rank, world_size=self.world,
                                     timeout=timedelta(seconds=self.timeout_s))
        if self.trainer == "megatron":
            from .megatron_replica import MegatronReplica

            t1 = time.perf_counter()
            self.replica = MegatronReplica(self.hf_config, seed=self.seed, lr=self.lr, **self.replica_kwargs)
            self.model, self.params, self.opt = self.replica.module, self.replica.params, self.replica.opt
            logger.info("worker %d: world group %.2fs, Megatron setup %.2fs", self.rank, t1 - t0,
                        time.perf_counter() - t1)
        return time.perf_counter() - t0

    # -- process groups ------------------------------------------------------------------------

    def set_dp(self, ranks: Sequence[int]) -> float:
        """Collective over the world: build the DP group of ``ranks``; returns seconds. Megatron
        trainer: members wrap the model in a new Megatron DDP for the group (fresh grad buffer and
        bucket groups), the others drop theirs."""
        from megatron.core.process_groups_config import ProcessGroupCollection

        t0 = time.perf_counter()
        ranks = sorted(int(r) for r in ranks)
        group = self.dist.new_group(ranks=ranks, backend="gloo")
        if self.rank in ranks:
            if self.replica is not None:
                self.replica.attach(group)
                pgc = self.replica.pgc
            else:
                pgc = ProcessGroupCollection()
                pgc.dp = group
                pgc.dp_cp = group
            self.pgc, self.dp_ranks = pgc, ranks
        else:
            if self.replica is not None:
                self.replica.detach()
            self.pgc, self.dp_ranks = None, []
        return time.perf_counter() - t0

    def dp_info(self) -> dict:
        """This worker's DP membership (``ranks``: the group it trains in, [] when serving) and, with
        the Megatron trainer, where its DDP wrapper reduces (``MegatronReplica.dp_info``)."""
        info = {"ranks": list(self.dp_ranks)}
        if self.replica is not None:
            info.update(self.replica.dp_info())
        return info

    def _need_dp(self) -> None:
        if self.pgc is None:
            raise RuntimeError(f"worker {self.rank} is not in the training group")

    # -- training ------------------------------------------------------------------------------

    def _sample_loss(self, ids: Sequence[int], norm: float):
        torch = self.torch
        x = torch.tensor([list(ids)], dtype=torch.long)
        logits = self.model(input_ids=x, use_cache=False).logits[0, :-1].float()
        nll = torch.nn.functional.cross_entropy(logits, x[0, 1:], reduction="sum")
        return nll / norm

    def _flat_grad(self):
        torch = self.torch
        return torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1) for p in self.params])

    def _set_grad(self, flat) -> None:
        off = 0
        for p in self.params:
            n = p.numel()
            p.grad = flat[off:off + n].view_as(p).clone()
            off += n

    def grads(self, batch: Sequence[Sequence[int]], mode: str = "deterministic"):
        """Gradient of the global token-mean NLL of ``batch`` (token-id lists) over the DP group;
        sets ``.grad`` and returns the flat gradient ``[P]`` (numpy float32, every rank the same).
        ``mode``: ``"deterministic"`` or ``"allreduce"`` (module docstring; with the Megatron trainer
        ``"allreduce"`` is Megatron DDP's grad sync + ``finalize_model_grads``)."""
        self._need_dp()
        torch, dist = self.torch, self.dist
        if mode not in ("deterministic", "allreduce"):
            raise ValueError(f"mode must be 'deterministic' or 'allreduce', got {mode!r}")
        group, dp = self.pgc.dp, len(self.dp_ranks)
        me = self.dp_ranks.index(self.rank)
        if self.replica is not None:
            return self.replica.grads(batch, me, dp, mode=mode)
        norm = float(sum(len(s) - 1 for s in batch))
        mine = list(range(me, len(batch), dp))
        self.opt.zero_grad(set_to_none=True)
        P = sum(p.numel() for p in self.params)
        if mode == "allreduce":
            loss = sum((self._sample_loss(batch[i], norm) for i in mine), torch.zeros(()))
            if mine:
                loss.backward()
            flat = self._flat_grad() if mine else torch.zeros(P)
            dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=group)
        else:
            rows = (len(batch) + dp - 1) // dp
            local = torch.zeros(rows, P)
            for k, i in enumerate(mine):
                self.opt.zero_grad(set_to_none=True)
                self._sample_loss(batch[i], norm).backward()
                local[k] = self._flat_grad()
            gathered = [torch.zeros(rows, P) for _ in range(dp)]
            dist.all_gather(gathered, local, group=group)
            flat = torch.zeros(P)
            for i in range(len(batch)):                       # fixed global order: bitwise reproducible
                flat = flat + gathered[i % dp][i // dp]
        self._set_grad(flat)
        return flat.numpy().copy()

    def _need_replica(self):
        if self.replica is None:
            raise RuntimeError("the RL step needs the Megatron trainer (trainer='megatron')")
        return self.replica

    def rl_grads(self, trajectories):
        """The reduced gradient ``[P]`` (fp32 numpy, before clipping) of one RL step over
        ``trajectories`` (the whole step's; ``MegatronReplica.rl_grads``), without stepping."""
        self._need_dp()
        rep = self._need_replica()
        rep.rl_grads(trajectories, self.dp_ranks.index(self.rank), len(self.dp_ranks))
        return rep._main_grads().numpy().copy()

    def train_step(self, trajectories) -> dict:
        """One RL step (``MegatronReplica.train_step``: tree-packed microbatches of this rank's
        share, policy loss, Megatron DDP reduction, clipping, AdamW); metrics of the whole step."""
        self._need_dp()
        out = self._need_replica().train_step(trajectories, self.dp_ranks.index(self.rank), len(self.dp_ranks))
        return {**out, "train_ranks": list(self.dp_ranks)}

    def set_lr(self, lr: float) -> None:
        for g in self.opt.param_groups:
            g["lr"] = lr

    def step(self) -> None:
        """Optimizer step with the gradients of the last :meth:`grads`."""
        self._need_dp()
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)

    def params_flat(self):
        return self.torch.cat([p.detach().reshape(-1) for p in self.params]).numpy().copy()

    def _opt_tensors(self) -> list:
        torch = self.torch
        out = []
        for p in self.params:
            st = self.opt.state[p]
            if not st:
                st["step"] = torch.zeros(())
                st["exp_avg"] = torch.zeros_like(p)
                st["exp_avg_sq"] = torch.zeros_like(p)
            out += [st["step"], st["exp_avg"], st["exp_avg_sq"]]
        return out

    def sync_from(self, src: int) -> float:
        """Collective over the DP group: parameters and AdamW state from world rank ``src``."""
        self._need_dp()
        t0 = time.perf_counter()
        with self.torch.no_grad():
            for t in [p.data for p in self.params] + self._opt_tensors():
                self.dist.broadcast(t, src=src, group=self.pgc.dp)
        return time.perf_counter() - t0

    # -- rollout role --------------------------------------------------------------------------

    def logprobs(self, seqs: Sequence[Sequence[int]]) -> list[list[float]]:
        """Log-probs (nats) of tokens 1..L-1 of each token list under this worker's current weights
        (its trainer's own forward: Megatron's with the Megatron trainer)."""
        if self.replica is not None:
            return self.replica.logprobs(seqs)
        torch = self.torch
        out = []
        self.model.eval()
        with torch.no_grad():
            for s in seqs:
                x = torch.tensor([list(s)], dtype=torch.long)
                lp = torch.log_softmax(self.model(input_ids=x, use_cache=False).logits[0, :-1].float(), -1)
                out.append(lp.gather(-1, x[0, 1:, None])[:, 0].tolist())
        self.model.train()
        return out

    def export(self, out_dir: str, version: str) -> float:
        """Write the weights as an HF checkpoint (the sync path engines load: the Megatron trainer's
        are converted layer by layer with ``convert.iter_megatron_to_hf``, as ``WeightSync.export``
        does); returns seconds."""
        from megatron_harts.rollout.weight_sync import save_hf_checkpoint

        t0 = time.perf_counter()
        tensors = self.replica.hf_tensors() if self.replica is not None else self.model.state_dict()
        with self.torch.no_grad():
            save_hf_checkpoint(out_dir, tensors, self.hf_config, version=version, overwrite=True, warn_sglang=False)
        return time.perf_counter() - t0

    def start_engine(self, out_dir: str, version: str, log_path: str | None = None) -> dict:
        """Export, then serve the export: start the embedded engine, or, if this worker keeps a
        released engine (:meth:`stop_engine` with ``keep``), resume its memory, load the export
        through ``push_weights`` and continue generation. Returns ``{url, export_s, start_s, resident}``."""
        from megatron_harts.rollout.engines import EmbeddedServer
        from megatron_harts.rollout.weight_sync import push_weights

        if self.pgc is not None:
            raise RuntimeError(f"worker {self.rank} is still in the training group: rebuild it first")
        export_s = self.export(out_dir, version)
        t0 = time.perf_counter()
        resident = self.server is not None
        if resident:
            self.engine.resume_memory()
            push_weights([self.engine], out_dir, version)
            self.engine.resume()
        else:
            self.server = EmbeddedServer(out_dir, weight_version=version, threads=1, log_path=log_path).start()
            self.engine = self.server.engine(timeout=120.0, retries=1, backoff=0.1)
        return {"url": self.server.url, "export_s": export_s, "start_s": time.perf_counter() - t0, "resident": resident}

    def generate(self, prompts: Sequence[Sequence[int]], max_new_tokens: int = 8, seed: int = 0,
                 temperature: float = 1.0) -> list[dict]:
        """Generate from this worker's engine; ``temperature=0``: greedy. Each answer:
        ``output_ids``, ``logprobs`` (the engine's log-softmax of its raw logits, nats) and
        ``weight_version``."""
        from megatron_harts.rollout.types import SamplingParams

        if self.engine is None:
            raise RuntimeError(f"worker {self.rank} serves no engine")
        out = []
        for k, p in enumerate(prompts):
            g = self.engine.generate(list(p), SamplingParams(max_new_tokens=max_new_tokens, temperature=temperature,
                                                              seed=seed + k))
            out.append({"output_ids": list(g.output_ids), "logprobs": list(g.logprobs),
                        "weight_version": g.weight_version})
        return out

    def update_engine(self, path: str, version: str) -> float:
        from megatron_harts.rollout.weight_sync import push_weights

        t0 = time.perf_counter()
        push_weights([self.engine], path, version)
        return time.perf_counter() - t0

    def stop_engine(self, keep: bool = False) -> float:
        """Leave the rollout role: stop the engine process, or with ``keep`` pause it in place and
        release its memory (``/pause_generation``, ``/release_memory_occupation``: SGLang frees its
        weights and KV cache; the embedded engine only records it), to resume later."""
        t0 = time.perf_counter()
        if self.server is not None:
            if keep:
                self.engine.pause("in_place")
                self.engine.release_memory()
            else:
                self.server.stop()
                self.server = self.engine = None
        return time.perf_counter() - t0

    def close(self) -> None:
        self.stop_engine(keep=False)
        if self.replica is not None:
            self.replica.close()
        if self.dist.is_initialized():
            self.dist.destroy_process_group()


class ElasticPool:
    """``n`` :class:`PoolWorker` Ray actors, all training at first. ``to_rollout(r)`` /
    ``to_training(r)`` switch worker ``r``'s role and return the seconds of each part.
    ``resident_engines``: a worker going back to training keeps its engine process, paused with
    its memory released, and resumes it on the next switch (SGLang's colocated mode) instead of
    stopping it and starting a new one.

    ``trainer``: ``"hf"`` or ``"megatron"`` (see the module docstring). ``timeout_s``: the world
    group's collective timeout (a collective missing a member fails after it instead of hanging).
    ``cpus_per_worker``: Ray CPUs each actor reserves (0 lets a 2-core machine hold any number).
    ``replica``: ``MegatronReplica`` keyword arguments (``chunk_size``, ``betas``, ``rl``: the RL
    step's settings) for the Megatron trainer.
    The driver must have Ray initialised or lets this class start a local cluster."""

    def __init__(self, n: int, hf_config: dict, work_dir: str, *, trainer: str = "hf", seed: int = 0,
                 threads: int = 1, lr: float = 1e-3, cpus_per_worker: float = 0, resident_engines: bool = False,
                 timeout_s: float = 120.0, replica: dict | None = None):
        import ray

        if n < 2:
            raise ValueError(f"an elastic pool needs >= 2 workers, got {n}")
        if trainer not in TRAINERS:
            raise ValueError(f"trainer must be one of {TRAINERS}, got {trainer!r}")
        if not ray.is_initialized():
            root = str(Path(__file__).resolve().parents[3])
            ray.init(_node_ip_address="127.0.0.1", include_dashboard=False, log_to_driver=False,
                     runtime_env={"env_vars": {"PYTHONPATH": os.pathsep.join([root, os.environ.get("PYTHONPATH", "")])}})
        self.ray = ray
        self.work_dir = Path(work_dir)
        self.work_dir.mkdir(parents=True, exist_ok=True)
        Actor = ray.remote(num_cpus=cpus_per_worker)(PoolWorker)
        self.trainer = trainer
        self.workers = [Actor.remote(r, n, hf_config, trainer=trainer, seed=seed, threads=threads, lr=lr,
                                     timeout_s=timeout_s, replica=replica) for r in range(n)]
        # rendezvous on the node where Ray placed rank 0 (the TCP store's host)
        init = ray.get(self.workers[0].address.remote())
        self.init_s = max(ray.get([w.setup.remote(init) for w in self.workers]))
        self.n = n
        self.training = list(range(n))
        self.urls: dict[int, str] = {}        # serving workers' engine URLs
        self.resident = resident_engines
        self.version = 0
        self.set_dp(self.training)

    def _get(self, refs):
        return self.ray.get(refs)

    def set_dp(self, ranks: Sequence[int]) -> float:
        return max(self._get([w.set_dp.remote(list(ranks)) for w in self.workers]))

    def grads(self, batch, mode: str = "deterministic"):
        """The gradient every training worker computed (checked equal across them)."""
        import numpy as np
        outs = self._get([self.workers[r].grads.remote(batch, mode) for r in self.training])
        for o in outs[1:]:
            if not np.array_equal(o, outs[0]):
                raise RuntimeError("DP ranks disagree on the reduced gradient")
        return outs[0]

    def rl_grads(self, trajectories):
        """The reduced RL gradient (``PoolWorker.rl_grads``) every training worker holds, checked
        bitwise equal across them (they all hold the all-reduced grad buffer)."""
        import numpy as np
        outs = self._get([self.workers[r].rl_grads.remote(trajectories) for r in self.training])
        for o in outs[1:]:
            if not np.array_equal(o, outs[0]):
                raise RuntimeError("DP ranks disagree on the reduced RL gradient")
        return outs[0]

    def train_step(self, trajectories) -> dict:
        """One RL step on the training workers (Megatron trainer); returns training rank 0's
        metrics (``train_ranks``: who trained) after checking every rank's ``grad_norm`` and loss agree."""
        outs = self._get([self.workers[r].train_step.remote(trajectories) for r in self.training])
        for o in outs[1:]:
            if (o["grad_norm"], o["loss"]) != (outs[0]["grad_norm"], outs[0]["loss"]):
                raise RuntimeError("DP ranks disagree on the RL step's gradient norm or loss")
        self.version += 1
        return outs[0]

    def set_lr(self, lr: float) -> None:
        """Learning rate of every worker (the serving ones keep it for their return)."""
        self._get([w.set_lr.remote(lr) for w in self.workers])

    def step(self) -> str:
        self._get([self.workers[r].step.remote() for r in self.training])
        self.version += 1
        return f"v{self.version}"

    def params(self, rank: int):
        return self._get(self.workers[rank].params_flat.remote())

    def to_rollout(self, rank: int, version: str | None = None) -> dict:
        """Worker ``rank`` leaves training and serves rollouts on its current weights, tagged
        ``version`` (default ``v<steps taken>``)."""
        if rank not in self.training or len(self.training) < 2:
            raise ValueError(f"worker {rank} cannot leave training (training: {self.training})")
        t0 = time.perf_counter()
        self.training = [r for r in self.training if r != rank]
        rebuild = self.set_dp(self.training)
        version = version or f"v{self.version}"
        eng = self._get(self.workers[rank].start_engine.remote(str(self.work_dir / f"w{rank}_{version}"), version,
                                                               str(self.work_dir / f"engine{rank}.log")))
        self.urls[rank] = eng["url"]
        return {"rebuild_s": rebuild, "total_s": time.perf_counter() - t0, **eng}

    def export(self, version: str | None = None) -> tuple[str, float]:
        """The trainers' current weights as an HF checkpoint ``<work_dir>/train_<version>`` (training
        rank 0 writes it: the sync path); returns ``(path, seconds)``."""
        version = version or f"v{self.version}"
        path = str(self.work_dir / f"train_{version}")
        return path, self._get(self.workers[self.training[0]].export.remote(path, version))

    def publish(self, rank: int) -> dict:
        """Push the trainers' current weights to the engine of worker ``rank`` (the sync path)."""
        version = f"v{self.version}"
        path, export_s = self.export(version)
        push_s = self._get(self.workers[rank].update_engine.remote(path, version))
        return {"export_s": export_s, "push_s": push_s, "version": version}

    def generate(self, rank: int, prompts, max_new_tokens: int = 8, temperature: float = 1.0):
        return self._get(self.workers[rank].generate.remote(prompts, max_new_tokens, 0, temperature))

    def dp_info(self) -> list[dict]:
        """Every worker's :meth:`PoolWorker.dp_info`, by rank."""
        return self._get([w.dp_info.remote() for w in self.workers])

    def logprobs(self, rank: int, seqs):
        """Log-probs of tokens 1..L-1 of each sequence under worker ``rank``'s trainer model."""
        return self._get(self.workers[rank].logprobs.remote(seqs))

    def to_training(self, rank: int) -> dict:
        """Worker ``rank`` stops serving and rejoins training with the trainers' state."""
        if rank in self.training:
            raise ValueError(f"worker {rank} is already training")
        t0 = time.perf_counter()
        stop = self._get(self.workers[rank].stop_engine.remote(self.resident))
        self.urls.pop(rank, None)
        src = self.training[0]
        self.training = sorted(self.training + [rank])
        rebuild = self.set_dp(self.training)
        sync = max(self._get([self.workers[r].sync_from.remote(src) for r in self.training]))
        return {"stop_s": stop, "rebuild_s": rebuild, "state_sync_s": sync, "total_s": time.perf_counter() - t0}

    def close(self) -> None:
        try:
            self._get([w.close.remote() for w in self.workers])
        finally:
            for w in self.workers:
                self.ray.kill(w)
