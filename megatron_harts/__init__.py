"""HARTS: hybrid-attention RL over rollout trees (Megatron-Core plugin)."""
__version__ = "0.1.0"
