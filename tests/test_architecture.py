"""The architecture's import contracts (pyproject.toml, [tool.importlinter]) hold: layers in their order, the
engine and the data path free of Flyte, ops/_shared private, no import cycle. import-linter reads every import,
function-local ones included, so a loop hidden inside a function body breaks the build too."""

import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LINT_IMPORTS = os.path.join(os.path.dirname(sys.executable), "lint-imports")


def lint_imports(config: str) -> subprocess.CompletedProcess:
    return subprocess.run([LINT_IMPORTS, "--config", config, "--no-cache"], cwd=ROOT, capture_output=True,
                          text=True, timeout=300)


def test_every_contract_is_kept():
    result = lint_imports(os.path.join(ROOT, "pyproject.toml"))
    assert result.returncode == 0, result.stdout[-6000:] + result.stderr[-2000:]
    assert "0 broken" in result.stdout


def test_a_broken_contract_fails_naming_the_import(tmp_path):
    """The check sees real imports: a contract the code breaks (the engine reads the data path) fails, and the
    report names the importing module, the imported one and the line."""
    config = tmp_path / "broken.ini"
    config.write_text("[importlinter]\nroot_packages =\n    fuseforge_flyte\n\n"
                      "[importlinter:contract:probe]\nname = probe\ntype = forbidden\n"
                      "source_modules = fuseforge_flyte.training\nforbidden_modules = fuseforge_flyte.data\n")
    result = lint_imports(str(config))
    assert result.returncode == 1, result.stdout
    assert "probe BROKEN" in result.stdout
    assert "fuseforge_flyte.training." in result.stdout and "-> fuseforge_flyte.data" in result.stdout
    assert "(l." in result.stdout
