"""What one served request settles when it ends, however it ends: the gateway admission (limits,
quotas, audit, with the tokens really produced) and then the request's trace. Run through
http/settlement.py's Settlement, so it happens exactly once."""

from __future__ import annotations

from dataclasses import dataclass

from ferrylm.gateway.policy import Admission
from ferrylm.server import gatekeeping
from ferrylm.server.fanout import Fanout
from ferrylm.server.request_trace import RequestTrace
from ferrylm.server.state import ServerState


@dataclass
class RequestEnd:
    """The settlement callback of one request; `fanout` is set once the engine took the request
    (None: refused before any engine work, nothing billed)."""

    state: ServerState
    admission: Admission | None
    trace: RequestTrace | None
    started: float
    fanout: Fanout | None = None

    async def __call__(self, status: int) -> None:
        await gatekeeping.finish(self.state, self.admission, status, self.fanout, self.started)
        if self.trace is not None:
            self.trace.end(status, self.fanout)
