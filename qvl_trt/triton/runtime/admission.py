"""Admission to a build's tensorrt_llm: its batch slots and a bounded queue, shared by every
process that calls it (each instance of postprocessing and of tensorrt_llm_bls is a stub
process of its own).

A build admits max_batch_size + max_queue requests at a time. A request takes one of those
places on arrival (`enter`) and keeps it to its end; when none is free it is refused at once
with a BusyError, which a client sees as "busy: ..." (the gateway's 429). Once its inputs are
made (tensorrt_llm_bls runs preprocessing and the vision encoder first) it waits for one of
the max_batch_size batch slots (`wait`), first come first served within a process (across
processes a free slot goes to whichever process's oldest waiter asks first); past
`max_wait_s` of waiting it is refused the same way. Only requests that hold a slot are sent
to tensorrt_llm, so the engine's own queue stays empty: the stock executor takes up to
max_batch_size requests into its batch and queues the rest where no metric of the backend
shows them, without limit (executorImpl.cpp getLeaderNewReqWithIds takes
mMaxNumActiveRequests - numActiveRequests; the backend's nv_trt_llm_request_metrics
"waiting" is active - scheduled: model_instance_state.cc WaitForStats). Here they wait where
this module counts them (the metrics qvl_llm_requests_waiting, qvl_llm_queue_wait_seconds).

A health probe (contract.HEALTH_PROBE, serve's supervisor) takes the one probe place instead
and no slot: it goes to tensorrt_llm at once and gets the next slot that frees there, so it
answers within about one answer's time however long the queue, and takes no client's place.

The places and slots are lock files (flock) in a folder of /dev/shm named after the
tritonserver whose stubs share it and the tensorrt_llm model: the kernel drops a dead
process's locks, and a restarted server starts with a folder of its own. `serve` removes the
folders of servers that are gone (serve/server.py).
"""

from __future__ import annotations

import fcntl
import math
import os
import tempfile
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from ...errors import BusyError, UnavailableError

if TYPE_CHECKING:  # standard library only at run time: serve imports this module's names
    from ..contract import PostprocessingParameters

# Where the python backend's shared memory is, and these places beside it.
SHM_DIR = Path("/dev/shm")
FOLDER_PREFIX = "qvl-admission-"
# How often the oldest waiter of a process looks for a slot another process freed (a slot
# this process frees wakes it at once). One try is a flock per slot: microseconds.
POLL_S = 0.01
# How often a waiting request asks whether its client went away (a round trip to Triton).
CANCEL_POLL_S = 0.25


def admission_root() -> Path:
    """Where the admission folders are: /dev/shm, or the temporary folder without one."""
    return SHM_DIR if SHM_DIR.is_dir() else Path(tempfile.gettempdir())


def admission_folder(llm_model: str) -> Path:
    """The folder of `llm_model`'s places, shared by the stubs of one tritonserver (their
    parent process)."""
    return admission_root() / f"{FOLDER_PREFIX}{os.getppid()}-{llm_model}"


class _Lock:
    """One place: held by at most one request of all the processes (an exclusive flock);
    `held` says whether a request of this process holds it."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.fd: int | None = None
        self.held = False

    def take(self) -> bool:
        if self.held:
            return False
        if self.fd is None:
            self.fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        try:
            fcntl.flock(self.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return False
        self.held = True
        return True

    def give(self) -> None:
        fcntl.flock(self.fd, fcntl.LOCK_UN)
        self.held = False


@dataclass(eq=False)  # compared by identity
class Ticket:
    """One admitted request: its place (the probe place for a probe) and, once it has one,
    its batch slot."""

    probe: bool
    place: _Lock
    slot: _Lock | None = None
    waited_s: float = 0.0  # how long it waited for its slot


class Admission:
    def __init__(self, folder: Path, *, slots: int, queue: int, max_wait_s: float = 0.0,
                 name: str = "tensorrt_llm", clock: Callable[[], float] = time.monotonic,
                 poll_s: float = POLL_S) -> None:
        """`slots`: tensorrt_llm's max_batch_size; `queue`: requests that may wait for one
        beyond them; `max_wait_s`: how long one may wait (0: as long as it takes); `name`: the
        LLM's, for messages."""
        folder.mkdir(mode=0o700, parents=True, exist_ok=True)
        self.slots, self.queue, self.max_wait_s, self.name = slots, queue, max_wait_s, name
        self._places = [_Lock(folder / f"place-{i}") for i in range(slots + queue)]
        self._slots = [_Lock(folder / f"slot-{i}") for i in range(slots)]
        self._probe = _Lock(folder / "probe")
        self._clock, self._poll_s = clock, poll_s
        self._cond = threading.Condition()
        self._waiting: deque[Ticket] = deque()  # this process's, oldest first
        self._closed = False
        self.running = 0  # this process's requests that hold a slot
        # Called (outside the lock) whenever `waiting` or `running` changed: the metrics.
        self.on_change: Callable[[], None] = lambda: None

    @classmethod
    def of(cls, params: PostprocessingParameters) -> Admission:
        """The admission of the tensorrt_llm a caller's parameters name, in this server."""
        return cls(admission_folder(params.tensorrt_llm_model), slots=params.batch_slots,
                   queue=params.max_queue, max_wait_s=params.max_queue_wait_s,
                   name=params.tensorrt_llm_model)

    @property
    def waiting(self) -> int:
        """This process's requests waiting for a slot."""
        return len(self._waiting)

    def enter(self, *, probe: bool = False) -> Ticket:
        """A place (the probe place for a probe), or a BusyError when none is free."""
        with self._cond:
            self._check_open()
            if probe:
                if self._probe.take():
                    return Ticket(True, self._probe)
                raise BusyError(f"a health probe of {self.name} is already in flight; send "
                                "the next one once it has answered")
            for place in self._places:
                if place.take():
                    return Ticket(False, place)
        raise BusyError(f"{self.name} has {self.slots} batch slots and {self.queue} places in "
                        "its queue (the repository's max_queue), all taken; send the request "
                        "again later")

    def wait(self, ticket: Ticket, cancelled: Callable[[], bool]) -> bool:
        """Wait for a batch slot (a probe needs none). True once `ticket` holds one; False
        when `cancelled()` (its client went away: asked every CANCEL_POLL_S). Raises
        BusyError past max_wait_s, UnavailableError once closing."""
        if ticket.probe:
            return True
        began = self._clock()
        deadline = began + self.max_wait_s if self.max_wait_s > 0 else math.inf
        next_ask = began + CANCEL_POLL_S
        with self._cond:
            self._waiting.append(ticket)
        self.on_change()
        try:
            while True:
                with self._cond:
                    self._check_open()
                    head = self._waiting[0] is ticket
                    if head and (slot := next((s for s in self._slots if s.take()), None)):
                        ticket.slot, ticket.waited_s = slot, self._clock() - began
                        self.running += 1
                        return True
                    now = self._clock()
                    if now >= deadline:
                        raise BusyError(
                            f"no batch slot of {self.name} came free within "
                            f"{self.max_wait_s:g} s (the repository's max_queue_wait); send the "
                            "request again later")
                    self._cond.wait(max(0.0, min(self._poll_s if head else CANCEL_POLL_S,
                                                 deadline - now, next_ask - now)))
                if self._clock() >= next_ask:  # outside the lock: a round trip to Triton
                    if cancelled():
                        return False
                    next_ask = self._clock() + CANCEL_POLL_S
        finally:
            with self._cond:
                self._waiting.remove(ticket)
                self._cond.notify_all()  # a new oldest waiter, or one fewer ahead
            self.on_change()

    def leave(self, ticket: Ticket) -> None:
        """Give back what `ticket` holds: its slot and its place."""
        with self._cond:
            if ticket.slot is not None:
                ticket.slot.give()
                ticket.slot = None
                self.running -= 1
            if ticket.place.held:
                ticket.place.give()
            self._cond.notify_all()  # this process's oldest waiter takes the slot now
        self.on_change()

    def close(self) -> None:
        """Unloading: waiting requests are refused (UnavailableError), new ones too."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()

    def _check_open(self) -> None:
        if self._closed:
            raise UnavailableError(f"{self.name}'s caller is unloading; send the request again "
                                   "once the server is back")
