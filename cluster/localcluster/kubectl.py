"""kubectl against the local cluster (the pinned binary that scripts/get_helm.sh fetches)."""

from __future__ import annotations

import json
import subprocess
from functools import lru_cache
from pathlib import Path

from .layout import REPO, state_dir


@lru_cache(maxsize=None)
def tool(name: str) -> str:
    """Path of the pinned helm or kubectl binary."""
    result = subprocess.run(["bash", str(REPO / "scripts" / "get_helm.sh"), name], capture_output=True, text=True)
    if result.returncode != 0:
        raise RuntimeError(f"cannot get {name}: {result.stderr.strip()}")
    return result.stdout.strip()


def admin_kubeconfig() -> Path:
    return state_dir() / "kubeconfig"


def kubectl(*args: str, input: str | None = None, kubeconfig: Path | None = None, check: bool = True,
            timeout: float = 120) -> subprocess.CompletedProcess[str]:
    argv = [tool("kubectl"), f"--kubeconfig={kubeconfig or admin_kubeconfig()}", *args]
    result = subprocess.run(argv, input=input, capture_output=True, text=True, timeout=timeout)
    if check and result.returncode != 0:
        raise RuntimeError(f"kubectl {' '.join(args)} failed:\n{result.stderr.strip()}")
    return result


def get_json(*args: str, kubeconfig: Path | None = None) -> dict:
    return json.loads(kubectl("get", *args, "-o", "json", kubeconfig=kubeconfig).stdout)


def apply(manifest: str) -> None:
    kubectl("apply", "--server-side", "--force-conflicts", "-f", "-", input=manifest)
