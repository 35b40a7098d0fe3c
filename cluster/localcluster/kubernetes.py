"""Command lines of etcd, kube-apiserver, kube-scheduler and kube-controller-manager for one machine."""

from __future__ import annotations

from pathlib import Path

from .layout import HOST, PORTS, SERVICE_CIDR


def etcd(kube: Path, data: Path) -> list[str]:
    client, peer = f"http://{HOST}:{PORTS.etcd_client}", f"http://{HOST}:{PORTS.etcd_peer}"
    return [
        str(kube), "etcd", "--name", "local", "--data-dir", str(data),
        "--listen-client-urls", client, "--advertise-client-urls", client,
        "--listen-peer-urls", peer, "--initial-advertise-peer-urls", peer,
        "--initial-cluster", f"local={peer}",
        # One member on a CI disk: fsync per write would dominate every API call; nothing here
        # outlives `down`, so durability across power loss buys nothing.
        "--unsafe-no-fsync",
        "--log-level", "warn",
    ]


AUDIT_POLICY = """apiVersion: audit.k8s.io/v1
kind: Policy
omitStages: [RequestReceived]
rules:
- level: None
  resources: [{group: coordination.k8s.io, resources: [leases]}]
- level: None
  nonResourceURLs: ["/healthz*", "/readyz*", "/livez*"]
- level: RequestResponse
  verbs: [create]
  resources: [{group: "", resources: [pods]}, {group: kubeflow.org, resources: [pytorchjobs]}]
- level: Metadata
"""


def apiserver(kube: Path, pki: Path, audit_log: Path) -> list[str]:
    """Every request is audited (who did what: the tests read it) except leases and health checks; pod and
    PyTorchJob creations with the created object (what Flyte and the operator asked for, after admission)."""
    policy = audit_log.parent / "audit-policy.yaml"
    policy.parent.mkdir(parents=True, exist_ok=True)
    policy.write_text(AUDIT_POLICY)
    return [
        str(kube), "kube-apiserver",
        f"--etcd-servers=http://{HOST}:{PORTS.etcd_client}",
        f"--bind-address={HOST}", f"--advertise-address={HOST}", f"--secure-port={PORTS.apiserver}",
        f"--tls-cert-file={pki / 'apiserver.crt'}", f"--tls-private-key-file={pki / 'apiserver.key'}",
        f"--client-ca-file={pki / 'ca.crt'}",
        f"--kubelet-client-certificate={pki / 'apiserver-kubelet-client.crt'}",
        f"--kubelet-client-key={pki / 'apiserver-kubelet-client.key'}",
        f"--kubelet-certificate-authority={pki / 'ca.crt'}",
        "--kubelet-preferred-address-types=InternalIP",
        "--service-account-issuer=https://kubernetes.default.svc.cluster.local",
        f"--service-account-key-file={pki / 'sa.pub'}",
        f"--service-account-signing-key-file={pki / 'sa.key'}",
        f"--service-cluster-ip-range={SERVICE_CIDR}",
        f"--requestheader-client-ca-file={pki / 'front-proxy-ca.crt'}",
        "--requestheader-allowed-names=front-proxy-client",
        "--requestheader-username-headers=X-Remote-User", "--requestheader-group-headers=X-Remote-Group",
        "--requestheader-extra-headers-prefix=X-Remote-Extra-",
        f"--proxy-client-cert-file={pki / 'front-proxy-client.crt'}",
        f"--proxy-client-key-file={pki / 'front-proxy-client.key'}",
        "--authorization-mode=Node,RBAC",
        # NodeRestriction and the defaults (NamespaceLifecycle, ServiceAccount, PodSecurity, ...).
        "--enable-admission-plugins=NodeRestriction",
        # Pod Security admission decides what runs; the API server does not refuse privileged pods itself.
        "--allow-privileged=true",
        # The API server's own address is loopback, which an Endpoints object may not hold.
        "--endpoint-reconciler-type=none",
        f"--audit-policy-file={policy}", f"--audit-log-path={audit_log}", "--audit-log-maxsize=100",
        "--profiling=false",
        "-v=1",
    ]


def controller_manager(kube: Path, pki: Path, kubeconfig: Path) -> list[str]:
    return [
        str(kube), "kube-controller-manager",
        f"--kubeconfig={kubeconfig}", f"--authentication-kubeconfig={kubeconfig}",
        f"--authorization-kubeconfig={kubeconfig}",
        f"--bind-address={HOST}", f"--secure-port={PORTS.controller_manager}",
        f"--service-account-private-key-file={pki / 'sa.key'}", f"--root-ca-file={pki / 'ca.crt'}",
        f"--cluster-signing-cert-file={pki / 'ca.crt'}", f"--cluster-signing-key-file={pki / 'ca.key'}",
        f"--service-cluster-ip-range={SERVICE_CIDR}",
        # Each controller acts as its own service account (least privilege, as kubeadm runs it).
        "--use-service-account-credentials=true",
        "--leader-elect=false",
        "--profiling=false",
        "-v=1",
    ]


def scheduler(kube: Path, kubeconfig: Path) -> list[str]:
    return [
        str(kube), "kube-scheduler",
        f"--kubeconfig={kubeconfig}", f"--authentication-kubeconfig={kubeconfig}",
        f"--authorization-kubeconfig={kubeconfig}",
        f"--bind-address={HOST}", f"--secure-port={PORTS.scheduler}",
        "--leader-elect=false",
        "--profiling=false",
        "-v=1",
    ]
