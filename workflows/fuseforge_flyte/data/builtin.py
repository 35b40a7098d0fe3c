"""Names and paths of what the package ships: the tiny chat and preference sets, the tiny corpus, the tiny
BPE tokenizer.

They exist so that a run works offline and a tiny model can visibly learn something; the files
are written by `python -m fuseforge_flyte.data.build_assets`.
"""

from __future__ import annotations

import os
from importlib import resources

BUILTIN_CHAT = "builtin:chat"
BUILTIN_TEXT = "builtin:text"
BUILTIN_PREFERENCES = "builtin:preferences"
BUILTIN_TOKENIZER = "builtin:tiny-bpe"

CHAT_FILE = "tiny_chat.jsonl"
CORPUS_FILE = "tiny_corpus.txt"
PREFERENCES_FILE = "tiny_preferences.jsonl"
TOKENIZER_DIR = "tiny-bpe"

# builtin dataset name -> (file under assets/, data format)
BUILTIN_DATASETS = {
    BUILTIN_CHAT: (CHAT_FILE, "messages"),
    BUILTIN_TEXT: (CORPUS_FILE, "text"),
    BUILTIN_PREFERENCES: (PREFERENCES_FILE, "preferences"),
}


def assets_dir() -> str:
    return str(resources.files("fuseforge_flyte") / "data" / "assets")


def asset_path(name: str) -> str:
    return os.path.join(assets_dir(), name)
