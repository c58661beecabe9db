"""Plot an RL-loop result (``scripts/gpu_rl.py``'s rollout.json, or one run's ``<out>/rollout.json``):
reward, train step seconds and compression per step, one line per trainer.

    python scripts/plot_rollout.py docs/benchmarks/rollout.json docs/benchmarks/rollout.png
"""
from __future__ import annotations

import json
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

SMOOTH = 10          # steps in the reward panel's moving mean


def main(argv=None) -> int:
    src, dst = (argv or sys.argv[1:])[:2]
    d = json.load(open(src))
    runs = d["runs"] if "runs" in d else {d["rows"][0]["trainer"]: {"rows": d["rows"]}}
    fig, axes = plt.subplots(1, 4, figsize=(17, 3.6))
    panels = [("reward_mean", "reward (mean over trajectories)"), ("train_s", "train step (s)"),
              ("sync_s", "weight sync: export + push (s)"), ("data_compression", "rollout trees' compression (x)")]
    for ax, (key, title) in zip(axes, panels):
        for name, r in runs.items():
            rows = r["rows"]
            label = {"tree": "HARTS (tree-packed)", "traj": "trajectory-wise"}.get(name, name)
            xs, ys = [x["step"] for x in rows], [x.get(key) for x in rows]
            line, = ax.plot(xs, ys, marker=".", alpha=0.45 if key == "reward_mean" else 1.0, label=label)
            if key == "reward_mean" and len(ys) >= 2 * SMOOTH:     # the trend under per-step sampling noise
                k = SMOOTH
                ma = [sum(ys[i - k + 1:i + 1]) / k for i in range(k - 1, len(ys))]
                ax.plot(xs[k - 1:], ma, color=line.get_color(), lw=2, label=f"{label}, mean of {k} steps")
        ax.set_title(title, fontsize=10)
        ax.set_xlabel("RL step")
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(dst, dpi=110)
    print(f"wrote {dst}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
