"""Names and paths of what the package ships: the tiny chat set, the tiny corpus, the tiny BPE tokenizer.

They exist so that a run works offline and a tiny model can visibly learn something; the files
are written by `python -m fuseforge_flyte.data.build_assets`.
"""

from __future__ import annotations

import os
from importlib import resources

BUILTIN_CHAT = "builtin:chat"
BUILTIN_TEXT = "builtin:text"
BUILTIN_TOKENIZER = "builtin:tiny-bpe"

CHAT_FILE = "tiny_chat.jsonl"
CORPUS_FILE = "tiny_corpus.txt"
TOKENIZER_DIR = "tiny-bpe"

# builtin dataset name -> (file under assets/, data format)
BUILTIN_DATASETS = {
    BUILTIN_CHAT: (CHAT_FILE, "messages"),
    BUILTIN_TEXT: (CORPUS_FILE, "text"),
}


def assets_dir() -> str:
    return str(resources.files("fuseforge_flyte") / "data" / "assets")


def asset_path(name: str) -> str:
    return os.path.join(assets_dir(), name)
