"""The budget controller's decision: each replica's KV budget from its memory reading.

Pure functions (no Ray), so the decision is tested over scripted readings. Design section 7: keep
every replica's memory under a high-water mark by lowering its KV budget (never below the policy's
calibrated floor), and give budget back when memory falls under a low-water mark. Hysteresis: the
band between the marks changes nothing, and a budget is raised only after ``raise_after``
consecutive readings under the low mark, so a replica does not oscillate around one mark.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class BudgetSettings:
    """Attributes:
        high_water: memory fraction above which the budget falls.
        low_water: memory fraction under which the budget may rise (``< high_water``).
        step_down: budget removed per period above the high mark (absolute fraction).
        step_up: budget added per period after ``raise_after`` periods under the low mark.
        raise_after: consecutive low readings needed before a raise.
    """
    high_water: float = 0.85
    low_water: float = 0.65
    step_down: float = 0.1
    step_up: float = 0.05
    raise_after: int = 3

    def __post_init__(self):
        if not 0.0 < self.low_water < self.high_water <= 1.0:
            raise ValueError(f"need 0 < low_water < high_water <= 1, got {self.low_water}, {self.high_water}")
        if self.step_down <= 0 or self.step_up <= 0 or self.raise_after < 1:
            raise ValueError("step_down, step_up and raise_after must be positive")


@dataclass(frozen=True)
class MemoryReading:
    """One replica's memory at one time.

    Attributes:
        used_bytes / total_bytes: device memory (NVML) or, on the CPU fallback, the KV pool's
            exact bytes held / its size.
        source: "nvml", "cpu" (KV accounting + process RSS) or "scripted".
        process_rss_bytes: the replica process's resident memory (psutil), when known.
    """
    used_bytes: int
    total_bytes: int
    source: str
    process_rss_bytes: int | None = None

    @property
    def fraction(self) -> float:
        return self.used_bytes / self.total_bytes if self.total_bytes > 0 else 0.0


@dataclass(frozen=True)
class ReplicaBudgetState:
    """What the controller remembers per replica between periods."""
    budget: float = 1.0
    low_streak: int = 0


def decide_budget(state: ReplicaBudgetState, reading: MemoryReading, floor: float,
                  settings: BudgetSettings) -> ReplicaBudgetState:
    """Next budget of one replica, in ``[floor, 1.0]``.

    Args:
        state: the previous state (budget and count of consecutive low readings).
        reading: the latest memory reading.
        floor: the replica policy's calibrated floor (0 for none).
        settings: the marks and steps.
    """
    floor = min(max(floor, 0.0), 1.0)
    frac = reading.fraction
    if frac > settings.high_water:
        return ReplicaBudgetState(max(floor, round(state.budget - settings.step_down, 6)), 0)
    if frac < settings.low_water:
        streak = state.low_streak + 1
        if streak >= settings.raise_after and state.budget < 1.0:
            return ReplicaBudgetState(min(1.0, round(state.budget + settings.step_up, 6)), 0)
        return ReplicaBudgetState(max(floor, state.budget), streak)
    return ReplicaBudgetState(max(floor, state.budget), 0)
