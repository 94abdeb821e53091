"""Noticing that the link changed during training (Kimad-style; docs/design.md section 7).

A shared cloud link slows and recovers while a run goes on. ``LinkWatch`` reads the step
times the training loop measures on the host (nothing is added to the step) and keeps the
link model of section 11 up to date: the first window of steps calibrates the step's compute
(the step time less the all-reduce the starting profile predicts), later windows give the
all-reduce's time (the step time less that compute), and its median against the prediction
rescales the profile's per-byte costs. Latencies and the kernels' per-value cost are kept:
what congestion changes is the rate. When the rate has moved by more than ``tolerance`` the
watch says so (``changed``), and the loop refits with ``refit_policy(..., link=watch.link)``.

Where the all-reduce is a small part of a noisy step (a fast link, shared CPUs), the step
times cannot tell a link that recovered from noise: ``probe(mesh, axis_name)`` instead times
a small exact ``psum`` between two steps (every process at the same step), whose time is
nearly all bytes on the wire, and re-estimates the rate from it against the profile's exact
line. It costs a few all-reduces of a megabyte each time it is called.

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
    """Re-estimates the link's rate from measured step times (or timed probes) and says
    when it changed.

    Attributes:
      link: the profile as last re-estimated (the starting one until a change is seen).
      tolerance: the relative change of the per-byte cost that counts as a change.
      window: the steps whose median makes one estimate (``observe``).
      changed: whether the last full window moved the rate by more than ``tolerance``
        (``link`` then holds the new estimate; the next window compares against it).
      compute_seconds: the step's compute as the first window calibrated it (None before).
      profile: the starting ``link``.
      slowdown: the per-byte cost of ``link`` over the profile's (1.0 until a change is
        seen; 3.0: the link is 3x slower).
      last_probe_seconds: how long the last ``probe`` call took (0.0 before).

    Args:
      link: the ``LinkProfile`` measured before training (``bench link``).
      tree: the gradients, parameters or shapes (as for ``cgx.estimate``).
      tolerance: a number in (0, 1).
      window: an int >= 3.

    Raises:
      ValueError: a bad ``tolerance``, ``window``, step or probe time, or probe size.
      TypeError: a ``link`` that is not a ``LinkProfile``, or a bad policy.

    Example:
        >>> import jax.numpy as jnp, cgx_jax as cgx
        >>> link = cgx.LinkProfile(processes=4, exact_latency=1e-3, seconds_per_byte=8e-9,
        ...                        compressed_latency=2e-3, seconds_per_wire_byte=8e-9,
        ...                        seconds_per_value=2e-10)
        >>> params, policy = {"w": jnp.zeros((2048, 2048))}, cgx.LayerPolicy()
        >>> watch = cgx.LinkWatch(link, params, window=5)
        >>> allreduce = watch.predict(policy)
        >>> refits = []
        >>> for step in range(20):  # compute 0.1 s; the rate drops 3x after step 9
        ...     slow = 3 if step >= 10 else 1  # 2.36 MB of packets at 8 ns/byte: 18.9 ms
        ...     if watch.observe(0.1 + allreduce + (slow - 1) * 0.0189, policy):
        ...         refits.append(step)  # the loop would refit_policy(..., link=watch.link)
        >>> refits, round(watch.slowdown, 1)
        ([14], 3.0)
    """

    def __init__(self, link: LinkProfile, tree, *, tolerance: float = 0.2, window: int = 20):
        if not isinstance(link, LinkProfile):
            raise TypeError(f"link must be a cgx.LinkProfile, got {type(link).__name__}")
        if (isinstance(tolerance, bool) or not isinstance(tolerance, numbers.Real)
                or not 0 < tolerance < 1):
            raise ValueError(f"tolerance must be a number in (0, 1), got {tolerance!r}")
        if isinstance(window, bool) or not isinstance(window, numbers.Integral) or window < 3:
            raise ValueError(f"window must be an int >= 3, got {window!r}")
        self.link, self.profile, self.tree = link, link, tree
        self.tolerance, self.window = float(tolerance), int(window)
        self.changed = False
        # Kept apart, not read back as a ratio of the profiles' per-byte costs: a fit of a
        # kernel-bound link can set the profile's seconds_per_wire_byte to exactly 0.
        self.slowdown = 1.0
        self.compute_seconds: float | None = None  # calibrated by the first window
        self._pending: list[tuple[float, LayerPolicy]] = []
        self._split_cache: dict = {}
        self._probes: dict = {}  # (mesh, axis, values) -> the compiled psum and its input
        self.last_probe_seconds = 0.0

    def predict(self, policy: LayerPolicy) -> float:
        """The all-reduce's seconds of ``policy`` on ``link`` (as ``cgx.estimate``)."""
        fixed, per_byte = self._split(policy)
        return fixed + per_byte

    def observe(self, step_seconds: float, policy: LayerPolicy) -> bool:
        """Adds one step's measured time (host seconds, the same number on every process)
        run with ``policy``. Returns True when this step completed a window that moved the
        rate by more than ``tolerance`` (``link`` is then the new estimate: refit now),
        else False."""
        check_policy(policy, "policy")
        if (isinstance(step_seconds, bool) or not isinstance(step_seconds, numbers.Real)
                or not math.isfinite(step_seconds) or step_seconds <= 0):
            raise ValueError(f"step_seconds must be a finite number > 0, got {step_seconds!r}")
        self._pending.append((float(step_seconds), policy))
        if len(self._pending) < self.window:
            return False
        steps, self._pending = self._pending, []
        if self.compute_seconds is None:  # calibrate: the link is as measured
            self.compute_seconds = statistics.median(
                seconds - self.predict(p) for seconds, p in steps)
            return False
        # Per step: the scale of the per-byte cost that explains its all-reduce time.
        scales = []
        for seconds, p in steps:
            fixed, per_byte = self._split(p)
            if per_byte > 0:
                scales.append((seconds - self.compute_seconds - fixed) / per_byte)
        scale = statistics.median(scales) if scales else 1.0
        if scale <= 0:
            # Steps faster than the calibrated compute and the model allow: the all-reduce
            # did not show above the noise. No estimate of the rate (not a free link), but
            # after a slowdown it says the link recovered, at least to the profile's rate.
            return self._move_to(min(self.slowdown, 1.0))
        return self._move_to(self.slowdown * scale)

    def observe_probe(self, seconds: float, nbytes: int) -> bool:
        """Re-estimates the rate from one timed exact all-reduce of ``nbytes`` of f32 per
        participant (``probe`` runs and times one; the same number on every process): its
        time less the profile's exact latency, over the profile's bytes term. Returns True
        when that moved the rate by more than ``tolerance`` (``link`` is then the new
        estimate: refit now), else False. A probe no slower than the latency says nothing."""
        if (isinstance(seconds, bool) or not isinstance(seconds, numbers.Real)
                or not math.isfinite(seconds) or seconds <= 0):
            raise ValueError(f"seconds must be a finite number > 0, got {seconds!r}")
        if isinstance(nbytes, bool) or not isinstance(nbytes, numbers.Integral) or nbytes < 1:
            raise ValueError(f"nbytes must be an int >= 1, got {nbytes!r}")
        profile = self.profile
        measured = ((seconds - profile.exact_latency) / (profile.seconds_per_byte * nbytes)
                    if profile.seconds_per_byte > 0 else 0.0)  # the rate over the profile's
        if measured <= 0:
            self.changed = False
            return False
        return self._move_to(measured)

    def probe(self, mesh, axis_name, *, values: int = 1 << 18, repeats: int = 3) -> bool:
        """Times ``repeats`` exact ``lax.psum``s of ``values`` f32 per participant over
        ``axis_name`` of ``mesh`` (between two steps: every process must call it at the
        same step) and ``observe_probe``s the fastest, the largest of that across processes
        (so every process decides alike). The fastest, because what a busy CPU or a
        scheduling hiccup adds to a probe is never negative, while a slower link slows them
        all. Returns what that returns; ``last_probe_seconds`` holds what the call took.

        Example:
            >>> import jax, cgx_jax as cgx
            >>> link = cgx.LinkProfile(processes=1, exact_latency=1.0, seconds_per_byte=1e-9,
            ...                        compressed_latency=1e-3, seconds_per_wire_byte=1e-9,
            ...                        seconds_per_value=0.0)
            >>> watch = cgx.LinkWatch(link, {"w": jax.numpy.zeros((64, 64))})
            >>> mesh = jax.make_mesh((2,), ("d",), devices=jax.devices()[:2])
            >>> watch.probe(mesh, "d", values=1024)  # faster than the 1 s latency: no news
            False
        """
        import time

        import jax
        import numpy as np
        from jax.sharding import NamedSharding, PartitionSpec as P

        for name, value in (("values", values), ("repeats", repeats)):
            if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 1:
                raise ValueError(f"{name} must be an int >= 1, got {value!r}")
        if axis_name not in mesh.axis_names:
            raise ValueError(f"axis_name {axis_name!r} is not an axis of the mesh "
                             f"{mesh.axis_names}")
        key = (mesh, axis_name, values)
        if key not in self._probes:
            sharding = NamedSharding(mesh, P(axis_name))
            psum = jax.jit(jax.shard_map(lambda x: jax.lax.psum(x, axis_name), mesh=mesh,
                                         in_specs=P(axis_name), out_specs=P(axis_name)))
            x = jax.device_put(np.zeros((mesh.shape[axis_name], values), np.float32), sharding)
            jax.block_until_ready(psum(x))  # compiled and run once, untimed
            self._probes[key] = (psum, x)
        psum, x = self._probes[key]
        begin, times = time.perf_counter(), []
        for _ in range(repeats):
            start = time.perf_counter()
            jax.block_until_ready(psum(x))
            times.append(time.perf_counter() - start)
        seconds = min(times)
        if jax.process_count() > 1:  # one number for every process
            from jax.experimental import multihost_utils
            seconds = float(np.max(multihost_utils.process_allgather(np.float64(seconds))))
        self.last_probe_seconds = time.perf_counter() - begin
        return self.observe_probe(seconds, 4 * values)

    def _move_to(self, slowdown: float) -> bool:
        """Whether ``slowdown`` (the per-byte cost over the profile's) differs from the
        current one by more than ``tolerance``; if so, ``link`` becomes the profile with its
        per-byte costs times ``slowdown``."""
        self.changed = abs(slowdown / self.slowdown - 1.0) > self.tolerance
        if self.changed:
            self.slowdown = slowdown
            profile = self.profile
            self.link = dataclasses.replace(
                profile, seconds_per_byte=profile.seconds_per_byte * slowdown,
                seconds_per_wire_byte=profile.seconds_per_wire_byte * slowdown,
                description=f"{profile.description} (rate x{1 / slowdown:.2f})")
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
