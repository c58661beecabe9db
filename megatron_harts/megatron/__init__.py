"""Megatron-Core integration: tree-packed params, tree-aware layers and specs, CPU shim.

Importing this package imports megatron.core but patches nothing (see ``cpu_shim``).
"""
from .layers import TreeCoreAttention, TreeGatedDeltaNet, TreeHybridStack, attention_backend, precompile_tree_attention
from .packed_seq import TreePackedSeqParams, tree_packed_seq_params
from .specs import tree_hybrid_stack_spec, tree_te_hybrid_stack_spec, treeify

__all__ = ["TreeCoreAttention", "attention_backend", "precompile_tree_attention", "TreeGatedDeltaNet", "TreeHybridStack", "TreePackedSeqParams",
           "tree_hybrid_stack_spec", "tree_packed_seq_params", "tree_te_hybrid_stack_spec", "treeify"]
