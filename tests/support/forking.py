"""Whether worker processes can still be forked from this test process.

torch refuses autograd in a forked child once the parent has started autograd's device threads; with
PyPI's torch build (CUDA-enabled, the one these machines install) some earlier tests in the same pytest
worker do that. Fork stays the fast default while a forked child can still run a backward pass.
"""

from __future__ import annotations

import os


def _fork_can_run_autograd() -> bool:
    pid = os.fork()
    if pid == 0:  # child: exit code says whether autograd works here
        code = 1
        try:
            import torch

            x = torch.ones(2, requires_grad=True)
            (x * 2).sum().backward()
            code = 0
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    return os.waitstatus_to_exitcode(status) == 0


_spawn_only = False


def start_method() -> str:
    """"fork" while forked children can use autograd, then "spawn" for the rest of this process."""
    global _spawn_only
    if not _spawn_only and not _fork_can_run_autograd():
        _spawn_only = True
    return "spawn" if _spawn_only else "fork"


def required() -> str:
    """"fork", for a test whose workers must inherit the parent's monkeypatches; fails if fork can't work here."""
    import pytest

    if start_method() != "fork":
        pytest.fail("this test patches the parent for its forked workers, but a torch.compile test ran earlier "
                    "in this process: mark that test `compiles` (tests/conftest.py runs those last)")
    return "fork"
