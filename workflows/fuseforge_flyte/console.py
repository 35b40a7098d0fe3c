"""Console output of the platform's processes: progress lines reach the terminal or the pod log.

Flyte's task processes and torch elastic's workers configure no logging, so without this the engine's
step lines (and the data preparation's summary) would be dropped; an application that configured
logging itself keeps its own setup.
"""

from __future__ import annotations

import logging
import sys


def ensure_console_logging() -> None:
    """INFO lines of the "fuseforge" loggers on stdout, unless logging is configured already."""
    logger = logging.getLogger("fuseforge")
    if logger.level == logging.NOTSET:
        logger.setLevel(logging.INFO)
    if not logger.handlers and not logging.getLogger().handlers:
        handler = logging.StreamHandler(sys.stdout)
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
        logger.addHandler(handler)
