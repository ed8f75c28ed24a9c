"""`rlproxy train` in which one rank's first micro-batch raises, once: rank FAIL_RANK (default
0) raises FAIL_ERROR (default RuntimeError; ValueError is the other choice).

Run by tests/trainer/test_distributed.py under torchrun. It stands in for a failure that only
one rank sees part-way through a data-parallel step (CUDA running out of memory on one GPU, a
bad kernel): on CPU there is no such failure to provoke, so the real `_micro_batch` is wrapped
here. Everything else is the real `rlproxy train`.
"""

from __future__ import annotations

import os
import sys
from typing import Any

from proxy.cli.main import main
from trainer.peft_backend import PeftTrainer

_real = PeftTrainer._micro_batch
_failed: list[bool] = []


def _micro_batch(self: PeftTrainer, *args: Any, **kwargs: Any) -> Any:
    rank = os.environ.get("RANK")
    if rank == os.environ.get("FAIL_RANK", "0") and not _failed:
        _failed.append(True)
        error = ValueError if os.environ.get("FAIL_ERROR") == "ValueError" else RuntimeError
        raise error(f"injected on rank {rank}: out of memory")
    return _real(self, *args, **kwargs)


PeftTrainer._micro_batch = _micro_batch  # type: ignore[method-assign]

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
