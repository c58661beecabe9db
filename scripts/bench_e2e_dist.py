"""HARTS vs trajectory-wise training steps under Megatron's parallel state (TP / DP / PP / EP).

Launched by torchrun, one process per GPU (``--device cpu``: per CPU process, gloo, tiny fp32
models, correctness only)::

    python -m torch.distributed.run --nproc-per-node N scripts/bench_e2e_dist.py --tp T --pp P --ep E ...
    # DP = N / (T * P); several configurations in one launch: --configs 1x1x1,2x1x1,1x2x1 (TxPxE each)
    python scripts/bench_e2e_dist.py --plot $OUT/e2e_dist.json [more.json ...] --out docs/benchmarks

Every rank runs ``megatron.core.parallel_state.initialize_model_parallel(T, P, expert=E)``, builds
the models of ``scripts/bench_e2e.py`` (``dense`` ~1.5B / ``moe``; ``--tiny``: the CPU models) as
its pipeline stage (``|`` stage separators inserted into the layer pattern at layer-pair
boundaries, as even as possible), wraps it in Megatron's ``DistributedDataParallel`` (fp32 grad
buffers, no overlap, no distributed optimizer) and trains through Megatron's own
``get_forward_backward_func`` schedule (``forward_backward_no_pipelining`` at PP=1, 1F1B at PP>1;
``variable_seq_lengths`` on: packs differ in length) with ``finalize_model_grads`` as the
gradient finaliser: gradients are all-reduced over DP by Megatron's DDP (1/DP pre-scaled sum,
expert grads over the expert-DP group), exactly as ``megatron.training`` does. The loss is
``megatron_harts.megatron.batch.rl_loss`` (GRPO, token-mean, on-policy) with the step's global
normalisers, so the DP-averaged gradient is the gradient of the whole global batch's loss.

Both sides get the same global batches (every rank generates them from the seed):
  harts     ``plan(trees, dp_size=DP, microbatch_capacity=--capacity, cost_model=...)`` assigns
            trees (parts of trees over capacity) to DP ranks and microbatch slots; each rank packs
            its own slots (``pack``) in slot order
  baseline  each trajectory its own chain (THD packing through the same layers), balanced by
            tokens over the same DP ranks and microbatches (LPT, ``planner.assign`` with cost =
            tokens, <= --capacity tokens per microbatch)
With PP > 1 both sides run at least PP microbatches per rank (``--num-microbatches`` fixes M).

Fresh-batch timing as ``bench_e2e.py``: ``--warmup-batches`` batches of other seeds (both sides),
then ``--max-steps`` timed steps, each a new global batch (seeds --seed, --seed+1, ...), the side
that goes first alternating. A rank's step starts after a barrier and holds planning, packing,
host-to-device copies, the schedule's forward + backward and the DP gradient all-reduce
(``finalize_model_grads``); per rank: ``wall_ms`` (whole step), ``grad_ms`` (schedule up to the
gradient sync: forward + backward incl. TP / PP / EP communication and pipeline bubbles),
``host_ms``, ``sync_ms`` (``finalize_model_grads``). Step time = the slowest rank's wall time;
speedup = baseline / harts of the medians over steps.

Per row (model x workload x recompute x configuration): compression, per-side step time
min/median/max, speedup, per-rank times, DP imbalance (a DP replica's time = the max over its
TP x PP ranks; imbalance = max / mean - 1 over replicas) measured vs predicted by the cost model
(``plan.cost`` per rank; baseline: the same cost model on its chains), predicted share vs
measured share of each replica, peak memory per rank, and numerics on the first timed batch
(untimed: baseline, harts and a baseline rerun with a random trajectory composition over the same
ranks): per-token log-prob max/mean |diff|, global loss and gradient-norm relative differences,
max over parameters of the per-parameter gradient relative difference (Megatron's reduced
``main_grad``), tree vs baseline next to rerun vs baseline. Targets (issue 17): speedup >= 0.9 x
compression, >= 5x on swe with recomputation; |measured - predicted HARTS imbalance| <= 0.05.

Rank 0 writes ``--out/--name`` (JSON, after every row) and, at the end, the tables as ``<name>.md``; ``--plot``
renders ``<name>.md`` (table) and ``<name>.png`` (speedup vs compression; measured vs predicted
imbalance) from result JSONs. Bad arguments or a combination Megatron refuses: one line on
stderr, exit status 2.
"""
from __future__ import annotations

import argparse
import contextlib
import faulthandler
import json
import os
import statistics
import sys
import time
from functools import partial

import numpy as np
import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, HERE)

import bench_e2e as E  # noqa: E402
from megatron_harts import verify  # noqa: E402
from megatron_harts.ops import chunk_plan, tree_token_logprobs  # noqa: E402
from megatron_harts.packing import pack  # noqa: E402
from megatron_harts.planner import plan  # noqa: E402
from megatron_harts.planner.cost import CostModel  # noqa: E402
from megatron_harts.planner.plan import assign  # noqa: E402
from megatron_harts.tree import RolloutTree, make_trajectory, trees_from_trajectories  # noqa: E402

LOSS = dict(loss_type="grpo", loss_agg_mode="token-mean")
SIDES = ("baseline", "harts")
GRAD_ALLREDUCE = ("Megatron DistributedDataParallel (grad_reduce_in_fp32, no overlap, no distributed optimizer; "
                  "1/DP pre-scaled all-reduce over the DP group, expert grads over the expert-DP group) "
                  "through finalize_model_grads")


class ConfigError(Exception):
    """Bad arguments or a parallel combination that cannot run: one line, exit status 2."""


def rank_env() -> tuple[int, int, int]:
    return int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1)), int(os.environ.get("LOCAL_RANK", 0))


def log(msg: str) -> None:
    if rank_env()[0] == 0:
        print(f"[e2e-dist {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


# ------------------------------------------------------------------------------------------------ configuration

def parse_configs(args, world: int) -> list[dict]:
    """``--configs TxPxE,...`` (or --tp/--pp/--ep) -> [{tp, pp, ep, dp}], validated against world."""
    specs = args.configs.split(",") if args.configs else [f"{args.tp}x{args.pp}x{args.ep}"]
    out, models = [], args.models.split(",")
    for s in specs:
        s, _, only = s.strip().partition(":")
        try:
            tp, pp, ep = (int(x) for x in s.split("x"))
        except ValueError:
            raise ConfigError(f"--configs: {s!r} is not TPxPPxEP[:model+model] (e.g. 2x1x1 or 1x1x2:moe)") from None
        only = only.split("+") if only else None
        if only and not set(only) <= set(models):
            raise ConfigError(f"--configs {s}:{'+'.join(only)}: models must be among --models {args.models}")
        if min(tp, pp, ep) < 1:
            raise ConfigError(f"--configs {s}: TP, PP and EP must be >= 1")
        if world % (tp * pp):
            raise ConfigError(f"--tp {tp} --pp {pp}: world size {world} is not a multiple of TP x PP = {tp * pp}")
        dp = world // (tp * pp)
        if dp % ep:
            raise ConfigError(f"--ep {ep}: expert parallelism must divide DP = {dp} (world {world} / TP {tp} / PP {pp})")
        out.append(dict(tp=tp, pp=pp, ep=ep, dp=dp, models=only or models))
    runs = [(c, m, incompatible(m, c)) for c in out for m in c["models"]]
    if all(why for _, _, why in runs):
        raise ConfigError(runs[0][2])
    return out


def incompatible(model: str, cfg: dict) -> str | None:
    """Why ``model`` cannot run at ``cfg`` (None: it can)."""
    if cfg["ep"] > 1 and model == "dense":
        return f"--ep {cfg['ep']}: the dense model has no experts; use --models moe"
    if cfg["tp"] > 1 and model == "moe":
        return (f"--tp {cfg['tp']} with --models moe: Megatron's MoE layer refuses tensor parallelism without "
                "sequence parallelism, which this driver does not run (packs are not padded to a multiple of TP); "
                "use TP=1 with EP for moe")
    return None


def stage_pattern(pattern: str, pp: int) -> str:
    """``pattern`` with ``|`` between PP stages: cut at layer-pair boundaries (after an MLP / MoE
    symbol) so that every stage gets ~the same number of layers."""
    if pp == 1:
        return pattern
    cuts = [i + 1 for i, s in enumerate(pattern) if s in "-E"]          # positions after a pair
    if len(cuts) < pp:
        raise ConfigError(f"--pp {pp}: pattern {pattern!r} has only {len(cuts)} layer pairs")
    n = len(pattern)
    chosen, prev = [], 0
    for k in range(1, pp):
        want = n * k / pp
        c = min((c for c in cuts if c > prev and c < n), key=lambda c: abs(c - want))
        chosen.append(c)
        prev = c
    parts = [pattern[a:b] for a, b in zip([0] + chosen, chosen + [n])]
    return "|".join(parts)


class CudaToCpu(torch.overrides.TorchFunctionMode):
    """CPU runs: ``device="cuda"`` arguments (Megatron's schedules allocate one) land on the CPU."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        d = kwargs.get("device")
        if (isinstance(d, str) and d.startswith("cuda")) or (isinstance(d, torch.device) and d.type == "cuda"):
            kwargs["device"] = torch.device("cpu")
        return func(*args, **kwargs)


class _CpuStream:
    """``torch.cuda.Stream`` / ``Event`` / ``current_stream()`` on CPU runs (Megatron's DDP gradient
    sync and MoE all-to-all dispatcher use them): everything is already done, waits are no-ops."""

    def __init__(self, *a, **k):
        pass

    def record(self, *a, **k):
        pass

    def record_event(self, *a, **k):
        return _CpuStream()

    def query(self):
        return True

    def wait(self, *a, **k):
        pass

    def wait_event(self, *a, **k):
        pass

    def wait_stream(self, *a, **k):
        pass

    def synchronize(self):
        pass


def init_parallel(cfg: dict, args) -> None:
    """Megatron's model-parallel groups for ``cfg`` (re-initialised when the sizes change)."""
    from megatron.core import parallel_state as ps

    try:
        if args.device == "cpu":
            from megatron_harts.megatron import cpu_shim
            cpu_shim.init_cpu_model_parallel(tensor_model_parallel_size=cfg["tp"], expert_model_parallel_size=cfg["ep"],
                                             pipeline_model_parallel_size=cfg["pp"], seed=args.seed)
        else:
            from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed
            if ps.model_parallel_is_initialized():
                ps.destroy_model_parallel()
            ps.initialize_model_parallel(tensor_model_parallel_size=cfg["tp"], pipeline_model_parallel_size=cfg["pp"],
                                         expert_model_parallel_size=cfg["ep"])
            model_parallel_cuda_manual_seed(args.seed)
    except (AssertionError, RuntimeError, ValueError) as e:
        msg = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise ConfigError(f"Megatron refused TP={cfg['tp']} PP={cfg['pp']} EP={cfg['ep']} on "
                          f"{rank_env()[1]} ranks: {msg}") from None
    assert ps.get_data_parallel_world_size() == cfg["dp"], (ps.get_data_parallel_world_size(), cfg)


def build_model(name: str, recompute: bool, args, max_len: int, cfg: dict):
    """This rank's pipeline stage of the bench_e2e model, wrapped in Megatron's DDP."""
    from megatron.core import parallel_state as ps
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron_harts.megatron import cpu_shim, tree_hybrid_stack_spec

    pattern, over = (E.TINY if args.tiny else E.MODELS)[name]
    pattern = stage_pattern(pattern, cfg["pp"])
    over = dict(over, **(E.RECOMPUTE if recompute else {}))
    if cfg["pp"] > 1:   # packs differ in length: stages exchange shapes; allgather refuses variable lengths
        over.update(variable_seq_lengths=True, moe_token_dispatcher_type="alltoall")
    if cfg["ep"] > 1:   # DP ranks hold packs of different lengths: allgather needs equal token counts per EP rank
        over.update(moe_token_dispatcher_type="alltoall")
    stage = dict(pre_process=ps.is_pipeline_first_stage(), post_process=ps.is_pipeline_last_stage())
    if args.device == "cpu":
        cpu_shim.cpu_manual_seed(args.seed)
        model = cpu_shim.build_tiny_hybrid_model(pattern, vocab_size=args.vocab, max_sequence_length=max_len,
                                                 hybrid_stack_spec=tree_hybrid_stack_spec(over.get("num_moe_experts")),
                                                 init_method_std=0.1, **stage, **over)
    else:
        from megatron.core.models.hybrid.hybrid_model import HybridModel
        from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed
        from megatron_harts.megatron.cpu_shim import tiny_hybrid_config
        model_parallel_cuda_manual_seed(args.seed)
        mc = tiny_hybrid_config(pattern, **{"init_method_std": 0.02, **over}, params_dtype=torch.bfloat16,
                                bf16=True, use_cpu_initialization=False)
        model = HybridModel(config=mc, hybrid_stack_spec=tree_hybrid_stack_spec(mc.num_moe_experts),
                            vocab_size=args.vocab, max_sequence_length=max_len, hybrid_layer_pattern=pattern,
                            position_embedding_type="rope", share_embeddings_and_output_weights=False, **stage)
        model = model.cuda(torch.cuda.current_device())
    ddp = DistributedDataParallel(config=model.config, module=model, ddp_config=DistributedDataParallelConfig(
        grad_reduce_in_fp32=True, overlap_grad_reduce=False, use_distributed_optimizer=False))
    return ddp, pattern


# ------------------------------------------------------------------------------------------------ step data

def harts_microbatches(trajs: list, args, cm: CostModel, dp: int, dp_rank: int, m_min: int) -> tuple[list, dict]:
    """This rank's tree-packed microbatch trees (slot order) and the plan's prediction."""
    trees = trees_from_trajectories(trajs)
    kw = dict(dp_size=dp, microbatch_capacity=args.capacity, cost_model=cm, chunk_size=args.chunk_size)
    try:
        p = plan(trees, num_microbatches=args.num_microbatches, **kw)
        if args.num_microbatches is None and p.num_microbatches < m_min:
            p = plan(trees, num_microbatches=m_min, **kw)
    except ValueError as e:
        raise ConfigError(f"planner: {e}") from None
    filled = [sum(bool(mb) for mb in p.ranks[r]) for r in range(dp)]
    return p.microbatches(trees, dp_rank), dict(rank_cost=p.cost.sum(1).tolist(), M=p.num_microbatches, filled=filled)


def baseline_microbatches(trajs: list, args, cm: CostModel, dp: int, dp_rank: int, m_min: int,
                          shuffle: int | None = None) -> tuple[list, dict]:
    """This rank's trajectory-wise microbatches: LPT on tokens over DP x M bins of <= capacity
    tokens (``shuffle``: a random composition instead, for the rerun), and the cost model's
    prediction of every rank's cost (chains: tokens + attention pairs + one round per pack)."""
    lens = np.array([len(t) for t in trajs], np.int64)
    if lens.max() > args.capacity:
        raise ConfigError(f"--capacity {args.capacity}: a trajectory has {lens.max()} tokens")
    cost = lens.astype(np.float64) if shuffle is None else np.random.default_rng(shuffle).random(len(lens))
    try:
        rk, mb, M = assign(cost, lens, dp_size=dp, capacity=args.capacity, num_microbatches=args.num_microbatches,
                           refine=shuffle is None)
        if args.num_microbatches is None and M < m_min:
            rk, mb, M = assign(cost, lens, dp_size=dp, capacity=args.capacity, num_microbatches=m_min,
                               refine=shuffle is None)
    except ValueError as e:
        raise ConfigError(f"baseline: {e}") from None
    chain = cm.tree_cost(lens, lens * (lens + 1) // 2)
    bins = rk * M + mb
    filled = [len(np.unique(bins[rk == r])) for r in range(dp)]
    rank_cost = np.bincount(rk, weights=chain, minlength=dp) + cm.per_round * np.array(filled)
    out = []
    for m in range(M):
        sel = np.flatnonzero((rk == dp_rank) & (mb == m))
        out.append([RolloutTree([trajs[i] for i in sel], merge_prefixes=False)] if sel.size else [])
    return out, dict(rank_cost=rank_cost.tolist(), M=M, filled=filled)


PAD_ID = "__pad__"


def pad_microbatch() -> list:
    """A microbatch that trains nothing: one 8-token chain, loss mask off, advantage 0."""
    t = make_trajectory(0, np.arange(1, 9), traj_id=PAD_ID, loss_mask=np.zeros(8, bool), advantage=0.0)
    return [RolloutTree([t], merge_prefixes=False)]


def device_microbatches(mb_trees: list, trajs: list, args, dp: int, device, ep: int, what: str, times: dict,
                        pred: dict) -> list:
    """``TreeMicrobatch`` es on ``device``: empty slots dropped; under EP (MoE all-to-all in every
    microbatch: all ranks must run the same number) ranks with fewer non-empty slots than the
    fullest rank (``pred["filled"]``, every rank's count) run :func:`pad_microbatch` es instead.
    ``times`` gets host ms of pack / copy. Checks use every rank's counts: all ranks raise together."""
    from megatron_harts.megatron.batch import GlobalNormalisers, TreeMicrobatch
    from megatron_harts.rl import RLBatch

    if min(pred["filled"]) == 0 and ep == 1:
        raise ConfigError(f"{what}: a DP rank got no trajectories ({len(trajs)} trajectories for DP={dp}); "
                          "use more groups (--swe-groups / --tau-groups / --tiny-groups)")
    mb_trees = [t for t in mb_trees if t]
    if ep > 1:
        mb_trees += [pad_microbatch() for _ in range(max(pred["filled"]) - len(mb_trees))]
    norms = GlobalNormalisers.of(trajs)
    out, copy_s, t0 = [], 0.0, time.perf_counter()
    for trees in mb_trees:
        pk = pack(trees, chunk_size=args.chunk_size)
        chunk_plan(pk, args.chunk_size)                  # host plan, cached on the pack, shared by the device copy
        mb = TreeMicrobatch(pk, RLBatch.from_trajectories(pk.trajectories), norms, len(mb_trees), dp)
        t1 = time.perf_counter()
        out.append(mb.to(device))
        copy_s += time.perf_counter() - t1
    if device.type == "cuda":
        t1 = time.perf_counter()
        torch.cuda.synchronize()
        copy_s += time.perf_counter() - t1
    times.update(pack=1e3 * (time.perf_counter() - t0 - copy_s), copy=1e3 * copy_s)
    return out


# ------------------------------------------------------------------------------------------------ one step

class Runner:
    """One configuration's model and the schedule around it."""

    def __init__(self, model, cfg: dict, args, device):
        from megatron.core import parallel_state as ps
        from megatron.core.distributed import finalize_model_grads

        self.model, self.cfg, self.args, self.device = model, cfg, args, device
        self.dp_rank = ps.get_data_parallel_rank()
        self.tp_group = ps.get_tensor_model_parallel_group()
        self.last = ps.is_pipeline_last_stage()
        self.tp_rank = ps.get_tensor_model_parallel_rank()
        self.clock = E.Clock(device)
        self.t_fin = None

        def timed_finalize(*a, **k):        # the gradient sync: time stamp before it
            self.clock.sync()
            self.t_fin = time.perf_counter()
            return finalize_model_grads(*a, **k)
        model.config.finalize_model_grads_func = timed_finalize

    def forward_step(self, store, data_iterator, model):
        from megatron_harts.megatron.batch import model_inputs, rl_loss
        mb = next(data_iterator)
        tokens, pos, psp = model_inputs(mb)
        out = model(tokens, pos, None, packed_seq_params=psp)

        def loss_func(x):
            if store is not None:          # numerics runs (untimed): per-trajectory log-probs
                lps = tree_token_logprobs(x.detach()[0], mb.pack, tp_group=self.tp_group)
                store["lps"].update({t.traj_id: lp.float().cpu() for t, lp in zip(mb.pack.trajectories, lps)
                                     if t.traj_id != PAD_ID})
            loss, n, rep = rl_loss(x, mb, tp_group=self.tp_group, **LOSS)
            if store is not None:
                store["loss"] += float(rep["rl loss"][0]) / (mb.num_microbatches * mb.dp_size)
            return loss, n, rep
        return out, loss_func

    def step(self, trajs: list, side: str, seed: int, store: dict | None = None, shuffle: int | None = None) -> dict:
        """One global batch on one side through Megatron's schedule; returns this rank's times (ms)."""
        import torch.distributed as dist
        from megatron.core.pipeline_parallel import get_forward_backward_func

        cfg, args = self.cfg, self.args
        a = argparse.Namespace(**{**vars(args), "seed": seed})
        m_min = cfg["pp"] if cfg["pp"] > 1 else 1
        self.model.zero_grad_buffer()
        E.reset_peak(self.device)
        self.clock.sync()
        dist.barrier()
        self.clock.sync()                 # NCCL's barrier is a device collective: wait for it
        t0 = time.perf_counter()
        if side == "harts":
            mb_trees, pred = harts_microbatches(trajs, a, self.cm, cfg["dp"], self.dp_rank, m_min)
        else:
            mb_trees, pred = baseline_microbatches(trajs, a, self.cm, cfg["dp"], self.dp_rank, m_min, shuffle)
        t_plan = time.perf_counter()
        times: dict = {}
        mbs = device_microbatches(mb_trees, trajs, a, cfg["dp"], self.device, cfg["ep"], side, times, pred)
        t1 = time.perf_counter()
        self.t_fin = None
        get_forward_backward_func()(
            forward_step_func=partial(self.forward_step, store), data_iterator=[iter(mbs)], model=[self.model],
            num_microbatches=len(mbs), seq_length=max(m.pack.num_tokens for m in mbs), micro_batch_size=1,
            forward_only=False)
        self.clock.sync()
        t2 = time.perf_counter()
        t_fin = self.t_fin if self.t_fin is not None else t2
        real = [m for m in mbs if m.pack.trajectories[0].traj_id != PAD_ID]
        return dict(wall_ms=1e3 * (t2 - t0), grad_ms=1e3 * (t_fin - t1), compute_ms=1e3 * (t_fin - t0),
                    sync_ms=1e3 * (t2 - t_fin), host_ms=1e3 * (t1 - t0), plan_ms=1e3 * (t_plan - t0),
                    pack_ms=times["pack"], copy_ms=times["copy"], microbatches=len(mbs),
                    pad_microbatches=sum(m.pack.trajectories[0].traj_id == PAD_ID for m in mbs),
                    compact_tokens=sum(m.pack.num_tokens for m in real),        # pad microbatches not counted
                    traj_tokens=sum(m.pack.num_trajectory_tokens for m in real), peak_gib=peak_gib(self.device),
                    pred=pred)

    # --------------------------------------------------------------------------- numerics

    def grads(self) -> dict:
        return {n: p.main_grad.detach().float().clone() for n, p in self.model.module.named_parameters()}

    def grad_norm(self) -> float:
        """Global L2 norm of the reduced gradient: each local shard weighted by 1 / (number of
        ranks holding the same shard), summed over all ranks."""
        import torch.distributed as dist
        from megatron.core import parallel_state as ps

        world, tp, dp = dist.get_world_size(), self.cfg["tp"], self.cfg["dp"]
        etp = ps.get_expert_tensor_parallel_world_size()
        edp = world // (self.cfg["pp"] * self.cfg["ep"] * etp)
        sq = torch.zeros((), dtype=torch.float64, device=self.device)
        for p in self.model.module.parameters():
            g2 = p.main_grad.detach().double().pow(2).sum()
            sharded = getattr(p, "tensor_model_parallel", False)
            if getattr(p, "allreduce", True):            # dense: replicated over DP (and TP if not sharded)
                rep = dp * (1 if sharded else tp)
            else:                                        # expert: over expert-DP (and expert-TP if not sharded)
                rep = edp * (1 if sharded else etp)
            sq += g2 / rep
        dist.all_reduce(sq)
        return float(sq.sqrt())


def peak_gib(device) -> float | None:
    return torch.cuda.max_memory_allocated() / 2**30 if device.type == "cuda" else None


def gather(obj):
    import torch.distributed as dist
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


def lp_diff(a: dict, b: dict) -> dict:
    if a.keys() != b.keys():
        raise RuntimeError(f"log-prob trajectories differ: {len(a)} vs {len(b)}")
    return E.lp_diff(a, b)


def numerics(runner: Runner, trajs: list, seed: int, do_rerun: bool) -> dict:
    """Untimed: baseline, harts and (``do_rerun``) a baseline with another composition on one
    batch; log-prob / loss / grad-norm / per-parameter gradient differences vs the baseline."""
    import torch.distributed as dist

    res, base_grads = {}, None
    sides = [("baseline", None), ("harts", None)] + ([("rerun", seed + 1)] if do_rerun else [])
    for name, shuffle in sides:
        store = dict(lps={}, loss=0.0)
        runner.step(trajs, "harts" if name == "harts" else "baseline", seed, store=store, shuffle=shuffle)
        keep = runner.last and runner.tp_rank == 0
        parts = gather((store["lps"] if keep else {}, store["loss"] if keep else 0.0))
        lps = {k: v for d, _ in parts for k, v in d.items()}
        res[name] = dict(lps=lps, loss=sum(x for _, x in parts), grad_norm=runner.grad_norm())
        if name == "baseline":
            base_grads = runner.grads()
        else:   # worst per-parameter relative difference, max over all ranks; GDN decay params apart
            worst = [0.0, 0.0]       # (other, decay): A_log / dt_bias grads are sums with cancellation
            for n, p in runner.model.module.named_parameters():
                d = float(verify.rel_diff(p.main_grad.detach().float(), base_grads[n]))
                k = int(n.endswith(verify.DECAY_PARAMS))
                worst[k] = max(worst[k], d)
            w = torch.tensor(worst, dtype=torch.float64, device=runner.device)
            dist.all_reduce(w, op=dist.ReduceOp.MAX)
            res[name]["grad_max_rel_diff"], res[name]["grad_max_rel_diff_decay"] = w.tolist()
    out = dict(loss_baseline=res["baseline"]["loss"], grad_norm_baseline=res["baseline"]["grad_norm"])
    for name in [s for s, _ in sides if s != "baseline"]:
        r, b = res[name], res["baseline"]
        out[f"lp_diff_{name}"] = lp_diff(r["lps"], b["lps"])
        out[f"loss_{name}"] = r["loss"]
        out[f"loss_rel_diff_{name}"] = abs(r["loss"] - b["loss"]) / max(abs(b["loss"]), 1e-30)
        out[f"grad_norm_{name}"] = r["grad_norm"]
        out[f"grad_norm_rel_diff_{name}"] = abs(r["grad_norm"] - b["grad_norm"]) / max(b["grad_norm"], 1e-30)
        out[f"grad_max_rel_diff_{name}"] = r["grad_max_rel_diff"]
        out[f"grad_max_rel_diff_decay_{name}"] = r["grad_max_rel_diff_decay"]
    out["trajectories"] = len(res["baseline"]["lps"])
    return out


# ------------------------------------------------------------------------------------------------ a row

def spread(xs):
    return E.spread(list(xs))


def imbalance(x) -> float:
    x = np.asarray(x, np.float64)
    return float(x.max() / max(x.mean(), 1e-30) - 1.0)


def bench_row(runner: Runner, model_name: str, recompute: bool, wl: str, batches: dict, args, cfg: dict,
              rank_dp: list[int]) -> dict:
    """One configuration x model x workload x recompute; rank 0's return value is the JSON row."""
    warm, timed = E.batch_seeds(args)
    for i, seed in enumerate(warm):
        t0 = time.perf_counter()
        for side in SIDES:
            runner.step(batches[seed], side, seed)
        log(f"{model_name} {wl}: warm-up batch {i + 1}/{len(warm)} (both sides) {time.perf_counter() - t0:.1f} s")
    steps = {s: [] for s in SIDES}
    for k, seed in enumerate(timed):
        for side in (SIDES if k % 2 == 0 else SIDES[::-1]):
            mine = runner.step(batches[seed], side, seed)
            allr = gather(mine)                                    # every rank's record, rank order
            dp = cfg["dp"]
            rep_grad = [max(r["grad_ms"] for r, d in zip(allr, rank_dp) if d == j) for j in range(dp)]
            rep_comp = [max(r["compute_ms"] for r, d in zip(allr, rank_dp) if d == j) for j in range(dp)]
            pred = allr[0]["pred"]["rank_cost"]
            by_dp = {d: r for r, d in zip(allr, rank_dp)}         # one rank per replica (same plan data)
            steps[side].append(dict(
                seed=seed, wall_ms=max(r["wall_ms"] for r in allr), rank_wall_ms=[r["wall_ms"] for r in allr],
                rank_grad_ms=[r["grad_ms"] for r in allr], rank_compute_ms=[r["compute_ms"] for r in allr],
                rank_host_ms=[r["host_ms"] for r in allr], rank_sync_ms=[r["sync_ms"] for r in allr],
                grad_ms=max(r["grad_ms"] for r in allr), host_ms=max(r["host_ms"] for r in allr),
                plan_ms=max(r["plan_ms"] for r in allr), pack_ms=max(r["pack_ms"] for r in allr),
                copy_ms=max(r["copy_ms"] for r in allr), replica_grad_ms=rep_grad, replica_compute_ms=rep_comp,
                microbatches=[by_dp[j]["microbatches"] for j in range(dp)], planned_microbatches=allr[0]["pred"]["M"],
                pad_microbatches=[by_dp[j]["pad_microbatches"] for j in range(dp)],
                compact_tokens=sum(by_dp[j]["compact_tokens"] for j in range(dp)),
                traj_tokens=sum(by_dp[j]["traj_tokens"] for j in range(dp)),
                replica_traj_tokens=[by_dp[j]["traj_tokens"] for j in range(dp)],
                predicted_cost=pred, predicted_imbalance=imbalance(pred), measured_imbalance=imbalance(rep_grad),
                measured_imbalance_compute=imbalance(rep_comp), rank_peak_gib=[r["peak_gib"] for r in allr]))
        log(f"{model_name} {wl} {cfg_name(cfg)} step {k + 1}/{len(timed)}: " + ", ".join(
            f"{s} {steps[s][-1]['wall_ms']:.0f} ms" for s in SIDES))
    trajs0 = batches[timed[0]]
    num = numerics(runner, trajs0, timed[0], args.rerun)
    tok = sum(x["traj_tokens"] for x in steps["baseline"])
    row = dict(model=model_name, workload=wl, recompute=recompute, **{k: cfg[k] for k in ("tp", "pp", "ep", "dp")},
               world=len(rank_dp), rank_dp=list(rank_dp),
               config=cfg_name(cfg), fresh_batches=True, steps=len(timed), warmup_batches=len(warm),
               trajectories=len(trajs0), trajectory_tokens=tok // len(timed), grad_allreduce=GRAD_ALLREDUCE,
               cost_model=dict(vars(runner.cm)), cost_units=runner.cost_units, numerics=num)
    for side, st in steps.items():
        rank_grad = np.median(np.array([x["rank_grad_ms"] for x in st]), axis=0)
        rep_grad = np.median(np.array([x["replica_grad_ms"] for x in st]), axis=0)
        pred = np.array([x["predicted_cost"] for x in st])            # [steps, dp]
        meas = np.array([x["replica_grad_ms"] for x in st])
        share_p = (pred / pred.sum(1, keepdims=True)).mean(0)
        share_m = (meas / meas.sum(1, keepdims=True)).mean(0)
        peaks = [p for x in st for p in x["rank_peak_gib"] if p is not None]
        row[side] = dict(
            steps=st, wall_ms=spread(x["wall_ms"] for x in st), grad_ms=spread(x["grad_ms"] for x in st),
            host_ms=spread(x["host_ms"] for x in st), rank_grad_ms=rank_grad.tolist(),
            rank_wall_ms=np.median(np.array([x["rank_wall_ms"] for x in st]), axis=0).tolist(),
            replica_grad_ms=rep_grad.tolist(), predicted_share=share_p.tolist(), measured_share=share_m.tolist(),
            # ms per cost unit fitted over all steps and replicas: predicted ms = cost x this
            ms_per_cost_unit=float(meas.sum() / max(pred.sum(), 1e-30)),
            predicted_imbalance=statistics.median(x["predicted_imbalance"] for x in st),
            measured_imbalance=statistics.median(x["measured_imbalance"] for x in st),
            measured_imbalance_compute=statistics.median(x["measured_imbalance_compute"] for x in st),
            rank_imbalance=imbalance(rank_grad), compact_tokens=sum(x["compact_tokens"] for x in st) // len(st),
            microbatches=statistics.mean(m for x in st for m in x["microbatches"]),
            peak_gib=max(peaks) if peaks else None,
            rank_peak_gib=[max(x["rank_peak_gib"][r] for x in st) if peaks else None for r in range(len(rank_grad))],
            tokens_per_s=tok / (sum(x["wall_ms"] for x in st) / 1e3))
    b, h = row["baseline"], row["harts"]
    row["compression"] = tok / sum(x["compact_tokens"] for x in steps["harts"])
    row["speedup"] = b["wall_ms"]["median"] / h["wall_ms"]["median"]
    row["speedup_grad"] = b["grad_ms"]["median"] / h["grad_ms"]["median"]
    row["speedup_range"] = [b["wall_ms"]["min"] / h["wall_ms"]["max"], b["wall_ms"]["max"] / h["wall_ms"]["min"]]
    row["target"] = 0.9 * row["compression"]
    row["imbalance_gap"] = abs(h["measured_imbalance"] - h["predicted_imbalance"])
    row["meets_speedup_target"] = row["speedup"] >= row["target"] and (wl != "swe" or not recompute
                                                                       or row["speedup"] >= 5)
    row["meets_imbalance_target"] = row["imbalance_gap"] <= 0.05
    return row


def cfg_name(cfg: dict) -> str:
    return f"TP{cfg['tp']} PP{cfg['pp']} DP{cfg['dp']}" + (f" EP{cfg['ep']}" if cfg["ep"] > 1 else "")


# ------------------------------------------------------------------------------------------------ output

def table(rows: list[dict]) -> list[str]:
    head = ("| config | model | workload | rc | steps | traj tok/step | compression | base step ms med [min-max] "
            "| harts step ms med [min-max] | speedup [range] | target | imbalance harts pred/meas | imbalance base "
            "pred/meas | base GiB | harts GiB | lp diff h-b / rerun | loss rel h-b / rerun | grad-norm rel h-b / rerun "
            "| grad max rel h-b / rerun | decay grad max rel h-b / rerun | met speedup / imbalance |")
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    f = lambda d: f"{d['median']:.1f} [{d['min']:.1f}-{d['max']:.1f}]"  # noqa: E731
    g = lambda x: "-" if x is None else f"{x:.1f}"  # noqa: E731
    for r in rows:
        b, h, n = r["baseline"], r["harts"], r["numerics"]
        rr = lambda k: f"{n[k + '_harts'] if not isinstance(n[k + '_harts'], dict) else n[k + '_harts']['max']:.1e} / " + (  # noqa: E731
            "-" if k + "_rerun" not in n else
            f"{n[k + '_rerun'] if not isinstance(n[k + '_rerun'], dict) else n[k + '_rerun']['max']:.1e}")
        lines.append(
            f"| {r['config']} | {r['model']} | {r['workload']} | {'on' if r['recompute'] else 'off'} | {r['steps']} "
            f"| {r['trajectory_tokens']} | {r['compression']:.2f} | {f(b['wall_ms'])} | {f(h['wall_ms'])} "
            f"| {r['speedup']:.2f} [{r['speedup_range'][0]:.2f}-{r['speedup_range'][1]:.2f}] | {r['target']:.2f} "
            f"| {h['predicted_imbalance']:.3f}/{h['measured_imbalance']:.3f} "
            f"| {b['predicted_imbalance']:.3f}/{b['measured_imbalance']:.3f} | {g(b['peak_gib'])} | {g(h['peak_gib'])} "
            f"| {rr('lp_diff')} | {rr('loss_rel_diff')} | {rr('grad_norm_rel_diff')} | {rr('grad_max_rel_diff')} | {rr('grad_max_rel_diff_decay')} "
            f"| {'yes' if r['meets_speedup_target'] else 'no'} / {'yes' if r['meets_imbalance_target'] else 'no'} |")
    return lines


def rank_table(rows: list[dict]) -> list[str]:
    """Per-rank median fwd+bwd ms, and per DP replica: predicted share vs measured share."""
    lines = ["| config | model | workload | side | rank grad ms (median) | replica grad ms | predicted share "
             "| measured share | ms per cost unit |", "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        for s in SIDES:
            x = r[s]
            j = lambda v, p=1: ", ".join(f"{y:.{p}f}" for y in v)  # noqa: E731
            lines.append(f"| {r['config']} | {r['model']} | {r['workload']} | {s} | {j(x['rank_grad_ms'])} "
                         f"| {j(x['replica_grad_ms'])} | {j(x['predicted_share'], 3)} | {j(x['measured_share'], 3)} "
                         f"| {x['ms_per_cost_unit']:.3g} |")
    return lines


def command_line(argv: list[str]) -> str:
    """The driver's arguments without those naming machine paths or limits (--out, --watchdog)."""
    out, skip = [], False
    for a in argv:
        if skip:
            skip = False
        elif a in ("--out", "--watchdog"):
            skip = True
        elif a.split("=", 1)[0] not in ("--out", "--watchdog"):
            out.append(a)
    return " ".join(["scripts/bench_e2e_dist.py"] + out)


def render(rows: list[dict], metas: list[dict], out_dir: str, name: str, skipped: list[dict] = ()) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    m = metas[0] if metas else {}
    lines = [f"# HARTS vs trajectory-wise under Megatron's parallel state ({m.get('device', '?')})", "",
             f"Produced by `scripts/bench_e2e_dist.py` (world {m.get('world')}, torch {m.get('torch')}); "
             f"{m.get('warmup_batches')} warm-up batches, then each timed step on a new global batch. Step ms = the "
             "slowest rank's wall clock (planning, packing, copies, forward + backward through Megatron's schedule, "
             "DDP gradient all-reduce). Imbalance = max / mean - 1 over DP replicas of the fwd+bwd time "
             "(pred: the planner's cost model). Numerics on the first timed batch: tree vs baseline and a baseline "
             "rerun with another composition vs the baseline.", ""]
    cpu = any(x.get("correctness_only") for x in metas)
    if cpu:
        lines += ["**CPU (gloo) run: correctness only.** Tiny fp32 models on CPU processes that share their cores; "
                  "the times and imbalances below say nothing about GPUs.", ""]
    lines += [f"- `{command_line(x.get('argv', []))}`" for x in metas]
    lines += ["", "## Per configuration", ""] + table(rows) + ["", "## Per rank", ""] + rank_table(rows)
    lines += [""] * bool(skipped) + [f"Not run: {x['model']} at {x['config']}: {x['reason']}" for x in skipped]
    fig, (ax, bx) = plt.subplots(1, 2, figsize=(10, 4.2))
    for key in sorted({(r["config"], r["model"], r["recompute"]) for r in rows}):
        pts = sorted((r["compression"], r["speedup"]) for r in rows if (r["config"], r["model"], r["recompute"]) == key)
        ax.plot([p[0] for p in pts], [p[1] for p in pts], "o-", label=f"{key[0]} {key[1]} rc {'on' if key[2] else 'off'}")
    hi = max([r["compression"] for r in rows] + [2]) * 1.05
    ax.plot([1, hi], [1, hi], "k--", lw=0.8, label="ideal")
    ax.plot([1, hi], [0.9, 0.9 * hi], "k:", lw=0.8, label="target 0.9x")
    ax.set_xlabel("compression")
    ax.set_ylabel("speedup (median step, slowest rank)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=6)
    for s, mk in zip(SIDES, "sx"):
        bx.scatter([r[s]["predicted_imbalance"] for r in rows], [r[s]["measured_imbalance"] for r in rows],
                   marker=mk, label=s)
    top = max([r[s][k] for r in rows for s in SIDES for k in ("predicted_imbalance", "measured_imbalance")] + [0.1])
    xs = np.array([0, top * 1.1])
    bx.plot(xs, xs, "k--", lw=0.8)
    bx.fill_between(xs, xs - 0.05, xs + 0.05, color="gray", alpha=0.2, label="target +-0.05")
    bx.set_xlabel("predicted DP imbalance")
    bx.set_ylabel("measured DP imbalance")
    bx.grid(alpha=0.3)
    bx.legend(fontsize=7)
    fig.suptitle(f"{m.get('device', '?')}" + (": CPU correctness run, times not meaningful" if cpu else ""),
                 fontsize=9)
    fig.tight_layout()
    fig.savefig(os.path.join(out_dir, f"{name}.png"), dpi=120)
    lines += ["", f"![speedup and imbalance]({name}.png)", ""]
    with open(os.path.join(out_dir, f"{name}.md"), "w") as f:
        f.write("\n".join(lines))


# ------------------------------------------------------------------------------------------------ main

def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=os.environ.get("OUT", "."), help="folder for the JSON (or the .md/.png)")
    ap.add_argument("--name", default="e2e_dist.json", help="JSON file name inside --out (--plot: the stem of .md/.png)")
    ap.add_argument("--plot", nargs="+", metavar="JSON", help="render <name>.md/.png from result JSONs and exit")
    ap.add_argument("--tp", type=int, default=1, help="tensor parallel size")
    ap.add_argument("--pp", type=int, default=1, help="pipeline parallel size (1F1B)")
    ap.add_argument("--ep", type=int, default=1, help="expert parallel size (moe only; divides DP)")
    ap.add_argument("--configs", help="several configurations in one launch: TPxPPxEP[:model+model][,...] "
                    "(overrides --tp/--pp/--ep; ':moe' runs only that model there)")
    ap.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    ap.add_argument("--tiny", action="store_true", help="tiny fp32 models and workloads (CPU correctness runs)")
    ap.add_argument("--tiny-groups", type=int, default=2, help="rollout groups of a --tiny swe/tau batch")
    ap.add_argument("--models", default="dense", help="dense, moe (comma-separated)")
    ap.add_argument("--workloads", default="swe", help="swe, tau, sweep:C (comma-separated)")
    ap.add_argument("--recompute", choices=["on", "off", "both"], default="on")
    ap.add_argument("--max-steps", type=int, default=5, help="timed global-batch steps per side")
    ap.add_argument("--warmup-batches", type=int, default=2)
    ap.add_argument("--capacity", type=int, default=0, help="max tokens per microbatch (0: 65536 with "
                    "recompute, 32768 without; tiny: 256)")
    ap.add_argument("--num-microbatches", type=int, default=None, help="microbatches per rank, both sides "
                    "(default: the fewest that fit, at least PP)")
    ap.add_argument("--cost-model", help="CostModel JSON of scripts/calibrate_cost.py (default: "
                    "CostModel.from_pattern FLOPs)")
    ap.add_argument("--chunk-size", type=int, default=64)
    ap.add_argument("--vocab", type=int, default=32768)
    ap.add_argument("--swe-groups", type=int, default=2, help="as bench_e2e.py: the same global batch")
    ap.add_argument("--swe-max-tokens", type=int, default=32768)
    ap.add_argument("--tau-groups", type=int, default=8)
    ap.add_argument("--sweep-tokens", type=int, default=131072)
    ap.add_argument("--no-rerun", dest="rerun", action="store_false", help="skip the baseline rerun (noise floor)")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--watchdog", type=float, default=0, help="dump all stacks and exit after this many seconds")
    return ap


def check_args(args) -> None:
    if args.max_steps < 1 or args.warmup_batches < 0:
        raise ConfigError("--max-steps must be >= 1 and --warmup-batches >= 0")
    if args.num_microbatches is not None and args.num_microbatches < 1:
        raise ConfigError(f"--num-microbatches must be >= 1, got {args.num_microbatches}")
    for m in args.models.split(","):
        if m not in E.MODELS:
            raise ConfigError(f"--models: unknown model {m!r} (dense, moe)")
    for w in args.workloads.split(","):
        if not (w in ("swe", "tau") or w.startswith("sweep:")):
            raise ConfigError(f"--workloads: unknown workload {w!r} (swe, tau, sweep:C)")
    if args.cost_model and not os.path.exists(args.cost_model):
        raise ConfigError(f"--cost-model {args.cost_model}: no such file")
    if "RANK" not in os.environ or "WORLD_SIZE" not in os.environ:
        raise ConfigError("launch with torchrun (python -m torch.distributed.run --nproc-per-node N ...): "
                          "RANK / WORLD_SIZE are not set")
    if args.device == "cuda" and not torch.cuda.is_available():
        raise ConfigError("--device cuda: no GPU; use --device cpu --tiny")


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    if args.watchdog:
        faulthandler.dump_traceback_later(args.watchdog, exit=True)
    if args.plot:
        rows, metas, skipped = [], [], []
        for path in args.plot:
            with open(path) as f:
                d = json.load(f)
            rows += d["rows"]
            skipped += d.get("skipped", [])
            metas.append(d["meta"])
        if not rows:
            print("bench_e2e_dist.py: error: --plot: no rows in " + " ".join(args.plot), file=sys.stderr)
            return 2
        os.makedirs(args.out, exist_ok=True)
        render(rows, metas, args.out, os.path.splitext(args.name)[0], skipped)
        print("\n".join(table(rows)))
        return 0
    rank, world, local = rank_env()
    try:
        check_args(args)
        cfgs = parse_configs(args, world)
        return run(args, cfgs, argv)
    except ConfigError as e:
        if rank == 0:
            print(f"bench_e2e_dist.py: error: {e}", file=sys.stderr, flush=True)
        return 2


def run(args, cfgs: list[dict], argv) -> int:
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    rank, world, local = rank_env()
    if args.tiny:
        args.vocab = 64
    device = torch.device(args.device if args.device == "cpu" else f"cuda:{local}")
    import torch._dynamo as dynamo
    if device.type == "cuda":
        torch.cuda.set_device(local)
        for k in ("cache_size_limit", "recompile_limit", "accumulated_cache_size_limit", "accumulated_recompile_limit"):
            if hasattr(dynamo.config, k):
                setattr(dynamo.config, k, 256)
        dist.init_process_group("nccl", device_id=device)
        ctx = contextlib.nullcontext()
    else:
        dynamo.config.disable = True        # Megatron's torch.compile'd fusions: minutes of C++ builds on CPU
        torch.set_num_threads(max(1, int(os.environ.get("OMP_NUM_THREADS", "1"))))
        dist.init_process_group("gloo")
        # CPU stand-ins for the CUDA calls on Megatron's path (nothing to wait for on the CPU): the p2p
        # shape exchange synchronizes; DDP's gradient sync asks for the current stream
        torch.cuda.synchronize = lambda *a, **k: None
        torch.cuda.current_stream = lambda *a, **k: _CpuStream()
        torch.cuda.stream = lambda *a, **k: contextlib.nullcontext()
        torch.cuda.Stream = torch.cuda.Event = _CpuStream
        torch.Tensor.record_stream = lambda self, *a, **k: None
        from megatron.core.transformer.moe import token_dispatcher    # all-to-all splits: host numpy as on GPU
        token_dispatcher.maybe_move_tensor_to_cpu = lambda t, as_numpy=False, record_stream=False: (
            t.numpy() if as_numpy and torch.is_tensor(t) else t)
        ctx = CudaToCpu()
    wls = args.workloads.split(",")
    recs = {"on": [True], "off": [False], "both": [True, False]}[args.recompute]
    seeds = sum(E.batch_seeds(args), [])
    data = {wl: {sd: E.workload(wl, argparse.Namespace(**{**vars(args), "seed": sd})) for sd in seeds} for wl in wls}
    max_len = max(len(t) for d in data.values() for ts in d.values() for t in ts)
    meta = dict(device=torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu (gloo)",
                torch=torch.__version__, world=world, chunk_size=args.chunk_size, max_steps=args.max_steps,
                warmup_batches=args.warmup_batches, vocab=args.vocab, fresh_batches=True,
                argv=sys.argv[1:] if argv is None else list(argv), grad_allreduce=GRAD_ALLREDUCE,
                configs=[cfg_name(c) for c in cfgs], simulated=False, tiny=args.tiny,
                correctness_only=device.type == "cpu")
    rows, skipped, path = [], [], os.path.join(args.out, args.name)
    if rank == 0:
        os.makedirs(args.out, exist_ok=True)
    with ctx:
        for cfg in cfgs:
            init_parallel(cfg, args)
            rank_dp = gather(ps.get_data_parallel_rank())
            for m in cfg["models"]:
                why = incompatible(m, cfg)
                if why:                                   # recorded in the JSON, not run
                    log(f"{cfg_name(cfg)} {m}: not run: {why}")
                    skipped.append(dict(model=m, config=cfg_name(cfg), reason=why))
                    continue
                for rc in recs:
                    cap = args.capacity or (256 if args.tiny else 65536 if rc else 32768)
                    a = argparse.Namespace(**{**vars(args), "capacity": cap})
                    t0 = time.perf_counter()
                    try:
                        model, pattern = build_model(m, rc, a, max_len, cfg)
                    except (ValueError, AssertionError) as e:     # Megatron's config checks (same on every rank)
                        msg = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
                        raise ConfigError(f"Megatron refused --models {m} at {cfg_name(cfg)}: {msg}") from None
                    log(f"{cfg_name(cfg)}: built {m} stage {pattern!r} (recompute {'on' if rc else 'off'}) in "
                        f"{time.perf_counter() - t0:.1f} s")
                    runner = Runner(model, cfg, a, device)
                    if args.cost_model:
                        runner.cm, runner.cost_units = CostModel.from_json(args.cost_model), "calibrated (s)"
                    else:
                        runner.cm = E.cost_model_for(m, a)
                        runner.cost_units = "FLOPs (CostModel.from_pattern, not calibrated)"
                    for wl in wls:
                        t0 = time.perf_counter()
                        row = bench_row(runner, m, rc, wl, data[wl], a, cfg, rank_dp)
                        row.update(capacity=cap, wall_s=time.perf_counter() - t0, pattern=pattern)
                        rows.append(row)
                        if rank == 0:
                            with open(path, "w") as f:
                                json.dump({"meta": meta, "rows": rows, "skipped": skipped}, f, indent=1)
                        log(f"{cfg_name(cfg)} {m} {wl} rc={rc}: compression {row['compression']:.2f}, speedup "
                            f"{row['speedup']:.2f}, imbalance harts pred {row['harts']['predicted_imbalance']:.3f} "
                            f"meas {row['harts']['measured_imbalance']:.3f} ({row['wall_s']:.0f} s)")
                    del runner, model
                    E.reset_peak(device)
    if rank == 0:
        with open(path, "w") as f:
            json.dump({"meta": meta, "rows": rows, "skipped": skipped}, f, indent=1)
        md = table(rows) + [""] + rank_table(rows) + [f"Not run: {x['model']} at {x['config']}: {x['reason']}"
                                                     for x in skipped]
        with open(os.path.splitext(path)[0] + ".md", "w") as f:       # --plot renders the full page + figure
            f.write("\n".join(md) + "\n")
        print("\n".join(table(rows)))
    dist.barrier()
    ps.destroy_model_parallel()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
