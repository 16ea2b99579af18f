"""What an exercise checker returns: a verdict and a message that says what to do next."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Feedback:
    """The verdict of a checker: ``ok`` and a message that says what to do next."""

    ok: bool
    message: str

    def __repr__(self) -> str:
        return ("✓ " if self.ok else "✗ ") + self.message

    def __bool__(self) -> bool:
        return self.ok
