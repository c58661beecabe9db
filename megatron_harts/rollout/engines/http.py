"""The one engine client: SGLang's native HTTP API, token ids in and out.

:class:`HttpEngine` speaks to ``python -m sglang.launch_server ... --skip-tokenizer-init`` and to
the embedded transformers engine (:mod:`.embedded_server`), which serves the same subset of that
API, so CPU tests exercise the code path the GPU runs. Endpoints and JSON fields used (checked
against SGLang 0.5.17's ``srt/entrypoints/http_server.py`` and ``srt/managers/io_struct.py``, and
0.5.2's where they differ):

=====================================  =====================================================
``POST /generate``                     ``{"input_ids", "sampling_params", "return_logprob",
                                       "rid"[, "priority"]}`` -> ``{"output_ids", "meta_info": {"id",
                                       "finish_reason": {"type": "stop"|"length"|"abort",
                                       ...}, "prompt_tokens", "cached_tokens",
                                       "completion_tokens", "weight_version",
                                       "output_token_logprobs": [[logprob, id, null], ...]}}``
``POST /abort_request``                ``{"rid"}`` or ``{"abort_all": true}``; 200, no body
``GET /get_load``                      0.5.17: ``[{"dp_rank", "num_reqs", "num_waiting_reqs",
                                       "num_tokens", ...}]`` per DP rank; 0.5.2: ``{"load": int}``
``GET /health_generate``, ``/health``  200 when a one-token generation went through / up
``POST /flush_cache``                  200, or 400 with a text reason (requests in flight)
``POST /update_weights_from_disk``     ``{"model_path", "weight_version", "abort_all_requests",
                                       "flush_cache"}`` -> ``{"success", "message",
                                       "num_paused_requests"}`` (400 when not successful)
``POST /update_weights_from_tensor``   ``{"serialized_named_tensors": [str per TP rank], "load_format",
                                       "flush_cache", "abort_all_requests", "weight_version"}`` ->
                                       ``{"success", "message"}`` (handles, not data: tensor_ipc)
``GET /model_info``                    ``{"weight_version", "model_path", ...}`` (0.5.17; 0.5.2
                                       has ``/get_model_info`` only, used on a 404)
``POST /release_memory_occupation``    ``{"tags": ["weights", "kv_cache"]}`` or ``{}`` (needs
``POST /resume_memory_occupation``     ``--enable-memory-saver`` on SGLang)
``POST /pause_generation``             ``{"mode": "abort"|"in_place"|"retract"}`` (0.5.17;
                                       0.5.2 ignores the body and always aborts)
``POST /continue_generation``          ``{}``
=====================================  =====================================================

Log-probs: SGLang returns log-probs after temperature scaling unless the server runs with
``SGLANG_RETURN_ORIGINAL_LOGPROB=1`` (``RETURN_ORIGINAL_LOGPROB=1`` before 0.5.3);
:class:`~.launch.SGLangServer` sets both, so ``Generation.logprobs`` are the model's own
(temperature 1) log-probs, which is what the trainer recomputes.

Retries: connection refused or reset, HTTP 5xx and (for calls other than ``generate``) timeouts are
retried ``retries`` times with exponential backoff, then raise :class:`EngineError` naming the URL
and endpoint. ``generate`` is retried on the same failures except timeouts: sampling is stateless,
so a second submission is just another sample of the same distribution, and any half-done first
attempt is aborted by ``rid`` before resubmitting. A timed-out ``generate`` is aborted and raises
(retrying would only double the wait). Every request uses its own connection, so the client is
safe to call from many threads at once.
"""
from __future__ import annotations

import http.client
import json
import logging
import socket
import threading
import time
import uuid
from typing import Any, Sequence
from urllib.parse import urlsplit

from ..types import EngineError, Generation, SamplingParams

log = logging.getLogger(__name__)

_RETRY_STATUS = frozenset({500, 502, 503, 504})


class _HttpStatus(Exception):
    def __init__(self, status: int, body: bytes):
        super().__init__(status)
        self.status, self.body = status, body

    def reason(self) -> str:
        text = self.body.decode("utf-8", errors="replace").strip()
        try:   # SGLang's error bodies: {"error": {"message": ...}}, {"message": ...} or {"detail": ...}
            obj = json.loads(text)
            if isinstance(obj, dict):
                err = obj.get("error", obj)
                text = str((err.get("message") if isinstance(err, dict) else err) or obj.get("detail") or obj)
        except ValueError:
            pass
        return f"HTTP {self.status}: {' '.join(text.split())[:300]}"


class HttpEngine:
    """An :class:`~megatron_harts.rollout.types.Engine` over SGLang's native HTTP API.

    ``url``: ``http://host:port`` of the server; ``timeout``: seconds a request may wait for its
    reply (for ``generate``, the whole generation); ``retries``: extra attempts after a
    retryable failure, with backoff ``backoff * 2**k`` seconds (capped at 10 s);
    ``name``: for logs and :attr:`name` (default ``sglang@host:port``).
    """

    def __init__(self, url: str, *, timeout: float = 600.0, retries: int = 3, backoff: float = 0.5,
                 name: str | None = None):
        parts = urlsplit(url if "://" in url else "http://" + url)
        if parts.scheme != "http" or not parts.hostname:
            raise ValueError(f"HttpEngine needs an http://host:port URL, got {url!r}")
        self.host, self.port = parts.hostname, parts.port or 80
        self.url = f"http://{self.host}:{self.port}"
        self.timeout, self.retries, self.backoff = float(timeout), int(retries), float(backoff)
        self.name = name or f"sglang@{self.host}:{self.port}"
        self._model_info_path = "/model_info"      # falls back to /get_model_info (SGLang < 0.5.1x)
        self._lock = threading.Lock()

    def __repr__(self) -> str:
        return f"HttpEngine({self.url!r})"

    # ---- transport ----------------------------------------------------------------------------

    def _once(self, method: str, path: str, body: Any, timeout: float) -> tuple[int, bytes]:
        """One request on a fresh connection; returns (status, body) or raises OSError/_HttpStatus."""
        conn = http.client.HTTPConnection(self.host, self.port, timeout=timeout)
        try:
            data = None if body is None else json.dumps(body).encode()
            headers = {"Content-Type": "application/json"} if data is not None else {}
            conn.request(method, path, body=data, headers=headers)
            resp = conn.getresponse()
            payload = resp.read()
        except http.client.HTTPException as e:      # bad status line, remote closed mid-reply, ...
            raise ConnectionError(f"{type(e).__name__}: {e}") from e
        finally:
            conn.close()
        if resp.status >= 400:
            raise _HttpStatus(resp.status, payload)
        return resp.status, payload

    def _call(self, method: str, path: str, body: Any = None, *, timeout: float | None = None,
              retry_timeouts: bool = True, retries: int | None = None, before_retry=None) -> bytes:
        """Send with bounded retries; returns the reply body; raises :class:`EngineError`."""
        timeout = self.timeout if timeout is None else timeout
        retries = self.retries if retries is None else retries
        attempt = 0
        while True:
            try:
                return self._once(method, path, body, timeout)[1]
            except _HttpStatus as e:
                if e.status not in _RETRY_STATUS or attempt >= retries:
                    raise EngineError(f"{self.url}{path}: {e.reason()}"
                                      + (f" (after {attempt + 1} attempts)" if attempt else "")) from None
                why = e.reason()
            except (socket.timeout, TimeoutError) as e:
                if not retry_timeouts or attempt >= retries:
                    raise EngineError(f"{self.url}{path}: no reply within {timeout:g} s"
                                      + (f" (after {attempt + 1} attempts)" if attempt else "")) from e
                why = f"timed out after {timeout:g} s"
            except OSError as e:                      # refused, reset, unreachable, DNS
                if attempt >= retries:
                    raise EngineError(f"{self.url}{path}: {type(e).__name__}: {e} "
                                      f"(after {attempt + 1} attempts)") from e
                why = f"{type(e).__name__}: {e}"
            delay = min(10.0, self.backoff * 2 ** attempt)
            log.warning("%s%s: %s; retry %d/%d in %.2f s", self.url, path, why, attempt + 1, retries, delay)
            time.sleep(delay)
            if before_retry is not None:
                before_retry()
            attempt += 1

    def _json(self, method: str, path: str, body: Any = None, **kw) -> Any:
        raw = self._call(method, path, body, **kw)
        try:
            return json.loads(raw) if raw.strip() else None
        except ValueError:
            raise EngineError(f"{self.url}{path}: reply is not JSON: {raw[:200]!r}") from None

    # ---- Engine protocol ----------------------------------------------------------------------

    def generate(self, input_ids: Sequence[int], sampling: SamplingParams, rid: str | None = None) -> Generation:
        """``POST /generate`` with token ids; blocks until the generation finishes or is aborted.

        ``rid`` (default: a fresh uuid) names the request for :meth:`abort`. Raises
        :class:`EngineError` on failure (after retries, see the module docstring).
        ``Generation.weight_version`` is the server's version when it replied (SGLang's
        ``meta_info.weight_version``): a request paused across a weight update reports the new one.
        ``latency_s`` is the client's wall time for the call.
        """
        rid = rid or uuid.uuid4().hex
        body = {"input_ids": [int(t) for t in input_ids], "sampling_params": sampling.to_sglang(),
                "return_logprob": True, "rid": rid, **sampling.request_fields()}
        t0 = time.perf_counter()
        try:
            d = self._json("POST", "/generate", body, retry_timeouts=False,
                           before_retry=lambda: self._abort_quietly(rid))
        except EngineError:
            self._abort_quietly(rid)
            raise
        latency = time.perf_counter() - t0
        try:
            meta = d["meta_info"]
            out = [int(t) for t in d["output_ids"]]
            lps = [float(x[0]) for x in meta.get("output_token_logprobs") or []]
            fr = meta.get("finish_reason")
            reason = fr.get("type") if isinstance(fr, dict) else (fr or "unknown")
        except (KeyError, TypeError, ValueError, IndexError) as e:
            raise EngineError(f"{self.url}/generate: unexpected reply ({type(e).__name__}: {e}): "
                              f"{json.dumps(d)[:200]}") from None
        if len(lps) != len(out):
            raise EngineError(f"{self.url}/generate: {len(out)} output ids but {len(lps)} log-probs (rid {rid})")
        return Generation(output_ids=out, logprobs=lps, finish_reason=str(reason),
                          weight_version=meta.get("weight_version"), prompt_tokens=int(meta.get("prompt_tokens") or 0),
                          cached_tokens=int(meta.get("cached_tokens") or 0), latency_s=latency)

    def generate_stream(self, input_ids: Sequence[int], sampling: SamplingParams, rid: str | None = None,
                        on_tokens=None, timeout: float | None = None) -> Generation:
        """``POST /generate`` with ``"stream": true``: like :meth:`generate`, but the tokens arrive
        as server-sent events and ``on_tokens(ids, logprobs)`` is called with each new piece as it
        arrives (before the call returns), so a caller can log what was generated before a failure.

        One attempt, no retries (a stream cannot be replayed): a refused connection, a reset, a
        stream that ends before its last event (server killed) or no event for ``timeout`` seconds
        (default: the client's ``timeout``) raise :class:`EngineError`; the tokens already passed to
        ``on_tokens`` stay valid. Both SGLang stream forms are read: cumulative ``output_ids`` (the
        default) and deltas (``--incremental-streaming-output``), told apart by
        ``meta_info.completion_tokens``.
        """
        rid = rid or uuid.uuid4().hex
        body = {"input_ids": [int(t) for t in input_ids], "sampling_params": sampling.to_sglang(),
                "return_logprob": True, "rid": rid, "stream": True, **sampling.request_fields()}
        timeout = self.timeout if timeout is None else float(timeout)
        t0 = time.perf_counter()
        out: list[int] = []
        lps: list[float] = []
        meta: dict = {}
        conn = http.client.HTTPConnection(self.host, self.port, timeout=timeout)
        try:
            conn.request("POST", "/generate", body=json.dumps(body).encode(),
                         headers={"Content-Type": "application/json", "Accept": "text/event-stream"})
            resp = conn.getresponse()
            if resp.status >= 400:
                raise EngineError(f"{self.url}/generate (stream): {_HttpStatus(resp.status, resp.read()).reason()}")
            finished = False
            while True:
                line = resp.readline()
                if not line:
                    break
                line = line.strip()
                if not line.startswith(b"data:"):
                    continue
                data = line[5:].strip()
                if data == b"[DONE]":
                    finished = True
                    break
                try:
                    d = json.loads(data)
                except ValueError:
                    raise EngineError(f"{self.url}/generate (stream): bad event {data[:200]!r}") from None
                if "error" in d:
                    err = d["error"]
                    raise EngineError(f"{self.url}/generate (stream): "
                                      f"{err.get('message') if isinstance(err, dict) else err}")
                meta = d.get("meta_info") or {}
                ids = [int(t) for t in d.get("output_ids") or []]
                new_lps = [float(x[0]) for x in meta.get("output_token_logprobs") or []]
                total = int(meta.get("completion_tokens", len(out) + len(ids)))
                if len(ids) == total and total >= len(out):          # cumulative: keep the new tail
                    if ids[:len(out)] != out:
                        raise EngineError(f"{self.url}/generate (stream): cumulative output changed (rid {rid})")
                    ids = ids[len(out):]
                if len(new_lps) == total and total >= len(lps):
                    new_lps = new_lps[len(lps):]
                if len(new_lps) != len(ids):
                    raise EngineError(f"{self.url}/generate (stream): {len(ids)} new ids but {len(new_lps)} "
                                      f"log-probs (rid {rid})")
                if ids:
                    out += ids
                    lps += new_lps
                    if on_tokens is not None:
                        on_tokens(ids, new_lps)
                fr = meta.get("finish_reason")
                if fr:
                    finished = True        # SGLang may close right after the last event
            if not finished:
                raise EngineError(f"{self.url}/generate (stream): stream ended after {len(out)} tokens without "
                                  f"its last event (server gone?)")
        except EngineError:
            self._abort_quietly(rid)
            raise
        except (socket.timeout, TimeoutError) as e:
            self._abort_quietly(rid)
            raise EngineError(f"{self.url}/generate (stream): no event within {timeout:g} s "
                              f"after {len(out)} tokens") from e
        except (OSError, http.client.HTTPException) as e:
            self._abort_quietly(rid)
            raise EngineError(f"{self.url}/generate (stream): {type(e).__name__}: {e} after {len(out)} tokens") from e
        finally:
            conn.close()
        fr = meta.get("finish_reason")
        reason = fr.get("type") if isinstance(fr, dict) else (fr or "unknown")
        return Generation(output_ids=out, logprobs=lps, finish_reason=str(reason),
                          weight_version=meta.get("weight_version"), prompt_tokens=int(meta.get("prompt_tokens") or 0),
                          cached_tokens=int(meta.get("cached_tokens") or 0), latency_s=time.perf_counter() - t0)

    def _abort_quietly(self, rid: str) -> None:
        try:
            self._call("POST", "/abort_request", {"rid": rid}, timeout=5.0, retries=0)
        except EngineError as e:
            log.debug("abort of %s after a failed generate: %s", rid, e)

    def abort(self, rid: str) -> None:
        """``POST /abort_request``: the request returns with finish reason ``abort`` (an unknown or
        finished ``rid`` is a no-op)."""
        self._call("POST", "/abort_request", {"rid": rid})

    def abort_all(self) -> None:
        """Abort every queued and running request."""
        self._call("POST", "/abort_request", {"rid": "", "abort_all": True})

    def load(self) -> dict[str, Any]:
        """``GET /get_load``, summed over DP ranks: ``{"running", "queued", "tokens_in_flight",
        "raw"}``; counts are -1 where the server does not report them (SGLang 0.5.2 reports only
        a token count)."""
        d = self._json("GET", "/get_load")
        if isinstance(d, dict) and "load" in d:       # SGLang <= 0.5.2: {"load": tokens}
            return {"running": -1, "queued": -1, "tokens_in_flight": int(d["load"]), "raw": d}
        ranks = d if isinstance(d, list) else [d]
        try:
            reqs = sum(int(r.get("num_reqs", 0)) for r in ranks)
            queued = sum(int(r.get("num_waiting_reqs", 0)) for r in ranks)
            toks = sum(int(r.get("num_tokens", 0)) for r in ranks)
        except (AttributeError, TypeError, ValueError):
            raise EngineError(f"{self.url}/get_load: unexpected reply {json.dumps(d)[:200]}") from None
        return {"running": reqs - queued, "queued": queued, "tokens_in_flight": toks, "raw": d}

    def health(self, timeout: float = 5.0) -> bool:
        """``GET /health_generate`` answered 200 within ``timeout`` seconds (no retries)."""
        try:
            self._call("GET", "/health_generate", timeout=timeout, retries=0)
            return True
        except EngineError as e:
            log.debug("%s unhealthy: %s", self.name, e)
            return False

    def alive(self, timeout: float = 5.0) -> bool:
        """``GET /health`` answered 200 (the server is up; nothing generated)."""
        try:
            self._call("GET", "/health", timeout=timeout, retries=0)
            return True
        except EngineError:
            return False

    def update_weights_from_disk(self, path: str, version: str, *, abort_all_requests: bool = False,
                                 flush_cache: bool = True) -> float:
        """``POST /update_weights_from_disk``: load the Hugging Face checkpoint at ``path`` (a
        directory the *server* can read) and tag it ``version``; returns wall seconds. SGLang
        waits for in-flight requests unless generation is paused (then it swaps at once)."""
        t0 = time.perf_counter()
        body = {"model_path": str(path), "weight_version": str(version), "abort_all_requests": abort_all_requests,
                "flush_cache": flush_cache}
        try:
            d = self._json("POST", "/update_weights_from_disk", body)
        except EngineError as e:
            raise EngineError(f"weight update to {version!r} from {path}: {e}") from None
        if not (isinstance(d, dict) and d.get("success")):
            raise EngineError(f"{self.url}/update_weights_from_disk: failed: {d}")
        return time.perf_counter() - t0

    def update_weights_from_tensor(self, serialized_named_tensors: Sequence[str], version: str | None, *,
                                   load_format: str | None = None, flush_cache: bool = True,
                                   abort_all_requests: bool = False, timeout: float | None = None) -> float:
        """``POST /update_weights_from_tensor`` (SGLang's native endpoint; the embedded engine has
        it too): load the tensors behind ``serialized_named_tensors`` (one string per TP rank,
        :func:`~.tensor_ipc.serialize_named_tensors`: CUDA IPC / shared-memory handles, not data)
        into the served model and tag it ``version``; returns wall seconds. No retries: a failed
        load leaves the worker unfit to serve (it is stopped, not retried)."""
        t0 = time.perf_counter()
        body = {"serialized_named_tensors": list(serialized_named_tensors), "load_format": load_format,
                "flush_cache": flush_cache, "abort_all_requests": abort_all_requests,
                "weight_version": None if version is None else str(version)}
        try:
            d = self._json("POST", "/update_weights_from_tensor", body, timeout=timeout, retries=0)
        except EngineError as e:
            raise EngineError(f"weight update from tensors to {version!r}: {e}") from None
        if not (isinstance(d, dict) and d.get("success")):
            raise EngineError(f"{self.url}/update_weights_from_tensor: failed: {d}")
        return time.perf_counter() - t0

    def set_weight_version(self, version: str) -> None:
        """``POST /update_weight_version``: retag the served weights without loading anything."""
        self._json("POST", "/update_weight_version", {"new_version": str(version), "abort_all_requests": False})

    def model_info(self) -> dict[str, Any]:
        """``GET /model_info`` (``/get_model_info`` on older SGLang)."""
        try:
            return self._json("GET", self._model_info_path)
        except EngineError as e:
            if self._model_info_path == "/model_info" and "HTTP 404" in str(e):
                with self._lock:
                    self._model_info_path = "/get_model_info"
                return self._json("GET", self._model_info_path)
            raise

    def weight_version(self) -> str | None:
        """The version tag of the weights being served (``model_info()["weight_version"]``)."""
        v = self.model_info().get("weight_version")
        return None if v is None else str(v)

    def flush_cache(self) -> None:
        """``POST /flush_cache``; SGLang refuses (``EngineError``) while requests are in flight."""
        self._call("POST", "/flush_cache")

    def release_memory(self, tags: Sequence[str] | None = None) -> None:
        """``POST /release_memory_occupation`` (``tags`` among ``weights``, ``kv_cache``; all by
        default). SGLang needs ``--enable-memory-saver``; the embedded engine frees nothing."""
        self._call("POST", "/release_memory_occupation", {"tags": list(tags)} if tags else {})

    def resume_memory(self, tags: Sequence[str] | None = None) -> None:
        """``POST /resume_memory_occupation``."""
        self._call("POST", "/resume_memory_occupation", {"tags": list(tags)} if tags else {})

    def pause(self, mode: str = "in_place") -> None:
        """``POST /pause_generation``. ``in_place`` (default): stop scheduling, in-flight requests
        wait with their caches and continue after :meth:`resume` (possibly on new weights);
        ``retract``: the same but their caches are dropped and recomputed; ``abort``: abort them
        (SGLang's default, and the only behaviour of SGLang 0.5.2)."""
        if mode not in ("in_place", "retract", "abort"):
            raise ValueError(f"pause mode must be in_place, retract or abort, got {mode!r}")
        self._call("POST", "/pause_generation", {"mode": mode})

    def resume(self) -> None:
        """``POST /continue_generation``."""
        self._call("POST", "/continue_generation", {})
