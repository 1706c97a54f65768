"""What `qvl-trt validate` found: the problems in a model repository and how many checks ran
(validate.py checks the configs and their wiring, validate_artifacts.py the files they name)."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path


@dataclass(frozen=True)
class Problem:
    where: str  # model (or model/file)
    message: str

    def __str__(self) -> str:
        return f"{self.where}: {self.message}"


@dataclass
class ValidationReport:
    repo: Path
    models: list[str] = field(default_factory=list)
    checks: int = 0
    problems: list[Problem] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.problems

    def check(self, ok: bool, where: str, message: str) -> bool:
        self.checks += 1
        if not ok:
            self.problems.append(Problem(where, message))
        return ok

