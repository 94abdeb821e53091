"""The convergence benchmark's image task: scikit-learn's bundled handwritten digits (1,797
8x8 images, no download) under Gaussian pixel noise, classified by ``bench train``'s ViT.

Clean digits saturate (the ViT example's exact, 4-bit and adaptive runs all end at 97.59%),
so they cannot show what compression costs. Here every training image gets fresh noise of
standard deviation ``noise`` (in units of the normalised pixels) each time it is drawn, and
the held-out images one fixed draw: the model cannot memorise the noise, and the held-out
accuracy stays well below 100% while the loss flattens. The split (70/30, stratified) is
the ViT example's.
"""

from __future__ import annotations

import numpy as np

SPLIT_SEED = 0  # the train/test split, as examples/vit/data.py
HELD_OUT_NOISE_SEED = 1234  # the held-out images' one noise draw, the same in every run
CLASSES = 10


def load(noise: float) -> tuple[tuple, tuple, str]:
    """``((x_train, y_train), (x_held_out, y_held_out), description)``: NHWC float32 images
    normalised with the training set's mean and deviation, the held-out ones with their
    fixed noise added; int32 labels."""
    try:
        from sklearn.datasets import load_digits
        from sklearn.model_selection import train_test_split
    except ImportError:  # pragma: no cover - depends on the environment
        raise SystemExit("--task digits needs scikit-learn: pip install scikit-learn") from None
    digits = load_digits()
    x = (digits.images / 16.0).astype(np.float32)[..., None]
    x_train, x_test, y_train, y_test = train_test_split(
        x, digits.target.astype(np.int32), test_size=0.3, random_state=SPLIT_SEED,
        stratify=digits.target)
    mean, std = x_train.mean(), x_train.std()
    x_train, x_test = (x_train - mean) / std, (x_test - mean) / std
    x_test = x_test + noise * np.random.default_rng(HELD_OUT_NOISE_SEED).standard_normal(
        x_test.shape).astype(np.float32)
    description = (f"scikit-learn digits, Gaussian pixel noise of {noise:g} standard "
                   f"deviations (fresh per training draw, fixed for held out): "
                   f"{len(x_train)} training, {len(x_test)} held-out images")
    return (x_train, y_train), (x_test.astype(np.float32), y_test), description


def train_batch(train: tuple, step: int, batch: int, noise: float, seed: int) -> tuple:
    """The images and labels of ``step``: epochs of a shuffled order drawn from ``(seed,
    epoch)``, fresh noise drawn from ``(seed, step)``."""
    x, y = train
    per_epoch = len(x) // batch
    epoch, index = divmod(step, per_epoch)
    order = np.random.default_rng([seed, epoch]).permutation(len(x))
    rows = order[index * batch:(index + 1) * batch]
    noisy = x[rows] + noise * np.random.default_rng([seed, step, 1]).standard_normal(
        x[rows].shape).astype(np.float32)
    return noisy.astype(np.float32), y[rows]
