"""What to prepare: `DataSpec`, the one input of `prepare`, and its cheap up-front checks.

`validate` touches nothing but `os.path.exists`, so the Flyte workflow and the engine can reject
a bad spec before a pod is scheduled or a tokenizer is downloaded.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass

from fuseforge_flyte.data.builtin import BUILTIN_DATASETS, BUILTIN_TOKENIZER
from fuseforge_flyte.model_names import is_uri, local_path

FORMATS = ("text", "messages", "prompt_completion")
DATA_FORMATS = ("auto",) + FORMATS
# file extension -> Hugging Face `datasets` builder
BUILDERS = {".json": "json", ".jsonl": "json", ".parquet": "parquet", ".csv": "csv", ".txt": "text"}
# names ending like these are files, never hub ids (so a missing one is "not found", not a hub lookup)
_OTHER_FILE_EXTENSIONS = {".tsv", ".xml", ".arrow", ".gz", ".zip", ".tar", ".bz2", ".xz", ".zst", ".xlsx", ".md",
                          ".yaml", ".yml", ".html", ".pickle", ".pkl", ".npy", ".pt"}
_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*(/[A-Za-z0-9][\w.-]*)?$")


# Files that hold model weights (PyTorch, safetensors, GGUF, TF/Flax, ONNX): never part of a tokenizer, and
# nothing prepared data depends on.
WEIGHT_FILE_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf", ".ckpt", ".h5", ".msgpack", ".onnx")


def looks_like_hub_id(source: str) -> bool:
    """'org/name' or 'name' (dots allowed, as in 'org/Model-2.5'), not an existing path, URI or data file name."""
    if is_uri(source) or os.path.exists(source) or not _HUB_ID.match(source):
        return False
    return os.path.splitext(source)[1].lower() not in set(BUILDERS) | _OTHER_FILE_EXTENSIONS


def check_source(source: str, field: str) -> None:
    """Cheap checks of a dataset source: known builtin, existing local path, supported extension."""
    if not source:
        raise ValueError(f"DataSpec.{field} is empty: name a dataset ('builtin:chat', a hub id, a file or folder)")
    if source.startswith("builtin:"):
        if source not in BUILTIN_DATASETS:
            raise ValueError(f"DataSpec.{field}: unknown builtin dataset {source!r}; "
                             f"known: {sorted(BUILTIN_DATASETS)}")
        return
    if looks_like_hub_id(source):
        return
    ext = os.path.splitext(source.rstrip("/"))[1].lower()
    if ext and ext not in BUILDERS:
        raise ValueError(f"DataSpec.{field}: unsupported file extension {ext!r} in {source!r}; "
                         f"supported: {', '.join(sorted(BUILDERS))}")
    path = local_path(source)
    if path and not os.path.exists(path):
        raise FileNotFoundError(f"DataSpec.{field}: dataset file or folder not found: {source!r}")


@dataclass
class DataSpec:
    """A dataset, the tokenizer and model it is prepared for, and how (format, packing, eval split).

    dataset / eval_dataset: "builtin:chat", "builtin:text", an HF hub id ("org/name"), or a local or
    fsspec path (file://, s3://, gs://...) to a .json/.jsonl/.parquet/.csv/.txt file or a folder of
    files of one of those kinds. .txt files hold documents separated by blank lines.
    model: a preset name, a model directory or an HF id; the tokenizer defaults to the model's own
    (a preset's is "builtin:tiny-bpe") and ids/positions are checked against its config.
    eval_split: the split of eval_dataset ("" = dataset_split).
    """

    dataset: str
    model: str
    seq_len: int
    tokenizer: str = ""
    data_format: str = "auto"
    dataset_config: str = ""
    dataset_split: str = "train"
    eval_fraction: float = 0.0
    eval_dataset: str = ""
    packing: bool = True
    seed: int = 0
    eval_split: str = ""

    def validate(self) -> "DataSpec":
        """Raise ValueError (FileNotFoundError for a missing local path) naming the first bad field."""
        check_source(self.dataset, "dataset")
        if self.eval_dataset:
            check_source(self.eval_dataset, "eval_dataset")
        if not self.model:
            raise ValueError("DataSpec.model is empty: name a preset, a model directory or an HF id")
        if isinstance(self.seq_len, bool) or not isinstance(self.seq_len, int) or self.seq_len < 2:
            raise ValueError(f"DataSpec.seq_len must be an integer >= 2, got {self.seq_len!r}")
        if self.data_format not in DATA_FORMATS:
            raise ValueError(f"DataSpec.data_format: unknown format {self.data_format!r}; "
                             f"use one of {list(DATA_FORMATS)}")
        if self.tokenizer.startswith("builtin:") and self.tokenizer != BUILTIN_TOKENIZER:
            raise ValueError(f"DataSpec.tokenizer: unknown builtin tokenizer {self.tokenizer!r}; "
                             f"the builtin one is {BUILTIN_TOKENIZER!r}")
        tok_path = local_path(self.tokenizer)
        if tok_path and not self.tokenizer.startswith("builtin:") and not looks_like_hub_id(self.tokenizer) \
                and not os.path.isdir(tok_path):
            raise FileNotFoundError(f"DataSpec.tokenizer: tokenizer directory not found: {self.tokenizer!r}")
        if not isinstance(self.eval_fraction, (int, float)) or not 0.0 <= self.eval_fraction < 1.0:
            raise ValueError(f"DataSpec.eval_fraction must be in [0, 1), got {self.eval_fraction!r}")
        if self.eval_fraction > 0 and self.eval_dataset:
            raise ValueError(f"DataSpec.eval_fraction={self.eval_fraction} and DataSpec.eval_dataset="
                             f"{self.eval_dataset!r} are both set: hold out a share of the data or name "
                             "a separate eval dataset, not both")
        if not self.dataset_split:
            raise ValueError("DataSpec.dataset_split is empty (use 'train')")
        if isinstance(self.seed, bool) or not isinstance(self.seed, int):
            raise ValueError(f"DataSpec.seed must be an integer, got {self.seed!r}")
        return self
