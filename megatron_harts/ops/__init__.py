"""Tree-aware ops over the compact tokens of a TreePack; each has a torch reference backend
(CPU/GPU) and a fast GPU backend (fla / FlexAttention)."""
from .attention import tree_attention
from .conv import tree_causal_conv1d
from .linear_attention import tree_gated_delta_rule, tree_simple_gla
from .logprobs import node_logprobs, restore, tree_token_logprobs
from .plan import ChunkPlan, chunk_plan

__all__ = ["ChunkPlan", "chunk_plan", "node_logprobs", "restore", "tree_attention", "tree_causal_conv1d",
           "tree_gated_delta_rule", "tree_simple_gla", "tree_token_logprobs"]
