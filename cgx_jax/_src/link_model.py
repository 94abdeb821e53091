"""Does compression pay on this link for this model? ``cgx.estimate`` predicts, per policy,
the bytes one participant sends and the time of one step's gradient all-reduce, from a link
profile measured by ``python -m cgx_jax.bench link`` (docs/design.md section 11).

A profile holds two straight lines fitted to all-reduces timed across the real processes:

- exact: ``seconds = latency + seconds_per_byte * f32_bytes + seconds_per_leaf * (leaves -
  1)`` (``lax.psum`` of one array, and of a pytree of many leaves: XLA:CPU across processes
  runs one all-reduce per leaf, each paying the latency; a backend that combines them
  measures a small ``seconds_per_leaf``);
- compressed: ``seconds = latency + seconds_per_wire_byte * wire_bytes + seconds_per_value
  * values`` (``compressed_psum`` with the default algorithm at 2, 4 and 8 bits): the wire
  term is the network, the per-value term the kernels (encode, decode, sum) on these CPUs
  while every process runs them at once.

A step's compressed all-reduce is the compressed line once per codec (leaves sharing a
codec travel as one buffer) plus one exact all-reduce of the leaves the policy keeps exact
(cgx fuses them into one ``psum``).
"""

from __future__ import annotations

import dataclasses
import json
import math

import jax
import numpy as np

from cgx_jax._src.codec import Codec, wire_bytes
from cgx_jax._src.policy import LayerPolicy, check_policy, is_compressible
from cgx_jax._src.trees import is_array, partition

# Below this share of the exact step (the all-reduce, plus the compute when it is given) a
# predicted saving is within what one measurement varies by: compression does not pay.
PAYS_FRACTION = 0.1


@dataclasses.dataclass(frozen=True)
class LinkProfile:
    """The fitted all-reduce costs of one set of processes on one network (the straight lines
    of the module docstring); ``load``/``save`` read and write the JSON ``bench link`` writes.

    Attributes:
      processes: the number of processes it was measured across.
      exact_latency: seconds of a ``psum`` of nothing (the exact line's intercept).
      seconds_per_byte: seconds per f32 byte of a ``psum``.
      compressed_latency: seconds of a compressed all-reduce of nothing.
      seconds_per_wire_byte: seconds per byte a compressed all-reduce sends.
      seconds_per_value: seconds per value of the compressed all-reduce's kernels.
      seconds_per_leaf: seconds each more leaf of a pytree ``psum`` costs.
      description: where it was measured (the CPU, the link).

    Example:
        >>> import cgx_jax as cgx
        >>> link = cgx.LinkProfile(processes=4, exact_latency=1e-3, seconds_per_byte=1e-8,
        ...                        compressed_latency=2e-3, seconds_per_wire_byte=1e-8,
        ...                        seconds_per_value=1e-10)
        >>> round(link.exact_seconds(4_000_000), 6)  # 4 MB of f32 gradients
        0.041
    """

    processes: int
    exact_latency: float
    seconds_per_byte: float
    compressed_latency: float
    seconds_per_wire_byte: float
    seconds_per_value: float
    seconds_per_leaf: float = 0.0
    description: str = ""

    def exact_seconds(self, nbytes: int, leaves: int = 1) -> float:
        if not nbytes:
            return 0.0
        return (self.exact_latency + self.seconds_per_byte * nbytes
                + self.seconds_per_leaf * (leaves - 1))

    def compressed_seconds(self, wire: int, values: int, buffers: int = 1) -> float:
        if not values:
            return 0.0
        return (self.compressed_latency * buffers + self.seconds_per_wire_byte * wire
                + self.seconds_per_value * values)

    def allreduce_seconds(self, wire: int, values: int, buffers: int, exact_bytes: int) -> float:
        """A step's compressed all-reduce: ``buffers`` codecs (one fused buffer each)
        sending ``wire`` bytes for ``values`` values, and one exact ``psum`` of
        ``exact_bytes``."""
        return (self.compressed_seconds(wire, values, buffers)
                + self.exact_seconds(exact_bytes))

    @classmethod
    def load(cls, path: str) -> LinkProfile:
        with open(path) as f:
            data = json.load(f)
        fields = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in data.items() if k in fields})

    def save(self, path: str, **extra) -> None:
        with open(path, "w") as f:
            json.dump({**dataclasses.asdict(self), **extra}, f, indent=2)


def _nonnegative_fit(features: np.ndarray, seconds: np.ndarray) -> np.ndarray:
    """Least squares of the relative errors (each row divided by its time, so a small
    model's milliseconds count as much as a large one's seconds) with every coefficient
    >= 0: a feature whose coefficient comes out negative (noise on a term too small to see)
    is dropped and the rest refitted."""
    features, seconds = features / seconds[:, None], np.ones_like(seconds)
    keep = list(range(features.shape[1]))
    while True:
        coef = np.linalg.lstsq(features[:, keep], seconds, rcond=None)[0]
        if (coef >= 0).all() or len(keep) == 1:
            out = np.zeros(features.shape[1])
            out[keep] = np.maximum(coef, 0)
            return out
        keep.pop(int(np.argmin(coef)))


def fit_profile(rows: list[dict], processes: int, bucket_size: int,
                description: str = "") -> LinkProfile:
    """A ``LinkProfile`` from ``bench allreduce``-style rows (``method``, ``elements``,
    ``bits``, ``seconds``, and ``leaves``, default 1): ``psum f32`` rows fit the exact line
    (its per-leaf term when some rows have several leaves), one-leaf ``cgx`` rows the
    compressed one. Needs at least two sizes, and two bit widths for the compressed line.

    Example:
        >>> rows = [dict(method="psum f32", elements=n, bits=32, seconds=1e-3 + 4 * n * 1e-9)
        ...         for n in (1 << 20, 1 << 22)]
        >>> rows += [dict(method=f"cgx auto {b}b", elements=n, bits=b,
        ...               seconds=2e-3 + wire_bytes(n, Codec(bits=b)) * 1e-9 + n * 1e-10)
        ...          for n in (1 << 20, 1 << 22) for b in (2, 8)]
        >>> p = fit_profile(rows, processes=4, bucket_size=Codec().bucket_size)
        >>> round(p.seconds_per_byte * 1e9, 3), round(p.seconds_per_value * 1e10, 3)
        (1.0, 1.0)
    """
    exact = [r for r in rows if r["method"] == "psum f32"]
    compressed = [r for r in rows if r["method"].startswith("cgx ") and r.get("leaves", 1) == 1]
    if len({r["elements"] for r in exact}) < 2 or len({r["bits"] for r in compressed}) < 2:
        raise ValueError("fit_profile needs psum f32 rows of two sizes or more and cgx rows "
                         f"of two bit widths or more; got {len(exact)} and {len(compressed)}")
    a, b, per_leaf = _nonnegative_fit(
        np.array([[1.0, 4.0 * r["elements"], r.get("leaves", 1) - 1] for r in exact]),
        np.array([r["seconds"] for r in exact]))
    c0, c1, c2 = _nonnegative_fit(
        np.array([[1.0, wire_bytes(r["elements"], Codec(bits=r["bits"], bucket_size=bucket_size)),
                   r["elements"]] for r in compressed]),
        np.array([r["seconds"] for r in compressed]))
    return LinkProfile(processes=processes, exact_latency=float(a), seconds_per_byte=float(b),
                       compressed_latency=float(c0), seconds_per_wire_byte=float(c1),
                       seconds_per_value=float(c2), seconds_per_leaf=float(per_leaf),
                       description=description)


@dataclasses.dataclass(frozen=True)
class PolicyEstimate:
    """One policy's prediction: ``wire_bytes`` one participant sends per step,
    ``seconds`` of the step's gradient all-reduce, ``saving`` against the exact one."""

    name: str
    wire_bytes: int
    seconds: float
    saving: float


@dataclasses.dataclass(frozen=True)
class Estimate:
    """``cgx.estimate``'s answer: the exact all-reduce and every policy's prediction;
    ``pays`` and ``advice`` say whether the best of them is worth it. ``str()`` is a table."""

    f32_bytes: int
    exact_seconds: float
    policies: tuple
    step_seconds: float | None
    profile: LinkProfile

    @property
    def best(self) -> PolicyEstimate:
        return max(self.policies, key=lambda p: p.saving)

    @property
    def exact_step(self) -> float:
        """The exact step's predicted seconds: compute (when given) plus the all-reduce."""
        return (self.step_seconds or 0.0) + self.exact_seconds

    @property
    def pays(self) -> bool:
        return self.best.saving > PAYS_FRACTION * self.exact_step

    @property
    def advice(self) -> str:
        best, exact = self.best, self.exact_seconds
        share = (f", {best.saving / self.exact_step:.0%} of a {self.exact_step * 1e3:.0f} ms "
                 f"exact step" if self.step_seconds is not None else "")
        if self.pays:
            return (f"compression pays: {best.name} saves {best.saving * 1e3:.1f} ms of the "
                    f"{exact * 1e3:.1f} ms exact all-reduce per step{share}")
        kernels = self.profile.seconds_per_value * self.f32_bytes / 4
        if best.saving > PAYS_FRACTION * exact:
            why = (f"the step is mostly compute: the exact all-reduce is "
                   f"{exact / self.exact_step:.0%} of it")
        elif kernels > 0.5 * exact:
            why = ("the link is fast next to the kernels: encoding and decoding these values "
                   f"takes about {kernels * 1e3:.1f} ms, what the smaller bytes save on the "
                   f"wire")
        else:
            why = ("the model is small: the all-reduce costs mostly latency, which fewer "
                   "bytes do not shorten")
        return (f"compression will not pay: the exact all-reduce takes {exact * 1e3:.1f} ms "
                f"per step and the best policy ({best.name}) saves "
                f"{max(best.saving, 0) * 1e3:.1f} ms{share}; {why}")

    def __str__(self) -> str:
        lines = [f"{'policy':<22} {'wire bytes':>12} {'x f32':>7} {'all-reduce ms':>14} "
                 f"{'saves ms':>9}"]
        lines.append(f"{'exact (f32 psum)':<22} {self.f32_bytes:>12,} {1:>7.2f} "
                     f"{self.exact_seconds * 1e3:>14.1f} {0:>9.1f}")
        for p in self.policies:
            lines.append(f"{p.name:<22} {p.wire_bytes:>12,} {self.f32_bytes / p.wire_bytes:>7.2f} "
                         f"{p.seconds * 1e3:>14.1f} {p.saving * 1e3:>9.1f}")
        return "\n".join(lines + [self.advice])


def allreduce_sizes(tree, policy: LayerPolicy | None) -> dict:
    """What one participant's gradient all-reduce of ``tree`` carries per step, as
    ``estimate`` counts it (floating array leaves only): ``wire``, the packet bytes of the
    leaves ``policy`` compresses; ``values``, their count; ``buffers``, the codecs in use (one
    fused buffer each); ``exact_bytes`` and ``exact_leaves``, the leaves sent in f32
    (``policy`` None: all of them).

    Example:
        >>> import jax.numpy as jnp, cgx_jax as cgx
        >>> tree = {"w": jnp.zeros((256, 128)), "b": jnp.zeros(128)}
        >>> allreduce_sizes(tree, cgx.LayerPolicy())
        {'wire': 18432, 'values': 32768, 'buffers': 1, 'exact_bytes': 512, 'exact_leaves': 1}
    """
    tree = partition(tree, is_array)[0]
    leaves = jax.tree_util.tree_leaves(tree)
    codecs = policy.resolve_leaves(tree) if policy is not None else [None] * len(leaves)
    sent = [(codec, math.prod(leaf.shape)) for codec, leaf in zip(codecs, leaves)
            if is_compressible(leaf)]
    compressed = [(codec, n) for codec, n in sent if codec is not None]
    exact = [n for codec, n in sent if codec is None]
    return dict(wire=sum(wire_bytes(n, codec) for codec, n in compressed),
                values=sum(n for _, n in compressed),
                buffers=len({codec for codec, _ in compressed}),
                exact_bytes=4 * sum(exact), exact_leaves=len(exact))


def default_policies() -> dict:
    """The policies ``estimate`` compares without ``policies=``: the default layer policy
    (``LayerPolicy()``, 4 bits) and the same leaves at 8 and 2 bits."""
    return {f"{bits} bits": LayerPolicy(default=Codec(bits=bits)) for bits in (8, 4, 2)}


def estimate(tree, link, *, policies: dict | None = None,
             step_seconds: float | None = None) -> Estimate:
    """Predicts what compressing ``tree``'s all-reduce saves per step on a measured link.

    ``tree``: the gradients, parameters or their shapes (``jax.eval_shape`` output), or
    a model as ``cgx.value_and_grad`` takes it (leaves that are not arrays are left out);
    ``link``: a ``LinkProfile`` or the path of the JSON ``python -m cgx_jax.bench link``
    wrote for these processes and network; ``policies``: name -> ``LayerPolicy`` (e.g. a
    ``cgx.fit_policy`` result; default: ``default_policies()``); ``step_seconds``: the
    step's time without its all-reduce (compute), so the verdict weighs the saving against
    the whole step (``bench train``'s ``floor``, or your step timed with ``lax.pmean``
    removed).

    Args:
      tree: the gradients, parameters or shapes, or a model (above).
      link: a ``LinkProfile``, or the path of a saved one.
      policies: name -> ``LayerPolicy`` to compare (default ``default_policies()``).
      step_seconds: the step's compute time, to weigh the saving against.

    Returns:
      An ``Estimate``: per policy its wire bytes, predicted all-reduce seconds and saving,
      and a verdict that says when compression will not pay, and why.

    Raises:
      ValueError: a tree with no floating array, an empty ``policies``, or a
        ``step_seconds`` that is not a finite number >= 0.
      OSError: a profile path that cannot be read.

    Example:
        >>> import jax.numpy as jnp, cgx_jax as cgx
        >>> link = cgx.LinkProfile(processes=4, exact_latency=1e-3, seconds_per_byte=8e-9,
        ...                        compressed_latency=2e-3, seconds_per_wire_byte=8e-9,
        ...                        seconds_per_value=2e-10)
        >>> e = cgx.estimate({"w": jnp.zeros((2048, 2048)), "b": jnp.zeros(2048)}, link)
        >>> e.pays, e.best.name
        (True, '2 bits')
    """
    profile = link if isinstance(link, LinkProfile) else LinkProfile.load(link)
    policies = default_policies() if policies is None else dict(policies)
    if not policies:
        raise ValueError("policies must name at least one cgx.LayerPolicy, got none "
                         "(None compares the defaults: 8, 4 and 2 bits)")
    for name, policy in policies.items():
        check_policy(policy, f"policies[{name!r}]")
    if step_seconds is not None and not (isinstance(step_seconds, (int, float))
                                         and math.isfinite(step_seconds) and step_seconds >= 0):
        raise ValueError(f"step_seconds must be the step's compute time in seconds, a finite "
                         f"number >= 0 (or None), got {step_seconds!r}")
    # Only array leaves have gradients to all-reduce (a model's floats and functions do not).
    tree = partition(tree, is_array)[0]
    leaves = jax.tree_util.tree_leaves(tree)
    floating = [is_compressible(leaf) for leaf in leaves]  # what a gradient all-reduce sends
    if not any(floating):
        raise ValueError(f"tree has no floating array leaf, so there is no all-reduce to "
                         f"estimate (leaves: {[type(leaf).__name__ for leaf in leaves]})")
    f32_bytes = sum(4 * math.prod(leaf.shape) for leaf, f in zip(leaves, floating) if f)
    exact = profile.exact_seconds(f32_bytes, sum(floating))  # lax.psum of the gradient tree
    rows = []
    for name, policy in policies.items():
        sizes = allreduce_sizes(tree, policy)
        seconds = profile.allreduce_seconds(sizes["wire"], sizes["values"], sizes["buffers"],
                                            sizes["exact_bytes"])
        rows.append(PolicyEstimate(name, sizes["wire"] + sizes["exact_bytes"], seconds,
                                   exact - seconds))
    return Estimate(f32_bytes, exact, tuple(rows), step_seconds, profile)
