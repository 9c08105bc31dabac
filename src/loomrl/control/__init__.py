"""The control role: the RL loop (``Controller``) and the components it holds."""

from loomrl.control.controller import Controller
from loomrl.control.step_record import Counters

__all__ = ["Controller", "Counters"]
