"""Libra: rollout/training GPU planning under drift, elastic role switches, C-MLFQ request queues.

``costs`` (cost models fitted on the project's H200 measurements; an online, drift-aware length
estimator), ``planner`` (the rollout/training GPU split per step, synchronous and
bounded-staleness asynchronous RL, role-switch costs included), ``cmlfq`` (the causality-driven
multi-level feedback queue and its baselines: FCFS, shortest-predicted-first, program-level
least-attained-service), ``workload`` (synthetic long-tailed, drifting agentic traces), ``sim``
(the trace-driven discrete-event simulator: every number it produces is a simulation),
``pool`` (a real elastic pool of Ray actors: a trainer leaves the gloo data-parallel group,
serves rollouts with the embedded engine and comes back).

Only ``pool`` imports torch / Ray; the rest is numpy.
"""
