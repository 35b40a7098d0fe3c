"""The training image without a Docker daemon: buildah builds it from a base made here and pushes it to a
real OCI registry (cluster/stores), the registration check finds it or says clearly that it cannot be
built, and the image pulled back and unpacked runs `import fuseforge, fuseforge_flyte` under chroot.

The image built here is the training ImageSpec with three stand-ins, because its packages cannot be had on
a machine without PyPI's CUDA torch (3 GB) or the CUDA index: the hash lock images/requirements.txt is
replaced by a lock of one small wheel (same `--require-hashes --no-deps` install), the indexes by one on
loopback (it also serves setuptools, packed from this environment, to build fuseforge from its sources),
and the torch install and `uv pip check` commands are left out. Base image, Python, env, the staged
sources and their install, the uid check, the user, tag, registry and the build/push path are the real ones.
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
import runpy
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from flytekit.image_spec.image_spec import ImageBuildEngine, ImageSpec

import fuseforge_flyte.image.buildah as buildah_mod
import fuseforge_flyte.image.docker as docker_mod
import fuseforge_flyte.image.registration as registration_mod
import fuseforge_flyte.image.spec as spec_mod
from fuseforge_flyte.config import load_config
from fuseforge_flyte.image import IMAGE_UID, ImageBuildError
from fuseforge_flyte.image.base import SUITE_PYTHON, check_name, make_base_image
from fuseforge_flyte.image.buildah import (
    BuildahImageBuilder,
    buildah_problem,
    is_loopback,
    qualified,
    render_buildah_context,
)
from fuseforge_flyte.image.docker import FuseforgeImageBuilder
from fuseforge_flyte.image.registry import registry_has_image, split_image_name
from fuseforge_flyte.image.sources import STAGED_SOURCE_DIR
from fuseforge_flyte.image.spec import UID_CHECK_COMMAND, training_image
from local_index import serve_index, wheel_from_installed, write_wheel
from oci_pull import pull, unpack

REPO = Path(__file__).resolve().parents[2]
BASE = "localhost/fuseforge-base:bookworm"
PYTHON = SUITE_PYTHON["bookworm"]


def image_config(registry: str, tag: str = "", **image: str):
    env = {"FUSEFORGE__IMAGE__REGISTRY": registry, "FUSEFORGE__IMAGE__TAG": tag,
           "FUSEFORGE__IMAGE__BASE_IMAGE": BASE, "FUSEFORGE__IMAGE__PYTHON_VERSION": PYTHON,
           "FUSEFORGE__IMAGE__APT_PACKAGES": "[]"}
    env.update({f"FUSEFORGE__IMAGE__{k.upper()}": v for k, v in image.items()})
    return load_config(env=env)


def executable(folder: Path, name: str, script: str) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / name
    path.write_text("#!/bin/sh\n" + script)
    path.chmod(0o755)
    return path


@pytest.fixture
def fake_uv(monkeypatch, tmp_path):
    uv = executable(tmp_path / "uvbin", "uv", "exit 0\n")
    monkeypatch.setattr(buildah_mod, "find_uv", lambda: uv)
    return uv


# ----------------------------------------------------------------------------- the Dockerfile buildah builds


def test_buildah_context_follows_the_locked_spec(fake_uv, tmp_path):
    spec = training_image(image_config("127.0.0.1:5000"))
    dockerfile = render_buildah_context(spec, tmp_path / "ctx")
    text = dockerfile.read_text()
    lines = text.splitlines()
    assert lines[1] == f"FROM {BASE}" and "FROM" not in "\n".join(lines[2:])  # no other image is pulled
    assert "micromamba" not in text and "ghcr.io" not in text and "--mount" not in text
    assert f"RUN uv venv --python {PYTHON} /opt/venv" in lines
    # The hash lock goes in as written and is installed as flytekit's template would: with the spec's args.
    assert (tmp_path / "ctx" / "requirements_uv.txt").read_text() == Path(spec.requirements).read_text()
    (install,) = [line for line in lines if "--requirement /tmp/requirements_uv.txt" in line]
    assert install.startswith(f"RUN uv pip install {spec.pip_extra_args} --requirement") and "index-url" not in install
    assert f"COPY --chown=flytekit {STAGED_SOURCE_DIR} /root/{STAGED_SOURCE_DIR}/" in lines
    assert (tmp_path / "ctx" / STAGED_SOURCE_DIR / "kernels" / "fuseforge" / "__init__.py").is_file()
    assert "RUN " + " && ".join(spec.commands) in lines and spec.commands[0] == UID_CHECK_COMMAND
    assert f"useradd --uid {IMAGE_UID} --user-group" in text and lines[-1] == f"USER {IMAGE_UID}:{IMAGE_UID}"
    assert 'DS_BUILD_OPS="0"' in text and (tmp_path / "ctx" / "uv").read_bytes() == fake_uv.read_bytes()
    # Order: user, venv, locked packages, sources, then the spec's commands (torch, fuseforge, check).
    order = [next(i for i, line in enumerate(lines) if line.startswith(p)) for p in
             ("RUN id -u flytekit", "RUN uv venv", "RUN uv pip install", f"COPY --chown=flytekit {STAGED_SOURCE_DIR}", "RUN test ")]
    assert order == sorted(order)


def test_buildah_context_names_indexes_and_qualifies_short_base_names(fake_uv, tmp_path):
    spec = dataclasses.replace(training_image(load_config(env={})), requirements=None, pip_extra_args=None,
                               packages=["numpy==2.0"], pip_index="https://pypi.example/simple",
                               pip_extra_index_url=["https://extra.example/simple"])
    text = render_buildah_context(spec, tmp_path).read_text()
    assert f"FROM docker.io/{spec.base_image}" in text  # buildah has no short-name search list here
    assert ("RUN uv pip install --index-url https://pypi.example/simple --extra-index-url https://extra.example/simple "
            "--requirement /tmp/requirements_uv.txt") in text
    assert "apt-get install -y --no-install-recommends build-essential" in text
    assert (tmp_path / "requirements_uv.txt").read_text() == "numpy==2.0\n"
    assert qualified("debian:bookworm") == "docker.io/library/debian:bookworm"
    assert qualified("ghcr.io/acme/x:1") == "ghcr.io/acme/x:1" and qualified("localhost/x:1") == "localhost/x:1"
    assert is_loopback("127.0.0.1:5000/x:1") and is_loopback("localhost:5000/x:1") and is_loopback("[::1]:5000/x:1")
    assert not is_loopback("ghcr.io/acme/x:1") and not is_loopback("registry.local:5000/x:1")


@pytest.mark.parametrize(
    "change, message",
    [
        (dict(conda_packages=["numpy"]), r"does not support ImageSpec conda_packages: build with Docker"),
        (dict(platform="linux/s390x"), r"platform 'linux/s390x' is not this machine's \(linux/"),
        (dict(requirements="uv.lock"), r"installs plain requirement files, not uv.lock"),
        (dict(copy=["no-such-dir"]), r"ImageSpec.copy entry 'no-such-dir' does not exist"),
    ],
)
def test_buildah_context_refuses_what_it_cannot_build(fake_uv, tmp_path, change, message):
    spec = dataclasses.replace(training_image(load_config(env={})), **change)
    with pytest.raises(ImageBuildError, match=message):
        render_buildah_context(spec, tmp_path)


def test_base_image_name_and_python_must_fit_debian():
    with pytest.raises(ImageBuildError, match=r'pulled from its registry.*set \[image\].base_image = "localhost/fuseforge-base:bookworm"'):
        check_name("nvidia/cuda:13.0.2-cudnn-runtime-ubuntu24.04", PYTHON, "bookworm")
    with pytest.raises(ImageBuildError, match=r'Debian bookworm has Python 3.11: set \[image\].python_version = "3.11"'):
        check_name(BASE, "3.12", "bookworm")
    check_name(BASE, PYTHON, "bookworm")


def test_build_base_cli_says_which_base_image_name_to_set(capsys, monkeypatch):
    monkeypatch.setenv("FUSEFORGE_CONFIG", "")
    from fuseforge_flyte.cli import main

    assert main(["--config", str(REPO / "platform.toml"), "build-base"]) == 1
    err = capsys.readouterr().err
    assert "[image].base_image = 'nvidia/cuda:" in err and 'set [image].base_image = "localhost/fuseforge-base:bookworm"' in err


def test_a_failing_buildah_command_is_named_with_its_last_error_line(tmp_path, monkeypatch):
    executable(tmp_path, "buildah", "echo 'STEP 1/2: FROM x'\necho 'Error: pushing: http: server gave HTTP response' >&2\necho >&2\nexit 125\n")
    monkeypatch.setenv("PATH", str(tmp_path))
    with pytest.raises(ImageBuildError) as info:
        buildah_mod.buildah("push", "a", "docker://a")
    assert str(info.value) == ("`buildah --storage-driver vfs push a docker://a` failed (exit 125): "
                               "Error: pushing: http: server gave HTTP response")


# ----------------------------------------------------------------------------- which builder builds


@pytest.fixture
def tools(tmp_path, monkeypatch):
    """PATH holding only the fake programs a test puts in it."""
    folder = tmp_path / "bin"
    folder.mkdir()
    monkeypatch.setenv("PATH", str(folder))
    monkeypatch.setattr(docker_mod, "check_locked", lambda spec, config=None: None)
    return folder


DAEMON_DOWN = "echo 'Cannot connect to the Docker daemon at unix:///var/run/docker.sock.' >&2\nexit 1\n"


def test_neither_docker_nor_buildah_is_one_line_naming_both(tools, monkeypatch):
    spec = training_image(image_config("127.0.0.1:5000"))
    with pytest.raises(ImageBuildError) as info:
        FuseforgeImageBuilder().build(spec)
    message = str(info.value)
    assert "\n" not in message and message.startswith(f"building {spec.image_name()} needs Docker")
    assert "no `docker` command on this machine; nor can buildah build: no `buildah` command (Debian/Ubuntu: apt-get install buildah)" in message
    executable(tools, "docker", DAEMON_DOWN)
    executable(tools, "buildah", "exit 0\n")
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    with pytest.raises(ImageBuildError, match=r"daemon is not reachable .*; nor can buildah build: .*needs root"):
        FuseforgeImageBuilder().build(spec)


def test_buildah_builds_where_no_docker_daemon_answers_and_docker_where_one_does(tools, monkeypatch):
    spec = training_image(image_config("127.0.0.1:5000"))
    built = []
    monkeypatch.setattr(BuildahImageBuilder, "build", lambda self, s, push=True: built.append(("buildah", push)) or s.image_name())
    monkeypatch.setattr(FuseforgeImageBuilder, "_build_image", lambda self, s, push=True: built.append(("docker", push)))
    monkeypatch.setattr(os, "geteuid", lambda: 0)
    executable(tools, "buildah", "exit 0\n")
    executable(tools, "docker", DAEMON_DOWN)
    assert FuseforgeImageBuilder().build(spec, push=False) == spec.image_name()
    executable(tools, "docker", "exit 0\n")  # `docker info` answers: Docker is still the builder
    FuseforgeImageBuilder().build(spec)
    assert built == [("buildah", False), ("docker", True)]
    assert ImageBuildEngine._get_builder("fuseforge-buildah").__class__ is BuildahImageBuilder


# ----------------------------------------------------------------------------- a real build, push and pull

E2E_MISSING = [
    reason for needed, reason in (
        (sys.platform == "linux" and os.geteuid() == 0, "needs root (buildah --isolation chroot, debootstrap, chroot)"),
        (shutil.which("buildah"), "needs buildah (bash scripts/cluster.sh deps installs it)"),
        (shutil.which("debootstrap"), "needs debootstrap (bash scripts/cluster.sh deps installs it)"),
        (shutil.which("go"), "needs Go to build cluster/stores (the registry)"),
    ) if not needed
]
try:
    buildah_mod.find_uv()
except ImageBuildError:
    E2E_MISSING.append("needs the uv package (pip install uv; in the dev extra)")
needs_image_tools = pytest.mark.skipif(bool(E2E_MISSING), reason="; ".join(E2E_MISSING))
one_worker = pytest.mark.xdist_group("image")  # one storage, registry and base for both builds


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.fixture(scope="module")
def storage(tmp_path_factory):
    """A buildah storage of this module's own (vfs), removed at the end, with the base image made here."""
    root = tmp_path_factory.mktemp("buildah")
    conf = root / "storage.conf"
    conf.write_text(f'[storage]\ndriver = "vfs"\ngraphroot = "{root}/graph"\nrunroot = "{root}/run"\n')
    previous = os.environ.get("CONTAINERS_STORAGE_CONF")
    os.environ["CONTAINERS_STORAGE_CONF"] = str(conf)
    try:
        started = time.monotonic()
        make_base_image(BASE, PYTHON)
        print(f"base image ready in {time.monotonic() - started:.0f} s")
        yield conf
    finally:
        subprocess.run(["buildah", "--storage-driver", "vfs", "rmi", "--all", "--force"], capture_output=True)
        if previous is None:
            os.environ.pop("CONTAINERS_STORAGE_CONF", None)
        else:
            os.environ["CONTAINERS_STORAGE_CONF"] = previous
        shutil.rmtree(root)


@pytest.fixture(scope="module")
def registry(tmp_path_factory):
    """cluster/stores' OCI registry on a free loopback port, stopped by pid."""
    sys.path.insert(0, str(REPO / "cluster"))
    from localcluster.build import build_all

    program = build_all(["stores"])["stores"]
    address = f"127.0.0.1:{free_port()}"
    log = tmp_path_factory.mktemp("registry") / "registry.log"
    with open(log, "w") as out:
        proc = subprocess.Popen([str(program), "registry", "--address", address, "--root", str(log.parent / "blobs")],
                                stdout=out, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 30
        while registry_has_image(f"{address}/probe:none", timeout=1) is None:
            assert proc.poll() is None and time.monotonic() < deadline, log.read_text()
            time.sleep(0.1)
        yield address
    finally:
        proc.terminate()
        proc.wait(timeout=30)


@pytest.fixture(scope="module")
def index(tmp_path_factory):
    """A loopback index: the probe wheel (locked by hash) and setuptools to build fuseforge with."""
    folder = tmp_path_factory.mktemp("index")
    wheel_from_installed(folder, "setuptools")
    probe = write_wheel(folder, "fuseforge-probe", "1.0", {"fuseforge_probe.py": b"LOCKED = True\n"})
    lock = folder / "probe-lock.txt"
    lock.write_text(f"fuseforge-probe==1.0 \\\n    --hash=sha256:{hashlib.sha256(probe.read_bytes()).hexdigest()}\n")
    with serve_index(folder) as url:
        yield url, lock


def probe_spec(config, index) -> ImageSpec:
    """The training ImageSpec with the stand-ins of the module docstring."""
    url, lock = index
    spec = training_image(config)
    kept = [c for c in spec.commands if c == UID_CHECK_COMMAND or STAGED_SOURCE_DIR in c]
    assert len(kept) == 2, spec.commands  # the uid check and the install of the staged sources
    # UV_INDEX_URL: building fuseforge from its sources fetches setuptools, from the index uv is told of.
    return dataclasses.replace(spec, requirements=str(lock), pip_index=url, commands=kept,
                               env={**spec.env, "UV_INDEX_URL": url})


@pytest.fixture
def registering(monkeypatch, tmp_path):
    """As in `pyflyte run --remote` on this machine: no Docker daemon; the registry asked, never Docker Hub."""
    monkeypatch.setattr(docker_mod, "registration_command", lambda: "pyflyte run --remote")
    monkeypatch.setattr(registration_mod, "_SEEN_REGISTRATION", [])  # what training_image() records stays here
    monkeypatch.setattr(docker_mod, "check_locked", lambda spec, config=None: None)  # the probe lock stands in
    monkeypatch.setattr(ImageSpec, "exist", lambda self: pytest.fail("asked Docker / Docker Hub, not the registry"))
    monkeypatch.delenv(docker_mod.IMAGE_CHECK_ENV, raising=False)
    no_daemon = tmp_path / "no-daemon"
    executable(no_daemon, "docker", DAEMON_DOWN)
    return no_daemon


def engine_build(spec: ImageSpec) -> None:
    """What flytekit does with a task's ImageSpec while serializing it for registration."""
    ImageBuildEngine.build.cache_clear()
    ImageBuildEngine.build(spec)


@needs_image_tools
@one_worker
@pytest.mark.usefixtures("storage")
def test_registration_builds_a_missing_image_with_buildah_and_the_image_runs_fuseforge(
    registry, index, registering, monkeypatch, tmp_path, capsys
):
    spec = probe_spec(image_config(registry), index)  # tag: the content hash
    name = spec.image_name()
    assert registry_has_image(name) is False

    # Absent, and nothing here can build it: one clear line, before anything could be registered.
    monkeypatch.setenv("PATH", str(registering))
    with pytest.raises(ImageBuildError) as info:
        engine_build(spec)
    assert "\n" not in str(info.value) and "nor can buildah build: no `buildah` command" in str(info.value)
    assert registry_has_image(name) is False

    # Absent, with buildah: built, pushed, and then found.
    monkeypatch.setenv("PATH", f"{registering}:/usr/sbin:/usr/bin:/sbin:/bin")
    started = time.monotonic()
    engine_build(spec)
    with capsys.disabled():
        print(f"\nbuilt and pushed {name} with buildah in {time.monotonic() - started:.1f} s")
    assert f"Image {name} is not in the registry: building and pushing it." in capsys.readouterr().out
    assert registry_has_image(name) is True

    # Present: nothing is built, even with no builder at all.
    monkeypatch.setenv("PATH", str(tmp_path))
    assert FuseforgeImageBuilder().should_build(spec) is False
    engine_build(spec)
    monkeypatch.setenv("PATH", "/usr/sbin:/usr/bin:/sbin:/bin")

    # What the image holds: pulled back over HTTP, unpacked, run under chroot as the image says.
    host, repository, tag = split_image_name(name)
    manifest, config, layers = pull(host, repository, tag)
    rootfs = tmp_path / "rootfs"
    try:
        unpack(manifest, layers, rootfs)
        settings = config["config"]
        assert settings["User"] == f"{IMAGE_UID}:{IMAGE_UID}" and settings["WorkingDir"] == "/root"
        env = dict(item.split("=", 1) for item in settings["Env"])
        assert env["VIRTUAL_ENV"] == "/opt/venv" and env["PYTHONPATH"] == "/root"
        script = ("import fuseforge, fuseforge_flyte, fuseforge_probe, sys; "
                  "print(\"%d.%d\" % sys.version_info[:2], fuseforge.__file__, fuseforge_flyte.__file__, fuseforge_probe.LOCKED)")
        proc = subprocess.run(
            ["chroot", f"--userspec={settings['User']}", str(rootfs), "/usr/bin/env", "-i", *settings["Env"],
             "HOME=/root", "/bin/sh", "-c", f"cd {settings['WorkingDir']} && python -c '{script}'"],
            capture_output=True, text=True, timeout=120,
        )
        assert proc.returncode == 0, proc.stderr
        site = f"/opt/venv/lib/python{PYTHON}/site-packages"
        assert proc.stdout.split() == [PYTHON, f"{site}/fuseforge/__init__.py", f"{site}/fuseforge_flyte/__init__.py", "True"]
        # Flyte runs tasks in /root as the image's user: it must own it.
        assert (rootfs / "root").stat().st_uid == IMAGE_UID
    finally:
        shutil.rmtree(rootfs, ignore_errors=True)


@needs_image_tools
@one_worker
@pytest.mark.usefixtures("storage")
def test_images_build_py_builds_and_pushes_without_a_docker_daemon(registry, index, registering, monkeypatch):
    monkeypatch.setenv("PATH", f"{registering}:/usr/sbin:/usr/bin:/sbin:/bin")
    for key, value in {"REGISTRY": registry, "TAG": "cli", "BASE_IMAGE": BASE, "PYTHON_VERSION": PYTHON,
                       "APT_PACKAGES": "[]"}.items():
        monkeypatch.setenv(f"FUSEFORGE__IMAGE__{key}", value)
    monkeypatch.setattr(spec_mod, "training_image", lambda config: probe_spec(config, index))
    monkeypatch.setattr(sys, "argv", ["images/build.py"])
    with pytest.raises(SystemExit) as done:
        runpy.run_path(str(REPO / "images" / "build.py"), run_name="__main__")
    assert done.value.code == 0
    assert registry_has_image(f"{registry}/fuseforge:cli") is True
    _, config, _ = pull(registry, "fuseforge", "cli")
    assert config["config"]["User"] == f"{IMAGE_UID}:{IMAGE_UID}" and config["architecture"] == "amd64"

