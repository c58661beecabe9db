"""Task families over sandboxes: ``make_env(family, task_index, seed, **kw)`` -> an
:class:`~megatron_harts.rollout.types.Environment`; ``list_families()``.

* ``lookup`` (:mod:`.lookup`): cat the requested file and repeat its digits; learnable in minutes.
* ``code_repair`` (:mod:`.code_repair`): fix a mutated standard-library function until its tests pass.

Shared turn parsing and the episode loop are in :mod:`.base`; the sandbox in
:mod:`megatron_harts.rollout.sandbox`.
"""
from . import code_repair, lookup  # noqa: F401  (registers the families)
from .base import (SandboxEnv, TaskFamily, Turn, escape_markup, get_family, list_families, make_env,
                   parse_turn, register_family, task_dir)
from .code_repair import CodeRepairEnv
from .lookup import LookupEnv

__all__ = ["SandboxEnv", "TaskFamily", "Turn", "escape_markup", "get_family", "list_families", "make_env",
           "parse_turn", "register_family", "task_dir", "CodeRepairEnv", "LookupEnv"]
