"""A clean run prints fuseforge's progress and summary, nothing else: each third-party message is off at its source
(fuseforge_flyte/quiet.py). Fresh processes, since each message is printed once per process at import."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
PYFLYTE = os.path.join(os.path.dirname(sys.executable), "pyflyte")


def _python(code: str, tmp_path) -> subprocess.CompletedProcess:
    env = dict(os.environ, TRITON_INTERPRET="1")
    env.pop("DS_ACCELERATOR", None)
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], cwd=tmp_path, env=env, capture_output=True,
                          text=True, timeout=300)


def test_loading_and_saving_a_model_imports_no_torchao_and_prints_nothing(tmp_path):
    """The workflows and the engine's model code load transformers' model classes; that imported torchao (two
    torch deprecation warnings per process, more on a torch it was not built for). Saving imported DeepSpeed
    through accelerate, which printed "Setting accelerator to CPU" on stdout, and showed a progress bar."""
    done = _python("""
        import sys, torch
        import fuseforge_flyte.workflows
        from fuseforge_flyte.training.models import build_model
        model = build_model("tiny-llama", seed=0, device=torch.device("cpu"))
        model.save_pretrained("saved")
        print("torchao imported:", "torchao" in sys.modules)
    """, tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip() == "torchao imported: False"
    assert done.stderr == "", done.stderr[-3000:]


def test_fp8_still_imports_torchao(tmp_path):
    done = _python("""
        import fuseforge_flyte.workflows
        import torchao.float8
        print(torchao.float8.Float8LinearConfig.__name__)
    """, tmp_path)
    assert done.returncode == 0 and done.stdout.strip() == "Float8LinearConfig", done.stderr[-2000:]


def test_pyflyte_does_not_warn_about_bool_options_of_the_examples(tmp_path):
    done = subprocess.run([PYFLYTE, "run", str(REPO / "examples" / "flyte" / "trainer_sft.py"), "sft_workflow",
                           "--help"], cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "is used more than once" not in done.stdout + done.stderr
    assert "register_constant" not in done.stderr


def test_a_local_launch_sends_the_agents_failure_records_to_one_log_file(tmp_path):
    """The agent's records about stopping workers (WARNING) and a worker's failure (ERROR) go to the log file; the
    console gets one line naming it, and only for the failure (a stopped worker alone prints nothing)."""
    done = _python(f"""
        import logging, os
        os.environ["FUSEFORGE_CACHE"] = {str(tmp_path)!r}
        from fuseforge_flyte.quiet import ELASTIC_AGENT_LOGGER, worker_failures_to_log_file
        agent = logging.getLogger(ELASTIC_AGENT_LOGGER)
        logging.basicConfig(level=logging.INFO)
        with worker_failures_to_log_file() as path:
            agent.info("started")
            agent.warning("Sending process 123 closing signal SIGTERM")
            logging.getLogger("torch.multiprocessing.spawn").warning("Terminating process 124 via signal SIGTERM")
            print("AFTER-WARNING", flush=True)
            agent.error("failed (exitcode: 1) local_rank: 1 ... Traceback (most recent call last)")
        print("LOG", path)
    """, tmp_path)
    assert done.returncode == 0, done.stderr
    log_path = done.stdout.split("LOG ", 1)[1].strip()
    written = Path(log_path).read_text()
    assert "closing signal SIGTERM" in written and "Terminating process" in written and "Traceback" in written
    assert "SIGTERM" not in done.stderr and "Traceback" not in done.stderr, done.stderr
    assert done.stderr.count("torch elastic's report with its traceback") == 1, done.stderr
    assert "started" in done.stderr  # records below WARNING pass as before
