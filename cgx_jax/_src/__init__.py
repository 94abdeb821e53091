"""cgx_jax's implementation. Nothing here is API: import what ``cgx_jax`` exports (its
``__all__``), run ``cgx_jax.launch`` and ``cgx_jax.bench``; modules under ``_src`` change
without notice (docs/design.md section 6 says what is public and stable)."""
