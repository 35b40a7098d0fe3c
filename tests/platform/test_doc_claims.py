"""What the README and the documentation pages tell a new user to type or open exists and works as written."""

from __future__ import annotations

import re

from docs_text import ROOT, all_text, page, section

from fuseforge_flyte import cli


def test_every_repository_path_the_docs_name_exists():
    named = set(re.findall(r"`((?:charts|recipes|workflows|scripts|cluster|images|examples|benchmarks)/[\w./-]+"
                           r"\.(?:yaml|py|sh|toml|md))`", all_text()))
    assert "charts/fuseforge/charts/platform/values.yaml" in named
    missing = sorted(path for path in named if not (ROOT / path).exists())
    assert missing == []


def test_snippets_use_the_current_transformers_argument():
    assert "torch_dtype=" not in all_text()  # transformers 5.24 warns: dtype=


def test_the_kernel_snippet_says_it_needs_a_gpu_and_gives_a_cpu_one():
    text = section(page("kernels/index.md"), "## Call an op")
    assert "need a CUDA GPU" in text and 'os.environ["TRITON_INTERPRET"] = "1"' in text


def test_cli_run_takes_every_workflow_the_docs_list():
    assert set(cli.WORKFLOW_FILES) == {"train", "compare", "distill", "dpo", "demo"}
    assert all((ROOT / path).exists() for path in cli.WORKFLOW_FILES.values())
    assert "`train`, `compare`, `distill`, `dpo` and `demo`" in " ".join(page("fine-tuning/index.md").split())


def test_the_cluster_guide_names_bucket_and_registry_access():
    install = page("cluster/install.md")
    assert "authType: iam" in install and "authType: accesskey" in install
    assert "imagePullSecrets" in install
