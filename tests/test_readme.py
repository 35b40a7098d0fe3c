"""The README fits on a few screens, every link in it resolves, and every command block marked runnable
(`<!-- runnable -->` on the line before its fence) runs as written: in a scratch directory that holds the checkout's
folders and `.venv` (this test's virtualenv), so that what a block writes stays out of the checkout."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from docs_text import README, ROOT

TEXT = README.read_text()
RUNNABLE = re.compile(r"<!-- runnable -->\n```bash\n(.*?)```", re.DOTALL)
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")


def slug(heading: str) -> str:
    """A heading's anchor as GitHub and MkDocs' toc make it (lowercased, punctuation dropped, spaces -> '-')."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def test_the_readme_fits_on_a_few_screens():
    assert len(TEXT.splitlines()) <= 250


def test_every_link_in_the_readme_resolves():
    links = [target for target in LINK.findall(TEXT) if not target.startswith(("http://", "https://"))]
    assert links, "no relative links found: the pattern is broken"
    for target in links:
        path, _, anchor = target.partition("#")
        file = ROOT / path if path else README
        assert file.exists(), f"README links to {target}, which does not exist"
        if anchor:
            headings = re.findall(r"^#+ (.+)$", file.read_text(), flags=re.MULTILINE)
            assert anchor in {slug(h) for h in headings}, f"README links to {target}: no such heading"


def test_the_readme_marks_its_local_commands_runnable():
    blocks = RUNNABLE.findall(TEXT)
    assert any("pyflyte run workflows/train.py train" in block for block in blocks)


def scratch_checkout(tmp_path: Path) -> Path:
    """A directory that looks like the checkout (its folders and files linked, `.venv` this test's virtualenv)."""
    work = tmp_path / "checkout"
    work.mkdir()
    for entry in ROOT.iterdir():
        if entry.name not in {".git", ".venv", "outputs", ".ci-venv"}:
            (work / entry.name).symlink_to(entry)
    (work / ".venv").symlink_to(sys.prefix)
    return work


@pytest.mark.slow
@pytest.mark.parametrize("block", RUNNABLE.findall(TEXT), ids=lambda block: block.strip().splitlines()[-1][:60])
def test_a_runnable_block_runs_as_written(tmp_path, block):
    work = scratch_checkout(tmp_path)
    env = dict(os.environ, TMPDIR=str(tmp_path), FUSEFORGE_CACHE=str(tmp_path / "cache"))
    done = subprocess.run(["bash", "-euo", "pipefail", "-c", block], cwd=work, env=env, capture_output=True,
                          text=True, timeout=900)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    if "pyflyte run workflows/train.py train" in block:  # what the README says the run leaves, where it says
        (run,) = (work / "outputs").iterdir()
        assert {"model", "metrics.json", "settings.json"} <= set(os.listdir(run))
        assert f"output: {run}" in done.stdout
