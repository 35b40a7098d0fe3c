"""Every S3 client in a task talks to the object store that Flyte's own client uses.

flytekit reads a non-AWS object store's endpoint and keys (MinIO, Ceph, the local cluster's store) from
FLYTE_AWS_ENDPOINT / FLYTE_AWS_ACCESS_KEY_ID / FLYTE_AWS_SECRET_ACCESS_KEY. The platform's own readers
(datasets, tokenizers, model folders, checkpoints) go through fsspec's s3fs, whose botocore client reads
AWS_ENDPOINT_URL_S3 / AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY instead: without the copy below, a pod
reading the dataset that `pyflyte run --remote` uploaded asks s3.amazonaws.com for it.
"""

from __future__ import annotations

import os
from typing import MutableMapping

# flytekit's variable -> botocore's.
SHARED_SETTINGS = (
    ("FLYTE_AWS_ENDPOINT", "AWS_ENDPOINT_URL_S3"),
    ("FLYTE_AWS_ACCESS_KEY_ID", "AWS_ACCESS_KEY_ID"),
    ("FLYTE_AWS_SECRET_ACCESS_KEY", "AWS_SECRET_ACCESS_KEY"),
)


def share_flyte_s3_settings(environ: MutableMapping[str, str] = os.environ) -> None:
    """Give botocore flytekit's S3 settings where botocore has none of its own (its own always win)."""
    for flyte_name, boto_name in SHARED_SETTINGS:
        if environ.get(flyte_name) and not environ.get(boto_name):
            environ[boto_name] = environ[flyte_name]
