"""Belayer: fault tolerance of agentic rollouts (engine workers and environments).

* :mod:`.engine`: a token log of every request as it streams, resumable requests
  (:class:`ResumableEngine`: a failed worker's request continues from prompt + generated tokens),
  shadow workers kept at the current weights and a :class:`Supervisor` that detects failures and
  promotes a shadow;
* :mod:`.env`: environment checkpoint / restore over the overlayfs sandboxes
  (:class:`CheckpointedEnv`: incremental file-system checkpoints, runtime state by replay of the
  logged actions) and prefix consistency with the model's context (:class:`BelayerAgentLoop` cuts
  a trajectory back to the turn its environment was restored to);
* :mod:`.journal`: a write-ahead journal of every episode at its turn boundaries
  (``BelayerAgentLoop(journal=DIR)``) from which a new process resumes a rollout after the client
  process crashed (``rollout(..., resume=True)``);
* :mod:`.faults`: fault injection (SIGKILL of engine servers and sandbox commands, hung and
  garbage-printing tools, lost sandboxes) and the checker (every trajectory replayed in a fresh
  environment, compared with a fault-free rollout);
* :mod:`.keeper`: a weight keeper process (:class:`Keeper`) that owns the current weights (CUDA
  memory shareable by CUDA IPC, or CPU shared memory), survives a worker's death and re-arms a
  replacement started without reading the checkpoint.

See docs/belayer.md.
"""
from .engine import FailoverEvent, RequestRecord, ResumableEngine, Segment, Supervisor, TokenLog, Worker

_KEEPER_NAMES = ("Keeper", "KeeperError", "StaleWeights", "start_keeper")


def __getattr__(name):        # lazy: `python -m ...belayer.keeper` must not import keeper twice
    if name in _KEEPER_NAMES:
        from . import keeper
        return getattr(keeper, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = ["FailoverEvent", "Keeper", "KeeperError", "RequestRecord", "ResumableEngine", "Segment", "StaleWeights",
           "Supervisor", "TokenLog", "Worker", "start_keeper"]
