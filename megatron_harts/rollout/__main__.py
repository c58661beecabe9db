"""``python -m megatron_harts.rollout``: run the on-policy RL loop (see :mod:`.cli`)."""
from .cli import main

raise SystemExit(main())
