"""Kueue, JobSet and Kubeflow Trainer v2 on the local control plane (issue 48): the controllers run and serve
their CRDs, Kueue holds a second GPU job until quota frees, and a TrainJob runs to completion through a JobSet."""

from __future__ import annotations

import time

import pytest
import yaml

from localcluster import processes, queueing
from localcluster.kubectl import apply, get_json, kubectl

# One xdist worker runs every cluster test (one control plane; `--dist loadgroup`).
pytestmark = [pytest.mark.cluster, pytest.mark.xdist_group("cluster")]

# A namespace labelled as the chart labels its task namespaces (Kueue's pod integration and pod webhook
# cover those only), Pod Security "restricted" as they are.
NAMESPACE = "fuseforge-queue-test"
IMAGE = "127.0.0.1:15000/fuseforge:test"  # any image runs the project's virtualenv on the node
RESTRICTED = {
    "pod": {"runAsNonRoot": True, "runAsUser": 1001, "runAsGroup": 1001, "seccompProfile": {"type": "RuntimeDefault"}},
    "container": {"allowPrivilegeEscalation": False, "capabilities": {"drop": ["ALL"]}},
}
CRDS = (
    "clusterqueues.kueue.x-k8s.io", "localqueues.kueue.x-k8s.io", "workloads.kueue.x-k8s.io",
    "resourceflavors.kueue.x-k8s.io", "workloadpriorityclasses.kueue.x-k8s.io",
    "jobsets.jobset.x-k8s.io",
    "trainjobs.trainer.kubeflow.org", "clustertrainingruntimes.trainer.kubeflow.org",
    "trainingruntimes.trainer.kubeflow.org",
)


@pytest.fixture(scope="module")
def namespace(control_plane):
    labels = {**queueing.TASK_NAMESPACE_LABELS, "pod-security.kubernetes.io/enforce": "restricted"}
    apply(yaml.safe_dump({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": NAMESPACE, "labels": labels}}))
    yield NAMESPACE
    # Gone before later tests list the task namespaces by that label (test_platform_install expects three).
    kubectl("delete", "namespace", NAMESPACE, "--timeout=120s", check=False, timeout=150)
    kubectl("delete", "clustertrainingruntime", RUNTIME, "--ignore-not-found", check=False)


def _container(command: list[str], gpus: int = 0) -> dict:
    resources = {"requests": {"cpu": "100m", "memory": "128Mi"}}
    if gpus:
        resources["requests"]["nvidia.com/gpu"] = str(gpus)
        resources["limits"] = {"nvidia.com/gpu": str(gpus)}
    return {"name": "node", "image": IMAGE, "command": command, "resources": resources,
            "env": [{"name": "OMP_NUM_THREADS", "value": "1"}], "securityContext": RESTRICTED["container"]}


def _conditions(obj: dict) -> dict[str, dict]:
    return {c["type"]: c for c in obj.get("status", {}).get("conditions", [])}


def _true(obj: dict, kind: str) -> bool:
    return _conditions(obj).get(kind, {}).get("status") == "True"


def _pod_logs(selector: str) -> str:
    out = []
    for pod in get_json("pods", "-n", NAMESPACE, "-l", selector)["items"]:
        result = kubectl("logs", "-n", NAMESPACE, pod["metadata"]["name"], "--all-containers", check=False)
        out.append(f"--- {pod['metadata']['name']} ({pod['status'].get('phase')})\n{result.stdout}{result.stderr}")
    return "\n".join(out)


def test_controllers_run_and_serve_their_crds(control_plane):
    for name in ("jobset", "trainer", "kueue"):
        assert processes.running_pid(name) is not None, f"{name} is not running"
    for crd in CRDS:
        found = get_json("crd", crd)
        assert _true(found, "Established"), crd
    resources = kubectl("api-resources", "-o", "name").stdout.split()
    for crd in CRDS:
        assert crd in resources, f"{crd} is not served"
    # Kueue's conversion webhook answers (the API server converts through it).
    assert get_json("clusterqueues.v1beta1.kueue.x-k8s.io")["items"] == []


QUEUE = {
    "flavor": {"apiVersion": "kueue.x-k8s.io/v1beta2", "kind": "ResourceFlavor", "metadata": {"name": "test-gpu"}},
    "cluster": {
        "apiVersion": "kueue.x-k8s.io/v1beta2", "kind": "ClusterQueue", "metadata": {"name": "test-gpus"},
        "spec": {"namespaceSelector": {}, "resourceGroups": [{
            "coveredResources": ["cpu", "memory", "nvidia.com/gpu"],
            "flavors": [{"name": "test-gpu", "resources": [
                {"name": "cpu", "nominalQuota": "4"}, {"name": "memory", "nominalQuota": "8Gi"},
                {"name": "nvidia.com/gpu", "nominalQuota": "4"}]}],
        }]},
    },
    "local": {"apiVersion": "kueue.x-k8s.io/v1beta2", "kind": "LocalQueue",
              "metadata": {"name": "test", "namespace": NAMESPACE}, "spec": {"clusterQueue": "test-gpus"}},
}


@pytest.fixture(scope="module")
def queue(namespace):
    for key in ("flavor", "cluster", "local"):
        apply(yaml.safe_dump(QUEUE[key]))
    deadline = time.monotonic() + 60
    while not _true(get_json("clusterqueue", "test-gpus"), "Active"):
        assert time.monotonic() < deadline, get_json("clusterqueue", "test-gpus").get("status")
        time.sleep(1)
    yield "test"
    kubectl("delete", "clusterqueue", "test-gpus", "--ignore-not-found", "--wait=false", check=False)
    kubectl("delete", "resourceflavor", "test-gpu", "--ignore-not-found", "--wait=false", check=False)


def _jobset(name: str, gpus: int, command: list[str]) -> str:
    pod = {"securityContext": RESTRICTED["pod"], "restartPolicy": "Never", "containers": [_container(command, gpus)]}
    return yaml.safe_dump({
        "apiVersion": "jobset.x-k8s.io/v1alpha2", "kind": "JobSet",
        "metadata": {"name": name, "namespace": NAMESPACE, "labels": {"kueue.x-k8s.io/queue-name": "test"}},
        "spec": {"suspend": True, "replicatedJobs": [{"name": "main", "replicas": 1, "template": {"spec": {
            "parallelism": 1, "completions": 1, "backoffLimit": 0, "template": {"spec": pod}}}}]},
    })


def test_kueue_holds_the_second_job_until_quota_frees(queue):
    """Two 3-GPU JobSets on a 4-GPU ClusterQueue: one runs, the other stays suspended until it finishes."""
    command = ["python", "-c", "import time; time.sleep(8); print('done', flush=True)"]
    for name in ("first", "second"):
        apply(_jobset(name, 3, command))
    started = time.monotonic()
    running_together, order, finished = False, [], {}
    while len(finished) < 2:
        assert time.monotonic() - started < 240, (order, finished, _pod_logs("jobset.sigs.k8s.io/jobset-name"))
        sets = {js["metadata"]["name"]: js for js in get_json("jobsets", "-n", NAMESPACE)["items"]}
        unsuspended = [n for n, js in sets.items() if not js["spec"].get("suspend") and n not in finished]
        running_together |= len(unsuspended) > 1
        for name in unsuspended:
            if name not in order:
                order.append(name)
        for name, js in sets.items():
            if _true(js, "Failed"):
                pytest.fail(f"JobSet {name} failed: {_conditions(js)['Failed'].get('message')}\n"
                            f"{_pod_logs('jobset.sigs.k8s.io/jobset-name=' + name)}")
            if _true(js, "Completed") and name not in finished:
                finished[name] = time.monotonic()
        time.sleep(0.5)
    assert not running_together, "Kueue admitted both 3-GPU jobs on a 4-GPU quota"
    assert len(order) == 2
    workloads = get_json("workloads", "-n", NAMESPACE)["items"]
    assert len(workloads) == 2 and all(_true(w, "Finished") for w in workloads), [w.get("status") for w in workloads]
    # The second was admitted only after the first finished.
    admitted = {w["metadata"]["ownerReferences"][0]["name"]: _conditions(w)["Admitted"]["lastTransitionTime"]
                for w in workloads}
    first_done = {w["metadata"]["ownerReferences"][0]["name"]: _conditions(w)["Finished"]["lastTransitionTime"]
                  for w in workloads}
    assert admitted[order[1]] >= first_done[order[0]], (admitted, first_done)


RUNTIME = "fuseforge-test-torch"
# What torchrun does with the PET_* variables Trainer's torch plugin sets, without torchrun.
RENDEZVOUS = """
import os, torch, torch.distributed as dist
os.environ.update(MASTER_ADDR=os.environ["PET_MASTER_ADDR"], MASTER_PORT=os.environ["PET_MASTER_PORT"])
rank, world = int(os.environ["PET_NODE_RANK"]), int(os.environ["PET_NNODES"])
dist.init_process_group("gloo", rank=rank, world_size=world)
total = torch.tensor([float(rank)])
dist.all_reduce(total)
assert total.item() == world * (world - 1) / 2
print(f"node {rank} of {world} reached the rendezvous at {os.environ['MASTER_ADDR']}", flush=True)
dist.destroy_process_group()
"""


def _runtime() -> None:
    pod = {"securityContext": RESTRICTED["pod"], "restartPolicy": "Never",
           "containers": [_container(["python", "-c", "pass"])]}
    apply(yaml.safe_dump({
        "apiVersion": "trainer.kubeflow.org/v1alpha1", "kind": "ClusterTrainingRuntime",
        "metadata": {"name": RUNTIME, "labels": {"trainer.kubeflow.org/framework": "torch"}},
        "spec": {"mlPolicy": {"numNodes": 1, "torch": {}}, "template": {"spec": {"replicatedJobs": [{
            "name": "node", "template": {
                "metadata": {"labels": {"trainer.kubeflow.org/trainjob-ancestor-step": "trainer"}},
                "spec": {"template": {"spec": pod}}},
        }]}}},
    }))


def _run_trainjob(name: str, labels: dict[str, str]) -> str:
    """Submit a 2-node TrainJob on the runtime, wait for it to complete; returns its pods' logs."""
    apply(yaml.safe_dump({
        "apiVersion": "trainer.kubeflow.org/v1alpha1", "kind": "TrainJob",
        "metadata": {"name": name, "namespace": NAMESPACE, "labels": labels},
        "spec": {"runtimeRef": {"name": RUNTIME, "kind": "ClusterTrainingRuntime"},
                 "trainer": {"numNodes": 2, "command": ["python", "-c", RENDEZVOUS]}},
    }))
    deadline = time.monotonic() + 240
    selector = f"jobset.sigs.k8s.io/jobset-name={name}"
    while True:
        job = get_json("trainjob", name, "-n", NAMESPACE)
        if _true(job, "Complete"):
            break
        if _true(job, "Failed"):
            pytest.fail(f"TrainJob failed: {_conditions(job)['Failed'].get('message')}\n{_pod_logs(selector)}")
        assert time.monotonic() < deadline, f"TrainJob did not finish: {job.get('status')}\n{_pod_logs(selector)}"
        time.sleep(1)
    jobset = get_json("jobset", name, "-n", NAMESPACE)
    assert jobset["metadata"]["ownerReferences"][0]["kind"] == "TrainJob"
    assert _true(jobset, "Completed")
    logs = _pod_logs(selector)
    assert "node 0 of 2" in logs and "node 1 of 2" in logs, logs
    return logs


def test_trainjob_runs_through_a_jobset(namespace):
    """A 2-node TrainJob on a minimal torch ClusterTrainingRuntime: Trainer v2 makes a JobSet whose two pods
    meet at the master address and port Trainer's torch plugin gives them (PET_*) and all-reduce over gloo."""
    _runtime()
    _run_trainjob("hello", {})


def test_trainjob_admitted_by_kueue(queue):
    """The same TrainJob labelled with a LocalQueue: Kueue suspends it, admits it as one Workload of two pods
    (its TrainJob integration), then Trainer starts the JobSet."""
    _runtime()
    _run_trainjob("queued", {"kueue.x-k8s.io/queue-name": queue})
    workloads = [w for w in get_json("workloads", "-n", NAMESPACE)["items"]
                 if w["metadata"]["ownerReferences"][0]["kind"] == "TrainJob"]
    assert len(workloads) == 1, workloads
    workload = workloads[0]
    assert _true(workload, "Admitted") or _true(workload, "Finished"), workload.get("status")
    assert sum(p["count"] for p in workload["spec"]["podSets"]) == 2
