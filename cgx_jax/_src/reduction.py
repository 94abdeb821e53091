"""The compressed reduction of many leaves as a plan and a run (docs/design.md sections 6
and 10): the all-reduce, and the reduce-scatter of ``compressed_psum_scatter``.

``plan_reduction`` decides, from shapes, dtypes and each leaf's codec only, everything static:
which leaves are exact, how the leaves sharing a codec are fused into segments
(``cgx_jax._src.fusion``), how long each segment is for the algorithm, and which segments share
one set of collectives. It runs no JAX operation, so a plan can be inspected and tested as
it is. ``run_plan`` then packs the segments, draws their noise (``cgx_jax._src.seeds``), runs the
collectives (``cgx_jax._src.collectives``) and unpacks the sums, and reduces the exact leaves
through one ``lax.psum`` (their small ones fused into a buffer across CPU processes).
``run_scatter_plan`` does the same for a plan of ``algorithm=REDUCE_SCATTER``.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
from jax import lax

from cgx_jax._src import fusion
from cgx_jax._src.axes import axis_tuple
from cgx_jax._src.backends import get_backend
from cgx_jax._src.codec import Codec
from cgx_jax._src.collectives import (
    REDUCE_SCATTER,
    AllReduceSettings,
    allreduce_segments,
    num_phases,
    padding_multiple,
    reduce_scatter,
    segment_rows,
)
from cgx_jax._src.consistency import installed_version
from cgx_jax._src.seeds import phase_seeds
from cgx_jax._src.vma import to_local


@dataclasses.dataclass(frozen=True)
class Segment:
    """One fused buffer of leaves sharing ``codec``: ``leaves`` are positions in the leaf
    list, ``group`` the codec group's number (its noise stream), ``multiple`` what the
    buffer is padded to, ``size`` the buffer's values (``fusion.pack``), ``length`` the
    values the algorithm sees (``size`` padded to ``multiple``; the kernels pad a single
    leaf's short last row themselves)."""

    codec: Codec
    leaves: tuple[int, ...]
    group: int
    multiple: int
    size: int
    length: int


@dataclasses.dataclass(frozen=True)
class ReductionPlan:
    """Everything static about one compressed all-reduce of a list of leaves.

    ``batches``: the segments (positions in ``segments``) that share one set of collectives:
    all of them for SRA and all-gather, one each for the ring and the hierarchical reduction.
    """

    shapes: tuple[tuple[int, ...], ...]
    dtypes: tuple[str, ...]
    exact: tuple[int, ...]
    segments: tuple[Segment, ...]
    algorithm: str
    num_participants: int
    inner_size: int
    mean: bool

    @property
    def rows(self) -> int | None:
        return segment_rows(self.algorithm, self.num_participants, self.inner_size > 1)

    @property
    def batches(self) -> list[tuple[int, ...]]:
        if self.rows is not None and self.segments:
            return [tuple(range(len(self.segments)))]
        return [(s,) for s in range(len(self.segments))]

    @property
    def divisor(self) -> int:
        return self.num_participants * self.inner_size if self.mean else 1

    @property
    def by_rows(self) -> bool:
        """Whether segments are packed row by row (the reduce-scatter; ``fusion.pack``)."""
        return self.algorithm == REDUCE_SCATTER

    def pack(self, segment: Segment, leaves):
        """The f32 buffer of ``segment`` (``fusion.pack``), as long as the plan says."""
        buf, length = fusion.pack([leaves[i] for i in segment.leaves], segment.codec.bucket_size,
                                  segment.multiple, self.rows, by_rows=self.by_rows)
        assert (buf.size, length) == (segment.size, segment.length), (segment, buf.shape)
        return buf

    def wire_settings(self, operation: str = "compressed all-reduce") -> dict:
        """What shapes this reduction's traffic, for ``check_processes_agree``."""
        return {
            "operation": operation,
            "cgx_jax version": installed_version(),
            "algorithm": self.algorithm,
            "participants (outer, inner)": [self.num_participants, self.inner_size],
            "mean": self.mean,
            "leaves": [f"{dtype}{list(shape)}" for dtype, shape in zip(self.dtypes, self.shapes)],
            "exact leaves": list(self.exact),
            "segments (codec, leaves, values)": [
                [repr(s.codec), list(s.leaves), s.size] for s in self.segments],
        }


def plan_reduction(leaves, codecs, *, algorithm: str, num_participants: int,
                   inner_size: int = 1, mean: bool = False) -> ReductionPlan:
    """The plan of reducing ``leaves`` (anything with ``shape`` and ``dtype``: arrays or
    ``jax.ShapeDtypeStruct``), each with its codec in ``codecs`` (None: exact), over
    ``num_participants`` (times ``inner_size`` devices reduced exactly first, the
    hierarchical reduction) with a resolved ``algorithm``; ``REDUCE_SCATTER``: leaves of
    shape ``[N, ...]``, row j summed onto participant j (``run_scatter_plan``).

    Example:
        >>> import jax, jax.numpy as jnp, cgx_jax as cgx
        >>> c = cgx.Codec(bits=4, bucket_size=64)
        >>> leaves = [jax.ShapeDtypeStruct((1 << 18,), jnp.float32),
        ...           jax.ShapeDtypeStruct((10,), jnp.float32),
        ...           jax.ShapeDtypeStruct((100,), jnp.float32)]
        >>> plan = plan_reduction(leaves, [c, None, c], algorithm="sra", num_participants=4)
        >>> plan.exact, [(s.leaves, s.size, s.length) for s in plan.segments]
        ((1,), [((0,), 262144, 262144), ((2,), 256, 256)])
    """
    by_rows = algorithm == REDUCE_SCATTER
    if by_rows:
        bad = [tuple(leaf.shape) for leaf in leaves
               if not leaf.shape or leaf.shape[0] != num_participants]
        assert not bad and inner_size == 1, (bad, inner_size)  # the callers' rows views
    groups, exact = fusion.group_by_codec(leaves, codecs)
    rows = segment_rows(algorithm, num_participants, hierarchical=inner_size > 1)
    segments = []
    for group, (codec, members) in enumerate(groups.items()):
        multiple = inner_size * padding_multiple(algorithm, codec, num_participants)
        sizes = [math.prod(leaves[i].shape) for i in members]
        for positions in fusion.split_segments(sizes, multiple, rows, by_rows=by_rows):
            size, length = fusion.packed_size([sizes[j] for j in positions], codec.bucket_size,
                                              multiple, rows, by_rows=by_rows)
            segments.append(Segment(codec, tuple(members[j] for j in positions), group,
                                    multiple, size, length))
    return ReductionPlan(
        shapes=tuple(tuple(leaf.shape) for leaf in leaves),
        dtypes=tuple(str(jnp.dtype(leaf.dtype)) for leaf in leaves),
        exact=tuple(exact), segments=tuple(segments), algorithm=algorithm,
        num_participants=num_participants, inner_size=inner_size, mean=mean)


def run_plan(plan: ReductionPlan, leaves, axis_name, *, key, backend: str,
             inner_axis_name=None, with_residual: bool = False):
    """The reduced ``leaves`` (a list, the input's dtypes) and, with ``with_residual``, what this
    participant's own compression lost of each (f32, zero for exact leaves; else None).
    Runs inside ``pmap``/``shard_map`` with the plan's axes bound; ``key`` may be None only
    when no segment rounds stochastically."""
    all_axes = axis_tuple(axis_name) + (() if inner_axis_name is None
                                        else axis_tuple(inner_axis_name))
    out = list(leaves)
    residual = [jnp.zeros(leaf.shape, jnp.float32) for leaf in leaves] if with_residual else None
    if plan.exact:
        reduce_exact = lax.pmean if plan.mean else lax.psum
        for i, value in zip(plan.exact, fusion.reduce_exact(
                reduce_exact, [leaves[i] for i in plan.exact], all_axes,
                fuse=fusion.exact_fusion_pays())):
            out[i] = value
    if not plan.segments:
        return out, residual
    seeds = segment_seeds(plan, key, axis_name, inner_axis_name)
    for batch in plan.batches:
        segments = [plan.segments[s] for s in batch]
        bufs = [plan.pack(segment, leaves) for segment in segments]
        call = AllReduceSettings(axis_name, tuple(s.codec for s in segments), plan.algorithm,
                                 backend, plan.num_participants, with_residual,
                                 inner_axis_name, divisor=plan.divisor)
        totals, residuals = allreduce_segments(bufs, seeds[batch[0]:batch[-1] + 1], call,
                                            tuple(s.length for s in segments))
        for segment, total, error in zip(segments, totals, residuals):
            shapes = [leaves[i].shape for i in segment.leaves]
            values = fusion.unpack(total, shapes, segment.codec.bucket_size)
            for i, value in zip(segment.leaves, values):
                out[i] = value.astype(leaves[i].dtype)
            if with_residual:
                for i, value in zip(segment.leaves, fusion.unpack(
                        error, shapes, segment.codec.bucket_size)):
                    residual[i] = value
    return out, residual


def segment_seeds(plan: ReductionPlan, key, axis_name, inner_axis_name=None):
    """``uint32[segments, phases, 2]``, the segments in plan order: each codec group its own
    stream, each device its own noise (zeros for nearest rounding; any ``key`` may be None
    when no segment rounds stochastically)."""
    participant = None
    if key is not None:
        participant = lax.axis_index(axis_name)
        if inner_axis_name is not None:
            participant = participant * plan.inner_size + lax.axis_index(inner_axis_name)
    phases = num_phases(plan.algorithm, plan.num_participants)
    seeds = []
    for group in sorted({s.group for s in plan.segments}):
        members = [s for s in plan.segments if s.group == group]
        seeds.append(phase_seeds(key if members[0].codec.stochastic else None, group,
                                 participant, len(members), phases))
    return jnp.concatenate(seeds)


def run_scatter_plan(plan: ReductionPlan, leaves, axis_name, *, key, backend: str):
    """The reduce-scatter of a ``REDUCE_SCATTER`` plan: ``leaves`` ``[N, ...]`` -> this
    participant's ``[...]`` of each (a list, the input's dtypes), the sum over participants
    of their row ``index``: exact leaves through ``lax.psum_scatter``, the segments through
    ``sra.reduce_scatter`` (peers' rows decoded, the own row raw, f32 sums in participant
    order). Typed varying over ``axis_name`` as ``lax.psum_scatter``'s result; under
    ``jax.grad`` it is the exact ``lax.psum_scatter`` (straight-through)."""
    out = [None] * len(leaves)
    for i in plan.exact:
        out[i] = lax.psum_scatter(leaves[i], axis_name, scatter_dimension=0, tiled=False)
    if not plan.segments:
        return out
    seeds = segment_seeds(plan, key, axis_name, None)
    bufs = [plan.pack(segment, leaves) for segment in plan.segments]
    chunks = _scatter_segments(bufs, seeds, plan, axis_name, backend)
    for segment, chunk in zip(plan.segments, chunks):
        shapes = [leaves[i].shape[1:] for i in segment.leaves]
        for i, value in zip(segment.leaves, fusion.unpack(chunk, shapes,
                                                          segment.codec.bucket_size)):
            out[i] = value.astype(leaves[i].dtype)
    return out


@functools.partial(jax.custom_jvp, nondiff_argnums=(2, 3, 4))
def _scatter_segments(bufs, seeds, plan: ReductionPlan, axis_name, backend: str):
    """This participant's f32 chunk of each segment's compressed reduce-scatter, typed
    varying (the kernels' outputs carry no axis type)."""
    chunks = reduce_scatter(bufs, tuple(s.length for s in plan.segments), axis_name,
                            lax.axis_index(axis_name), plan.num_participants, seeds,
                            tuple(s.codec for s in plan.segments), get_backend(backend))
    return to_local(chunks, axis_name)


@_scatter_segments.defjvp
def _scatter_segments_jvp(plan, axis_name, backend, primals, tangents):
    # Straight-through: the derivative is the exact reduce-scatter of the tangents, whose
    # transpose is the exact all-gather, as for lax.psum_scatter.
    bufs, seeds = primals
    chunks = _scatter_segments(bufs, seeds, plan, axis_name, backend)
    tangent = [lax.psum_scatter(t.reshape(plan.num_participants, -1), axis_name,
                                scatter_dimension=0, tiled=False) for t in tangents[0]]
    return chunks, tangent
