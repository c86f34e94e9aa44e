"""The parsed arguments of one spec stage, from which a codec class builds itself."""

from __future__ import annotations

from dataclasses import dataclass, field

__all__ = ["StageArgs"]


@dataclass
class StageArgs:
    """The arguments of one stage: ``topk:0.01:exact`` -> positional ['0.01'], flags {'exact'}."""

    stage: str
    positional: list[str] = field(default_factory=list)
    flags: list[str] = field(default_factory=list)
    options: dict[str, str] = field(default_factory=dict)

    def expect(
        self, *, positional: int = 0, flags: tuple[str, ...] = (), options: tuple[str, ...] = ()
    ) -> None:
        """Raise ValueError if anything beyond the given shape was passed."""
        if len(self.positional) != positional:
            raise ValueError(
                f"{self.stage!r} takes {positional} positional argument(s), "
                f"got {len(self.positional)}"
            )
        for f in self.flags:
            if f not in flags:
                allowed = ", ".join(flags) or "none"
                raise ValueError(f"unknown flag {f!r} in {self.stage!r} (allowed: {allowed})")
        if len(set(self.flags)) != len(self.flags):
            raise ValueError(f"repeated flag in {self.stage!r}")
        for k in self.options:
            if k not in options:
                allowed = ", ".join(options) or "none"
                raise ValueError(f"unknown option {k!r} in {self.stage!r} (allowed: {allowed})")

    def int_option(self, key: str, default: int) -> int:
        """Parse the integer option ``key=N`` (ValueError naming it when not an integer)."""
        raw = self.options.get(key)
        if raw is None:
            return default
        try:
            return int(raw)
        except ValueError:
            raise ValueError(f"option {key}={raw!r} in {self.stage!r} is not an integer") from None
