"""DP rank x microbatch x slot planning of rollout trees (docs/design.md#10-planner)."""
from .cost import CostModel
from .plan import Part, Plan, assign, plan
from .split import Parts, TreeStats, split_parts, tree_stats

__all__ = ["CostModel", "Part", "Parts", "Plan", "TreeStats", "assign", "plan", "split_parts", "tree_stats"]
