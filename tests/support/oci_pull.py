"""Pull an image back from a registry with plain HTTP and unpack it, to look inside it without a runtime.

Nothing here runs containers, so a test proves what an image holds by fetching its manifest, config and
layers (OCI distribution API, each blob checked against its digest), applying the layers in order with
their whiteouts into a directory, and running a program there with chroot.
"""

from __future__ import annotations

import hashlib
import io
import json
import shutil
import tarfile
import urllib.request
from pathlib import Path
from typing import Dict, Tuple

MANIFEST_TYPES = (
    "application/vnd.oci.image.manifest.v1+json",
    "application/vnd.docker.distribution.manifest.v2+json",
)
INDEX_TYPES = ("application/vnd.oci.image.index.v1+json", "application/vnd.docker.distribution.manifest.list.v2+json")


def _get(url: str, accept: Tuple[str, ...] = ()) -> Tuple[bytes, str]:
    request = urllib.request.Request(url, headers={"Accept": ", ".join(accept)} if accept else {})
    with urllib.request.urlopen(request, timeout=60) as response:  # noqa: S310 (a loopback registry)
        return response.read(), response.headers.get("Content-Type", "")


def _blob(base: str, digest: str) -> bytes:
    data, _ = _get(f"{base}/blobs/{digest}")
    algorithm, _, expected = digest.partition(":")
    assert algorithm == "sha256" and hashlib.sha256(data).hexdigest() == expected, f"blob {digest} does not match its digest"
    return data


def pull(registry: str, repository: str, reference: str) -> Tuple[dict, dict, Dict[str, bytes]]:
    """(manifest, config, layer blobs by digest) of an image on an http registry, for linux/amd64."""
    base = f"http://{registry}/v2/{repository}"
    body, media_type = _get(f"{base}/manifests/{reference}", MANIFEST_TYPES + INDEX_TYPES)
    manifest = json.loads(body)
    if manifest.get("mediaType", media_type) in INDEX_TYPES:
        (entry,) = [m for m in manifest["manifests"] if m.get("platform", {}).get("architecture") == "amd64"]
        body, _ = _get(f"{base}/manifests/{entry['digest']}", MANIFEST_TYPES)
        manifest = json.loads(body)
    config = json.loads(_blob(base, manifest["config"]["digest"]))
    layers = {layer["digest"]: _blob(base, layer["digest"]) for layer in manifest["layers"]}
    return manifest, config, layers


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    elif path.exists() or path.is_symlink():
        path.unlink()


def unpack(manifest: dict, layers: Dict[str, bytes], rootfs: Path) -> None:
    """Apply the layers in order into rootfs (as root: owners kept), honouring whiteouts."""
    rootfs.mkdir(parents=True, exist_ok=True)
    for layer in manifest["layers"]:
        with tarfile.open(fileobj=io.BytesIO(layers[layer["digest"]]), mode="r:*") as archive:
            members = []
            for member in archive.getmembers():
                path = Path(member.name.removeprefix("./").lstrip("/") or ".")
                if path.name == ".wh..wh..opq":  # opaque directory: the lower layers' entries are gone
                    for child in (rootfs / path.parent).glob("*"):
                        _remove(child)
                elif path.name.startswith(".wh."):
                    _remove(rootfs / path.parent / path.name[len(".wh."):])
                else:
                    members.append(member)
            # "tar" filter: nothing written outside rootfs, also through a symlink a layer made.
            archive.extractall(rootfs, members=members, numeric_owner=True, filter="tar")
