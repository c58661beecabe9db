#!/usr/bin/env python
"""Summarise py-spy's collapsed stacks (``py-spy record --format raw --threads``, as
``bench_war.py --py-spy`` writes them for each low-load server) side by side.

For each file: the busiest thread (the SGLang scheduler's loop), its sampled seconds (samples /
``--rate``), the inclusive seconds of the functions named by ``--match`` (a frame whose function
name contains the string; each sample counted once per name), and the ``--top`` functions by self
time (the sample's innermost frame, by function and file). Seconds are CPU-busy samples (py-spy
leaves idle threads out), so two servers that ran the same steps compare directly.

    python scripts/py_spy_summary.py war_h200/py_spy_suffix.txt war_h200/py_spy_ngram.txt --rate 250
"""
from __future__ import annotations

import argparse
import re
import sys
from collections import Counter
from pathlib import Path

DEFAULT_MATCH = ("event_loop_normal,forward_batch_generation,_prepare_for_speculative_decoding,"
                 "_prepare_draft_tokens,batch_get,_update_ngram_corpus,process_batch_result,"
                 "get_next_batch_to_run,recv_requests,forward_extend,replay,capture")
_FRAME = re.compile(r"^(?P<func>.*?) \((?P<file>[^()]*?)(?::\d+)?\)$")


def parse(text: str) -> dict[str, Counter]:
    """``{thread: Counter({stack tuple (outermost first, process and thread frames removed): samples})}``.
    A line is ``frame;frame;...;frame COUNT``; process frames (``process PID:"cmd"``, whose command
    may span lines) and the thread frame (``thread (0x...)``) are recognised by their prefix."""
    threads: dict[str, Counter] = {}
    buf = ""
    for raw in text.splitlines():
        buf = f"{buf}\n{raw}" if buf else raw
        m = re.search(r" (\d+)$", buf)
        if not m:
            continue                            # a process command line spanning lines
        frames, count = buf[:m.start()].split(";"), int(m.group(1))
        buf = ""
        thread, stack = "?", []
        for f in frames:
            if f.startswith("process ") or f.startswith("\"") or f == "":
                continue
            if f.startswith("thread ("):
                thread = f
                continue
            stack.append(f)
        threads.setdefault(thread, Counter())[tuple(stack)] += count
    return threads


def func_name(frame: str) -> str:
    m = _FRAME.match(frame)
    return m.group("func") if m else frame


def short(frame: str) -> str:
    m = _FRAME.match(frame)
    if not m:
        return frame
    parts = m.group("file").split("/")
    return f"{m.group('func')} ({'/'.join(parts[-2:])})"


def summarise(path: Path, rate: float, match: list[str], top: int) -> dict:
    threads = parse(path.read_text(errors="replace"))
    if not threads:
        return {"file": str(path), "samples": 0}
    name, stacks = max(threads.items(), key=lambda kv: sum(kv[1].values()))
    total = sum(stacks.values())
    incl = {m: 0 for m in match}
    self_t: Counter = Counter()
    for st, c in stacks.items():
        names = [func_name(f) for f in st]
        for m in match:
            if any(m in n for n in names):
                incl[m] += c
        if st:
            self_t[short(st[-1])] += c
    return {"file": str(path), "thread": name, "samples": total, "seconds": total / rate,
            "other_threads_s": (sum(sum(c.values()) for c in threads.values()) - total) / rate,
            "inclusive_s": {m: incl[m] / rate for m in match},
            "self_s": [(f, c / rate) for f, c in self_t.most_common(top)]}


def children(path: Path, rate: float, target: str, top: int) -> tuple[float, list[tuple[str, float]]]:
    """Inclusive seconds of the first frame (outermost) whose function name ends with ``target``
    on the busiest thread, and the same split by the frame it calls (``(self)``: samples inside it)."""
    threads = parse(path.read_text(errors="replace"))
    if not threads:
        return 0.0, []
    _, stacks = max(threads.items(), key=lambda kv: sum(kv[1].values()))
    total, by = 0, Counter()
    for st, c in stacks.items():
        i = next((i for i, f in enumerate(st) if func_name(f).endswith(target)), None)
        if i is None:
            continue
        total += c
        by[short(st[i + 1]) if i + 1 < len(st) else "(self)"] += c
    return total / rate, [(f, c / rate) for f, c in by.most_common(top)]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("files", nargs="+", type=Path)
    p.add_argument("--rate", type=float, default=250.0, help="py-spy's -r (samples per second)")
    p.add_argument("--match", default=DEFAULT_MATCH, help="comma list of function-name substrings")
    p.add_argument("--top", type=int, default=20)
    p.add_argument("--children", default="", help="comma list of function names (a suffix, e.g. "
                   "NGRAMWorker.forward_batch_generation): each one's seconds split by the frame it calls")
    args = p.parse_args(argv)
    for f in args.files:
        if not f.is_file():
            p.error(f"{f}: no such file")
    match = [m for m in args.match.split(",") if m]
    rows = [summarise(f, args.rate, match, args.top) for f in args.files]
    names = [Path(r["file"]).stem for r in rows]
    print("| function (inclusive, s) | " + " | ".join(names) + " |")
    print("|---|" + "---:|" * len(rows))
    print("| busiest thread, all | " + " | ".join(f"{r.get('seconds', 0):.2f}" for r in rows) + " |")
    print("| other threads | " + " | ".join(f"{r.get('other_threads_s', 0):.2f}" for r in rows) + " |")
    for m in match:
        print(f"| {m} | " + " | ".join(f"{r.get('inclusive_s', {}).get(m, 0):.2f}" for r in rows) + " |")
    for target in [t for t in args.children.split(",") if t]:
        for f, n in zip(args.files, names):
            tot, split = children(f, args.rate, target, args.top)
            print(f"\n{n}: {target} {tot:.2f} s, by the frame it calls (s)")
            for fr, sec in split:
                print(f"  {sec:8.2f}  {fr}")
    for r, n in zip(rows, names):
        print(f"\n{n}: top self time (s)")
        for fr, s in r.get("self_s", []):
            print(f"  {s:8.2f}  {fr}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
