"""A gRPC health-service stub for the clients' wait_for_serving."""

from __future__ import annotations

from grpc_health.v1 import health_pb2


class HealthStub:
    """Answers ``Check`` with ``statuses`` in turn (the last one for good); counts calls."""

    def __init__(self, *statuses: int) -> None:
        self.statuses = list(statuses)
        self.calls = 0

    def Check(self, request, timeout=None):
        self.calls += 1
        status = self.statuses[min(self.calls, len(self.statuses)) - 1]
        return health_pb2.HealthCheckResponse(status=status)
