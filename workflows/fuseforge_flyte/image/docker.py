"""The "fuseforge" ImageSpec builder: flytekit's Docker builder, run from the staged sources so that builds work
from any directory; buildah (buildah.py) where no Docker daemon answers; a clear message when neither can build.

At registration (`pyflyte run --remote`, `pyflyte register`) it checks that the image is in the registry
before anything refers to it: flytekit alone, without Docker, only prints "Flytekit assumes the image
... already exists" and registers tasks whose pods then fail with ImagePullBackOff. A content-hash tag
changes with every local edit, so it is the one most likely never to have been pushed.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import warnings
from pathlib import Path
from typing import Dict, Optional

from flytekit.image_spec.default_builder import DefaultImageBuilder, create_docker_context
from flytekit.image_spec.image_spec import ImageBuildEngine, ImageSpec

from fuseforge_flyte.config import PlatformConfig
from fuseforge_flyte.image import ImageBuildError
# Importing it registers the daemonless builder with flytekit too (as "fuseforge-buildah").
from fuseforge_flyte.image.buildah import BuildahImageBuilder, buildah_problem
from fuseforge_flyte.image.registration import registration_command
from fuseforge_flyte.image.registry import registry_has_image
from fuseforge_flyte.image.requirements import check_locked
from fuseforge_flyte.image.sources import in_staged_sources

BUILDER_NAME = "fuseforge"
# FUSEFORGE_IMAGE_CHECK=off skips the registry check at registration (the tag is then trusted as pushed).
IMAGE_CHECK_ENV = "FUSEFORGE_IMAGE_CHECK"
# Image names whose tag is the content hash of the sources (not a tag the user chose and pushed).
_CONTENT_TAGGED: set = set()
# The config each image name was made from (what its lock must cover).
_CONFIG_OF: Dict[str, PlatformConfig] = {}


def note_image(image_name: str, config: PlatformConfig, content_tagged: bool) -> None:
    """What training_image made this image name from: the config its lock must cover, and whether its tag is
    the content hash (then it was probably never pushed)."""
    if content_tagged:
        _CONTENT_TAGGED.add(image_name)
    _CONFIG_OF[image_name] = config


def render_docker_context(spec: ImageSpec, out_dir: os.PathLike | str,
                          config: Optional[PlatformConfig] = None) -> Path:
    """Write the Dockerfile and build context flytekit would build, without Docker (the lock checked first)."""
    check_locked(spec, config if config is not None else _CONFIG_OF.get(spec.image_name()))
    out = Path(out_dir).resolve()
    out.mkdir(parents=True, exist_ok=True)
    with in_staged_sources(spec):
        create_docker_context(spec, out)
    return out / "Dockerfile"


def _fixes(image_name: str) -> str:
    return (
        "Build and push it with `python images/build.py` (needs Docker or buildah), or build images/Dockerfile with any "
        f"BuildKit builder (`docker build -f images/Dockerfile -t {image_name} .`), push it, and set [image].tag "
        "to the tag you pushed"
    )


def check_docker(image_name: str) -> None:
    """Fail early, and clearly, when there is no Docker to build with."""
    advice = (
        f"building {image_name} needs Docker with BuildKit (the `docker` command and a running daemon) "
        "or, where no Docker daemon answers, buildah as root. "
        "Install/start Docker, install buildah, or build images/Dockerfile with another builder, push it, and set [image].tag "
        "to the tag you pushed (see `python images/build.py --help`)"
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
    """flytekit's Docker builder, run from the staged sources (buildah where no Docker daemon answers); says
    clearly when neither can build, and at registration refuses an image the registry does not have (or, for a
    content-hash tag, cannot show)."""

    builder_type = BUILDER_NAME

    def should_build(self, image_spec: ImageSpec) -> bool:
        command = registration_command()
        if command is None:
            return super().should_build(image_spec)  # flytekit's own check: local runs, `pyflyte package`
        if os.getenv(IMAGE_CHECK_ENV, "").lower() in ("off", "0", "false", "no"):
            # Trusted as pushed; flytekit's own check would ask Docker Hub about any registry without Docker.
            return bool(image_spec._is_force_push)
        name = image_spec.image_name()
        # The registry itself first: without a Docker daemon flytekit's exist() asks Docker Hub about any
        # registry that is not "localhost:..." (127.0.0.1:5000 included). Docker (with your credentials) next.
        exists = registry_has_image(name)
        if exists is None:
            exists = image_spec.exist()
        if exists:
            return bool(image_spec._is_force_push)  # FLYTE_FORCE_PUSH_IMAGE_SPEC rebuilds it anyway
        if exists is False:
            print(f"Image {name} is not in the registry: building and pushing it.")
            return True  # build() fails with the fixes named when there is no Docker
        if name in _CONTENT_TAGGED:
            raise ImageBuildError(
                f"{command}: cannot tell whether the registry has {name}, and its tag is a hash of your sources "
                "(any local edit makes a new tag), so it was probably never pushed: the cluster would fail to pull "
                f"it (ImagePullBackOff). {_fixes(name)}. If it is pushed and only the check cannot see it (a "
                f"registry that needs credentials and no Docker here), set {IMAGE_CHECK_ENV}=off."
            )
        print(f"Cannot check the registry for {name}; its tag was set in [image].tag, so it is assumed pushed.")
        return False

    def build_image(self, image_spec: ImageSpec) -> Optional[str]:
        push = os.getenv("FLYTE_PUSH_IMAGE_SPEC", "True").lower() in ("true", "1")
        return self.build(image_spec, push=push)

    def build(self, image_spec: ImageSpec, *, push: bool = True) -> Optional[str]:
        check_locked(image_spec, _CONFIG_OF.get(image_spec.image_name()))
        try:
            check_docker(image_spec.image_name())
            daemonless = False
        except ImageBuildError as docker_missing:
            problem = buildah_problem()
            if problem is not None:
                message = f"{str(docker_missing).rstrip('.')}; nor can buildah build: {problem}."
                if image_spec.image_name() in _CONTENT_TAGGED:  # say why a new tag appeared at all
                    message += " The tag is a hash of your sources and image settings, so every local edit asks for a new image."
                raise ImageBuildError(message) from None
            daemonless = True
        if daemonless:  # no Docker daemon: buildah builds the same spec
            return BuildahImageBuilder().build(image_spec, push=push)
        with in_staged_sources(image_spec), warnings.catch_warnings():
            # tag_format is used by ImageSpec itself, not the builder; flytekit warns about it regardless.
            warnings.filterwarnings("ignore", message="The following parameters are unsupported")
            self._build_image(image_spec, push=push)
        return image_spec.image_name()


ImageBuildEngine.register(BUILDER_NAME, FuseforgeImageBuilder(), priority=0)
