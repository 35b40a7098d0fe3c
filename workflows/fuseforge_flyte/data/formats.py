"""Data formats and their loss masks: raw examples -> documents of token ids and aligned labels.

A document is what packing treats as a unit: `input_ids` and `labels` of the same length (at most
seq_len), labels = the token where a loss is taken, IGNORE_INDEX elsewhere, always IGNORE_INDEX at
position 0 (no token of an earlier document predicts a document's first token).

- text (continued pretraining): the tokenizer's own BOS (if it adds one) + the text + EOS (if the
  tokenizer has one); every token is a loss token. Longer than seq_len: cut into seq_len pieces, each
  its own document (nothing is lost; pieces of one token carry no loss and are left out).
- messages: the chat template renders the conversation; the loss is on the assistant turns only
  (content and the template's end-of-turn token). With `{% generation %}` tags the template marks
  them; without, each assistant span is found by rendering prefixes (messages[:i] plus the
  generation prompt, then messages[:i+1]), which must tokenize as prefixes of each other, and the
  template's trailing whitespace after the turn is not trained.
- prompt_completion: strings: BOS + prompt (no loss) + completion + EOS (loss); lists of messages:
  the prompt rendered with the generation prompt, the loss on the rest of the full rendering.
SFT examples longer than seq_len are cut at seq_len (the tail is lost); an example left without a
loss token becomes an empty document (length 0), which the caller counts as dropped.
"""

from __future__ import annotations

import re
from typing import Dict, List, Optional, Sequence

from fuseforge.loss_args import IGNORE_INDEX  # pure Python: loads no torch/triton

FORMAT_COLUMNS = {"messages": ("messages",), "prompt_completion": ("prompt", "completion"), "text": ("text",)}
_GENERATION_TAG = re.compile(r"\{%-?\s*generation\s*-?%\}")


def expected_columns() -> str:
    return "; ".join(f"{fmt}: {', '.join(cols)}" for fmt, cols in FORMAT_COLUMNS.items())


def detect_format(columns: Sequence[str], requested: str, source: str, field: str = "dataset") -> str:
    """The data format of a dataset with `columns`: `requested`, checked, or (auto) found from the columns."""
    columns = list(columns)
    if requested != "auto":
        if requested not in FORMAT_COLUMNS:
            raise ValueError(f"DataSpec.data_format: unknown format {requested!r}; "
                             f"use 'auto' or one of {list(FORMAT_COLUMNS)}")
        missing = [c for c in FORMAT_COLUMNS[requested] if c not in columns]
        if missing:
            raise ValueError(f"DataSpec.{field}: {source!r} has no column {missing[0]!r} needed by data_format "
                             f"{requested!r}; its columns are {columns} (expected columns: {expected_columns()})")
        return requested
    for fmt in ("messages", "prompt_completion", "text"):
        if all(c in columns for c in FORMAT_COLUMNS[fmt]):
            return fmt
    raise ValueError(f"DataSpec.{field}: cannot tell the format of {source!r} from its columns {columns}: "
                     f"expected columns: {expected_columns()} (or set DataSpec.data_format)")


def chat_template_of(tokenizer) -> Optional[str]:
    template = getattr(tokenizer, "chat_template", None)
    if isinstance(template, dict):
        template = template.get("default") or next(iter(template.values()), None)
    return template or None


def has_generation_tags(template: str) -> bool:
    return bool(_GENERATION_TAG.search(template))


class Encoder:
    """A batched `Dataset.map` function: raw examples of one format -> documents (see the module doc).

    Output columns: input_ids, labels (int32 lists), length (0 = dropped example) and cut (1 on the
    first document of an example that was longer than seq_len).
    """

    def __init__(self, tokenizer, data_format: str, seq_len: int, *, tokenizer_name: str, source: str):
        self.tok = tokenizer
        self.format = data_format
        self.seq_len = seq_len
        self.source = source
        self.eos = tokenizer.eos_token_id
        bos = tokenizer.bos_token_id
        probe = tokenizer("a", add_special_tokens=True)["input_ids"]
        plain = tokenizer("a", add_special_tokens=False)["input_ids"]
        self.prefix = [bos] if bos is not None and probe[:1] == [bos] and plain[:1] != [bos] else []
        self._blank: Dict[int, bool] = {}
        self.template = chat_template_of(tokenizer)
        self.generation_tags = bool(self.template) and has_generation_tags(self.template)
        if data_format == "messages" and not self.template:
            raise ValueError(
                f"DataSpec.tokenizer: the tokenizer {tokenizer_name!r} has no chat template, but {source!r} is in "
                "messages format; set DataSpec.tokenizer to a tokenizer that has one (e.g. the instruct "
                "model's, or 'builtin:tiny-bpe')")

    # ------------------------------------------------------------------ helpers

    def _ids(self, texts: List[str]) -> List[List[int]]:
        return self.tok(texts, add_special_tokens=False, verbose=False)["input_ids"] if texts else []

    def _is_blank(self, token: int) -> bool:
        if token not in self._blank:
            self._blank[token] = self.tok.decode([token]).strip() == ""
        return self._blank[token]

    def _trim(self, ids: List[int], start: int, end: int) -> int:
        """`end` moved left past whitespace-only tokens (a template's separator after a turn)."""
        while end > start and self._is_blank(ids[end - 1]):
            end -= 1
        return end

    def _render(self, conversations: List[list], indices: List[int], generation_prompt: bool) -> List[str]:
        """Chat-template strings, one per conversation; an error names the example it failed on."""
        try:
            return self.tok.apply_chat_template(conversations, tokenize=False,
                                                add_generation_prompt=generation_prompt)
        except Exception:
            for conv, index in zip(conversations, indices):
                try:
                    self.tok.apply_chat_template([conv], tokenize=False, add_generation_prompt=generation_prompt)
                except Exception as err:
                    raise ValueError(f"DataSpec.dataset: the chat template failed on example {index} of "
                                     f"{self.source!r}: {type(err).__name__}: {err}") from err
            raise

    def _check_prefix(self, prefix: List[int], full: List[int], index: int, what: str) -> None:
        if full[:len(prefix)] != prefix:
            raise ValueError(
                f"DataSpec.tokenizer: the chat template does not render conversation prefixes stably "
                f"(example {index} of {self.source!r}, {what}): the tokens of the shorter rendering are not a "
                "prefix of the longer one, so the assistant spans cannot be found. Use a tokenizer whose "
                "template has {% generation %} tags, or one that renders prefixes stably")

    def _messages(self, value, index: int, column: str) -> List[dict]:
        if not isinstance(value, list) or not value or not all(
                isinstance(m, dict) and isinstance(m.get("role"), str) for m in value):
            raise ValueError(f"DataSpec.dataset: example {index} of {self.source!r}: column {column!r} must be a "
                             f"non-empty list of {{'role', 'content'}} messages, got {str(value)[:200]!r}")
        return [{k: v for k, v in m.items() if v is not None} for m in value]

    def _emit(self, out: Dict[str, list], ids: List[int], loss: List[bool]) -> None:
        """One SFT example as a document: cut at seq_len; empty when no loss token is left."""
        cut = len(ids) > self.seq_len
        ids, loss = ids[:self.seq_len], loss[:self.seq_len]
        labels = [t if keep else IGNORE_INDEX for t, keep in zip(ids, loss)]
        if labels:
            labels[0] = IGNORE_INDEX
        if all(label == IGNORE_INDEX for label in labels):
            ids, labels = [], []
        out["input_ids"].append(ids)
        out["labels"].append(labels)
        out["length"].append(len(ids))
        out["cut"].append(int(cut))

    # ------------------------------------------------------------------ formats

    def __call__(self, batch: Dict[str, list], indices: List[int]) -> Dict[str, list]:
        out: Dict[str, list] = {"input_ids": [], "labels": [], "length": [], "cut": []}
        getattr(self, "_encode_" + self.format)(batch, indices, out)
        return out

    def _encode_text(self, batch, indices, out) -> None:
        texts = batch["text"]
        for text, index in zip(texts, indices):
            if not isinstance(text, str):
                raise ValueError(f"DataSpec.dataset: example {index} of {self.source!r}: column 'text' must be "
                                 f"a string, got {type(text).__name__}")
        for ids in self._ids(list(texts)):
            ids = self.prefix + ids
            if self.eos is not None and (not ids or ids[-1] != self.eos):
                ids.append(self.eos)
            pieces = [ids[i:i + self.seq_len] for i in range(0, len(ids), self.seq_len)]
            pieces = [p for p in pieces if len(p) >= 2]
            if not pieces:
                pieces = [[]]
            for n, piece in enumerate(pieces):
                out["input_ids"].append(piece)
                out["labels"].append([IGNORE_INDEX] + piece[1:] if piece else [])
                out["length"].append(len(piece))
                out["cut"].append(int(n == 0 and len(ids) > self.seq_len))

    def _encode_messages(self, batch, indices, out) -> None:
        conversations = [self._messages(v, i, "messages") for v, i in zip(batch["messages"], indices)]
        if self.generation_tags:
            try:
                enc = self.tok.apply_chat_template(conversations, tokenize=True, return_dict=True,
                                                   return_assistant_tokens_mask=True)
            except Exception:
                self._render(conversations, indices, False)  # raises naming the example
                raise
            for ids, mask in zip(enc["input_ids"], enc["assistant_masks"]):
                self._emit(out, list(ids), [bool(m) for m in mask])
            return
        # No generation tags: tokens of each assistant turn = rendering of messages[:i+1] beyond the
        # rendering of messages[:i] with the generation prompt.
        fulls = self._ids(self._render(conversations, indices, False))
        turns = [(k, i) for k, conv in enumerate(conversations) for i, m in enumerate(conv) if m["role"] == "assistant"]
        heads = self._ids(self._render([conversations[k][:i] for k, i in turns],
                                       [indices[k] for k, _ in turns], True)) if turns else []
        upto = self._ids(self._render([conversations[k][:i + 1] for k, i in turns],
                                      [indices[k] for k, _ in turns], False)) if turns else []
        loss = [[False] * len(ids) for ids in fulls]
        for (k, i), head, done in zip(turns, heads, upto):
            self._check_prefix(head, done, indices[k], f"assistant message {i}")
            self._check_prefix(done, fulls[k], indices[k], f"the conversation up to message {i}")
            end = self._trim(done, len(head), len(done))
            for j in range(len(head), end):
                loss[k][j] = True
        for ids, mask in zip(fulls, loss):
            self._emit(out, ids, mask)

    def _encode_prompt_completion(self, batch, indices, out) -> None:
        prompts, completions = batch["prompt"], batch["completion"]
        if isinstance(prompts[0], str):
            for p, c, index in zip(prompts, completions, indices):
                if not isinstance(p, str) or not isinstance(c, str):
                    raise ValueError(f"DataSpec.dataset: example {index} of {self.source!r}: 'prompt' and "
                                     "'completion' must both be strings (or both lists of messages)")
            for p_ids, c_ids in zip(self._ids(prompts), self._ids(completions)):
                p_ids = self.prefix + p_ids
                c_ids = c_ids + ([self.eos] if self.eos is not None else [])
                self._emit(out, p_ids + c_ids, [False] * len(p_ids) + [True] * len(c_ids))
            return
        if not self.template:
            raise ValueError(
                f"DataSpec.tokenizer: {self.source!r} holds conversational prompt/completion (lists of messages) "
                "but the tokenizer has no chat template; set DataSpec.tokenizer to one that has")
        p_msgs = [self._messages(v, i, "prompt") for v, i in zip(prompts, indices)]
        c_msgs = [self._messages(v, i, "completion") for v, i in zip(completions, indices)]
        heads = self._ids(self._render(p_msgs, indices, True))
        fulls = self._ids(self._render([p + c for p, c in zip(p_msgs, c_msgs)], indices, False))
        for head, full, index in zip(heads, fulls, indices):
            self._check_prefix(head, full, index, "prompt vs prompt + completion")
            end = self._trim(full, len(head), len(full))
            self._emit(out, full, [len(head) <= j < end for j in range(len(full))])
