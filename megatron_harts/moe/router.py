"""Multiplicity-weighted top-k routing for tree packs (docs/design.md#9-moe).

Under tree packing a compact token ``u`` stands for ``multiplicity(u)`` trajectory tokens with the
same hidden state, so with deterministic, no-drop top-k routing it gets the same logits, scores
and experts in every trajectory through it. :class:`TreeTopKRouter` therefore computes every
router objective and statistic of the trajectory-wise microbatch from the compact tokens, with
token ``u`` weighted by ``w(u) = multiplicity(u)`` and token counts = sums of multiplicities:

* ``aux_loss``: ``tokens_per_expert[e] = sum_u w(u) routing(u, e)`` (all-reduced over TP x CP as
  in Megatron), ``sum_u w(u) scores(u, e)``, ``T = sum_u w(u)``;
* ``global_aux_loss``: the same over TP x DP x CP, accumulated in ``global_tokens_per_expert``;
* ``seq_aux_loss``: see ``seq_aux_loss_sequence`` below;
* z-loss: ``coeff * sum_u w(u) logsumexp(u)^2 / sum_u w(u)``;
* expert bias (aux-loss-free balancing): ``local_tokens_per_expert += sum_u w(u) routing(u, :)``,
  which ``finalize_model_grads._update_router_expert_bias`` turns into the bias update;
* logged statistics: the aux losses / z-loss go to Megatron's MoE metrics tracker as usual, and
  :attr:`TreeTopKRouter.tree_tokens_per_expert` holds the weighted ``[E]`` load of the last tree
  microbatch (this rank's tokens). The token dispatcher's own ``tokens_per_expert`` stays the
  compact count: it sizes real expert work.

``seq_aux_loss_sequence`` (constructor argument, set through the spec with ``functools.partial``):

* ``"trajectory"`` (default): a sequence is a trajectory. With ``P_i[e] = sum_{t in i} scores(t,
  e)`` and ``f_i[e] = sum_{t in i} routing(t, e)`` over the ``L_i`` tokens of trajectory i (a compact
  token counts once in every trajectory through it: a sparse ``[n, T]`` membership matrix built from
  ``pack.traj_index``), ``loss = coeff * E / (topk * n) * sum_i sum_e P_i[e] f_i[e] / L_i^2``, the
  mean of Megatron's per-sequence loss over the microbatch's n trajectories (what Megatron computes
  for n samples of equal length as ``[S, n]``, and for one trajectory alone).
* ``"microbatch"``: what stock Megatron computes for THD-packed trajectories: ``HybridModel`` sees
  ``[T, 1, h]`` (``bsz = 1``; ``TransformerLayer._maybe_unflatten_for_moe`` only unflattens
  fixed-length ``tokens_per_sample`` batches), so the whole packed microbatch is one "sequence" and
  the loss is the ``aux_loss`` formula with the ``seq_aux_loss`` coefficient.

Tree mode is active only inside :meth:`TreeTopKRouter.tree_routing` (entered by
:class:`~megatron_harts.moe.layer.TreeMoETransformerLayer` for a ``TreePackedSeqParams``);
otherwise the router is a plain ``TopKRouter``. Sequence parallelism: the router sees its
``[T / tp]`` slice of the compact tokens and weights them by the same slice of the
multiplicities; normalisers use the microbatch's trajectory-token count ``W`` so that the sum over
TP ranks equals the trajectory-wise value exactly (as it does in Megatron for equal slices).
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Iterator, Optional

import torch
from megatron.core.tensor_parallel.mappings import reduce_from_tensor_model_parallel_region
from megatron.core.transformer.moe.moe_logging import get_moe_metrics_tracker
from megatron.core.transformer.moe.moe_utils import (
    MoEAuxLossAutoScaler,
    compute_routing_scores_for_aux_loss,
    switch_load_balancing_loss_func,
    topk_routing_with_score_function,
)
from megatron.core.transformer.moe.router import TopKRouter

from ..packing import TreePack

SEQ_AUX_SEQUENCES = ("trajectory", "microbatch")
_TREE_LOAD_BALANCING_TYPES = ("aux_loss", "seq_aux_loss", "global_aux_loss", "none")


def check_tree_moe_config(config) -> None:
    """Raise if ``config`` routes in a way that is not a deterministic, no-drop function of each
    token (then a compact token cannot stand for its ``multiplicity`` trajectory tokens)."""
    if config.moe_expert_capacity_factor is not None or config.moe_pad_expert_input_to_capacity:
        raise ValueError(
            "tree packing requires no-drop MoE routing: moe_expert_capacity_factor must be None and "
            "moe_pad_expert_input_to_capacity False (token dropping depends on which tokens share a "
            f"microbatch; got capacity_factor={config.moe_expert_capacity_factor}, "
            f"pad_to_capacity={config.moe_pad_expert_input_to_capacity})")
    types = config.moe_router_load_balancing_type
    for t in [types] if isinstance(types, str) else list(types):
        if t not in _TREE_LOAD_BALANCING_TYPES:
            raise NotImplementedError(
                f"tree packing: moe_router_load_balancing_type {t!r} is not supported (only "
                f"{_TREE_LOAD_BALANCING_TYPES}): its routing depends on the whole token batch")
    if config.moe_input_jitter_eps is not None or config.moe_router_force_load_balancing:
        raise ValueError("tree packing requires deterministic routing: moe_input_jitter_eps / "
                         "moe_router_force_load_balancing draw random noise per token copy")


@dataclass
class _TreeWeights:
    w: torch.Tensor          # [s] fp32 multiplicities of this rank's compact tokens
    total: torch.Tensor      # 0-d fp32: W = trajectory tokens of the whole microbatch
    shards: int              # T / s (tp under sequence parallelism, else 1)
    lo: int                  # first compact token of this rank's slice
    pack: TreePack


def _traj_membership(pack: TreePack, lo: int, hi: int, device: torch.device):
    """Sparse ``[n, hi - lo]`` fp32 matrix, entry (i, u - lo) = 1 for every token u of trajectory i
    in ``[lo, hi)`` (``pack.traj_index``), and the trajectory lengths ``[n]`` fp32. Cached."""
    def build():
        idx = pack.traj_index.to(device)
        lengths = pack.trajectory_lengths.to(device)
        traj = torch.repeat_interleave(torch.arange(lengths.shape[0], device=device), lengths)
        keep = (idx >= lo) & (idx < hi)
        m = torch.sparse_coo_tensor(torch.stack([traj[keep], idx[keep] - lo]),
                                    torch.ones(int(keep.sum()), device=device),
                                    (lengths.shape[0], hi - lo)).coalesce()
        return m, lengths.float()
    return pack.cached(("moe_traj_membership", lo, hi, str(device)), build)


class TreeTopKRouter(TopKRouter):
    """``TopKRouter`` whose objectives and statistics are multiplicity-weighted for tree packs
    (module docstring). Outside :meth:`tree_routing` it is exactly ``TopKRouter``."""

    def __init__(self, *args, seq_aux_loss_sequence: str = "trajectory", **kwargs):
        super().__init__(*args, **kwargs)
        if seq_aux_loss_sequence not in SEQ_AUX_SEQUENCES:
            raise ValueError(f"seq_aux_loss_sequence must be one of {SEQ_AUX_SEQUENCES}, got "
                             f"{seq_aux_loss_sequence!r}")
        self.seq_aux_loss_sequence = seq_aux_loss_sequence
        self._tree_pack: Optional[TreePack] = None
        self.tree_tokens_per_expert: Optional[torch.Tensor] = None

    @contextlib.contextmanager
    def tree_routing(self, pack: TreePack) -> Iterator[None]:
        """Route the compact tokens of ``pack`` (this router's input is ``[T, 1, h]``, or its
        sequence-parallel slice) with multiplicity weights inside the block."""
        check_tree_moe_config(self.config)
        prev, self._tree_pack = self._tree_pack, pack
        try:
            yield
        finally:
            self._tree_pack = prev

    # ------------------------------------------------------------------------------------------

    def _tree_weights(self, pack: TreePack, s: int, device) -> _TreeWeights:
        T = pack.num_tokens
        if s == T:
            lo, shards = 0, 1
        elif self.config.sequence_parallel and s * self.tp_group.size() == T:
            lo, shards = self.tp_group.rank() * s, self.tp_group.size()
        else:
            raise ValueError(f"tree MoE router: got {s} tokens for a pack of {T} compact tokens "
                             f"(sequence_parallel={self.config.sequence_parallel}, "
                             f"tp={self.tp_group.size()}); replay/padding tokens must not enter MoE")
        w_full = pack.cached(("moe_multiplicity", str(device)),
                             lambda: pack.multiplicity.to(device=device, dtype=torch.float32))
        return _TreeWeights(w=w_full[lo:lo + s], total=w_full.sum(), shards=shards, lo=lo, pack=pack)

    def _layer_number_for_logging(self):
        num_layers = self.config.num_layers + (self.config.mtp_num_layers or 0)
        layer_number = self.layer_number + self.config.num_layers if self.is_mtp_layer else self.layer_number
        return layer_number, num_layers

    def _tree_z_loss(self, logits: torch.Tensor, tw: _TreeWeights) -> torch.Tensor:
        """Weighted z-loss: ``coeff * sum_u w(u) lse(u)^2 / W`` summed over the TP x CP slices
        (Megatron: per-slice mean times ``coeff / tp_cp``)."""
        if self.config.moe_z_loss_coeff is None or not (self.training and torch.is_grad_enabled()):
            return logits
        coeff = self.config.moe_z_loss_coeff / self.tp_cp_group.size()
        local_count = tw.total / tw.shards       # Megatron's per-slice token count, trajectory-wise
        z_loss = (torch.logsumexp(logits, dim=-1).square() * tw.w).sum() / local_count * coeff
        scale = local_count * self.tp_cp_group.size() if self.calculate_per_token_loss else 1.0
        logits = MoEAuxLossAutoScaler.apply(logits, z_loss * scale)
        if self.is_mtp_layer and self.config.mtp_use_repeated_layer and self.config.mtp_num_layers is not None:
            z_loss = z_loss / self.config.mtp_num_layers
        layer_number, num_layers = self._layer_number_for_logging()
        get_moe_metrics_tracker().record("z_loss", z_loss / coeff, layer_number, num_layers,
                                         avg_group=self.tp_dp_cp_group)
        return logits

    def _weighted_load(self, routing_map: torch.Tensor, tw: _TreeWeights, group) -> torch.Tensor:
        """``sum_u w(u) routing(u, :)`` all-reduced over ``group`` (``[E]`` fp32)."""
        local = (routing_map.float() * tw.w[:, None]).sum(0)
        return reduce_from_tensor_model_parallel_region(local, group)

    def _tree_switch_loss(self, probs, scores, routing_map, tw, loss_type, name, group, needs_dp_avg=True):
        coeff = self.get_aux_loss_coeff(loss_type)
        if coeff == 0:
            return probs
        tpe = self._weighted_load(routing_map, tw, group)
        # Megatron (no padding mask): total = local slice count * group size.
        total = tw.total / tw.shards * group.size()
        if loss_type == "global_aux_loss":
            self.global_tokens_per_expert += tpe
            self.ga_steps += 1
            tpe = self.global_tokens_per_expert / self.ga_steps
        loss = switch_load_balancing_loss_func(
            probs=scores * tw.w[:, None], tokens_per_expert=tpe, total_num_tokens=total, topk=self.topk,
            num_experts=self.config.num_moe_experts, moe_aux_loss_coeff=coeff,
            fused=self.config.moe_router_fusion)
        return self.attach_and_log_load_balancing_loss(probs, coeff, loss, name, group, needs_dp_avg=needs_dp_avg,
                                                       valid_token_count=tw.total / tw.shards)

    def _tree_seq_aux_loss(self, probs, scores, routing_map, tw: _TreeWeights):
        coeff = self.get_aux_loss_coeff("seq_aux_loss")
        if coeff == 0:
            return probs
        if self.seq_aux_loss_sequence == "microbatch":
            return self._tree_switch_loss(probs, scores, routing_map, tw, "seq_aux_loss",
                                          "seq_load_balancing_loss", self.tp_cp_group)
        m, lengths = _traj_membership(tw.pack, tw.lo, tw.lo + scores.shape[0], scores.device)
        p = torch.sparse.mm(m, scores.float())                                           # [n, E]
        f = reduce_from_tensor_model_parallel_region(torch.sparse.mm(m, routing_map.float()), self.tp_cp_group)
        per_traj = (p * f).sum(-1) / lengths.clamp(min=1).square()
        loss = per_traj.mean() * (self.config.num_moe_experts * coeff / self.topk)
        return self.attach_and_log_load_balancing_loss(probs, coeff, loss, "seq_load_balancing_loss",
                                                       self.tp_cp_group, valid_token_count=tw.total / tw.shards)

    def routing(self, logits: torch.Tensor, padding_mask: Optional[torch.Tensor] = None):
        """``TopKRouter.routing`` with multiplicity weights inside :meth:`tree_routing`."""
        pack = self._tree_pack
        if pack is None:
            return super().routing(logits, padding_mask=padding_mask)
        seq_length, bsz = logits.shape[:2]
        if bsz != 1:
            raise ValueError(f"tree MoE router expects [T, 1, E] logits, got {tuple(logits.shape)}")
        if padding_mask is not None and bool(padding_mask.any()):
            raise NotImplementedError("tree MoE router: tree packs have no padding tokens")
        check_tree_moe_config(self.config)
        logits = logits.view(-1, self.config.num_moe_experts)
        tw = self._tree_weights(pack, logits.shape[0], logits.device)

        logits = self._tree_z_loss(logits, tw)
        probs, routing_map = topk_routing_with_score_function(
            logits, self.topk, use_pre_softmax=self.config.moe_router_pre_softmax,
            num_groups=self.config.moe_router_num_groups, group_topk=self.config.moe_router_group_topk,
            scaling_factor=self.config.moe_router_topk_scaling_factor, score_function=self.score_function,
            expert_bias=self.expert_bias, fused=self.config.moe_router_fusion, router_replay=self.router_replay)

        if self.training and torch.is_grad_enabled() and self.is_aux_loss_enabled():
            aux_map, aux_scores = compute_routing_scores_for_aux_loss(
                logits, self.topk, self.score_function, fused=self.config.moe_router_fusion)
            probs = self._tree_switch_loss(probs, aux_scores, aux_map, tw, "aux_loss", "load_balancing_loss",
                                           self.tp_cp_group)
            probs = self._tree_seq_aux_loss(probs, aux_scores, aux_map, tw)
            probs = self._tree_switch_loss(probs, aux_scores, aux_map, tw, "global_aux_loss",
                                           "global_load_balancing_loss", self.tp_dp_cp_group, needs_dp_avg=False)

        accumulate = self.enable_expert_bias and torch.is_grad_enabled()  # as TopKRouter._apply_expert_bias
        with torch.no_grad():
            load = (routing_map.float() * tw.w[:, None]).sum(0)
            self.tree_tokens_per_expert = load
            if accumulate:
                self.local_tokens_per_expert += load
        return probs, routing_map
