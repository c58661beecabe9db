"""RL objectives on per-trajectory tensors; independent of how the batch was packed."""
from .batch import RLBatch
from .objectives import KL_ESTIMATORS, LOSS_AGG_MODES, LOSS_TYPES, aggregate, kl_penalty, policy_loss

__all__ = ["KL_ESTIMATORS", "LOSS_AGG_MODES", "LOSS_TYPES", "RLBatch", "aggregate", "kl_penalty", "policy_loss"]
