"""The cluster install, checked offline with a real helm (fetched by scripts/get_helm.sh).

charts/fuseforge is rendered for the default and a multi-node/multi-GPU values file, every manifest is
validated against the Kubernetes JSON schemas (kubernetes-validate, offline), the GPU PodTemplate,
RBAC scopes and platform.toml are asserted, and bad values must be rejected by values.schema.json.

The whole release is rendered offline, Flyte included: the flyte-binary chart Chart.lock pins is
vendored as charts/fuseforge/charts/flyte-binary-<version>.tgz (see charts/fuseforge/README.md), so the
Flyte Deployment, its config and RBAC are rendered from the real chart and checked against what our
values set. Chart.lock is checked by helm itself (`helm dependency build` and `helm dependency list`).
"""

from __future__ import annotations

import base64
import copy
import fnmatch
import json
import os
import re
import shlex
import shutil
import subprocess
import tarfile
from dataclasses import dataclass
from itertools import product
from pathlib import Path
from typing import Dict, List, Sequence

import kubernetes_validate
import pytest
import yaml

from docs_text import page

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib  # type: ignore[no-redef]

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "charts" / "fuseforge"
PLATFORM_CHART = CHART / "charts" / "platform"
MULTINODE_VALUES = CHART / "ci" / "multinode-h200-values.yaml"
HELM_VERSION = "v4.1.4"
RELEASE = "fuseforge"
FLYTE_NAMESPACE = "flyte"
# The oldest Kubernetes the chart supports in practice and the newest schemas the package ships.
K8S_VERSIONS = ("1.32.0", kubernetes_validate.latest_version())
READ_ONLY_VERBS = {"get", "list", "watch"}
PYTORCHJOB_API = "kubeflow.org/v1/PyTorchJob"
YAML_LOADER = getattr(yaml, "CSafeLoader", yaml.SafeLoader)  # libyaml when there: the release is ~1300 lines
FLYTE_VERSION = next(
    d["version"] for d in yaml.safe_load((CHART / "Chart.lock").read_text())["dependencies"] if d["name"] == "flyte-binary"
)
FLYTE_ARCHIVE = CHART / "charts" / f"flyte-binary-{FLYTE_VERSION}.tgz"
FLYTE_FULLNAME = f"{RELEASE}-flyte-binary"  # flyte-binary's fullname: its Deployment and ServiceAccount


# ----------------------------------------------------------------------------------------- helm


@dataclass
class Helm:
    binary: Path
    env: Dict[str, str]

    def run(self, *args: str, timeout: int = 120) -> subprocess.CompletedProcess:
        return subprocess.run(
            [str(self.binary), *args], capture_output=True, text=True, env=self.env, timeout=timeout
        )

    def template(self, chart: Path, *args: str) -> subprocess.CompletedProcess:
        return self.run("template", RELEASE, str(chart), "--namespace", FLYTE_NAMESPACE, *args)

    def render(self, chart: Path, *args: str) -> List[dict]:
        proc = self.template(chart, *args)
        assert proc.returncode == 0, f"helm template failed:\n{proc.stderr}"
        return [doc for doc in yaml.load_all(proc.stdout, Loader=YAML_LOADER) if doc]


@pytest.fixture(scope="session")
def helm(tmp_path_factory) -> Helm:
    proc = subprocess.run(
        ["bash", str(ROOT / "scripts" / "get_helm.sh")], capture_output=True, text=True, timeout=600
    )
    if proc.returncode == 2 and not os.environ.get("CI"):
        pytest.skip(f"no helm and no npm to fetch it: {proc.stderr.strip()}")
    assert proc.returncode == 0, f"scripts/get_helm.sh failed:\n{proc.stderr}"
    # A private helm home: no user repositories, plugins or cluster credentials leak into the tests.
    home = tmp_path_factory.mktemp("helm-home")
    env = {
        **os.environ,
        "HELM_CACHE_HOME": str(home / "cache"),
        "HELM_CONFIG_HOME": str(home / "config"),
        "HELM_DATA_HOME": str(home / "data"),
        "KUBECONFIG": str(home / "no-kubeconfig"),
    }
    return Helm(Path(proc.stdout.strip()), env)


@pytest.fixture(scope="session")
def umbrella() -> Path:
    """charts/fuseforge itself, with every dependency: platform unpacked, flyte-binary vendored."""
    assert FLYTE_ARCHIVE.is_file(), f"{FLYTE_ARCHIVE.relative_to(ROOT)} is missing: see charts/fuseforge/README.md"
    return CHART


# ----------------------------------------------------------------------------------------- values


def _merge(base: dict, override: dict) -> dict:
    """Helm's coalescing of values files: maps merge, anything else replaces, null deletes."""
    for key, value in override.items():
        if value is None:
            base.pop(key, None)
        elif isinstance(value, dict) and isinstance(base.get(key), dict):
            _merge(base[key], value)
        else:
            base[key] = copy.deepcopy(value)
    return base


def platform_values(*values_files: Path) -> dict:
    """The platform subchart's effective values for the umbrella with these values files."""
    values = yaml.safe_load((PLATFORM_CHART / "values.yaml").read_text())
    for path in (CHART / "values.yaml", *values_files):
        _merge(values, yaml.safe_load(path.read_text()).get("platform") or {})
    return values


def flyte_values(*values_files: Path) -> dict:
    """What the umbrella's values files hand to flyte-binary (over flyte-binary's own defaults)."""
    values: dict = {}
    for path in (CHART / "values.yaml", *values_files):
        _merge(values, yaml.safe_load(path.read_text()).get("flyte-binary") or {})
    return values


def from_chart(docs: Sequence[dict], chart: str) -> List[dict]:
    """The manifests a (sub)chart rendered, by their helm.sh/chart label (name-version)."""
    return [
        doc for doc in docs
        if (doc["metadata"].get("labels") or {}).get("helm.sh/chart", "").rsplit("-", 1)[0] == chart
    ]


def platform_docs(docs: Sequence[dict]) -> List[dict]:
    return from_chart(docs, "platform")


@dataclass
class Rendered:
    name: str
    values: dict  # effective platform values
    release: List[dict]  # every manifest of the release: platform, Flyte, the umbrella's own

    @property
    def docs(self) -> List[dict]:
        """The platform subchart's manifests."""
        return platform_docs(self.release)

    def of_kind(self, kind: str) -> List[dict]:
        return [doc for doc in self.docs if doc["kind"] == kind]

    def one(self, kind: str, namespace: str, name: str | None = None) -> dict:
        found = [
            doc for doc in self.of_kind(kind)
            if doc["metadata"].get("namespace") == namespace and name in (None, doc["metadata"]["name"])
        ]
        assert len(found) == 1, f"expected one {kind} {name or ''} in {namespace}, found {len(found)}"
        return found[0]

    def gpu_template(self, namespace: str) -> dict:
        return self.one("PodTemplate", namespace, self.values["gpuPodTemplate"]["name"])

    @property
    def task_namespaces(self) -> List[str]:
        return [f"{p}-{d}" for p, d in product(self.values["projects"], self.values["domains"])]

    @property
    def flyte_namespace(self) -> str:
        return self.values.get("flyteNamespace") or FLYTE_NAMESPACE


SCENARIOS = {"default": (), "multinode": (MULTINODE_VALUES,)}


@pytest.fixture(scope="session", params=sorted(SCENARIOS))
def rendered(request, helm, umbrella) -> Rendered:
    files = SCENARIOS[request.param]
    args = [arg for path in files for arg in ("-f", str(path))]
    docs = helm.render(umbrella, *args)
    return Rendered(request.param, platform_values(*files), docs)


def platform_toml(configmap: dict) -> dict:
    return tomllib.loads(configmap["data"]["platform.toml"])


def primary_container(pod_template: dict) -> dict:
    # Flyte applies "primary" to the task's main container only, "default" to every container.
    containers = {c["name"]: c for c in pod_template["template"]["spec"]["containers"]}
    assert set(containers) == {"default", "primary"}
    assert "resources" not in containers["default"]  # GPUs for the main container only
    return containers["primary"]


def image_of(values: dict) -> str:
    # Flyte replaces the templates' image with the task's; without a fixed tag it is a placeholder,
    # never the implicit :latest.
    return f"{values['image']['registry']}/{values['image']['name']}:{values['image']['tag'] or 'set-by-flyte-task'}"


def toml_tolerations(tolerations: Sequence[dict]) -> List[dict]:
    renamed = {"tolerationSeconds": "toleration_seconds"}
    return [{renamed.get(k, k): v for k, v in t.items()} for t in tolerations]


# ----------------------------------------------------------------------------------------- helm itself


def test_get_helm_reuses_the_pinned_binary(helm):
    again = subprocess.run(
        ["bash", str(ROOT / "scripts" / "get_helm.sh")], capture_output=True, text=True, timeout=60
    )
    assert again.returncode == 0, again.stderr
    assert Path(again.stdout.strip()) == helm.binary
    assert "fetching" not in again.stderr  # cached: no second download
    assert helm.run("version", "--template", "{{.Version}}").stdout.strip() == HELM_VERSION


@pytest.mark.parametrize(
    "which, values_files",
    [("platform", ()), ("umbrella", ()), ("umbrella", (MULTINODE_VALUES,))],
    ids=["platform-default", "umbrella-default", "umbrella-multinode"],
)
def test_lint_strict(helm, umbrella, which, values_files):
    chart = PLATFORM_CHART if which == "platform" else umbrella
    args = [arg for path in values_files for arg in ("-f", str(path))]
    proc = helm.run("lint", "--strict", str(chart), *args)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "0 chart(s) failed" in proc.stdout


# ----------------------------------------------------------------------------------------- manifests


@pytest.mark.parametrize("k8s_version", K8S_VERSIONS)
def test_every_manifest_matches_the_kubernetes_schema(rendered, k8s_version):
    assert rendered.docs and from_chart(rendered.release, "flyte-binary")  # platform and Flyte both rendered
    for doc in rendered.release:
        where = f"{doc['kind']} {doc['metadata'].get('namespace')}/{doc['metadata']['name']}"
        try:
            kubernetes_validate.validate(doc, k8s_version, strict=True)
        except kubernetes_validate.ValidationError as exc:
            pytest.fail(f"{rendered.name}: {where} is invalid for Kubernetes {k8s_version}: {exc.message}")


def test_every_task_namespace_gets_the_platform_resources(rendered):
    # The only Role: reading the namespace's checkpoint key by name (see the RBAC tests).
    assert {doc["kind"] for doc in rendered.docs} == {
        "Namespace", "ServiceAccount", "PodTemplate", "ConfigMap", "NetworkPolicy", "Secret", "Role", "RoleBinding"
    }
    namespaces = rendered.of_kind("Namespace")
    assert [ns["metadata"]["name"] for ns in namespaces] == rendered.task_namespaces
    for ns in namespaces:  # uninstalling must not delete running jobs and their results
        assert ns["metadata"]["annotations"]["helm.sh/resource-policy"] == "keep"
    base = rendered.values["basePodTemplate"]["name"]
    for ns in rendered.task_namespaces:
        for kind in ("ServiceAccount", "ConfigMap", "Secret"):
            rendered.one(kind, ns)
        for name in ("fuseforge-task-isolation", "fuseforge-task-egress"):
            rendered.one("NetworkPolicy", ns, name)
        rendered.one("Role", ns, KEY_READER)
        rendered.one("RoleBinding", ns, KEY_READER)
        rendered.gpu_template(ns)
        rendered.one("PodTemplate", ns, base)
    # The fallback copies Flyte consults for namespaces the chart does not manage (no base template:
    # other projects' pods must not change).
    rendered.gpu_template(rendered.flyte_namespace)
    rendered.one("ConfigMap", rendered.flyte_namespace)
    assert len(rendered.of_kind("PodTemplate")) == 2 * len(rendered.task_namespaces) + 1
    assert len(rendered.of_kind("Secret")) == len(rendered.task_namespaces)  # the checkpoint keys


# ----------------------------------------------------------------------------------------- GPU PodTemplate


def test_gpu_pod_template_carries_gpus_placement_and_shm(rendered):
    tpl = rendered.values["gpuPodTemplate"]
    cfg = rendered.values["platformConfig"]
    gpus = tpl["gpus"]
    for namespace in [*rendered.task_namespaces, rendered.flyte_namespace]:
        template = rendered.gpu_template(namespace)
        spec = template["template"]["spec"]
        container = primary_container(template)
        assert container["image"] == image_of(rendered.values)

        resources = container["resources"]
        for kind in ("requests", "limits"):
            expected = {**tpl["resources"][kind], "nvidia.com/gpu": gpus}
            assert resources[kind] == expected, kind
        assert resources["requests"]["nvidia.com/gpu"] == resources["limits"]["nvidia.com/gpu"] == gpus

        assert spec["nodeSelector"] == tpl["nodeSelector"]
        assert spec["tolerations"] == tpl["tolerations"]
        assert {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"} in spec["tolerations"]
        assert spec.get("priorityClassName", "") == tpl["priorityClassName"]
        assert spec.get("schedulerName", "") == tpl["schedulerName"]

        volumes = {v["name"]: v for v in spec["volumes"]}
        mounts = {m["mountPath"]: m for m in container["volumeMounts"]}
        shm = volumes[mounts["/dev/shm"]["name"]]
        assert shm["emptyDir"] == {"medium": "Memory", "sizeLimit": tpl["shmSize"]}
        assert [m for m in container["volumeMounts"] if m["mountPath"] == "/dev/shm"] == [mounts["/dev/shm"]]

        env = {e["name"]: e.get("value") for e in container.get("env", [])}
        for extra in tpl["env"]:
            assert env[extra["name"]] == extra["value"]
        managed = namespace in rendered.task_namespaces
        if managed:
            assert spec["serviceAccountName"] == rendered.values["training"]["serviceAccount"]["name"]
            config_mount = mounts[cfg["mountPath"]]
            assert config_mount["readOnly"] is True
            assert volumes[config_mount["name"]]["configMap"]["name"] == cfg["configMapName"]
            assert env["FUSEFORGE_CONFIG"] == f"{cfg['mountPath']}/platform.toml"
        else:  # neither the ServiceAccount nor the ConfigMap exists in namespaces the chart does not manage
            assert "serviceAccountName" not in spec
            assert "FUSEFORGE_CONFIG" not in env
            assert not any("configMap" in v for v in spec["volumes"])


@pytest.mark.parametrize("gpus, shm", [(3, "7Gi"), (0, "512Mi")])
def test_gpu_count_and_shm_size_come_from_values(helm, umbrella, gpus, shm):
    docs = helm.render(
        umbrella,
        "--set", f"platform.gpuPodTemplate.gpus={gpus}",
        "--set", f"platform.gpuPodTemplate.shmSize={shm}",
    )
    templates = [d for d in docs if d["kind"] == "PodTemplate" and d["metadata"]["name"] == "fuseforge-gpu"]
    assert templates
    for template in templates:
        container = primary_container(template)
        if gpus:
            assert container["resources"]["limits"] == {"nvidia.com/gpu": gpus}
            assert container["resources"]["requests"] == {"nvidia.com/gpu": gpus}
        else:  # no GPU request at all: GPU counts are left to the tasks
            assert "resources" not in container
        (shm_volume,) = [v for v in template["template"]["spec"]["volumes"] if "emptyDir" in v]
        assert shm_volume["emptyDir"]["sizeLimit"] == shm
    from fuseforge_flyte.config import config_from_dict

    for configmap in (d for d in platform_docs(docs) if d["kind"] == "ConfigMap"):
        config = platform_toml(configmap)
        assert config["cluster"]["gpus"] == gpus
        assert "elastic" not in config  # workers per pod follow [cluster].gpus in fuseforge_flyte.config
        assert config_from_dict(config, "ConfigMap").elastic.nproc_per_node == max(gpus, 1)  # one per GPU


# ----------------------------------------------------------------------------------------- checkpoint key

KEY_SECRET = "fuseforge-checkpoint-key"  # the Secret the chart creates (checkpointKey.create)


def without_generated_keys(docs: Sequence[dict]) -> List[dict]:
    """The manifests with the checkpoint keys blanked: a render without a cluster generates new ones."""
    docs = copy.deepcopy(list(docs))
    for doc in platform_docs(docs):
        if doc["kind"] == "Secret":
            doc["data"] = dict.fromkeys(doc["data"], "")
    return docs


def key_mounts(template: dict, values: dict) -> tuple[dict, dict, dict]:
    """(env, volume mount, volume) of the checkpoint key in a GPU PodTemplate's primary container."""
    spec = template["template"]["spec"]
    container = primary_container(template)
    env = {e["name"]: e.get("value") for e in container.get("env", [])}
    mounts = [m for m in container["volumeMounts"] if m["mountPath"] == values["checkpointKey"]["mountPath"]]
    mount = mounts[0] if mounts else {}
    volumes = [v for v in spec["volumes"] if v["name"] == mount.get("name")]
    return env, mount, volumes[0] if volumes else {}


def assert_key_mounted(template: dict, values: dict, secret_name: str) -> None:
    ck = values["checkpointKey"]
    spec = template["template"]["spec"]
    env, mount, volume = key_mounts(template, values)
    key_file = f"{ck['mountPath']}/key"
    assert env["FUSEFORGE_CHECKPOINT_KEY_FILE"] == key_file
    assert env["FUSEFORGE_CHECKPOINT_REQUIRE_KEY"] == "1"  # a local copy of bucket data is verified too
    assert "FUSEFORGE_CHECKPOINT_KEY" not in env  # checkpoint.signing.configured_key refuses both at once
    assert mount == {"name": volume["name"], "mountPath": ck["mountPath"], "readOnly": True}
    # Only the Secret's one key, as the file the environment names; readable by the pod's fsGroup only.
    assert volume["secret"] == {
        "secretName": secret_name, "items": [{"key": ck["secretKey"], "path": "key"}], "defaultMode": 0o440,
    }
    assert spec["securityContext"]["fsGroup"] == values["podSecurityContext"]["fsGroup"]
    assert spec["automountServiceAccountToken"] is False
    # Not inside the platform.toml mount (a mount point in a read-only ConfigMap volume cannot be made).
    assert not key_file.startswith(values["platformConfig"]["mountPath"].rstrip("/") + "/")
    # Sidecars do not get it: only the primary (training) container.
    (default,) = [c for c in spec["containers"] if c["name"] == "default"]
    assert "env" not in default and "volumeMounts" not in default


def test_training_pods_get_a_generated_checkpoint_key(rendered):
    ck = rendered.values["checkpointKey"]
    assert ck["create"] is True and ck["existingSecret"] == ""
    keys = set()
    for namespace in rendered.task_namespaces:
        secret = rendered.one("Secret", namespace, KEY_SECRET)
        assert secret["type"] == "Opaque" and secret["immutable"] is True
        # helm uninstall leaves it (a reinstall reuses it): a lost key makes every checkpoint unverifiable.
        assert secret["metadata"]["annotations"]["helm.sh/resource-policy"] == "keep"
        assert set(secret["data"]) == {ck["secretKey"]}
        key = base64.b64decode(secret["data"][ck["secretKey"]], validate=True).decode()
        assert re.fullmatch(r"[A-Za-z0-9]{48}", key)  # randAlphaNum 48: well over the 16 bytes a key needs
        keys.add(key)
        assert_key_mounted(rendered.gpu_template(namespace), rendered.values, KEY_SECRET)
    assert len(keys) == len(rendered.task_namespaces)  # one key per namespace, not one shared
    # The fallback in the Flyte namespace: no Secret there, so neither the volume nor the variables.
    fallback = rendered.gpu_template(rendered.flyte_namespace)
    env, mount, volume = key_mounts(fallback, rendered.values)
    assert not mount and not volume
    assert not [name for name in env if name.startswith("FUSEFORGE_CHECKPOINT")]
    assert not any("secret" in v for v in fallback["template"]["spec"]["volumes"])
    assert not [s for s in rendered.of_kind("Secret") if s["metadata"]["namespace"] == rendered.flyte_namespace]
    # The base template (tasks that do not train) gets no key either.
    for namespace in rendered.task_namespaces:
        base = rendered.one("PodTemplate", namespace, rendered.values["basePodTemplate"]["name"])
        assert "volumes" not in base["template"]["spec"]


def test_training_pods_can_use_an_existing_checkpoint_key_secret(helm, umbrella, tmp_path):
    ck = {"create": False, "existingSecret": "team-checkpoint-key", "secretKey": "hmac",
          "mountPath": "/etc/fuseforge-checkpoint-key"}
    docs = helm.render(umbrella, "-f", str(_write_values(tmp_path, {"platform": {"checkpointKey": ck}})))
    rendered = Rendered("existing-key", _merge(platform_values(), {"checkpointKey": ck}), docs)
    assert not rendered.of_kind("Secret")  # the chart neither creates nor holds the key
    for namespace in rendered.task_namespaces:
        assert_key_mounted(rendered.gpu_template(namespace), rendered.values, "team-checkpoint-key")
    for doc in docs:
        kubernetes_validate.validate(doc, K8S_VERSIONS[0], strict=True)
    for template in rendered.of_kind("PodTemplate"):
        assert restricted_violations(template["template"]["spec"]) == []
    # The install notes tell how to create it.
    notes = install_notes(helm, umbrella, "-f", str(tmp_path / "values.json"))
    assert '--from-literal=hmac="$(openssl rand -hex 32)"' in notes and "team-checkpoint-key" in notes


@pytest.mark.parametrize(
    "checkpoint_key, messages",
    [
        ({"existingSecret": "mine"}, ('create is true and existingSecret is "mine"', "(create: false, existingSecret: <name>)")),
        ({"create": False}, ("create is false and no existingSecret is named", "Set create: true, or existingSecret")),
    ],
    ids=["both", "neither"],
)
def test_checkpoint_key_needs_exactly_one_source(helm, umbrella, tmp_path, checkpoint_key, messages):
    values = _write_values(tmp_path, {"platform": {"checkpointKey": checkpoint_key}})
    proc = helm.template(umbrella, "-f", str(values))
    assert proc.returncode != 0, "accepted"
    assert "don't meet the specifications of the schema" in proc.stderr  # values.schema.json refuses it
    assert "/checkpointKey/existingSecret" in proc.stderr, proc.stderr
    # and the templates too, naming both ways out, should schema validation be skipped
    proc = helm.template(umbrella, "-f", str(values), "--skip-schema-validation")
    assert proc.returncode != 0, "accepted"
    for message in messages:
        assert message in proc.stderr, proc.stderr


@pytest.mark.parametrize(
    "values, message",
    [
        ({"checkpointKey": {"mountPath": "/etc/fuseforge/key"}}, "checkpointKey.mountPath (/etc/fuseforge/key) overlaps /etc/fuseforge"),
        ({"checkpointKey": {"mountPath": "/dev/shm"}}, "checkpointKey.mountPath (/dev/shm) overlaps /dev/shm"),
        ({"podSecurityContext": {"fsGroup": None}}, "podSecurityContext.fsGroup is not set"),
    ],
    ids=["inside-platform-toml", "on-shm", "no-fsgroup"],
)
def test_checkpoint_key_mounts_that_cannot_work_are_rejected(helm, umbrella, tmp_path, values, message):
    proc = helm.template(umbrella, "-f", str(_write_values(tmp_path, {"platform": values})))
    assert proc.returncode != 0, "accepted"
    assert message in proc.stderr, proc.stderr


def test_the_chart_readme_and_the_docs_document_the_checkpoint_key():
    chart_readme = (CHART / "README.md").read_text()
    for text in (chart_readme, page("cluster/security.md")):
        assert "checkpointKey.existingSecret" in text
        assert "rotat" in text.lower()
        assert "FUSEFORGE_CHECKPOINT_KEY_FILE" in text


# ----------------------------------------------------------------------------------------- RBAC


KEY_READER = "fuseforge-checkpoint-key-reader"


def test_training_pods_get_no_api_token_and_no_role_but_their_key(rendered):
    """Training reads platform.toml from a mounted ConfigMap: no token, no ClusterRole, and one Role: reading its
    namespace's checkpoint key by name, which only the training ServiceAccount is bound to."""
    for kind in ("ClusterRole", "ClusterRoleBinding"):
        assert not rendered.of_kind(kind), kind
    sa_name = rendered.values["training"]["serviceAccount"]["name"]
    key_secret = rendered.values["checkpointKey"]["existingSecret"] or "fuseforge-checkpoint-key"
    assert {(d["metadata"]["namespace"], d["metadata"]["name"]) for d in rendered.of_kind("Role")} == {
        (ns, KEY_READER) for ns in rendered.task_namespaces}
    for namespace in rendered.task_namespaces:
        role = rendered.one("Role", namespace)
        assert role["rules"] == [{"apiGroups": [""], "resources": ["secrets"], "resourceNames": [key_secret],
                                  "verbs": ["get"]}]
        binding = rendered.one("RoleBinding", namespace)
        assert binding["roleRef"] == {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": KEY_READER}
        assert binding["subjects"] == [{"kind": "ServiceAccount", "name": sa_name, "namespace": namespace}]
    for namespace in rendered.task_namespaces:
        account = rendered.one("ServiceAccount", namespace)
        assert account["metadata"]["name"] == sa_name
        assert account["metadata"].get("annotations", {}) == rendered.values["training"]["serviceAccount"]["annotations"]
        assert account["automountServiceAccountToken"] is False
    for template in rendered.of_kind("PodTemplate"):  # also pods whose ServiceAccount mounts one
        assert template["template"]["spec"]["automountServiceAccountToken"] is False


def test_training_rbac_opt_in_is_namespaced_and_read_only(helm, umbrella, tmp_path):
    extra = [{"apiGroups": ["kubeflow.org"], "resources": ["pytorchjobs"], "verbs": ["get", "list"]}]
    training = {"serviceAccount": {"name": "trainer", "automountToken": True}, "rbac": {"create": True, "extraRules": extra}}
    api_server = {"to": [{"ipBlock": {"cidr": "10.0.0.1/32"}}], "ports": [{"port": 443, "protocol": "TCP"}]}
    network = {"egress": {"enabled": True, "apiServer": api_server}}
    values = _write_values(tmp_path, {"platform": {"training": training, "networkPolicy": network}})
    docs = helm.render(umbrella, "-f", str(values))
    rendered = Rendered("rbac", _merge(platform_values(), {"training": training}), docs)
    assert not rendered.of_kind("ClusterRole") and not rendered.of_kind("ClusterRoleBinding")
    configmap_name = rendered.values["platformConfig"]["configMapName"]
    for namespace in rendered.task_namespaces:
        # With an API token, the pods may reach the API server (only with it: see the egress tests).
        egress = rendered.one("NetworkPolicy", namespace, "fuseforge-task-egress")["spec"]["egress"]
        assert api_server in egress
        role = rendered.one("Role", namespace, "trainer")
        assert role["metadata"]["name"] == "trainer"
        for rule in role["rules"]:
            assert set(rule["verbs"]) <= READ_ONLY_VERBS, rule
            for field in ("apiGroups", "resources", "verbs", "resourceNames"):
                assert not any("*" in item for item in rule.get(field, [])), rule
            assert "secrets" not in rule["resources"], rule
        assert role["rules"] == [
            {"apiGroups": [""], "resources": ["configmaps"], "resourceNames": [configmap_name], "verbs": ["get"]},
            *extra,
        ]
        binding = rendered.one("RoleBinding", namespace, "trainer")
        assert binding["roleRef"] == {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": "trainer"}
        assert binding["subjects"] == [{"kind": "ServiceAccount", "name": "trainer", "namespace": namespace}]
        assert rendered.one("ServiceAccount", namespace)["automountServiceAccountToken"] is True
        assert rendered.gpu_template(namespace)["template"]["spec"]["automountServiceAccountToken"] is True
    # The fallback template in the Flyte namespace never mounts a token.
    assert rendered.gpu_template(rendered.flyte_namespace)["template"]["spec"]["automountServiceAccountToken"] is False
    for doc in docs:
        kubernetes_validate.validate(doc, K8S_VERSIONS[0], strict=True)

    # A Role without a token is of no use: refused, naming the value to set.
    no_token = _write_values(tmp_path, {"platform": {"training": {"rbac": {"create": True}}, "networkPolicy": network}})
    proc = helm.template(umbrella, "-f", str(no_token))
    assert proc.returncode != 0
    assert "training.rbac.create needs training.serviceAccount.automountToken: true" in proc.stderr
    # A token but no way through the egress policy to the API server: refused, naming the value to set.
    unreachable = _write_values(tmp_path, {"platform": {"training": training}})
    proc = helm.template(umbrella, "-f", str(unreachable))
    assert proc.returncode != 0
    assert "networkPolicy.egress.apiServer.to is empty" in proc.stderr and "kubectl get endpoints kubernetes" in proc.stderr


# ----------------------------------------------------------------------------------------- pod security

# What the "restricted" Pod Security Standard allows (https://kubernetes.io/docs/concepts/security/pod-security-standards/).
RESTRICTED_VOLUME_TYPES = {
    "configMap", "csi", "downwardAPI", "emptyDir", "ephemeral", "persistentVolumeClaim", "projected", "secret",
}


def restricted_violations(pod_spec: dict) -> List[str]:
    """The rules of the restricted Pod Security level (v1.25+) a pod spec breaks, as messages."""
    problems = []
    pod_ctx = pod_spec.get("securityContext", {})
    for flag in ("hostNetwork", "hostPID", "hostIPC"):
        if pod_spec.get(flag):
            problems.append(f"{flag} is set")
    for volume in pod_spec.get("volumes", []):
        kinds = set(volume) - {"name"}
        if not kinds <= RESTRICTED_VOLUME_TYPES:
            problems.append(f"volume {volume['name']} is of type {sorted(kinds)}")
    containers = pod_spec.get("containers", []) + pod_spec.get("initContainers", [])
    if not containers:
        problems.append("no containers")
    for container in containers:
        ctx = container.get("securityContext", {})
        name = container["name"]
        if ctx.get("privileged"):
            problems.append(f"{name}: privileged")
        if ctx.get("allowPrivilegeEscalation") is not False:
            problems.append(f"{name}: allowPrivilegeEscalation is not false")
        if "ALL" not in ctx.get("capabilities", {}).get("drop", []):
            problems.append(f"{name}: capabilities do not drop ALL")
        if set(ctx.get("capabilities", {}).get("add", [])) - {"NET_BIND_SERVICE"}:
            problems.append(f"{name}: adds capabilities")
        if not (ctx.get("runAsNonRoot", pod_ctx.get("runAsNonRoot")) is True):
            problems.append(f"{name}: runAsNonRoot is not true")
        if ctx.get("runAsUser", pod_ctx.get("runAsUser")) == 0:
            problems.append(f"{name}: runs as uid 0")
        seccomp = ctx.get("seccompProfile", pod_ctx.get("seccompProfile", {})).get("type")
        if seccomp not in ("RuntimeDefault", "Localhost"):
            problems.append(f"{name}: seccompProfile is {seccomp!r}, not RuntimeDefault/Localhost")
        for port in container.get("ports", []):
            if port.get("hostPort"):
                problems.append(f"{name}: hostPort")
    return problems


def test_restricted_check_catches_what_it_should():
    assert len(restricted_violations({"containers": [{"name": "c"}], "hostNetwork": True})) == 5


def test_task_pods_pass_the_restricted_pod_security_level(rendered):
    assert rendered.of_kind("PodTemplate")
    for template in rendered.of_kind("PodTemplate"):
        spec = template["template"]["spec"]
        where = f"PodTemplate {template['metadata']['namespace']}/{template['metadata']['name']}"
        assert restricted_violations(spec) == [], where
        # The image's user is named ("flytekit"): Kubernetes can only enforce runAsNonRoot on a numeric uid.
        assert spec["securityContext"]["runAsUser"] == rendered.values["podSecurityContext"]["runAsUser"] > 0
        assert spec["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
        for container in spec["containers"]:
            assert container["securityContext"]["capabilities"] == {"drop": ["ALL"]}
    for namespace in rendered.of_kind("Namespace"):
        labels = namespace["metadata"]["labels"]
        for mode in ("enforce", "warn", "audit"):
            assert labels[f"pod-security.kubernetes.io/{mode}"] == "restricted", mode


def test_image_user_matches_the_pod_security_context():
    """The uid the pods run as is the uid images/Dockerfile and the ImageSpec give the user flytekit."""
    from fuseforge_flyte.image import IMAGE_UID

    values = platform_values()
    assert values["podSecurityContext"]["runAsUser"] == values["podSecurityContext"]["runAsGroup"] == IMAGE_UID
    dockerfile = (ROOT / "images" / "Dockerfile").read_text()
    assert f"--uid {IMAGE_UID}" in dockerfile and f"USER {IMAGE_UID}" in dockerfile


def test_pod_security_level_and_labels_come_from_values(helm, umbrella, tmp_path):
    values = _write_values(tmp_path, {"platform": {"namespaces": {
        "podSecurity": {"enforce": "baseline", "warn": "restricted", "version": "v1.32"},
        "labels": {"team": "ml"},
    }}})
    docs = helm.render(umbrella, "-f", str(values))
    for namespace in (d for d in docs if d["kind"] == "Namespace"):
        labels = namespace["metadata"]["labels"]
        assert labels["pod-security.kubernetes.io/enforce"] == "baseline"
        assert labels["pod-security.kubernetes.io/enforce-version"] == "v1.32"
        assert labels["pod-security.kubernetes.io/warn"] == "restricted"
        assert labels["team"] == "ml"


def flyte_deployment(docs: Sequence[dict], name: str = FLYTE_FULLNAME) -> dict:
    """flyte-binary's one Deployment in a rendered release."""
    (deployment,) = [d for d in from_chart(docs, "flyte-binary") if d["kind"] == "Deployment"]
    assert deployment["metadata"]["name"] == name
    assert deployment["metadata"]["labels"]["helm.sh/chart"] == f"flyte-binary-{FLYTE_VERSION}"  # the locked chart
    return deployment


def flyte_config(docs: Sequence[dict]) -> Dict[str, dict]:
    """flyte-binary's configuration files (its ConfigMap <fullname>-config), parsed."""
    (configmap,) = [
        d for d in from_chart(docs, "flyte-binary")
        if d["kind"] == "ConfigMap" and d["metadata"]["name"] == f"{FLYTE_FULLNAME}-config"
    ]
    return {name: yaml.safe_load(text) for name, text in configmap["data"].items()}


def test_flyte_deployment_gets_our_values(rendered):
    """What values.yaml sets for flyte-binary shows up in the rendered Deployment, config and RBAC."""
    values = flyte_values(*SCENARIOS[rendered.name])
    ours = values["deployment"]
    pod = flyte_deployment(rendered.release)["spec"]["template"]["spec"]
    containers = {c["name"]: c for c in pod["containers"]}
    init = {c["name"]: c for c in pod["initContainers"]}
    assert set(containers) == {"flyte"} and set(init) == {"wait-for-db"}  # gen-admin-auth-secret: auth only
    flyte, wait_for_db = containers["flyte"], init["wait-for-db"]
    # Images: Flyte's pinned to the locked chart's version, PostgreSQL's client to ours.
    assert flyte["image"] == f"{ours['image']['repository']}:{FLYTE_VERSION}"
    assert wait_for_db["image"] == "{repository}:{tag}".format(**ours["waitForDB"]["image"])
    # Security contexts exactly as set, and the pod passes the restricted Pod Security level.
    assert pod["securityContext"] == {k: v for k, v in ours["podSecurityContext"].items() if k != "enabled"}
    assert pod["securityContext"]["runAsUser"] > 0
    assert flyte["securityContext"] == ours["securityContext"]
    assert wait_for_db["securityContext"] == ours["waitForDB"]["securityContext"]
    assert restricted_violations(pod) == []
    # A read-only root filesystem; what Flyte writes goes to emptyDirs (its state dir, /tmp).
    assert flyte["securityContext"]["readOnlyRootFilesystem"] is True
    assert wait_for_db["securityContext"]["readOnlyRootFilesystem"] is True
    writable = {m["mountPath"]: m["name"] for m in flyte["volumeMounts"] if not m.get("readOnly")}
    volumes = {v["name"]: v for v in pod["volumes"]}
    for path in ("/tmp", "/var/run/flyte"):
        assert "emptyDir" in volumes[writable[path]], path
    # The database password: a file of the existing Secret's volume, named in Flyte's database config.
    for volume in ours["extraVolumes"]:
        assert volume in pod["volumes"]
    for mount in ours["extraVolumeMounts"]:
        assert mount in flyte["volumeMounts"]
    database = values["configuration"]["database"]
    config = flyte_config(rendered.release)
    postgres = config["002-database.yaml"]["database"]["postgres"]
    assert "password" not in postgres
    assert {k: postgres[k] for k in ("host", "port", "dbname", "username", "options", "passwordPath")} == database
    (mount,) = [m for m in flyte["volumeMounts"] if Path(m["mountPath"]) == Path(database["passwordPath"]).parent]
    (volume,) = [v for v in pod["volumes"] if v["name"] == mount["name"]]
    assert volume["secret"]["secretName"] == "fuseforge-flyte-db"
    # Task and k8s plugin settings are Flyte's last configuration file.
    assert config["100-inline-config.yaml"] == values["configuration"]["inline"]
    # Only the platform's projects are seeded (flyte-binary's defaults also seed "flytesnacks").
    admin = config["000-core.yaml"]["flyte"]["admin"]
    seeded = set(admin["seedProjects"]) | {p["name"] for p in admin["seedProjectsWithDetails"]}
    assert seeded and seeded <= set(rendered.values["projects"])
    # Flyte's ServiceAccount is bound to our ClusterRole (flyteRbac), not flyte-binary's own.
    assert not [d for d in from_chart(rendered.release, "flyte-binary") if d["kind"].endswith(("Role", "RoleBinding"))]
    (role,) = [d for d in from_chart(rendered.release, "fuseforge") if d["kind"] == "ClusterRole"]
    (binding,) = [d for d in from_chart(rendered.release, "fuseforge") if d["kind"] == "ClusterRoleBinding"]
    umbrella_values = yaml.safe_load((CHART / "values.yaml").read_text())
    assert role["rules"][: len(umbrella_values["flyteRbac"]["clusterRules"])] == umbrella_values["flyteRbac"]["clusterRules"]
    assert binding["roleRef"]["name"] == role["metadata"]["name"]
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": pod["serviceAccountName"], "namespace": FLYTE_NAMESPACE}]


def test_flyte_auth_init_container_is_pinned_and_unprivileged(helm, umbrella, tmp_path):
    ours = flyte_values()["deployment"]
    docs = helm.render(umbrella, "-f", str(_write_values(tmp_path, AUTH_ON)))
    pod = flyte_deployment(docs)["spec"]["template"]["spec"]
    (gen,) = [c for c in pod["initContainers"] if c["name"] == "gen-admin-auth-secret"]
    assert gen["image"] == f"{ours['image']['repository']}:{FLYTE_VERSION}"
    assert gen["securityContext"] == ours["genAdminAuthSecret"]["securityContext"]
    assert restricted_violations(pod) == []
    for doc in docs:
        kubernetes_validate.validate(doc, K8S_VERSIONS[0], strict=True)


# ----------------------------------------------------------------------------------------- least privilege


FLYTE_SA = ("flyte", FLYTE_FULLNAME)  # (namespace, name) of Flyte's ServiceAccount


def rbac_allows(docs: Sequence[dict], account: tuple, verb: str, group: str, resource: str, namespace: str,
                name: str = "") -> bool:
    """What `kubectl auth can-i` would answer for this ServiceAccount from these manifests alone (RBAC's
    rules: union of the bound roles; a ClusterRoleBinding everywhere, a RoleBinding in its namespace;
    resourceNames restrict to those names; "*" matches anything)."""
    roles = {(d["kind"], d["metadata"].get("namespace") if d["kind"] == "Role" else None, d["metadata"]["name"]): d
             for d in docs if d["kind"] in ("Role", "ClusterRole")}  # a ClusterRole's namespace means nothing
    subject = {"kind": "ServiceAccount", "namespace": account[0], "name": account[1]}
    for binding in docs:
        if binding["kind"] not in ("RoleBinding", "ClusterRoleBinding") or subject not in binding.get("subjects", []):
            continue
        where = binding["metadata"].get("namespace")
        if binding["kind"] == "RoleBinding" and where != namespace:
            continue
        ref = binding["roleRef"]
        role = roles.get((ref["kind"], where if ref["kind"] == "Role" else None, ref["name"]))
        for rule in (role or {}).get("rules", []):
            if (({"*", group} & set(rule.get("apiGroups", []))) and ({"*", resource} & set(rule.get("resources", [])))
                    and ({"*", verb} & set(rule.get("verbs", [])))
                    and (not rule.get("resourceNames") or name in rule["resourceNames"])):
                return True
    return False


def test_rbac_evaluator_answers_like_the_api_server():
    docs = [
        {"kind": "ClusterRole", "metadata": {"name": "c", "namespace": "ignored"},
         "rules": [{"apiGroups": [""], "resources": ["pods"], "verbs": ["get"]}]},
        {"kind": "ClusterRoleBinding", "metadata": {"name": "c", "namespace": "ignored"},
         "roleRef": {"kind": "ClusterRole", "name": "c"},
         "subjects": [{"kind": "ServiceAccount", "namespace": "a", "name": "x"}]},
        {"kind": "Role", "metadata": {"namespace": "b", "name": "r"},
         "rules": [{"apiGroups": [""], "resources": ["secrets"], "resourceNames": ["k"], "verbs": ["get"]}]},
        {"kind": "RoleBinding", "metadata": {"namespace": "b", "name": "r"}, "roleRef": {"kind": "Role", "name": "r"},
         "subjects": [{"kind": "ServiceAccount", "namespace": "a", "name": "x"}]},
    ]
    assert rbac_allows(docs, ("a", "x"), "get", "", "pods", "anywhere")
    assert not rbac_allows(docs, ("a", "x"), "list", "", "pods", "anywhere")
    assert rbac_allows(docs, ("a", "x"), "get", "", "secrets", "b", "k")
    assert not rbac_allows(docs, ("a", "x"), "get", "", "secrets", "b")  # every Secret: not granted
    assert not rbac_allows(docs, ("a", "x"), "get", "", "secrets", "c", "k")
    assert not rbac_allows(docs, ("a", "y"), "get", "", "pods", "anywhere")


# What upstream flyte-binary's ClusterRole grants and Flyte never needs outside its own namespace.
FLYTE_NEVER = [("get", "", "secrets"), ("list", "", "secrets"), ("watch", "", "secrets"), ("create", "", "secrets"),
               ("update", "", "secrets"), ("create", "", "serviceaccounts"), ("update", "", "resourcequotas"),
               ("create", "", "pods/exec"), ("get", "", "pods/log"), ("list", "", "namespaces")]


@pytest.mark.parametrize("auth", [False, True], ids=["auth-off", "auth-on"])
def test_flyte_reads_no_secrets_but_its_own_and_can_run_tasks(helm, umbrella, tmp_path, auth):
    docs = helm.render(umbrella, *(["-f", str(_write_values(tmp_path, AUTH_ON))] if auth else []))
    assert not [d for d in from_chart(docs, "flyte-binary") if "Role" in d["kind"]]  # flyte-binary's own: off
    task_namespaces = [f"fuseforge-{d}" for d in ("development", "staging", "production")]
    for namespace in [*task_namespaces, "kube-system", "default"]:
        for verb, group, resource in FLYTE_NEVER:
            assert not rbac_allows(docs, FLYTE_SA, verb, group, resource, namespace, "fuseforge-checkpoint-key"), \
                (verb, resource, namespace)
        # What running tasks needs (flyteRbac's rules, from Flyte's sources).
        for verb, group, resource in [("create", "", "pods"), ("delete", "", "pods"), ("watch", "", "pods"),
                                      ("get", "", "podtemplates"), ("create", "", "events"),
                                      ("create", "kubeflow.org", "pytorchjobs"), ("watch", "kubeflow.org", "pytorchjobs"),
                                      ("create", "flyte.lyft.com", "flyteworkflows"), ("create", "", "namespaces")]:
            assert rbac_allows(docs, FLYTE_SA, verb, group, resource, namespace), (verb, resource, namespace)
    # Its own Secrets, in its own namespace, by name: the webhook's certificate (and the admin auth secret).
    own = [f"{FLYTE_FULLNAME}-webhook-secret"] + ([f"{FLYTE_FULLNAME}-admin-auth"] if auth else [])
    for name in own:
        assert rbac_allows(docs, FLYTE_SA, "get", "", "secrets", FLYTE_NAMESPACE, name)
        assert rbac_allows(docs, FLYTE_SA, "update", "", "secrets", FLYTE_NAMESPACE, name)
    assert not rbac_allows(docs, FLYTE_SA, "get", "", "secrets", FLYTE_NAMESPACE, "fuseforge-flyte-db")
    assert not rbac_allows(docs, FLYTE_SA, "list", "", "secrets", FLYTE_NAMESPACE)
    assert rbac_allows(docs, FLYTE_SA, "update", "admissionregistration.k8s.io", "mutatingwebhookconfigurations",
                       "", f"{FLYTE_FULLNAME}-webhook")
    assert not rbac_allows(docs, FLYTE_SA, "update", "admissionregistration.k8s.io", "mutatingwebhookconfigurations",
                           "", "someone-elses-webhook")
    # The checkpoint keys: readable by the training ServiceAccount of their own namespace only.
    for namespace in task_namespaces:
        training = (namespace, "fuseforge-training")
        assert rbac_allows(docs, training, "get", "", "secrets", namespace, "fuseforge-checkpoint-key")
        assert not rbac_allows(docs, training, "list", "", "secrets", namespace)
        assert not rbac_allows(docs, (namespace, "default"), "get", "", "secrets", namespace, "fuseforge-checkpoint-key")
        others = [n for n in task_namespaces if n != namespace]
        assert not any(rbac_allows(docs, training, "get", "", "secrets", n, "fuseforge-checkpoint-key") for n in others)
    for doc in docs:
        kubernetes_validate.validate(doc, K8S_VERSIONS[0], strict=True)


def test_flyte_without_its_webhook_gets_no_webhook_or_secret_rights(helm, umbrella):
    docs = helm.render(umbrella, "--set", "flyte-binary.flyte-core-components.propeller.disableWebhook=true")
    assert not [d for d in docs if d["kind"] in ("Role", "RoleBinding") and d["metadata"]["namespace"] == FLYTE_NAMESPACE]
    assert not rbac_allows(docs, FLYTE_SA, "create", "admissionregistration.k8s.io", "mutatingwebhookconfigurations", "")
    assert not rbac_allows(docs, FLYTE_SA, "create", "", "secrets", FLYTE_NAMESPACE)


def test_flyte_binary_cluster_role_cannot_come_back_alongside(helm, umbrella):
    proc = helm.template(umbrella, "--set", "flyte-binary.rbac.create=true")
    assert proc.returncode != 0
    assert "flyte-binary.rbac.create must stay false while flyteRbac.create is true" in proc.stderr
    # Without either, Flyte's permissions are the operator's business: nothing is rendered for it.
    docs = helm.render(umbrella, "--set", "flyteRbac.create=false")
    assert not rbac_allows(docs, FLYTE_SA, "create", "", "pods", "fuseforge-development")


@pytest.mark.parametrize("rule, field", [
    ({"apiGroups": [""], "resources": ["secrets"], "verbs": ["get"]}, "/flyteRbac/extraClusterRules/0/resources/0"),
    ({"apiGroups": [""], "resources": ["*"], "verbs": ["get"]}, "/flyteRbac/extraClusterRules/0/resources/0"),
    ({"apiGroups": ["*"], "resources": ["pods"], "verbs": ["get"]}, "/flyteRbac/extraClusterRules/0/apiGroups/0"),
    ({"apiGroups": [""], "resources": ["pods"], "verbs": ["*"]}, "/flyteRbac/extraClusterRules/0/verbs/0"),
    ({"apiGroups": ["rbac.authorization.k8s.io"], "resources": ["clusterroles"], "verbs": ["escalate"]},
     "/flyteRbac/extraClusterRules/0/verbs/0"),
    ({"apiGroups": [""], "resources": ["pods/exec"], "verbs": ["create"]}, "/flyteRbac/extraClusterRules/0/resources/0"),
], ids=["secrets", "any-resource", "any-group", "any-verb", "escalate", "exec"])
def test_flyte_rules_that_would_reopen_secrets_or_wildcards_are_rejected(helm, umbrella, rule, field):
    proc = helm.template(umbrella, "--set-json", f"flyteRbac.extraClusterRules=[{json.dumps(rule)}]")
    assert proc.returncode != 0 and "don't meet the specifications of the schema" in proc.stderr
    assert field in proc.stderr, proc.stderr


# ----------------------------------------------------------------------------------------- images


IMAGE_TAG = re.compile(r"^[^@]+:(?P<tag>[A-Za-z0-9_][A-Za-z0-9_.-]*)$")


def images_in(docs: Sequence[dict]) -> List[str]:
    found = []
    for doc in docs:
        spec = doc.get("template", {}).get("spec") or doc.get("spec", {}).get("template", {}).get("spec") or {}
        for container in spec.get("containers", []) + spec.get("initContainers", []):
            found.append(container["image"])
    return found


def image_tag(image: str) -> str:
    match = IMAGE_TAG.match(image.rsplit("/", 1)[-1] if "/" in image else image)
    assert match, f"{image} has no tag (that is :latest)"
    assert match["tag"] != "latest", image
    return match["tag"]


@pytest.mark.parametrize("tag", ["", "v1.2.3"])
def test_rendered_images_always_carry_a_pinned_tag(helm, umbrella, tag):
    docs = helm.render(umbrella, "--set-string", f"platform.image.tag={tag}")
    platform_images = images_in(platform_docs(docs))
    assert platform_images
    for image in platform_images:
        assert image_tag(image) == (tag or "set-by-flyte-task"), image
    # Flyte's own pod, and the co-pilot sidecar image it puts into task pods (named in its config).
    flyte_images = images_in(from_chart(docs, "flyte-binary"))
    copilot = flyte_config(docs)["001-plugins.yaml"]["plugins"]["k8s"]["co-pilot"]["image"]
    assert len(flyte_images) == 2  # flyte, wait-for-db
    assert [image_tag(image) for image in images_in(docs)]  # every image of the release is pinned
    assert image_tag(copilot) == image_tag(flyte_deployment(docs)["spec"]["template"]["spec"]["containers"][0]["image"]) == FLYTE_VERSION


def test_flyte_images_are_pinned_to_the_locked_chart():
    flyte = yaml.safe_load((CHART / "values.yaml").read_text())["flyte-binary"]
    with tarfile.open(FLYTE_ARCHIVE) as tar:
        chart_values = yaml.safe_load(tar.extractfile("flyte-binary/values.yaml"))
    # The released chart's own default image (flyte-binary-release:<version>; the flyte-binary repository
    # has no version tags), set explicitly so that values.schema.json can refuse "latest".
    expected = {k: chart_values["deployment"]["image"][k] for k in ("repository", "tag")}
    assert flyte["deployment"]["image"] == expected == {
        "repository": "cr.flyte.org/flyteorg/flyte-binary-release", "tag": FLYTE_VERSION,
    }
    postgres = flyte["deployment"]["waitForDB"]["image"]
    assert postgres["repository"] == "postgres"
    assert re.fullmatch(r"\d+\.\d+(-alpine[\d.]*)?", postgres["tag"]), postgres  # a minor release, not "15-alpine"


# ----------------------------------------------------------------------------------------- network


def flyte_admin_policy(docs: Sequence[dict], flyte_name: str = FLYTE_FULLNAME) -> dict:
    (policy,) = [d for d in docs if d["kind"] == "NetworkPolicy" and d["metadata"]["namespace"] == FLYTE_NAMESPACE]
    # It selects exactly Flyte's pod: the rendered Deployment's selector, a subset of its pod's labels.
    deployment = flyte_deployment(docs, flyte_name)
    selector = policy["spec"]["podSelector"]["matchLabels"]
    assert selector == deployment["spec"]["selector"]["matchLabels"]
    assert selector.items() <= deployment["spec"]["template"]["metadata"]["labels"].items()
    return policy


def test_flyte_admin_is_reachable_only_from_its_namespace_and_the_ingress(helm, umbrella, tmp_path):
    docs = helm.render(umbrella)
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    policy = flyte_admin_policy(docs)
    kubernetes_validate.validate(policy, K8S_VERSIONS[0], strict=True)
    spec = policy["spec"]
    assert spec["podSelector"]["matchLabels"] == {
        "app.kubernetes.io/name": "flyte-binary", "app.kubernetes.io/instance": RELEASE,
        "app.kubernetes.io/component": "flyte-binary",
    }
    assert spec["policyTypes"] == ["Ingress"]
    api, webhook = spec["ingress"]
    assert {p["port"] for p in api["ports"]} == {8088, 8089}
    # Every port Flyte's pod opens is covered by one of the two rules.
    pod = flyte_deployment(docs)["spec"]["template"]["spec"]
    assert {p["containerPort"] for c in pod["containers"] for p in c.get("ports", [])} == {8088, 8089, 9443}
    assert api["from"] == [{"podSelector": {}}, *values["networkPolicy"]["adminFrom"]]  # own namespace + ingress
    assert "from" not in webhook and [p["port"] for p in webhook["ports"]] == [9443]  # the API server calls it
    renamed = ("--set", "flyte-binary.nameOverride=flyte")
    flyte_admin_policy(helm.render(umbrella, *renamed), f"{RELEASE}-flyte")  # still Flyte's pod

    off = helm.render(umbrella, "--set", "networkPolicy.enabled=false")
    assert not [d for d in off if d["kind"] == "NetworkPolicy" and d["metadata"]["namespace"] == FLYTE_NAMESPACE]
    without_flyte = helm.render(umbrella, "--set", "flyte-binary.enabled=false")
    assert not [d for d in without_flyte if d["kind"] == "NetworkPolicy" and d["metadata"]["namespace"] == FLYTE_NAMESPACE]


def test_task_pods_accept_connections_only_from_their_namespace(rendered):
    for namespace in rendered.task_namespaces:
        policy = rendered.one("NetworkPolicy", namespace, "fuseforge-task-isolation")
        assert policy["spec"]["podSelector"] == {}  # every pod of the namespace
        assert policy["spec"]["policyTypes"] == ["Ingress"]
        assert policy["spec"]["ingress"] == [{"from": [{"podSelector": {}}]}]
    assert not [d for d in rendered.of_kind("NetworkPolicy") if d["metadata"]["namespace"] == rendered.flyte_namespace]


PRIVATE = ["10.0.0.0/8", "172.16.0.0/12", "192.168.0.0/16", "100.64.0.0/10", "169.254.0.0/16"]


def egress_rules(docs: Sequence[dict], namespace: str) -> List[dict]:
    (policy,) = [d for d in docs if d["kind"] == "NetworkPolicy" and d["metadata"]["namespace"] == namespace
                 and d["metadata"]["name"] == "fuseforge-task-egress"]
    assert policy["spec"]["podSelector"] == {} and policy["spec"]["policyTypes"] == ["Egress"]
    rules = policy["spec"]["egress"]
    assert all(rule.get("to") for rule in rules), rules  # a rule without peers would allow any destination
    return rules


def test_task_pods_connect_only_to_dns_their_job_and_public_https_by_default(rendered):
    egress = rendered.values["networkPolicy"]["egress"]
    for namespace in rendered.task_namespaces:
        dns, same_job, public = egress_rules(rendered.docs, namespace)
        assert dns == {"to": egress["dns"]["to"], "ports": [{"port": 53, "protocol": "UDP"}, {"port": 53, "protocol": "TCP"}]}
        assert dns["to"] == [{"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "kube-system"}},
                              "podSelector": {"matchLabels": {"k8s-app": "kube-dns"}}}]
        assert same_job == {"to": [{"podSelector": {}}]}  # the pods of the namespace, i.e. of its jobs
        # HTTPS only, never the cluster's private ranges nor link-local (the cloud metadata endpoint's credentials).
        assert public == {"to": [{"ipBlock": {"cidr": "0.0.0.0/0", "except": PRIVATE}}], "ports": [{"port": 443, "protocol": "TCP"}]}
    # None in Flyte's namespace (its fallback template's pods are other projects').
    assert not [d for d in rendered.of_kind("NetworkPolicy") if d["metadata"]["namespace"] == rendered.flyte_namespace]


def test_task_egress_is_an_allow_list_from_values(helm, umbrella, tmp_path):
    store = [{"ipBlock": {"cidr": "52.218.0.0/17"}}]
    hubs = [{"ipBlock": {"cidr": "18.160.0.0/15"}}, {"namespaceSelector": {"matchLabels": {"team": "mirror"}}}]
    metadata = {"to": [{"ipBlock": {"cidr": "169.254.169.254/32"}}], "ports": [{"port": 80, "protocol": "TCP"}]}
    egress = {"objectStore": {"to": store}, "hubs": {"to": hubs, "ports": [{"port": 8443, "protocol": "TCP"}]},
              "publicHttps": False, "sameNamespace": False, "extraRules": [metadata]}
    docs = helm.render(umbrella, "-f", str(_write_values(tmp_path, {"platform": {"networkPolicy": {"egress": egress}}})))
    for namespace in ("fuseforge-development", "fuseforge-production"):
        dns, object_store, hub, extra = egress_rules(docs, namespace)
        assert dns["ports"][0]["port"] == 53
        assert object_store == {"to": store, "ports": [{"port": 443, "protocol": "TCP"}]}
        assert hub == {"to": hubs, "ports": [{"port": 8443, "protocol": "TCP"}]}
        assert extra == metadata
    for doc in docs:
        kubernetes_validate.validate(doc, K8S_VERSIONS[0], strict=True)
    off = helm.render(umbrella, "--set", "platform.networkPolicy.egress.enabled=false")
    assert not [d for d in off if d["kind"] == "NetworkPolicy" and d["metadata"]["name"] == "fuseforge-task-egress"]
    assert [d for d in off if d["kind"] == "NetworkPolicy" and d["metadata"]["name"] == "fuseforge-task-isolation"]


@pytest.mark.parametrize("args, field", [
    (["--set-json", 'platform.networkPolicy.egress.hubs.to=[{"ipBlock":{"cidr":"huggingface.co"}}]'],
     "/networkPolicy/egress/hubs/to/0/ipBlock/cidr"),
    (["--set-json", 'platform.networkPolicy.egress.objectStore.to=[{"fqdn":"s3.amazonaws.com"}]'],
     "/networkPolicy/egress/objectStore/to/0"),
    (["--set-json", 'platform.networkPolicy.egress.extraRules=[{"to":[]}]'], "/networkPolicy/egress/extraRules/0/to"),
    (["--set-json", 'platform.networkPolicy.egress.dns.ports=[{"port":53,"protocol":"ICMP"}]'],
     "/networkPolicy/egress/dns/ports/0/protocol"),
    (["--set", "platform.networkPolicy.egress.publicHttps=yes"], "/networkPolicy/egress/publicHttps"),
], ids=["host-name-as-cidr", "unknown-peer", "rule-without-peers", "bad-protocol", "not-a-boolean"])
def test_egress_values_that_cannot_work_are_rejected(helm, umbrella, args, field):
    proc = helm.template(umbrella, *args)
    assert proc.returncode != 0 and "don't meet the specifications of the schema" in proc.stderr
    assert field in proc.stderr, proc.stderr


def test_every_egress_value_is_documented_in_values_and_schema():
    schema = json.loads((PLATFORM_CHART / "values.schema.json").read_text())["properties"]["networkPolicy"]
    egress_schema = schema["properties"]["egress"]["properties"]
    values_text = (PLATFORM_CHART / "values.yaml").read_text()
    egress_values = yaml.safe_load(values_text)["networkPolicy"]["egress"]
    assert set(egress_values) == set(egress_schema)
    lines = values_text.splitlines()
    start = lines.index("  egress:")
    end = next(i for i in range(start + 1, len(lines)) if lines[i].strip() and not lines[i].startswith("    "))
    for key in egress_values:
        assert egress_schema[key].get("description"), key
        (index,) = [i for i in range(start, end) if re.match(rf"^    {key}:", lines[i])]
        assert lines[index - 1].strip().startswith("#"), f"networkPolicy.egress.{key} has no comment in values.yaml"


# ----------------------------------------------------------------------------------------- platform.toml


def test_platform_toml_describes_this_cluster(rendered):
    values = rendered.values
    tpl = values["gpuPodTemplate"]
    settings = values["platformConfig"]["settings"]
    for namespace in [*rendered.task_namespaces, rendered.flyte_namespace]:
        config = platform_toml(rendered.one("ConfigMap", namespace))
        assert config["image"] == values["image"]
        cluster = config["cluster"]
        assert cluster["gpus"] == tpl["gpus"]
        assert cluster["pod_template_name"] == tpl["name"]
        assert cluster["node_selector"] == tpl["nodeSelector"]
        assert cluster["tolerations"] == toml_tolerations(tpl["tolerations"])
        assert cluster["shared_memory"] == ""  # the PodTemplate mounts /dev/shm; a second mount is invalid
        for key in ("cpu", "memory"):
            if key in tpl["resources"]["requests"]:
                assert cluster[key] == str(tpl["resources"]["requests"][key])
        project, domain = (
            namespace.rsplit("-", 1) if namespace in rendered.task_namespaces
            else (values["projects"][0], values["domains"][0])
        )
        assert config["flyte"] == {"project": project, "domain": domain}
        # Workers per pod are left to fuseforge_flyte.config (one per GPU) unless settings give them.
        assert config.get("elastic", {}) == settings.get("elastic", {})
        for table in ("training", "checkpoint"):
            assert config.get(table, {}) == settings.get(table, {})


def test_platform_toml_loads_with_fuseforge_flyte_config(rendered):
    from fuseforge_flyte.config import config_from_dict

    for configmap in rendered.of_kind("ConfigMap"):
        source = f"ConfigMap {configmap['metadata']['namespace']}/{configmap['metadata']['name']}"
        config = config_from_dict(platform_toml(configmap), source)
        assert config.cluster.gpus == rendered.values["gpuPodTemplate"]["gpus"]
        settings = rendered.values["platformConfig"]["settings"]
        assert config.elastic.nproc_per_node == settings.get("elastic", {}).get("nproc_per_node", config.cluster.gpus)
        assert config.cluster.pod_template_name == rendered.values["gpuPodTemplate"]["name"]


def _write_values(tmp_path: Path, values: dict) -> Path:
    """As JSON: valid YAML without YAML 1.1 surprises (helm reads an unquoted y as true)."""
    path = tmp_path / "values.json"
    path.write_text(json.dumps(values, ensure_ascii=False))
    return path


def test_platform_toml_settings_round_trip_through_toml(helm, umbrella, tmp_path):
    tricky = 'quote " backslash \\ tab \t newline \n unicode é ✓ <b>&'
    settings = {
        "training": {"model": tricky, "lr": 0.0002, "steps": 12, "kernels": False, "dataset": ""},
        "image": {"extras": ["hf", "platform"], "extra_packages": []},
        "odd keys": {"dotted.key": 1, "quoted \"key\"": "x", "nested": {"deeper": {"leaf": True}}},
        "runs": [{"name": "a", "gpus": 1}, {"name": "b", "tags": ["x", "y"]}],
    }
    values = _write_values(tmp_path, {"platform": {"platformConfig": {"settings": settings}}})
    docs = helm.render(umbrella, "-f", str(values))
    config = platform_toml(next(d for d in platform_docs(docs) if d["kind"] == "ConfigMap"))
    assert config["training"] == settings["training"]
    assert config["odd keys"] == settings["odd keys"]
    assert config["runs"] == settings["runs"]
    assert config["image"] == {"registry": "localhost:30000", "name": "fuseforge", "tag": "", **settings["image"]}


def test_platform_toml_content_is_used_verbatim(helm, umbrella, tmp_path):
    content = '[flyte]\nproject = "fuseforge"\ndomain = "development"\n'
    values = _write_values(tmp_path, {"platform": {"platformConfig": {"content": content}}})
    docs = helm.render(umbrella, "-f", str(values))
    configmaps = [d for d in platform_docs(docs) if d["kind"] == "ConfigMap"]
    assert configmaps
    for configmap in configmaps:
        assert configmap["data"]["platform.toml"].strip() == content.strip()


@pytest.mark.parametrize(
    "settings, message",
    [
        ({"training": {"runs": [{"model": "a"}, "b"]}}, 'key "runs" mixes tables'),
        ({"elastic": {"nproc_per_node": 16}}, "nproc_per_node (16) must be <= gpuPodTemplate.gpus (8)"),
        ({"cluster": {"gpus": 4}}, "settings.cluster.gpus comes from gpuPodTemplate.gpus"),
        ({"image": {"registry": "ghcr.io/acme"}}, "settings.image.registry comes from image.registry"),
    ],
    ids=["mixed-list", "more-workers-than-gpus", "gpus-in-settings", "registry-in-settings"],
)
def test_platform_toml_settings_that_cannot_work_are_rejected(helm, umbrella, tmp_path, settings, message):
    values = _write_values(tmp_path, {"platform": {"platformConfig": {"settings": settings}}})
    proc = helm.template(umbrella, "-f", str(values))
    assert proc.returncode != 0
    assert message in proc.stderr


# ----------------------------------------------------------------------------------------- bad values


BAD_VALUES = [
    (["--set", "platform.gpuPodTemplate.gpus=-1"], "/gpuPodTemplate/gpus"),
    (["--set-string", "platform.gpuPodTemplate.gpus=two"], "/gpuPodTemplate/gpus"),
    (["--set", "platform.gpuPodTemplate.shmSize=lots"], "/gpuPodTemplate/shmSize"),
    (["--set", "platform.gpuPodTemplate.tolerations[0].operator=Maybe"], "/gpuPodTemplate/tolerations/0/operator"),
    (["--set", "platform.gpuPodTemplate.resources.limits.memory=much"], "/gpuPodTemplate/resources/limits/memory"),
    (["--set", "platform.gpuPodTemplate.gpu=2"], "additional properties 'gpu' not allowed"),
    (["--set", "platform.projects[0]=Bad_Name"], "/projects/0"),
    (["--set", "platform.image.registry=Not A Registry"], "/image/registry"),
    (["--set", "platform.trainingOperator.check=sometimes"], "/trainingOperator/check"),
    (
        ["--set-json", 'platform.training.rbac.extraRules=[{"apiGroups":[""],"resources":["pods"],"verbs":["delete"]}]'],
        "/training/rbac/extraRules/0/verbs/0",
    ),
    (
        ["--set-json", 'platform.training.rbac.extraRules=[{"apiGroups":[""],"resources":["secrets"],"verbs":["get"]}]'],
        "/training/rbac/extraRules/0/resources/0",
    ),
    (
        ["--set-json", 'platform.training.rbac.extraRules=[{"apiGroups":["*"],"resources":["pods"],"verbs":["get"]}]'],
        "/training/rbac/extraRules/0/apiGroups/0",
    ),
    (
        ["--set-json", 'flyte-binary.configuration.inline.tasks.task-plugins.enabled-plugins=["container"]'],
        "/flyte-binary/configuration/inline/tasks/task-plugins/enabled-plugins",
    ),
    (["--set", "flyte-binary.enabled=maybe"], "/flyte-binary/enabled"),
    # get on these opens a shell, an attached terminal, a port or a proxy: never "read-only".
    *[
        (
            ["--set-json", f'platform.training.rbac.extraRules=[{{"apiGroups":[""],"resources":["{resource}"],"verbs":["get"]}}]'],
            "/training/rbac/extraRules/0/resources/0",
        )
        for resource in ("pods/exec", "pods/attach", "pods/portforward", "pods/proxy", "services/proxy", "nodes/proxy", "pods/*")
    ],
    (["--set", "platform.namespaces.podSecurity.enforce=strict"], "/namespaces/podSecurity/enforce"),
    (["--set", "platform.securityContext.privileged=true"], "/securityContext/privileged"),
    (["--set", "flyte-binary.configuration.database.password=hunter2"], "/flyte-binary/configuration/database/password"),
    (["--set", "flyte-binary.deployment.image.tag=latest"], "/flyte-binary/deployment/image/tag"),
    (["--set", "flyte-binary.deployment.waitForDB.image.tag=latest"], "/flyte-binary/deployment/waitForDB/image/tag"),
    (["--set", "flyte-binary.configuration.auth.enabled=true"], "/flyte-binary/configuration/auth"),
    (["--set", "flyte-binary.configuration.auth.oidc.clientSecret=s3cret"], "/flyte-binary/configuration/auth/oidc/clientSecret"),
    (["--set", "networkPolicy.enabled=yes"], "/networkPolicy/enabled"),
    (["--set", "platform.checkpointKey.existingSecret=mine"], "/checkpointKey/existingSecret"),
    (["--set", "platform.checkpointKey.create=false"], "/checkpointKey/existingSecret"),
    (["--set", "platform.checkpointKey.existingSecret=Not_A_Name"], "/checkpointKey/existingSecret"),
    (["--set", "platform.checkpointKey.secretKey=a/b"], "/checkpointKey/secretKey"),
    (["--set", "platform.checkpointKey.mountPath=relative"], "/checkpointKey/mountPath"),
    (["--set", "platform.checkpointKey=null"], "missing property 'checkpointKey'"),
    *[  # the checkpoint key's variables come from checkpointKey (configured_key refuses KEY and KEY_FILE together)
        (["--set", "platform.gpuPodTemplate.env[0].value=x", "--set", f"platform.gpuPodTemplate.env[0].name={name}"],
         "/gpuPodTemplate/env/0/name")
        for name in ("FUSEFORGE_CHECKPOINT_KEY", "FUSEFORGE_CHECKPOINT_KEY_FILE", "FUSEFORGE_CHECKPOINT_REQUIRE_KEY")
    ],
    (["--set", "platform.podSecurityContext.fsGroupChangePolicy=Sometimes"], "/podSecurityContext/fsGroupChangePolicy"),
]


@pytest.mark.parametrize("args, field", BAD_VALUES, ids=[f"{f}={a[-1].rsplit('=', 1)[-1][:40]}" for a, f in BAD_VALUES])
def test_bad_values_are_rejected_naming_the_field(helm, umbrella, args, field):
    proc = helm.template(umbrella, *args)
    assert proc.returncode != 0, f"{args} was accepted"
    assert "don't meet the specifications of the schema" in proc.stderr
    assert field in proc.stderr, proc.stderr


def test_too_long_namespace_is_rejected(helm, umbrella):
    project, domain = "large-language-model-pretraining", "production-europe-west4"  # each one is valid
    assert len(f"{project}-{domain}") == 56
    ok = helm.template(umbrella, "--set", f"platform.projects[0]={project}", "--set", f"platform.domains[0]={domain}")
    assert ok.returncode == 0, ok.stderr
    project += "-experiments"
    proc = helm.template(umbrella, "--set", f"platform.projects[0]={project}", "--set", f"platform.domains[0]={domain}")
    assert proc.returncode != 0
    assert f'"{project}-{domain}"' in proc.stderr and "longer than 63 characters" in proc.stderr


# ----------------------------------------------------------------------------------------- training operator


@pytest.mark.parametrize(
    "check, api_versions, ok",
    [("always", False, False), ("always", True, True), ("auto", False, True), ("never", False, True)],
)
def test_training_operator_check(helm, umbrella, check, api_versions, ok):
    args = ["--set", f"platform.trainingOperator.check={check}"]
    if api_versions:
        args += ["--api-versions", PYTORCHJOB_API]
    proc = helm.template(umbrella, *args)
    assert (proc.returncode == 0) == ok, proc.stderr
    if not ok:
        assert "PyTorchJob API (kubeflow.org/v1) is not installed" in proc.stderr
        assert "training-operator.git/manifests/overlays/standalone?ref=v1.8.1" in proc.stderr


# ----------------------------------------------------------------------------------------- packaging


def test_charts_package_offline_and_render_from_the_archive(helm, umbrella, tmp_path):
    for chart in (PLATFORM_CHART, umbrella):
        proc = helm.run("package", str(chart), "--destination", str(tmp_path))
        assert proc.returncode == 0, proc.stderr
    archive = tmp_path / "fuseforge-0.1.0.tgz"
    assert (tmp_path / "platform-0.1.0.tgz").is_file()
    with tarfile.open(archive) as tar:
        names = set(tar.getnames())
    for member in ("values.schema.json", "charts/platform/values.schema.json",
                   "charts/platform/templates/gpu-podtemplate.yaml", "templates/NOTES.txt",
                   "charts/flyte-binary/templates/deployment.yaml"):
        assert f"fuseforge/{member}" in names
    assert without_generated_keys(helm.render(archive)) == without_generated_keys(helm.render(umbrella))


def test_chart_lock_is_in_sync_and_pins_flyte_1_16(helm, tmp_path):
    meta = yaml.safe_load((CHART / "Chart.yaml").read_text())
    lock = yaml.safe_load((CHART / "Chart.lock").read_text())
    declared = {d["name"]: (d["version"], d.get("repository", "")) for d in meta["dependencies"]}
    locked = {d["name"]: (d["version"], d["repository"]) for d in lock["dependencies"]}
    assert declared == locked
    version, repository = declared["flyte-binary"]
    assert version.startswith("v1.16.") and version.count(".") == 2  # an exact Flyte 1.16.x, no range
    assert repository == "https://flyteorg.github.io/flyte"
    # helm checks Chart.lock's digest before it fetches anything: in a private helm home with no
    # repositories it stops at the missing repository, which proves the lock matched Chart.yaml.
    copy_ = tmp_path / "fuseforge"
    shutil.copytree(CHART, copy_, ignore=shutil.ignore_patterns("*.tgz"))
    proc = helm.run("dependency", "build", str(copy_))
    assert "out of sync" not in proc.stderr, proc.stderr
    if proc.returncode != 0:
        assert "https://flyteorg.github.io/flyte" in proc.stderr, proc.stderr


def test_vendored_flyte_chart_is_the_locked_one(helm):
    """charts/ holds exactly the locked flyte-binary archive, and helm finds it in order offline."""
    assert sorted(p.name for p in (CHART / "charts").glob("*.tgz")) == [FLYTE_ARCHIVE.name]
    with tarfile.open(FLYTE_ARCHIVE) as tar:
        meta = yaml.safe_load(tar.extractfile("flyte-binary/Chart.yaml"))
        names = set(tar.getnames())
    assert (meta["name"], meta["version"], meta["appVersion"]) == ("flyte-binary", FLYTE_VERSION, "1.16.0")
    assert "flyte-binary/templates/deployment.yaml" in names
    proc = helm.run("dependency", "list", str(CHART))
    assert proc.returncode == 0, proc.stderr
    status = {line.split()[0]: line.split()[-1] for line in proc.stdout.splitlines()[1:] if line.strip()}
    assert status == {"platform": "unpacked", "flyte-binary": "ok"}, proc.stdout


# ----------------------------------------------------------------------------------------- Flyte values


def test_flyte_binary_values_enable_pytorch_jobs_on_gpus():
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    platform = platform_values()
    flyte = values["flyte-binary"]
    assert flyte["enabled"] is True and values["platform"]["enabled"] is True
    plugins = flyte["configuration"]["inline"]["tasks"]["task-plugins"]
    assert {"container", "sidecar", "k8s-array", "pytorch"} <= set(plugins["enabled-plugins"])
    assert plugins["default-for-task-types"]["pytorch"] == "pytorch"
    assert plugins["default-for-task-types"]["container"] == "container"
    k8s = flyte["configuration"]["inline"]["plugins"]["k8s"]
    assert k8s["gpu-resource-name"] == platform["gpuPodTemplate"]["gpuResourceName"] == "nvidia.com/gpu"
    assert k8s["resource-tolerations"]["nvidia.com/gpu"] == platform["gpuPodTemplate"]["tolerations"]
    # Pods that name no template get the platform's base template (security context only, no GPUs).
    assert k8s["default-pod-template-name"] == platform["basePodTemplate"]["name"] != platform["gpuPodTemplate"]["name"]
    assert set(platform["projects"]) <= set(flyte["flyte-core-components"]["admin"]["seedProjects"])

    rules = values["flyteRbac"]["clusterRules"]

    def verbs_for(group: str, resource: str) -> set:
        return {
            verb
            for rule in rules
            if group in rule["apiGroups"] and resource in rule["resources"]
            for verb in rule["verbs"]
        }

    assert {"create", "get", "list", "watch", "delete", "patch", "update"} <= verbs_for("kubeflow.org", "pytorchjobs")
    assert {"get", "list", "watch"} <= verbs_for("", "podtemplates")
    assert not any("*" in item for rule in rules for f in rule.values() for item in f)


def install_dry_run(helm, umbrella, *args: str) -> tuple[List[dict], str]:
    """The manifests and the notes of `helm install --dry-run=client`."""
    proc = helm.run("install", RELEASE, str(umbrella), "--namespace", FLYTE_NAMESPACE, "--dry-run=client", *args)
    assert proc.returncode == 0, proc.stderr
    manifest, notes = proc.stdout.split("\nMANIFEST:\n", 1)[1].split("\nNOTES:\n", 1)
    return [doc for doc in yaml.load_all(manifest, Loader=YAML_LOADER) if doc], notes


def install_notes(helm, umbrella, *args: str) -> str:
    return install_dry_run(helm, umbrella, *args)[1]


def test_install_notes_tell_how_to_run_and_reach_the_console(helm, umbrella):
    docs, notes = install_dry_run(helm, umbrella)
    assert "--service-account fuseforge-training" in notes
    # flyte-binary has no Service serving both ports (<fullname>-http and -grpc): forward its Deployment.
    assert f"port-forward deployment/{FLYTE_FULLNAME} 8088:8088 8089:8089" in notes
    flyte_deployment(docs)  # the Deployment the notes name exists
    docs, notes = install_dry_run(helm, umbrella, "--set", "flyte-binary.nameOverride=flyte")
    assert f"port-forward deployment/{RELEASE}-flyte 8088:8088 8089:8089" in notes
    flyte_deployment(docs, f"{RELEASE}-flyte")
    assert "fuseforge-development, fuseforge-staging, fuseforge-production" in notes
    assert f"NetworkPolicy {RELEASE}-flyte-admin" in notes
    assert "password read from /etc/flyte/db/password (an existing Secret)" in notes


AUTH_ON = {"flyte-binary": {"configuration": {"auth": {
    "enabled": True, "oidc": {"baseUrl": "https://accounts.example.com", "clientId": "flyte"},
    "authorizedUris": ["https://flyte.example.com"], "clientSecretsExternalSecretRef": "flyte-client-secrets",
}}}}


def test_install_notes_say_plainly_when_auth_is_off(helm, umbrella, tmp_path):
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    assert values["flyte-binary"]["configuration"]["auth"]["enabled"] is False  # flyte-binary's default, made visible
    notes = install_notes(helm, umbrella)
    assert "WARNING: Flyte authentication is OFF" in notes
    assert "can register workflows and launch GPU pods" in notes
    notes = install_notes(helm, umbrella, "-f", str(_write_values(tmp_path, AUTH_ON)))
    assert "authentication is OFF" not in notes
    assert "WARNING: networkPolicy.enabled=false" in install_notes(helm, umbrella, "--set", "networkPolicy.enabled=false")


# ----------------------------------------------------------------------------------------- database


def test_database_password_comes_from_an_existing_secret_over_tls():
    flyte = yaml.safe_load((CHART / "values.yaml").read_text())["flyte-binary"]
    database = flyte["configuration"]["database"]
    assert not database.get("password")  # no password in a values file
    assert "sslmode=require" in database["options"]  # TLS to the external database by default
    path = Path(database["passwordPath"])
    (mount,) = [m for m in flyte["deployment"]["extraVolumeMounts"] if path.parent == Path(m["mountPath"])]
    (volume,) = [v for v in flyte["deployment"]["extraVolumes"] if v["name"] == mount["name"]]
    assert mount["readOnly"] is True
    assert volume["secret"]["secretName"] and {"key": "password", "path": path.name} in volume["secret"]["items"]
    assert f"create secret generic {volume['secret']['secretName']}" in page("cluster/install.md")


def test_database_password_path_outside_a_secret_is_refused(helm, umbrella):
    proc = helm.template(umbrella, "--set", "flyte-binary.configuration.database.passwordPath=/etc/passwd")
    assert proc.returncode != 0
    assert "passwordPath (/etc/passwd) must be a file of a Secret volume" in proc.stderr
    ok = helm.template(umbrella, "--set", "flyte-binary.enabled=false",
                       "--set", "flyte-binary.configuration.database.passwordPath=/etc/passwd")
    assert ok.returncode == 0, ok.stderr  # Flyte installed elsewhere: its values are not ours to check


# ----------------------------------------------------------------------------------------- the image


DOCKERFILE = ROOT / "images" / "Dockerfile"
# uv/pip install options that take a value (the value is not a requirement).
PIP_OPTIONS_WITH_VALUE = {
    "-i", "--index-url", "--extra-index-url", "--index-strategy", "-f", "--find-links", "-c",
    "--constraint", "-p", "--python", "--target", "--prefix", "--cache-dir",
}


def dockerfile_instructions(path: Path) -> List[tuple]:
    """(KEYWORD, argument text) per instruction, continuation lines joined, comments dropped."""
    lines = [line for line in path.read_text().splitlines() if not line.lstrip().startswith("#")]
    joined = re.sub(r"\\\n\s*", " ", "\n".join(lines))
    return [tuple(line.strip().split(None, 1)) for line in joined.splitlines() if line.strip()]


def excluded_from_context(path: str, dockerignore: Path) -> bool:
    """Whether a .dockerignore leaves `path` out of the build context (last matching pattern wins)."""
    excluded = False
    for pattern in dockerignore.read_text().splitlines():
        pattern = pattern.strip()
        if not pattern or pattern.startswith("#"):
            continue
        negated = pattern.startswith("!")
        pattern = pattern.lstrip("!").rstrip("/")
        if fnmatch.fnmatch(path, pattern) or fnmatch.fnmatch(path, pattern + "/*"):
            excluded = not negated
    return excluded


def pip_install_arguments(command: str) -> List[List[str]]:
    """The arguments after `pip install` in each `&&`-separated part of a RUN command."""
    found = []
    for part in re.split(r"&&|;", command):
        words = shlex.split(part)
        for i in range(len(words) - 1):
            if words[i] == "pip" and words[i + 1] == "install":
                found.append(words[i + 2:])
    return found


def test_dockerfile_installs_parseable_requirements_from_its_build_context():
    from packaging.requirements import Requirement

    assert DOCKERFILE.is_file(), "images/Dockerfile is missing"
    dockerignore = DOCKERFILE.with_name(DOCKERFILE.name + ".dockerignore")  # BuildKit's per-Dockerfile ignore file
    instructions = dockerfile_instructions(DOCKERFILE)
    args = dict(
        (arg.split("=", 1)[0], arg.split("=", 1)[1]) for kw, arg in instructions if kw == "ARG" and "=" in arg
    )
    copied: Dict[str, Path] = {}  # destination in the image -> source in the repository
    requirements: List[str] = []
    installs = 0
    for keyword, text in instructions:
        if keyword == "COPY" and "--from=" not in text:
            *sources, dest = text.split()
            for source in sources:
                assert (ROOT / source).exists(), f"COPY {source}: not in the repository"
                if dockerignore.is_file():
                    assert not excluded_from_context(source, dockerignore), f"COPY {source}: excluded by {dockerignore.name}"
                target = dest if len(sources) == 1 and not dest.endswith("/") else f"{dest.rstrip('/')}/{Path(source).name}"
                copied[target] = ROOT / source
        if keyword != "RUN":
            continue
        command = re.sub(r"\$\{(\w+)\}", lambda m: args.get(m.group(1), m.group(0)), text)
        command = re.sub(r"^(--\S+\s+)+", "", command)  # RUN --mount=... flags
        for words in pip_install_arguments(command):
            installs += 1
            skip = False
            for i, word in enumerate(words):
                if skip:
                    skip = False
                elif word in ("-r", "--requirement"):
                    source = copied[words[i + 1]]  # a requirements file must come from the repository
                    joined = re.sub(r"\\\n\s*", " ", source.read_text())  # continuation lines (--hash=...)
                    for line in joined.splitlines():
                        line = line.split("#", 1)[0].strip()
                        if line:
                            requirement, *options = line.split(" --")
                            assert all(o.startswith("hash=sha256:") for o in options), line
                            requirements.append(requirement.strip())
                    skip = True
                elif word in PIP_OPTIONS_WITH_VALUE:
                    skip = True
                elif word.startswith("-"):
                    continue
                elif word.startswith("/"):  # a local project: one the Dockerfile copied in
                    assert any(word == dest.rstrip("/") or dest.startswith(word.rstrip("/") + "/") for dest in copied), word
                else:
                    requirements.append(word)
    assert installs >= 2
    parsed = [Requirement(line) for line in requirements]  # raises InvalidRequirement on a bad line
    names = {req.name for req in parsed}
    assert {"torch", "flytekit", "flytekitplugins-kfpytorch"} <= names
    (torch,) = [req for req in parsed if req.name == "torch" and "==" in str(req.specifier)]
    assert len(torch.specifier) == 1  # the image pins its CUDA torch exactly
    # Everything but torch is pinned exactly (the lock), and no install lets one index shadow another.
    assert all(str(req.specifier).startswith("==") for req in parsed), [str(r) for r in parsed if "==" not in str(r.specifier)]
    assert "unsafe-best-match" not in DOCKERFILE.read_text()
