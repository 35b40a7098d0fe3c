"""`prepare`: a DataSpec -> a prepared directory (tokenized, loss-masked, packed shards + tokenizer + manifest).

Everything that can be checked cheaply (the spec, the model's positions and vocabulary against the
tokenizer, the columns, the chat template) is checked before the first example is tokenized. The
manifest is written last, so an interrupted run never leaves a directory that looks prepared.
Deterministic: the same spec and inputs give the same shards.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import tempfile
from dataclasses import asdict
from typing import Optional, Tuple

import numpy as np

from fuseforge_flyte.data.checks import DataNumbers, check_fits_model, load_model_config, packing_unsupported_reason
from fuseforge_flyte.data.formats import Encoder, detect_format
from fuseforge_flyte.data.packing import best_fit_decreasing, one_per_row
from fuseforge_flyte.data.shards import (FORMAT_VERSION, SPLITS, DataManifest, SplitStats,
                                         manifest_path, split_dir, tokenizer_dir, write_manifest, write_split)
from fuseforge_flyte.data.sources import load_source
from fuseforge_flyte.data.spec import DataSpec
from fuseforge_flyte.data.tokenizer import load_tokenizer, resolve_tokenizer_source
from fuseforge_flyte.model_names import PRESETS

log = logging.getLogger("fuseforge.data")


def _document_features():
    import datasets

    ids = datasets.List(datasets.Value("int32"))
    return datasets.Features({"input_ids": ids, "labels": ids, "length": datasets.Value("int32"),
                              "cut": datasets.Value("int8")})


def hold_out(dataset, fraction: float, seed: int) -> Tuple[object, Optional[object]]:
    """(train, eval): round(fraction * n) examples (at least 1 when fraction > 0 and n >= 2, at most
    n - 1) picked by a permutation seeded with `seed`; both keep the source order."""
    n = len(dataset)
    k = int(round(fraction * n))
    if fraction > 0 and n >= 2:
        k = max(k, 1)
    k = min(k, n - 1)
    if k <= 0:
        return dataset, None
    order = np.random.default_rng(seed).permutation(n)
    return dataset.select(np.sort(order[k:])), dataset.select(np.sort(order[:k]))


def _clear(out_dir: str) -> None:
    """Remove an earlier preparation's outputs, the manifest first."""
    if os.path.exists(manifest_path(out_dir)):
        os.remove(manifest_path(out_dir))
    for name in list(SPLITS) + [os.path.basename(tokenizer_dir(out_dir))]:
        shutil.rmtree(os.path.join(out_dir, name), ignore_errors=True)
    for name in os.listdir(out_dir):
        if name.startswith(".prepare-"):
            shutil.rmtree(os.path.join(out_dir, name), ignore_errors=True)


def _fingerprint(spec: DataSpec, what: str) -> str:
    return hashlib.sha256(json.dumps([asdict(spec), what], sort_keys=True).encode()).hexdigest()[:32]


def prepare(spec: DataSpec, out_dir: str) -> DataManifest:
    """Tokenize, mask, pack and write `spec`'s data into `out_dir`; returns the manifest written there."""
    from fuseforge_flyte.quiet import disable_progress_bars

    spec.validate()
    disable_progress_bars()  # the summary line below says what was prepared
    preset = spec.model in PRESETS
    config = load_model_config(spec.model)
    check_fits_model(DataNumbers(seq_len=spec.seq_len), config, preset=preset)
    tokenizer_name = resolve_tokenizer_source(spec.tokenizer, spec.model)
    tokenizer = load_tokenizer(spec.tokenizer, spec.model)
    check_fits_model(DataNumbers(vocab_size=len(tokenizer), max_token_id=len(tokenizer) - 1), config, preset=preset)
    packing = spec.packing
    if packing:
        reason = packing_unsupported_reason(config)
        if reason is not None:  # pad instead: never attend across examples
            log.warning("packing off for %s: %s; each example gets its own padded row", spec.model, reason)
            packing = False
    if tokenizer.pad_token_id is None and tokenizer.eos_token_id is not None:
        tokenizer.pad_token = tokenizer.eos_token  # saved with the data, so the engine/generation have one
    pad_token_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0

    os.makedirs(out_dir, exist_ok=True)
    _clear(out_dir)
    work = tempfile.mkdtemp(prefix=".prepare-", dir=out_dir)
    try:
        train = load_source(spec.dataset, field="dataset", config=spec.dataset_config, split=spec.dataset_split,
                            cache_dir=work)
        data_format = detect_format(train.column_names, spec.data_format, spec.dataset)
        eval_data, eval_source = None, ""
        if spec.eval_dataset:
            eval_data = load_source(spec.eval_dataset, field="eval_dataset",
                                    config=spec.dataset_config if spec.eval_dataset == spec.dataset else "",
                                    split=spec.eval_split or spec.dataset_split, cache_dir=work)
            detect_format(eval_data.column_names, data_format, spec.eval_dataset, field="eval_dataset")
            eval_source = spec.eval_dataset
        elif spec.eval_fraction > 0:
            train, eval_data = hold_out(train, spec.eval_fraction, spec.seed)
            eval_source = f"eval_fraction={spec.eval_fraction}"
            if eval_data is None:
                log.warning("DataSpec.eval_fraction=%s holds out no example of %d: no eval split",
                            spec.eval_fraction, len(train))
        encoder = Encoder(tokenizer, data_format, spec.seq_len, tokenizer_name=tokenizer_name, source=spec.dataset)

        counts = {}
        stats = {}
        truncated = dropped = 0
        max_token_id = -1
        for split, raw, source in (("train", train, spec.dataset), ("eval", eval_data, spec.eval_dataset)):
            stats[split], counts[split] = SplitStats(), 0
            if raw is None:
                continue
            encoder.source = source or spec.dataset
            docs = raw.map(encoder, batched=True, with_indices=True, remove_columns=raw.column_names,
                           features=_document_features(), cache_file_name=os.path.join(work, f"{split}-docs.arrow"),
                           new_fingerprint=_fingerprint(spec, split + "-docs"), desc=f"tokenizing {split}")
            lengths = np.asarray(docs.data.column("length").to_numpy(), dtype=np.int64)
            counts[split] = len(raw)
            truncated += int(np.count_nonzero(docs.data.column("cut").to_numpy()))
            dropped += int(np.count_nonzero(lengths == 0))
            groups = best_fit_decreasing(lengths, spec.seq_len) if packing else one_per_row(lengths)
            if not groups:
                if split == "train":
                    raise ValueError(f"DataSpec.dataset: no example of {spec.dataset!r} has a token to train on "
                                     f"(data_format {data_format!r}: all {len(raw)} examples were dropped; "
                                     "messages data needs assistant turns)")
                log.warning("no eval example of %s has a loss token: no eval split", source)
                continue
            stats[split] = write_split(docs, groups, split_dir(out_dir, split), seq_len=spec.seq_len,
                                       pad_token_id=pad_token_id, work_file=os.path.join(work, f"{split}-rows.arrow"),
                                       fingerprint=_fingerprint(spec, split + "-rows"))
            max_token_id = max(max_token_id, stats[split].max_token_id, pad_token_id)
        tokenizer.save_pretrained(tokenizer_dir(out_dir))
    finally:
        shutil.rmtree(work, ignore_errors=True)

    tr, ev = stats["train"], stats["eval"]
    manifest = DataManifest(
        format_version=FORMAT_VERSION, data_format=data_format, seq_len=spec.seq_len, packing=packing,
        vocab_size=len(tokenizer), max_token_id=max_token_id, pad_token_id=pad_token_id, tokenizer=tokenizer_name,
        train_examples=counts["train"], train_sequences=tr.sequences, train_tokens=tr.tokens,
        train_loss_tokens=tr.loss_tokens, eval_examples=counts["eval"], eval_sequences=ev.sequences,
        eval_tokens=ev.tokens, eval_loss_tokens=ev.loss_tokens, truncated_examples=truncated, source=spec.dataset,
        dropped_examples=dropped, packing_efficiency=tr.tokens / max(1, tr.sequences * spec.seq_len),
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id, model=spec.model,
        eval_source=eval_source, dataset_config=spec.dataset_config, dataset_split=spec.dataset_split,
        seed=spec.seed,
    )
    check_fits_model(DataNumbers.of(manifest), config, preset=preset)
    write_manifest(out_dir, manifest)
    if truncated:
        log.warning("%d examples were longer than seq_len %d and were %s", truncated, spec.seq_len,
                    "split into seq_len pieces" if data_format == "text" else "truncated (their tail is not trained)")
    log.info("prepared %s (%s, tokenizer %s) into %s: %d train examples -> %d sequences of %d, %d tokens, "
             "%d loss tokens, packing efficiency %.1f%%; %d eval examples -> %d sequences, %d loss tokens; "
             "%d truncated, %d dropped", spec.dataset, data_format, tokenizer_name, out_dir, manifest.train_examples,
             manifest.train_sequences, spec.seq_len, manifest.train_tokens, manifest.train_loss_tokens,
             100 * manifest.packing_efficiency, manifest.eval_examples, manifest.eval_sequences,
             manifest.eval_loss_tokens, truncated, dropped)
    return manifest

