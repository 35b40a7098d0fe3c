"""What the README tells a new user to type or open exists and works as written."""

from __future__ import annotations

import re
from pathlib import Path

from fuseforge_flyte import cli

ROOT = Path(__file__).resolve().parents[2]
README = (ROOT / "README.md").read_text()


def test_every_repository_path_the_readme_names_exists():
    named = set(re.findall(r"`((?:charts|recipes|workflows|scripts|cluster|images)/[\w./-]+\.(?:yaml|py|sh|toml))`",
                           README))
    assert "charts/fuseforge/charts/platform/values.yaml" in named
    missing = sorted(path for path in named if not (ROOT / path).exists())
    assert missing == []


def test_snippets_use_the_current_transformers_argument():
    assert "torch_dtype=" not in README  # transformers 5.24 warns: dtype=


def test_the_kernel_snippet_says_it_needs_a_gpu_and_gives_a_cpu_one():
    section = README.split("## Use the kernels", 1)[1].split("\n## ", 1)[0]
    assert "need a CUDA GPU" in section and 'os.environ["TRITON_INTERPRET"] = "1"' in section


def test_cli_run_takes_every_workflow_the_readme_lists():
    assert set(cli.WORKFLOW_FILES) == {"train", "compare", "distill", "dpo", "demo"}
    assert all((ROOT / path).exists() for path in cli.WORKFLOW_FILES.values())
    assert "`train`,\n`compare`, `distill`, `dpo` and `demo`" in README


def test_the_cluster_guide_names_bucket_and_registry_access():
    install = README.split("## Install on a cluster", 1)[1].split("\n## ", 1)[0]
    assert "authType: iam" in install and "authType: accesskey" in install
    assert "imagePullSecrets" in install
