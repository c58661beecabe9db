import os
import sys

import torch
from hypothesis import HealthCheck, settings

sys.path.insert(0, os.path.dirname(__file__))
if not torch.cuda.is_available():  # fla's Triton kernels run in Triton's interpreter (tests/fla_interpret.py)
    import fla_interpret

    fla_interpret.enable()
torch.set_num_threads(min(4, os.cpu_count() or 1))
settings.register_profile("ci", max_examples=int(os.environ.get("HARTS_EXAMPLES", "25")), deadline=None,
                          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
settings.load_profile("ci")
