"""KV-aware autoscaling for Ray Serve: a custom ``autoscaling_config.policy.policy_function``.

Replicas report, through ``record_autoscaling_stats``, ``kv_pressure`` (KV bytes held / pool),
``budget_at_floor`` (1.0 when the budget controller has pushed the replica's KV budget down to its
floor) and ``queue_len`` (requests waiting for admission). :func:`decide_replicas` is the pure
decision; :func:`kv_pressure_policy` adapts it to Serve's ``AutoscalingContext``.

Scale out by one when most replicas sit at their budget floor or their KV pool is nearly full
while requests queue; scale in by one when every replica runs at full budget with low pressure
and no queue, after ``scale_in_after`` such decisions in a row. Bounded by min / max replicas.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class ScalingSettings:
    high_pressure: float = 0.85
    low_pressure: float = 0.3
    queue_per_replica: float = 2.0
    scale_in_after: int = 3


def decide_replicas(metrics: dict[str, dict[Any, float]], current: int, min_replicas: int, max_replicas: int,
                    state: dict, settings: ScalingSettings = ScalingSettings()) -> tuple[int, dict]:
    """Target replica count and the policy's new state.

    Args:
        metrics: metric name -> replica -> value (``kv_pressure``, ``budget_at_floor``, ``queue_len``,
            ``budget``); replicas missing a metric count as 0 (1.0 for ``budget``).
        current: running replicas; min_replicas / max_replicas: bounds.
        state: the previous state (``{"calm": n}``).
    """
    replicas = set()
    for values in metrics.values():
        replicas |= set(values)
    n = max(len(replicas), 1)
    get = lambda name, default=0.0: [metrics.get(name, {}).get(r, default) for r in replicas] or [default]
    queue = sum(get("queue_len"))
    pressed = sum(1 for f, p in zip(get("budget_at_floor"), get("kv_pressure"))
                  if f >= 1.0 or p >= settings.high_pressure)
    calm = all(b >= 1.0 for b in get("budget", 1.0)) and max(get("kv_pressure")) < settings.low_pressure and queue == 0
    target, streak = current, 0
    if pressed * 2 > n and queue > settings.queue_per_replica * n:
        target = current + 1
    elif calm:
        streak = state.get("calm", 0) + 1
        if streak >= settings.scale_in_after:
            target, streak = current - 1, 0
    return max(min_replicas, min(max_replicas, target)), {"calm": streak}


def kv_pressure_policy(ctx) -> tuple[int, dict]:
    """Ray Serve custom autoscaling policy (``policy_function: autoscale.policy:kv_pressure_policy``)."""
    metrics = ctx.aggregated_metrics or {}
    return decide_replicas(metrics, ctx.current_num_replicas, ctx.capacity_adjusted_min_replicas,
                           ctx.capacity_adjusted_max_replicas, dict(ctx.policy_state or {}))
