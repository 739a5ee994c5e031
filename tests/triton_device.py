"""Where the Triton kernel tests run: on the GPU when there is one, else in Triton's CPU interpreter.

    from tests.triton_device import DEVICE, require_triton_runtime
    require_triton_runtime()          # at the top of a test module, before it imports the kernels

Without a GPU the kernels run under TRITON_INTERPRET=1 (numpy on the CPU; tests/conftest.py sets it before
anything imports triton). A module is skipped when Triton is not installed (an optional dependency) or
when there is neither a GPU nor the interpreter.
"""

from __future__ import annotations

import os

import pytest
import torch

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def require_triton_runtime() -> None:
    """Skip the calling module unless its kernels can run; on CPU, patch the interpreter's loop bounds."""
    pytest.importorskip("triton", reason="Triton is not installed (optional; the GPU path needs it)")
    if DEVICE == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("no GPU and TRITON_INTERPRET is not 1 (tests/conftest.py sets it before triton is imported)",
                    allow_module_level=True)
    if DEVICE == "cpu":
        interpreter_index_shim()


def interpreter_index_shim() -> None:
    """Triton 3.6's interpreter turns loaded scalars (numpy arrays of shape (1,)) into loop bounds with int(),
    which numpy >= 2.4 refuses; give its tensors an __index__ that takes the single element."""
    from triton.runtime import interpreter

    original = interpreter._patch_lang_tensor

    def patch(tensor, scope):
        original(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))

    if getattr(original, "__name__", "") != "patch":
        interpreter._patch_lang_tensor = patch
