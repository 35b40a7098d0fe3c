"""Content fingerprints of a data source: the key under which prepared data is cached.

The Flyte data-preparation task is cached on its inputs; a file path or a bucket URI says nothing about
what the file holds, so a cheap task hashes the contents first and the cached task is keyed on that.
Local files and folders are hashed byte for byte; object-store objects by their store's own identity
(ETag/version, size, modification time) without downloading them; hub ids and preset names by name.
Model weight files are left out: only a model's tokenizer and config shape prepared data.
"""

from __future__ import annotations

import hashlib
import json
import os
from importlib import resources
from typing import Iterable

from fuseforge_flyte.data.spec import WEIGHT_FILE_SUFFIXES

_CHUNK = 1 << 20


def _hash_file(path: str, digest) -> None:
    with open(path, "rb") as handle:
        while True:
            block = handle.read(_CHUNK)
            if not block:
                break
            digest.update(block)


def _local_files(path: str) -> Iterable[str]:
    if os.path.isfile(path):
        yield path
        return
    for base, dirs, names in os.walk(path):
        dirs.sort()
        for name in sorted(names):
            # model weights shape no prepared data, and hashing a model directory's gigabytes would cost
            # more than the preparation itself
            if not name.endswith(WEIGHT_FILE_SUFFIXES):
                yield os.path.join(base, name)


def _hash_local(path: str, digest) -> None:
    root = path if os.path.isdir(path) else os.path.dirname(path)
    for file in _local_files(path):
        digest.update(os.path.relpath(file, root).encode())
        _hash_file(file, digest)


def _hash_remote(uri: str, digest) -> None:
    import fsspec

    fs, path = fsspec.core.url_to_fs(uri)
    found = fs.find(path, detail=True) if fs.isdir(path) else {path: fs.info(path)}
    for name in sorted(found):
        if name.endswith(WEIGHT_FILE_SUFFIXES):
            continue
        digest.update(json.dumps([name, object_identity(found[name])], sort_keys=True).encode())


# What a store says about an object's bytes, and what only says when it was written.
_CONTENT_KEYS = ("etag", "md5hash", "crc32c")
_WRITE_KEYS = ("version_id", "generation", "mtime", "last_modified", "updated", "lastmodified")


def object_identity(info: dict) -> dict:
    """The fields of an object's metadata that identify its contents: the size and a content hash (ETag, MD5,
    CRC32C) when the store gives one, so that the same bytes uploaded again (`pyflyte run --remote` uploads a
    local file on every run) keep their fingerprint; else the write time and version, which change with it."""
    fields = {key.lower(): str(value) for key, value in info.items()}
    chosen = [k for k in _CONTENT_KEYS if k in fields] or [k for k in _WRITE_KEYS if k in fields]
    return {key: fields[key] for key in sorted(chosen + (["size"] if "size" in fields else []))}


def _assets_root() -> str:
    return str(resources.files("fuseforge_flyte") / "data" / "assets")


def fingerprint_source(source: str, digest) -> None:
    """Feed what identifies `source`'s contents into `digest`."""
    digest.update(b"\0" + source.encode())
    if not source:
        return
    if source.startswith("builtin:"):
        _hash_local(_assets_root(), digest)  # any change to the shipped data or tokenizer
    elif "://" in source and not source.startswith("file://"):
        _hash_remote(source, digest)
    else:
        path = source[len("file://"):] if source.startswith("file://") else source
        if os.path.exists(path):
            _hash_local(path, digest)


def fingerprint(*sources: str) -> str:
    """One hex digest over the contents of every source (datasets, tokenizer, model directory)."""
    digest = hashlib.sha256()
    for source in sources:
        fingerprint_source(source, digest)
    return digest.hexdigest()
