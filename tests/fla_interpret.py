"""Run fla's Triton kernels on CPU through Triton's interpreter (tests only).

Call :func:`enable` before anything imports fla. Two adaptations: autotuners keep their
first config (the interpreter cannot benchmark), and loop counters of plain ``range`` loops
inside fla kernels get Triton's ``.to(dtype)`` (compiled Triton gives them tensor type; the
interpreter gives Python ints).
"""
from __future__ import annotations

import builtins
import os
import sys


class _Int(int):
    def to(self, dtype, **kw):
        from triton.runtime.interpreter import _implicit_cvt
        return _implicit_cvt(int(self)).to(dtype, **kw)


class _Range:
    def __init__(self, *args):
        self._r = builtins.range(*args)

    def __iter__(self):
        return (_Int(i) for i in self._r)

    def __len__(self):
        return len(self._r)

    def __getitem__(self, i):
        return self._r[i]


def enable() -> None:
    """Switch Triton to its interpreter and patch fla as described above (idempotent)."""
    if any(m == "fla" or m.startswith("fla.") for m in sys.modules) and os.environ.get("TRITON_INTERPRET") != "1":
        raise RuntimeError("fla was imported before fla_interpret.enable(); its kernels are already compiled")
    os.environ["TRITON_INTERPRET"] = "1"
    import triton.runtime.autotuner as autotuner

    if not getattr(autotuner.Autotuner, "_harts_first_config", False):
        init = autotuner.Autotuner.__init__

        def first_config(self, fn, arg_names, configs, *args, **kw):
            init(self, fn, arg_names, configs[:1], *args, **kw)

        autotuner.Autotuner.__init__ = first_config
        autotuner.Autotuner._harts_first_config = True
    import fla.ops  # noqa: F401  (imports the kernel modules)
    import fla.modules  # noqa: F401

    for name, mod in list(sys.modules.items()):
        if mod is not None and (name.startswith("fla.ops") or name.startswith("fla.modules")):
            mod.range = _Range
