"""The rollout side: on-policy agentic RL on SGLang feeding HARTS.

``types`` (engine / environment protocols), ``tokenizer`` (ids <-> text, agent markup),
``engines`` (SGLang's native HTTP API; the embedded transformers server for CPU), ``sandbox`` and
``envs`` (bubblewrap + overlayfs sandboxes, task families), ``agent_loop`` (multi-turn episodes,
branching into rollout trees), ``trainer`` (Megatron HybridModel, tree-packed steps),
``weight_sync`` (Megatron -> Hugging Face checkpoints pushed to engines), ``loop`` (the driver,
local or on Ray), ``cli`` (``python -m megatron_harts.rollout``).

Depends on ``megatron_harts.tree`` (and ``megatron`` for the trainer); nothing outside this
package imports it. Submodules are imported on use (Ray, transformers and Megatron are heavy).
"""
