"""Fill a file-based Go module proxy with modules whose .zip the upstream proxy serves but whose .mod it refuses.

The Go module proxy these machines reach serves some module versions only in part: for
github.com/flyteorg/flyte/flyteadmin v1.13.0 it answers .info and .zip but refuses .mod. The go command
needs all three, so this writes them into a file:// proxy (GOPROXY=file://DIR,https://proxy.golang.org):
the .zip and .info as served, and the .mod taken from the go.mod inside that same zip. The go command then
checks both against the checksum database (sum.golang.org) as for any download, and go.sum pins them, so a
changed byte fails the build.

Usage: python3 cluster/goproxy.py DIR MODULE@VERSION ...
"""

from __future__ import annotations

import io
import sys
import urllib.request
import zipfile
from pathlib import Path

UPSTREAM = "https://proxy.golang.org"


def escape(path: str) -> str:
    """Module paths are case-encoded on the proxy: an upper-case letter becomes '!' and its lower case."""
    return "".join("!" + c.lower() if c.isupper() else c for c in path)


def fetch(url: str) -> bytes:
    with urllib.request.urlopen(url, timeout=120) as response:
        return response.read()


def add(root: Path, module: str, version: str) -> None:
    """Write MODULE@VERSION's .info, .mod and .zip under ROOT, unless they are there already."""
    folder = root / escape(module) / "@v"
    files = [folder / f"{escape(version)}.{ext}" for ext in ("info", "mod", "zip")]
    if all(f.exists() for f in files):
        return
    base = f"{UPSTREAM}/{escape(module)}/@v/{escape(version)}"
    info, archive = fetch(base + ".info"), fetch(base + ".zip")
    with zipfile.ZipFile(io.BytesIO(archive)) as z:
        gomod = z.read(f"{module}@{version}/go.mod")
    folder.mkdir(parents=True, exist_ok=True)
    for f, data in zip(files, (info, gomod, archive)):
        tmp = f.with_suffix(f.suffix + ".tmp")
        tmp.write_bytes(data)
        tmp.replace(f)
    listing = folder / "list"
    versions = set(listing.read_text().split()) if listing.exists() else set()
    listing.write_text("\n".join(sorted(versions | {version})) + "\n")


def main(argv: list[str]) -> int:
    if len(argv) < 2:
        print(__doc__.strip().splitlines()[-1], file=sys.stderr)
        return 2
    root = Path(argv[0])
    for spec in argv[1:]:
        module, _, version = spec.partition("@")
        try:
            add(root, module, version)
        except Exception as exc:  # one line naming the module: the build cannot go on without it
            print(f"goproxy: cannot fetch {spec} from {UPSTREAM}: {exc}", file=sys.stderr)
            return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
