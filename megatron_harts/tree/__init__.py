"""Rollout trees: trajectories, validation, token trie, JSONL I/O."""
from .io import read_jsonl, write_jsonl
from .rollout_tree import RolloutTree, trees_from_trajectories
from .trajectory import Trajectory, TreeValidationError, make_trajectory
from .trie import Trie, build_trie

__all__ = ["RolloutTree", "Trajectory", "TreeValidationError", "Trie", "build_trie", "make_trajectory",
           "read_jsonl", "trees_from_trajectories", "write_jsonl"]
