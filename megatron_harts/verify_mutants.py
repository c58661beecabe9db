"""Broken tree packs: a self-test of the checker in ``megatron_harts.verify`` (``--mutant NAME``).

A mutant takes the tree-side pack of a ``verify`` run (already on its device) and returns a copy
whose derived plans are wrong in one way that the layers cannot tell from a correct pack: the
plan the layers read from the pack's cache is swapped for one built from wrong inputs. The layers
run unchanged, the baseline (THD) pack never passes through a mutant, and nothing outside
``verify`` imports this module. ``verify --mutant NAME`` must exit 1; the margin it reports
(difference over gate, > 1) says by how much the gate rejected the broken tree.

* ``sibling_visible``: the ancestor mask lets the first token of every later sibling branch see
  the first token of the previous sibling (``subtree_end`` of that token widened by one, in the
  attention mask only: the SDPA mask on CPU, the FlexAttention block mask on CUDA). Needs ``*``.
* ``state_handoff_dropped``: every linear-attention sequence that starts from a state handed over
  at a branch (all sequences of chunk-plan rounds > 0) starts from the zero state instead: the
  rounds are merged into one round without initial states. Needs ``G`` or ``M``.
* ``position_off_by_one``: the RoPE position of every token below a branch point is one too large
  (kept below the longest trajectory's length, the size of the rotary table); the chunk plan is
  built from the true positions first. Needs ``*``.
* ``moe_multiplicity_ignored``: the MoE router weights every compact token by 1 instead of its
  multiplicity (aux losses, z-loss and expert-bias counts count compact tokens). Needs ``E``.

:func:`apply` also returns what the mutant touched in this pack (``exercised``; 0 means the
workload cannot show the mutant: ``verify`` then refuses to run it) and :func:`branch_coverage`
where the pack's branch points fall relative to chunk boundaries.
"""
from __future__ import annotations

import dataclasses
from typing import Callable

import numpy as np
import torch

from .ops.attention import ancestor_mask, block_mask
from .ops.plan import ChunkPlan, ChunkRound, chunk_plan
from .packing import TreePack


@dataclasses.dataclass(frozen=True)
class Mutant:
    name: str
    layers: str          # the pattern needs one of these layer symbols for the mutant to matter
    doc: str
    fn: Callable[[TreePack], tuple[TreePack, int]]


def _copy(pack: TreePack, **fields) -> TreePack:
    """A shallow copy with its own cache dict (the original pack is left as it was)."""
    return dataclasses.replace(pack, **fields, _cache=dict(pack._cache))


def _swap_built(pack: TreePack, build: Callable[[TreePack], object], wrong_of: Callable[[object], object]):
    """Run ``build(pack)`` (which caches its result on ``pack``), then replace the cache entries it
    added whose value is its result by ``wrong_of(result)``; check that ``build`` now returns them."""
    before = set(pack._cache)
    right = build(pack)
    keys = [k for k in set(pack._cache) - before if pack._cache[k] is right]
    if not keys:
        raise RuntimeError(f"{getattr(build, '__name__', build)} does not cache its result on the pack; "
                           "the mutant cannot be injected")
    wrong = wrong_of(right)
    for k in keys:
        pack._cache[k] = wrong
    if build(pack) is not wrong:
        raise RuntimeError(f"mutant not picked up by {getattr(build, '__name__', build)}")
    return right, wrong


def _children(pack: TreePack) -> np.ndarray:
    parent = pack.parent.cpu().numpy()
    return np.bincount(parent[parent >= 0], minlength=pack.num_tokens)


def sibling_visible(pack: TreePack, masks: tuple[str, ...] | None = None) -> tuple[TreePack, int]:
    """``masks``: which attention masks to widen, ``dense`` (:func:`ancestor_mask`, the SDPA path)
    and / or ``block`` (:func:`block_mask`, FlexAttention); default: the one that ``backend="auto"``
    uses on the pack's device."""
    masks = masks or (("block",) if pack.device.type == "cuda" else ("dense",))
    parent, end = pack.parent, pack.subtree_end
    T = pack.num_tokens
    s = torch.nonzero(parent >= 0).flatten()
    nxt = end[s]
    s, nxt = s[nxt < T], nxt[nxt < T]
    s = s[parent[nxt] == parent[s]]               # s has a next sibling, starting at subtree_end[s]
    wide = end.clone()
    wide[s] += 1                                  # ... which now sees s
    wrong = dataclasses.replace(pack, subtree_end=wide, _cache={})
    out = _copy(pack)
    if "block" in masks:
        _swap_built(out, block_mask, lambda _: block_mask(wrong))
    if "dense" in masks:
        _swap_built(out, ancestor_mask, lambda _: ancestor_mask(wrong))
    return out, int(s.numel())


def _one_round(plan: ChunkPlan) -> ChunkPlan:
    """``plan`` with all rounds merged into round 0 (no initial states), same layout order."""
    rounds, cu_cpu, keep, off = plan.rounds, [plan.rounds[0].cu_seqlens_cpu], [], 0
    for r, rd in enumerate(rounds):
        if r:
            cu_cpu.append(rd.cu_seqlens_cpu[1:] + off)
        keep.append(rd.keep + off)
        off += int(rd.cu_seqlens_cpu[-1])
    cu_cpu = torch.cat(cu_cpu)
    merged = ChunkRound(gather=torch.cat([rd.gather for rd in rounds]), cu_seqlens=cu_cpu.to(plan.gather_all.device),
                        cu_seqlens_cpu=cu_cpu, init_from=None, keep=torch.cat(keep))
    return dataclasses.replace(plan, rounds=[merged], round_sizes=[off])


def state_handoff_dropped(pack: TreePack) -> tuple[TreePack, int]:
    out = _copy(pack)
    plan, _ = _swap_built(out, lambda p: chunk_plan(p, pack.chunk_size), _one_round)
    return out, sum(len(rd.cu_seqlens_cpu) - 1 for rd in plan.rounds[1:])


def _below_branch(pack: TreePack) -> np.ndarray:
    """bool ``[T]``: tokens with a branch point (>= 2 children) among their strict ancestors."""
    T = pack.num_tokens
    br = np.flatnonzero(_children(pack) >= 2)
    diff = np.zeros(T + 1, dtype=np.int64)
    np.add.at(diff, br + 1, 1)
    np.add.at(diff, pack.subtree_end.cpu().numpy()[br], -1)
    return np.cumsum(diff[:T]) > 0


def position_off_by_one(pack: TreePack) -> tuple[TreePack, int]:
    out = _copy(pack)
    chunk_plan(out, pack.chunk_size)              # the chunk plan keeps the true positions
    pos = pack.position_ids.cpu().numpy()
    shift = _below_branch(pack) & (pos + 1 < int(pack.trajectory_lengths.max()))
    out.position_ids = pack.position_ids + torch.from_numpy(shift.astype(np.int64)).to(pack.device)
    return out, int(shift.sum())


def moe_multiplicity_ignored(pack: TreePack) -> tuple[TreePack, int]:
    from .moe.router import TreeTopKRouter

    out = _copy(pack)
    T = pack.num_tokens
    # The router's weights are built lazily (pack.cached) on its device when it first routes this
    # pack; build them here (T tokens: no sequence-parallel slice, so no router instance is read)
    # and replace the new [T] entry by ones.
    weights = lambda p: TreeTopKRouter._tree_weights(None, p, T, pack.device)
    before = set(out._cache)
    weights(out)
    keys = [k for k in set(out._cache) - before
            if isinstance(out._cache[k], torch.Tensor) and out._cache[k].shape == (T,)]
    if len(keys) != 1:
        raise RuntimeError("TreeTopKRouter._tree_weights does not cache one [T] weight tensor on the pack; "
                           "the mutant cannot be injected")
    out._cache[keys[0]] = torch.ones_like(out._cache[keys[0]])
    tw = weights(out)
    if not (bool((tw.w == 1).all()) and float(tw.total) == T):
        raise RuntimeError("mutant not picked up by TreeTopKRouter._tree_weights")
    return out, int((pack.multiplicity > 1).sum())


MUTANTS = {m.name: m for m in (
    Mutant("sibling_visible", "*", "the first token of each later sibling branch sees the first token of the "
           "previous sibling (attention mask)", sibling_visible),
    Mutant("state_handoff_dropped", "GM", "linear-attention sequences after a branch start from the zero state "
           "instead of the handed-over state (chunk plan)", state_handoff_dropped),
    Mutant("position_off_by_one", "*", "RoPE positions one too large below every branch point", position_off_by_one),
    Mutant("moe_multiplicity_ignored", "E", "MoE router objectives weight compact tokens by 1, not by their "
           "multiplicity", moe_multiplicity_ignored),
)}


def apply(name: str, pack: TreePack) -> tuple[TreePack, int]:
    """``(mutated copy of pack, number of tokens / sequences / sibling pairs the mutant changed)``."""
    return MUTANTS[name].fn(pack)


def branch_coverage(pack: TreePack, chunk_size: int | None = None) -> dict:
    """Where the branch points of ``pack`` fall for the chunk plan: ``branch_points`` (tokens with
    >= 2 children), ``at_chunk_boundary`` (at a chunk's last position: the children start new
    chunks), ``inside_chunk``; ``handoff_sequences`` (linear-attention sequences that start from a
    handed-over state), of which ``handoff_with_replay`` replay the shared start of their chunk (a
    branch inside that chunk)."""
    C = chunk_size or pack.chunk_size
    br = np.flatnonzero(_children(pack) >= 2)
    at_boundary = int((pack.position_ids.cpu().numpy()[br] % C == C - 1).sum())
    plan = chunk_plan(pack, C)
    handoffs = replayed = 0
    for rd in plan.rounds[1:]:
        cu = rd.cu_seqlens_cpu
        kept = torch.zeros(int(cu[-1]), dtype=torch.bool)
        kept[rd.keep.cpu()] = True
        handoffs += len(cu) - 1
        replayed += int((~kept[cu[:-1]]).sum())
    return dict(branch_points=int(br.size), at_chunk_boundary=at_boundary, inside_chunk=int(br.size) - at_boundary,
                handoff_sequences=handoffs, handoff_with_replay=replayed)
