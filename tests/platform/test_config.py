"""platform.toml loading: the repo's file, every kind of error naming file and key, and the overrides."""

from __future__ import annotations

import json
import textwrap
from pathlib import Path

import pytest

from fuseforge_flyte.config import (
    CONFIG_PATH_ENV,
    RESOLVED_CONFIG_ENV,
    ConfigError,
    PlatformConfig,
    Toleration,
    load_config,
)

REPO = Path(__file__).resolve().parents[2]
REQUIRED = """
[image]
registry = "ghcr.io/acme"
[flyte]
project = "ml"
domain = "production"
"""


def write(tmp_path: Path, body: str, name: str = "platform.toml") -> Path:
    path = tmp_path / name
    path.write_text(textwrap.dedent(body))
    return path


def error_of(path: Path, env: dict | None = None) -> str:
    with pytest.raises(ConfigError) as info:
        load_config(path, env=env or {})
    return str(info.value)


def test_repo_platform_toml_is_valid_and_equals_builtin_defaults(tmp_path, monkeypatch):
    from_file = load_config(REPO / "platform.toml", env={})
    monkeypatch.chdir(tmp_path)  # no ./platform.toml, no FUSEFORGE_CONFIG
    builtin = load_config(env={})
    assert builtin.source == "built-in defaults"
    assert isinstance(from_file, PlatformConfig)
    assert from_file == builtin, "platform.toml and the built-in defaults in fuseforge_flyte/config have drifted apart"
    assert from_file.source.endswith("platform.toml")


def test_good_file_gives_typed_values(tmp_path):
    path = write(
        tmp_path,
        REQUIRED
        + """
        [cluster]
        gpus = 4
        cpu = 48
        memory = "512Gi"
        accelerator = "nvidia-h100"
        node_selector = { "nvidia.com/gpu.product" = "NVIDIA-H100-80GB-HBM3" }
        tolerations = [{ key = "dedicated", operator = "Equal", value = "ml", effect = "NoExecute", toleration_seconds = 30 }]
        [elastic]
        nnodes = 2
        nproc_per_node = 4
        [training]
        steps = 50
        lr = 1
        strategy = "fsdp"
        loss_chunk_size = 2048
        [checkpoint]
        dir = "s3://bucket/ckpt"
        every = 10
        """,
    )
    config = load_config(path, env={})
    assert config.image.registry == "ghcr.io/acme"
    assert config.cluster.gpus == 4 and config.cluster.cpu == "48"  # integer CPU kept as a quantity string
    assert config.cluster.tolerations == (Toleration("dedicated", "Equal", "ml", "NoExecute", 30),)
    assert config.cluster.node_selector == {"nvidia.com/gpu.product": "NVIDIA-H100-80GB-HBM3"}
    assert config.elastic.nnodes == 2
    spec = config.train_spec(seed=7)
    assert (spec.steps, spec.lr, spec.strategy, spec.seed) == (50, 1.0, "fsdp", 7)
    assert spec.loss_chunk_size == 2048 and load_config(env={}).train_spec().loss_chunk_size == 0
    assert isinstance(spec.lr, float)
    assert (spec.checkpoint_dir, spec.checkpoint_every) == ("s3://bucket/ckpt", 10)
    assert load_config(path, env={}).train_spec().checkpoint_dir == "s3://bucket/ckpt"
    assert load_config(env={}).train_spec().checkpoint_dir == ""  # the default location (cluster) or none
    assert load_config(env={}).train_spec().checkpoint_location is None
    assert spec.allow_unsigned_checkpoints is False  # refused unless opted into by name


def test_the_unsigned_checkpoint_opt_in_is_one_checkpoint_setting(tmp_path):
    path = write(tmp_path, REQUIRED + "\n[checkpoint]\nallow_unsigned_checkpoints = true\n")
    assert load_config(path, env={}).train_spec().allow_unsigned_checkpoints is True
    env = {"FUSEFORGE__CHECKPOINT__ALLOW_UNSIGNED_CHECKPOINTS": "true"}
    assert load_config(env=env).train_spec().allow_unsigned_checkpoints is True
    with pytest.raises(ConfigError, match=r"\[checkpoint\]\.allow_unsigned_checkpoints must be"):
        load_config(env={"FUSEFORGE__CHECKPOINT__ALLOW_UNSIGNED_CHECKPOINTS": '"yes"'})


FLYTE = '[flyte]\nproject = "ml"\ndomain = "production"\n'


@pytest.mark.parametrize(
    "body, expected",
    [
        ('[cluster]\ngpus = "two"', '[cluster].gpus must be an integer >= 0, got "two"'),
        ("[cluster]\ngpus = true", "[cluster].gpus must be an integer >= 0, got true"),
        ("[cluster]\ngpus = -1", "[cluster].gpus must be an integer >= 0, got -1"),
        ('[cluster]\nmemory = "lots"', '[cluster].memory must be a Kubernetes quantity such as "256Gi", got "lots"'),
        ("[cluster]\nnode_selector = { zone = 1 }", '[cluster].node_selector must be a table of strings, got {"zone": 1}'),
        ('[cluster]\ntolerations = [{ effect = "Never" }]', "[cluster].tolerations[0].effect must be one of"),
        ('[elastic]\nstart_method = "forkserver"', '[elastic].start_method must be one of "spawn", "fork", got "forkserver"'),
        ('[flyte]\ninsecure = "yes"', '[flyte].insecure must be true or false, got "yes"'),
        ('[training]\nsteps = "many"', '[training].steps must be an integer, got "many"'),
        ('[training]\nstrategy = "horovod"', "[training].strategy: 'horovod' is not one of"),
        ("[training]\nloss_chunk_size = 512.0", "[training].loss_chunk_size must be an integer, got 512.0"),
        ("[training]\nloss_chunk_size = -1", "[training].loss_chunk_size must be a finite value >= 0, got -1"),
        ('[checkpoint]\nevery = 5\ndir = "off"', "[checkpoint].every > 0 needs checkpoints, but [checkpoint].dir is 'off'"),
    ],
)
def test_wrong_type_or_value_names_file_and_key(tmp_path, body, expected):
    required = REQUIRED.replace(FLYTE, "") if body.startswith("[flyte]") else REQUIRED
    path = write(tmp_path, required + body + ('\nproject = "p"\ndomain = "d"' if body.startswith("[flyte]") else ""))
    message = error_of(path)
    assert message.startswith(f"{path}: "), message
    assert expected in message, message


@pytest.mark.parametrize(
    "text, expected",
    [
        ('[image]\nregistry = "ghcr.io/acme"\nextras = [1]\n' + FLYTE, "[image].extras[0] must be a string, got 1"),
        ('[image]\nregistry = "Not A Registry!"\n' + FLYTE, '[image].registry must be a container registry such as'),
        ("cluster = 3\n" + REQUIRED, "[cluster] must be a table, got 3"),
    ],
)
def test_wrong_type_in_required_sections(tmp_path, text, expected):
    path = write(tmp_path, text)
    message = error_of(path)
    assert message.startswith(f"{path}: ") and expected in message, message


@pytest.mark.parametrize(
    "body, expected",
    [
        ("[clustr]\ngpus = 1", 'unknown section [clustr] (known sections: image, cluster, flyte, elastic, training, checkpoint, data, tracking); did you mean "cluster"?'),
        ("[cluster]\ngpu = 1", 'unknown key [cluster].gpu'),
        ("[cluster]\ngpu = 1", 'did you mean "gpus"?'),
        ('[[cluster.tolerations]]\nkey = "a"\nsecs = 3', "unknown key [cluster].tolerations[0].secs"),
        ("[training]\nlearning_rate = 0.1", "unknown key [training].learning_rate"),
    ],
)
def test_unknown_key_names_file_and_key(tmp_path, body, expected):
    message = error_of(write(tmp_path, REQUIRED + body))
    assert message.startswith(f"{tmp_path / 'platform.toml'}: "), message
    assert expected in message, message


@pytest.mark.parametrize(
    "body, key",
    [
        ('[flyte]\nproject = "p"\ndomain = "d"', "[image].registry"),
        ('[image]\nregistry = "ghcr.io/acme"\n[flyte]\nproject = "p"', "[flyte].domain"),
    ],
)
def test_missing_required_key_names_file_and_key(tmp_path, body, key):
    path = write(tmp_path, body)
    message = error_of(path)
    assert message.startswith(f"{path}: missing required key {key}"), message


def test_cross_key_check_names_both_keys(tmp_path):
    message = error_of(write(tmp_path, REQUIRED + "[cluster]\ngpus = 4\n[elastic]\nnproc_per_node = 8"))
    assert "[elastic].nproc_per_node (8) must be <= [cluster].gpus (4)" in message


def test_workers_per_pod_follow_the_gpu_count(tmp_path):
    """[elastic].nproc_per_node defaults to one worker per GPU, and follows an overridden GPU count."""
    for gpus, workers in ((4, 4), (1, 1), (0, 1)):
        config = load_config(write(tmp_path, REQUIRED + f"[cluster]\ngpus = {gpus}"), env={})
        assert config.elastic.nproc_per_node == workers
        assert load_config(env={RESOLVED_CONFIG_ENV: config.to_json()}) == config  # the pod sees the same number
    # The repo's platform.toml says 8 GPUs and 8 workers, i.e. one per GPU: overriding the GPUs alone works.
    for env in ({"FUSEFORGE__CLUSTER__GPUS": "4"}, {}):
        config = load_config(REPO / "platform.toml", env=env)
        assert config.elastic.nproc_per_node == config.cluster.gpus
    assert load_config(REPO / "platform.toml", env={}, overrides={"cluster.gpus": "1"}).elastic.nproc_per_node == 1
    # Explicit choices are kept: fewer workers than GPUs in the file, or both overridden.
    fewer = write(tmp_path, REQUIRED + "[cluster]\ngpus = 8\n[elastic]\nnproc_per_node = 2")
    assert load_config(fewer, env={"FUSEFORGE__CLUSTER__GPUS": "4"}).elastic.nproc_per_node == 2
    both = {"FUSEFORGE__CLUSTER__GPUS": "4", "FUSEFORGE__ELASTIC__NPROC_PER_NODE": "2"}
    assert load_config(REPO / "platform.toml", env=both).elastic.nproc_per_node == 2
    # A file that sets more workers than the overridden GPU count: the message says what to do.
    six = write(tmp_path, REQUIRED + "[cluster]\ngpus = 8\n[elastic]\nnproc_per_node = 6")
    message = error_of(six, {"FUSEFORGE__CLUSTER__GPUS": "4"})
    assert message.startswith(f"{six}: [elastic].nproc_per_node (6) must be <= [cluster].gpus (4)")
    assert "[cluster].gpus comes from environment variable FUSEFORGE__CLUSTER__GPUS" in message
    assert "[elastic].nproc_per_node must be an integer >= 0" in error_of(write(tmp_path, REQUIRED + "[elastic]\nnproc_per_node = -1"))


def test_invalid_toml_names_file(tmp_path):
    path = write(tmp_path, "[cluster\ngpus = 1")
    assert error_of(path).startswith(f"{path}: invalid TOML")


def test_env_override_is_typed_and_named_in_errors(tmp_path):
    path = write(tmp_path, REQUIRED)
    env = {
        "FUSEFORGE__CLUSTER__GPUS": "4",
        "FUSEFORGE__ELASTIC__NPROC_PER_NODE": "4",
        "FUSEFORGE__IMAGE__PYTHON_VERSION": "3.11",  # a string key: not read as the float 3.11
        "FUSEFORGE__CLUSTER__NODE_SELECTOR": '{ pool = "h200" }',
        "FUSEFORGE__TRAINING__KERNELS": "false",
        "FUSEFORGE__TRAINING__LOSS_CHUNK_SIZE": "4096",
    }
    config = load_config(path, env=env)
    assert (config.cluster.gpus, config.elastic.nproc_per_node) == (4, 4)
    assert config.image.python_version == "3.11"
    assert config.cluster.node_selector == {"pool": "h200"}
    assert config.training.kernels is False and config.training.loss_chunk_size == 4096
    assert "6 override(s)" in config.source

    bad = error_of(path, {"FUSEFORGE__CLUSTER__GPUS": "two"})
    assert bad == 'environment variable FUSEFORGE__CLUSTER__GPUS: [cluster].gpus must be an integer >= 0, got "two"'
    assert "environment variable FUSEFORGE__CLUSTER__GPU: unknown key [cluster].gpu" in error_of(path, {"FUSEFORGE__CLUSTER__GPU": "1"})
    assert "expected FUSEFORGE__<SECTION>__<KEY>" in error_of(path, {"FUSEFORGE__GPUS": "1"})


def test_cli_style_overrides_are_named(tmp_path):
    path = write(tmp_path, REQUIRED)
    assert load_config(path, env={}, overrides={"training.steps": "7"}).training.steps == 7
    with pytest.raises(ConfigError, match=r"^--set training\.steps=x: \[training\]\.steps must be an integer"):
        load_config(path, env={}, overrides={"training.steps": "x"})


def test_config_file_location(tmp_path, monkeypatch):
    other = write(tmp_path, REQUIRED + "[cluster]\ngpus = 2\n[elastic]\nnproc_per_node = 2", name="other.toml")
    assert load_config(env={CONFIG_PATH_ENV: str(other)}).cluster.gpus == 2
    with pytest.raises(ConfigError, match="FUSEFORGE_CONFIG=.*missing.toml: no such config file"):
        load_config(env={CONFIG_PATH_ENV: str(tmp_path / "missing.toml")})

    monkeypatch.chdir(tmp_path)
    assert load_config(env={}).source == "built-in defaults"
    write(tmp_path, REQUIRED + "[cluster]\ngpus = 1\n[elastic]\nnproc_per_node = 1")
    local = load_config(env={})
    assert (local.cluster.gpus, local.source) == (1, "platform.toml")


def test_resolved_config_round_trips_and_wins(tmp_path):
    original = load_config(write(tmp_path, REQUIRED + "[cluster]\ngpus = 2\n[elastic]\nnproc_per_node = 2"), env={})
    env = {RESOLVED_CONFIG_ENV: original.to_json(), "FUSEFORGE__CLUSTER__GPUS": "8", CONFIG_PATH_ENV: "/nonexistent"}
    restored = load_config(env=env)
    assert restored == original  # the registered config, not the pod's file or variables
    assert restored.source == RESOLVED_CONFIG_ENV
    broken = json.loads(original.to_json())
    broken["cluster"]["gpus"] = "x"
    with pytest.raises(ConfigError, match=f"^{RESOLVED_CONFIG_ENV}: \\[cluster\\].gpus must be"):
        load_config(env={RESOLVED_CONFIG_ENV: json.dumps(broken)})


def test_env_override_values_are_toml_and_their_errors_name_the_variable(tmp_path):
    """FUSEFORGE__ variables hold TOML values (arrays of inline tables too); a bad value inside one is
    reported at its key path, naming the variable."""
    path = write(tmp_path, REQUIRED)
    tolerations = '[{ key = "dedicated", operator = "Equal", value = "ml", effect = "NoExecute", toleration_seconds = 30 }]'
    config = load_config(path, env={"FUSEFORGE__CLUSTER__TOLERATIONS": tolerations})
    assert config.cluster.tolerations == (Toleration("dedicated", "Equal", "ml", "NoExecute", 30),)
    bad = error_of(path, {"FUSEFORGE__CLUSTER__TOLERATIONS": '[{ key = "a" }, { operator = "Sometimes" }]'})
    assert bad == ('environment variable FUSEFORGE__CLUSTER__TOLERATIONS: [cluster].tolerations[1].operator '
                   'must be one of "Exists", "Equal", got "Sometimes"')


def test_env_override_names_are_case_insensitive_and_errors_use_the_name_as_set(tmp_path):
    path = write(tmp_path, REQUIRED)
    assert load_config(path, env={"fuseforge__Cluster__GPUS": "2"}).cluster.gpus == 2
    assert error_of(path, {"fuseforge__cluster__gpus": "two"}) == (
        'environment variable fuseforge__cluster__gpus: [cluster].gpus must be an integer >= 0, got "two"')


def test_env_override_of_an_unknown_section_or_a_nested_key_is_an_error(tmp_path):
    path = write(tmp_path, REQUIRED)
    assert error_of(path, {"FUSEFORGE__CLUSTR__GPUS": "1"}).startswith(
        "environment variable FUSEFORGE__CLUSTR__GPUS: unknown section [clustr] (known sections: ")
    assert error_of(path, {"FUSEFORGE__CLUSTR__GPUS": "1"}).endswith('did you mean "cluster"?')
    # a key is one name after its section: no deeper nesting into tables
    nested = error_of(path, {"FUSEFORGE__CLUSTER__NODE_SELECTOR__POOL": "h200"})
    assert nested.startswith("environment variable FUSEFORGE__CLUSTER__NODE_SELECTOR__POOL: unknown key "
                             "[cluster].node_selector__pool (known keys: gpus, "), nested
    assert "expected FUSEFORGE__<SECTION>__<KEY>" in error_of(path, {"FUSEFORGE__CLUSTER": "{ gpus = 1 }"})


@pytest.mark.parametrize(
    "body, expected",
    [
        ("[training]\nkernels = 1", "[training].kernels must be true or false, got 1"),
        ("[training]\nlr = true", "[training].lr must be a number, got true"),
        ("[training]\nmodel = 1", "[training].model must be a string, got 1"),
        ("[cluster]\ncpu = 4.5", '[cluster].cpu must be a Kubernetes quantity such as "32" or "500m", got 4.5'),
        ("[cluster]\ncpu = true", '[cluster].cpu must be a Kubernetes quantity such as "32" or "500m", got true'),
        ('[cluster]\ntolerations = [{ toleration_seconds = "30" }]', '[cluster].tolerations[0].toleration_seconds must be an integer >= 0, got "30"'),
        ('[cluster]\ntolerations = [3]', "[cluster].tolerations[0] must be a table, got 3"),
        ('[cluster]\ntolerations = "x"', '[cluster].tolerations must be a list of tables, got "x"'),
        # per table, an unknown key is reported before a bad value, and list items in order
        ('[cluster]\ngpus = "two"\ngpu = 3', "unknown key [cluster].gpu"),
        ('[cluster]\ntolerations = [{ effect = "x" }, { key = "a", b = 1 }]', "[cluster].tolerations[0].effect must be one of"),
    ],
)
def test_types_are_strict_and_the_first_problem_is_reported(tmp_path, body, expected):
    path = write(tmp_path, REQUIRED + body)
    message = error_of(path)
    assert message.startswith(f"{path}: ") and expected in message, message


def test_a_section_of_the_file_is_reported_before_a_missing_section(tmp_path):
    path = write(tmp_path, '[elastic]\nnnodes = 0\n[flyte]\nproject = "p"\ndomain = "d"')
    assert error_of(path) == f"{path}: [elastic].nnodes must be an integer >= 1, got 0"


def test_decorator_tolerations_may_be_toleration_objects():
    from fuseforge_flyte.user_task import resolve_config

    config = resolve_config(load_config(REPO / "platform.toml", env={}),
                            {"tolerations": [Toleration("dedicated", "Equal", "ml", "NoExecute")]})
    assert config.cluster.tolerations == (Toleration(key="dedicated", operator="Equal", value="ml", effect="NoExecute"),)
    assert config.to_dict()["cluster"]["tolerations"] == [
        {"key": "dedicated", "operator": "Equal", "value": "ml", "effect": "NoExecute"}]
