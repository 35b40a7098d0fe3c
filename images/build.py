#!/usr/bin/env python
"""Build (and push) the fuseforge training image from platform.toml's [image] table.

    python images/build.py               # docker build + push to [image].registry
    python images/build.py --no-push     # local build only
    python images/build.py --render DIR  # write the Dockerfile and context to DIR (no Docker needed)

Same as `python -m fuseforge_flyte.cli build-image ...`; needs fuseforge installed with the [platform] extra.
"""

import sys

from fuseforge_flyte.cli import main

if __name__ == "__main__":
    sys.exit(main(["build-image", *sys.argv[1:]]))
