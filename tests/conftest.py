"""Suite-wide set-up, before any test module imports Triton."""

from __future__ import annotations

import os

import torch

# Without a GPU, the Triton kernels (engine.attention_triton) run under
# Triton's interpreter on CPU tensors.  Triton reads the switch when a kernel
# is defined, so it must be set before the first import of triton.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
