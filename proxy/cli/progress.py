"""Progress bars for the long commands (`export`, `score --pending`, `train --steps`).

A bar is drawn on standard error only when standard error is a terminal; in a pipe, a log file
or CI the commands stay quiet (the trainer child that `serve` starts logs to a file, so it never
draws one). Bars come from tqdm.
"""

from __future__ import annotations

import sys
from typing import TextIO

from tqdm import tqdm


def progress(total: int | None, desc: str, unit: str, stream: TextIO | None = None) -> tqdm:
    """A bar on `stream` (default: standard error), disabled unless `stream` is a terminal.

    Use it as a context manager; `update(n)` after each item. `total` None shows a count
    without a bar (when the total is unknown)."""
    out = sys.stderr if stream is None else stream
    return tqdm(
        total=total,
        desc=desc,
        unit=unit,
        file=out,
        disable=not out.isatty(),
        leave=True,
    )
