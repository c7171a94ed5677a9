"""The deployment files: every Kustomize overlay renders (`kubectl kustomize`) and is
wired together (ports, probes, service names, the discovery name the control plane is
given, secrets, GPUs), its control-plane config is one `switchyard serve` accepts, and
each Dockerfile runs as a non-root user with a gRPC health check."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from control.config import parse_config

ROOT = Path(__file__).resolve().parents[2]
OVERLAYS = sorted(p.name for p in (ROOT / "deploy/k8s/overlays").iterdir())
DOCKERFILES = sorted((ROOT / "deploy/docker").glob("*.Dockerfile"))


def render(overlay: str) -> dict[tuple[str, str], Any]:
    kubectl = shutil.which("kubectl")
    assert kubectl, "kubectl is not installed (scripts/setup.sh --for-tests installs it)"
    out = subprocess.run(
        [kubectl, "kustomize", str(ROOT / "deploy/k8s/overlays" / overlay)],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert out.returncode == 0, out.stderr
    return {(d["kind"], d["metadata"]["name"]): d for d in yaml.safe_load_all(out.stdout)}


def container(doc: dict[str, Any]) -> dict[str, Any]:
    (c,) = doc["spec"]["template"]["spec"]["containers"]
    return c


def port(c: dict[str, Any], name: str) -> int:
    return next(int(p["containerPort"]) for p in c["ports"] if p["name"] == name)


def test_there_is_an_overlay_per_engine() -> None:
    assert OVERLAYS == ["trtllm", "vllm"]


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_an_overlay_is_wired_together(overlay: str, tmp_path: Path) -> None:
    docs = render(overlay)
    control = docs[("Deployment", "switchyard-control")]
    workers = docs[("StatefulSet", "switchyard-workers")]
    public = docs[("Service", "switchyard")]
    headless = docs[("Service", workers["spec"]["serviceName"])]
    assert ("PodDisruptionBudget", "switchyard-control") in docs
    pdb = docs[("PodDisruptionBudget", "switchyard-control")]
    assert pdb["spec"]["minAvailable"] < control["spec"]["replicas"]
    assert pdb["spec"]["selector"]["matchLabels"].items() <= (
        control["spec"]["template"]["metadata"]["labels"].items()
    )

    # The control plane's config, from the generated ConfigMap it mounts.
    cp = container(control)
    volumes = {v["name"]: v for v in control["spec"]["template"]["spec"]["volumes"]}
    config_map = docs[("ConfigMap", volumes["config"]["configMap"]["name"])]
    (config_text,) = config_map["data"].values()
    config = yaml.safe_load(config_text)
    mounts = {m["name"]: m["mountPath"] for m in cp["volumeMounts"]}
    assert cp["args"][-1].startswith(mounts["config"])
    (model,) = config["models"]

    # Ports: the config listens where the container and the Service say.
    assert int(config["listen"].rpartition(":")[2]) == port(cp, "grpc")
    assert int(config["metrics"]["listen"].rpartition(":")[2]) == port(cp, "metrics")
    assert {p["targetPort"] for p in public["spec"]["ports"]} == {"grpc", "metrics"}
    assert (
        public["spec"]["selector"].items()
        <= control["spec"]["template"]["metadata"]["labels"].items()
    )

    # Probes: gRPC on the plaintext health port (the public one speaks TLS); ready when
    # the model has a healthy worker (its health service name).
    assert "tls" in config and int(config["health"]["listen"].rpartition(":")[2]) == port(
        cp, "health"
    )
    assert cp["readinessProbe"]["grpc"] == {"port": port(cp, "health"), "service": model["name"]}
    assert cp["livenessProbe"]["grpc"] == {"port": port(cp, "health"), "service": "liveness"}

    # Workers: found by the headless Service's DNS name, on the port they listen on.
    w = container(workers)
    assert headless["spec"]["clusterIP"] == "None"
    (hport,) = headless["spec"]["ports"]
    assert hport["targetPort"] == "grpc" and hport["port"] == port(w, "grpc")
    assert model["discovery"]["dns"] == f"{headless['metadata']['name']}:{hport['port']}"
    assert (
        headless["spec"]["selector"].items()
        <= workers["spec"]["template"]["metadata"]["labels"].items()
    )
    assert f"--port={port(w, 'grpc')}" in w["args"] and "--host=$(POD_IP)" in w["args"]
    assert model["engine"] == overlay
    for probe in ("startupProbe", "livenessProbe", "readinessProbe"):
        assert w[probe]["grpc"]["port"] == port(w, "grpc"), probe
    assert w["resources"]["limits"]["nvidia.com/gpu"] == 1

    # Draining: the preStop drain and the worker's own grace fit in the grace period.
    drain = " ".join(w["lifecycle"]["preStop"]["exec"]["command"])
    assert "switchyard drain" in drain and f"switchyard:{public['spec']['ports'][0]['port']}" in (
        drain
    )
    drain_grace = int(drain.split("--grace ")[1].split()[0])
    worker_grace = next(
        int(a.split("=")[1]) for a in w["args"] if a.startswith(("--grace=", "--grace-s="))
    )
    period = workers["spec"]["template"]["spec"]["terminationGracePeriodSeconds"]
    assert period > drain_grace + worker_grace
    assert control["spec"]["template"]["spec"]["terminationGracePeriodSeconds"] > 10 + 5

    # Secrets: the tokens file and certificates are mounted where the config reads them.
    assert volumes["tokens"]["secret"]["secretName"] == "switchyard-tokens"
    assert volumes["tls"]["secret"]["secretName"] == "switchyard-tls"
    assert config["auth"]["tokens_file"].startswith(mounts["tokens"] + "/")
    assert config["tls"]["cert"].startswith(mounts["tls"] + "/")
    for spec in (control, workers):
        security = spec["spec"]["template"]["spec"]["securityContext"]
        assert security["runAsNonRoot"] is True and security["runAsUser"] != 0

    # And `switchyard serve` takes the config, with its paths made real here.
    for key in ("model", "tokenizer"):
        if key in model:
            (tmp_path / key).mkdir()
            model[key] = str(tmp_path / key)
    for section, key in (("auth", "tokens_file"), ("tls", "cert"), ("tls", "key")):
        (tmp_path / key).write_text("")
        config[section][key] = str(tmp_path / key)
    parsed = parse_config(config)
    assert parsed.models[0].dns == model["discovery"]["dns"]


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: p.name)
def test_a_dockerfile_runs_as_a_user_with_a_grpc_health_check(dockerfile: Path) -> None:
    lines = [line.strip() for line in dockerfile.read_text().splitlines()]
    users = [line.split()[1] for line in lines if line.startswith("USER ")]
    assert users and users[-1] not in ("root", "0")
    health = [
        line
        for i, line in enumerate(lines)
        if line.startswith("CMD") and i and lines[i - 1].startswith("HEALTHCHECK")
    ]
    assert health and '"switchyard", "health"' in health[0]


def test_the_dockerfiles_cover_every_image_the_overlays_use() -> None:
    images = {
        c["image"].partition(":")[0]
        for overlay in OVERLAYS
        for doc in render(overlay).values()
        if doc["kind"] in ("Deployment", "StatefulSet")
        for c in doc["spec"]["template"]["spec"]["containers"]
    }
    names = {f"switchyard-{p.name.removesuffix('.Dockerfile')}" for p in DOCKERFILES}
    assert images <= names, images - names
