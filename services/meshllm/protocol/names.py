"""Names on the planes: etcd keys and NATS subjects (ARCHITECTURE §2)."""

from __future__ import annotations

from urllib.parse import quote

__all__ = [
    "instance_key",
    "instances_prefix",
    "kv_subject",
    "load_subject",
    "model_key",
    "models_prefix",
    "planner_key",
    "router_subject",
]

ROOT = "meshllm/v1"


def instances_prefix(namespace: str, component: str | None = None, endpoint: str | None = None) -> str:
    """Prefix of instance keys, narrowed to a component and endpoint when given."""
    p = f"{ROOT}/{namespace}/instances/"
    if component is not None:
        p += f"{component}/"
        if endpoint is not None:
            p += f"{endpoint}/"
    return p


def instance_key(namespace: str, component: str, endpoint: str, instance_id: str) -> str:
    return f"{instances_prefix(namespace, component, endpoint)}{instance_id}"


def models_prefix(namespace: str, model: str | None = None) -> str:
    """Prefix of model card keys, narrowed to one model when given."""
    p = f"{ROOT}/{namespace}/models/"
    # Model names may hold "/" (org/name): quote them into one key segment.
    return p if model is None else f"{p}{quote(model, safe='')}/"


def model_key(namespace: str, model: str, instance_id: str) -> str:
    return f"{models_prefix(namespace, model)}{instance_id}"


def planner_key(namespace: str, name: str) -> str:
    """The planner's keys: "leader" (lease-bound, the elected planner) and "state" (its profile and decisions)."""
    return f"{ROOT}/{namespace}/planner/{name}"


def kv_subject(namespace: str, component: str) -> str:
    """NATS subject of KvEventBatch messages."""
    return f"meshllm.{namespace}.kv.{component}"


def load_subject(namespace: str, component: str) -> str:
    """NATS subject of LoadSnapshot messages."""
    return f"meshllm.{namespace}.load.{component}"


def router_subject(namespace: str, component: str) -> str:
    """NATS subject of the RouterSyncBatch messages router replicas share."""
    return f"meshllm.{namespace}.router.{component}"
