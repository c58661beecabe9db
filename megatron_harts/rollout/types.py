"""The narrow interfaces of the rollout side: engines, environments, what a turn returns.

Everything here is plain data or a ``typing.Protocol``; implementations live in
``rollout.engines`` (SGLang over HTTP, the embedded transformers default), ``rollout.envs``
(bubblewrap + overlayfs sandboxes and the task families) and are composed by
``rollout.agent_loop``. The rollout side depends on ``megatron_harts.tree`` (it produces
:class:`~megatron_harts.tree.Trajectory` records), never the reverse.

Units: token ids are ints of the engine's vocabulary; log-probs are natural-log probabilities of
the sampled token under the engine's model at temperature 1 (what the trainer recomputes);
times are seconds.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any, Protocol, Sequence, runtime_checkable


class EngineError(RuntimeError):
    """An engine could not serve a request (down, timed out, bad reply); the message names the
    engine's URL (or ``embedded``) and the endpoint."""


@dataclass
class SamplingParams:
    """SGLang's ``sampling_params`` subset used by the agent loop.

    ``stop_token_ids``: generation stops after emitting one of these (it is part of the output);
    ``max_new_tokens`` bounds the turn (finish reason ``length``); ``priority``: the request's
    scheduling priority (an int; larger is served first, SGLang's default direction), sent as the
    top-level ``priority`` of ``/generate`` (not inside ``sampling_params``) and honoured only by
    servers started with ``--enable-priority-scheduling``; ``None``: the field is not sent.
    """

    max_new_tokens: int = 64
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    stop_token_ids: list[int] = field(default_factory=list)
    seed: int | None = None           # per-request sampling seed (SGLang: ``sampling_seed``)
    priority: int | None = None       # SGLang's request ``priority`` (top-level field of /generate)

    def __post_init__(self):
        if self.priority is not None and (isinstance(self.priority, bool) or not isinstance(self.priority, int)):
            raise ValueError(f"SamplingParams.priority must be an int or None, got {self.priority!r}")

    def request_fields(self) -> dict[str, Any]:
        """The top-level ``/generate`` fields besides ``sampling_params``: ``priority`` when set."""
        return {} if self.priority is None else {"priority": int(self.priority)}

    def to_sglang(self) -> dict[str, Any]:
        """The ``sampling_params`` object of SGLang's ``/generate``."""
        d = {"max_new_tokens": self.max_new_tokens, "temperature": self.temperature, "top_p": self.top_p,
             "top_k": self.top_k, "stop_token_ids": list(self.stop_token_ids), "skip_special_tokens": False,
             "no_stop_trim": True}
        if self.seed is not None:
            d["sampling_seed"] = self.seed
        return d

    @classmethod
    def from_sglang(cls, d: dict[str, Any]) -> "SamplingParams":
        return cls(max_new_tokens=int(d.get("max_new_tokens", 128)), temperature=float(d.get("temperature", 1.0)),
                   top_p=float(d.get("top_p", 1.0)), top_k=int(d.get("top_k", -1)),
                   stop_token_ids=[int(t) for t in d.get("stop_token_ids") or []],
                   seed=d.get("sampling_seed"))


@dataclass
class Generation:
    """One ``/generate`` answer.

    ``output_ids`` ``[n]`` and ``logprobs`` ``[n]`` (log p of each output token given everything
    before it); ``finish_reason``: ``stop`` (a stop token, included in ``output_ids``), ``length``
    or ``abort``; ``weight_version``: the engine's weights that produced it; ``cached_tokens``:
    prompt tokens served from the engine's prefix cache (0 where unknown).
    """

    output_ids: list[int]
    logprobs: list[float]
    finish_reason: str
    weight_version: str | None = None
    prompt_tokens: int = 0
    cached_tokens: int = 0
    latency_s: float = 0.0

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@runtime_checkable
class Engine(Protocol):
    """What the agent loop, weight sync and the companion modules need of an inference engine.

    Implementations: :class:`~megatron_harts.rollout.engines.HttpEngine` (SGLang's native HTTP
    API; also the embedded server's) and the embedded default behind it.
    """

    name: str

    def generate(self, input_ids: Sequence[int], sampling: SamplingParams, rid: str | None = None) -> Generation:
        """Sample a continuation of ``input_ids``; blocks until done or aborted."""

    def abort(self, rid: str) -> None:
        """Abort the request ``rid`` (it returns with finish reason ``abort``)."""

    def load(self) -> dict[str, Any]:
        """``{"running": int, "queued": int, "tokens_in_flight": int}`` at least."""

    def health(self, timeout: float = 5.0) -> bool:
        """True when the engine can generate (SGLang: ``/health_generate``)."""

    def update_weights_from_disk(self, path: str, version: str) -> float:
        """Load the Hugging Face checkpoint at ``path`` (tagged ``version``); returns seconds."""

    def weight_version(self) -> str | None:
        """The version tag of the weights being served."""

    def flush_cache(self) -> None:
        """Drop the prefix cache (after a weight update SGLang does this itself)."""

    def release_memory(self) -> None:
        """Free GPU memory (weights, KV) for another role; ``resume_memory`` brings it back."""

    def resume_memory(self) -> None: ...

    def pause(self) -> None:
        """Stop scheduling new tokens (in-flight requests wait); ``resume`` continues."""

    def resume(self) -> None: ...


@dataclass
class StepResult:
    """What an environment returns for one model turn.

    ``observation``: text appended to the context (tool output), ``None`` when the episode ended;
    ``done``: the episode is over (answer given, turn budget spent, or fatal error); ``reward``:
    the final reward when ``done`` (else ``None``); ``info``: e.g. ``{"tool": "run", "exit": 0,
    "truncated": False, "timed_out": False, "error": "..."}``.
    """

    observation: str | None
    done: bool
    reward: float | None = None
    info: dict[str, Any] = field(default_factory=dict)


@runtime_checkable
class Environment(Protocol):
    """A stateful task instance (one sandbox). Text in, text out: the agent loop tokenises.

    ``prompt()`` is the task statement; ``step(action)`` takes the model's turn (its decoded text,
    tool-call markers included) and runs the tool it calls; ``fork()`` returns an independent copy
    of the current state (file system and turn count) for branching; ``close()`` frees the sandbox.
    """

    task_id: str

    def prompt(self) -> str: ...

    def step(self, action: str) -> StepResult: ...

    def fork(self) -> "Environment": ...

    def close(self) -> None: ...
