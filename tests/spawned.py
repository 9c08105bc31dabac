"""How a rank started by ``torch.multiprocessing.spawn`` in a test ends.

One fresh-clone run (of dozens) lost ``tests/test_fsdp.py``'s sharded step to rank 1 dying
with SIGABRT ("terminate called without an active exception") after its work and its
``destroy_process_group`` were done: a C++ object holding a thread was destroyed at
interpreter finalization (the model's DTensors, the device mesh and the rendezvous store all
still live then, and their order of destruction is the interpreter's). A rank here has
written what the test reads before it ends, so it leaves without finalization, as
``multiprocessing`` itself ends a forked child.
"""

from __future__ import annotations

import os
import sys


def end_rank() -> None:
    """Wait for every rank, tear the group down, and leave the process at once (exit 0)."""
    import torch.distributed as dist

    dist.barrier()  # no rank tears the group down while another may still use it
    dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
