"""Layer specs for tree-packed training of hybrid models (``HybridModel(hybrid_stack_spec=...)``).

Which spec to use:

* :func:`tree_hybrid_stack_spec` (this module): the local (non-TE) spec of
  ``cpu_shim.local_hybrid_stack_spec`` with the tree layers swapped in. Use it on CPU and on GPUs
  without Transformer Engine; tested on CPU (``tests/test_megatron_tree.py``).
* With TE installed, :func:`treeify` can be applied to Megatron's
  ``hybrid_layer_specs.hybrid_stack_spec`` in principle, but that is **not done or tested here**
  (no TE in this environment): TE's GDN spec fuses the input norm into ``in_proj``
  (``TELayerNormColumnParallelLinear``), which the tree GDN inherits unchanged, while the TE stack
  needs ``params={"final_norm": TENorm}`` on :class:`TreeHybridStack` and the non-tree fallback
  of :class:`TreeCoreAttention` is the local ``DotProductAttention``, not TE's.

Pattern symbols covered by the tree path: ``G`` (GDN), ``*`` (attention), ``-`` (MLP), ``E``
(MoE; multiplicity-weighted router, ``megatron_harts.moe``), ``M`` (Mamba2, ``mamba.TreeMambaMixer``).
"""
from __future__ import annotations

from typing import Optional

from megatron.core.transformer.spec_utils import ModuleSpec

from .cpu_shim import local_hybrid_stack_spec
from .layers import TreeCoreAttention, TreeGatedDeltaNet, TreeHybridStack
from .mamba import TreeMambaMixer


def treeify(spec: ModuleSpec) -> ModuleSpec:
    """Swap the tree layers into a ``HybridStack`` spec, in place: stack -> ``TreeHybridStack``,
    ``gdn_layer`` mixer -> ``TreeGatedDeltaNet``, ``attention_layer`` core attention ->
    ``TreeCoreAttention``, ``mamba_layer`` mixer -> ``TreeMambaMixer``, ``moe_layer`` (if any) ->
    ``megatron_harts.moe.treeify_moe``. Returns ``spec``."""
    subs = spec.submodules
    spec.module = TreeHybridStack
    subs.gdn_layer.submodules.self_attention.module = TreeGatedDeltaNet
    subs.attention_layer.submodules.self_attention.submodules.core_attention = TreeCoreAttention
    subs.mamba_layer.submodules.mixer.module = TreeMambaMixer
    if isinstance(subs.moe_layer, ModuleSpec):  # 'E': multiplicity-weighted router (megatron_harts.moe)
        from ..moe import treeify_moe
        treeify_moe(subs.moe_layer)
    return spec


def tree_hybrid_stack_spec(num_moe_experts: Optional[int] = None, qk_layernorm: bool = False) -> ModuleSpec:
    """Local (non-TE) hybrid stack spec with tree-aware ``G`` and ``*`` layers; arguments as
    ``cpu_shim.local_hybrid_stack_spec``."""
    return treeify(local_hybrid_stack_spec(num_moe_experts, qk_layernorm))
