"""Weight keeper: a process that owns the current weights and re-arms a replacement engine worker.

``python -m megatron_harts.rollout.belayer.keeper --model-path DIR --port P [--device cpu|cuda[:i]]
[--weight-version V] [--parent-pid PID]``

The keeper loads the checkpoint's tensors (every ``*.safetensors`` file of a Hugging Face
directory, the names as stored: what SGLang's and transformers' loaders expect) once and keeps
them: on ``cuda`` in device memory, shareable by CUDA IPC; on ``cpu`` in POSIX shared memory
(torch's ``file_system`` strategy, :mod:`~megatron_harts.rollout.engines.tensor_ipc`). It is a
separate process from every engine worker, so a worker's death (SIGKILL of its process group)
leaves it and the weights untouched.

A replacement worker is started *without reading the checkpoint* (SGLang: ``--load-format dummy``:
random weights; the embedded engine: ``--load-format dummy``: the model built from ``config.json``,
parameters uninitialised, generation refused until weights arrive) and then re-armed
(:meth:`Keeper.rearm`):

1. health check of the keeper and its device (``GET /health``: the process answers; on a GPU
   ``torch.cuda.synchronize`` and ``mem_get_info`` succeed, i.e. the CUDA context is not in an
   error state; the checksum of every kept tensor (:func:`~.tensor_ipc.fingerprint`) equals the
   one taken at load, so nothing wrote into the shared weights);
2. ``POST /handles`` with the weight version the caller expects: the serialized handles (SGLang's
   ``update_weights_from_tensor`` body), or HTTP 409 when the keeper holds another version (a
   stale keeper is refused: :class:`StaleWeights`);
3. ``POST /update_weights_from_tensor`` to the worker with those handles and the version: the
   worker maps the keeper's memory and copies it into its own parameters (SGLang's
   ``model.load_weights``; the embedded engine's ``copy_``), a device-to-device (or shared-memory)
   copy instead of a disk read, a parse of safetensors and a host-to-device transfer.

The worker's parameters are its own copy: a later death of the keeper does not affect a worker
already re-armed. :meth:`Keeper.load` moves the keeper to a new checkpoint (the supervisor calls
it on every weight update, so the keeper stays at the current version).

What this does not keep is the KV cache of the dead worker (see docs/belayer.md, "GPU state reuse").

Times are seconds (``time.monotonic``); sizes are bytes.
"""
from __future__ import annotations

import argparse
import glob
import http.client
import json
import logging
import os
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Sequence

from ..engines.launch import _ServerProcess
from ..types import EngineError

log = logging.getLogger(__name__)


class KeeperError(EngineError):
    """The keeper cannot re-arm a worker: dead, unhealthy or unreachable (one-line reason)."""


class StaleWeights(KeeperError):
    """The keeper holds another weight version than the one asked for."""


# ------------------------------------------------------------------------------ keeper process
class _Store:
    """The kept tensors (``{name: tensor}``), their version, device and load-time checksums."""

    def __init__(self, device: str):
        import torch

        from ..engines import tensor_ipc

        self.torch, self.ipc = torch, tensor_ipc
        self.device = device
        if device.startswith("cuda"):
            if not torch.cuda.is_available():
                raise RuntimeError(f"--device {device}: CUDA is not available in the keeper process")
            torch.cuda.set_device(torch.device(device))
        else:
            tensor_ipc.share_cpu_tensors_between_processes()
        self.lock = threading.Lock()
        self.tensors: dict[str, Any] = {}
        self.sums: list[int] = []
        self.version: str | None = None
        self.model_path: str | None = None
        self.load_s = 0.0

    def load(self, path: str, version: str | None) -> str:
        """Read every ``*.safetensors`` file of ``path`` onto the device (CPU: into shared memory)
        and make it the kept version. The previous tensors are released once no one maps them."""
        from safetensors.torch import load_file

        t0 = time.monotonic()
        files = sorted(glob.glob(os.path.join(path, "*.safetensors")))
        if not files:
            raise FileNotFoundError(f"{path}: no *.safetensors file (the keeper reads Hugging Face safetensors only)")
        tensors: dict[str, Any] = {}
        for f in files:
            for name, t in load_file(f, device=self.device if self.device.startswith("cuda") else "cpu").items():
                if name in tensors:
                    raise ValueError(f"{path}: tensor {name} appears in two files")
                tensors[name] = t.share_memory_() if not t.is_cuda else t
        sums = self.ipc.fingerprint(tensors.values())
        with self.lock:
            self.tensors, self.sums, self.version, self.model_path = tensors, sums, version, path
            self.load_s = time.monotonic() - t0
        n = sum(t.numel() * t.element_size() for t in tensors.values())
        msg = (f"kept {len(tensors)} tensors ({n / 2**20:.1f} MiB) of {path} on {self.device}, weight version "
               f"{version}, in {self.load_s:.2f} s")
        log.info(msg)
        return msg

    def check(self, deep: bool = True) -> dict:
        """The health report (see the module doc); ``ok`` False with ``reason`` when a check fails."""
        t0 = time.monotonic()
        torch = self.torch
        with self.lock:
            tensors, sums, version = list(self.tensors.values()), list(self.sums), self.version
        rep: dict[str, Any] = {"ok": True, "weight_version": version, "device": self.device,
                               "num_tensors": len(tensors),
                               "bytes": sum(t.numel() * t.element_size() for t in tensors), "pid": os.getpid()}
        try:
            if self.device.startswith("cuda"):
                dev = torch.device(self.device)       # handler threads do not inherit set_device
                torch.cuda.synchronize(dev)
                free, total = torch.cuda.mem_get_info(dev)
                rep["gpu"] = {"name": torch.cuda.get_device_name(dev), "free_bytes": free, "total_bytes": total}
            if deep:
                now = self.ipc.fingerprint(tensors)
                bad = [i for i, (a, b) in enumerate(zip(now, sums)) if a != b]
                rep["checksum_ok"] = not bad
                if bad:
                    names = list(self.tensors)
                    rep.update(ok=False, reason=f"{len(bad)} kept tensor(s) changed since load, e.g. "
                                                f"{names[bad[0]] if bad[0] < len(names) else bad[0]}")
        except Exception as e:      # noqa: BLE001 - a CUDA error here is the finding
            rep.update(ok=False, reason=f"device check failed: {type(e).__name__}: {e}")
        if not tensors:
            rep.update(ok=False, reason="no weights loaded")
        rep["check_s"] = time.monotonic() - t0
        return rep

    def handles(self, version: str | None, tp_size: int) -> dict:
        with self.lock:
            if version is not None and version != self.version:
                raise StaleWeights(f"keeper holds weight version {self.version!r}, asked for {version!r}")
            named = list(self.tensors.items())
            kept = self.version
        t0 = time.monotonic()
        ser = self.ipc.serialize_named_tensors(named, tp_size=tp_size)
        return {"weight_version": kept, "serialized_named_tensors": ser, "num_tensors": len(named),
                "serialize_s": time.monotonic() - t0}


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    store: _Store = None

    def log_message(self, fmt, *args):
        log.debug("%s %s", self.address_string(), fmt % args)

    def _send(self, status: int, obj: Any) -> None:
        data = json.dumps(obj).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def _body(self) -> dict:
        n = int(self.headers.get("Content-Length") or 0)
        raw = self.rfile.read(n) if n else b""
        return json.loads(raw) if raw.strip() else {}

    def do_GET(self):
        path = self.path.split("?", 1)[0]
        if path == "/health":
            rep = self.store.check(deep="deep=0" not in self.path)
            return self._send(200 if rep["ok"] else 503, rep)
        self._send(404, {"error": {"message": f"no route {path}"}})

    def do_POST(self):
        path = self.path.split("?", 1)[0]
        try:
            body = self._body()
            if path == "/handles":
                return self._send(200, self.store.handles(body.get("weight_version"), int(body.get("tp_size", 1))))
            if path == "/load":
                if not body.get("model_path"):
                    return self._send(400, {"error": {"message": "model_path is required"}})
                msg = self.store.load(str(body["model_path"]), body.get("weight_version"))
                return self._send(200, {"success": True, "message": msg, "load_s": self.store.load_s})
            self._send(404, {"error": {"message": f"no route {path}"}})
        except StaleWeights as e:
            self._send(409, {"error": {"message": str(e)}})
        except Exception as e:      # noqa: BLE001 - reported to the caller, the keeper stays up
            log.exception("%s failed", path)
            self._send(500, {"error": {"message": f"{type(e).__name__}: {e}"}})


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="Belayer weight keeper: owns the current weights, hands out IPC handles")
    p.add_argument("--model-path", required=True, help="Hugging Face checkpoint directory (safetensors)")
    p.add_argument("--weight-version", default=None)
    p.add_argument("--device", default="cpu", help="cpu (shared memory) or cuda[:i] (CUDA IPC)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--parent-pid", type=int, default=None, help="exit when this process is gone")
    p.add_argument("--log-level", default="info")
    args = p.parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s",
                        stream=sys.stderr)
    store = _Store(args.device)
    store.load(args.model_path, args.weight_version)
    handler = type("Handler", (_Handler,), {"store": store})
    httpd = type("Server", (ThreadingHTTPServer,), {"daemon_threads": True})((args.host, args.port), handler)
    if args.parent_pid:
        def watch():
            while True:
                time.sleep(1.0)
                try:
                    os.kill(args.parent_pid, 0)
                except ProcessLookupError:
                    log.warning("parent process %d is gone; keeper exits", args.parent_pid)
                    httpd.shutdown()
                    return
                except PermissionError:
                    pass
        threading.Thread(target=watch, daemon=True).start()
    import signal
    signal.signal(signal.SIGTERM, lambda *_: threading.Thread(target=httpd.shutdown, daemon=True).start())
    log.info("keeper serving on http://%s:%d", args.host, args.port)
    try:
        httpd.serve_forever(poll_interval=0.2)
    finally:
        httpd.server_close()
    return 0


# ------------------------------------------------------------------------------------- client
class Keeper(_ServerProcess):
    """The keeper process (started by :meth:`start`, healthy once its weights are loaded) and its
    client. ``device``: ``cpu`` or ``cuda[:i]`` (the GPU the workers run on: CUDA IPC handles are
    opened on the device they were made on); other keywords: :class:`_ServerProcess`."""

    kind = "keeper"

    def __init__(self, model_path: str, *, weight_version: str | None = None, device: str = "cpu", **kw: Any):
        kw.setdefault("startup_timeout", 300.0)
        kw.setdefault("grace", 5.0)
        super().__init__(**kw)
        self.model_path, self.version, self.device = str(model_path), weight_version, device

    def command(self) -> list[str]:
        cmd = [self.python, "-m", "megatron_harts.rollout.belayer.keeper", "--model-path", self.model_path,
               "--device", self.device, "--host", self.host, "--port", str(self.port), "--parent-pid", str(os.getpid())]
        if self.version is not None:
            cmd += ["--weight-version", str(self.version)]
        return cmd

    def _request(self, method: str, path: str, body: Any = None, timeout: float = 60.0) -> tuple[int, dict]:
        conn = http.client.HTTPConnection(self.host, self.port, timeout=timeout)
        try:
            data = None if body is None else json.dumps(body).encode()
            conn.request(method, path, body=data, headers={"Content-Type": "application/json"} if data else {})
            resp = conn.getresponse()
            raw = resp.read()
        except (OSError, http.client.HTTPException) as e:
            raise KeeperError(f"keeper at {self.url}{path} unreachable: {type(e).__name__}: {e}") from None
        finally:
            conn.close()
        try:
            obj = json.loads(raw) if raw.strip() else {}
        except ValueError:
            raise KeeperError(f"keeper at {self.url}{path}: reply is not JSON: {raw[:200]!r}") from None
        return resp.status, obj

    def health(self, timeout: float = 10.0, deep: bool = True) -> dict:
        """The keeper's health report (see the module doc); raises :class:`KeeperError` when the
        process is gone, does not answer within ``timeout`` s, or reports a failed check."""
        if not self.alive():
            raise KeeperError(f"keeper at {self.url} is not running ({self.dead_reason})")
        status, rep = self._request("GET", "/health" + ("" if deep else "?deep=0"), timeout=timeout)
        if status != 200 or not rep.get("ok"):
            raise KeeperError(f"keeper at {self.url} unhealthy: {rep.get('reason') or f'HTTP {status}'}")
        return rep

    def handles(self, weight_version: str | None, tp_size: int = 1, timeout: float = 120.0) -> list[str]:
        """The serialized handles of the kept weights, if they are ``weight_version``; raises
        :class:`StaleWeights` when the keeper holds another version."""
        status, rep = self._request("POST", "/handles", {"weight_version": weight_version, "tp_size": tp_size},
                                    timeout=timeout)
        msg = (rep.get("error") or {}).get("message")
        if status == 409:
            raise StaleWeights(f"keeper at {self.url}: {msg}")
        if status != 200:
            raise KeeperError(f"keeper at {self.url}/handles: HTTP {status}: {msg}")
        return rep["serialized_named_tensors"]

    def load(self, model_path: str, weight_version: str | None, timeout: float = 600.0) -> float:
        """Keep the checkpoint at ``model_path`` (tagged ``weight_version``) instead; returns wall
        seconds. On failure the keeper keeps its previous version (and is then stale)."""
        t0 = time.monotonic()
        status, rep = self._request("POST", "/load", {"model_path": str(model_path), "weight_version": weight_version},
                                    timeout=timeout)
        if status != 200:
            raise KeeperError(f"keeper at {self.url}: loading {model_path}: "
                              f"{(rep.get('error') or {}).get('message') or f'HTTP {status}'}")
        self.model_path, self.version = str(model_path), weight_version
        return time.monotonic() - t0

    def rearm(self, engine: Any, weight_version: str | None, tp_size: int = 1) -> dict[str, float]:
        """Health-check the keeper, take its handles at ``weight_version`` and load them into the
        worker behind ``engine`` (an :class:`~megatron_harts.rollout.engines.HttpEngine` of a
        server started with ``--load-format dummy``). Returns the phases in seconds:
        ``{"health_s", "handles_s", "update_s", "rearm_s"}``. Raises :class:`KeeperError` /
        :class:`StaleWeights` (keeper side) or ``EngineError`` (the worker refused the tensors)."""
        t0 = time.monotonic()
        self.health()
        t1 = time.monotonic()
        ser = self.handles(weight_version, tp_size=tp_size)
        t2 = time.monotonic()
        engine.update_weights_from_tensor(ser, weight_version)
        t3 = time.monotonic()
        return {"health_s": t1 - t0, "handles_s": t2 - t1, "update_s": t3 - t2, "rearm_s": t3 - t0}


def start_keeper(model_path: str, weight_version: str | None = None, device: str = "cpu", **kw: Any) -> Keeper:
    """Start a :class:`Keeper` for ``model_path`` and wait until it holds the weights."""
    return Keeper(model_path, weight_version=weight_version, device=device, **kw).start()


__all__: Sequence[str] = ("Keeper", "KeeperError", "StaleWeights", "start_keeper", "main")

if __name__ == "__main__":
    sys.exit(main())
