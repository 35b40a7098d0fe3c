"""What a container registry holds, asked over the Docker Registry HTTP API v2 (no Docker needed): both image
builders ask it whether a tag is already pushed."""

from __future__ import annotations

import json
import re
import urllib.error
import urllib.parse
import urllib.request
from typing import Dict, Optional, Tuple

_MANIFEST_TYPES = (
    "application/vnd.oci.image.index.v1+json",
    "application/vnd.oci.image.manifest.v1+json",
    "application/vnd.docker.distribution.manifest.list.v2+json",
    "application/vnd.docker.distribution.manifest.v2+json",
)


def split_image_name(image_name: str) -> Tuple[str, str, str]:
    """(registry host, repository, tag) of "host[:port]/path/name:tag"; Docker Hub for a bare "user/name"."""
    rest, _, tag = image_name.rpartition(":")
    if not rest or "/" in tag:
        rest, tag = image_name, "latest"
    first, _, path = rest.partition("/")
    if path and ("." in first or ":" in first or first == "localhost"):
        return first, path, tag
    return "registry-1.docker.io", rest if "/" in rest else f"library/{rest}", tag


def _request(url: str, headers: Dict[str, str], timeout: float, method: str = "HEAD") -> Tuple[Optional[int], Dict[str, str], bytes]:
    request = urllib.request.Request(url, headers=headers, method=method)
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:  # noqa: S310 (http(s) only)
            return response.status, dict(response.headers), response.read() if method == "GET" else b""
    except urllib.error.HTTPError as exc:
        return exc.code, dict(exc.headers or {}), b""
    except (OSError, ValueError):  # unreachable, refused, timed out, TLS failure
        return None, {}, b""


def registry_has_image(image_name: str, timeout: float = 10.0) -> Optional[bool]:
    """Whether the registry has this tag (Docker Registry HTTP API v2, anonymous token if asked for one):
    True or False when the registry says so, None when it cannot tell (unreachable, needs credentials)."""
    host, repository, tag = split_image_name(image_name)
    scheme = "http" if host.split(":")[0] in ("localhost", "127.0.0.1") else "https"
    url = f"{scheme}://{host}/v2/{repository}/manifests/{tag}"
    headers = {"Accept": ", ".join(_MANIFEST_TYPES)}
    status, response_headers, _ = _request(url, headers, timeout)
    challenge = next((v for k, v in response_headers.items() if k.lower() == "www-authenticate"), "")
    if status == 401 and challenge.lower().startswith("bearer "):
        params = dict(re.findall(r'(\w+)="([^"]*)"', challenge))
        realm = params.pop("realm", "")
        if realm.startswith(("https://", "http://")):
            query = urllib.parse.urlencode({k: v for k, v in params.items() if k in ("service", "scope")})
            token_status, _, body = _request(f"{realm}?{query}", {}, timeout, method="GET")
            token = None
            if token_status == 200:
                try:
                    answer = json.loads(body)
                    token = answer.get("token") or answer.get("access_token")
                except (ValueError, AttributeError):
                    pass
            if token:
                status, _, _ = _request(url, {**headers, "Authorization": f"Bearer {token}"}, timeout)
    if status == 200:
        return True
    if status == 404:
        return False
    return None
