"""DP rank x microbatch x slot planning of rollout trees (DESIGN.md section 3, "Planning")."""
from .cost import CostModel
from .plan import Part, Plan, assign, plan
from .split import Parts, TreeStats, split_parts, tree_stats

__all__ = ["CostModel", "Part", "Parts", "Plan", "TreeStats", "assign", "plan", "split_parts", "tree_stats"]
