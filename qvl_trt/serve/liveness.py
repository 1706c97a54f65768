"""Busy or dead: what the supervisor concludes from its end-to-end probes and from the
progress the server reports. Standard library only (the CLI reads the defaults here).

A probe is a one-token text request through each ensemble (supervisor.probe) with the
health_probe flag: it does not queue behind other requests for a batch slot but takes the
next one that frees (triton/runtime/admission.py), so on a saturated server it waits at
most about one answer. Its outcome:
- answered: the server serves; readiness turns (or stays) true;
- refused as busy (every place taken, another probe in flight): no verdict, nothing changes;
- an error (connection refused, a model that is not healthy): a failure; `probe_failures`
  in a row are a fault, and readiness is false from the first until a probe answers again;
- still waiting: busy while the server makes progress (serve/progress.py: an iteration of a
  tensorrt_llm model, a request finished by any model); a fault once it has waited
  `stall_timeout_s` with no progress at all since it was sent (a wedged engine or model: a
  stub alive but answering nothing, an idle server whose probe never returns), and a fault
  whatever the progress once it has waited `probe_deadline_s` (a model that hangs the
  requests it holds while others go on).
Readiness stays true while the server is busy: a pod that reports not-ready when it is merely
full moves its load onto the others, which then fill up in turn.

`Liveness` holds no clock and does no I/O: it is fed events with their times, so its rules
are tested with hand-made timestamps.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from ..errors import ConfigError


@dataclass(frozen=True)
class LivenessRules:
    """`qvl-trt serve`'s --probe-interval, --stall-timeout and --probe-deadline."""

    probe_interval_s: float = 5.0  # from one probe's answer to the next probe
    stall_timeout_s: float = 60.0
    probe_deadline_s: float = 900.0
    probe_failures: int = 2

    def __post_init__(self) -> None:
        for name in ("probe_interval_s", "stall_timeout_s", "probe_deadline_s"):
            if not getattr(self, name) > 0:
                raise ConfigError(f"--{name.removesuffix('_s').replace('_', '-')} "
                                  f"{getattr(self, name)} must be a positive number of seconds")
        if self.probe_deadline_s < self.stall_timeout_s:
            raise ConfigError(f"--probe-deadline {self.probe_deadline_s:g} is below "
                              f"--stall-timeout {self.stall_timeout_s:g}; raise it")
        if self.probe_failures < 1:
            raise ConfigError(f"probe_failures {self.probe_failures} must be at least 1")


class Outcome(enum.Enum):
    ANSWERED = "answered"
    BUSY = "busy"  # refused because the build is full: says nothing about liveness
    FAILED = "failed"


class Liveness:
    def __init__(self, rules: LivenessRules, now: float) -> None:
        self.rules = rules
        self.restarted(now)

    def restarted(self, now: float) -> None:
        """A (re)started server: nothing known of it until its first probe answers."""
        self.answered = False  # a probe answered since the start
        self.failures = 0  # probe failures in a row
        self.error = ""  # the last failure's
        self.pending_since: float | None = None  # the probe in flight, sent then
        self.last_progress = now
        self._progress: tuple[float, ...] | None = None

    def progress(self, counters: tuple[float, ...] | None, now: float) -> None:
        """The server's progress counters as read now (None: not readable). The first reading
        after a probe went out starts the stall clock; each change restarts it."""
        if counters is not None and counters != self._progress:
            self.last_progress = now
            self._progress = counters

    def probe_sent(self, now: float) -> None:
        """A probe went out: the stall clock runs from the next reading on."""
        self.pending_since = now
        self._progress = None

    def probe_done(self, outcome: Outcome, now: float, error: str = "") -> None:
        self.pending_since = None
        if outcome is Outcome.ANSWERED:
            self.answered, self.failures, self.error = True, 0, ""
        elif outcome is Outcome.FAILED:
            self.failures += 1
            self.error = error

    def fault(self, now: float) -> str | None:
        """Why the server must be restarted now, or None."""
        if self.failures >= self.rules.probe_failures:
            return f"the end-to-end probe failed {self.failures} times in a row ({self.error})"
        if self.pending_since is None:
            return None
        waited = now - self.pending_since
        if waited >= self.rules.probe_deadline_s:
            return (f"the end-to-end probe has waited {waited:.0f} s (--probe-deadline "
                    f"{self.rules.probe_deadline_s:g}) while requests went on: a model holds "
                    "the requests it has")
        still = now - max(self.pending_since, self.last_progress)
        if still >= self.rules.stall_timeout_s:
            return (f"the end-to-end probe has waited {waited:.0f} s and the server made no "
                    f"progress for {still:.0f} s (--stall-timeout "
                    f"{self.rules.stall_timeout_s:g}): no tensorrt_llm iteration, no request "
                    "finished")
        return None

    def readiness(self) -> tuple[bool, str]:
        """(ready, reason): ready once a probe answered, until one fails; busy is ready."""
        if self.failures:
            return False, f"probe failed: {self.error}"
        if not self.answered:
            return False, "first probe pending"
        return True, ""

    def busy(self, now: float) -> bool:
        """The probe in flight has waited longer than a probe on an idle server takes (its
        interval): the server is busy, not dead, while it progresses."""
        return self.pending_since is not None and \
            now - self.pending_since > self.rules.probe_interval_s
