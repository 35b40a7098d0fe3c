"""What the LoRA tests share: loading an adapter and a merged model the way a user without fuseforge would."""

import json
import os
import subprocess
import sys
import textwrap

import torch

LOAD_WITHOUT_FUSEFORGE = textwrap.dedent("""
    import json, sys
    sys.modules["fuseforge"] = None          # as if fuseforge were not installed
    import torch, transformers, peft
    base_dir, adapter_dir, merged_dir, ids_path, out_path = sys.argv[1:]
    ids = torch.load(ids_path)
    base = transformers.AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    adapted = peft.PeftModel.from_pretrained(base, adapter_dir).eval()
    merged = transformers.AutoModelForCausalLM.from_pretrained(merged_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        torch.save({"adapter": adapted(input_ids=ids).logits, "merged": merged(input_ids=ids).logits}, out_path)
    print(json.dumps({"fuseforge": [m for m in sys.modules if m.startswith("fuseforge") and sys.modules[m]]}))
""")


def load_without_fuseforge(base_dir: str, adapter_dir: str, merged_dir: str, ids: torch.Tensor, tmp_path) -> dict:
    """{"adapter": logits of the base with the adapter (plain peft), "merged": the merged model's (plain
    transformers)} for `ids`, computed in a subprocess that cannot import fuseforge."""
    torch.save(ids.cpu(), tmp_path / "ids.pt")
    proc = subprocess.run([sys.executable, "-c", LOAD_WITHOUT_FUSEFORGE, base_dir, adapter_dir, merged_dir,
                           str(tmp_path / "ids.pt"), str(tmp_path / "logits.pt")], capture_output=True, text=True,
                          timeout=300, cwd=str(tmp_path), env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert json.loads(proc.stdout.strip().splitlines()[-1]) == {"fuseforge": []}
    return torch.load(tmp_path / "logits.pt")
