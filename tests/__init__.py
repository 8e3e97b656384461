"""Test package. Without CUDA, Triton kernels run under the Triton interpreter.

``TRITON_INTERPRET`` is read when triton is first imported in the process, so it is set
here, before any test module is collected (a module that imports triton at its top would
otherwise fix the mode for everything after it)."""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
