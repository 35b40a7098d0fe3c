"""The README's demo through the real control plane, as a user runs and watches it: `pyflyte run --remote`,
the execution and its nodes as the console reads them from Flyte's admin API, the trained model fetched
with FlyteRemote and answered by plain transformers, the Deck rendered in Chromium, and the pods that
Flyte created carrying what the chart promises."""

from __future__ import annotations

import os
import shutil
import subprocess

import pytest

from remote import (NAMESPACE, ROOT, SUCCEEDED, audited_creations, download, execution_error, flyte_remote,
                    run_remote, task_node, wait, walk_nodes)

pytestmark = [pytest.mark.cluster, pytest.mark.xdist_group("cluster")]

STEPS = 6
# Kept for a person to look at (CI prints the path): the Deck as Chromium rendered it.
ARTIFACTS = ROOT / ".ci-artifacts"


@pytest.fixture(scope="module")
def demo(platform, tmp_path_factory):
    folder = tmp_path_factory.mktemp("demo")
    name = run_remote(folder, "workflows/fuseforge_flyte/workflows.py", "demo", "--steps", str(STEPS),
                      "--eval_every", "3")
    remote = flyte_remote()
    execution = wait(name, remote=remote)
    assert execution.closure.phase == SUCCEEDED, execution_error(execution)
    return name, execution, remote, folder


def test_every_node_succeeded_with_durations_and_logs(demo):
    _, execution, _, _ = demo
    nodes = dict(walk_nodes(execution.node_executions))
    tasks = {n.task_executions[0].id.task_id.name.rsplit(".", 1)[-1]: n for n in nodes.values() if n.task_executions}
    assert {"fingerprint_data", "prepare_data", "train_model", "sample_model"} <= set(tasks), sorted(tasks)
    for path, node in nodes.items():
        assert node.closure.phase == 3, (path, node.closure.phase)  # NodeExecution.Phase SUCCEEDED
        assert node.closure.duration.total_seconds() > 0, path
    trained = tasks["train_model"].task_executions[-1]
    assert trained.closure.duration.total_seconds() > 0
    # The console's "logs" column comes from the task execution; the pod it ran in is named in its metadata.
    assert trained.closure.metadata.external_resources or trained.closure.logs is not None


def test_the_trained_model_is_fetched_and_answers_with_plain_transformers(demo, tmp_path):
    from flytekit.core.context_manager import FlyteContextManager
    from fuseforge_flyte.sampling import Samples
    from transformers import AutoModelForCausalLM, AutoTokenizer

    _, execution, remote, _ = demo
    metrics = execution.outputs["metrics"]
    assert metrics.steps == STEPS and 0 < metrics.final_loss < metrics.loss_curve[0] * 2
    samples = execution.outputs.get("samples", as_type=Samples)
    assert len(samples.prompts) == len(samples.answers) == 3, samples
    model = execution.outputs["model"]
    assert model.remote_source.startswith("s3://fuseforge-flyte/"), model.remote_source
    with FlyteContextManager.with_context(remote.context.new_builder()):
        path = model.download()
    tokenizer = AutoTokenizer.from_pretrained(path)
    lm = AutoModelForCausalLM.from_pretrained(path)
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}],
                                           add_generation_prompt=True, return_dict=True, return_tensors="pt")
    answer = lm.generate(**prompt, max_new_tokens=8, do_sample=False)[0][prompt["input_ids"].shape[1]:]
    assert len(answer) > 0 and isinstance(tokenizer.decode(answer), str)


def test_the_training_deck_renders_in_chromium(demo, tmp_path):
    chromium = shutil.which("chromium")
    if chromium is None:
        pytest.fail("chromium is not installed: `bash scripts/cluster.sh deps` installs it")
    _, execution, remote, _ = demo
    deck_uri = task_node(execution, "train_model").closure.deck_uri
    assert deck_uri.startswith("s3://"), deck_uri
    html = download(remote, deck_uri, tmp_path / "deck.html")
    env = dict(os.environ, HOME=str(tmp_path))
    flags = [chromium, "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars", "--window-size=1600,1400"]
    dom = subprocess.run([*flags, "--dump-dom", html.as_uri()], capture_output=True, text=True, env=env,
                         timeout=120).stdout
    assert "Training metrics" in dom and "final loss" in dom.lower(), dom[:2000]
    assert 'alt="loss, throughput and memory per step"' in dom
    ARTIFACTS.mkdir(exist_ok=True)
    png = ARTIFACTS / "training-deck.png"
    subprocess.run([*flags, f"--screenshot={png}", html.as_uri()], capture_output=True, env=env, timeout=120,
                   check=True)
    from PIL import Image

    image = Image.open(png).convert("L")
    low, high = image.getextrema()
    assert image.size == (1600, 1400) and high - low > 100, "the screenshot is blank"
    print(f"Deck screenshot: {png}")


def test_pods_carry_what_the_chart_promises(demo):
    name, _, _, _ = demo
    pods = {p["metadata"]["name"]: p for p in audited_creations("pods", name)}
    assert pods, "no pod of the execution in the audit log"
    for pod in pods.values():
        spec = pod["spec"]
        assert all(c["image"] == "127.0.0.1:15000/fuseforge:local" for c in spec["containers"])
        assert spec["securityContext"]["runAsNonRoot"] is True
        assert spec["securityContext"]["runAsUser"] == 1001
        assert spec["securityContext"]["seccompProfile"]["type"] == "RuntimeDefault"
        for container in spec["containers"]:
            assert container["securityContext"]["allowPrivilegeEscalation"] is False
            # ["ALL", "ALL"]: propeller appends the lists of the default and the GPU PodTemplate when merging them.
            assert set(container["securityContext"]["capabilities"]["drop"]) == {"ALL"}
    training = [p for p in pods.values() if p["spec"]["containers"][0].get("resources", {}).get("limits", {}).get("nvidia.com/gpu")]
    assert len(training) == 1, sorted(pods)
    spec = training[0]["spec"]
    primary = spec["containers"][0]
    assert primary["resources"]["limits"]["nvidia.com/gpu"] == "2"
    assert spec["serviceAccountName"] == "fuseforge-training"
    assert spec.get("automountServiceAccountToken") is False
    assert {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"} in spec["tolerations"]
    assert spec["nodeSelector"]["nvidia.com/gpu.present"] == "true"
    volumes = {v["name"]: v for v in spec["volumes"]}
    shm = next(v for v in volumes.values() if v.get("emptyDir", {}).get("medium") == "Memory")
    assert shm["emptyDir"]["sizeLimit"] == "2Gi"
    mounts = {m["mountPath"]: m for m in primary["volumeMounts"]}
    assert "/dev/shm" in mounts
    env = {e["name"]: e for e in primary["env"]}
    assert env["FUSEFORGE_CHECKPOINT_REQUIRE_KEY"]["value"] == "1"
    key_file = env["FUSEFORGE_CHECKPOINT_KEY_FILE"]["value"]
    key_mount = next(m for path, m in mounts.items() if key_file.startswith(path + "/"))
    assert key_mount.get("readOnly") is True
    assert volumes[key_mount["name"]]["secret"]["secretName"]
    # The data pods carry no GPU and run without the training service account.
    others = [p for p in pods.values() if p is not training[0]]
    assert others and all(p["spec"].get("serviceAccountName") != "fuseforge-training" for p in others)
    assert all(p["metadata"]["namespace"] == NAMESPACE for p in pods.values())
