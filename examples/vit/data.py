"""Datasets for the ViT example, as NHWC float32 images normalised with training-set
statistics and int32 labels.

- ``digits``: scikit-learn's bundled handwritten digits (1,797 8x8 grayscale images, no
  download), split once into train and test with a fixed seed (the same split for every run).
- ``cifar10``: the standard CIFAR-10 python batches (``data_batch_1`` .. ``data_batch_5``,
  ``test_batch``) read from a local folder.
"""

from __future__ import annotations

import dataclasses
import os
import pickle

import numpy as np

CIFAR10_FILES = tuple(f"data_batch_{i}" for i in range(1, 6)) + ("test_batch",)
SPLIT_SEED = 0  # the train/test split of digits; independent of the training seed


@dataclasses.dataclass
class Dataset:
    name: str
    x_train: np.ndarray  # (n, height, width, channels) float32
    y_train: np.ndarray  # (n,) int32
    x_test: np.ndarray
    y_test: np.ndarray
    num_classes: int

    @property
    def image_size(self) -> int:
        return self.x_train.shape[1]

    @property
    def channels(self) -> int:
        return self.x_train.shape[3]


def _normalise(x_train, x_test):
    axes = (0, 1, 2)  # per channel
    mean = x_train.mean(axis=axes, keepdims=True)
    std = x_train.std(axis=axes, keepdims=True) + 1e-6
    return ((x_train - mean) / std).astype(np.float32), ((x_test - mean) / std).astype(np.float32)


def load_digits(test_fraction: float = 0.3) -> Dataset:
    try:
        from sklearn.datasets import load_digits as sk_load_digits
        from sklearn.model_selection import train_test_split
    except ImportError:  # pragma: no cover - depends on the environment
        raise SystemExit("the digits dataset needs scikit-learn: pip install scikit-learn "
                         "(or pip install -e '.[examples]')") from None
    digits = sk_load_digits()
    x = (digits.images / 16.0).astype(np.float32)[..., None]  # (1797, 8, 8, 1)
    y = digits.target.astype(np.int32)
    x_train, x_test, y_train, y_test = train_test_split(
        x, y, test_size=test_fraction, random_state=SPLIT_SEED, stratify=y)
    x_train, x_test = _normalise(x_train, x_test)
    return Dataset("digits", x_train, y_train, x_test, y_test, 10)


def _read_cifar_batch(path):
    with open(path, "rb") as f:
        batch = pickle.load(f, encoding="bytes")
    data = np.asarray(batch[b"data"], dtype=np.uint8).reshape(-1, 3, 32, 32).transpose(0, 2, 3, 1)
    return data, np.asarray(batch[b"labels"], dtype=np.int32)


def load_cifar10(data_dir: str | None) -> Dataset:
    """Reads the CIFAR-10 python version (``cifar-10-python.tar.gz``, extracted). ``data_dir``
    may be the ``cifar-10-batches-py`` folder itself or the folder that contains it."""
    if not data_dir:
        raise SystemExit("--dataset cifar10 needs --data-dir PATH: a folder with the CIFAR-10 "
                         f"python batches ({', '.join(CIFAR10_FILES)})")
    candidates = [data_dir, os.path.join(data_dir, "cifar-10-batches-py")]
    folder = next((d for d in candidates
                   if all(os.path.isfile(os.path.join(d, f)) for f in CIFAR10_FILES)), None)
    if folder is None:
        missing = [f for f in CIFAR10_FILES if not os.path.isfile(os.path.join(data_dir, f))]
        raise SystemExit(
            f"CIFAR-10 python batches not found in {data_dir!r} (nor in its "
            f"cifar-10-batches-py/ subfolder): expected files {', '.join(CIFAR10_FILES)}; "
            f"missing {', '.join(missing)}. Download and extract the python version from "
            "https://www.cs.toronto.edu/~kriz/cifar.html (cifar-10-python.tar.gz).")
    train = [_read_cifar_batch(os.path.join(folder, f)) for f in CIFAR10_FILES[:-1]]
    x_test, y_test = _read_cifar_batch(os.path.join(folder, CIFAR10_FILES[-1]))
    x_train = np.concatenate([x for x, _ in train]).astype(np.float32) / 255.0
    y_train = np.concatenate([y for _, y in train])
    x_train, x_test = _normalise(x_train, x_test.astype(np.float32) / 255.0)
    return Dataset("cifar10", x_train, y_train, x_test, y_test, 10)


def load(name: str, data_dir: str | None = None) -> Dataset:
    if name == "digits":
        return load_digits()
    if name == "cifar10":
        return load_cifar10(data_dir)
    raise SystemExit(f"unknown dataset {name!r}: choose digits or cifar10")


def epoch_batches(n: int, batch_size: int, seed: int, epoch: int):
    """Index arrays of the full batches of one epoch (the remainder is dropped). The order
    depends only on (seed, epoch), so every mode of a run sees the same data in the same order."""
    order = np.random.default_rng([seed, epoch]).permutation(n)
    for start in range(0, n - batch_size + 1, batch_size):
        yield order[start:start + batch_size]


def random_shift(x: np.ndarray, rng: np.random.Generator, max_shift: int) -> np.ndarray:
    """Augmentation: moves each image by up to ``max_shift`` pixels in each direction (edge
    padding, then a random crop of the original size)."""
    if max_shift <= 0:
        return x
    n, h, w, _ = x.shape
    padded = np.pad(x, ((0, 0), (max_shift, max_shift), (max_shift, max_shift), (0, 0)),
                    mode="edge")
    dy, dx = rng.integers(0, 2 * max_shift + 1, size=(2, n))
    rows = dy[:, None] + np.arange(h)[None, :]  # (n, h)
    cols = dx[:, None] + np.arange(w)[None, :]  # (n, w)
    return padded[np.arange(n)[:, None, None], rows[:, :, None], cols[:, None, :]]
