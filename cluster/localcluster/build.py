"""Build the control plane's Go programs once per version into the cache.

Each component is a Go module under cluster/ whose go.mod and go.sum pin every dependency. A binary is
reused while the module's files, the Go version and the link flags are the same (its cache key), so a
second `up` builds nothing. `go mod download` runs first: a module the proxy refuses fails at once,
named in the error, instead of half-way through a long compile.
"""

from __future__ import annotations

import hashlib
import os
import re
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from .layout import MODULES, cache_dir

UPSTREAM_PROXY = "https://proxy.golang.org"


@dataclass(frozen=True)
class Component:
    """A Go module under cluster/ and the programs built from it (output name -> package)."""

    name: str
    programs: dict[str, str]
    # Module versions whose .zip the proxy serves but whose .mod it refuses (see cluster/goproxy.py).
    file_proxy: tuple[str, ...] = ()
    cgo: bool = False
    ldflags: tuple[str, ...] = field(default=())

    @property
    def module_dir(self) -> Path:
        return MODULES / self.name


def _kubernetes_version() -> str:
    match = re.search(r"^\s*k8s\.io/kubernetes (v\S+)", (MODULES / "kube" / "go.mod").read_text(), re.M)
    if not match:
        raise RuntimeError("cluster/kube/go.mod does not require k8s.io/kubernetes")
    return match.group(1)


def _kube_ldflags() -> tuple[str, ...]:
    version = _kubernetes_version()
    major, minor = version.lstrip("v").split(".")[:2]
    pkg = "k8s.io/component-base/version"
    return (
        f"-X {pkg}.gitVersion={version}",
        f"-X {pkg}.gitMajor={major}",
        f"-X {pkg}.gitMinor={minor}",
        f"-X {pkg}.gitTreeState=clean",
    )


def components() -> dict[str, Component]:
    return {
        c.name: c
        for c in (
            Component("kube", {"kube": "."}, ldflags=_kube_ldflags()),
            Component("node", {"node": "."}),
            Component("stores", {"stores": "."}),
            Component("operator", {"training-operator": "github.com/kubeflow/training-operator/cmd/training-operator.v1"}),
            Component("flyte", {"flyte": "."}),
            Component(
                "flyteadmin",
                {
                    "flyteadmin": "github.com/flyteorg/flyte/flyteadmin/cmd",
                    "flytescheduler": "github.com/flyteorg/flyte/flyteadmin/cmd/scheduler",
                },
                file_proxy=(
                    "github.com/flyteorg/flyte/flyteadmin@v1.13.0",
                    "github.com/flyteorg/flyte/flytepropeller@v1.13.0",
                ),
                cgo=True,
            ),
            Component("flytepropeller", {"flytepropeller": "."}),
            Component("datacatalog", {"datacatalog": "github.com/flyteorg/datacatalog/cmd"}, cgo=True),
            # Kueue and Kubeflow Trainer v2 with JobSet (issue 48): pin-only modules.
            Component("kueue", {"kueue": "sigs.k8s.io/kueue/cmd/kueue"}),
            Component("jobset", {"jobset": "sigs.k8s.io/jobset"}),
            Component("trainer", {"trainer-controller-manager": "github.com/kubeflow/trainer/v2/cmd/trainer-controller-manager"}),
        )
    }


def go_version() -> str:
    return subprocess.run(["go", "env", "GOVERSION"], check=True, capture_output=True, text=True).stdout.strip()


def cache_key(component: Component) -> str:
    digest = hashlib.sha256()
    digest.update(go_version().encode())
    digest.update(repr((component.programs, component.ldflags, component.cgo, component.file_proxy)).encode())
    for path in sorted(component.module_dir.rglob("*")):
        if path.is_file() and (path.suffix == ".go" or path.name in ("go.mod", "go.sum")):
            digest.update(str(path.relative_to(component.module_dir)).encode())
            digest.update(path.read_bytes())
    return digest.hexdigest()[:16]


def binary_dir(component: Component) -> Path:
    return cache_dir() / "cluster" / "bin" / f"{component.name}-{cache_key(component)}"


def go_env(component: Component) -> dict[str, str]:
    env = dict(os.environ)
    proxies = [UPSTREAM_PROXY]
    if component.file_proxy:
        proxies.insert(0, (cache_dir() / "goproxy").as_uri())
    env.update(
        GOPROXY=",".join(proxies),
        GOFLAGS="-mod=readonly -buildvcs=false",
        CGO_ENABLED="1" if component.cgo else "0",
    )
    env.pop("GOWORK", None)
    return env


def _log(message: str) -> None:
    print(f"cluster: {message}", file=sys.stderr, flush=True)


def build(component: Component) -> Path:
    """Return the folder holding the component's programs, building them first when not cached."""
    target = binary_dir(component)
    if all((target / name).is_file() for name in component.programs):
        return target
    env = go_env(component)
    if component.file_proxy:
        subprocess.run(
            [sys.executable, str(MODULES / "goproxy.py"), str(cache_dir() / "goproxy"), *component.file_proxy],
            check=True,
        )
    _log(f"building {component.name} (first time for this version; cached in {target.parent})")
    started = time.monotonic()
    download = subprocess.run(
        ["go", "mod", "download"], cwd=component.module_dir, env=env, capture_output=True, text=True
    )
    if download.returncode != 0:
        raise RuntimeError(f"go mod download for cluster/{component.name} failed:\n{download.stderr.strip()}")
    staging = target.with_name(target.name + f".partial-{os.getpid()}")
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    try:
        for name, package in component.programs.items():
            ldflags = " ".join(("-s", "-w", *component.ldflags))
            result = subprocess.run(
                ["go", "build", "-trimpath", "-ldflags", ldflags, "-o", str(staging / name), package],
                cwd=component.module_dir, env=env, capture_output=True, text=True,
            )
            if result.returncode != 0:
                raise RuntimeError(f"go build of {package} in cluster/{component.name} failed:\n{result.stderr.strip()}")
        shutil.rmtree(target, ignore_errors=True)
        staging.rename(target)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    _log(f"built {component.name} in {time.monotonic() - started:.0f} s")
    return target


def build_all(names: list[str] | None = None) -> dict[str, Path]:
    """Build (or find) every component; returns program name -> path."""
    programs: dict[str, Path] = {}
    for component in components().values():
        if names is not None and component.name not in names:
            continue
        folder = build(component)
        for name in component.programs:
            programs[name] = folder / name
    return programs
