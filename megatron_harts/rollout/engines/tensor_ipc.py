"""Named tensors handed to another process without copying them: CUDA IPC on a GPU, shared memory on CPU.

The wire format is SGLang's ``MultiprocessingSerializer.serialize(named_tensors, output_str=True)``
(``sglang/srt/utils``): a list ``[(name, tensor), ...]`` pickled with
:class:`multiprocessing.reduction.ForkingPickler` (torch registers its reductions there) and
base64-encoded, one string per tensor-parallel rank: the body SGLang's
``POST /update_weights_from_tensor`` takes in ``serialized_named_tensors``, and the body the
embedded engine's endpoint of that name takes.

What crosses is a *handle*, not the data:

* a CUDA tensor becomes a CUDA IPC handle of its allocation (``cudaIpcGetMemHandle``, torch's
  ``rebuild_cuda_tensor``): the receiver maps the sender's device memory; the sender must keep the
  tensor alive while any receiver may still open the handle (the weight keeper does: it owns them);
* a CPU tensor is moved to POSIX shared memory under torch's ``file_system`` sharing strategy (a
  named segment in ``/dev/shm``, torch's ``rebuild_storage_filename``): unlike the default
  ``file_descriptor`` strategy, whose descriptors are passed over a socket authenticated with the
  sending process's ``multiprocessing`` authkey, it works between unrelated processes (a keeper and
  an engine server started separately).

:func:`deserialize_named_tensors` unpickles with an allow-list (torch's rebuild functions, tensor,
storage, dtype and size types, plain containers): a body posted to a server endpoint is not trusted
to run arbitrary code on unpickling.

:func:`fingerprint` is an exact, order-independent checksum of tensors' bytes (per tensor: the sum
of its bytes read as int32, in int64, or as uint8 when the size is not a multiple of 4), used to
check that kept weights are intact.
"""
from __future__ import annotations

import base64
import builtins
import io
import logging
import pickle
from typing import Iterable, Sequence

log = logging.getLogger(__name__)

_SAFE_BUILTINS = frozenset({"list", "tuple", "dict", "set", "frozenset", "str", "bytes", "int", "float", "bool",
                            "complex", "slice", "NoneType", "bytearray"})


class UnsafePayload(ValueError):
    """A serialized payload names something the allow-list refuses to load."""


def _torch():
    import torch
    import torch.multiprocessing.reductions  # noqa: F401 - registers torch's ForkingPickler reductions
    return torch


def share_cpu_tensors_between_processes() -> None:
    """Use torch's ``file_system`` sharing strategy in this process (see the module doc): CPU tensors
    serialized afterwards go through named shared-memory segments any local process can map."""
    import torch.multiprocessing as mp
    if mp.get_sharing_strategy() != "file_system":
        mp.set_sharing_strategy("file_system")


def serialize_named_tensors(named: Sequence[tuple[str, object]], tp_size: int = 1) -> list[str]:
    """``[(name, tensor)]`` -> ``tp_size`` copies of one base64 string (SGLang's format, see the
    module doc). CPU tensors are moved to shared memory (``file_system`` strategy) first."""
    from multiprocessing.reduction import ForkingPickler

    torch = _torch()
    if tp_size < 1:
        raise ValueError(f"tp_size must be >= 1, got {tp_size}")
    named = [(str(n), t) for n, t in named]
    for n, t in named:
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{n}: expected a torch.Tensor, got {type(t).__name__}")
    if any(not t.is_cuda for _, t in named):
        share_cpu_tensors_between_processes()
    buf = io.BytesIO()
    ForkingPickler(buf).dump(named)
    s = base64.b64encode(buf.getvalue()).decode("ascii")
    return [s] * tp_size


class _AllowListUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str):
        torch = _torch()
        ok = False
        if module == "builtins":
            ok = name in _SAFE_BUILTINS
        elif module == "torch.multiprocessing.reductions":
            ok = name.startswith("rebuild_")
        elif module in ("torch", "torch.storage"):
            obj = getattr(torch, name, None) if module == "torch" else None
            ok = (name in ("Tensor", "Size", "device", "UntypedStorage", "TypedStorage") or name.endswith("Storage")
                  or isinstance(obj, torch.dtype))
        elif module == "torch._utils":
            ok = name in ("_rebuild_tensor", "_rebuild_tensor_v2")
        if not ok:
            raise UnsafePayload(f"serialized tensors name {module}.{name}, which is not on the allow-list")
        if module == "builtins":
            return getattr(builtins, name)
        return super().find_class(module, name)


def deserialize_named_tensors(data: str | bytes) -> list[tuple[str, object]]:
    """One element of ``serialized_named_tensors`` -> ``[(name, tensor)]`` (mapped, not copied:
    CUDA tensors alias the sender's device memory, CPU tensors its shared-memory segments).
    Raises :class:`UnsafePayload` for anything outside the allow-list and ``ValueError`` for a
    payload that is not base64 / a pickle of ``[(str, Tensor)]``."""
    torch = _torch()
    try:
        raw = base64.b64decode(data, validate=True) if isinstance(data, str) else bytes(data)
    except (ValueError, TypeError) as e:
        raise ValueError(f"serialized tensors are not base64: {e}") from None
    try:
        obj = _AllowListUnpickler(io.BytesIO(raw)).load()
    except UnsafePayload:
        raise
    except Exception as e:       # noqa: BLE001 - a truncated pickle, a segment that no longer exists, ...
        raise ValueError(f"serialized tensors could not be opened: {type(e).__name__}: {e}") from None
    if isinstance(obj, dict):
        obj = list(obj.items())
    if not isinstance(obj, list) or not all(isinstance(x, tuple) and len(x) == 2 and isinstance(x[0], str)
                                            and isinstance(x[1], torch.Tensor) for x in obj):
        raise ValueError("serialized tensors must be a list of (name, tensor) pairs")
    return obj


def fingerprint(tensors: Iterable[object]) -> list[int]:
    """Per tensor, an exact checksum of its bytes (see the module doc); computed on the tensor's
    device (a GPU reduction for CUDA tensors), returned as Python ints."""
    torch = _torch()
    out = []
    for t in tensors:
        t = t.detach().contiguous().reshape(-1)
        b = t.view(torch.uint8)
        if b.numel() % 4 == 0:
            out.append(int(b.view(torch.int32).sum(dtype=torch.int64)))
        else:
            out.append(int(b.sum(dtype=torch.int64)))
    return out
