#!/usr/bin/env python
"""Build (and push) the fuseforge training image from platform.toml's [image] table.

    python images/build.py               # docker build + push to [image].registry
    python images/build.py --no-push     # local build only
    python images/build.py --render DIR  # write the Dockerfile and context to DIR (no Docker needed)

The image installs the hash lock images/requirements.txt (sha256-checked, from PyPI alone), then torch by name
from [image].torch_index_url alone, then this checkout; a lock that no longer covers [image] stops the build
(renew it with `python images/lock.py`). See fuseforge_flyte/image/spec.py.

Same as `python -m fuseforge_flyte.cli build-image ...`; needs fuseforge installed with the [platform] extra.
"""

import sys

from fuseforge_flyte.cli import main

if __name__ == "__main__":
    sys.exit(main(["build-image", *sys.argv[1:]]))
