"""What every config section shares: the base class and the field types several roles use.

Each role keeps its own section beside its code (``training/config.py``,
``weights/config.py``, ...); ``loomrl.config`` puts them together into ``JobConfig``. This
module imports none of them, so any section can import it without a cycle.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict

# ``device`` fields: 'auto' (CUDA when present, else the CPU), 'cpu', 'cuda' or 'cuda:<index>'.
DEVICE_PATTERN = r"^(auto|cpu|cuda(:\d+)?)$"

# ``dtype`` fields of a model's compute weights ('auto': bfloat16 where the device computes
# bf16 natively, float32 elsewhere: loomrl.device.bf16).
DtypeName = Literal["auto", "float32", "bfloat16", "float16"]


class Section(BaseModel):
    """A table of the job file: typed fields, unknown keys are errors, assignments validated."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True)
