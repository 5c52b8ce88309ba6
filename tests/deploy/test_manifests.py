"""The Kubernetes deployment in ``deploy/k8s``: schema-valid, consistent, and its exact commands run.

The static tests read the objects ``kubectl apply -k`` would send (``base``,
and ``tls``: the base plus its JSON patches, applied here) and validate each
against the Kubernetes OpenAPI schemas that ``kubernetes-validate`` ships.
The live test runs each container's own command and arguments, expanded the
way the kubelet expands ``$(VAR)`` with the container's environment, as real
processes on 127.0.0.1. Only what a pod gets from its surroundings is
replaced: pod index, bind host, ports, checkpoint volume, namespace, the
rendezvous address, the shards' addresses and the job's scale (one worker
node), plus ``--epochs``. The serving replicas' tables come from a job of
the test's own once the digits job is over (digits has none).
"""

from __future__ import annotations

import os
import re
import select
import shutil
import signal
import subprocess
import time
import tomllib
import urllib.request
from pathlib import Path

import grpc
import kubernetes_validate
import pytest
import yaml
from grpc_health.v1 import health_pb2, health_pb2_grpc
from torch.distributed.run import get_args_parser as torchrun_parser

from shardps.cli import server as server_cli
from shardps.cli import main as worker_cli
from tests.support.manifests import K8S, load_kustomization, objects, the_container

ROOT = Path(__file__).resolve().parents[2]
K8S_VERSION = kubernetes_validate.latest_version()  # the newest schemas the package holds
POD_INDEX_FIELD = "metadata.labels['apps.kubernetes.io/pod-index']"
NAME, COMPONENT = "app.kubernetes.io/name", "app.kubernetes.io/component"
SHARD_PORTS = {"grpc": 50051, "health": 50052, "metrics": 9100}  # names and numbers fixed by the spec
REPLICA_PORTS = {"grpc": 50060, "metrics": 9102}  # Serving and gRPC health on one port (shardps serve)
SERVE_GRACE_SECONDS = 5  # what `shardps serve` gives the calls in flight after SIGTERM (cli/serve.py)
TLS_FLAGS = ("--tls-cert", "--tls-key", "--tls-ca", "--auth-token-file")
CHECKPOINT_ALLOWANCE_SECONDS = 30  # the least time a final checkpoint (after a scheduled one) may need
ONE_WORKER = {"SHARDPS_MIN_WORKERS": "1", "SHARDPS_MAX_WORKERS": "1"}  # the live test's job: one worker node
START_TIMEOUT, WORKER_TIMEOUT, STOP_TIMEOUT = 60.0, 120.0, 30.0  # seconds
_REF = re.compile(r"\$\$|\$\(([A-Za-z_][A-Za-z0-9_.-]*)\)")


# --- reading the manifests -------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def base() -> dict[tuple[str, str], dict]:
    return objects(K8S / "base")


def _configmaps(docs: dict) -> dict[str, dict[str, str]]:
    return {name: d.get("data", {}) for (kind, name), d in docs.items() if kind == "ConfigMap"}


# --- what the kubelet does with env, command and args --------------------------------------------------------------

def expand(text: str, env: dict[str, str]) -> str:
    """Kubernetes' ``$(VAR)`` expansion: defined names are replaced, others stay as written, ``$$`` is ``$``."""
    return _REF.sub(lambda m: "$" if m.group(0) == "$$" else env.get(m.group(1), m.group(0)), text)


def container_env(container: dict, configmaps: dict[str, dict[str, str]], fields: dict[str, str],
                  overrides: dict[str, str] | None = None) -> dict[str, str]:
    """The environment the kubelet gives ``container``: ``envFrom`` first, then ``env`` in order.

    Each ``env`` value is expanded with the variables defined before it.

    Args:
        configmaps: ConfigMap name -> data.
        fields: downward API ``fieldPath`` -> the value this pod would get.
        overrides: variable -> value that replaces what the pod would get from
            its surroundings (an expansion that uses it sees the replacement).

    Raises:
        AssertionError: a source this function does not know, or an override
            naming a variable the container does not define.
    """
    overrides, env, used = dict(overrides or {}), {}, set()

    def define(name: str, value: str) -> None:
        if name in overrides:
            value = overrides[name]
            used.add(name)
        env[name] = value

    for source in container.get("envFrom", []):
        assert set(source) <= {"configMapRef", "prefix"}, f"envFrom {source}: teach container_env"
        for key, value in configmaps[source["configMapRef"]["name"]].items():
            define(source.get("prefix", "") + key, value)
    for var in container.get("env", []):
        if "value" in var:
            define(var["name"], expand(var["value"], env))
        elif "configMapKeyRef" in var.get("valueFrom", {}):
            ref = var["valueFrom"]["configMapKeyRef"]
            define(var["name"], configmaps[ref["name"]][ref["key"]])
        elif "fieldRef" in var.get("valueFrom", {}):
            path = var["valueFrom"]["fieldRef"]["fieldPath"]
            assert path in fields, f"env {var['name']} reads {path}; the test gives this pod only {sorted(fields)}"
            define(var["name"], fields[path])
        else:
            raise AssertionError(f"env {var}: teach container_env this source")
    assert used == set(overrides), f"the container defines none of {sorted(set(overrides) - used)}"
    return env


def command_line(container: dict, env: dict[str, str]) -> list[str]:
    """``command + args`` after expansion; every ``$(VAR)`` must have resolved."""
    argv = [expand(a, env) for a in container["command"] + container.get("args", [])]
    unresolved = [a for a in argv if "$(" in a]
    assert not unresolved, f"{container['name']}: no variable for {unresolved}"
    return argv


def shard_config(docs: dict, index: int):
    """The ``ShardConfig`` the real ``shardps-server`` parser makes of pod ``index``'s command line."""
    container = the_container(docs["StatefulSet", "shardps-shard"])
    argv = command_line(container, container_env(container, _configmaps(docs), {POD_INDEX_FIELD: str(index)}))
    assert argv[0] == "shardps-server"
    try:
        return server_cli.parse_args(argv[1:])
    except SystemExit:
        pytest.fail(f"shardps-server refuses the StatefulSet's arguments {argv[1:]} (its message is in stderr)")


def worker_command(docs: dict, namespace: str = "default"):
    """``(argv, torchrun's parsed args, shardps' parsed args)`` of the worker Job's container."""
    container = the_container(docs["Job", "shardps-worker"])
    argv = command_line(container, container_env(container, _configmaps(docs), {"metadata.namespace": namespace}))
    assert argv[0] == "torchrun"
    launcher = torchrun_parser().parse_args(argv[1:])
    try:
        shardps = worker_cli._parser().parse_args(launcher.training_script_args)
    except SystemExit:
        pytest.fail(f"shardps refuses the Job's arguments {launcher.training_script_args} (message in stderr)")
    return argv, launcher, shardps


def replica_command(docs: dict):
    """``(argv, parsed args)`` of the replica Deployment's container, parsed by the real ``shardps`` parser."""
    container = the_container(docs["Deployment", "shardps-replica"])
    argv = command_line(container, container_env(container, _configmaps(docs), {}))
    assert argv[0] == "shardps"
    try:
        return argv, worker_cli._parser().parse_args(argv[1:])
    except SystemExit:
        pytest.fail(f"shardps refuses the replica Deployment's arguments {argv[1:]} (message in stderr)")


# --- static checks ---------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("overlay", ["base", "tls"])
def test_every_object_validates_against_the_kubernetes_schemas(overlay):
    docs = load_kustomization(K8S / overlay)
    assert docs
    for doc in docs:
        try:
            kubernetes_validate.validate(doc, K8S_VERSION, strict=True)
        except kubernetes_validate.ValidationError as exc:
            pytest.fail(f"deploy/k8s/{overlay}: {doc['kind']}/{doc['metadata']['name']} is not valid Kubernetes "
                        f"{K8S_VERSION}: {exc.message} at {'.'.join(map(str, exc.path))}")


def test_kustomizations_name_every_file():
    for overlay in ("base", "tls"):
        k = yaml.safe_load((K8S / overlay / "kustomization.yaml").read_text())
        named = {r for r in k.get("resources", []) if not (K8S / overlay / r).is_dir()}
        named |= {p["path"] for p in k.get("patches", []) if "path" in p}  # (or inline: "patch")
        present = {p.name for p in (K8S / overlay).glob("*.yaml")} - {"kustomization.yaml"}
        assert named == present, f"deploy/k8s/{overlay}: files {sorted(present - named)} are not in its kustomization"


def test_shard_statefulset_matches_its_service_config_and_probes(base):
    cm = base["ConfigMap", "shardps"]["data"]
    sts = base["StatefulSet", "shardps-shard"]
    spec, pod = sts["spec"], sts["spec"]["template"]
    svc = base["Service", spec["serviceName"]]
    labels = pod["metadata"]["labels"]
    assert labels[NAME] == "shardps" and labels[COMPONENT] == "shard"
    assert svc["spec"].get("clusterIP") == "None", "the StatefulSet's Service must be headless (pod DNS names)"
    assert svc["spec"]["selector"].items() <= labels.items()
    assert spec["selector"]["matchLabels"].items() <= labels.items()
    assert spec["podManagementPolicy"] == "Parallel"

    addresses = cm["SHARDPS_SERVERS"].split(",")
    assert spec["replicas"] == len(addresses) == int(cm["SHARDPS_NUM_SHARDS"]), \
        "replicas, SHARDPS_NUM_SHARDS and the addresses in SHARDPS_SERVERS must agree"
    container = the_container(sts)
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert ports == SHARD_PORTS
    assert addresses == [f"{sts['metadata']['name']}-{i}.{svc['metadata']['name']}:{ports['grpc']}"
                         for i in range(spec["replicas"])], "SHARDPS_SERVERS must list the pods in ordinal order"
    assert {p["targetPort"] for p in svc["spec"]["ports"]} <= set(ports)

    for index in (0, spec["replicas"] - 1):
        config = shard_config(base, index)
        assert (config.shard_index, config.num_shards) == (index, spec["replicas"])
        assert (config.host, config.port, config.health_port, config.metrics_port) == (
            "0.0.0.0", ports["grpc"], ports["health"], ports["metrics"])
    assert config.min_workers == int(cm["SHARDPS_MIN_WORKERS"])
    assert config.checkpoint_every_seconds > 0

    assert "readinessProbe" in container and "livenessProbe" in container
    for probe in {"startupProbe", "readinessProbe", "livenessProbe"} & set(container):
        assert container[probe]["grpc"] == {"port": ports["health"]}, f"{probe} must ask the plaintext health port"
    grace = pod["spec"]["terminationGracePeriodSeconds"]
    assert grace > config.grace_seconds + CHECKPOINT_ALLOWANCE_SECONDS, (
        f"terminationGracePeriodSeconds {grace} leaves no time for the final checkpoint after "
        f"--grace-seconds {config.grace_seconds}")

    (claim,) = spec["volumeClaimTemplates"]
    mounts = {m["name"]: m["mountPath"] for m in container["volumeMounts"]}
    assert mounts[claim["metadata"]["name"]] == config.checkpoint_dir, "the PVC must be mounted at --checkpoint-dir"
    annotations = pod["metadata"]["annotations"]
    assert annotations["prometheus.io/scrape"] == "true"
    assert annotations["prometheus.io/port"] == str(ports["metrics"])


def test_worker_job_is_elastic_torchrun_against_the_shards(base):
    cm = base["ConfigMap", "shardps"]["data"]
    job = base["Job", "shardps-worker"]
    spec, pod = job["spec"], job["spec"]["template"]
    labels = pod["metadata"]["labels"]
    assert labels[NAME] == "shardps" and labels[COMPONENT] == "worker"
    svc = base["Service", pod["spec"]["subdomain"]]
    assert svc["spec"].get("clusterIP") == "None" and svc["spec"]["selector"].items() <= labels.items()
    shard_selector = base["Service", "shardps-shard"]["spec"]["selector"]
    assert not shard_selector.items() <= labels.items(), "the shards' Service must not select workers"

    low, high = int(cm["SHARDPS_MIN_WORKERS"]), int(cm["SHARDPS_MAX_WORKERS"])
    assert spec["completionMode"] == "Indexed"
    assert low <= spec["parallelism"] == spec["completions"] <= high
    container = the_container(job)
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}

    _, launcher, args = worker_command(base, namespace="ns")
    assert launcher.nnodes == f"{low}:{high}" and launcher.nproc_per_node == "1"
    assert launcher.rdzv_backend == "c10d" and launcher.no_python and launcher.training_script == "shardps"
    assert launcher.rdzv_endpoint == (f"{job['metadata']['name']}-0.{svc['metadata']['name']}.ns.svc.cluster.local:"
                                      f"{ports['rdzv']}"), "the rendezvous must be pod 0's full DNS name"
    assert (args.command, args.job, args.worker_index) == ("train", "digits", "env")
    assert args.workers is None, "--workers comes from torchrun's WORLD_SIZE"
    assert ",".join(args.servers) == cm["SHARDPS_SERVERS"]
    assert args.local_ranks == int(launcher.nproc_per_node)
    assert args.metrics_port == ports["metrics"]
    assert pod["metadata"]["annotations"]["prometheus.io/port"] == str(ports["metrics"])


def test_replica_deployment_reads_every_shard_and_is_ready_once_it_serves(base):
    cm = base["ConfigMap", "shardps"]["data"]
    deployment = base["Deployment", "shardps-replica"]
    spec, pod = deployment["spec"], deployment["spec"]["template"]
    labels = pod["metadata"]["labels"]
    assert labels[NAME] == "shardps" and labels[COMPONENT] == "replica"
    assert spec["selector"]["matchLabels"].items() <= labels.items()
    assert spec["replicas"] >= 2, "one replica restarting or rolled must not stop serving"
    assert spec["strategy"]["rollingUpdate"]["maxUnavailable"] == 0, "a new replica reads the tables before it serves"
    for other in ("shardps-shard", "shardps-worker"):
        assert not base["Service", other]["spec"]["selector"].items() <= labels.items(), f"{other} selects replicas"

    container = the_container(deployment)
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert ports == REPLICA_PORTS
    _, args = replica_command(base)
    assert args.command == "serve"
    assert ",".join(args.servers) == cm["SHARDPS_SERVERS"], "a replica reads every shard, in shard order"
    tables = args.tables.split(",")
    assert tables == cm["SHARDPS_SERVING_TABLES"].split(",") and all(tables) and len(set(tables)) == len(tables)
    assert (args.host, args.port, args.metrics_port) == ("0.0.0.0", ports["grpc"], ports["metrics"])
    assert args.period >= 0.05

    # Ready (gRPC health SERVING) once the first state is read; alive while it waits for its tables.
    assert container["readinessProbe"]["grpc"] == {"port": ports["grpc"]}, "readiness asks gRPC health"
    assert container["livenessProbe"]["tcpSocket"] == {"port": ports["grpc"]}, (
        "liveness must not ask gRPC health: a replica waiting for its tables says NOT_SERVING and is alive")
    assert "startupProbe" not in container
    assert pod["spec"]["terminationGracePeriodSeconds"] > SERVE_GRACE_SECONDS
    assert pod["metadata"]["annotations"]["prometheus.io/scrape"] == "true"
    assert pod["metadata"]["annotations"]["prometheus.io/port"] == str(ports["metrics"])

    serving = base["Service", "shardps-replica"]["spec"]
    assert serving["selector"].items() <= labels.items()
    assert serving.get("clusterIP") != "None" and not serving.get("publishNotReadyAddresses"), \
        "clients must reach ready replicas only"
    assert [(p["name"], p["port"], p["targetPort"]) for p in serving["ports"]] == [("grpc", ports["grpc"], "grpc")]
    scraped = base["Service", "shardps-replica-metrics"]["spec"]
    assert scraped["selector"].items() <= labels.items()
    assert scraped.get("clusterIP") == "None" and scraped["publishNotReadyAddresses"] is True, \
        "Prometheus scrapes every replica, ready or not"
    assert [(p["name"], p["port"], p["targetPort"]) for p in scraped["ports"]] == [
        ("metrics", ports["metrics"], "metrics")]


def test_pods_are_non_root_bounded_and_match_the_image(base):
    dockerfile = (ROOT / "deploy" / "Dockerfile").read_text()
    user = re.search(r"^USER (\d+):(\d+)\s*$", dockerfile, re.M)
    assert user, "deploy/Dockerfile must name its user by number (runAsNonRoot cannot check a name)"
    exposed = {int(p) for line in re.findall(r"^EXPOSE (.+)$", dockerfile, re.M) for p in line.split()}
    workloads = [key for key in base if key[0] in ("StatefulSet", "Deployment", "Job", "DaemonSet")]
    assert set(workloads) == {("StatefulSet", "shardps-shard"), ("Job", "shardps-worker"),
                              ("Deployment", "shardps-replica")}
    for key in workloads:
        pod = base[key]["spec"]["template"]["spec"]
        context = pod["securityContext"]
        assert context["runAsNonRoot"] is True
        assert (context["runAsUser"], context["runAsGroup"]) == (int(user.group(1)), int(user.group(2)))
        container = the_container(base[key])
        assert container["securityContext"]["allowPrivilegeEscalation"] is False
        for kind in ("requests", "limits"):
            assert {"cpu", "memory"} <= set(container["resources"][kind]), f"{key}: {kind} for cpu and memory"
        assert {p["containerPort"] for p in container["ports"]} <= exposed, f"{key}: ports the image does not EXPOSE"


def test_image_holds_every_package_folder():
    """The Dockerfile copies every folder pyproject.toml maps into ``shardps`` (without cli/: no ``shardps``)."""
    dockerfile = (ROOT / "deploy" / "Dockerfile").read_text()
    folders = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-dir"].values())
    copied = set(re.findall(r"^COPY (\S+) \./\1\s*$", dockerfile, re.M))
    assert folders <= copied, f"deploy/Dockerfile does not COPY {sorted(folders - copied)}"
    assert re.search(r'^RUN pip install "\.\[apps\]"', dockerfile, re.M), "`shardps train digits` needs the apps extra"


def test_tls_overlay_covers_the_replicas(tmp_path):
    """deploy/k8s/tls leaves nothing in plaintext: the serving replicas serve their port with mutual TLS and the
    token from the shards' Secret, read the shards with the workers' Secret (``--shards-*``), and their readiness
    probe asks the plaintext health port (Kubernetes' gRPC probe cannot do TLS; health needs no token)."""
    docs, base = objects(K8S / "tls"), objects(K8S / "base")
    replicas = sorted(key for key, d in base.items() if d["metadata"].get("labels", {}).get(COMPONENT) == "replica")
    assert replicas and all(key in docs for key in replicas), "deploy/k8s/tls must keep the replicas"
    deployment = docs["Deployment", "shardps-replica"]
    pod, container = deployment["spec"]["template"]["spec"], the_container(deployment)
    secrets = {v["name"]: v["secret"]["secretName"] for v in pod["volumes"] if "secret" in v}
    mounts = {m["mountPath"]: m for m in container["volumeMounts"] if m["name"] in secrets}
    assert mounts and all(m.get("readOnly") for m in mounts.values()), "mount the Secrets read-only"

    def secret_of(path: str) -> str:
        (mount,) = [m for where, m in mounts.items() if path.startswith(where + "/")]
        return secrets[mount["name"]]

    def pod_secrets(key) -> set[str]:
        return {v["secret"]["secretName"] for v in docs[key]["spec"]["template"]["spec"]["volumes"] if "secret" in v}

    given = dict(a.split("=", 1) for a in container["args"] if a.startswith("--") and "=" in a)
    own = {flag: given.get(flag) for flag in TLS_FLAGS}
    shards = {flag: given.get("--shards-" + flag[2:]) for flag in TLS_FLAGS}
    assert all(own.values()) and all(shards.values()), f"TLS flags missing: own {own}, to the shards {shards}"
    assert {secret_of(p) for p in own.values()} == pod_secrets(("StatefulSet", "shardps-shard")), \
        "the Serving port takes the shards' Secret"
    assert {secret_of(p) for p in shards.values()} == pod_secrets(("Job", "shardps-worker")), \
        "the replica reads the shards with the workers' Secret"

    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert ports == {**REPLICA_PORTS, "health": ports.get("health")} and ports["health"] not in REPLICA_PORTS.values()
    argv, args = replica_command(docs)
    assert args.health_port == ports["health"] and args.port == ports["grpc"]
    assert container["readinessProbe"]["grpc"] == {"port": ports["health"]}, "readiness asks the plaintext health port"
    assert container["livenessProbe"]["tcpSocket"] == {"port": ports["grpc"]}
    exposed = {int(p) for line in re.findall(r"^EXPOSE (.+)$", (ROOT / "deploy" / "Dockerfile").read_text(), re.M)
               for p in line.split()}
    assert set(ports.values()) <= exposed, "deploy/Dockerfile must EXPOSE the replica's ports"

    # `shardps serve` takes the files: the Secrets' files made here (tests.support.pki), at the mount paths.
    from shardps.cli import serve as serve_cli
    from tests.support.pki import make_pki

    pki = make_pki(tmp_path)
    files = {"tls": {"tls.crt": "server.pem", "tls.key": "server.key"},
             "shards-tls": {"tls.crt": "client.pem", "tls.key": "client.key"}}
    for where, mount in mounts.items():
        folder = tmp_path / mount["name"]
        folder.mkdir()
        for name, source in {**files[mount["name"]], "ca.crt": "ca.pem", "token": "token"}.items():
            (folder / name).write_bytes(pki.read(source))
        argv = [a.replace(where + "/", f"{folder}/") for a in argv]
    args = worker_cli._parser().parse_args(argv[1:])
    credentials, interceptors = serve_cli.own_security(args)
    security = serve_cli.shards_security(args)
    assert credentials is not None and len(interceptors) == 1, "mutual TLS and the token on the Serving port"
    assert security.tls and security.cert is not None and security.token, "mutual TLS and the token to the shards"


def test_tls_overlay_mounts_every_file_its_flags_name(tmp_path):
    docs = objects(K8S / "tls")
    flags = {"--tls-cert", "--tls-key", "--tls-ca", "--auth-token-file"}
    files = {}
    for key in (("StatefulSet", "shardps-shard"), ("Job", "shardps-worker")):
        pod = docs[key]["spec"]["template"]["spec"]
        container = the_container(docs[key])
        secrets = {v["name"] for v in pod["volumes"] if "secret" in v}
        mounts = [m for m in container["volumeMounts"] if m["name"] in secrets]
        assert mounts and all(m.get("readOnly") for m in mounts), f"{key}: mount the Secret read-only"
        given = dict(a.split("=", 1) for a in container["args"] if a.split("=", 1)[0] in flags)
        assert set(given) == flags, f"{key}: TLS flags {sorted(flags - set(given))} missing"
        for flag, path in given.items():
            assert any(path.startswith(m["mountPath"] + "/") for m in mounts), f"{key}: {flag} {path} is not mounted"
        files[key[0]] = given
    sts = the_container(docs["StatefulSet", "shardps-shard"])
    assert sts["readinessProbe"]["grpc"]["port"] == SHARD_PORTS["health"], "probes stay on the plaintext port"

    # Both programs accept the flags. The shard's parser opens the files: point the mount at placeholders.
    (mount,) = {p.rsplit("/", 1)[0] for p in files["StatefulSet"].values()}
    for path in files["StatefulSet"].values():
        (tmp_path / path.rsplit("/", 1)[1]).write_text("placeholder\n")
    argv = command_line(sts, container_env(sts, _configmaps(docs), {POD_INDEX_FIELD: "0"}))
    argv = [a.replace(mount + "/", f"{tmp_path}/") for a in argv[1:]]
    try:
        config = server_cli.parse_args(argv)
    except SystemExit:
        pytest.fail(f"shardps-server refuses the TLS overlay's arguments {argv} (message in stderr)")
    assert config.tls_ca and config.tls_cert and config.tls_key and config.auth_token_file
    _, _, args = worker_command(docs)
    assert (args.tls_ca, args.tls_cert, args.tls_key, args.auth_token_file) == tuple(
        files["Job"][f] for f in ("--tls-ca", "--tls-cert", "--tls-key", "--auth-token-file"))


# --- the commands, run -----------------------------------------------------------------------------------------------

def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _read_until(proc: subprocess.Popen, pattern: re.Pattern, deadline: float, what: str) -> str:
    """Everything ``proc`` printed on stdout until a line matches ``pattern``; fails at ``deadline`` or exit."""
    out, fd = b"", proc.stdout.fileno()
    while not pattern.search(out.decode(errors="replace")):
        remaining = deadline - time.monotonic()
        ready = select.select([fd], [], [], max(0.0, remaining))[0] if remaining > 0 else []
        if not ready:
            pytest.fail(f"{what} printed no {pattern.pattern!r} in time; stdout so far: {out.decode()!r}")
        chunk = os.read(fd, 65536)
        if not chunk:
            pytest.fail(f"{what} exited with {proc.wait(timeout=10)} before printing {pattern.pattern!r}; "
                        f"stdout: {out.decode()!r}")
        out += chunk
    return out.decode(errors="replace")


def _set_flag(argv: list[str], flag: str, value: str) -> list[str]:
    hits = [i for i, a in enumerate(argv) if a.startswith(flag + "=")]
    assert len(hits) == 1, f"expected one {flag}=... in {argv}"
    return [f"{flag}={value}" if i == hits[0] else a for i, a in enumerate(argv)]


def _train_tables(servers: str, tables: list[str]) -> None:
    """A job of the test's own whose model has ``tables``, one step, on shards whose job is over (reset first)."""
    import torch
    from torch import nn

    from shardps.worker import DistributedOptimizer, ShardedEmbedding
    from shardps.worker.session.client import ShardClient

    for index, address in enumerate(servers.split(",")):
        client = ShardClient(address, index=index)
        try:
            client.reset()  # the digits job is over: a new job may join
        finally:
            client.close()
    model = nn.ModuleDict({name: ShardedEmbedding(None, 4, name=name) for name in tables})
    model.bias = nn.Parameter(torch.zeros(1))
    dist = DistributedOptimizer(torch.optim.SGD([model.bias], lr=0.1), [("bias", model.bias)], servers=servers,
                                model=model, worker_id="tables-job",
                                sparse_optimizer=torch.optim.SGD([model[name].handle for name in tables], lr=1.0))
    try:
        dist.zero_grad()
        ids = torch.arange(8)
        (sum(model[name](ids).pow(2).sum() for name in tables) + model.bias.sum()).backward()
        dist.step()
        dist.tables.settle(tables[0])
    finally:
        dist.close()


def _check_replica(base: dict, addresses: list[str], tmp_path: Path, started: list, logs: list) -> None:
    """The replica Deployment's exact command against the live shards: NOT_SERVING while they hold none of its
    tables (the digits job has none), SERVING once a job with them has trained; SIGTERM: exit 0."""
    import torch

    from shardps.common.rows import ids_bytes
    from shardps.proto import shardps_pb2 as pb
    from shardps.proto import shardps_pb2_grpc as pb_grpc

    configmaps = _configmaps(base)
    replica = the_container(base["Deployment", "shardps-replica"])
    assert shutil.which(replica["command"][0]), f"{replica['command'][0]} is not on PATH: pip install -e ."
    env = container_env(replica, configmaps, {}, {
        "SHARDPS_SERVERS": ",".join(addresses), "SHARDPS_HOST": "127.0.0.1", "SHARDPS_SERVING_PORT": "0",
        "SHARDPS_REPLICA_METRICS_PORT": "0"})
    logs.append(open(tmp_path / "replica.log", "wb"))
    proc = subprocess.Popen(command_line(replica, env), env={**os.environ, **env}, stdin=subprocess.DEVNULL,
                            stdout=subprocess.PIPE, stderr=logs[-1], bufsize=0)
    started.append(proc)
    out = _read_until(proc, re.compile(r"^metrics on \S+:\d+$", re.M), time.monotonic() + START_TIMEOUT, "replica")
    found = {m.group(1): m.group(2) for m in re.finditer(r"^(serving|metrics) on (\S+:\d+)$", out, re.M)}
    assert set(found) == {"serving", "metrics"}, f"the replica printed {out!r}"
    tables = configmaps["shardps"]["SHARDPS_SERVING_TABLES"].split(",")
    with grpc.insecure_channel(found["serving"]) as channel:
        health = health_pb2_grpc.HealthStub(channel)
        assert health.Check(health_pb2.HealthCheckRequest(), timeout=10).status == \
            health_pb2.HealthCheckResponse.NOT_SERVING, "ready before it read its tables"
        _train_tables(",".join(addresses), tables)
        _read_until(proc, re.compile(r"^serving tables ", re.M), time.monotonic() + START_TIMEOUT, "replica")
        assert health.Check(health_pb2.HealthCheckRequest(), timeout=10).status == \
            health_pb2.HealthCheckResponse.SERVING
        ids = ids_bytes(torch.arange(3))
        reply = pb_grpc.ServingStub(channel).Lookup(pb.LookupRequest(table=tables[-1], ids=ids), timeout=10)
        assert reply.state >= 1 and reply.dim == 4 and len(reply.rows) == 3 * 4 * 4
    with urllib.request.urlopen(f"http://{found['metrics']}/metrics", timeout=10) as page:
        state = re.search(r"^shardps_serving_state (\S+)$", page.read().decode(), re.M)
    assert state and float(state.group(1)) >= 1, "the replica's metrics do not show its state"
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=STOP_TIMEOUT) == 0, f"replica: {(tmp_path / 'replica.log').read_text()[-2000:]}"


def test_manifest_commands_serve_train_and_stop_on_loopback(tmp_path, base):
    """Shard pods (exact command, env-expanded args) serve health and metrics, the worker Job's exact torchrun
    command trains one epoch against them, the replica Deployment's exact command serves their tables once a job
    that has them trained, SIGTERM stops it with exit 0, and every shard with exit 0 and a final checkpoint."""
    configmaps = _configmaps(base)
    shard = the_container(base["StatefulSet", "shardps-shard"])
    assert shutil.which(shard["command"][0]), f"{shard['command'][0]} is not on PATH: pip install -e ."
    shards: list[tuple[subprocess.Popen, Path, Path]] = []  # process, checkpoint volume, stderr log
    replicas: list[subprocess.Popen] = []
    logs = []
    try:
        for index in range(int(configmaps["shardps"]["SHARDPS_NUM_SHARDS"])):
            volume, log = tmp_path / f"pvc-{index}", tmp_path / f"shard-{index}.log"
            volume.mkdir()
            env = container_env(shard, configmaps, {POD_INDEX_FIELD: str(index)}, {
                **ONE_WORKER, "SHARDPS_HOST": "127.0.0.1", "SHARDPS_PORT": "0",
                "SHARDPS_HEALTH_PORT": "0", "SHARDPS_METRICS_PORT": "0",
                "SHARDPS_CHECKPOINT_DIR": str(volume)})
            logs.append(open(log, "wb"))
            proc = subprocess.Popen(command_line(shard, env), env={**os.environ, **env}, stdin=subprocess.DEVNULL,
                                    stdout=subprocess.PIPE, stderr=logs[-1], bufsize=0)
            shards.append((proc, volume, log))
        deadline, addresses = time.monotonic() + START_TIMEOUT, []
        for index, (proc, _, log) in enumerate(shards):
            out = _read_until(proc, re.compile(r"listening on \S+:\d+"), deadline, f"shard {index} ({log})")
            found = {m.group(1): m.group(2) for m in re.finditer(
                rf"^shardps-server shard {index}/\d+ (metrics|health|listening) on (\S+:\d+)$", out, re.M)}
            assert set(found) == {"metrics", "health", "listening"}, f"shard {index} printed {out!r}"
            addresses.append(found["listening"])
            with grpc.insecure_channel(found["health"]) as channel:
                reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=10)
            assert reply.status == health_pb2.HealthCheckResponse.SERVING
            with urllib.request.urlopen(f"http://{found['metrics']}/metrics", timeout=10) as page:
                assert re.search(rf'^shardps_shard_version{{shard="{index}"}} ', page.read().decode(), re.M)

        worker = the_container(base["Job", "shardps-worker"])
        env = container_env(worker, configmaps, {"metadata.namespace": "default"}, {
            **ONE_WORKER, "SHARDPS_SERVERS": ",".join(addresses),
            "SHARDPS_RDZV_ENDPOINT": f"127.0.0.1:{_free_port()}", "SHARDPS_WORKER_METRICS_PORT": "0"})
        argv = _set_flag(command_line(worker, env), "--epochs", "1")
        job = subprocess.Popen(argv, env={**os.environ, **env}, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                               stderr=subprocess.STDOUT, start_new_session=True)
        try:
            out = job.communicate(timeout=WORKER_TIMEOUT)[0].decode(errors="replace")
        except subprocess.TimeoutExpired:
            os.killpg(job.pid, signal.SIGKILL)  # torchrun and the worker it started: their own session
            out = job.communicate()[0].decode(errors="replace")
            pytest.fail(f"the worker Job's command did not finish in {WORKER_TIMEOUT:.0f}s:\n{out[-4000:]}")
        finally:
            if job.poll() is None:  # an error above: torchrun (our child, not yet reaped) leads its group
                os.killpg(job.pid, signal.SIGKILL)
                job.wait()
        assert job.returncode == 0, f"the worker Job's command failed:\n{out[-4000:]}"
        assert re.search(r"^done .*test_accuracy=", out, re.M) and re.search(r"metrics on \S+:\d+", out), out[-4000:]

        _check_replica(base, addresses, tmp_path, replicas, logs)

        for proc, _, _ in shards:
            proc.send_signal(signal.SIGTERM)
        for index, (proc, volume, log) in enumerate(shards):
            assert proc.wait(timeout=STOP_TIMEOUT) == 0, f"shard {index}: {log.read_text()[-2000:]}"
            assert any((volume / f"shard-{index}").iterdir()), f"shard {index} left no checkpoint in its volume"
    finally:
        for proc in replicas + [proc for proc, *_ in shards]:
            if proc.poll() is None:
                proc.kill()
            proc.wait()
            proc.stdout.close()
        for log in logs:
            log.close()
