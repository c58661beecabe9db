"""Inference engines for the rollout side.

One client, :class:`HttpEngine`, speaks SGLang's native HTTP API (token ids in and out); two
servers speak it: SGLang itself on a GPU (:class:`SGLangServer`, started with
``--skip-tokenizer-init``) and the embedded transformers engine (CPU default, not SGLang;
:class:`EmbeddedServer`, :mod:`.embedded_server`), so CPU tests run the client path the GPU runs.
:func:`start_engine` starts either.

Importing this package is cheap (stdlib only); torch and transformers are imported by the embedded
server's own process.
"""
from .http import HttpEngine
from .launch import EmbeddedServer, SGLangServer, free_port, start_engine

__all__ = ["HttpEngine", "SGLangServer", "EmbeddedServer", "start_engine", "free_port"]
