"""``GET /stats``: the service's counters and configuration as JSON."""

from __future__ import annotations

import json
from collections.abc import Callable

from twisted.web.resource import IResource, Resource
from twisted.web.server import Site

__all__ = ["stats_site"]


class _JSONResource(Resource):
    isLeaf = True

    def __init__(self, produce: Callable[[], dict]) -> None:
        super().__init__()
        self._produce = produce

    def render_GET(self, request) -> bytes:
        request.setHeader(b"content-type", b"application/json")
        return json.dumps(self._produce(), indent=2).encode() + b"\n"


def stats_site(produce: Callable[[], dict], metrics: IResource | None = None) -> Site:
    """A site serving ``produce()`` at ``/stats``, ``metrics`` (see
    sdexec/metrics.py) at ``/metrics``, and a 404 elsewhere."""
    root = Resource()
    root.putChild(b"stats", _JSONResource(produce))
    if metrics is not None:
        root.putChild(b"metrics", metrics)
    return Site(root)
