"""How closely one converted checkpoint follows another on the same requests: the weight-only
INT8/INT4 checkpoint against the one in the model dtype, both run by the reference decoder
(which dequantizes as the engine's GEMM does). Per case: the greedy tokens of each, where
they first differ, and the largest logit difference over the steps both took from identical
inputs (the prompt's last token, then every generated token before the first divergence).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass

from ..deps import require
from .sampling import DecodeRequest


@dataclass(frozen=True)
class CaseAgreement:
    name: str
    baseline: tuple[int, ...]
    candidate: tuple[int, ...]
    first_divergence: int | None  # index of the first differing token; None: identical
    max_logit_diff: float  # over the steps taken from identical inputs

    @property
    def agreed(self) -> int:
        """Leading tokens the candidate produced as the baseline did."""
        return len(self.baseline) if self.first_divergence is None else self.first_divergence


@dataclass(frozen=True)
class Agreement:
    cases: tuple[CaseAgreement, ...]

    @property
    def token_agreement(self) -> float:
        """Greedy tokens produced before each case's first divergence, over all the baseline
        produced (1.0: every case identical)."""
        total = sum(len(c.baseline) for c in self.cases)
        return sum(c.agreed for c in self.cases) / total if total else 1.0

    @property
    def max_logit_diff(self) -> float:
        return max((c.max_logit_diff for c in self.cases), default=0.0)

    def summary(self) -> str:
        same = sum(c.first_divergence is None for c in self.cases)
        return (f"{same} of {len(self.cases)} cases identical, greedy-token agreement "
                f"{self.token_agreement:.1%}, max logit difference {self.max_logit_diff:.3g}")


def first_divergence(a: Sequence[int], b: Sequence[int]) -> int | None:
    """Index of the first position where the sequences differ (a length difference counts
    at the shorter one's end); None when they are equal."""
    for i, (x, y) in enumerate(zip(a, b, strict=False)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def compare_decoders(baseline, candidate,
                     requests: Sequence[tuple[str, DecodeRequest]]) -> Agreement:
    """Run each (name, request) greedily through both ReferenceDecoders and compare."""
    require("torch", extra="export", why="compare checkpoints")
    cases = []
    for name, request in requests:
        request = dataclasses.replace(
            request, sampling=dataclasses.replace(request.sampling, greedy=True),
            return_generation_logits=True)
        base = baseline.generate([request])[0]
        cand = candidate.generate([request])[0]
        first = first_divergence(base.token_ids, cand.token_ids)
        # Step i's logits come from the prompt and tokens [0, i): equal inputs up to `first`.
        steps = min(len(base.token_ids), len(cand.token_ids),
                    len(base.token_ids) if first is None else first + 1)
        diff = (base.generation_logits[:steps] - cand.generation_logits[:steps]).abs()
        cases.append(CaseAgreement(name, base.token_ids, cand.token_ids, first,
                                   float(diff.max()) if steps else 0.0))
    return Agreement(tuple(cases))
