"""postprocessing's Outbox (qvl_trt/triton/runtime/postprocessing.py): streamed tokens that
arrive while a response is on its way ride in the next one, nothing is sent after close, a
cancelled or failed send stops it, and one sender thread serves every request in turn; the
client's cancel flag is asked at a bounded rate. The served token path (text, counts, cancellation) is tested on a real tritonserver in
test_serve_server.py and test_triton_runtime_tensorrt_llm_bls.py."""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from qvl_trt.triton.runtime.postprocessing import CANCEL_CHECK_S, Outbox, StopTail, _polled

WAIT = 30  # seconds; only reached when something is broken


class GatedSend:
    """A send that blocks until released, recording what it was given and whether two ran
    at once."""

    def __init__(self, answer: bool = True) -> None:
        self.sent: list[list[int]] = []
        self.started = threading.Semaphore(0)
        self.release = threading.Semaphore(0)
        self.answer = answer
        self.running = 0
        self.overlapped = False

    def __call__(self, ids: list[int]) -> bool:
        self.running += 1
        self.overlapped |= self.running > 1
        self.started.release()
        assert self.release.acquire(timeout=WAIT)
        self.sent.append(list(ids))
        self.running -= 1
        return self.answer


@pytest.fixture
def pool():
    pool = ThreadPoolExecutor(max_workers=1)
    yield pool
    pool.shutdown(wait=True)


def test_tokens_put_during_a_send_ride_in_the_next_response(pool) -> None:
    send = GatedSend()
    outbox = Outbox(send, pool)
    outbox.put([1])
    assert send.started.acquire(timeout=WAIT)  # [1] is being sent
    for token in (2, 3, 4):
        outbox.put([token])
    send.release.release()
    assert send.started.acquire(timeout=WAIT)  # one response for all three
    outbox.put([5])
    send.release.release()
    assert send.started.acquire(timeout=WAIT)
    send.release.release()
    assert outbox.close() == []
    assert send.sent == [[1], [2, 3, 4], [5]]
    assert not send.overlapped and not outbox.stopped and outbox.error is None


def test_close_waits_for_the_send_in_flight_and_keeps_the_rest(pool) -> None:
    send = GatedSend()
    outbox = Outbox(send, pool)
    outbox.put([1, 2])
    assert send.started.acquire(timeout=WAIT)
    outbox.put([3])
    closed: list[list[int]] = []
    closer = threading.Thread(target=lambda: closed.append(outbox.close()))
    closer.start()
    closer.join(timeout=0.2)
    assert closer.is_alive(), "close returned while a send was in flight"
    send.release.release()
    closer.join(timeout=WAIT)
    # [3] waited for the final response; nothing is sent once closed.
    assert closed == [[3]] and send.sent == [[1, 2]]
    outbox.put([4])
    assert send.sent == [[1, 2]]


def test_a_send_that_answers_false_stops_the_outbox(pool) -> None:
    send = GatedSend(answer=False)  # the client has cancelled
    outbox = Outbox(send, pool)
    outbox.put([1])
    assert send.started.acquire(timeout=WAIT)
    outbox.put([2])
    send.release.release()
    assert outbox.close() == [2]
    assert outbox.stopped and send.sent == [[1]]


def test_a_failing_send_is_kept_for_the_request_to_raise(pool) -> None:
    def send(ids: list[int]) -> bool:
        raise RuntimeError("the response could not be sent")

    outbox = Outbox(send, pool)
    outbox.put([1])
    outbox.close()
    assert isinstance(outbox.error, RuntimeError)


def test_without_send_every_token_waits_for_the_final_response(pool) -> None:
    outbox = Outbox(None, pool)
    for token in range(5):
        outbox.put([token])
    assert outbox.close() == [0, 1, 2, 3, 4]


def test_one_sender_thread_serves_requests_in_turn(pool) -> None:
    """A request whose tokens keep coming does not hold the only sender: after each of its
    responses it queues behind the others."""
    busy, quiet = GatedSend(), GatedSend()
    a, b = Outbox(busy, pool), Outbox(quiet, pool)
    a.put([1])
    assert busy.started.acquire(timeout=WAIT)
    a.put([2])  # waiting for a's next turn
    b.put([10])  # queued behind a's running send
    busy.release.release()
    assert quiet.started.acquire(timeout=WAIT), "b waited for a to run dry"
    assert busy.sent == [[1]]
    quiet.release.release()
    assert busy.started.acquire(timeout=WAIT)
    busy.release.release()
    assert a.close() == [] and b.close() == []
    assert busy.sent == [[1], [2]] and quiet.sent == [[10]]


def test_a_pool_already_shut_down_leaves_the_tokens_for_close() -> None:
    """At unload: no drain can be queued; close() must not wait for one."""
    pool = ThreadPoolExecutor(max_workers=1)
    pool.shutdown()
    outbox = Outbox(GatedSend(), pool)
    outbox.put([1, 2])
    assert outbox.close() == [1, 2]


def test_the_cancel_flag_is_asked_at_most_every_period_and_stays_true(monkeypatch) -> None:
    """Each ask is a round trip to Triton: between asks the last answer holds, and once the
    client has cancelled it is not asked again (the clock is the test's)."""
    now = [0.0]
    monkeypatch.setattr(time, "monotonic", lambda: now[0])
    asked: list[float] = []

    def is_cancelled() -> bool:
        asked.append(now[0])
        return len(asked) > 1  # cancelled from the second ask on

    cancelled = _polled(is_cancelled)
    seen = []
    for step in range(12):  # a token every quarter period, for three periods
        now[0] = 10 + step * CANCEL_CHECK_S / 4
        seen.append(cancelled())
    assert asked == [10, 10 + CANCEL_CHECK_S]
    assert seen == [False] * 4 + [True] * 8


# ---- the end of the answer: a final stop word cut off, the finish reason ---------------------

def test_a_stop_word_is_held_back_while_it_may_begin_and_cut_at_the_end() -> None:
    tail = StopTail([[7, 8, 9], [5, 5]], max_tokens=100)
    sent = [tail.push(ids) for ids in ([1, 2], [7], [8], [3, 7], [8])]
    # 7, 8 wait until 3 shows they are no stop word; never a token of the final one is sent.
    assert sent == [[1, 2], [], [], [7, 8, 3], []]
    assert tail.finish([9]) == [] and tail.stopped
    assert tail.generated == 8 and tail.finish_reason() == "stop"
    tail = StopTail([[7, 8, 9]], max_tokens=100)
    assert tail.push([1, 7]) == [1] and tail.finish([8]) == [7, 8]  # no stop word: all of it
    assert not tail.stopped
    assert StopTail([], max_tokens=3).push([4]) == [4]
    one = StopTail([[5]], max_tokens=100)  # a one-token stop word holds back only itself
    assert one.push([1, 2]) == [1, 2] and one.push([5]) == [] and one.finish([]) == []


@pytest.mark.parametrize("ids, words, limit, want", [
    ([1] * 7, [], 8, "stop"),  # the end token came first (it is not counted)
    ([1] * 8, [], 8, "length"),
    ([1] * 7 + [5], [[5]], 8, "stop"),  # the stop word completed on the last allowed token
])
def test_the_finish_reason(ids: list[int], words: list[list[int]], limit: int,
                           want: str) -> None:
    tail = StopTail(words, max_tokens=limit)
    tail.finish(ids)
    assert tail.generated == len(ids) and tail.finish_reason() == want
