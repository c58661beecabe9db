"""Compact DFS layout of one microbatch of rollout trees."""
from .tree_pack import TreePack, pack, pack_trajectories

__all__ = ["TreePack", "pack", "pack_trajectories"]
