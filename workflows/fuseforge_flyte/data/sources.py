"""Reading a dataset source into a Hugging Face `datasets.Dataset` of raw examples.

Files go through `datasets`' own builders (json, parquet, csv, text), chosen from the extension; a
folder means every supported file under it, which must all be of one kind. `.txt` files hold one
document per blank-line separated block (the builder's `sample_by="paragraph"`, then stripped), not
one per line, since a line is rarely a document. Hub ids go to `load_dataset(id, name, split)`.
"""

from __future__ import annotations

import os
from typing import List, Optional, Tuple

from fuseforge_flyte import hub
from fuseforge_flyte.data.file_errors import first_non_utf8, first_unreadable_line
from fuseforge_flyte.data.builtin import BUILTIN_DATASETS, asset_path
from fuseforge_flyte.data.spec import BUILDERS, looks_like_hub_id
from fuseforge_flyte.model_names import is_uri, local_path


def _extension(path: str) -> str:
    return os.path.splitext(path)[1].lower()


def _list_files(source: str, field: str) -> Tuple[str, List[str]]:
    """(builder, data files) for a file or folder, local or fsspec."""
    import fsspec

    path = local_path(source)
    if path:
        if not os.path.exists(path):
            raise FileNotFoundError(f"DataSpec.{field}: dataset file or folder not found: {source!r}")
        fs, root, unstrip = fsspec.filesystem("file"), os.path.abspath(path), (lambda p: p)
    else:
        fs, root = fsspec.core.url_to_fs(source)
        unstrip = fs.unstrip_protocol
        if not fs.exists(root):
            raise FileNotFoundError(f"DataSpec.{field}: dataset file or folder not found: {source!r}")
    if fs.isdir(root):
        found = sorted(p for p in fs.find(root)
                       if not any(part.startswith((".", "_")) for part in p[len(root):].split("/") if part))
        files = [p for p in found if _extension(p) in BUILDERS]
        if not files:
            raise ValueError(f"DataSpec.{field}: folder {source!r} has no {'/'.join(sorted(BUILDERS))} files "
                             f"(found {len(found)} other files)")
        kinds = sorted({BUILDERS[_extension(p)] for p in files})
        if len(kinds) > 1:
            exts = sorted({_extension(p) for p in files})
            raise ValueError(f"DataSpec.{field}: folder {source!r} mixes file kinds {exts}; "
                             "put files of one kind (json/jsonl, parquet, csv or txt) in a folder")
        return kinds[0], [unstrip(p) for p in files]
    ext = _extension(root)
    if ext not in BUILDERS:
        raise ValueError(f"DataSpec.{field}: unsupported file extension {ext or '(none)'!r} in {source!r}; "
                         f"supported: {', '.join(sorted(BUILDERS))}")
    return BUILDERS[ext], [unstrip(root)]


def _all_blank(files: List[str]) -> bool:
    """Every file empty or whitespace (which `datasets` reports with obscure errors)."""
    import fsspec

    for name in files:
        fs, path = fsspec.core.url_to_fs(name)
        if fs.size(path) > 4096:
            return False
        with fs.open(path, "rb") as handle:
            if handle.read().strip():
                return False
    return True


def _strip_documents(dataset):
    """Blank-line blocks of a .txt file as stripped documents, empty ones removed."""
    def strip(batch):
        return {"text": [t.strip() for t in batch["text"]]}
    def nonempty(batch):
        return [bool(t) for t in batch["text"]]
    return dataset.map(strip, batched=True).filter(nonempty, batched=True)


def _read_error(field: str, source: str, builder: str, split: str, err: Exception) -> Exception:
    """datasets' own error, named: an OSError as it is, a bad split, or a generation error's cause."""
    if isinstance(err, OSError):
        return err
    if isinstance(err, ValueError) and not isinstance(err, UnicodeDecodeError):
        return ValueError(f"DataSpec.{field}: could not read {source!r} with split {split!r}: {err}")
    cause = err.__cause__ or err  # datasets' generation errors (ragged CSV...) carry the cause
    return ValueError(f"DataSpec.{field}: could not read {source!r} as {builder}: {cause}")


def load_source(source: str, *, field: str = "dataset", config: str = "", split: str = "train",
                cache_dir: Optional[str] = None):
    """The examples of DataSpec.<field> as a `datasets.Dataset` (errors name the field and the source).

    `split` may use `datasets`' slicing syntax ("train[:1000]"); files have only a "train" split.
    `cache_dir` receives the Arrow copy of file sources (hub datasets use the usual HF cache).
    """
    import datasets

    if source in BUILTIN_DATASETS:
        source = asset_path(BUILTIN_DATASETS[source][0])
    elif source.startswith("builtin:"):
        raise ValueError(f"DataSpec.{field}: unknown builtin dataset {source!r}; known: {sorted(BUILTIN_DATASETS)}")
    if looks_like_hub_id(source) and not is_uri(source):
        def load_from_hub():
            try:
                return datasets.load_dataset(source, name=config or None, split=split)
            except (datasets.exceptions.DatasetNotFoundError, FileNotFoundError) as err:
                raise ValueError(f"DataSpec.{field}: hub dataset {source!r} not found or not reachable ({err})") from err
            except ValueError as err:  # unknown split or config
                raise ValueError(f"DataSpec.{field}: {source!r} (config {config!r}, split {split!r}): {err}") from err

        dataset = hub.load_hub_id(load_from_hub, option=field, hub_id=source, what="dataset")
    else:
        builder, files = _list_files(source, field)
        if _all_blank(files):
            raise ValueError(f"DataSpec.{field}: {source!r} has no rows (its files are empty)")
        kwargs = {"sample_by": "paragraph"} if builder == "text" else {}
        try:
            dataset = datasets.load_dataset(builder, data_files=files, split=split, cache_dir=cache_dir, **kwargs)
        except FileNotFoundError:
            raise
        except Exception as err:
            where = first_unreadable_line(files, builder)  # the file and line, which datasets does not name
            if where is None:
                raise _read_error(field, source, builder, split, err) from err
            raise ValueError(f"DataSpec.{field}: {where}") from err
        local_files = [f for f in files if not is_uri(f) or f.startswith("file://")]
        where = first_non_utf8([local_path(f) or f for f in local_files]) if builder != "parquet" else None
        if where is not None:  # loaded, but the bytes would fail later, in tokenization, naming nothing
            raise ValueError(f"DataSpec.{field}: {where}")
        if builder == "text":
            dataset = _strip_documents(dataset)
    if isinstance(dataset, datasets.IterableDataset):
        raise ValueError(f"DataSpec.{field}: {source!r} loaded as a streaming dataset; a map-style one is needed")
    if len(dataset) == 0:
        raise ValueError(f"DataSpec.{field}: {source!r} has no rows (split {split!r})")
    return dataset
