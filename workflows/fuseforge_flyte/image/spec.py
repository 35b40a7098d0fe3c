"""The training image as a flytekit ImageSpec, built from platform.toml's [image] table.

Locked, like images/Dockerfile: the requirements of fuseforge's pyproject extras (transformers, deepspeed,
flytekit + plugins, ...) come from the hash lock images/requirements.txt, installed from PyPI alone with
`--require-hashes --no-deps` (every archive checked against its sha256, nothing resolved); then torch, by
name, from [image].torch_index_url alone (its CUDA stack with it; what the lock already holds stays), and
fuseforge itself: this source checkout (staged without caches, `uv pip install --no-deps`), or, when
[image].fuseforge is a pip requirement, from the lock like everything else; `uv pip check` last. No index ever serves another's packages: no
`--extra-index-url`, no `UV_INDEX_STRATEGY`, at build or run time. A lock that no longer covers [image]
(an added extra_packages entry, another torch) stops the build, naming `python images/lock.py`.
Its builder is "fuseforge" (docker.py: Docker, else buildah, and the registry check at registration);
importing this module registers it with flytekit, as the tasks that name this image need.
"""

from __future__ import annotations

import hashlib
import json
import shlex
from pathlib import Path
from typing import List, Optional, Tuple

from flytekit.constants import CopyFileDetection
from flytekit.image_spec.image_spec import ImageSpec

from fuseforge_flyte.config import ImageConfig, PlatformConfig
from fuseforge_flyte.image import IMAGE_UID
# Importing the builder registers it with flytekit ("fuseforge", and buildah's "fuseforge-buildah").
from fuseforge_flyte.image.docker import BUILDER_NAME, note_image
from fuseforge_flyte.image.lock import lock_file
from fuseforge_flyte.image.registration import note_registration
from fuseforge_flyte.image.requirements import image_packages
from fuseforge_flyte.image.sources import STAGED_SOURCE_DIR, find_checkout, source_files

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
    note_registration()
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
    note_image(f"{image.registry}/{image.name}:{tag}", config, content_tagged=not image.tag)
    return ImageSpec(
        **settings,
        registry=image.registry,
        builder=BUILDER_NAME,
        # The tag is ours (fixed, or the hash above), so flytekit never hashes the working directory.
        tag_format=tag,
        source_copy_mode=CopyFileDetection.NO_COPY,
    )
