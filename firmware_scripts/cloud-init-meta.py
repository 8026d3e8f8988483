"""flash.sh (cloud-init mode): the card's meta-data with a new instance-id, the image's other keys
carried over.

    python3 cloud-init-meta.py IMAGE_META_DATA INSTANCE_ID OUT

cloud-init runs `runcmd` once per instance-id, so every flash needs a new one. The image's file is
edited where its shape allows it: a JSON object (cloud-init reads meta-data as YAML, of which JSON
is a part), or YAML's plain top-level `key: value` lines (comments, a `---` header and values
continued on indented lines included). Any other shape (flow style, an indented mapping, several
documents) is replaced by the instance-id alone, and the reason printed: the file written must
parse, and the new instance-id must be the only one (a second one, which YAML readers take last,
would bring the old id back). flash.sh keeps the image's file as fedal/meta-data.orig.
"""

from __future__ import annotations

import json
import re
import sys

KEY = re.compile(r"""^(?P<q>["']?)(?P<name>[A-Za-z0-9_][A-Za-z0-9_.-]*)(?P=q)[ \t]*:(?:[ \t]|$)""")


# YAML's node properties and references: an anchor whose key is dropped would leave its alias
# unresolved, and a tag can make a value what a plain reading does not see
PROPERTY = re.compile(r"(?:^|[\s\[{,:-])[&*!]\S")
OTHER_BREAKS = ("\x85", "\u2028", "\u2029")  # line breaks to YAML 1.1 (PyYAML, cloud-init's reader) too


def edited(text: str, instance_id: str) -> tuple[str, str]:
    """(the new meta-data, why the image's keys were not kept: "" when they were). Where PyYAML
    is at hand (cloud-init's own reader), the result is read back: the image's keys must come
    out as they went in, beside the new instance-id alone; else the new instance-id alone."""
    text = text.lstrip("\ufeff").replace("\r\n", "\n").replace("\r", "\n")
    ours = f"instance-id: {instance_id}\n"  # flash.sh's: fedal-<client id>-<ns>, plain characters
    written, why = _merged(text, instance_id, ours)
    if not why and not _reads_back(text, written, instance_id):
        return ours, "the image's meta-data reads differently once edited (YAML beyond plain keys)"
    return written, why


def _reads_back(text: str, written: str, instance_id: str) -> bool:
    try:
        import yaml
    except ImportError:  # the shapes _merged takes are plain enough without the check
        return True
    try:
        before, after = yaml.safe_load(text), yaml.safe_load(written)
    except yaml.YAMLError:
        return False
    before = {} if before is None else before
    if not isinstance(before, dict) or not isinstance(after, dict) or after.get("instance-id") != instance_id:
        return False
    return {k: v for k, v in after.items() if k != "instance-id"} == \
        {k: v for k, v in before.items() if k != "instance-id"}


def _merged(text: str, instance_id: str, ours: str) -> tuple[str, str]:
    if any(mark in text for mark in OTHER_BREAKS):
        return ours, "the image's meta-data holds line breaks other than newlines"
    if text.lstrip().startswith("{"):
        try:
            data = json.loads(text)
        except ValueError:
            return ours, "the image's meta-data is neither JSON nor plain YAML keys"
        if not isinstance(data, dict):
            return ours, "the image's meta-data is not a mapping"
        data.pop("instance-id", None)
        return json.dumps({"instance-id": instance_id, **data}, indent=2, ensure_ascii=False) + "\n", ""
    kept: list[str] = []
    dropping = False  # inside the image's instance-id (its value may go on over indented lines)
    started = False  # a key came: a `---` after it starts a second document
    ended = False  # the document's end (`...`): nothing but comments may follow
    for line in text.split("\n"):
        bare = line.strip()
        if not bare or bare.startswith("#"):
            if not dropping:
                kept.append(line)
            continue
        if ended:
            return ours, "the image's meta-data is not one document of plain keys"
        if line[0] in " \t":  # the value of the key above goes on
            if not started:
                return ours, "the image's meta-data is an indented mapping"
            if PROPERTY.search(bare):
                return ours, "the image's meta-data uses YAML anchors, aliases or tags"
            if not dropping:
                kept.append(line)
            continue
        if bare == "..." and line[0] == ".":
            ended = True
            continue
        if bare.startswith(("---", "...", "%")):
            if started or line.rstrip() != "---":
                return ours, "the image's meta-data is not one document of plain keys"
            continue  # the header: ours goes first
        key = KEY.match(line)
        if key is None:
            return ours, "the image's meta-data is not plain YAML keys (flow style, a list, ...)"
        if PROPERTY.search(line[key.end():]):
            return ours, "the image's meta-data uses YAML anchors, aliases or tags"
        started = True
        dropping = key.group("name") == "instance-id"
        if not dropping:
            kept.append(line)
    body = "\n".join(kept).strip("\n")
    return ours + (body + "\n" if body else ""), ""


def main(argv: list[str]) -> int:
    if len(argv) != 3:
        print("usage: cloud-init-meta.py IMAGE_META_DATA INSTANCE_ID OUT", file=sys.stderr)
        return 2
    source, instance_id, out = argv
    with open(source, encoding="utf-8", errors="replace") as f:
        text, why = edited(f.read(), instance_id)
    with open(out, "w", encoding="utf-8") as f:
        f.write(text)
    if why:
        print(f"{why}: replaced by one holding the new instance-id alone (the image's is kept in fedal/meta-data.orig)")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
