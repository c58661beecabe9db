"""``TreeMoETransformerLayer``: the ``E`` layer that hands the tree pack to its router."""
from __future__ import annotations

from megatron.core.transformer.transformer_layer import MoETransformerLayer

from ..megatron.packed_seq import TreePackedSeqParams
from .dispatch import use_counts_once_dispatcher
from .router import TreeTopKRouter


class TreeMoETransformerLayer(MoETransformerLayer):
    """``MoETransformerLayer`` that, for a ``TreePackedSeqParams``, runs its MLP part inside
    ``self.mlp.router.tree_routing(pack)`` (multiplicity-weighted router losses and statistics).

    The pack is passed explicitly from the layer's own ``packed_seq_params`` argument, so full-layer
    activation recomputation (``recompute_granularity="full"``), which re-runs ``forward`` with the
    same arguments, re-enters the block. Selective recomputation of the MoE/MLP module alone would
    re-run the router outside it, and is refused for tree packs, as are partial CUDA graphs.

    Its allgather token dispatcher is :class:`~megatron_harts.moe.dispatch.CountsOnceAllGatherDispatcher`
    (one device->host copy per layer, none with grouped experts under tree routing;
    ``dispatcher_backend = "reference"``: Megatron's), for tree packs and trajectory-wise packs alike.
    """

    dispatcher_backend = "fast"

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        if hasattr(self.mlp, "token_dispatcher"):
            use_counts_once_dispatcher(self.mlp, self.dispatcher_backend)

    def _forward_mlp(self, hidden_states, inference_context=None, padding_mask=None, packed_seq_params=None):
        if not isinstance(packed_seq_params, TreePackedSeqParams):
            return super()._forward_mlp(hidden_states, inference_context, padding_mask=padding_mask,
                                        packed_seq_params=packed_seq_params)
        router = getattr(self.mlp, "router", None)
        if not isinstance(router, TreeTopKRouter):
            raise TypeError(f"tree packs need a TreeTopKRouter in MoE layers, got {type(router).__name__} "
                            "(use megatron_harts.megatron.tree_hybrid_stack_spec / treeify)")
        if self.recompute_mlp or getattr(self.mlp, "moe_layer_recompute", False) or self.use_partial_cudagraphs:
            raise NotImplementedError("tree packs: selective MoE/MLP recomputation and partial CUDA graphs of "
                                      "MoE layers are not supported (use recompute_granularity='full')")
        if getattr(packed_seq_params, "tokens_per_sample", None) is not None:
            raise ValueError("tree packs: packed_seq_params.tokens_per_sample must be None")
        with router.tree_routing(packed_seq_params.tree_pack):
            return super()._forward_mlp(hidden_states, inference_context, padding_mask=padding_mask,
                                        packed_seq_params=packed_seq_params)
