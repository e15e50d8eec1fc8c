"""The deployment files under ``deploy/``.

Static: every Kubernetes manifest validates (strict, offline) against the Kubernetes JSON
schemas, the kustomization lists exactly the manifests, the ConfigMap's files load with
recserve's own config loaders, every recserve command line in the manifests and in
docker-compose parses with the real ``recserve`` parser, and the names that tie the pieces
together (DNS names of the shards, services, ports, config and checkpoint paths, Prometheus
targets) agree. The TLS overlays (deploy/k8s-overlays) change only the server Deployment, into
one whose TLS flags name files of its mounted Secrets and whose probes speak TLS; the tier-tls
overlay gives every pod that speaks to the embedding tier the files of its mutual TLS and
probes that need no plaintext gRPC. Live: both
Procfiles run under honcho on free loopback ports; the serving one answers a prediction for a
checkpoint trained here.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import json
import os
import re
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml

from embedding_store.cli import build_parser
from embedding_store.config import (
    JobType,
    embedding_config_from_mapping,
    global_config_from_mapping,
    load_embedding_config,
    load_global_config,
)
from embedding_store.grpc_common import LIVENESS_SERVICE
from tests.scripts import load_script

kubernetes_validate = pytest.importorskip("kubernetes_validate")

REPO_ROOT = Path(__file__).resolve().parents[2]
DEPLOY = REPO_ROOT / "deploy"
K8S = DEPLOY / "k8s"
CONFIGS = DEPLOY / "configs"
NAMESPACE = "recserve"
IMAGE = "recserve"
# The documented minimum (pod-index label, GA gRPC probes) and the newest schemas shipped.
K8S_VERSIONS = ("1.28.0", kubernetes_validate.latest_version())
WORKLOAD_KINDS = ("Deployment", "StatefulSet", "Job")
ADULT_ROW = {
    "age": 52,
    "workclass": "Self-emp-inc",
    "fnlwgt": 287927,
    "education": "HS-grad",
    "educational-num": 9,
    "marital-status": "Married-civ-spouse",
    "occupation": "Exec-managerial",
    "relationship": "Wife",
    "race": "White",
    "gender": "Female",
    "capital-gain": 15024,
    "capital-loss": 0,
    "hours-per-week": 40,
    "native-country": "United-States",
}


# --------------------------------------------------------------------------- helpers
def k8s_files() -> list[Path]:
    return sorted(p for p in K8S.rglob("*.yaml") if p.name != "kustomization.yaml")


def k8s_docs(path: Path) -> list[dict]:
    return [d for d in yaml.safe_load_all(path.read_text()) if d is not None]


def kustomization() -> dict:
    return yaml.safe_load((K8S / "kustomization.yaml").read_text())


@functools.cache
def core_docs() -> tuple[dict, ...]:
    """Every document of the files the kustomization applies (parsed once; read only)."""
    return tuple(d for name in kustomization()["resources"] for d in k8s_docs(K8S / name))


def by_kind(kind: str) -> dict[str, dict]:
    return {d["metadata"]["name"]: d for d in core_docs() if d["kind"] == kind}


def pod_spec(workload: dict) -> dict:
    return workload["spec"]["template"]["spec"]


def recserve_containers(workload: dict) -> list[dict]:
    """Main containers that run ``recserve ...`` (the image's entrypoint, no command)."""
    return [
        c
        for c in pod_spec(workload)["containers"]
        if c["image"].split(":")[0] == IMAGE and "command" not in c
    ]


def substituted_args(container: dict) -> list[str]:
    """Container args with ``$(VAR)`` replaced as the kubelet would (downward-API values
    replaced by a plausible value: index 0)."""
    values = {}
    for env in container.get("env", []):
        values[env["name"]] = env.get("value", "0")

    def expand(arg: str) -> str:
        def one(match: re.Match) -> str:
            assert match[1] in values, f"$({match[1]}) in {arg!r} is not a container env var"
            return values[match[1]]

        return re.sub(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)", one, arg)

    return [expand(a) for a in container.get("args", [])]


def parse_recserve(args: list[str]):
    """Parse with the real ``recserve`` command line (SystemExit on a bad flag)."""
    return build_parser().parse_args(args)


def env_file(path: Path) -> dict[str, str]:
    values = {}
    for line in path.read_text().splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            key, _, value = line.partition("=")
            values[key.strip()] = value.strip()
    return values


def free_ports(n: int) -> list[int]:
    sockets = []
    try:
        for _ in range(n):
            sock = socket.socket()
            sock.bind(("127.0.0.1", 0))
            sockets.append(sock)
        return [s.getsockname()[1] for s in sockets]
    finally:
        for sock in sockets:
            sock.close()


def load_healthcheck_module():
    return load_script(DEPLOY / "scripts" / "healthcheck.py", "recserve_deploy_healthcheck")


# --------------------------------------------------------------------------- Kubernetes
@pytest.mark.parametrize("version", K8S_VERSIONS)
@pytest.mark.parametrize("path", k8s_files(), ids=lambda p: str(p.relative_to(K8S)))
def test_manifest_validates_against_kubernetes_schemas(path: Path, version: str) -> None:
    docs = k8s_docs(path)
    assert docs, f"{path} holds no document"
    for doc in docs:
        if doc["apiVersion"].startswith("monitoring.coreos.com/"):
            # Prometheus Operator CRD (optional/): not in the core schemas; checked below.
            assert path.parent.name == "optional", f"{path}: CRD outside optional/"
            continue
        try:
            kubernetes_validate.validate(doc, version, strict=True)
        except kubernetes_validate.ValidationError as error:
            pytest.fail(f"{path} {doc['kind']}/{doc['metadata']['name']}: {error.message}")


def test_kustomization_lists_exactly_the_manifests() -> None:
    k = kustomization()
    assert k["apiVersion"] == "kustomize.config.k8s.io/v1beta1"
    assert k["kind"] == "Kustomization"
    assert k["namespace"] == NAMESPACE
    listed = k["resources"]
    assert len(listed) == len(set(listed)), "a resource is listed twice"
    present = sorted(p.name for p in K8S.glob("*.yaml") if p.name != "kustomization.yaml")
    assert sorted(listed) == present
    assert all(p.parent == K8S / "optional" for p in k8s_files() if p.name not in listed)
    assert any(label["pairs"] for label in k["labels"]), "no common labels"
    # Labels that reach pod templates also reach a StatefulSet's volumeClaimTemplates, which
    # it cannot change: a label that changes between releases (the version) must stay out.
    for label in k["labels"]:
        if label.get("includeTemplates"):
            assert "app.kubernetes.io/version" not in label["pairs"], label
    assert [i["name"] for i in k["images"]] == [IMAGE]

    seen = set()
    for doc in core_docs():
        key = (doc["kind"], doc["metadata"]["name"])
        assert key not in seen, f"{key} defined twice"
        seen.add(key)
        if doc["kind"] != "Namespace":
            assert doc["metadata"].get("namespace", NAMESPACE) == NAMESPACE, key
    assert ("Namespace", NAMESPACE) in seen


def test_configmap_files_load_with_recserve_loaders() -> None:
    configmaps = by_kind("ConfigMap")
    assert configmaps, "no ConfigMap"
    for name, configmap in configmaps.items():
        for key, text in configmap["data"].items():
            source = f"ConfigMap {name} {key}"
            data = yaml.safe_load(text)
            if key.startswith("embedding_config"):
                embedding_config_from_mapping(data, source=source)
            elif key.startswith("global_config"):
                global_config_from_mapping(data, source=source)
            else:
                pytest.fail(f"{source}: neither an embedding nor a global config")
            # The same files as deploy/configs/ (compose mounts those).
            assert text == (CONFIGS / key).read_text(), f"{source} differs from deploy/configs"
    # ... and deploy/configs/embedding_config.yml is the Adult example's.
    adult = yaml.safe_load((REPO_ROOT / "examples/adult_income/embedding_config.yml").read_text())
    assert yaml.safe_load((CONFIGS / "embedding_config.yml").read_text()) == adult
    for path in CONFIGS.glob("global_config*.yml"):
        load_global_config(path)
    infer = load_global_config(CONFIGS / "global_config.infer.yml").common_config
    assert infer.job_type is JobType.INFER and infer.infer_config.embedding_checkpoint
    train = load_global_config(CONFIGS / "global_config.train.yml").common_config
    assert train.job_type is JobType.TRAIN


def _mounted_config_files(workload: dict, container: dict) -> dict[str, Path]:
    """``/etc/recserve/<key>`` -> deploy/configs/<key> for the ConfigMap mounted there."""
    volumes = {v["name"]: v for v in pod_spec(workload).get("volumes", [])}
    for claim in workload["spec"].get("volumeClaimTemplates", []):
        volumes[claim["metadata"]["name"]] = {"persistentVolumeClaim": claim}
    files = {}
    for mount in container.get("volumeMounts", []):
        assert mount["name"] in volumes, f"volume {mount['name']} is not defined"
        volume = volumes[mount["name"]]
        if "configMap" in volume:
            configmap = by_kind("ConfigMap")[volume["configMap"]["name"]]
            for key in configmap["data"]:
                files[f"{mount['mountPath']}/{key}"] = CONFIGS / key
    return files


def _service_port(service: str, port: int) -> bool:
    spec = by_kind("Service")[service]["spec"]
    return any(p["port"] == port for p in spec["ports"])


def _resolves(address: str) -> bool:
    """``service:port`` or ``<statefulset>-<i>.<headless>.<ns>.svc.cluster.local:port`` names
    a Service port (and, for a pod name, an ordinal below the StatefulSet's replicas)."""
    host, _, port = address.rpartition(":")
    match = re.fullmatch(rf"(.+)-(\d+)\.([^.]+)\.{NAMESPACE}\.svc\.cluster\.local", host)
    if match is None:
        return host in by_kind("Service") and _service_port(host, int(port))
    statefulset = by_kind("StatefulSet").get(match[1])
    return (
        statefulset is not None
        and statefulset["spec"]["serviceName"] == match[3]
        and int(match[2]) < statefulset["spec"]["replicas"]
        and _service_port(match[3], int(port))
    )


def test_k8s_init_containers_wait_for_real_targets() -> None:
    for kind in WORKLOAD_KINDS:
        for name, workload in by_kind(kind).items():
            for container in pod_spec(workload).get("initContainers", []):
                command = container["command"]
                if "/app/deploy/scripts/healthcheck.py" not in command:
                    continue
                assert (DEPLOY / "scripts" / "healthcheck.py").is_file()
                targets = [a for a in command if a.startswith("grpc://")]
                assert targets, f"{kind}/{name}: no target"
                for target in targets:
                    assert _resolves(target.removeprefix("grpc://")), f"{kind}/{name}: {target}"
                if name == "server":  # waits for every serving shard, not some of them
                    replicas = by_kind("StatefulSet")["ps"]["spec"]["replicas"]
                    shards = [t for t in targets if t.startswith("grpc://ps-")]
                    assert shards == [
                        f"grpc://ps-{i}.ps-headless.{NAMESPACE}.svc.cluster.local:7000"
                        for i in range(replicas)
                    ]


def test_k8s_recserve_commands_and_wiring() -> None:
    workloads = {(kind, name): d for kind in WORKLOAD_KINDS for name, d in by_kind(kind).items()}
    services = by_kind("Service")
    parsed = {}
    for (kind, name), workload in workloads.items():
        # Selectors match the pod labels; every Service selects some workload.
        labels = workload["spec"]["template"]["metadata"]["labels"]
        selector = workload["spec"].get("selector", {}).get("matchLabels", {})
        assert selector.items() <= labels.items(), f"{kind}/{name}: selector misses its pods"
        containers = recserve_containers(workload)
        assert containers, f"{kind}/{name} runs no recserve container"
        for container in containers:
            for probe in ("readinessProbe", "livenessProbe"):
                if kind != "Job":
                    assert probe in container, f"{kind}/{name}: no {probe}"
            assert container["resources"]["requests"] and container["resources"]["limits"]
            args = parse_recserve(substituted_args(container))
            parsed[name] = args
            files = _mounted_config_files(workload, container)
            for flag in ("embedding_config", "global_config"):
                path = getattr(args, flag, None)
                if path is not None:
                    assert path in files, f"{kind}/{name}: {path} is not a mounted config file"
    for name, service in services.items():
        selector = service["spec"]["selector"]
        assert any(
            selector.items() <= w["spec"]["template"]["metadata"]["labels"].items()
            for w in workloads.values()
        ), f"Service {name} selects no pods"

    # Parameter-server StatefulSets: replica index from the pod-index label, size = replicas,
    # a headless Service that publishes not-ready pods, and workers naming every shard by DNS.
    for name, statefulset in by_kind("StatefulSet").items():
        spec = statefulset["spec"]
        assert spec["podManagementPolicy"] == "Parallel"
        headless = services[spec["serviceName"]]["spec"]
        assert headless["clusterIP"] == "None" and headless["publishNotReadyAddresses"]
        (container,) = recserve_containers(statefulset)
        env = {e["name"]: e for e in container["env"]}
        assert env["REPLICA_INDEX"]["valueFrom"]["fieldRef"]["fieldPath"] == (
            "metadata.labels['apps.kubernetes.io/pod-index']"
        )
        assert int(env["REPLICA_SIZE"]["value"]) == spec["replicas"]
        assert "--replica-index=$(REPLICA_INDEX)" in container["args"]
        args = parsed[name]
        assert args.command == "embedding-parameter-server" and args.host == "0.0.0.0"
        assert _service_port(spec["serviceName"], args.port)
        annotations = spec["template"]["metadata"]["annotations"]
        assert annotations["prometheus.io/port"] == str(args.metrics_port)
        expected = [
            f"{name}-{i}.{spec['serviceName']}.{NAMESPACE}.svc.cluster.local:{args.port}"
            for i in range(spec["replicas"])
        ]
        workers = [w for w in parsed.values() if w.command == "embedding-worker" and w.ps]
        assert [w.ps for w in workers].count(expected) == 1, f"no worker names {expected}"
        assert all(_resolves(address) for address in expected)
        pdb = by_kind("PodDisruptionBudget")[name]["spec"]
        assert pdb["selector"]["matchLabels"] == spec["selector"]["matchLabels"]

    # The serving shards load the checkpoint the server serves and the trainer writes.
    (server_name,) = [n for n, a in parsed.items() if a.command == "serve"]
    server = parsed[server_name]
    (trainer_name,) = [n for n, a in parsed.items() if a.command == "train"]
    trainer = parsed[trainer_name]
    infer = load_global_config(CONFIGS / "global_config.infer.yml").common_config.infer_config
    assert infer.embedding_checkpoint == f"{server.checkpoint}/embeddings"
    script_args = [a for a in trainer.script_args if a != "--"]
    assert f"--checkpoint-dir={server.checkpoint}" in script_args
    host, _, port = server.embedding_workers.rpartition(":")
    assert _service_port(host, int(port)) and parsed[host].command == "embedding-worker"
    host, _, port = trainer.embedding_workers.rpartition(":")
    assert _service_port(host, int(port)) and parsed[host].command == "embedding-worker"

    # Server: HTTP probes, a Service with both ports, PDB and an autoscaler.
    deployment = by_kind("Deployment")[server_name]
    (container,) = recserve_containers(deployment)
    assert container["readinessProbe"]["httpGet"]["path"] == "/v2/health/ready"
    assert container["livenessProbe"]["httpGet"]["path"] == "/v2/health/live"
    assert _service_port(server_name, server.http_port)
    assert _service_port(server_name, server.grpc_port)
    assert "replicas" not in deployment["spec"], "the HPA owns the replica count"
    hpa = by_kind("HorizontalPodAutoscaler")[server_name]["spec"]
    assert hpa["scaleTargetRef"] == {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "name": server_name,
    }
    assert server_name in by_kind("PodDisruptionBudget")
    # Shards and workers are scraped (pod annotations) on the port they serve /metrics on,
    # which their container and Service name "metrics" (the optional ServiceMonitor's port).
    for (kind, name), workload in workloads.items():
        if parsed[name].command not in ("embedding-parameter-server", "embedding-worker"):
            continue
        annotations = workload["spec"]["template"]["metadata"]["annotations"]
        assert annotations["prometheus.io/scrape"] == "true", f"{kind}/{name}"
        assert annotations["prometheus.io/port"] == str(parsed[name].metrics_port), name
        (container,) = recserve_containers(workload)
        ports = {p["name"]: p["containerPort"] for p in container["ports"]}
        assert ports["metrics"] == parsed[name].metrics_port, f"{kind}/{name}"
        labels = workload["spec"]["template"]["metadata"]["labels"]
        scraped = [
            s
            for s in services.values()
            if s["spec"]["selector"].items() <= labels.items()
            and s["metadata"]["labels"].get("recserve.io/metrics") == "true"
        ]
        assert any(p["name"] == "metrics" for s in scraped for p in s["spec"]["ports"]), name

    # Serving shards and workers report readiness through native gRPC probes.
    for name in ("ps", "embedding-worker"):
        workload = workloads.get(("StatefulSet", name)) or workloads[("Deployment", name)]
        (container,) = recserve_containers(workload)
        assert container["readinessProbe"]["grpc"]["port"] == parsed[name].port
    # Every shard and worker is alive while its "recserve.liveness" health service answers
    # (the overall service is readiness: NOT_SERVING while loading or unconfigured).
    for name in ("ps", "ps-train", "embedding-worker", "embedding-worker-train"):
        workload = workloads.get(("StatefulSet", name)) or workloads[("Deployment", name)]
        (container,) = recserve_containers(workload)
        probe = container["livenessProbe"]["grpc"]
        assert (probe["port"], probe["service"]) == (parsed[name].port, LIVENESS_SERVICE), name

    # Training Job: indexed, one torchrun node per index, node 0 the rendezvous master.
    job = by_kind("Job")[trainer_name]
    assert job["spec"]["completionMode"] == "Indexed"
    assert job["spec"]["completions"] == job["spec"]["parallelism"] == trainer.nnodes
    # A replaced pod could not join the other node's static rendezvous: no retries.
    assert job["spec"]["backoffLimit"] == 0
    (container,) = recserve_containers(job)
    env = {e["name"]: e for e in container["env"]}
    assert env["NODE_RANK"]["valueFrom"]["fieldRef"]["fieldPath"] == (
        "metadata.annotations['batch.kubernetes.io/job-completion-index']"
    )
    assert "--node-rank=$(NODE_RANK)" in container["args"]
    subdomain = pod_spec(job)["subdomain"]
    assert services[subdomain]["spec"]["clusterIP"] == "None"
    assert trainer.master_addr == f"{trainer_name}-0.{subdomain}.{NAMESPACE}.svc.cluster.local"
    assert (REPO_ROOT / trainer.entry).is_file()


def test_network_policies_guard_every_tier_port_and_let_its_clients_in() -> None:
    # Each tier workload's gRPC port is open only to the components that call it; the
    # selectors must match real pods and the ports real container ports, or the policy
    # silently guards nothing (or blocks the clients).
    workloads = [d for d in core_docs() if d["kind"] in ("Deployment", "StatefulSet", "Job")]

    def labels(workload: dict) -> dict:
        return workload["spec"]["template"]["metadata"]["labels"]

    components = {labels(w)["app.kubernetes.io/component"] for w in workloads}
    callers = {  # who calls whom, from the --ps / --embedding-workers wiring
        "ps": {"embedding-worker", "server"},
        "ps-train": {"embedding-worker-train"},
        "embedding-worker": {"server"},
        "embedding-worker-train": {"trainer"},
    }
    policies = by_kind("NetworkPolicy")
    assert set(policies) == set(callers)
    for name, policy in policies.items():
        selector = policy["spec"]["podSelector"]["matchLabels"]
        (target,) = [w for w in workloads if selector.items() <= labels(w).items()]
        ports = {
            p["containerPort"]: p["name"]
            for c in recserve_containers(target)
            for p in c.get("ports", ())
        }
        assert policy["spec"]["policyTypes"] == ["Ingress"]
        grpc_rule, metrics_rule = policy["spec"]["ingress"]
        assert [ports[p["port"]] for p in grpc_rule["ports"]] == ["grpc"], name
        allowed = set()
        for peer in grpc_rule["from"]:
            match = peer["podSelector"]
            allowed |= set(match.get("matchLabels", {}).values()) - {"recserve"}
            for expression in match.get("matchExpressions", ()):
                assert expression["operator"] == "In"
                allowed |= set(expression["values"])
        assert allowed == callers[name] and allowed <= components, name
        assert "from" not in metrics_rule  # Prometheus, from anywhere
        assert [ports[p["port"]] for p in metrics_rule["ports"]] == ["metrics"], name


def test_tier_pods_take_the_token_from_an_optional_secret() -> None:
    for workload in core_docs():
        if workload["kind"] not in ("Deployment", "StatefulSet", "Job"):
            continue
        assert pod_spec(workload)["automountServiceAccountToken"] is False
        (container,) = recserve_containers(workload)
        env = {e["name"]: e for e in container["env"]}
        reference = env["RECSERVE_TIER_TOKEN"]["valueFrom"]["secretKeyRef"]
        assert reference == {"name": "recserve-tier-token", "key": "token", "optional": True}


def test_optional_servicemonitors_select_services() -> None:
    services = by_kind("Service")
    for doc in k8s_docs(K8S / "optional" / "servicemonitor.yaml"):
        assert doc["kind"] == "ServiceMonitor"
        selector = doc["spec"]["selector"]["matchLabels"]
        selected = [
            s for s in services.values() if selector.items() <= s["metadata"]["labels"].items()
        ]
        assert selected, f"ServiceMonitor {doc['metadata']['name']} selects no Service"
        ports = {p["name"] for s in selected for p in s["spec"]["ports"]}
        assert {e["port"] for e in doc["spec"]["endpoints"]} <= ports


# --------------------------------------------------------------------------- TLS overlays
# deploy/k8s-overlays/tls and .../mtls: kustomize overlays of deploy/k8s (beside it: kustomize
# refuses an overlay inside its base's directory) that turn on TLS in the prediction server.
# Rendered here in Python (strategic merge and JSON 6902 patches, the subset they use) and,
# where kubectl is installed, by `kubectl kustomize`, which must agree.
OVERLAYS = DEPLOY / "k8s-overlays"
TLS_OVERLAYS = ("tls", "mtls")
SERVER_TLS_SECRET = "recserve-server-tls"
CLIENT_CA_SECRET = "recserve-client-ca"
#: The flags each overlay puts on the server: flag -> (Secret, key) of the file it names.
TLS_FILES = {
    "tls": {"tls_cert": (SERVER_TLS_SECRET, "tls.crt"), "tls_key": (SERVER_TLS_SECRET, "tls.key")},
    "mtls": {
        "tls_cert": (SERVER_TLS_SECRET, "tls.crt"),
        "tls_key": (SERVER_TLS_SECRET, "tls.key"),
        "tls_client_ca": (CLIENT_CA_SECRET, "ca.crt"),
    },
}
PROBES = ("startupProbe", "readinessProbe", "livenessProbe")
#: deploy/k8s-overlays/tier-tls: the embedding tier's mutual TLS, the Component
#: components/tier-tls applied to deploy/k8s (docs/deploy.md, "Tier TLS").
TIER_TLS_OVERLAY = "tier-tls"
TIER_TLS_COMPONENT = OVERLAYS / "components" / "tier-tls"
TIER_TLS_SECRET = "recserve-tier-tls"
#: Variable -> the Secret's key of the file it names (cert-manager's names).
TIER_TLS_KEYS = {
    "RECSERVE_TIER_TLS_CERT": "tls.crt",
    "RECSERVE_TIER_TLS_KEY": "tls.key",
    "RECSERVE_TIER_TLS_CA": "ca.crt",
}
#: The image's health check script (deploy/docker/Dockerfile: the repository at /app).
IMAGE_HEALTHCHECK = ["python", "/app/deploy/scripts/healthcheck.py"]
#: Lists a strategic merge patch merges item by item, by this key (kustomize's, for pods).
_MERGE_KEYS = {
    "containers": "name",
    "initContainers": "name",
    "volumes": "name",
    "volumeMounts": "mountPath",
    "env": "name",
    "ports": "containerPort",
}

requires_kubectl = pytest.mark.skipif(
    shutil.which("kubectl") is None, reason="kubectl is not installed"
)


def _strategic_merge(base: dict, patch: dict) -> None:
    for key, value in patch.items():
        if value is None:
            base.pop(key, None)
        elif isinstance(value, dict) and isinstance(base.get(key), dict):
            _strategic_merge(base[key], value)
        elif isinstance(value, list) and key in _MERGE_KEYS and isinstance(base.get(key), list):
            merge_key = _MERGE_KEYS[key]
            items = {item[merge_key]: item for item in base[key]}
            added = []
            for item in value:
                if item[merge_key] in items:
                    _strategic_merge(items[item[merge_key]], item)
                else:
                    added.append(copy.deepcopy(item))
            base[key][:0] = added  # kustomize puts new items first
        else:
            base[key] = copy.deepcopy(value)


def _json_patch(doc: dict, operations: list[dict]) -> None:
    """RFC 6902 add, remove and test (what the overlays use); a missing path raises."""
    for operation in operations:
        parts = [p.replace("~1", "/").replace("~0", "~") for p in operation["path"][1:].split("/")]
        *parents, last = parts
        target = doc
        for part in parents:
            target = target[int(part)] if isinstance(target, list) else target[part]
        key: int | str = last
        if isinstance(target, list):
            key = len(target) if last == "-" else int(last)
        op = operation["op"]
        if op == "test":
            assert target[key] == operation["value"], f"test failed: {operation}"
        elif op == "add" and isinstance(target, list):
            target.insert(key, copy.deepcopy(operation["value"]))
        elif op == "add":
            target[key] = copy.deepcopy(operation["value"])
        elif op == "remove":
            del target[key]
        else:
            pytest.fail(f"unsupported JSON patch op {op!r}")


def _keyed(docs) -> dict[tuple[str, str], dict]:
    keyed = {(d["kind"], d["metadata"]["name"]): copy.deepcopy(d) for d in docs}
    assert len(keyed) == len(docs), "an object is defined twice"
    return keyed


def render_overlay(directory: Path, base: dict[tuple[str, str], dict]) -> dict:
    """The objects ``kubectl kustomize directory`` makes of ``base`` (deploy/k8s's objects),
    for overlays made of resources, components and patches only."""
    k = yaml.safe_load((directory / "kustomization.yaml").read_text())
    assert k["apiVersion"] == "kustomize.config.k8s.io/v1beta1" and k["kind"] == "Kustomization"
    assert set(k) <= {"apiVersion", "kind", "resources", "components", "patches"}, directory
    (parent,) = k["resources"]
    parent_dir = (directory / parent).resolve()
    assert parent_dir.is_dir(), f"{directory}: {parent} is not a directory"
    docs = _keyed(base.values()) if parent_dir == K8S else render_overlay(parent_dir, base)
    for component in k.get("components", []):
        component_dir = (directory / component).resolve()
        c = yaml.safe_load((component_dir / "kustomization.yaml").read_text())
        assert c["apiVersion"] == "kustomize.config.k8s.io/v1alpha1" and c["kind"] == "Component"
        assert set(c) <= {"apiVersion", "kind", "patches"}, component_dir
        _apply_patches(component_dir, c["patches"], docs)
    _apply_patches(directory, k.get("patches", []), docs)
    return docs


def _apply_patches(directory: Path, patches: list[dict], docs: dict) -> None:
    for patch in patches:
        body = yaml.safe_load((directory / patch["path"]).read_text())
        if isinstance(body, list):  # JSON 6902: the target names the object
            target = patch["target"]
            doc = docs[(target["kind"], target["name"])]
            api = f"{target['group']}/{target['version']}" if target.get("group") else "v1"
            assert doc["apiVersion"] == api, f"{patch['path']}: {api} != {doc['apiVersion']}"
            _json_patch(doc, body)
        else:  # strategic merge: the patch names the object itself
            assert "target" not in patch, patch
            key = (body["kind"], body["metadata"]["name"])
            assert key in docs, f"{directory / patch['path']} patches no object ({key})"
            doc = docs[key]
            assert body["apiVersion"] == doc["apiVersion"], patch["path"]
            assert body["metadata"].get("namespace", NAMESPACE) == NAMESPACE
            # Every container the patch names exists (a new one would be added silently).
            for field in ("containers", "initContainers"):
                names = {c["name"] for c in pod_spec(doc).get(field, [])}
                for container in body["spec"]["template"]["spec"].get(field, []):
                    assert container["name"] in names, f"{patch['path']}: {container['name']}"
            _strategic_merge(doc, body)


def check_tls_server(overlay: str, deployment: dict, base_deployment: dict) -> None:
    """The server Deployment of ``overlay``: its flags parse, name files in the mounted
    Secrets, and its probes and scrape annotations speak TLS to ports it has."""
    for version in K8S_VERSIONS:
        try:
            kubernetes_validate.validate(deployment, version, strict=True)
        except kubernetes_validate.ValidationError as error:
            pytest.fail(f"{overlay}: Deployment/server: {error.message}")
    (container,) = recserve_containers(deployment)
    (base_container,) = recserve_containers(base_deployment)
    assert container["args"][: len(base_container["args"])] == base_container["args"]
    args = parse_recserve(substituted_args(container))
    assert args.command == "serve"
    volumes = {v["name"]: v for v in pod_spec(deployment)["volumes"]}
    mounts = {m["mountPath"]: m for m in container["volumeMounts"]}
    for flag in ("tls_cert", "tls_key", "tls_client_ca"):
        path = getattr(args, flag)
        if flag not in TLS_FILES[overlay]:
            assert path is None, f"{overlay}: --{flag.replace('_', '-')} {path}"
            continue
        secret, key = TLS_FILES[overlay][flag]
        assert path is not None, f"{overlay}: no --{flag.replace('_', '-')}"
        directory, _, name = str(path).rpartition("/")
        mount = mounts.get(directory)
        assert mount is not None, f"{overlay}: {path} is in no mounted volume"
        assert mount.get("readOnly") is True and "subPath" not in mount, mount
        volume = volumes[mount["name"]]["secret"]
        assert volume["secretName"] == secret, f"{overlay}: {path} is not from {secret}"
        assert not volume.get("optional"), "the server must not start without its certificate"
        assert "items" not in volume and name == key, f"{overlay}: {path}: key {key}"
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    for probe_name in PROBES:
        probe, base_probe = container[probe_name], base_container[probe_name]
        if overlay == "mtls":  # the kubelet has no client certificate
            assert "httpGet" not in probe and ports[probe["tcpSocket"]["port"]] == args.http_port
            handler = "tcpSocket"
        else:
            get, base_get = probe["httpGet"], base_probe["httpGet"]
            assert get["scheme"] == "HTTPS", f"{overlay}: {probe_name}"
            assert get == dict(base_get, scheme="HTTPS"), f"{overlay}: {probe_name}"
            assert ports[get["port"]] == args.http_port, f"{overlay}: {probe_name}"
            handler = "httpGet"
        timing = {k: v for k, v in probe.items() if k != handler}
        assert timing == {k: v for k, v in base_probe.items() if k != "httpGet"}, probe_name
    annotations = deployment["spec"]["template"]["metadata"]["annotations"]
    assert annotations["prometheus.io/scheme"] == "https"
    assert annotations["prometheus.io/port"] == str(args.http_port)
    # Nothing else in the pod changed: the other containers, the rest of the server's.
    spec, base_spec = pod_spec(deployment), pod_spec(base_deployment)
    assert spec["initContainers"] == base_spec["initContainers"]
    assert {k: v for k, v in spec.items() if k not in ("containers", "volumes")} == {
        k: v for k, v in base_spec.items() if k not in ("containers", "volumes")
    }
    assert all(volume in spec["volumes"] for volume in base_spec["volumes"])
    assert all(mount in container["volumeMounts"] for mount in base_container["volumeMounts"])
    changed = {*PROBES, "args", "volumeMounts"}
    assert {k: v for k, v in container.items() if k not in changed} == {
        k: v for k, v in base_container.items() if k not in changed
    }


@pytest.mark.parametrize("overlay", TLS_OVERLAYS)
def test_tls_overlay_patches_the_server_deployment(overlay: str) -> None:
    base = _keyed(core_docs())
    rendered = render_overlay(OVERLAYS / overlay, base)
    assert rendered.keys() == base.keys()
    changed = [key for key in base if rendered[key] != base[key]]
    assert changed == [("Deployment", "server")], changed
    check_tls_server(overlay, rendered[("Deployment", "server")], base[("Deployment", "server")])


def test_tls_overlays_are_beside_the_base() -> None:
    # kustomize refuses an overlay inside its base's directory (a cycle), and everything under
    # deploy/k8s is a manifest the base applies or an optional one.
    assert list(K8S.rglob("kustomization.yaml")) == [K8S / "kustomization.yaml"]
    overlays = (*TLS_OVERLAYS, TIER_TLS_OVERLAY)
    directories = sorted(p.name for p in OVERLAYS.iterdir() if p.is_dir())
    assert directories == sorted((*overlays, "components"))
    assert [p.name for p in (OVERLAYS / "components").iterdir()] == [TIER_TLS_COMPONENT.name]
    for directory in (*(OVERLAYS / o for o in overlays), TIER_TLS_COMPONENT):
        k = yaml.safe_load((directory / "kustomization.yaml").read_text())
        used = {patch["path"] for patch in k.get("patches", [])}
        present = {p.name for p in directory.glob("*.yaml")} - {"kustomization.yaml"}
        apart = {"servicemonitor-patch.yaml"} if directory.name == "tls" else set()
        assert present == used | apart, f"{directory}: {sorted(present ^ (used | apart))}"


def test_tls_servicemonitor_patch_scrapes_https() -> None:
    monitor = _server_monitor()
    patch = yaml.safe_load((OVERLAYS / "tls" / "servicemonitor-patch.yaml").read_text())
    _json_patch(monitor, patch)
    (endpoint,) = monitor["spec"]["endpoints"]
    assert endpoint["scheme"] == "https" and endpoint["tlsConfig"]
    assert endpoint["path"] == "/metrics"
    # ... on the Service port that reaches the server's HTTP (and TLS) port.
    service = by_kind("Service")["server"]
    (port,) = [p for p in service["spec"]["ports"] if p["name"] == endpoint["port"]]
    (container,) = recserve_containers(by_kind("Deployment")["server"])
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert ports[port["targetPort"]] == parse_recserve(container["args"]).http_port


@functools.cache
def kubectl_kustomize(directory: Path) -> dict[tuple[str, str], dict]:
    result = subprocess.run(
        ["kubectl", "kustomize", str(directory)], capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0, result.stderr
    return _keyed([d for d in yaml.safe_load_all(result.stdout) if d is not None])


@requires_kubectl
@pytest.mark.parametrize("overlay", TLS_OVERLAYS)
def test_tls_overlay_renders_with_kubectl(overlay: str) -> None:
    base = kubectl_kustomize(K8S)
    rendered = kubectl_kustomize(OVERLAYS / overlay)
    assert rendered.keys() == base.keys()
    changed = [key for key in base if rendered[key] != base[key]]
    assert changed == [("Deployment", "server")], changed
    server, base_server = rendered[("Deployment", "server")], base[("Deployment", "server")]
    check_tls_server(overlay, server, base_server)
    # The Python rendering above does what kustomize does.
    assert render_overlay(OVERLAYS / overlay, base)[("Deployment", "server")] == server


def _dials_the_tier(container: dict) -> bool:
    """A container that speaks to the tier: ``recserve ...`` (every role does), or a health
    check of tier gRPC ports (the init containers that wait for the tier)."""
    command = container.get("command")
    if command is None:
        return container["image"].split(":")[0] == IMAGE
    return any(str(word).startswith("grpc://") for word in command)


def _inside(path: str, directory: str) -> bool:
    return path == directory or path.startswith(directory.rstrip("/") + "/")


def check_tier_tls(name: str, workload: dict, base_workload: dict) -> None:
    """One workload of the tier-tls rendering: its tier containers read the three files from
    a read-only mount of the Secret, no kubelet grpc probe is left, and nothing else moved."""
    for version in K8S_VERSIONS:
        try:
            kubernetes_validate.validate(workload, version, strict=True)
        except kubernetes_validate.ValidationError as error:
            pytest.fail(f"{name}: {error.message}")
    spec, base_spec = pod_spec(workload), pod_spec(base_workload)
    volumes = {v["name"]: v for v in spec["volumes"]}
    assert all(volume in spec["volumes"] for volume in base_spec["volumes"]), name
    assert len(spec["volumes"]) == len(base_spec["volumes"]) + 1, name
    # Outside the containers and volumes, the workload is the base's.
    strip = ("containers", "initContainers", "volumes")
    assert {k: v for k, v in spec.items() if k not in strip} == {
        k: v for k, v in base_spec.items() if k not in strip
    }, name
    assert {k: v for k, v in workload["spec"].items() if k != "template"} == {
        k: v for k, v in base_workload["spec"].items() if k != "template"
    }, name
    assert workload["metadata"] == base_workload["metadata"], name
    assert workload["spec"]["template"]["metadata"] == base_workload["spec"]["template"]["metadata"]
    dialing = []
    for field in ("initContainers", "containers"):
        containers, base_containers = spec.get(field, []), base_spec.get(field, [])
        assert [c["name"] for c in containers] == [c["name"] for c in base_containers], name
        for container, base_container in zip(containers, base_containers, strict=True):
            where = f"{name} {container['name']}"
            if not _dials_the_tier(base_container):
                assert container == base_container, f"{where} does not dial the tier"
                continue
            dialing.append(container["name"])
            # The three variables, plain values, each naming its key in a read-only mount
            # of the whole Secret (no subPath: a renewed Secret reaches the files).
            env = {e["name"]: e for e in container["env"]}
            mounts = {m["mountPath"]: m for m in container["volumeMounts"]}
            for variable, key in TIER_TLS_KEYS.items():
                directory, _, file = env[variable]["value"].rpartition("/")
                assert set(env[variable]) == {"name", "value"}, f"{where}: {variable}"
                mount = mounts.get(directory)
                assert mount is not None, f"{where}: {variable} is in no mounted volume"
                assert mount.get("readOnly") is True and "subPath" not in mount, where
                secret = volumes[mount["name"]]["secret"]
                assert secret["secretName"] == TIER_TLS_SECRET, where
                assert not secret.get("optional"), f"{where}: a tier pod without its files"
                assert "items" not in secret and file == key, f"{where}: {variable}: {key}"
                # Not inside another mount (the ConfigMap's, read-only, at /etc/recserve):
                # the runtime could not make the mount point there.
                others = [p for p in mounts if p != directory]
                assert not any(_inside(directory, p) or _inside(p, directory) for p in others)
            base_env = base_container.get("env", [])
            assert [e for e in container["env"] if e["name"] not in TIER_TLS_KEYS] == base_env
            assert len(container["env"]) == len(base_env) + len(TIER_TLS_KEYS), where
            base_mounts = base_container.get("volumeMounts", [])
            assert [m for m in container["volumeMounts"] if m["mountPath"] != directory] == (
                base_mounts
            ), where
            # Probes: no kubelet grpc probe (plaintext only): the health check script on the
            # container's own port, asking the base probe's health service. Timings kept.
            ports = {p["name"]: p["containerPort"] for p in container.get("ports", [])}
            for probe_name in PROBES:
                probe, base_probe = container.get(probe_name), base_container.get(probe_name)
                if base_probe is None:
                    assert probe is None, where
                    continue
                assert "grpc" not in probe, f"{where}: {probe_name} is a kubelet grpc probe"
                if "grpc" not in base_probe:
                    assert probe == base_probe, f"{where}: {probe_name}"
                    continue
                port = base_probe["grpc"]["port"]
                assert port in ports.values(), f"{where}: {probe_name} on {port}"
                service = base_probe["grpc"].get("service", "")
                assert service in ("", LIVENESS_SERVICE), f"{where}: {probe_name}"
                command = probe["exec"]["command"]
                assert command[:2] == IMAGE_HEALTHCHECK, f"{where}: {command}"
                assert (REPO_ROOT / command[1].removeprefix("/app/")).is_file()
                health = load_healthcheck_module()
                *options, target = command[2:]
                argv = ["recserve", *substituted_args(container)]
                own = health.targets_from_argv(argv)
                assert [target] == own == [f"grpc://127.0.0.1:{port}"], f"{where}: {target}"
                # The script gives up before the kubelet does, and asks the same service.
                timeout, *asked = options
                assert float(timeout.removeprefix("--timeout=")) < base_probe.get(
                    "timeoutSeconds", 1
                ), f"{where}: {timeout}"
                assert asked == ([f"--service={service}"] if service else []), where
                parsed = health.parse_args(command[2:])
                assert (parsed.service, parsed.targets) == (service, [target]), where
                handler = "exec"
                assert set(probe) - {handler} == set(base_probe) - {"grpc"}, where
                timing = {k: v for k, v in probe.items() if k != handler}
                assert timing == {k: v for k, v in base_probe.items() if k != "grpc"}, where
            changed = {*PROBES, "env", "volumeMounts"}
            assert {k: v for k, v in container.items() if k not in changed} == {
                k: v for k, v in base_container.items() if k not in changed
            }, where
    assert dialing, f"{name}: no container speaks to the tier"


def check_tier_tls_overlay(rendered: dict, base: dict) -> None:
    assert rendered.keys() == base.keys()
    changed = {key for key in base if rendered[key] != base[key]}
    # Every workload speaks to the tier (servers, clients, trainer): all change, nothing else.
    assert changed == {key for key in base if key[0] in WORKLOAD_KINDS}, sorted(changed)
    for key in sorted(changed):
        check_tier_tls(f"{key[0]}/{key[1]}", rendered[key], base[key])


def test_tier_tls_overlay_mounts_the_secret_in_every_tier_pod() -> None:
    base = _keyed(core_docs())
    check_tier_tls_overlay(render_overlay(OVERLAYS / TIER_TLS_OVERLAY, base), base)


def _ordered(doc):
    """``doc`` with the lists a strategic merge merges by key in key order (where kustomize
    puts a new item, first or last, is no matter for them; containers keep theirs)."""
    if isinstance(doc, dict):
        return {
            k: sorted((_ordered(i) for i in v), key=lambda i: i[_MERGE_KEYS[k]])
            if k in ("env", "volumes", "volumeMounts") and isinstance(v, list)
            else _ordered(v)
            for k, v in doc.items()
        }
    if isinstance(doc, list):
        return [_ordered(i) for i in doc]
    return doc


@requires_kubectl
def test_tier_tls_overlay_renders_with_kubectl() -> None:
    base = kubectl_kustomize(K8S)
    rendered = kubectl_kustomize(OVERLAYS / TIER_TLS_OVERLAY)
    check_tier_tls_overlay(rendered, base)
    # The Python rendering above does what kustomize does.
    assert _ordered(render_overlay(OVERLAYS / TIER_TLS_OVERLAY, base)) == _ordered(rendered)


@requires_kubectl
@pytest.mark.parametrize("overlay", TLS_OVERLAYS)
def test_tier_tls_component_composes_with_the_server_tls_overlays(
    overlay: str, tmp_path: Path
) -> None:
    """The documented overlay of both: resources ../<overlay>, components the tier's (paths
    relative to the overlay's directory: kustomize refuses absolute ones)."""
    (tmp_path / "kustomization.yaml").write_text(
        yaml.safe_dump(
            {
                "apiVersion": "kustomize.config.k8s.io/v1beta1",
                "kind": "Kustomization",
                "resources": [os.path.relpath(OVERLAYS / overlay, tmp_path)],
                "components": [os.path.relpath(TIER_TLS_COMPONENT, tmp_path)],
            }
        )
    )
    both = kubectl_kustomize(tmp_path)
    server_tls = kubectl_kustomize(OVERLAYS / overlay)
    tier_tls = kubectl_kustomize(OVERLAYS / TIER_TLS_OVERLAY)
    server = ("Deployment", "server")
    assert both.keys() == tier_tls.keys()
    assert all(both[key] == tier_tls[key] for key in both if key != server)
    # The server: the front end's TLS over the tier's (the tier's TLS on the server TLS).
    check_tier_tls("Deployment/server", both[server], server_tls[server])


def _server_monitor() -> dict:
    (monitor,) = [
        copy.deepcopy(d)
        for d in k8s_docs(K8S / "optional" / "servicemonitor.yaml")
        if d["metadata"]["name"] == "recserve-server"
    ]
    return monitor


@requires_kubectl
def test_tls_servicemonitor_patch_applies_with_kubectl(tmp_path: Path) -> None:
    """The documented `kubectl patch --type=json --patch-file` takes the file (YAML), and
    does what the Python patch above does."""
    monitor = _server_monitor()
    path = tmp_path / "servicemonitor.yaml"
    path.write_text(yaml.safe_dump(monitor))
    patch = OVERLAYS / "tls" / "servicemonitor-patch.yaml"
    command = ["kubectl", "patch", "--local", "-f", str(path), "--type=json"]
    command += ["--patch-file", str(patch), "-o", "json"]
    result = subprocess.run(command, capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    _json_patch(monitor, yaml.safe_load(patch.read_text()))
    assert json.loads(result.stdout) == monitor


# --------------------------------------------------------------------------- compose
def compose() -> dict:
    return yaml.safe_load((DEPLOY / "docker-compose.yml").read_text())


def test_docker_compose_references_exist() -> None:
    data = compose()
    services = data["services"]
    named_volumes = set(data.get("volumes", {}))
    host_ports: list[str] = []
    parsed = {}
    for name, service in services.items():
        if "build" in service:
            context = (DEPLOY / service["build"]["context"]).resolve()
            assert context.is_dir(), f"{name}: build context {context}"
            assert (context / service["build"]["dockerfile"]).is_file()
        for volume in service.get("volumes", []):
            source, target = volume.split(":")[:2]
            if source.startswith((".", "/")):
                assert (DEPLOY / source).exists(), f"{name}: {source} does not exist"
            else:
                assert source in named_volumes, f"{name}: volume {source} is not declared"
        for target, condition in service.get("depends_on", {}).items():
            assert target in services, f"{name} depends on unknown {target}"
            assert condition["condition"] in (
                "service_started",
                "service_healthy",
                "service_completed_successfully",
            )
            if condition["condition"] == "service_healthy":
                assert not services[target].get("healthcheck", {}).get("disable")
        for port in service.get("ports", []):
            host_ports.append(str(port).split(":")[0])
        if service.get("image", "").split(":")[0] == IMAGE and "entrypoint" not in service:
            parsed[name] = args = parse_recserve(service["command"])
            for flag in ("embedding_config", "global_config"):
                path = getattr(args, flag, None)
                if path is not None:
                    assert path.startswith("/etc/recserve/")
                    assert (CONFIGS / path.removeprefix("/etc/recserve/")).is_file(), path
            test = service["healthcheck"]["test"]
            assert test[0] == "CMD" and test[1] == "python"
            if test[2].startswith("/app/"):
                assert (REPO_ROOT / test[2].removeprefix("/app/")).is_file()
        if service.get("restart") != "no":
            assert service.get("restart") in ("always", "unless-stopped", "on-failure"), name
    assert len(host_ports) == len(set(host_ports)), f"host ports collide: {host_ports}"

    # Two shards named in order by the worker, the server on the worker, all on one checkpoint.
    shards = sorted(n for n, a in parsed.items() if a.command == "embedding-parameter-server")
    assert [parsed[n].replica_index for n in shards] == list(range(len(shards))) == [0, 1]
    assert {parsed[n].replica_size for n in shards} == {len(shards)}
    (worker,) = [n for n, a in parsed.items() if a.command == "embedding-worker"]
    assert parsed[worker].ps == [f"{n}:{parsed[n].port}" for n in shards]
    (server,) = [n for n, a in parsed.items() if a.command == "serve"]
    assert parsed[server].embedding_workers == f"{worker}:{parsed[worker].port}"
    infer = load_global_config(CONFIGS / "global_config.infer.yml").common_config.infer_config
    assert infer.embedding_checkpoint == f"{parsed[server].checkpoint}/embeddings"
    trainer = services["trainer"]
    assert f"--checkpoint-dir {parsed[server].checkpoint} " in " ".join(trainer["command"])
    for name in [*shards, server]:
        assert services[name]["depends_on"]["trainer"] == {
            "condition": "service_completed_successfully"
        }


def test_prometheus_targets_are_compose_services() -> None:
    services = compose()["services"]
    config = yaml.safe_load((DEPLOY / "prometheus" / "prometheus.yml").read_text())
    assert "prometheus" in services
    mounts = [v.split(":")[0] for v in services["prometheus"]["volumes"]]
    assert "./prometheus/prometheus.yml" in mounts
    targets = [
        t for job in config["scrape_configs"] for s in job["static_configs"] for t in s["targets"]
    ]
    assert targets
    for target in targets:
        host, _, port = target.rpartition(":")
        assert host in services, f"target {target} is not a compose service"
        args = parse_recserve(services[host]["command"])
        assert int(port) in (getattr(args, "metrics_port", None), getattr(args, "http_port", None))


# --------------------------------------------------------------------------- Docker
def test_dockerfiles() -> None:
    cpu = (DEPLOY / "docker" / "Dockerfile").read_text()
    assert re.search(r"^FROM python:3\.11-slim", cpu, re.M)
    torch_install = cpu.index('pip install "torch==${TORCH_VERSION}"')
    assert torch_install < cpu.index("pip install /app"), "torch must come first"
    assert "ARG TORCH_VERSION=2.13.0" in cpu
    assert "ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu" in cpu
    assert re.search(r"^USER 10001", cpu, re.M) and "HEALTHCHECK" in cpu
    assert 'ENTRYPOINT ["recserve"]' in cpu
    cuda = (DEPLOY / "docker" / "Dockerfile.cuda").read_text()
    assert "nvidia/cuda:" in cuda and "download.pytorch.org/whl/${CUDA_INDEX}" in cuda
    assert "NOT BUILT" in cuda
    for dockerfile in ("Dockerfile", "Dockerfile.cuda"):
        ignore = (DEPLOY / "docker" / f"{dockerfile}.dockerignore").read_text().splitlines()
        kept = {line[1:].rstrip("/") for line in ignore if line.startswith("!")}
        needed = {"pyproject.toml", "README.md", "embedding_store", "training", "serving"}
        assert needed | {"examples", "deploy/scripts", "deploy/configs"} <= kept
        for path in kept:
            assert (REPO_ROOT / path).exists(), f"{dockerfile}.dockerignore keeps {path}"


def test_healthcheck_targets_from_command_lines() -> None:
    health = load_healthcheck_module()
    assert health.targets_from_argv(["/usr/local/bin/recserve", "serve", "--http-port=9000"]) == [
        "http://127.0.0.1:9000/v2/health/ready"
    ]
    assert health.targets_from_argv(["recserve", "serve", "--host", "0.0.0.0"]) == [
        "http://127.0.0.1:8000/v2/health/ready"
    ]
    assert health.targets_from_argv(
        ["recserve", "embedding-parameter-server", "--port=7000", "--host=0.0.0.0"]
    ) == ["grpc://127.0.0.1:7000"]
    assert health.targets_from_argv(["recserve", "embedding-worker", "--port", "7100"]) == [
        "grpc://127.0.0.1:7100"
    ]
    assert health.targets_from_argv(
        ["recserve", "serve", "--http-port=8443", "--tls-cert", "c.pem", "--tls-key", "k.pem"]
    ) == ["https://127.0.0.1:8443/v2/health/ready"]
    # Mutual TLS refuses a client without a certificate: only the port can be checked.
    assert health.targets_from_argv(
        ["recserve", "serve", "--tls-cert=c.pem", "--tls-key=k.pem", "--tls-client-ca=ca.pem"]
    ) == ["tcp://127.0.0.1:8000"]
    assert health.targets_from_argv(["recserve", "train", "--entry", "x.py"]) == []
    assert health.check("grpc://127.0.0.1:1", timeout=0.5) is not None
    assert health.main(["--wait", "0", "http://127.0.0.1:1/v2/health/ready"]) == 1


# --------------------------------------------------------------------------- Procfiles
@pytest.mark.parametrize(
    ("procfile", "env"), [("Procfile", ".env"), ("Procfile.serving", ".env.serving")]
)
def test_procfile_variables_are_defined(procfile: str, env: str) -> None:
    defined = set(env_file(DEPLOY / env))
    text = "\n".join(
        line for line in (DEPLOY / procfile).read_text().splitlines() if not line.startswith("#")
    )
    used = set(re.findall(r"\$\{?([A-Za-z_][A-Za-z0-9_]*)", text))
    assert used, procfile
    assert used <= defined, f"{procfile} uses {sorted(used - defined)}, undefined in {env}"


@pytest.mark.parametrize("procfile", ["Procfile", "Procfile.serving"])
def test_every_procfile_process_execs_its_program(procfile: str) -> None:
    # Without exec, /bin/sh stays the parent: honcho's SIGTERM reaches the shell, and the
    # program's own shutdown (drain, dump on exit) is cut short.
    for line in (DEPLOY / procfile).read_text().splitlines():
        if not line.strip() or line.startswith("#"):
            continue
        name, command = line.split(":", 1)
        last = command.split("&&")[-1].strip()
        assert last.startswith("exec "), f"{procfile} process {name!r} does not exec: {command}"


def _honcho() -> str:
    candidate = Path(sys.executable).with_name("honcho")
    found = str(candidate) if candidate.exists() else shutil.which("honcho")
    if not found:
        pytest.skip("honcho is not installed (pip install -e '.[dev]')")
    return found


def _process_env() -> dict[str, str]:
    env = dict(os.environ)
    env["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), env.get("PATH", "")])
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO_ROOT), env.get("PYTHONPATH")]))
    env["OMP_NUM_THREADS"] = "1"
    return env


@contextlib.contextmanager
def honcho_start(procfile: str, env_path: Path, log_path: Path) -> Iterator[subprocess.Popen]:
    """``honcho start`` in its own process group; on exit SIGTERM that group (honcho stops
    its processes), then SIGKILL whatever it started that is still running, by PID."""
    command = [_honcho(), "-f", str(DEPLOY / procfile), "-e", str(env_path)]
    command += ["-d", str(REPO_ROOT), "start"]
    with open(log_path, "wb") as log:
        process = subprocess.Popen(
            command,
            cwd=REPO_ROOT,
            env=_process_env(),
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    try:
        yield process
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGTERM)
            try:
                process.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(process.pid, signal.SIGKILL)
                process.wait()
        started = re.findall(r"started \(pid=(\d+)\)", log_path.read_text(errors="replace"))
        for pid in map(int, started):
            with contextlib.suppress(ProcessLookupError):
                os.killpg(pid, signal.SIGKILL)  # honcho runs each process in its own group


def _fail(message: str, log_path: Path) -> None:
    pytest.fail(f"{message}\n--- honcho log ---\n{log_path.read_text(errors='replace')[-6000:]}")


def _wait_until(condition, process: subprocess.Popen, log_path: Path, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process.poll() is not None:
            _fail(f"honcho exited ({process.returncode}) before {what}", log_path)
        result = condition()
        if result:
            return result
        time.sleep(0.25)
    _fail(f"timed out after {timeout:.0f} s waiting for {what}", log_path)


def _http_get(url: str) -> bytes | None:
    try:
        with urllib.request.urlopen(url, timeout=3) as response:
            return response.read() if response.status == 200 else None
    except (OSError, urllib.error.HTTPError):
        return None


def _write_env(path: Path, base: Path, **overrides: object) -> dict[str, str]:
    values = env_file(base)
    values.update({k: str(v) for k, v in overrides.items()})
    path.write_text("".join(f"{k}={shlex.quote(v)}\n" for k, v in values.items()))
    return values


def test_procfile_embedding_tier_comes_up(tmp_path: Path) -> None:
    """deploy/Procfile: 2 Train-mode shards and a worker; the worker reports SERVING (it
    reached both shards), the shards serve /metrics, and once configured the tier answers
    training lookups of Adult rows on both shards."""
    from embedding_store.optimizers import SGD
    from embedding_store.worker_client import RemoteEmbeddingWorker
    from examples.adult_income.preprocess import instances_to_batch

    health = load_healthcheck_module()
    ps0, ps1, m0, m1, worker, worker_metrics = free_ports(6)
    settings = _write_env(
        tmp_path / "tier.env",
        DEPLOY / ".env",
        PS0_PORT=ps0,
        PS1_PORT=ps1,
        PS0_METRICS_PORT=m0,
        PS1_METRICS_PORT=m1,
        WORKER_PORT=worker,
        WORKER_METRICS_PORT=worker_metrics,
    )
    log_path = tmp_path / "honcho.log"
    with honcho_start("Procfile", tmp_path / "tier.env", log_path) as process:
        target = f"grpc://127.0.0.1:{worker}"
        _wait_until(
            lambda: health.check(target, 2.0) is None, process, log_path, 90, "worker SERVING"
        )
        for port in (ps0, ps1):
            # Train shards answer (NOT_SERVING until a trainer configures their optimizer).
            assert health.check(f"grpc://127.0.0.1:{port}", 2.0) in (None, "NOT_SERVING")
        for port in (m0, m1):
            metrics = _wait_until(
                lambda p=port: _http_get(f"http://127.0.0.1:{p}/metrics"),
                process,
                log_path,
                30,
                f"metrics on {port}",
            )
            assert b"recserve_ps" in metrics
        metrics = _http_get(f"http://127.0.0.1:{worker_metrics}/metrics") or b""
        assert b"recserve_worker_lookups_total" in metrics, metrics[-2000:]
        config = load_embedding_config(REPO_ROOT / settings["RECSERVE_EMBEDDING_CONFIG"])
        tier = RemoteEmbeddingWorker(f"127.0.0.1:{worker}", config, timeout=30)
        try:
            tier.configure(optimizer=SGD(lr=0.1))
            rows = [dict(ADULT_ROW, age=age, fnlwgt=age * 1000) for age in range(20, 70)]
            batch = instances_to_batch(rows)
            result = tier.lookup(batch, train=True)
            assert [s.name for s in result.slots] == [f.name for f in batch.id_type_features]
            assert all(s.embeddings.shape[0] == len(rows) for s in result.slots)
            rows_per_shard = tier.status().rows_per_shard
            assert len(rows_per_shard) == 2 and min(rows_per_shard) > 0, rows_per_shard
        finally:
            tier.close()
        for port in (ps0, ps1):  # configured Train shards report SERVING
            assert health.check(f"grpc://127.0.0.1:{port}", 2.0) is None
    assert process.poll() is not None


def test_procfile_serving_answers_predictions(tmp_path: Path, adult_checkpoint: Path) -> None:
    """deploy/Procfile.serving on a trained Adult checkpoint (1 epoch, the session's, which
    it only reads): Infer shards load its embeddings, the server comes up ready and answers a
    friendly-JSON prediction with a probability."""
    checkpoint = adult_checkpoint
    ps0, ps1, m0, m1, worker, worker_metrics, http, grpc_port = free_ports(8)
    _write_env(
        tmp_path / "serving.env",
        DEPLOY / ".env.serving",
        CHECKPOINT=checkpoint,
        RUN_DIR=tmp_path / "run",
        PS0_PORT=ps0,
        PS1_PORT=ps1,
        PS0_METRICS_PORT=m0,
        PS1_METRICS_PORT=m1,
        WORKER_PORT=worker,
        WORKER_METRICS_PORT=worker_metrics,
        HTTP_PORT=http,
        GRPC_PORT=grpc_port,
    )
    log_path = tmp_path / "honcho.log"
    base = f"http://127.0.0.1:{http}"
    with honcho_start("Procfile.serving", tmp_path / "serving.env", log_path) as process:
        _wait_until(
            lambda: _http_get(f"{base}/v2/health/ready"), process, log_path, 150, "readiness"
        )
        request = urllib.request.Request(
            f"{base}/v1/models/adult:predict",
            data=json.dumps({"instances": [ADULT_ROW]}).encode(),
            headers={"Content-Type": "application/json"},
        )
        with urllib.request.urlopen(request, timeout=30) as response:
            answer = json.loads(response.read())
        (prediction,) = answer["predictions"]
        assert 0.0 <= prediction[0] <= 1.0, answer
        manifest = json.loads((checkpoint / "manifest.json").read_text())
        assert answer["model_version"] == manifest["version"]
        # The shards run in Infer mode on the rendered configs, and served the lookups.
        for name in ("ps0", "ps1"):
            rendered = load_global_config(tmp_path / "run" / f"{name}.global_config.yml")
            assert rendered.common_config.job_type is JobType.INFER
            assert rendered.common_config.infer_config.embedding_checkpoint == str(
                checkpoint / "embeddings"
            )
        for port in (m0, m1, worker_metrics):  # shards and worker answered the lookups
            metrics = _http_get(f"http://127.0.0.1:{port}/metrics") or b""
            assert re.search(rb'method="Lookup"', metrics), metrics[-2000:]
        assert _http_get(f"{base}/metrics")
    assert process.poll() is not None


def test_deploy_docs_exist() -> None:
    text = (REPO_ROOT / "docs" / "deploy.md").read_text()
    for needle in ("Procfile.serving", "docker compose", "kubectl apply -k", "pod-index"):
        assert needle in text, needle
    # The TLS overlays: the commands that create their Secrets and apply them, and the
    # files the docs name exist.
    for needle in (
        f"create secret tls {SERVER_TLS_SECRET} ",
        f"create secret generic {CLIENT_CA_SECRET} --from-file=ca.crt=",
        "kubectl apply -k deploy/k8s-overlays/tls",
        "kubectl apply -k deploy/k8s-overlays/mtls",
        f"kubectl apply -k deploy/k8s-overlays/{TIER_TLS_OVERLAY}",
        f"secretName: {TIER_TLS_SECRET}",
        "components/tier-tls",
        "--patch-file deploy/k8s-overlays/tls/servicemonitor-patch.yaml",
    ):
        assert needle in text, needle
    for path in set(re.findall(r"deploy/k8s-overlays/[\w./-]*\w", text)):
        assert (REPO_ROOT / path).exists(), path


def test_compose_healthchecks_probe_the_port_each_service_listens_on() -> None:
    """A healthcheck on another port (a copy-pasted shard's 7000 on the worker) checks
    something else, or nothing: the service is marked healthy, or never, whatever it does."""
    health = load_healthcheck_module()
    checked = []
    for name, service in compose()["services"].items():
        check = service.get("healthcheck", {})
        if check.get("disable") or service.get("image", "").split(":")[0] != IMAGE:
            continue
        if "entrypoint" in service:
            continue
        probed = re.findall(r"(?:grpc|http)://[^\s'\"]+", " ".join(check["test"]))
        expected = health.targets_from_argv(["recserve", *service["command"]])
        assert probed, f"{name}: healthcheck names no target"
        assert probed == expected, f"{name}: healthcheck probes {probed}, listens on {expected}"
        checked.append(name)
    assert sorted(checked) == ["ps0", "ps1", "server", "worker"]
