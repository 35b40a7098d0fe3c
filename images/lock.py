#!/usr/bin/env python
"""Write images/requirements.in (the image's direct requirements) and hash-lock it into images/requirements.txt.

    python images/lock.py           # needs network access to PyPI and `uv` (pip install uv)
    python images/lock.py --check   # only check that requirements.in matches pyproject.toml (offline)

requirements.in is what pyproject.toml's extras ask for (`python -m fuseforge_flyte.cli requirements`).
requirements.txt pins every package the image installs after torch, each with the sha256 of its
archives, resolved for the image's platform: Linux x86_64 (manylinux_2_28), CPython [image].python_version,
together with [image].torch so that the versions fit the torch the image runs. torch itself, and the
packages only torch needs (its CUDA libraries), are left out: images/Dockerfile installs them first, from
[image].torch_index_url. images/Dockerfile and the ImageSpec build (fuseforge_flyte.image.spec) install the lock
with `--require-hashes --no-deps` from PyPI alone, then torch by name from its own index alone.
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Dict, List, Set

from fuseforge_flyte.image.lock import parse_lock

HERE = Path(__file__).resolve().parent
REQUIREMENTS_IN = HERE / "requirements.in"
REQUIREMENTS_TXT = HERE / "requirements.txt"
PLATFORM = "x86_64-manylinux_2_28"
INDEX_URL = "https://pypi.org/simple"
IN_HEADER = (
    "# The training image's direct requirements, from pyproject.toml's extras (`python -m fuseforge_flyte.cli\n"
    "# requirements`). Do not install this file: images/lock.py resolves it into the hash-locked\n"
    "# images/requirements.txt, which images/Dockerfile installs. tests/deploy/test_flyte_image.py fails when it is stale.\n"
)
TXT_HEADER = (
    "# Hash-locked requirements of the training image, made by `python images/lock.py` from images/requirements.in\n"
    "# for Linux x86_64, CPython {python}, with {torch} (installed after these, from {index} alone; it and the\n"
    "# packages only it needs are left out). The image builds install it with --require-hashes --no-deps.\n"
)


def direct_requirements() -> List[str]:
    """The requirement lines `python -m fuseforge_flyte.cli requirements` prints (comments dropped)."""
    from fuseforge_flyte.cli import requirements_txt
    from fuseforge_flyte.config import load_config

    lines = requirements_txt(load_config()).splitlines()
    return [line for line in lines if line.strip() and not line.lstrip().startswith("#")]


def drop_torch_stack(blocks: Dict[str, dict], torch: str = "torch") -> Dict[str, dict]:
    """Leave out torch and every package that is there only because of torch (transitively)."""
    removed: Set[str] = {torch}
    changed = True
    while changed:
        changed = False
        for name, block in blocks.items():
            if name in removed or not block["via"]:
                continue
            if all(parent in removed for parent in block["via"]):  # "-r requirements.in" is never removed
                removed.add(name)
                changed = True
    return {name: block for name, block in blocks.items() if name not in removed}


def write_requirements_in() -> None:
    REQUIREMENTS_IN.write_text(IN_HEADER + "\n".join(direct_requirements()) + "\n")


def lock() -> None:
    from fuseforge_flyte.config import load_config

    image = load_config().image
    uv = [shutil.which("uv")] if shutil.which("uv") else [sys.executable, "-m", "uv"]
    with tempfile.TemporaryDirectory() as tmp:
        constraints = Path(tmp) / "torch.txt"
        constraints.write_text(image.torch + "\n")
        out = Path(tmp) / "lock.txt"
        subprocess.run(
            [*uv, "pip", "compile", str(REQUIREMENTS_IN), "--constraint", str(constraints),
             "--python-version", image.python_version, "--python-platform", PLATFORM,
             "--index-url", INDEX_URL, "--generate-hashes", "--no-header", "--quiet", "-o", str(out)],
            check=True,
        )
        blocks = drop_torch_stack(parse_lock(out.read_text()))
    body = []
    for name in sorted(blocks):
        lines = blocks[name]["lines"]
        body.append("\n".join(lines))
        via = sorted(p.replace(str(REQUIREMENTS_IN), "requirements.in") for p in blocks[name]["via"])
        if via:
            body.append("    # via " + ", ".join(via))
    header = TXT_HEADER.format(python=image.python_version, torch=image.torch, index=image.torch_index_url or "PyPI")
    REQUIREMENTS_TXT.write_text(header + "\n".join(body) + "\n")
    print(f"wrote {REQUIREMENTS_IN} and {REQUIREMENTS_TXT} ({len(blocks)} packages)")


def main(argv: List[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--check", action="store_true", help="only check requirements.in against pyproject.toml")
    args = parser.parse_args(argv)
    if args.check:
        committed = [l for l in REQUIREMENTS_IN.read_text().splitlines() if l.strip() and not l.startswith("#")]
        if committed != direct_requirements():
            print("images/requirements.in is stale: run python images/lock.py", file=sys.stderr)
            return 1
        return 0
    write_requirements_in()
    lock()
    return 0


if __name__ == "__main__":
    sys.exit(main())
