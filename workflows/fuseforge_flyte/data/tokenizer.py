"""Which tokenizer prepares the data, and loading it from wherever it lives.

A remote (fsspec) tokenizer directory is copied to a local temporary directory first, because
`AutoTokenizer.from_pretrained` reads local directories and hub ids only; weight files are
skipped so that pointing at a whole model directory does not download the model.
"""

from __future__ import annotations

import os
import tempfile

from fuseforge_flyte import hub
from fuseforge_flyte.data.builtin import BUILTIN_TOKENIZER, TOKENIZER_DIR, asset_path
from fuseforge_flyte.data.spec import WEIGHT_FILE_SUFFIXES, looks_like_hub_id
from fuseforge_flyte.model_names import PRESETS, is_uri, local_path

# any one of these marks a directory as holding a tokenizer
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json", "vocab.txt",
                   "spiece.model", "sentencepiece.bpe.model")


def resolve_tokenizer_source(source: str, model: str) -> str:
    """The tokenizer actually used: `source`, or (source "") the model's own; a preset's is the builtin."""
    if source:
        return source
    if model in PRESETS:
        return BUILTIN_TOKENIZER
    path = local_path(model)
    if path and os.path.isfile(path):  # a config.json: its directory may hold the tokenizer
        return os.path.dirname(os.path.abspath(path))
    return model


def _has_tokenizer_files(directory: str) -> bool:
    return any(os.path.isfile(os.path.join(directory, name)) for name in TOKENIZER_FILES)


def _download_dir(uri: str) -> str:
    """Copy the non-weight files of a remote directory into a new local temporary directory."""
    import fsspec

    fs, root = fsspec.core.url_to_fs(uri)
    if not fs.isdir(root):
        raise FileNotFoundError(f"no tokenizer found at {uri!r}: not a directory")
    names = [p for p in fs.ls(root, detail=False) if fs.isfile(p)]
    wanted = [p for p in names if not p.endswith(WEIGHT_FILE_SUFFIXES)]
    if not any(os.path.basename(p) in TOKENIZER_FILES for p in wanted):
        found = sorted(os.path.basename(p) for p in names)
        raise ValueError(f"no tokenizer found at {uri!r}: the directory has no tokenizer files "
                         f"(looked for any of {list(TOKENIZER_FILES)}; found {found})")
    local = tempfile.mkdtemp(prefix="fuseforge-tokenizer-")  # fresh: no stale files, no races between runs
    for remote in wanted:
        fs.get(remote, os.path.join(local, os.path.basename(remote)))
    return local


def load_tokenizer(source: str, model: str):
    """A PreTrainedTokenizerBase for DataSpec.tokenizer `source` (or the model's own when source is '').

    Accepts "builtin:tiny-bpe", a local directory, a file:// or other fsspec URI of a tokenizer
    directory, or an HF hub id. Raises FileNotFoundError/ValueError saying where nothing was found.
    """
    from transformers import AutoTokenizer

    resolved = resolve_tokenizer_source(source, model)
    what = f"DataSpec.tokenizer={source!r}" if source else f"the tokenizer of DataSpec.model={model!r}"
    if resolved == BUILTIN_TOKENIZER:
        directory = asset_path(TOKENIZER_DIR)
    elif is_uri(resolved) and not resolved.startswith("file://"):
        directory = _download_dir(resolved)
    else:
        directory = local_path(resolved)
        if not os.path.exists(directory):
            if looks_like_hub_id(resolved):
                try:
                    return hub.load_hub_id(lambda: AutoTokenizer.from_pretrained(resolved),
                                           option="tokenizer" if source else "model", hub_id=resolved,
                                           what="tokenizer" if source else "model")
                except OSError as err:
                    raise ValueError(f"{what}: no tokenizer found at hub id {resolved!r} ({err})") from err
            raise FileNotFoundError(f"{what}: no tokenizer found at {resolved!r}: no such directory")
    if not os.path.isdir(directory) or not _has_tokenizer_files(directory):
        hint = "" if source else " (set DataSpec.tokenizer to one, e.g. 'builtin:tiny-bpe')"
        raise FileNotFoundError(f"{what}: no tokenizer found at {resolved!r}: no tokenizer files "
                                f"({', '.join(TOKENIZER_FILES)}){hint}")
    return AutoTokenizer.from_pretrained(directory)
