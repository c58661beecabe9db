"""Layer specs for tree-packed training of hybrid models (``HybridModel(hybrid_stack_spec=...)``).

Which spec to use:

* :func:`tree_hybrid_stack_spec` (this module): the local (non-TE) spec of
  ``cpu_shim.local_hybrid_stack_spec`` with the tree layers swapped in. Use it on CPU and on GPUs
  without Transformer Engine; tested on CPU (``tests/test_megatron_tree.py``).
* :func:`tree_te_hybrid_stack_spec`: Megatron's Transformer Engine spec
  (``hybrid_layer_specs.hybrid_stack_spec``: fused LayerNorm+Linear projections, ``TENorm``, TE
  grouped-GEMM MoE experts) with the same tree layers swapped in and ``TENorm`` as the final norm.
  Needs TE. Its structure is tested here; its numerics are **not** (neither the CPU machines nor
  the H200 image have TE): run ``python -m megatron_harts.verify --device cuda --spec te`` once on
  a TE machine before training with it. The tree core attention is the local one on both specs
  (``tree_attention``; for inputs that are not tree packs it falls back to the local
  ``DotProductAttention``, not TE's).

Pattern symbols covered by the tree path: ``G`` (GDN), ``*`` (attention), ``-`` (MLP), ``E``
(MoE; multiplicity-weighted router, ``megatron_harts.moe``), ``M`` (Mamba2, ``mamba.TreeMambaMixer``).
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Optional

from megatron.core.transformer.spec_utils import ModuleSpec

from .cpu_shim import local_hybrid_stack_spec
from .layers import ATTENTION_BACKENDS, TreeCoreAttention, TreeGatedDeltaNet, TreeHybridStack
from .mamba import TreeMambaMixer


def treeify(spec: ModuleSpec, attention_backend: str = "auto") -> ModuleSpec:
    """Swap the tree layers into a ``HybridStack`` spec, in place: stack -> ``TreeHybridStack``,
    ``gdn_layer`` mixer -> ``TreeGatedDeltaNet``, ``attention_layer`` core attention ->
    ``TreeCoreAttention`` (with ``tree_attention_backend=attention_backend``; Megatron calls the
    ``core_attention`` builder directly, so a non-default backend is bound with ``functools.partial``),
    ``mamba_layer`` mixer -> ``TreeMambaMixer``, ``moe_layer`` (if any) ->
    ``megatron_harts.moe.treeify_moe``. Returns ``spec``."""
    if attention_backend not in ATTENTION_BACKENDS:
        raise ValueError(f"attention_backend must be one of {ATTENTION_BACKENDS}, got {attention_backend!r}")
    subs = spec.submodules
    spec.module = TreeHybridStack
    subs.gdn_layer.submodules.self_attention.module = TreeGatedDeltaNet
    subs.attention_layer.submodules.self_attention.submodules.core_attention = (
        TreeCoreAttention if attention_backend == "auto"
        else functools.partial(TreeCoreAttention, tree_attention_backend=attention_backend))
    subs.mamba_layer.submodules.mixer.module = TreeMambaMixer
    if isinstance(subs.moe_layer, ModuleSpec):  # 'E': multiplicity-weighted router (megatron_harts.moe)
        from ..moe import treeify_moe
        treeify_moe(subs.moe_layer)
    return spec


def tree_hybrid_stack_spec(num_moe_experts: Optional[int] = None, qk_layernorm: bool = False,
                           attention_backend: str = "auto", grouped_experts: bool = False) -> ModuleSpec:
    """Local (non-TE) hybrid stack spec with tree-aware ``G`` and ``*`` layers; arguments as
    ``cpu_shim.local_hybrid_stack_spec`` and :func:`treeify`. ``grouped_experts``: MoE experts as
    Megatron's ``TEGroupedMLP`` on torch's grouped GEMM (``megatron_harts.moe.grouped``) instead of
    ``SequentialMLP``."""
    spec = treeify(local_hybrid_stack_spec(num_moe_experts, qk_layernorm), attention_backend)
    if grouped_experts and isinstance(spec.submodules.moe_layer, ModuleSpec):
        from ..moe.grouped import use_grouped_experts
        use_grouped_experts(spec.submodules.moe_layer)
    return spec


def _copy_spec(x):
    """Copy of a spec tree: new ``ModuleSpec`` / submodule dataclasses and params dicts, the same
    leaf classes and functions (``deepcopy`` cannot copy TE's placeholder classes)."""
    if isinstance(x, ModuleSpec):
        return dataclasses.replace(x, params=dict(x.params or {}), submodules=_copy_spec(x.submodules))
    if dataclasses.is_dataclass(x) and not isinstance(x, type):
        return dataclasses.replace(x, **{f.name: _copy_spec(getattr(x, f.name))
                                         for f in dataclasses.fields(x) if f.init})
    return x


def tree_te_hybrid_stack_spec(attention_backend: str = "auto") -> ModuleSpec:
    """Megatron's TE hybrid stack spec with the tree layers swapped in (a copy; Megatron's own spec
    is left alone) and ``TENorm`` as the stack's final norm. Raises ``ImportError`` without
    Transformer Engine."""
    from megatron.core.extensions import transformer_engine as te

    if not te.HAVE_TE:
        raise ImportError("tree_te_hybrid_stack_spec needs Transformer Engine, which is not installed; "
                          "use tree_hybrid_stack_spec() (local spec, --tree-spec local)")
    from megatron.core.models.hybrid.hybrid_layer_specs import hybrid_stack_spec

    spec = treeify(_copy_spec(hybrid_stack_spec), attention_backend)
    spec.params = {**(spec.params or {}), "final_norm": te.TENorm}
    return spec
