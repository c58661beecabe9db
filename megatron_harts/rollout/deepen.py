"""A checkpoint with the same outputs and the decode cost of a deeper model.

Speculation pays when a turn's time is decode: a large model's one-token forward is slow and
a verification of ``k`` draft tokens costs about the same. The models that can be made here
(:mod:`~megatron_harts.rollout.text_model`, ~28M parameters, minutes of training) write
text-like output, but with decode CUDA graphs their one-token forward is a few hundred
microseconds, and a low-load step is dominated by sandboxed tool calls, prefills and HTTP
(docs/war.md, H200 runs 3-4). A deeper model cannot be trained to the same quality in the
device time at hand, and random weights accept no draft.

:func:`deepen_checkpoint` appends ``factor - 1`` copies of a Qwen3-Next checkpoint's layer stack
after its own layers, with every block's output projection set to zero (attention ``o_proj``,
GDN ``out_proj``, the MLP's / every expert's / the shared expert's ``down_proj``). Each appended
layer still runs its norms, projections, recurrences, attention, router and experts on real
weights (the same kernels, the same expert routing as the layer it copies), but adds an exact
zero to the residual stream, so the deepened model's logits equal the original's bit for bit in
any precision: same tokens, same log-probs, same acceptance of any drafter, with ``factor``
times the per-layer work of every forward. What it emulates is a model whose decode costs
``factor`` times as much; what it does not emulate is a wider model's memory traffic per layer.

    python -m megatron_harts.rollout.deepen SRC DST --factor 8

``SRC``: a Hugging Face ``Qwen3NextForCausalLM`` directory (``config.json`` + safetensors, as
:func:`~megatron_harts.rollout.weight_sync.save_hf_checkpoint` writes); the layer count must
be a multiple of ``full_attention_interval`` so that the copies keep the attention pattern
(SGLang derives layer kinds from the interval, not from ``layer_types``).
"""
from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path
from typing import Iterator

import torch

__all__ = ["deepen_checkpoint", "OUTPUT_PROJECTIONS"]

# The projections whose output is added to the residual stream: zero in an appended layer.
OUTPUT_PROJECTIONS = re.compile(r"\.(self_attn\.o_proj|linear_attn\.out_proj|mlp(\.experts(\.\d+)?|\.shared_expert)?"
                                r"\.down_proj)(\.weight)?$")
_LAYER = re.compile(r"^model\.layers\.(\d+)\.(.+)$")


class DeepenError(ValueError):
    """A checkpoint that cannot be deepened (one line, naming the file and field)."""


def _read_state(src: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    files = sorted(src.glob("*.safetensors"))
    if not files:
        raise DeepenError(f"{src}: no *.safetensors files")
    state: dict[str, torch.Tensor] = {}
    for f in files:
        state.update(load_file(str(f)))
    return state


def _deepened(state: dict[str, torch.Tensor], num_layers: int, factor: int) -> Iterator[tuple[str, torch.Tensor]]:
    yield from state.items()
    for copy in range(1, factor):
        for name, t in state.items():
            m = _LAYER.match(name)
            if not m:
                continue
            layer, rest = int(m.group(1)), m.group(2)
            new = f"model.layers.{copy * num_layers + layer}.{rest}"
            yield new, torch.zeros_like(t) if OUTPUT_PROJECTIONS.search(new) else t


def deepen_checkpoint(src: str | Path, dst: str | Path, factor: int, *, overwrite: bool = False) -> dict:
    """Write ``dst``: ``src``'s model with ``factor`` times its layers, the appended ones adding
    zero (module docstring). Returns ``{"layers": [old, new], "params": [old, new],
    "zeroed": n}``: layer counts, parameter counts and the number of zeroed tensors. Raises
    :class:`DeepenError` (one line) on a checkpoint it cannot deepen."""
    from .weight_sync import save_hf_checkpoint

    src, dst = Path(src), Path(dst)
    if factor < 1:
        raise DeepenError(f"factor: {factor} (must be >= 1)")
    cfg_file = src / "config.json"
    try:
        cfg = json.loads(cfg_file.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise DeepenError(f"{cfg_file}: {e}") from None
    if cfg.get("model_type") != "qwen3_next":
        raise DeepenError(f"{cfg_file}: model_type {cfg.get('model_type')!r} (expected 'qwen3_next')")
    n, interval = int(cfg["num_hidden_layers"]), int(cfg.get("full_attention_interval", 4))
    if n % interval:
        raise DeepenError(f"{cfg_file}: num_hidden_layers {n} is not a multiple of full_attention_interval "
                          f"{interval} (the copies would change the attention pattern)")
    if cfg.get("mlp_only_layers"):
        raise DeepenError(f"{cfg_file}: mlp_only_layers {cfg['mlp_only_layers']} (not supported)")
    state = _read_state(src)
    found = {int(m.group(1)) for m in map(_LAYER.match, state) if m}
    if found != set(range(n)):
        raise DeepenError(f"{src}: the safetensors hold layers {sorted(found)}, config.json says {n}")
    new_cfg = dict(cfg, num_hidden_layers=n * factor)
    if "layer_types" in cfg:
        new_cfg["layer_types"] = list(cfg["layer_types"]) * factor
    zeroed = 0
    params = 0

    def counted():
        nonlocal zeroed, params
        for name, t in _deepened(state, n, factor):
            if _LAYER.match(name) and int(_LAYER.match(name).group(1)) >= n and OUTPUT_PROJECTIONS.search(name):
                zeroed += 1
            params += t.numel()
            yield name, t

    dtype = cfg.get("dtype") or cfg.get("torch_dtype")
    save_hf_checkpoint(dst, counted(), new_cfg, version=f"deepened-x{factor}", dtype=dtype, overwrite=overwrite,
                       warn_sglang=False)
    for extra in ("generation_config.json",):
        if (src / extra).exists():
            (dst / extra).write_text((src / extra).read_text())
    old_params = sum(t.numel() for t in state.values())
    return {"layers": [n, n * factor], "params": [old_params, params], "zeroed": zeroed}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m megatron_harts.rollout.deepen", description=__doc__.split("\n\n")[0])
    p.add_argument("src", help="Qwen3-Next Hugging Face checkpoint directory")
    p.add_argument("dst", help="output directory")
    p.add_argument("--factor", type=int, default=8, help="layer multiple (1: a copy)")
    p.add_argument("--overwrite", action="store_true")
    args = p.parse_args(argv)
    try:
        info = deepen_checkpoint(args.src, args.dst, args.factor, overwrite=args.overwrite)
    except (DeepenError, FileExistsError) as e:
        print(f"deepen: {e}", file=sys.stderr)
        return 2
    print(json.dumps(info))
    return 0


if __name__ == "__main__":
    sys.exit(main())
