"""Reference side of ``test_weight_sync.py``: load checkpoint directories with
``Qwen3NextForCausalLM.from_pretrained`` and compute per-token log-probs, in its own process
with fla blocked (see ``hf_qwen3_next_ref.py`` for why).

``python tests/hf_ckpt_ref.py IN.json OUT.pt``

IN.json: ``{"checkpoints": [dir, ...], "trajectories": [[token ids], ...]}``. For each directory:
``from_pretrained(dir, dtype=float32, output_loading_info=True)`` (nothing downloaded), then every
trajectory's per-token log-probs (``hf_qwen3_next_ref.checked_logprobs``: right-padded rows,
checked against plain ``[1, L]`` forwards of a few trajectories). OUT.pt: the list of
``{"config": config.to_dict(), "state_dict", "logprobs": [[L - 1] per trajectory],
"loading_info": {"missing_keys", "unexpected_keys", "mismatched_keys", "error_msgs"} as lists,
"torch_path": bool, "alone_vs_batched": float}``, one per directory.
"""
import json
import os
import sys

sys.modules["fla"] = None              # must precede any transformers import: force the torch path
sys.modules["causal_conv1d"] = None

import torch  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from hf_qwen3_next_ref import checked_logprobs  # noqa: E402


def run_one(path: str, trajectories: list[list[int]]) -> dict:
    from transformers import Qwen3NextForCausalLM

    model, info = Qwen3NextForCausalLM.from_pretrained(path, dtype=torch.float32, output_loading_info=True)
    model = model.eval()
    info = {k: sorted(str(x) for x in v) for k, v in info.items()}
    return {"config": model.config.to_dict(), "state_dict": model.state_dict(), "loading_info": info,
            **checked_logprobs(model, trajectories)}


def main(inp: str, outp: str) -> None:
    spec = json.load(open(inp))
    torch.save([run_one(p, spec["trajectories"]) for p in spec["checkpoints"]], outp)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
