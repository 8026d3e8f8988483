"""One call from a dataset name to the federated setting: clients, public set, test set.

Order (ALGORITHMS.md section 2): load -> hold the public set out of the training split ->
partition what remains among clients -> optionally hold a local test split out of each client's
share (its own distribution, for personalised evaluation) -> keep the common test split separate. The public split and the
client partition use independent random streams derived from `seed`, so the public set (and
its hash) depends only on dataset, public_size and seed, not on the partition settings:
runs that differ only in partition or alpha share the same P.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import numpy as np

from fedal.data.arrays import ArrayDataset
from fedal.data.embedded import MNIST1D_SAMPLES, load_digits, load_mnist1d
from fedal.data.files import load_cifar10_dir, load_mnist_dir, load_svhn_dir
from fedal.data.image_files import TRAIN_SPLITS, load_celeba_dir, load_cinic10_dir
from fedal.data.partition import PARTITIONERS, by_identity, label_histogram
from fedal.data.public import content_hash, split_public_indices
from fedal.data.shift import FEATURE_PARTITIONERS, feature_partition

__all__ = ["DATASETS", "DEFAULT_CELEBA_ATTRIBUTE", "GROUP_PARTITIONS", "SplitError", "VALID_SPLIT_DATASETS", "FederatedData",
           "check_dataset_options", "build_federated", "load_dataset", "public_set", "split_local_tests"]

DATASETS = ("mnist1d", "digits", "mnist", "fashion-mnist", "cifar10", "svhn", "cinic10", "celeba")
_FILE_DATASETS = ("mnist", "fashion-mnist", "cifar10", "svhn", "cinic10", "celeba")
# Datasets that publish a validation split, which train_splits="train+valid" adds to the training set.
VALID_SPLIT_DATASETS = ("cinic10", "celeba")
# Partitions that deal whole groups of samples (ArrayDataset.groups) instead of looking at labels.
GROUP_PARTITIONS = ("identity",)
DEFAULT_CELEBA_ATTRIBUTE = "Smiling"


@dataclass(eq=False)
class FederatedData:
    """Client datasets, the unlabeled public set and the common test set."""

    clients: list[ArrayDataset]  # each client's training data
    public_x: np.ndarray
    public_hash: str
    test: ArrayDataset
    num_classes: int
    input_shape: tuple
    partition_stats: np.ndarray  # [N, K] label histogram of the clients
    # Provenance: indices into the loaded training split (None if built by hand).
    public_indices: np.ndarray | None = None
    client_indices: list[np.ndarray] | None = None
    # Each client's local test split: drawn from its own share, disjoint from its training data
    # (empty datasets when local_test_fraction is 0).
    client_tests: list[ArrayDataset] | None = None
    client_test_indices: list[np.ndarray] | None = None


def check_dataset_options(dataset: str, train_splits: str = "train", celeba_attribute: str | None = None,
                          mnist1d_samples: int | None = None) -> None:
    """Refuse options the dataset does not have, before anything is read."""
    if mnist1d_samples is not None and dataset != "mnist1d":
        raise ValueError(f"mnist1d_samples applies to dataset 'mnist1d' only, not {dataset!r}")
    if mnist1d_samples is not None and int(mnist1d_samples) < 10:
        raise ValueError(f"mnist1d_samples must be at least 10 (one per class), got {mnist1d_samples}")
    if train_splits not in TRAIN_SPLITS:
        raise ValueError(f"train_splits must be one of {', '.join(TRAIN_SPLITS)}, got {train_splits!r}")
    if train_splits != "train" and dataset not in VALID_SPLIT_DATASETS:
        raise ValueError(f"train_splits {train_splits!r} needs a dataset with a validation split "
                         f"({', '.join(VALID_SPLIT_DATASETS)}); {dataset!r} has none")
    if celeba_attribute is not None and dataset != "celeba":
        raise ValueError(f"celeba_attribute applies to dataset 'celeba' only, not {dataset!r}")


def load_dataset(dataset: str, data_dir=None, *, train_splits: str = "train",
                 celeba_attribute: str | None = None, mnist1d_samples: int | None = None) -> tuple[ArrayDataset, ArrayDataset]:
    """(train, test) for a name in DATASETS.

    The file datasets read from `data_dir`; for mnist1d, `data_dir` (if given) is where the
    generated arrays are cached instead of the default cache directory; digits ignores it.
    `train_splits` "train+valid" adds the published validation split to the training set
    (cinic10, celeba); `celeba_attribute` is CelebA's binary task (None: Smiling);
    `mnist1d_samples` how many MNIST-1D samples to generate, train and test together (None:
    MNIST1D_SAMPLES).
    """
    if dataset not in DATASETS:
        raise ValueError(f"unknown dataset {dataset!r}; choose one of: {', '.join(DATASETS)}")
    check_dataset_options(dataset, train_splits, celeba_attribute, mnist1d_samples)
    if dataset in _FILE_DATASETS and data_dir is None:
        raise ValueError(f"dataset {dataset!r} is read from local files: pass data_dir "
                         f"(nothing is downloaded)")
    if dataset == "mnist1d":
        train, test = load_mnist1d(MNIST1D_SAMPLES if mnist1d_samples is None else int(mnist1d_samples),
                                   cache_dir=data_dir)
    elif dataset == "digits":
        train, test = load_digits()
    elif dataset == "mnist":
        train, test = load_mnist_dir(data_dir, kind="mnist")
    elif dataset == "fashion-mnist":
        train, test = load_mnist_dir(data_dir, kind="fashion")
    elif dataset == "cifar10":
        train, test = load_cifar10_dir(data_dir)
    elif dataset == "cinic10":
        train, test = load_cinic10_dir(data_dir, train_splits=train_splits)
    elif dataset == "celeba":
        train, test = load_celeba_dir(data_dir, attribute=celeba_attribute or DEFAULT_CELEBA_ATTRIBUTE,
                                      train_splits=train_splits)
    else:
        train, test = load_svhn_dir(data_dir)
    if len(test) == 0:  # well-formed but empty files: a run would train and then have nothing to score
        raise ValueError(f"{dataset}: its test split is empty{f' (in {data_dir})' if data_dir else ''}: every "
                         "accuracy is measured on it")
    return train, test


def build_federated(dataset: str, num_clients: int, partition: str = "dirichlet-client",
                    alpha: float = 1.0, samples_per_client: int | None = None,
                    public_size: int = 1000, seed: int = 0,
                    data_dir: str | os.PathLike | None = None,
                    local_test_fraction: float = 0.0, shift_c: float = 5.0, *,
                    train_splits: str = "train", celeba_attribute: str | None = None,
                    mnist1d_samples: int | None = None) -> FederatedData:
    """Load `dataset` and split it into `num_clients` clients plus a public set.

    `alpha` is the Dirichlet concentration of the chosen partition (alpha of the FedAL paper's
    per-client scheme, beta of the per-class scheme; ignored by "iid").
    `samples_per_client=None` gives every client as many samples as fit equally; for
    "dirichlet-class" (unequal sizes by design) it uses the whole remaining pool, and a number
    first draws num_clients * samples_per_client samples uniformly from the pool.
    `local_test_fraction` of every client's share (rounded, at least one sample left for
    training) becomes that client's local test split, chosen uniformly at random from an
    independent stream: at 0 the clients' data are exactly those of a run without the option.
    FedAKD's partitions ("pow", "covariate-shift[-pca][-pow]", see `fedal.data.shift`) split
    by features; `shift_c` is Algorithm 2's C, and they use half the pool unless
    `samples_per_client` is given (then num_clients * samples_per_client in all).
    "identity" (celeba only) deals whole celebrity identities to clients, as LEAF does; see
    `fedal.data.partition.by_identity`. `train_splits`, `celeba_attribute`, `mnist1d_samples`: see `load_dataset`.
    Same arguments -> identical arrays.
    """
    if dataset not in DATASETS:
        raise ValueError(f"unknown dataset {dataset!r}; choose one of: {', '.join(DATASETS)}")
    if partition not in PARTITIONERS and partition not in FEATURE_PARTITIONERS and partition not in GROUP_PARTITIONS:
        raise ValueError(f"unknown partition {partition!r}; "
                         f"choose one of: {', '.join([*PARTITIONERS, *FEATURE_PARTITIONERS, *GROUP_PARTITIONS])}")
    if partition in GROUP_PARTITIONS and dataset != "celeba":
        raise ValueError(f"partition {partition!r} deals celebrity identities and needs dataset 'celeba', not {dataset!r}")
    if int(num_clients) < 1:
        raise ValueError(f"num_clients must be at least 1, got {num_clients}")
    if not 0.0 <= float(local_test_fraction) < 1.0:
        raise ValueError(f"local_test_fraction must lie in [0, 1), got {local_test_fraction}")
    train, test = load_dataset(dataset, data_dir, train_splits=train_splits, celeba_attribute=celeba_attribute,
                               mnist1d_samples=mnist1d_samples)
    try:
        return _split(train, test, num_clients, partition, alpha, samples_per_client, public_size, seed,
                      local_test_fraction, shift_c)
    except SplitError:
        raise
    except ValueError as exc:  # the dataset, as loaded, cannot be split as asked
        raise SplitError(f"{dataset}: {exc}") from None


class SplitError(ValueError):
    """A dataset that loaded, but cannot be split as asked (too few samples for the clients or the
    public set, a partition it has no groups for): a choice of the run's settings, not a damaged file."""


def _split(train: ArrayDataset, test: ArrayDataset, num_clients: int, partition: str, alpha: float,
           samples_per_client: int | None, public_size: int, seed: int, local_test_fraction: float,
           shift_c: float) -> FederatedData:
    public_seq, partition_seq, local_test_seq = seed_streams(seed)
    public_idx, remaining = split_public_indices(len(train), public_size,
                                                 np.random.default_rng(public_seq))
    public_x = np.ascontiguousarray(train.x[public_idx])

    rng = np.random.default_rng(partition_seq)
    pool_labels = train.y[remaining]
    if partition == "dirichlet-client":
        local = PARTITIONERS[partition](pool_labels, num_clients, alpha, samples_per_client, rng,
                                        num_classes=train.num_classes)
    elif partition == "iid":
        local = PARTITIONERS[partition](pool_labels, num_clients, samples_per_client, rng)
    elif partition in GROUP_PARTITIONS:
        if train.groups is None:
            raise ValueError(f"partition {partition!r}: {train.name} has no identities")
        local = by_identity(train.groups[remaining], num_clients, samples_per_client, rng)
    elif partition in FEATURE_PARTITIONERS:
        local = feature_partition(partition, train.x[remaining], num_clients, shift_c, samples_per_client, rng)
    else:  # dirichlet-class
        pool = np.arange(len(remaining))
        if samples_per_client is not None:
            total = num_clients * int(samples_per_client)
            if total > len(pool):
                raise ValueError(f"cannot give {num_clients} clients {samples_per_client} "
                                 f"samples each: {total} needed, {len(pool)} available")
            pool = np.sort(rng.permutation(len(pool))[:total])
        local = [pool[p] for p in PARTITIONERS[partition](pool_labels[pool], num_clients,
                                                          alpha, rng)]
    client_idx = [remaining[p] for p in local]  # back to indices into the training split
    client_idx, client_test_idx = split_local_tests(client_idx, local_test_fraction,
                                                    np.random.default_rng(local_test_seq))

    clients = [train.subset(idx, name=f"{train.name}/client{n}")
               for n, idx in enumerate(client_idx)]
    client_tests = [train.subset(idx, name=f"{train.name}/client{n}-test")
                    for n, idx in enumerate(client_test_idx)]
    return FederatedData(
        clients=clients,
        public_x=public_x,
        public_hash=content_hash(public_x),
        test=test,
        num_classes=train.num_classes,
        input_shape=train.input_shape,
        partition_stats=label_histogram(train.y, client_idx, train.num_classes),
        public_indices=public_idx,
        client_indices=client_idx,
        client_tests=client_tests,
        client_test_indices=client_test_idx,
    )


def seed_streams(seed: int) -> list[np.random.SeedSequence]:
    """Independent streams for the public split, the partition and the local test splits.
    spawn(3)'s first two children equal spawn(2)'s: adding the third kept earlier runs as they were."""
    return np.random.SeedSequence(seed).spawn(3)


def public_set(dataset: str, public_size: int, seed: int, data_dir: str | os.PathLike | None = None, *,
               train_splits: str = "train", celeba_attribute: str | None = None,
               mnist1d_samples: int | None = None) -> np.ndarray:
    """The public set `build_federated` holds out for these settings, without partitioning:
    what a coordinator serves when a run names only its dataset."""
    train, _ = load_dataset(dataset, data_dir, train_splits=train_splits, celeba_attribute=celeba_attribute,
                               mnist1d_samples=mnist1d_samples)
    public_idx, _ = split_public_indices(len(train), public_size, np.random.default_rng(seed_streams(seed)[0]))
    return np.ascontiguousarray(train.x[public_idx])


def split_local_tests(client_idx: list[np.ndarray], fraction: float,
                      rng: np.random.Generator) -> tuple[list[np.ndarray], list[np.ndarray]]:
    """(train, local test) index arrays per client, disjoint, each in the order of the client's
    share (so a fraction of 0 leaves the training data exactly as it was)."""
    trains, tests = [], []
    for idx in client_idx:
        n_test = min(int(round(fraction * len(idx))), max(len(idx) - 1, 0))
        order = rng.permutation(len(idx))
        tests.append(idx[np.sort(order[:n_test])])
        trains.append(idx[np.sort(order[n_test:])])
    return trains, tests
