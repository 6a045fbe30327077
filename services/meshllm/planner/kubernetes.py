"""The Kubernetes connector: scales the worker Deployments through the scale subresource (docs/planner-kubernetes.md).

    connector = KubernetesConnector(namespace="meshllm")          # in a pod: its service account, its namespace
    await connector.scale("decode", 4)                             # PATCH deployments/scale meshllm-decode
    await connector.replicas()                                     # {"prefill": 1, "decode": 4}

The official client (`pip install 'meshllm[kubernetes]'`) is synchronous: every call runs in a thread. It is
imported when a connector is built, so the planner runs without it on other connectors.

`replicas()` reports each Deployment's `spec.replicas`, the count the planner asked for. A pod that Kubernetes
is stopping (Terminating: SIGTERM sent, the worker draining) no longer counts there, which is what the
`Connector` contract wants ("draining ones not counted"); pods still starting do count, as they do on every
connector. `ready()` reads `status.readyReplicas` for the ones serving already.

Scaling down drains because Kubernetes sends the worker SIGTERM and the worker drains on it (unregister, grace
period, in-flight requests up to `--drain-timeout`, then the rest stopped for the router to migrate); the
Deployments' `terminationGracePeriodSeconds` must outlast that (deploy/k8s/worker-*.yaml). The Deployment
controller picks which pods go; this connector does not steer it (no `controller.kubernetes.io/pod-deletion-cost`).
"""

from __future__ import annotations

import asyncio
import importlib
import json
import logging
import os
from collections.abc import Callable, Mapping
from pathlib import Path
from types import ModuleType
from typing import Any, TypeVar

from meshllm.errors import CannotConnect, ConfigError, FailedPrecondition, InvalidArgument, MeshError, NotFound, Unavailable
from meshllm.planner.model import ROLES, Connector

__all__ = ["DEFAULT_DEPLOYMENTS", "KUBE_CONFIG_MODES", "KubernetesConnector"]

log = logging.getLogger(__name__)

T = TypeVar("T")

#: role -> worker Deployment, as deploy/k8s/worker-prefill.yaml and worker-decode.yaml name them.
DEFAULT_DEPLOYMENTS: Mapping[str, str] = {"prefill": "meshllm-prefill", "decode": "meshllm-decode"}
KUBE_CONFIG_MODES = ("auto", "incluster", "kubeconfig")
INSTALL_HINT = "pip install 'meshllm[kubernetes]'"
SERVICE_ACCOUNT_NAMESPACE = Path("/var/run/secrets/kubernetes.io/serviceaccount/namespace")
RBAC_HINT = "check the planner's Role and RoleBinding (deploy/k8s/planner.yaml)"


def _import_kubernetes() -> ModuleType:
    try:
        return importlib.import_module("kubernetes")
    except ImportError as exc:
        raise ConfigError(f"the kubernetes connector needs the kubernetes package ({exc}): {INSTALL_HINT}") from None


class KubernetesConnector(Connector):
    """Sets the replicas of one Deployment per role in one namespace.

    `api` stands in for `kubernetes.client.AppsV1Api` (tests); without it the connector loads the configuration
    `kube_config` names: `incluster` (the pod's service account), `kubeconfig` (`$KUBECONFIG` or ~/.kube/config,
    its current context) or `auto` (in-cluster when running in a pod, else kubeconfig). `namespace` defaults to
    the pod's own (in-cluster) or the kubeconfig context's, else `default`. `deployments` maps the roles the
    planner scales, and only those: `replicas()` reads every one.
    """

    kind = "kubernetes"

    def __init__(
        self,
        *,
        namespace: str | None = None,
        deployments: Mapping[str, str] = DEFAULT_DEPLOYMENTS,
        kube_config: str = "auto",
        api: Any | None = None,
        request_timeout_s: float = 10.0,
    ) -> None:
        if unknown := set(deployments) - set(ROLES):
            raise ConfigError(f"kubernetes: unknown role {', '.join(sorted(unknown))}; roles are {', '.join(ROLES)}")
        if kube_config not in KUBE_CONFIG_MODES:
            raise ConfigError(f"kubernetes: --kube-config {kube_config!r}: choose from {', '.join(KUBE_CONFIG_MODES)}")
        k8s = _import_kubernetes()
        self._api_exception: type[Exception] = k8s.client.exceptions.ApiException
        self._connection_errors = _connection_errors()
        self.deployments = dict(deployments)
        self.request_timeout_s = request_timeout_s
        self._owns_api = api is None
        if api is None:
            mode = _resolve_mode(kube_config)
            api = k8s.client.AppsV1Api(_api_client(k8s, mode))
            namespace = namespace or _default_namespace(k8s, mode)
        self.api = api
        self.namespace = namespace or "default"

    def deployment(self, role: str) -> str:
        """The Deployment of `role`; InvalidArgument for a role this connector has none for."""
        try:
            return self.deployments[role]
        except KeyError:
            known = ", ".join(f"{r}={d}" for r, d in sorted(self.deployments.items())) or "none"
            raise InvalidArgument(
                f"kubernetes: no Deployment for role {role!r} in namespace {self.namespace} (known: {known})"
            ) from None

    async def replicas(self) -> dict[str, int]:
        roles = list(self.deployments)
        scales = await asyncio.gather(*(self._read_scale(r) for r in roles))
        return dict(zip(roles, scales, strict=True))

    async def ready(self) -> dict[str, int]:
        """Ready pods of each role's Deployment (`status.readyReplicas`): started and passing their readiness probe."""
        roles = list(self.deployments)
        found = await asyncio.gather(*(self._read_ready(r) for r in roles))
        return dict(zip(roles, found, strict=True))

    async def scale(self, role: str, replicas: int, *, busy: Mapping[str, int] | None = None) -> None:
        del busy  # the ReplicaSet controller chooses which pods go
        if replicas < 0:
            raise InvalidArgument(f"kubernetes: replicas must be >= 0, got {replicas} for role {role!r}")
        name = self.deployment(role)
        body = {"spec": {"replicas": replicas}}
        for attempt in (1, 2):
            try:
                await self._call("patch", "deployments/scale", name, self.api.patch_namespaced_deployment_scale, body=body)
                break
            except _Conflict as conflict:
                if attempt == 2:
                    raise
                log.info("%s; retrying once", conflict)
        log.info("kubernetes: deployments/scale %s in namespace %s set to %d replicas", name, self.namespace, replicas)

    async def _read_scale(self, role: str) -> int:
        name = self.deployment(role)
        scale = await self._call("get", "deployments/scale", name, self.api.read_namespaced_deployment_scale)
        return int((scale.spec.replicas if scale.spec is not None else None) or 0)

    async def _read_ready(self, role: str) -> int:
        name = self.deployment(role)
        found = await self._call("get", "deployments", name, self.api.read_namespaced_deployment)
        return int((found.status.ready_replicas if found.status is not None else None) or 0)

    async def _call(self, verb: str, resource: str, name: str, method: Callable[..., T], **kwargs: Any) -> T:
        """`method(name, namespace, **kwargs)` in a thread, its errors as MeshErrors (a 409 as `_Conflict`)."""
        what = f"{verb} {resource} {name} in namespace {self.namespace}"
        try:
            return await asyncio.to_thread(method, name, self.namespace, _request_timeout=self.request_timeout_s, **kwargs)
        except self._api_exception as exc:
            raise _api_error(what, exc) from exc
        except self._connection_errors as exc:
            raise CannotConnect(f"kubernetes: cannot reach the API server to {what}: {exc}") from exc

    async def _aclose(self) -> None:
        client = getattr(self.api, "api_client", None)
        if self._owns_api and client is not None:
            await asyncio.to_thread(client.close)


class _Conflict(Unavailable):
    """A 409 from the API server: the object changed under the request (`scale` retries it once)."""


def _api_error(what: str, exc: Any) -> MeshError:
    status = int(getattr(exc, "status", 0) or 0)
    said = _server_message(exc)
    if status == 401:
        return FailedPrecondition(
            f"kubernetes: unauthorized to {what}: check the service account token or kubeconfig credentials ({said})"
        )
    if status == 403:
        return FailedPrecondition(f"kubernetes: forbidden to {what}: {RBAC_HINT} ({said})")
    if status == 404:
        return NotFound(f"kubernetes: not found: {what}: apply deploy/k8s/worker-*.yaml or name the Deployment ({said})")
    if status == 409:
        return _Conflict(f"kubernetes: conflict on {what} ({said})")
    if status in (400, 422):
        return InvalidArgument(f"kubernetes: the API server refused to {what} ({said})")
    if status == 0:
        return CannotConnect(f"kubernetes: cannot reach the API server to {what} ({said})")
    return Unavailable(f"kubernetes: HTTP {status} on {what} ({said})")


def _server_message(exc: Any) -> str:
    """The API server's Status message when the body carries one, else the HTTP reason."""
    try:
        message = json.loads(exc.body or "").get("message")
    except (ValueError, AttributeError):
        message = None
    return str(message or getattr(exc, "reason", None) or "no reason given").strip()


def _connection_errors() -> tuple[type[Exception], ...]:
    # urllib3 comes with the kubernetes client; its errors (MaxRetryError, timeouts) are not OSErrors.
    try:
        urllib3 = importlib.import_module("urllib3")
    except ImportError:
        return (OSError,)
    return (OSError, urllib3.exceptions.HTTPError)


def _resolve_mode(kube_config: str) -> str:
    if kube_config != "auto":
        return kube_config
    return "incluster" if os.environ.get("KUBERNETES_SERVICE_HOST") else "kubeconfig"


def _api_client(k8s: ModuleType, mode: str) -> Any:
    """An ApiClient of its own Configuration (the client's global default stays untouched)."""
    configuration = k8s.client.Configuration()
    try:
        if mode == "incluster":
            k8s.config.load_incluster_config(client_configuration=configuration)
        else:
            k8s.config.load_kube_config(client_configuration=configuration, persist_config=False)
    except (k8s.config.ConfigException, OSError) as exc:
        where = "in-cluster (the pod's service account)" if mode == "incluster" else "kubeconfig"
        raise ConfigError(f"kubernetes: cannot load the {where} configuration: {exc}") from None
    return k8s.client.ApiClient(configuration)


def _default_namespace(k8s: ModuleType, mode: str) -> str | None:
    if mode == "incluster":
        try:
            return SERVICE_ACCOUNT_NAMESPACE.read_text().strip() or None
        except OSError:
            return None
    try:
        _, current = k8s.config.list_kube_config_contexts()
    except (k8s.config.ConfigException, OSError):
        return None
    namespace = (current or {}).get("context", {}).get("namespace")
    return str(namespace) if namespace else None
