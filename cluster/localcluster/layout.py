"""Where the local cluster keeps its binaries, state and logs, and which loopback ports it uses."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
MODULES = REPO / "cluster"

NODE_NAME = "fuseforge-node"
CLUSTER_DOMAIN = "cluster.local"
SERVICE_CIDR = "10.96.0.0/16"
# Every listener binds to loopback; the cluster DNS takes its own loopback address (port 53 is fixed
# by resolv.conf).
HOST = "127.0.0.1"
DNS_ADDRESS = "127.0.0.10:53"


@dataclass(frozen=True)
class Ports:
    etcd_client: int = 12379
    etcd_peer: int = 12380
    apiserver: int = 16443
    scheduler: int = 10259
    controller_manager: int = 10257
    kubelet: int = 10250
    postgres: int = 15432
    s3: int = 19000
    registry: int = 15000
    operator_metrics: int = 18085
    operator_health: int = 18086
    operator_webhook: int = 19443
    # Kueue, JobSet and Kubeflow Trainer v2 (issue 48): metrics, health probes and webhooks on loopback.
    kueue_metrics: int = 18087
    kueue_health: int = 18088
    kueue_webhook: int = 19444
    jobset_metrics: int = 18089
    jobset_health: int = 18090
    jobset_webhook: int = 19445
    trainer_metrics: int = 18091
    trainer_health: int = 18092
    trainer_webhook: int = 19446


PORTS = Ports()


def cache_dir() -> Path:
    """Built binaries and module downloads outlive the cluster: ~/.cache/fuseforge (or $FUSEFORGE_CACHE)."""
    base = os.environ.get("FUSEFORGE_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "fuseforge"
    )
    return Path(base)


# Where cluster state lives by default (and the tests' clusters): a folder every user can enter.
STATE_PARENT = "/var/tmp"


def state_dir() -> Path:
    """Everything of one running cluster (data, certificates, logs, pids); removed by `down`.

    Outside the checkout (pyflyte packages the checkout for registration) and outside root's home:
    PostgreSQL and pods run as other users and must reach it. Outside /tmp too: pods with a read-only
    root mount an emptyDir there (the chart's Flyte pod), which would hide the programs under it."""
    folder = Path(os.environ.get("FUSEFORGE_CLUSTER_DIR") or f"{STATE_PARENT}/fuseforge-cluster-{os.getuid()}")
    if folder.resolve().is_relative_to("/tmp"):
        raise ValueError(f"FUSEFORGE_CLUSTER_DIR={folder}: the cluster's state must be outside /tmp (pods mount "
                         f"their own /tmp over it); use a folder under {STATE_PARENT}")
    return folder


def log_path(component: str) -> Path:
    return state_dir() / "logs" / f"{component}.log"
