"""Belayer: fault tolerance of agentic rollouts (engine workers and environments).

* :mod:`.engine`: a token log of every request as it streams, resumable requests
  (:class:`ResumableEngine`: a failed worker's request continues from prompt + generated tokens),
  shadow workers kept at the current weights and a :class:`Supervisor` that detects failures and
  promotes a shadow;
* :mod:`.env`: environment checkpoint / restore over the overlayfs sandboxes
  (:class:`CheckpointedEnv`: incremental file-system checkpoints, runtime state by replay of the
  logged actions) and prefix consistency with the model's context (:class:`BelayerAgentLoop` cuts
  a trajectory back to the turn its environment was restored to);
* :mod:`.faults`: fault injection (SIGKILL of engine servers and sandbox commands, hung and
  garbage-printing tools, lost sandboxes) and the checker (every trajectory replayed in a fresh
  environment, compared with a fault-free rollout).

See docs/belayer.md.
"""
from .engine import FailoverEvent, RequestRecord, ResumableEngine, Segment, Supervisor, TokenLog, Worker

__all__ = ["FailoverEvent", "RequestRecord", "ResumableEngine", "Segment", "Supervisor", "TokenLog", "Worker"]
