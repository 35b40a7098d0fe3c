"""The data path: tokenizer, dataset sources, formats and loss masks, packing, prepared shards; and the
benchmark-only datasets (`benchmark`), which need none of them.

Plain Hugging Face code (`transformers`, `tokenizers`, `datasets`); nothing here imports Flyte.
The Flyte data-preparation task is a thin wrapper around `prepare`.
"""
