"""`python -m fuseforge_flyte.training ...`: see fuseforge_flyte.training.cli."""

import sys

from fuseforge_flyte.training.cli import main

if __name__ == "__main__":
    sys.exit(main())
