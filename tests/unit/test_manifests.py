"""deploy/kubernetes: the Kustomize base and its examples, rendered, validated and scanned;
deploy/kubernetes-network too, alone and with each of its components (the client-certificate
recipes) in an overlay as a user would write it.

``kubectl kustomize`` renders both (kubectl with kustomize is on the project's machines; where
it is missing the tests fail and say how to install it). Every object rendered is validated
against the JSON schemas of several Kubernetes minors, strictly (an unknown field fails), by
kubernetes-validate, and scanned by checkov; both come from the tools venv that
``make tools-venv`` makes (``.venv-tools``, or ``$JAILD_TOOLS_VENV``), not jaild's own. Each
has a positive control: a copy broken on purpose must be caught. cert-manager's custom
resources are validated against its CRD schemas, vendored (tests/schemas/cert-manager).
checkov's findings may be skipped only by annotations on jaild's two DaemonSets (the daemon
and the device plugin that advertises its jail slots), each with its reason.

The rest holds the manifests to what the daemon reads: the config ConfigMap is a valid
jaild.toml whose drain fits in the pod's grace period, the policies ConfigMap is the
repository's policies/*.toml, the device plugin advertises the daemon's jail slots and mounts
its socket directory read-only, the agent example runs with no privilege at all and no
hostPath, requesting a slot.
"""

from __future__ import annotations

import copy
import json
import os
import re
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from jaild.daemon.config import load_config_file
from jaild.policy.schema import load_policy_text

REPO = Path(__file__).resolve().parent.parent.parent
K8S = REPO / "deploy" / "kubernetes"
EXAMPLES = K8S / "examples"
NETWORK = REPO / "deploy" / "kubernetes-network"
COMPONENTS = NETWORK / "components"  # kind: Component, each rendered in an overlay of its own
TOOLS_VENV = Path(os.environ.get("JAILD_TOOLS_VENV") or REPO / ".venv-tools")

# kubectl on the machines is v1.32: it and the two minors before it, always; and the newest
# three the installed kubernetes-validate has schemas for.
MINORS = ("1.30", "1.31", "1.32")
NEWEST = 3
SOCKET_DIR = "/run/jaild"
SANDBOX_LABEL = ("jaild.io/sandbox", "true")
# daemon.socket_group is "users": gid 100 in Debian's base-passwd (the image is Debian's).
USERS_GID = 100
IMAGE = "localhost/jaild:latest"
SLOTS = "jaild.dev/slots"  # access.slot_resource's default, the device plugin's resource
SKIPPABLE = {("DaemonSet", "jaild"), ("DaemonSet", "jaild-slots")}  # jaild's two DaemonSets

Obj = dict[str, Any]


def kubectl() -> str:
    path = shutil.which("kubectl")
    if path is None:
        pytest.fail(
            "kubectl is not on PATH: the manifests are rendered with `kubectl kustomize`. "
            "Install kubectl >= 1.27 (kustomize v5 built in): Debian's packages from "
            "pkgs.k8s.io (apt-get install kubectl after adding its repository), or the "
            "static binary from dl.k8s.io into /usr/local/bin",
            pytrace=False,
        )
    return path


def tool(name: str) -> str:
    path = TOOLS_VENV / "bin" / name
    if not os.access(path, os.X_OK):
        pytest.fail(
            f"{path} is missing: the manifests are checked with checkov and "
            "kubernetes-validate from a venv of their own. `make tools-venv` makes it "
            "(deploy/kubernetes/requirements-check.txt); JAILD_TOOLS_VENV names another",
            pytrace=False,
        )
    return str(path)


def run(argv: list[str], cwd: Path | None = None,
        timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run(argv, capture_output=True, text=True, cwd=cwd, timeout=timeout,
                          check=False)


def render(directory: Path) -> str:
    out = run([kubectl(), "kustomize", str(directory)])
    assert out.returncode == 0, f"kubectl kustomize {directory} failed:\n{out.stderr}"
    return out.stdout


def load_yaml(path: Path) -> list[Obj]:
    """The documents of a YAML file, by the tools venv's PyYAML (jaild's venv need not have it)."""
    code = ("import json, sys, yaml; "
            "json.dump([d for d in yaml.safe_load_all(open(sys.argv[1])) if d], sys.stdout)")
    out = run([tool("python"), "-c", code, str(path)])
    assert out.returncode == 0, out.stderr
    docs: list[Obj] = json.loads(out.stdout)
    return docs


def write_docs(path: Path, docs: list[Obj]) -> None:
    """JSON documents between ``---`` lines: YAML, as both tools read it."""
    path.write_text("".join("---\n" + json.dumps(d, indent=1) + "\n" for d in docs))


RENDERS = ("base", "examples", "network", "namespace-cas", "spiffe")


@dataclass
class Rendered:
    directory: Path  # <name>.yaml for each of RENDERS, as kubectl kustomize wrote them
    base: list[Obj]
    examples: list[Obj]
    network: list[Obj]  # the base with the TLS listener (deploy/kubernetes-network)
    namespace_cas: list[Obj]  # network + components/namespace-cas
    spiffe: list[Obj]  # network + components/spiffe + an agent elsewhere (spiffe_agent)

    @property
    def every(self) -> list[Obj]:
        return self.base + self.examples + self.network + self.namespace_cas + self.spiffe

    @property
    def files(self) -> list[Path]:
        return [self.directory / f"{name}.yaml" for name in RENDERS]


def overlay(directory: Path, component: str, extra: tuple[Obj, ...] = ()) -> Path:
    """An overlay as a user would write it, in ``directory``: deploy/kubernetes-network and
    ``extra`` (objects of the user's own) as resources, ``components/<component>`` as a
    component. Paths relative: kustomize takes no absolute ones."""
    directory.mkdir()
    resources = [os.path.relpath(NETWORK, directory)]
    if extra:
        write_docs(directory / "extra.yaml", list(extra))
        resources.append("extra.yaml")
    (directory / "kustomization.yaml").write_text(json.dumps({
        "apiVersion": "kustomize.config.k8s.io/v1beta1", "kind": "Kustomization",
        "resources": resources,
        "components": [os.path.relpath(COMPONENTS / component, directory)]}))
    return directory


def spiffe_agent(examples: list[Obj]) -> Obj:
    """The example agent as a network client elsewhere (namespace trainers, no socket, no
    sandbox node), labelled for the SPIFFE component's patch."""
    agent = copy.deepcopy(one(examples, "Deployment"))
    agent["metadata"].update(name="trainer", namespace="trainers")
    agent["metadata"]["labels"]["jaild.io/svid"] = "true"
    pod = agent["spec"]["template"]["spec"]
    for key in ("nodeSelector", "tolerations"):
        pod.pop(key)
    pod["securityContext"].pop("supplementalGroups")
    pod["volumes"] = [v for v in pod["volumes"] if "hostPath" not in v]
    (container,) = pod["containers"]
    container["volumeMounts"] = [m for m in container["volumeMounts"]
                                 if m["mountPath"] != SOCKET_DIR]
    container["env"] = [{"name": "JAILD_SOCKET", "value": "tls://jaild.jaild-system.svc:7443"}]
    return agent


@pytest.fixture(scope="module")
def rendered(tmp_path_factory: pytest.TempPathFactory) -> Rendered:
    out = tmp_path_factory.mktemp("rendered")
    overlays = tmp_path_factory.mktemp("overlays")
    (out / "base.yaml").write_text(render(K8S))
    (out / "examples.yaml").write_text(render(EXAMPLES))
    (out / "network.yaml").write_text(render(NETWORK))
    examples = load_yaml(out / "examples.yaml")
    (out / "namespace-cas.yaml").write_text(
        render(overlay(overlays / "namespace-cas", "namespace-cas")))
    (out / "spiffe.yaml").write_text(
        render(overlay(overlays / "spiffe", "spiffe", (spiffe_agent(examples),))))
    return Rendered(out, *(load_yaml(out / f"{name}.yaml") for name in RENDERS))


def one(docs: list[Obj], kind: str, name: str | None = None) -> Obj:
    """The one object of ``kind`` whose name starts with ``name`` (ending in NUL: is it)."""
    found = [d for d in docs if d["kind"] == kind
             and (name is None or (d["metadata"]["name"] + "\0").startswith(name))]
    assert len(found) == 1, f"expected one {kind} {name or ''}, found {len(found)}"
    return found[0]


# ---------------------------------------------------------------------------- schemas


@pytest.fixture(scope="module")
def versions() -> list[str]:
    code = ("from kubernetes_validate.utils import all_versions; "
            "print('\\n'.join(all_versions()))")
    out = run([tool("python"), "-c", code])
    assert out.returncode == 0, out.stderr
    have = sorted({".".join(v.split(".")[:2]) for v in out.stdout.split()},
                  key=lambda v: tuple(map(int, v.split("."))))
    missing = [m for m in MINORS if m not in have]
    assert not missing, f"kubernetes-validate has no schemas for {missing} (it has {have})"
    return sorted(set(MINORS) | set(have[-NEWEST:]), key=lambda v: tuple(map(int, v.split("."))))


def validate(files: list[Path], version: str) -> subprocess.CompletedProcess[str]:
    return run([tool("kubernetes-validate"), "--strict", "--no-warn", "-k", f"{version}.0",
                *map(str, files)])


def built_in(doc: Obj) -> bool:
    """A kind of Kubernetes itself (kubernetes-validate's), not a custom resource."""
    group = doc["apiVersion"].rpartition("/")[0]
    return "." not in group or group.endswith(".k8s.io")


def test_every_object_is_valid_for_each_minor_strictly(rendered: Rendered,
                                                       versions: list[str]) -> None:
    """Kubernetes' own kinds; the custom resources (cert-manager's): the test below."""
    for version in versions:
        out = validate(rendered.files, version)
        assert out.returncode == 0, f"Kubernetes {version}:\n{out.stdout}{out.stderr}"
        passed = re.findall(r"passed for resource", out.stdout)
        assert len(passed) == len([d for d in rendered.every if built_in(d)]), (
            f"Kubernetes {version}:\n{out.stdout}")


def validate_custom(files: list[Path]) -> list[tuple[str, str, list[str]]]:
    out = run([tool("python"), str(REPO / "tests" / "crd_validate.py"), *map(str, files)])
    assert out.returncode == 0, out.stderr
    return [tuple(entry) for entry in json.loads(out.stdout)]  # type: ignore[misc]


def test_every_custom_resource_is_valid_against_its_vendored_schema_strictly(
        rendered: Rendered, tmp_path: Path) -> None:
    """cert-manager's Certificates and Issuers, against the CRD schemas of a pinned release
    (tests/schemas/cert-manager: no network at test time), an unknown field failing."""
    custom = [d for d in rendered.every if not built_in(d)]
    assert {d["kind"] for d in custom} == {"Certificate", "Issuer"}
    results = validate_custom(rendered.files)
    assert len(results) == len(custom)
    assert [r for r in results if r[2]] == []

    # positive controls: a misspelt field, a wrong type, a kind with no schema
    docs = copy.deepcopy(rendered.namespace_cas)
    ca = one(docs, "Certificate", "jaild-client-ca")
    ca["spec"]["isCa"] = ca["spec"].pop("isCA")
    one(docs, "Issuer", "jaild-client")["spec"]["ca"]["secretName"] = 7
    issuer = copy.deepcopy(one(docs, "Issuer", "jaild-client"))
    issuer["kind"] = "ClusterIssuer"
    bad = tmp_path / "bad.yaml"
    write_docs(bad, [*docs, issuer])
    failed = {(kind, name): errors for kind, name, errors in validate_custom([bad]) if errors}
    assert set(failed) == {("Certificate", "jaild-client-ca"), ("Issuer", "jaild-client"),
                           ("ClusterIssuer", "jaild-client")}, failed
    assert "isCa" in str(failed[("Certificate", "jaild-client-ca")])
    assert "secretName" in str(failed[("Issuer", "jaild-client")])


def test_the_validator_catches_a_misspelt_field(rendered: Rendered, tmp_path: Path) -> None:
    """Positive control: a field that does not exist, and one of the wrong type, fail."""
    docs = copy.deepcopy(rendered.base)
    pod = one(docs, "DaemonSet", "jaild\0")["spec"]["template"]["spec"]
    pod["terminationGracePeriodSecond"] = pod.pop("terminationGracePeriodSeconds")
    bad = tmp_path / "misspelt.yaml"
    write_docs(bad, docs)
    out = validate([bad], MINORS[-1])
    assert out.returncode != 0 and "terminationGracePeriodSecond" in out.stdout + out.stderr, (
        out.stdout + out.stderr)

    docs = copy.deepcopy(rendered.examples)
    one(docs, "Deployment")["spec"]["replicas"] = "two"
    write_docs(bad, docs)
    out = validate([bad], MINORS[0])
    assert out.returncode != 0 and "replicas" in out.stdout + out.stderr, out.stdout + out.stderr


# ---------------------------------------------------------------------------- checkov


def checkov(directory: Path) -> dict[str, list[Obj]]:
    """checkov's results on every YAML file in ``directory``, offline (--skip-download); not
    --quiet, which would leave the skipped checks out of the JSON."""
    out = run([tool("checkov"), "-d", str(directory), "--framework", "kubernetes", "--compact",
               "--skip-download", "-o", "json"], cwd=directory, timeout=300)
    assert out.returncode in (0, 1), f"checkov failed to run:\n{out.stdout}\n{out.stderr}"
    report = json.loads(out.stdout)
    if isinstance(report, list):
        (report,) = [r for r in report if r.get("check_type") == "kubernetes"]
    assert report.get("check_type") == "kubernetes", f"checkov scanned nothing: {report}"
    results: dict[str, list[Obj]] = report["results"]
    return results


def findings(checks: list[Obj]) -> str:
    return "\n".join(f"  {c['check_id']} {c['resource']}: {c['check_name']}" for c in checks)


def test_checkov_finds_nothing_but_the_daemonsets_reasoned_skips(rendered: Rendered) -> None:
    results = checkov(rendered.directory)
    failed = results["failed_checks"]
    assert not failed, "checkov's findings:\n" + findings(failed)
    skipped = results["skipped_checks"]
    assert skipped, "the DaemonSet's skips were not seen: is checkov reading its annotations?"
    allowed = {f"{kind}.jaild-system.{name}" for kind, name in SKIPPABLE}
    wrong = [c for c in skipped if c["resource"] not in allowed]
    assert not wrong, "skipped off jaild's DaemonSets:\n" + findings(wrong)
    # what checkov skipped is what the annotations name (their reasons: the test below)
    for kind, name in SKIPPABLE:
        annotations = one(rendered.base, kind, name + "\0")["metadata"]["annotations"]
        named = {v.partition("=")[0] for k, v in annotations.items() if SKIP.fullmatch(k)}
        assert {c["check_id"] for c in skipped
                if c["resource"] == f"{kind}.jaild-system.{name}"} == named, name


def test_checkov_catches_a_privileged_agent(rendered: Rendered, tmp_path: Path) -> None:
    """Positive control: the agent made privileged, sharing the host's pids, fails."""
    docs = copy.deepcopy(rendered.examples)
    pod = one(docs, "Deployment")["spec"]["template"]["spec"]
    pod["hostPID"] = True
    pod["containers"][0]["securityContext"].update(privileged=True,
                                                   allowPrivilegeEscalation=True)
    write_docs(tmp_path / "examples.yaml", docs)
    failed = {(c["check_id"], c["resource"]) for c in checkov(tmp_path)["failed_checks"]}
    for check in ("CKV_K8S_16", "CKV_K8S_17", "CKV_K8S_20"):
        assert (check, "Deployment.agents.agent") in failed, sorted(failed)


SKIP = re.compile(r"checkov\.io/skip\d+")
REASONED = re.compile(r"(CKV2?_K8S_\d+)=(.{20,})")


def skip_problems(docs: list[Obj]) -> list[str]:
    """Skip annotations anywhere but jaild's DaemonSets, or without a reason."""
    problems = []
    for d in docs:
        places = [d["metadata"].get("annotations") or {}]
        template = d.get("spec", {}).get("template", {}).get("metadata", {})
        places.append(template.get("annotations") or {})
        where = f"{d['kind']} {d['metadata']['name']}"
        for found in places:
            for key, value in found.items():
                if not SKIP.fullmatch(key):
                    continue
                if (d["kind"], d["metadata"]["name"]) not in SKIPPABLE:
                    problems.append(f"{where}: {key} (skips belong on jaild's DaemonSets only)")
                elif not REASONED.fullmatch(value):
                    problems.append(f"{where}: {key}={value!r} gives no reason")
    return problems


def test_skips_are_on_the_daemonset_only_each_with_a_reason(rendered: Rendered) -> None:
    assert skip_problems(rendered.every) == []
    for _kind, name in SKIPPABLE:
        skips = one(rendered.base, "DaemonSet", name + "\0")["metadata"]["annotations"]
        ids = [v.partition("=")[0] for k, v in skips.items() if SKIP.fullmatch(k)]
        assert len(ids) == len(set(ids)), f"a check skipped twice: {ids}"

    # positive control: a skip on the agent, and one with no reason, are both named
    docs = copy.deepcopy(rendered.base + rendered.examples)
    one(docs, "Deployment")["metadata"]["annotations"] = {"checkov.io/skip1": "CKV_K8S_16=x" * 3}
    one(docs, "DaemonSet", "jaild\0")["metadata"]["annotations"]["checkov.io/skip99"] = "CKV_K8S_8"
    assert len(skip_problems(docs)) == 2, skip_problems(docs)


# ---------------------------------------------------------------------------- the daemon


def configmap_data(docs: list[Obj], name: str) -> dict[str, str]:
    data: dict[str, str] = one(docs, "ConfigMap", name + "-")["data"]
    return data


def daemon_pod(rendered: Rendered) -> Obj:
    pod: Obj = one(rendered.base, "DaemonSet", "jaild\0")["spec"]["template"]["spec"]
    return pod


def mebibytes(quantity: str) -> int:
    units = {"Mi": 1, "Gi": 1024, "Ti": 1024 * 1024}
    return int(quantity[:-2]) * units[quantity[-2:]]


def test_the_policies_configmap_is_the_repositorys_policies(rendered: Rendered) -> None:
    shipped = {p.name: p.read_text() for p in sorted((REPO / "policies").glob("*.toml"))}
    copies = {p.name: p.read_text() for p in sorted((K8S / "policies").glob("*.toml"))}
    assert copies == shipped, (
        "deploy/kubernetes/policies/ differs from policies/: run `make k8s-policies` (and list "
        "a new file in deploy/kubernetes/kustomization.yaml)")
    kustomization = (K8S / "kustomization.yaml").read_text()
    listed = set(re.findall(r"^\s+- policies/(\S+\.toml)$", kustomization, re.M))
    assert listed == set(shipped), "kustomization.yaml's jaild-policies files: " + str(listed)
    assert configmap_data(rendered.base, "jaild-policies") == shipped


def test_the_config_is_valid_and_the_grace_period_outlasts_the_drain(
        rendered: Rendered, tmp_path: Path) -> None:
    config = tmp_path / "jaild.toml"
    config.write_text(configmap_data(rendered.base, "jaild-config")["jaild.toml"])
    sections = load_config_file(str(config))  # jaild's own validation
    daemon, limits = sections["daemon"], sections["limits"]
    assert daemon.metrics_address == "0.0.0.0:9464"
    assert daemon.drain_s > 0
    pod = daemon_pod(rendered)
    margin = pod["terminationGracePeriodSeconds"] - daemon.drain_s - limits.shutdown_grace_s
    assert margin >= 5, "terminationGracePeriodSeconds must outlast drain_s + shutdown_grace_s"

    (container,) = pod["containers"]
    mounts = {m["mountPath"]: m for m in container["volumeMounts"]}
    assert os.path.dirname(daemon.socket) == SOCKET_DIR and SOCKET_DIR in mounts
    assert daemon.policies_dir in mounts and "/etc/jaild/jaild.toml" in mounts
    assert {"name": "JAILD_CONFIG", "value": "/etc/jaild/jaild.toml"} in container["env"]
    assert daemon.socket_group == "users"
    # the jails' ceiling below the pod's memory, leaving the daemon its room
    limit = mebibytes(container["resources"]["limits"]["memory"])
    assert 0 < limits.max_memory_mb <= limit - 512, (limits.max_memory_mb, limit)
    port = int(daemon.metrics_address.rpartition(":")[2])
    assert {"name": "metrics", "containerPort": port, "protocol": "TCP"} in container["ports"]


def test_the_daemonset(rendered: Rendered) -> None:
    ds = one(rendered.base, "DaemonSet", "jaild\0")
    pod = ds["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    assert container["image"] == IMAGE
    assert pod["hostPID"] is True and container["securityContext"]["privileged"] is True
    assert ds["spec"]["updateStrategy"] == {
        "type": "RollingUpdate", "rollingUpdate": {"maxUnavailable": 1, "maxSurge": 0}}
    assert pod["serviceAccountName"] == "jaild"
    volumes = {v["name"]: v for v in pod["volumes"]}
    assert volumes["socket-dir"]["hostPath"] == {"path": SOCKET_DIR, "type": "DirectoryOrCreate"}
    node_name = {"name": "JAILD_NODE_NAME",
                 "valueFrom": {"fieldRef": {"fieldPath": "spec.nodeName"}}}
    assert node_name in container["env"]
    assert pod["nodeSelector"] == dict([SANDBOX_LABEL])
    assert {"key": SANDBOX_LABEL[0], "operator": "Equal", "value": SANDBOX_LABEL[1],
            "effect": "NoSchedule"} in pod["tolerations"]
    probe = ["/opt/jaild/venv/bin/jaild", "policies", "--socket", f"{SOCKET_DIR}/jaild.sock"]
    assert container["startupProbe"]["exec"]["command"] == probe
    assert container["readinessProbe"]["exec"]["command"] == probe
    assert container["livenessProbe"]["httpGet"] == {"path": "/metrics", "port": "metrics"}
    for kind in ("requests", "limits"):
        assert set(container["resources"][kind]) >= {"cpu", "memory"}
    annotations = ds["spec"]["template"]["metadata"]["annotations"]
    assert annotations["prometheus.io/scrape"] == "true"
    assert annotations["prometheus.io/port"] == "9464"
    assert annotations["prometheus.io/path"] == "/metrics"
    service = one(rendered.base, "Service")
    assert service["spec"]["clusterIP"] == "None"
    assert service["spec"]["ports"][0]["name"] == "metrics"
    assert service["spec"]["selector"] == ds["spec"]["selector"]["matchLabels"]


def test_everything_in_jaild_system_and_the_rbac_reads_pods_only(rendered: Rendered) -> None:
    namespace = one(rendered.base, "Namespace")
    assert namespace["metadata"]["name"] == "jaild-system"
    assert namespace["metadata"]["labels"]["pod-security.kubernetes.io/enforce"] == "privileged"
    cluster_wide = {"Namespace", "ClusterRole", "ClusterRoleBinding"}
    for d in rendered.base:
        if d["kind"] not in cluster_wide:
            assert d["metadata"]["namespace"] == "jaild-system", d["metadata"]
    role = one(rendered.base, "ClusterRole")
    assert role["rules"] == [
        {"apiGroups": [""], "resources": ["pods"], "verbs": ["get", "list", "watch"]}]
    binding = one(rendered.base, "ClusterRoleBinding")
    assert binding["roleRef"]["name"] == role["metadata"]["name"]
    assert binding["subjects"] == [
        {"kind": "ServiceAccount", "name": "jaild", "namespace": "jaild-system"}]
    one(rendered.base, "ServiceAccount", "jaild")


# ---------------------------------------------------------------------------- the examples


# Pod Security's "restricted" level, as the Kubernetes documentation lists it (Pod Security
# Standards): no API server runs here to admit the agent, so its rules are checked field by field.
RESTRICTED_VOLUMES = {"configMap", "csi", "downwardAPI", "emptyDir", "ephemeral",
                      "persistentVolumeClaim", "projected", "secret"}


def restricted_problems(pod: Obj) -> list[str]:
    """What Pod Security's restricted level (which contains baseline) refuses in ``pod``."""
    problems = [f"{k}: true" for k in ("hostPID", "hostIPC", "hostNetwork") if pod.get(k)]
    for volume in pod.get("volumes", []):
        kinds = set(volume) - {"name"}
        if not kinds <= RESTRICTED_VOLUMES:
            problems.append(f"volume {volume['name']}: {sorted(kinds)}")
    context = pod.get("securityContext", {})
    for c in pod["containers"] + pod.get("initContainers", []):
        sc, name = c.get("securityContext", {}), c["name"]
        if sc.get("privileged"):
            problems.append(f"{name}: privileged")
        if sc.get("allowPrivilegeEscalation") is not False:
            problems.append(f"{name}: allowPrivilegeEscalation not false")
        if not sc.get("runAsNonRoot", context.get("runAsNonRoot")):
            problems.append(f"{name}: runAsNonRoot not true")
        if 0 in (sc.get("runAsUser"), context.get("runAsUser")):
            problems.append(f"{name}: runAsUser 0")
        seccomp = sc.get("seccompProfile", context.get("seccompProfile", {}))
        if seccomp.get("type") not in ("RuntimeDefault", "Localhost"):
            problems.append(f"{name}: seccompProfile {seccomp}")
        capabilities = sc.get("capabilities", {})
        if "ALL" not in capabilities.get("drop", []):
            problems.append(f"{name}: capabilities not dropped")
        if set(capabilities.get("add", [])) - {"NET_BIND_SERVICE"}:
            problems.append(f"{name}: capabilities added {capabilities['add']}")
        if any("hostPort" in port for port in c.get("ports", [])):
            problems.append(f"{name}: hostPort")
    return problems


def agent_pod(docs: list[Obj]) -> Obj:
    pod: Obj = one(docs, "Deployment")["spec"]["template"]["spec"]
    return pod


def test_the_agent_runs_with_no_privilege_no_hostpath_and_a_slot(rendered: Rendered) -> None:
    deployment = one(rendered.examples, "Deployment")
    assert deployment["metadata"]["namespace"] == "agents"
    pod = agent_pod(rendered.examples)
    assert pod["automountServiceAccountToken"] is False
    assert restricted_problems(pod) == []
    assert not [v for v in pod["volumes"] if "hostPath" in v]  # the slot mounts the socket
    context = pod["securityContext"]
    assert context["runAsNonRoot"] is True and context["runAsUser"] > 0
    assert USERS_GID in context["supplementalGroups"]  # the socket's group
    (container,) = pod["containers"]
    assert container["securityContext"]["readOnlyRootFilesystem"] is True
    # one jail slot, requested = limit; the socket's directory comes with it, not as a volume
    resources = container["resources"]
    assert resources["requests"][SLOTS] == resources["limits"][SLOTS] == "1"
    assert SOCKET_DIR not in {m["mountPath"] for m in container["volumeMounts"]}
    assert {"name": "JAILD_SOCKET", "value": f"{SOCKET_DIR}/jaild.sock"} in container["env"]
    assert pod["nodeSelector"] == dict([SANDBOX_LABEL])
    assert {"key": SANDBOX_LABEL[0], "operator": "Equal", "value": SANDBOX_LABEL[1],
            "effect": "NoSchedule"} in pod["tolerations"]

    # positive control: the agent as it was (the socket by hostPath), and as root, are named
    old = copy.deepcopy(pod)
    old["volumes"].append({"name": "jaild-socket",
                           "hostPath": {"path": SOCKET_DIR, "type": "Directory"}})
    old["securityContext"]["runAsUser"] = 0
    assert restricted_problems(old) == [
        "volume jaild-socket: ['hostPath']", "agent: runAsUser 0"], restricted_problems(old)


def test_the_admission_policys_cel_refuses_slots_outside_the_agents_namespaces(
        rendered: Rendered) -> None:
    """The example ValidatingAdmissionPolicy's expression, evaluated by a CEL
    implementation (cel-python, in the tools venv; no API server runs here): the example
    agent, which requests a slot, is refused, and so is a pod asking for one in an init
    container's limits; the same agent without the request is admitted (the control). Its
    binding applies it to every namespace but those labelled jaild.io/agents=true."""
    agent = agent_pod(rendered.examples)
    without = copy.deepcopy(agent)
    for kind in ("requests", "limits"):
        del without["containers"][0]["resources"][kind][SLOTS]
    init = copy.deepcopy(without)
    init["initContainers"] = [{"name": "init", "image": "x",
                               "resources": {"limits": {SLOTS: "1"}}}]
    pods = {name: {"spec": spec} for name, spec in
            (("agent", agent), ("without", without), ("init", init))}
    proc = subprocess.run(
        [tool("python"), str(REPO / "tests" / "cel_admission.py"),
         str(REPO / "deploy" / "kubernetes" / "examples" / "admission-policy.yaml")],
        input=json.dumps(pods), capture_output=True, text=True, timeout=120, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    failed = json.loads(proc.stdout)
    assert failed["without"] == [], failed["without"]
    for name in ("agent", "init"):
        assert len(failed[name]) == 1, (name, failed[name])
        assert failed[name][0].startswith(
            f"only pods in namespaces labelled jaild.io/agents=true may request {SLOTS}")

    # where it applies: the binding's selector, read as the API server reads NotIn
    binding = one(rendered.examples, "ValidatingAdmissionPolicyBinding")
    policy = one(rendered.examples, "ValidatingAdmissionPolicy")
    assert binding["spec"]["policyName"] == policy["metadata"]["name"]
    assert binding["spec"]["validationActions"] == ["Deny"]
    selector = binding["spec"]["matchResources"]["namespaceSelector"]
    assert set(selector) == {"matchExpressions"}
    (rule,) = selector["matchExpressions"]
    assert rule["operator"] == "NotIn"

    def bound(labels: dict[str, str]) -> bool:
        return labels.get(rule["key"]) not in rule["values"]

    agents = one(rendered.examples, "Namespace")["metadata"]["labels"]
    assert not bound(agents)  # the agents' namespace may request slots
    assert bound({}) and bound({"jaild.io/agents": "false"})  # every other namespace may not


def test_the_agents_namespace_is_restricted_and_its_quota_caps_slots(
        rendered: Rendered) -> None:
    labels = one(rendered.examples, "Namespace")["metadata"]["labels"]
    # no hostPath in the agents: Pod Security's strictest level admits them
    for mode in ("enforce", "warn", "audit"):
        assert labels[f"pod-security.kubernetes.io/{mode}"] == "restricted"
    cluster_wide = {"Namespace", "ValidatingAdmissionPolicy", "ValidatingAdmissionPolicyBinding"}
    for d in rendered.examples:
        assert d["metadata"].get("namespace") == (None if d["kind"] in cluster_wide
                                                  else "agents"), d["metadata"]
    quota = one(rendered.examples, "ResourceQuota")
    assert quota["metadata"]["namespace"] == "agents"
    hard = quota["spec"]["hard"]
    assert {"limits.memory", "limits.cpu", "pods"} <= set(hard)
    # an extended resource is quota'd by its request only: the "requests." prefix
    assert f"requests.{SLOTS}" in hard and f"limits.{SLOTS}" not in hard and SLOTS not in hard
    deployment = one(rendered.examples, "Deployment")
    per_pod = int(agent_pod(rendered.examples)["containers"][0]["resources"]["requests"][SLOTS])
    assert deployment["spec"]["replicas"] * per_pod <= int(hard[f"requests.{SLOTS}"])


# ---------------------------------------------------------------------------- the slots


def test_the_device_plugin_advertises_the_daemons_slots_and_mounts_the_socket_read_only(
        rendered: Rendered, tmp_path: Path) -> None:
    """squat/generic-device-plugin, as the base runs it: the resource is access.slot_resource
    (its domain and device name), its count the jails of the default policy the daemon's
    memory admits (at most limits.max_jobs), its one path the
    socket's directory, bind-mounted read-only at the same path (the plugin sees it there:
    the path it hands the kubelet is the one it globbed)."""
    ds = one(rendered.base, "DaemonSet", "jaild-slots\0")
    pod = ds["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    image, _, tag = container["image"].rpartition(":")
    assert image == "ghcr.io/squat/generic-device-plugin" and tag == "0.1.0"  # a release
    args = container["args"]
    domain = [a.partition("=")[2] for a in args if a.startswith("--domain=")]
    (device_text,) = [args[i + 1] for i, a in enumerate(args) if a == "--device"]
    (tmp_path / "device.yaml").write_text(device_text)
    (device,) = load_yaml(tmp_path / "device.yaml")
    config = tmp_path / "jaild.toml"
    config.write_text(configmap_data(rendered.base, "jaild-config")["jaild.toml"])
    sections = load_config_file(str(config))
    access, limits = sections["access"], sections["limits"]
    assert access.slot_resource == SLOTS == f"{domain[0]}/{device['name']}"
    (group,) = device["groups"]
    # the node's slots are the daemon's jails: as many of the default policy's as its memory
    # admits (a pod granted a slot is not then refused for memory the daemon as a whole lacks)
    default = load_policy_text(configmap_data(rendered.base, "jaild-policies")["default.toml"],
                               "default")
    admitted = int(limits.max_memory_mb * limits.memory_overcommit)
    assert group["count"] == admitted // default.limits.memory_mb, (group["count"], admitted)
    assert group["count"] <= limits.max_jobs
    assert group["paths"] == [{"path": SOCKET_DIR, "type": "Mount", "readOnly": True}]
    mounts = {m["mountPath"]: m for m in container["volumeMounts"]}
    volumes = {v["name"]: v for v in pod["volumes"]}
    assert mounts[SOCKET_DIR]["readOnly"] is True
    assert volumes[mounts[SOCKET_DIR]["name"]]["hostPath"]["path"] == SOCKET_DIR
    plugins = "/var/lib/kubelet/device-plugins"
    assert volumes[mounts[plugins]["name"]]["hostPath"]["path"] == plugins
    # no more than it needs: not privileged, no capability, no token, no host namespaces
    sc = container["securityContext"]
    assert sc.get("privileged", False) is False and sc["capabilities"] == {"drop": ["ALL"]}
    assert sc["allowPrivilegeEscalation"] is False and sc["readOnlyRootFilesystem"] is True
    assert pod["automountServiceAccountToken"] is False
    assert not any(pod.get(k) for k in ("hostPID", "hostIPC", "hostNetwork"))
    # on the nodes the daemon runs on, and only there
    daemon = daemon_pod(rendered)
    assert pod["nodeSelector"] == daemon["nodeSelector"]
    assert pod["tolerations"] == daemon["tolerations"]


def test_the_requirements_pin_lower_bounds() -> None:
    lines = [line.split("#")[0].strip()
             for line in (K8S / "requirements-check.txt").read_text().splitlines()]
    names = {re.split(r"[<>=]", line)[0]: line for line in lines if line}
    assert set(names) == {"checkov", "kubernetes-validate", "cel-python"}
    assert all(">=" in line for line in names.values()), names


# ---------------------------------------------------------------------------- over the network


def test_the_network_overlay_adds_a_tls_listener_and_nothing_else(
        rendered: Rendered, tmp_path: Path) -> None:
    import tomllib

    base = tomllib.loads(configmap_data(rendered.base, "jaild-config")["jaild.toml"])
    text = configmap_data(rendered.network, "jaild-config")["jaild.toml"]
    config = tmp_path / "jaild.toml"
    config.write_text(text)
    sections = load_config_file(str(config))  # jaild's own validation
    daemon, access, tls = sections["daemon"], sections["access"], sections["tls"]
    # the base's config, with only the listener, the principals and [tls] added
    network = tomllib.loads(text)
    assert network.pop("tls")
    assert network["daemon"].pop("listen") == ["tls://0.0.0.0:7443"]
    assert network["access"].pop("principals")
    assert network == base
    # the listener's port is the pod's port "tls", and the Service and NetworkPolicy name it
    pod = one(rendered.network, "DaemonSet", "jaild\0")["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    port = int(daemon.listen[0].rpartition(":")[2])
    assert {"name": "tls", "containerPort": port, "protocol": "TCP"} in container["ports"]
    assert {"name": "metrics", "containerPort": 9464, "protocol": "TCP"} in container["ports"]
    (service,) = [d for d in rendered.network
                  if d["kind"] == "Service" and d["metadata"]["name"] == "jaild"]
    assert service["spec"]["clusterIP"] == "None"  # headless: every pod's address
    assert service["spec"]["ports"] == [
        {"name": "tls", "port": port, "targetPort": "tls", "protocol": "TCP"}]
    (policy,) = [d for d in rendered.network if d["kind"] == "NetworkPolicy"
                 and d["metadata"]["name"] == "jaild-tls"]
    (rule,) = policy["spec"]["ingress"]
    assert rule["ports"] == [{"port": "tls", "protocol": "TCP"}]
    assert rule["from"] == [{"namespaceSelector": {"matchLabels": {"jaild.io/client": "true"}}}]
    # the certificates: the Secret's files, read-only, where [tls] looks
    mounts = {m["mountPath"]: m for m in container["volumeMounts"]}
    assert mounts["/etc/jaild/tls"]["readOnly"] is True
    for path in (tls.cert, tls.key, tls.client_ca):
        assert os.path.dirname(path) == "/etc/jaild/tls"
    volumes = {v["name"]: v for v in pod["volumes"]}
    assert volumes[mounts["/etc/jaild/tls"]["name"]]["secret"]["secretName"] == "jaild-tls"
    assert access.principals == ("spiffe://cluster.local/ns/*/sa/*",)
    # the rest of the DaemonSet is the base's
    base_pod = daemon_pod(rendered)
    assert pod["hostPID"] == base_pod["hostPID"]
    assert container["securityContext"] == base_pod["containers"][0]["securityContext"]


# ---------------------------------------------------------------------------- client certificates


def component_config(rendered: Rendered, docs: list[Obj], tmp_path: Path) -> tuple[Obj, Any]:
    """A component's jaild.toml: (its TOML, jaild's own reading of its [tls]), after checking
    it is the network overlay's with tls.client_ca replaced by tls.scoped_client_cas."""
    import tomllib

    text = configmap_data(docs, "jaild-config")["jaild.toml"]
    config = tmp_path / "jaild.toml"
    config.write_text(text)
    tls = load_config_file(str(config))["tls"]  # jaild's own validation
    network = tomllib.loads(configmap_data(rendered.network, "jaild-config")["jaild.toml"])
    mine = tomllib.loads(text)
    assert network["tls"].pop("client_ca")
    assert mine["tls"].pop("scoped_client_cas")
    assert mine == network
    return mine, tls


def mounted(pod: Obj, path: str) -> Obj:
    """The volume the file ``path`` is in, in the pod's one container."""
    (container,) = pod["containers"]
    (mount,) = [m for m in container["volumeMounts"]
                if path.startswith(m["mountPath"].rstrip("/") + "/")]
    assert mount.get("readOnly") is True
    (volume,) = [v for v in pod["volumes"] if v["name"] == mount["name"]]
    return volume


def test_namespace_cas_one_ca_per_tenant_namespace_bound_to_it(
        rendered: Rendered, tmp_path: Path) -> None:
    """components/namespace-cas: each scoped CA file is a tenant namespace's, mounted from
    the ConfigMap jaild-client-cas, and may name that namespace's service accounts only; the
    namespace has its own CA and a namespaced Issuer of it; no ClusterIssuer anywhere."""
    docs = rendered.namespace_cas
    _, tls = component_config(rendered, docs, tmp_path)
    assert tls.client_ca == ""
    pod = one(docs, "DaemonSet", "jaild\0")["spec"]["template"]["spec"]
    cas = one(docs, "ConfigMap", "jaild-client-cas-")
    tenants = []
    for entry in tls.scoped_client_cas:
        path, _, pattern = entry.partition("=")
        namespace = Path(path).stem
        tenants.append(namespace)
        assert pattern == f"spiffe://cluster.local/ns/{namespace}/sa/*", entry
        assert mounted(pod, path)["configMap"]["name"] == cas["metadata"]["name"]
        assert Path(path).name in cas["data"]
        # the namespace's CA, and the Issuer of it that its Certificates can reference
        (ca,) = [d for d in docs if d["kind"] == "Certificate"
                 and d["metadata"]["namespace"] == namespace and d["spec"].get("isCA")]
        issuers = [d for d in docs if d["kind"] == "Issuer" and d["metadata"]["namespace"]
                   == namespace and d["spec"].get("ca", {}).get("secretName")
                   == ca["spec"]["secretName"]]
        assert len(issuers) == 1
        assert ca["spec"]["privateKey"]["rotationPolicy"] == "Never"  # the daemon's copy holds
    assert tenants == ["agents"]
    assert not [d for d in docs if d["kind"] == "ClusterIssuer"]
    for cert in (d for d in docs if d["kind"] == "Certificate"):
        assert cert["spec"]["issuerRef"]["kind"] == "Issuer", cert["metadata"]
    # the daemon's own certificate: the Secret the network overlay mounts
    (server,) = [d for d in docs if d["kind"] == "Certificate"
                 and d["metadata"]["name"] == "jaild"]
    assert server["metadata"]["namespace"] == "jaild-system"
    assert server["spec"]["secretName"] == mounted(pod, tls.cert)["secret"]["secretName"]
    assert server["spec"]["usages"] == ["server auth"]
    # the certificate policy applies where the NetworkPolicy lets clients knock
    binding = one(docs, "ValidatingAdmissionPolicyBinding", "jaild-client-certificates")
    knock = one(docs, "NetworkPolicy", "jaild-tls")["spec"]["ingress"][0]["from"][0]
    assert binding["spec"]["matchResources"]["namespaceSelector"] == knock["namespaceSelector"]
    assert binding["spec"]["validationActions"] == ["Deny"]


def test_namespace_cas_the_shipped_config_refuses_another_namespaces_principal(
        rendered: Rendered, tmp_path: Path) -> None:
    """The component's tls.scoped_client_cas, as the daemon reads it, with a test CA in the
    file's place: agents' CA naming agents' service account is let in (the control), naming
    another namespace's is refused. The placeholder shipped in the file's place is no CA:
    the daemon refuses to start on it rather than trust anyone."""
    from jaild.daemon.tls import load_client_trust
    from jaild.errors import StartupError
    from tests.tls import CertAuthority

    _, tls = component_config(rendered, rendered.namespace_cas, tmp_path)
    ca = CertAuthority(tmp_path / "agents", "agents CA")
    (entry,) = tls.scoped_client_cas
    path, _, pattern = entry.partition("=")
    trust = load_client_trust("", [f"{ca.cert}={pattern}"])
    own, other = "spiffe://cluster.local/ns/agents/sa/agent", "spiffe://cluster.local/ns/x/sa/a"
    assert trust.refusal(ca.client("a", uri=own).certificate, own) is None
    refused = trust.refusal(ca.client("b", uri=other).certificate, other)
    assert refused is not None and refused[0] == "out_of_scope"

    placeholder = tmp_path / "placeholder.crt"
    placeholder.write_text(configmap_data(rendered.namespace_cas, "jaild-client-cas")[
        Path(path).name])
    with pytest.raises(StartupError, match="cannot be used"):
        load_client_trust("", [f"{placeholder}={pattern}"])


def test_namespace_cas_the_certificate_policys_cel_keeps_each_namespace_to_its_own(
        rendered: Rendered) -> None:
    """The component's ValidatingAdmissionPolicy, evaluated by cel-python (no API server):
    the tenant's own client Certificate is admitted in its namespace (the control), the
    same Certificate naming another namespace is refused -- and admitted in that other
    namespace, its own (the control that the namespace, not the name, decides); a
    CertificateRequest only cert-manager's controller may create."""
    cert = one(rendered.namespace_cas, "Certificate", "agent-jaild-client")
    namespace = cert["metadata"]["namespace"]
    other = "spiffe://cluster.local/ns/payments/sa/agent"

    def request(ns: str, user: str = "alice@example.org") -> Obj:
        return {"namespace": ns, "userInfo": {"username": user}}

    def variant(ns: str, **spec: object) -> Obj:
        changed = copy.deepcopy(cert)
        changed["spec"].update(spec)
        return {"object": changed, "request": request(ns)}

    cases: dict[str, Obj] = {
        "own": {"object": cert, "request": request(namespace)},
        "other-uri": variant(namespace, uris=[other]),
        "other-uri-second": variant(namespace, uris=[cert["spec"]["uris"][0], other]),
        "other-uri-in-its-namespace": variant("payments", uris=[other]),
        "look-alike-namespace": variant(
            namespace, uris=[f"spiffe://cluster.local/ns/{namespace}-x/sa/agent"]),
        "other-cn": variant(namespace, commonName=other),
        "dns-only": variant(namespace, uris=None, dnsNames=["svc.example"]),
        "request-by-user": {"object": {"kind": "CertificateRequest", "spec": {}},
                            "request": request(namespace)},
        "request-by-cert-manager": {
            "object": {"kind": "CertificateRequest", "spec": {}},
            "request": request(namespace, "system:serviceaccount:cert-manager:cert-manager")},
    }
    cases["dns-only"]["object"]["spec"].pop("uris")
    proc = subprocess.run(
        [tool("python"), str(REPO / "tests" / "cel_admission.py"),
         str(COMPONENTS / "namespace-cas" / "certificate-policy.yaml")],
        input=json.dumps(cases), capture_output=True, text=True, timeout=120, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    failed = json.loads(proc.stdout)
    for admitted in ("own", "other-uri-in-its-namespace", "dns-only", "request-by-cert-manager"):
        assert failed[admitted] == [], (admitted, failed[admitted])
    expected = {"other-uri": "spec.uris", "other-uri-second": "spec.uris",
                "look-alike-namespace": "spec.uris", "other-cn": "spec.commonName",
                "request-by-user": "only cert-manager's controller"}
    for name, says in expected.items():
        assert len(failed[name]) == 1 and says in failed[name][0], (name, failed[name])
    assert f"namespace {namespace} may name only" in failed["other-uri"][0]


def test_spiffe_the_daemon_trusts_the_trust_domain_and_agents_get_their_svid(
        rendered: Rendered, tmp_path: Path) -> None:
    """components/spiffe: the daemon's scoped CA is the driver's ca.crt, in a CSI volume of
    its own pod, for this trust domain's service accounts only; a labelled agent gets the
    driver's volume and the client's variables naming its files; the daemon's service
    account may create CertificateRequests in jaild-system and nothing more."""
    docs = rendered.spiffe
    _, tls = component_config(rendered, docs, tmp_path)
    assert tls.client_ca == ""
    (entry,) = tls.scoped_client_cas
    path, _, pattern = entry.partition("=")
    assert pattern == "spiffe://cluster.local/ns/*/sa/*"
    assert pattern == configmap_data(rendered.network, "jaild-config")["jaild.toml"].split(
        "principals = [\"")[1].split("\"")[0]  # the overlay's access.principals
    pod = one(docs, "DaemonSet", "jaild\0")["spec"]["template"]["spec"]
    driver = {"driver": "spiffe.csi.cert-manager.io", "readOnly": True}
    assert mounted(pod, path)["csi"] == driver
    agent = one(docs, "Deployment", "trainer")["spec"]["template"]["spec"]
    (container,) = agent["containers"]
    env = {e["name"]: e["value"] for e in container["env"]}
    for name in ("JAILD_TLS_CERT", "JAILD_TLS_KEY"):
        assert mounted(agent, env[name])["csi"] == driver, name
    assert Path(env["JAILD_TLS_CERT"]).name == "tls.crt"
    role = one(docs, "Role", "jaild-svid")
    assert role["rules"] == [{"apiGroups": ["cert-manager.io"],
                              "resources": ["certificaterequests"], "verbs": ["create"]}]
    binding = one(docs, "RoleBinding", "jaild-svid")
    assert binding["subjects"] == [
        {"kind": "ServiceAccount", "name": "jaild", "namespace": "jaild-system"}]
    assert not [d for d in docs if d["kind"] in ("Certificate", "Issuer", "ClusterIssuer")]
