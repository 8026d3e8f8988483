"""What a benchmark's report keeps when it is written again: the hand-written reading below the
generated part (from its "## Reading" heading on), so a rerun replaces the numbers only."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

READING_MARK = "## Reading"


def kept_reading(path: Path) -> str:
    """The hand-written reading of the report at `path` ("" if it has none), to append."""
    if not path.exists():
        return ""
    text = path.read_text()
    i = text.find(READING_MARK)
    return "" if i < 0 else "\n" + text[i:]


def write_report(path: Path, generated: str) -> None:
    """`generated` at `path`, followed by the reading the file held (kept_reading)."""
    path.write_text(generated + kept_reading(path))


def write_results(out: str | Path, name: str, lines: list[str], data: dict[str, Any]) -> None:
    """A benchmark's outputs in `out` (made if missing): NAME.md (its lines, the reading the file
    held kept below them) and NAME.json (`data`); the lines printed as well."""
    folder = Path(out)
    folder.mkdir(parents=True, exist_ok=True)
    write_report(folder / f"{name}.md", "\n".join(lines))
    (folder / f"{name}.json").write_text(json.dumps(data, indent=2))
    print("\n".join(lines))
