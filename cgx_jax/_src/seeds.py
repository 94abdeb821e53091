"""How a JAX PRNG key becomes the ``uint32[2]`` seeds of the kernels' stochastic rounding
(docs/design.md sections 2 and 6).

Every encode of a compressed all-reduce draws its own noise: the step's key is folded with
the fused group's number, then the participant's index, then the segment's number within
the group, then the phase (SRA's and all-gather's two quantizations, the ring's N encodes),
so groups, participants, segments and phases never share a noise stream while every run
with the same key gives the same bytes.

Every other key cgx derives is derived here too, one function per branch of the tree:
``value_and_grad``'s key of a step (``step_key``), of a noise group sharded over other mesh
axes (``shard_group_key``), of an FSDP leaf's gather (``gather_key``) and of each model-axis
block of it (``block_key``), of a gather's gradient (``gradient_key``), the Optax transform's
split (``next_keys``), and each participant's copy of an NNX module's RNG keys
(``participant_key``).
"""

from __future__ import annotations

import warnings

import jax
import jax.numpy as jnp
import numpy as np

from cgx_jax._src.codec import Codec


def seed_bits(key, name: str = "key"):
    """``uint32[2]`` kernel seed from a JAX PRNG key (typed ``jax.random.key`` or legacy
    ``PRNGKey``); ``TypeError`` naming ``name`` for anything else.

    Example:
        >>> import jax
        >>> seed_bits(jax.random.key(0)).dtype
        dtype('uint32')
    """
    _is_typed_key(key, name)  # either kind draws the same bits
    return jax.random.bits(key, (2,), jnp.uint32)


def raw_key(key, name: str = "key"):
    """``key`` (a typed ``jax.random.key`` or a legacy ``PRNGKey``) as a raw ``uint32[2]``
    ``PRNGKey``, which checkpoints like any array; ``None`` gives ``PRNGKey(0)``;
    ``TypeError`` naming ``name`` for anything else.

    Example:
        >>> import jax
        >>> bool((raw_key(jax.random.key(5)) == jax.random.PRNGKey(5)).all())
        True
    """
    if key is None:
        return jax.random.PRNGKey(0)
    return jax.random.key_data(key) if _is_typed_key(key, name) else jnp.asarray(key)


def key_or_deprecated_seed(key, seed, where: str):
    """``key``; for a caller still passing ``seed=`` (an int: the spelling before ``key=``),
    ``jax.random.PRNGKey(seed)``, the noise that spelling gave, with a ``DeprecationWarning``
    naming ``key=``. ``TypeError`` for both, or a seed that is not an int.

    Example:
        >>> import warnings
        >>> with warnings.catch_warnings():
        ...     warnings.simplefilter("ignore", DeprecationWarning)
        ...     old = key_or_deprecated_seed(None, 3, "cgx.value_and_grad")
        >>> bool((old == jax.random.PRNGKey(3)).all())
        True
    """
    if seed is None:
        return key
    if key is not None:
        raise TypeError(f"{where}: pass key= only; seed= is its deprecated spelling, "
                        f"got both (seed={seed!r})")
    if isinstance(seed, bool) or not isinstance(seed, (int, np.integer)):
        raise TypeError(f"{where}: seed must be an int, got {seed!r:.80} of type "
                        f"{type(seed).__name__}; pass key=jax.random.key(seed) instead")
    warnings.warn(f"{where}(seed={seed}) is deprecated and will be removed in a later "
                  f"release: pass key=jax.random.key({seed}), which gives the same noise",
                  DeprecationWarning, stacklevel=3)
    return jax.random.PRNGKey(seed)


def _is_typed_key(key, name: str) -> bool:
    """Whether ``key`` is a typed ``jax.random.key`` (else a raw ``uint32[2]`` ``PRNGKey``);
    ``TypeError`` naming ``name`` when it is neither."""
    if isinstance(key, jax.Array) and jnp.issubdtype(key.dtype, jax.dtypes.prng_key):
        return True
    if isinstance(key, (jax.Array, np.ndarray)) and key.dtype == jnp.uint32 and key.shape == (2,):
        return False
    raise TypeError(
        f"{name} must be a JAX PRNG key (jax.random.key(0) or jax.random.PRNGKey(0)), got "
        f"{key!r:.80} of type {type(key).__name__}")


PASS_A_KEY = ("pass key=jax.random.key(...) (a fresh one each step), or a codec with "
              "rounding='nearest'")


def need_key(codecs, key, paths, what: str, fix: str = PASS_A_KEY) -> None:
    """The one check that stochastic rounding has its noise: a ``ValueError`` when a codec
    of ``codecs`` (one per leaf, None for an exact leaf) is stochastic and ``key`` is None,
    saying ``what`` rounds, the ``fix`` and the leaves (``paths``) it concerns.

    Example:
        >>> need_key([Codec(rounding="nearest")], None, ["w"], "cgx.compressed_psum")
        >>> try:
        ...     need_key([Codec()], None, ["w"], "cgx.compressed_psum")
        ... except ValueError as e:
        ...     print(str(e)[:62])
        cgx.compressed_psum rounds stochastically and needs a PRNG key
    """
    stochastic = [p for p, c in zip(paths, codecs) if c is not None and c.stochastic]
    if stochastic and key is None:
        raise ValueError(f"{what} rounds stochastically and needs a PRNG key: {fix}; leaves "
                         f"rounded stochastically: {stochastic[:8]}")


def rounding_seed(codec: Codec, key):
    """The seed of one encode with ``codec``: from ``key`` for stochastic rounding (which
    needs one), zeros for nearest rounding (which draws no noise)."""
    if codec.stochastic:
        if key is None:
            raise ValueError(
                "stochastic rounding needs a PRNG key: pass key=jax.random.key(...) or use "
                "Codec(rounding='nearest')")
        return seed_bits(key)
    return jnp.zeros((2,), jnp.uint32)


# The FSDP weights' gathers (and their gradients' reduce-scatters) fold this into the step's
# key, apart from the noise groups of the compressed mean (which fold small numbers).
GATHER_STREAM = 0x6A7E


def _fold(key, *data):
    """``key`` folded with each of ``data`` in turn; None stays None (nearest rounding)."""
    if key is None:
        return None
    for d in data:
        key = jax.random.fold_in(key, d)
    return key


def step_key(base_key, step):
    """``value_and_grad``'s key of ``step`` (an integer scalar array).

    Example:
        >>> import jax, jax.numpy as jnp
        >>> step_key(jax.random.PRNGKey(0), jnp.int32(3)).shape
        (2,)
    """
    return _fold(base_key, step.astype(jnp.uint32))


def shard_group_key(key, group_number: int, shard_index):
    """The key of noise group ``group_number`` on the shard ``shard_index`` (its index over
    the other mesh axes that shard it): each distinct shard draws its own noise.

    Example:
        >>> import jax
        >>> shard_group_key(None, 0, 1) is None
        True
    """
    return _fold(key, group_number, shard_index)


def gather_key(key, leaf: int):
    """The key of FSDP leaf ``leaf``'s gather and of its gradient's reduce-scatter.

    Example:
        >>> import jax
        >>> gather_key(jax.random.PRNGKey(0), 2).shape
        (2,)
    """
    return _fold(key, GATHER_STREAM, leaf)


def block_key(key, block_index):
    """The key of one block (``block_index`` over the model axes) of a gathered leaf.

    Example:
        >>> import jax
        >>> block_key(jax.random.PRNGKey(0), 1).shape
        (2,)
    """
    return _fold(key, block_index)


def gradient_key(key):
    """The key of a compressed gather's gradient (its reduce-scatter in the VJP), apart from
    the gather's own.

    Example:
        >>> import jax
        >>> bool((gradient_key(jax.random.PRNGKey(0)) != jax.random.PRNGKey(0)).any())
        True
    """
    return _fold(key, 1)


def next_keys(rng_key):
    """``(the state's next rng_key, this step's key)``: the Optax transform's split, as
    optax's own noisy transformations split theirs.

    Example:
        >>> import jax
        >>> [k.shape for k in next_keys(jax.random.PRNGKey(0))]
        [(2,), (2,)]
    """
    state_key, key = jax.random.split(rng_key)
    return state_key, key


def participant_key(key, index):
    """An NNX module's RNG key as participant ``index`` uses it (its own dropout masks).

    Example:
        >>> import jax
        >>> participant_key(jax.random.key(0), 3).dtype
        key<fry>
    """
    return _fold(key, index)


def phase_seeds(key, group_number: int, participant, segments: int, phases: int):
    """``uint32[segments, phases, 2]``: one seed per segment and quantization phase of one
    participant's reduction of fused group ``group_number``; ``key`` None (nearest rounding)
    gives zeros.

    Example:
        >>> import jax
        >>> phase_seeds(jax.random.key(0), 0, 1, segments=3, phases=2).shape
        (3, 2, 2)
    """
    if key is None:
        return jnp.zeros((segments, phases, 2), jnp.uint32)
    key = jax.random.fold_in(jax.random.fold_in(key, group_number), participant)

    def seed(segment, phase):
        return seed_bits(jax.random.fold_in(jax.random.fold_in(key, segment), phase))

    # One batched hash per level instead of one per segment and phase: the same bits, but a
    # model's 50 segments no longer unroll into hundreds of hashes, which made compiling a
    # ViT's step slow (docs/design.md section 6).
    return jax.vmap(lambda s: jax.vmap(lambda p: seed(s, p))(jnp.arange(phases)))(
        jnp.arange(segments))
