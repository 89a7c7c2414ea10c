"""Kubernetes Events about an LLMDeployment, posted through the operator's own API client.

The reconciler and the autoscaler post their decisions and errors here, from kopf's handler
threads and from the operator's periodic task alike (kopf's own ``kopf.event`` works only
inside a kopf handler). An Event that cannot be posted is logged, never raised: it must not
fail the reconcile it describes.
"""

from __future__ import annotations

import dataclasses
import datetime
import logging
import os
import socket
from typing import Any

from kvpilot.operator.apply import KubeApiError, KubeClient

logger = logging.getLogger("kvpilot.operator.events")

COMPONENT = "kvpilot-operator"
MAX_MESSAGE = 1024
"""Characters of a message kept (the API server refuses longer ones)."""


@dataclasses.dataclass(frozen=True)
class Event:
    """A Kubernetes Event to post about the LLMDeployment (``type`` Normal or Warning)."""

    type: str
    reason: str
    message: str


def event_object(obj: dict[str, Any], event: Event, now: datetime.datetime) -> dict[str, Any]:
    """The core/v1 Event about ``obj`` (an object with apiVersion, kind and metadata) (pure)."""
    meta = obj["metadata"]
    stamp = now.astimezone(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
    return {
        "apiVersion": "v1",
        "kind": "Event",
        "metadata": {"generateName": f"{meta['name']}.", "namespace": meta["namespace"]},
        "involvedObject": {
            "apiVersion": obj.get("apiVersion"),
            "kind": obj.get("kind"),
            "name": meta["name"],
            "namespace": meta["namespace"],
            "uid": meta.get("uid"),
            "resourceVersion": meta.get("resourceVersion"),
        },
        "type": event.type,
        "reason": event.reason,
        "message": event.message[:MAX_MESSAGE],
        "source": {"component": COMPONENT},
        "reportingComponent": COMPONENT,
        "reportingInstance": os.environ.get("HOSTNAME") or socket.gethostname(),
        "firstTimestamp": stamp,
        "lastTimestamp": stamp,
        "count": 1,
    }


class EventSink:
    """Posts Events with ``client`` (``post`` is the runtime's ``post_event``)."""

    def __init__(self, client: KubeClient) -> None:
        self.client = client

    def post(self, obj: dict[str, Any], event: Event) -> None:
        """Create the Event; a refusal or an outage is logged and dropped."""
        body = event_object(obj, event, datetime.datetime.now(datetime.UTC))
        try:
            self.client.request(
                "POST", f"/api/v1/namespaces/{body['metadata']['namespace']}/events", body
            )
        except (KubeApiError, OSError, Exception) as exc:  # noqa: BLE001 - never fail the caller
            logger.warning(
                "event %s for %s/%s not posted: %s",
                event.reason,
                body["metadata"]["namespace"],
                obj["metadata"]["name"],
                exc,
            )
