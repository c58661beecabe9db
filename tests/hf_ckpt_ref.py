"""Reference side of ``test_weight_sync.py``: load checkpoint directories with
``Qwen3NextForCausalLM.from_pretrained`` and compute per-token log-probs, in its own process
with fla blocked (see ``hf_qwen3_next_ref.py`` for why).

``python tests/hf_ckpt_ref.py IN.json OUT.pt``

IN.json: ``{"checkpoints": [dir, ...], "trajectories": [[token ids], ...]}``. For each directory:
``from_pretrained(dir, dtype=float32, output_loading_info=True)`` (nothing downloaded), then every
trajectory's per-token log-probs (``hf_qwen3_next_ref.batched_logprobs``: right-padded rows,
checked against plain ``[1, L]`` forwards of a few trajectories). OUT.pt: the list of
``{"config": config.to_dict(), "state_dict", "logprobs": [[L - 1] per trajectory],
"loading_info": {"missing_keys", "unexpected_keys", "mismatched_keys", "error_msgs"} as lists,
"torch_path": bool, "alone_vs_batched": float}``, one per directory.
"""
import inspect
import json
import os
import sys

sys.modules["fla"] = None              # must precede any transformers import: force the torch path
sys.modules["causal_conv1d"] = None

import torch  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from hf_qwen3_next_ref import alone_logprobs, batched_logprobs  # noqa: E402


def run_one(path: str, trajectories: list[list[int]]) -> dict:
    from transformers import Qwen3NextForCausalLM
    from transformers.models.qwen3_next import modeling_qwen3_next as mq

    model, info = Qwen3NextForCausalLM.from_pretrained(path, dtype=torch.float32, output_loading_info=True)
    model = model.eval()
    torch_path = all(inspect.getclosurevars(f).nonlocals.get("is_new_implementation") is False
                     for f in (mq.torch_chunk_gated_delta_rule, mq.causal_conv1d_fn))
    with torch.no_grad():
        logprobs = batched_logprobs(model, trajectories)
        some = sorted(range(len(trajectories)), key=lambda i: -len(trajectories[i]))[:2] + [0, len(trajectories) - 1]
        alone_err = max(float((alone_logprobs(model, trajectories[i]) - logprobs[i]).abs().max())
                        for i in set(some) if len(trajectories[i]) > 1)
    info = {k: sorted(str(x) for x in v) for k, v in info.items()}
    return {"config": model.config.to_dict(), "state_dict": model.state_dict(), "logprobs": logprobs,
            "loading_info": info, "torch_path": torch_path, "alone_vs_batched": alone_err}


def main(inp: str, outp: str) -> None:
    spec = json.load(open(inp))
    torch.save([run_one(p, spec["trajectories"]) for p in spec["checkpoints"]], outp)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
