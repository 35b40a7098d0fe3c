"""The training image: ImageSpec from [image], its offline Docker context, images/ files, the build CLI."""

from __future__ import annotations

import http.server
import json
import re
import shlex
import shutil
import socket
import stat
import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import click
import pytest

import fuseforge_flyte.image.docker as docker_mod
import fuseforge_flyte.image.registration as registration_mod
import fuseforge_flyte.image.spec as spec_mod
from fuseforge_flyte.cli import main, pyflyte_command, requirements_txt
from fuseforge_flyte.config import load_config
from fuseforge_flyte.image import IMAGE_UID, ImageBuildError
from fuseforge_flyte.image.docker import IMAGE_CHECK_ENV, FuseforgeImageBuilder, render_docker_context
from fuseforge_flyte.image.lock import parse_lock, requirement_lines as lock_lines
from fuseforge_flyte.image.registration import registration_command
from fuseforge_flyte.image.registry import registry_has_image
from fuseforge_flyte.image.sources import STAGED_SOURCE_DIR
from fuseforge_flyte.image.spec import LOCKED_INSTALL_ARGS, UID_CHECK_COMMAND, torch_install_command, training_image

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture
def defaults(tmp_path, monkeypatch):
    """The built-in defaults (same as the repo's platform.toml), independent of the cwd and environment."""
    monkeypatch.chdir(tmp_path)
    return load_config(env={})


def small_checkout(root: Path) -> Path:
    """A minimal source tree shaped like the repo, to watch the content tag react to edits."""
    (root / "kernels" / "fuseforge").mkdir(parents=True)
    (root / "workflows" / "fuseforge_flyte").mkdir(parents=True)
    shutil.copy(REPO / "pyproject.toml", root / "pyproject.toml")
    (root / "kernels" / "fuseforge" / "__init__.py").write_text("VERSION = 1\n")
    (root / "workflows" / "fuseforge_flyte" / "__init__.py").write_text("")
    return root


LOCK = REPO / "images" / "requirements.txt"


def test_image_spec_follows_config(defaults):
    spec = training_image(defaults)
    image = defaults.image
    assert spec.registry == image.registry and spec.name == image.name
    assert spec.base_image == image.base_image and spec.python_version == image.python_version
    # The hash lock, installed as it is (hashes checked, nothing resolved); no loose package list, no extra index.
    assert spec.requirements == str(LOCK) and spec.pip_extra_args == LOCKED_INSTALL_ARGS == "--require-hashes --no-deps"
    assert spec.packages is None and spec.pip_extra_index_url is None and spec.pip_index is None
    locked = set(parse_lock(LOCK.read_text()))
    assert {"triton", "transformers", "deepspeed", "flytekit", "flytekitplugins-kfpytorch",
            "flytekitplugins-deck-standard"} <= locked and "torch" not in locked
    assert spec.copy == [STAGED_SOURCE_DIR]
    # The uid check first: the chart's pods run as IMAGE_UID, so the image's user must have it. Then torch by name
    # from its own index alone, fuseforge from the checkout without dependencies, and a consistency check.
    assert spec.commands == [UID_CHECK_COMMAND,
                             f"uv pip install --index-url {image.torch_index_url} {image.torch}",
                             f"uv pip install --no-deps /root/{STAGED_SOURCE_DIR}", "uv pip check"]
    assert f'= "{IMAGE_UID}:{IMAGE_UID}"' in UID_CHECK_COMMAND
    assert spec.apt_packages == list(image.apt_packages)
    assert spec.image_name() == f"{image.registry}/{image.name}:{spec.tag}"


def test_content_tag_tracks_sources_not_caches(tmp_path, monkeypatch, defaults):
    checkout = small_checkout(tmp_path / "repo")
    monkeypatch.setattr(spec_mod, "find_checkout", lambda: checkout)
    first = training_image(defaults).tag
    assert training_image(defaults).tag == first  # deterministic

    cache = checkout / "kernels" / "fuseforge" / "__pycache__"
    cache.mkdir()
    (cache / "x.cpython-311.pyc").write_bytes(b"\0" * 16)
    assert training_image(defaults).tag == first  # caches are neither hashed nor copied

    (checkout / "kernels" / "fuseforge" / "__init__.py").write_text("VERSION = 2\n")
    edited = training_image(defaults).tag
    assert edited != first

    pinned = load_config(env={"FUSEFORGE__IMAGE__TAG": "release-1"})
    assert training_image(pinned).image_name().endswith("/fuseforge:release-1")
    other_torch = load_config(env={"FUSEFORGE__IMAGE__TORCH": "torch==2.10.0"})
    assert training_image(other_torch).tag not in (first, edited)


def test_pip_requirement_instead_of_checkout(defaults, tmp_path):
    """fuseforge from a pip requirement comes from the lock like everything else: this lock was made for the
    checkout, so it is refused until `python images/lock.py` locks that requirement too."""
    config = load_config(env={"FUSEFORGE__IMAGE__FUSEFORGE": "fuseforge[hf,platform]==0.1.0"})
    spec = training_image(config)
    assert spec.requirements == str(LOCK) and spec.packages is None
    assert not spec.copy and spec.commands == [UID_CHECK_COMMAND, torch_install_command(config.image), "uv pip check"]
    with pytest.raises(ImageBuildError, match=r"fuseforge\[hf,platform\]==0.1.0 is not in it.*python images/lock.py"):
        render_docker_context(spec, tmp_path / "ctx", config)


def test_unknown_extra_is_a_config_error(defaults):
    config = load_config(env={"FUSEFORGE__IMAGE__EXTRAS": '["hf", "gpu"]'})
    with pytest.raises(ValueError, match=r"\[image\]\.extras names \['gpu'\], but pyproject.toml only defines"):
        training_image(config)


def install_commands(dockerfile: str) -> list:
    """Every `uv pip install ...` of a rendered Dockerfile, in order, as argument lists."""
    joined = re.sub(r"\\\n", " ", dockerfile)
    return [shlex.split(m.group(1)) for m in re.finditer(r"uv pip install ((?:(?!&&)[^\n])*)", joined)]


def test_render_docker_context_offline_from_any_directory(tmp_path, defaults):
    """The build context pyflyte and images/build.py build: locked, one index per install, nothing unsafe."""
    spec = training_image(defaults)
    dockerfile = render_docker_context(spec, tmp_path / "ctx")
    text = dockerfile.read_text()
    image = defaults.image
    assert f"FROM {image.base_image}" in text
    assert f"COPY --chown=flytekit {STAGED_SOURCE_DIR} /root/{STAGED_SOURCE_DIR}/" in text
    assert "DS_BUILD_OPS=0" in text
    # No index strategy that lets one index serve another's packages, at build or run time (ENV stays in the image).
    assert "unsafe-best-match" not in text and "UV_INDEX_STRATEGY" not in text and "UV_EXTRA_INDEX_URL" not in text
    assert "--extra-index-url" not in text and "--index-strategy" not in text
    locked, torch, source = install_commands(text)
    # 1. the lock, from PyPI alone: every archive checked against its sha256, nothing resolved beyond it
    assert locked == ["--require-hashes", "--no-deps", "--requirement", "requirements_uv.txt"]
    requirements = (tmp_path / "ctx" / "requirements_uv.txt").read_text()
    assert lock_lines(requirements) == lock_lines(LOCK.read_text())  # the lock itself: nothing added, nothing lost
    for line in re.sub(r"\\\n\s*", " ", requirements).splitlines():
        if line.strip() and not line.lstrip().startswith("#"):
            requirement, *hashes = line.split()
            assert re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9._-]*(\[[^\]]*\])?==\S+", requirement), line
            assert hashes and all(re.fullmatch(r"--hash=sha256:[0-9a-f]{64}", h) for h in hashes), line
    # 2. torch by name, from its index alone; that index appears nowhere else
    assert torch == ["--index-url", image.torch_index_url, image.torch]
    assert text.count(image.torch_index_url) == 1
    # 3. fuseforge from the staged checkout, without dependencies; then the whole environment is checked
    assert source == ["--no-deps", f"/root/{STAGED_SOURCE_DIR}"]
    assert text.index("--requirement requirements_uv.txt") < text.index(image.torch_index_url) < text.index(
        "uv pip check")

    staged = tmp_path / "ctx" / STAGED_SOURCE_DIR
    assert (staged / "pyproject.toml").is_file()
    assert (staged / "kernels" / "fuseforge" / "__init__.py").is_file()
    assert (staged / "workflows" / "fuseforge_flyte" / "tasks.py").is_file()
    assert not list(staged.rglob("__pycache__")) and not list(staged.rglob("*.egg-info"))


def test_a_lock_that_no_longer_fits_the_image_is_refused_before_building(tmp_path, defaults):
    more = load_config(env={"FUSEFORGE__IMAGE__EXTRA_PACKAGES": '["tensorboard>=2.18"]'})
    with pytest.raises(ImageBuildError, match=r"requirements.txt no longer fits \[image\].*tensorboard>=2.18 is not in "
                                              r"it. Renew it with `python images/lock.py`"):
        render_docker_context(training_image(more), tmp_path / "more")
    other_torch = load_config(env={"FUSEFORGE__IMAGE__TORCH": "torch==2.10.0"})
    with pytest.raises(ImageBuildError, match=r"it was not made for torch==2.10.0"):
        render_docker_context(training_image(other_torch), tmp_path / "torch")
    narrower = load_config(env={"FUSEFORGE__IMAGE__EXTRA_PACKAGES": '["numpy<2"]'})
    with pytest.raises(ImageBuildError, match=r"numpy<2 does not allow the locked numpy=="):
        FuseforgeImageBuilder().build(training_image(narrower), push=False)  # before anything asks for Docker
    assert not (tmp_path / "more").exists() and not (tmp_path / "torch").exists()


def test_without_the_lock_nothing_is_built(tmp_path, monkeypatch, defaults):
    """Installed from a wheel (e.g. inside the image): the spec keeps its identity, but it is never built unlocked."""
    monkeypatch.setattr(spec_mod, "find_checkout", lambda: None)
    config = load_config(env={"FUSEFORGE__IMAGE__FUSEFORGE": "fuseforge[hf,platform]==0.1.0"})
    spec = training_image(config)
    assert spec.requirements is None and spec.packages
    with pytest.raises(ImageBuildError, match=r"built from the hash lock images/requirements.txt of the fuseforge "
                                              r"source checkout.*build from a git checkout"):
        render_docker_context(spec, tmp_path / "ctx", config)


def test_build_without_docker_says_so(defaults, monkeypatch, tmp_path):
    spec = training_image(defaults)
    monkeypatch.setenv("PATH", str(tmp_path))  # no docker anywhere
    with pytest.raises(ImageBuildError, match=r"needs Docker with BuildKit.*no `docker` command"):
        FuseforgeImageBuilder().build(spec, push=False)

    # A docker CLI whose daemon is down (as on this test machine's CI).
    fake = tmp_path / "docker"
    fake.write_text("#!/bin/sh\necho 'Cannot connect to the Docker daemon at unix:///var/run/docker.sock.' >&2\nexit 1\n")
    fake.chmod(fake.stat().st_mode | stat.S_IEXEC)
    with pytest.raises(ImageBuildError, match=r"daemon is not reachable \(Cannot connect to the Docker daemon"):
        FuseforgeImageBuilder().build(spec, push=False)
    assert main(["build-image", "--no-push"]) == 1


def requirement_lines(text: str) -> list:
    return [line for line in text.splitlines() if line.strip() and not line.lstrip().startswith("#")]


def test_requirements_in_is_in_sync_with_pyproject(defaults):
    committed = requirement_lines((REPO / "images" / "requirements.in").read_text())
    assert committed == requirement_lines(requirements_txt(defaults)), (
        "images/requirements.in is stale: python images/lock.py (rewrites it and the lock)"
    )
    assert defaults.image.torch not in committed  # the CUDA torch is installed first, separately
    proc = subprocess.run([sys.executable, str(REPO / "images" / "lock.py"), "--check"], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr


def load_lock_script():
    import importlib.util

    spec = importlib.util.spec_from_file_location("fuseforge_images_lock", REPO / "images" / "lock.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_requirements_txt_is_hash_locked_and_covers_requirements_in(defaults):
    """Every package pinned with ==, each with sha256 hashes; the direct requirements satisfied; no torch stack."""
    from packaging.requirements import Requirement
    from packaging.utils import canonicalize_name
    from packaging.version import Version

    lock = load_lock_script()
    text = (REPO / "images" / "requirements.txt").read_text()
    assert f"with {defaults.image.torch} " in text  # locked against the torch the image installs
    pinned = {}
    joined = re.sub(r"\\\n\s*", " ", text)
    for line in joined.splitlines():
        if not line.strip() or line.lstrip().startswith("#"):
            continue
        requirement, *options = line.split()
        assert options and all(re.fullmatch(r"--hash=sha256:[0-9a-f]{64}", o) for o in options), line
        name, _, version = requirement.partition("==")
        assert version and re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9._-]*", name), f"not pinned with ==: {line}"
        pinned[canonicalize_name(name)] = Version(version)
    assert set(pinned) == set(lock.parse_lock(text))  # the lock script reads what it wrote
    assert "torch" not in pinned and not any(n.startswith(("nvidia-", "cuda-")) for n in pinned)
    image_env = {"python_version": defaults.image.python_version, "python_full_version": defaults.image.python_version + ".0",
                 "sys_platform": "linux", "platform_system": "Linux", "platform_machine": "x86_64"}
    for line in requirement_lines((REPO / "images" / "requirements.in").read_text()):
        req = Requirement(line)
        if req.name == "torch" or (req.marker and not req.marker.evaluate(image_env)):
            continue
        name = canonicalize_name(req.name)
        assert name in pinned, f"{req} is missing from images/requirements.txt: python images/lock.py"
        assert req.specifier.contains(pinned[name], prereleases=True), f"{req} vs locked {pinned[name]}"


def test_lock_script_leaves_out_only_what_torch_alone_needs():
    lock = load_lock_script()
    text = textwrap.dedent("""\
        fsspec==1 \\
            --hash=sha256:aa
            # via
            #   torch
            #   flytekit
        flytekit==2 \\
            --hash=sha256:bb
            # via -r requirements.in
        nvidia-cublas==3 \\
            --hash=sha256:cc
            # via cuda-toolkit
        cuda-toolkit==4 \\
            --hash=sha256:dd
            # via torch
        torch==2.11.0 \\
            --hash=sha256:ee
            # via -r requirements.in
        triton==3.6.0 \\
            --hash=sha256:ff
            # via torch, -r requirements.in
        """)
    blocks = lock.parse_lock(text)
    assert blocks["fsspec"]["via"] == {"torch", "flytekit"}
    assert sorted(lock.drop_torch_stack(blocks)) == ["flytekit", "fsspec", "triton"]


def test_dockerfile_installs_only_hash_checked_packages_besides_torch(defaults):
    """The same steps as the ImageSpec build: the lock from PyPI alone, then torch by name from its index alone."""
    text = (REPO / "images" / "Dockerfile").read_text()
    assert "unsafe-best-match" not in text and "--index-strategy" not in text  # no index may shadow another's
    assert "--extra-index-url" not in text and "UV_INDEX_STRATEGY" not in text
    locked, torch_install, source = install_commands(text)
    assert locked == ["--no-deps", "--require-hashes", "--requirement", "/tmp/requirements.txt"]
    assert torch_install == ["--index-url", "${TORCH_INDEX_URL}", "${TORCH}"]
    assert text.index("--requirement /tmp/requirements.txt") < text.index("--index-url") < text.index("uv pip check")
    assert "COPY images/requirements.txt /tmp/requirements.txt" in text
    assert source == ["--no-deps", "/opt/fuseforge-src"]
    # The image's user has the uid the chart's pods run as, and the image says so numerically.
    assert f"useradd --uid {IMAGE_UID} " in text and re.search(rf"^USER {IMAGE_UID}:{IMAGE_UID}$", text, flags=re.M)


def test_dockerfile_matches_config_defaults_and_context(defaults):
    text = (REPO / "images" / "Dockerfile").read_text()
    args = dict(re.findall(r"^ARG (\w+)=(\S+)$", text, flags=re.M))
    image = defaults.image
    assert args == {
        "BASE_IMAGE": image.base_image,
        "PYTHON_VERSION": image.python_version,
        "TORCH": image.torch,
        "TORCH_INDEX_URL": image.torch_index_url,
    }
    ignore = (REPO / "images" / "Dockerfile.dockerignore").read_text().splitlines()
    for line in re.findall(r"^COPY (?!--from)(.+)$", text, flags=re.M):
        *sources, _ = line.split()
        for source in sources:
            assert (REPO / source).exists(), f"images/Dockerfile copies {source}, which does not exist"
            assert f"!{source}" in ignore or f"!{source}/" in ignore, f"{source} is excluded from the build context"


def test_cli_render_and_errors(tmp_path, capsys, monkeypatch, defaults):
    monkeypatch.setenv("FUSEFORGE_CONFIG", "")  # main(--config) sets it; restored after the test
    assert main(["build-image", "--render", str(tmp_path / "out")]) == 0
    assert (tmp_path / "out" / "Dockerfile").is_file()
    assert main(["--set", "cluster.gpus=two", "config"]) == 2
    assert '--set cluster.gpus=two: [cluster].gpus must be an integer >= 0, got "two"' in capsys.readouterr().err
    config_file = tmp_path / "custom.toml"
    config_file.write_text(textwrap.dedent('[image]\nregistry = "ghcr.io/acme"\n[flyte]\nproject = "ml"\ndomain = "prod"\n'))
    assert main(["--config", str(config_file), "config"]) == 0
    assert '"registry": "ghcr.io/acme"' in capsys.readouterr().out


def test_remote_run_command_uses_flyte_settings(defaults):
    command = pyflyte_command(defaults, "compare", remote=True, extra=["--steps", "5"])
    assert command[:4] == ["pyflyte", "run", "--remote", "--copy"] and command[4] == "all"
    assert command[5:9] == ["-p", defaults.flyte.project, "-d", defaults.flyte.domain]
    assert command[-4:] == [str(REPO / "workflows" / "compare.py"), "compare", "--steps", "5"]
    assert pyflyte_command(defaults, "train", remote=False, extra=[])[2:] == [str(REPO / "workflows" / "train.py"), "train"]


# ----------------------------------------------------------------------------------------- the registry check


class FakeRegistry(http.server.BaseHTTPRequestHandler):
    """A Docker Registry v2 that wants an anonymous bearer token, like ghcr.io or Docker Hub."""

    tags: set = set()

    def log_message(self, *args):  # quiet
        pass

    def do_GET(self):
        if self.path.startswith("/token?"):
            body = json.dumps({"token": "anon"}).encode()
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)
        else:
            self.send_response(404)
            self.end_headers()

    def do_HEAD(self):
        match = re.fullmatch(r"/v2/(.+)/manifests/(.+)", self.path)
        if not match:
            self.send_response(404)
        elif self.headers.get("Authorization") != "Bearer anon":
            self.send_response(401)
            host = self.headers["Host"]
            self.send_header(
                "WWW-Authenticate",
                f'Bearer realm="http://{host}/token",service="{host}",scope="repository:{match[1]}:pull"',
            )
        else:
            self.send_response(200 if f"{match[1]}:{match[2]}" in self.tags else 404)
        self.end_headers()


@pytest.fixture
def registry():
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), FakeRegistry)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    FakeRegistry.tags = set()
    yield f"localhost:{server.server_address[1]}"
    server.shutdown()


@pytest.fixture
def closed_port():
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]  # nothing listens there once closed: connection refused


def spec_for(tmp_path, registry_host: str, tag: str = ""):
    config = load_config(env={"FUSEFORGE__IMAGE__REGISTRY": registry_host, "FUSEFORGE__IMAGE__TAG": tag})
    return training_image(config)


@pytest.fixture
def registering(monkeypatch, tmp_path):
    """As under `pyflyte run --remote`, on a machine without Docker."""
    monkeypatch.setattr(docker_mod, "registration_command", lambda: "pyflyte run --remote")
    # training_image() records the registration it sees; a fresh record keeps it from later tests.
    monkeypatch.setattr(registration_mod, "_SEEN_REGISTRATION", [])
    monkeypatch.setenv("PATH", str(tmp_path))  # no docker
    monkeypatch.delenv(IMAGE_CHECK_ENV, raising=False)


def test_registry_check_answers_yes_no_or_unknown(registry, closed_port):
    FakeRegistry.tags = {"fuseforge:pushed"}
    assert registry_has_image(f"{registry}/fuseforge:pushed") is True  # through the anonymous token
    assert registry_has_image(f"{registry}/fuseforge:never") is False
    assert registry_has_image(f"localhost:{closed_port}/fuseforge:any", timeout=2) is None


def test_registration_refuses_a_content_hash_image_it_cannot_find(registering, registry, closed_port, tmp_path):
    spec = spec_for(tmp_path, f"localhost:{closed_port}")  # tag "" = hash of the sources; registry unreachable
    builder = FuseforgeImageBuilder()
    with pytest.raises(ImageBuildError) as info:
        builder.should_build(spec)
    message = str(info.value)
    assert message.startswith("pyflyte run --remote: cannot tell whether the registry has")
    assert "ImagePullBackOff" in message and "python images/build.py" in message and "[image].tag" in message
    assert f"{IMAGE_CHECK_ENV}=off" in message

    # The registry says it is missing: flytekit would build it, and without Docker that fails naming the fixes.
    missing = spec_for(tmp_path, registry)
    assert builder.should_build(missing) is True
    with pytest.raises(ImageBuildError, match=r"needs Docker.*python images/build.py.*hash of your sources"):
        builder.build(missing)
    # It is there: nothing to do.
    FakeRegistry.tags = {f"fuseforge:{missing.tag}"}
    assert builder.should_build(missing) is False


def test_registration_trusts_a_fixed_tag_or_the_opt_out(registering, closed_port, tmp_path, monkeypatch):
    builder = FuseforgeImageBuilder()
    assert builder.should_build(spec_for(tmp_path, f"localhost:{closed_port}", tag="v1.2.3")) is False
    monkeypatch.setenv(IMAGE_CHECK_ENV, "off")
    assert builder.should_build(spec_for(tmp_path, f"localhost:{closed_port}")) is False


def test_no_check_outside_registration(closed_port, tmp_path, monkeypatch):
    """Local runs and the offline `pyflyte package` keep flytekit's behaviour (assume the image exists)."""
    monkeypatch.setenv("PATH", str(tmp_path))
    assert registration_command() is None
    assert FuseforgeImageBuilder().should_build(spec_for(tmp_path, f"localhost:{closed_port}")) is False


def test_registration_is_recognised_from_the_pyflyte_command():
    class RunParams:
        is_remote = True

    root = click.Context(click.Group("pyflyte"), info_name="pyflyte")
    with click.Context(click.Command("register"), parent=root, info_name="register"):
        assert registration_command() == "pyflyte register"
    with click.Context(click.Command("package"), parent=root, info_name="package"):
        assert registration_command() is None
    run = click.Context(click.Group("run"), parent=root, info_name="run", obj=RunParams())
    with click.Context(click.Command("train"), parent=run, info_name="train"):
        assert registration_command() == "pyflyte run --remote"
    RunParams.is_remote = False
    with click.Context(click.Command("train"), parent=run, info_name="train"):
        assert registration_command() is None


# ----------------------------------------------------------------------------------------- scripts/setup_env.sh


def run_setup_env(tmp_path: Path, extra_path: str = "", **env_extra: str) -> list:
    """scripts/setup_env.sh against a fake virtualenv whose python records each pip call."""
    venv = tmp_path / "venv"
    (venv / "bin").mkdir(parents=True, exist_ok=True)
    log = tmp_path / "pip.log"
    log.write_text("")
    fake = venv / "bin" / "python"
    fake.write_text(f'#!/bin/sh\nif [ "$1" = "-c" ]; then exit 1; fi\necho "$@" >> {log}\n')
    fake.chmod(0o755)
    env = {"PATH": f"{extra_path}:/usr/bin:/bin", "HOME": str(tmp_path), "FUSEFORGE_VENV": str(venv), **env_extra}
    proc = subprocess.run(["bash", str(REPO / "scripts" / "setup_env.sh")], env=env, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == str(venv)
    return [line.split() for line in log.read_text().splitlines()]


def torch_install(calls: list) -> list:
    (call,) = [c for c in calls if any(a.startswith("torch") for a in c)]
    return call


def no_gpu_here() -> bool:
    return shutil.which("nvidia-smi", path="/usr/bin:/bin") is None and not list(Path("/dev").glob("nvidia[0-9]*"))


@pytest.mark.skipif(not no_gpu_here(), reason="this machine has an NVIDIA GPU")
def test_setup_env_takes_cpu_torch_without_a_gpu(tmp_path):
    call = torch_install(run_setup_env(tmp_path, FUSEFORGE_TORCH_INDEX_CHECK="off"))
    # An extra index, so that pip's own index (or a configured wheelhouse) still serves everything else.
    assert call[-3:] == ["--extra-index-url", "https://download.pytorch.org/whl/cpu", "torch==2.13.0"]
    assert "--index-url" not in call
    # FUSEFORGE_TORCH still picks the build; FUSEFORGE_TORCH_INDEX the index ("" = none).
    call = torch_install(run_setup_env(tmp_path, FUSEFORGE_TORCH="torch==2.12.0", FUSEFORGE_TORCH_INDEX_CHECK="off"))
    assert call[-3:] == ["--extra-index-url", "https://download.pytorch.org/whl/cpu", "torch==2.12.0"]
    call = torch_install(run_setup_env(tmp_path, FUSEFORGE_TORCH_INDEX=""))
    assert "--extra-index-url" not in call and call[-1] == "torch==2.13.0"


@pytest.mark.skipif(not no_gpu_here(), reason="this machine has an NVIDIA GPU")
def test_setup_env_takes_torch_from_pypi_when_the_cpu_index_cannot_be_reached(tmp_path, closed_port):
    unreachable = f"http://127.0.0.1:{closed_port}/whl/cpu"
    calls = run_setup_env(tmp_path, FUSEFORGE_CPU_TORCH_INDEX=unreachable)
    call = torch_install(calls)
    assert "--extra-index-url" not in call and call[-1] == "torch==2.13.0"
    # An index the user names is used as given, reachable or not.
    call = torch_install(run_setup_env(tmp_path, FUSEFORGE_TORCH_INDEX=unreachable))
    assert call[-3:] == ["--extra-index-url", unreachable, "torch==2.13.0"]


def test_setup_env_takes_the_default_torch_with_a_gpu(tmp_path):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "nvidia-smi").write_text("#!/bin/sh\nexit 0\n")
    (bin_dir / "nvidia-smi").chmod(0o755)
    call = torch_install(run_setup_env(tmp_path, extra_path=str(bin_dir), FUSEFORGE_TORCH="torch==2.11.0"))
    assert "--extra-index-url" not in call and call[-1] == "torch==2.11.0"
