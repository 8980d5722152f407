"""The Kubernetes manifests (deploy/k8s): schemas, lint, and that the pieces agree with each other and with the code.

- yamllint (deploy/.yamllint.yaml) over every YAML file under deploy/.
- kubernetes-validate, strict (unknown fields are errors), against the oldest Kubernetes the manifests target
  (1.27: native gRPC probes are GA there) and the newest schema it bundles: every resource the kustomization
  lists, the ConfigMaps its generators make, and the Secrets of secrets.example.yaml.
- `kubectl kustomize` renders the whole thing when kubectl is on the machine, and the result validates too.
- Cross-references: selectors match pod labels, named ports exist, every ConfigMap and Secret a pod mounts is
  generated or documented, Envoy's upstream is the headless Service in the kustomization's namespace, and the
  replicas' full command line (the image's ENTRYPOINT + the Deployment's args with the ConfigMap's values)
  parses with the real `tether-server serve` parser.
"""

import functools
import json
import re
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
K8S = ROOT / "deploy" / "k8s"
DOCKERFILE = ROOT / "deploy" / "docker" / "server.Dockerfile"
OLDEST = "1.27"


@functools.cache
def kustomization() -> dict:
    return yaml.safe_load((K8S / "kustomization.yaml").read_text())


def read_env(path: Path) -> dict[str, str]:
    out = {}
    for line in path.read_text().splitlines():
        if line.strip() and not line.lstrip().startswith("#"):
            key, _, value = line.partition("=")
            out[key.strip()] = value.strip()
    return out


def generated_configmaps() -> list[dict]:
    """What kustomize's configMapGenerator makes (without the hash suffix)."""
    out = []
    for gen in kustomization()["configMapGenerator"]:
        data = {}
        for env in gen.get("envs", []):
            data |= read_env(K8S / env)
        for f in gen.get("files", []):
            data[Path(f).name] = (K8S / f).read_text()
        out.append({"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": gen["name"]}, "data": data})
    return out


@functools.cache
def resources() -> list[dict]:
    docs = []
    for name in kustomization()["resources"]:
        docs += [d for d in yaml.safe_load_all((K8S / name).read_text()) if d]
    return docs


def example_secrets() -> list[dict]:
    return [d for d in yaml.safe_load_all((K8S / "secrets.example.yaml").read_text()) if d]


def by_kind(kind: str) -> dict[str, dict]:
    return {d["metadata"]["name"]: d for d in resources() if d["kind"] == kind}


def selects(selector: dict, labels: dict) -> bool:
    return all(labels.get(k) == v for k, v in selector.items())


def test_every_manifest_is_listed_and_every_listed_file_exists():
    listed = set(kustomization()["resources"])
    assert all((K8S / f).is_file() for f in listed)
    generator_files = {f for g in kustomization()["configMapGenerator"] for f in g.get("files", [])}
    others = {"kustomization.yaml", "secrets.example.yaml"} | generator_files
    assert {p.name for p in K8S.glob("*.yaml")} - others == listed


def test_yamllint():
    pytest.importorskip("yamllint")
    from yamllint import linter
    from yamllint.config import YamlLintConfig

    conf = YamlLintConfig(file=str(ROOT / "deploy" / ".yamllint.yaml"))
    problems = []
    for path in sorted((ROOT / "deploy").rglob("*.yaml")):
        problems += [
            f"{path.relative_to(ROOT)}:{p.line}: {p.desc} ({p.rule})" for p in linter.run(path.read_text(), conf)
        ]
    assert not problems, "\n".join(problems)


@pytest.mark.parametrize("version", [OLDEST, "latest"])
def test_manifests_validate_against_the_kubernetes_schemas(version):
    pytest.importorskip("kubernetes_validate")
    from kubernetes_validate import utils

    version = utils.latest_version() if version == "latest" else version
    docs = resources() + generated_configmaps() + example_secrets()
    errors = []
    for doc in docs:
        try:
            utils.validate(doc, version, strict=True)
        except utils.ValidationError as e:
            errors.append(f"{doc['kind']}/{doc['metadata']['name']}: {'.'.join(map(str, e.path))}: {e.message}")
    assert not errors, "\n".join(errors)
    kinds = {d["kind"] for d in docs}
    assert {"Deployment", "Service", "PodDisruptionBudget", "ConfigMap", "Secret", "NetworkPolicy"} <= kinds


def test_kubectl_kustomize_renders_valid_manifests():
    kubectl = shutil.which("kubectl")
    if kubectl is None:
        pytest.skip("kubectl is not installed")
    run = subprocess.run([kubectl, "kustomize", str(K8S)], capture_output=True, text=True, timeout=60)
    assert run.returncode == 0, run.stderr
    docs = [d for d in yaml.safe_load_all(run.stdout) if d]
    names = {(d["kind"], d["metadata"]["name"]) for d in docs}
    assert ("Deployment", "tether-server") in names and ("Deployment", "tether-envoy") in names
    assert all(d["metadata"].get("namespace") == "tether" for d in docs if d["kind"] != "Namespace")
    # Generated ConfigMaps get a content hash, and the pods reference the hashed names.
    cms = [n for k, n in names if k == "ConfigMap"]
    assert len(cms) == 2 and all(re.fullmatch(r"tether-(server|envoy)-config-[a-z0-9]{10}", n) for n in cms)
    for d in docs:
        if d["kind"] == "Deployment":
            spec = d["spec"]["template"]["spec"]
            refs = [v["configMap"]["name"] for v in spec["volumes"] if "configMap" in v]
            refs += [r["configMapRef"]["name"] for c in spec["containers"] for r in c.get("envFrom", [])]
            assert refs and set(refs) <= set(cms)
    try:
        from kubernetes_validate import utils
    except ImportError:
        return  # rendering alone was checked; the schemas need kubernetes-validate
    for doc in docs:
        utils.validate(doc, utils.latest_version(), strict=True)


# ---- cross-references ----------------------------------------------------------------------------------------------


def pod_spec(name: str) -> dict:
    return by_kind("Deployment")[name]["spec"]["template"]["spec"]


def pod_labels(name: str) -> dict:
    return by_kind("Deployment")[name]["spec"]["template"]["metadata"]["labels"]


def container(name: str) -> dict:
    (c,) = pod_spec(name)["containers"]
    return c


def container_ports(name: str) -> dict[str, int]:
    return {p["name"]: p["containerPort"] for p in container(name)["ports"]}


def test_selectors_and_named_ports_agree():
    deployments = by_kind("Deployment")
    for name, d in deployments.items():
        assert selects(d["spec"]["selector"]["matchLabels"], pod_labels(name))
    for svc in by_kind("Service").values():
        (target,) = [n for n in deployments if selects(svc["spec"]["selector"], pod_labels(n))]
        for port in svc["spec"]["ports"]:
            assert port["targetPort"] in container_ports(target), (svc["metadata"]["name"], port)
    for pdb in by_kind("PodDisruptionBudget").values():
        assert [n for n in deployments if selects(pdb["spec"]["selector"]["matchLabels"], pod_labels(n))]
    for policy in by_kind("NetworkPolicy").values():
        (target,) = [n for n in deployments if selects(policy["spec"]["podSelector"]["matchLabels"], pod_labels(n))]
        for rule in policy["spec"]["ingress"]:
            for port in rule["ports"]:
                assert port["port"] in container_ports(target).values()
            for peer in rule["from"]:
                if "podSelector" in peer:
                    assert [n for n in deployments if selects(peer["podSelector"]["matchLabels"], pod_labels(n))]


def test_every_configmap_and_secret_a_pod_uses_exists():
    configmaps = {c["metadata"]["name"] for c in generated_configmaps()}
    secrets = {s["metadata"]["name"] for s in example_secrets()}
    for name in by_kind("Deployment"):
        spec = pod_spec(name)
        for v in spec["volumes"]:
            if "configMap" in v:
                assert v["configMap"]["name"] in configmaps
            if "secret" in v:
                assert v["secret"]["secretName"] in secrets
        mounted = {m["name"] for m in container(name)["volumeMounts"]}
        assert mounted == {v["name"] for v in spec["volumes"]}
        for ref in container(name).get("envFrom", []):
            assert ref["configMapRef"]["name"] in configmaps


def entrypoint() -> list[str]:
    text = DOCKERFILE.read_text().replace("\\\n", " ")
    (line,) = [ln for ln in text.splitlines() if ln.startswith("ENTRYPOINT")]
    return json.loads(line.removeprefix("ENTRYPOINT"))


def test_the_replicas_command_line_parses_with_tether_server_serve():
    from tether.server.cli import build_parser
    from tether.server.rpc_server import SERVICE_NAME

    c = container("tether-server")
    env = read_env(K8S / "server.env")
    args = [re.sub(r"\$\((\w+)\)", lambda m: env[m.group(1)], a) for a in c["args"]]
    command = entrypoint() + args
    assert command[:2] == ["tether-server", "serve"]
    cfg = build_parser().parse_args(command[1:])
    assert cfg.host == "0.0.0.0" and cfg.port == container_ports("tether-server")["grpc"]
    assert cfg.metrics_port == container_ports("tether-server")["metrics"]
    assert cfg.api_keys.startswith(next(m["mountPath"] for m in c["volumeMounts"] if m["name"] == "api-keys"))
    assert cfg.grace_s < pod_spec("tether-server")["terminationGracePeriodSeconds"] - 6  # after preStop's sleep
    # The kernel cache (--cache-dir) is on a writable volume: the root filesystem is read-only.
    (cache,) = [m for m in c["volumeMounts"] if f"{cfg.cache_dir}/".startswith(m["mountPath"].rstrip("/") + "/")]
    assert cfg.cache_dir and not cache.get("readOnly")
    # Every variable of the ConfigMap is used, and every $(VAR) is defined.
    used = set(re.findall(r"\$\((\w+)\)", " ".join(c["args"])))
    assert used == set(env)
    # Probes: gRPC health on the serving port, for the service name the server registers.
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert c[probe]["grpc"]["port"] == cfg.port
    assert c["readinessProbe"]["grpc"]["service"] == SERVICE_NAME == c["startupProbe"]["grpc"]["service"]
    assert c["resources"]["limits"]["nvidia.com/gpu"] == 1 == c["resources"]["requests"]["nvidia.com/gpu"]
    annotations = by_kind("Deployment")["tether-server"]["spec"]["template"]["metadata"]["annotations"]
    assert annotations["prometheus.io/scrape"] == "true"
    assert (
        int(annotations["prometheus.io/port"]) == cfg.metrics_port and annotations["prometheus.io/path"] == "/metrics"
    )


def test_envoy_is_wired_to_the_headless_service_its_configmap_and_its_certificate():
    envoy = yaml.safe_load((K8S / "envoy.yaml").read_text())
    (headless,) = [s for s in by_kind("Service").values() if s["spec"].get("clusterIP") == "None"]
    assert headless["spec"]["publishNotReadyAddresses"] is False
    (upstream,) = [c for c in envoy["static_resources"]["clusters"] if c["name"] == "tether_server"]
    address = upstream["load_assignment"]["endpoints"][0]["lb_endpoints"][0]["endpoint"]["address"]["socket_address"]
    namespace = kustomization()["namespace"]
    assert address["address"] == f"{headless['metadata']['name']}.{namespace}.svc.cluster.local"
    grpc_port = next(p for p in headless["spec"]["ports"] if p["name"] == "grpc")
    assert address["port_value"] == grpc_port["port"] == container_ports("tether-server")["grpc"]
    listeners = {x["name"]: x for x in envoy["static_resources"]["listeners"]}
    ports = container_ports("tether-envoy")
    assert listeners["tether_grpc"]["address"]["socket_address"]["port_value"] == ports["grpc-tls"]
    assert listeners["envoy_admin_proxy"]["address"]["socket_address"]["port_value"] == ports["admin-proxy"]
    c = container("tether-envoy")
    mounts = {m["name"]: m["mountPath"] for m in c["volumeMounts"]}
    assert c["args"][c["args"].index("--config-path") + 1] == f"{mounts['config']}/envoy.yaml"
    tls = listeners["tether_grpc"]["filter_chains"][0]["transport_socket"]["typed_config"]["common_tls_context"]
    (cert,) = tls["tls_certificates"]
    assert cert["certificate_chain"]["filename"] == f"{mounts['tls']}/tls.crt"
    assert cert["private_key"]["filename"] == f"{mounts['tls']}/tls.key"
    tls_secret = next(v["secret"]["secretName"] for v in pod_spec("tether-envoy")["volumes"] if v["name"] == "tls")
    assert next(s for s in example_secrets() if s["metadata"]["name"] == tls_secret)["type"] == "kubernetes.io/tls"
    assert c["readinessProbe"]["httpGet"]["path"] == "/ready"
    annotations = by_kind("Deployment")["tether-envoy"]["spec"]["template"]["metadata"]["annotations"]
    assert int(annotations["prometheus.io/port"]) == ports["admin-proxy"]


def test_pods_run_as_non_root_without_privileges():
    for name in by_kind("Deployment"):
        spec = pod_spec(name)
        assert spec["securityContext"]["runAsNonRoot"] is True and spec["securityContext"]["runAsUser"] > 0
        assert spec["automountServiceAccountToken"] is False
        sc = container(name)["securityContext"]
        assert sc["allowPrivilegeEscalation"] is False and sc["readOnlyRootFilesystem"] is True
        assert sc["capabilities"]["drop"] == ["ALL"]
    # The server image's user is the one the pod runs as (files in the image belong to it).
    user = [ln.split()[1] for ln in DOCKERFILE.read_text().splitlines() if ln.startswith("USER ")][-1]
    ctx = pod_spec("tether-server")["securityContext"]
    assert user == f"{ctx['runAsUser']}:{ctx['runAsGroup']}"
