"""Where the model computes: one ``device`` setting for every command and node.

``auto`` is the first CUDA GPU when there is one, else the CPU; ``cpu``, ``cuda``, ``cuda:N`` and
``mps`` name one. On a GPU the frozen backbones run in half precision (the reference runs CLIP in
fp16) and everything that learns — per-class tensors, optimiser state, losses — stays float32,
with the backbones' matrix products under autocast. On the CPU everything is float32, exactly as
the golden vectors were computed, and autocast is off.
"""

from __future__ import annotations

import contextlib
import re
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

DEVICE_NAMES = re.compile(r"auto|cpu|cuda(:\d+)?|mps")


def check(name: str) -> None:
    """Raise ValueError unless ``name`` is a device setting (no torch import: config checks)."""
    if not DEVICE_NAMES.fullmatch(name):
        raise ValueError("expected auto, cpu, cuda, cuda:N or mps")


def resolve(name: str) -> torch.device:
    """The device ``name`` means on this machine; a GPU that is not there is a clear error."""
    import torch

    check(name)
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device {name}: CUDA is not available on this machine")
    if device.type == "cuda" and (device.index or 0) >= torch.cuda.device_count():
        raise ValueError(f"device {name}: this machine has {torch.cuda.device_count()} GPU(s)")
    if device.type == "mps" and not torch.backends.mps.is_available():
        raise ValueError(f"device {name}: MPS is not available on this machine")
    return device


def backbone_dtype(device: torch.device) -> torch.dtype:
    """float16 for the frozen backbones on a GPU, float32 elsewhere."""
    import torch

    return torch.float16 if device.type in ("cuda", "mps") else torch.float32


def autocast(device: torch.device) -> contextlib.AbstractContextManager[object]:
    """Half-precision matrix products with float32 accumulation on a GPU; nothing on the CPU."""
    import torch

    if device.type == "cpu":
        return contextlib.nullcontext()
    return torch.autocast(device.type, dtype=torch.float16)
