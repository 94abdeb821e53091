"""Compressed all-reduce of one flat f32 buffer, built only from ``lax`` collectives
(docs/design.md section 4). It runs inside ``pmap``/``shard_map`` with the axes bound; the
kernels never communicate, XLA moves every byte.

One module per algorithm (``sra``, ``allgather``, ``ring``, ``hierarchical``), the CPU
cross-process transport in ``transport``, the one use of JAX internals in ``jax_compat``.
Each flat algorithm takes buffers already padded for it (``padding_multiple``; SRA and
all-gather a list of segments sharing their collectives, the ring one buffer), this
participant's index, seeds (one ``uint32[2]`` pair per quantization phase, per segment) and
a backend (``cgx_jax._src.backends``), and returns the f32 sums and, with ``with_residual=True``,
what this participant's own compression lost (the input minus what its peers decoded of
it; error feedback adds it to the next step's gradient), else ``None``. A ``divisor``
above 1 (``compressed_pmean``) scales the sums by ``f32(1/divisor)`` in the kernel that
writes them.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Hashable

import jax
import jax.numpy as jnp
from jax import lax

from cgx_jax._src.axes import axis_tuple
from cgx_jax._src.backends import get_backend
from cgx_jax._src.codec import Codec
from cgx_jax._src.collectives.allgather import allgather_reduce
from cgx_jax._src.collectives.hierarchical import hierarchical_reduce
from cgx_jax._src.collectives.ring import ring_reduce
from cgx_jax._src.collectives.sra import reduce_scatter, scatter_reduce_allgather


def _ring_segments(bufs, lengths, axis_name, index, num_participants, seeds, codecs, backend,
                   with_residual=False, divisor=1):
    """The ring in the segments' calling convention; it takes one segment."""
    del lengths  # the ring's one buffer is padded whole
    (buf,), (seeds,), (codec,) = bufs, seeds, codecs
    total, residual = ring_reduce(buf, axis_name, index, num_participants, seeds, codec, backend,
                               with_residual=with_residual, divisor=divisor)
    return [total], (None if residual is None else [residual])


@dataclasses.dataclass(frozen=True)
class Algorithm:
    """How one flat algorithm lays out and reduces its segments.

    ``chunked``: it splits a segment into one whole-bucket chunk per participant (SRA, the
    ring), so segments pad to ``bucket_size * N``; else to ``bucket_size``. ``rows(N)``: the
    rows the kernels view each segment as when several segments of any codecs share one set
    of collectives (SRA N chunks, all-gather one packet), or None when it takes one padded
    buffer per codec. ``phases(N)``: the seed pairs it consumes (one per quantization). ``run``
    takes ``(bufs, lengths, axis_name, index, N, seeds, codecs, backend, with_residual=,
    divisor=)`` and returns ``(sums, residuals or None)``, one per segment.
    """

    chunked: bool
    rows: Callable[[int], int | None]
    phases: Callable[[int], int]
    run: Callable


REGISTRY = {
    "sra": Algorithm(chunked=True, rows=lambda n: n, phases=lambda n: 2,
                     run=scatter_reduce_allgather),
    "allgather": Algorithm(chunked=False, rows=lambda n: 1, phases=lambda n: 2,
                           run=allgather_reduce),
    # The ring encodes N times: the raw chunk, then the partial sum after each of N-1 hops.
    "ring": Algorithm(chunked=True, rows=lambda n: None, phases=lambda n: max(n, 2),
                      run=_ring_segments),
}
ALGORITHMS = (*REGISTRY, "auto")

# The compressed reduce-scatter (``compressed_psum_scatter``) is planned like the all-reduce
# algorithms: SRA's first half, its segments N rows of whole buckets (row j of every leaf
# side by side, ``fusion.pack(by_rows=True)``), one quantization. Its ``run`` is
# ``sra.reduce_scatter``: each participant's chunk of each segment, no residuals.
REDUCE_SCATTER = "reduce_scatter"
LAYOUTS = {**REGISTRY, REDUCE_SCATTER: Algorithm(chunked=True, rows=lambda n: n,
                                                 phases=lambda n: 1, run=reduce_scatter)}


def resolve_algorithm(algorithm: str, num_participants: int) -> str:
    """``"auto"``: all-gather for N <= 2 participants, SRA otherwise.

    At N = 2 both move one packet per participant, but all-gather quantizes once instead of
    twice (less error) and runs one collective instead of two; from N = 3 on all-gather moves
    N-1 packets against SRA's 2(N-1)/N, so SRA wins on bytes. The ring moves as many bytes as
    SRA but in N-1 dependent steps and with more error, so "auto" never picks it.

    Example:
        >>> resolve_algorithm("auto", 2), resolve_algorithm("auto", 8)
        ('allgather', 'sra')
    """
    if algorithm == "auto":
        return "allgather" if num_participants <= 2 else "sra"
    return algorithm


def num_phases(algorithm: str, num_participants: int) -> int:
    """How many seed pairs a (resolved) algorithm consumes.

    Example:
        >>> num_phases("sra", 8), num_phases("ring", 8)
        (2, 8)
    """
    return LAYOUTS[algorithm].phases(num_participants)


def padding_multiple(algorithm: str, codec: Codec, num_participants: int) -> int:
    """What a (resolved) algorithm's segments are padded to: whole buckets, one chunk per
    participant for SRA and the ring.

    Example:
        >>> padding_multiple("sra", Codec(bucket_size=64), 4)
        256
    """
    chunks = num_participants if LAYOUTS[algorithm].chunked else 1
    return codec.bucket_size * chunks


@dataclasses.dataclass(frozen=True)
class AllReduceSettings:
    """Everything static about one all-reduce of fused segments: ``codecs`` one per segment
    (SRA and all-gather carry segments of several codecs in one set of collectives; the ring
    and the hierarchical reduction take one segment), ``algorithm`` is resolved (not
    "auto"), ``num_participants`` is the size of ``axis_name`` (the outer axis when
    ``inner_axis_name`` is set). The sums come out scaled by ``f32(1/divisor)`` (``divisor``:
    the number of all participants for a mean, else 1) by the kernel that writes them, so a
    mean costs no extra pass over the result."""

    axis_name: Hashable
    codecs: tuple[Codec, ...]
    algorithm: str
    backend: str
    num_participants: int
    with_residual: bool
    inner_axis_name: Hashable = None
    divisor: int = 1

    @property
    def all_axes(self):
        """Every axis the sum runs over."""
        if self.inner_axis_name is None:
            return self.axis_name
        return axis_tuple(self.axis_name) + axis_tuple(self.inner_axis_name)


def segment_rows(algorithm: str, num_participants: int, hierarchical: bool) -> int | None:
    """The rows the kernels view each segment as, whose last may be short (SRA N chunks,
    all-gather one), when large leaves travel as segments of their own
    (``fusion.split_segments``) and several segments share the collectives; None for the
    ring and the hierarchical reduction, which take one padded buffer.

    Example:
        >>> segment_rows("sra", 4, hierarchical=False), segment_rows("ring", 4, False)
        (4, None)
    """
    return None if hierarchical else LAYOUTS[algorithm].rows(num_participants)


def _reduce_flat(bufs, lengths, seeds, settings: AllReduceSettings, index):
    """The flat algorithm of ``settings`` over ``settings.axis_name`` -> (sums, residuals or
    None), one per segment."""
    return REGISTRY[settings.algorithm].run(
        bufs, lengths, settings.axis_name, index, settings.num_participants, seeds,
        settings.codecs, get_backend(settings.backend), with_residual=settings.with_residual,
        divisor=settings.divisor)


@functools.partial(jax.custom_jvp, nondiff_argnums=(2, 3))
def allreduce_segments(bufs, seeds, settings: AllReduceSettings, lengths: tuple):
    """The compressed sums (scaled for ``settings.divisor``) of the segments ``bufs`` (a list of
    flat f32 buffers; ``seeds uint32[segments, phases, 2]``) over ``settings.all_axes`` ->
    ``(f32 sums, local compression residuals)``, lists like ``bufs`` (the residuals empty arrays
    without ``with_residual``); differentiable as an exact ``psum`` (or ``pmean``; straight-
    through). ``lengths``
    are the lengths the algorithm sees, padded for it: a buffer is that long, or (with
    ``segment_rows``) short within its last row (``fusion.pack``). More than one segment
    needs ``segment_rows``."""
    index = lax.axis_index(settings.axis_name)
    if settings.inner_axis_name is None:
        totals, residuals = _reduce_flat(bufs, lengths, seeds, settings, index)
    else:
        (buf,) = bufs

        def reduce_outer(piece):
            (total,), residuals = _reduce_flat([piece], (piece.size,), seeds, settings, index)
            return total, (None if residuals is None else residuals[0])

        total, residual = hierarchical_reduce(buf, settings.inner_axis_name, reduce_outer)
        totals, residuals = [total], (None if residual is None else [residual])
    if residuals is None:
        residuals = [jnp.zeros((0,), jnp.float32) for _ in bufs]
    return totals, residuals


@allreduce_segments.defjvp
def _allreduce_segments_jvp(settings, lengths, primals, tangents):
    # Straight-through: the derivative of a (compressed) sum is the exact sum of tangents,
    # whose transpose is again a psum, so jax.grad works through compressed_psum.
    bufs, seeds = primals
    totals, residuals = allreduce_segments(bufs, seeds, settings, lengths)
    # Under shard_map both are typed invariant over the reduced axes (the algorithms end in
    # an invariant gather), so jax.grad of a per-participant loss counts it once, as for psum.
    tangent = lax.psum(list(tangents[0]), settings.all_axes)
    if settings.divisor != 1:
        tangent = [t / jnp.float32(settings.divisor) for t in tangent]
    return (totals, residuals), (tangent, [jnp.zeros_like(e) for e in residuals])
