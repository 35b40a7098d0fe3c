"""Test setup: run kernels through Triton's CPU interpreter when no GPU is present.

TRITON_INTERPRET must be set before any @triton.jit decorator runs, so it is
decided here, at conftest import time, before fuseforge is imported. So is
XDG_CONFIG_HOME, where training makes its per-user checkpoint key.
"""

import os
import random
import tempfile

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
# Training without a configured checkpoint key makes a per-user key under $XDG_CONFIG_HOME/fuseforge: keep the
# tests' key out of the real home directory (one per test process; spawned workers inherit it).
os.environ["XDG_CONFIG_HOME"] = tempfile.mkdtemp(prefix="fuseforge-tests-config-")
# flytekit's local task cache (~/.flyte/local-cache) outlives the test session, but the outputs its entries point
# at live in the tests' temporary folders, which pytest removes: a later session would hit entries whose folder
# is gone. One cache per test process instead. (A GPU machine with the kernel library alone has no flytekit: its
# kernel and Hugging Face tests still run.)
try:
    import flytekit.core.local_cache  # noqa: E402
except ImportError:
    pass
else:
    flytekit.core.local_cache.CACHE_LOCATION = tempfile.mkdtemp(prefix="fuseforge-tests-flyte-cache-")

import pytest  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.fixture
def device() -> str:
    return DEVICE


@pytest.fixture(autouse=True)
def _seed(request):
    """Fresh random inputs per test, reproducible from the logged seed (FUSEFORGE_SEED pins it)."""
    seed = int(os.environ.get("FUSEFORGE_SEED", random.randrange(2**31)))
    torch.manual_seed(seed)
    random.seed(seed)
    request.node.user_properties.append(("seed", seed))
    print(f"[seed={seed}] rerun with FUSEFORGE_SEED={seed}")
    yield seed


@pytest.fixture(autouse=True)
def _isolated_environment():
    """Each test starts from the same os.environ: a variable left by one test (LOCAL_RANK, say)
    must not change how a later test in the same worker process behaves."""
    saved = dict(os.environ)
    yield
    if os.environ != saved:
        os.environ.clear()
        os.environ.update(saved)


@pytest.fixture(autouse=True)
def _no_deferred_target_errors_leak():
    """A bad class index found on the GPU after a test ended must not fail the next test's loss call."""
    yield
    from fuseforge.ops import targets

    try:
        targets.raise_pending_target_errors(wait=True)
    except ValueError:
        pass


@pytest.fixture
def sync_target_check(monkeypatch):
    """Bad class indices raise in the loss call itself, on the GPU too (TARGET_CHECK="sync")."""
    from fuseforge.ops import targets

    monkeypatch.setattr(targets, "TARGET_CHECK", "sync")


@pytest.fixture(scope="module")
def one_torch_thread():
    """Training tests on 2 cores with 2 workers: one thread each; forked workers must not inherit an OpenMP pool."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def deepspeed_on_cpu():
    """DeepSpeed without its JIT-built shared-memory op (inference all-reduce only; gloo does ours):
    its CPU backend would compile it for a minute on first use (FUSEFORGE_TEST_DS_SHM=1 keeps it)."""
    import importlib

    deepspeed = pytest.importorskip("deepspeed", reason="DeepSpeed not installed (optional extra)")
    comm_torch = importlib.import_module("deepspeed.comm.torch")
    original = comm_torch.build_shm_op
    if os.environ.get("FUSEFORGE_TEST_DS_SHM") != "1":
        comm_torch.build_shm_op = lambda: None
    yield deepspeed
    comm_torch.build_shm_op = original


def pytest_report_header(config):
    interp = os.environ.get("TRITON_INTERPRET", "0") == "1"
    return f"fuseforge tests on {DEVICE} (Triton interpreter: {interp})"


def pytest_collection_modifyitems(config, items):
    """Tests marked `compiles` run after all others, in each test process.

    torch.compile (PyPI's torch build) leaves the process unable to fork workers that run autograd
    (tests/support/forking.py). Tests that patch the parent and fork workers to inherit the patch need fork:
    putting the compiling tests last keeps fork usable for them whatever xdist hands each worker first.
    """
    items.sort(key=lambda item: item.get_closest_marker("compiles") is not None)  # stable: order kept otherwise
