"""adaptive/ (measure.py, fit.py, schedule.py), adaptive layer-wise compression (docs/design.md
section 7): layer_errors measures the real codec, the fit_policy dynamic program (knapsack)
against brute force, the fit on a ViT-like block's gradients, adaptive training with refits
on 8 devices, and bad arguments."""

import dataclasses
import itertools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from models import NUM_DEVICES, LinenBlock, init_params, loss_fn, replicate, tail_loss, teacher_data

import cgx_jax as cgx
from cgx_jax._src.adaptive.fit import knapsack

CPU = jax.devices("cpu")

CHOICES = (2, 3, 4, 5, 6, 8)


def random_table(rng, leaves, choices, bucket_size=64, integer_errors=False):
    """A table of random leaf sizes, the real packet bytes, and random errors and squares."""
    sizes = [int(s) for s in rng.integers(1, 40, leaves) * bucket_size // 2]
    nbytes = [[cgx.wire_bytes(n, cgx.Codec(bits=b, bucket_size=bucket_size)) for b in choices]
              for n in sizes]
    if integer_errors:
        errors = rng.integers(0, 30, (leaves, len(choices))).astype(np.float32)
    else:
        errors = rng.uniform(0, 1, (leaves, len(choices))).astype(np.float32)
    squares = rng.uniform(0.1, 10, leaves) * np.asarray(sizes)
    return cgx.ErrorTable([f"layer{i}/kernel" for i in range(leaves)], sizes,
                          jnp.asarray(errors), nbytes, choices, bucket_size,
                          squares=jnp.asarray(squares, jnp.float32))


def byte_budget(table, bits):
    return sum(-(-n // table.bucket_size) * (8 + table.bucket_size * bits / 8)
               for n in table.sizes)


def assignments(table):
    return itertools.product(table.choices, repeat=len(table.paths))


# ---------------------------------------------------------------------------
# layer_errors
# ---------------------------------------------------------------------------

def test_layer_errors_measures_the_real_codec():
    k1, k2 = jax.random.split(jax.random.key(1))
    grads = {"a": jax.random.normal(k1, (10, 50)), "b": jax.random.normal(k2, (3, 64)),
             "bias": jnp.ones(50), "steps": jnp.arange(4)}
    base = cgx.LayerPolicy(min_size=0)
    table = cgx.layer_errors(grads, (2, 5), 64, base=base)  # eager, as jitted below
    assert table.paths == ("a", "b") and table.sizes == (500, 192)
    for i, name in enumerate(table.paths):
        for j, bits in enumerate(table.choices):
            codec = cgx.Codec(bits=bits, bucket_size=64, rounding="nearest")
            x = grads[name]
            y = cgx.dequantize(cgx.quantize(x, codec), codec, x.shape)
            np.testing.assert_allclose(table.errors[i, j], jnp.sum((x - y) ** 2), rtol=1e-5)
            assert table.bytes[i, j] == cgx.wire_bytes(x.size, codec)
        np.testing.assert_allclose(table.squares[i], np.sum(np.square(grads[name])), rtol=1e-5)
    jitted = jax.jit(lambda g: cgx.layer_errors(g, (2, 5), 64, base=base))(grads)
    # The same codec bytes; XLA may sum the squared errors in another order under jit (on a
    # GPU it does), so the f32 sums agree to rounding, not to the bit.
    np.testing.assert_allclose(np.asarray(jitted.errors), np.asarray(table.errors), rtol=1e-6)
    assert jitted.bytes.tolist() == table.bytes.tolist()


# ---------------------------------------------------------------------------
# The dynamic program
# ---------------------------------------------------------------------------

def test_knapsack_is_optimal_against_brute_force():
    rng = np.random.default_rng(0)
    for _ in range(40):
        rows, cols = rng.integers(4, 7), rng.integers(3, 5)
        values = rng.uniform(0, 1, (rows, cols))
        costs = rng.integers(0, 30, (rows, cols))
        capacity = int(rng.integers(0, 30 * rows))
        feasible = [(values[range(rows), a].sum(), a)
                    for a in itertools.product(range(cols), repeat=rows)
                    if costs[range(rows), a].sum() <= capacity]
        chosen = knapsack(values, costs, capacity)
        if not feasible:
            assert chosen is None
            continue
        assert costs[range(rows), chosen].sum() <= capacity
        np.testing.assert_allclose(values[range(rows), chosen].sum(), min(feasible)[0],
                                   rtol=1e-12)


@pytest.mark.parametrize("budget_bits", [2.5, 3, 4, 5.5])
def test_fit_error_objective_matches_brute_force(budget_bits):
    rng = np.random.default_rng(int(2 * budget_bits))
    for _ in range(12):
        table = random_table(rng, rng.integers(4, 7), tuple(sorted(rng.choice(
            CHOICES, rng.integers(3, 5), replace=False))))
        if budget_bits < table.choices[0]:
            continue
        limit = byte_budget(table, budget_bits)
        best = min(table.cost(a)[0] for a in assignments(table) if table.cost(a)[1] <= limit)
        slack = int(limit) - int(table.bytes.min(axis=1).sum())
        # One byte per cell: the rounding is exact, so the DP is the true optimum.
        exact = cgx.fit_policy(table, error="squared", budget_bits=budget_bits,
                               cells=max(slack, 1))
        error, nbytes = table.cost(table.bits_of(exact))
        assert nbytes <= limit
        np.testing.assert_allclose(error, best, rtol=1e-6)
        # The default 2000 cells: still within the budget, and never worse than uniform.
        coarse = cgx.fit_policy(table, error="squared", budget_bits=budget_bits, cells=50)
        error, nbytes = table.cost(table.bits_of(coarse))
        assert nbytes <= limit and error >= best * (1 - 1e-6)
        if budget_bits in table.choices:
            assert error <= table.cost(int(budget_bits))[0] * (1 + 1e-6)


@pytest.mark.parametrize("budget_bits", [3, 4, 5])
def test_fit_bytes_objective_matches_brute_force(budget_bits):
    rng = np.random.default_rng(budget_bits)
    for _ in range(12):
        table = random_table(rng, rng.integers(4, 7), (2, 3, 4, 5, 6)[:rng.integers(4, 6)],
                             integer_errors=True)
        errors = table.host_errors()
        limit = errors[:, table.choices.index(budget_bits)].sum()
        best = min(table.cost(a)[1] for a in assignments(table) if table.cost(a)[0] <= limit)
        slack = int(limit - errors.min(axis=1).sum())
        # Integer errors and one error unit per cell: exact rounding, the true optimum.
        fitted = cgx.fit_policy(table, error="squared", budget_bits=budget_bits,
                                objective="bytes", cells=max(slack, 1))
        error, nbytes = table.cost(table.bits_of(fitted))
        assert error <= limit and nbytes == best
        coarse = cgx.fit_policy(table, error="squared", budget_bits=budget_bits,
                                objective="bytes", cells=7)
        error, nbytes = table.cost(table.bits_of(coarse))
        assert error <= limit and best <= nbytes <= table.cost(budget_bits)[1]


@pytest.mark.parametrize("budget_bits", [3, 4, 5.5])
def test_fit_relative_error_matches_brute_force(budget_bits):
    """error="relative" (the default) minimises each leaf's squared error over its mean
    square, computed here in numpy; a leaf of zeros counts nothing."""
    rng = np.random.default_rng(int(10 * budget_bits))
    for _ in range(12):
        table = random_table(rng, rng.integers(4, 7), (2, 3, 4, 8))
        squares = rng.uniform(0.01, 100, len(table.paths)) ** 2
        squares[0] = 0.0
        table = cgx.ErrorTable(table.paths, table.sizes, table.errors, table.bytes,
                               table.choices, table.bucket_size, squares=jnp.asarray(squares))
        relative = table.host_errors() * np.asarray(table.sizes)[:, None] / np.where(
            squares > 0, squares, np.inf)[:, None]
        limit = byte_budget(table, budget_bits)
        rows = np.arange(len(table.paths))

        def cost(bits):
            return relative[rows, [table.choices.index(b) for b in bits]].sum()

        best = min(cost(a) for a in assignments(table) if table.cost(a)[1] <= limit)
        slack = int(limit) - int(table.bytes.min(axis=1).sum())
        fitted = cgx.fit_policy(table, budget_bits=budget_bits, cells=max(slack, 1))
        assert table.cost(table.bits_of(fitted))[1] <= limit
        np.testing.assert_allclose(cost(table.bits_of(fitted)), best, rtol=1e-6)
        assert table.bits_of(fitted)[0] == table.choices[0]  # zeros: the fewest bits


def test_relative_error_ignores_a_leaf_s_scale_and_squared_follows_it():
    """Two leaves of one shape of distribution, 100x apart: relative gives both the same
    bits, squared gives the large one more; a table without squares warns and fits squared."""
    k1, k2 = jax.random.split(jax.random.key(0))
    grads = {"a": jax.random.normal(k1, (64, 64)), "b": 0.01 * jax.random.normal(k2, (64, 64))}
    base = cgx.LayerPolicy(min_size=0)
    table = cgx.layer_errors(grads, bucket_size=256, base=base)
    relative = table.bits_of(cgx.fit_policy(table, budget_bits=4, base=base))
    squared = table.bits_of(cgx.fit_policy(table, budget_bits=4, base=base, error="squared"))
    assert relative == (4, 4) and squared[0] > 4 > squared[1]
    bare = cgx.ErrorTable(table.paths, table.sizes, table.errors, table.bytes, table.choices,
                          table.bucket_size)
    with pytest.warns(UserWarning, match="no squares"):
        assert table.bits_of(cgx.fit_policy(bare, budget_bits=4, base=base)) == squared
    with pytest.raises(ValueError, match="error"):
        cgx.fit_policy(table, budget_bits=4, error="absolute")
    with pytest.raises(ValueError, match="error"):
        cgx.AdaptiveConfig(error="absolute")


def test_fit_is_monotone_in_the_budget_and_never_worse_than_uniform():
    rng = np.random.default_rng(7)
    for _ in range(5):
        table = random_table(rng, 30, CHOICES)
        previous = np.inf
        for budget_bits in np.arange(2.0, 8.01, 0.25):
            fitted = cgx.fit_policy(table, error="squared", budget_bits=float(budget_bits))
            error, nbytes = table.cost(table.bits_of(fitted))
            assert nbytes <= byte_budget(table, budget_bits)
            assert error <= previous * (1 + 1e-6)
            if budget_bits in CHOICES:
                assert error <= table.cost(int(budget_bits))[0] * (1 + 1e-6)
            previous = error


# ---------------------------------------------------------------------------
# A real model's gradients
# ---------------------------------------------------------------------------

@jax.jit
def vit_block_grads():
    """Gradients of a regression loss on random data, at initialisation (one program)."""
    model = LinenBlock()
    kx, ky = jax.random.split(jax.random.key(3))
    x, y = jax.random.normal(kx, (32, 64)), jax.random.normal(ky, (32, 10))
    params = model.init(jax.random.key(0), x[:1])["params"]
    return jax.grad(lambda p: jnp.mean((model.apply({"params": p}, x) - y) ** 2))(params)


def test_fitted_policy_beats_uniform_4_bit_on_a_vit_block():
    grads = vit_block_grads()
    base = cgx.LayerPolicy(min_size=0)
    table = jax.jit(lambda g: cgx.layer_errors(g, base=base))(grads)
    fitted = cgx.fit_policy(table, error="squared", budget_bits=4, base=base)
    # The same from the gradients.
    assert fitted == cgx.fit_policy(grads, error="squared", budget_bits=4, base=base)
    bits = table.bits_of(fitted)
    error, nbytes = table.cost(bits)
    uniform_error, uniform_bytes = table.cost(4)
    lean = cgx.fit_policy(table, error="squared", budget_bits=4, base=base, objective="bytes")
    lean_error, lean_bytes = table.cost(table.bits_of(lean))
    print(f"\nViT-like block, {len(bits)} compressed leaves {table.paths}")
    print(f"  uniform 4 bit:         error {uniform_error:.4e}  bytes {uniform_bytes}")
    print(f"  fitted (min error):    error {error:.4e}  bytes {nbytes}  bits {bits}")
    print(f"  fitted (min bytes):    error {lean_error:.4e}  bytes {lean_bytes}  "
          f"bits {table.bits_of(lean)}")
    print(cgx.summary(fitted, grads))
    assert nbytes <= uniform_bytes and error < uniform_error
    assert lean_error <= uniform_error and lean_bytes < uniform_bytes
    # The summary shows the chosen bits; exact leaves stay exact.
    rows = {line.split()[0]: line for line in cgx.summary(fitted, grads).splitlines()}
    assert table.bucket_size == cgx.Codec().bucket_size  # candidates bucket as the default
    for path, b in zip(table.paths, bits):
        assert f"{b} bit/{table.bucket_size} stochastic" in rows[path]
    assert "exact" in rows["qkv/bias"]


# ---------------------------------------------------------------------------
# Training with refits on 8 simulated devices
# ---------------------------------------------------------------------------

def small_policy():
    return cgx.LayerPolicy(default=cgx.Codec(bits=4, bucket_size=64), min_size=256)


def adaptive_train(config, steps):
    """The loop of refit_policy's docstring: refit when due, one step function per policy."""
    base = small_policy()
    compiled = {}

    def step_for(policy):
        if policy not in compiled:
            tx = optax.chain(cgx.compressed_allreduce("batch", policy=policy, adaptive=config),
                             optax.sgd(0.2, momentum=0.9))

            def step(params, state, x, y):
                loss, grads = jax.value_and_grad(loss_fn)(params, x, y)
                updates, state = tx.update(grads, state, params)
                return optax.apply_updates(params, updates), state, jax.lax.pmean(loss, "batch")
            compiled[policy] = (tx, jax.pmap(step, axis_name="batch", devices=CPU[:NUM_DEVICES]))
        return compiled[policy]

    policy = base
    params = replicate(init_params())
    state = jax.pmap(step_for(policy)[0].init, devices=CPU[:NUM_DEVICES])(params)
    x, y = teacher_data()
    losses, step_bytes, policies = [], [], []
    for i in range(steps):
        if config.due(i):
            policy = cgx.refit_policy(state, config, base=policy)
            policies.append(policy)
        params, state, loss = step_for(policy)[1](params, state, x, y)
        losses.append(float(loss[0]))  # waits on each step (rendezvous hazard)
        step_bytes.append(wire_total(policy))
    return np.array(losses), np.array(step_bytes), policies, state, len(compiled)


def wire_total(policy):
    return int(cgx.summary(policy, init_params()).splitlines()[-1].split()[1])


def test_adaptive_training_matches_uniform_4_bit_at_fewer_bytes():
    # At budget_bits=4 the fit of this two-matrix model is uniform 4 bit (identical losses);
    # at 3.5 bits-equivalent it picks 3 and 4 bits, 11% fewer bytes per step. Measured over
    # 120 steps: tail loss 0.024496 against 0.024503 for uniform 4 bit.
    steps = 120
    config = cgx.AdaptiveConfig(budget_bits=3.5, every=40, warmup=10, bucket_size=64)
    losses, step_bytes, policies, state, compiled = adaptive_train(config, steps)

    tx = optax.chain(cgx.compressed_allreduce("batch", policy=small_policy()),
                     optax.sgd(0.2, momentum=0.9))
    params = replicate(init_params())
    opt_state = jax.pmap(tx.init, devices=CPU[:NUM_DEVICES])(params)
    x, y = teacher_data()
    step = jax.pmap(lambda p, s, x, y: _sgd_step(tx, p, s, x, y), axis_name="batch",
                    devices=CPU[:NUM_DEVICES])
    uniform = []
    for _ in range(steps):
        params, opt_state, loss = step(params, opt_state, x, y)
        uniform.append(float(loss[0]))
    uniform_bytes = wire_total(small_policy())

    print(f"\nadaptive training: refits at {[i for i in range(steps) if config.due(i)]}, "
          f"{compiled} compiled step functions, bits per refit "
          f"{[[c.bits for _, c in p.overrides] for p in policies]}")
    print(f"  tail loss adaptive {tail_loss(losses):.6f} (bytes/step {step_bytes[0]} before "
          f"the first refit, {step_bytes[-1]} after), uniform 4 bit {tail_loss(uniform):.6f} "
          f"(bytes/step {uniform_bytes})")
    assert compiled <= 1 + len(policies)
    assert step_bytes.max() <= uniform_bytes and step_bytes[-1] < uniform_bytes
    assert tail_loss(losses) <= 1.005 * tail_loss(uniform), (tail_loss(losses),
                                                             tail_loss(uniform))
    # Every replica holds the same (all-reduced) statistics, and the window is counted.
    errors = np.asarray(state[0].adaptive.table.errors)
    assert errors.shape == (NUM_DEVICES, 2, len(config.choices))
    for replica in errors[1:]:
        np.testing.assert_array_equal(replica, errors[0])
    assert np.all(np.asarray(state[0].adaptive.steps) == steps)


def _sgd_step(tx, params, state, x, y):
    loss, grads = jax.value_and_grad(loss_fn)(params, x, y)
    updates, state = tx.update(grads, state, params)
    return optax.apply_updates(params, updates), state, jax.lax.pmean(loss, "batch")


@pytest.mark.parametrize("sample_every", [1, 2])
def test_window_mean_by_value_across_window_boundaries(sample_every):
    # The state's error table after each update is the mean of the all-reduced per-step
    # tables of the sampled updates since the window began (docs/design.md section 7),
    # computed here independently: warmup 2, every 3, so the windows are updates {0, 1},
    # {2, 3, 4}, {5, 6, 7}; one in two sampled: {0}, {2, 4}, {5, 7}.
    config = cgx.AdaptiveConfig(every=3, warmup=2, choices=(2, 4, 8), bucket_size=256,
                                sample_every=sample_every)
    base = cgx.LayerPolicy(min_size=0)
    tx = cgx.compressed_allreduce("batch", policy=base, adaptive=config)
    keys = jax.random.split(jax.random.key(3), 8)
    # Per update: two participants with different gradients, scaled so every step differs.
    grads = [{"w": (t + 1.0) * jax.random.normal(k, (2, 32, 64))} for t, k in enumerate(keys)]
    update = jax.pmap(tx.update, axis_name="batch", devices=jax.devices("cpu")[:2])
    state = jax.pmap(tx.init, devices=jax.devices("cpu")[:2])({"w": jnp.zeros((2, 32, 64))})
    measure = jax.jit(lambda g: cgx.layer_errors(g, config.choices, config.bucket_size,
                                                 base=base).errors)
    per_step = [np.mean([np.asarray(measure({"w": g["w"][p]}), np.float64) for p in range(2)],
                        axis=0) for g in grads]
    window_of = [-1 if t < config.warmup else (t - config.warmup) // config.every
                 for t in range(len(grads))]
    start = {w: window_of.index(w) for w in window_of}
    for t, g in enumerate(grads):
        _, state = update(g, state)
        members = [u for u in range(t + 1) if window_of[u] == window_of[t]
                   and (u - start[window_of[u]]) % sample_every == 0]
        want = np.mean([per_step[u] for u in members], axis=0)
        got = np.asarray(state.adaptive.table.errors[0], np.float64)
        np.testing.assert_allclose(got, want, rtol=1e-5, err_msg=f"after update {t}")
    assert [t for t in range(9) if config.due(t)] == [2, 5, 8]
    # No warmup: the first refit after the first `every` updates, never before any update
    # (step 0 has no statistics to refit from).
    assert [t for t in range(12) if cgx.AdaptiveConfig(warmup=0, every=5).due(t)] == [5, 10]


def test_default_state_has_no_adaptive_statistics():
    state = cgx.compressed_allreduce("batch").init(init_params())
    assert state.adaptive is None and len(jax.tree.leaves(state)) == 1


# ---------------------------------------------------------------------------
# A time budget on a measured link (Kimad)
# ---------------------------------------------------------------------------

def a_link(latency=2e-3, per_byte=1e-6, per_value=2e-9):
    """A link of ``per_byte`` seconds per byte (1e-6: about a millisecond per KB), and a
    latency per codec (each codec in use is one more buffer) that a byte budget ignores."""
    return cgx.LinkProfile(processes=4, exact_latency=1e-3, seconds_per_byte=per_byte,
                           compressed_latency=latency, seconds_per_wire_byte=per_byte,
                           seconds_per_value=per_value)


def model_seconds(table, link, bits):
    """The all-reduce time of per-leaf ``bits``, written out from the link model (design.md
    section 11): a latency per codec, per wire byte, per value, and the exact psum."""
    nbytes = sum(int(table.bytes[i, table.choices.index(b)]) for i, b in enumerate(bits))
    exact = (link.exact_latency + link.seconds_per_byte * table.exact_bytes
             if table.exact_bytes else 0.0)
    return (link.compressed_latency * len(set(bits)) + link.seconds_per_wire_byte * nbytes
            + link.seconds_per_value * sum(table.sizes) + exact)


def with_exact_bytes(table, exact_bytes):
    return cgx.ErrorTable(table.paths, table.sizes, table.errors, table.bytes, table.choices,
                          table.bucket_size, exact_bytes, squares=table.squares)


def test_time_budget_fit_matches_brute_force_and_beats_every_uniform_width_that_fits():
    rng = np.random.default_rng(11)
    link, checked = a_link(), 0
    for _ in range(10):
        table = with_exact_bytes(random_table(rng, rng.integers(3, 6), (2, 3, 4, 8)),
                                 int(rng.integers(0, 2000)))
        times = {a: model_seconds(table, link, a) for a in assignments(table)}
        # Quantiles, and half a byte's time short of three assignments' (where rounding the
        # byte limit up instead of down would fit one that overruns).
        some = [list(times)[int(i)] for i in rng.integers(0, len(times), 3)]
        for budget in [*np.quantile(sorted(times.values()), [0.05, 0.3, 0.6, 0.9]),
                       *(times[a] - 0.5 * link.seconds_per_wire_byte for a in some)]:
            feasible = [table.cost(a)[0] for a, t in times.items() if t <= budget]
            # Enough cells for one per byte: the DP is exact, so the result is the optimum.
            fitted = cgx.fit_policy(table, error="squared", time_budget=float(budget), link=link,
                                    cells=int(table.bytes.sum()))
            bits = table.bits_of(fitted)
            assert model_seconds(table, link, bits) <= budget * (1 + 1e-12)
            np.testing.assert_allclose(table.cost(bits)[0], min(feasible), rtol=1e-6)
            for width in table.choices:
                if model_seconds(table, link, [width] * len(table.paths)) <= budget:
                    assert table.cost(bits)[0] <= table.cost(width)[0] * (1 + 1e-6)
            checked += 1
    assert checked == 70


def test_time_budget_fit_of_gradients_fits_what_estimate_predicts():
    """From a gradient tree: the exact leaves' psum counts against the budget, and the fitted
    policy's all-reduce, as cgx.estimate predicts it, fits; a tighter budget buys fewer
    bits, a looser one more."""
    keys = jax.random.split(jax.random.key(3), 3)
    grads = {"big": jax.random.normal(keys[0], (256, 256)),
             "small": 0.01 * jax.random.normal(keys[1], (128, 128)),
             "bias": jax.random.normal(keys[2], (4096,))}
    base = cgx.LayerPolicy(min_size=1024)  # bias: 1-D, exact
    link = a_link(per_byte=2e-8)  # uniform 2 bits: 3.9 ms, 4 bits: 4.3 ms, 8 bits: 5.1 ms
    table = cgx.layer_errors(grads, CHOICES, 1024, base=base)
    assert table.paths == ("big", "small") and table.exact_bytes == 4 * 4096
    means = []
    for budget in (4.2e-3, 4.6e-3, 5.2e-3):
        fitted = cgx.fit_policy(grads, time_budget=budget, link=link, base=base)
        predicted = cgx.estimate(grads, link, policies={"fitted": fitted}).policies[0].seconds
        assert predicted <= budget, (budget, predicted)
        bits = table.bits_of(fitted)
        means.append(np.average(bits, weights=table.sizes))
        assert fitted.resolve(grads)["bias"] is None
    assert means[0] < means[1] < means[2], means


def test_a_time_budget_no_policy_meets_gets_the_fastest_policy_and_a_warning():
    table = with_exact_bytes(random_table(np.random.default_rng(5), 4, (2, 4, 8)), 4000)
    link = a_link()
    fastest = model_seconds(table, link, [2] * 4)
    with pytest.warns(UserWarning, match=r"no policy meets time_budget=.* the fastest \(every "
                                         r"candidate at 2 bits\) takes .* ms over"):
        fitted = cgx.fit_policy(table, error="squared", time_budget=0.5 * fastest, link=link)
    assert table.bits_of(fitted) == (2, 2, 2, 2)


def test_a_refit_under_a_time_budget_follows_the_link_it_is_given():
    """AdaptiveConfig(time_budget=...): each refit fits the window's error table to the
    budget on the link as last measured; a link 4x slower per byte (with less latency) gets
    fewer bits, and the
    same link the same policy as fit_policy gives."""
    config = cgx.AdaptiveConfig(time_budget=4.6e-3, every=5, warmup=1)
    base = cgx.LayerPolicy(min_size=1024)
    tx = cgx.compressed_allreduce("batch", policy=base, adaptive=config)
    keys = jax.random.split(jax.random.key(4), 2)
    grads = {"big": jax.random.normal(keys[0], (2, 256, 256)),
             "small": 0.01 * jax.random.normal(keys[1], (2, 128, 128))}
    state = jax.pmap(tx.init)(grads)
    _, state = jax.pmap(tx.update, axis_name="batch")(grads, state)
    fast, slow = a_link(per_byte=2e-8), a_link(per_byte=8e-8, latency=1e-4)
    table = state.adaptive.table
    bits = {}
    for name, link in (("fast", fast), ("slow", slow)):
        refit = cgx.refit_policy(state, config, base=base, link=link)
        assert refit == cgx.fit_policy(table, time_budget=4.6e-3, link=link, base=base)
        bits[name] = np.average(table.bits_of(refit), weights=table.sizes)
    assert bits["slow"] < bits["fast"], bits
    with pytest.raises(ValueError, match="time_budget needs link="):
        cgx.refit_policy(state, config, base=base)
    with pytest.raises(ValueError, match="give one budget"):
        cgx.AdaptiveConfig(budget_bits=4, time_budget=0.01)
    with pytest.raises(ValueError, match="time_budget must be the all-reduce's seconds"):
        cgx.AdaptiveConfig(time_budget=-1)


def synthetic_steps(watch, policy, rates, compute=0.1, noise=0.05, seed=0):
    """Step times of ``policy`` on a link whose per-byte cost is ``rate`` times the
    watch's starting one, with up to ``noise`` relative jitter on the whole step."""
    rng = np.random.default_rng(seed)
    start = watch.link
    rate_free = cgx.LinkProfile(**{**start.__dict__, "seconds_per_byte": 0.0,
                                   "seconds_per_wire_byte": 0.0})
    latency_part = cgx.estimate(watch.tree, rate_free, policies={"p": policy}).policies[0].seconds
    byte_part = cgx.estimate(watch.tree, start, policies={"p": policy}).policies[0].seconds \
        - latency_part
    return [(compute + latency_part + rate * byte_part) * (1 + rng.uniform(-noise, noise))
            for rate in rates]


def test_the_link_watch_refits_when_the_rate_changes_and_not_for_noise():
    """1 Gbit/s-like link, then 5x slower, then back: no change flagged while the rate holds
    (5% jitter), one flagged within a window of each change, the new rate within 10%, and
    the refit to a time budget gives fewer bits while it is slow."""
    params = {"w1": jnp.zeros((2048, 2048)), "w2": jnp.zeros((2048, 1024)),
              "b": jnp.zeros(2048)}  # 4 bits: 3.2 MB, 26 ms at 8 ns per byte
    link = a_link(per_byte=8e-9, latency=1e-3)
    policy = cgx.LayerPolicy()
    watch = cgx.LinkWatch(link, params, tolerance=0.25, window=10)
    rates = [1.0] * 40 + [5.0] * 40 + [1.0] * 40
    changes = []
    for step, seconds in enumerate(synthetic_steps(watch, policy, rates, compute=0.05)):
        if watch.observe(seconds, policy):  # True once per window that moved the rate
            changes.append((step, watch.link.seconds_per_wire_byte / link.seconds_per_wire_byte))
    assert [step for step, _ in changes] == [49, 89], changes  # the first full window after
    assert abs(changes[0][1] - 5.0) < 0.5 and abs(changes[1][1] - 1.0) < 0.1, changes
    # What the loop then does: refit to a 90 ms all-reduce on the link as estimated.
    table = cgx.layer_errors(jax.tree.map(lambda p: jax.random.normal(jax.random.key(0),
                                                                      p.shape), params))
    slow = cgx.LinkProfile(**{**link.__dict__, "seconds_per_byte": 5 * link.seconds_per_byte,
                              "seconds_per_wire_byte": 5 * link.seconds_per_wire_byte})
    bits = [np.average(table.bits_of(cgx.fit_policy(table, time_budget=0.09, link=profile)),
                       weights=table.sizes) for profile in (link, slow)]
    assert bits[1] < bits[0], bits


def test_steps_faster_than_the_calibration_are_no_estimate_or_a_recovery():
    """Steps that come out faster than the calibrated compute (the first window ran slow,
    as a first run often does) leave no time for the all-reduce: on the profiled link that
    is no measurement of the rate, not a free link (which would refit to the widest
    codecs); after a slowdown it says the link recovered, back to the profile's rate."""
    params = {"w": jnp.zeros((1024, 1024))}
    link, policy = a_link(per_byte=8e-9), cgx.LayerPolicy()
    watch = cgx.LinkWatch(link, params, window=5)
    times = synthetic_steps(watch, policy, [1.0] * 5, compute=0.2, seed=1)
    times += synthetic_steps(watch, policy, [1.0] * 10, compute=0.1, seed=2)
    assert not any(watch.observe(t, policy) for t in times)
    assert watch.link == link and not watch.changed

    watch = cgx.LinkWatch(link, params, window=5)
    times = synthetic_steps(watch, policy, [1.0] * 5 + [5.0] * 5, compute=0.2, seed=3)
    times += synthetic_steps(watch, policy, [1.0] * 5, compute=0.1, seed=4)
    assert [step for step, t in enumerate(times) if watch.observe(t, policy)] == [9, 14]
    assert watch.link == dataclasses.replace(link, description=watch.link.description)


def test_probes_re_estimate_the_rate_against_the_profile(cpu_devices):
    """Timed exact psums of 1 MB: a 5x slower link is seen at the first probe and a
    recovery at the first probe after it; 10% and 5% jitter are not; the estimate is the
    probe's rate over the profile's, whatever the estimate before."""
    params = {"w": jnp.zeros((1024, 1024))}
    link = a_link(per_byte=8e-9, latency=1e-3)
    watch = cgx.LinkWatch(link, params, tolerance=0.25)
    rates = [1.0, 1.1, 0.95, 5.0, 5.2, 4.9, 1.0, 1.05]
    rng = np.random.default_rng(0)
    probes = [(1e-3 + 8e-9 * 1e6 * rate) * (1 + rng.uniform(-0.05, 0.05)) for rate in rates]
    flagged = [i for i, seconds in enumerate(probes) if watch.observe_probe(seconds, 10**6)]
    assert flagged == [3, 6], flagged
    assert watch.link.seconds_per_wire_byte / link.seconds_per_wire_byte == pytest.approx(
        (probes[6] - 1e-3) / 8e-3)
    assert not watch.observe_probe(5e-4, 10**6)  # faster than the latency: no news
    with pytest.raises(ValueError, match="seconds must be a finite number > 0"):
        watch.observe_probe(0.0, 10**6)
    with pytest.raises(ValueError, match="nbytes must be an int >= 1, got 0"):
        watch.observe_probe(1.0, 0)
    # probe() runs a real psum: on a profile claiming 1e-15 s per byte any time is slower.
    fast = cgx.LinkProfile(processes=4, exact_latency=0.0, seconds_per_byte=1e-15,
                           compressed_latency=0.0, seconds_per_wire_byte=1e-15,
                           seconds_per_value=0.0)
    watch = cgx.LinkWatch(fast, params)
    mesh = jax.make_mesh((4,), ("d",), devices=cpu_devices[:4])
    assert watch.probe(mesh, "d", values=4096) and watch.link.seconds_per_wire_byte > 1e-12
    with pytest.raises(ValueError, match="axis_name 'x' is not an axis of the mesh"):
        watch.probe(mesh, "x")
    with pytest.raises(ValueError, match="repeats must be an int >= 1, got 0"):
        watch.probe(mesh, "d", repeats=0)


def test_a_kernel_bound_profile_with_no_per_wire_byte_cost_is_watched():
    """fit_profile sets seconds_per_wire_byte to exactly 0 when 2- and 8-bit calls take the
    same time: probes and steps still rescale the exact per-byte cost (was a
    ZeroDivisionError), and ``slowdown`` says by how much."""
    link = cgx.LinkProfile(processes=4, exact_latency=1e-3, seconds_per_byte=8e-9,
                           compressed_latency=1e-3, seconds_per_wire_byte=0.0,
                           seconds_per_value=2e-10)
    watch = cgx.LinkWatch(link, {"w": jnp.zeros(4)})
    assert watch.observe_probe(0.05, 10**6)  # (0.05 - 1e-3) / 8e-3: 6.125x slower
    assert watch.slowdown == pytest.approx(6.125)
    assert watch.link.seconds_per_byte == pytest.approx(6.125 * 8e-9)
    assert watch.link.seconds_per_wire_byte == 0.0 and "rate x0.16" in watch.link.description
    assert not watch.observe_probe(0.05, 10**6)  # the same rate again: no change
    assert watch.observe_probe(9e-3, 10**6) and watch.slowdown == pytest.approx(1.0)
    # Steps: an exact leaf's bytes carry the rate.
    params = {"w": jnp.zeros((1024, 1024)), "b": jnp.zeros(1 << 20)}
    steps = cgx.LinkWatch(link, params, window=5)
    policy = cgx.LayerPolicy()
    times = synthetic_steps(steps, policy, [1.0] * 5 + [4.0] * 5, noise=0.0)
    assert [i for i, t in enumerate(times) if steps.observe(t, policy)] == [9]
    assert steps.slowdown == pytest.approx(4.0)


def test_a_probe_at_the_latency_says_nothing_and_changes_nothing():
    """A probe that took exactly the exact latency measures a rate of 0: no estimate."""
    link = a_link(per_byte=8e-9, latency=1e-3)
    watch = cgx.LinkWatch(link, {"w": jnp.zeros(4)})
    assert not watch.observe_probe(link.exact_latency, 10**6)
    assert watch.link == link and watch.slowdown == 1.0 and not watch.changed
    assert watch.observe_probe(link.exact_latency + 2 * 8e-3, 10**6)  # then 2x slower
    assert watch.slowdown == pytest.approx(2.0)


def test_probe_reports_the_fastest_of_its_psums_in_bytes(cpu_devices, monkeypatch):
    """probe() hands observe_probe the fastest of ``repeats`` timed psums (a hiccup is not
    the link) and the bytes each participant sent (4 per f32 value), not the values."""
    import time

    watch = cgx.LinkWatch(a_link(per_byte=8e-9), {"w": jnp.zeros(4)})
    mesh = jax.make_mesh((4,), ("d",), devices=cpu_devices[:4])
    watch.probe(mesh, "d", values=4096)  # compiles and caches the psum
    (key, (psum, x)), = watch._probes.items()
    delays = iter([0.3, 0.02, 0.3])

    def slow_psum(value):
        time.sleep(next(delays))
        return psum(value)

    watch._probes[key] = (slow_psum, x)
    seen = []
    monkeypatch.setattr(watch, "observe_probe", lambda s, n: seen.append((s, n)) or False)
    assert watch.probe(mesh, "d", values=4096, repeats=3) is False
    (seconds, nbytes), = seen
    assert nbytes == 4 * 4096
    assert 0.02 <= seconds < 0.25, seconds
    assert watch.last_probe_seconds >= 0.62


def test_link_watches_fed_the_same_numbers_decide_alike_and_check_arguments():
    params = {"w": jnp.zeros((1024, 1024))}
    link, policy = a_link(per_byte=8e-9), cgx.LayerPolicy()
    watches = [cgx.LinkWatch(link, params, window=5) for _ in range(2)]
    times = synthetic_steps(watches[0], policy, [1.0] * 5 + [3.0] * 10, seed=3)
    decisions = [[w.observe(t, policy) for t in times] for w in watches]
    assert decisions[0] == decisions[1] and any(decisions[0])
    assert watches[0].link == watches[1].link
    with pytest.raises(ValueError, match="tolerance must be a number in"):
        cgx.LinkWatch(link, params, tolerance=1.5)
    with pytest.raises(ValueError, match="window must be an int >= 3"):
        cgx.LinkWatch(link, params, window=2)
    with pytest.raises(TypeError, match="link must be a cgx.LinkProfile"):
        cgx.LinkWatch("link.json", params)
    with pytest.raises(ValueError, match="step_seconds must be a finite number > 0"):
        watches[0].observe(float("nan"), policy)


def test_time_budget_arguments_are_checked(tmp_path):
    table = random_table(np.random.default_rng(0), 3, (2, 4, 8))
    link = a_link()
    with pytest.raises(ValueError, match="give one budget: budget_bits=4 .* time_budget=0.01"):
        cgx.fit_policy(table, budget_bits=4, time_budget=0.01, link=link)
    with pytest.raises(ValueError, match="time_budget needs link="):
        cgx.fit_policy(table, time_budget=0.01)
    with pytest.raises(ValueError, match="link= is only taken with time_budget="):
        cgx.fit_policy(table, link=link)
    for bad in (0, -1.0, float("nan"), True, "1"):
        with pytest.raises(ValueError, match="time_budget must be the all-reduce's seconds"):
            cgx.fit_policy(table, time_budget=bad, link=link)
    with pytest.raises(ValueError, match="objective='error'"):
        cgx.fit_policy(table, time_budget=0.01, link=link, objective="bytes")
    with pytest.raises(TypeError, match="link must be a cgx.LinkProfile or the path"):
        cgx.fit_policy(table, time_budget=0.01, link={"processes": 4})
    path = tmp_path / "link.json"
    link.save(str(path))
    assert (cgx.fit_policy(table, error="squared", time_budget=0.01, link=str(path))
            == cgx.fit_policy(table, error="squared", time_budget=0.01, link=link))


# ---------------------------------------------------------------------------
# Bad arguments
# ---------------------------------------------------------------------------

def test_bad_arguments_raise_clear_errors():
    table = random_table(np.random.default_rng(0), 3, (2, 4, 8))
    with pytest.raises(ValueError, match="budget_bits must be between the smallest choice 2"):
        cgx.fit_policy(table, budget_bits=1.5)
    with pytest.raises(ValueError, match="budget_bits must be a number of bits"):
        cgx.fit_policy(table, budget_bits="4")
    with pytest.raises(ValueError, match="budget_bits must be one of the choices"):
        cgx.fit_policy(table, budget_bits=3, objective="bytes")
    with pytest.raises(ValueError, match="choices must be a non-empty sequence"):
        cgx.fit_policy(table, choices=(2, 2, 4))
    with pytest.raises(ValueError, match="choices must be a non-empty sequence"):
        cgx.layer_errors({"w": jnp.zeros((4, 64))}, choices=(0, 4))
    with pytest.raises(ValueError, match=r"choices \(3,\) are not all in the table's"):
        cgx.fit_policy(table, choices=(3,))
    with pytest.raises(ValueError, match="bucket_size 1024 differs from the table's 64"):
        cgx.fit_policy(table, bucket_size=1024)
    with pytest.raises(ValueError, match="objective must be one of"):
        cgx.fit_policy(table, objective="speed")
    with pytest.raises(ValueError, match="every must be an int >= 1"):
        cgx.AdaptiveConfig(every=0)
    with pytest.raises(ValueError, match="sample_every must be an int >= 1, got 0"):
        cgx.AdaptiveConfig(sample_every=0)
    with pytest.raises(ValueError, match="bucket_size must be"):
        cgx.AdaptiveConfig(bucket_size=12)
    with pytest.raises(TypeError, match="adaptive must be a cgx_jax.AdaptiveConfig"):
        cgx.compressed_allreduce("batch", adaptive=4)
    nan_table = cgx.ErrorTable(table.paths, table.sizes, table.errors.at[0, 0].set(jnp.nan),
                               table.bytes, table.choices, table.bucket_size)
    with pytest.raises(ValueError, match="NaN or infinite errors"):
        cgx.fit_policy(nan_table)
    config = cgx.AdaptiveConfig()
    fresh = cgx.compressed_allreduce("batch", adaptive=config).init(
        {"w": jnp.zeros((256, 256))})
    with pytest.raises(ValueError, match="no error statistics yet"):
        cgx.refit_policy(fresh, config)
    with pytest.raises(TypeError, match="expected an ErrorTable"):
        cgx.refit_policy(optax.EmptyState(), config)
