"""Last in the cluster group: `helm uninstall` leaves nothing of the release but what the chart keeps on
purpose (the task namespaces and their checkpoint keys: platform.namespaces.keepOnUninstall)."""

from __future__ import annotations

import pytest

import time

from localcluster.cluster import FLYTE_NAMESPACE, RELEASE, helm
from localcluster.kubectl import get_json

from conftest import RUNNING

# One xdist worker runs every cluster test (one control plane; `--dist loadgroup`).
pytestmark = [pytest.mark.cluster, pytest.mark.xdist_group("cluster")]

KINDS = "deployments,replicasets,pods,services,configmaps,secrets,serviceaccounts,podtemplates,networkpolicies,roles,rolebindings"
KEPT = {("Namespace", name) for name in ("fuseforge-development", "fuseforge-staging", "fuseforge-production")}


def _ours(selector: str) -> list[tuple[str, str, str]]:
    found = get_json(KINDS, "-A", "-l", selector)["items"]
    found += get_json("clusterroles,clusterrolebindings,namespaces", "-l", selector)["items"]
    return [(i["kind"], i["metadata"].get("namespace", ""), i["metadata"]["name"]) for i in found]


def test_uninstall_leaves_only_what_the_chart_keeps(platform):
    if RUNNING:
        pytest.skip("FUSEFORGE_TEST_CLUSTER=running: the release stays installed")
    assert _ours(f"app.kubernetes.io/instance={RELEASE}")  # installed
    helm("uninstall", RELEASE, "-n", FLYTE_NAMESPACE, "--wait")
    deadline = time.monotonic() + 120
    while True:
        left = [r for r in _ours(f"app.kubernetes.io/instance={RELEASE}")
                if (r[0], r[2]) not in KEPT and not (r[0] == "Secret" and r[2] == "fuseforge-checkpoint-key")]
        if not left or time.monotonic() > deadline:
            break
        time.sleep(1)
    assert left == []
    assert not get_json("pods", "-n", FLYTE_NAMESPACE)["items"]
    assert helm("status", RELEASE, "-n", FLYTE_NAMESPACE, check=False).returncode != 0
