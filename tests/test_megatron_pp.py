"""Tree packing under pipeline parallelism: PP=2 (1F1B and the interleaved schedule) on 2 CPU
processes (gloo), through Megatron's own ``get_forward_backward_func`` schedule.

Each stage's ``forward_step`` takes the next ``TreeMicrobatch`` from its own iterator (every
rank plans the same step, ``build_step``) and builds ``TreePackedSeqParams`` from it, so the
tree reaches every stage; hidden states ``[T, 1, h]`` travel between stages with
``variable_seq_lengths`` (T differs per pack and between tree and trajectory-wise packs); the
last stage computes ``rl_loss`` through Megatron's ``forward_step_calc_loss``. On each rank, the
step's losses (per microbatch) and every local parameter's gradient of the tree-packed run equal
those of the trajectory-wise run (``pack_trajectories``) through the same schedule.
Tolerances as ``tests/test_megatron_dist.py``: 1e-5 relative, GDN decay grads 5e-4.

Megatron's schedules allocate one scalar with ``device="cuda"`` and call ``torch.cuda.synchronize``
after exchanging shapes; the workers run under the test launcher's ``CudaToCpu`` mode and a no-op
synchronize (CPU stand-ins, nothing in Megatron is changed).
"""
from __future__ import annotations

import os
import sys
from functools import partial

import pytest
import torch

from megatron_harts import verify
from megatron_harts.megatron import cpu_shim, tree_hybrid_stack_spec
from megatron_harts.megatron.arguments import TreePackingArgumentError, validate_tree_packing_args
from megatron_harts.megatron.batch import build_step, model_inputs, rl_loss

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from test_megatron_dist import (BASE, C, DECAY_TOL, LOSS_KW, TOL, VOCAB, _free_port,  # noqa: E402
                                _megatron_args, _trajectories)

M = 4                                   # microbatches per step (>= PP, a multiple of it for interleaving)
PATTERNS = {None: "G*-|G-", 2: "G*|-G|*-|G-"}   # PP=2; PP=2 x VPP=2 (one '|' segment per model chunk)


def _forward_step(data_iterator, model):
    mb = next(data_iterator)
    tokens, pos, psp = model_inputs(mb)
    output = model(tokens, pos, None, packed_seq_params=psp)
    return output, partial(lambda mb, x: rl_loss(x, mb, **LOSS_KW), mb)


def _chunks(vpp):
    """This rank's model chunks (one per virtual stage), built as Megatron's ``get_model`` does."""
    from megatron.core import parallel_state as ps
    cpu_shim.cpu_manual_seed(0)
    chunks = []
    for v in range(vpp or 1):
        vs = v if vpp else None
        chunks.append(cpu_shim.build_tiny_hybrid_model(
            PATTERNS[vpp], vocab_size=VOCAB, init_method_std=0.1,
            hybrid_stack_spec=tree_hybrid_stack_spec(),
            pre_process=ps.is_pipeline_first_stage(ignore_virtual=False, vp_stage=vs),
            post_process=ps.is_pipeline_last_stage(ignore_virtual=False, vp_stage=vs), vp_stage=vs,
            variable_seq_lengths=True, moe_token_dispatcher_type="alltoall",
            # interleaved with PP=2: Megatron needs overlapped (unbatched) p2p, else a batch holds a send and
            # a receive in each direction between the same two ranks (its validate_args asserts this)
            **(dict(overlap_p2p_comm=True, batch_p2p_comm=False) if vpp else {})))   # Megatron: allgather refuses
                                                                                # variable_seq_lengths, even unused
    return chunks


def _step(chunks, trajs, tree_packing):
    """One step through Megatron's schedule -> (per-microbatch ``rl loss`` on the last stage, grads)."""
    from megatron.core.pipeline_parallel import get_forward_backward_func
    for c in chunks:
        c.zero_grad(set_to_none=True)
    mbs = build_step(trajs, dp_size=1, dp_rank=0, num_microbatches=M, tree_packing=tree_packing, chunk_size=C)
    out = get_forward_backward_func()(
        forward_step_func=_forward_step, data_iterator=[iter(mbs) for _ in chunks], model=chunks,
        num_microbatches=M, seq_length=max(mb.pack.num_tokens for mb in mbs), micro_batch_size=1,
        forward_only=False)
    losses = [float(r["rl loss"][0]) for r in out]
    grads = {f"chunk{i}.{n}": p.grad.clone() for i, c in enumerate(chunks) for n, p in c.named_parameters()}
    return losses, grads


def _pp2(rank, vpp=None):
    from megatron.core import parallel_state as ps
    from megatron_cpu_launch import CudaToCpu
    torch.cuda.synchronize = lambda *a, **k: None        # called after the shape exchange (CPU: nothing to wait for)
    with cpu_shim.cpu_megatron(pipeline_model_parallel_size=2, virtual_pipeline_model_parallel_size=vpp, seed=0), \
            CudaToCpu():
        assert ps.get_pipeline_model_parallel_world_size() == 2
        chunks = _chunks(vpp)
        trajs = _trajectories(num_groups=2 * M)
        tree_losses, tree = _step(chunks, trajs, True)
        traj_losses, base = _step(chunks, trajs, False)
        what = f"PP=2 VPP={vpp} rank {rank}"
        last = ps.is_pipeline_last_stage(ignore_virtual=True)
        assert len(tree_losses) == len(traj_losses) == (M if last else 0), what
        for a, b in zip(tree_losses, traj_losses):
            assert verify.rel_diff(torch.tensor(a), torch.tensor(b)) < TOL, f"{what}: loss {a} vs {b}"
        assert tree.keys() == base.keys()
        # every local parameter got a gradient (hidden states and their gradients crossed the stages)
        assert all(float(g.abs().max()) > 0 for g in base.values()), f"{what}: zero gradients"
        errs = {n: verify.rel_diff(tree[n], base[n]) for n in base}
        bad = {n: e for n, e in errs.items() if e >= (DECAY_TOL if n.endswith(verify.DECAY_PARAMS) else TOL)}
        assert not bad, f"{what}: grad rel errs {bad}"
        # the tree-packed microbatches really are compressed and of varying length
        lens = {mb.pack.num_tokens for mb in build_step(trajs, dp_size=1, dp_rank=0, num_microbatches=M,
                                                          chunk_size=C)}
        assert len(lens) > 1


def _pp2_vpp2(rank):
    _pp2(rank, vpp=2)


def _worker(rank, world, port, fn_name):
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port))
    torch.set_num_threads(1)
    globals()[fn_name](rank)


@pytest.mark.skipif(os.environ.get("HARTS_SKIP_DIST_TESTS") == "1", reason="HARTS_SKIP_DIST_TESTS=1")
@pytest.mark.parametrize("fn", ["_pp2", "_pp2_vpp2"], ids=["1f1b", "interleaved"])
def test_pp2_tree_equals_trajectory_wise(fn):
    torch.multiprocessing.spawn(_worker, args=(2, _free_port(), fn), nprocs=2, join=True)


@pytest.mark.parametrize("argv", [BASE, ["--tree-trajectories", "x.jsonl"]], ids=["tree-packing", "thd-baseline"])
def test_args_pp_sets_variable_seq_lengths(argv):
    """Megatron's validate_args sets variable_seq_lengths False; packs differ in length, so stages
    must exchange shapes. Without experts the (unused) dispatcher becomes alltoall, which Megatron's
    config requires with variable lengths; with experts alltoall must be asked for (next test)."""
    pp = ["--pipeline-model-parallel-size", "2", "--hybrid-layer-pattern", "G*|-G"]
    args = _megatron_args(argv + pp)
    args.variable_seq_lengths = False                      # what Megatron's validate_args sets
    validate_tree_packing_args(args)
    assert args.variable_seq_lengths and args.moe_token_dispatcher_type == "alltoall"
    moe = _megatron_args(argv + pp + ["--num-experts", "4", "--moe-token-dispatcher-type", "alltoall"])
    validate_tree_packing_args(moe)
    assert moe.variable_seq_lengths
    no_pp = _megatron_args(argv + ["--hybrid-layer-pattern", "G*-G"])
    no_pp.variable_seq_lengths = False
    validate_tree_packing_args(no_pp)
    assert not no_pp.variable_seq_lengths and no_pp.moe_token_dispatcher_type == "allgather"


def test_args_pp_moe_needs_alltoall():
    args = _megatron_args(BASE + ["--pipeline-model-parallel-size", "2", "--num-experts", "4"])
    with pytest.raises(TreePackingArgumentError, match="needs --moe-token-dispatcher-type alltoall"):
        validate_tree_packing_args(args)
