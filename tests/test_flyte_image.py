"""The training image: ImageSpec from [image], its offline Docker context, images/ files, the build CLI."""

from __future__ import annotations

import re
import shutil
import stat
import textwrap
from pathlib import Path

import pytest

import fuseforge_flyte.image as image_mod
from fuseforge_flyte.cli import main, pyflyte_command, requirements_txt
from fuseforge_flyte.config import load_config
from fuseforge_flyte.image import (
    STAGED_SOURCE_DIR,
    FuseforgeImageBuilder,
    ImageBuildError,
    render_docker_context,
    training_image,
)

REPO = Path(__file__).resolve().parents[1]


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


def test_image_spec_follows_config(defaults):
    spec = training_image(defaults)
    image = defaults.image
    assert spec.registry == image.registry and spec.name == image.name
    assert spec.base_image == image.base_image and spec.python_version == image.python_version
    assert spec.packages[0] == image.torch  # resolved first, from the CUDA index below
    assert spec.pip_extra_index_url == [image.torch_index_url]
    names = {re.split(r"[<>=\[ ]", p, maxsplit=1)[0] for p in spec.packages}
    assert {"torch", "triton", "transformers", "deepspeed", "flytekit", "flytekitplugins-kfpytorch",
            "flytekitplugins-deck-standard"} <= names
    assert spec.copy == [STAGED_SOURCE_DIR]
    assert spec.commands == [f"uv pip install --no-deps /root/{STAGED_SOURCE_DIR}"]
    assert spec.apt_packages == list(image.apt_packages)
    assert spec.image_name() == f"{image.registry}/{image.name}:{spec.tag}"


def test_content_tag_tracks_sources_not_caches(tmp_path, monkeypatch, defaults):
    checkout = small_checkout(tmp_path / "repo")
    monkeypatch.setattr(image_mod, "find_checkout", lambda: checkout)
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


def test_pip_requirement_instead_of_checkout(defaults):
    config = load_config(env={"FUSEFORGE__IMAGE__FUSEFORGE": "fuseforge[hf,platform]==0.1.0"})
    spec = training_image(config)
    assert spec.packages == [config.image.torch, "fuseforge[hf,platform]==0.1.0"]
    assert not spec.copy and not spec.commands


def test_unknown_extra_is_a_config_error(defaults):
    config = load_config(env={"FUSEFORGE__IMAGE__EXTRAS": '["hf", "gpu"]'})
    with pytest.raises(ValueError, match=r"\[image\]\.extras names \['gpu'\], but pyproject.toml only defines"):
        training_image(config)


def test_render_docker_context_offline_from_any_directory(tmp_path, defaults):
    spec = training_image(defaults)
    dockerfile = render_docker_context(spec, tmp_path / "ctx")
    text = dockerfile.read_text()
    assert f"FROM {defaults.image.base_image}" in text
    assert f"--extra-index-url {defaults.image.torch_index_url}" in text
    assert f"COPY --chown=flytekit {STAGED_SOURCE_DIR} /root/{STAGED_SOURCE_DIR}/" in text
    assert "uv pip install --no-deps /root/fuseforge-src" in text
    assert "DS_BUILD_OPS=0" in text and "UV_INDEX_STRATEGY=unsafe-best-match" in text
    requirements = (tmp_path / "ctx" / "requirements_uv.txt").read_text().splitlines()
    assert requirements[0] == defaults.image.torch and "flytekit==1.16.31" in requirements

    staged = tmp_path / "ctx" / STAGED_SOURCE_DIR
    assert (staged / "pyproject.toml").is_file()
    assert (staged / "kernels" / "fuseforge" / "__init__.py").is_file()
    assert (staged / "workflows" / "fuseforge_flyte" / "tasks.py").is_file()
    assert not list(staged.rglob("__pycache__")) and not list(staged.rglob("*.egg-info"))


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


def test_requirements_txt_is_in_sync_with_pyproject(defaults):
    committed = (REPO / "images" / "requirements.txt").read_text()
    assert committed == requirements_txt(defaults), (
        "images/requirements.txt is stale: python -m fuseforge_flyte.cli requirements > images/requirements.txt"
    )
    assert defaults.image.torch not in committed.splitlines()  # the CUDA torch is installed first, separately


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
