"""Suite-wide settings: Triton's interpreter on CPU-only machines, and the torch thread count."""

import os

import torch

# Must be set before the first Triton launch (ENVIRONMENT.md): kernels run in the interpreter
# when there is no GPU.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

torch.set_num_threads(int(os.environ.get("KVPILOT_NUM_THREADS", "2")))
