"""grpc.health.v1 as grpcio-health-checking's asyncio servicer serves it, with `List`
too: that servicer leaves it to the generated base, which raises NotImplementedError, so a
client listing the services got UNIMPLEMENTED and the server logged a traceback."""

from __future__ import annotations

from typing import Any

from grpc_health.v1 import health_pb2
from grpc_health.v1.health import aio as health_aio  # type: ignore[attr-defined]

__all__ = ["HealthServicer"]


class HealthServicer(health_aio.HealthServicer):  # type: ignore[misc]
    async def List(self, request: Any, context: Any) -> health_pb2.HealthListResponse:
        """Every service this server has a status for, at this moment."""
        statuses = dict(self._server_status)
        return health_pb2.HealthListResponse(
            statuses={
                name: health_pb2.HealthCheckResponse(status=status)
                for name, status in statuses.items()
            }
        )
