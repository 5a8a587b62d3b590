"""The Kubernetes manifests (deploy/k8s): every overlay renders with ``kubectl kustomize``, every
object validates against the Kubernetes schemas, each service is probed, budgeted and sized, the
HA overlay is a three-node NATS and a three-member etcd that the services list in full, and the
GPU overlay runs vLLM workers on GPUs, NATS and etcd over TLS with a user per service (the
Secrets `laneway bus provision` writes) and API keys on. Rendered and validated here, never
applied: there is no cluster on this machine."""

from __future__ import annotations

import dataclasses
import importlib.util
import re
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml

from bus.runtime import SHUTDOWN_GRACE_S
from bus.settings import ServiceSettings
from bus.tls import TlsFiles
from infra.bus_provision import Wanted, k8s_secrets, provision
from infra.embedded import ROUTE_SETTINGS, find_binary
from infra.provisioned import NATS_ACCOUNTS_FILE
from infra.serve import MODULES, WORKER_MODULES
from services.ingress.main import IngressSettings
from services.kv_indexer.main import IndexerSettings
from services.planner.main import SHARED_KNOBS, PlannerSettings
from services.worker.settings import WorkerSettings
from tests.security.certificates import make_certificates

pytestmark = pytest.mark.live  # runs kubectl and nats-server (to test the NATS configuration)

OVERLAYS = Path(__file__).parents[2] / "deploy" / "k8s" / "overlays"

# Each Deployment and the module it runs.
SERVICES = {
    "ingress": "services.ingress",
    "planner": "services.planner",
    "kv-indexer": "services.kv_indexer",
    "prefill-worker": "services.worker.prefill_worker",
    "decode-worker": "services.worker.decode_worker",
}
WORKERS = ("prefill-worker", "decode-worker")
# Servers per StatefulSet, and replicas of each Laneway service but the autoscaled ingress.
SHAPES = {"dev": (1, 1), "ha": (3, 2), "gpu": (3, 2)}
# The oldest Kubernetes the manifests use features of (the preStop sleep action), and the newest
# the validator knows.
KUBERNETES_VERSIONS = ("1.30.0", kubernetes_validate.utils.latest_version())

Obj = dict[str, Any]


@dataclass
class Manifests:
    overlay: str
    objects: list[Obj]

    def get(self, kind: str, name: str) -> Obj:
        found = [o for o in self.of_kind(kind) if o["metadata"]["name"] == name]
        assert len(found) == 1, f"{self.overlay}: {len(found)} {kind} named {name}"
        return found[0]

    def of_kind(self, kind: str) -> list[Obj]:
        return [o for o in self.objects if o["kind"] == kind]

    def config_map(self, prefix: str) -> Obj:
        """A generated ConfigMap (its name carries a content hash)."""
        found = [o for o in self.of_kind("ConfigMap") if o["metadata"]["name"].startswith(prefix)]
        assert len(found) == 1, f"{self.overlay}: {len(found)} ConfigMaps named {prefix}-*"
        return found[0]

    @property
    def settings(self) -> dict[str, str]:
        data: dict[str, str] = self.config_map("laneway-config")["data"]
        return data


def _render(overlay: str) -> Manifests:
    kubectl = shutil.which("kubectl")
    if kubectl is None:
        pytest.skip("kubectl is not installed: the manifests cannot be rendered")
    done = subprocess.run(
        [kubectl, "kustomize", str(OVERLAYS / overlay)],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    return Manifests(overlay, [o for o in yaml.safe_load_all(done.stdout) if o])


@pytest.fixture(scope="module", params=sorted(SHAPES))
def manifests(request: pytest.FixtureRequest) -> Manifests:
    return _render(request.param)


def _pod(deployment: Obj) -> Obj:
    spec: Obj = deployment["spec"]["template"]
    return spec


def _container(deployment: Obj) -> Obj:
    containers: list[Obj] = _pod(deployment)["spec"]["containers"]
    assert len(containers) == 1
    return containers[0]


def _module_of(command: list[str]) -> str:
    """The module a container's command runs: `python -m MODULE`, or `laneway serve SERVICE`."""
    if command[:2] == ["python", "-m"]:
        return command[2]
    assert command[:2] == ["laneway", "serve"], command
    if command[2] != "worker":
        return MODULES[command[2]]
    role = command[command.index("--role") + 1] if "--role" in command else "both"
    return WORKER_MODULES[role]


def _selects(selector: dict[str, str], labels: dict[str, str]) -> bool:
    return bool(selector) and selector.items() <= labels.items()


@pytest.mark.parametrize("version", KUBERNETES_VERSIONS)
def test_every_object_validates(manifests: Manifests, version: str) -> None:
    for obj in manifests.objects:
        kubernetes_validate.validate(obj, version, strict=True)


def test_validation_refuses_a_misspelt_field() -> None:
    # The check above is only worth something if strict validation does refuse what it should.
    pod = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "p"}}
    pod["spec"] = {"containers": [{"name": "c", "image": "i", "readinesProbe": {}}]}
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(pod, KUBERNETES_VERSIONS[0], strict=True)


@pytest.mark.parametrize("name", sorted(SERVICES))
def test_each_service_is_probed_budgeted_and_sized(manifests: Manifests, name: str) -> None:
    deployment = manifests.get("Deployment", name)
    labels = _pod(deployment)["metadata"]["labels"]
    container = _container(deployment)
    module = SERVICES[name]
    assert _module_of(container["command"]) == module
    assert importlib.util.find_spec(module) is not None

    config = manifests.config_map("laneway-config")["metadata"]["name"]
    assert {"configMapRef": {"name": config}} in container["envFrom"]
    ports = {port["name"]: port["containerPort"] for port in container["ports"]}
    assert ports["metrics"] == int(manifests.settings["LANEWAY_METRICS_PORT"])
    assert manifests.settings["LANEWAY_METRICS_HOST"] == "0.0.0.0"  # the kubelet is outside
    assert container["readinessProbe"]["httpGet"] == {"path": "/readyz", "port": "metrics"}
    assert container["livenessProbe"]["httpGet"] == {"path": "/healthz", "port": "metrics"}
    assert {"cpu", "memory"} <= container["resources"]["requests"].keys()

    budgets = [
        pdb
        for pdb in manifests.of_kind("PodDisruptionBudget")
        if _selects(pdb["spec"]["selector"]["matchLabels"], labels)
    ]
    assert len(budgets) == 1, f"{name}: {len(budgets)} PodDisruptionBudgets"
    assert budgets[0]["spec"]["maxUnavailable"] == 1
    services = [s for s in manifests.of_kind("Service") if _selects(s["spec"]["selector"], labels)]
    assert len(services) == 1
    assert {"name": "metrics", "port": ports["metrics"], "targetPort": "metrics"} in services[0][
        "spec"
    ]["ports"]


def test_the_ingress_is_autoscaled_and_serves_its_port(manifests: Manifests) -> None:
    deployment = manifests.get("Deployment", "ingress")
    # The autoscaler owns the count: one in the Deployment would be reset by every apply.
    assert "replicas" not in deployment["spec"]
    autoscaler = manifests.get("HorizontalPodAutoscaler", "ingress")
    target = autoscaler["spec"]["scaleTargetRef"]
    assert (target["kind"], target["name"]) == ("Deployment", "ingress")
    assert autoscaler["spec"]["minReplicas"] >= SHAPES[manifests.overlay][0]
    env = {e["name"]: e.get("value") for e in _container(deployment)["env"]}
    assert env["LANEWAY_HOST"] == "0.0.0.0"
    ports = {p["name"]: p for p in manifests.get("Service", "ingress")["spec"]["ports"]}
    assert ports["http"]["port"] == int(env["LANEWAY_PORT"])


def _names_read(settings: type[ServiceSettings]) -> set[str]:
    """Its settings' names, a nested one's fields as ``<setting>_<field>`` (LANEWAY_KV_MOVES)."""
    names = set(settings.model_fields)
    for name, field in settings.model_fields.items():
        if dataclasses.is_dataclass(field.annotation):
            names |= {f"{name}_{f.name}" for f in dataclasses.fields(field.annotation)}
    # The kv policy's knobs it takes from shared settings stop a planner given them.
    return names - {f"kv_{knob}" for knob in SHARED_KNOBS}


def test_every_setting_is_one_a_service_reads(manifests: Manifests) -> None:
    # A misspelt LANEWAY_* name would be ignored without a word (the settings ignore extras).
    read = set().union(
        *(
            _names_read(cls)
            for cls in (
                ServiceSettings,
                IngressSettings,
                PlannerSettings,
                IndexerSettings,
                WorkerSettings,
            )
        )
    )
    # Read from the environment by bus.tls, beside the settings.
    files = TlsFiles(Path("ca"), Path("cert"), Path("key"))
    read |= {v.removeprefix("LANEWAY_").lower() for s in ("NATS", "ETCD") for v in files.env(s)}
    names = set(manifests.settings)
    for name in SERVICES:
        names |= {e["name"] for e in _container(manifests.get("Deployment", name)).get("env", [])}
    for setting in names:
        assert setting.startswith("LANEWAY_"), setting
        assert setting.removeprefix("LANEWAY_").lower() in read, setting
    WorkerSettings.model_validate(
        {k.removeprefix("LANEWAY_").lower(): v for k, v in manifests.settings.items()}
    )


@pytest.mark.parametrize("name", sorted(SERVICES))
def test_termination_grace_covers_the_shutdown(manifests: Manifests, name: str) -> None:
    # A stopping service winds down within SHUTDOWN_GRACE_S (workers drain within it), after the
    # preStop hook; the kubelet's kill must come later, not cut the drain short.
    deployment = manifests.get("Deployment", name)
    pre_stop = _container(deployment).get("lifecycle", {}).get("preStop", {})
    pause = pre_stop.get("sleep", {}).get("seconds", 0)
    assert _pod(deployment)["spec"]["terminationGracePeriodSeconds"] > pause + SHUTDOWN_GRACE_S
    if name in WORKERS:
        assert float(manifests.settings["LANEWAY_DRAIN_TIMEOUT_S"]) < SHUTDOWN_GRACE_S


def test_replicas_match_the_overlay(manifests: Manifests) -> None:
    servers, replicas = SHAPES[manifests.overlay]
    for name in SERVICES.keys() - {"ingress"}:
        assert manifests.get("Deployment", name)["spec"]["replicas"] >= replicas, name
    for name in ("nats", "etcd"):
        stateful = manifests.get("StatefulSet", name)
        assert stateful["spec"]["replicas"] == servers, name
        assert stateful["spec"]["podManagementPolicy"] == "Parallel"
        assert [v["metadata"]["name"] for v in stateful["spec"]["volumeClaimTemplates"]] == ["data"]
        [anti] = stateful["spec"]["template"]["spec"]["affinity"]["podAntiAffinity"][
            "requiredDuringSchedulingIgnoredDuringExecution"
        ]
        assert anti["topologyKey"] == "kubernetes.io/hostname"
        assert _selects(anti["labelSelector"]["matchLabels"], stateful["metadata"]["labels"])
    assert int(manifests.settings["LANEWAY_STREAM_REPLICAS"]) == servers


def _resolves(manifests: Manifests, host: str) -> bool:
    """A Service's name, or ``<pod>.<headless Service>`` of an existing StatefulSet pod."""
    pod, _, domain = host.partition(".")
    if not domain:
        return any(s["metadata"]["name"] == host for s in manifests.of_kind("Service"))
    for stateful in manifests.of_kind("StatefulSet"):
        spec = stateful["spec"]
        pods = {f"{stateful['metadata']['name']}-{i}" for i in range(spec["replicas"])}
        if spec["serviceName"] == domain and pod in pods:
            return True
    return False


def _host(url: str) -> str:
    bare = url.strip().removeprefix("nats://").removeprefix("http://").removeprefix("https://")
    return bare.rpartition(":")[0]


def test_clients_name_every_member(manifests: Manifests) -> None:
    servers = SHAPES[manifests.overlay][0]
    for setting in ("LANEWAY_NATS_URL", "LANEWAY_ETCD_ENDPOINTS"):
        hosts = [_host(url) for url in manifests.settings[setting].split(",")]
        assert all(_resolves(manifests, host) for host in hosts), hosts
        # On a cluster every member is listed: a client fails over without asking the Service.
        assert len(set(hosts)) == servers, hosts

    etcd = _container(manifests.get("StatefulSet", "etcd"))
    env = {e["name"]: e.get("value") for e in etcd["env"]}
    members = dict(m.split("=") for m in env["ETCD_INITIAL_CLUSTER"].split(","))
    assert sorted(members) == [f"etcd-{i}" for i in range(servers)]
    assert all(_resolves(manifests, _host(url)) for url in members.values())


def test_nats_configuration_is_valid(manifests: Manifests, tmp_path: Path) -> None:
    # What the GPU overlay mounts from Secrets: a certificate (the test's own CA's) and the
    # accounts `laneway bus provision` writes, at paths of the test's.
    tls = tmp_path / "tls"
    tls.mkdir()
    ca, cert, key = make_certificates(tls)
    for mounted, made in (("ca.crt", ca), ("tls.crt", cert), ("tls.key", key)):
        (tls / mounted).write_bytes(made.read_bytes())
    provision(tmp_path / "auth", Wanted(workers=2), etcd_endpoints=None)
    for key_name, text in manifests.config_map("nats-config")["data"].items():
        (tmp_path / key_name).write_text(text.replace("/etc/nats/tls/", f"{tls}/"))
    checked = subprocess.run(
        [find_binary("nats-server"), "-t", "-c", str(tmp_path / "nats.conf")],
        capture_output=True,
        text=True,
        timeout=30,
        env={"POD_NAME": "nats-0"},
        check=False,
    )
    assert checked.returncode == 0, checked.stderr
    servers = SHAPES[manifests.overlay][0]
    cluster = (tmp_path / "cluster.conf").read_text()
    routes = cluster.count("nats://nats-")
    assert routes == (0 if servers == 1 else servers)
    if servers > 1:
        # The routes' liveness and compression the multi-host suite measured.
        assert all(line.strip() in cluster for line in ROUTE_SETTINGS.splitlines())


def test_etcd_takes_every_setting_given_it(manifests: Manifests) -> None:
    # etcd maps ETCD_X to its flag --x and refuses an unknown ETCD_ variable only at start: a
    # misspelt one would be found on the cluster, so each is checked against the binary here.
    helped = subprocess.run(
        [find_binary("etcd"), "--help"], capture_output=True, text=True, timeout=30, check=False
    )
    flags = set(re.findall(r"^\s+--([a-z0-9-]+)", helped.stdout + helped.stderr, re.MULTILINE))
    assert "initial-cluster" in flags
    env = _container(manifests.get("StatefulSet", "etcd"))["env"]
    for variable in (e["name"] for e in env):
        assert variable.startswith("ETCD_"), variable
        assert variable.removeprefix("ETCD_").lower().replace("_", "-") in flags, variable


def _env(container: Obj) -> dict[str, Obj]:
    return {e["name"]: e for e in container.get("env", [])}


def test_gpu_workers_run_vllm_on_a_gpu_each() -> None:
    manifests = _render("gpu")
    for name in WORKERS:
        deployment = manifests.get("Deployment", name)
        pod = _pod(deployment)["spec"]
        container = _container(deployment)
        resources = container["resources"]
        assert resources["limits"]["nvidia.com/gpu"] == resources["requests"]["nvidia.com/gpu"] == 1
        assert {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"} in pod[
            "tolerations"
        ]
        env = _env(container)
        assert env["LANEWAY_ENGINE"]["value"] == "vllm"
        model = Path(env["LANEWAY_MODEL_DIR"]["value"])
        [mount] = [m for m in container["volumeMounts"] if model.is_relative_to(m["mountPath"])]
        assert mount["readOnly"]
        [volume] = [v for v in pod["volumes"] if v["name"] == mount["name"]]
        claim = volume["persistentVolumeClaim"]["claimName"]
        assert (
            "ReadOnlyMany" in manifests.get("PersistentVolumeClaim", claim)["spec"]["accessModes"]
        )
        assert env["LANEWAY_NODE"]["valueFrom"]["fieldRef"]["fieldPath"] == "spec.nodeName"
        rack = env["LANEWAY_RACK"]["valueFrom"]["fieldRef"]["fieldPath"]
        assert rack == "metadata.labels['topology.kubernetes.io/zone']"
        # Ready once the engine is loaded; a large model may take minutes to get there.
        assert container["readinessProbe"]["httpGet"]["path"] == "/readyz"
        probe = container["startupProbe"]
        assert probe["periodSeconds"] * probe["failureThreshold"] >= 600


def test_gpu_overlay_secures_the_bus_and_the_api(tmp_path: Path) -> None:
    manifests = _render("gpu")
    settings = manifests.settings
    assert settings["LANEWAY_API_AUTH"] == "true"
    assert settings["LANEWAY_NATS_TLS_CA"] == settings["LANEWAY_ETCD_TLS_CA"]
    assert all(e.startswith("https://") for e in settings["LANEWAY_ETCD_ENDPOINTS"].split(","))
    etcd = _env(_container(manifests.get("StatefulSet", "etcd")))
    assert etcd["ETCD_LISTEN_CLIENT_URLS"]["value"].startswith("https://")
    assert etcd["ETCD_PEER_CLIENT_CERT_AUTH"]["value"] == "true"
    nats_conf = manifests.config_map("nats-config")["data"]["nats.conf"]
    assert "tls {" in nats_conf and f"include ./auth/{NATS_ACCOUNTS_FILE}" in nats_conf
    # Every Secret the objects name is one `laneway bus provision --k8s-secrets` writes, or the
    # bus's certificate, and each service's pod mounts its own role's users alone.
    provision(tmp_path / "bus", Wanted(workers=2), etcd_endpoints=None)
    provisioned = {s["metadata"]["name"]: s for s in k8s_secrets(tmp_path / "bus")}
    for secret in provisioned.values():
        kubernetes_validate.validate(secret, KUBERNETES_VERSIONS[0], strict=True)
    named = set()
    for obj in [*manifests.of_kind("Deployment"), *manifests.of_kind("StatefulSet")]:
        volumes = obj["spec"]["template"]["spec"].get("volumes", [])
        named |= {v["secret"]["secretName"] for v in volumes if "secret" in v}
    named |= {
        v["secret"]["secretName"]
        for v in manifests.get("Job", "laneway-bus-init")["spec"]["template"]["spec"]["volumes"]
        if "secret" in v
    }
    assert named - provisioned.keys() == {"laneway-bus-tls"}
    for name in SERVICES:
        deployment = manifests.get("Deployment", name)
        command = _container(deployment)["command"]
        assert command[-2:] == ["--bus-credentials", "/etc/laneway/bus"]
        role = "worker" if command[2] == "worker" else command[2]
        volumes = {v["name"]: v for v in _pod(deployment)["spec"]["volumes"]}
        assert volumes["bus-credentials"]["secret"]["secretName"] == f"laneway-bus-{role}"
