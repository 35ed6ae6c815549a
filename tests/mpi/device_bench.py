"""Run under mpiexec: ``pycoll bench COLLECTIVE --device cuda`` as bench/gpu_check.sh runs it
between processes, every algorithm, with ``--check``, on a stand-in for CuPy whose arrays are
on a stand-in device whose inboxes the processes map (tests/fake_device.py), so the
benchmark's own code and the peer-memory transport run as on a GPU node.

Exits with the benchmark's status; rank 0 prints its table.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent.parent))
from fake_device import SharedFileDevice, cupy_look_alike  # noqa: E402

import pycoll  # noqa: E402
from pycoll import spaces  # noqa: E402
from pycoll.cli import main  # noqa: E402

device = SharedFileDevice(seed=pycoll.world().rank)
sys.modules["cupy"] = cupy_look_alike(device)
spaces.register(device)
status = main(["bench", sys.argv[1], "--device", "cuda", "--algorithm", "all", "-b", "8",
               "-e", "64K", "-f", "8", "-n", "2", "-w", "1", "--check", "1"])
# the bench unmaps its peers' memory before exit (not the interpreter's teardown, in no order)
if not pycoll.world()._device_transports and all(a.freed for a in device.allocations):
    print(f"rank {pycoll.world().rank}: device buffers freed before exit", flush=True)
sys.exit(status)
