"""`up`, `down`, `status` and `logs` of the local cluster."""

from __future__ import annotations

import base64
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import yaml

from . import build, health, kubernetes, pki, postgres, processes, queueing
from .kubectl import admin_kubeconfig, apply, get_json, kubectl, tool
from .layout import DNS_ADDRESS, HOST, NODE_NAME, PORTS, REPO, log_path, state_dir

# Start order; `down` stops them in reverse.
COMPONENTS = (
    "etcd", "kube-apiserver", "kube-controller-manager", "kube-scheduler", "postgres", "s3", "registry",
    "node", "training-operator", "jobset", "trainer", "kueue",
)
OPERATOR_NAMESPACE = "kubeflow"
# The webhook certificate folder the training operator's certificate rotator reads (fixed under /tmp; it never
# writes it): `up` writes our certificate there and `down` removes it again, with the folders if left empty.
OPERATOR_CERT_DIR = Path("/tmp/k8s-webhook-server/serving-certs")
FLYTE_NAMESPACE = "flyte"
BUCKET = "fuseforge-flyte"
OBJECT_STORE_SECRET = "fuseforge-object-store"
RELEASE = "fuseforge"
LOCAL_VALUES = REPO / "cluster" / "local-values.yaml"
# The training image as cluster/local-values.yaml names it (registry/name).
LOCAL_IMAGE_PREFIX = f"{HOST}:{PORTS.registry}/fuseforge"


def log(message: str) -> None:
    print(f"cluster: {message}", file=sys.stderr, flush=True)


def _paths() -> dict[str, Path]:
    root = state_dir()
    return {
        "pki": root / "pki",
        "etcd": root / "etcd",
        "postgres": root / "postgres",
        "pgsocket": root / "pgsocket",
        "s3": root / "s3",
        "registry": root / "registry",
        "node": root / "node",
        "secrets": root / "secrets",
        "bin": root / "bin",
        "kubeconfigs": root / "kubeconfigs",
    }


def _link_binaries(programs: dict[str, Path], folder: Path) -> dict[str, Path]:
    """state/bin holds every program under its own name: the node puts it on pods' PATH, and pods that
    run as another user (Flyte runs as nobody) can read it there, unlike the cache in root's home."""
    folder.mkdir(parents=True, exist_ok=True)
    folder.chmod(0o755)
    linked = {}
    for name, target in programs.items():
        link = folder / name
        link.unlink(missing_ok=True)
        try:
            os.link(target, link)
        except OSError:
            shutil.copy2(target, link)
        linked[name] = link
    return linked


def _check_ports() -> None:
    busy = []
    for field in PORTS.__dataclass_fields__:
        port = getattr(PORTS, field)
        if health.port_in_use(HOST, port):
            busy.append(f"{field} ({HOST}:{port})")
    if busy:
        raise health.ComponentFailed(
            "ports in use, by another cluster or program: " + ", ".join(busy)
            + " (`bash scripts/cluster.sh down` stops a cluster this checkout started)"
        )


def _start(name: str, argv: list[str], **kwargs) -> None:
    if processes.running_pid(name) is not None:
        return
    processes.start(name, argv, **kwargs)


def _secret(path: Path, value_factory) -> str:
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(value_factory())
        path.chmod(0o600)
    return path.read_text().strip()


def up(*, with_node: bool = True, with_operator: bool = True, with_queueing: bool = True) -> None:
    started = time.monotonic()
    paths = _paths()
    state_dir().mkdir(parents=True, exist_ok=True)
    state_dir().chmod(0o755)
    if missing := missing_packages():
        raise RuntimeError("missing packages: " + " ".join(missing) + " (bash scripts/cluster.sh deps installs them)")
    if not any(processes.running_pid(c) for c in COMPONENTS):
        _check_ports()
    wanted = ["kube", "stores"] + (["node"] if with_node else []) + (["operator"] if with_operator else [])
    wanted += ["flyte", "flyteadmin", "flytepropeller", "datacatalog"]
    wanted += ["jobset", "trainer", "kueue"] if with_queueing else []
    programs = build.build_all(wanted)
    programs = _link_binaries(programs, paths["bin"])
    built = time.monotonic()
    kube = programs["kube"]
    tool("kubectl"), tool("helm")

    pki.make_all(paths["pki"])
    paths["kubeconfigs"].mkdir(parents=True, exist_ok=True)
    pki.write_kubeconfig(admin_kubeconfig(), paths["pki"], user="kubernetes-admin", cert="admin")
    cm_config = pki.write_kubeconfig(paths["kubeconfigs"] / "controller-manager", paths["pki"],
                                     user="system:kube-controller-manager", cert="controller-manager")
    sched_config = pki.write_kubeconfig(paths["kubeconfigs"] / "scheduler", paths["pki"],
                                        user="system:kube-scheduler", cert="scheduler")
    node_config = pki.write_kubeconfig(paths["kubeconfigs"] / "node", paths["pki"],
                                       user=f"system:node:{NODE_NAME}", cert="node")
    ca = paths["pki"] / "ca.crt"

    _start("etcd", kubernetes.etcd(kube, paths["etcd"]))
    health.wait("etcd", lambda: health.http_ok(f"http://{HOST}:{PORTS.etcd_client}/health"), timeout=60, what="health")
    _start("kube-apiserver", kubernetes.apiserver(kube, paths["pki"], log_path("kube-apiserver-audit")))
    health.wait(
        "kube-apiserver",
        lambda: health.https_ok(f"https://{HOST}:{PORTS.apiserver}/readyz", ca=ca,
                                cert=paths["pki"] / "admin.crt", key=paths["pki"] / "admin.key"),
        timeout=120, what="/readyz",
    )
    _start("kube-controller-manager", kubernetes.controller_manager(kube, paths["pki"], cm_config))
    _start("kube-scheduler", kubernetes.scheduler(kube, sched_config))

    # Object store, registry and database: what a user's cluster has outside Kubernetes.
    _secret(paths["secrets"] / "s3-access-key", lambda: "fuseforge-" + os.urandom(6).hex())
    _secret(paths["secrets"] / "s3-secret-key", lambda: os.urandom(24).hex())
    _start("s3", [str(programs["stores"]), "s3", "--address", f"{HOST}:{PORTS.s3}", "--root", str(paths["s3"]),
                  "--bucket", BUCKET, "--access-key-file", str(paths["secrets"] / "s3-access-key"),
                  "--secret-key-file", str(paths["secrets"] / "s3-secret-key")])
    _start("registry", [str(programs["stores"]), "registry", "--address", f"{HOST}:{PORTS.registry}",
                        "--root", str(paths["registry"])])
    postgres.init(paths["postgres"], paths["secrets"] / "postgres-password")
    _start("postgres", postgres.server(paths["postgres"], paths["pgsocket"]))
    health.wait("postgres", lambda: postgres.ready(paths["pgsocket"]), timeout=60, what="connections")
    postgres.create_database(paths["pgsocket"], paths["secrets"] / "postgres-password")
    health.wait("s3", lambda: health.tcp_open(HOST, PORTS.s3), timeout=30, what="listener")
    health.wait("registry", lambda: health.http_ok(f"http://{HOST}:{PORTS.registry}/v2/"), timeout=30, what="/v2/")

    for name in ("kube-controller-manager", "kube-scheduler"):
        port = PORTS.controller_manager if name == "kube-controller-manager" else PORTS.scheduler
        health.wait(name, lambda port=port: health.tcp_open(HOST, port), timeout=60, what="its secure port")
    health.wait("kube-controller-manager", lambda: _default_service_account(), timeout=60,
                what="the default ServiceAccount")

    if with_node:
        _start("node", [
            str(programs["node"]), "--kubeconfig", str(node_config), "--node-name", NODE_NAME,
            "--state-dir", str(paths["node"]), "--cpus", str(os.cpu_count() or 2), "--memory", _memory(),
            "--gpus", os.environ.get("FUSEFORGE_CLUSTER_GPUS", "8"), "--pods", "110",
            "--kubelet-address", f"{HOST}:{PORTS.kubelet}",
            "--tls-cert", str(paths["pki"] / "kubelet.crt"), "--tls-key", str(paths["pki"] / "kubelet.key"),
            "--client-ca", str(ca), "--dns-address", DNS_ADDRESS, "--cluster-domain", "cluster.local",
            "--path", os.pathsep.join(_pod_path(paths["bin"])),
            "--entrypoint", f"cr.flyte.org/flyteorg/flyte-binary-release={paths['bin'] / 'flyte'}",
            # The fuseforge image's user owns its WORKDIR (images/Dockerfile); here a fresh one per container.
            "--workdir", f"{LOCAL_IMAGE_PREFIX}=/home/flytekit",
            *[arg for folder in _closed_ancestors() for arg in ("--traversable", folder)],
        ])
        health.wait("node", _node_ready, timeout=90, what="a Ready Node")
        # What GPU feature discovery does on a GPU node: the GPU PodTemplate selects on it.
        if int(os.environ.get("FUSEFORGE_CLUSTER_GPUS", "8")) > 0:
            kubectl("label", "node", NODE_NAME, "nvidia.com/gpu.present=true", "--overwrite")
    _cluster_services(paths)
    if with_operator:
        _start_operator(programs["training-operator"], paths)
    if with_queueing:
        # JobSet, Kubeflow Trainer v2 and Kueue (localcluster/queueing.py).
        queueing.start_all(programs, paths, _start)
    log(f"up in {time.monotonic() - started:.0f} s ({built - started:.0f} s finding/building binaries); "
        f"KUBECONFIG={admin_kubeconfig()}")


def _memory() -> str:
    with open("/proc/meminfo") as f:
        kib = int(f.readline().split()[1])
    return f"{kib // 1024}Mi"


def _pod_path(bin_dir: Path) -> list[str]:
    """What pods find on PATH: the project's virtualenv (the "image") and the cluster's programs."""
    venv = Path(os.environ.get("FUSEFORGE_VENV") or REPO / ".venv")
    return [str(venv / "bin"), str(bin_dir)]


def _closed_ancestors() -> list[str]:
    """Folders on the way to the virtualenv's interpreter that other users cannot enter (pyenv under
    /root): pods run as other users (the chart's uid 1001, Flyte's nobody) and must start it."""
    venv = Path(os.environ.get("FUSEFORGE_VENV") or REPO / ".venv")
    closed = []
    for target in {(venv / "bin" / "python").resolve(), venv.resolve()}:
        for folder in reversed(target.parents):
            if folder.is_dir() and not folder.stat().st_mode & 0o001 and str(folder) not in closed:
                closed.append(str(folder))
    return closed


def _default_service_account() -> bool:
    return kubectl("-n", "default", "get", "serviceaccount", "default", check=False).returncode == 0


def _node_ready() -> bool:
    node = get_json("node", NODE_NAME)
    return any(c["type"] == "Ready" and c["status"] == "True" for c in node["status"].get("conditions", []))


def _cluster_services(paths: dict[str, Path]) -> None:
    """Namespace `flyte`, the Service naming the database (resolved by the node's DNS), and the Secrets
    a user creates before installing: the database password and the object store's keys."""
    apply(
        f"""apiVersion: v1
kind: Namespace
metadata:
  name: {FLYTE_NAMESPACE}
---
apiVersion: v1
kind: Service
metadata:
  name: postgres
  namespace: {FLYTE_NAMESPACE}
spec:
  ports:
  - port: {PORTS.postgres}
"""
    )
    apply(kubectl("-n", FLYTE_NAMESPACE, "create", "secret", "generic", "fuseforge-flyte-db",
                  f"--from-file=password={paths['secrets'] / 'postgres-password'}",
                  "--dry-run=client", "-o", "yaml").stdout)
    apply(object_store_secret(FLYTE_NAMESPACE))


def object_store_secret(namespace: str) -> str:
    """Secret fuseforge-object-store: the S3 keys as the AWS_* variables both Flyte and flytekit read."""
    secrets = _paths()["secrets"]
    return kubectl(
        "-n", namespace, "create", "secret", "generic", OBJECT_STORE_SECRET,
        f"--from-file=AWS_ACCESS_KEY_ID={secrets / 's3-access-key'}",
        f"--from-file=AWS_SECRET_ACCESS_KEY={secrets / 's3-secret-key'}",
        "--dry-run=client", "-o", "yaml",
    ).stdout


def _operator_module_dir() -> Path:
    component = build.components()["operator"]
    out = subprocess.run(
        ["go", "list", "-m", "-f", "{{.Dir}}", "github.com/kubeflow/training-operator"],
        cwd=component.module_dir, env=build.go_env(component), check=True, capture_output=True, text=True,
    )
    return Path(out.stdout.strip())


def _operator_webhook(manifests: Path, pki_dir: Path) -> None:
    """The operator's PyTorchJob validating webhook, called by the API server at the operator's loopback port.

    The Secret holds the webhook CA and a serving certificate for both the Service name the operator's
    cert rotator checks and 127.0.0.1 (what the API server dials: a Service in front of a process on this
    machine has no routable endpoints); the rotator keeps it and writes its CA into the configuration.
    """
    files = {"ca.crt": "operator-webhook-ca.crt", "ca.key": "operator-webhook-ca.key",
             "tls.crt": "operator-webhook.crt", "tls.key": "operator-webhook.key"}
    secret = kubectl("-n", OPERATOR_NAMESPACE, "create", "secret", "generic", "training-operator-webhook-cert",
                     *[f"--from-file={key}={pki_dir / name}" for key, name in files.items()],
                     "--dry-run=client", "-o", "yaml").stdout
    apply(secret)
    configs = yaml.safe_load((manifests / "webhook" / "manifests.yaml").read_text())
    config = configs if isinstance(configs, dict) else next(c for c in configs if c)
    webhook = next(w for w in config["webhooks"] if "pytorchjob" in w["name"])
    path = webhook["clientConfig"]["service"]["path"]
    webhook["clientConfig"] = {
        "url": f"https://{HOST}:{PORTS.operator_webhook}{path}",
        "caBundle": base64.b64encode((pki_dir / "operator-webhook-ca.crt").read_bytes()).decode(),
    }
    config["metadata"] = {"name": "validator.training-operator.kubeflow.org"}
    config["webhooks"] = [webhook]
    apply(yaml.safe_dump(config))


def _start_operator(binary: Path, paths: dict[str, Path]) -> None:
    """The training operator out of cluster, with its own ServiceAccount and ClusterRole from its module."""
    if processes.running_pid("training-operator") is not None:
        return
    manifests = _operator_module_dir() / "manifests" / "base"
    apply(f"apiVersion: v1\nkind: Namespace\nmetadata:\n  name: {OPERATOR_NAMESPACE}\n")
    kubectl("apply", "--server-side", "--force-conflicts", "-f", str(manifests / "crds" / "kubeflow.org_pytorchjobs.yaml"))
    for name in ("service-account.yaml", "role.yaml"):
        kubectl("apply", "--server-side", "--force-conflicts", "-n", OPERATOR_NAMESPACE, "-f", str(manifests / "rbac" / name))
    # The module's binding names no namespace for the ServiceAccount (its kustomization adds it).
    binding = kubectl("create", "clusterrolebinding", "training-operator", "--clusterrole=training-operator",
                      f"--serviceaccount={OPERATOR_NAMESPACE}:training-operator", "--dry-run=client", "-o", "yaml").stdout
    apply(binding)
    kubectl("wait", "--for=condition=Established", "crd/pytorchjobs.kubeflow.org", "--timeout=60s")
    _operator_webhook(manifests, paths["pki"])
    token = kubectl("-n", OPERATOR_NAMESPACE, "create", "token", "training-operator", "--duration=48h").stdout.strip()
    config = pki.write_kubeconfig(paths["kubeconfigs"] / "training-operator", paths["pki"],
                                  user="system:serviceaccount:kubeflow:training-operator", token=token)
    OPERATOR_CERT_DIR.mkdir(parents=True, exist_ok=True)
    shutil.copy(paths["pki"] / "operator-webhook.crt", OPERATOR_CERT_DIR / "tls.crt")
    shutil.copy(paths["pki"] / "operator-webhook.key", OPERATOR_CERT_DIR / "tls.key")
    # KUBEFLOW_NAMESPACE stays unset: the operator would also take it as the only namespace to watch
    # (its certificates default to namespace kubeflow).
    env = {k: v for k, v in os.environ.items() if k != "KUBEFLOW_NAMESPACE"}
    _start("training-operator", [
        str(binary), f"--kubeconfig={config}", "--enable-scheme=pytorchjob",
        f"--metrics-bind-address={HOST}:{PORTS.operator_metrics}",
        f"--health-probe-bind-address={HOST}:{PORTS.operator_health}",
        f"--webhook-server-port={PORTS.operator_webhook}",
        f"--pytorch-init-container-template-file={REPO / 'cluster' / 'operator-init-container.yaml'}",
        "--zap-log-level=info", "--zap-devel=false",
    ], env=env)
    health.wait("training-operator", lambda: health.http_ok(f"http://{HOST}:{PORTS.operator_health}/readyz"),
                timeout=90, what="/readyz")


def helm(*args: str, check: bool = True, timeout: float = 600) -> subprocess.CompletedProcess[str]:
    result = subprocess.run([tool("helm"), f"--kubeconfig={admin_kubeconfig()}", *args],
                            capture_output=True, text=True, timeout=timeout)
    if check and result.returncode != 0:
        raise RuntimeError(f"helm {' '.join(args)} failed:\n{result.stderr.strip()}")
    return result


def task_namespaces() -> list[str]:
    """The namespaces the installed chart made for Flyte's project-domains."""
    found = get_json("namespaces", "-l", "app.kubernetes.io/component=platform")
    return sorted(item["metadata"]["name"] for item in found["items"])


def install(*extra_values: str, timeout: str = "5m") -> None:
    """`helm install fuseforge charts/fuseforge` with cluster/local-values.yaml, as the README shows,
    then the object store's keys in each task namespace, then wait until Flyte is ready."""
    started = time.monotonic()
    values = ["-f", str(LOCAL_VALUES)] + [arg for v in extra_values for arg in ("-f", v)]
    helm("install", RELEASE, str(REPO / "charts" / "fuseforge"), "-n", FLYTE_NAMESPACE, *values)
    for namespace in task_namespaces():
        apply(object_store_secret(namespace))
    kubectl("-n", FLYTE_NAMESPACE, "rollout", "status", f"deployment/{RELEASE}-flyte-binary", f"--timeout={timeout}",
            timeout=600)
    write_flyte_config()
    log(f"installed {RELEASE} in {time.monotonic() - started:.0f} s; pyflyte/flytectl config: {flyte_config_path()}")


def flyte_config_path() -> Path:
    return state_dir() / "flyte" / "config.yaml"


def write_flyte_config() -> Path:
    """The pyflyte/flytectl configuration `flytectl config init --host 127.0.0.1:8089 --insecure` writes
    (Flyte's gRPC API, which the Flyte pod serves on this machine's loopback), plus the object store's
    endpoint and keys under `storage.connection` (flytekit's keys) so that FlyteRemote and `pyflyte` read
    outputs and upload local files as a user with bucket access does. Mode 0600: it holds the keys."""
    path = flyte_config_path()
    path.parent.mkdir(parents=True, exist_ok=True)
    secrets = _paths()["secrets"]
    access_key = (secrets / "s3-access-key").read_text().strip()
    secret_key = (secrets / "s3-secret-key").read_text().strip()
    path.touch(mode=0o600)
    path.chmod(0o600)
    path.write_text(
        "admin:\n"
        f"  # For gRPC endpoints you might want to use dns:///flyte.myexample.com\n"
        f"  endpoint: dns:///{HOST}:8089\n"
        "  authType: Pkce\n"
        "  insecure: true\n"
        "console:\n"
        f"  endpoint: http://{HOST}:8088\n"
        "storage:\n"
        "  connection:\n"
        f"    endpoint: http://{HOST}:{PORTS.s3}\n"
        f"    access-key: {access_key}\n"
        f"    secret-key: {secret_key}\n"
        "logger:\n"
        "  show-source: true\n"
        "  level: 0\n"
    )
    return path


def down() -> None:
    """Stop what `up` started (by pid, in reverse order) and remove the cluster's state."""
    for name in reversed(COMPONENTS):
        if processes.stop(name, grace=40 if name == "node" else 20):
            log(f"stopped {name}")
    for name in processes.names():  # anything else this cluster started
        processes.stop(name)
    for name in ("tls.crt", "tls.key"):  # what `up` wrote for the operator, now stopped
        (OPERATOR_CERT_DIR / name).unlink(missing_ok=True)
    for folder in (OPERATOR_CERT_DIR, OPERATOR_CERT_DIR.parent):
        if folder.exists() and not any(folder.iterdir()):
            folder.rmdir()
    shutil.rmtree(state_dir(), ignore_errors=True)


def status() -> dict[str, str]:
    return {name: (f"running (pid {pid})" if (pid := processes.running_pid(name)) else "stopped") for name in COMPONENTS}


# Machine packages the control plane needs: program -> Debian package.
DEBIAN_PACKAGES = {"nslookup": "bind9-dnsutils", "openssl": "openssl", "setpriv": "util-linux", "pg_isready": "postgresql"}
# What tests/cluster uses besides: a browser to look at the Decks as the console shows them.
TEST_PACKAGES = {"chromium": "chromium"}
# The training image without a Docker daemon: buildah builds and pushes it, debootstrap makes its base
# (python images/build.py, tests/deploy/test_image_buildah.py).
IMAGE_PACKAGES = {"buildah": "buildah", "debootstrap": "debootstrap"}


def missing_packages(packages: dict[str, str] = DEBIAN_PACKAGES) -> list[str]:
    missing = [pkg for program, pkg in packages.items() if shutil.which(program) is None]
    try:
        postgres.bin_dir()
    except RuntimeError:
        missing.append("postgresql")
    return sorted(set(missing))


def deps() -> None:
    """Install the Debian packages the cluster and its tests need (as root), or say which are missing."""
    missing = missing_packages({**DEBIAN_PACKAGES, **TEST_PACKAGES, **IMAGE_PACKAGES})
    for program in ("go", "npm"):
        if shutil.which(program) is None:
            raise RuntimeError(f"{program} is not installed (the cluster's programs are built with Go; helm and kubectl come from npm)")
    if not missing:
        return
    command = ["apt-get", "install", "-y", "--no-install-recommends", *missing]
    if os.geteuid() != 0:
        raise RuntimeError("missing packages: " + " ".join(missing) + "; install them with: sudo " + " ".join(command))
    log("installing " + " ".join(missing))
    if subprocess.run(command, capture_output=True).returncode != 0:
        subprocess.run(["apt-get", "update", "-q"], check=True, capture_output=True)
        subprocess.run(command, check=True, capture_output=True)


def main(argv: list[str]) -> int:
    if not argv or argv[0] not in ("up", "down", "status", "logs", "install", "build", "deps"):
        print("usage: cluster.sh deps|build|up|install|down|status|logs COMPONENT", file=sys.stderr)
        return 2
    command = argv[0]
    try:
        if command == "up":
            up()
        elif command == "deps":
            deps()
        elif command == "build":
            started = time.monotonic()
            build.build_all(None)
            tool("kubectl"), tool("helm")
            log(f"binaries ready in {time.monotonic() - started:.0f} s")
        elif command == "install":
            install(*argv[1:])
        elif command == "down":
            down()
        elif command == "status":
            for name, state in status().items():
                print(f"{name:26} {state}")
        else:
            if len(argv) < 2:
                print("usage: cluster.sh logs COMPONENT (" + ", ".join(COMPONENTS) + ")", file=sys.stderr)
                return 2
            path = log_path(argv[1])
            if not path.exists():
                print(f"no log for {argv[1]} at {path}", file=sys.stderr)
                return 1
            sys.stdout.write(path.read_text(errors="replace"))
    except (health.ComponentFailed, RuntimeError, ValueError) as exc:
        log(str(exc))
        return 1
    return 0
