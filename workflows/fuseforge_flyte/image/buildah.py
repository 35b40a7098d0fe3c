"""Build and push an ImageSpec with buildah, for machines without a Docker daemon.

flytekit's Docker template cannot be built where no registry can be pulled from: it mounts the
ghcr.io/astral-sh/uv and mambaorg/micromamba images and installs Python from conda-forge. So this builder
renders its own Dockerfile from the same ImageSpec fields (base image, apt packages, env, packages and
their indexes, copies, commands, entrypoint) that needs nothing besides the base image: Python comes from
the base (or uv downloads it, where it can), and uv itself is copied into the context from this machine's
`uv` package. buildah runs as root with `--isolation chroot --storage-driver vfs` (no daemon, no overlay
mounts, no user namespaces) and pushes to the spec's registry, without TLS only when that is on loopback.
"""

from __future__ import annotations

import json
import os
import platform as host_platform
import shlex
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import List, Optional

from flytekit.constants import CopyFileDetection
from flytekit.image_spec.image_spec import ImageBuildEngine, ImageSpec, ImageSpecBuilder

from fuseforge_flyte.image import IMAGE_UID, ImageBuildError
from fuseforge_flyte.image.sources import in_staged_sources
from fuseforge_flyte.image.registry import registry_has_image, split_image_name

BUILDER_NAME = "fuseforge-buildah"
STORAGE_FLAGS = ("--storage-driver", "vfs")
VENV = "/opt/venv"
REQUIREMENTS = "requirements_uv.txt"
# ImageSpec fields that need an image or a BuildKit feature this builder does not use.
UNSUPPORTED_FIELDS = ("conda_packages", "conda_channels", "python_exec", "pip_secret_mounts", "cuda", "cudnn")
_ARCH = {"x86_64": "amd64", "aarch64": "arm64", "arm64": "arm64", "ppc64le": "ppc64le", "s390x": "s390x"}


def buildah_problem() -> Optional[str]:
    """Why buildah cannot build on this machine, or None when it can."""
    if shutil.which("buildah") is None:
        return "no `buildah` command (Debian/Ubuntu: apt-get install buildah)"
    if os.geteuid() != 0:
        return "buildah builds here with --isolation chroot --storage-driver vfs, which needs root"
    return None


def buildah(*args: str, quiet: bool = False) -> str:
    """Run buildah on vfs storage; its output streams unless quiet (then stdout is returned). Fails naming
    the command and buildah's last error line."""
    command = ["buildah", *STORAGE_FLAGS, *args]
    if quiet:
        proc = subprocess.run(command, capture_output=True, text=True)
        stdout, errors = proc.stdout, proc.stderr.splitlines()
    else:
        with subprocess.Popen(command, stderr=subprocess.PIPE, text=True) as proc:
            errors = []
            for line in proc.stderr:  # passed through as it comes (a RUN step's output), the last kept
                sys.stderr.write(line)
                errors = [line] if line.strip() else errors
        stdout = ""
    if proc.returncode != 0:
        last = [line.strip() for line in errors if line.strip()][-1:] or ["no error output"]
        raise ImageBuildError(f"`{shlex.join(command)}` failed (exit {proc.returncode}): {last[0]}")
    return stdout


def has_local_image(name: str) -> bool:
    """Whether buildah's storage holds an image of this name."""
    command = ["buildah", *STORAGE_FLAGS, "inspect", "--type", "image", name]
    return subprocess.run(command, capture_output=True).returncode == 0


def qualified(image: str) -> str:
    """The name buildah resolves without a search list: Docker's default registry for a short name."""
    first, _, rest = image.partition("/")
    if rest and ("." in first or ":" in first or first == "localhost"):
        return image
    return f"docker.io/{image}" if rest else f"docker.io/library/{image}"


def is_loopback(image_name: str) -> bool:
    """Whether the image's registry listens on this machine (the only kind pushed to without TLS)."""
    host = split_image_name(image_name)[0]
    hostname = host[: host.index("]") + 1] if host.startswith("[") else host.split(":")[0]
    return hostname in ("localhost", "127.0.0.1", "[::1]")


def find_uv() -> Path:
    """The uv binary of this machine (PyPI's `uv` package, else uv on PATH): it installs the packages."""
    try:
        from uv import find_uv_bin

        return Path(find_uv_bin())
    except (ImportError, FileNotFoundError):
        found = shutil.which("uv")
        if found:
            return Path(found)
    raise ImageBuildError("the buildah build needs uv on this machine to copy into the image: pip install uv")


def _check_spec(spec: ImageSpec) -> None:
    used = [name for name in UNSUPPORTED_FIELDS if getattr(spec, name, None)]
    if used:
        raise ImageBuildError(f"the buildah builder does not support ImageSpec {', '.join(used)}: build with Docker")
    if spec.source_copy_mode not in (None, CopyFileDetection.NO_COPY):
        raise ImageBuildError("the buildah builder copies sources only through ImageSpec.copy (source_copy_mode must be NO_COPY)")
    machine = host_platform.machine()
    wanted = [p.strip() for p in (spec.platform or "").split(",") if p.strip()]
    if wanted and wanted != [f"linux/{_ARCH.get(machine, machine)}"]:
        raise ImageBuildError(
            f"ImageSpec platform {spec.platform!r} is not this machine's (linux/{_ARCH.get(machine, machine)}): "
            "buildah here builds without emulation; set [image].platform to it or build with Docker"
        )


def requirements_text(spec: ImageSpec) -> str:
    """What uv installs: the spec's requirements file as written (a hash lock stays one), then its packages."""
    text = ""
    if spec.requirements:
        if Path(spec.requirements).name in ("uv.lock", "poetry.lock"):
            raise ImageBuildError(f"the buildah builder installs plain requirement files, not {spec.requirements}")
        text = Path(spec.requirements).read_text().rstrip("\n") + "\n"
    return text + "".join(f"{package}\n" for package in spec.packages or [])


def _install_args(spec: ImageSpec) -> str:
    args = [f"--index-url {spec.pip_index}"] if spec.pip_index else []
    args += [f"--extra-index-url {url}" for url in spec.pip_extra_index_url or []]
    if spec.pip_extra_args:
        args.append(spec.pip_extra_args)
    return " ".join([*args, "--requirement", f"/tmp/{REQUIREMENTS}"])


def _copy_into(spec: ImageSpec, context: Path) -> List[str]:
    """Copy ImageSpec.copy (relative to the cwd, as flytekit reads it) into the context; the COPY lines."""
    lines = []
    for src in spec.copy or []:
        path = Path(src)
        if path.is_absolute() or ".." in path.parts:
            raise ImageBuildError(f"ImageSpec.copy entry {src!r}: only relative paths inside the build directory")
        if path.is_dir():
            shutil.copytree(path, context / path, dirs_exist_ok=True)
            lines.append(f"COPY --chown=flytekit {path.as_posix()} /root/{path.as_posix()}/")
        elif path.is_file():
            (context / path).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(path, context / path)
            lines.append(f"COPY --chown=flytekit {path.as_posix()} /root/{path.parent.as_posix()}/")
        else:
            raise ImageBuildError(f"ImageSpec.copy entry {src!r} does not exist in {os.getcwd()}")
    return lines


def render_buildah_context(spec: ImageSpec, out_dir: os.PathLike | str) -> Path:
    """Write the Dockerfile and context buildah builds for this spec; returns the Dockerfile."""
    _check_spec(spec)
    out = Path(out_dir).resolve()
    out.mkdir(parents=True, exist_ok=True)
    shutil.copy2(find_uv(), out / "uv")
    requirements = requirements_text(spec)
    with in_staged_sources(spec):
        copies = _copy_into(spec, out)
    env = {"UV_PYTHON_INSTALL_DIR": "/opt/python", "UV_COMPILE_BYTECODE": "1", "UV_LINK_MODE": "copy",
           "UV_NO_CACHE": "1", "VIRTUAL_ENV": VENV, "PATH": f"{VENV}/bin:$PATH", "FLYTE_SDK_RICH_TRACEBACKS": "0",
           "PYTHONPATH": "/root", **(spec.env or {})}
    lines = [
        "# Rendered by fuseforge_flyte.image.buildah from the ImageSpec; built with `buildah bud --isolation chroot`.",
        f"FROM {qualified(spec.base_image or 'debian:bookworm-slim')}",
        "USER root",
        "WORKDIR /",
    ]
    if spec.apt_packages:
        lines.append(
            "RUN apt-get update && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends "
            + " ".join(spec.apt_packages) + " && rm -rf /var/lib/apt/lists/*"
        )
    lines += [
        "COPY uv /usr/local/bin/uv",
        "ENV " + " ".join(f"{key}={json.dumps(value)}" for key, value in env.items()),
        # The uid the Helm chart's pods run as (fuseforge_flyte.image.IMAGE_UID), as images/Dockerfile makes it.
        f"RUN id -u flytekit >/dev/null 2>&1 || useradd --uid {IMAGE_UID} --user-group --create-home --shell /bin/bash flytekit",
        f"RUN uv venv --python {spec.python_version or '.'.join(map(str, sys.version_info[:2]))} {VENV}",
    ]
    if requirements:
        (out / REQUIREMENTS).write_text(requirements)
        lines += [f"COPY {REQUIREMENTS} /tmp/{REQUIREMENTS}", f"RUN uv pip install {_install_args(spec)} && rm /tmp/{REQUIREMENTS}"]
    lines += copies
    if spec.commands:
        lines.append("RUN " + " && ".join(spec.commands))
    lines += [
        "RUN chown -R flytekit /root /home/flytekit",
        'ENV PATH="$PATH:/usr/local/nvidia/bin:/usr/local/cuda/bin" LD_LIBRARY_PATH="/usr/local/nvidia/lib64"',
        "WORKDIR /root",
        f"USER {IMAGE_UID}:{IMAGE_UID}",
    ]
    if spec.entrypoint:
        lines.append(f"ENTRYPOINT {json.dumps(spec.entrypoint)}")
    dockerfile = out / "Dockerfile"
    dockerfile.write_text("\n".join(lines) + "\n")
    return dockerfile


class BuildahImageBuilder(ImageSpecBuilder):
    """flytekit ImageSpec builder that builds with buildah and pushes to the spec's registry."""

    builder_type = BUILDER_NAME

    def should_build(self, image_spec: ImageSpec) -> bool:
        # Unknown (no answer from the registry) builds too: the push then says what is wrong.
        return registry_has_image(image_spec.image_name()) is not True or bool(image_spec._is_force_push)

    def build_image(self, image_spec: ImageSpec) -> Optional[str]:
        push = os.getenv("FLYTE_PUSH_IMAGE_SPEC", "True").lower() in ("true", "1")
        return self.build(image_spec, push=push)

    def build(self, image_spec: ImageSpec, *, push: bool = True) -> str:
        name = image_spec.image_name()
        problem = buildah_problem()
        if problem:
            raise ImageBuildError(f"building {name} with buildah: {problem}")
        base = qualified(image_spec.base_image or "debian:bookworm-slim")
        if base.startswith("localhost/") and not has_local_image(base):
            raise ImageBuildError(
                f"the base image {base} is not in buildah's storage: make it with "
                "`python -m fuseforge_flyte.cli build-base`, or set [image].base_image to one a registry has"
            )
        with tempfile.TemporaryDirectory(prefix="fuseforge-buildah-") as tmp:
            dockerfile = render_buildah_context(image_spec, tmp)
            print(f"Building {name} with buildah (base {base})", file=sys.stderr)
            # --pull=false: pull the base only when storage does not hold it.
            buildah("bud", "--isolation", "chroot", "--pull=false", "--file", str(dockerfile), "--tag", name, tmp)
        if push and image_spec.registry:
            tls = ["--tls-verify=false"] if is_loopback(name) else []
            buildah("push", *tls, name, f"docker://{name}")
            print(f"Pushed {name}", file=sys.stderr)
        return name


ImageBuildEngine.register(BUILDER_NAME, BuildahImageBuilder(), priority=0)
