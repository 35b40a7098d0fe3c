"""Every workflow through the real control plane: a user's own .jsonl uploaded by `--remote` (and its
preparation cached by datacatalog), the project's CLI, compare, dpo, distill, the `@training_task`
examples, and bad data stopped in preparation before any training pod exists. The runs start together
and Flyte schedules them on the node as its CPUs allow."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from localcluster.cluster import flyte_config_path
from remote import (FAILED, ROOT, SUCCEEDED, audited_creations, cluster_toml, execution_error, flyte_remote,
                    run_remote, task_node, wait)

pytestmark = [pytest.mark.cluster, pytest.mark.xdist_group("cluster")]

WORKFLOWS = "workflows/fuseforge_flyte/workflows.py"
SMALL = ("--steps", "2", "--batch_size", "2")


def chat_rows(count: int, offset: int = 0) -> list[dict]:
    return [{"messages": [{"role": "user", "content": f"What is {i} plus {i + 1}?"},
                          {"role": "assistant", "content": f"{i} plus {i + 1} is {2 * i + 1}."}]}
            for i in range(offset, offset + count)]


def write_jsonl(path: Path, rows: list) -> Path:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


@pytest.fixture(scope="module")
def runs(platform, tmp_path_factory):
    """Start every run (their pods queue for the node's CPUs), then wait for each as a test needs it."""
    folder = tmp_path_factory.mktemp("runs")
    own = write_jsonl(folder / "own.jsonl", chat_rows(40))
    bad = write_jsonl(folder / "bad.jsonl", chat_rows(12) + [{"messages": [{"role": "user", "content": "hi"},
                                                                          {"role": "assistant"}]}])
    started = {
        "own": run_remote(folder, WORKFLOWS, "train", "--dataset", str(own), *SMALL),
        "bad": run_remote(folder, WORKFLOWS, "train", "--dataset", str(bad), *SMALL),
        "compare": run_remote(folder, WORKFLOWS, "compare", *SMALL),
        "dpo": run_remote(folder, WORKFLOWS, "dpo", "--model", "tiny-llama", "--steps", "2", "--batch_size", "2",
                          "--max_length", "48"),
        "distill": run_remote(folder, WORKFLOWS, "distill", "--teacher", "tiny-llama", *SMALL),
        "sft_example": run_remote(folder, "examples/flyte/trainer_sft.py", "sft_workflow", "--steps", "2"),
        "trl_example": run_remote(folder, "examples/flyte/trl_sft.py", "trl_workflow", "--steps", "2"),
        "torch_loop_example": run_remote(folder, "examples/flyte/torch_loop.py", "pretrain_workflow", "--steps", "2"),
    }
    # The pods read what was uploaded, not this machine's files.
    own.rename(folder / "own.moved")
    bad.rename(folder / "bad.moved")
    return folder, started


def finished(runs, key: str, phase: int = SUCCEEDED):
    execution = wait(runs[1][key], timeout=1500)
    assert execution.closure.phase == phase, execution_error(execution)
    return execution


def test_own_jsonl_is_uploaded_trained_on_and_its_preparation_cached(runs):
    from flyteidl.core.catalog_pb2 import CatalogCacheStatus

    folder, _ = runs
    first = finished(runs, "own")
    # The input is the copy `--remote` uploaded to the bucket (the local file was moved away since).
    literal = str(first.inputs.literals["dataset"].to_flyte_idl())
    assert 'uri: "s3://fuseforge-flyte/' in literal, literal
    assert first.outputs["metrics"].steps == 2
    prepared = task_node(first, "prepare_data").closure.task_node_metadata
    assert prepared.cache_status in (CatalogCacheStatus.CACHE_POPULATED, CatalogCacheStatus.CACHE_MISS)

    (folder / "own.moved").rename(folder / "own.jsonl")
    again = run_remote(folder, WORKFLOWS, "train", "--dataset", str(folder / "own.jsonl"), *SMALL)
    changed = write_jsonl(folder / "changed.jsonl", chat_rows(40, offset=100))
    # The project's CLI: the same run through `python -m fuseforge_flyte.cli run --remote` (pyflyte underneath).
    env = dict(os.environ, FLYTECTL_CONFIG=str(flyte_config_path()), FUSEFORGE_IMAGE_CHECK="off",
               PATH=f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}")  # the activated virtualenv
    cli = subprocess.run(
        [sys.executable, "-m", "fuseforge_flyte.cli", "--config", str(cluster_toml(folder)), "--set", "image.tag=local",
         "run", "--remote", "train", "--dataset", str(changed), *SMALL],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=600,
    )
    assert cli.returncode == 0, cli.stdout[-3000:] + cli.stderr[-3000:]
    changed_name = cli.stdout.split("/executions/")[1].split()[0].strip()

    hit = wait(again, timeout=900)
    assert hit.closure.phase == SUCCEEDED, execution_error(hit)
    assert task_node(hit, "prepare_data").closure.task_node_metadata.cache_status == CatalogCacheStatus.CACHE_HIT
    miss = wait(changed_name, timeout=900)
    assert miss.closure.phase == SUCCEEDED, execution_error(miss)
    assert task_node(miss, "prepare_data").closure.task_node_metadata.cache_status != CatalogCacheStatus.CACHE_HIT


def test_bad_data_fails_in_preparation_naming_the_row_and_no_training_pod_starts(runs):
    execution = finished(runs, "bad", phase=FAILED)
    error = execution_error(execution)
    assert "example 12 of" in error and "bad.jsonl" in error and "'content'" in error, error[-2000:]
    node = task_node(execution, "prepare_data")
    assert node.closure.phase == 5  # NodeExecution.Phase FAILED
    pods = audited_creations("pods", runs[1]["bad"])
    assert pods and not any(p["spec"].get("serviceAccountName") == "fuseforge-training" for p in pods)
    assert not audited_creations("pytorchjobs", runs[1]["bad"])


@pytest.mark.parametrize("key", ["compare", "dpo", "distill", "sft_example", "trl_example", "torch_loop_example"])
def test_workflow_succeeds_on_the_cluster(runs, key):
    execution = finished(runs, key)
    outputs = execution.outputs
    assert list(outputs.keys()), "no outputs"
