"""Save fla's Triton autotuning results so the next process (or machine) skips autotuning.

fla (0.6) can load kernel configs from ``$FLA_CONFIG_DIR/{kernel}.json`` when ``FLA_CACHE_MODE``
is ``strict`` / ``fuzzy`` / ``full`` (read once, when fla is imported). A fresh GPU machine
otherwise spends minutes benchmarking every config of every GDN kernel. After a run,
:func:`save_fla_autotune` writes what this process tuned in that format (merged into existing
files); afterwards::

    FLA_CACHE_MODE=fuzzy FLA_CONFIG_DIR=configs/fla/H200 python scripts/bench_e2e.py ...
"""
from __future__ import annotations

import gc
import json
import logging
import os

log = logging.getLogger(__name__)


def add_save_fla_configs_arg(parser) -> None:
    """``--save-fla-configs DIR`` for the GPU scripts (they call :func:`save_fla_autotune` after each step)."""
    parser.add_argument("--save-fla-configs", metavar="DIR", help="write fla autotuning results there after each "
                        "step (reuse: FLA_CACHE_MODE=fuzzy FLA_CONFIG_DIR=DIR)")


def _config_dict(cfg) -> dict:
    return {"kwargs": dict(cfg.kwargs), "num_warps": cfg.num_warps, "num_stages": cfg.num_stages,
            "num_ctas": cfg.num_ctas, "maxnreg": cfg.maxnreg}


def _live_instances(cls) -> list:
    """Objects of ``cls`` tracked by the garbage collector (dead weak proxies among them, e.g.
    Megatron's, raise ``ReferenceError`` on ``isinstance`` and are skipped)."""
    out = []
    for o in gc.get_objects():
        try:
            if isinstance(o, cls):
                out.append(o)
        except ReferenceError:
            continue
    return out


def save_fla_autotune(out_dir: str) -> int:
    """Write the best config of every (fla kernel, tuning key) tuned in this process into
    ``out_dir/{kernel}.json`` (fla's ``autotune_entries`` format). Returns the number of entries."""
    from fla.ops.utils.cache import AutotuneKey, CachedAutotuner

    os.makedirs(out_dir, exist_ok=True)
    n = 0
    for tuner in _live_instances(CachedAutotuner):
        if not tuner.cache:
            continue
        path = os.path.join(out_dir, f"{tuner.kernel_name}.json")
        data = {"kernel_name": tuner.kernel_name, "autotune_entries": {}}
        if os.path.exists(path):
            with open(path) as f:
                data = json.load(f)
        for key, cfg in tuner.cache.items():
            data["autotune_entries"][AutotuneKey.key_hash(key)] = {
                "autotune_key": AutotuneKey.normalize_autotune_key(key), "config": _config_dict(cfg)}
            n += 1
        with open(path, "w") as f:
            json.dump(data, f, indent=1, sort_keys=True)
    log.info("saved %d fla autotune entries to %s", n, out_dir)
    return n
