"""Test-only launcher: runs ``scripts/pretrain_hybrid_harts.py`` (Megatron's real ``pretrain`` loop)
on CPU with gloo, for ``tests/test_pretrain_cpu.py``.

Megatron's training loop assumes CUDA throughout (init asserts it, ``device="cuda"`` literals,
streams/events, RNG, memory stats, the optimizer's ``torch.cuda.*`` type checks). This module fakes
those CUDA entry points before running the script unchanged; the model runs through
``megatron_harts.megatron.cpu_shim`` with the torch (reference) backends of the tree ops. Nothing
here is imported by the package: it only exists to exercise the entry point's glue (arguments,
data iterator, ``forward_step`` / ``loss_func`` contract, logging) where no GPU is available.
With ``HARTS_GRADS_OUT=FILE`` the first step's reduced gradients are saved there (``torch.save``).

    python -m torch.distributed.run ... tests/megatron_cpu_launch.py scripts/pretrain_hybrid_harts.py ARGS
"""
import contextlib
import os
import runpy
import sys

import torch
from torch.overrides import TorchFunctionMode

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from megatron_harts.megatron import cpu_shim  # noqa: E402


def _cpu(device):
    if (isinstance(device, str) and device.startswith("cuda")) or (isinstance(device, torch.device)
                                                                  and device.type == "cuda"):
        return torch.device("cpu")
    return device


class CudaToCpu(TorchFunctionMode):
    """``device="cuda"`` arguments (and ``tensor.to("cuda")``) land on the CPU."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        if "device" in kwargs:
            kwargs["device"] = _cpu(kwargs["device"])
        if func is torch.Tensor.to and len(args) > 1:
            args = (args[0], _cpu(args[1])) + tuple(args[2:])
        return func(*args, **kwargs)


class _Stream:
    def __init__(self, *a, **k):
        pass

    def wait_stream(self, *a, **k):
        pass

    def wait_event(self, *a, **k):
        pass

    def synchronize(self):
        pass

    def record_event(self, *a, **k):
        return _Event()


class _Event(_Stream):
    def record(self, *a, **k):
        pass

    def query(self):
        return True

    def elapsed_time(self, other):
        return 0.0


def fake_cuda():
    """Patch the CUDA entry points Megatron's training loop touches (this process only)."""
    cuda = torch.cuda
    real_available = cuda.is_available
    for name, fn in dict(is_available=lambda: True, is_current_stream_capturing=lambda: False,
                         device_count=lambda: 1, set_device=lambda *a, **k: None,
                         synchronize=lambda *a, **k: None, empty_cache=lambda *a, **k: None,
                         current_stream=lambda *a, **k: _Stream(), default_stream=lambda *a, **k: _Stream(),
                         stream=lambda *a, **k: contextlib.nullcontext(), Stream=_Stream, Event=_Event,
                         get_rng_state=lambda *a, **k: torch.get_rng_state(),
                         set_rng_state=lambda state, *a, **k: torch.set_rng_state(state),
                         manual_seed=lambda *a, **k: None, reset_peak_memory_stats=lambda *a, **k: None,
                         memory_stats=lambda *a, **k: {}, mem_get_info=lambda *a, **k: (1 << 34, 1 << 35),
                         memory_allocated=lambda *a, **k: 0, max_memory_allocated=lambda *a, **k: 0,
                         memory_reserved=lambda *a, **k: 0, max_memory_reserved=lambda *a, **k: 0).items():
        setattr(cuda, name, fn)
    torch.nn.Module.cuda = lambda self, device=None: self
    torch.Tensor.cuda = lambda self, *a, **k: self
    torch.Tensor.record_stream = lambda self, *a, **k: None
    cpu_type = torch.Tensor.type

    def tensor_type(self, *a, **k):       # the optimizer checks for torch.cuda.* tensor types
        t = cpu_type(self, *a, **k)
        if not a and not k and isinstance(t, str) and t.startswith("torch.") and not t.startswith("torch.cuda."):
            return "torch.cuda." + t[len("torch."):]
        return t
    torch.Tensor.type = tensor_type

    from megatron.core import tensor_parallel
    import megatron.training.training as training
    tensor_parallel.model_parallel_cuda_manual_seed = lambda seed, *a, **k: cpu_shim.cpu_manual_seed(seed)
    training.set_jit_fusion_options = lambda *a, **k: None      # warms up fused kernels on "cuda"
    initialize = training.initialize_megatron

    def initialize_megatron(*a, **k):     # claim CUDA only for Megatron's init (dynamo probes it later)
        out = initialize(*a, **k)
        cuda.is_available = real_available
        return out
    training.initialize_megatron = initialize_megatron
    grads_out = os.environ.get("HARTS_GRADS_OUT")
    if grads_out:
        finalize = training.finalize_model_grads

        def finalize_model_grads(model, *a, **k):     # the first step's reduced gradients, for the test
            out = finalize(model, *a, **k)
            if not os.path.exists(grads_out):
                torch.save({n: (p.main_grad if getattr(p, "main_grad", None) is not None else p.grad).float().clone()
                            for n, p in model[0].named_parameters()}, grads_out)
            return out
        training.finalize_model_grads = finalize_model_grads


if __name__ == "__main__":
    cpu_shim.enable_cpu_megatron()
    fake_cuda()
    CudaToCpu().__enter__()
    script = sys.argv[1]
    sys.argv = sys.argv[1:]
    runpy.run_path(script, run_name="__main__")
