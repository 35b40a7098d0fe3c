"""The documentation site builds with `mkdocs build --strict`: every page in the nav, every link and anchor between
pages, every included file (the README's sections, the chart's README, cluster/README.md, benchmarks/RESULTS.md)
and every API reference resolves. A broken one fails here, naming it."""

import os
import subprocess
import sys

from docs_text import DOCS, ROOT

MKDOCS = os.path.join(os.path.dirname(sys.executable), "mkdocs")


def build(tmp_path, config: str = "mkdocs.yml") -> subprocess.CompletedProcess:
    env = dict(os.environ, NO_MKDOCS_2_WARNING="1")  # Material's notice about its successor, printed on every build
    return subprocess.run([MKDOCS, "build", "--strict", "--config-file", config, "--site-dir", str(tmp_path / "site")],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)


def test_the_site_builds_strictly(tmp_path):
    done = build(tmp_path)
    assert done.returncode == 0, done.stderr[-6000:]
    warnings = [line for line in done.stderr.splitlines() if line.startswith(("WARNING", "ERROR"))]
    assert warnings == []
    reference = (tmp_path / "site" / "reference" / "functional" / "index.html").read_text()
    assert 'id="fuseforge.functional.fused_linear_cross_entropy"' in reference  # rendered from the docstrings


def test_every_page_is_in_the_nav(tmp_path):
    """A page left out of mkdocs.yml's nav would be built but found by nobody."""
    import yaml

    def pages(nav):
        for item in nav:
            if isinstance(item, str):
                yield item
            elif isinstance(item, dict):
                for value in item.values():
                    yield from ([value] if isinstance(value, str) else pages(value))

    config = yaml.safe_load((ROOT / "mkdocs.yml").read_text())
    listed = set(pages(config["nav"]))
    on_disk = {str(p.relative_to(DOCS)) for p in DOCS.rglob("*.md")}
    assert on_disk - listed == set()
    assert listed - on_disk == set()


def test_a_broken_link_fails_the_build(tmp_path):
    """The strict build is not a formality: under this site's own validation settings, a page that links to a
    missing page or anchor fails it."""
    import yaml

    ours = yaml.safe_load((ROOT / "mkdocs.yml").read_text())
    docs = tmp_path / "docs"
    docs.mkdir()
    (docs / "index.md").write_text("# Probe\n\n[a missing page](missing.md) and [an anchor](#nowhere)\n")
    config = tmp_path / "mkdocs.yml"
    config.write_text(yaml.safe_dump({"site_name": "probe", "docs_dir": str(docs), "strict": ours["strict"],
                                      "validation": ours["validation"]}))
    done = build(tmp_path, str(config))
    assert done.returncode != 0
    assert "missing.md" in done.stderr and "#nowhere" in done.stderr
