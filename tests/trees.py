"""Random and hand-made rollout trees hitting the corner cases of
docs/design.md#12-numerical-contract-and-verification."""
from __future__ import annotations

import numpy as np
from hypothesis import strategies as st


def _tokens(draw, n, vocab):
    return draw(st.lists(st.integers(0, vocab - 1), min_size=n, max_size=n))


@st.composite
def trajectory_sets(draw, chunk_size: int, max_traj: int = 8, max_chunks: int = 4, vocab: int = 6):
    """Token lists built by branching earlier ones, preferring positions kC-1, kC, kC+1; also
    duplicates, leaves ending inside another path, unrelated roots, long chains."""
    C = chunk_size
    max_len = max_chunks * C + 2
    trajs = [_tokens(draw, draw(st.integers(1, max_len)), vocab)]
    for _ in range(draw(st.integers(0, max_traj - 1))):
        base = trajs[draw(st.integers(0, len(trajs) - 1))]
        kind = draw(st.sampled_from(["branch", "branch", "branch", "dup", "prefix", "fresh"]))
        if kind == "dup":
            new = list(base)
        elif kind == "prefix":
            new = base[:draw(st.integers(1, len(base)))]
        elif kind == "fresh":
            new = _tokens(draw, draw(st.integers(1, max_len)), vocab)
        else:
            k = draw(st.integers(0, len(base) // C))
            p = draw(st.sampled_from([k * C - 1, k * C, k * C + 1, draw(st.integers(0, len(base)))]))
            p = min(max(p, 0), len(base))
            new = base[:p] + _tokens(draw, draw(st.integers(1 if p == 0 else 0, max_len - p + 1)) or 1, vocab)
            new = new or base[:1]
        trajs.append(new)
    return trajs


def deep_tree(C: int, levels: int = 24, seed: int = 0) -> list[list[int]]:
    """Each trajectory branches off the previous one a little deeper: ``levels`` branch levels."""
    rng = np.random.default_rng(seed)
    trajs = [rng.integers(0, 50, size=levels * 3 + C).tolist()]
    for j in range(1, levels):
        p = 3 * j + (j % 3) - 1  # branch points walk across chunk boundaries
        trajs.append(trajs[-1][:p] + rng.integers(50, 100, size=3 + C // 2).tolist())
    return trajs


def wide_tree(C: int, children: int = 120, seed: int = 0) -> list[list[int]]:
    """``children`` trajectories sharing a prefix of C + 1 tokens (branch one past a boundary)."""
    rng = np.random.default_rng(seed)
    prefix = rng.integers(0, 50, size=C + 1).tolist()
    return [prefix + [50 + (i % 40), int(rng.integers(0, 50))] + rng.integers(0, 50, size=i % 5).tolist()
            for i in range(children)]


def corner_cases(C: int) -> dict[str, list[list[int]]]:
    rng = np.random.default_rng(1)
    base = rng.integers(0, 40, size=3 * C + 5).tolist()
    alt = lambda n: rng.integers(40, 80, size=n).tolist()
    return {
        "on_boundary": [base, base[:C] + alt(C + 3)],
        "one_past": [base, base[:C + 1] + alt(5)],
        "one_before": [base, base[:C - 1] + alt(2 * C)],
        "long_chain": [rng.integers(0, 40, size=7 * C + 3).tolist()],
        "single": [base],
        "ends_inside": [base, base[:2 * C + 3], base[:C]],
        "duplicates": [base, list(base), base[:C + 2] + alt(4)],
        "multi_root": [base, alt(C + 2), base[:1] + alt(3)],
        "deep": deep_tree(C),
        "wide": wide_tree(C),
    }


def random_trees(seed: int, chunk_size: int, vocab: int, num_trees: int = 3,
                 branches: tuple[int, int] = (0, 6)) -> list[list[list[int]]]:
    """Token lists of ``num_trees`` trees, each a root trajectory plus ``branches`` (half-open
    range) branches at random points."""
    C = chunk_size
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(num_trees):
        trajs = [rng.integers(0, vocab, int(rng.integers(1, 4 * C))).tolist()]
        for _ in range(int(rng.integers(*branches))):
            base = trajs[int(rng.integers(len(trajs)))]
            p = int(rng.integers(0, len(base) + 1))
            trajs.append(base[:p] + rng.integers(0, vocab, int(rng.integers(1 if p == 0 else 0, 2 * C))).tolist())
        out.append(trajs)
    return out
