"""The platform's workflows run through the local cluster as a user runs them: `pyflyte run --remote` with the
config `install` wrote and the platform.toml the chart rendered, FlyteRemote to follow and fetch, and the
API server's audit log for the pods and PyTorchJobs that Flyte and the operator created."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path
from typing import Iterator, Optional

from localcluster.cluster import flyte_config_path
from localcluster.kubectl import kubectl
from localcluster.layout import log_path

ROOT = Path(__file__).resolve().parents[2]
PROJECT, DOMAIN = "fuseforge", "development"
NAMESPACE = f"{PROJECT}-{DOMAIN}"
PYFLYTE = Path(sys.executable).parent / "pyflyte"
SUCCEEDED, FAILED = 4, 6  # flyteidl WorkflowExecution.Phase


def cluster_toml(folder: Path) -> Path:
    """platform.toml as the chart rendered it for the task namespace (what the README tells users to fetch)."""
    path = folder / "cluster.toml"
    if not path.exists():
        path.write_text(kubectl("-n", NAMESPACE, "get", "configmap", "fuseforge-platform",
                                "-o", "jsonpath={.data.platform\\.toml}").stdout)
    return path


def run_remote(folder: Path, *args: str, settings: Optional[dict] = None, timeout: float = 600) -> str:
    """`pyflyte run --remote ...` from the checkout; returns the execution's name. `settings` are platform.toml
    overrides (FUSEFORGE__SECTION__KEY) applied when the tasks are registered."""
    env = dict(os.environ, FUSEFORGE_CONFIG=str(cluster_toml(folder)), FUSEFORGE__IMAGE__TAG="local",
               FUSEFORGE_IMAGE_CHECK="off")
    env.update({f"FUSEFORGE__{k.replace('.', '__').upper()}": str(v) for k, v in (settings or {}).items()})
    result = subprocess.run(
        [str(PYFLYTE), "--config", str(flyte_config_path()), "run", "--remote", "--project", PROJECT,
         "--domain", DOMAIN, *args],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout,
    )
    found = re.search(r"/executions/([a-z0-9]+)", result.stdout)
    assert result.returncode == 0 and found, result.stdout[-3000:] + result.stderr[-3000:]
    return found.group(1)


def flyte_remote():
    from flytekit.configuration import Config
    from flytekit.remote import FlyteRemote

    return FlyteRemote(Config.auto(config_file=str(flyte_config_path())), default_project=PROJECT,
                       default_domain=DOMAIN)


def wait(name: str, timeout: float = 900, remote=None):
    """The execution, synced with its nodes, once it has ended."""
    remote = remote or flyte_remote()
    execution = remote.fetch_execution(name=name)
    deadline = time.monotonic() + timeout
    while True:
        execution = remote.sync_execution(execution, sync_nodes=True)
        if execution.is_done:
            return execution
        if time.monotonic() > deadline:
            raise AssertionError(f"execution {name} still {execution.closure.phase} after {timeout:.0f} s: "
                                 f"{node_phases(execution)}")
        time.sleep(3)


def walk_nodes(nodes: dict, prefix: str = "") -> Iterator[tuple[str, object]]:
    """(path, node execution) of every node, sub-workflow nodes included ("n0/n0-0-n1")."""
    for key, node in nodes.items():
        if key in ("start-node", "end-node") or key.endswith(("-start-node", "-end-node")):
            continue
        yield prefix + key, node
        if node.subworkflow_node_executions:
            yield from walk_nodes(node.subworkflow_node_executions, prefix + key + "/")


def node_phases(execution) -> dict:
    return {path: node.closure.phase for path, node in walk_nodes(execution.node_executions)}


def task_node(execution, task_suffix: str):
    """The node execution whose task name ends with task_suffix (e.g. "prepare_data"). A node served from the
    cache ran no task: its catalog key names the task instead."""
    for _, node in walk_nodes(execution.node_executions):
        if node.task_executions:
            task = node.task_executions[0].id.task_id.name
        else:
            metadata = node.closure.task_node_metadata
            task = metadata.catalog_key.dataset_id.name if metadata is not None and metadata.catalog_key else ""
        if task.endswith(task_suffix):
            return node
    raise AssertionError(f"no node ran a task named *{task_suffix}: {node_phases(execution)}")


def execution_error(execution) -> str:
    messages = [execution.closure.error.message] if execution.closure.error else []
    for _, node in walk_nodes(execution.node_executions):
        for attempt in node.task_executions or []:
            if attempt.closure.error:
                messages.append(attempt.closure.error.message)
    return "\n".join(messages)


def audited_creations(resource: str, name_prefix: str) -> list[dict]:
    """The objects the API server created for `resource` (pods, pytorchjobs) in the task namespace whose
    names start with name_prefix, as stored after admission (the audit policy logs their responses)."""
    created = []
    with open(log_path("kube-apiserver-audit")) as log:
        for line in log:
            if '"create"' not in line or f'"{resource}"' not in line:
                continue
            event = json.loads(line)
            ref = event.get("objectRef", {})
            if (event.get("verb") == "create" and ref.get("resource") == resource and not ref.get("subresource")
                    and ref.get("namespace") == NAMESPACE and event.get("stage") == "ResponseComplete"
                    and event.get("responseStatus", {}).get("code") == 201
                    and ref.get("name", "").startswith(name_prefix)):
                created.append(event["responseObject"])
    return created


def download(remote, uri: str, target: Path) -> Path:
    """A file or folder of the object store, read with the keys in the flyte config (as a user reads them)."""
    remote.file_access.get_data(uri, str(target), is_multipart=uri.endswith("/"))
    return target
