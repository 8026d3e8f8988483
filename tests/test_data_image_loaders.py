"""CINIC-10 (folders of PNGs) and CelebA (aligned JPEGs + the three list files) from files written
here in exactly the published layout; the identity partition; `fedal simulate` on both."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from fedal.data import (
    ArrayDataset,
    build_federated,
    by_identity,
    load_celeba_dir,
    load_cifar10_dir,
    load_cinic10_dir,
    load_dataset,
)
from fedal.models import build_model, models_for_input
from fedal.sim.config import DEFAULT_MODELS, ConfigError, load_config
from tests.test_data_loaders import write_cifar

CELEBA_ATTRIBUTES = (
    "5_o_Clock_Shadow Arched_Eyebrows Attractive Bags_Under_Eyes Bald Bangs Big_Lips Big_Nose Black_Hair Blond_Hair "
    "Blurry Brown_Hair Bushy_Eyebrows Chubby Double_Chin Eyeglasses Goatee Gray_Hair Heavy_Makeup High_Cheekbones Male "
    "Mouth_Slightly_Open Mustache Narrow_Eyes No_Beard Oval_Face Pale_Skin Pointy_Nose Receding_Hairline Rosy_Cheeks "
    "Sideburns Smiling Straight_Hair Wavy_Hair Wearing_Earrings Wearing_Hat Wearing_Lipstick Wearing_Necklace "
    "Wearing_Necktie Young").split()
SMILING, MALE = CELEBA_ATTRIBUTES.index("Smiling"), CELEBA_ATTRIBUTES.index("Male")
# CIFAR-10's order (its batches.meta label_names): label k must mean the same class in both datasets
CINIC10_CLASSES = ("airplane", "automobile", "bird", "cat", "deer", "dog", "frog", "horse", "ship", "truck")


# ---------------------------------------------------------------- CINIC-10 folders of PNGs

def write_cinic(root: Path, per_class: dict[str, int] | None = None, seed: int = 0) -> dict[str, list[np.ndarray]]:
    """root/{train,valid,test}/<class>/*.png as published (file names like the real ones), random
    32x32 RGB pixels; the first test airplane is greyscale (CINIC-10 has some from ImageNet).
    Returns each split's images in class order, then file name order."""
    per_class = per_class or {"train": 2, "valid": 1, "test": 1}
    rng = np.random.default_rng(seed)
    images: dict[str, list[np.ndarray]] = {}
    for split, n in per_class.items():
        images[split] = []
        for cls in CINIC10_CLASSES:
            d = root / split / cls
            d.mkdir(parents=True)
            names = sorted(f"n{rng.integers(10**7, 10**8)}_{i}.png" if i % 2 else f"cifar10-{split}-{i}.png"
                           for i in range(n))
            for i, name in enumerate(names):
                if split == "test" and cls == "airplane" and i == 0:
                    grey = rng.integers(0, 256, size=(32, 32), dtype=np.uint8)
                    Image.fromarray(grey, mode="L").save(d / name)
                    images[split].append(np.repeat(grey[:, :, None], 3, axis=2))
                else:
                    pixels = rng.integers(0, 256, size=(32, 32, 3), dtype=np.uint8)
                    Image.fromarray(pixels, mode="RGB").save(d / name)
                    images[split].append(pixels)
    return images


def test_load_cinic10_dir_reads_the_published_layout(tmp_path):
    images = write_cinic(tmp_path)
    (tmp_path / "train" / "cat" / "notes.txt").write_text("not an image")  # other files are ignored
    train, test = load_cinic10_dir(tmp_path)
    assert train.x.shape == (20, 3, 32, 32) and test.x.shape == (10, 3, 32, 32)
    assert train.name == "cinic10" and test.name == "cinic10-test" and train.num_classes == 10
    assert train.x.dtype == np.float32 and train.x.flags.c_contiguous and train.groups is None
    # CIFAR-10's class order: the two airplanes first, the two trucks last
    assert train.y.tolist() == [k for k in range(10) for _ in range(2)]
    assert test.y.tolist() == list(range(10))
    expected = np.stack(images["train"]).transpose(0, 3, 1, 2).astype(np.float32) / np.float32(255.0)
    assert np.array_equal(train.x, expected)  # lossless PNG: exactly the pixels, scaled as CIFAR-10's
    grey = test.x[0]
    assert np.array_equal(grey[0], grey[1]) and np.array_equal(grey[1], grey[2])
    assert np.array_equal(grey[0] * 255, images["test"][0][:, :, 0].astype(np.float32))

    both, test2 = load_cinic10_dir(tmp_path, train_splits="train+valid")
    assert len(both) == 30 and np.array_equal(both.x[:20], train.x) and np.array_equal(test2.x, test.x)
    assert both.y[20:].tolist() == list(range(10))


def test_cinic10_matches_the_cifar10_loaders_layout(tmp_path):
    """The same pixels given as a CIFAR-10 batch row and as a CINIC-10 PNG load to identical arrays."""
    write_cifar(tmp_path / "cifar", n_train=2, n_test=1)
    cifar_train, _ = load_cifar10_dir(tmp_path / "cifar")
    row = (cifar_train.x[0] * 255).round().astype(np.uint8)  # [3, 32, 32]
    write_cinic(tmp_path / "cinic")
    target = sorted((tmp_path / "cinic" / "train" / "airplane").glob("*.png"))[0]
    Image.fromarray(row.transpose(1, 2, 0), mode="RGB").save(target)
    cinic_train, _ = load_cinic10_dir(tmp_path / "cinic")
    assert cinic_train.x.dtype == cifar_train.x.dtype and cinic_train.x.shape[1:] == cifar_train.x.shape[1:]
    assert np.array_equal(cinic_train.x[0], cifar_train.x[0])


def test_cinic10_is_also_found_in_a_CINIC_10_folder(tmp_path):
    write_cinic(tmp_path / "CINIC-10", {"train": 1, "test": 1})
    train, test = load_cinic10_dir(tmp_path)
    assert len(train) == 10 and len(test) == 10  # valid/ is absent and not needed for "train"
    with pytest.raises(FileNotFoundError, match="valid"):
        load_cinic10_dir(tmp_path, train_splits="train+valid")


def test_cinic10_malformed_inputs_are_refused(tmp_path):
    with pytest.raises(FileNotFoundError, match="train/, valid/ and test/"):
        load_cinic10_dir(tmp_path)
    write_cinic(tmp_path, {"train": 1, "test": 1})
    with pytest.raises(ValueError, match="train_splits"):
        load_cinic10_dir(tmp_path, train_splits="valid")

    bird = tmp_path / "train" / "bird"
    moved = tmp_path / "bird-elsewhere"
    bird.rename(moved)
    with pytest.raises(FileNotFoundError, match=r"train/bird"):
        load_cinic10_dir(tmp_path)
    moved.rename(bird)

    (tmp_path / "test" / "Truck").mkdir()
    with pytest.raises(ValueError, match="not CINIC-10 classes: Truck"):
        load_cinic10_dir(tmp_path)
    (tmp_path / "test" / "Truck").rmdir()

    (png,) = sorted((tmp_path / "train" / "dog").glob("*.png"))
    Image.fromarray(np.zeros((32, 33, 3), np.uint8)).save(png)
    with pytest.raises(ValueError, match=r"is 33x32, CINIC-10 images are 32x32"):
        load_cinic10_dir(tmp_path)
    png.write_bytes(b"\x89PNG\r\n\x1a\n" + b"garbage" * 10)
    with pytest.raises(ValueError, match="not a readable image"):
        load_cinic10_dir(tmp_path)
    good = np.zeros((32, 32, 3), np.uint8)
    Image.fromarray(good).save(png)
    png.write_bytes(png.read_bytes()[:-30])  # pixel data cut short
    with pytest.raises(ValueError, match=str(png.name)):
        load_cinic10_dir(tmp_path)
    png.unlink()
    with pytest.raises(ValueError, match="no .png images"):
        load_cinic10_dir(tmp_path)


# ---------------------------------------------------------------- CelebA

QUADRANTS = np.array([[[230, 30, 30], [30, 230, 30]], [[30, 30, 230], [230, 230, 30]]], np.uint8)


def celeba_image(shift: int) -> np.ndarray:
    """218x178 RGB: magenta bands above and below the centred 178x178 square (the crop removes
    them), and four colour quadrants in the square, rolled by `shift` so images differ."""
    img = np.empty((218, 178, 3), np.uint8)
    img[:] = (255, 0, 255)
    quads = np.roll(QUADRANTS.reshape(4, 3), shift, axis=0).reshape(2, 2, 3)
    for r in range(2):
        for c in range(2):
            img[20 + 89 * r:20 + 89 * (r + 1), 89 * c:89 * (c + 1)] = quads[r, c]
    return img


def write_celeba(root: Path, partitions=(0, 0, 0, 0, 0, 0, 1, 1, 2, 2), identities=(7, 7, 3, 3, 3, 9, 5, 5, 1, 2),
                 seed: int = 0) -> dict:
    """root/img_align_celeba/000001.jpg ... and the three list files, formatted as published."""
    rng = np.random.default_rng(seed)
    n = len(partitions)
    files = [f"{i + 1:06d}.jpg" for i in range(n)]
    values = rng.choice([-1, 1], size=(n, 40))
    (root / "img_align_celeba").mkdir(parents=True)
    for i, name in enumerate(files):
        Image.fromarray(celeba_image(i)).save(root / "img_align_celeba" / name, quality=95, subsampling=0)
    rows = [f"{name} " + " ".join(f"{v:2d}" for v in row) for name, row in zip(files, values)]
    (root / "list_attr_celeba.txt").write_text(f"{n}\n" + " ".join(CELEBA_ATTRIBUTES) + " \n" + "\n".join(rows) + "\n")
    (root / "list_eval_partition.txt").write_text("".join(f"{f} {p}\n" for f, p in zip(files, partitions)))
    (root / "identity_CelebA.txt").write_text("".join(f"{f} {i}\n" for f, i in zip(files, identities)))
    return {"files": files, "values": values, "partitions": np.array(partitions), "identities": np.array(identities)}


def test_load_celeba_dir_binary_attribute_crop_and_identities(tmp_path):
    meta = write_celeba(tmp_path)
    train, test = load_celeba_dir(tmp_path)
    assert train.x.shape == (6, 3, 32, 32) and test.x.shape == (2, 3, 32, 32)
    assert train.x.dtype == np.float32 and train.x.flags.c_contiguous and train.num_classes == 2
    assert (train.name, test.name) == ("celeba", "celeba-test")
    assert train.y.tolist() == (meta["values"][:6, SMILING] == 1).astype(int).tolist()
    assert test.y.tolist() == (meta["values"][8:, SMILING] == 1).astype(int).tolist()
    assert train.groups.tolist() == [7, 7, 3, 3, 3, 9] and test.groups.tolist() == [1, 2]
    # The centred square, resized: each quadrant keeps its colour (channel 0 is red), and no
    # magenta from the bands above and below reaches the first or last row.
    for i, sample in enumerate(train.x):
        quads = np.roll(QUADRANTS.reshape(4, 3), i, axis=0).reshape(2, 2, 3)
        for r in range(2):
            for c in range(2):
                block = sample[:, 16 * r + 2:16 * r + 14, 16 * c + 2:16 * c + 14] * 255
                assert np.abs(block - quads[r, c][:, None, None]).max() < 12, (i, r, c)
        magenta = np.array([255, 0, 255], np.float32)[:, None]
        for row in (sample[:, 0] * 255, sample[:, 31] * 255):  # [3, 32]
            assert np.abs(row - magenta).max(axis=0).min() > 100

    male, _ = load_celeba_dir(tmp_path, attribute="Male")
    assert male.y.tolist() == (meta["values"][:6, MALE] == 1).astype(int).tolist()
    both, _ = load_celeba_dir(tmp_path, train_splits="train+valid")
    assert len(both) == 8 and both.groups.tolist() == [7, 7, 3, 3, 3, 9, 5, 5]
    assert np.array_equal(both.x[:6], train.x)


def test_celeba_is_also_found_in_torchvisions_celeba_folder(tmp_path):
    write_celeba(tmp_path / "celeba")
    train, test = load_dataset("celeba", tmp_path, celeba_attribute="Young")
    assert len(train) == 6 and len(test) == 2


def test_celeba_missing_files_are_named(tmp_path):
    with pytest.raises(FileNotFoundError, match="list_attr_celeba.txt, list_eval_partition.txt, identity_CelebA.txt"):
        load_celeba_dir(tmp_path)
    write_celeba(tmp_path)
    (tmp_path / "identity_CelebA.txt").unlink()
    with pytest.raises(FileNotFoundError, match="missing in .*: identity_CelebA.txt"):
        load_celeba_dir(tmp_path)
    write_celeba(tmp_path / "b")
    (tmp_path / "b" / "img_align_celeba" / "000003.jpg").unlink()
    with pytest.raises(FileNotFoundError, match="000003.jpg"):
        load_celeba_dir(tmp_path / "b")
    # an image of the valid split is not read unless asked for
    write_celeba(tmp_path / "c")
    (tmp_path / "c" / "img_align_celeba" / "000007.jpg").unlink()
    assert len(load_celeba_dir(tmp_path / "c")[0]) == 6
    with pytest.raises(FileNotFoundError, match="000007.jpg"):
        load_celeba_dir(tmp_path / "c", train_splits="train+valid")


def _edit(path: Path, fn) -> None:
    lines = path.read_text().split("\n")
    path.write_text("\n".join(fn(lines)))


@pytest.mark.parametrize("damage, needle", [
    (lambda ls: ["202599 images", *ls[1:]], "line 1 must be the number of images"),
    (lambda ls: [ls[0], *ls[2:]], "line 2 must name the 40 attributes"),  # header line missing
    (lambda ls: [ls[0], ls[1].replace("Young", ""), *ls[2:]], "got 39 field"),
    (lambda ls: [ls[0], ls[1].replace("Young", "Smiling"), *ls[2:]], "line 2 must name the 40 attributes"),
    (lambda ls: ["11", *ls[1:]], "line 1 promises 11 images, the file lists 10"),
    (lambda ls: [*ls[:4], ls[4].replace(" 1", " 0", 1), *ls[5:]], "line 5 must be a file name and 40 values"),
    (lambda ls: [*ls[:4], ls[4].rsplit(" ", 1)[0], *ls[5:]], "line 5 must be a file name and 40 values"),
    (lambda ls: [*ls[:4], "/etc/" + ls[4], *ls[5:]], "line 5: '/etc/0000.*' is not an image file name"),
    (lambda ls: [*ls[:4], "../" + ls[4], *ls[5:]], "line 5: '../0000.*' is not an image file name"),
])
def test_celeba_malformed_attribute_file_is_refused(tmp_path, damage, needle):
    write_celeba(tmp_path)
    _edit(tmp_path / "list_attr_celeba.txt", damage)
    with pytest.raises(ValueError, match=needle):
        load_celeba_dir(tmp_path)


def test_celeba_unknown_attribute_lists_the_names(tmp_path):
    write_celeba(tmp_path)
    with pytest.raises(ValueError, match="unknown attribute 'smiling'.*5_o_Clock_Shadow, Arched_Eyebrows.*Young"):
        load_celeba_dir(tmp_path, attribute="smiling")


@pytest.mark.parametrize("file, damage, needle", [
    ("list_eval_partition.txt", lambda ls: [ls[0].replace(" 0", " 3"), *ls[1:]], "line 1 must be a file name and a partition"),
    ("list_eval_partition.txt", lambda ls: [ls[0].replace(" 0", ""), *ls[1:]], "line 1 must be a file name and a partition"),
    ("list_eval_partition.txt", lambda ls: ls[1:], "list different images; not in list_eval_partition.txt: 000001.jpg"),
    ("list_eval_partition.txt", lambda ls: [*ls, "999999.jpg 0"], "not in list_attr_celeba.txt: 999999.jpg"),
    ("list_eval_partition.txt", lambda ls: [ls[0], ls[0], *ls[1:]], "000001.jpg is listed more than once"),
    ("identity_CelebA.txt", lambda ls: [ls[0].replace(" 7", " x"), *ls[1:]], "line 1 must be a file name and a non-negative"),
    ("identity_CelebA.txt", lambda ls: ls[:-2], "not in identity_CelebA.txt: 000010.jpg"),
    # past int64 (was an OverflowError traceback)
    ("identity_CelebA.txt", lambda ls: [ls[0].replace(" 7", f" {10**30}"), *ls[1:]], "line 1 must be a file name and a "
     "non-negative"),
    ("list_attr_celeba.txt", lambda ls: ["11", ls[1], ls[2], *ls[2:]], "000001.jpg is listed more than once"),
])
def test_celeba_malformed_lists_are_refused(tmp_path, file, damage, needle):
    write_celeba(tmp_path)
    _edit(tmp_path / file, damage)
    with pytest.raises(ValueError, match=needle):
        load_celeba_dir(tmp_path)


def test_celeba_images_of_the_wrong_size_or_damaged_are_refused(tmp_path):
    write_celeba(tmp_path)
    jpg = tmp_path / "img_align_celeba" / "000002.jpg"
    Image.fromarray(np.zeros((218, 178, 3), np.uint8).transpose(1, 0, 2)).save(jpg)  # 218 wide, 178 high
    with pytest.raises(ValueError, match=r"000002.jpg: image is 218x178, aligned CelebA .* images are 178x218"):
        load_celeba_dir(tmp_path)
    Image.fromarray(np.zeros((409, 500, 3), np.uint8)).save(jpg)  # img_celeba (in the wild) sizes vary
    with pytest.raises(ValueError, match="500x409"):
        load_celeba_dir(tmp_path)
    jpg.write_bytes(b"\xff\xd8\xff\xe0 not really a jpeg")
    with pytest.raises(ValueError, match="000002.jpg: not a readable image"):
        load_celeba_dir(tmp_path)


# ---------------------------------------------------------------- the identity partition

def test_by_identity_deals_whole_identities_deterministically():
    rng = np.random.default_rng(0)
    groups = rng.integers(0, 40, size=400)
    parts = by_identity(groups, 5, None, np.random.default_rng(1))
    assert sorted(np.concatenate(parts).tolist()) == list(range(400))  # every image, once
    owners = [set(groups[p].tolist()) for p in parts]
    for a in range(5):
        for b in range(a + 1, 5):
            assert not owners[a] & owners[b]  # no identity on two clients
    sizes = [len(p) for p in parts]
    assert max(sizes) - min(sizes) <= np.bincount(groups).max()  # dealt to the least-loaded client
    again = by_identity(groups, 5, None, np.random.default_rng(1))
    assert all(np.array_equal(a, b) for a, b in zip(parts, again))
    other = by_identity(groups, 5, None, np.random.default_rng(2))
    assert any(not np.array_equal(a, b) for a, b in zip(parts, other))

    capped = by_identity(groups, 4, 30, np.random.default_rng(1))
    assert [len(p) for p in capped] == [30] * 4
    owners = [set(groups[p].tolist()) for p in capped]
    assert sum(len(o) for o in owners) == len(set().union(*owners))
    with pytest.raises(ValueError, match="3 identities"):
        by_identity(np.array([0, 0, 1, 2]), 4, None, np.random.default_rng(0))
    with pytest.raises(ValueError, match="by whole identities"):
        by_identity(groups, 4, 101, np.random.default_rng(0))


def test_groups_travel_with_subsets_and_are_checked():
    ds = ArrayDataset(np.zeros((3, 2), np.float32), np.array([0, 1, 0]), 2, "t", np.array([5, 6, 5]))
    assert ds.subset([2, 1]).groups.tolist() == [5, 6] and ArrayDataset(ds.x, ds.y, 2, "t").subset([0]).groups is None
    for bad in (np.array([5, 6, 5], np.int32), np.array([5, 6]), [5, 6, 5]):
        with pytest.raises(ValueError, match="groups must be an int64 array of shape"):
            ArrayDataset(ds.x, ds.y, 2, "t", bad)


def test_build_federated_celeba_by_identity(tmp_path):
    write_celeba(tmp_path, partitions=[0] * 24 + [2] * 4, identities=[i // 3 for i in range(28)])
    fd = build_federated("celeba", 3, partition="identity", public_size=6, seed=4, data_dir=tmp_path)
    assert fd.num_classes == 2 and fd.input_shape == (3, 32, 32) and len(fd.test) == 4
    assert sum(len(c) for c in fd.clients) == 18
    owners = [set(c.groups.tolist()) for c in fd.clients]
    assert all(owners) and sum(len(o) for o in owners) == len(set().union(*owners))
    again = build_federated("celeba", 3, partition="identity", public_size=6, seed=4, data_dir=tmp_path)
    assert all(np.array_equal(a, b) for a, b in zip(fd.client_indices, again.client_indices))
    male = build_federated("celeba", 3, partition="identity", public_size=6, seed=4, data_dir=tmp_path,
                           celeba_attribute="Male")
    assert np.array_equal(male.public_x, fd.public_x)  # the attribute changes labels, not the public rows
    with pytest.raises(ValueError, match="partition 'identity' .* needs dataset 'celeba', not 'digits'"):
        build_federated("digits", 3, partition="identity")
    with pytest.raises(ValueError, match="celeba_attribute applies to dataset 'celeba' only"):
        build_federated("digits", 3, celeba_attribute="Smiling")
    with pytest.raises(ValueError, match="needs a dataset with a validation split"):
        build_federated("digits", 3, train_splits="train+valid")


def test_run_config_checks_the_dataset_options():
    cfg = load_config(None, {"dataset": "celeba", "data_dir": "/d", "partition": "identity"})
    assert cfg.celeba_attribute is None and cfg.resolved().celeba_attribute == "Smiling"
    assert cfg.dataset_options() == {"train_splits": "train", "celeba_attribute": None, "mnist1d_samples": None}
    cinic = load_config(None, {"dataset": "cinic10", "data_dir": "/d", "train_splits": "train+valid"})
    assert cinic.train_splits == "train+valid"
    assert load_config(None, {"dataset": "digits"}).resolved().celeba_attribute is None
    for overrides, needle in [
        ({"dataset": "cinic10", "data_dir": "/d", "partition": "identity"}, "needs dataset 'celeba', not 'cinic10'"),
        ({"dataset": "cifar10", "data_dir": "/d", "celeba_attribute": "Male"}, "celeba_attribute applies to dataset 'celeba'"),
        ({"dataset": "svhn", "data_dir": "/d", "train_splits": "train+valid"}, "validation split"),
        ({"dataset": "celeba", "data_dir": "/d", "train_splits": "all"}, "unknown train_splits 'all'"),
        ({"dataset": "celeba"}, "set data_dir"),
    ]:
        with pytest.raises(ConfigError, match=needle):
            load_config(None, overrides)


# ---------------------------------------------------------------- models

@pytest.mark.parametrize("dataset, classes", [("cinic10", 10), ("celeba", 2)])
def test_zoo_models_take_the_image_datasets(dataset, classes):
    names = models_for_input((3, 32, 32))
    assert set(DEFAULT_MODELS[dataset]) <= set(names) and {"resnet18", "wrn16_1", "smallcnn", "lenet5"} <= set(names)
    x = torch.rand(2, 3, 32, 32)
    for name in names:
        torch.manual_seed(0)
        model = build_model(name, (3, 32, 32), classes).eval()
        with torch.no_grad():
            assert model(x).shape == (2, classes), name


# ---------------------------------------------------------------- fedal simulate, end to end

def fedal(*args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}:{os.environ.get('PATH', '')}"}
    return subprocess.run(["fedal", *args], capture_output=True, text=True, env=env, timeout=300)


TINY = ["--clients", "2", "--rounds", "2", "--tau", "1", "--quiet"]


def test_simulate_cinic10_end_to_end(tmp_path):
    write_cinic(tmp_path / "cinic", {"train": 3, "valid": 1, "test": 1})
    out = tmp_path / "r.json"
    proc = fedal("simulate", "--dataset", "cinic10", "--data-dir", str(tmp_path / "cinic"), *TINY,
                 "--public-size", "10", "--models", "smallcnn,lenet5", "--train-splits", "train+valid", "--out", str(out))
    assert proc.returncode == 0, proc.stderr
    results = json.loads(out.read_text())
    assert results["config"]["dataset"] == "cinic10" and results["config"]["train_splits"] == "train+valid"
    assert results["data"]["client_sizes"] == [15, 15] and results["data"]["test_size"] == 10  # 40 - 10 public
    assert len(results["rounds"]) == 2 and 0.0 <= results["final"]["mean_acc"] <= 1.0


def test_simulate_celeba_by_identity_end_to_end(tmp_path):
    write_celeba(tmp_path / "celeba", partitions=[0] * 14 + [1] * 2 + [2] * 4, identities=[i // 2 for i in range(20)])
    out = tmp_path / "r.json"
    proc = fedal("simulate", "--dataset", "celeba", "--data-dir", str(tmp_path / "celeba"), *TINY, "--public-size", "4",
                 "--partition", "identity", "--celeba-attribute", "Male", "--out", str(out))
    assert proc.returncode == 0, proc.stderr
    results = json.loads(out.read_text())
    assert results["config"]["celeba_attribute"] == "Male" and results["config"]["partition"] == "identity"
    assert results["config"]["models"] == DEFAULT_MODELS["celeba"]
    assert sum(results["data"]["client_sizes"]) == 10 and results["data"]["test_size"] == 4
    assert min(results["data"]["client_identities"]) >= 1
    assert np.asarray(results["data"]["label_histogram"]).shape == (2, 2)
    assert len(results["rounds"]) == 2

    proc = fedal("simulate", "--dataset", "celeba", "--data-dir", str(tmp_path / "celeba"), *TINY, "--public-size", "4",
                 "--celeba-attribute", "Smile", "--out", str(tmp_path / "bad.json"))
    assert proc.returncode == 1 and "unknown attribute 'Smile'" in proc.stderr and "Smiling" in proc.stderr
    assert not (tmp_path / "bad.json").exists()
    proc = fedal("simulate", "--dataset", "cinic10", "--data-dir", str(tmp_path / "celeba"), *TINY,
                 "--partition", "identity", "--out", str(tmp_path / "bad.json"))
    assert proc.returncode == 2 and "needs dataset 'celeba'" in proc.stderr


def test_coordinator_serves_the_public_rows_simulate_holds_out(tmp_path):
    """A run created over the API with cinic10 and train+valid serves the public rows
    `fedal simulate` holds out for the same settings (the validation images are in the pool)."""
    from coordinator.config import load_coordinator_config
    from coordinator.runs import RunManager
    from fedal.data import content_hash, public_set
    from tests.local_api import local_client

    data = tmp_path / "state" / "cinic"  # where an API-created run may read datasets: under the state dir
    write_cinic(data, {"train": 2, "valid": 1, "test": 1})
    cfg = load_coordinator_config(None, state_dir=tmp_path / "state", api={"token": "tok"})
    runs = RunManager(cfg)
    try:
        api = local_client(runs)
        spec = {"run_id": "cinic", "client_ids": ["pi-1", "pi-2"],
                "run": {"strategy": "fedmd", "dataset": "cinic10", "data_dir": str(data), "train_splits": "train+valid",
                        "models": ["smallcnn"], "rounds": 1, "public_size": 8, "seed": 3}}
        created = api.post("/api/v1/runs", json=spec, headers={"Authorization": "Bearer tok"})
        assert created.status_code == 201, created.text
        served = api.get("/api/v1/runs/cinic/public").headers["x-content-hash"]
    finally:
        runs.store.close()
    both = build_federated("cinic10", 2, public_size=8, seed=3, data_dir=data, train_splits="train+valid")
    assert served == both.public_hash == content_hash(public_set("cinic10", 8, 3, data, train_splits="train+valid"))
    assert served != content_hash(public_set("cinic10", 8, 3, data))  # train/ alone: another pool, other rows


def test_a_results_files_data_dir_finds_its_files_from_anywhere_and_other_files_are_said(tmp_path, monkeypatch):
    """A relative --data-dir was saved as given: the results' config, repeated from another
    folder, found no files there, or other files of the same names, and said nothing."""
    import shutil

    from click.testing import CliRunner

    from fedal_cli.main import cli

    monkeypatch.chdir(tmp_path)
    write_cinic(tmp_path / "cinic", {"train": 3, "valid": 1, "test": 1})
    args = ["--dataset", "cinic10", "--clients", "2", "--rounds", "1", "--tau", "1", "--quiet", "--public-size", "10",
            "--models", "smallcnn"]
    first = CliRunner().invoke(cli, ["simulate", "--data-dir", "cinic", *args, "--out", "r.json"])
    assert first.exit_code == 0, first.output
    saved = json.loads((tmp_path / "r.json").read_text())
    assert saved["config"]["data_dir"] == str(tmp_path / "cinic")  # absolute: as read

    (tmp_path / "elsewhere").mkdir()
    monkeypatch.chdir(tmp_path / "elsewhere")
    again = CliRunner().invoke(cli, ["simulate", "--config", "../r.json", "--quiet", "--out", "again.json"])
    assert again.exit_code == 0 and "warning" not in again.output, again.output
    repeated = json.loads((tmp_path / "elsewhere" / "again.json").read_text())
    assert repeated["data"] == saved["data"] and repeated["final"] == saved["final"]

    shutil.rmtree(tmp_path / "cinic")
    write_cinic(tmp_path / "cinic", {"train": 3, "valid": 1, "test": 1}, seed=1)  # other files, the same names' shape
    other = CliRunner().invoke(cli, ["simulate", "--config", "../r.json", "--quiet", "--out", "other.json"])
    assert other.exit_code == 0 and "is not the one ../r.json ran on" in other.output, other.output


def test_the_demo_saves_its_data_dir_as_read_too(tmp_path, monkeypatch):
    """`fedal demo` kept a relative --data-dir as given in the results it wrote (simulate made it
    absolute): its results, given as --config from another folder, found no files."""
    from fedal_cli import demo
    from fedal_cli.main import cli

    monkeypatch.chdir(tmp_path)
    seen = {}

    def run_demo(config, *_args, **_kwargs):  # the run the demo would start, with the config it would save
        seen["data_dir"] = config.data_dir
        raise demo.procs.Stopped(15)

    monkeypatch.setattr(demo, "run_demo", run_demo)
    write_cinic(tmp_path / "cinic", {"train": 3, "valid": 1, "test": 1})
    from click.testing import CliRunner

    CliRunner().invoke(cli, ["demo", "--dataset", "cinic10", "--data-dir", "cinic", "--clients", "2", "--rounds", "1",
                             "--models", "smallcnn", "--public-size", "10", "--workdir", "w"])
    assert seen["data_dir"] == str(tmp_path / "cinic")
