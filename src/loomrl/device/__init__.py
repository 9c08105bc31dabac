"""The device layer: where a model computes (``placement``) and moving its state off the
device and back (``offload``). Roles ask it; the time-slicing scheduler only asks the
executors to offload, through their endpoints."""

from loomrl.device.placement import module_device, resolve_device

__all__ = ["module_device", "resolve_device"]
