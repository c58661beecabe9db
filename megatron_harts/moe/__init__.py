"""MoE under tree packing: multiplicity-weighted router objectives and statistics.

* :class:`TreeTopKRouter` (``router.py``): ``TopKRouter`` whose aux losses (``aux_loss``,
  ``seq_aux_loss``, ``global_aux_loss``), z-loss, expert-bias token counts and load statistics weight
  each compact token by its multiplicity, so they equal trajectory-wise training of the microbatch.
* :class:`TreeMoETransformerLayer` (``layer.py``): the ``E`` layer that passes its
  ``TreePackedSeqParams.tree_pack`` to the router (a scoped ``router.tree_routing(pack)`` block).
* :func:`treeify_moe`: swaps both into an ``E`` layer spec (called by
  ``megatron_harts.megatron.specs.treeify``).
"""
from __future__ import annotations

import dataclasses
from functools import partial

from .layer import TreeMoETransformerLayer
from .router import SEQ_AUX_SEQUENCES, TreeTopKRouter, check_tree_moe_config


def treeify_moe(moe_layer_spec, seq_aux_loss_sequence: str = "trajectory"):
    """In place: ``moe_layer_spec.module`` -> :class:`TreeMoETransformerLayer` and the router of its
    MoE ``mlp`` (a ``partial(MoELayer, submodules=MoESubmodules(...))`` or a ``ModuleSpec``) ->
    :class:`TreeTopKRouter` (``seq_aux_loss_sequence``: see ``router.py``). Returns the spec."""
    if seq_aux_loss_sequence not in SEQ_AUX_SEQUENCES:
        raise ValueError(f"seq_aux_loss_sequence must be one of {SEQ_AUX_SEQUENCES}")
    router = TreeTopKRouter if seq_aux_loss_sequence == "trajectory" else partial(
        TreeTopKRouter, seq_aux_loss_sequence=seq_aux_loss_sequence)
    moe_layer_spec.module = TreeMoETransformerLayer
    layer_subs = moe_layer_spec.submodules
    mlp = layer_subs.mlp
    if isinstance(mlp, partial):
        subs = dataclasses.replace(mlp.keywords["submodules"], router=router)
        layer_subs.mlp = partial(mlp.func, *mlp.args, **{**mlp.keywords, "submodules": subs})
    else:  # ModuleSpec(module=MoELayer, submodules=MoESubmodules(...))
        mlp.submodules = dataclasses.replace(mlp.submodules, router=router)
    return moe_layer_spec


__all__ = ["TreeMoETransformerLayer", "TreeTopKRouter", "check_tree_moe_config", "treeify_moe"]
