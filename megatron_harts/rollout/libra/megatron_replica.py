"""The Megatron-Core trainer of one elastic-pool worker (``ElasticPool(..., trainer="megatron")``).

A :class:`MegatronReplica` holds the Megatron ``HybridModel`` of a Hugging Face Qwen3-Next config
(``megatron.convert``: the engine serves the HF layout, the trainer trains the Megatron one; the
``tiny`` preset with 4 HF layers is the pattern ``G-G-G-*-``, 0.2M parameters, fp32, the tree
layers of ``megatron.specs`` so GDN runs its torch path on CPU) and, while the worker trains,
Megatron's own ``megatron.core.distributed.DistributedDataParallel`` around it, built with a
``ProcessGroupCollection`` whose data-parallel groups (``dp``, ``dp_cp``, ``intra_dp_cp``,
``expt_dp``, ``intra_expt_dp``) are the pool's current training subgroup.

Process groups. The world group (gloo) is created by the pool and never restarts. Megatron's
``parallel_state`` is initialised once per worker process over that world with TP = PP = EP =
CP = 1 (``cpu_shim.init_cpu_model_parallel``): it gives the model its single-rank TP / PP / EP / CP
groups (the layers are built with ``parallel_state``'s groups, as ``HartsTrainer`` builds them).
Its own DP group (the whole world, fixed at start) is never used for a reduction here: every DP
collective of the training path takes the collection: DDP's grad buckets
(``setup_process_groups_for_ddp`` reads ``pgc.dp`` / ``pgc.dp_cp``; no fallback to
``parallel_state`` when a collection is given) and ``finalize_model_grads(..., pg_collection=pgc)``
(``dp_cp`` for the token count; ``embd`` / ``pos_embd`` are ``None``: one pipeline stage).

Rank-set change (:meth:`attach` / :meth:`detach`). The DDP wrapper binds its grad buffer and bucket
groups to one DP group at construction, so a new rank set needs a new wrapper: the old one is
dropped (its backward hooks sit on the parameters' gradient accumulators, which it holds in
``grad_accs``; they are released with it, checked by a weak reference), and a new
``DistributedDataParallel`` is built around the same module with the new collection, which
allocates a fresh, zeroed grad buffer and rebinds ``param.main_grad``. A worker leaving training
drops its wrapper (and grad buffer) and keeps the module and the AdamW state.

Gradient (:meth:`grads`): the global batch's token-mean NLL. DP rank j takes samples
``i = j (mod dp)``, packs them (``pack_trajectories``: each sample its own chain, the THD layout
``HartsTrainer``'s baseline runs), backpropagates the **sum** of their token NLLs through the DDP
wrapper (its hooks accumulate into ``main_grad``), and calls Megatron's
``finalize_model_grads(num_tokens=<its predicted tokens>)``: with ``calculate_per_token_loss`` the
DDP all-reduces (sums) the grad buffer over ``pgc.dp`` and the token count over ``pgc.dp_cp``, then
scales the gradients by ``1 / global tokens``. ``mode="deterministic"`` is the reference: per-sample
gradients (read from ``main_grad``) are all-gathered over ``pgc.dp`` and summed in sample order,
bitwise independent of the rank set. The optimizer is ``torch.optim.AdamW`` on ``param.grad =
param.main_grad`` (what Megatron's ``FP32Optimizer`` does for fp32 parameters).

The RL step (:meth:`train_step`, what ``RLLoop`` with ``libra_pool`` runs): ``HartsTrainer.train_step``
data-parallel, through the functions the two share (``rollout.trainer.step_microbatches``,
``forward_backward``, ``StepTotals``): the step's trees over DP x M microbatches, each rank its own
tree packs, the policy loss of every microbatch with the step's global normalisers, backward through
the DDP wrapper, ``finalize_model_grads(num_tokens=None)`` (a sum over ``pgc.dp``: the shares are
already normalised), the gradient clipped by its norm, AdamW.

Megatron's ``@jit_fuser`` functions are ``torch.compile``'d; on CPU compiling them costs 2 s per
process with a warm inductor cache and 10-15 s cold (3 workers on 2 cores: most of a minute), so
the worker turns dynamo off (``torch._dynamo.config.disable``) and they run eagerly.
"""
from __future__ import annotations

import gc
import logging
import time
import weakref
from typing import Any, Sequence

import numpy as np
import torch
import torch.distributed as dist

logger = logging.getLogger(__name__)

__all__ = ["MegatronReplica", "dp_collection"]


def dp_collection(group):
    """Megatron ``ProcessGroupCollection`` for a DP group ``group`` on a TP = PP = EP = CP = 1
    setup: ``tp`` / ``pp`` / ``ep`` / ``cp`` from ``parallel_state`` (single-rank groups),
    ``dp`` = ``dp_cp`` = ``intra_dp_cp`` = ``expt_dp`` = ``intra_expt_dp`` = ``group`` (EP = 1:
    experts are data-parallel over the same ranks), ``embd`` = ``pos_embd`` = ``None`` (one pipeline
    stage: no embedding-tying reduction). Only these fields are set, so nothing falls back to the
    world-sized DP groups of ``parallel_state``."""
    from megatron.core import parallel_state as ps
    from megatron.core.process_groups_config import ProcessGroupCollection

    return ProcessGroupCollection(
        tp=ps.get_tensor_model_parallel_group(), pp=ps.get_pipeline_model_parallel_group(),
        ep=ps.get_expert_model_parallel_group(), cp=ps.get_context_parallel_group(), embd=None, pos_embd=None,
        dp=group, dp_cp=group, intra_dp_cp=group, expt_dp=group, intra_expt_dp=group)


class MegatronReplica:
    """One worker's Megatron model, AdamW state and (while training) DDP wrapper.

    Args:
        hf_config: Qwen3-Next config kwargs (``weight_sync.model_config``); the model is
            ``convert.build_megatron_model(convert.hf_config_to_megatron(hf_config))``.
        seed: weight-initialisation seed (the same on every worker: identical initial weights).
        lr: AdamW learning rate (betas 0.9 / 0.999, no weight decay, as the pool's HF trainer).
        chunk_size: the tree packs' chunk length (tokens) for the GDN chunked kernel.
        ddp_config: Megatron ``DistributedDataParallelConfig`` kwargs (default: no overlap, no
            distributed optimizer, fp32 grad buffer, sum in the collective).
        betas: AdamW betas (``HartsTrainer`` uses (0.9, 0.99)).
        rl: the RL step's settings (:meth:`train_step`): ``tree`` (HARTS tree packs, else
            trajectory-wise THD), ``microbatch_tokens``, ``grad_clip``, ``loss`` (``rl.policy_loss``
            kwargs), ``old_logprobs`` (``trainer`` or ``engine``), as ``HartsTrainer`` takes them.

    Needs ``torch.distributed`` initialised (the pool's world group, gloo) before construction:
    Megatron's ``parallel_state`` is initialised over it (a collective over the world).
    """

    def __init__(self, hf_config: dict, *, seed: int = 0, lr: float = 1e-3, chunk_size: int = 16,
                 ddp_config: dict | None = None, betas: tuple[float, float] = (0.9, 0.999), rl: dict | None = None):
        import torch._dynamo

        from megatron_harts.megatron import convert, cpu_shim

        if not dist.is_initialized():
            raise RuntimeError("MegatronReplica needs the world process group first")
        torch._dynamo.config.disable = True         # Megatron's jit_fuser compiles: 10+ s per process on CPU
        t0 = time.perf_counter()
        cpu_shim.init_cpu_model_parallel(tensor_model_parallel_size=1, expert_model_parallel_size=1, seed=seed)
        self.hf_config, self.chunk_size = dict(hf_config), chunk_size
        self.args = convert.hf_config_to_megatron(self.hf_config)
        torch.manual_seed(seed)                      # weights are initialised on the host (use_cpu_initialization)
        self.module = convert.build_megatron_model(self.args, tree=True, calculate_per_token_loss=True)
        self.params = [p for p in self.module.parameters() if p.requires_grad]
        self.opt = torch.optim.AdamW(self.params, lr=lr, weight_decay=0.0, betas=tuple(betas))
        from megatron_harts.rollout.trainer import RL_STEP_DEFAULTS, rl_loss_kwargs

        rl = dict(rl or {})
        bad = set(rl) - set(RL_STEP_DEFAULTS)
        if bad:
            raise ValueError(f"MegatronReplica rl: unknown settings {sorted(bad)} (known: {sorted(RL_STEP_DEFAULTS)})")
        self.rl = {**RL_STEP_DEFAULTS, **rl}
        self.loss_kwargs = rl_loss_kwargs(self.rl["loss"], self.rl["old_logprobs"])
        self.steps = 0
        self.ddp_kwargs = {**dict(overlap_grad_reduce=False, use_distributed_optimizer=False, grad_reduce_in_fp32=True,
                                  average_in_collective=False), **(ddp_config or {})}
        self.ddp = None
        self.pgc = None
        self.ddp_builds = 0
        self.init_s = time.perf_counter() - t0
        logger.info("libra: Megatron HybridModel %r, %d params, rank %d/%d, %.2fs", self.args.pattern,
                    sum(p.numel() for p in self.params), dist.get_rank(), dist.get_world_size(), self.init_s)

    # -- DP wrapper ----------------------------------------------------------------------------

    def attach(self, group) -> float:
        """Wrap the module in a new Megatron DDP whose DP groups are ``group`` (this rank is a
        member); any previous wrapper is dropped first. Returns seconds."""
        from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig

        t0 = time.perf_counter()
        self.detach()
        self.pgc = dp_collection(group)
        self.ddp = DistributedDataParallel(self.module.config, DistributedDataParallelConfig(**self.ddp_kwargs),
                                           self.module, pg_collection=self.pgc)
        self.ddp_builds += 1
        if self.ddp.dp_group is not group or self.ddp.dp_cp_group is not group:
            raise RuntimeError("Megatron DDP did not take the pool's DP group from the collection")
        return time.perf_counter() - t0

    def detach(self) -> None:
        """Drop the DDP wrapper and its grad buffer (the module and AdamW state stay)."""
        if self.ddp is None:
            return
        ref = weakref.ref(self.ddp)
        for p in self.params:
            p.grad = None
            if hasattr(p, "main_grad"):
                del p.main_grad                   # a view of the dropped grad buffer
        # DDP's backward hooks sit on the gradient accumulators it keeps in ``grad_accs`` (the hooks
        # refer back to the wrapper: a cycle); releasing them frees the wrapper by reference count,
        # without a full gc pass (0.5-2 s in a process holding torch + Megatron)
        self.ddp.grad_accs.clear()
        self.ddp = self.pgc = None
        if ref() is not None:
            gc.collect()
        if ref() is not None:                     # its hooks would still fire on the accumulators
            raise RuntimeError("the previous Megatron DDP wrapper is still referenced")

    def dp_info(self) -> dict:
        """Where Megatron's DDP reduces: world ranks of the wrapper's ``dp_group`` / ``dp_cp_group``
        and of every grad bucket group's collective group (``bucket_dp_ranks``, one list per bucket
        group, dense and expert), the grad buffers' DP sizes, whether every ``param.main_grad`` is a
        view of this wrapper's grad buffers, and how many wrappers were built."""
        if self.ddp is None:
            return {"ddp": False, "ddp_builds": self.ddp_builds}
        ranks = dist.get_process_group_ranks
        ddp = self.ddp
        storages = {b.grad_data.untyped_storage().data_ptr() for b in ddp.buffers + ddp.expert_parallel_buffers}
        return {"ddp": True, "ddp_builds": self.ddp_builds, "dp_ranks": ranks(ddp.dp_group),
                "dp_cp_ranks": ranks(ddp.dp_cp_group),
                "bucket_dp_ranks": [ranks(bg.data_parallel_group)
                                    for bg in ddp.bucket_groups + ddp.expert_parallel_bucket_groups],
                "buffer_dp_sizes": [b.data_parallel_world_size for b in ddp.buffers + ddp.expert_parallel_buffers],
                "main_grad_in_buffer": all(p.main_grad.untyped_storage().data_ptr() in storages for p in self.params)}

    def _need_ddp(self):
        if self.ddp is None:
            raise RuntimeError(f"rank {dist.get_rank()}: no DDP wrapper (not in the training group)")
        return self.ddp

    # -- forward -------------------------------------------------------------------------------

    def _pack(self, seqs: Sequence[Sequence[int]]):
        from megatron_harts.packing import pack_trajectories
        from megatron_harts.tree import Trajectory, trees_from_trajectories

        trajs = [Trajectory(tokens=np.asarray(s, dtype=np.int64), traj_id=str(k), group_id=str(k))
                 for k, s in enumerate(seqs)]
        return pack_trajectories(trees_from_trajectories(trajs), chunk_size=self.chunk_size), trajs

    def _token_logprobs(self, model, seqs: Sequence[Sequence[int]]) -> list[torch.Tensor]:
        """Per-sequence log-probs ``[L_i - 1]`` (nats) of tokens 1..L_i-1 under ``model``, in input
        order (one THD pack of all ``seqs``)."""
        from megatron_harts.megatron.packed_seq import tree_packed_seq_params
        from megatron_harts.ops import tree_token_logprobs

        pack, trajs = self._pack(seqs)
        logits = model(pack.tokens[None], pack.position_ids[None], None,
                       packed_seq_params=tree_packed_seq_params(pack))           # [1, T, V]
        lps = tree_token_logprobs(logits[0], pack)                             # pack.trajectories' order
        index = {id(t): k for k, t in enumerate(trajs)}
        out: list[Any] = [None] * len(seqs)
        for t, lp in zip(pack.trajectories, lps):
            out[index[id(t)]] = lp
        return out

    @torch.no_grad()
    def logprobs(self, seqs: Sequence[Sequence[int]]) -> list[list[float]]:
        """Log-probs of tokens 1..L_i-1 of each sequence under the current weights (eval mode)."""
        self.module.eval()
        try:
            return [lp.float().tolist() for lp in self._token_logprobs(self.module, seqs)]
        finally:
            self.module.train()

    # -- gradients -----------------------------------------------------------------------------

    def _main_grads(self) -> torch.Tensor:
        return torch.cat([p.main_grad.reshape(-1) for p in self.params])

    def _use_main_grads(self) -> None:
        for p in self.params:                      # Megatron's FP32Optimizer: param.grad = param.main_grad
            p.grad = p.main_grad

    def grads(self, batch: Sequence[Sequence[int]], me: int, dp: int, mode: str = "allreduce") -> np.ndarray:
        """Gradient ``[P]`` (fp32) of the token-mean NLL of ``batch`` over the DP group; this rank is
        DP rank ``me`` of ``dp``. Leaves it in ``param.grad`` (= ``main_grad``) for :meth:`step`.

        ``mode="allreduce"``: Megatron's reduction (grad buffer all-reduce + ``finalize_model_grads``);
        ``"deterministic"``: per-sample gradients all-gathered and summed in sample order."""
        ddp = self._need_ddp()
        if mode not in ("allreduce", "deterministic"):
            raise ValueError(f"mode must be 'allreduce' or 'deterministic', got {mode!r}")
        mine = list(range(me, len(batch), dp))
        total = sum(len(s) - 1 for s in batch)
        self.module.train()
        self.opt.zero_grad(set_to_none=True)
        ddp.zero_grad_buffer()
        if mode == "allreduce":
            if mine:
                lps = self._token_logprobs(ddp, [batch[i] for i in mine])
                (-torch.stack([lp.sum() for lp in lps]).sum()).backward()   # sum of token NLLs (per-token loss)
            from megatron.core.distributed import finalize_model_grads
            num_tokens = torch.tensor(sum(len(batch[i]) - 1 for i in mine), dtype=torch.int64)
            finalize_model_grads([ddp], num_tokens=num_tokens, pg_collection=self.pgc)
            if int(num_tokens) != total:
                raise RuntimeError(f"DP token count {int(num_tokens)} != batch tokens {total}: wrong DP group")
        else:
            P = sum(p.numel() for p in self.params)
            rows = (len(batch) + dp - 1) // dp
            local = torch.zeros(rows, P)
            for k, i in enumerate(mine):
                ddp.zero_grad_buffer()
                (-self._token_logprobs(ddp, [batch[i]])[0].sum()).backward()
                local[k] = self._main_grads()
            gathered = [torch.zeros(rows, P) for _ in range(dp)]
            dist.all_gather(gathered, local, group=self.pgc.dp)
            flat = torch.zeros(P)
            for i in range(len(batch)):                       # fixed global order: bitwise reproducible
                flat = flat + gathered[i % dp][i // dp]
            flat = flat * (1.0 / total)
            off = 0
            with torch.no_grad():
                for p in self.params:
                    p.main_grad.copy_(flat[off:off + p.numel()].view_as(p))
                    off += p.numel()
        self._use_main_grads()
        return self._main_grads().numpy().copy()

    # -- the RL step (HartsTrainer's, data-parallel) ---------------------------------------------

    def _forward_mb(self, mb):
        """logits ``[1, T, V]`` of one microbatch through the DDP wrapper (its hooks fill ``main_grad``)."""
        from megatron_harts.megatron.batch import model_inputs

        tokens, position_ids, params = model_inputs(mb)
        return self._need_ddp()(tokens, position_ids, None, packed_seq_params=params)

    def rl_grads(self, trajectories, me: int, dp: int):
        """Reduced gradient of the RL loss of one step (``HartsTrainer.train_step``'s, without the
        clip and the optimizer step); this rank is DP rank ``me`` of ``dp``. Every rank is given
        the whole step's ``trajectories``; ``trainer.step_microbatches`` assigns the trees to
        ``dp`` x ``M`` microbatches identically on every rank and this rank packs its own
        (``tree``: HARTS tree packs), each microbatch's ``policy_loss`` carrying the step's
        **global** normalisers (tokens, sequences, max length), so the loss is the sum of the
        ranks' shares whatever the split. Backward through the DDP wrapper accumulates the local
        share into the grad buffer; ``finalize_model_grads(num_tokens=None)`` all-reduces (sums:
        ``calculate_per_token_loss`` sets DDP's gradient scaling to 1) over ``pgc.dp`` and scales
        nothing more: the shares are already normalised. ``param.grad = main_grad`` afterwards.
        Returns ``(totals, num_tokens, microbatches, pack_s)``: this rank's
        :class:`~megatron_harts.rollout.trainer.StepTotals`, the step's trained tokens."""
        from megatron.core.distributed import finalize_model_grads

        from megatron_harts.rollout.trainer import forward_backward, step_microbatches

        ddp = self._need_ddp()
        t0 = time.perf_counter()
        self.module.train()
        mbs = step_microbatches(trajectories, microbatch_tokens=self.rl["microbatch_tokens"], tree=self.rl["tree"],
                                chunk_size=self.chunk_size, step=self.steps, dp_size=dp, dp_rank=me)
        pack_s = time.perf_counter() - t0
        self.opt.zero_grad(set_to_none=True)
        ddp.zero_grad_buffer()
        totals = forward_backward(self._forward_mb, mbs, torch.device("cpu"), loss_kwargs=self.loss_kwargs,
                                  old_logprobs=self.rl["old_logprobs"])
        finalize_model_grads([ddp], num_tokens=None, pg_collection=self.pgc)
        self._use_main_grads()
        return totals, mbs[0].norms.num_tokens, len(mbs), pack_s

    def _reduce_totals(self, totals):
        """The step's :class:`StepTotals`: sums over ``pgc.dp`` (gloo) of every rank's."""
        from megatron_harts.rollout.trainer import StepTotals

        x = torch.tensor([totals.loss, totals.logprob_sum, totals.trajectory_tokens, totals.packed_tokens],
                         dtype=torch.float64)
        dist.all_reduce(x, group=self.pgc.dp)
        diffs: list = [None] * dist.get_world_size(self.pgc.dp)
        dist.all_gather_object(diffs, torch.cat(totals.diffs) if totals.diffs else torch.zeros(0), group=self.pgc.dp)
        d = [t for t in diffs if t.numel()]
        return StepTotals(float(x[0]), float(x[1]), int(x[2]), int(x[3]), d)

    def train_step(self, trajectories, me: int, dp: int) -> dict:
        """One RL optimizer step over the DP group (:meth:`rl_grads`, then the gradient clipped to
        ``grad_clip`` by its global norm (every rank holds the same reduced ``main_grad``: no model
        parallelism, so the local norm is the global one), AdamW). Returns ``HartsTrainer.train_step``'s
        metrics of the whole step (losses, tokens and mismatch summed / gathered over the ranks)."""
        t0 = time.perf_counter()
        totals, num_tokens, mbs, pack_s = self.rl_grads(trajectories, me, dp)
        fb_s = time.perf_counter() - t0 - pack_s
        grad_norm = float(torch.nn.utils.clip_grad_norm_(self.params, self.rl["grad_clip"]))
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        self.steps += 1
        totals = self._reduce_totals(totals)
        return totals.metrics(grad_norm=grad_norm, num_tokens=num_tokens, microbatches=mbs, pack_s=pack_s,
                              fwd_bwd_s=fb_s, train_s=time.perf_counter() - t0)

    def set_lr(self, lr: float) -> None:
        for g in self.opt.param_groups:
            g["lr"] = lr

    # -- export --------------------------------------------------------------------------------

    def hf_tensors(self):
        """``(HF name, tensor)`` pairs of the current weights in the checkpoint layout engines load
        (``convert.iter_megatron_to_hf``, streaming per HF layer)."""
        from megatron_harts.megatron.convert import iter_megatron_to_hf

        return iter_megatron_to_hf(self.module.named_parameters(), self.hf_config, layout="checkpoint")

    def close(self) -> None:
        from megatron_harts.megatron import cpu_shim

        self.detach()
        cpu_shim.destroy_cpu_model_parallel()
