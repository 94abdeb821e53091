"""seeds.py (docs/design.md section 6, "Keys and noise"): the kernel seeds of every segment
and phase follow the documented folding of the key, and deriving them does not grow the
program with the number of segments."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from cgx_jax._src.seeds import phase_seeds, seed_bits


def folded(key, group, participant, segment, phase):
    """The documented derivation of one seed, one fold at a time."""
    for data in (group, participant, segment, phase):
        key = jax.random.fold_in(key, data)
    return np.asarray(seed_bits(key))


@pytest.mark.parametrize("key", [jax.random.key(3), jax.random.PRNGKey(11)],
                         ids=["typed", "legacy"])
def test_seeds_follow_the_documented_folding(key):
    got = np.asarray(jax.jit(lambda k, p: phase_seeds(k, 2, p, segments=5, phases=3))(
        key, jnp.int32(1)))
    assert got.shape == (5, 3, 2) and got.dtype == np.uint32
    for segment in range(5):
        for phase in range(3):
            np.testing.assert_array_equal(got[segment, phase], folded(key, 2, 1, segment, phase))
    assert len({tuple(s) for s in got.reshape(-1, 2)}) == 15  # no two phases share a seed


def test_program_size_does_not_grow_with_segments():
    # One batched hash per fold, not one per segment and phase: a model's 50 segments had
    # unrolled into hundreds of hashes (a ViT-S gradient tree compiled 4x slower).
    def lowered(segments):
        return jax.jit(lambda k: phase_seeds(k, 0, 1, segments, 2)).lower(
            jax.random.key(0)).as_text()

    assert len(lowered(64)) < 1.1 * len(lowered(2))


def test_the_entry_points_take_an_optax_style_key():
    """key= (typed or raw) as optax's noisy transformations take it, kept raw in the state as
    rng_key; key(s) gives PRNGKey(s)'s bits; anything else is a TypeError naming key."""
    import cgx_jax as cgx

    params = {"w": jnp.zeros((4, 4))}
    typed = cgx.compressed_allreduce("batch", key=jax.random.key(7)).init(params)
    raw = cgx.compressed_allreduce("batch", key=jax.random.PRNGKey(7)).init(params)
    default = cgx.compressed_allreduce("batch").init(params)
    assert typed.rng_key.dtype == jnp.uint32 and typed.rng_key.shape == (2,)
    np.testing.assert_array_equal(typed.rng_key, raw.rng_key)
    np.testing.assert_array_equal(default.rng_key, jax.random.PRNGKey(0))
    for make in (lambda k: cgx.compressed_allreduce("batch", key=k),
                 lambda k: cgx.value_and_grad(lambda w, x: 0.0, mesh=jax.make_mesh(
                     (1,), ("data",), devices=jax.devices()[:1]), axis_name="data", key=k)):
        with pytest.raises(TypeError, match=r"key must be a JAX PRNG key .* got 7"):
            make(7)


def test_the_deprecated_seed_still_works_warns_and_gives_the_same_noise():
    """seed=s, the spelling before key=, keeps working for a release: a DeprecationWarning
    naming key=jax.random.key(s), and bitwise what key=jax.random.key(s) gives (the state's
    rng_key; value_and_grad's compressed gradients). Both at once, or a seed that is not an
    int, is a TypeError."""
    import cgx_jax as cgx

    params = {"w": jnp.zeros((4, 4))}
    with pytest.warns(DeprecationWarning, match=r"compressed_allreduce\(seed=5\) is deprecated"
                                                r".*key=jax\.random\.key\(5\)"):
        old = cgx.compressed_allreduce("batch", seed=5).init(params)
    new = cgx.compressed_allreduce("batch", key=jax.random.key(5)).init(params)
    np.testing.assert_array_equal(old.rng_key, new.rng_key)
    assert not np.array_equal(new.rng_key, jax.random.PRNGKey(0))

    mesh = jax.make_mesh((8,), ("data",), devices=jax.devices()[:8])
    w = jnp.linspace(-1.0, 1.0, 128 * 128).reshape(128, 128)
    x = jnp.cos(jnp.arange(16 * 128.0)).reshape(16, 128)
    loss = lambda w, x: jnp.mean(jnp.tanh(x @ w) ** 2)  # noqa: E731
    with pytest.warns(DeprecationWarning, match=r"value_and_grad\(seed=5\)"):
        old_fn = cgx.value_and_grad(loss, mesh=mesh, axis_name="data", seed=5)
    fns = {"old": old_fn}
    for name, key in (("new", 5), ("other", 6)):
        fns[name] = cgx.value_and_grad(loss, mesh=mesh, axis_name="data",
                                       key=jax.random.key(key))
    grads = {name: np.asarray(jax.jit(fn)(w, x, step=jnp.int32(2))[1])
             for name, fn in fns.items()}
    assert grads["old"].tobytes() == grads["new"].tobytes()
    assert grads["old"].tobytes() != grads["other"].tobytes()  # the key reaches the noise

    with pytest.raises(TypeError, match=r"pass key= only.*got both \(seed=1\)"):
        cgx.compressed_allreduce("batch", key=jax.random.key(1), seed=1)
    with pytest.raises(TypeError, match=r"seed must be an int, got 'a' of type str"):
        cgx.value_and_grad(loss, mesh=mesh, axis_name="data", seed="a")
