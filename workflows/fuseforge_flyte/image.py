"""The training image as a flytekit ImageSpec, built from platform.toml's [image] table.

The image gets CUDA torch from the configured wheel index, the requirements of fuseforge's
pyproject extras (transformers, deepspeed, flytekit + plugins, ...), and fuseforge itself: this
source checkout (staged without caches and installed with `uv pip install --no-deps`) or a pip
requirement. Builds go through flytekit's Docker builder, wrapped (builder "fuseforge") so that they
work from any directory and fail with a clear message when Docker is missing.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import subprocess
import tempfile
import warnings
from pathlib import Path
from typing import Iterator, List, Optional, Tuple

from flytekit.constants import CopyFileDetection
from flytekit.image_spec.default_builder import DefaultImageBuilder, create_docker_context
from flytekit.image_spec.image_spec import ImageBuildEngine, ImageSpec

from fuseforge_flyte.config import ConfigError, PlatformConfig

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib  # type: ignore[no-redef]

BUILDER_NAME = "fuseforge"
STAGED_SOURCE_DIR = "fuseforge-src"  # inside the Docker context and under /root in the image
# What a wheel build of fuseforge needs from the checkout (README.md/LICENSE when present).
SOURCE_PATHS = ("pyproject.toml", "README.md", "LICENSE", "kernels", "workflows")
_IGNORED = ("__pycache__", "*.pyc", "*.pyo", "*.egg-info", ".pytest_cache", "build", "dist")
# Build-time settings: no DeepSpeed op pre-compilation (ops JIT on the GPU node when used), and let uv
# take each package from whichever index has the best match (torch+cuXXX from the torch index).
IMAGE_ENV = {"DS_BUILD_OPS": "0", "UV_INDEX_STRATEGY": "unsafe-best-match"}


class ImageBuildError(RuntimeError):
    """The image cannot be built on this machine (no Docker, no source checkout)."""


def find_checkout() -> Optional[Path]:
    """The fuseforge source checkout this package runs from, or None (installed from a wheel)."""
    root = Path(__file__).resolve().parents[2]
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


def _pyproject_requirements(checkout: Path, config: PlatformConfig) -> List[str]:
    """fuseforge's own dependencies plus those of the chosen extras, as pyproject.toml lists them."""
    with open(checkout / "pyproject.toml", "rb") as fh:
        project = tomllib.load(fh)["project"]
    optional = project.get("optional-dependencies", {})
    extras = config.image.extras
    unknown = [e for e in extras if e not in optional]
    if unknown:
        raise ConfigError(
            f"{config.source}: [image].extras names {unknown}, but pyproject.toml only defines {sorted(optional)}"
        )
    requirements = list(project.get("dependencies", []))
    for extra in extras:
        requirements += [r for r in optional[extra] if not r.replace(" ", "").startswith("fuseforge")]
    return list(dict.fromkeys(requirements))


def image_packages(config: PlatformConfig, checkout: Optional[Path]) -> List[str]:
    """pip requirements of the image; torch first so that its CUDA build is what gets resolved."""
    image = config.image
    if image.fuseforge == "checkout":
        if checkout is None:
            # Only reachable where the image is not built (e.g. inside the running image itself).
            requirements = []
        else:
            requirements = _pyproject_requirements(checkout, config)
    else:
        requirements = [image.fuseforge]
    return list(dict.fromkeys([image.torch, *requirements, *image.extra_packages]))


def _content_tag(settings: dict, files: List[Tuple[str, Path]]) -> str:
    digest = hashlib.sha256(json.dumps(settings, sort_keys=True).encode())
    for rel, path in files:
        digest.update(rel.encode() + b"\0")
        digest.update(hashlib.sha256(path.read_bytes()).digest())
    return digest.hexdigest()[:20]


def training_image(config: PlatformConfig) -> ImageSpec:
    """The ImageSpec every fuseforge task runs in."""
    image = config.image
    checkout = find_checkout()
    from_checkout = image.fuseforge == "checkout"
    settings = dict(
        name=image.name,
        base_image=image.base_image,
        python_version=image.python_version,
        packages=image_packages(config, checkout),
        apt_packages=list(image.apt_packages),
        pip_extra_index_url=[image.torch_index_url] if image.torch_index_url else None,
        env=dict(IMAGE_ENV),
        platform=image.platform,
        copy=[STAGED_SOURCE_DIR] if from_checkout else None,
        commands=[f"uv pip install --no-deps /root/{STAGED_SOURCE_DIR}"] if from_checkout else None,
    )
    files = source_files(checkout) if (from_checkout and checkout is not None) else []
    tag = image.tag or _content_tag(settings, files)
    return ImageSpec(
        **settings,
        registry=image.registry,
        builder=BUILDER_NAME,
        # The tag is ours (fixed, or the hash above), so flytekit never hashes the working directory.
        tag_format=tag,
        source_copy_mode=CopyFileDetection.NO_COPY,
    )


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
def _prepared(spec: ImageSpec) -> Iterator[None]:
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


def render_docker_context(spec: ImageSpec, out_dir: os.PathLike | str) -> Path:
    """Write the Dockerfile and build context flytekit would build, without Docker."""
    out = Path(out_dir).resolve()
    out.mkdir(parents=True, exist_ok=True)
    with _prepared(spec):
        create_docker_context(spec, out)
    return out / "Dockerfile"


def check_docker(image_name: str) -> None:
    """Fail early, and clearly, when there is no Docker to build with."""
    advice = (
        f"building {image_name} needs Docker with BuildKit (the `docker` command and a running daemon). "
        "Install/start Docker, or build images/Dockerfile with another builder, push it, and set [image].tag "
        "to the tag you pushed"
    )
    if shutil.which("docker") is None:
        raise ImageBuildError(f"{advice}: no `docker` command on this machine.")
    try:
        probe = subprocess.run(["docker", "info"], capture_output=True, text=True, timeout=60)
    except subprocess.TimeoutExpired:
        raise ImageBuildError(f"{advice}: `docker info` did not answer within 60 s.") from None
    if probe.returncode != 0:
        reason = (probe.stderr.strip() or probe.stdout.strip()).splitlines()[-1:] or ["unknown error"]
        raise ImageBuildError(f"{advice}: the Docker daemon is not reachable ({reason[0]}).")


class FuseforgeImageBuilder(DefaultImageBuilder):
    """flytekit's Docker builder, run from the staged sources; says clearly when Docker is missing."""

    builder_type = BUILDER_NAME

    def build_image(self, image_spec: ImageSpec) -> Optional[str]:
        push = os.getenv("FLYTE_PUSH_IMAGE_SPEC", "True").lower() in ("true", "1")
        return self.build(image_spec, push=push)

    def build(self, image_spec: ImageSpec, *, push: bool = True) -> Optional[str]:
        check_docker(image_spec.image_name())
        with _prepared(image_spec), warnings.catch_warnings():
            # tag_format is used by ImageSpec itself, not the builder; flytekit warns about it regardless.
            warnings.filterwarnings("ignore", message="The following parameters are unsupported")
            self._build_image(image_spec, push=push)
        return image_spec.image_name()


ImageBuildEngine.register(BUILDER_NAME, FuseforgeImageBuilder(), priority=0)
