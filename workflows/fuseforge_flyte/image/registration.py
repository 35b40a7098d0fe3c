"""Whether this process registers tasks with a Flyte cluster (`pyflyte run --remote`, `pyflyte register`):
only then must the image already be in the registry."""

from __future__ import annotations

from typing import List, Optional

# The registration command seen when the tasks were defined: `pyflyte run --remote` serializes them in a
# worker thread of flytekit's event loop, where click's (thread-local) context is empty.
_SEEN_REGISTRATION: List[str] = []


def note_registration() -> None:
    """Remember the registration command of this process, while click's context still shows it (task definition)."""
    if (command := registration_command()) and not _SEEN_REGISTRATION:
        _SEEN_REGISTRATION.append(command)


def registration_command() -> Optional[str]:
    """The pyflyte command registering tasks with a Flyte cluster in this process, or None (a local run,
    `pyflyte package`, tests): only then must the image exist in the registry."""
    import click

    ctx = click.get_current_context(silent=True)
    while ctx is not None:
        if getattr(ctx.obj, "is_remote", False) is True:
            return "pyflyte run --remote"
        if ctx.info_name in ("register", "deploy"):
            return f"pyflyte {ctx.info_name}"
        ctx = ctx.parent
    return _SEEN_REGISTRATION[-1] if _SEEN_REGISTRATION else None
