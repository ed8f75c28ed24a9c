"""OpenMP threads that wait sleep instead of spinning, on a machine whose cores are shared.

PyPI's CPU torch (and the MKL inside it) runs its parallel regions on GNU OpenMP. By default a
libgomp thread that has done its part of a region spins for up to 300,000 iterations before it
sleeps, waiting for the next region. That pays when each thread has a core to itself. On a
machine whose cores are shared (the agent beside rlproxy, the trainer process beside the engine,
other services) the spinner holds a core that its partner needs to finish its own part, so every
region waits on a thread the kernel has put aside. Measured on a 2-core machine at load 6-9
(docs/benchmarks/long-session.md): a 1,024-token prefill with 2 threads took 3-6x as long as with
`OMP_WAIT_POLICY=PASSIVE`, a decode step at batch 8 8-20x, and 8 concurrent 2,849-token prefills
made the embedded engine 0.61x vLLM CPU's tokens/s.

`prefer_passive_waits` sets `OMP_WAIT_POLICY=PASSIVE` for this process and its children unless
the user chose a policy (`OMP_WAIT_POLICY`, or libgomp's `GOMP_SPINCOUNT`): set
`OMP_WAIT_POLICY=ACTIVE`, or `GOMP_SPINCOUNT=300000` (libgomp's default), for the old spinning on
a machine with cores to spare. libgomp reads the policy once, when torch loads it: the command
line calls this before anything imports torch.
"""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import MutableMapping

logger = logging.getLogger(__name__)

USER_CHOICES = ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")


def prefer_passive_waits(environ: MutableMapping[str, str] | None = None) -> bool:
    """Set `OMP_WAIT_POLICY=PASSIVE` in `environ` (default: this process's) unless the user set
    a wait policy or spin count; True when it did."""
    env = os.environ if environ is None else environ
    if any(name in env for name in USER_CHOICES):
        return False
    env["OMP_WAIT_POLICY"] = "PASSIVE"
    if environ is None and "torch" in sys.modules:
        logger.warning("torch was imported first: OMP_WAIT_POLICY=PASSIVE reaches children only")
    return True
