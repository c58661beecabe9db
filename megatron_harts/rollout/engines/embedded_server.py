"""The embedded transformers engine (CPU default, not SGLang).

``python -m megatron_harts.rollout.engines.embedded_server --model-path DIR --port P
[--host 127.0.0.1] [--weight-version V] [--threads N] [--parent-pid PID]``

A small HTTP server (stdlib ``ThreadingHTTPServer``) around a Hugging Face
``AutoModelForCausalLM`` (fp32, local directory, nothing downloaded) that serves the subset of
SGLang's native API that :class:`~megatron_harts.rollout.engines.http.HttpEngine` uses, with the
same JSON shapes (see that module's table), so the client code path is the same on CPU (CI) and
against SGLang on a GPU. It is a correctness reference, not a fast server: one request runs at a
time (a scheduler thread takes requests from a FIFO queue), on the CPU. With
``--enable-priority-scheduling`` (SGLang's flag) the queue is served by the request's top-level
``priority`` instead, as SGLang 0.5.17's ``fcfs`` policy with that flag: larger values first
(``--schedule-low-priority-values-first``: smaller first), ties in arrival order, a request without
a priority last (SGLang gives it ``-sys.maxsize - 1``); a running request is never preempted.
Without the flag ``priority`` is accepted and ignored, as SGLang does.

Generation: a prefill of the prompt, then one-token incremental decoding steps that feed the
model's cache back (attention KV and the linear-attention conv / recurrent states). Sampling
follows SGLang: temperature (0 = greedy), top-k (-1 = all), top-p, a per-request
``sampling_seed`` (reproducible here; SGLang's seeding is its own), ``stop_token_ids`` plus the
checkpoint's ``eos_token_id`` (config and generation config) unless ``ignore_eos``; a stop token is
part of the output; ``max_new_tokens`` is checked first (finish reason ``length``). The log-prob
returned for each sampled token is ``log_softmax`` of the raw logits (temperature 1: the model's
own distribution, what the trainer recomputes; SGLang returns the same with
``SGLANG_RETURN_ORIGINAL_LOGPROB=1``). The test suite checks these against a teacher-forced full
forward of prompt + output (fp32, within 1e-5).

Control: ``/abort_request`` works for queued requests (they return at once) and running ones
(checked between decode steps); ``/pause_generation`` stops the scheduler at the next step
boundary until ``/continue_generation`` (mode ``abort``, SGLang's default, also aborts every
request); ``/update_weights_from_disk`` loads a checkpoint of the same architecture (strict: every
parameter, no extra tensor) into the live model: when paused at once, otherwise after the running
request and before the queued ones (SGLang waits for in-flight requests too);
``/update_weights_from_tensor`` (SGLang's body: ``serialized_named_tensors``, handles made by
:mod:`.tensor_ipc`, e.g. a weight keeper's shared memory) copies named tensors into the live model;
with ``--load-format dummy`` the model is built from ``config.json`` without reading its weights
and refuses generation until one of the two updates has loaded them;
``/release_memory_occupation`` and ``/resume_memory_occupation`` only record the state (they free
nothing on the CPU); ``/flush_cache`` is a no-op (there is no prefix cache: ``cached_tokens`` is
always 0).

Streaming (``"stream": true``, as SGLang): the reply is ``text/event-stream`` (chunked), one
``data: {JSON}`` event per ``--stream-interval`` new tokens (SGLang's flag: default 1, an event
per token; with N the events carry N tokens each, the last one the rest) with the reply's shape so
far (cumulative ``output_ids`` and ``output_token_logprobs``, ``finish_reason`` null until the last
event, as SGLang without ``--incremental-streaming-output``; with that flag each event carries only
its new tokens and log-probs, ``completion_tokens`` the total so far), then ``data: [DONE]``; a
client that disconnects aborts its request. ``--enable-deterministic-inference`` (as SGLang's
flag of that name): a seeded request draws the token at absolute position ``p`` (0-based index
in prompt + output) from a generator seeded by ``(sampling_seed, p)``, so the same seed and
context give the same token wherever the request starts: a request resumed from ``prompt + generated`` continues exactly as the
uninterrupted one would (SGLang hashes seed and position the same way in that mode).

The Qwen3-Next modeling code of transformers picks fla's Triton kernels (GPU only) whenever
``import fla`` works; :func:`main` blocks ``fla`` and ``causal_conv1d`` before transformers is
imported, so this process always takes transformers' torch path.
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import secrets
import sys
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

ENGINE_NAME = "embedded transformers engine (CPU default, not SGLang)"
log = logging.getLogger("megatron_harts.rollout.embedded")

_GREEDY_EPS = 1e-6            # SGLang treats temperature < 1e-6 as greedy


def block_gpu_kernel_packages() -> None:
    """Make ``import fla`` / ``import causal_conv1d`` fail, so transformers takes its torch path.

    Must run before ``transformers.models.qwen3_next`` is imported (it decides at import)."""
    if "transformers.models.qwen3_next.modeling_qwen3_next" in sys.modules:
        raise RuntimeError("transformers' Qwen3-Next modeling is already imported: blocking fla now is too late")
    sys.modules["fla"] = None
    sys.modules["causal_conv1d"] = None


class BadRequest(ValueError):
    """A request the engine refuses (HTTP 400)."""


@dataclass
class _Request:
    rid: str
    input_ids: list[int]
    max_new_tokens: int
    temperature: float
    top_p: float
    top_k: int
    stop_ids: frozenset
    seed: int | None
    return_logprob: bool
    speculative: bool = True             # draft-verify when the engine has speculation (WAR)
    spec_steps: int = 0                  # verification steps (speculative requests)
    output_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    finish: dict | None = None
    state: str = "queued"                # queued | running | done
    abort_message: str | None = None
    weight_version: str | None = None
    t0: float = field(default_factory=time.perf_counter)
    done: threading.Event = field(default_factory=threading.Event)
    tick: threading.Event = field(default_factory=threading.Event)     # set every stream_interval tokens
    stream_interval: int = 1             # tokens per streamed event (the server's --stream-interval)
    priority: int | None = None          # SGLang's request priority (used with priority scheduling)


@dataclass
class _Control:
    """A job the scheduler runs between requests (weight update, health probe)."""
    fn: Any
    result: Any = None
    error: BaseException | None = None
    done: threading.Event = field(default_factory=threading.Event)


class EmbeddedEngine:
    """The model, the request queue and the scheduler thread (no HTTP here).

    ``model_path``: a local Hugging Face checkpoint directory; ``weight_version``: its tag;
    ``threads``: torch intra-op threads; ``stream_interval``: tokens per streamed event;
    ``incremental_stream``: streamed events carry only their new tokens (else cumulative);
    ``priority_scheduling``: serve queued requests by ``priority`` (SGLang's
    ``--enable-priority-scheduling``), larger first unless ``low_priority_first``.
    """

    def __init__(self, model_path: str, weight_version: str | None = None, threads: int | None = None,
                 speculative=None, deterministic: bool = False, stream_interval: int = 1,
                 incremental_stream: bool = False, load_format: str = "auto", priority_scheduling: bool = False,
                 low_priority_first: bool = False):
        import torch

        if load_format not in ("auto", "dummy"):
            raise ValueError(f"load_format must be 'auto' or 'dummy', got {load_format!r}")
        self.load_format = load_format

        if int(stream_interval) < 1:
            raise ValueError(f"stream_interval must be >= 1, got {stream_interval}")
        self.stream_interval = int(stream_interval)
        self.incremental_stream = bool(incremental_stream)
        self.priority_scheduling = bool(priority_scheduling)
        self._priority_sign = 1 if low_priority_first else -1      # SGLang's SchedulePolicy.priority_sign

        # ``speculative``: a ``war.speculative.SpecConfig`` -> lossless suffix speculation (WAR)
        self.spec = None
        if speculative is not None:
            from ..war.speculative import SpecDecoder
            self.spec = SpecDecoder(speculative)

        self.torch = torch
        if threads:
            torch.set_num_threads(int(threads))
        t0 = time.perf_counter()
        self._model_class(model_path)                     # transformers' modeling code, imported once
        self.import_s = time.perf_counter() - t0          # s
        t1 = time.perf_counter()
        self.model = self._load(model_path) if load_format == "auto" else self._load_dummy(model_path)
        self.weights_loaded = load_format == "auto"      # dummy: refuse generation until weights arrive
        self.weights_load_s = time.perf_counter() - t1    # model build (+ checkpoint read unless dummy), s
        self.model_path = model_path
        self.weight_version = weight_version
        self.deterministic = bool(deterministic)     # seeded draws keyed by (seed, position)
        cfg = self.model.config
        self.vocab_size = int(cfg.vocab_size)
        self.max_len = int(getattr(cfg, "max_position_embeddings", 0) or 1 << 30)
        self.eos_ids = self._eos_ids()
        import inspect
        params = inspect.signature(self.model.forward).parameters
        self._cache_kw = "cache" if "cache" in params else "past_key_values"
        log.info("%s: %s %s (%s, %.1fM parameters, vocab %d, eos %s) in %.1f s, weight version %s, "
                 "torch threads %d", ENGINE_NAME,
                 "loaded" if self.weights_loaded else "built without weights (--load-format dummy) from", model_path,
                 type(self.model).__name__,
                 sum(p.numel() for p in self.model.parameters()) / 1e6, self.vocab_size, sorted(self.eos_ids),
                 time.perf_counter() - t0, weight_version, torch.get_num_threads())

        if self.priority_scheduling:
            log.info("priority scheduling: queued requests by priority, %s first, ties in arrival order, "
                     "no priority last", "smaller" if self._priority_sign > 0 else "larger")
        self._cv = threading.Condition()           # guards everything below
        self._queue: deque[_Request] = deque()
        self._control: deque[_Control] = deque()
        self._by_rid: dict[str, _Request] = {}
        self._running: _Request | None = None
        self._paused = False
        self._parked = False                        # the running request waits at a step boundary
        self._stop = False
        self._step_lock = threading.Lock()          # held during each forward / weight load
        self.memory_released: set[str] = set()
        self.last_step = time.monotonic()
        self.tokens_generated = 0
        self._thread = threading.Thread(target=self._loop, name="embedded-scheduler", daemon=True)
        self._thread.start()

    # ---- model ---------------------------------------------------------------------------------

    def _load(self, path: str):
        from transformers import AutoModelForCausalLM

        model, info = AutoModelForCausalLM.from_pretrained(path, dtype=self.torch.float32, local_files_only=True,
                                                           output_loading_info=True)
        bad = {k: v for k, v in info.items() if v and k in ("missing_keys", "unexpected_keys", "mismatched_keys")}
        if bad:
            raise ValueError(f"checkpoint {path} does not match its model class: "
                             + "; ".join(f"{k} {sorted(map(str, v))[:5]}" for k, v in bad.items()))
        # Fresh allocations instead of views of the memory-mapped safetensors file (8-byte aligned
        # only): the CPU fp32 kernels take other code paths by alignment, and a model with the same
        # weights at other addresses gave a decode-step log-prob differing in its last bits
        # (measured: 1 of 16 steps). With this, a worker loaded from the checkpoint and one
        # re-armed from a weight keeper (--load-format dummy) produce bit-identical outputs.
        with self.torch.no_grad():
            for t in list(model.parameters()) + list(model.buffers()):
                t.data = t.data.clone()
        return model.eval()

    @staticmethod
    def _model_class(path: str):
        """The transformers class serving ``path`` (importing its modeling module: seconds, the
        same for a checkpoint and a dummy start, kept out of ``weights_load_s``)."""
        from transformers import AutoConfig, AutoModelForCausalLM

        cfg = AutoConfig.from_pretrained(path, local_files_only=True)
        return AutoModelForCausalLM._model_mapping[type(cfg)]

    def _load_dummy(self, path: str):
        """The model of ``path``'s ``config.json`` without reading its weights (``--load-format
        dummy``, as SGLang's): parameters allocated but not initialised (transformers'
        ``no_init_weights``); non-persistent buffers (rotary frequencies) are computed as usual.
        Serves nothing until :meth:`load_tensors` has filled every parameter."""
        from transformers import AutoConfig, AutoModelForCausalLM
        try:
            from transformers.initialization import no_init_weights
        except ImportError:          # older transformers: a random init (slower, same result once loaded)
            import contextlib
            no_init_weights = contextlib.nullcontext
        cfg = AutoConfig.from_pretrained(path, local_files_only=True)
        with no_init_weights():
            model = AutoModelForCausalLM.from_config(cfg, dtype=self.torch.float32)
        return model.eval()

    def load_tensors(self, named, version: str | None) -> str:
        """Copy ``[(name, tensor)]`` (checkpoint names; e.g. mapped from a weight keeper's shared
        memory) into the live model's parameters and buffers, cast to their dtype; tag
        ``version``. Every name must exist with the same shape; a model built with
        ``--load-format dummy`` and not yet loaded needs every entry of its state dict (nothing
        may stay uninitialised). Holds the step lock while copying."""
        t0 = time.perf_counter()
        sd = self.model.state_dict()
        by_ptr: dict[int, list[str]] = {}           # tied weights: one storage, several names
        for k, v in sd.items():
            by_ptr.setdefault(v.data_ptr(), []).append(k)
        names = {n for n, _ in named}
        unknown = sorted(names - set(sd))
        if unknown:
            raise BadRequest(f"update_weights_from_tensor: {len(unknown)} name(s) not in the model, e.g. {unknown[:3]}")
        bad = [(n, tuple(t.shape), tuple(sd[n].shape)) for n, t in named if tuple(t.shape) != tuple(sd[n].shape)]
        if bad:
            raise BadRequest(f"update_weights_from_tensor: shape mismatch, e.g. {bad[0][0]} {bad[0][1]} vs {bad[0][2]}")
        if not self.weights_loaded:
            missing = [ks for ks in by_ptr.values() if not names & set(ks)]
            if missing:
                raise BadRequest(f"update_weights_from_tensor: the dummy-loaded model needs every tensor; "
                                 f"{len(missing)} missing, e.g. {missing[0][0]}")
        with self._step_lock, self.torch.no_grad():
            for n, t in named:
                sd[n].copy_(t)
            self.weights_loaded = True
            if version is not None:
                self.weight_version = version
        self.weights_load_s = time.perf_counter() - t0
        msg = f"Succeeded to update {len(named)} tensors in {self.weights_load_s:.3f} s."
        log.info("%s (weight version %s)", msg, self.weight_version)
        return msg

    def _eos_ids(self) -> frozenset:
        ids: set[int] = set()
        for cfg in (self.model.config, getattr(self.model, "generation_config", None)):
            e = getattr(cfg, "eos_token_id", None) if cfg is not None else None
            if e is not None:
                ids |= {int(e)} if isinstance(e, int) else {int(x) for x in e}
        return frozenset(ids)

    def _forward(self, ids: list[int], cache):
        torch = self.torch
        with self._step_lock, torch.no_grad():
            out = self.model(input_ids=torch.tensor([ids], dtype=torch.long), use_cache=True,
                             **{self._cache_kw: cache})
        new_cache = getattr(out, "cache", None) or getattr(out, "past_key_values", None)
        return out.logits[0, -1].float(), (new_cache if new_cache is not None else cache)

    def _new_cache(self):
        from transformers import DynamicCache

        try:
            return DynamicCache(config=self.model.config)
        except TypeError:       # older transformers: the model builds its own cache
            return None

    def load_weights(self, path: str, version: str | None) -> str:
        """Load the checkpoint at ``path`` into the live model (same class, every parameter, no
        extra tensor); returns a message. Holds the step lock while copying."""
        t0 = time.perf_counter()
        cfg_file = os.path.join(path, "config.json")
        if not os.path.isfile(cfg_file):
            raise BadRequest(f"{path} is not a Hugging Face checkpoint directory (no config.json)")
        arch = json.load(open(cfg_file)).get("architectures") or []
        if arch and type(self.model).__name__ not in arch:
            raise BadRequest(f"{path} holds {arch}, the engine serves {type(self.model).__name__}")
        new = self._load(path)
        sd = new.state_dict()
        with self._step_lock:
            missing, unexpected = self.model.load_state_dict(sd, strict=False)
            if missing or unexpected:     # cannot happen for the same class; refuse rather than half-load
                raise BadRequest(f"{path}: missing {missing[:5]}, unexpected {unexpected[:5]}")
            self.model_path, self.weight_version = path, version if version is not None else self.weight_version
            self.weights_loaded = True
        del new, sd
        msg = f"Succeeded to update model weights from {path} in {time.perf_counter() - t0:.2f} s."
        log.info("%s (weight version %s)", msg, self.weight_version)
        return msg

    # ---- requests ------------------------------------------------------------------------------

    def parse(self, body: dict) -> _Request:
        """A ``/generate`` body -> a queued-to-be request (raises :class:`BadRequest`)."""
        if not self.weights_loaded:
            raise BadRequest("no weights loaded (started with --load-format dummy): POST /update_weights_from_tensor "
                             "or /update_weights_from_disk first")
        ids = body.get("input_ids")
        if ids is None:
            raise BadRequest("input_ids is required (the embedded engine has no tokenizer)")
        if not isinstance(ids, list) or not ids or isinstance(ids[0], list):
            raise BadRequest("input_ids must be one non-empty list of token ids (no batches)")
        ids = [int(t) for t in ids]
        bad = [t for t in ids if not 0 <= t < self.vocab_size]
        if bad:
            raise BadRequest(f"token id {bad[0]} outside the vocabulary of {self.vocab_size}")
        if len(ids) >= self.max_len:
            raise BadRequest(f"prompt of {len(ids)} tokens does not fit the context length {self.max_len}")
        sp = body.get("sampling_params") or {}
        if not isinstance(sp, dict):
            raise BadRequest("sampling_params must be an object")
        temperature = float(sp.get("temperature", 1.0))
        top_k = int(sp.get("top_k", -1))
        if temperature < _GREEDY_EPS:
            temperature, top_k = 1.0, 1
        top_p = float(sp.get("top_p", 1.0))
        if not 0.0 < top_p <= 1.0:
            raise BadRequest(f"top_p must be in (0, 1], got {top_p}")
        if top_k == 0 or top_k < -1:
            raise BadRequest(f"top_k must be -1 or positive, got {top_k}")
        if sp.get("stop") or sp.get("stop_regex"):
            raise BadRequest("string stops need a tokenizer; use stop_token_ids")
        max_new = int(sp.get("max_new_tokens", 128))
        if max_new < 0:
            raise BadRequest(f"max_new_tokens must be >= 0, got {max_new}")
        stop = frozenset() if sp.get("ignore_eos") else \
            frozenset(int(t) for t in sp.get("stop_token_ids") or []) | self.eos_ids
        seed = sp.get("sampling_seed")
        rid = body.get("rid") or secrets.token_hex(16)
        if not isinstance(rid, str):
            raise BadRequest("rid must be a string (no batches)")
        priority = body.get("priority")
        if priority is not None and (isinstance(priority, bool) or not isinstance(priority, int)):
            raise BadRequest(f"priority must be an integer, got {priority!r}")
        return _Request(rid=rid, input_ids=ids, max_new_tokens=max_new, temperature=temperature, top_p=top_p,
                        top_k=top_k, stop_ids=stop, seed=None if seed is None else int(seed),
                        return_logprob=bool(body.get("return_logprob")),
                        speculative=bool(body.get("speculative", True)), stream_interval=self.stream_interval,
                        priority=priority)

    def submit(self, req: _Request) -> None:
        with self._cv:
            if req.rid in self._by_rid:
                raise BadRequest(f"duplicate request id {req.rid}")
            self._by_rid[req.rid] = req
            self._queue.append(req)
            self._cv.notify_all()

    def result(self, req: _Request, n: int | None = None, start: int = 0, partial: bool = False) -> dict:
        """SGLang's ``/generate`` reply for a finished request; with ``n``: a streaming event with
        the first ``n`` output tokens (``finish_reason`` null unless the request is done and the
        event is not ``partial``, i.e. not one of the whole events a reader catches up on after the
        end), or with ``start`` only tokens ``start..n-1`` (incremental streaming;
        ``completion_tokens`` stays ``n``)."""
        out = list(req.output_ids if n is None else req.output_ids[start:n])
        final = n is None or (req.done.is_set() and not partial)
        finish = req.finish if final else None
        meta = {"id": req.rid, "finish_reason": finish, "prompt_tokens": len(req.input_ids),
                "weight_version": req.weight_version if final else self.weight_version,
                "completion_tokens": len(out) if n is None else n, "cached_tokens": 0,
                "e2e_latency": time.perf_counter() - req.t0}
        if req.spec_steps:                    # SGLang's names for speculative requests
            meta["spec_verify_ct"] = req.spec_steps
            meta["spec_accept_length"] = len(req.output_ids) / req.spec_steps
        if req.return_logprob:
            meta["input_token_logprobs"] = []
            meta["output_token_logprobs"] = [[lp, t, None] for lp, t in zip(req.logprobs[start:], out)]
            meta["output_token_logprobs_length"] = len(out)
        return {"text": "", "output_ids": out, "meta_info": meta}

    def _finish(self, req: _Request, finish: dict) -> None:
        with self._cv:
            req.finish, req.state = finish, "done"
            req.weight_version = self.weight_version      # SGLang reports the version at reply time
            self._by_rid.pop(req.rid, None)
            if self._running is req:
                self._running = None
            self._cv.notify_all()
        req.done.set()
        req.tick.set()

    def abort(self, rid: str | None = None, abort_all: bool = False, message: str = "Aborted by the user") -> int:
        """Abort ``rid`` (or everything): queued requests finish now, the running one at its next
        step boundary. Returns how many were found."""
        with self._cv:
            targets = list(self._by_rid.values()) if abort_all else [r for r in [self._by_rid.get(rid or "")] if r]
            queued = [r for r in targets if r.state == "queued"]
            for req in targets:
                req.abort_message = message
            for req in queued:       # out of the queue now: the scheduler can no longer take them
                self._queue.remove(req)
            self._cv.notify_all()
        for req in queued:
            self._finish(req, {"type": "abort", "message": message, "status_code": None, "err_type": None})
        if targets:
            log.info("aborted %d request(s)%s", len(targets), "" if abort_all else f" ({rid})")
        return len(targets)

    def pause(self, mode: str) -> None:
        """Stop at the next step boundary (``abort``: abort everything first)."""
        if mode not in ("abort", "in_place", "retract"):
            raise BadRequest(f"unknown pause mode {mode!r}")
        if mode == "abort":
            self.abort(abort_all=True, message="Aborted by pause_generation")
        with self._cv:
            self._paused = True
            self._cv.notify_all()
            while self._running is not None and not self._parked and not self._stop:
                self._cv.wait()          # until the running request is parked at a step boundary
        log.info("generation paused (mode %s)", mode)

    def resume(self) -> None:
        with self._cv:
            self._paused = False
            self._cv.notify_all()
        log.info("generation continued")

    @property
    def paused(self) -> bool:
        return self._paused

    def run_control(self, fn, timeout: float | None = None):
        """Run ``fn()`` in the scheduler between requests (now, under the step lock, when paused)."""
        with self._cv:
            paused = self._paused
            if not paused:
                job = _Control(fn)
                self._control.append(job)
                self._cv.notify_all()
        if paused:
            return fn()
        if not job.done.wait(timeout):
            raise TimeoutError("the scheduler did not get to the job in time")
        if job.error is not None:
            raise job.error
        return job.result

    def load_stats(self) -> dict:
        with self._cv:
            running = [self._running] if self._running is not None else []
            queued = list(self._queue)
        tokens = sum(len(r.input_ids) + len(r.output_ids) for r in running) + sum(len(r.input_ids) for r in queued)
        return {"running": len(running), "queued": len(queued), "tokens": tokens}

    def scheduler_alive(self) -> bool:
        return self._thread.is_alive()

    def stop(self) -> None:
        with self._cv:
            self._stop = True
            self._cv.notify_all()
        self.abort(abort_all=True, message="server shutting down")

    # ---- scheduler -----------------------------------------------------------------------------

    def _loop(self) -> None:
        while True:
            with self._cv:
                while not self._stop and not self._control and (self._paused or not self._queue):
                    self._cv.wait()
                if self._stop:
                    return
                if self._control:
                    job, req = self._control.popleft(), None
                else:
                    job, req = None, self._next_request()
                    req.state, self._running = "running", req
            if job is not None:
                self._run_job(job)
                continue
            try:
                self._generate(req)
            except Exception as e:          # a failing model must not kill the scheduler
                log.exception("request %s failed", req.rid)
                self._finish(req, {"type": "abort", "message": f"engine error: {type(e).__name__}: {e}",
                                   "status_code": 500, "err_type": "InternalServerError"})

    def _next_request(self) -> _Request:
        """Take the next queued request (``self._cv`` held): FIFO, or with priority scheduling the
        first of the best ``priority * sign`` (SGLang's ``_sort_by_priority_and_fcfs`` key; no
        priority counts as the worst, as SGLang's ``Scheduler._set_or_validate_priority``)."""
        if not self.priority_scheduling:
            return self._queue.popleft()
        worst = sys.maxsize if self._priority_sign > 0 else -sys.maxsize - 1
        req = min(self._queue, key=lambda r: (worst if r.priority is None else r.priority) * self._priority_sign)
        self._queue.remove(req)
        return req

    @staticmethod
    def _run_job(job: _Control) -> None:
        try:
            job.result = job.fn()
        except BaseException as e:       # noqa: BLE001 - handed back to the caller
            job.error = e
        job.done.set()

    def _wait_unpaused(self, req: _Request) -> None:
        """Park at a step boundary while paused; control jobs queued before the pause run here."""
        while True:
            with self._cv:
                self._parked = True
                self._cv.notify_all()
                while self._paused and not self._control and req.abort_message is None and not self._stop:
                    self._cv.wait()
                self._parked = False
                if not (self._paused and self._control and req.abort_message is None and not self._stop):
                    return
                job = self._control.popleft()
            self._run_job(job)

    def _generate(self, req: _Request) -> None:
        torch = self.torch
        gen = torch.Generator().manual_seed(req.seed if req.seed is not None else secrets.randbits(63))
        if self.spec is not None and req.speculative:
            return self.spec.generate(self, req, gen)
        self._wait_unpaused(req)
        if req.abort_message is not None:
            return self._finish(req, {"type": "abort", "message": req.abort_message, "status_code": None,
                                      "err_type": None})
        cache = self._new_cache()
        logits, cache = self._forward(req.input_ids, cache)
        self.last_step = time.monotonic()
        while True:
            if len(req.output_ids) >= req.max_new_tokens or len(req.input_ids) + len(req.output_ids) >= self.max_len:
                return self._finish(req, {"type": "length", "length": len(req.output_ids)})
            if req.output_ids and req.output_ids[-1] in req.stop_ids:
                return self._finish(req, {"type": "stop", "matched": req.output_ids[-1]})
            self._wait_unpaused(req)
            if req.abort_message is not None:
                return self._finish(req, {"type": "abort", "message": req.abort_message, "status_code": None,
                                          "err_type": None})
            if self.deterministic and req.seed is not None:      # keyed by (seed, absolute position)
                pos = len(req.input_ids) + len(req.output_ids)
                gen = torch.Generator().manual_seed((req.seed * 1_000_003 + pos * 7_919) % (1 << 63))
            tok = self._sample(logits, req, gen)
            lp = float(torch.log_softmax(logits, -1)[tok]) if req.return_logprob else None
            if lp is not None:            # log-prob first: a streaming reader takes min(len) of both
                req.logprobs.append(lp)
            req.output_ids.append(tok)
            if len(req.output_ids) % req.stream_interval == 0:   # wake a streaming reader once per event
                req.tick.set()
            self.tokens_generated += 1
            if len(req.output_ids) < req.max_new_tokens and tok not in req.stop_ids:
                logits, cache = self._forward([tok], cache)
                self.last_step = time.monotonic()

    def _sample(self, logits, req: _Request, gen) -> int:
        """Temperature, top-k, top-p (SGLang's order), then a draw with the request's generator."""
        torch = self.torch
        if req.top_k == 1:
            return int(torch.argmax(logits))
        probs = torch.softmax(logits / req.temperature, -1)
        if 0 < req.top_k < probs.numel():
            kth = torch.topk(probs, req.top_k).values[-1]
            probs = torch.where(probs >= kth, probs, torch.zeros_like(probs))
        if req.top_p < 1.0:
            sorted_p, idx = torch.sort(probs, descending=True)
            cum = torch.cumsum(sorted_p, 0)
            drop = (cum - sorted_p) > req.top_p * cum[-1]         # keep the smallest prefix reaching top_p
            sorted_p = torch.where(drop, torch.zeros_like(sorted_p), sorted_p)
            probs = torch.zeros_like(probs).scatter_(0, idx, sorted_p)
        return int(torch.multinomial(probs, 1, generator=gen))


# ---- HTTP ----------------------------------------------------------------------------------------

class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server_version = "harts-embedded"
    engine: EmbeddedEngine = None         # set on the subclass made in serve()
    model_path: str = ""

    def log_message(self, fmt, *args):   # route the access log to logging at debug level
        log.debug("%s %s", self.address_string(), fmt % args)

    def _send(self, status: int, obj: Any = None, text: str | None = None) -> None:
        if text is not None:
            data, ctype = text.encode(), "text/plain; charset=utf-8"
        else:
            data, ctype = json.dumps(obj).encode(), "application/json"
        self.send_response(status)
        self.send_header("Content-Type", ctype)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def _body(self) -> dict:
        n = int(self.headers.get("Content-Length") or 0)
        raw = self.rfile.read(n) if n else b""
        if not raw.strip():
            return {}
        try:
            obj = json.loads(raw)
        except ValueError as e:
            raise BadRequest(f"body is not JSON: {e}") from None
        if not isinstance(obj, dict):
            raise BadRequest("body must be a JSON object")
        return obj

    def do_GET(self):
        self._dispatch("GET")

    def do_POST(self):
        self._dispatch("POST")

    def do_PUT(self):
        self._dispatch("POST")

    def _dispatch(self, method: str) -> None:
        path = self.path.split("?", 1)[0]
        fn = _ROUTES.get(path)
        if fn is None:
            return self._send(404, {"detail": "Not Found"})
        try:
            body = self._body() if method == "POST" else {}
            fn(self, body)
        except BadRequest as e:
            self._send(400, {"error": {"message": str(e)}})
        except (BrokenPipeError, ConnectionResetError):
            log.debug("client went away during %s", path)
        except Exception as e:             # noqa: BLE001 - one bad request must not take the server down
            log.exception("%s failed", path)
            self._send(500, {"error": {"message": f"{type(e).__name__}: {e}"}})

    # routes ------------------------------------------------------------------------------------

    def generate(self, body):
        eng = self.engine
        req = eng.parse(body)
        eng.submit(req)
        if body.get("stream"):
            return self._stream(req)
        req.done.wait()
        if req.finish and req.finish.get("status_code") == 500:
            return self._send(500, {"error": {"message": req.finish["message"]}})
        self._send(200, eng.result(req))

    def _chunk(self, data: bytes) -> None:
        self.wfile.write(b"%x\r\n%s\r\n" % (len(data), data))
        self.wfile.flush()

    def _stream(self, req: _Request) -> None:
        """Server-sent events, one per ``stream_interval`` new tokens (cumulative, SGLang's default,
        or only the new ones with ``incremental_stream``), then ``[DONE]``; an error ends the stream
        with ``data: {"error": ...}``; a vanished client aborts ``req``."""
        eng = self.engine
        every, incremental = req.stream_interval, eng.incremental_stream
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Cache-Control", "no-cache")
        self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()
        sent = 0
        try:
            while True:
                req.tick.wait(5.0)
                req.tick.clear()
                done = req.done.is_set()          # read before the count: once done, the count is final
                n = min(len(req.output_ids), len(req.logprobs)) if req.return_logprob else len(req.output_ids)
                if done and req.finish and req.finish.get("status_code") == 500:
                    self._chunk(b"data: " + json.dumps({"error": {"message": req.finish["message"]}}).encode()
                                + b"\n\n")
                    break
                if not done:                      # whole events of `every` tokens until the end
                    n = sent + (n - sent) // every * every
                # one event per `every` tokens, as SGLang's scheduler emits them, also when this
                # reader woke late (several events' tokens ready, or the request finished since)
                while n - sent > every:
                    ev = eng.result(req, sent + every, start=sent if incremental else 0, partial=True)
                    self._chunk(b"data: " + json.dumps(ev).encode() + b"\n\n")
                    sent += every
                if n > sent or done:
                    ev = eng.result(req, n, start=sent if incremental else 0)
                    self._chunk(b"data: " + json.dumps(ev).encode() + b"\n\n")
                    sent = n
                if done:
                    break
            self._chunk(b"data: [DONE]\n\n")
            self._chunk(b"")
        except (BrokenPipeError, ConnectionResetError):
            eng.abort(req.rid, message="client disconnected")
            raise

    def abort_request(self, body):
        self.engine.abort(body.get("rid"), bool(body.get("abort_all")))
        self._send(200, text="")

    def get_load(self, body):
        s = self.engine.load_stats()
        self._send(200, [{"dp_rank": 0, "num_reqs": s["running"] + s["queued"], "num_waiting_reqs": s["queued"],
                          "num_tokens": s["tokens"], "num_pending_tokens": 0, "ts_tic": time.perf_counter()}])

    def health(self, body):
        self._send(200 if self.engine.scheduler_alive() else 503, text="")

    def health_generate(self, body):
        eng = self.engine
        if not eng.scheduler_alive():
            return self._send(503, text="")
        s = eng.load_stats()
        if eng.paused or (s["running"] and time.monotonic() - eng.last_step < 20):
            return self._send(200, text="")
        req = eng.parse({"input_ids": [0], "sampling_params": {"max_new_tokens": 1, "temperature": 0.0},
                         "rid": f"HEALTH_CHECK_{secrets.token_hex(8)}"})
        eng.submit(req)
        ok = req.done.wait(20.0)
        if not ok:
            eng.abort(req.rid)
        self._send(200 if ok and req.finish and req.finish["type"] != "abort" else 503, text="")

    def model_info(self, body):
        eng = self.engine
        cfg = eng.model.config
        self._send(200, {"model_path": eng.model_path, "tokenizer_path": None, "is_generation": True,
                         "preferred_sampling_params": None, "weight_version": eng.weight_version,
                         "model_type": getattr(cfg, "model_type", None),
                         "architectures": getattr(cfg, "architectures", None), "engine": ENGINE_NAME})

    def weight_version(self, body):            # SGLang 0.5.2's /get_weight_version
        self._send(200, {"weight_version": self.engine.weight_version})

    def server_info(self, body):
        eng = self.engine
        self._send(200, {"engine": ENGINE_NAME, "version": "embedded", "model_path": eng.model_path,
                         "weight_version": eng.weight_version, "paused": eng.paused,
                         "load_format": eng.load_format, "weights_loaded": eng.weights_loaded,
                         "weights_load_s": eng.weights_load_s, "import_s": eng.import_s,
                         "memory_released": sorted(eng.memory_released), "tokens_generated": eng.tokens_generated,
                         "load": eng.load_stats(),
                         "speculative": None if eng.spec is None else dict(eng.spec.stats,
                                                                            accept_len=eng.spec.accept_len())})

    def war_add_trajectories(self, body):
        """WAR: index completed trajectories for suffix speculation:
        ``{"trajectories": [{"tokens": [...], "group": "..."}]}``."""
        eng = self.engine
        if eng.spec is None:
            raise BadRequest("speculation is off (start the server with --speculative-algorithm suffix)")
        trajs = body.get("trajectories")
        if not isinstance(trajs, list):
            raise BadRequest("trajectories must be a list of {tokens, group}")
        for t in trajs:
            if not isinstance(t, dict) or not isinstance(t.get("tokens"), list):
                raise BadRequest("each trajectory needs a tokens list")
            eng.spec.add_trajectory([int(x) for x in t["tokens"]], t.get("group"))
        self._send(200, {"success": True, "indexed": len(trajs), "indexed_tokens": eng.spec.drafter.indexed_tokens})

    def flush_cache(self, body):
        self._send(200, text="Cache flushed (the embedded engine has no prefix cache).\n")

    def update_weights_from_disk(self, body):
        eng = self.engine
        path = body.get("model_path")
        if not path:
            raise BadRequest("model_path is required")
        if body.get("abort_all_requests"):
            eng.abort(abort_all=True, message="Aborted by update_weights_from_disk")
        try:
            msg = eng.run_control(lambda: eng.load_weights(path, body.get("weight_version")))
        except Exception as e:            # noqa: BLE001 - SGLang answers 400 with success false
            log.error("weight update from %s failed: %s", path, e)
            return self._send(400, {"success": False, "message": f"{type(e).__name__}: {e}",
                                    "num_paused_requests": 0})
        self._send(200, {"success": True, "message": msg, "num_paused_requests": 0})

    def update_weights_from_tensor(self, body):
        """SGLang's ``/update_weights_from_tensor``: ``serialized_named_tensors`` (one string per TP
        rank; the embedded engine has one rank: element 0), ``load_format`` (None or ``direct``),
        ``weight_version``, ``abort_all_requests``, ``flush_cache`` (no prefix cache here)."""
        from .tensor_ipc import UnsafePayload, deserialize_named_tensors

        eng = self.engine
        ser = body.get("serialized_named_tensors")
        if not isinstance(ser, list) or not ser:
            raise BadRequest("serialized_named_tensors must be a non-empty list (one entry per TP rank)")
        if body.get("load_format") not in (None, "direct"):
            raise BadRequest(f"load_format {body.get('load_format')!r} is not supported (None or 'direct')")
        if body.get("abort_all_requests"):
            eng.abort(abort_all=True, message="Aborted by update_weights_from_tensor")
        try:
            named = deserialize_named_tensors(ser[0])
        except (UnsafePayload, ValueError) as e:
            return self._send(400, {"success": False, "message": str(e)})
        try:
            msg = eng.run_control(lambda: eng.load_tensors(named, body.get("weight_version")))
        except Exception as e:            # noqa: BLE001 - SGLang answers 400 with success false
            log.error("weight update from tensors failed: %s", e)
            return self._send(400, {"success": False, "message": f"{type(e).__name__}: {e}"})
        finally:
            del named                     # unmap the sender's memory now
        self._send(200, {"success": True, "message": msg})

    def update_weight_version(self, body):
        eng = self.engine
        if "new_version" not in body:
            raise BadRequest("new_version is required")
        if body.get("abort_all_requests"):
            eng.abort(abort_all=True)
        eng.weight_version = str(body["new_version"])
        self._send(200, {"success": True, "message": f"Weight version updated to {eng.weight_version}",
                         "new_version": eng.weight_version})

    def release_memory_occupation(self, body):
        tags = body.get("tags") or ["weights", "kv_cache"]
        self.engine.memory_released |= set(tags)
        log.info("release_memory_occupation %s: recorded only (the embedded engine frees nothing)", tags)
        self._send(200, None)

    def resume_memory_occupation(self, body):
        tags = body.get("tags") or ["weights", "kv_cache"]
        self.engine.memory_released -= set(tags)
        log.info("resume_memory_occupation %s: recorded only", tags)
        self._send(200, None)

    def pause_generation(self, body):
        self.engine.pause(body.get("mode", "abort"))
        self._send(200, {"message": "Generation paused successfully.", "status": "ok"})

    def continue_generation(self, body):
        self.engine.resume()
        self._send(200, {"message": "Generation continued successfully.", "status": "ok"})


_ROUTES = {
    "/generate": _Handler.generate, "/abort_request": _Handler.abort_request, "/get_load": _Handler.get_load,
    "/health": _Handler.health, "/health_generate": _Handler.health_generate,
    "/model_info": _Handler.model_info, "/get_model_info": _Handler.model_info,
    "/get_weight_version": _Handler.weight_version, "/weight_version": _Handler.weight_version,
    "/server_info": _Handler.server_info, "/get_server_info": _Handler.server_info,
    "/flush_cache": _Handler.flush_cache, "/war/add_trajectories": _Handler.war_add_trajectories, "/update_weights_from_disk": _Handler.update_weights_from_disk,
    "/update_weight_version": _Handler.update_weight_version,
    "/update_weights_from_tensor": _Handler.update_weights_from_tensor,
    "/release_memory_occupation": _Handler.release_memory_occupation,
    "/resume_memory_occupation": _Handler.resume_memory_occupation,
    "/pause_generation": _Handler.pause_generation, "/continue_generation": _Handler.continue_generation,
}


def serve(engine: EmbeddedEngine, host: str, port: int) -> ThreadingHTTPServer:
    """An HTTP server (not yet serving) bound to ``host:port`` for ``engine``."""
    handler = type("Handler", (_Handler,), {"engine": engine})
    server_cls = type("Server", (ThreadingHTTPServer,), {"daemon_threads": True, "request_queue_size": 256})
    return server_cls((host, port), handler)


def _watch_parent(pid: int, httpd: ThreadingHTTPServer) -> None:
    while True:
        time.sleep(1.0)
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            log.warning("parent process %d is gone; shutting down", pid)
            httpd.shutdown()
            return
        except PermissionError:
            pass


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=f"{ENGINE_NAME}: SGLang's native HTTP API subset over transformers")
    p.add_argument("--model-path", required=True, help="local Hugging Face checkpoint directory")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=30000)
    p.add_argument("--weight-version", default=None, help="version tag of the initial weights")
    p.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: torch's)")
    p.add_argument("--parent-pid", type=int, default=None, help="exit when this process is gone")
    p.add_argument("--enable-deterministic-inference", action="store_true",
                   help="seeded sampling keyed by (sampling_seed, token position), as SGLang's flag")
    p.add_argument("--stream-interval", type=int, default=1,
                   help="tokens per streamed event (as SGLang's flag; default 1: an event per token)")
    p.add_argument("--incremental-streaming-output", action="store_true",
                   help="streamed events carry only their new tokens (as SGLang's flag; default: cumulative)")
    p.add_argument("--load-format", default="auto", choices=["auto", "dummy"],
                   help="dummy (as SGLang's): build the model from config.json without reading its weights; "
                        "generation is refused until POST /update_weights_from_tensor (or _from_disk) loads them")
    p.add_argument("--enable-priority-scheduling", action="store_true",
                   help="serve queued requests by their priority, larger first (as SGLang's flag; default: FIFO)")
    p.add_argument("--schedule-low-priority-values-first", action="store_true",
                   help="with --enable-priority-scheduling: smaller priority values first (as SGLang's flag)")
    p.add_argument("--log-level", default="info")
    p.add_argument("--speculative-algorithm", default=None, choices=["suffix"],
                   help="WAR: lossless suffix speculation over completed trajectories (default: off)")
    p.add_argument("--speculative-num-draft-tokens", type=int, default=8, help="draft tokens per verification")
    p.add_argument("--speculative-corpus", default=None, help="JSONL of completed trajectories to watch")
    args = p.parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s",
                        stream=sys.stderr)
    if not os.path.isfile(os.path.join(args.model_path, "config.json")):
        log.error("%s: --model-path %s is not a Hugging Face checkpoint directory (no config.json)",
                  ENGINE_NAME, args.model_path)
        return 2
    block_gpu_kernel_packages()
    log.info("%s starting: model %s, %s:%d", ENGINE_NAME, args.model_path, args.host, args.port)
    spec = None
    if args.speculative_algorithm:
        if args.speculative_num_draft_tokens < 1:
            log.error("--speculative-num-draft-tokens must be >= 1, got %d", args.speculative_num_draft_tokens)
            return 2
        from ..war.speculative import SpecConfig
        spec = SpecConfig(budget=args.speculative_num_draft_tokens, feed=args.speculative_corpus)
    if args.stream_interval < 1:
        log.error("--stream-interval must be >= 1, got %d", args.stream_interval)
        return 2
    engine = EmbeddedEngine(args.model_path, args.weight_version, args.threads, speculative=spec,
                            deterministic=args.enable_deterministic_inference, stream_interval=args.stream_interval,
                            incremental_stream=args.incremental_streaming_output, load_format=args.load_format,
                            priority_scheduling=args.enable_priority_scheduling,
                            low_priority_first=args.schedule_low_priority_values_first)
    httpd = serve(engine, args.host, args.port)
    if args.parent_pid:
        threading.Thread(target=_watch_parent, args=(args.parent_pid, httpd), daemon=True).start()
    import signal

    def _term(signum, frame):
        log.info("signal %d: shutting down", signum)
        threading.Thread(target=httpd.shutdown, daemon=True).start()
    signal.signal(signal.SIGTERM, _term)
    log.info("%s serving on http://%s:%d", ENGINE_NAME, args.host, args.port)
    try:
        httpd.serve_forever(poll_interval=0.2)
    except KeyboardInterrupt:
        pass
    finally:
        engine.stop()
        httpd.server_close()
    log.info("%s stopped", ENGINE_NAME)
    return 0


if __name__ == "__main__":
    sys.exit(main())
