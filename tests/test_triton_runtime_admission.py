"""Admission to a build's tensorrt_llm (qvl_trt/triton/runtime/admission.py): batch slots
plus a bounded queue, exactly, shared by every process that calls it (a second process's
requests take the same places, and a killed one's come back); first come first served for a
slot; refusals past the queue and past the wait bound; a probe bypasses the queue; closing
refuses the waiting. Outcomes only: no assertion on how long anything took."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest

from qvl_trt.errors import BusyError, UnavailableError
from qvl_trt.triton.runtime.admission import Admission

WAIT = 30  # seconds; only reached when something is broken


def never() -> bool:
    return False


def until(condition) -> None:
    deadline = time.monotonic() + WAIT
    while not condition():
        assert time.monotonic() < deadline, "never happened"
        time.sleep(0.005)


def admitted(admission: Admission, n: int) -> list:
    """`n` requests that entered and hold a slot."""
    tickets = [admission.enter() for _ in range(n)]
    for ticket in tickets:
        assert admission.wait(ticket, never)
    return tickets


def test_slots_plus_queue_are_admitted_and_no_more(tmp_path: Path) -> None:
    admission = Admission(tmp_path, slots=2, queue=1, name="b_tensorrt_llm")
    running = admitted(admission, 2)
    queued = admission.enter()  # waits for a slot: the third place
    with pytest.raises(BusyError) as refused:
        admission.enter()
    assert str(refused.value) == ("b_tensorrt_llm has 2 batch slots and 1 places in its queue "
                                  "(the repository's max_queue), all taken; send the request "
                                  "again later")
    admission.leave(running[0])
    assert admission.wait(queued, never)
    assert admission.running == 2 and admission.waiting == 0
    for ticket in (running[1], queued):
        admission.leave(ticket)
    admitted(admission, 2)  # every place came back


def test_without_a_queue_the_slots_are_admitted(tmp_path: Path) -> None:
    admission = Admission(tmp_path, slots=2, queue=0)
    first, second = admission.enter(), admission.enter()  # both before either waits
    assert admission.wait(first, never) and admission.wait(second, never)
    with pytest.raises(BusyError):
        admission.enter()


def test_slots_go_first_come_first_served(tmp_path: Path) -> None:
    admission = Admission(tmp_path, slots=1, queue=3)
    (running,) = admitted(admission, 1)
    order: list[int] = []

    def wait(n: int, ticket) -> None:
        assert admission.wait(ticket, never)
        order.append(n)
        admission.leave(ticket)  # hands the slot on to the next

    threads = []
    for n in range(3):
        ticket = admission.enter()
        threads.append(threading.Thread(target=wait, args=(n, ticket)))
        threads[-1].start()
        until(lambda n=n: admission.waiting == n + 1)  # the next one queues behind it
    admission.leave(running)
    for thread in threads:
        thread.join(timeout=WAIT)
    assert order == [0, 1, 2]


def test_a_wait_past_the_bound_is_refused_and_gives_its_place_back(tmp_path: Path) -> None:
    admission = Admission(tmp_path, slots=1, queue=1, max_wait_s=0.05, name="llm")
    admitted(admission, 1)
    ticket = admission.enter()
    with pytest.raises(BusyError, match="no batch slot of llm came free within 0.05 s"):
        admission.wait(ticket, never)
    assert admission.waiting == 0
    admission.leave(ticket)
    admission.enter()  # its place is free again


def test_a_client_that_goes_away_leaves_the_queue(tmp_path: Path) -> None:
    admission = Admission(tmp_path, slots=1, queue=1)
    admitted(admission, 1)
    ticket = admission.enter()
    assert not admission.wait(ticket, lambda: True)
    assert admission.waiting == 0
    admission.leave(ticket)


def test_a_probe_takes_no_place_and_no_slot_and_one_at_a_time(tmp_path: Path) -> None:
    admission = Admission(tmp_path, slots=1, queue=0)
    admitted(admission, 1)
    probe = admission.enter(probe=True)  # though every place is taken
    assert admission.wait(probe, never) and probe.slot is None
    with pytest.raises(BusyError, match="a health probe of tensorrt_llm is already in flight"):
        admission.enter(probe=True)
    admission.leave(probe)
    admission.leave(admission.enter(probe=True))


def test_closing_refuses_the_waiting_and_the_new(tmp_path: Path) -> None:
    admission = Admission(tmp_path, slots=1, queue=1)
    admitted(admission, 1)
    ticket = admission.enter()
    errors: list[BaseException] = []

    def wait() -> None:
        try:
            admission.wait(ticket, never)
        except UnavailableError as exc:
            errors.append(exc)

    thread = threading.Thread(target=wait)
    thread.start()
    admission.close()
    thread.join(timeout=WAIT)
    assert len(errors) == 1 and "unloading" in str(errors[0])
    with pytest.raises(UnavailableError):
        admission.enter()


HOLDER = textwrap.dedent("""
    import sys, time
    from pathlib import Path
    from qvl_trt.triton.runtime.admission import Admission
    admission = Admission(Path(sys.argv[1]), slots=2, queue=1)
    tickets = [admission.enter() for _ in range(2)]
    for ticket in tickets:
        assert admission.wait(ticket, lambda: False)
    admission.enter()  # queued
    print("holding", flush=True)
    time.sleep(600)
""")


def test_places_are_shared_across_processes_and_a_dead_ones_come_back(tmp_path: Path) -> None:
    """Another instance's stub holds every slot and the queue's place: this process is
    refused; once that process is killed (a stub that died), its places are free."""
    holder = subprocess.Popen([sys.executable, "-c", HOLDER, str(tmp_path)],
                              stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline() == "holding\n"
        admission = Admission(tmp_path, slots=2, queue=1)
        with pytest.raises(BusyError):
            admission.enter()
        probe = admission.enter(probe=True)  # the probe place is not the holder's
        admission.leave(probe)
    finally:
        holder.kill()
        holder.wait(timeout=WAIT)
    admitted(admission, 2)
    admission.enter()
