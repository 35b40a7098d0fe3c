"""sha256 of checkpoint files: hashed once right after they are written, checked before any byte is loaded."""

from __future__ import annotations

import hashlib
import os
from concurrent.futures import ThreadPoolExecutor
from typing import Dict, List, Optional, Tuple

_CHUNK = 4 << 20


def file_digest(path: str) -> Tuple[int, str]:
    """(size, sha256 hex) of a file, streamed in 4 MiB chunks."""
    digest, size = hashlib.sha256(), 0
    buffer = bytearray(_CHUNK)
    view = memoryview(buffer)
    with open(path, "rb", buffering=0) as handle:
        while True:
            n = handle.readinto(view)
            if not n:
                break
            digest.update(view[:n])
            size += n
    return size, digest.hexdigest()


def digest_files(directory: str, names: List[str]) -> Dict[str, Dict]:
    """{name: {size, sha256}}; a few threads (hashlib and reads release the GIL)."""
    if not names:
        return {}
    with ThreadPoolExecutor(max_workers=min(4, len(names))) as pool:
        results = pool.map(lambda rel: file_digest(os.path.join(directory, rel)), names)
        return {rel: {"size": size, "sha256": sha} for rel, (size, sha) in zip(names, results)}


def check_file(path: str, rel: str, expected: Dict) -> Optional[str]:
    """Why the file at `path` does not match its manifest entry, or None."""
    try:
        size = os.path.getsize(path)
        if size == expected["size"]:
            size, sha = file_digest(path)
    except FileNotFoundError:
        return f"file {rel} is missing"
    except OSError as err:
        return f"file {rel} is unreadable ({err})"
    if size != expected["size"]:
        return f"file {rel} is {size} bytes, the manifest recorded {expected['size']} (truncated?)"
    if sha != expected["sha256"]:
        return (f"file {rel} changed since it was written (sha256 {sha[:16]}..., the manifest recorded "
                f"{expected['sha256'][:16]}...)")
    return None


def check_bytes(rel: str, data: bytes, expected: Dict) -> Optional[str]:
    """Why `data` (file `rel`, read whole) does not match its manifest entry, or None."""
    if len(data) != expected["size"]:
        return f"file {rel} is {len(data)} bytes, the manifest recorded {expected['size']} (truncated?)"
    sha = hashlib.sha256(data).hexdigest()
    if sha != expected["sha256"]:
        return f"file {rel} changed since it was written (sha256 {sha[:16]}..., the manifest recorded " \
               f"{expected['sha256'][:16]}...)"
    return None
