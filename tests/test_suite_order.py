"""The suite's file order (tests/conftest.py LONG_FILES): every file it names exists, so a renamed
long file does not silently drop to the end of the run, where one worker would run it alone."""

from __future__ import annotations

from pathlib import Path

from tests.conftest import LONG_FILES


def test_the_long_files_named_for_the_suite_order_exist():
    here = Path(__file__).parent
    assert sorted(name for name in LONG_FILES if not (here / name).is_file()) == []
