"""Fetch a finished execution's metrics and trained model with FlyteRemote, and ask the model a question.

    python scripts/fetch_model.py --config ~/.flyte/config.yaml EXECUTION [--project P --domain D] [--to DIR]
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("execution", help="the execution's name (the last part of its console URL)")
    parser.add_argument("--config", required=True, help="the pyflyte/flytectl config file")
    parser.add_argument("--project", default="fuseforge")
    parser.add_argument("--domain", default="development")
    parser.add_argument("--to", default="", help="copy the model directory here (default: only print where it is)")
    parser.add_argument("--question", default="What is the capital of France?")
    args = parser.parse_args(argv)

    from flytekit.configuration import Config
    from flytekit.core.context_manager import FlyteContextManager
    from flytekit.remote import FlyteRemote

    from fuseforge_flyte import quiet

    quiet.keep_torchao_unimported()  # before transformers: no torchao deprecation lines
    from transformers import AutoModelForCausalLM, AutoTokenizer

    quiet.disable_progress_bars()

    remote = FlyteRemote(Config.auto(config_file=args.config), default_project=args.project,
                         default_domain=args.domain)
    execution = remote.sync_execution(remote.fetch_execution(name=args.execution))
    if execution.closure.phase != 4:  # SUCCEEDED
        error = execution.closure.error.message if execution.closure.error else "not finished"
        print(f"execution {args.execution} did not succeed: {error}", file=sys.stderr)
        return 1
    metrics = execution.outputs["metrics"]
    print(f"steps {metrics.steps}, final loss {metrics.final_loss:.4f}, {metrics.tokens_per_s:,.0f} tokens/s, "
          f"peak memory {metrics.peak_memory_gib:.2f} GiB")
    with FlyteContextManager.with_context(remote.context.new_builder()):  # the config's object-store keys
        path = execution.outputs["model"].download()
    if args.to:
        path = shutil.copytree(path, args.to, dirs_exist_ok=True)
    print(f"model: {path}")
    tokenizer, model = AutoTokenizer.from_pretrained(path), AutoModelForCausalLM.from_pretrained(path)
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": args.question}], add_generation_prompt=True,
                                           return_dict=True, return_tensors="pt")
    answer = model.generate(**prompt, max_new_tokens=24, do_sample=False)[0][prompt["input_ids"].shape[1]:]
    print(f"Q: {args.question}\nA: {tokenizer.decode(answer, skip_special_tokens=True)}")
    return 0


if __name__ == "__main__":
    code = main()
    sys.stdout.flush()
    sys.stderr.flush()
    # flytekit's object-store session lives on its own event-loop thread, which interpreter shutdown stops before
    # the session is closed: a normal exit prints asyncio's "Unclosed client session" errors for nothing.
    os._exit(code)
