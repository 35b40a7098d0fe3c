"""Least privilege on a live API server (issue 35): what Flyte's ServiceAccount and the training pods' may do,
asked with `kubectl auth can-i --as system:serviceaccount:...`, and the egress policies and read-only Flyte pod
the chart installs. The offline counterparts (rendered RBAC, evaluated rule by rule) are in tests/deploy.

The local install turns Flyte's pod webhook off (cluster/local-values.yaml), so there Flyte gets no Role in its
own namespace either: it can read no Secret at all.
"""

from __future__ import annotations

import pytest

from localcluster.cluster import FLYTE_NAMESPACE, OBJECT_STORE_SECRET, RELEASE, task_namespaces
from localcluster.kubectl import get_json, kubectl

# One xdist worker runs every cluster test (one control plane; `--dist loadgroup`).
pytestmark = [pytest.mark.cluster, pytest.mark.xdist_group("cluster")]

FLYTE_SA = f"system:serviceaccount:{FLYTE_NAMESPACE}:{RELEASE}-flyte-binary"
KEY_SECRET = "fuseforge-checkpoint-key"


def training_sa(namespace: str) -> str:
    return f"system:serviceaccount:{namespace}:fuseforge-training"


def allowed(user: str, verb: str, what: str, namespace: str | None) -> bool:
    """`kubectl auth can-i VERB WHAT` as `user`, in `namespace` (None: in every namespace)."""
    where = ["--all-namespaces"] if namespace is None else ["-n", namespace]
    result = kubectl("auth", "can-i", verb, what, *where, f"--as={user}", check=False)
    answer = result.stdout.strip()
    assert answer in ("yes", "no"), f"kubectl auth can-i {verb} {what}: {result.stderr.strip()}"
    return answer == "yes"


@pytest.mark.parametrize("verb, what", [
    ("get", "secrets"), ("list", "secrets"), ("watch", "secrets"), ("get", f"secret/{KEY_SECRET}"),
    ("get", f"secret/{OBJECT_STORE_SECRET}"), ("create", "secrets"), ("update", f"secret/{KEY_SECRET}"),
])
def test_flyte_cannot_touch_secrets_in_the_task_namespaces(platform, verb, what):
    for namespace in task_namespaces():
        assert not allowed(FLYTE_SA, verb, what, namespace), f"Flyte may {verb} {what} in {namespace}"


@pytest.mark.parametrize("verb, what, namespace", [
    ("list", "secrets", None),  # flyte-binary's own ClusterRole allowed this: every Secret of the cluster
    ("get", "secrets", "kube-system"),
    ("get", "secret/fuseforge-flyte-db", FLYTE_NAMESPACE),  # its database password comes as a mounted file
    ("list", "secrets", FLYTE_NAMESPACE),
    ("create", "serviceaccounts", "fuseforge-development"),
    ("update", "resourcequotas", "fuseforge-development"),
    ("list", "namespaces", None),
])
def test_flyte_has_nothing_it_does_not_use(platform, verb, what, namespace):
    assert not allowed(FLYTE_SA, verb, what, namespace)


@pytest.mark.parametrize("verb, what", [
    ("create", "pods"), ("watch", "pods"), ("delete", "pods"), ("patch", "pods"), ("get", "podtemplates"),
    ("create", "events"), ("create", "pytorchjobs.kubeflow.org"), ("watch", "pytorchjobs.kubeflow.org"),
    ("create", "flyteworkflows.flyte.lyft.com"), ("watch", "flyteworkflows.flyte.lyft.com"),
])
def test_flyte_can_still_run_tasks_everywhere(platform, verb, what):
    for namespace in task_namespaces():
        assert allowed(FLYTE_SA, verb, what, namespace), f"Flyte may not {verb} {what} in {namespace}"
    assert allowed(FLYTE_SA, "create", "namespaces", None)  # the cluster resource manager's namespace template


def test_the_training_account_reads_its_own_key_and_nothing_else(platform):
    namespaces = task_namespaces()
    for namespace in namespaces:
        assert allowed(training_sa(namespace), "get", f"secret/{KEY_SECRET}", namespace)
        assert not allowed(training_sa(namespace), "list", "secrets", namespace)
        assert not allowed(training_sa(namespace), "get", f"secret/{OBJECT_STORE_SECRET}", namespace)
        assert not allowed(training_sa(namespace), "update", f"secret/{KEY_SECRET}", namespace)
        for other in namespaces:
            if other != namespace:
                assert not allowed(training_sa(namespace), "get", f"secret/{KEY_SECRET}", other)
        # Nobody else in the namespace: its default ServiceAccount, under which other pods run.
        assert not allowed(f"system:serviceaccount:{namespace}:default", "get", f"secret/{KEY_SECRET}", namespace)


def test_task_namespaces_carry_the_egress_policy(platform):
    for namespace in task_namespaces():
        policy = get_json("networkpolicy", "fuseforge-task-egress", "-n", namespace)
        assert policy["spec"]["policyTypes"] == ["Egress"]
        assert all(rule.get("to") for rule in policy["spec"]["egress"])  # no rule open to anywhere


def test_flyte_runs_with_a_read_only_root_filesystem(platform):
    """This node honours readOnlyRootFilesystem (cluster/node): Flyte ready means it writes only to its emptyDirs."""
    deployment = get_json("deployment", f"{RELEASE}-flyte-binary", "-n", FLYTE_NAMESPACE)
    (flyte,) = [c for c in deployment["spec"]["template"]["spec"]["containers"] if c["name"] == "flyte"]
    assert flyte["securityContext"]["readOnlyRootFilesystem"] is True
    assert deployment["status"].get("readyReplicas") == 1
