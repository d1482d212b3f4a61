"""docs/tfjob.yaml and docs/tfjob_ps.yaml are valid Kubernetes manifests, checked offline (no cluster runs here).

What is validated, and how:
- Built-in kinds (the PersistentVolumeClaims) against Kubernetes' own schema with `kubernetes-validate --strict`
  (K8S_VERSION): unknown or misspelled fields and wrong types fail.
- TFJob is a custom resource (kubeflow.org/v1) whose schema kubernetes-validate does not ship (it only warns
  "Couldn't find schema" and passes), so the TFJob is checked in two parts:
  * its outer structure (spec.runPolicy, spec.tfReplicaSpecs.<Chief|Worker|PS|Evaluator|Master>.replicas /
    restartPolicy / template) against TFJOB_SCHEMA below, written from the training operator's v1 API,
    strict (no unknown fields, enum values for the replica types and policies);
  * every replica's pod `template` as a Kubernetes `v1/PodTemplate` with kubernetes-validate --strict, so
    containers, ports, resources, volumes and mounts meet the real pod schema.
- Consistency the operator needs: the container is named `tensorflow`, has a `tfjob-port`, every replica runs
  the same command, and every claim a pod mounts is defined in the file.
What is NOT validated: values only a cluster knows (whether the image exists, the storage class, quotas,
whether the training operator is installed), and the TFJob fields that only its controller interprets beyond
the types above. The planted-misspelling tests prove each check can fail.
"""

from __future__ import annotations

import copy
import os
import subprocess
import sys

import jsonschema
import kubernetes_validate
import pytest
import yaml

from tests.helpers import ROOT

K8S_VERSION = "1.30.0"
MANIFESTS = [os.path.join(ROOT, "docs", name) for name in ("tfjob.yaml", "tfjob_ps.yaml")]

REPLICA_SPEC = {
    "type": "object", "additionalProperties": False, "required": ["template"],
    "properties": {
        "replicas": {"type": "integer", "minimum": 0},
        "restartPolicy": {"enum": ["Always", "OnFailure", "Never", "ExitCode"]},
        "template": {"type": "object"},  # a PodTemplateSpec: validated apart, with Kubernetes' own schema
    },
}
TFJOB_SCHEMA = {
    "type": "object", "additionalProperties": False, "required": ["apiVersion", "kind", "metadata", "spec"],
    "properties": {
        "apiVersion": {"const": "kubeflow.org/v1"},
        "kind": {"const": "TFJob"},
        "metadata": {"type": "object", "required": ["name"]},
        "spec": {
            "type": "object", "additionalProperties": False, "required": ["tfReplicaSpecs"],
            "properties": {
                "enableDynamicWorker": {"type": "boolean"},
                "successPolicy": {"type": "string"},
                "runPolicy": {
                    "type": "object", "additionalProperties": False,
                    "properties": {
                        "activeDeadlineSeconds": {"type": "integer", "minimum": 1},
                        "backoffLimit": {"type": "integer", "minimum": 0},
                        "cleanPodPolicy": {"enum": ["All", "Running", "None"]},
                        "schedulingPolicy": {"type": "object"},
                        "suspend": {"type": "boolean"},
                        "ttlSecondsAfterFinished": {"type": "integer", "minimum": 0},
                    },
                },
                "tfReplicaSpecs": {
                    "type": "object", "minProperties": 1, "additionalProperties": False,
                    "properties": {kind: REPLICA_SPEC for kind in ("Chief", "Master", "Worker", "PS", "Evaluator")},
                },
            },
        },
    },
}


def documents(path: str) -> list[dict]:
    with open(path) as f:
        return [doc for doc in yaml.safe_load_all(f) if doc]


def check(docs: list[dict]) -> None:
    """Raises (kubernetes_validate or jsonschema ValidationError, AssertionError) if any document is invalid."""
    claims = {d["metadata"]["name"] for d in docs if d["kind"] == "PersistentVolumeClaim"}
    for doc in docs:
        if doc["kind"] != "TFJob":
            kubernetes_validate.validate(doc, K8S_VERSION, strict=True)
            continue
        jsonschema.validate(doc, TFJOB_SCHEMA)
        commands = set()
        for replica_type, replica in doc["spec"]["tfReplicaSpecs"].items():
            template = {"apiVersion": "v1", "kind": "PodTemplate",
                        "metadata": {"name": f"{doc['metadata']['name']}-{replica_type.lower()}"},
                        "template": replica["template"]}
            kubernetes_validate.validate(template, K8S_VERSION, strict=True)
            pod = replica["template"]["spec"]
            [container] = [c for c in pod["containers"] if c["name"] == "tensorflow"]  # the one the operator sets
            assert any(p.get("name") == "tfjob-port" for p in container.get("ports", [])), replica_type
            commands.add(tuple(container["command"]))
            mounted = {v["persistentVolumeClaim"]["claimName"] for v in pod.get("volumes", [])
                       if "persistentVolumeClaim" in v}
            assert mounted <= claims, f"{replica_type} mounts undefined claims {mounted - claims}"
        assert len(commands) == 1, f"replicas run different commands: {commands}"


@pytest.mark.parametrize("path", MANIFESTS, ids=os.path.basename)
def test_tfjob_manifest_is_valid(path):
    docs = documents(path)
    assert [d["kind"] for d in docs] == ["PersistentVolumeClaim", "TFJob"]
    check(docs)


@pytest.mark.slow
@pytest.mark.parametrize("path", MANIFESTS, ids=os.path.basename)
def test_kubernetes_validate_cli_passes_the_built_in_kinds(path):
    """The command users run; it passes the PVC and can only warn about the TFJob (hence `check` above)."""
    cli = os.path.join(os.path.dirname(sys.executable), "kubernetes-validate")
    done = subprocess.run([cli, "--strict", "-k", K8S_VERSION, path], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "passed for resource persistentvolumeclaim/" in done.stdout
    assert "Couldn't find schema for kind TFJob" in done.stdout + done.stderr


def _plant(where: str, docs: list[dict]) -> None:
    tfjob = docs[1]
    chief = tfjob["spec"]["tfReplicaSpecs"]["Chief"]
    if where == "pod template":  # a misspelled container field
        container = chief["template"]["spec"]["containers"][0]
        container["volumeMount"] = container.pop("volumeMounts")
    elif where == "replica spec":
        chief["restartPolicyy"] = chief.pop("restartPolicy")
    elif where == "replica type":
        tfjob["spec"]["tfReplicaSpecs"]["Workers"] = tfjob["spec"]["tfReplicaSpecs"].pop("Worker")
    elif where == "run policy value":
        tfjob["spec"]["runPolicy"]["cleanPodPolicy"] = "Sometimes"
    elif where == "claim name":
        chief["template"]["spec"]["volumes"][0]["persistentVolumeClaim"]["claimName"] = "mwloop-shraed"
    elif where == "pvc":
        docs[0]["spec"]["accesModes"] = docs[0]["spec"].pop("accessModes")


@pytest.mark.parametrize("where", ["pod template", "replica spec", "replica type", "run policy value", "claim name",
                                  "pvc"])
def test_a_planted_mistake_fails_the_check(where):
    docs = copy.deepcopy(documents(MANIFESTS[0]))
    _plant(where, docs)
    with pytest.raises((kubernetes_validate.ValidationError, jsonschema.ValidationError, AssertionError)):
        check(docs)
