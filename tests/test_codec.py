"""codec.py: Codec checks its arguments, and each error names the argument and the value
(docs/design.md sections 2 and 8). Packet sizes and the padding rule are checked by codec.py's
doctests and through the packets the kernels and the public quantize write
(test_backends_ffi.py, test_api.py)."""

import pytest

from cgx_jax._src.codec import Codec


@pytest.mark.parametrize("kwargs,name", [
    (dict(bits=0), "bits"), (dict(bits=9), "bits"), (dict(bits=-1), "bits"),
    (dict(bits=4.5), "bits"), (dict(bits="4"), "bits"), (dict(bits=True), "bits"),
    (dict(bucket_size=0), "bucket_size"), (dict(bucket_size=-8), "bucket_size"),
    (dict(bucket_size=7), "bucket_size"), (dict(bucket_size=12), "bucket_size"),
    (dict(bucket_size=2**40), "bucket_size"), (dict(bucket_size=64.0), "bucket_size"),
    (dict(rounding="up"), "rounding"), (dict(rounding=None), "rounding"),
], ids=lambda v: repr(v) if isinstance(v, dict) else None)
def test_invalid_codec_arguments_raise(kwargs, name):
    with pytest.raises((ValueError, TypeError), match=name) as info:
        Codec(**kwargs)
    assert repr(next(iter(kwargs.values()))) in str(info.value)  # the value is named too
