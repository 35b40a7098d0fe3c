"""The local cluster's certificates, service-account keys and kubeconfigs, made with the openssl CLI.

One CA signs every serving and client certificate; Kubernetes takes identities from them (CN = user,
O = groups), so each component gets the identity it has in a kubeadm cluster: the scheduler
`system:kube-scheduler`, the node `system:node:<name>` in `system:nodes`, the admin `system:masters`.
"""

from __future__ import annotations

import subprocess
from pathlib import Path

from .layout import HOST, NODE_NAME, PORTS

DAYS = "30"
# The operator's cert rotator replaces certificates that expire within 90 days.
WEBHOOK_DAYS = "3650"
# Webhook CAs and certificates handed to a cert rotator (long-lived RSA, PKCS#1).
WEBHOOK_PREFIXES = ("operator-webhook", "controllers-webhook")


def _openssl(*args: str, cwd: Path) -> None:
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True)


def _key(path: Path) -> None:
    if path.stem.startswith(WEBHOOK_PREFIXES):
        # The training operator's and Kueue's cert rotator reads PKCS#1 RSA keys only.
        _openssl("genrsa", "-traditional", "-out", path.name, "2048", cwd=path.parent)
    else:
        _openssl("genpkey", "-algorithm", "EC", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-out", path.name, cwd=path.parent)
    path.chmod(0o600)


def make_ca(folder: Path, name: str = "ca", *, dns_name: str = "") -> None:
    _key(folder / f"{name}.key")
    extra = ["-addext", f"subjectAltName=DNS:{dns_name}"] if dns_name else []
    _openssl(
        "req", "-x509", "-new", "-key", f"{name}.key", "-out", f"{name}.crt",
        "-days", WEBHOOK_DAYS if name.startswith(WEBHOOK_PREFIXES) else DAYS,
        "-subj", f"/CN=fuseforge-local-{name}",
        "-addext", "basicConstraints=critical,CA:TRUE",
        "-addext", "keyUsage=critical,keyCertSign,cRLSign,digitalSignature",
        *extra,
        cwd=folder,
    )


def make_cert(folder: Path, name: str, subject: str, *, server_names: tuple[str, ...] = (), client: bool = False,
              ca: str = "ca") -> None:
    """Write NAME.key/NAME.crt signed by CA. server_names: DNS names and IP addresses it serves."""
    _key(folder / f"{name}.key")
    usages = (["serverAuth"] if server_names else []) + (["clientAuth"] if client else [])
    extensions = [
        "basicConstraints=critical,CA:FALSE",
        "keyUsage=critical,digitalSignature,keyEncipherment",
        f"extendedKeyUsage={','.join(usages)}",
    ]
    if server_names:
        sans = [f"IP:{n}" if n.replace(".", "").isdigit() else f"DNS:{n}" for n in server_names]
        extensions.append("subjectAltName=" + ",".join(sans))
    (folder / f"{name}.ext").write_text("\n".join(extensions) + "\n")
    _openssl("req", "-new", "-key", f"{name}.key", "-subj", subject, "-out", f"{name}.csr", cwd=folder)
    _openssl(
        "x509", "-req", "-in", f"{name}.csr", "-CA", f"{ca}.crt", "-CAkey", f"{ca}.key", "-CAcreateserial",
        "-days", WEBHOOK_DAYS if name.startswith(WEBHOOK_PREFIXES) else DAYS,
        "-extfile", f"{name}.ext", "-out", f"{name}.crt",
        cwd=folder,
    )
    (folder / f"{name}.csr").unlink()
    (folder / f"{name}.ext").unlink()


def make_all(folder: Path) -> None:
    """Every certificate and key of the cluster, unless they exist (an `up` after a crash reuses them)."""
    if (folder / "done").exists():
        return
    folder.mkdir(parents=True, exist_ok=True)
    make_ca(folder)
    api_names = (
        HOST, "10.96.0.1", "localhost", "kubernetes", "kubernetes.default", "kubernetes.default.svc",
        "kubernetes.default.svc.cluster.local",
    )
    make_cert(folder, "apiserver", "/CN=kube-apiserver", server_names=api_names)
    make_cert(folder, "apiserver-kubelet-client", "/O=system:masters/CN=kube-apiserver-kubelet-client", client=True)
    make_cert(folder, "admin", "/O=system:masters/CN=kubernetes-admin", client=True)
    make_cert(folder, "scheduler", "/CN=system:kube-scheduler", client=True)
    make_cert(folder, "controller-manager", "/CN=system:kube-controller-manager", client=True)
    make_cert(folder, "node", f"/O=system:nodes/CN=system:node:{NODE_NAME}", client=True)
    make_cert(folder, "kubelet", f"/CN={NODE_NAME}", server_names=(HOST, NODE_NAME, "localhost"))
    # The API server's front proxy (aggregated APIs) has a CA of its own, as in kubeadm.
    make_ca(folder, "front-proxy-ca")
    make_cert(folder, "front-proxy-client", "/CN=front-proxy-client", client=True, ca="front-proxy-ca")
    # The training operator's webhook CA is handed to the operator (its cert rotator keeps CA and key in
    # a Secret), so it is not the cluster's CA. The rotator checks that CA against the name it gives its own.
    make_ca(folder, "operator-webhook-ca", dns_name="training-operator-ca")
    make_cert(folder, "operator-webhook", "/CN=training-operator",
              server_names=(HOST, "training-operator.kubeflow.svc"), ca="operator-webhook-ca")
    _openssl("genpkey", "-algorithm", "RSA", "-pkeyopt", "rsa_keygen_bits:2048", "-out", "sa.key", cwd=folder)
    _openssl("pkey", "-in", "sa.key", "-pubout", "-out", "sa.pub", cwd=folder)
    (folder / "sa.key").chmod(0o600)
    (folder / "done").write_text("")


def make_controllers_webhook(folder: Path, service_names: tuple[str, ...], ca_dns_name: str) -> None:
    """The webhook CA and serving certificate of Kueue, JobSet and Trainer v2 (one for the three: the API
    server dials each at 127.0.0.1). Kueue's cert rotator keeps them when the CA is valid for its CA name
    and the certificate for its Service name, so both are in; made once per state dir."""
    if (folder / "controllers-webhook.crt").exists():
        return
    make_ca(folder, "controllers-webhook-ca", dns_name=ca_dns_name)
    make_cert(folder, "controllers-webhook", "/CN=fuseforge-controllers-webhook",
              server_names=(HOST, *service_names), ca="controllers-webhook-ca")


def api_server_url() -> str:
    return f"https://{HOST}:{PORTS.apiserver}"


def write_kubeconfig(path: Path, pki: Path, *, user: str, cert: str | None = None, token: str | None = None) -> Path:
    """A kubeconfig for the local API server, authenticating with a client certificate or a token."""
    if cert:
        credentials = f"    client-certificate: {pki / (cert + '.crt')}\n    client-key: {pki / (cert + '.key')}\n"
    elif token:
        credentials = f"    token: {token}\n"
    else:
        raise ValueError("write_kubeconfig needs a client certificate or a token")
    path.write_text(
        "apiVersion: v1\nkind: Config\n"
        f"clusters:\n- name: fuseforge-local\n  cluster:\n    server: {api_server_url()}\n"
        f"    certificate-authority: {pki / 'ca.crt'}\n"
        f"users:\n- name: {user}\n  user:\n{credentials}"
        f"contexts:\n- name: fuseforge-local\n  context:\n    cluster: fuseforge-local\n    user: {user}\n"
        "current-context: fuseforge-local\n"
    )
    path.chmod(0o600)
    return path
