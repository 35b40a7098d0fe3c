#!/usr/bin/env bash
# Run the test suite, the docs site's strict build included (tests/test_docs.py). Without a GPU the kernels run
# through Triton's CPU interpreter.
# tests/cluster runs against the local control plane (scripts/cluster.sh): its Go programs are built
# first (once per version, cached), and its tests share one pytest-xdist worker (--dist loadgroup).
# FUSEFORGE_SKIP_CLUSTER=1 leaves the control plane out (the unit suite alone).
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/_prelude.sh"
if [ "${FUSEFORGE_SKIP_CLUSTER:-0}" != 1 ]; then
    bash "$ROOT/scripts/cluster.sh" deps     # Debian's packages the control plane needs, installed if missing (root)
    bash "$ROOT/scripts/cluster.sh" build
fi
exec "$VENV/bin/python" -m pytest -n "${FUSEFORGE_TEST_WORKERS:-2}" --dist loadgroup "$@" tests
