"""One local control plane for every test in tests/cluster (scripts/cluster.sh up ... down).

All these tests run in one pytest-xdist group (`--dist loadgroup`), so one worker starts the cluster
once; the other worker runs the rest of the suite meanwhile. The cluster's component logs are printed
when a test here fails.
"""

from __future__ import annotations

import os
import sys
import tempfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "cluster"))

from localcluster import cluster as local  # noqa: E402
from localcluster import health  # noqa: E402
from localcluster.kubectl import kubectl  # noqa: E402
from localcluster.layout import STATE_PARENT, state_dir  # noqa: E402


# FUSEFORGE_TEST_CLUSTER=running: use the cluster `scripts/cluster.sh up` (and `install`) started, and leave it
# running (for working on these tests; the tests that check `down` and uninstall are skipped).
RUNNING = os.environ.get("FUSEFORGE_TEST_CLUSTER") == "running"


@pytest.fixture(scope="session")
def control_plane():
    """A running cluster in a fresh state dir; stopped and removed at the end of the session."""
    if os.environ.get("FUSEFORGE_SKIP_CLUSTER") == "1":
        pytest.skip("FUSEFORGE_SKIP_CLUSTER=1")
    if RUNNING:
        local.up()  # starts only what is not running
        yield local
        return
    # Not under pytest's tmp dir (mode 0700): PostgreSQL and pods run as other users and must reach it.
    folder = Path(tempfile.mkdtemp(prefix="fuseforge-cluster-", dir=STATE_PARENT))
    folder.chmod(0o755)
    os.environ["FUSEFORGE_CLUSTER_DIR"] = str(folder)
    try:
        local.up()
    except Exception:
        _print_logs()
        local.down()
        raise
    yield local
    local.down()
    # `down` leaves no processes, ports or files behind.
    from localcluster.layout import HOST, PORTS

    listening = [f for f in PORTS.__dataclass_fields__ if health.port_in_use(HOST, getattr(PORTS, f))]
    assert not listening, f"still listening after down: {listening}"
    assert not folder.exists(), f"{folder} left after down"
    assert not local.OPERATOR_CERT_DIR.exists(), f"{local.OPERATOR_CERT_DIR} left after down"


@pytest.fixture(scope="session")
def platform(control_plane):
    """The chart installed as the README says (helm install with cluster/local-values.yaml), Flyte ready."""
    if RUNNING:
        yield control_plane
        return
    try:
        control_plane.install()
    except Exception:
        _print_logs()
        raise
    yield control_plane


@pytest.fixture
def k(control_plane):
    return kubectl


def _print_logs(lines: int = 60) -> None:
    folder = state_dir() / "logs"
    if not folder.is_dir():
        return
    for path in sorted(folder.glob("*.log")):
        if path.name.endswith("-audit.log"):
            continue
        print(f"\n----- {path.name} (last {lines} lines) -----")
        print(health.log_tail(path.stem, lines))


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    if report.failed and "control_plane" in getattr(item, "fixturenames", ()):
        _print_logs()
