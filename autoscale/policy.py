"""KV-aware autoscaling for Ray Serve: a custom ``autoscaling_config.policy.policy_function``.

Replicas report, through ``record_autoscaling_stats``, ``kv_pressure`` (KV bytes held / pool),
``budget_at_floor`` (1.0 when the budget controller has pushed the replica's KV budget down to its
floor) and ``queue_len`` (requests waiting for admission). :func:`decide_replicas` is the pure
decision; :func:`kv_pressure_policy` adapts it to Serve's ``AutoscalingContext``.

Scale out by one when requests queue and most replicas are under KV pressure: their budget was
pushed to the floor or below ``budget_low`` by the budget controller (quality is being traded for
memory), or their KV pool is nearly full. Scale in by one when every replica runs at full budget
with low pressure and no queue, after ``scale_in_after`` such decisions in a row. Bounded by min /
max replicas.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class ScalingSettings:
    high_pressure: float = 0.85
    low_pressure: float = 0.3
    budget_low: float = 0.5
    queue_per_replica: float = 2.0
    scale_in_after: int = 3


def decide_replicas(metrics: dict[str, dict[Any, float]], current: int, min_replicas: int, max_replicas: int,
                    state: dict, settings: ScalingSettings = ScalingSettings(),
                    handle_queued: float = 0.0) -> tuple[int, dict]:
    """Target replica count and the policy's new state.

    Args:
        metrics: metric name -> replica -> value (``kv_pressure``, ``budget_at_floor``, ``queue_len``,
            ``budget``); replicas missing a metric count as 0 (1.0 for ``budget``).
        current: running replicas; min_replicas / max_replicas: bounds.
        state: the previous state (``{"calm": n}``).
        handle_queued: requests Serve holds at the handles before any replica takes them.
    """
    replicas = set()
    for values in metrics.values():
        replicas |= set(values)
    n = max(len(replicas), 1)
    get = lambda name, default=0.0: [metrics.get(name, {}).get(r, default) for r in replicas] or [default]
    queue = sum(get("queue_len")) + handle_queued
    pressed = sum(1 for f, p, b in zip(get("budget_at_floor"), get("kv_pressure"), get("budget", 1.0))
                  if f >= 1.0 or p >= settings.high_pressure or b <= settings.budget_low)
    calm = all(b >= 1.0 for b in get("budget", 1.0)) and max(get("kv_pressure")) < settings.low_pressure and queue == 0
    target, streak = current, 0
    if pressed * 2 > n and queue > settings.queue_per_replica * n:
        target = current + 1
    elif calm:
        # Keep asking for one replica fewer while calm: Serve applies it once the decision has held
        # for its downscale_delay_s.
        streak = state.get("calm", 0) + 1
        if streak >= settings.scale_in_after:
            target = current - 1
    return max(min_replicas, min(max_replicas, target)), {"calm": streak}


def kv_pressure_policy(ctx) -> tuple[int, dict]:
    """Ray Serve custom autoscaling policy (``policy_function: autoscale.policy:kv_pressure_policy``)."""
    import logging
    metrics = ctx.aggregated_metrics or {}
    queued = float(ctx.total_queued_requests or 0.0)
    target, state = decide_replicas(metrics, ctx.current_num_replicas, ctx.capacity_adjusted_min_replicas,
                                    ctx.capacity_adjusted_max_replicas, dict(ctx.policy_state or {}),
                                    handle_queued=queued)
    if target != ctx.current_num_replicas:
        summary = {name: [round(v, 3) for v in values.values()] for name, values in metrics.items()}
        logging.getLogger("ray.serve").info("kv_pressure_policy: %d -> %d replicas (handle queue %.1f, metrics %s)",
                                            ctx.current_num_replicas, target, queued, summary)
    return target, state
