"""Memory tuning policy: a pure function from what the cache observes to its next memory target.

No I/O and no clock: the caller passes `now` and the time of the last change, so the policy is unit- and
property-tested (tests/operator/test_tuning.py). docs/autoscaling.md explains the reasoning; in short:

* Grow (multiplicatively, up to `maximum`) only while the hit ratio is below the target AND the misses are
  capacity misses: entries are being evicted for room (rate above a floor) while still young (median age at eviction
  below the reuse horizon). Cold misses and entries evicted long after their last chance of reuse are not helped by
  more memory, so they do not grow the cache.
* Shrink (multiplicatively, down to `minimum`) only when memory sits idle: no traffic at all, or the hit ratio is
  comfortably above the target (target + hysteresis), nothing is evicted for room and the cache holds less than
  `underuse_fraction` of its budget. Growing and shrinking need disjoint conditions, so a constant signal moves memory
  in one direction only (no flapping), and the band between "below target" and "target + hysteresis" holds.
* A cooldown after each change (longer before shrinking than before growing) lets the effect of a change reach the
  measurement window before the next decision; steps smaller than `min_step_fraction` are not worth a resize.
* The result is always within [minimum, maximum] (a current value outside them is brought back first).
* With a miss-ratio curve (the sidecars' miniature simulations: predicted hit ratio per cache size), a grow jumps
  straight to the smallest size whose predicted hit ratio reaches target + `curve_margin` (interpolated between the
  curve's sizes, within the bounds) instead of stepping by `grow_factor`; if no size reaches it, to the smallest
  size within `curve_min_gain` of the best predicted ratio, and not at all when that is no more than the current
  size (`CurveFlat`: more memory would not help). Without a curve, or when the curve disagrees with what is measured
  (it predicts the target at or below the current size, or a ratio at the current size more than `curve_tolerance`
  from the measured one, or cannot be read there), the multiplicative step stands.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, replace

from promptcache.contract.quantity import MAX_INT64

ALIGN = 1 << 20  # targets are whole MiB

GROW, SHRINK, HOLD = "grow", "shrink", "hold"


@dataclass(frozen=True)
class Signal:
    """What the caches observed over the last measurement window (aggregated over the nodes)."""

    hit_ratio: float | None            # hit tokens / (hit + missed tokens); None when there were no lookups
    lookup_tokens_per_s: float          # hit + missed tokens per second (traffic); 0 when idle
    capacity_evictions_per_s: float     # entries evicted to make room, per second (worst node)
    eviction_age_s: float | None = None  # mean age of the entries evicted for room; None when none were
    stored_bytes: float = 0.0           # bytes the cache holds (fullest node)
    # miss-ratio curve: (cache budget bytes, predicted hit ratio) by size, over the same window; None without one
    curve: tuple[tuple[int, float], ...] | None = None


@dataclass(frozen=True)
class Policy:
    target_hit_ratio: float = 0.8
    grow_factor: float = 1.5             # memory x this per grow step
    shrink_factor: float = 0.8           # memory x this per shrink step (at most)
    grow_cooldown_s: float = 300.0       # no change within this long of the last one, before growing again
    shrink_cooldown_s: float = 900.0     # ... before shrinking (giving memory back is never urgent)
    hysteresis: float = 0.05             # shrink under load only above target + this
    min_eviction_rate: float = 0.05      # capacity evictions/s below this are not pressure
    reuse_horizon_s: float = 3600.0      # entries evicted older than this would not have been reused anyway
    idle_tokens_per_s: float = 1.0       # traffic below this is "no load"
    underuse_fraction: float = 0.5       # holds less than this share of its budget: memory sits idle
    headroom: float = 0.25               # when shrinking an under-used cache, keep stored x (1 + this)
    min_step_fraction: float = 0.05      # smaller changes are not worth a resize
    curve_margin: float = 0.025          # a curve-guided grow aims at target + this (half the hysteresis band)
    curve_min_gain: float = 0.01         # predicted gains below this are not worth memory
    curve_tolerance: float = 0.1         # the curve is used only if it predicts the measured ratio within this

    def validate(self) -> "Policy":
        if not 0 <= self.target_hit_ratio <= 1:
            raise ValueError("target_hit_ratio must be within 0..1")
        if self.grow_factor <= 1 or not 0 < self.shrink_factor < 1:
            raise ValueError("grow_factor must be > 1 and shrink_factor within (0, 1)")
        if min(self.grow_cooldown_s, self.shrink_cooldown_s, self.hysteresis, self.min_eviction_rate,
               self.idle_tokens_per_s, self.headroom, self.min_step_fraction, self.curve_margin,
               self.curve_min_gain, self.curve_tolerance) < 0:
            raise ValueError("cooldowns, thresholds and fractions must not be negative")
        return self


@dataclass(frozen=True)
class Decision:
    action: str          # grow | shrink | hold
    memory_bytes: int    # the new target (== current for hold)
    reason: str          # machine-readable, CamelCase (Event reason)
    message: str         # for people


MAX_SIZE = MAX_INT64   # curve sizes above this (or not finite) are not sizes: a byte count is an int64


def _finite(x: float | None, absent: float | None) -> float | None:
    return x if x is not None and isinstance(x, (int, float)) and math.isfinite(x) else absent


def sanitize(signal: Signal) -> Signal:
    """The signal with every figure finite, as decide() reads it: a figure that is not finite (a sidecar's sums that
    overflow, NaN) counts as absent: the hit ratio and the eviction age None, the rates and stored bytes 0; negative
    rates and bytes are 0 and the hit ratio is clamped to [0, 1]. Curve points whose size is not an integer in
    (0, MAX_INT64] or whose ratio is not finite are dropped (ratios clamped to [0, 1]); no point left is no curve."""
    ratio = _finite(signal.hit_ratio, None)
    age = _finite(signal.eviction_age_s, None)
    curve = None
    if signal.curve:
        pts = []
        for s, r in signal.curve:
            if isinstance(s, float):
                s = int(s) if math.isfinite(s) and s.is_integer() else 0
            r = _finite(r, None)
            if isinstance(s, int) and 0 < s <= MAX_SIZE and r is not None:
                pts.append((s, min(1.0, max(0.0, float(r)))))
        curve = tuple(pts) or None
    return replace(signal, hit_ratio=None if ratio is None else min(1.0, max(0.0, float(ratio))),
                   lookup_tokens_per_s=max(0.0, _finite(signal.lookup_tokens_per_s, 0.0)),
                   capacity_evictions_per_s=max(0.0, _finite(signal.capacity_evictions_per_s, 0.0)),
                   eviction_age_s=None if age is None else max(0.0, age),
                   stored_bytes=max(0.0, _finite(signal.stored_bytes, 0.0)), curve=curve)


def _align_up(n: float) -> int:
    return int(math.ceil(n / ALIGN) * ALIGN)


def _align_down(n: float) -> int:
    return int(math.floor(n / ALIGN) * ALIGN)


FLAT = -1  # curve_size(): more memory would not help


def _at(mono: list[tuple[int, float]], x: float) -> float | None:
    """The curve at size x, interpolated linearly; None outside its sizes."""
    for (s0, r0), (s1, r1) in zip(mono, mono[1:]):
        if s0 <= x <= s1:
            return r0 + (r1 - r0) * (x - s0) / (s1 - s0) if s1 > s0 else r1
    return mono[0][1] if len(mono) == 1 and mono[0][0] == x else None


def curve_size(curve: tuple[tuple[int, float], ...], aim: float, current: int, min_gain: float,
               measured: float | None = None, tolerance: float = 1.0) -> float | None:
    """The smallest size (same units as the curve's) whose predicted hit ratio reaches `aim`, interpolated linearly
    between the curve's sizes; if none does, the smallest within `min_gain` of the best. None when the curve gives no
    answer above `current` (it already predicts `aim` at or below it) or when it disagrees with the `measured` hit
    ratio at `current` by more than `tolerance` (or cannot be read there); FLAT when it predicts no gain above
    `current`. Ratios are made non-decreasing in size first (a larger cache of the same policy does not hit less; a
    sampled estimate may say so by noise)."""
    pts = sorted((int(s), float(r)) for s, r in curve if s > 0)
    if not pts:
        return None
    mono, best = [], 0.0
    for s, r in pts:
        best = max(best, r)
        mono.append((s, best))
    if measured is not None and tolerance < 1.0:
        here = _at(mono, current)
        if here is None or abs(here - measured) > tolerance:
            return None
    for i, (s, r) in enumerate(mono):
        if r >= aim:
            if i == 0:
                return None if s <= current else float(s)
            s0, r0 = mono[i - 1]
            at = s0 + (aim - r0) / (r - r0) * (s - s0) if r > r0 else float(s)
            return at if at > current else None
    enough = next(s for s, r in mono if r >= best - min_gain)
    return float(enough) if enough > current else FLAT


def decide(signal: Signal, current: int, minimum: int, maximum: int, policy: Policy,
           last_change: float | None, now: float, overhead: int = 0) -> Decision:
    """The next memory target for a cache using `current` bytes, bounded by [minimum, maximum]. `overhead`: memory
    beyond the cache budget (the curve's sizes are budgets). The signal is read through sanitize(): a figure that is
    not finite counts as absent, so no signal makes decide() raise."""
    if minimum > maximum:
        raise ValueError(f"minimum {minimum} is above maximum {maximum}")
    if current < minimum or current > maximum:
        to = min(max(current, minimum), maximum)
        action = GROW if to > current else SHRINK
        return Decision(action, to, "OutsideBounds",
                        f"memory {current} outside [{minimum}, {maximum}]: brought to {to}")

    p = policy
    signal = sanitize(signal)
    ratio = signal.hit_ratio
    since = math.inf if last_change is None else now - last_change
    idle = signal.lookup_tokens_per_s < p.idle_tokens_per_s
    pressure = signal.capacity_evictions_per_s >= p.min_eviction_rate
    young = signal.eviction_age_s is None or signal.eviction_age_s < p.reuse_horizon_s
    ratio_text = "n/a" if ratio is None else f"{ratio:.3f}"

    want: str = HOLD
    to = current
    reason, message = "OnTarget", f"hit ratio {ratio_text}, target {p.target_hit_ratio}"
    if not idle and ratio is not None and ratio < p.target_hit_ratio:
        if not pressure:
            reason = "ColdMisses"
            message = (f"hit ratio {ratio_text} below target {p.target_hit_ratio} but only "
                       f"{signal.capacity_evictions_per_s:.3g} capacity evictions/s: more memory would not help")
        elif not young:
            reason = "StaleEvictions"
            message = (f"hit ratio {ratio_text} below target {p.target_hit_ratio}; evicted entries were "
                       f"{signal.eviction_age_s:.0f}s old (horizon {p.reuse_horizon_s:.0f}s): more memory would "
                       "not help")
        elif current >= maximum:
            reason = "AtMaximum"
            message = f"hit ratio {ratio_text} below target {p.target_hit_ratio} but memory is at its maximum"
        else:
            want, to = GROW, min(maximum, _align_up(current * p.grow_factor))
            reason = "HitRatioBelowTarget"
            how = f"x{p.grow_factor:g}, no miss-ratio curve"
            aim = min(1.0, p.target_hit_ratio + p.curve_margin)
            jump = (curve_size(signal.curve, aim, current - overhead, p.curve_min_gain, ratio, p.curve_tolerance)
                    if signal.curve else None)
            if signal.curve and jump is None:
                how = (f"x{p.grow_factor:g}: the miss-ratio curve disagrees with the measured ratio at "
                       f"{current - overhead} bytes of cache")
            if jump == FLAT:
                want, reason = HOLD, "CurveFlat"
                message = (f"hit ratio {ratio_text} below target {p.target_hit_ratio}, but the miss-ratio curve "
                           f"predicts no gain above {current - overhead} bytes of cache: more memory would not help")
            elif jump is not None:
                to = min(maximum, _align_up(round(jump) + overhead))
                how = f"miss-ratio curve: {aim:.3f} at {int(jump)} bytes of cache"
            if want == GROW:
                message = (f"hit ratio {ratio_text} < target {p.target_hit_ratio} with "
                           f"{signal.capacity_evictions_per_s:.3g} capacity evictions/s: grow {current} -> {to} "
                           f"({how})")
    elif idle:
        reason, message = "AtMinimum", f"no load ({signal.lookup_tokens_per_s:.3g} tokens/s looked up), at the minimum"
        if current > minimum:
            want, to = SHRINK, max(minimum, _align_down(current * p.shrink_factor))
            reason = "Idle"
            message = (f"no load ({signal.lookup_tokens_per_s:.3g} tokens/s looked up): shrink {current} -> {to}")
    elif (ratio is not None and ratio >= p.target_hit_ratio + p.hysteresis and not pressure
          and signal.stored_bytes < p.underuse_fraction * current and current > minimum):
        floor = max(minimum, _align_up(signal.stored_bytes * (1 + p.headroom)), _align_down(current * p.shrink_factor))
        want, to = SHRINK, min(current, floor)
        reason = "Underused"
        message = (f"hit ratio {ratio_text} >= {p.target_hit_ratio + p.hysteresis:.3f}, holding "
                   f"{signal.stored_bytes:.0f} of {current} bytes: shrink {current} -> {to}")

    if want == HOLD or to == current:
        return Decision(HOLD, current, reason, message)
    cooldown = p.grow_cooldown_s if want == GROW else p.shrink_cooldown_s
    if since < cooldown:
        return Decision(HOLD, current, "Cooldown",
                        f"would {want} ({reason}) but the last change was {since:.0f}s ago (cooldown {cooldown:.0f}s)")
    if abs(to - current) < p.min_step_fraction * current and to not in (minimum, maximum):
        return Decision(HOLD, current, "StepTooSmall", f"would {want} {current} -> {to}: below the minimum step")
    return Decision(want, to, reason, message)


def policy_for(target_hit_ratio: float, base: Policy | None = None) -> Policy:
    return replace(base or Policy(), target_hit_ratio=target_hit_ratio).validate()
