"""The training image's hash lock, images/requirements.txt: reading it, and checking that it still covers
what [image] asks for before an image is built from it.

The lock (written by images/lock.py) pins every package the image installs besides torch's own stack, each
with the sha256 of its archives. A build installs exactly it (`--require-hashes --no-deps`), so a requirement
it lacks would simply be missing from the image: the check below names it and the command that renews the lock.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Dict, List, Optional

LOCK_PATH = "images/requirements.txt"  # relative to the source checkout
RENEW = "python images/lock.py"
_HEAD = re.compile(r"^([A-Za-z0-9][A-Za-z0-9._-]*)(\[[^\]]*\])?==(\S+)")


class StaleLockError(ValueError):
    """The lock does not cover [image]'s requirements (or was made for another torch)."""


def lock_file(checkout: Optional[Path]) -> Optional[Path]:
    """images/requirements.txt of the source checkout, or None (no checkout, or no lock in it)."""
    if checkout is None:
        return None
    path = checkout / LOCK_PATH
    return path if path.is_file() else None


def canonical_name(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def parse_lock(text: str) -> Dict[str, dict]:
    """{name: {"lines": [...], "via": {parents}}} of uv/pip-compile output (split or line annotations)."""
    blocks: Dict[str, dict] = {}
    current = None
    via_open = False
    for line in text.splitlines():
        head = _HEAD.match(line)
        if head:
            current = {"lines": [line], "via": set(), "version": head.group(3)}
            blocks[canonical_name(head.group(1))] = current
            via_open = False
            continue
        if current is None:
            continue
        stripped = line.strip()
        if stripped.startswith("--hash="):
            current["lines"].append(line)
        elif stripped.startswith("# via"):
            rest = stripped[len("# via"):].strip()
            via_open = not rest
            current["via"].update(p.strip() for p in rest.split(",") if p.strip())
        elif via_open and stripped.startswith("#"):
            current["via"].add(stripped.lstrip("#").strip())
        else:
            via_open = False
    return blocks


def requirement_lines(text: str) -> List[str]:
    """The lock's installable lines (requirements and their hashes), comments and blank lines left out."""
    return [line.strip() for line in text.splitlines() if line.strip() and not line.lstrip().startswith("#")]


def stale_requirements(text: str, requirements: List[str], torch: str, python_version: str) -> List[str]:
    """What is wrong with the lock for these pip requirements, as messages; [] when it covers them all (torch
    aside) with fitting versions, for the image's Linux x86_64 CPython, and was made for `torch`."""
    from packaging.requirements import Requirement
    from packaging.version import Version

    problems = []
    if f"with {torch} " not in text:
        problems.append(f"it was not made for {torch} ([image].torch)")
    blocks = parse_lock(text)
    for block in blocks.values():
        if not any(line.strip().startswith("--hash=sha256:") for line in block["lines"][1:]):
            problems.append(f"{block['lines'][0].split()[0]} has no sha256 hash")
    env = {"python_version": python_version, "python_full_version": f"{python_version}.0", "sys_platform": "linux",
           "platform_system": "Linux", "platform_machine": "x86_64", "os_name": "posix",
           "implementation_name": "cpython", "platform_python_implementation": "CPython"}
    for line in requirements:
        requirement = Requirement(line)
        if canonical_name(requirement.name) == "torch":  # installed from its own index, never locked
            continue
        if requirement.marker is not None and not requirement.marker.evaluate(env):
            continue
        block = blocks.get(canonical_name(requirement.name))
        if block is None:
            problems.append(f"{requirement} is not in it")
        elif not requirement.specifier.contains(Version(block["version"]), prereleases=True):
            problems.append(f"{requirement} does not allow the locked {requirement.name}=={block['version']}")
    return problems
