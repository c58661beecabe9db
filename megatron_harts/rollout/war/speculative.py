"""Lossless draft-verify decoding for the embedded engine, with the suffix drafter.

Each verification step forwards ``pending + draft`` in one call (``pending``: the emitted tokens
not yet in the model's cache, at least the last one; ``draft``: up to ``budget`` tokens from
:class:`~.suffix.SuffixDrafter`), giving the target distributions ``P[0..k]`` for the draft's
positions and the one after it. :func:`verify`:

* greedy (``top_k == 1``): accept the longest prefix with ``d_i == argmax P[i]``, then emit the
  argmax at the first mismatch (or after the whole draft) -- the tokens greedy decoding emits;
* sampling: the draft is deterministic (``q = one-hot(d_i)``), so speculative sampling accepts
  ``d_i`` with probability ``min(1, p_i(d_i) / q_i(d_i)) = p_i(d_i)`` and on rejection samples
  from the residual ``max(p_i - q_i, 0)``, i.e. ``p_i`` with ``d_i`` removed, renormalised; after
  a fully accepted draft the bonus token is sampled from ``P[k]``. Each emitted token is then
  distributed exactly as in ordinary sampling (Leviathan et al. 2023, Chen et al. 2023), where
  ``p`` is the processed distribution of the request (temperature, top-k, top-p in SGLang's
  order, as the engine's ``_sample``).

The log-prob of every emitted token is ``log_softmax`` of its raw logits row (temperature 1),
as without speculation; only the floating-point path differs (a multi-token forward instead of
one-token steps). Rejection rolls the model's cache back to a copy taken before the verify
forward (the linear-attention states cannot be truncated) and keeps the emitted tokens pending
for the next forward, so a step costs one forward either way.
"""
from __future__ import annotations

import copy
import logging
import threading
import time
from dataclasses import dataclass
from typing import Sequence

from .suffix import DrafterConfig, SuffixDrafter
from .sglang_plugin import group_of

log = logging.getLogger(__name__)


def processed_probs(logits, temperature: float, top_k: int, top_p: float):
    """``[..., V]`` raw logits -> the sampling distribution (temperature, top-k, top-p; SGLang's
    order, identical to ``EmbeddedEngine._sample``). Rows need not be normalised after top-p
    (``torch.multinomial`` normalises); :func:`verify` normalises."""
    import torch

    probs = torch.softmax(logits / temperature, -1)
    V = probs.shape[-1]
    if 0 < top_k < V:
        kth = torch.topk(probs, top_k, dim=-1).values[..., -1:]
        probs = torch.where(probs >= kth, probs, torch.zeros_like(probs))
    if top_p < 1.0:
        sorted_p, idx = torch.sort(probs, descending=True, dim=-1)
        cum = torch.cumsum(sorted_p, -1)
        drop = (cum - sorted_p) > top_p * cum[..., -1:]
        sorted_p = torch.where(drop, torch.zeros_like(sorted_p), sorted_p)
        probs = torch.zeros_like(probs).scatter_(-1, idx, sorted_p)
    return probs / probs.sum(-1, keepdim=True)


def verify(probs, draft: Sequence[int], greedy: bool, gen, logits=None) -> tuple[int, int]:
    """``probs`` ``[k+1, V]`` (target distributions at the draft's positions and after it),
    ``draft`` ``[k]`` -> ``(accepted, next_token)``; ``greedy`` compares with the argmax of
    ``logits`` (raw, ``[k+1, V]``; default ``probs``). ``gen``: a ``torch.Generator``."""
    import torch

    k = len(draft)
    if greedy:
        am = torch.argmax(logits if logits is not None else probs, -1).tolist()
        for i, d in enumerate(draft):
            if am[i] != d:
                return i, am[i]
        return k, am[k]
    for i, d in enumerate(draft):
        p = probs[i]
        if float(torch.rand((), generator=gen)) < float(p[d]):
            continue
        res = p.clone()
        res[d] = 0.0
        return i, int(torch.multinomial(res / res.sum(), 1, generator=gen))
    return k, int(torch.multinomial(probs[k], 1, generator=gen))


@dataclass
class SpecConfig:
    """``budget``: draft tokens per verification; ``max_depth``: the drafter's trie depth;
    ``index_outputs``: index each finished request's output under its group (as arctic's cache
    keeps responses); ``feed``: JSONL of completed trajectories to watch (see
    :class:`~.sglang_plugin.TrajectoryFeed`)."""

    budget: int = 8
    max_depth: int = 64
    min_token_prob: float = 0.1
    index_outputs: bool = True
    feed: str | None = None


class SpecDecoder:
    """The engine-side speculation: one :class:`SuffixDrafter` shared by the engine's requests
    (guarded by a lock: the HTTP threads feed it, the scheduler thread drafts)."""

    def __init__(self, config: SpecConfig | None = None):
        from .sglang_plugin import SuffixCorpus

        self.cfg = config or SpecConfig()
        if self.cfg.budget < 1:
            raise ValueError(f"speculative budget must be >= 1, got {self.cfg.budget}")
        self.drafter = SuffixDrafter(DrafterConfig(max_depth=self.cfg.max_depth, budget=self.cfg.budget,
                                                   min_token_prob=self.cfg.min_token_prob))
        self._feed = SuffixCorpus(self.cfg.budget + 1, feed=self.cfg.feed) if self.cfg.feed else None
        if self._feed is not None:
            self._feed.drafter = self.drafter
        self.lock = threading.Lock()
        self.stats = {"verify_steps": 0, "emitted": 0, "drafted": 0, "accepted": 0}

    def add_trajectory(self, tokens: Sequence[int], group: str | None) -> None:
        with self.lock:
            self.drafter.add_trajectory(tokens, group)

    def accept_len(self) -> float:
        s = self.stats
        return s["emitted"] / s["verify_steps"] if s["verify_steps"] else 0.0

    def _forward_all(self, eng, ids: list[int], cache):
        torch = eng.torch
        with eng._step_lock, torch.no_grad():
            out = eng.model(input_ids=torch.tensor([ids], dtype=torch.long), use_cache=True,
                            **{eng._cache_kw: cache})
        new_cache = getattr(out, "cache", None) or getattr(out, "past_key_values", None)
        return out.logits[0].float(), (new_cache if new_cache is not None else cache)

    def generate(self, eng, req, gen) -> None:
        """``EmbeddedEngine._generate`` with draft-verify steps (same stops, aborts, pauses)."""
        torch = eng.torch
        eng._wait_unpaused(req)
        if req.abort_message is not None:
            return eng._finish(req, {"type": "abort", "message": req.abort_message, "status_code": None,
                                     "err_type": None})
        if self._feed is not None:
            with self.lock:
                self._feed.poll(force=False)
        group = group_of(req.rid)
        with self.lock:
            ctx = self.drafter.start(req.input_ids)
        cache = eng._new_cache()
        if len(req.input_ids) > 1:
            _, cache = self._forward_all(eng, req.input_ids[:-1], cache)
        pending = [req.input_ids[-1]]
        greedy = req.top_k == 1
        eng.last_step = time.monotonic()
        try:
            while True:
                n_out = len(req.output_ids)
                if n_out >= req.max_new_tokens or len(req.input_ids) + n_out >= eng.max_len:
                    return eng._finish(req, {"type": "length", "length": n_out})
                if req.output_ids and req.output_ids[-1] in req.stop_ids:
                    return eng._finish(req, {"type": "stop", "matched": req.output_ids[-1]})
                eng._wait_unpaused(req)
                if req.abort_message is not None:
                    return eng._finish(req, {"type": "abort", "message": req.abort_message, "status_code": None,
                                             "err_type": None})
                room = min(req.max_new_tokens - n_out, eng.max_len - len(req.input_ids) - n_out) - 1
                draft: list[int] = []
                if room > 0:
                    with self.lock:
                        draft = self.drafter.draft(ctx, group, budget=min(self.cfg.budget, room)).tokens
                snapshot = copy.deepcopy(cache) if draft else None
                logits, cache = self._forward_all(eng, pending + draft, cache)
                eng.last_step = time.monotonic()
                rows = logits[len(pending) - 1:]                       # [k+1, V]
                probs = None if greedy else processed_probs(rows, req.temperature, req.top_k, req.top_p)
                n_acc, nxt = verify(probs if probs is not None else rows, draft, greedy, gen, logits=rows)
                emitted = draft[:n_acc] + [nxt]
                for j, t in enumerate(emitted):                        # a stop token ends the turn there
                    if t in req.stop_ids:
                        emitted = emitted[:j + 1]
                        break
                if req.return_logprob:            # log-probs first: a streaming reader takes min(len) of both
                    lp = torch.log_softmax(rows[:len(emitted)], -1)
                    req.logprobs += lp.gather(1, torch.tensor(emitted)[:, None])[:, 0].tolist()
                req.output_ids += emitted
                req.tick.set()
                eng.tokens_generated += len(emitted)
                ctx.extend(emitted)
                req.spec_steps += 1
                s = self.stats
                s["verify_steps"] += 1
                s["emitted"] += len(emitted)
                s["drafted"] += len(draft)
                s["accepted"] += min(n_acc, len(emitted))
                if n_acc < len(draft):                                  # roll the cache back
                    cache, pending = snapshot, pending + emitted
                else:
                    pending = [nxt]
        finally:
            if self.cfg.index_outputs and req.output_ids:
                self.add_trajectory(req.output_ids, group)
