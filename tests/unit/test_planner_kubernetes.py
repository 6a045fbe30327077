"""The Kubernetes connector against the official client's own objects: no cluster runs here.

A recording stand-in for `kubernetes.client.AppsV1Api` returns real `V1Scale` / `V1Deployment` models and raises
real `ApiException`s; the last tests drive the real `AppsV1Api` over HTTP against a small local server that
answers as the API server would (its paths, its Status bodies), and against a port nothing listens on.
"""

from __future__ import annotations

import json
import sys
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any, ClassVar

import pytest
from kubernetes import client
from kubernetes.client.exceptions import ApiException

from meshllm.errors import CannotConnect, ConfigError, FailedPrecondition, InvalidArgument, NotFound, Unavailable
from meshllm.planner.kubernetes import DEFAULT_DEPLOYMENTS, KubernetesConnector
from meshllm.planner.model import ROLES

NS = "meshllm"


def forbidden(verb: str, name: str) -> ApiException:
    status = {"kind": "Status", "status": "Failure", "reason": "Forbidden", "code": 403, "message": (
        f'deployments.apps "{name}" is forbidden: User "system:serviceaccount:{NS}:meshllm-planner" cannot {verb} '
        f'resource "deployments/scale" in API group "apps" in the namespace "{NS}"'
    )}  # fmt: skip
    return ApiException(status=403, reason="Forbidden", body=json.dumps(status))


class StandInApi:
    """Records every call; answers from `scales` / `ready`, or raises what `errors` queues for a method."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, str, str, dict[str, Any]]] = []
        self.scales = {"meshllm-prefill": 1, "meshllm-decode": 2}
        self.ready = {"meshllm-prefill": 1, "meshllm-decode": None}
        self.errors: dict[str, list[Exception]] = {}

    def _record(self, method: str, name: str, namespace: str, kwargs: dict[str, Any]) -> None:
        self.calls.append((method, name, namespace, kwargs))
        if self.errors.get(method):
            raise self.errors[method].pop(0)

    def read_namespaced_deployment_scale(self, name: str, namespace: str, **kwargs: Any) -> client.V1Scale:
        self._record("read_namespaced_deployment_scale", name, namespace, kwargs)
        return client.V1Scale(spec=client.V1ScaleSpec(replicas=self.scales[name]), status=client.V1ScaleStatus(replicas=1))

    def patch_namespaced_deployment_scale(self, name: str, namespace: str, body: Any, **kwargs: Any) -> client.V1Scale:
        self._record("patch_namespaced_deployment_scale", name, namespace, {"body": body, **kwargs})
        self.scales[name] = body["spec"]["replicas"]
        return client.V1Scale(spec=client.V1ScaleSpec(replicas=self.scales[name]))

    def read_namespaced_deployment(self, name: str, namespace: str, **kwargs: Any) -> client.V1Deployment:
        self._record("read_namespaced_deployment", name, namespace, kwargs)
        spec = client.V1DeploymentSpec(
            replicas=self.scales[name],
            selector=client.V1LabelSelector(match_labels={"app": name}),
            template=client.V1PodTemplateSpec(),
        )
        status = client.V1DeploymentStatus(replicas=self.scales[name], ready_replicas=self.ready[name])
        return client.V1Deployment(metadata=client.V1ObjectMeta(name=name, namespace=namespace), spec=spec, status=status)


@pytest.fixture
def api() -> StandInApi:
    return StandInApi()


@pytest.fixture
def connector(api: StandInApi) -> KubernetesConnector:
    return KubernetesConnector(namespace=NS, api=api)


async def test_scale_patches_the_roles_deployment_scale_in_its_namespace(api: StandInApi, connector: KubernetesConnector) -> None:
    await connector.scale("decode", 5)
    assert api.calls == [
        ("patch_namespaced_deployment_scale", "meshllm-decode", NS, {"body": {"spec": {"replicas": 5}}, "_request_timeout": 10.0})
    ]
    await connector.scale("prefill", 0)
    assert api.calls[-1][:3] == ("patch_namespaced_deployment_scale", "meshllm-prefill", NS)
    assert api.calls[-1][3]["body"] == {"spec": {"replicas": 0}}


async def test_replicas_are_the_scales_spec_and_ready_is_the_deployments_status(
    api: StandInApi, connector: KubernetesConnector
) -> None:
    assert await connector.replicas() == {"prefill": 1, "decode": 2}
    assert sorted(c[:3] for c in api.calls) == [
        ("read_namespaced_deployment_scale", "meshllm-decode", NS),
        ("read_namespaced_deployment_scale", "meshllm-prefill", NS),
    ]
    await connector.scale("decode", 4)
    assert await connector.replicas() == {"prefill": 1, "decode": 4}
    assert await connector.ready() == {"prefill": 1, "decode": 0}  # readyReplicas absent: none ready yet


async def test_forbidden_is_a_readable_error_naming_the_role(api: StandInApi, connector: KubernetesConnector) -> None:
    api.errors["patch_namespaced_deployment_scale"] = [forbidden("patch", "meshllm-decode")]
    with pytest.raises(FailedPrecondition) as info:
        await connector.scale("decode", 3)
    message = info.value.message
    assert message.startswith(f"kubernetes: forbidden to patch deployments/scale meshllm-decode in namespace {NS}: ")
    assert "deploy/k8s/planner.yaml" in message
    assert "system:serviceaccount:meshllm:meshllm-planner" in message  # the server's own words
    assert len(api.calls) == 1  # not retried


async def test_a_conflict_is_retried_once(api: StandInApi, connector: KubernetesConnector) -> None:
    api.errors["patch_namespaced_deployment_scale"] = [ApiException(status=409, reason="Conflict")]
    await connector.scale("prefill", 3)
    assert [c[0] for c in api.calls] == ["patch_namespaced_deployment_scale"] * 2
    assert api.scales["meshllm-prefill"] == 3

    api.calls.clear()
    api.errors["patch_namespaced_deployment_scale"] = [ApiException(status=409, reason="Conflict") for _ in range(2)]
    with pytest.raises(Unavailable, match="kubernetes: conflict on patch deployments/scale meshllm-prefill"):
        await connector.scale("prefill", 2)
    assert len(api.calls) == 2


@pytest.mark.parametrize(
    ("status", "error", "words"),
    [
        (404, NotFound, "not found: get deployments/scale meshllm-prefill in namespace meshllm"),
        (401, FailedPrecondition, "unauthorized to get deployments/scale"),
        (500, Unavailable, "HTTP 500 on get deployments/scale"),
        (0, CannotConnect, "cannot reach the API server"),
    ],
)
async def test_api_errors_become_mesh_errors(
    api: StandInApi, connector: KubernetesConnector, status: int, error: type[Exception], words: str
) -> None:
    api.errors["read_namespaced_deployment_scale"] = [ApiException(status=status, reason="why")] * 2
    with pytest.raises(error, match=words):
        await connector.replicas()


async def test_an_unknown_role_is_a_clear_error(connector: KubernetesConnector) -> None:
    with pytest.raises(InvalidArgument, match=r"no Deployment for role 'agg' in namespace meshllm \(known: decode="):
        await connector.scale("agg", 1)  # a role of the planner, but the manifests have no aggregated Deployment
    with pytest.raises(ConfigError, match=f"unknown role mixed; roles are {', '.join(ROLES)}"):
        KubernetesConnector(namespace=NS, deployments={"mixed": "x"}, api=StandInApi())
    with pytest.raises(InvalidArgument, match=">= 0"):
        await connector.scale("decode", -1)


def test_the_default_deployments_are_the_manifests() -> None:
    import yaml

    k8s = Path(__file__).resolve().parents[2] / "deploy" / "k8s"
    names = {
        d["metadata"]["name"]
        for path in k8s.glob("worker-*.yaml")
        for d in yaml.safe_load_all(path.read_text())
        if d and d["kind"] == "Deployment"
    }
    assert set(DEFAULT_DEPLOYMENTS.values()) == names


def test_a_missing_kubernetes_package_says_how_to_install_it(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "kubernetes", None)  # `import kubernetes` now raises ImportError
    with pytest.raises(ConfigError, match=r"needs the kubernetes package .*pip install 'meshllm\[kubernetes\]'"):
        KubernetesConnector(namespace=NS)


def test_a_bad_kube_config_mode_and_a_pod_without_a_service_account(monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(ConfigError, match="choose from auto, incluster, kubeconfig"):
        KubernetesConnector(kube_config="cluster")
    monkeypatch.setenv("KUBERNETES_SERVICE_HOST", "10.96.0.1")  # auto: in a pod, so in-cluster; no token here
    monkeypatch.setenv("KUBERNETES_SERVICE_PORT", "443")
    with pytest.raises(ConfigError, match="cannot load the in-cluster"):
        KubernetesConnector()


# ------------------------------------------------------------------ the real AppsV1Api over HTTP


class FakeApiServer(BaseHTTPRequestHandler):
    """Answers the two scale calls as the API server does; `forbid` makes every call a 403 Status."""

    seen: ClassVar[list[tuple[str, str, str, Any]]] = []
    forbid: ClassVar[bool] = False

    def _answer(self, body: Any) -> None:
        length = int(self.headers.get("Content-Length") or 0)
        sent = json.loads(self.rfile.read(length)) if length else None
        type(self).seen.append((self.command, self.path, self.headers.get("Content-Type", ""), sent))
        code = 403 if self.forbid else 200
        if self.forbid:
            body = {"kind": "Status", "apiVersion": "v1", "status": "Failure", "reason": "Forbidden", "code": 403,
                    "message": 'deployments.apps "meshllm-decode" is forbidden: User "u" cannot patch'}  # fmt: skip
        data = json.dumps(body).encode()
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self) -> None:
        self._answer({"kind": "Scale", "apiVersion": "autoscaling/v1", "spec": {"replicas": 3}, "status": {"replicas": 3}})

    def do_PATCH(self) -> None:
        self._answer({"kind": "Scale", "apiVersion": "autoscaling/v1", "spec": {"replicas": 6}, "status": {"replicas": 3}})

    def log_message(self, format: str, *args: Any) -> None:
        pass


@pytest.fixture
def kubeconfig(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """A kubeconfig whose current context names namespace `team-a` and a server from `write(server)`."""
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    path = tmp_path / "kubeconfig"
    monkeypatch.setattr("kubernetes.config.kube_config.KUBE_CONFIG_DEFAULT_LOCATION", str(path))
    yield path


def write_kubeconfig(path: Path, server: str) -> None:
    path.write_text(json.dumps({
        "apiVersion": "v1", "kind": "Config", "current-context": "c",
        "clusters": [{"name": "k", "cluster": {"server": server}}],
        "users": [{"name": "u", "user": {"token": "t"}}],
        "contexts": [{"name": "c", "context": {"cluster": "k", "user": "u", "namespace": "team-a"}}],
    }))  # fmt: skip


@pytest.fixture
def fake_server() -> Iterator[str]:
    FakeApiServer.seen, FakeApiServer.forbid = [], False
    server = ThreadingHTTPServer(("127.0.0.1", 0), FakeApiServer)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


async def test_the_real_client_sends_the_scale_patch_the_api_server_expects(kubeconfig: Path, fake_server: str) -> None:
    write_kubeconfig(kubeconfig, fake_server)
    async with KubernetesConnector(kube_config="kubeconfig") as connector:
        assert connector.namespace == "team-a"  # the kubeconfig context's
        await connector.scale("decode", 6)
        assert (await connector.replicas())["decode"] == 3
    method, path, content_type, body = FakeApiServer.seen[0]
    assert (method, path, body) == (
        "PATCH",
        "/apis/apps/v1/namespaces/team-a/deployments/meshllm-decode/scale",
        {"spec": {"replicas": 6}},
    )
    assert content_type.startswith("application/strategic-merge-patch+json")
    assert ("GET", "/apis/apps/v1/namespaces/team-a/deployments/meshllm-prefill/scale") in {s[:2] for s in FakeApiServer.seen}


async def test_the_real_client_turns_a_403_status_into_the_readable_error(kubeconfig: Path, fake_server: str) -> None:
    write_kubeconfig(kubeconfig, fake_server)
    FakeApiServer.forbid = True
    async with KubernetesConnector(kube_config="kubeconfig", namespace=NS) as connector:
        with pytest.raises(
            FailedPrecondition, match=r"forbidden to patch deployments/scale meshllm-decode in namespace meshllm: .*User \"u\""
        ):
            await connector.scale("decode", 2)


async def test_the_real_client_with_no_api_server_is_cannot_connect(kubeconfig: Path) -> None:
    write_kubeconfig(kubeconfig, "http://127.0.0.1:1")
    async with KubernetesConnector(kube_config="kubeconfig", request_timeout_s=2.0) as connector:
        with pytest.raises(CannotConnect, match="kubernetes: cannot reach the API server to get deployments/scale"):
            await connector.replicas()
