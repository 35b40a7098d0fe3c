"""What the training image installs ([image] and pyproject.toml's extras), and whether the hash lock covers it.

A build installs the lock alone (lock.py), so a requirement it lacks would simply be missing from the image:
check_locked refuses such a build first, naming the command that renews the lock.
"""

from __future__ import annotations

from pathlib import Path
from typing import List, Optional

from flytekit.image_spec.image_spec import ImageSpec

from fuseforge_flyte.config import ConfigError, PlatformConfig, get_config
from fuseforge_flyte.image import ImageBuildError
from fuseforge_flyte.image.lock import LOCK_PATH, RENEW, stale_requirements
from fuseforge_flyte.image.sources import find_checkout

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib  # type: ignore[no-redef]


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


def check_locked(spec: ImageSpec, config: Optional[PlatformConfig] = None) -> None:
    """Refuse to build an image that would not be the locked one: no lock, or a lock that does not cover [image]
    (of `config`; platform.toml's when None)."""
    if not spec.requirements or spec.packages:
        raise ImageBuildError(
            f"{spec.image_name()}: the image is built from the hash lock {LOCK_PATH} of the fuseforge source "
            "checkout, and this fuseforge_flyte has none (installed from a wheel?): build from a git checkout")
    if config is None:
        config = get_config()
    # In the lock like everything else: the extras' requirements, extra_packages, fuseforge when it is a pip requirement.
    requirements = image_packages(config, find_checkout())
    problems = stale_requirements(Path(spec.requirements).read_text(), requirements, config.image.torch,
                                  config.image.python_version)
    if problems:
        raise ImageBuildError(f"{spec.requirements} no longer fits [image] ({config.source}): "
                              f"{'; '.join(problems)}. Renew it with `{RENEW}` (needs PyPI) and commit it")
