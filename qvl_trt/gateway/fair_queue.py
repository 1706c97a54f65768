"""The gateway's slots (requests sent on to the deployment at once), shared fairly by tenants.

A request takes a free slot at once while nobody waits; otherwise it waits in its tenant's
queue, up to `places` waiting in all (more: Full, a 429). When a slot frees it goes to the
waiting tenant with the fewest requests in slots, the earliest waiting first among equals,
each tenant's requests in their order: a tenant that floods the gateway holds its own slots
while any other tenant's request is the next to get one. A waiter whose client goes away (its
task cancelled) leaves its place. One event loop: no locks.
"""

from __future__ import annotations

import asyncio
import itertools
from collections import deque


class Full(Exception):
    """Every slot is taken and every waiting place too."""


class FairSlots:
    def __init__(self) -> None:
        self.running: dict[str, int] = {}  # tenant -> requests in slots
        self._queues: dict[str, deque[tuple[int, asyncio.Future]]] = {}
        self._order = itertools.count()

    @property
    def in_slots(self) -> int:
        return sum(self.running.values())

    @property
    def waiting(self) -> int:
        return sum(len(q) for q in self._queues.values())

    async def enter(self, tenant: str, slots: int, places: int) -> None:
        """Take a slot for `tenant`, waiting for one if need be; Full when none is free and
        `places` requests wait already. Pair with `leave`."""
        if self.in_slots < slots and not self.waiting:
            self._take(tenant)
            return
        if self.waiting >= places:
            raise Full
        ticket = asyncio.get_running_loop().create_future()
        self._queues.setdefault(tenant, deque()).append((next(self._order), ticket))
        try:
            await ticket
        except asyncio.CancelledError:
            if ticket.done() and not ticket.cancelled():
                self.leave(tenant, slots)  # the slot came with the cancel: hand it on
            else:
                self._drop(tenant, ticket)
            raise

    def leave(self, tenant: str, slots: int) -> None:
        """`tenant`'s request left its slot: hand free slots to the waiting, fairly."""
        self.running[tenant] -= 1
        if not self.running[tenant]:
            del self.running[tenant]
        while self.in_slots < slots and self._queues:
            chosen = min(self._queues, key=lambda t: (self.running.get(t, 0),
                                                      self._queues[t][0][0]))
            _, ticket = self._queues[chosen].popleft()
            if not self._queues[chosen]:
                del self._queues[chosen]
            if ticket.cancelled():  # its task is being cancelled: it leaves by itself
                continue
            self._take(chosen)
            ticket.set_result(None)

    def _take(self, tenant: str) -> None:
        self.running[tenant] = self.running.get(tenant, 0) + 1

    def _drop(self, tenant: str, ticket: asyncio.Future) -> None:
        queue = self._queues.get(tenant)
        if queue is None:
            return
        self._queues[tenant] = deque(item for item in queue if item[1] is not ticket)
        if not self._queues[tenant]:
            del self._queues[tenant]
