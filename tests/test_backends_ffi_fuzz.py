"""backends/ffi.py, property-based: the FFI handlers called directly (bypassing the Python
checks) with any combination of sizes, bits, bucket sizes and row counts either match the numpy
model byte for byte (consistent shapes) or fail with an error (inconsistent ones)
(docs/design.md sections 3 and 8). Run under AddressSanitizer/UBSan with tests/sanitize.sh,
they also show no access outside a buffer."""

import jax
import jax.numpy as jnp
import numpy as np
import numpy_model as model
from hypothesis import HealthCheck, given, settings, strategies as st

from cgx_jax._src.backends import ffi

CPU = jax.devices("cpu")[0]
SETTINGS = settings(max_examples=60, deadline=None,
                    suppress_health_check=[HealthCheck.too_slow])


def call(target, outs, *args, **attrs):
    ffi._register()
    attrs = {k: (v if isinstance(v, bool) else np.int64(v)) for k, v in attrs.items()}
    with jax.default_device(CPU):
        result = jax.ffi.ffi_call(target, outs)(*[jax.device_put(a, CPU) for a in args], **attrs)
        return jax.block_until_ready(result)


def sds(shape, dtype):
    return jax.ShapeDtypeStruct(shape, dtype)


def raises(fn):
    try:
        fn()
    except Exception:  # XlaRuntimeError carries the handler's ffi::Error
        return True
    return False


codecs = st.tuples(st.integers(1, 8), st.sampled_from([8, 16, 24, 64, 200]), st.booleans())


@SETTINGS
@given(codec=codecs, rows=st.integers(0, 3), buckets=st.integers(0, 4),
       length_delta=st.sampled_from([0, 0, 0, -8, 8, 1]),
       packet_delta=st.sampled_from([0, 0, 1, -1]),
       seed_len=st.sampled_from([2, 2, 2, 1, 3]), short=st.sampled_from([0, 0, 1, 9, 200]),
       data=st.data())
def test_quantize_matches_model_or_fails(codec, rows, buckets, length_delta, packet_delta,
                                         seed_len, short, data):
    """x's last row is ``short`` values short (read as padding with the last value)."""
    bits, bucket_size, stochastic = codec
    n = max(0, buckets * bucket_size + length_delta)
    short = min(short, rows * n)
    x = np.asarray(data.draw(st.lists(st.floats(-1e6, 1e6, width=32), min_size=rows * n - short,
                                      max_size=rows * n - short)), np.float32)
    seed = np.arange(1, seed_len + 1, dtype=np.uint32)
    pbytes = model.packet_bytes(n, bits, bucket_size) if n % bucket_size == 0 else 0
    out = sds((rows, max(0, pbytes + packet_delta)), jnp.uint8)
    # None: cgx_quantize; a size: cgx_quantize_with_residual, whose residual must be x's.
    residual_size = data.draw(st.sampled_from([None, None, x.size, x.size, x.size + 1,
                                           max(0, x.size - 1)]))
    target, outs = (("cgx_quantize", out) if residual_size is None else
                    ("cgx_quantize_with_residual", (out, sds((residual_size,), jnp.float32))))
    skip_row = data.draw(st.sampled_from([-1, -1, 0, rows - 1, rows, 2**31 - 1]))
    run = lambda: call(target, outs, x, seed, np.int32(skip_row), bits=bits,
                       bucket_size=bucket_size, stochastic=stochastic, n=n)
    consistent = (n % bucket_size == 0 and packet_delta == 0 and seed_len == 2 and
                  (short < n or short == 0) and residual_size in (None, x.size))
    if not consistent:
        # XLA skips a custom call whose outputs are all empty; nothing can be written then.
        if rows * out.shape[1] + (residual_size or 0) > 0:
            assert raises(run)
        return
    got = run() if residual_size is None else run()[0]
    padded = np.concatenate([x, np.repeat(x[-1:], short)]).reshape(rows, n)
    want = model.quantize_rows(padded, seed, bits, bucket_size, stochastic, skip_row)
    np.testing.assert_array_equal(np.asarray(got), want)
    if residual_size is not None:
        want_residual = model.residual_rows(padded, want, bits, bucket_size, skip_row)
        np.testing.assert_array_equal(np.asarray(run()[1]),
                                      want_residual.reshape(-1)[:x.size])

@SETTINGS
@given(codec=codecs, rows=st.integers(1, 3), buckets=st.integers(1, 4),
       packet_delta=st.sampled_from([0, 0, 1, -1, 8]), offset=st.sampled_from([0, 0, 1, 8, -1]),
       divisor=st.sampled_from([1, 1, 3, 4, 0, 2**24 + 1]), data=st.data())
def test_dequantize_of_arbitrary_bytes_matches_model_or_fails(codec, rows, buckets,
                                                              packet_delta, offset, divisor,
                                                              data):
    """Row r's packet is read at byte ``offset`` of rows ``packet_delta`` bytes longer than
    one packet; the values come out times 1 / ``divisor`` (in [1, 2^24], else an error)."""
    bits, bucket_size, _ = codec
    n = buckets * bucket_size
    pbytes = model.packet_bytes(n, bits, bucket_size) + packet_delta
    packets = np.frombuffer(data.draw(st.binary(min_size=rows * pbytes, max_size=rows * pbytes)),
                            np.uint8).reshape(rows, pbytes)
    run = lambda: call("cgx_dequantize", sds((rows, n), jnp.float32), packets, bits=bits,
                       bucket_size=bucket_size, offset=offset, n=n, divisor=divisor)
    # The rows cannot hold a packet at that offset, or the divisor is out of range.
    if not 0 <= offset <= packet_delta or not 1 <= divisor <= 2**24:
        assert raises(run)
        return
    got = np.asarray(run())
    want = model.dequantize_rows(packets[:, offset:offset + pbytes - packet_delta], bits,
                                 bucket_size, n) * (np.float32(1) / np.float32(divisor))
    np.testing.assert_array_equal(np.isnan(got), np.isnan(want))
    np.testing.assert_array_equal(got[~np.isnan(got)], want[~np.isnan(want)])


@SETTINGS
@given(codec=codecs, peers=st.integers(1, 4), buckets=st.integers(1, 3),
       own_index=st.integers(-2, 5), own=st.sampled_from([None, "chunk", "rows", "short rows"]),
       packet_delta=st.sampled_from([0, 0, 1]), sum_delta=st.sampled_from([0, 0, -8, 8]),
       before=st.sampled_from([0, 0, 3, 8]), after=st.sampled_from([0, 5]),
       divisor=st.sampled_from([1, 1, 3, 0]), data=st.data())
def test_reduce_requantize_matches_model_or_fails(codec, peers, buckets, own_index, own,
                                                  packet_delta, sum_delta, before, after,
                                                  divisor, data):
    """The peers' packets sit at byte ``before`` of rows with ``after`` more bytes (junk);
    ``own`` is absent, one chunk, or all rows (the last 3 values short); the sum may be
    8 values short (or 8 too long: an error) and comes out times 1 / ``divisor`` (the
    packet encodes the sum itself)."""
    bits, bucket_size, stochastic = codec
    n = buckets * bucket_size
    pbytes = model.packet_bytes(n, bits, bucket_size)
    chunks = np.asarray(data.draw(st.lists(st.floats(-1e3, 1e3, width=32), min_size=peers * n,
                                           max_size=peers * n)), np.float32).reshape(peers, n)
    packets = model.quantize_rows(chunks, [5, 6], bits, bucket_size, stochastic)
    junk = np.frombuffer(data.draw(st.binary(min_size=peers * 13, max_size=peers * 13)),
                         np.uint8).reshape(peers, 13)
    rows = np.concatenate([junk[:, :before], packets, junk[:, 8:8 + after]], axis=1)
    with_own = own is not None
    all_rows = (chunks * 2).reshape(-1)
    own_values = {None: np.zeros((0,), np.float32), "chunk": chunks[0] * 2, "rows": all_rows,
                  "short rows": all_rows[:-3]}[own]
    # The own chunk the kernel reads: row own_index of all rows padded with their last value.
    padded_rows = np.concatenate([all_rows[:-3], np.repeat(all_rows[-4:-3], 3)])
    own_chunk = {"chunk": chunks[0] * 2, "rows": all_rows.reshape(peers, n),
                 "short rows": padded_rows.reshape(peers, n)}.get(own)
    if own in ("rows", "short rows") and 0 <= own_index < peers:
        own_chunk = own_chunk[own_index]
    seed = np.array([7, 8], np.uint32)
    bad_own = with_own and not 0 <= own_index < peers
    attrs = dict(bits=bits, bucket_size=bucket_size, n=n, offset=before)
    own_args = (rows, own_values, np.int32(own_index))
    with_sum = lambda: call("cgx_reduce_requantize_with_sum",
                            (sds((pbytes + packet_delta,), jnp.uint8),
                             sds((n + sum_delta,), jnp.float32)),
                            *own_args, seed, stochastic=stochastic, **attrs)
    sum_alone = lambda: call("cgx_reduce_sum", sds((n + sum_delta,), jnp.float32), *own_args,
                             divisor=divisor, **attrs)
    if bad_own:  # own_index outside [0, N) with an own chunk
        assert raises(with_sum) and (n + sum_delta == 0 or raises(sum_alone))
        return
    want_packet, want_total = model.reduce_requantize(
        packets, own_chunk, own_index, seed, bits, bucket_size, stochastic, n)
    # A sum 8 short is a short sum, an empty one (n = 8) an error: no output is optional.
    if packet_delta or sum_delta > 0 or n + sum_delta == 0:
        assert raises(with_sum)
    else:
        packet, total = (np.asarray(a) for a in with_sum())
        np.testing.assert_array_equal(packet, want_packet)
        np.testing.assert_array_equal(total, want_total[:n + sum_delta])
    if n + sum_delta == 0:
        return  # XLA drops a call whose only result is empty: nothing runs to fail
    if sum_delta > 0 or divisor < 1:
        assert raises(sum_alone)
        return
    scale = np.float32(1) / np.float32(divisor)
    np.testing.assert_array_equal(np.asarray(sum_alone()), (want_total * scale)[:n + sum_delta])
