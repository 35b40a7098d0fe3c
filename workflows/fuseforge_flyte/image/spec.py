"""The training image as a flytekit ImageSpec, built from platform.toml's [image] table.

Locked, like images/Dockerfile: the requirements of fuseforge's pyproject extras (transformers, deepspeed,
flytekit + plugins, ...) come from the hash lock images/requirements.txt, installed from PyPI alone with
`--require-hashes --no-deps` (every archive checked against its sha256, nothing resolved); then torch, by
name, from [image].torch_index_url alone (its CUDA stack with it; what the lock already holds stays), and
fuseforge itself: this source checkout (staged without caches, `uv pip install --no-deps`), or, when
[image].fuseforge is a pip requirement, from the lock like everything else; `uv pip check` last. No index ever serves another's packages: no
`--extra-index-url`, no `UV_INDEX_STRATEGY`, at build or run time. A lock that no longer covers [image]
(an added extra_packages entry, another torch) stops the build, naming `python images/lock.py`.
Builds go through flytekit's Docker builder, wrapped (builder "fuseforge") so that they work from any
directory; without a Docker daemon they go through buildah (fuseforge_flyte.image.buildah), and they fail with
a clear message when neither can build.

Registration (`pyflyte run --remote`, `pyflyte register`) checks that the image is in the registry
before anything refers to it: flytekit alone, without Docker, only prints "Flytekit assumes the image
... already exists" and registers tasks whose pods then fail with ImagePullBackOff. A content-hash tag
changes with every local edit, so it is the one most likely never to have been pushed.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import shlex
import subprocess
import warnings
from pathlib import Path
from typing import Dict, List, Optional, Tuple

from flytekit.constants import CopyFileDetection
from flytekit.image_spec.default_builder import DefaultImageBuilder, create_docker_context
from flytekit.image_spec.image_spec import ImageBuildEngine, ImageSpec

from fuseforge_flyte.config import ConfigError, ImageConfig, PlatformConfig
from fuseforge_flyte.image import IMAGE_UID, ImageBuildError
from fuseforge_flyte.image.lock import LOCK_PATH, RENEW, lock_file, stale_requirements
from fuseforge_flyte.image.registry import registry_has_image
from fuseforge_flyte.image.sources import STAGED_SOURCE_DIR, find_checkout, in_staged_sources, source_files

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib  # type: ignore[no-redef]

BUILDER_NAME = "fuseforge"
# Image settings: no DeepSpeed op pre-compilation (ops JIT on the GPU node when used). Nothing about indexes:
# each install names its one index (see the module docstring).
IMAGE_ENV = {"DS_BUILD_OPS": "0"}
# How the lock is installed: each archive checked against its sha256, nothing resolved beyond it.
LOCKED_INSTALL_ARGS = "--require-hashes --no-deps"
# The image user's uid is the one the Helm chart's pods run as (IMAGE_UID): the build checks it.
UID_CHECK_COMMAND = (
    f'test "$(id -u flytekit):$(id -g flytekit)" = "{IMAGE_UID}:{IMAGE_UID}" || '
    f'(echo "the image user flytekit is $(id -u flytekit):$(id -g flytekit), the fuseforge chart runs pods as '
    f'{IMAGE_UID}:{IMAGE_UID}: set platform.podSecurityContext.runAsUser/runAsGroup to it, or use a base image '
    f'whose first free uid is {IMAGE_UID} (ubuntu 24.04 has user ubuntu at 1000)" >&2; exit 1)'
)
# FUSEFORGE_IMAGE_CHECK=off skips the registry check at registration (the tag is then trusted as pushed).
IMAGE_CHECK_ENV = "FUSEFORGE_IMAGE_CHECK"
# Image names whose tag is the content hash of the sources (not a tag the user chose and pushed).
_CONTENT_TAGGED: set = set()
# The config each image name was made from (what its lock must cover).
_CONFIG_OF: Dict[str, PlatformConfig] = {}


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


def torch_install_command(image: ImageConfig) -> str:
    """torch by name from its own index alone ([image].torch_index_url; PyPI when ""): no other index is asked,
    so no other index can serve it, and torch's stack (CUDA libraries) comes from where torch does."""
    index = f"--index-url {shlex.quote(image.torch_index_url)} " if image.torch_index_url else ""
    return f"uv pip install {index}{shlex.quote(image.torch)}"


def _content_tag(settings: dict, files: List[Tuple[str, Path]], lock: Optional[Path] = None) -> str:
    digest = hashlib.sha256(json.dumps(settings, sort_keys=True).encode())
    if lock is not None:
        digest.update(b"lock\0" + hashlib.sha256(lock.read_bytes()).digest())
    for rel, path in files:
        digest.update(rel.encode() + b"\0")
        digest.update(hashlib.sha256(path.read_bytes()).digest())
    return digest.hexdigest()[:20]


def training_image(config: PlatformConfig) -> ImageSpec:
    """The ImageSpec every fuseforge task runs in: the lock (hash-checked), torch from its index, fuseforge.

    Without a source checkout (e.g. inside the running image) there is no lock: the spec then names the
    requirements unlocked, for its identity only, and the builder refuses to build or render it."""
    image = config.image
    if (command := registration_command()) and not _SEEN_REGISTRATION:
        _SEEN_REGISTRATION.append(command)
    checkout = find_checkout()
    from_checkout = image.fuseforge == "checkout"
    lock = lock_file(checkout)
    packages = image_packages(config, checkout)  # also checks [image].extras
    settings = dict(
        name=image.name,
        base_image=image.base_image,
        python_version=image.python_version,
        packages=None if lock else packages,
        requirements=str(lock) if lock else None,
        pip_extra_args=LOCKED_INSTALL_ARGS if lock else None,
        apt_packages=list(image.apt_packages),
        env=dict(IMAGE_ENV),
        platform=image.platform,
        copy=[STAGED_SOURCE_DIR] if from_checkout else None,
        commands=[
            UID_CHECK_COMMAND,
            torch_install_command(image),
            *([f"uv pip install --no-deps /root/{STAGED_SOURCE_DIR}"] if from_checkout else []),
            "uv pip check",
        ],
    )
    files = source_files(checkout) if (from_checkout and checkout is not None) else []
    tag = image.tag or _content_tag({k: v for k, v in settings.items() if k != "requirements"}, files, lock)
    if not image.tag:
        _CONTENT_TAGGED.add(f"{image.registry}/{image.name}:{tag}")
    _CONFIG_OF[f"{image.registry}/{image.name}:{tag}"] = config
    return ImageSpec(
        **settings,
        registry=image.registry,
        builder=BUILDER_NAME,
        # The tag is ours (fixed, or the hash above), so flytekit never hashes the working directory.
        tag_format=tag,
        source_copy_mode=CopyFileDetection.NO_COPY,
    )


def check_locked(spec: ImageSpec, config: Optional[PlatformConfig] = None) -> None:
    """Refuse to build an image that would not be the locked one: no lock, or a lock that does not cover [image]."""
    if not spec.requirements or spec.packages:
        raise ImageBuildError(
            f"{spec.image_name()}: the image is built from the hash lock {LOCK_PATH} of the fuseforge source "
            "checkout, and this fuseforge_flyte has none (installed from a wheel?): build from a git checkout")
    if config is None:
        from fuseforge_flyte.config import get_config

        config = _CONFIG_OF.get(spec.image_name()) or get_config()
    # In the lock like everything else: the extras' requirements, extra_packages, fuseforge when it is a pip requirement.
    requirements = image_packages(config, find_checkout())
    problems = stale_requirements(Path(spec.requirements).read_text(), requirements, config.image.torch,
                                  config.image.python_version)
    if problems:
        raise ImageBuildError(f"{spec.requirements} no longer fits [image] ({config.source}): "
                              f"{'; '.join(problems)}. Renew it with `{RENEW}` (needs PyPI) and commit it")


def render_docker_context(spec: ImageSpec, out_dir: os.PathLike | str,
                          config: Optional[PlatformConfig] = None) -> Path:
    """Write the Dockerfile and build context flytekit would build, without Docker (the lock checked first)."""
    check_locked(spec, config)
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


# The registration command seen when the tasks were defined: `pyflyte run --remote` serializes them in a
# worker thread of flytekit's event loop, where click's (thread-local) context is empty.
_SEEN_REGISTRATION: List[str] = []


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


class FuseforgeImageBuilder(DefaultImageBuilder):
    """flytekit's Docker builder, run from the staged sources (buildah where no Docker daemon answers); says
    clearly when neither can build, and
    at registration refuses an image the registry does not have (or, for a content-hash tag, cannot show)."""

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
        check_locked(image_spec)
        try:
            check_docker(image_spec.image_name())
            daemonless = False
        except ImageBuildError as docker_missing:
            from fuseforge_flyte.image.buildah import buildah_problem

            problem = buildah_problem()
            if problem is not None:
                message = f"{str(docker_missing).rstrip('.')}; nor can buildah build: {problem}."
                if image_spec.image_name() in _CONTENT_TAGGED:  # say why a new tag appeared at all
                    message += " The tag is a hash of your sources and image settings, so every local edit asks for a new image."
                raise ImageBuildError(message) from None
            daemonless = True
        if daemonless:  # no Docker daemon: buildah builds the same spec
            from fuseforge_flyte.image.buildah import BuildahImageBuilder

            return BuildahImageBuilder().build(image_spec, push=push)
        with in_staged_sources(image_spec), warnings.catch_warnings():
            # tag_format is used by ImageSpec itself, not the builder; flytekit warns about it regardless.
            warnings.filterwarnings("ignore", message="The following parameters are unsupported")
            self._build_image(image_spec, push=push)
        return image_spec.image_name()


ImageBuildEngine.register(BUILDER_NAME, FuseforgeImageBuilder(), priority=0)
# The daemonless builder registers itself with flytekit too (as "fuseforge-buildah") when imported.
import fuseforge_flyte.image.buildah  # noqa: E402,F401
