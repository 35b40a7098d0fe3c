#!/usr/bin/env bash
# The main job through the local control plane (README, "Run the platform on this machine"): the cluster up,
# the chart installed, `pyflyte run --remote` of the demo (its tasks as pods, the trained model in the object
# store), followed until it ends, then the model fetched and asked a question by plain transformers.
# Extra arguments are passed to the workflow, e.g. `bash scripts/cluster_demo.sh --steps 30`. The cluster
# stays up afterwards (`bash scripts/cluster.sh down` stops it).
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/_prelude.sh"
export PATH="$VENV/bin:$PATH"
bash "$ROOT/scripts/cluster.sh" up
STATE="${FUSEFORGE_CLUSTER_DIR:-/var/tmp/fuseforge-cluster-$(id -u)}"
export KUBECONFIG="$STATE/kubeconfig"
KUBECTL="$(bash "$ROOT/scripts/get_helm.sh" kubectl)"
HELM="$(bash "$ROOT/scripts/get_helm.sh")"
"$HELM" status fuseforge -n flyte > /dev/null 2>&1 || bash "$ROOT/scripts/cluster.sh" install
# The platform.toml the chart rendered for this cluster (image, GPUs, resources), as the README says.
"$KUBECTL" -n fuseforge-development get configmap fuseforge-platform -o jsonpath='{.data.platform\.toml}' \
    > "$STATE/cluster.toml"
# The image is this machine's environment here; FUSEFORGE_IMAGE_CHECK=off trusts the tag "local" as pushed.
FUSEFORGE_CONFIG="$STATE/cluster.toml" FUSEFORGE__IMAGE__TAG=local FUSEFORGE_IMAGE_CHECK=off \
    pyflyte --config "$STATE/flyte/config.yaml" run --remote --wait --project fuseforge --domain development \
    workflows/demo.py demo "$@" | tee "$STATE/demo-run.log"
EXECUTION="$(grep -o '/executions/[a-z0-9]*' "$STATE/demo-run.log" | head -1 | cut -d/ -f3)"
exec python "$ROOT/scripts/fetch_model.py" --config "$STATE/flyte/config.yaml" "$EXECUTION"
