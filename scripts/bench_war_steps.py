#!/usr/bin/env python
"""Drafting cost per SGLang scheduler step, as HARTS_SUFFIX's worker pays it, on CPU.

Replays logged streams (default: the H200 model's sampled code_repair episodes) as SGLang's
scheduler drives a speculative worker (``war.replay.replay_steps``): ``--batch`` trajectories at
once, one request per model turn, every step one drafting call for all running requests, greedy
tree verification against the logged tokens, each request advancing by accepted + 1 tokens.
Timed per step: the worker's hooks (before verification ``gather_draft_inputs`` and
``SuffixCorpus.batch_get``: context updates, drafting, ids/mask layout; after it
``SuffixCorpus.after_verify``: the feed's indexing, which on a GPU overlaps the verify forward;
both columns also shown apart), for

* ``ref_*``: the path before the fast context index (``war.suffix_ref``: a suffix trie per
  request's context, per-row masks), tree and chain drafts;
* ``ours_*``: the current path (``war.suffix`` / ``war.sglang_plugin``), tree and chain; the
  drafts are checked bitwise equal to ``ref_*``'s at every step (exit 1 otherwise);
* ``py_*``: the same with the drafter's compiled parts off (``war/suffix_expand.c``: all in
  Python, as with ``$HARTS_SUFFIX_NATIVE=0``); drafts checked bitwise equal to ``ours_*``'s;
* ``sglang_ngram``: SGLang 0.5.17's C++ ``NgramCorpus`` as ``NGRAMWorker`` drives it
  (``synchronize`` + ``batch_get`` before verification, ``batch_put`` after it, last 18 tokens),
  JIT-built on CPU;
* ``before_*`` (with ``--before REV``): the plugin with ``war/suffix.py`` as it was at git
  revision ``REV`` (loaded from ``git show``), tree and chain; drafts checked bitwise equal to
  ``ours_*``'s (a before/after comparison of the drafter in one run).

Completed trajectories are indexed at once, untimed (``--queued``: through the queue the
server's feed uses, indexed by ``after_verify`` within ``index_s`` per step, timed; drafts then
depend on timing, so no equality check). Numbers: microseconds per step and per request (step /
batch size), p50 / p99 / mean over all steps, the median over ``--repeats`` runs (methods
interleaved within each); ``--clock cpu`` times the process's CPU time instead of wall time.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--streams", default=str(ROOT / "docs" / "benchmarks" / "war_sampled_streams_h200model.jsonl.gz"))
    p.add_argument("--batch", type=int, default=8, help="concurrent trajectories")
    p.add_argument("--draft-tokens", type=int, default=17, help="--speculative-num-draft-tokens (root + budget)")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--methods", default="ref_tree,ours_tree,ref_chain,ours_chain,sglang_ngram")
    p.add_argument("--queued", action="store_true", help="index finished trajectories as the feed does (timed)")
    p.add_argument("--rl-steps", default=None, metavar="K,K",
                   help="replay only the streams of these RL steps (e.g. 0: empty corpora, as a run's first step)")
    p.add_argument("--out", default=None, help="write the rows as JSON here")
    p.add_argument("--before", default=None, metavar="REV",
                   help="git revision whose war/suffix.py the before_tree / before_chain methods time")
    p.add_argument("--clock", choices=("wall", "cpu"), default="wall",
                   help="wall time, or the process's CPU time (all threads: robust to other jobs on shared cores)")
    args = p.parse_args(argv)
    known = {"ref_tree", "ours_tree", "ref_chain", "ours_chain", "py_tree", "py_chain", "sglang_ngram",
             "before_tree", "before_chain"}
    bad = [m for m in args.methods.split(",") if m not in known]
    if bad:
        p.error(f"--methods: unknown {', '.join(bad)} (known: {', '.join(sorted(known))})")
    if any(m.startswith("before_") for m in args.methods.split(",")) and not args.before:
        p.error("--methods before_*: needs --before REV (the git revision of war/suffix.py to time)")
    if args.batch < 1 or args.draft_tokens < 2 or args.repeats < 1:
        p.error("--batch and --repeats must be >= 1 and --draft-tokens >= 2 (the root and one draft token)")

    import numpy as np

    from megatron_harts.rollout.war import suffix
    from megatron_harts.rollout.war.replay import NgramStep, SuffixStep, load_streams, replay_steps
    from megatron_harts.rollout.war.sglang_plugin import SuffixCorpus, draft_config, sglang_site
    from megatron_harts.rollout.war.suffix_ref import RefSuffixCorpus, ref_gather_draft_inputs

    try:
        streams = load_streams(args.streams)
    except ValueError as e:
        p.error(f"--streams: {e}")
    if args.rl_steps is not None:
        try:
            keep = {int(x) for x in args.rl_steps.split(",")}
        except ValueError:
            p.error(f"--rl-steps: comma list of integers, got {args.rl_steps!r}")
        streams = [s for s in streams if s.step in keep]
        if not streams:
            p.error(f"--rl-steps {args.rl_steps}: no stream of {args.streams} is in these steps")
    n = args.draft_tokens
    before = _suffix_at(args.before, p) if args.before else None

    def make(name: str):
        if name == "sglang_ngram":
            sglang_site()
            return NgramStep(n)
        kind, shape = name.split("_")
        if kind == "ref":
            return SuffixStep(RefSuffixCorpus(n, draft_config(n, shape), feed=""), name, ref_gather_draft_inputs,
                              queued=args.queued)
        corpus = SuffixCorpus(n, draft_config(n, shape), feed="")
        if kind == "before":
            corpus.drafter = before.SuffixDrafter(corpus.drafter.cfg)
        return SuffixStep(corpus, name, queued=args.queued)

    rows, drafts = [], {}
    for rep in range(args.repeats):
        for name in args.methods.split(","):
            compiled = suffix.native()
            if name.startswith("py_"):           # the compiled parts off for this method only
                suffix._NATIVE = None
            try:
                r = replay_steps(make(name), streams, batch=args.batch, keep=not args.queued and rep == 0,
                                 clock=time.process_time_ns if args.clock == "cpu" else time.perf_counter_ns)
            finally:
                suffix._NATIVE = compiled
            if r.drafts:
                drafts[name] = r.drafts
            rows.append({"method": name, "repeat": rep, "steps": r.steps, "mean_batch": round(r.mean_bs, 2),
                         "accept_len": round(r.accept_len, 3), "step_us_p50": r.step_us_p50,
                         "step_us_p99": r.step_us_p99, "step_us_mean": r.step_us_mean, "req_us_p50": r.req_us_p50,
                         "req_us_p99": r.req_us_p99, "before_us_p99": r.before_us_p99,
                         "before_us_mean": r.before_us_mean, "after_us_mean": r.after_us_mean})
            print(json.dumps({k: (round(v, 1) if isinstance(v, float) else v) for k, v in rows[-1].items()}), flush=True)
    ok = True
    for shape in ("tree", "chain"):
        for other in ("ref", "before", "py"):
            a, b = drafts.get(f"{other}_{shape}"), drafts.get(f"ours_{shape}")
            if a is not None and b is not None:
                same = len(a) == len(b) and all(np.array_equal(x[0], y[0]) and np.array_equal(x[1], y[1])
                                                for x, y in zip(a, b))
                print(f"{shape}: drafts of ours vs {other} over {len(a)} steps: "
                      f"{'bitwise equal' if same else 'DIFFER'}")
                ok &= same
    print(f"\n| method | steps | mean batch | tokens/verify | step us p50 / p99 / mean | per request us p50 / p99 "
          f"| before verify us p99 / mean | after verify us mean |")
    print("|---|---:|---:|---:|---|---|---|---:|")
    summary = []
    for name in args.methods.split(","):
        rs = [r for r in rows if r["method"] == name]
        med = {k: statistics.median(r[k] for r in rs) for k in ("step_us_p50", "step_us_p99", "step_us_mean",
                                                                 "req_us_p50", "req_us_p99", "before_us_p99",
                                                                 "before_us_mean", "after_us_mean")}
        summary.append(dict(method=name, steps=rs[0]["steps"], mean_batch=rs[0]["mean_batch"],
                            accept_len=rs[0]["accept_len"], **med))
        print(f"| {name} | {rs[0]['steps']} | {rs[0]['mean_batch']} | {rs[0]['accept_len']} | "
              f"{med['step_us_p50']:.0f} / {med['step_us_p99']:.0f} / {med['step_us_mean']:.0f} | "
              f"{med['req_us_p50']:.0f} / {med['req_us_p99']:.0f} | {med['before_us_p99']:.0f} / "
              f"{med['before_us_mean']:.0f} | {med['after_us_mean']:.0f} |")
    if args.out:
        Path(args.out).write_text(json.dumps({"command": " ".join(sys.argv), "streams": args.streams,
                                              "before": args.before, "clock": args.clock, "batch": args.batch,
                                              "queued": args.queued,
                                              "summary": summary,
                                              "runs": rows, "date": time.strftime("%Y-%m-%d")}, indent=1))
    return 0 if ok else 1


def _suffix_at(rev: str, p: argparse.ArgumentParser):
    """``megatron_harts.rollout.war.suffix`` as it was at git revision ``rev``, as a module of its
    own (``suffix_before``)."""
    import subprocess
    import types

    r = subprocess.run(["git", "-C", str(ROOT), "show", f"{rev}:megatron_harts/rollout/war/suffix.py"],
                       capture_output=True, text=True)
    if r.returncode != 0:
        p.error(f"--before {rev}: {r.stderr.strip() or 'git show failed'}")
    mod = types.ModuleType("suffix_before")
    sys.modules[mod.__name__] = mod               # dataclasses look their module up
    exec(compile(r.stdout, f"{rev}:megatron_harts/rollout/war/suffix.py", "exec"), mod.__dict__)
    return mod


if __name__ == "__main__":
    sys.exit(main())
