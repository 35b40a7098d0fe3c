"""Preference data (DPO's): any source the data path reads, checked and saved as a `datasets` directory.

A preference example is TRL's: `chosen` and `rejected` (strings, or lists of chat messages), with an
optional `prompt` (without one TRL takes the conversations' shared beginning as the prompt). Rows are
checked here, on the CPU data pod, so a wrong column or a mixed row fails before any GPU is held; the
chat template is applied later by TRL's own tokenization in the reference task.
"""

from __future__ import annotations

import json
import os
from typing import Any, Dict, List, Optional

from fuseforge_flyte.data.sources import load_source

PREFERENCE_COLUMNS = ("prompt", "chosen", "rejected")
REQUIRED_COLUMNS = ("chosen", "rejected")
SPLITS_FILE = "splits.json"  # what was prepared: rows per split, the source, the options


def _kind(value: Any) -> Optional[str]:
    """'text', 'messages' or None (neither)."""
    if isinstance(value, str):
        return "text"
    if isinstance(value, list) and value and all(isinstance(m, dict) and "role" in m and "content" in m
                                                 for m in value):
        return "messages"
    return None


def check_preference_columns(columns: List[str], source: str) -> None:
    missing = [c for c in REQUIRED_COLUMNS if c not in columns]
    if missing:
        raise ValueError(f"dataset {source!r} has no column {missing[0]!r} needed for preference data; its columns "
                         f"are {list(columns)} (expected: chosen, rejected and optionally prompt; each a string "
                         "or a list of {role, content} messages)")


def check_preference_row(row: Dict[str, Any], index: int, source: str) -> str:
    """The row's kind ('text' or 'messages'); ValueError naming the row and column when it is malformed."""
    kinds = {}
    for column in PREFERENCE_COLUMNS:
        if column not in row or (column == "prompt" and row[column] is None):
            continue
        kind = _kind(row[column])
        if kind is None:
            raise ValueError(f"dataset {source!r}, row {index}, column {column!r}: expected a non-empty string or a "
                             f"list of {{role, content}} messages, got {json.dumps(row[column])[:120]}")
        kinds[column] = kind
    if len(set(kinds.values())) > 1:
        raise ValueError(f"dataset {source!r}, row {index}: columns mix strings and message lists ({kinds}); "
                         "use one kind per row")
    if row["chosen"] == row["rejected"]:
        raise ValueError(f"dataset {source!r}, row {index}: chosen and rejected are identical, so the pair "
                         "carries no preference")
    return next(iter(kinds.values()))


def prepare_preferences(source: str, out_dir: str, *, config: str = "", split: str = "train",
                        eval_fraction: float = 0.0, seed: int = 0) -> Dict[str, int]:
    """Read `source`, check every row, keep the preference columns, hold out `eval_fraction`, save to `out_dir`
    (a `datasets.DatasetDict` with "train" and, when held out, "eval"); rows per split."""
    import datasets


    if not 0.0 <= eval_fraction < 1.0:
        raise ValueError(f"eval_fraction must be in [0, 1), got {eval_fraction!r}")
    dataset = load_source(source, config=config, split=split)
    check_preference_columns(dataset.column_names, source)
    kinds = {check_preference_row(row, i, source) for i, row in enumerate(dataset)}
    if len(kinds) > 1:
        raise ValueError(f"dataset {source!r} mixes string rows and message-list rows; use one kind")
    dataset = dataset.select_columns([c for c in PREFERENCE_COLUMNS if c in dataset.column_names])
    splits = {"train": dataset}
    if eval_fraction > 0:
        held = dataset.train_test_split(test_size=eval_fraction, seed=seed)
        if len(held["test"]) == 0 or len(held["train"]) == 0:
            raise ValueError(f"eval_fraction={eval_fraction} of {len(dataset)} rows leaves an empty split")
        splits = {"train": held["train"], "eval": held["test"]}
    datasets.DatasetDict(splits).save_to_disk(out_dir)
    counts = {name: len(part) for name, part in splits.items()}
    with open(os.path.join(out_dir, SPLITS_FILE), "w", encoding="utf-8") as handle:
        json.dump({"source": source, "rows": counts, "kind": kinds.pop()}, handle)
    return counts


def load_prepared(path: str):
    """The DatasetDict a preparation (or the reference task) saved."""
    import datasets

    if not os.path.isdir(path):
        raise FileNotFoundError(f"prepared preference data not found: {path!r}")
    return datasets.load_from_disk(path)
