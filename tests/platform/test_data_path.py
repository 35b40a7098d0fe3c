"""The data path (fuseforge_flyte.data): loss masks, packing without leakage, eval splits, sources, errors.

Offline: the shipped builtin:tiny-bpe tokenizer, tiny datasets written into tmp_path, a random-init
tiny Llama for the packing equivalence.
"""

import dataclasses
import json
import os

import numpy as np
import pytest
import torch

from fuseforge_flyte.data.checks import DataNumbers, check_fits_model, load_model_config
from fuseforge_flyte.data.formats import IGNORE_INDEX
from fuseforge_flyte.data.packing import best_fit_decreasing
from fuseforge_flyte.data.prepare import prepare
from fuseforge_flyte.data.shards import (MANIFEST_NAME, is_prepared_dir, open_split, read_manifest,
                                         tokenizer_dir)
from fuseforge_flyte.data.spec import DataSpec
from fuseforge_flyte.data.tokenizer import load_tokenizer

END = "<|end|>"
CHATS = [
    [{"role": "system", "content": "You are terse."},
     {"role": "user", "content": "What is 2 plus 3?"},
     {"role": "assistant", "content": "2 plus 3 is 5."}],
    [{"role": "user", "content": "Hello!"},
     {"role": "assistant", "content": "Hello! How can I help you today?"},
     {"role": "user", "content": "Reverse the word 'stone'."},
     {"role": "assistant", "content": "The word 'stone' reversed is 'enots'."}],
    [{"role": "user", "content": "Count from 3 to 6."},
     {"role": "assistant", "content": "3, 4, 5, 6."},
     {"role": "user", "content": "Thanks."},
     {"role": "assistant", "content": "You are welcome!"},
     {"role": "user", "content": "What is the capital of Peru?"},
     {"role": "assistant", "content": "The capital of Peru is Lima."}],
    [{"role": "user", "content": "No answer here."}],  # no assistant turn: dropped
]


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer("builtin:tiny-bpe", "")


@pytest.fixture(scope="module")
def tokenizer_variants(tmp_path_factory, tok):
    """Copies of tiny-bpe: its chat template without {% generation %} tags, and with no template."""
    root = tmp_path_factory.mktemp("tokenizers")
    no_tags = load_tokenizer("builtin:tiny-bpe", "")
    no_tags.chat_template = tok.chat_template.replace("{% generation %}", "").replace("{% endgeneration %}", "")
    assert no_tags.chat_template != tok.chat_template
    no_tags.save_pretrained(root / "no_tags")
    no_template = load_tokenizer("builtin:tiny-bpe", "")
    no_template.chat_template = None
    no_template.save_pretrained(root / "no_template")
    unstable = load_tokenizer("builtin:tiny-bpe", "")  # its generation prompt is not how turns render
    prompt = "{%- if add_generation_prompt -%}{{- '<|assistant|>\\n"
    assert prompt in no_tags.chat_template
    unstable.chat_template = no_tags.chat_template.replace(prompt, prompt + "A: ")
    unstable.save_pretrained(root / "unstable")
    return {"tags": "builtin:tiny-bpe", "no_tags": str(root / "no_tags"), "no_template": str(root / "no_template"),
            "unstable": str(root / "unstable")}


def write_jsonl(path, rows):
    with open(path, "w", encoding="utf-8") as handle:
        for row in rows:
            handle.write(json.dumps(row) + "\n")
    return str(path)


def run(tmp_path, dataset, name="out", **kwargs):
    kwargs.setdefault("model", "tiny-llama")
    kwargs.setdefault("seq_len", 128)
    out = str(tmp_path / name)
    manifest = prepare(DataSpec(dataset=dataset, **kwargs), out)
    return out, manifest


def all_rows(data_dir, split="train"):
    data = open_split(data_dir, split)
    return data.batch(range(len(data)))


def loss_spans(row, tok):
    """The decoded runs of consecutive loss tokens of one row, checking labels equal the inputs there."""
    ids, labels = row["input_ids"], row["labels"]
    keep = labels != IGNORE_INDEX
    assert torch.equal(labels[keep], ids[keep])
    spans, current = [], []
    for token, on in zip(ids.tolist(), keep.tolist()):
        if on:
            current.append(token)
        elif current:
            spans.append(current)
            current = []
    if current:
        spans.append(current)
    return [tok.decode(span) for span in spans]


# ------------------------------------------------------------------ 1. SFT loss masks


@pytest.mark.parametrize("variant", ["tags", "no_tags"])
def test_messages_loss_is_exactly_the_assistant_turns(tmp_path, tok, tokenizer_variants, variant):
    data = write_jsonl(tmp_path / "chat.jsonl", [{"messages": m} for m in CHATS])
    out, manifest = run(tmp_path, data, tokenizer=tokenizer_variants[variant], packing=False)
    assert manifest.data_format == "messages"
    assert (manifest.train_examples, manifest.dropped_examples, manifest.train_sequences) == (4, 1, 3)
    rows = all_rows(out)
    for i, chat in enumerate(CHATS[:3]):  # packing=False keeps one example per row, in order
        row = {k: v[i] for k, v in rows.items()}
        expected = [m["content"] + END for m in chat if m["role"] == "assistant"]
        assert loss_spans(row, tok) == expected
    assert manifest.train_loss_tokens == int((rows["labels"] != IGNORE_INDEX).sum())


def test_generation_tags_and_prefix_rendering_agree(tmp_path, tokenizer_variants):
    data = write_jsonl(tmp_path / "chat.jsonl", [{"messages": m} for m in CHATS])
    a, _ = run(tmp_path, data, name="a", tokenizer=tokenizer_variants["tags"])
    b, _ = run(tmp_path, data, name="b", tokenizer=tokenizer_variants["no_tags"])
    for key, value in all_rows(a).items():
        assert torch.equal(value, all_rows(b)[key]), key


def test_prompt_completion_loss_is_the_completion_and_eos(tmp_path, tok):
    rows = [{"prompt": "What is 4 plus 4?", "completion": " 4 plus 4 is 8."},
            {"prompt": "Name a color.", "completion": " Green."}]
    out, manifest = run(tmp_path, write_jsonl(tmp_path / "pc.jsonl", rows), packing=False)
    assert manifest.data_format == "prompt_completion"
    data = all_rows(out)
    for i, example in enumerate(rows):
        row = {k: v[i] for k, v in data.items()}
        assert loss_spans(row, tok) == [example["completion"] + END]
        assert row["input_ids"][0].item() == tok.bos_token_id


def test_conversational_prompt_completion(tmp_path, tok):
    rows = [{"prompt": [{"role": "user", "content": "What is 7 times 6?"}],
             "completion": [{"role": "assistant", "content": "7 times 6 is 42."}]}]
    out, _ = run(tmp_path, write_jsonl(tmp_path / "pc.jsonl", rows), packing=False)
    assert loss_spans(open_split(out, "train")[0], tok) == ["7 times 6 is 42." + END]


def test_long_sft_examples_are_truncated_and_counted(tmp_path, tok):
    long_answer = " ".join(["word"] * 80)
    chats = [CHATS[0], [{"role": "user", "content": " ".join(["ask"] * 80)},
                        {"role": "assistant", "content": long_answer}]]
    out, manifest = run(tmp_path, write_jsonl(tmp_path / "c.jsonl", [{"messages": m} for m in chats]), seq_len=40)
    # the second example's prompt alone is longer than 40 tokens: truncated, then dropped (no loss token left)
    assert (manifest.truncated_examples, manifest.dropped_examples) == (1, 1)
    assert manifest.train_sequences == 1


# ------------------------------------------------------------------ 2. packing


def test_best_fit_decreasing_fits_every_document_once():
    rng = np.random.default_rng(0)
    lengths = rng.integers(0, 65, size=500)
    rows = best_fit_decreasing(lengths, 64)
    placed = sorted(d for row in rows for d in row)
    assert placed == [i for i in range(500) if lengths[i] > 0]
    assert all(sum(lengths[d] for d in row) <= 64 for row in rows)
    assert len(rows) <= int(np.ceil(lengths.sum() / 64 * 1.25)) + 1  # close to the volume bound
    assert best_fit_decreasing(lengths, 64) == rows  # deterministic
    # 6 opens a row, 5 a second, 4 fills the first (6+4), 3 and 2 fill the second (5+3+2)
    assert best_fit_decreasing([5, 3, 2, 4, 6], 10) == [[4, 3], [0, 1, 2]]


def _packed_text(tmp_path):
    words = "the lamp the bridge the river the mill a baker a boat an orchard".split()
    rng = np.random.default_rng(1)
    docs = [" ".join(rng.choice(words, size=n)) for n in (3, 9, 14, 5, 20, 7)]
    return run(tmp_path, write_jsonl(tmp_path / "docs.jsonl", [{"text": d} for d in docs]), seq_len=48)


def test_packed_rows_restart_positions_and_mask_boundaries(tmp_path, tok):
    out, manifest = _packed_text(tmp_path)
    assert manifest.packing and manifest.train_sequences < manifest.train_examples
    rows = all_rows(out)
    for ids, labels, pos in zip(rows["input_ids"], rows["labels"], rows["position_ids"]):
        starts = (pos == 0).nonzero().flatten().tolist()
        assert starts[0] == 0
        assert (labels[starts] == IGNORE_INDEX).all()
        steps = torch.diff(pos)
        assert ((steps == 1) | (pos[1:] == 0)).all()
        pad_start = starts[-1]
        if ids[pad_start].item() == tok.pad_token_id:  # the padding segment: all pad, no loss
            assert (ids[pad_start:] == tok.pad_token_id).all() and (labels[pad_start:] == IGNORE_INDEX).all()
        doc_labels = labels[:pad_start] if ids[pad_start].item() == tok.pad_token_id else labels
        keep = doc_labels != IGNORE_INDEX
        assert keep.sum() == len(doc_labels) - sum(1 for s in starts if s < len(doc_labels))


def test_models_that_cannot_take_packed_rows_get_padded_rows(tmp_path, monkeypatch):
    """Where the model would attend across packed examples, each example gets its own padded row instead."""
    import fuseforge_flyte.data.prepare as prepare_module
    from fuseforge_flyte.data.checks import packing_unsupported_reason
    from transformers import LlamaConfig

    config = LlamaConfig()
    assert packing_unsupported_reason(config) is None
    config._attn_implementation = "some_kernel"
    assert "not known to take packed-sequence masks" in packing_unsupported_reason(config)
    monkeypatch.setattr(prepare_module, "packing_unsupported_reason", lambda config: "no packed masks here")
    manifest = prepare(DataSpec(dataset="builtin:chat", model="tiny-llama", seq_len=128), str(tmp_path / "out"))
    assert not manifest.packing and manifest.train_sequences == manifest.train_examples
    assert all(int((pos == 0).sum()) <= 2 for pos in all_rows(str(tmp_path / "out"))["position_ids"])


def _token_losses(model, ids, position_ids=None):
    logits = model(input_ids=ids[None], position_ids=None if position_ids is None else position_ids[None],
                   use_cache=False).logits[0]
    return torch.nn.functional.cross_entropy(logits[:-1].float(), ids[1:], reduction="none")


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_packed_losses_equal_documents_run_alone(tmp_path, tok, attn):
    from transformers import LlamaConfig, LlamaForCausalLM

    out, _ = _packed_text(tmp_path)
    data = open_split(out, "train")
    row = max((data[i] for i in range(len(data))), key=lambda r: int((r["position_ids"] == 0).sum()))
    ids, labels, pos = row["input_ids"], row["labels"], row["position_ids"]
    starts = (pos == 0).nonzero().flatten().tolist() + [len(ids)]
    assert len(starts) >= 4  # at least two documents (and maybe padding) in the row
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                         attn_implementation=attn)
    model = LlamaForCausalLM(config).float().eval()
    with torch.no_grad():
        packed = _token_losses(model, ids, pos)
        plain = _token_losses(model, ids, torch.arange(len(ids)))
        leaked = 0.0
        for s, e in zip(starts[:-1], starts[1:]):
            if (labels[s:e] == IGNORE_INDEX).all():
                continue  # padding
            alone = _token_losses(model, ids[s:e])
            torch.testing.assert_close(packed[s:e - 1], alone, atol=1e-5, rtol=0)
            leaked = max(leaked, (plain[s:e - 1] - alone).abs().max().item())
    assert leaked > 1e-3  # without restarting positions the later documents see the earlier ones


# ------------------------------------------------------------------ 3. eval split


def _numbered_docs(tmp_path, n=40):
    return write_jsonl(tmp_path / "docs.jsonl", [{"text": f"Document {i} is here."} for i in range(n)])


def _texts(data_dir, split, tok):
    rows = all_rows(data_dir, split)
    return {tok.decode(ids, skip_special_tokens=True) for ids in rows["input_ids"]}


def test_eval_fraction_holds_out_a_disjoint_seeded_share(tmp_path, tok):
    data = _numbered_docs(tmp_path)
    a, manifest = run(tmp_path, data, name="a", eval_fraction=0.25, packing=False, seq_len=16)
    assert (manifest.train_examples, manifest.eval_examples) == (30, 10)
    assert (manifest.train_sequences, manifest.eval_sequences) == (30, 10)
    train, held = _texts(a, "train", tok), _texts(a, "eval", tok)
    assert not train & held and train | held == {f"Document {i} is here." for i in range(40)}

    b, _ = run(tmp_path, data, name="b", eval_fraction=0.25, packing=False, seq_len=16)
    for split in ("train", "eval"):
        for key, value in all_rows(a, split).items():
            assert torch.equal(value, all_rows(b, split)[key])
    assert read_manifest(a) == read_manifest(b)
    c, _ = run(tmp_path, data, name="c", eval_fraction=0.25, packing=False, seq_len=16, seed=1)
    assert _texts(c, "eval", tok) != held


def test_eval_dataset_and_no_eval(tmp_path):
    data = _numbered_docs(tmp_path)
    other = write_jsonl(tmp_path / "eval.jsonl", [{"text": "An eval document."}] * 3)
    out, manifest = run(tmp_path, data, name="a", eval_dataset=other)
    assert manifest.eval_examples == 3 and len(open_split(out, "eval")) >= 1
    out, manifest = run(tmp_path, data, name="b")
    assert manifest.eval_sequences == 0 and open_split(out, "eval") is None


# ------------------------------------------------------------------ 4. errors


def _model_dir(tmp_path, vocab_size, positions):
    path = tmp_path / f"model_{vocab_size}_{positions}"
    path.mkdir()
    (path / "config.json").write_text(json.dumps({
        "model_type": "llama", "vocab_size": vocab_size, "hidden_size": 64, "intermediate_size": 128,
        "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
        "max_position_embeddings": positions}))
    return str(path)


def test_bad_inputs_name_the_problem(tmp_path, tokenizer_variants):
    chat = write_jsonl(tmp_path / "chat.jsonl", [{"messages": m} for m in CHATS])
    other = write_jsonl(tmp_path / "other.jsonl", [{"body": "x", "title": "y"}])
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    xml = tmp_path / "data.xml"
    xml.write_text("<a/>")
    cases = [
        (ValueError, "no column 'text'.*'body', 'title'", dict(dataset=other, data_format="text")),
        (ValueError, "cannot tell the format.*'body', 'title'.*messages: messages", dict(dataset=other)),
        (ValueError, "has no rows", dict(dataset=str(empty))),
        (ValueError, "has no chat template", dict(dataset=chat, tokenizer=tokenizer_variants["no_template"])),
        (ValueError, "does not render conversation prefixes stably", dict(dataset=chat,
                                                                          tokenizer=tokenizer_variants["unstable"])),
        (ValueError, "DataSpec.data_format: unknown format 'chat'", dict(dataset=chat, data_format="chat")),
        (FileNotFoundError, "not found.*missing.jsonl", dict(dataset=str(tmp_path / "missing.jsonl"))),
        (ValueError, "unsupported file extension '.xml'", dict(dataset=str(xml))),
        (ValueError, "eval_fraction=0.1 and DataSpec.eval_dataset", dict(dataset=chat, eval_fraction=0.1,
                                                                         eval_dataset=chat)),
        (ValueError, r"ids go up to 1023 \(vocabulary 1024\) but the model's vocab_size is 100",
         dict(dataset=chat, model=_model_dir(tmp_path, 100, 256), tokenizer="builtin:tiny-bpe")),
        (ValueError, "seq_len 128 is above the model's max_position_embeddings 64",
         dict(dataset=chat, model=_model_dir(tmp_path, 2048, 64), tokenizer="builtin:tiny-bpe")),
        (FileNotFoundError, "no tokenizer found", dict(dataset=chat, model=_model_dir(tmp_path, 2048, 256))),
    ]
    for error, pattern, kwargs in cases:
        out = tmp_path / "out"
        with pytest.raises(error, match=pattern):
            run(tmp_path, **kwargs)
        assert not is_prepared_dir(str(out))


def test_check_fits_model_presets_and_manifests(tmp_path):
    numbers = DataNumbers(vocab_size=5000, max_token_id=4999, seq_len=64)
    preset = load_model_config("tiny-llama")
    check_fits_model(numbers, preset, preset=True)  # a preset's vocabulary follows the data
    with pytest.raises(ValueError, match="max_position_embeddings 4096"):
        check_fits_model(dataclasses.replace(numbers, seq_len=5000), preset, preset=True)
    with pytest.raises(ValueError, match="vocab_size is 100"):
        check_fits_model(numbers, load_model_config(_model_dir(tmp_path, 100, 256)))


def test_read_manifest_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="not found"):
        read_manifest(str(tmp_path / "nowhere"))
    (tmp_path / "partial").mkdir()
    with pytest.raises(FileNotFoundError, match="not a prepared data directory"):
        read_manifest(str(tmp_path / "partial"))
    out, _ = run(tmp_path, "builtin:text")
    raw = json.loads((tmp_path / "out" / MANIFEST_NAME).read_text())
    raw["format_version"] = 99
    (tmp_path / "out" / MANIFEST_NAME).write_text(json.dumps(raw))
    with pytest.raises(ValueError, match="format_version 99"):
        read_manifest(out)


# ------------------------------------------------------------------ 5. sources


def test_parquet_csv_folder_and_file_uri_sources(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    texts = [f"Row {i} of the table." for i in range(6)]
    pq.write_table(pa.table({"text": texts}), tmp_path / "t.parquet")
    _, m = run(tmp_path, str(tmp_path / "t.parquet"), name="pq")
    assert (m.data_format, m.train_examples) == ("text", 6)

    (tmp_path / "pc.csv").write_text('prompt,completion\n"Say hi.", Hi.\n"Say bye.", Bye.\n')
    _, m = run(tmp_path, str(tmp_path / "pc.csv"), name="csv")
    assert (m.data_format, m.train_examples) == ("prompt_completion", 2)

    folder = tmp_path / "folder"
    (folder / "sub").mkdir(parents=True)
    write_jsonl(folder / "a.jsonl", [{"messages": m} for m in CHATS[:2]])
    write_jsonl(folder / "sub" / "b.jsonl", [{"messages": m} for m in CHATS[2:3]])
    (folder / "README.md").write_text("ignored")
    _, m = run(tmp_path, str(folder), name="folder")
    assert (m.data_format, m.train_examples) == ("messages", 3)

    _, m = run(tmp_path, "file://" + str(tmp_path / "t.parquet"), name="uri")
    assert m.train_examples == 6


def test_builtin_datasets_and_reading_api(tmp_path, tok):
    out, m = run(tmp_path, "builtin:chat", seq_len=256, eval_fraction=0.05)
    assert (m.data_format, m.tokenizer, m.vocab_size) == ("messages", "builtin:tiny-bpe", len(tok))
    assert m.train_examples > 300 and m.eval_examples > 10 and m.packing_efficiency > 0.9
    assert m.max_token_id < m.vocab_size and m.pad_token_id == tok.pad_token_id
    assert is_prepared_dir(out) and os.path.isfile(os.path.join(tokenizer_dir(out), "tokenizer.json"))
    data = open_split(out, "train")
    assert data.shuffle and data.seq_len == 256 and data.source == "builtin:chat"
    sample, batch = data[1], data.batch([1, 0, 1])
    assert set(sample) == {"input_ids", "labels", "position_ids"}
    for key, value in sample.items():
        assert value.dtype == torch.int64 and value.shape == (256,)
        assert batch[key].shape == (3, 256) and torch.equal(batch[key][0], value)
    _, m = run(tmp_path, "builtin:text", name="text")
    assert m.data_format == "text" and m.train_loss_tokens > 1000


def test_txt_documents_are_blank_line_separated(tmp_path):
    (tmp_path / "doc.txt").write_text("First document,\nstill the first.\n\nSecond one.\n\n\n\nThird\none.\n")
    _, m = run(tmp_path, str(tmp_path / "doc.txt"))
    assert (m.data_format, m.train_examples) == ("text", 3)


def test_fsspec_dataset_and_tokenizer_directory(tmp_path, tokenizer_variants):
    import fsspec

    fs = fsspec.filesystem("memory")
    root = f"/fuseforge-test-{os.getpid()}-{tmp_path.name}"
    for name in os.listdir(tokenizer_variants["no_tags"]):
        with open(os.path.join(tokenizer_variants["no_tags"], name), "rb") as handle:
            fs.pipe(f"{root}/tok/{name}", handle.read())
    fs.pipe(f"{root}/tok/model.safetensors", b"weights are not copied")
    fs.pipe(f"{root}/data/chat.jsonl", "".join(json.dumps({"messages": m}) + "\n" for m in CHATS).encode())
    fs.pipe(f"{root}/notok/config.json", b"{}")
    _, m = run(tmp_path, f"memory://{root}/data", tokenizer=f"memory://{root}/tok")
    assert (m.data_format, m.train_examples, m.dropped_examples) == ("messages", 4, 1)
    with pytest.raises(ValueError, match="has no tokenizer files"):
        load_tokenizer(f"memory://{root}/notok", "")
    _, m = run(tmp_path, f"memory://{root}/data/chat.jsonl", name="file_tok",
               tokenizer="file://" + tokenizer_variants["no_tags"])
    assert m.train_examples == 4
