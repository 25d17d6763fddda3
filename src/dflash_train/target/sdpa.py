"""Which scaled_dot_product_attention kernel the target's attention runs (`target.sdpa_backend`).

`auto` leaves the choice to PyTorch (flash, memory-efficient, cuDNN or math, by its own
rules); any other name forces that one kernel with `torch.nn.attention.sdpa_kernel`, so a
kernel that cannot take the call raises instead of silently falling back. On a CPU only
`math` and `flash` (PyTorch's CPU flash kernel) exist.
"""

from __future__ import annotations

import contextlib

from torch.nn.attention import SDPBackend, sdpa_kernel

_BACKENDS = {"flash": SDPBackend.FLASH_ATTENTION, "cudnn": SDPBackend.CUDNN_ATTENTION,
             "efficient": SDPBackend.EFFICIENT_ATTENTION, "math": SDPBackend.MATH}


def sdpa_backend(name: str) -> contextlib.AbstractContextManager:
    """A context in which every F.scaled_dot_product_attention call uses the `name` kernel."""
    if name == "auto":
        return contextlib.nullcontext()
    if name not in _BACKENDS:
        raise ValueError(f"unknown SDPA backend {name!r}: use auto, {', '.join(_BACKENDS)}")
    return sdpa_kernel([_BACKENDS[name]])
