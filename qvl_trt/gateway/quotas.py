"""Per-tenant quotas (tenants.Quotas): requests and tokens per minute as token buckets, and
requests in flight. A request past one gets QuotaExceeded, which names the limit and when to
retry; a tenant's refusals never touch another tenant's buckets.

Tokens are prompt + completion tokens, known only as the answer comes: a request is admitted
while its tenant's token bucket is not empty (its prompt is counted as 0 tokens before its
answer starts, as the deployment alone can count visual tokens), and its tokens are taken
from the bucket once its answer ends (a cut-short answer: the tokens made so far). A tenant
can so overdraw by one answer per stream; its debt refuses its requests until the bucket has
refilled past 0.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass

from .tenants import Quotas


@dataclass(frozen=True)
class QuotaExceeded(Exception):
    limit: str  # the Quotas field
    value: int
    retry_after_s: float

    def __str__(self) -> str:
        return f"{self.limit} of {self.value}"


class TokenBucket:
    """`per_minute` units, refilled continuously; starts full."""

    def __init__(self, per_minute: int, now: float) -> None:
        self.per_minute = per_minute
        self.level = float(per_minute)
        self._at = now

    def refill(self, now: float) -> None:
        self.level = min(self.per_minute, self.level + (now - self._at) * self.per_minute / 60)
        self._at = now

    def seconds_until(self, level: float) -> float:
        return max(0.0, (level - self.level) * 60 / self.per_minute)


class TenantQuota:
    """One tenant's buckets and streams; `clock`: seconds (time.monotonic)."""

    def __init__(self, quotas: Quotas, clock: Callable[[], float] = time.monotonic) -> None:
        self.clock = clock
        self.streams = 0
        self.quotas = Quotas()
        self.requests: TokenBucket | None = None
        self.tokens: TokenBucket | None = None
        self.update(quotas)

    def update(self, quotas: Quotas) -> None:
        """New limits (a reloaded keys file); a bucket whose limit stays keeps its level."""
        now = self.clock()

        def bucket(old: TokenBucket | None, per_minute: int | None) -> TokenBucket | None:
            if per_minute is None:
                return None
            if old is not None and old.per_minute == per_minute:
                return old
            return TokenBucket(per_minute, now)

        self.requests = bucket(self.requests, quotas.requests_per_minute)
        self.tokens = bucket(self.tokens, quotas.tokens_per_minute)
        self.quotas = quotas

    def admit(self) -> None:
        """Count a new request in, or raise QuotaExceeded: its streams at max_streams, no
        request left this minute, or the token bucket at or below 0."""
        now, q = self.clock(), self.quotas
        if q.max_streams is not None and self.streams >= q.max_streams:
            raise QuotaExceeded("max_streams", q.max_streams, 1.0)
        for bucket in (self.requests, self.tokens):
            if bucket is not None:
                bucket.refill(now)
        if self.requests is not None and self.requests.level < 1:
            raise QuotaExceeded("requests_per_minute", self.requests.per_minute,
                                self.requests.seconds_until(1))
        if self.tokens is not None and self.tokens.level <= 0:
            # Past 0 by one token's refill: the next admission finds it positive.
            raise QuotaExceeded("tokens_per_minute", self.tokens.per_minute,
                                self.tokens.seconds_until(0) + 60 / self.tokens.per_minute)
        if self.requests is not None:
            self.requests.level -= 1
        self.streams += 1

    def release(self, tokens: int) -> None:
        """The request ended, having used `tokens` (prompt + completion)."""
        self.streams -= 1
        if self.tokens is not None:
            self.tokens.refill(self.clock())
            self.tokens.level -= tokens


def retry_after_header(seconds: float) -> str:
    """Retry-After in whole seconds, at least 1."""
    return str(max(1, math.ceil(seconds)))
