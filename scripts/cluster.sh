#!/usr/bin/env bash
# The local control plane: `up`, `down`, `status`, `logs COMPONENT` (see cluster/localcluster).
# Builds its Go programs on first use (cached per version under ~/.cache/fuseforge/cluster), then starts
# etcd, kube-apiserver, kube-controller-manager, kube-scheduler, PostgreSQL, an S3 store, a registry,
# the node that runs pods as processes, the Kubeflow training operator (v1), JobSet, Kubeflow Trainer v2
# and Kueue, all on loopback.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
if [ "${1:-}" = "up" ]; then
    # Pods run in the project's virtualenv (the node's "image"); make sure it exists.
    VENV="$(bash "$ROOT/scripts/setup_env.sh")"
else
    VENV="${FUSEFORGE_VENV:-$ROOT/.venv}"
fi
PY="$VENV/bin/python"
[ -x "$PY" ] || PY=python3
export FUSEFORGE_VENV="$VENV"
cd "$ROOT"
PYTHONPATH="$ROOT/cluster${PYTHONPATH:+:$PYTHONPATH}" exec "$PY" -m localcluster "$@"
