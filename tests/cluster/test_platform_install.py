"""The chart on a live API server: helm install/upgrade/rollback, values the schema refuses, and what the
API server enforces (RBAC, Pod Security admission, the checkpoint key)."""

from __future__ import annotations

import json

import pytest
import yaml

from localcluster.cluster import FLYTE_NAMESPACE, RELEASE, helm, task_namespaces
from localcluster.kubectl import get_json, kubectl

# One xdist worker runs every cluster test (one control plane; `--dist loadgroup`).
pytestmark = [pytest.mark.cluster, pytest.mark.xdist_group("cluster")]

TASK_NAMESPACE = "fuseforge-development"
TRAINING_SA = f"system:serviceaccount:{TASK_NAMESPACE}:fuseforge-training"
FLYTE_SA = f"system:serviceaccount:{FLYTE_NAMESPACE}:{RELEASE}-flyte-binary"


def release_revision() -> int:
    return json.loads(helm("status", RELEASE, "-n", FLYTE_NAMESPACE, "-o", "json").stdout)["version"]


def gpu_request(namespace: str = TASK_NAMESPACE) -> str:
    template = get_json("podtemplate", "fuseforge-gpu", "-n", namespace)
    primary = next(c for c in template["template"]["spec"]["containers"] if c["name"] == "primary")
    return primary["resources"]["limits"]["nvidia.com/gpu"]


def test_install_creates_the_platform_and_flyte_serves(platform):
    assert task_namespaces() == ["fuseforge-development", "fuseforge-production", "fuseforge-staging"]
    deployment = get_json("deployment", f"{RELEASE}-flyte-binary", "-n", FLYTE_NAMESPACE)
    assert deployment["status"].get("readyReplicas") == 1
    pod = get_json("pods", "-n", FLYTE_NAMESPACE, "-l", "app.kubernetes.io/name=flyte-binary")["items"][0]
    # The node ran the pod in this machine's environment and recorded the image the chart asked for.
    status = pod["status"]["containerStatuses"][0]
    assert status["image"].startswith("cr.flyte.org/flyteorg/flyte-binary-release:")
    assert status["ready"] is True


def test_upgrade_applies_changed_values_and_rollback_restores_them(platform, tmp_path):
    before, revision = gpu_request(), release_revision()
    values = tmp_path / "more-gpus.yaml"
    values.write_text(yaml.safe_dump({"platform": {"gpuPodTemplate": {"gpus": 4}}}))
    helm("upgrade", RELEASE, "charts/fuseforge", "-n", FLYTE_NAMESPACE, "--reuse-values", "-f", str(values))
    assert gpu_request() == "4" != before
    assert release_revision() == revision + 1
    helm("rollback", RELEASE, str(revision), "-n", FLYTE_NAMESPACE, "--wait")
    assert gpu_request() == before
    assert release_revision() == revision + 2


@pytest.mark.parametrize(
    "values, field",
    [
        ({"platform": {"gpuPodTemplate": {"gpus": "eight"}}}, "gpus"),
        ({"flyte-binary": {"configuration": {"database": {"password": "hunter2"}}}}, "password"),
    ],
    ids=["gpus-not-a-number", "password-in-values"],
)
def test_values_the_schema_rejects_change_nothing(platform, tmp_path, values, field):
    revision = release_revision()
    bad = tmp_path / "bad.yaml"
    bad.write_text(yaml.safe_dump(values))
    result = helm("upgrade", RELEASE, "charts/fuseforge", "-n", FLYTE_NAMESPACE, "--reuse-values", "-f", str(bad),
                  check=False)
    assert result.returncode != 0
    assert field in result.stderr and "schema" in result.stderr.lower(), result.stderr
    assert release_revision() == revision


def can_i(user: str, verb: str, resource: str, namespace: str = TASK_NAMESPACE, subresource: str = "") -> bool:
    args = ["auth", "can-i", verb, resource, "-n", namespace, f"--as={user}"]
    if subresource:
        args.append(f"--subresource={subresource}")
    return kubectl(*args, check=False).stdout.strip() == "yes"


@pytest.mark.parametrize(
    "verb, resource, subresource",
    [("create", "pods", "exec"), ("create", "pods", "attach"), ("create", "pods", "portforward"),
     ("get", "pods", "proxy"), ("get", "services", "proxy"), ("get", "secrets", ""), ("list", "pods", "")],
)
def test_training_service_account_gets_nothing_from_the_api(platform, verb, resource, subresource):
    assert not can_i(TRAINING_SA, verb, resource, subresource=subresource)


def test_training_pods_carry_no_api_token(platform):
    account = get_json("serviceaccount", "fuseforge-training", "-n", TASK_NAMESPACE)
    assert account.get("automountServiceAccountToken") is False


@pytest.mark.parametrize(
    "verb, resource", [("create", "pods"), ("delete", "pods"), ("create", "pytorchjobs.kubeflow.org"),
                       ("watch", "pytorchjobs.kubeflow.org"), ("get", "podtemplates")],
)
def test_flyte_can_do_what_running_tasks_needs(platform, verb, resource):
    assert can_i(FLYTE_SA, verb, resource)


def test_flyte_cannot_exec_into_task_pods(platform):
    assert not can_i(FLYTE_SA, "create", "pods", subresource="exec")


def _pod(name: str, spec: dict, namespace: str = TASK_NAMESPACE) -> str:
    return yaml.safe_dump({"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name, "namespace": namespace},
                           "spec": spec})


def test_privileged_pod_in_a_task_namespace_is_refused_by_pod_security(platform):
    spec = {"containers": [{"name": "x", "image": "busybox", "securityContext": {"privileged": True}}]}
    result = kubectl("create", "--dry-run=server", "-f", "-", input=_pod("privileged", spec), check=False)
    assert result.returncode != 0
    assert "violates PodSecurity" in result.stderr and "restricted" in result.stderr, result.stderr


def test_a_pod_from_the_gpu_template_is_admitted(platform):
    template = get_json("podtemplate", "fuseforge-gpu", "-n", TASK_NAMESPACE)["template"]
    spec = template["spec"]
    result = kubectl("create", "--dry-run=server", "-o", "json", "-f", "-",
                     input=_pod("training", spec), check=False)
    assert result.returncode == 0, result.stderr
    admitted = json.loads(result.stdout)["spec"]
    primary = next(c for c in admitted["containers"] if c["name"] == "primary")
    assert primary["resources"]["limits"]["nvidia.com/gpu"] == gpu_request()
    assert any(v.get("emptyDir", {}).get("medium") == "Memory" for v in admitted["volumes"])


def test_checkpoint_key_is_in_every_task_namespace_and_mounted_read_only(platform):
    for namespace in task_namespaces():
        secret = get_json("secret", "fuseforge-checkpoint-key", "-n", namespace)
        assert len(secret["data"]["key"]) > 0
        spec = get_json("podtemplate", "fuseforge-gpu", "-n", namespace)["template"]["spec"]
        primary = next(c for c in spec["containers"] if c["name"] == "primary")
        mount = next(m for m in primary["volumeMounts"] if "checkpoint-key" in m["mountPath"])
        assert mount["readOnly"] is True
        env = {e["name"]: e.get("value") for e in primary["env"]}
        assert env["FUSEFORGE_CHECKPOINT_KEY_FILE"].startswith(mount["mountPath"])
        assert env["FUSEFORGE_CHECKPOINT_REQUIRE_KEY"] == "1"


def test_network_policies_are_accepted_but_not_enforced_here(platform):
    """The API server stores them; nothing here enforces them (no CNI): every pod shares this machine's
    network, so isolation between task namespaces is not tested locally."""
    policies = get_json("networkpolicies", "-A")["items"]
    namespaces = {p["metadata"]["namespace"] for p in policies}
    assert FLYTE_NAMESPACE in namespaces and TASK_NAMESPACE in namespaces
