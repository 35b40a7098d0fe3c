"""Environment variables set for the length of a block: launchers hand settings to their workers this way."""

from __future__ import annotations

import contextlib
import os
from typing import Iterator, Mapping


@contextlib.contextmanager
def environment(values: Mapping[str, str], *, override: bool = True) -> Iterator[None]:
    """Set `values` in os.environ inside the block, then restore every one exactly (unset if it was unset).

    override=False leaves a variable that is already set alone (an explicit user setting wins).
    """
    previous = {name: os.environ.get(name) for name in values}
    changed = {name: value for name, value in values.items() if override or previous[name] is None}
    os.environ.update(changed)
    try:
        yield
    finally:
        for name in changed:
            if previous[name] is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = previous[name]
