"""Where a dataset file goes wrong: its name and line number.

`datasets` reports a broken JSON line by its row (0-based, so "row 35" is line 36 of the file). After such a
failure the files are read once more, line by line, for the first line that is not UTF-8 or (JSON) not JSON.
Bytes that are not UTF-8 inside a JSON string load without complaint and surface later as a bare
UnicodeDecodeError naming no file; so local text files are also checked for UTF-8 after loading, in C-speed chunks.
"""

from __future__ import annotations

import codecs
import json
from typing import Iterable, Optional

CHUNK_BYTES = 16 << 20


def first_non_utf8(files: Iterable[str]) -> Optional[str]:
    """'<file>, line <n>: not UTF-8 text ...' for the first byte sequence that is not UTF-8, or None."""
    for name in files:
        decoder, offset, lines, line_start = codecs.getincrementaldecoder("utf-8")(), 0, 1, 0
        with open(name, "rb") as handle:
            while True:
                chunk = handle.read(CHUNK_BYTES)
                try:
                    decoder.decode(chunk, final=not chunk)
                except UnicodeDecodeError as err:
                    # the error's position is within what the decoder held (this chunk, plus a partial character)
                    bad = max(0, err.start - len(err.object) + len(chunk))
                    line = lines + chunk[:bad].count(b"\n")
                    newline = chunk.rfind(b"\n", 0, bad)
                    column = bad - newline if newline >= 0 else offset + bad - line_start + 1
                    return (f"{name}, line {line}: not UTF-8 text (byte 0x{err.object[err.start]:02x} at column "
                            f"{column}); save the file as UTF-8")
                if not chunk:
                    break
                if b"\n" in chunk:
                    line_start = offset + chunk.rfind(b"\n") + 1
                offset, lines = offset + len(chunk), lines + chunk.count(b"\n")
    return None


def _looks_like_json_lines(name: str, first: bytes) -> bool:
    """A .jsonl file, or a .json file that is not one JSON document (one opens with '[')."""
    return name.lower().endswith(".jsonl") or not first.lstrip().startswith(b"[")


def _json_document_problem(name: str, data: bytes) -> Optional[str]:
    try:
        json.loads(data.decode("utf-8"))
    except json.JSONDecodeError as err:
        return f"{name}, line {err.lineno}: not valid JSON ({err.msg} at column {err.colno}); fix that line"
    return None


def first_unreadable_line(files: Iterable[str], builder: str) -> Optional[str]:
    """'<file>, line <n>: <what is wrong>; <fix>' for the first line that is not UTF-8 (every text builder) or not
    JSON (the json builder), or None when every line reads."""
    import fsspec

    for name in files:
        with fsspec.open(name, "rb") as handle:
            data = handle.read()
        json_lines = builder == "json" and _looks_like_json_lines(name, data[:64])
        for number, raw in enumerate(data.splitlines(), start=1):
            try:
                text = raw.decode("utf-8")
            except UnicodeDecodeError as err:
                return (f"{name}, line {number}: not UTF-8 text (byte 0x{raw[err.start]:02x} at column "
                        f"{err.start + 1}); save the file as UTF-8")
            if json_lines and text.strip():
                try:
                    json.loads(text)
                except json.JSONDecodeError as err:
                    return (f"{name}, line {number}: not valid JSON ({err.msg} at column {err.colno}); fix or "
                            f"remove that line")
        if builder == "json" and not json_lines:
            problem = _json_document_problem(name, data)
            if problem:
                return problem
    return None
