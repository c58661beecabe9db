"""Weight sync trainer -> rollout engines: Megatron ``HybridModel`` -> Hugging Face checkpoint on
disk -> every engine's ``update_weights_from_disk``.

Typical use in the RL loop::

    from megatron_harts.rollout.weight_sync import WeightSync, tiny_qwen3_next_config

    hf_config = tiny_qwen3_next_config(moe=True, dtype="bfloat16")   # or the model's config dict
    sync = WeightSync(hf_config, "/dev/shm/harts_ckpt", keep=2)
    path, stats = sync.export(megatron_model, version="step-12")   # GPU/bf16 params are fine
    sync.push(engines, path, "step-12")                            # Engine.update_weights_from_disk
    # or both: stats = sync.sync(megatron_model, "step-12", engines)

What is written (:func:`save_hf_checkpoint`) is the layout ``save_pretrained`` writes and
``from_pretrained`` / SGLang load: ``config.json`` (``architectures: ["Qwen3NextForCausalLM"]``,
``model_type``, ``dtype`` / ``torch_dtype``, ``layer_types`` and the legacy keys SGLang's own
Qwen3-Next config reads: ``full_attention_interval``, ``rope_theta``,
``partial_rotary_factor``), safetensors shards of at most ``bucket_mb`` each
(``model-0000k-of-0000N.safetensors``, per-expert MoE weights as in released checkpoints;
``lm_head.weight`` also when tied, because SGLang's Qwen3-Next never ties it) with
``model.safetensors.index.json``, and ``harts_version.json`` (the version tag). The directory
is written under a temporary name next to its final one and renamed when complete, so an engine
never sees a half-written checkpoint.

Conversion streams (:func:`megatron_harts.megatron.convert.iter_megatron_to_hf`): one HF decoder
layer is converted on the parameters' device, copied to host memory in the checkpoint dtype and
appended to the current bucket; a full bucket is written and dropped. Host memory holds about
one bucket plus one layer.

SGLang compatibility (0.5.17's ``Qwen3NextForCausalLM``): every layer is built as MoE (it ignores
``mlp_only_layers`` and needs ``num_experts > 0``), and the layer types come from
``full_attention_interval`` only. :func:`sglang_incompatibilities` lists what a config breaks;
:func:`save_hf_checkpoint` logs it. transformers' ``Qwen3NextForCausalLM`` (the embedded engine)
loads every config.

Faster paths, not implemented: SGLang's ``/update_weights_from_tensor`` (tensors handed over in
GPU memory, same node: no disk, no host copy) and ``/update_weights_from_distributed`` (NCCL
broadcast from the trainer ranks to the engines' ranks). On GPU they avoid the device -> host copy
and the safetensors write / read that dominate this path; the conversion
(:func:`~megatron_harts.megatron.convert.iter_megatron_to_hf` with ``layout="checkpoint"``) is the
same and yields per-layer buckets ready for them.
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import re
import shutil
import sys
import tempfile
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Iterable, Iterator, Mapping, Sequence

import torch

logger = logging.getLogger(__name__)

__all__ = ["SyncStats", "WeightSync", "save_hf_checkpoint", "tiny_qwen3_next_config", "small_qwen3_next_config",
           "qwen3_next_preset", "model_config", "hf_config_json", "sglang_incompatibilities", "read_version",
           "VERSION_FILE", "INDEX_FILE", "PRESETS"]

VERSION_FILE = "harts_version.json"
INDEX_FILE = "model.safetensors.index.json"
LATEST_FILE = "LATEST"
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


# ---------------------------------------------------------------------------------------------
# Configs
# ---------------------------------------------------------------------------------------------

def _layer_types(num_layers: int, interval: int) -> list[str]:
    return ["linear_attention" if (i + 1) % interval else "full_attention" for i in range(num_layers)]


def tiny_qwen3_next_config(vocab_size: int = 264, hidden_size: int = 64, num_layers: int = 4, moe: bool = False,
                           **overrides) -> dict[str, Any]:
    """``Qwen3NextConfig`` kwargs of a tiny model: 3 Gated DeltaNet : 1 gated attention (the
    release's ratio, ``full_attention_interval = 4``), GDN 2 key / 4 value heads of 16, attention
    4 query / 2 KV heads of 16 with partial RoPE 0.25, SwiGLU ``2 * hidden``; ``moe``: every layer
    MoE with 4 experts top-2 (renormalised) of ``hidden / 2`` plus a gated shared expert of
    ``hidden`` (servable by SGLang; the dense variant is not, see
    :func:`sglang_incompatibilities`). ``overrides`` are applied last; giving
    ``full_attention_interval`` recomputes ``layer_types``. The vocabulary (264) is
    :class:`~megatron_harts.rollout.tokenizer.ByteTokenizer`'s.
    """
    cfg: dict[str, Any] = dict(
        model_type="qwen3_next", vocab_size=vocab_size, hidden_size=hidden_size, intermediate_size=2 * hidden_size,
        num_hidden_layers=num_layers, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
        linear_conv_kernel_dim=4, linear_key_head_dim=16, linear_value_head_dim=16, linear_num_key_heads=2,
        linear_num_value_heads=4, hidden_act="silu", rms_norm_eps=1e-6, max_position_embeddings=4096,
        initializer_range=0.02, tie_word_embeddings=False, attention_bias=False, attention_dropout=0.0,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25},
        decoder_sparse_step=1, mlp_only_layers=[], full_attention_interval=4, dtype="float32",
        bos_token_id=1, eos_token_id=2, pad_token_id=0)
    if moe:
        cfg.update(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=hidden_size // 2,
                   shared_expert_intermediate_size=hidden_size, norm_topk_prob=True)
    else:
        cfg.update(num_experts=0, num_experts_per_tok=1, moe_intermediate_size=0, shared_expert_intermediate_size=0)
    return _finish_config(cfg, overrides)


def small_qwen3_next_config(moe: bool = False, **overrides) -> dict[str, Any]:
    """A 77.3M (dense) / 91.5M (``moe``) parameter Qwen3-Next for GPU runs: hidden 768, 12 layers
    (9 GDN : 3 gated attention), GDN 4 key / 8 value heads of 64, attention 12 query / 2 KV heads
    of 64, partial RoPE 0.25, SwiGLU 2048; ``moe``: 8 experts top-2 of 256 plus a shared expert of
    512 in every layer. bf16 checkpoints; vocabulary 264 (the byte tokenizer)."""
    cfg = tiny_qwen3_next_config(vocab_size=264, hidden_size=768, num_layers=12, moe=False)
    cfg.update(intermediate_size=2048, num_attention_heads=12, num_key_value_heads=2, head_dim=64,
               linear_key_head_dim=64, linear_value_head_dim=64, linear_num_key_heads=4, linear_num_value_heads=8,
               max_position_embeddings=32768, dtype="bfloat16")
    if moe:
        cfg.update(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=256,
                   shared_expert_intermediate_size=512, norm_topk_prob=True)
    return _finish_config(cfg, overrides)


def qwen3_next_preset(name: str, moe: bool = False, **overrides) -> dict[str, Any]:
    """``"tiny"`` (:func:`tiny_qwen3_next_config`, CPU tests) or ``"small"``
    (:func:`small_qwen3_next_config`, GPU)."""
    if name == "tiny":
        return tiny_qwen3_next_config(moe=moe, **overrides)
    if name == "small":
        return small_qwen3_next_config(moe=moe, **overrides)
    raise ValueError(f"unknown preset {name!r} (tiny, small)")


PRESETS = ("tiny", "tiny-moe", "small", "small-moe")


def model_config(spec: str, check: bool = False, **overrides) -> dict[str, Any]:
    """``Qwen3NextConfig`` kwargs from a preset name (``tiny``, ``tiny-moe``, ``small``,
    ``small-moe``; SGLang serves only the ``-moe`` ones) or a path to a ``config.json`` (or a
    checkpoint directory holding one); ``overrides`` are applied last. ``check``: also map it to
    Megatron (``convert.hf_config_to_megatron``), so a config with missing or unsupported fields
    fails here with a ``ValueError`` naming the file and field instead of later in the trainer."""
    name = str(spec)
    if name in PRESETS:
        base, _, moe = name.partition("-")
        return qwen3_next_preset(base, moe=bool(moe), **overrides)
    path = Path(name)
    if path.is_dir():
        path = path / "config.json"
    if not path.is_file():
        raise ValueError(f"model {spec!r}: neither a preset {PRESETS} nor a config.json path")
    try:
        cfg = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{path}: not valid JSON ({e})") from e
    if cfg.get("model_type", "qwen3_next") != "qwen3_next":
        raise ValueError(f"{path}: model_type {cfg.get('model_type')!r}, only qwen3_next is supported")
    cfg = dict(cfg, **overrides)
    if check:
        from ..megatron.convert import hf_config_to_megatron
        try:
            hf_config_to_megatron(cfg)
        except NotImplementedError as e:
            raise ValueError(f"{path}: {e}") from e
        except (KeyError, TypeError) as e:
            raise ValueError(f"{path}: missing or invalid field ({type(e).__name__}: {e})") from e
    return cfg


def _finish_config(cfg: dict[str, Any], overrides: Mapping[str, Any]) -> dict[str, Any]:
    cfg = dict(cfg, **overrides)
    if "layer_types" not in overrides:
        cfg["layer_types"] = _layer_types(cfg["num_hidden_layers"], cfg["full_attention_interval"])
    return cfg


def _attention_interval(layer_types: Sequence[str]) -> int | None:
    """The ``full_attention_interval`` that generates ``layer_types``, or None."""
    for k in range(1, len(layer_types) + 1):
        if list(layer_types) == _layer_types(len(layer_types), k):
            return k
    return None


def sglang_incompatibilities(hf_config: Mapping[str, Any]) -> list[str]:
    """Why SGLang's (0.5.17) Qwen3-Next would not serve this config as transformers does (empty:
    servable): it builds every layer as MoE and derives the layer types from
    ``full_attention_interval`` alone."""
    hf_config = _as_dict(hf_config)
    bad = []
    if not hf_config.get("num_experts"):
        bad.append("num_experts = 0 (SGLang builds every layer as MoE)")
    if hf_config.get("mlp_only_layers"):
        bad.append("mlp_only_layers (SGLang ignores them)")
    if hf_config.get("decoder_sparse_step", 1) != 1:
        bad.append("decoder_sparse_step != 1 (SGLang ignores it)")
    types = hf_config.get("layer_types")
    if types is not None and _attention_interval(types) is None:
        bad.append("layer_types is not a full_attention_interval pattern")
    return bad


def _as_dict(hf_config) -> dict[str, Any]:
    """A ``Qwen3NextConfig`` (object) or its kwargs / ``to_dict()`` as a plain dict."""
    if isinstance(hf_config, Mapping):
        return dict(hf_config)
    if hasattr(hf_config, "to_dict"):
        return hf_config.to_dict()
    raise TypeError(f"hf_config must be a dict or a Qwen3NextConfig, got {type(hf_config).__name__}")


def _dtype_name(dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _config_dtype(hf_config: Mapping[str, Any]) -> torch.dtype | None:
    name = hf_config.get("dtype") or hf_config.get("torch_dtype")
    if name is None or name == "auto":
        return None
    name = _dtype_name(name)
    if name not in _DTYPES:
        raise ValueError(f"unsupported checkpoint dtype {name!r} ({sorted(_DTYPES)})")
    return _DTYPES[name]


def hf_config_json(hf_config: Mapping[str, Any], dtype: torch.dtype | None = None) -> dict[str, Any]:
    """The ``config.json`` written for ``hf_config`` (``Qwen3NextConfig`` kwargs or ``to_dict()``):
    transformers' full ``to_dict()`` where transformers is importable (defaults filled in), plus
    ``architectures``, ``model_type``, ``dtype`` and ``torch_dtype``, ``layer_types``, and the keys
    SGLang's own config class reads (``full_attention_interval``, ``rope_theta``,
    ``partial_rotary_factor``)."""
    cfg = _as_dict(hf_config)
    try:
        from transformers import Qwen3NextConfig        # configuration only (no modeling import)

        kwargs = {k: v for k, v in cfg.items() if k not in ("architectures", "transformers_version", "torch_dtype")}
        out = Qwen3NextConfig(**kwargs).to_dict()
    except ImportError:
        out = cfg
    out = {k: v for k, v in out.items() if k not in ("torch_dtype",)}
    out["architectures"] = ["Qwen3NextForCausalLM"]
    out["model_type"] = "qwen3_next"
    if dtype is None:
        dtype = _config_dtype(cfg)
    if dtype is not None:
        out["dtype"] = out["torch_dtype"] = _dtype_name(dtype)
    n = out["num_hidden_layers"]
    types = cfg.get("layer_types") or out.get("layer_types") or _layer_types(n, cfg.get("full_attention_interval", 4))
    out["layer_types"] = list(types)
    interval = _attention_interval(types)
    if interval is not None:
        out["full_attention_interval"] = interval
    else:
        out.pop("full_attention_interval", None)
    rp = dict(out.get("rope_parameters") or cfg.get("rope_parameters") or {})
    out["rope_theta"] = float(rp.get("rope_theta", cfg.get("rope_theta", 10000.0)))
    out["partial_rotary_factor"] = float(rp.get("partial_rotary_factor", cfg.get("partial_rotary_factor", 1.0)))
    if rp:
        out["rope_parameters"] = rp
    return out


# ---------------------------------------------------------------------------------------------
# Writing a checkpoint
# ---------------------------------------------------------------------------------------------

@dataclass
class SyncStats:
    """Cost of one export / sync.

    ``bytes``: tensor bytes written (checkpoint dtype); ``num_buckets``: safetensors shards;
    ``convert_s``: Megatron -> HF layout (on the parameters' device; on GPU the kernels run
    asynchronously, so part of their time lands in ``gather_s``); ``gather_s``: device -> host
    copy and cast to the checkpoint dtype; ``write_s``: safetensors + json writes and the rename;
    ``seconds``: wall time of the export (all of the above, plus ``wait_s``: the GPU work still
    queued by the caller when the export began, waited for first so it is not counted as
    gathering); ``push_s``: wall time of
    :meth:`WeightSync.push` (all engines in parallel), ``engine_s``: each engine's reported load
    time.
    """

    bytes: int = 0
    num_buckets: int = 0
    convert_s: float = 0.0
    gather_s: float = 0.0
    write_s: float = 0.0
    seconds: float = 0.0
    wait_s: float = 0.0
    push_s: float = 0.0
    engine_s: dict[str, float] = field(default_factory=dict)
    version: str | None = None
    path: str | None = None

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def _checkpoint_layout(named: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
    """Model layout -> on-disk layout: fused ``experts.gate_up_proj`` / ``experts.down_proj``
    become one ``Linear`` per expert. Names already in the on-disk layout pass through."""
    for name, t in named:
        if name.endswith("mlp.experts.gate_up_proj"):
            base = name[: -len("gate_up_proj")]
            for e in range(t.shape[0]):
                gate, up = t[e].chunk(2, 0)
                yield f"{base}{e}.gate_proj.weight", gate
                yield f"{base}{e}.up_proj.weight", up
        elif name.endswith("mlp.experts.down_proj"):
            base = name[: -len("down_proj")]
            for e in range(t.shape[0]):
                yield f"{base}{e}.down_proj.weight", t[e]
        else:
            yield name, t


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def save_hf_checkpoint(out_dir, hf_state_dict: Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]],
                       hf_config: Mapping[str, Any], *, bucket_mb: float = 256, version: str,
                       dtype: torch.dtype | str | None = None, overwrite: bool = False, fsync: bool = False,
                       warn_sglang: bool = True, _stats: SyncStats | None = None) -> SyncStats:
    """Write a Hugging Face ``Qwen3NextForCausalLM`` checkpoint directory, atomically.

    ``hf_state_dict``: a mapping or an iterable of ``(name, tensor)`` (e.g.
    ``convert.iter_megatron_to_hf(...)``: consumed lazily, one bucket at a time), in the model
    layout (fused experts) or the on-disk layout; written in the on-disk layout (with
    ``lm_head.weight`` whenever given, tied or not: SGLang loads it, transformers re-ties).
    Tensors may live on any device; they are copied to host memory and cast to ``dtype``
    (default: the config's ``dtype`` / ``torch_dtype``, else kept). ``bucket_mb``: the most
    tensor bytes per safetensors shard (a single larger tensor gets a shard of its own). ``version``: the tag written to
    ``harts_version.json`` (and the safetensors metadata).

    The directory is assembled as ``.<name>.tmp-<id>`` beside ``out_dir`` and renamed to
    ``out_dir`` when complete; on an error the temporary directory is removed and ``out_dir`` is
    untouched. An existing ``out_dir`` raises ``FileExistsError`` unless ``overwrite`` (then the
    old one is renamed aside and removed after the swap: between the two renames a reader finds
    no directory, never a partial one; :class:`WeightSync` writes a new directory per version).
    A process killed mid-write leaves its ``.<name>.tmp-<pid>-<id>`` directory behind. ``fsync``: flush every file before the
    rename (crash safety; readers on the same machine do not need it). ``warn_sglang``: log
    what SGLang could not serve (:func:`sglang_incompatibilities`).
    """
    from safetensors.torch import save_file

    hf_config = _as_dict(hf_config)
    t_start = time.perf_counter()
    stats = _stats if _stats is not None else SyncStats()
    stats.version = version
    out_dir = Path(out_dir)
    if out_dir.exists() and not overwrite:
        raise FileExistsError(f"checkpoint directory {out_dir} exists (overwrite=False)")
    if isinstance(dtype, str):
        dtype = _DTYPES[_dtype_name(dtype)]
    if dtype is None:
        dtype = _config_dtype(hf_config)
    if bucket_mb <= 0:
        raise ValueError(f"bucket_mb must be > 0, got {bucket_mb}")
    limit = int(bucket_mb * 2 ** 20)
    problems = sglang_incompatibilities(hf_config) if warn_sglang else []
    if problems:
        logger.warning("checkpoint %s: SGLang's Qwen3-Next cannot serve this config: %s", out_dir, "; ".join(problems))
    named = hf_state_dict.items() if isinstance(hf_state_dict, Mapping) else hf_state_dict
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = out_dir.parent / f".{out_dir.name}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    tmp.mkdir()
    write_s = gather_s = 0.0
    try:
        shard_files: list[Path] = []
        weight_map: dict[str, int] = {}
        bucket: dict[str, torch.Tensor] = {}
        size = total = 0
        meta = {"format": "pt", "harts_version": str(version)}

        def flush():
            nonlocal bucket, size, write_s
            if not bucket:
                return
            t0 = time.perf_counter()
            f = tmp / f"shard-{len(shard_files):05d}.tmp"
            save_file(bucket, str(f), metadata=meta)
            if fsync:
                with open(f, "rb") as fh:
                    os.fsync(fh.fileno())
            shard_files.append(f)
            bucket, size = {}, 0
            storages.clear()
            write_s += time.perf_counter() - t0

        it = iter(_checkpoint_layout(named))
        storages: set[int] = set()          # storages in the current bucket
        while True:
            t0 = time.perf_counter()
            try:
                name, t = next(it)              # the producer's time: conversion (Megatron -> HF)
            except StopIteration:
                break
            t1 = time.perf_counter()
            stats.convert_s += t1 - t0
            if not isinstance(t, torch.Tensor):
                raise TypeError(f"HF weight {name!r} is a {type(t).__name__}, not a tensor")
            if name in weight_map or name in bucket:
                raise ValueError(f"HF weight {name!r} given twice")
            t = t.detach()
            if t.device.type != "cpu" and dtype is not None and t.dtype != dtype:
                t = t.to(dtype)             # cast on the device: fewer bytes over PCIe (same rounding)
            if t.device.type != "cpu" or (dtype is not None and t.dtype != dtype):
                t = t.to("cpu", dtype or t.dtype)
            # own storage per tensor: safetensors refuses tensors sharing memory (views of one
            # weight, a tied lm_head)
            if not t.is_contiguous():
                t = t.contiguous()
            elif (t.untyped_storage().nbytes() != t.numel() * t.element_size()
                  or t.untyped_storage().data_ptr() in storages):
                t = t.clone()
            gather_s += time.perf_counter() - t1
            nbytes = t.numel() * t.element_size()
            if bucket and size + nbytes > limit:
                flush()
            if nbytes > limit:
                logger.warning("HF weight %s (%.1f MB) exceeds bucket_mb=%g: written as its own shard",
                               name, nbytes / 2 ** 20, bucket_mb)
            bucket[name] = t
            storages.add(t.untyped_storage().data_ptr())
            weight_map[name] = len(shard_files)
            size += nbytes
            total += nbytes
        flush()
        if not shard_files:
            raise ValueError("no weights to write")
        t0 = time.perf_counter()
        n = len(shard_files)
        names = [f"model-{k + 1:05d}-of-{n:05d}.safetensors" for k in range(n)]
        for f, nm in zip(shard_files, names):
            f.rename(tmp / nm)
        index = {"metadata": {"total_size": total, "harts_version": str(version)},
                 "weight_map": {k: names[v] for k, v in sorted(weight_map.items())}}
        (tmp / INDEX_FILE).write_text(json.dumps(index, indent=2))
        (tmp / "config.json").write_text(json.dumps(hf_config_json(hf_config, dtype), indent=2, sort_keys=True))
        (tmp / VERSION_FILE).write_text(json.dumps(
            {"version": str(version), "created": time.time(), "bytes": total, "num_shards": n,
             "dtype": _dtype_name(dtype) if dtype is not None else None}, indent=2))
        if fsync:
            _fsync_dir(tmp)
        old = None
        if out_dir.exists():                       # overwrite: move the old one aside, then swap
            old = out_dir.parent / f".{out_dir.name}.old-{uuid.uuid4().hex[:8]}"
            out_dir.rename(old)
        tmp.rename(out_dir)
        if fsync:
            _fsync_dir(out_dir.parent)
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
        write_s += time.perf_counter() - t0
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    stats.bytes, stats.num_buckets = total, n
    stats.gather_s += gather_s
    stats.write_s += write_s
    stats.seconds += time.perf_counter() - t_start
    stats.path = str(out_dir)
    logger.info("wrote %s (version %s): %.1f MB in %d shard(s); convert %.3fs, gather %.3fs, write %.3fs",
                out_dir, version, total / 2 ** 20, n, stats.convert_s, stats.gather_s, stats.write_s)
    return stats


def read_version(path) -> str | None:
    """The version tag of a checkpoint directory written by :func:`save_hf_checkpoint`."""
    f = Path(path) / VERSION_FILE
    return json.loads(f.read_text())["version"] if f.exists() else None


# ---------------------------------------------------------------------------------------------
# The trainer side
# ---------------------------------------------------------------------------------------------

def _unwrap(model):
    """``model`` without DDP / ``Float16Module`` wrappers (``.module`` chains); a one-element
    list of model chunks is accepted."""
    if isinstance(model, (list, tuple)):
        if len(model) != 1:
            raise NotImplementedError(f"{len(model)} model chunks (virtual pipeline): only one is exported")
        model = model[0]
    while hasattr(model, "module") and isinstance(getattr(model, "module"), torch.nn.Module):
        model = model.module
    return model


def _check_unsharded() -> None:
    try:
        from megatron.core import parallel_state as ps
    except ImportError:
        return
    if ps.model_parallel_is_initialized():
        sizes = {"TP": ps.get_tensor_model_parallel_world_size(), "PP": ps.get_pipeline_model_parallel_world_size(),
                 "EP": ps.get_expert_model_parallel_world_size()}
        bad = {k: v for k, v in sizes.items() if v > 1}
        if bad:
            raise NotImplementedError(f"weight sync gathers TP = PP = EP = 1 models only, got {bad}")


def _safe_name(version: str) -> str:
    s = re.sub(r"[^A-Za-z0-9._-]", "_", str(version))
    if not s or s.startswith("."):
        s = "v" + s
    return s


def push_weights(engines: Sequence[Any], path, version: str, *, raise_on_error: bool = True,
                 stats: SyncStats | None = None) -> dict[str, float]:
    """Call ``engine.update_weights_from_disk(path, version)`` on every engine, in parallel
    threads; returns ``{engine name: seconds it reported}``. Engines that fail are logged;
    with ``raise_on_error`` a ``RuntimeError`` naming each failed engine is raised after all
    finished. ``stats`` (e.g. from :meth:`WeightSync.export`) receives ``push_s`` / ``engine_s``."""
    path = str(path)
    if not engines:
        return {}
    names, seen = [], {}
    for i, e in enumerate(engines):
        n = str(getattr(e, "name", None) or f"engine{i}")
        seen[n] = seen.get(n, 0) + 1
        names.append(n if seen[n] == 1 else f"{n}#{seen[n]}")
    t0 = time.perf_counter()

    def one(e):
        s = time.perf_counter()
        reported = e.update_weights_from_disk(path, version)
        return float(reported) if reported is not None else time.perf_counter() - s

    times: dict[str, float] = {}
    errors: dict[str, BaseException] = {}
    with ThreadPoolExecutor(max_workers=min(32, len(engines))) as pool:
        futs = {n: pool.submit(one, e) for n, e in zip(names, engines)}
        for n, f in futs.items():
            try:
                times[n] = f.result()
            except Exception as exc:      # noqa: BLE001 - collected and re-raised below
                errors[n] = exc
                logger.error("engine %s: update_weights_from_disk(%s, %s) failed: %s", n, path, version, exc)
    wall = time.perf_counter() - t0
    if stats is not None:
        stats.push_s, stats.engine_s = wall, dict(times)
    logger.info("push %s to %d engine(s): %.3fs wall (%s)", version, len(engines), wall,
                ", ".join(f"{n} {s:.3f}s" for n, s in times.items()))
    if errors and raise_on_error:
        raise RuntimeError(f"weight update to {version} failed on {len(errors)}/{len(engines)} engine(s): "
                           + "; ".join(f"{n}: {type(e).__name__}: {e}" for n, e in errors.items()))
    return times


class WeightSync:
    """Export a Megatron model as an HF checkpoint and make the rollout engines load it.

    ``hf_config``: ``Qwen3NextConfig`` kwargs / ``to_dict()`` of the model (what
    :func:`~megatron_harts.megatron.convert.hf_config_to_megatron` built it from); its ``dtype``
    (or ``torch_dtype``) is the checkpoint dtype unless ``dtype`` is given (default: the
    parameters' own). ``out_root``: where version directories ``out_root/<version>`` go (a
    tmpfs such as ``/dev/shm`` saves the disk round trip on one machine; engines on other
    machines need a shared file system). ``keep``: checkpoint directories kept (the newest by
    creation time, among those in ``out_root`` holding ``harts_version.json``); older ones are
    deleted after each export. ``out_root/LATEST`` names the newest directory.
    """

    def __init__(self, hf_config: Mapping[str, Any], out_root, keep: int = 2, *, bucket_mb: float = 256,
                 dtype: torch.dtype | str | None = None, fsync: bool = False):
        if keep < 1:
            raise ValueError(f"keep must be >= 1, got {keep}")
        from megatron_harts.megatron.convert import hf_config_to_megatron

        self.hf_config = _as_dict(hf_config)
        self.args = hf_config_to_megatron(self.hf_config)       # validates the config early
        self.out_root = Path(out_root)
        self.keep, self.bucket_mb, self.fsync = keep, bucket_mb, fsync
        if isinstance(dtype, str):
            dtype = _DTYPES[_dtype_name(dtype)]
        self.dtype = dtype if dtype is not None else _config_dtype(self.hf_config)
        self.history: list[SyncStats] = []
        problems = sglang_incompatibilities(self.hf_config)
        if problems:
            logger.warning("SGLang's Qwen3-Next cannot serve this model (transformers can): %s", "; ".join(problems))
        self._lock = threading.Lock()

    def path_for(self, version: str) -> Path:
        return self.out_root / _safe_name(version)

    def export(self, megatron_model_or_state_dict, version: str) -> tuple[str, SyncStats]:
        """Write ``out_root/<version>`` from a Megatron ``HybridModel`` (possibly wrapped in DDP /
        ``Float16Module``, parameters on GPU, bf16) or its state dict; returns ``(path, stats)``.

        Conversion runs per HF layer on the parameters' device; each converted tensor is copied
        to host memory in the checkpoint dtype (the zero-centred norm shift ``w - 1`` is done
        in fp32 before the cast). Re-exporting a version replaces its directory atomically.
        Call it when the parameters hold the new weights (after the optimizer step and, with
        the distributed optimizer's overlapped parameter all-gather, after that gather).
        """
        from megatron_harts.megatron.convert import iter_megatron_to_hf

        with self._lock:
            t0 = time.perf_counter()
            stats = SyncStats(version=str(version))
            src = megatron_model_or_state_dict
            if isinstance(src, Mapping):
                named = src.items()
            else:
                _check_unsharded()
                named = _unwrap(src).named_parameters()
            if torch.cuda.is_available() and torch.cuda.is_initialized():
                t_w = time.perf_counter()
                torch.cuda.synchronize()
                stats.wait_s = time.perf_counter() - t_w
            path = self.path_for(version)
            with torch.no_grad():
                hf_iter = iter_megatron_to_hf(named, self.hf_config, layout="checkpoint")
                save_hf_checkpoint(path, hf_iter, self.hf_config, bucket_mb=self.bucket_mb, version=str(version),
                                   dtype=self.dtype, overwrite=True, fsync=self.fsync, warn_sglang=False,
                                   _stats=stats)
            self._write_latest(path)
            self._cleanup(keep_path=path)
            stats.seconds = time.perf_counter() - t0
            self.history.append(stats)
            logger.info("export %s: %.1f MB, %d bucket(s), %.3fs (wait %.3f, convert %.3f, gather %.3f, write %.3f)",
                        version, stats.bytes / 2 ** 20, stats.num_buckets, stats.seconds, stats.wait_s,
                        stats.convert_s, stats.gather_s, stats.write_s)
            return str(path), stats

    def push(self, engines: Sequence[Any], path, version: str, *, raise_on_error: bool = True,
             stats: SyncStats | None = None) -> dict[str, float]:
        """:func:`push_weights`."""
        return push_weights(engines, path, version, raise_on_error=raise_on_error, stats=stats)

    def sync(self, megatron_model_or_state_dict, version: str, engines: Sequence[Any] = ()) -> SyncStats:
        """:meth:`export` then :meth:`push`; returns the stats of both."""
        path, stats = self.export(megatron_model_or_state_dict, version)
        self.push(engines, path, version, stats=stats)
        return stats

    # -- housekeeping -------------------------------------------------------------------------

    def checkpoints(self) -> list[Path]:
        """Checkpoint directories in ``out_root`` (those with ``harts_version.json``), oldest first."""
        if not self.out_root.is_dir():
            return []
        found = []
        for d in self.out_root.iterdir():
            f = d / VERSION_FILE
            if d.is_dir() and not d.name.startswith(".") and f.is_file():
                try:
                    created = float(json.loads(f.read_text()).get("created", 0.0))
                except (OSError, ValueError):
                    created = f.stat().st_mtime
                found.append((created, d.name, d))
        return [d for _, _, d in sorted(found)]

    def _cleanup(self, keep_path: Path) -> None:
        dirs = [d for d in self.checkpoints() if d != keep_path]
        for d in dirs[: max(0, len(dirs) - (self.keep - 1))]:
            logger.info("removing old checkpoint %s", d)
            shutil.rmtree(d, ignore_errors=True)

    def _write_latest(self, path: Path) -> None:
        tmp = self.out_root / f".{LATEST_FILE}.{uuid.uuid4().hex[:8]}"
        tmp.write_text(path.name + "\n")
        os.replace(tmp, self.out_root / LATEST_FILE)


# ---------------------------------------------------------------------------------------------
# Benchmark: python -m megatron_harts.rollout.weight_sync --preset small [--moe] [--device cuda]
# ---------------------------------------------------------------------------------------------

def _bench(argv: Sequence[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description="time WeightSync.export on a random Megatron model")
    p.add_argument("--preset", default="tiny", choices=["tiny", "small"])
    p.add_argument("--moe", action="store_true")
    p.add_argument("--dtype", default=None, help="checkpoint dtype (default: the preset's)")
    p.add_argument("--param-dtype", default="float32", help="Megatron parameter dtype")
    p.add_argument("--device", default="cpu")
    p.add_argument("--out", default=None, help="output root (default: a temporary directory)")
    p.add_argument("--bucket-mb", type=float, default=256)
    p.add_argument("--repeats", type=int, default=3)
    a = p.parse_args(argv)
    from megatron_harts.megatron import convert, cpu_shim

    cfg = qwen3_next_preset(a.preset, moe=a.moe, **({"dtype": a.dtype} if a.dtype else {}))
    args = convert.hf_config_to_megatron(cfg)
    root = a.out or tempfile.mkdtemp(prefix="harts_ws_")
    t0 = time.perf_counter()
    with cpu_shim.cpu_megatron(seed=0):          # built on the host, then moved
        model = convert.build_megatron_model(args)
    model = model.to(a.device, _DTYPES[a.param_dtype])
    build_s = time.perf_counter() - t0
    nparams = sum(p_.numel() for p_ in model.parameters())
    sync = WeightSync(cfg, root, keep=2, bucket_mb=a.bucket_mb)
    runs = []
    for r in range(a.repeats):
        _, st = sync.export(model, f"bench-{r}")
        runs.append(st.to_dict())
    res = {"preset": a.preset, "moe": a.moe, "params": nparams, "param_dtype": a.param_dtype,
           "ckpt_dtype": _dtype_name(sync.dtype) if sync.dtype else a.param_dtype, "device": a.device,
           "build_s": build_s, "runs": runs}
    print(json.dumps(res, indent=1))
    best = min(runs, key=lambda s: s["seconds"])
    print(f"{a.preset}{'-moe' if a.moe else ''}: {nparams / 1e6:.1f}M params, {best['bytes'] / 2 ** 20:.1f} MB "
          f"{res['ckpt_dtype']}, {best['num_buckets']} bucket(s): export {best['seconds']:.3f}s (convert "
          f"{best['convert_s']:.3f}, gather {best['gather_s']:.3f}, write {best['write_s']:.3f}) -> {root}")
    if a.out is None:
        shutil.rmtree(root, ignore_errors=True)
    return res


if __name__ == "__main__":
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
    _bench()
