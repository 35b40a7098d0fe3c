"""The clean copy of the source checkout that ImageSpec.copy names, as both builders (flytekit's Docker builder
and buildah) put it into the image: the files a wheel build of fuseforge needs, caches left out."""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from pathlib import Path
from typing import Iterator, List, Optional, Tuple

from flytekit.image_spec.image_spec import ImageSpec

from fuseforge_flyte.image import ImageBuildError

STAGED_SOURCE_DIR = "fuseforge-src"  # inside the Docker context and under /root in the image
# What a wheel build of fuseforge needs from the checkout (README.md/LICENSE when present).
SOURCE_PATHS = ("pyproject.toml", "README.md", "LICENSE", "kernels", "workflows")
_IGNORED = ("__pycache__", "*.pyc", "*.pyo", "*.egg-info", ".pytest_cache", "build", "dist")


def find_checkout() -> Optional[Path]:
    """The fuseforge source checkout this package runs from, or None (installed from a wheel)."""
    root = Path(__file__).resolve().parents[3]
    if (root / "pyproject.toml").is_file() and (root / "kernels" / "fuseforge").is_dir():
        return root
    return None


def _is_ignored(name: str) -> bool:
    return any(Path(name).match(pattern) for pattern in _IGNORED)


def source_files(checkout: Path) -> List[Tuple[str, Path]]:
    """(relative path, absolute path) of every file that goes into the image, sorted, caches left out."""
    found = []
    for top in SOURCE_PATHS:
        path = checkout / top
        if path.is_file():
            found.append((top, path))
        elif path.is_dir():
            for dirpath, dirnames, filenames in os.walk(path):
                dirnames[:] = sorted(d for d in dirnames if not _is_ignored(d))
                for name in filenames:
                    if not _is_ignored(name):
                        full = Path(dirpath) / name
                        found.append((full.relative_to(checkout).as_posix(), full))
    return sorted(found)


@contextlib.contextmanager
def staged_context() -> Iterator[Path]:
    """A temporary directory holding a clean copy of the sources, as `ImageSpec.copy` expects them."""
    checkout = find_checkout()
    if checkout is None:
        raise ImageBuildError(
            "[image].fuseforge = \"checkout\" needs the fuseforge source checkout, but this fuseforge_flyte "
            "is installed from a wheel. Build from a git checkout, or set [image].fuseforge to a pip "
            "requirement such as \"fuseforge[hf,platform,deepspeed]==0.1.0\"."
        )
    with tempfile.TemporaryDirectory(prefix="fuseforge-image-") as tmp:
        for rel, path in source_files(checkout):
            target = Path(tmp) / STAGED_SOURCE_DIR / rel
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(path, target)
        yield Path(tmp)


@contextlib.contextmanager
def in_staged_sources(spec: ImageSpec) -> Iterator[None]:
    """Run inside the staged sources when the spec copies them (flytekit resolves `copy` from the cwd)."""
    if not spec.copy:
        yield
        return
    previous = os.getcwd()
    with staged_context() as stage:
        os.chdir(stage)
        try:
            yield
        finally:
            os.chdir(previous)
