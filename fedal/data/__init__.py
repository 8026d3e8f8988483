"""Datasets as numpy arrays, federated partitions and the shared public set (no torch here)."""

from fedal.data.arrays import ArrayDataset
from fedal.data.embedded import default_cache_dir, load_digits, load_mnist1d
from fedal.data.federated import DATASETS, FederatedData, SplitError, build_federated, load_dataset, public_set
from fedal.data.files import load_cifar10_dir, load_idx, load_mnist_dir, load_svhn_dir
from fedal.data.image_files import CINIC10_CLASSES, load_celeba_dir, load_cinic10_dir
from fedal.data.partition import (
    PARTITIONERS,
    allocate_quotas,
    by_identity,
    dirichlet_per_class,
    dirichlet_per_client,
    iid,
    label_histogram,
)
from fedal.data.public import (
    check_servable,
    content_hash,
    public_file_limit,
    public_rows_from_npz,
    split_public,
    split_public_indices,
)

__all__ = [
    "ArrayDataset", "CINIC10_CLASSES", "DATASETS", "FederatedData", "PARTITIONERS",
    "allocate_quotas", "build_federated", "by_identity", "check_servable", "content_hash", "default_cache_dir",
    "public_set",
    "dirichlet_per_class", "dirichlet_per_client", "iid", "label_histogram",
    "load_celeba_dir", "load_cifar10_dir", "load_cinic10_dir", "load_dataset", "load_digits", "load_idx", "load_mnist1d",
    "load_mnist_dir", "load_svhn_dir", "public_file_limit", "public_rows_from_npz", "SplitError", "split_public",
    "split_public_indices",
]
