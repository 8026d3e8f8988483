"""Loaders for datasets published as folders of image files: CINIC-10 (PNG) and CelebA (JPEG).

Like `fedal.data.files`, they read the official layout from files the user already has (nothing
is ever downloaded), check it, and return `ArrayDataset`s laid out as the CIFAR-10 loader's:
x float32 [n, 3, 32, 32] in [0, 1], channels first, so the same zoo models take all three.
Missing files raise FileNotFoundError naming what was expected and where; malformed ones
ValueError naming the file. Images are decoded with Pillow (the `sim` extra), in a few threads:
Pillow releases the GIL while it decodes, and CelebA has 202,599 JPEGs.
"""

from __future__ import annotations

import os
from collections import Counter
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np

from fedal.data.arrays import ArrayDataset

__all__ = ["CINIC10_CLASSES", "CELEBA_SIZE", "TRAIN_SPLITS", "load_cinic10_dir", "load_celeba_dir",
           "read_celeba_attributes"]

# CIFAR-10's class order (its batches.meta), which CINIC-10 shares: label k means the same class in both.
CINIC10_CLASSES = ("airplane", "automobile", "bird", "cat", "deer", "dog", "frog", "horse", "ship", "truck")
# What makes the training set of a dataset that publishes a validation split; the test split is the test set.
TRAIN_SPLITS = ("train", "train+valid")

# Aligned CelebA images are 178 wide, 218 high. The centred 178x178 square (rows 20..197) holds the
# face; it is resized to 32x32 so CelebA has CIFAR-10's shape and every image model of the zoo
# (resnet18 and the WRNs need at least 32x32) takes it, at 12 KiB a sample in float32.
CELEBA_ALIGNED_SIZE = (178, 218)
CELEBA_SIZE = 32
_CELEBA_CROP = (0, 20, 178, 198)  # left, top, right, bottom
CELEBA_ATTRIBUTE_COUNT = 40
_CELEBA_FILES = ("list_attr_celeba.txt", "list_eval_partition.txt", "identity_CelebA.txt")


def _pillow():
    try:
        from PIL import Image
    except ImportError as e:  # the core install has no image library
        raise ImportError("reading image datasets needs Pillow: pip install 'fedal-edge[sim]' (or pillow)") from e
    return Image


def _decode_all(paths: Sequence[Path], decode: Callable[[Path], np.ndarray], shape: tuple[int, ...]) -> np.ndarray:
    """uint8 [len(paths), *shape], row i decoded from paths[i]; the first bad file's error propagates."""
    out = np.empty((len(paths), *shape), dtype=np.uint8)
    if not paths:
        return out
    workers = max(1, min(8, os.cpu_count() or 1, len(paths)))
    with ThreadPoolExecutor(max_workers=workers) as pool:
        for i, pixels in enumerate(pool.map(decode, paths)):
            out[i] = pixels
    return out


def _to_float_chw(hwc: np.ndarray) -> np.ndarray:
    """[n, H, W, 3] uint8 -> C-contiguous [n, 3, H, W] float32 in [0, 1], as the CIFAR-10 loader scales."""
    return np.ascontiguousarray(hwc.transpose(0, 3, 1, 2), dtype=np.float32) / np.float32(255.0)


def _check_train_splits(train_splits: str, name: str) -> None:
    if train_splits not in TRAIN_SPLITS:
        raise ValueError(f"{name}: train_splits must be one of {', '.join(TRAIN_SPLITS)}, got {train_splits!r}")


def _open_rgb(path: Path, size: tuple[int, int], what: str):
    """The image at `path` as RGB, refused unless it is `size` (width, height): the size is read
    from the header, before anything is decoded."""
    image_mod = _pillow()
    try:
        im = image_mod.open(path)
    except FileNotFoundError:
        raise FileNotFoundError(f"{what}: expected file {path}") from None
    except Exception as e:  # Pillow raises many types for a file it cannot identify
        raise ValueError(f"{path}: not a readable image ({type(e).__name__}: {e})") from e
    with im:
        if im.size != size:
            raise ValueError(f"{path}: image is {im.size[0]}x{im.size[1]}, {what} images are {size[0]}x{size[1]}")
        try:
            # CINIC-10 has some greyscale images from ImageNet: every image becomes 3 channels
            return im.convert("RGB")
        except Exception as e:  # truncated or corrupt pixel data
            raise ValueError(f"{path}: corrupt image data ({type(e).__name__}: {e})") from e


# ---------------------------------------------------------------- CINIC-10

def _cinic_root(root: Path) -> Path:
    for d in (root, root / "CINIC-10", root / "cinic-10"):
        if (d / "train").is_dir() and (d / "test").is_dir():
            return d
    raise FileNotFoundError(f"cinic10: expected the folders train/, valid/ and test/, each with one folder per class "
                            f"({', '.join(CINIC10_CLASSES)}) of 32x32 PNG images, in {root} or {root / 'CINIC-10'}")


def _read_cinic_split(root: Path, split: str) -> ArrayDataset:
    split_dir = root / split
    if not split_dir.is_dir():
        raise FileNotFoundError(f"cinic10: expected folder {split_dir} with one folder per class")
    unexpected = sorted(p.name for p in split_dir.iterdir()
                        if p.is_dir() and not p.name.startswith(".") and p.name not in CINIC10_CLASSES)
    if unexpected:
        raise ValueError(f"cinic10: {split_dir} holds folders that are not CINIC-10 classes: {', '.join(unexpected)}; "
                         f"expected {', '.join(CINIC10_CLASSES)}")
    paths: list[Path] = []
    labels: list[int] = []
    for k, cls in enumerate(CINIC10_CLASSES):
        class_dir = split_dir / cls
        if not class_dir.is_dir():
            raise FileNotFoundError(f"cinic10: expected folder {class_dir} of PNG images")
        files = sorted(p for p in class_dir.iterdir() if p.suffix.lower() == ".png" and p.is_file())
        if not files:
            raise ValueError(f"cinic10: {class_dir} holds no .png images")
        paths += files
        labels += [k] * len(files)

    def decode(path: Path) -> np.ndarray:
        return np.asarray(_open_rgb(path, (32, 32), "CINIC-10"), dtype=np.uint8)

    x = _to_float_chw(_decode_all(paths, decode, (32, 32, 3)))
    return ArrayDataset(x, np.asarray(labels, dtype=np.int64), len(CINIC10_CLASSES), f"cinic10-{split}")


def load_cinic10_dir(root, train_splits: str = "train") -> tuple[ArrayDataset, ArrayDataset]:
    """CINIC-10 (train, test) from its folders of PNGs: x [n, 3, 32, 32] float32 in [0, 1], labels
    in CIFAR-10's class order. Samples are ordered by class, then file name.

    `root` (or `root/CINIC-10`) holds train/, valid/ and test/, each with the ten class folders.
    `train_splits` "train" trains on train/ (90,000 images); "train+valid" adds valid/ (180,000).
    The test set is test/ either way; valid/ is only read when asked for.
    """
    _check_train_splits(train_splits, "cinic10")
    root = _cinic_root(Path(root))
    parts = [_read_cinic_split(root, split) for split in train_splits.split("+")]
    train = ArrayDataset(np.concatenate([p.x for p in parts]), np.concatenate([p.y for p in parts]),
                         len(CINIC10_CLASSES), "cinic10")
    test = _read_cinic_split(root, "test")
    return train, ArrayDataset(test.x, test.y, test.num_classes, "cinic10-test")


# ---------------------------------------------------------------- CelebA

def _celeba_root(root: Path) -> Path:
    for d in (root, root / "celeba"):  # torchvision puts the files under celeba/
        if all((d / f).is_file() for f in _CELEBA_FILES):
            return d
    missing = [f for f in _CELEBA_FILES if not (root / f).is_file()]
    raise FileNotFoundError(f"celeba: expected {', '.join(_CELEBA_FILES)} and the folder img_align_celeba/ "
                            f"in {root} or {root / 'celeba'}; missing in {root}: {', '.join(missing)}")


def _lines(path: Path) -> list[str]:
    try:
        text = path.read_text(encoding="ascii")
    except UnicodeDecodeError as e:
        raise ValueError(f"{path}: not a CelebA text file (non-ASCII byte at {e.start})") from e
    return [line for line in text.splitlines() if line.strip()]


def read_celeba_attributes(path) -> tuple[list[str], list[str], np.ndarray]:
    """list_attr_celeba.txt: (attribute names, file names, values int8 [n, 40] of -1/1).

    Line 1 is the number of images, line 2 the 40 attribute names, then one line per image:
    its file name and 40 values of -1 or 1.
    """
    path = Path(path)
    lines = _lines(path)
    if len(lines) < 2:
        raise ValueError(f"{path}: expected the image count on line 1 and the {CELEBA_ATTRIBUTE_COUNT} attribute "
                         f"names on line 2, got {len(lines)} line(s)")
    try:
        count = int(lines[0].strip())
    except ValueError:
        raise ValueError(f"{path}: line 1 must be the number of images, got {lines[0][:60]!r}") from None
    names = lines[1].split()
    if len(names) != CELEBA_ATTRIBUTE_COUNT or len(set(names)) != len(names) or any(n.lstrip("-").isdigit() for n in names):
        raise ValueError(f"{path}: line 2 must name the {CELEBA_ATTRIBUTE_COUNT} attributes (5_o_Clock_Shadow ... "
                         f"Young), got {len(names)} field(s): {lines[1][:60]!r}")
    rows = lines[2:]
    if len(rows) != count:
        raise ValueError(f"{path}: line 1 promises {count} images, the file lists {len(rows)}")
    files: list[str] = []
    values = np.empty((len(rows), CELEBA_ATTRIBUTE_COUNT), dtype=np.int8)
    for i, line in enumerate(rows):
        fields = line.split()
        if len(fields) != CELEBA_ATTRIBUTE_COUNT + 1 or any(v not in ("1", "-1") for v in fields[1:]):
            raise ValueError(f"{path}: line {i + 3} must be a file name and {CELEBA_ATTRIBUTE_COUNT} values of -1 or 1, "
                             f"got {line[:80]!r}")
        if "/" in fields[0] or "\\" in fields[0] or fields[0] in (".", ".."):  # a name in img_align_celeba/, no path
            raise ValueError(f"{path}: line {i + 3}: {fields[0][:60]!r} is not an image file name (no folders)")
        files.append(fields[0])
        values[i] = [int(v) for v in fields[1:]]
    _check_unique(files, path)
    return names, files, values


def _check_unique(files: list[str], path: Path) -> None:
    if len(set(files)) != len(files):
        dup = next(f for f, n in Counter(files).items() if n > 1)
        raise ValueError(f"{path}: {dup} is listed more than once")


def _read_pairs(path: Path, allowed: set[int] | None, what: str) -> dict[str, int]:
    """`file value` lines (list_eval_partition.txt, identity_CelebA.txt) as a dict."""
    out: dict[str, int] = {}
    for i, line in enumerate(_lines(path)):
        fields = line.split()
        try:
            if len(fields) != 2:
                raise ValueError
            value = int(fields[1])
            if value < 0 or value >= 2**63 or (allowed is not None and value not in allowed):  # int64 holds them
                raise ValueError
        except ValueError:
            raise ValueError(f"{path}: line {i + 1} must be a file name and {what}, got {line[:80]!r}") from None
        if fields[0] in out:
            raise ValueError(f"{path}: {fields[0]} is listed more than once")
        out[fields[0]] = value
    return out


def _celeba_pixels(path: Path) -> np.ndarray:
    image_mod = _pillow()
    im = _open_rgb(path, CELEBA_ALIGNED_SIZE, "aligned CelebA (img_align_celeba)")
    small = im.crop(_CELEBA_CROP).resize((CELEBA_SIZE, CELEBA_SIZE), image_mod.Resampling.BILINEAR)
    return np.asarray(small, dtype=np.uint8)


def load_celeba_dir(root, attribute: str = "Smiling", train_splits: str = "train") -> tuple[ArrayDataset, ArrayDataset]:
    """CelebA (train, test) as a binary task: label 1 where `attribute` is 1 in list_attr_celeba.txt,
    0 where it is -1. x [n, 3, 32, 32] float32 in [0, 1]: each aligned 178x218 image's centred
    178x178 square, resized to 32x32 (bilinear, antialiased). `groups` holds each image's celebrity
    identity (identity_CelebA.txt) for the "identity" partition.

    `root` (or `root/celeba`) holds list_attr_celeba.txt, list_eval_partition.txt,
    identity_CelebA.txt and img_align_celeba/. The official partition decides the splits
    (0 train, 1 valid, 2 test): `train_splits` "train" or "train+valid"; the test set is split 2.
    Samples keep the order of list_attr_celeba.txt; only the images of the chosen splits are read.
    """
    _check_train_splits(train_splits, "celeba")
    root = _celeba_root(Path(root))
    names, files, values = read_celeba_attributes(root / "list_attr_celeba.txt")
    if attribute not in names:
        raise ValueError(f"celeba: unknown attribute {attribute!r}; {root / 'list_attr_celeba.txt'} names: "
                         f"{', '.join(names)}")
    split_of = _read_pairs(root / "list_eval_partition.txt", {0, 1, 2}, "a partition of 0, 1 or 2")
    identity_of = _read_pairs(root / "identity_CelebA.txt", None, "a non-negative identity number")
    for other, table in (("list_eval_partition.txt", split_of), ("identity_CelebA.txt", identity_of)):
        if set(table) != set(files):
            missing = sorted(set(files) - set(table))
            extra = sorted(set(table) - set(files))
            raise ValueError(f"celeba: {root / other} and list_attr_celeba.txt list different images"
                             + (f"; not in {other}: {', '.join(missing[:5])}" if missing else "")
                             + (f"; not in list_attr_celeba.txt: {', '.join(extra[:5])}" if extra else ""))
    image_dir = root / "img_align_celeba"
    if not image_dir.is_dir():
        raise FileNotFoundError(f"celeba: expected folder {image_dir} of the aligned 178x218 JPEG images")
    labels = (values[:, names.index(attribute)] == 1).astype(np.int64)
    splits = np.array([split_of[f] for f in files], dtype=np.int64)
    identities = np.array([identity_of[f] for f in files], dtype=np.int64)
    train_codes = [0, 1] if train_splits == "train+valid" else [0]

    def subset(mask: np.ndarray, name: str) -> ArrayDataset:
        idx = np.flatnonzero(mask)
        x = _to_float_chw(_decode_all([image_dir / files[i] for i in idx], _celeba_pixels, (CELEBA_SIZE, CELEBA_SIZE, 3)))
        return ArrayDataset(x, labels[idx], 2, name, identities[idx])

    return subset(np.isin(splits, train_codes), "celeba"), subset(splits == 2, "celeba-test")
