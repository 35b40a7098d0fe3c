"""Answers from a trained model directory through plain transformers (no fuseforge): the check that
what a run returned loads and generates as any Hugging Face model does. Also a command line::

    python -m fuseforge_flyte.sampling outputs/<run>/model "What is the capital of France?" "Hi there."
"""

from __future__ import annotations

import argparse
import html
import sys
from dataclasses import dataclass, field
from typing import List, Optional, Sequence


@dataclass
class Samples:
    """Prompts and the model's answers, printed side by side."""

    prompts: List[str] = field(default_factory=list)
    answers: List[str] = field(default_factory=list)

    def __str__(self) -> str:
        return "\n".join(f"  {prompt} -> {answer}" for prompt, answer in zip(self.prompts, self.answers))

    def __repr__(self) -> str:
        """What pyflyte prints inside the output tuple: the pairs from a line of their own."""
        return "\n" + str(self)


def generate(model_dir: str, prompts: Sequence[str], *, max_new_tokens: int = 32) -> List[str]:
    """Greedy answers to each prompt, as a user turn through the chat template when there is one."""
    import torch

    from fuseforge_flyte.quiet import quiet_third_party

    quiet_third_party(cuda=False)  # before transformers loads its model code; generation runs on the CPU
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    answers = []
    for prompt in prompts:
        if tokenizer.chat_template:
            ids = tokenizer.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True,
                                                return_dict=True, return_tensors="pt")["input_ids"]
        else:
            ids = tokenizer(prompt, return_tensors="pt")["input_ids"]
        with torch.no_grad():
            out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
                                 do_sample=False, pad_token_id=tokenizer.pad_token_id or tokenizer.eos_token_id)
        answers.append(tokenizer.decode(out[0, ids.shape[1]:], skip_special_tokens=True).strip())
    return answers


def samples_html(prompts: Sequence[str], answers: Sequence[str]) -> str:
    rows = "".join(f"<tr><td>{html.escape(p)}</td><td>{html.escape(a)}</td></tr>" for p, a in zip(prompts, answers))
    return f"<table><tr><th>prompt</th><th>answer</th></tr>{rows}</table>"


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m fuseforge_flyte.sampling",
                                     description="Answer prompts with a trained model directory (greedy).")
    parser.add_argument("model_dir", help="a Hugging Face model directory, e.g. outputs/<run>/model")
    parser.add_argument("prompts", nargs="+", help="questions, each a user turn of the chat template")
    parser.add_argument("--max_new_tokens", type=int, default=32)
    args = parser.parse_args(argv)
    answers = generate(args.model_dir, args.prompts, max_new_tokens=args.max_new_tokens)
    print(Samples(prompts=list(args.prompts), answers=answers))
    return 0


if __name__ == "__main__":
    sys.exit(main())
