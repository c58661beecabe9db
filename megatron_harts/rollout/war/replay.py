"""Offline drafter evaluation: logged trajectories replayed token by token.

Streams (:func:`code_repair_streams`): scripted agentic episodes on the real ``code_repair``
environment (real bubblewrap sandboxes run every command; observations are the real outputs),
tokenised with the project's :class:`~megatron_harts.rollout.tokenizer.ByteTokenizer`. The model
turns are *scripted*, not sampled from a model (no trained model here): per sample a seeded
choice among realistic strategies -- read the file (``cat``/``sed -n``/``head``), run the tests,
fix the bug either by rewriting ``solution.py`` with a heredoc quoting the whole fixed source or
by a ``python3`` string replacement of the buggy line, sometimes after a wrong first edit, test
again, answer. So the model turns quote and patch real standard-library source that the
observations showed, which is what suffix speculation exploits in agentic coding rollouts.

Replay (:func:`replay`): RL steps in order; in a step each trajectory is replayed turn by turn
(one request per model turn, its prompt = the context so far). In a model turn each verification
step asks the method for a draft of at most ``budget`` tokens given the context, accepts its
longest prefix that equals the logged tokens (greedy verification against the logged stream; a
tree draft: its best path), and emits accepted + 1 tokens (the target's own next token), never
past the end of the turn. ``accept_len`` = emitted tokens per verification step (SGLang's
"accept length"; 1.0 = no speculation gain). Drafter latency: wall time of each draft call
(index updates timed separately).

Methods: ``ours`` (:class:`~.suffix.SuffixDrafter`), ``arctic`` (arctic-inference's
``SuffixDecodingCache``), ``sglang_ngram`` (SGLang 0.5.17's ``NgramCorpus`` fed as its NGRAM
worker feeds it) and ``sglang_ngram_corpus`` (the same plus every completed trajectory loaded as
an external corpus).
"""
from __future__ import annotations

import difflib
import json
import logging
import random
import time
from dataclasses import dataclass, field
from typing import Protocol, Sequence

import numpy as np

from ..tokenizer import ByteTokenizer
from .suffix import Draft, DrafterConfig, SuffixDrafter

log = logging.getLogger(__name__)


@dataclass
class Stream:
    """One logged trajectory: ``tokens`` ``[n]``, ``loss_mask`` ``[n]`` (1 on model tokens),
    ``group`` (task), ``step`` (RL step), ``traj_id``."""

    tokens: list[int]
    loss_mask: list[int]
    group: str
    step: int
    traj_id: str

    def turns(self) -> list[tuple[int, int]]:
        """``[(start, end)]`` of the model-generated segments (each one engine request)."""
        out, start = [], None
        for i, m in enumerate(list(self.loss_mask) + [0]):
            if m and start is None:
                start = i
            elif not m and start is not None:
                out.append((start, i))
                start = None
        return out


# ----------------------------------------------------------------------------------- streams
def _fix_actions(rng: random.Random, mutant: str, fixed: str, name: str) -> list[str]:
    """The model turns of one scripted code_repair episode (see the module docstring)."""
    read = rng.choice(["cat solution.py", "cat -n solution.py", "sed -n '1,200p' solution.py", "head -n 120 solution.py"])
    test = "python3 test_solution.py"
    old = [ln for ln in difflib.ndiff(mutant.splitlines(), fixed.splitlines()) if ln.startswith("- ")]
    new = [ln for ln in difflib.ndiff(mutant.splitlines(), fixed.splitlines()) if ln.startswith("+ ")]
    old_line, new_line = (old[0][2:], new[0][2:]) if old and new else ("", "")
    heredoc = f"cat > solution.py << 'EOF'\n{fixed.rstrip()}\nEOF"
    replace = ("python3 - << 'EOF'\nimport pathlib\np = pathlib.Path('solution.py')\ns = p.read_text()\n"
               f"s = s.replace({old_line!r}, {new_line!r})\np.write_text(s)\nprint('patched')\nEOF")
    fix = heredoc if rng.random() < 0.6 else replace
    acts = [f"<call>{read}</call>"]
    if rng.random() < 0.7:
        acts.append(f"<call>{test}</call>")
    if rng.random() < 0.3:                       # a wrong first edit: the buggy source written back
        acts.append(f"<call>cat > solution.py << 'EOF'\n{mutant.rstrip()}\nEOF</call>")
        acts.append(f"<call>{test}</call>")
    acts.append(f"<call>{fix}</call>")
    acts.append(f"<call>{test}</call>")
    acts.append(f"<answer>Fixed `{name}`: the line `{old_line.strip()}` is now `{new_line.strip()}`; "
                f"the tests pass.<eos>")
    return acts


def code_repair_streams(n_tasks: int = 6, samples: int = 4, steps: int = 3, seed: int = 0) -> list[Stream]:
    """``steps * n_tasks * samples`` trajectories of scripted episodes on code_repair tasks
    ``0 .. n_tasks-1`` (real sandboxes; needs bubblewrap), byte-tokenised."""
    from ..agent_loop import scripted_trajectory
    from ..envs.code_repair import CodeRepairEnv, select

    tok = ByteTokenizer()
    out: list[Stream] = []
    for step in range(steps):
        for t in range(n_tasks):
            fn, site, task = select(seed, t)
            mutant = (task / "workspace" / "solution.py").read_text()
            for s in range(samples):
                rng = random.Random(f"{seed}/{step}/{t}/{s}")
                env = CodeRepairEnv(t, seed)
                acts = _fix_actions(rng, mutant, env.reference_solution, fn.name)
                tr = scripted_trajectory(env, acts, tok, traj_id=f"s{step}/t{t}/{s}", group_id=f"t{t}")
                out.append(Stream([int(x) for x in tr.tokens], [int(x) for x in tr.loss_mask], f"t{t}", step,
                                  f"s{step}/t{t}/{s}"))
    return out


def sampled_streams(engine, family: str = "code_repair", n_tasks: int = 6, samples: int = 4, steps: int = 3, *,
                    max_new_tokens: int = 256, max_turns: int = 8, temperature: float = 1.0,
                    seed: int = 0) -> list[Stream]:
    """``steps`` rounds of ``n_tasks x samples`` episodes sampled from ``engine`` (an
    :class:`~megatron_harts.rollout.types.Engine`, e.g. the embedded engine serving a model from
    :mod:`megatron_harts.rollout.text_model`) by the agent loop on ``family``'s real environments;
    every model turn is the model's own tokens. The weights stay fixed (no training between
    rounds): a round stands for an RL step of a slowly moving policy. Failed episodes raise."""
    from ..agent_loop import AgentLoop, RolloutConfig
    from ..envs import make_env

    out: list[Stream] = []
    for step in range(steps):
        cfg = RolloutConfig(group_size=samples, max_new_tokens=max_new_tokens, max_turns=max_turns,
                            temperature=temperature, max_concurrency=4, seed=seed * 1000 + step)
        loop = AgentLoop(engine, ByteTokenizer(), lambda t: make_env(family, int(t), seed=seed), cfg)
        res = loop.rollout(list(range(n_tasks)), [f"t{t}" for t in range(n_tasks)])
        if res.failed:
            raise RuntimeError(f"sampled_streams: {len(res.failed)} episodes failed: {res.failed[:2]}")
        for tr in res.trajectories:
            out.append(Stream([int(x) for x in tr.tokens], [int(x) for x in tr.loss_mask], str(tr.group_id), step,
                              f"s{step}/{tr.traj_id}"))
    return out


def save_streams(streams: Sequence[Stream], path: str) -> None:
    """Write ``streams`` as JSONL, one record per stream (``tokens``, ``loss_mask``, ``group``,
    ``step``, ``traj_id``), gzip-compressed when ``path`` ends in ``.gz``: what
    :func:`load_streams` reads back."""
    import gzip
    import json
    from pathlib import Path

    Path(path).parent.mkdir(parents=True, exist_ok=True)
    with (gzip.open(path, "wt") if str(path).endswith(".gz") else open(path, "w")) as f:
        for st in streams:
            f.write(json.dumps({"traj_id": st.traj_id, "group": st.group, "step": st.step, "tokens": list(st.tokens),
                                "loss_mask": list(st.loss_mask)}) + "\n")


def load_streams(path: str) -> list[Stream]:
    """Streams saved by ``scripts/bench_war.py --save-streams`` (JSONL, ``.gz`` allowed). A missing
    or unreadable file, or a line that is not such a record, raises ``ValueError`` naming the file,
    the line and the field."""
    import gzip
    import json

    out = []
    try:
        with (gzip.open(path, "rt") if str(path).endswith(".gz") else open(path)) as f:
            for i, line in enumerate(f, 1):
                try:
                    d = json.loads(line)
                except ValueError as e:
                    raise ValueError(f"{path}:{i}: not JSON ({e})") from None
                for key in ("tokens", "loss_mask", "group", "step", "traj_id"):
                    if not isinstance(d, dict) or key not in d:
                        raise ValueError(f"{path}:{i}: field {key!r} missing (a --save-streams record has "
                                         f"tokens, loss_mask, group, step, traj_id)")
                try:
                    out.append(Stream(d["tokens"], d["loss_mask"], d["group"], int(d["step"]), d["traj_id"]))
                except (TypeError, ValueError) as e:
                    raise ValueError(f"{path}:{i}: bad record: {e}") from None
    except OSError as e:
        raise ValueError(f"{path}: cannot read the streams: {e.strerror or e}") from None
    return out


# ----------------------------------------------------------------------------------- methods
class Method(Protocol):
    name: str

    def start(self, stream: Stream, prompt_end: int) -> None: ...

    def draft(self, context: Sequence[int]) -> list[list[int]]: ...

    def accept(self, context: Sequence[int], new: Sequence[int]) -> None: ...

    def stop(self) -> None: ...

    def finish(self, stream: Stream) -> None: ...


class OursMethod:
    """:class:`SuffixDrafter`: group + global tries of completed trajectories, and the
    trajectory's own context (kept across its turns, extended by observations and accepted tokens)."""

    def __init__(self, cfg: DrafterConfig, name: str = "ours"):
        self.name, self.d = name, SuffixDrafter(cfg)
        self._ctx, self._stream, self.budget = None, None, cfg.budget

    def start(self, stream, prompt_end):
        if self._stream is not stream:
            self._stream, self._ctx = stream, self.d.start(stream.tokens[:prompt_end])
        else:
            self._ctx.extend(stream.tokens[len(self._ctx.tokens):prompt_end])

    def draft(self, context):
        return self.d.draft(self._ctx, self._stream.group).paths()

    def accept(self, context, new):
        self._ctx.extend(new)

    def stop(self):
        pass

    def finish(self, stream):
        self.d.add_trajectory(stream.tokens, stream.group)
        self._stream = self._ctx = None


class ArcticMethod:
    """arctic-inference's ``SuffixDecodingCache`` as vLLM's ``suffix`` method drives it: one
    request per turn (``start_request`` with the prompt, responses appended, ``stop_request``);
    responses stay in its global tree."""

    def __init__(self, max_depth: int, budget: int, max_spec_factor: float = 1.0, min_token_prob: float = 0.1,
                 tree: bool = False):
        from arctic_inference.suffix_decoding import SuffixDecodingCache

        self.name = "arctic_tree" if tree else "arctic"
        self.tree = tree
        self.cache = SuffixDecodingCache(max_tree_depth=max_depth, max_cached_requests=-1)
        self.max_depth, self.budget = max_depth, budget
        self.factor, self.min_prob = max_spec_factor, min_token_prob
        self._rid, self._n = None, 0

    def start(self, stream, prompt_end):
        self._n += 1
        self._rid = f"{stream.traj_id}#{self._n}"
        self.cache.start_request(self._rid, np.asarray(stream.tokens[:prompt_end], dtype=np.int32))

    def draft(self, context):
        ctx = np.asarray(context[-self.max_depth:], dtype=np.int32)
        d = self.cache.speculate(self._rid, ctx, max_spec_tokens=self.budget, max_spec_factor=self.factor,
                                 min_token_prob=self.min_prob, use_tree_spec=self.tree)
        if self.tree:
            return Draft([int(t) for t in d.token_ids], parents=[int(x) for x in d.parents]).paths()
        return [list(d.token_ids)]

    def accept(self, context, new):
        self.cache.add_active_response(self._rid, list(new))

    def stop(self):
        self.cache.stop_request(self._rid)

    def finish(self, stream):
        pass


class SGLangNgramMethod:
    """SGLang 0.5.17's ``NgramCorpus`` (its C++ trie, built on first use), fed as
    ``NGRAMWorker`` feeds it: after each verification step the last ``max_trie_depth`` tokens of
    the request are inserted (prompts are not), drafts are a BFS tree of ``budget + 1`` nodes (the
    root is the last context token). ``external=True``: every completed trajectory is also loaded
    as an external corpus (its suffix automaton gets ``budget // 2`` of the draft nodes)."""

    def __init__(self, budget: int, max_trie_depth: int = 18, external: bool = False):
        from .sglang_plugin import ngram_corpus_cls

        NgramCorpus = ngram_corpus_cls()
        self.name = "sglang_ngram_corpus" if external else "sglang_ngram"
        self.n, self.depth, self.external = budget + 1, max_trie_depth, external
        self.corpus = NgramCorpus(max_trie_depth=max_trie_depth, draft_token_num=self.n, max_bfs_breadth=10,
                                  external_sam_budget=budget // 2 if external else 0)
        self._rid, self._k = None, 0

    def start(self, stream, prompt_end):
        self._k += 1
        self._rid = f"{stream.traj_id}#{self._k}"

    def draft(self, context):
        self.corpus.synchronize()
        ids, mask = self.corpus.batch_get([self._rid], [list(context[-self.depth:])], [len(context)])
        ids = [int(x) for x in ids]
        mask = np.asarray(mask, dtype=bool).reshape(self.n, self.n)
        return [[ids[j] for j in range(1, self.n) if mask[i, j]] for i in range(1, self.n)]

    def accept(self, context, new):
        self.corpus.batch_put([list(context[-self.depth:])])

    def stop(self):
        self.corpus.erase_match_state([self._rid])

    def finish(self, stream):
        if self.external:
            self.corpus.synchronize()
            n = self.corpus.load_external_corpus_named(stream.traj_id, [stream.tokens])
            self.corpus.commit_external_corpus_load(stream.traj_id, n)


# ------------------------------------------------------------------------------------ replay
@dataclass
class ReplayResult:
    """Per method: ``steps`` (verifications), ``emitted`` model tokens, ``accept_len``
    (emitted / steps), ``draft_us_mean``/``draft_us_median``/``draft_us_p99`` (microseconds per draft call),
    ``update_s`` (seconds spent indexing), per-step ``accept_len_by_step``."""

    method: str
    steps: int = 0
    emitted: int = 0
    accept_len: float = 0.0
    draft_us_mean: float = 0.0
    draft_us_median: float = 0.0
    draft_us_p99: float = 0.0
    update_s: float = 0.0
    accept_len_by_step: dict = field(default_factory=dict)


def accepted(paths: list[list[int]], target: Sequence[int]) -> int:
    """Longest prefix of ``target`` that one of the draft ``paths`` starts with."""
    best = 0
    for p in paths:
        k = 0
        for a, b in zip(p, target):
            if a != b:
                break
            k += 1
        best = max(best, k)
    return best


def replay(method: Method, streams: Sequence[Stream]) -> ReplayResult:
    """Replay ``streams`` (in RL-step order) through ``method``; see the module docstring."""
    res = ReplayResult(method.name)
    lat: list[float] = []
    upd = 0.0
    by_step: dict[int, list[int]] = {}
    for st in sorted(streams, key=lambda s: s.step):
        toks = st.tokens
        for a, b in st.turns():
            t0 = time.perf_counter()
            method.start(st, a)
            upd += time.perf_counter() - t0
            p = a
            while p < b:
                t0 = time.perf_counter_ns()
                paths = method.draft(toks[:p])
                lat.append((time.perf_counter_ns() - t0) / 1e3)
                k = accepted(paths, toks[p:b])
                n = min(k + 1, b - p)
                t0 = time.perf_counter()
                method.accept(toks[:p + n], toks[p:p + n])
                upd += time.perf_counter() - t0
                p += n
                res.steps += 1
                res.emitted += n
                s = by_step.setdefault(st.step, [0, 0])
                s[0] += 1
                s[1] += n
            method.stop()
        t0 = time.perf_counter()
        method.finish(st)
        upd += time.perf_counter() - t0
    res.accept_len = res.emitted / max(res.steps, 1)
    res.draft_us_mean = float(np.mean(lat)) if lat else 0.0
    res.draft_us_p99 = float(np.percentile(lat, 99)) if lat else 0.0
    res.draft_us_median = float(np.median(lat)) if lat else 0.0
    res.update_s = upd
    res.accept_len_by_step = {k: v[1] / v[0] for k, v in sorted(by_step.items())}
    return res


# ------------------------------------------------------------------- batched scheduler steps
@dataclass
class Req:
    """The fields of an SGLang ``Req`` that the drafting hooks read: ``rid``, ``origin_input_ids``
    (the prompt, a list of token ids) and ``output_ids`` (tokens emitted so far)."""

    rid: str
    origin_input_ids: list[int]
    output_ids: list[int]


class SuffixStep:
    """``HartsSuffixWorker``'s hooks on CPU: before verification the worker's
    :func:`~.sglang_plugin.gather_draft_inputs` and ``corpus.batch_get`` (sync mode: no overlap
    splice); after it ``corpus.after_verify()`` (the feed's indexing, which the worker runs after
    the verify forward's launch). ``corpus``: a :class:`~.sglang_plugin.SuffixCorpus` (or a drop-in
    with the same interface, as ``suffix_ref``'s; ``gather``: the worker's input loop, default
    :func:`~.sglang_plugin.gather_draft_inputs`); completed trajectories are indexed whole at once
    (``add_trajectory``, untimed), or with ``queued`` as the server's feed does: queued, then
    indexed at most ``corpus.index_s`` (plus one slice) per step, timed as part of the step (drafts
    then depend on timing)."""

    def __init__(self, corpus, name: str = "ours", gather=None, queued: bool = False):
        from .sglang_plugin import gather_draft_inputs

        self.name, self.corpus, self.n, self.queued = name, corpus, corpus.n, queued
        self._gather = gather or gather_draft_inputs
        self._owner: dict[str, int] = {}
        self._depth = corpus.drafter.cfg.max_depth

    def draft(self, reqs: list[Req]) -> tuple[np.ndarray, np.ndarray]:
        c = self.corpus
        bs = len(reqs)
        rids, toks, totals = self._gather(c, self._owner, self._depth, reqs, [0] * (bs * self.n), [0] * bs,
                                          self.n, False)
        return c.batch_get(rids, toks, totals)

    def after_verify(self, reqs: list[Req]) -> None:
        self.corpus.after_verify()

    def depart(self, rids: list[str]) -> None:
        self.corpus.erase_match_state(rids)

    def finish(self, stream: Stream) -> None:
        if self.queued:
            self.corpus.drafter.queue_trajectory(stream.tokens, stream.group)
        else:
            self.corpus.drafter.add_trajectory(stream.tokens, stream.group)


class NgramStep:
    """``NGRAMWorker`` (SGLang 0.5.17) around its C++ ``NgramCorpus`` (defaults: trie depth 18,
    BFS breadth 10): per step ``synchronize`` + ``batch_get`` of each request's last 18 tokens,
    after verification ``batch_put`` of the same window (both timed as the step's drafting cost)."""

    def __init__(self, n: int, max_trie_depth: int = 18):
        from .sglang_plugin import _concat_last_n, ngram_corpus_cls

        self.name, self.n, self.depth = "sglang_ngram", n, max_trie_depth
        self.corpus = ngram_corpus_cls()(max_trie_depth=max_trie_depth, draft_token_num=n, max_bfs_breadth=10)
        self._cat = _concat_last_n

    def _windows(self, reqs):
        d = self.depth
        return [self._cat(list(r.origin_input_ids), list(r.output_ids[-d:]), d) for r in reqs]

    def draft(self, reqs):
        self.corpus.synchronize()
        ids, mask = self.corpus.batch_get([r.rid for r in reqs], self._windows(reqs),
                                          [len(r.origin_input_ids) + len(r.output_ids) for r in reqs])
        return np.asarray(ids), np.asarray(mask)

    def after_verify(self, reqs):
        self.corpus.batch_put(self._windows(reqs))

    def depart(self, rids):
        self.corpus.erase_match_state(rids)

    def finish(self, stream):
        pass


def parents_accept(tokens: Sequence[int], parents: Sequence[int], target: Sequence[int]) -> int:
    """Tokens accepted by greedy tree verification of a draft given as ``tokens`` and their
    ``parents`` (indices into ``tokens``, each before its child; -1: a child of the root): the
    longest root path whose tokens equal ``target``'s prefix."""
    depth, ok, best = [0] * len(tokens), [False] * len(tokens), 0
    for i, (t, p) in enumerate(zip(tokens, parents)):
        depth[i] = 1 if p < 0 else depth[p] + 1
        ok[i] = (p < 0 or ok[p]) and depth[i] <= len(target) and t == target[depth[i] - 1]
        if ok[i]:
            best = max(best, depth[i])
    return best


def tree_accept(ids: Sequence[int], mask: np.ndarray, target: Sequence[int]) -> int:
    """:func:`parents_accept` of a draft in SGLang's layout: ``ids`` ``[n]``, node 0 the root;
    ``mask`` ``[n, n]`` bool, ``mask[i, j]``: node ``j`` is ``i`` or its ancestor (unused nodes
    included, as SGLang verifies them)."""
    parent = [int(np.flatnonzero(mask[i, :i])[-1]) - 1 for i in range(1, len(ids))]   # -1: the root
    return parents_accept(list(ids[1:]), parent, target)


def draft_log_acceptance(draft_log: str, feed: str) -> dict:
    """Check a server's drafts (``$HARTS_SUFFIX_DRAFT_LOG`` of :class:`~.sglang_plugin.SuffixCorpus`)
    against the trajectories it generated (the feed's JSONL, with ``traj`` ids): each draft is
    placed in its trajectory (the rid's part before ``#``; its context's tail must match there)
    and scored as a verification against the tokens the server went on to emit: ``accepted``, the
    longest draft path equal to the trajectory's next tokens. ``emitted``: the tokens the request
    actually advanced by in that step (the next draft of the same rid starts that much later; the
    request's last step has none). Verification accepts exactly the draft path the emitted tokens
    follow, so ``emitted == accepted + 1`` for every step: ``short`` counts steps where the server
    emitted less (it lost drafted tokens that matched), ``long`` steps where it emitted more than the
    draft explains (a draft logged against the wrong context).

    Returns ``{"drafts", "placed", "unplaced", "steps" (placed drafts with a next one), "short", "long",
    "accepted_mean", "tokens_per_verify" (mean accepted + 1 over placed drafts), "emitted_mean"
    (over steps), "by_source": {source: [drafts, accepted mean]}}``."""
    from .sglang_plugin import traj_of

    trajs: dict[str, list[int]] = {}
    with open(feed) as f:
        for line in f:
            if line.strip():
                rec = json.loads(line)
                if rec.get("traj") is not None:
                    trajs[rec["traj"]] = rec["tokens"]
    rows: list[dict] = []
    with open(draft_log) as f:
        for line in f:
            if line.strip():
                rows.append(json.loads(line))
    nxt: dict[int, int] = {}                     # row -> the context length of the same rid's next row
    last: dict[str, int] = {}
    for i, r in enumerate(rows):
        if r["rid"] in last:
            nxt[last[r["rid"]]] = r["n"]
        last[r["rid"]] = i
    placed, unplaced, steps, short, long_, acc_sum, emit_sum = 0, 0, 0, 0, 0, 0, 0
    by_source: dict[str, list] = {}
    for i, r in enumerate(rows):
        toks, n, tail = trajs.get(traj_of(r["rid"]) or ""), r["n"], r["tail"]
        if toks is None or n > len(toks) or toks[n - len(tail):n] != tail:
            unplaced += 1
            continue
        placed += 1
        draft = r["draft"]
        parents = r["parents"] if r["parents"] is not None else list(range(-1, len(draft) - 1))
        acc = parents_accept(draft, parents, toks[n:])
        acc_sum += acc
        src = by_source.setdefault(r["source"] or "none", [0, 0])
        src[0] += 1
        src[1] += acc
        if i in nxt:
            steps += 1
            e = nxt[i] - n
            emit_sum += e
            short += e < acc + 1
            long_ += e > acc + 1
    return {"drafts": len(rows), "placed": placed, "unplaced": unplaced, "steps": steps, "short": short,
            "long": long_,
            "accepted_mean": acc_sum / max(placed, 1), "tokens_per_verify": 1 + acc_sum / max(placed, 1),
            "emitted_mean": emit_sum / max(steps, 1),
            "by_source": {k: [c, a / c] for k, (c, a) in sorted(by_source.items())}}


@dataclass
class StepReplayResult:
    """``steps`` (scheduler iterations), ``verifies`` (request-steps), ``emitted`` model tokens,
    ``accept_len`` (emitted / verifies); drafting cost per scheduler step ``step_us_*`` and per
    request ``req_us_*`` (step cost / batch size), microseconds; of it, ``before_us_*`` the part
    before verification (``method.draft``: on a GPU it delays the verify forward's launch) and
    ``after_us_mean`` the part after it (``method.after_verify``: on a GPU it runs while the verify
    forward computes); ``mean_bs`` (requests per step); ``drafts``: per step the ``(ids, mask)``
    returned (when ``keep``)."""

    method: str
    steps: int = 0
    verifies: int = 0
    emitted: int = 0
    accept_len: float = 0.0
    mean_bs: float = 0.0
    step_us_p50: float = 0.0
    step_us_p99: float = 0.0
    step_us_mean: float = 0.0
    req_us_p50: float = 0.0
    req_us_p99: float = 0.0
    before_us_p99: float = 0.0
    before_us_mean: float = 0.0
    after_us_mean: float = 0.0
    step_us: list = field(default_factory=list)
    before_us: list = field(default_factory=list)
    drafts: list = field(default_factory=list)


def replay_steps(method, streams: Sequence[Stream], batch: int = 8, keep: bool = False,
                 max_steps: int | None = None, clock=time.perf_counter_ns) -> StepReplayResult:
    """Replay ``streams`` as SGLang's scheduler drives a speculative worker: up to ``batch``
    trajectories at once (RL steps in order: the next step's trajectories start once the last
    step's are all done), one request per model turn (rid ``group/traj#turn-k``, prompt = the
    stream up to the turn), every scheduler step one ``method.draft(reqs)`` for all running
    requests (timed), greedy tree verification against the logged tokens, each request advancing
    by accepted + 1 tokens (never past its turn's end), ``method.after_verify`` (timed, part of the
    step), finished turns ``depart`` (untimed) and finished trajectories ``finish`` (indexed,
    untimed). A finished turn's trajectory starts its next turn at the next step. ``clock``: the
    timer in ns (wall time; ``time.process_time_ns``: the process's CPU time, all its threads,
    which leaves out the time other processes take the CPU from it on a shared machine)."""
    res = StepReplayResult(method.name)
    order = sorted(streams, key=lambda s: s.step)
    nxt = 0
    slots: list[list] = []                        # [stream, turns, turn index, req, turn end]
    bss: list[int] = []
    while True:
        # fill free slots (respecting the RL-step barrier)
        while len(slots) < batch and nxt < len(order) and \
                (not slots or all(s[0].step == order[nxt].step for s in slots)):
            st = order[nxt]
            nxt += 1
            turns = st.turns()
            if turns:
                slots.append([st, turns, -1, None, 0])
            else:
                method.finish(st)
        if not slots:
            break
        for s in slots:                            # start pending turns
            if s[3] is None:
                s[2] += 1
                a, b = s[1][s[2]]
                s[3], s[4] = Req(f"{s[0].group}/{s[0].traj_id}#turn-{s[2]}", list(s[0].tokens[:a]), []), b
        reqs = [s[3] for s in slots]
        t0 = clock()
        ids, mask = method.draft(reqs)
        dt = clock() - t0
        n = len(ids) // len(reqs)
        ids2, mask2 = np.asarray(ids).reshape(len(reqs), n), np.asarray(mask, dtype=bool).reshape(len(reqs), n, n)
        if keep:
            res.drafts.append((np.array(ids2), np.array(mask2)))
        for s, r, di, dm in zip(slots, reqs, ids2, mask2):
            toks, b = s[0].tokens, s[4]
            p = len(r.origin_input_ids) + len(r.output_ids)
            k = tree_accept(di.tolist(), dm, toks[p:b])
            e = min(k + 1, b - p)
            r.output_ids.extend(toks[p:p + e])
            res.emitted += e
        res.before_us.append(dt / 1e3)
        t0 = clock()
        method.after_verify(reqs)
        dt += clock() - t0
        res.step_us.append(dt / 1e3)
        res.steps += 1
        res.verifies += len(reqs)
        bss.append(len(reqs))
        gone, keep_slots = [], []
        for s in slots:
            r = s[3]
            if len(r.origin_input_ids) + len(r.output_ids) >= s[4]:
                gone.append(r.rid)
                s[3] = None
                if s[2] + 1 == len(s[1]):
                    method.finish(s[0])
                    continue
            keep_slots.append(s)
        if gone:
            method.depart(gone)
        slots = keep_slots
        if max_steps is not None and res.steps >= max_steps:
            break
    res.accept_len = res.emitted / max(res.verifies, 1)
    if res.step_us:
        st, per = np.asarray(res.step_us), np.asarray(res.step_us) / np.asarray(bss)
        res.mean_bs = float(np.mean(bss))
        res.step_us_p50, res.step_us_p99 = float(np.percentile(st, 50)), float(np.percentile(st, 99))
        res.step_us_mean = float(st.mean())
        res.req_us_p50, res.req_us_p99 = float(np.percentile(per, 50)), float(np.percentile(per, 99))
        bef = np.asarray(res.before_us)
        res.before_us_p99, res.before_us_mean = float(np.percentile(bef, 99)), float(bef.mean())
        res.after_us_mean = res.step_us_mean - res.before_us_mean
    return res
