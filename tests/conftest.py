import os
from pathlib import Path

import pytest


@pytest.fixture(scope="session", autouse=True)
def _fedal_cache(tmp_path_factory):
    """Generated datasets go to a cache private to this test session (never the user's)."""
    cache = tmp_path_factory.mktemp("fedal-cache")
    old = os.environ.get("FEDAL_CACHE_DIR")
    os.environ["FEDAL_CACHE_DIR"] = str(cache)
    yield Path(cache)
    if old is None:
        os.environ.pop("FEDAL_CACHE_DIR", None)
    else:
        os.environ["FEDAL_CACHE_DIR"] = old
