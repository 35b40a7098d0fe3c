"""A package index on loopback for image builds that must not reach PyPI.

Its wheels are made here: an installed pure-Python distribution of this environment packed back into a
wheel (fuseforge's build backend, setuptools, for `uv pip install /root/fuseforge-src` in the image),
and small wheels written from a few files. The index is a directory `<name>/<wheel>` served by
http.server: its listings are the PEP 503 pages uv reads.
"""

from __future__ import annotations

import base64
import contextlib
import functools
import hashlib
import http.server
import importlib.metadata
import threading
import zipfile
from pathlib import Path
from typing import Dict, Iterator


def _record_hash(data: bytes) -> str:
    return "sha256=" + base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()


def write_wheel(folder: Path, name: str, version: str, files: Dict[str, bytes], metadata: str = "") -> Path:
    """A py3-none-any wheel holding `files` (paths inside site-packages), with its dist-info and RECORD."""
    dist = f"{name.replace('-', '_')}-{version}"
    info = f"{dist}.dist-info"
    contents = dict(files)
    contents[f"{info}/METADATA"] = (metadata or f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n").encode()
    contents[f"{info}/WHEEL"] = b"Wheel-Version: 1.0\nGenerator: fuseforge-tests\nRoot-Is-Purelib: true\nTag: py3-none-any\n"
    record = "".join(f"{path},{_record_hash(data)},{len(data)}\n" for path, data in sorted(contents.items()))
    contents[f"{info}/RECORD"] = (record + f"{info}/RECORD,,\n").encode()
    target = folder / name.lower().replace("_", "-") / f"{dist}-py3-none-any.whl"
    target.parent.mkdir(parents=True, exist_ok=True)
    with zipfile.ZipFile(target, "w", zipfile.ZIP_DEFLATED) as archive:
        for path, data in sorted(contents.items()):
            archive.writestr(path, data)
    return target


def wheel_from_installed(folder: Path, name: str) -> Path:
    """Pack an installed pure-Python distribution of this environment back into a wheel."""
    dist = importlib.metadata.distribution(name)
    files = {}
    for path in dist.files or []:
        if path.suffix == ".pyc" or "__pycache__" in path.parts or path.parts[0] == ".." or path.name in ("RECORD", "INSTALLER", "REQUESTED"):
            continue
        if path.name == "direct_url.json" or path.name == "WHEEL" or path.name == "METADATA":
            continue
        files[str(path)] = Path(dist.locate_file(path)).read_bytes()
    return write_wheel(folder, dist.metadata["Name"], dist.version, files, metadata=dist.read_text("METADATA") or "")


class _Quiet(http.server.SimpleHTTPRequestHandler):
    def log_message(self, *args):
        pass


@contextlib.contextmanager
def serve_index(folder: Path) -> Iterator[str]:
    """Serve `folder` on a free loopback port; yields the index URL."""
    handler = functools.partial(_Quiet, directory=str(folder))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}/"
    finally:
        server.shutdown()
        server.server_close()
