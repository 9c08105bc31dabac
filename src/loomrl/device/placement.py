"""The one place that decides where models compute: ``model.device`` of the job config.

``"auto"`` is CUDA when this process sees a GPU and the CPU otherwise, so a job file runs
unchanged on a laptop and on a GPU host; ``"cpu"``, ``"cuda"`` or ``"cuda:1"`` pin it.
Training, generation and model loading take the device from here and nothing else.
"""

from __future__ import annotations

import torch


def resolve_device(name: str = "auto") -> torch.device:
    """The ``torch.device`` that ``name`` means here; a CUDA device that is not there is an error."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(
            f"model.device={name!r} but torch sees no CUDA device here; use 'auto' or 'cpu'"
        )
    return device


def module_device(module: torch.nn.Module) -> torch.device:
    """The device a module's parameters live on (the CPU for one without parameters)."""
    param = next(module.parameters(), None)
    return param.device if param is not None else torch.device("cpu")
