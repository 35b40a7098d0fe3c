"""Kueue, JobSet and Kubeflow Trainer v2 out of cluster, as the training operator runs (issue 48).

Each runs as a process on this machine with a ServiceAccount token and the ClusterRole of its own
module's manifests; CRDs and webhook configurations come from the module too (the Go module cache
after `go mod download`), the webhooks pointed at https://127.0.0.1:PORT with one self-signed CA
(`pki.make_controllers_webhook`). Start order: JobSet (Trainer creates JobSets), Trainer, then Kueue
(its TrainJob and JobSet integrations need those CRDs).

- JobSet and Trainer: their own cert management off; controller-runtime reads the serving certificate
  from $TMPDIR/k8s-webhook-server/serving-certs, so each gets a TMPDIR in the state dir holding it.
- Kueue: its internal cert management on (with it off it reads a metrics certificate from a fixed path
  under /etc): the rotator keeps the Secret made here (CA valid for `kueue-ca`, certificate for the
  webhook Service's name and 127.0.0.1) and writes it to `webhook.certDir`; the CRDs' conversion webhooks
  point at 127.0.0.1 as in the module's `webhook_in_*` patches.
"""

from __future__ import annotations

import base64
import os
import shutil
import subprocess
import time
from pathlib import Path

import yaml

from . import build, health, pki, processes
from .kubectl import apply, get_json, kubectl
from .layout import HOST, PORTS, state_dir

KUEUE_NAMESPACE = "kueue-system"
JOBSET_NAMESPACE = "jobset-system"
TRAINER_NAMESPACE = "kubeflow-system"
KUEUE_SERVICE = "kueue-webhook-service"  # the rotator's DNS name is SERVICE.NAMESPACE.svc
KUEUE_SECRET = "kueue-webhook-server-cert"
KUEUE_CA_NAME = "kueue-ca"
# Namespaces whose plain pods Kueue manages (its pod integration) and whose pods its pod webhook sees:
# the chart's task namespaces carry this label.
TASK_NAMESPACE_LABELS = {"app.kubernetes.io/component": "platform"}
# Kueue integrations on: Trainer v2 TrainJobs, JobSets and plain pods (the task namespaces only).
KUEUE_FRAMEWORKS = ("trainer.kubeflow.org/trainjob", "jobset.x-k8s.io/jobset", "pod")
# CRDs whose conversion webhook Kueue serves (the module's config/components/crd/patches/webhook_in_*).
KUEUE_CONVERTED = ("clusterqueues", "cohorts", "localqueues", "multikueueclusters", "resourceflavors", "workloads")

MODULES = {  # component -> the upstream module whose files (CRDs, RBAC, webhooks) are used
    "kueue": "sigs.k8s.io/kueue",
    "jobset": "sigs.k8s.io/jobset",
    "trainer": "github.com/kubeflow/trainer/v2",
}


def module_dir(component: str, module: str) -> Path:
    """The upstream module's folder in the Go module cache (`go list -m` in our pin-only module)."""
    pinned = build.components()[component]
    out = subprocess.run(
        ["go", "list", "-m", "-f", "{{.Dir}}", module],
        cwd=pinned.module_dir, env=build.go_env(pinned), check=True, capture_output=True, text=True,
    )
    return Path(out.stdout.strip())


def _docs(path: Path) -> list[dict]:
    return [d for d in yaml.safe_load_all(path.read_text()) if d]


def _ca_bundle(pki_dir: Path) -> str:
    return base64.b64encode((pki_dir / "controllers-webhook-ca.crt").read_bytes()).decode()


def _namespace(name: str) -> None:
    apply(f"apiVersion: v1\nkind: Namespace\nmetadata:\n  name: {name}\n")


def _crds(files: list[Path], patch=None) -> list[str]:
    names = []
    for path in files:
        for doc in _docs(path):
            if doc.get("kind") != "CustomResourceDefinition":
                continue
            if patch:
                patch(doc)
            apply(yaml.safe_dump(doc))
            names.append(doc["metadata"]["name"])
    deadline = time.monotonic() + 60
    for name in names:
        # `kubectl wait` right after the apply can find no status yet, and fails.
        while not any(c["type"] == "Established" and c["status"] == "True"
                      for c in get_json("crd", name).get("status", {}).get("conditions") or []):
            if time.monotonic() > deadline:
                raise health.ComponentFailed(f"CRD {name} not Established after 60 s")
            time.sleep(0.5)
    return names


def _rbac(component: str, namespace: str, account: str, files: list[Path], renames: dict[str, str] | None = None) -> None:
    """The module's ClusterRoles (and namespaced Roles) under COMPONENT-prefixed names, bound to its
    ServiceAccount in NAMESPACE (the modules' bindings name no namespace: their kustomizations add it).
    renames: resourceNames in the rules that its kustomization renames (webhook configurations)."""
    _namespace(namespace)
    apply(f"apiVersion: v1\nkind: ServiceAccount\nmetadata:\n  name: {account}\n  namespace: {namespace}\n")
    for path in files:
        for doc in _docs(path):
            if doc.get("kind") not in ("ClusterRole", "Role"):
                continue
            for rule in doc.get("rules", []):
                if "resourceNames" in rule:
                    rule["resourceNames"] = [(renames or {}).get(n, n) for n in rule["resourceNames"]]
            name = doc["metadata"]["name"]
            if not name.startswith(component):
                name = f"{component}-{name}"
            doc["metadata"] = {"name": name}
            subject = {"kind": "ServiceAccount", "name": account, "namespace": namespace}
            ref = {"apiGroup": "rbac.authorization.k8s.io", "kind": doc["kind"], "name": name}
            binding = {"apiVersion": "rbac.authorization.k8s.io/v1", "metadata": {"name": name},
                       "roleRef": ref, "subjects": [subject]}
            if doc["kind"] == "Role":
                doc["metadata"]["namespace"] = namespace
                binding["metadata"]["namespace"] = namespace
                binding["kind"] = "RoleBinding"
            else:
                binding["kind"] = "ClusterRoleBinding"
            apply(yaml.safe_dump(doc))
            apply(yaml.safe_dump(binding))


def _kubeconfig(component: str, namespace: str, account: str, paths: dict[str, Path]) -> Path:
    token = kubectl("-n", namespace, "create", "token", account, "--duration=48h").stdout.strip()
    return pki.write_kubeconfig(paths["kubeconfigs"] / component, paths["pki"],
                                user=f"system:serviceaccount:{namespace}:{account}", token=token)


def _webhooks(path: Path, names: dict[str, str], port: int, pki_dir: Path, keep=lambda w: True,
              selector=lambda w: None) -> None:
    """The module's webhook configurations, each webhook called at https://127.0.0.1:PORT/PATH.
    names: the module's configuration name -> the name the controller (its cert rotator) expects."""
    for config in _docs(path):
        config["metadata"] = {"name": names[config["metadata"]["name"]]}
        webhooks = []
        for webhook in config["webhooks"]:
            if not keep(webhook):
                continue
            if (namespaces := selector(webhook)) is not None:
                webhook["namespaceSelector"] = namespaces
            path_ = webhook["clientConfig"]["service"]["path"]
            webhook["clientConfig"] = {"url": f"https://{HOST}:{port}{path_}", "caBundle": _ca_bundle(pki_dir)}
            webhooks.append(webhook)
        config["webhooks"] = webhooks
        apply(yaml.safe_dump(config))


def _serving_certs(component: str, pki_dir: Path) -> Path:
    """A TMPDIR for COMPONENT whose k8s-webhook-server/serving-certs holds the webhook certificate
    (controller-runtime's default CertDir is under os.TempDir()); inside the state dir, so `down` removes it."""
    tmp = state_dir() / component / "tmp"
    certs = tmp / "k8s-webhook-server" / "serving-certs"
    certs.mkdir(parents=True, exist_ok=True)
    shutil.copy(pki_dir / "controllers-webhook.crt", certs / "tls.crt")
    shutil.copy(pki_dir / "controllers-webhook.key", certs / "tls.key")
    return tmp


def _config(component: str, config: dict) -> Path:
    path = state_dir() / component / "config.yaml"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    return path


def _launch(start, component: str, binary: Path, kubeconfig: Path, config: Path, namespace: str, tmp: Path) -> None:
    """Start a controller as all three run: its kubeconfig and Configuration file, its namespace as the pod's,
    TMPDIR where its certificates are (see the module docstring)."""
    env = dict(os.environ, POD_NAMESPACE=namespace, TMPDIR=str(tmp))
    start(component, [str(binary), f"--kubeconfig={kubeconfig}", f"--config={config}", "--zap-log-level=info"],
          env=env)


def _ready(component: str, port: int) -> None:
    health.wait(component, lambda: health.http_ok(f"http://{HOST}:{port}/readyz"), timeout=120, what="/readyz")


def start_jobset(binary: Path, paths: dict[str, Path], start) -> None:
    if processes.running_pid("jobset") is not None:
        return
    src = module_dir("jobset", MODULES["jobset"])
    _crds(sorted((src / "config" / "components" / "crd" / "bases").glob("*.yaml")))
    _rbac("jobset", JOBSET_NAMESPACE, "jobset-controller-manager", [src / "config" / "components" / "rbac" / "role.yaml"])
    names = {"mutating-webhook-configuration": "jobset-mutating-webhook-configuration",
             "validating-webhook-configuration": "jobset-validating-webhook-configuration"}
    # The module's kustomize patch: its pod webhooks see only JobSet's pods.
    jobset_pods = {"matchExpressions": [{"key": "jobset.sigs.k8s.io/jobset-name", "operator": "Exists"}]}

    def keep(webhook: dict) -> bool:
        if webhook["clientConfig"]["service"]["path"].endswith("--v1-pod"):
            webhook["objectSelector"] = jobset_pods
        return True

    _webhooks(src / "config" / "components" / "webhook" / "manifests.yaml", names, PORTS.jobset_webhook,
              paths["pki"], keep=keep)
    kubeconfig = _kubeconfig("jobset", JOBSET_NAMESPACE, "jobset-controller-manager", paths)
    config = _config("jobset", {
        "apiVersion": "config.jobset.x-k8s.io/v1alpha1", "kind": "Configuration",
        "webhook": {"port": PORTS.jobset_webhook, "host": HOST},
        "metrics": {"bindAddress": f"{HOST}:{PORTS.jobset_metrics}"},
        "health": {"healthProbeBindAddress": f"{HOST}:{PORTS.jobset_health}"},
        "leaderElection": {"leaderElect": False},
        "internalCertManagement": {"enable": False},
    })
    _launch(start, "jobset", binary, kubeconfig, config, JOBSET_NAMESPACE, _serving_certs("jobset", paths["pki"]))
    _ready("jobset", PORTS.jobset_health)


def start_trainer(binary: Path, paths: dict[str, Path], start) -> None:
    if processes.running_pid("trainer") is not None:
        return
    src = module_dir("trainer", MODULES["trainer"])
    _crds(sorted((src / "manifests" / "base" / "crds").glob("trainer.kubeflow.org_*.yaml")))
    _rbac("trainer", TRAINER_NAMESPACE, "kubeflow-trainer-controller-manager",
          [src / "manifests" / "base" / "rbac" / "role.yaml"])
    # The names the module's kustomize patches give (and the controller's cert rotator would use).
    names = {"mutating-webhook-configuration": "defaulter.trainer.kubeflow.org",
             "validating-webhook-configuration": "validator.trainer.kubeflow.org"}
    _webhooks(src / "manifests" / "base" / "webhook" / "manifests.yaml", names, PORTS.trainer_webhook, paths["pki"])
    kubeconfig = _kubeconfig("trainer", TRAINER_NAMESPACE, "kubeflow-trainer-controller-manager", paths)
    config = _config("trainer", {
        "apiVersion": "config.trainer.kubeflow.org/v1alpha1", "kind": "Configuration",
        "webhook": {"port": PORTS.trainer_webhook, "host": HOST},
        "metrics": {"bindAddress": f"{HOST}:{PORTS.trainer_metrics}", "secureServing": False},
        "health": {"healthProbeBindAddress": f"{HOST}:{PORTS.trainer_health}"},
        "leaderElection": {"leaderElect": False},
        "certManagement": {"enable": False},
    })
    _launch(start, "trainer", binary, kubeconfig, config, TRAINER_NAMESPACE, _serving_certs("trainer", paths["pki"]))
    _ready("trainer", PORTS.trainer_health)


def kueue_configuration(cert_dir: Path) -> dict:
    """Kueue's Configuration (config.kueue.x-k8s.io/v1beta2: a `waitForPodsReady` section turns it on;
    v1beta1 spelled that `waitForPodsReady.enable: true`)."""
    return {
        "apiVersion": "config.kueue.x-k8s.io/v1beta2", "kind": "Configuration",
        "namespace": KUEUE_NAMESPACE,
        "webhook": {"port": PORTS.kueue_webhook, "host": HOST, "certDir": str(cert_dir)},
        "metrics": {"bindAddress": f"{HOST}:{PORTS.kueue_metrics}"},
        "health": {"healthProbeBindAddress": f"{HOST}:{PORTS.kueue_health}"},
        "leaderElection": {"leaderElect": False},
        "internalCertManagement": {"enable": True, "webhookServiceName": KUEUE_SERVICE,
                                   "webhookSecretName": KUEUE_SECRET},
        # Gang admission: an admitted workload whose pods are not all ready within the timeout is evicted
        # and requeued (so a half-started multi-node run does not hold its GPUs).
        "waitForPodsReady": {"timeout": "5m", "blockAdmission": False},
        "manageJobsWithoutQueueName": False,
        "managedJobsNamespaceSelector": {"matchLabels": dict(TASK_NAMESPACE_LABELS)},
        "integrations": {"frameworks": list(KUEUE_FRAMEWORKS)},
        # The on-demand visibility API is an aggregated API server of its own (not set up here).
        "featureGates": {"VisibilityOnDemand": False},
    }


def _kueue_webhook_wanted(webhook: dict) -> bool:
    """Kueue's own objects and the enabled integrations only: a webhook for a kind whose integration is off
    (PyTorchJob, batch Job, ...) would send those objects to a handler Kueue does not serve."""
    path = webhook["clientConfig"]["service"]["path"]
    return any(part in path for part in ("-kueue-x-k8s-io-", "-jobset-x-k8s-io-", "-trainer-kubeflow-org-", "--v1-pod"))


def _kueue_selector(webhook: dict) -> dict | None:
    if webhook["clientConfig"]["service"]["path"].endswith("--v1-pod"):
        return {"matchLabels": dict(TASK_NAMESPACE_LABELS)}
    if "-kueue-x-k8s-io-" in webhook["clientConfig"]["service"]["path"]:
        return None
    # As the module's kustomization sets it for job kinds.
    return {"matchExpressions": [{"key": "kubernetes.io/metadata.name", "operator": "NotIn",
                                  "values": ["kube-system", KUEUE_NAMESPACE]}]}


def start_kueue(binary: Path, paths: dict[str, Path], start) -> None:
    if processes.running_pid("kueue") is not None:
        return
    src = module_dir("kueue", MODULES["kueue"])
    pki_dir = paths["pki"]
    bundle = _ca_bundle(pki_dir)

    def conversion(crd: dict) -> None:
        plural = crd["spec"]["names"]["plural"]
        if plural in KUEUE_CONVERTED:
            crd["spec"]["conversion"] = {"strategy": "Webhook", "webhook": {
                "conversionReviewVersions": ["v1"],
                "clientConfig": {"url": f"https://{HOST}:{PORTS.kueue_webhook}/convert", "caBundle": bundle}}}

    _crds(sorted((src / "config" / "components" / "crd" / "bases").glob("*.yaml")), patch=conversion)
    rbac = src / "config" / "components" / "rbac"
    names = {"mutating-webhook-configuration": "kueue-mutating-webhook-configuration",
             "validating-webhook-configuration": "kueue-validating-webhook-configuration"}
    _rbac("kueue", KUEUE_NAMESPACE, "kueue-controller-manager", [rbac / "role.yaml", rbac / "manager_secrets_role.yaml"],
          renames=names)
    files = {"ca.crt": "controllers-webhook-ca.crt", "ca.key": "controllers-webhook-ca.key",
             "tls.crt": "controllers-webhook.crt", "tls.key": "controllers-webhook.key"}
    apply(kubectl("-n", KUEUE_NAMESPACE, "create", "secret", "generic", KUEUE_SECRET,
                  *[f"--from-file={key}={pki_dir / name}" for key, name in files.items()],
                  "--dry-run=client", "-o", "yaml").stdout)
    _webhooks(src / "config" / "components" / "webhook" / "manifests.yaml", names, PORTS.kueue_webhook, pki_dir,
              keep=_kueue_webhook_wanted, selector=_kueue_selector)
    kubeconfig = _kubeconfig("kueue", KUEUE_NAMESPACE, "kueue-controller-manager", paths)
    # What a mounted Secret would hold: the rotator waits until the files in certDir match its Secret.
    cert_dir = state_dir() / "kueue" / "certs"
    cert_dir.mkdir(parents=True, exist_ok=True)
    for key, name in files.items():
        if key != "ca.key":
            shutil.copy(pki_dir / name, cert_dir / key)
    config = _config("kueue", kueue_configuration(cert_dir))
    _launch(start, "kueue", binary, kubeconfig, config, KUEUE_NAMESPACE, cert_dir.parent)
    # Its certificate bootstrap runs a manager of its own whose /readyz has no checks: the webhook port opens
    # only with the real one.
    health.wait("kueue", lambda: health.tcp_open(HOST, PORTS.kueue_webhook), timeout=120, what="its webhook port")
    _ready("kueue", PORTS.kueue_health)


def start_all(programs: dict[str, Path], paths: dict[str, Path], start) -> None:
    pki.make_controllers_webhook(paths["pki"], (f"{KUEUE_SERVICE}.{KUEUE_NAMESPACE}.svc",), KUEUE_CA_NAME)
    start_jobset(programs["jobset"], paths, start)
    start_trainer(programs["trainer-controller-manager"], paths, start)
    start_kueue(programs["kueue"], paths, start)
