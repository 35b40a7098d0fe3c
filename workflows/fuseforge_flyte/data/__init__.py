"""The data path: tokenizer, dataset sources, formats and loss masks, packing, prepared shards.

Plain Hugging Face code (`transformers`, `tokenizers`, `datasets`); nothing here imports Flyte.
The Flyte data-preparation task is a thin wrapper around `prepare`.
"""
