"""A config problem: where (dotted path), what was expected, what was given."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Problem:
    path: str
    expected: str
    given: str
    message: str = ""

    def __str__(self) -> str:
        return f"{self.path}: {self.detail()}"

    def detail(self) -> str:
        """What is wrong, without where: "expected …, got …" and the message, if any."""
        text = f"expected {self.expected}, got {self.given}"
        return f"{text} ({self.message})" if self.message else text


class ConfigError(Exception):
    """Raised with every problem found at once."""

    def __init__(self, problems: list[Problem], source: str = "config") -> None:
        self.problems = problems
        lines = "\n".join(f"  - {p}" for p in problems)
        super().__init__(f"{source} has {len(problems)} problem(s):\n{lines}")
