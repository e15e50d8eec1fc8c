"""What the deploy files mean, checked as a cluster (or docker compose, or honcho) would run
them, statically: no engine, no cluster.

tests/integration/test_deploy.py validates the manifests against the Kubernetes schemas and
checks much of the wiring; this file checks the rest, class by class:

* every process listens on exactly the container ports (and names) its pod declares, and
  the arguments pass recserve's own checks after parsing (not only argparse's);
* every Service port reaches a port of the one workload it selects, under the same name;
  every selector (Services, PDBs, NetworkPolicies, workloads, spreading rules,
  ServiceMonitors) selects exactly the pods it is named for;
* every probe asks the process something it answers (an HTTP route of the server, the gRPC
  health service of the tier's port);
* every volume mount has its volume and every volume a mount; every path a command reads or
  writes (checkpoints, dumps, caches) is on a mount that allows it;
* the training entry's own arguments parse with the script's parser;
* the Procfiles, expanded with their .env files, parse, and wire shards, worker and server
  together; docker compose's one-shot trainer is not restarted.
"""

from __future__ import annotations

import argparse
import functools
import re
import shlex
from collections.abc import Iterator
from pathlib import Path, PurePosixPath
from types import ModuleType

import pytest
import yaml

from embedding_store.cli import build_parser
from embedding_store.config import load_global_config
from embedding_store.grpc_common import LIVENESS_SERVICE
from serving.commands import check_arguments
from tests.scripts import load_script

REPO_ROOT = Path(__file__).resolve().parents[2]
DEPLOY = REPO_ROOT / "deploy"
K8S = DEPLOY / "k8s"
CONFIGS = DEPLOY / "configs"
IMAGE = "recserve"
WORKLOAD_KINDS = ("Deployment", "StatefulSet", "Job")
COMPONENT = "app.kubernetes.io/component"
#: The health services a shard or worker answers on its gRPC port: "" (readiness) and the
#: liveness one (embedding_store/grpc_common.py).
GRPC_HEALTH_SERVICES = ("", LIVENESS_SERVICE)
#: torchrun's default rendezvous port (training/commands.py).
DEFAULT_MASTER_PORT = 29500


# --------------------------------------------------------------------------- helpers
@functools.cache
def k8s_docs() -> tuple[dict, ...]:
    """Every document of the files deploy/k8s/kustomization.yaml applies, plus the optional
    ServiceMonitors."""
    kustomization = yaml.safe_load((K8S / "kustomization.yaml").read_text())
    paths = [K8S / name for name in kustomization["resources"]]
    paths.append(K8S / "optional" / "servicemonitor.yaml")
    return tuple(d for p in paths for d in yaml.safe_load_all(p.read_text()) if d is not None)


def of_kind(kind: str) -> dict[str, dict]:
    return {d["metadata"]["name"]: d for d in k8s_docs() if d["kind"] == kind}


def workloads() -> dict[str, dict]:
    """Deployments, StatefulSets and Jobs by name (names are unique across the three)."""
    found = [d for d in k8s_docs() if d["kind"] in WORKLOAD_KINDS]
    by_name = {d["metadata"]["name"]: d for d in found}
    assert len(by_name) == len(found), "two workloads share a name"
    return by_name


def pod_spec(workload: dict) -> dict:
    return workload["spec"]["template"]["spec"]


def pod_labels(workload: dict) -> dict[str, str]:
    return workload["spec"]["template"]["metadata"]["labels"]


def all_containers(workload: dict) -> list[dict]:
    spec = pod_spec(workload)
    return [*spec.get("initContainers", []), *spec["containers"]]


def recserve_container(workload: dict) -> dict:
    """The one main container that runs ``recserve ...`` (the image's entrypoint)."""
    (container,) = [
        c
        for c in pod_spec(workload)["containers"]
        if c["image"].split(":")[0] == IMAGE and "command" not in c
    ]
    return container


def expand_args(container: dict, values: dict[str, str] | None = None) -> list[str]:
    """The container's args with ``$(VAR)`` expanded as the kubelet does; downward-API
    variables take their value from ``values`` (every one used must be given)."""
    env = {e["name"]: e.get("value") for e in container.get("env", [])}
    env.update(values or {})

    def one(match: re.Match) -> str:
        value = env.get(match[1])
        assert value is not None, f"$({match[1]}) has no value here"
        return value

    return [re.sub(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)", one, a) for a in container.get("args", [])]


def parse_recserve(argv: list[str]) -> argparse.Namespace:
    return build_parser().parse_args(argv)


def selects(selector: dict[str, str], labels: dict[str, str]) -> bool:
    return selector.items() <= labels.items()


def label_selector_matches(selector: dict, labels: dict[str, str]) -> bool:
    """A metav1.LabelSelector (matchLabels and In/NotIn/Exists/DoesNotExist expressions)."""
    if not selects(selector.get("matchLabels", {}), labels):
        return False
    for expression in selector.get("matchExpressions", []):
        key, operator = expression["key"], expression["operator"]
        values = expression.get("values", [])
        if operator == "In" and labels.get(key) not in values:
            return False
        if operator == "NotIn" and key in labels and labels[key] in values:
            return False
        if operator == "Exists" and key not in labels:
            return False
        if operator == "DoesNotExist" and key in labels:
            return False
    return True


def selected_workloads(selector: dict[str, str]) -> list[str]:
    return sorted(n for n, w in workloads().items() if selects(selector, pod_labels(w)))


def listening_ports(args: argparse.Namespace) -> dict[str, int]:
    """Port name (the deploy files' convention) -> the port this command line listens on."""
    if args.command in ("embedding-parameter-server", "embedding-worker"):
        ports = {"grpc": args.port}
        if args.metrics_port is not None:
            ports["metrics"] = args.metrics_port
        return ports
    if args.command == "serve":
        return {"http": args.http_port, "grpc": args.grpc_port}
    if args.command == "train":  # node 0 runs the rendezvous; every node may be node 0
        return {"rendezvous": args.master_port or DEFAULT_MASTER_PORT}
    raise AssertionError(f"no port convention for recserve {args.command}")


def parsed_main(workload: dict) -> argparse.Namespace:
    """The main container's command line, parsed (downward-API values: index 0)."""
    container = recserve_container(workload)
    downward = {
        e["name"]: "0" for e in container.get("env", []) if "valueFrom" in e and "value" not in e
    }
    return parse_recserve(expand_args(container, downward))


def inside(path: str, root: str) -> bool:
    """Whether ``path`` is ``root`` or below it."""
    return (
        PurePosixPath(path) == PurePosixPath(root)
        or PurePosixPath(root) in PurePosixPath(path).parents
    )


def mount_of(container: dict, path: str) -> dict | None:
    """The mount ``path`` lies on (the deepest one), or None (the image's root filesystem)."""
    mounts = [m for m in container.get("volumeMounts", []) if inside(path, m["mountPath"])]
    return max(mounts, key=lambda m: len(m["mountPath"]), default=None)


def writable(workload: dict, container: dict, path: str) -> bool:
    """Whether ``container`` can write at ``path``: on a mount that is read-write both in the
    mount and in the volume (a PVC volume's readOnly wins), or on a writable root."""
    mount = mount_of(container, path)
    if mount is None:
        context = container.get("securityContext", {})
        return not context.get("readOnlyRootFilesystem", False)
    if mount.get("readOnly"):
        return False
    volume = volumes_of(workload)[mount["name"]]
    if "configMap" in volume or "secret" in volume:
        return False  # always mounted read-only
    return not volume.get("persistentVolumeClaim", {}).get("readOnly", False)


def volumes_of(workload: dict) -> dict[str, dict]:
    volumes = {v["name"]: v for v in pod_spec(workload).get("volumes", [])}
    for claim in workload["spec"].get("volumeClaimTemplates", []):
        assert claim["metadata"]["name"] not in volumes
        volumes[claim["metadata"]["name"]] = {"persistentVolumeClaim": {"claimName": None}}
    return volumes


def image_env() -> dict[str, str]:
    """The ENV of deploy/docker/Dockerfile (``ENV A=1 \\`` continued lines)."""
    text = (DEPLOY / "docker" / "Dockerfile").read_text().replace("\\\n", " ")
    values = {}
    for line in text.splitlines():
        if line.startswith("ENV "):
            for word in shlex.split(line[4:]):
                key, _, value = word.partition("=")
                values[key] = value
    return values


@functools.cache
def healthcheck() -> ModuleType:
    return load_script(DEPLOY / "scripts" / "healthcheck.py", "recserve_deploy_healthcheck")


@functools.cache
def train_script_parser() -> argparse.ArgumentParser:
    from examples.adult_income.train import build_parser as build_train_parser

    return build_train_parser()


@functools.cache
def recserve_sources() -> str:
    """The text of recserve's packages (where the variables it reads are named)."""
    return "\n".join(
        p.read_text()
        for package in ("embedding_store", "training", "serving", "clients")
        for p in (REPO_ROOT / package).rglob("*.py")
    )


#: Variables read by the runtime, not by recserve: torch's threads, Python's buffering.
EXTERNAL_VARIABLES = {"OMP_NUM_THREADS", "PYTHONUNBUFFERED"}


# --------------------------------------------------------------------------- Kubernetes
def test_k8s_containers_declare_exactly_the_ports_their_process_listens_on() -> None:
    for name, workload in workloads().items():
        args = parsed_main(workload)
        declared = {p["name"]: p["containerPort"] for p in recserve_container(workload)["ports"]}
        assert declared == listening_ports(args), f"{name}: {declared} != what {args.command} binds"
        for container in all_containers(workload):
            if container is not recserve_container(workload):
                assert "ports" not in container, f"{name} {container['name']}: binds nothing"


def test_k8s_arguments_pass_recserve_checks_beyond_parsing() -> None:
    """What the handlers refuse after argparse accepted it: a replica index at or above the
    size (for every ordinal the StatefulSet makes), metrics on the gRPC port, serve's combined
    checks, a node rank outside --nnodes."""
    for name, workload in workloads().items():
        container = recserve_container(workload)
        args = parsed_main(workload)
        if args.command in ("embedding-parameter-server", "embedding-worker"):
            assert args.metrics_port != args.port, name
        if args.command == "embedding-parameter-server":
            for ordinal in range(workload["spec"]["replicas"]):
                shard = parse_recserve(expand_args(container, {"REPLICA_INDEX": str(ordinal)}))
                assert shard.replica_index == ordinal < shard.replica_size, f"{name}-{ordinal}"
            assert args.replica_size == workload["spec"]["replicas"], name
        elif args.command == "serve":
            assert check_arguments(args) is None, f"{name}: {check_arguments(args)}"
        elif args.command == "train":
            completions = workload["spec"]["completions"]
            for index in range(completions):
                node = parse_recserve(expand_args(container, {"NODE_RANK": str(index)}))
                assert 0 <= node.node_rank < node.nnodes == completions, f"{name} {index}"
            assert args.nproc_per_node >= 1 and args.embedding_workers, name


def test_k8s_training_entry_arguments_parse_with_the_script() -> None:
    (job,) = of_kind("Job").values()
    args = parsed_main(job)
    assert args.entry == "examples/adult_income/train.py"
    assert (REPO_ROOT / args.entry).is_file()
    script_args = args.script_args[1:] if args.script_args[:1] == ["--"] else args.script_args
    parsed = train_script_parser().parse_args(script_args)
    server = parsed_main(workloads()["server"])
    assert parsed.checkpoint_dir == server.checkpoint
    assert parsed.overwrite, "a re-run Job must be able to replace the last checkpoint"


def test_k8s_services_reach_named_ports_of_the_one_workload_they_select() -> None:
    for name, service in of_kind("Service").items():
        spec = service["spec"]
        chosen = selected_workloads(spec["selector"])
        assert len(chosen) == 1, f"Service {name} selects {chosen}"
        workload = workloads()[chosen[0]]
        assert pod_labels(workload)[COMPONENT] == service["metadata"]["labels"][COMPONENT], name
        container = recserve_container(workload)
        named = {p["name"]: p["containerPort"] for p in container["ports"]}
        for port in spec["ports"]:
            target = port.get("targetPort", port["port"])
            if isinstance(target, str):
                assert target in named, f"Service {name} port {port['name']}: no port {target}"
                number = named[target]
            else:
                assert target in named.values(), f"Service {name}: no container port {target}"
                number = target
            # Same name, same number: peers dial the Service port the process listens on.
            assert named.get(port["name"]) == number == port["port"], f"Service {name} {port}"
            if port.get("appProtocol") == "grpc":
                assert port["name"] == "grpc", f"Service {name} {port}"


def test_k8s_selectors_select_exactly_their_own_pods() -> None:
    """Controllers whose selectors overlap fight over pods; a PDB, NetworkPolicy or spreading
    rule that selects another component guards (or spreads) the wrong pods."""
    for name, workload in workloads().items():
        own = workload["spec"].get("selector", {}).get("matchLabels")
        if workload["kind"] != "Job":  # a Job's selector is generated
            assert selected_workloads(own) == [name], f"{name}'s selector: {own}"
        spec = pod_spec(workload)
        rules = [c["labelSelector"] for c in spec.get("topologySpreadConstraints", [])] + [
            term["podAffinityTerm"]["labelSelector"]
            for kind in ("podAntiAffinity", "podAffinity")
            for term in spec.get("affinity", {})
            .get(kind, {})
            .get("preferredDuringSchedulingIgnoredDuringExecution", [])
        ]
        for rule in rules:
            matched = [
                n for n, w in workloads().items() if label_selector_matches(rule, pod_labels(w))
            ]
            assert matched == [name], f"{name}: spreading rule {rule} selects {matched}"
    for kind in ("PodDisruptionBudget", "NetworkPolicy"):
        for name, doc in of_kind(kind).items():
            selector = doc["spec"]["selector" if kind != "NetworkPolicy" else "podSelector"]
            matched = [
                n for n, w in workloads().items() if label_selector_matches(selector, pod_labels(w))
            ]
            assert len(matched) == 1, f"{kind} {name} selects {matched}"
            component = pod_labels(workloads()[matched[0]])[COMPONENT]
            assert component == doc["metadata"]["labels"][COMPONENT], f"{kind} {name}"
    for name, hpa in of_kind("HorizontalPodAutoscaler").items():
        target = hpa["spec"]["scaleTargetRef"]
        workload = workloads().get(target["name"])
        assert workload is not None and workload["kind"] == target["kind"], name
        assert workload["apiVersion"] == target["apiVersion"], name
        assert "replicas" not in workload["spec"], f"{name}: the HPA owns the replica count"
        # Utilization is a share of the requests: every container must request it.
        for metric in hpa["spec"]["metrics"]:
            resource = metric["resource"]["name"]
            for container in pod_spec(workload)["containers"]:
                assert resource in container["resources"]["requests"], f"{name}: {resource}"


def test_servicemonitors_select_services_that_have_their_ports() -> None:
    """The Prometheus Operator keeps, of each selected Service, the endpoints whose port has
    the endpoint's name: a selected Service without that port is a mistake (nothing scraped)."""
    services = of_kind("Service")
    for name, monitor in of_kind("ServiceMonitor").items():
        assert monitor["spec"]["namespaceSelector"]["matchNames"] == ["recserve"]
        selected = {
            n: s
            for n, s in services.items()
            if label_selector_matches(monitor["spec"]["selector"], s["metadata"]["labels"])
        }
        assert selected, f"ServiceMonitor {name} selects no Service"
        for endpoint in monitor["spec"]["endpoints"]:
            for service_name, service in selected.items():
                ports = {p["name"] for p in service["spec"]["ports"]}
                assert endpoint["port"] in ports, (
                    f"ServiceMonitor {name} selects Service {service_name}, which has no port "
                    f"{endpoint['port']!r} ({sorted(ports)})"
                )
    # Between them, every process that serves metrics is scraped once.
    scraped = [
        (service_name, endpoint["port"])
        for monitor in of_kind("ServiceMonitor").values()
        for endpoint in monitor["spec"]["endpoints"]
        for service_name, service in services.items()
        if label_selector_matches(monitor["spec"]["selector"], service["metadata"]["labels"])
        and endpoint["port"] in {p["name"] for p in service["spec"]["ports"]}
    ]
    assert len(scraped) == len(set(scraped))
    expected = {
        (n, p["name"])
        for n, s in services.items()
        for p in s["spec"]["ports"]
        if p["name"] == "metrics"
    } | {("server", "http")}
    assert set(scraped) == expected


def _get_routes() -> set[str]:
    from serving.http_app import create_app
    from tests.unit.fake_core import FakeCore

    app = create_app(FakeCore())
    return {r.path for r in app.routes if "GET" in getattr(r, "methods", ())}


def test_k8s_probes_ask_what_the_process_answers() -> None:
    routes = _get_routes()
    for name, workload in workloads().items():
        container = recserve_container(workload)
        args = parsed_main(workload)
        named = {p["name"]: p["containerPort"] for p in container.get("ports", [])}
        for probe_name in ("startupProbe", "readinessProbe", "livenessProbe"):
            probe = container.get(probe_name)
            if probe is None:
                assert workload["kind"] == "Job" or probe_name == "startupProbe", name
                continue
            where = f"{name} {probe_name}"
            if "httpGet" in probe:
                assert args.command == "serve", where
                port = probe["httpGet"]["port"]
                port = named[port] if isinstance(port, str) else port
                assert port == args.http_port, where
                assert probe["httpGet"]["path"] in routes, where
            elif "grpc" in probe:
                assert args.command in ("embedding-parameter-server", "embedding-worker"), where
                assert probe["grpc"]["port"] == args.port, where
                assert probe["grpc"].get("service", "") in GRPC_HEALTH_SERVICES, where
            else:
                pytest.fail(f"{where}: unexpected handler {sorted(probe)}")
            # A probe that times out after the period piles up; a readiness probe that
            # gives up after the liveness probe restarts the pod first.
            assert probe.get("timeoutSeconds", 1) <= probe.get("periodSeconds", 10), where
    # The server's liveness is the route that answers while the model is loaded, readiness
    # the one that follows draining and reloads.
    server = recserve_container(workloads()["server"])
    assert server["livenessProbe"]["httpGet"]["path"] == "/v2/health/live"
    assert server["startupProbe"]["httpGet"]["path"] == "/v2/health/live"
    assert server["readinessProbe"]["httpGet"]["path"] == "/v2/health/ready"


def test_k8s_volumes_are_defined_used_and_exist() -> None:
    configmaps, claims = of_kind("ConfigMap"), of_kind("PersistentVolumeClaim")
    for name, workload in workloads().items():
        volumes = volumes_of(workload)
        used = set()
        for container in all_containers(workload):
            paths = [m["mountPath"] for m in container.get("volumeMounts", [])]
            assert len(paths) == len(set(paths)), f"{name} {container['name']}: {paths}"
            for mount in container.get("volumeMounts", []):
                assert mount["name"] in volumes, f"{name}: no volume {mount['name']}"
                used.add(mount["name"])
        assert used == set(volumes), f"{name}: unused volumes {sorted(set(volumes) - used)}"
        for volume in volumes.values():
            if "configMap" in volume:
                configmap = configmaps[volume["configMap"]["name"]]
                for item in volume["configMap"].get("items", []):
                    assert item["key"] in configmap["data"], f"{name}: {item}"
            claim = volume.get("persistentVolumeClaim", {}).get("claimName")
            if claim is not None:
                assert claim in claims, f"{name}: no PersistentVolumeClaim {claim}"


def _checkpoint_paths(command: list[str]) -> list[str]:
    return re.findall(r"/checkpoints/[^\s;\"']*", " ".join(command))


def test_k8s_paths_the_processes_use_are_mounted_with_the_access_they_need() -> None:
    env = image_env()
    for name, workload in workloads().items():
        container = recserve_container(workload)
        args = parsed_main(workload)
        reads: list[str] = []
        writes: list[str] = []
        context = container.get("securityContext", {})
        if context.get("readOnlyRootFilesystem"):
            # numba's kernel cache and other caches (the image's ENV) must be writable.
            writes += [env["NUMBA_CACHE_DIR"], env["XDG_CACHE_HOME"]]
        for flag in ("embedding_config", "global_config"):
            if getattr(args, flag, None):
                reads.append(getattr(args, flag))
        if args.command == "embedding-parameter-server":
            config = load_global_config(CONFIGS / Path(args.global_config).name)
            common = config.common_config
            if common.infer_config.embedding_checkpoint and common.job_type.value == "Infer":
                reads.append(common.infer_config.embedding_checkpoint)
            if config.embedding_parameter_server_config.enable_incremental_update:
                writes.append(config.embedding_parameter_server_config.incremental_dir)
            if args.dump_on_exit:
                writes.append(args.dump_on_exit)
            # Load and Dump RPCs are bound to the checkpoint volume: a training shard's
            # dumps must be able to write there (an inference shard's may not).
            assert args.load_root == args.dump_root == "/checkpoints", name
            reads.append(args.load_root)
            if common.job_type.value == "Train":
                writes.append(args.dump_root)
        if args.command == "serve":
            reads.append(str(args.checkpoint))
        if args.command == "train":
            script = train_script_parser().parse_args(args.script_args[1:])
            writes.append(str(script.checkpoint_dir))
            if script.stop_checkpoint_dir is not None:
                writes.append(str(script.stop_checkpoint_dir))
        for path in reads:
            assert mount_of(container, path) is not None, f"{name} reads {path}: not mounted"
        for path in writes:
            assert writable(workload, container, path), f"{name} writes {path}: read-only"
        # Init containers (shell loops, health checks) read what they name.
        for init in pod_spec(workload).get("initContainers", []):
            for path in _checkpoint_paths(init["command"]):
                assert mount_of(init, path) is not None, f"{name} {init['name']}: {path}"


def test_k8s_env_set_is_env_used() -> None:
    """Every variable a container sets is either expanded in its args or read by the code
    (recserve's sources, torch's OMP_NUM_THREADS), and every $(VAR) is set."""
    sources = recserve_sources()
    external = EXTERNAL_VARIABLES
    for name, workload in workloads().items():
        for container in all_containers(workload):
            words = " ".join([*container.get("args", []), *container.get("command", [])])
            expanded = set(re.findall(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)", words))
            variables = {e["name"] for e in container.get("env", [])}
            assert expanded <= variables, f"{name} {container['name']}: {expanded - variables}"
            for variable in variables - expanded - external:
                assert f'"{variable}"' in sources, f"{name}: nothing reads {variable}"


def test_k8s_training_rendezvous_is_reachable() -> None:
    (job,) = of_kind("Job").values()
    args = parsed_main(job)
    service = of_kind("Service")[pod_spec(job)["subdomain"]]
    assert service["spec"]["clusterIP"] == "None"
    # Node 0's name resolves before it is ready (a Job pod has no readiness probe, but DNS
    # for a starting pod must not wait for it).
    assert service["spec"]["publishNotReadyAddresses"] is True
    (port,) = service["spec"]["ports"]
    assert port["port"] == (args.master_port or DEFAULT_MASTER_PORT)
    assert job["spec"]["parallelism"] == job["spec"]["completions"] == args.nnodes
    host = args.master_addr.split(".")
    assert host[:3] == [f"{job['metadata']['name']}-0", service["metadata"]["name"], "recserve"]


# --------------------------------------------------------------------------- docker compose
@functools.cache
def compose() -> dict:
    return yaml.safe_load((DEPLOY / "docker-compose.yml").read_text())


def test_compose_one_shot_dependencies_are_not_restarted() -> None:
    """``service_completed_successfully`` waits for an exit 0; a restart policy would start
    the service again (and again) after it."""
    services = compose()["services"]
    for name, service in services.items():
        for target, condition in service.get("depends_on", {}).items():
            if condition["condition"] == "service_completed_successfully":
                assert services[target].get("restart") == "no", f"{name} -> {target}"
            if condition["condition"] == "service_healthy":
                check = services[target].get("healthcheck", {})
                assert check.get("test") and not check.get("disable"), f"{name} -> {target}"


def _compose_mounts(service: dict) -> dict[str, bool]:
    """Container path -> writable, of a compose service's volumes."""
    mounts = {}
    for volume in service.get("volumes", []):
        _source, target, *mode = volume.split(":")
        mounts[target] = "ro" not in mode
    return mounts


def _compose_mount_of(mounts: dict[str, bool], path: str) -> bool | None:
    """Whether ``path`` is on a writable mount (None: on no mount)."""
    targets = [t for t in mounts if inside(path, t)]
    return mounts[max(targets, key=len)] if targets else None


def test_compose_containers_run_with_the_restrictions_of_the_pods() -> None:
    """Every recserve pod runs read-only, capabilities dropped, without privilege escalation;
    the compose containers of the same image do too, with the caches of the image's ENV on a
    tmpfs: a process that writes elsewhere fails on one Docker host, not first on a cluster."""
    for name, workload in workloads().items():
        context = recserve_container(workload).get("securityContext", {})
        assert context.get("readOnlyRootFilesystem") is True, name
        assert context.get("allowPrivilegeEscalation") is False, name
        assert context.get("capabilities", {}).get("drop") == ["ALL"], name
    env = image_env()
    for name, service in compose()["services"].items():
        if service.get("image", "").split(":")[0] != IMAGE:
            continue
        assert service.get("read_only") is True, name
        assert service.get("cap_drop") == ["ALL"], name
        assert "no-new-privileges:true" in service.get("security_opt", []), name
        tmpfs = [entry.split(":")[0] for entry in service.get("tmpfs", [])]
        for cache in (env["NUMBA_CACHE_DIR"], env["XDG_CACHE_HOME"]):
            assert any(inside(cache, mount) for mount in tmpfs), f"{name}: {cache}"


def test_compose_trainer_command_parses_and_writes_where_the_server_reads() -> None:
    services = compose()["services"]
    trainer = services["trainer"]
    assert trainer["entrypoint"] == ["/bin/sh", "-c"]
    (script,) = trainer["command"]
    # Compose turns $$ into $; the shell then expands the variables from the environment.
    environment = {
        k: re.sub(r"\$\{\w+:-(.*)\}", r"\1", v) for k, v in trainer["environment"].items()
    }
    text = script.replace("$$", "$")
    text = re.sub(r"\$\{(\w+)\}", lambda m: environment[m[1]], text)
    (command,) = re.findall(r"exec (python [^;]*)", text)
    words = shlex.split(command)
    assert words[:2] == ["python", "examples/adult_income/train.py"]
    assert (REPO_ROOT / words[1]).is_file()
    parsed = train_script_parser().parse_args(words[2:])
    server = parse_recserve(services["server"]["command"])
    assert parsed.checkpoint_dir == server.checkpoint and parsed.overwrite
    assert parsed.epochs == 3
    # The skip test looks at the marker the checkpoint writes last.
    assert f"[ -f {server.checkpoint}/DONE ]" in text
    assert _compose_mount_of(_compose_mounts(trainer), str(parsed.checkpoint_dir)) is True
    # Stopped (compose stop/down, a reboot), it writes where it stood, never into the served
    # directory, within its stop_grace_period (10 s unless set: a checkpoint may not fit).
    assert parsed.checkpoint_on_stop and parsed.stop_checkpoint_dir is not None
    stop = str(parsed.stop_checkpoint_dir)
    assert not inside(stop, server.checkpoint) and not inside(server.checkpoint, stop)
    assert _compose_mount_of(_compose_mounts(trainer), stop) is True
    assert _compose_seconds(trainer.get("stop_grace_period", "10s")) >= 60


def test_compose_paths_the_processes_use_are_mounted() -> None:
    services = compose()["services"]
    for name, service in services.items():
        if service.get("image", "").split(":")[0] != IMAGE or "entrypoint" in service:
            continue
        args = parse_recserve(service["command"])
        mounts = _compose_mounts(service)
        reads = [getattr(args, f, None) for f in ("embedding_config", "global_config")]
        if args.command == "serve":
            reads.append(str(args.checkpoint))
        if args.command == "embedding-parameter-server":
            config = load_global_config(CONFIGS / Path(args.global_config).name)
            reads.append(config.common_config.infer_config.embedding_checkpoint)
            assert args.load_root == args.dump_root == "/checkpoints", name
            reads.append(args.load_root)
        for path in filter(None, reads):
            assert _compose_mount_of(mounts, path) is not None, f"{name} reads {path}"
        ports = listening_ports(args)
        assert len(set(ports.values())) == len(ports), f"{name}: {ports}"


# --------------------------------------------------------------------------- Procfiles
def env_file(path: Path) -> dict[str, str]:
    values = {}
    for line in path.read_text().splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            key, _, value = line.partition("=")
            values[key.strip()] = value.strip()
    return values


def procfile_commands(procfile: str, env: str) -> Iterator[tuple[str, list[list[str]]]]:
    """(process, [argv of each ``&&`` step]) with the variables expanded as the shell would,
    ``exec`` dropped."""
    values = env_file(DEPLOY / env)
    for line in (DEPLOY / procfile).read_text().splitlines():
        if not line.strip() or line.startswith("#"):
            continue
        name, command = line.split(":", 1)
        text = re.sub(r"\$\{?([A-Za-z_][A-Za-z0-9_]*)\}?", lambda m: values[m[1]], command)
        steps, step = [], []
        for word in shlex.split(text):
            if word == "&&":
                steps.append(step)
                step = []
            else:
                step.append(word)
        steps.append(step)
        yield name, [s[1:] if s[:1] == ["exec"] else s for s in steps]


@pytest.mark.parametrize(
    ("procfile", "env"), [("Procfile", ".env"), ("Procfile.serving", ".env.serving")]
)
def test_procfile_commands_parse_and_wire_the_tier(
    procfile: str, env: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from embedding_store.model_checkpoint import EMBEDDINGS_DIR

    monkeypatch.chdir(REPO_ROOT)  # honcho -d . : relative paths are the repository's
    parsed: dict[str, argparse.Namespace] = {}
    waits: dict[str, list[str]] = {}
    rendered: dict[str, str] = {}
    loads: dict[str, str | None] = {}
    for name, steps in procfile_commands(procfile, env):
        *before, main = steps
        assert main[0] == "recserve", f"{procfile} {name}: {main}"
        parsed[name] = args = parse_recserve(main[1:])
        for step in before:
            assert step[0] == "python", step
            if step[1] == "deploy/scripts/healthcheck.py":
                options = healthcheck().parse_args(step[2:])
                waits[name] = options.targets
                assert options.wait > 0
            elif step[1] == "deploy/scripts/render_infer_config.py":
                out = step[step.index("--out") + 1]
                rendered[name] = out
                assert args.global_config == out, f"{name} renders {out}, reads elsewhere"
                # The script itself, writing here: the config the shard will load.
                render = load_script(REPO_ROOT / step[1], "recserve_deploy_render")
                here = tmp_path / f"{name}.yml"
                assert render.main([*step[2:], "--out", str(here)]) == 0
                config = load_global_config(here).common_config
                assert config.job_type.value == "Infer", name
                loads[name] = config.infer_config.embedding_checkpoint
            else:
                pytest.fail(f"{procfile} {name}: unknown step {step}")
    shards = sorted(n for n, a in parsed.items() if a.command == "embedding-parameter-server")
    assert [parsed[n].replica_index for n in shards] == list(range(len(shards)))
    assert {parsed[n].replica_size for n in shards} == {len(shards)}
    # Load and Dump RPCs are bound to one root, under which the checkpoints lie.
    roots = {(parsed[n].dump_root, parsed[n].load_root) for n in shards}
    assert roots == {("runs", "runs")}, roots
    (worker,) = [n for n, a in parsed.items() if a.command == "embedding-worker"]
    assert parsed[worker].ps == [f"127.0.0.1:{parsed[n].port}" for n in shards]
    ports = [p for a in parsed.values() for p in listening_ports(a).values()]
    assert len(ports) == len(set(ports)), f"{procfile}: ports collide: {ports}"
    assert len(set(rendered.values())) == len(rendered), "two shards render one file"
    servers = [n for n, a in parsed.items() if a.command == "serve"]
    for server in servers:
        address = f"127.0.0.1:{parsed[worker].port}"
        assert parsed[server].embedding_workers == address
        # Every shard loads the embeddings of the checkpoint the server serves.
        embeddings = (REPO_ROOT / parsed[server].checkpoint / EMBEDDINGS_DIR).absolute()
        assert {n: loads.get(n) for n in shards} == dict.fromkeys(shards, str(embeddings))
        assert embeddings.is_relative_to((REPO_ROOT / "runs").absolute())  # a reload's too
        assert check_arguments(parsed[server]) is None
        # It starts once every shard and the worker are SERVING.
        expected = [f"grpc://127.0.0.1:{parsed[n].port}" for n in [*shards, worker]]
        assert waits[server] == expected


def test_procfile_stacks_can_run_side_by_side() -> None:
    def ports(procfile: str, env: str) -> set[int]:
        return {
            p
            for _, steps in procfile_commands(procfile, env)
            for p in listening_ports(parse_recserve(steps[-1][1:])).values()
        }

    assert not ports("Procfile", ".env") & ports("Procfile.serving", ".env.serving")


# --------------------------------------------------------------------------- start-up and stop
def _grace_seconds(args: argparse.Namespace) -> float:
    return float(getattr(args, "grace_seconds", 0.0) or 0.0)


#: What a process may take beyond --grace-seconds to be gone (docs/deploy.md, "Probes": the
#: server is gone within --grace-seconds plus ~4 s).
STOP_MARGIN_SECONDS = 4.0


def test_k8s_pods_get_the_time_to_drain() -> None:
    """The kubelet kills a pod terminationGracePeriodSeconds after it began stopping it, the
    preStop hook included: the drain must fit."""
    for name, workload in workloads().items():
        if workload["kind"] == "Job":
            continue
        container = recserve_container(workload)
        args = parsed_main(workload)
        pre_stop = container.get("lifecycle", {}).get("preStop", {}).get("exec", {})
        sleep = pre_stop.get("command", [])
        hook = float(sleep[1]) if sleep[:1] == ["sleep"] else 0.0
        assert not sleep or (len(sleep) == 2 and sleep[0] == "sleep"), f"{name}: {sleep}"
        needed = hook + _grace_seconds(args) + STOP_MARGIN_SECONDS
        period = pod_spec(workload).get("terminationGracePeriodSeconds", 30)
        assert period >= needed, f"{name}: {period} s to stop, needs {needed:g} s"


#: What torchrun takes beyond --shutdown-timeout to kill the ranks still running, report and
#: exit (training/torchrun.py): the kubelet's SIGKILL must not come first.
JOB_STOP_MARGIN_SECONDS = 10.0


def test_k8s_training_job_writes_where_it_stood_within_its_grace() -> None:
    """A preempted, evicted or deleted training pod gets SIGTERM, then SIGKILL
    terminationGracePeriodSeconds later (30 by default): the ranks' --shutdown-timeout
    (the time they have to write their stop checkpoint) must fit inside it. The stop
    checkpoint goes to a directory of its own on the checkpoint volume, which the training
    shards may dump into, never to the one deploy/ serves (a partly trained model), and the
    same Job, run again, resumes from it (--stop-checkpoint-dir)."""
    (job,) = of_kind("Job").values()
    args = parsed_main(job)
    script = train_script_parser().parse_args(args.script_args[1:])
    assert script.checkpoint_on_stop, "a stopped Job would lose every step since its start"
    period = pod_spec(job).get("terminationGracePeriodSeconds", 30)
    needed = args.shutdown_timeout + JOB_STOP_MARGIN_SECONDS
    assert period >= needed, f"{period} s to stop, needs {needed:g} s"

    stop = str(script.stop_checkpoint_dir)
    served = str(parsed_main(workloads()["server"]).checkpoint)
    assert script.stop_checkpoint_dir is not None
    assert not inside(stop, served) and not inside(served, stop), (stop, served)
    training_shards = {
        name: parsed_main(workload)
        for name, workload in workloads().items()
        if name.endswith("-train") and parsed_main(workload).command == "embedding-parameter-server"
    }
    assert training_shards
    for name, shard in training_shards.items():
        assert inside(stop, shard.dump_root), f"{name} may not dump into {stop}"


def _compose_seconds(text: str) -> float:
    match = re.fullmatch(r"(\d+)s", text)
    assert match, text
    return float(match[1])


def test_compose_services_get_the_time_to_drain() -> None:
    for name, service in compose()["services"].items():
        if service.get("image", "").split(":")[0] != IMAGE or "entrypoint" in service:
            continue
        args = parse_recserve(service["command"])
        period = _compose_seconds(service.get("stop_grace_period", "10s"))
        needed = _grace_seconds(args) + STOP_MARGIN_SECONDS
        assert period >= needed, f"{name}: {period:g} s to stop, needs {needed:g} s"


def test_k8s_init_waits_outlast_what_they_wait_for() -> None:
    """An init container that gives up on an embedding worker no later than the worker gives
    up on its shards (--startup-timeout, then a restart) fails the pod: for the Job
    (restartPolicy Never, backoffLimit 0) that fails the whole training run."""
    services = of_kind("Service")
    for name, workload in workloads().items():
        for init in pod_spec(workload).get("initContainers", []):
            command = init["command"]
            if command[:2] != ["python", "/app/deploy/scripts/healthcheck.py"]:
                continue
            options = healthcheck().parse_args(command[2:])
            for target in options.targets:
                host = target.removeprefix("grpc://").rpartition(":")[0]
                if host not in services:
                    continue  # a shard: it has no start-up timeout of its own
                (worker,) = selected_workloads(services[host]["spec"]["selector"])
                timeout = parsed_main(workloads()[worker]).startup_timeout
                assert options.wait > timeout, f"{name} {init['name']}: --wait {options.wait:g}"


def test_k8s_init_containers_wait_for_the_markers_the_checkpoint_writes() -> None:
    """The serving shards load <checkpoint>/embeddings (its own DONE written last); the
    server loads <checkpoint> (DONE written last)."""
    from embedding_store.checkpoint_manifest import DONE_MARKER
    from embedding_store.model_checkpoint import EMBEDDINGS_DIR

    server = parsed_main(workloads()["server"])
    expected = {
        "ps": f"{server.checkpoint}/{EMBEDDINGS_DIR}/{DONE_MARKER}",
        "server": f"{server.checkpoint}/{DONE_MARKER}",
    }
    for name, marker in expected.items():
        (init,) = [
            c
            for c in pod_spec(workloads()[name])["initContainers"]
            if c["name"] == "wait-for-checkpoint"
        ]
        assert f"until [ -f {marker} ]" in init["command"][-1], name
    infer = load_global_config(CONFIGS / "global_config.infer.yml").common_config.infer_config
    assert f"{infer.embedding_checkpoint}/{DONE_MARKER}" == expected["ps"]


def test_k8s_scrape_annotations_name_a_metrics_port() -> None:
    for name, workload in workloads().items():
        annotations = workload["spec"]["template"]["metadata"].get("annotations", {})
        if annotations.get("prometheus.io/scrape") != "true":
            continue
        ports = listening_ports(parsed_main(workload))
        port = int(annotations["prometheus.io/port"])
        assert port in (ports.get("metrics"), ports.get("http")), f"{name}: {port} of {ports}"
        assert annotations["prometheus.io/path"] == "/metrics", name
    scraped = {
        n
        for n, w in workloads().items()
        if w["spec"]["template"]["metadata"].get("annotations", {}).get("prometheus.io/scrape")
    }
    assert scraped == set(workloads()) - {"train-adult"}


# --------------------------------------------------------------------------- image
def test_image_exposes_every_port_of_the_conventions_and_ships_every_package() -> None:
    expose = {
        int(p)
        for line in (DEPLOY / "docker" / "Dockerfile").read_text().splitlines()
        if line.startswith("EXPOSE ")
        for p in line.split()[1:]
    }
    used = {
        p["containerPort"]
        for w in workloads().values()
        for p in recserve_container(w).get("ports", [])
    }
    assert expose == used, f"EXPOSE {sorted(expose)}, the pods use {sorted(used)}"
    # Every package pyproject installs is in the build context.
    pyproject = (REPO_ROOT / "pyproject.toml").read_text()
    (include,) = re.findall(r"^include = \[(.*)\]$", pyproject, re.M)
    packages = {p.strip().strip('"').rstrip("*") for p in include.split(",")}
    for dockerfile in ("Dockerfile", "Dockerfile.cuda"):
        ignore = (DEPLOY / "docker" / f"{dockerfile}.dockerignore").read_text().splitlines()
        kept = {line[1:].rstrip("/") for line in ignore if line.startswith("!")}
        assert packages <= kept, f"{dockerfile}: {sorted(packages - kept)} left out"


def test_image_build_checks_the_installed_packages_not_the_sources_in_app() -> None:
    """The build's import check runs in WORKDIR /app, where ``python -c`` would find the
    copied sources first and pass on an install that lacks a package: it runs with ``-P``
    (no working directory on sys.path), imports every installed package, and pip's in-tree
    build leftovers (a second, stale copy of the sources) are removed."""
    pyproject = (REPO_ROOT / "pyproject.toml").read_text()
    (include,) = re.findall(r"^include = \[(.*)\]$", pyproject, re.M)
    packages = {p.strip().strip('"').rstrip("*") for p in include.split(",")}
    for dockerfile in ("Dockerfile", "Dockerfile.cuda"):
        text = (DEPLOY / "docker" / dockerfile).read_text().replace("\\\n", " ")
        (run,) = [line for line in text.splitlines() if line.startswith("RUN pip install /app")]
        steps = [shlex.split(step) for step in run[len("RUN ") :].split("&&")]
        (check,) = [s for s in steps if s[0] == "python" and "-c" in s]
        assert "-P" in check[: check.index("-c")], f"{dockerfile}: {check}"
        imported = re.findall(r"^import ([\w, ]+);", check[check.index("-c") + 1])
        assert packages <= {p.strip() for p in imported[0].split(",")}, dockerfile
        assert ["rm", "-rf", "/app/build", "/app/*.egg-info"] in steps, dockerfile


def test_k8s_replicated_workloads_have_a_disruption_budget_and_spread() -> None:
    """A workload of several pods (or autoscaled) that a node drain could empty at once: a
    PodDisruptionBudget limits the evictions, and a spreading rule keeps its pods apart."""
    autoscaled = {
        h["spec"]["scaleTargetRef"]["name"] for h in of_kind("HorizontalPodAutoscaler").values()
    }
    budgets = of_kind("PodDisruptionBudget")
    for name, workload in workloads().items():
        if workload["kind"] == "Job":
            continue
        if workload["spec"].get("replicas", 1) < 2 and name not in autoscaled:
            continue
        labels = pod_labels(workload)
        covering = [
            b for b in budgets.values() if label_selector_matches(b["spec"]["selector"], labels)
        ]
        assert len(covering) == 1, f"{name}: {len(covering)} PodDisruptionBudgets"
        spec = pod_spec(workload)
        spread = spec.get("topologySpreadConstraints", []) or spec.get("affinity", {}).get(
            "podAntiAffinity"
        )
        assert spread, f"{name}: nothing keeps its pods on different nodes"


def test_compose_and_procfile_variables_are_used() -> None:
    """A variable set for a process and read by nothing is a misspelling, or a setting that
    silently does nothing."""
    sources = recserve_sources()
    for name, service in compose()["services"].items():
        words = [*service.get("entrypoint", []), *service.get("command", [])]
        text = " ".join(words).replace("$$", "$")
        for variable in service.get("environment", {}):
            used = re.search(rf"\$\{{?{variable}\b", text) is not None
            read = variable in EXTERNAL_VARIABLES or f'"{variable}"' in sources
            assert used or read, f"compose {name}: nothing reads {variable}"
    for procfile, env in (("Procfile", ".env"), ("Procfile.serving", ".env.serving")):
        text = (DEPLOY / procfile).read_text()
        for variable in env_file(DEPLOY / env):
            used = re.search(rf"\$\{{?{variable}\b", text) is not None
            read = variable in EXTERNAL_VARIABLES or f'"{variable}"' in sources
            assert used or read, f"{env}: nothing reads {variable}"
