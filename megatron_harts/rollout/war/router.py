"""sglang-router 0.3.2 as a process (the scheduling anchor): ``python -m
sglang_router.launch_router --worker-urls ... --policy {cache_aware,round_robin,power_of_two}``.

The router needs ``/health``, ``/server_info`` and ``/model_info`` from its workers at startup
(observed with 0.3.2; the embedded server and SGLang serve all three) and forwards ``/generate``
bodies (token ids included) to the worker its policy picks. The agent loop then sees one
:class:`~megatron_harts.rollout.engines.HttpEngine` (the router's URL). The router answers ``/health``
before it has registered its workers (it adds them in the background): :meth:`RouterServer.start` also
waits until ``GET /workers`` lists every worker healthy (requests sent right away all went to the
first ones: [1, 1, 4] of 6 under round_robin).
"""
from __future__ import annotations

import json
import sys
import urllib.error
import urllib.request
from typing import Sequence

from ..engines.launch import _ServerProcess, free_port

POLICIES = ("cache_aware", "round_robin", "power_of_two", "random")


class RouterServer(_ServerProcess):
    """sglang-router in front of ``worker_urls`` with ``policy``; ``extra_args`` verbatim."""

    kind = "sglang-router"

    def __init__(self, worker_urls: Sequence[str], policy: str = "cache_aware", *, extra_args: Sequence[str] = (),
                 **kw):
        if policy not in POLICIES:
            raise ValueError(f"policy must be one of {POLICIES}, got {policy!r}")
        if not worker_urls:
            raise ValueError("worker_urls must name at least one worker")
        kw.setdefault("startup_timeout", 120.0)
        kw.setdefault("grace", 5.0)
        super().__init__(**kw)
        self.worker_urls, self.policy = [str(u) for u in worker_urls], policy
        self.extra_args = [str(a) for a in extra_args]

    def command(self) -> list[str]:
        # every router binds a Prometheus exporter, by default on port 29000: a second router alive at
        # the same time (tests, replicas' anchors one after another while the last one shuts down)
        # panicked with "Address already in use". Each gets a free port unless the caller names one.
        metrics = [] if any(a.startswith("--prometheus-port") for a in self.extra_args) else \
            ["--prometheus-host", self.host, "--prometheus-port", str(free_port(self.host))]
        return [self.python or sys.executable, "-m", "sglang_router.launch_router", "--host", self.host,
                "--port", str(self.port), "--worker-urls", *self.worker_urls, "--policy", self.policy,
                "--log-level", "warn", *metrics, *self.extra_args]

    def _ready(self) -> bool:
        try:
            with urllib.request.urlopen(f"{self.url}/workers", timeout=2.0) as r:
                listed = json.loads(r.read()).get("workers", [])
        except urllib.error.HTTPError as e:
            return e.code == 404            # a router without the listing: /health is all there is
        except (OSError, ValueError):
            return False
        healthy = {str(w.get("url", "")).rstrip("/") for w in listed if w.get("is_healthy", True)}
        return all(u.rstrip("/") in healthy for u in self.worker_urls)
