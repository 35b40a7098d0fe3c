"""A run's output folder: the trained model (`model/`, a Hugging Face directory), `metrics.json` and
`settings.json` (the run's resolved settings); a local directory or an fsspec URI.

The engine writes it; the Flyte layer (run_outputs.py, launch.py) picks where it is and returns its model.
Left empty, a local run's folder is `./outputs/<model>-<UTC time>`.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import time
from typing import Any

OUTPUTS_ROOT = "outputs"
MODEL_SUBDIR = "model"
METRICS_FILE = "metrics.json"
SETTINGS_FILE = "settings.json"


def default_run_name(model: str) -> str:
    """<last part of the model name>-<UTC time>: readable and distinct per run (also the tracker's run name)."""
    tail = re.sub(r"[^\w.-]+", "-", model.rstrip("/").rsplit("/", 1)[-1]).strip("-") or "run"
    return f"{tail}-{time.strftime('%Y%m%d-%H%M%S', time.gmtime())}"


def new_output_dir(output_dir: str, model: str) -> str:
    """The absolute directory a local run writes to: `output_dir`, or a new ./outputs/<model>-<UTC time>."""
    if output_dir:
        return os.path.abspath(os.path.expanduser(output_dir))
    base = os.path.abspath(os.path.join(OUTPUTS_ROOT, default_run_name(model)))
    os.makedirs(os.path.dirname(base), exist_ok=True)
    for attempt in range(1, 1000):  # two runs started in the same second (compare) get their own directory
        candidate = base if attempt == 1 else f"{base}-{attempt}"
        try:
            os.mkdir(candidate)
            return candidate
        except FileExistsError:
            continue
    raise FileExistsError(f"output_dir: {base}-* are all taken; name one with output_dir")


def model_dir(output_dir: str) -> str:
    return f"{output_dir.rstrip('/')}/{MODEL_SUBDIR}"


def write_run_record(output_dir: str, metrics: Any, settings: Any) -> None:
    """metrics.json and settings.json (both dataclasses) beside the model: what ran and what it measured.
    `output_dir` is a local directory or an fsspec URI."""
    import fsspec

    for name, value in ((METRICS_FILE, metrics), (SETTINGS_FILE, settings)):
        with fsspec.open(f"{output_dir.rstrip('/')}/{name}", "w", encoding="utf-8", auto_mkdir=True) as handle:
            json.dump(dataclasses.asdict(value), handle, indent=2, default=str)
            handle.write("\n")
