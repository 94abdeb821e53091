"""Noticing that the link changed during training (Kimad-style; docs/design.md section 7).

A shared cloud link slows and recovers while a run goes on. ``LinkWatch`` reads the step
times the training loop measures on the host (nothing is added to the step) and keeps the
link model of section 11 up to date: the first window of steps calibrates the step's compute
(the step time less the all-reduce the starting profile predicts), later windows give the
all-reduce's time (the step time less that compute), and its median against the prediction
rescales the profile's per-byte costs. Latencies and the kernels' per-value cost are kept:
what congestion changes is the rate. When the rate has moved by more than ``tolerance`` the
watch says so (``changed``), and the loop refits with ``refit_policy(..., link=watch.link)``.

Every process must refit to the same policy: feed every process's watch the same numbers
(for example the largest step time across processes, ``jax.experimental.multihost_utils.
process_allgather``); the processes-agree check of the compressed collectives catches the
rest.
"""

from __future__ import annotations

import dataclasses
import math
import numbers
import statistics

from cgx_jax._src.link_model import LinkProfile, estimate
from cgx_jax._src.policy import LayerPolicy, check_policy


class LinkWatch:
    """Re-estimates the link's rate from measured step times and says when it changed.

    Attributes:
      link: the profile as last re-estimated (the starting one until a change is seen).
      tolerance: the relative change of the per-byte cost that counts as a change.
      window: the steps whose median makes one estimate.
      changed: whether the last full window moved the rate by more than ``tolerance``
        (``link`` then holds the new estimate; the next window compares against it).

    Args:
      link: the ``LinkProfile`` measured before training (``bench link``).
      tree: the gradients, parameters or shapes (as for ``cgx.estimate``).
      tolerance: a number in (0, 1).
      window: an int >= 3.

    Raises:
      ValueError: a bad ``tolerance``, ``window`` or step time.
      TypeError: a ``link`` that is not a ``LinkProfile``, or a bad policy.

    Example:
        >>> import jax.numpy as jnp, cgx_jax as cgx
        >>> link = cgx.LinkProfile(processes=4, exact_latency=1e-3, seconds_per_byte=8e-9,
        ...                        compressed_latency=2e-3, seconds_per_wire_byte=8e-9,
        ...                        seconds_per_value=2e-10)
        >>> params, policy = {"w": jnp.zeros((2048, 2048))}, cgx.LayerPolicy()
        >>> watch = cgx.LinkWatch(link, params, window=5)
        >>> allreduce = watch.predict(policy)
        >>> for step in range(15):  # compute 0.1 s; the rate drops 3x after step 9
        ...     slow = 3 if step >= 10 else 1
        ...     changed = watch.observe(0.1 + allreduce + (slow - 1) * 0.0167, policy)
        >>> watch.changed, round(watch.link.seconds_per_wire_byte / link.seconds_per_wire_byte, 1)
        (True, 3.0)
    """

    def __init__(self, link: LinkProfile, tree, *, tolerance: float = 0.2, window: int = 20):
        if not isinstance(link, LinkProfile):
            raise TypeError(f"link must be a cgx.LinkProfile, got {type(link).__name__}")
        if (isinstance(tolerance, bool) or not isinstance(tolerance, numbers.Real)
                or not 0 < tolerance < 1):
            raise ValueError(f"tolerance must be a number in (0, 1), got {tolerance!r}")
        if isinstance(window, bool) or not isinstance(window, numbers.Integral) or window < 3:
            raise ValueError(f"window must be an int >= 3, got {window!r}")
        self.link, self.tree = link, tree
        self.tolerance, self.window = float(tolerance), int(window)
        self.changed = False
        self.compute_seconds: float | None = None  # calibrated by the first window
        self._pending: list[tuple[float, LayerPolicy]] = []
        self._split_cache: dict = {}

    def predict(self, policy: LayerPolicy) -> float:
        """The all-reduce's seconds of ``policy`` on ``link`` (as ``cgx.estimate``)."""
        fixed, per_byte = self._split(policy)
        return fixed + per_byte

    def observe(self, step_seconds: float, policy: LayerPolicy) -> bool:
        """Adds one step's measured time (host seconds, the same number on every process)
        run with ``policy``. Returns ``changed``, updated when a window is full."""
        check_policy(policy, "policy")
        if (isinstance(step_seconds, bool) or not isinstance(step_seconds, numbers.Real)
                or not math.isfinite(step_seconds) or step_seconds <= 0):
            raise ValueError(f"step_seconds must be a finite number > 0, got {step_seconds!r}")
        self._pending.append((float(step_seconds), policy))
        if len(self._pending) < self.window:
            return self.changed
        steps, self._pending = self._pending, []
        if self.compute_seconds is None:  # calibrate: the link is as measured
            self.compute_seconds = statistics.median(
                seconds - self.predict(p) for seconds, p in steps)
            return self.changed
        # Per step: the scale of the per-byte cost that explains its all-reduce time.
        scales = []
        for seconds, p in steps:
            fixed, per_byte = self._split(p)
            if per_byte > 0:
                scales.append((seconds - self.compute_seconds - fixed) / per_byte)
        scale = statistics.median(scales) if scales else 1.0
        self.changed = abs(scale - 1.0) > self.tolerance
        if self.changed:
            self.link = dataclasses.replace(
                self.link, seconds_per_byte=self.link.seconds_per_byte * max(scale, 0.0),
                seconds_per_wire_byte=self.link.seconds_per_wire_byte * max(scale, 0.0),
                description=f"{self.link.description} (rate x{1 / max(scale, 1e-9):.2f})")
            self._split_cache.clear()
        return self.changed

    def _split(self, policy: LayerPolicy) -> tuple[float, float]:
        """``(seconds that do not scale with the rate, seconds per byte term)`` of
        ``policy``'s all-reduce on ``link``."""
        if policy not in self._split_cache:
            whole = estimate(self.tree, self.link, policies={"p": policy}).policies[0].seconds
            rate_free = dataclasses.replace(self.link, seconds_per_byte=0.0,
                                            seconds_per_wire_byte=0.0)
            fixed = estimate(self.tree, rate_free, policies={"p": policy}).policies[0].seconds
            self._split_cache[policy] = (fixed, whole - fixed)
        return self._split_cache[policy]
