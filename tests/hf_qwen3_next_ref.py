"""Reference side of ``test_hf_parity.py``, run in its own process (no fla there).

``python tests/hf_qwen3_next_ref.py IN.json OUT.pt``

IN.json: ``{"models": [{"config": {Qwen3NextConfig kwargs}, "seed": int, "norm_std": float}, ...],
"trajectories": [[token ids], ...]}``. For each model: build ``Qwen3NextForCausalLM`` from the
config with random weights (seeded; nothing downloaded); perturb every norm weight and ``dt_bias``
by ``N(0, norm_std)`` (HF initialises the zero-centered RMSNorms to 0 and the gated norm to 1,
which would hide a wrong ``1 + w`` conversion); compute every trajectory's per-token log-probs in
fp32 (``use_cache=False``) as right-padded rows of a batch (:func:`batched_logprobs`), checked
against plain ``[1, L]`` forwards of a few trajectories (``alone_vs_batched``: max abs
difference). OUT.pt: the list of ``{"config": config.to_dict(), "state_dict", "logprobs":
[[L - 1] per trajectory], "torch_path": bool, "alone_vs_batched": float}``, one per model.

transformers picks fla's Triton kernels for the GDN whenever ``import fla`` works (decided when
``modeling_qwen3_next`` is imported), and those need a GPU. Blocking the import here, before
transformers is imported, makes it take its torch path; hence the separate process: the test
session itself imports fla for Megatron's GDN.
"""
import json
import sys

sys.modules["fla"] = None              # must precede any transformers import: force the torch path
sys.modules["causal_conv1d"] = None    # same for the conv kernel package, if installed

import torch  # noqa: E402


def alone_logprobs(model, toks: list[int]) -> torch.Tensor:
    """``[L - 1]`` log-probs of one trajectory from a plain ``[1, L]`` forward."""
    ids = torch.tensor(toks, dtype=torch.long)[None]
    logits = model(input_ids=ids, use_cache=False).logits[0, :-1].float()
    return torch.log_softmax(logits, -1).gather(1, ids[0, 1:, None])[:, 0]


def batched_logprobs(model, trajectories: list[list[int]], rows: int = 64) -> list[torch.Tensor]:
    """The same for every trajectory, ``rows`` trajectories per forward, each its own row,
    right-padded, no attention mask. Every layer is causal (attention, conv, GDN recurrence) and
    acts per row and per token otherwise (norms, MLP, no-drop MoE), so padding after a row's last
    token cannot change its log-probs: each row is its trajectory's plain forward."""
    out = []
    for s in range(0, len(trajectories), rows):
        part = trajectories[s:s + rows]
        L = max(len(t) for t in part)
        ids = torch.zeros(len(part), L, dtype=torch.long)
        for i, t in enumerate(part):
            ids[i, :len(t)] = torch.tensor(t)
        logp = torch.log_softmax(model(input_ids=ids, use_cache=False).logits.float(), -1)
        out += [logp[i, :len(t) - 1].gather(1, ids[i, 1:len(t), None])[:, 0] for i, t in enumerate(part)]
    return out


def run_one(model_spec: dict, trajectories: list[list[int]]) -> dict:
    from transformers import Qwen3NextConfig, Qwen3NextForCausalLM

    torch.manual_seed(model_spec["seed"])
    config = Qwen3NextConfig(**model_spec["config"])
    model = Qwen3NextForCausalLM(config).float().eval()
    std = model_spec.get("norm_std", 0.1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight") or name.endswith("dt_bias"):
                p.add_(torch.randn_like(p) * std)
    return {"config": config.to_dict(), "state_dict": model.state_dict(), **checked_logprobs(model, trajectories)}


TORCH_REFERENCES = ("torch_chunk_gated_delta_rule", "causal_conv1d_fn")


def ran_torch_references(model, toks: list[int]) -> bool:
    """Whether a plain forward of ``toks`` executes transformers' own torch GDN and conv code
    (:data:`TORCH_REFERENCES` in ``modeling_qwen3_next.py``), observed with ``sys.setprofile``
    rather than read from how transformers wraps them: the wrappers (kernel-hub ``Func`` modules
    since transformers 5.25, closures before) change between versions, the executed code does not."""
    ran: set[str] = set()

    def profile(frame, event, _arg):
        code = frame.f_code
        if event == "call" and code.co_name in TORCH_REFERENCES and code.co_filename.endswith("modeling_qwen3_next.py"):
            ran.add(code.co_name)

    sys.setprofile(profile)
    try:
        alone_logprobs(model, toks[:8])
    finally:
        sys.setprofile(None)
    return ran == set(TORCH_REFERENCES)


def checked_logprobs(model, trajectories: list[list[int]]) -> dict:
    """``{"logprobs", "torch_path", "alone_vs_batched"}``: every trajectory's log-probs
    (:func:`batched_logprobs`), whether transformers took its torch GDN / conv path, and the largest
    difference of the batch to single ``[1, L]`` forwards of a few trajectories."""
    with torch.no_grad():
        torch_path = ran_torch_references(model, trajectories[0])
        logprobs = batched_logprobs(model, trajectories)
        # the batch is only a shortcut: check it against single [1, L] forwards of a few trajectories
        some = sorted(range(len(trajectories)), key=lambda i: -len(trajectories[i]))[:2] + [0, len(trajectories) - 1]
        alone_err = max(float((alone_logprobs(model, trajectories[i]) - logprobs[i]).abs().max())
                        for i in set(some) if len(trajectories[i]) > 1)
    return {"logprobs": logprobs, "torch_path": torch_path, "alone_vs_batched": alone_err}


def main(inp: str, outp: str) -> None:
    spec = json.load(open(inp))
    torch.save([run_one(m, spec["trajectories"]) for m in spec["models"]], outp)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
