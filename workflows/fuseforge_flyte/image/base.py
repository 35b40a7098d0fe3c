"""A base image made on this machine: Debian (debootstrap --variant=minbase) with Python, in buildah's storage.

Where no registry can be pulled from, buildah still needs something to build FROM. debootstrap fetches
Debian's packages (a package archive, not a registry) and the root filesystem is imported into buildah's
storage under [image].base_image, which must then be a `localhost/...` name so that buildah never tries a
registry for it. The root filesystem is cached as a tar under ~/.cache/fuseforge/base (keyed by suite,
packages and mirror): a second import, or one into a fresh storage, takes seconds.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Sequence

from fuseforge_flyte.image import ImageBuildError
from fuseforge_flyte.image.buildah import STORAGE_FLAGS, buildah, buildah_problem, has_local_image

DEFAULT_SUITE = "bookworm"
DEFAULT_MIRROR = "http://deb.debian.org/debian"
# Python of each suite's python3 package: [image].python_version must name it.
SUITE_PYTHON = {"bookworm": "3.11", "trixie": "3.13"}
# python3 for the venv, ca-certificates for https indexes; minbase already has bash, apt and useradd.
PACKAGES = ("python3", "ca-certificates")
# Left out of the image: package caches and lists, docs, and device nodes (a runtime mounts /dev).
_PRUNED = ("var/cache/apt/archives", "var/lib/apt/lists", "usr/share/doc", "usr/share/man", "usr/share/locale", "dev")
ENV = ("PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin", "LANG=C.UTF-8")


def cache_dir() -> Path:
    base = os.environ.get("FUSEFORGE_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "fuseforge"
    )
    return Path(base) / "base"


def check_name(name: str, python_version: str, suite: str) -> None:
    """The base must be a local name, and its Python the one [image].python_version asks for."""
    if not name.startswith("localhost/"):
        raise ImageBuildError(
            f"[image].base_image = {name!r} is pulled from its registry; a base made here needs a local name: "
            f'set [image].base_image = "localhost/fuseforge-base:{suite}" (and python_version = '
            f'"{SUITE_PYTHON.get(suite, "?")}")'
        )
    if suite not in SUITE_PYTHON:
        raise ImageBuildError(f"Debian suite {suite!r} is not one of {sorted(SUITE_PYTHON)}")
    if SUITE_PYTHON[suite] != python_version:
        raise ImageBuildError(
            f"[image].python_version = {python_version!r}, but Debian {suite} has Python {SUITE_PYTHON[suite]}: "
            f'set [image].python_version = "{SUITE_PYTHON[suite]}"'
        )


def rootfs_tar(suite: str, mirror: str, packages: Sequence[str]) -> Path:
    """The cached root filesystem tar, made with debootstrap when missing."""
    key = hashlib.sha256(repr((suite, mirror, sorted(packages), _PRUNED)).encode()).hexdigest()[:12]
    tar = cache_dir() / f"{suite}-{key}.tar"
    if tar.is_file():
        return tar
    if shutil.which("debootstrap") is None:
        raise ImageBuildError("making the base image needs debootstrap (Debian/Ubuntu: apt-get install debootstrap)")
    tar.parent.mkdir(parents=True, exist_ok=True)
    debs = cache_dir() / "debs"
    debs.mkdir(exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="fuseforge-rootfs-", dir=tar.parent) as tmp:
        rootfs = Path(tmp) / "rootfs"
        command = ["debootstrap", "--variant=minbase", f"--include={','.join(packages)}", f"--cache-dir={debs}",
                   suite, str(rootfs), mirror]
        print(f"+ {' '.join(command)}", file=sys.stderr)
        proc = subprocess.run(command, capture_output=True, text=True)
        if proc.returncode != 0:
            log = (proc.stdout + proc.stderr).strip().splitlines()[-3:]
            raise ImageBuildError(f"debootstrap of Debian {suite} from {mirror} failed: {' | '.join(log)}")
        for path in _PRUNED:
            shutil.rmtree(rootfs / path, ignore_errors=True)
            (rootfs / path).mkdir(parents=True)
        partial = Path(tmp) / "rootfs.tar"
        subprocess.run(["tar", "--numeric-owner", "-C", str(rootfs), "-cf", str(partial), "."], check=True)
        partial.rename(tar)
    return tar


def make_base_image(name: str, python_version: str, suite: str = DEFAULT_SUITE, mirror: str = DEFAULT_MIRROR,
                    packages: Sequence[str] = PACKAGES, replace: bool = False) -> str:
    """Import a Debian root filesystem into buildah's storage as `name` (kept when already there)."""
    check_name(name, python_version, suite)
    problem = buildah_problem()
    if problem:
        raise ImageBuildError(f"making the base image {name}: {problem}")
    if not replace and has_local_image(name):
        return name
    if os.geteuid() != 0:
        raise ImageBuildError("debootstrap needs root")
    tar = rootfs_tar(suite, mirror, packages)
    container = buildah("from", "scratch", quiet=True).strip()
    try:
        buildah("add", "--quiet", container, str(tar), "/", quiet=True)
        buildah("config", *(a for e in ENV for a in ("--env", e)), "--cmd", "/bin/bash",
                "--label", f"org.opencontainers.image.description=Debian {suite} minbase with {', '.join(packages)}",
                container, quiet=True)
        buildah("commit", "--quiet", container, name, quiet=True)
    finally:
        subprocess.run(["buildah", *STORAGE_FLAGS, "rm", container], capture_output=True)
    return name
