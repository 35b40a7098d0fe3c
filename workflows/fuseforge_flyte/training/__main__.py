"""`python -m fuseforge_flyte.training ...`: see fuseforge_flyte.training.cli."""

import sys

from fuseforge_flyte.training.cli import main

sys.exit(main())
