"""Regenerate the shipped assets: `tiny_chat.jsonl`, `tiny_preferences.jsonl` and the `tiny-bpe` tokenizer.

    python -m fuseforge_flyte.data.build_assets [--out DIR]

Deterministic (fixed seed, single-threaded BPE training), so the shipped files are exactly this
script's output. The chat set is template-generated (arithmetic, capitals, word reversal, counting,
unit conversions, greetings) so that a tiny model can visibly learn its patterns. The preference set
pairs each question with its answer (chosen) and the answer to another question of the same kind
(rejected), so a preference-trained tiny model visibly learns to tell them apart.
"""

from __future__ import annotations

import argparse
import json
import os
import random
from typing import Dict, List

from fuseforge_flyte.data.builtin import CHAT_FILE, CORPUS_FILE, PREFERENCES_FILE, TOKENIZER_DIR, assets_dir

BOS, END, PAD = "<|bos|>", "<|end|>", "<|pad|>"
ROLE_TOKENS = ["<|system|>", "<|user|>", "<|assistant|>"]
SPECIAL_TOKENS = [BOS, END, PAD] + ROLE_TOKENS
VOCAB_SIZE = 1024
NUM_CONVERSATIONS = 480
NUM_PREFERENCES = 320
SEED = 20261203

# Assistant content and the end token after it are inside {% generation %}, so
# apply_chat_template(..., return_assistant_tokens_mask=True) marks exactly what is trained on.
CHAT_TEMPLATE = (
    "{{- bos_token -}}"
    "{%- for message in messages -%}"
    "{%- if message['role'] == 'assistant' -%}"
    "{{- '<|assistant|>\\n' -}}{% generation %}{{- message['content'] + '<|end|>' -}}{% endgeneration %}"
    "{{- '\\n' -}}"
    "{%- else -%}"
    "{{- '<|' + message['role'] + '|>\\n' + message['content'] + '<|end|>\\n' -}}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|assistant|>\\n' -}}{%- endif -%}"
)

CAPITALS = [
    ("France", "Paris"), ("Germany", "Berlin"), ("Italy", "Rome"), ("Spain", "Madrid"), ("Portugal", "Lisbon"),
    ("Japan", "Tokyo"), ("China", "Beijing"), ("India", "New Delhi"), ("Canada", "Ottawa"),
    ("Australia", "Canberra"), ("Brazil", "Brasilia"), ("Argentina", "Buenos Aires"), ("Egypt", "Cairo"),
    ("Kenya", "Nairobi"), ("Norway", "Oslo"), ("Sweden", "Stockholm"), ("Finland", "Helsinki"),
    ("Poland", "Warsaw"), ("Greece", "Athens"), ("Turkey", "Ankara"), ("Mexico", "Mexico City"),
    ("Peru", "Lima"), ("Chile", "Santiago"), ("Ireland", "Dublin"), ("Austria", "Vienna"),
    ("Hungary", "Budapest"), ("Russia", "Moscow"), ("Thailand", "Bangkok"), ("Vietnam", "Hanoi"),
    ("Morocco", "Rabat"), ("Ghana", "Accra"), ("Denmark", "Copenhagen"), ("Belgium", "Brussels"),
    ("Netherlands", "Amsterdam"), ("Switzerland", "Bern"), ("Cuba", "Havana"), ("Iceland", "Reykjavik"),
    ("Nepal", "Kathmandu"), ("Indonesia", "Jakarta"), ("South Korea", "Seoul"),
]
WORDS = [
    "apple", "river", "garden", "window", "pencil", "bridge", "candle", "forest", "winter", "summer",
    "planet", "rocket", "silver", "orange", "dragon", "castle", "butter", "mirror", "ladder", "pocket",
    "yellow", "basket", "flower", "market", "saddle", "kitten", "lemon", "tiger", "cloud", "stone",
    "bread", "light", "music", "paper", "water", "horse", "table", "chair", "green", "night",
]
UNITS = [  # (question unit, answer unit, factor)
    ("kilometers", "meters", 1000), ("meters", "centimeters", 100), ("kilograms", "grams", 1000),
    ("hours", "minutes", 60), ("minutes", "seconds", 60), ("days", "hours", 24), ("weeks", "days", 7),
]
SYSTEM_PROMPTS = ["You are a helpful assistant.", "You are a concise assistant. Answer in one sentence."]
GREETINGS = [("Hello!", "Hello! How can I help you today?"), ("Hi there.", "Hi! What can I do for you?"),
             ("Good morning!", "Good morning! How can I help?")]
CLOSINGS = [("Thank you!", "You are welcome!"), ("Thanks, that helps.", "Glad I could help."),
            ("Goodbye.", "Goodbye! Have a nice day.")]


def _arithmetic(rng: random.Random):
    op = rng.choice(["plus", "minus", "times"])
    if op == "times":
        a, b = rng.randint(2, 12), rng.randint(2, 12)
        c = a * b
    else:
        a, b = rng.randint(1, 60), rng.randint(1, 60)
        if op == "minus" and b > a:
            a, b = b, a
        c = a + b if op == "plus" else a - b
    question = rng.choice([f"What is {a} {op} {b}?", f"Can you tell me what {a} {op} {b} is?"])
    return question, f"{a} {op} {b} is {c}."


def _capital(rng: random.Random):
    country, capital = rng.choice(CAPITALS)
    return f"What is the capital of {country}?", f"The capital of {country} is {capital}."


def _reverse(rng: random.Random):
    word = rng.choice(WORDS)
    return f"Reverse the word '{word}'.", f"The word '{word}' reversed is '{word[::-1]}'."


def _letters(rng: random.Random):
    word = rng.choice(WORDS)
    return f"How many letters are in the word '{word}'?", f"The word '{word}' has {len(word)} letters."


def _count(rng: random.Random):
    a = rng.randint(1, 20)
    b = a + rng.randint(2, 6)
    return f"Count from {a} to {b}.", ", ".join(str(i) for i in range(a, b + 1)) + "."


def _units(rng: random.Random):
    src, dst, factor = rng.choice(UNITS)
    n = rng.randint(1, 9)
    return f"How many {dst} are in {n} {src}?", f"{n} {src} is {n * factor} {dst}."


TASKS = [_arithmetic, _capital, _reverse, _letters, _count, _units]


def make_conversation(rng: random.Random) -> List[Dict[str, str]]:
    """One to three user/assistant turns, sometimes with a system message and a greeting or closing."""
    messages: List[Dict[str, str]] = []
    if rng.random() < 0.3:
        messages.append({"role": "system", "content": rng.choice(SYSTEM_PROMPTS)})
    turns = rng.choice([1, 1, 2, 3])
    pairs = [rng.choice(TASKS)(rng) for _ in range(turns)]
    if turns > 1 and rng.random() < 0.3:
        pairs[0] = rng.choice(GREETINGS)
    if turns > 1 and rng.random() < 0.3:
        pairs[-1] = rng.choice(CLOSINGS)
    for question, answer in pairs:
        messages.append({"role": "user", "content": question})
        messages.append({"role": "assistant", "content": answer})
    return messages


def make_chat(n: int = NUM_CONVERSATIONS, seed: int = SEED) -> List[List[Dict[str, str]]]:
    rng = random.Random(seed)
    return [make_conversation(rng) for _ in range(n)]


def write_chat(path: str, conversations: List[List[Dict[str, str]]]) -> None:
    write_jsonl(path, [{"messages": messages} for messages in conversations])


def write_jsonl(path: str, rows: List[dict]) -> None:
    with open(path, "w", encoding="utf-8", newline="\n") as handle:
        for row in rows:
            handle.write(json.dumps(row, ensure_ascii=False) + "\n")


def make_preference(rng: random.Random) -> Dict[str, List[Dict[str, str]]]:
    """A conversational prompt / chosen / rejected row: the rejected answer answers another question of the
    same kind (a wrong capital, sum, count...), so only the question tells the two apart."""
    task = rng.choice(TASKS)
    question, answer = task(rng)
    other_question, other = task(rng)
    while other == answer or other_question == question:
        other_question, other = task(rng)
    prompt = [{"role": "system", "content": rng.choice(SYSTEM_PROMPTS)}] if rng.random() < 0.3 else []
    prompt.append({"role": "user", "content": question})
    return {"prompt": prompt, "chosen": [{"role": "assistant", "content": answer}],
            "rejected": [{"role": "assistant", "content": other}]}


def make_preferences(n: int = NUM_PREFERENCES, seed: int = SEED + 1) -> List[Dict[str, List[Dict[str, str]]]]:
    rng = random.Random(seed)
    return [make_preference(rng) for _ in range(n)]


def train_tokenizer(texts: List[str], out_dir: str) -> None:
    """Byte-level BPE over `texts`, wrapped as a PreTrainedTokenizerFast with the chat template."""
    os.environ["RAYON_NUM_THREADS"] = "1"  # single-threaded training: the same merges every time
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=VOCAB_SIZE, special_tokens=SPECIAL_TOKENS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(texts, trainer=trainer)
    wrapped = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token=BOS, eos_token=END, pad_token=PAD, add_bos_token=True,
        add_eos_token=False, extra_special_tokens=ROLE_TOKENS, model_max_length=1 << 20,
        clean_up_tokenization_spaces=False,
    )
    wrapped.chat_template = CHAT_TEMPLATE
    os.makedirs(out_dir, exist_ok=True)
    wrapped.save_pretrained(out_dir)


def build(out: str) -> None:
    conversations = make_chat()
    write_chat(os.path.join(out, CHAT_FILE), conversations)
    write_jsonl(os.path.join(out, PREFERENCES_FILE), make_preferences())
    with open(os.path.join(assets_dir(), CORPUS_FILE), encoding="utf-8") as handle:
        texts = [block.strip() for block in handle.read().split("\n\n") if block.strip()]
    texts += [m["content"] for messages in conversations for m in messages]
    train_tokenizer(texts, os.path.join(out, TOKENIZER_DIR))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=assets_dir(), help="assets directory to write (default: the package's)")
    build(parser.parse_args().out)


if __name__ == "__main__":
    main()
