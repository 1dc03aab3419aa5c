"""How much history the event log keeps: its retention, by age and by size.

A daemon that runs for weeks must not fill its disk. After each snapshot, the fact log drops
the facts older than `max_age_s`, and the oldest facts while the log takes more than
`max_bytes`, but only up to a snapshot: the state they folded to stays in the log, so replay
is unchanged. The defaults hold a month of a 1,024-device job in 32 GiB (docs/store.md,
"Retention", has the arithmetic); `[store]` in the daemon's configuration sets them.
"""

from __future__ import annotations

import math

import msgspec

DAY_S = 86_400.0
DEFAULT_RETENTION_S = 30 * DAY_S
DEFAULT_RETENTION_BYTES = 32 * 1024**3
MIN_RETENTION_BYTES = 64 * 1024**2
"""The smallest size bound that makes sense: the facts after the newest snapshot are always
kept, and between two snapshots (10,000 facts) a 4,096-device cluster writes about 7 MB."""


class Retention(msgspec.Struct, frozen=True):
    """The bounds on the log's history; 0 turns a bound off (both 0: keep everything)."""

    max_age_s: float = DEFAULT_RETENTION_S  # facts recorded longer ago than this are dropped
    max_bytes: int = DEFAULT_RETENTION_BYTES  # the oldest facts are dropped while the log takes more

    def __post_init__(self) -> None:
        if isinstance(self.max_age_s, bool) or not isinstance(self.max_age_s, (int, float)) \
                or not math.isfinite(self.max_age_s) or self.max_age_s < 0:
            raise ValueError(f"max_age_s must be a number of seconds >= 0 (0: no age bound), got {self.max_age_s!r}")
        if isinstance(self.max_bytes, bool) or not isinstance(self.max_bytes, int) or self.max_bytes < 0:
            raise ValueError(f"max_bytes must be an integer >= 0 (0: no size bound), got {self.max_bytes!r}")

    @property
    def bounded(self) -> bool:
        """Whether anything is ever dropped."""
        return bool(self.max_age_s or self.max_bytes)

    def recorded_before(self, now_wall_s: float) -> float | None:
        """The age bound at `now_wall_s`: facts recorded before it are past retention (None: no bound)."""
        return now_wall_s - self.max_age_s if self.max_age_s else None

    def byte_budget(self) -> int | None:
        """The size bound (None: no bound)."""
        return self.max_bytes or None
