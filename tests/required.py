"""What a test does when a part of the machine it needs is missing (node and npm, a coding-agent
CLI that does not start, Chromium, haproxy, redis-server, a tmpfs mount): in CI it fails,
elsewhere it skips; both say which part is missing and how to get it.

CI is told by the standard `CI` variable (GitHub Actions, GitLab CI and most CI services set it;
`.ci/run` exports `CI=true`). A CI machine is supposed to have every part the suites it runs
need, so a missing one must turn the run red, not leave it green with a skip nobody reads. `CI`
unset, empty, `0`, `false` or `no`: not CI.

Not for parts CI is not meant to have: an optional extra (wandb: `pip install
'rlproxy[wandb]'`) and the platform (glibc's `mallinfo2`, Linux's `/proc`) keep a plain skip,
and the deploy suite (`make test-deploy`: root and podman), which CI does not run, may skip.
"""

from __future__ import annotations

import os
from typing import NoReturn

import pytest

NOT_CI = frozenset({"", "0", "false", "no"})


def in_ci() -> bool:
    """Whether these tests run in CI (the `CI` variable, see above)."""
    return os.environ.get("CI", "").strip().lower() not in NOT_CI


def missing(part: str, how: str) -> NoReturn:
    """`part` is missing on this machine: fail in CI, skip elsewhere. `how`: how to get it (the
    package to install, the make target that runs the tests with it)."""
    if in_ci():
        pytest.fail(
            f"{part}: {how} (CI={os.environ['CI']}: CI must have it, so this fails, not skips)",
            pytrace=False,
        )
    pytest.skip(f"{part}: {how}")
