"""flash.sh's cloud-init meta-data (firmware_scripts/cloud-init-meta.py): every shape an image's
meta-data may take comes out as a file cloud-init can read, holding flash.sh's new instance-id as
its only one (a second, which YAML readers take last, brought the old id back, and with it a
`runcmd` that never ran), with the image's other keys kept where the shape allows."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

SCRIPT = Path(__file__).resolve().parents[1] / "firmware_scripts" / "cloud-init-meta.py"
NEW = "fedal-pi-1-1764000000000000000"


REPLACED = None  # the image's file of a shape this cannot edit: the new instance-id alone, and said


@pytest.mark.parametrize("image, kept", [
    ("instance-id: iid-image\nlocal-hostname: raspberrypi\n", {"local-hostname": "raspberrypi"}),
    ("instance-id: iid-image\r\nlocal-hostname: raspberrypi", {"local-hostname": "raspberrypi"}),  # CRLF, no last newline
    ('"instance-id": iid-image\n\'dsmode\': local\n', {"dsmode": "local"}),  # quoted keys
    ("---\n# the image's\ninstance-id: iid-image\nlocal-hostname: pi\n...\n", {"local-hostname": "pi"}),
    ("instance-id: >-\n  iid-\n  image\nlocal-hostname: pi\n", {"local-hostname": "pi"}),  # a folded value
    ("local-hostname: pi\npublic-keys:\n  - ssh-ed25519 AAAA\n", {"local-hostname": "pi", "public-keys": ["ssh-ed25519 AAAA"]}),
    ('{"instance-id": "iid-image", "local-hostname": "raspberrypi"}', {"local-hostname": "raspberrypi"}),  # JSON
    ("{instance-id: iid-image, dsmode: local}\n", REPLACED),  # flow style: replaced
    ("  instance-id: iid-image\n  dsmode: local\n", REPLACED),  # an indented mapping: replaced
    ("instance-id: a\n---\ninstance-id: b\n", REPLACED),  # two documents: replaced
    ("- instance-id\n", REPLACED),  # not a mapping: replaced
    ("[1, 2]", REPLACED),
    ("local-hostname: pi\u2028instance-id: iid-old\n", REPLACED),  # a line break to YAML 1.1: the old id again
    ("local-hostname: pi\x85dsmode: local\n", REPLACED),
    ("instance-id: &iid iid-local01\nlocal-hostname: *iid\n", REPLACED),  # the anchor goes with the id
    ("local-hostname: !!str pi\n", REPLACED),  # a tag
    ("public-keys:\n  - &k ssh-ed25519 AAAA\nother: *k\n", REPLACED),
    ('{"instance-id": "iid", "local-hostname": "pi-\u00e9t\u00e9"}', {"local-hostname": "pi-\u00e9t\u00e9"}),  # as UTF-8
    ("", {}),
    ("# nothing but a comment\n", {}),
])
def test_the_card_gets_one_new_instance_id_and_the_images_other_keys(tmp_path, image, kept):
    source, out = tmp_path / "meta-data.orig", tmp_path / "meta-data"
    source.write_bytes(image.encode())
    r = subprocess.run([sys.executable, str(SCRIPT), str(source), NEW, str(out)], capture_output=True, text=True,
                       timeout=30)
    assert r.returncode == 0, r.stderr
    text = out.read_text()
    assert yaml.safe_load(text) == {"instance-id": NEW, **(kept or {})}, text
    assert text.count("instance-id") == 1 and text.startswith(("instance-id: fedal-", '{\n  "instance-id": "fedal-'))
    assert ("replaced by one holding the new instance-id alone" in r.stdout) == (kept is REPLACED), r.stdout


@pytest.mark.parametrize("image", [
    '{"instance-id": "iid", "size": 1e3}',  # a string to YAML 1.1, a float to JSON: not written back as 1000.0
    "local-hostname: pi # a comment\nsize: 0x1F\n",
])
def test_without_pyyaml_the_plain_shapes_are_merged_and_with_it_checked(tmp_path, image):
    """Where PyYAML is at hand the result is read back as cloud-init reads it; without it (a host
    with only the fleet extra) the same plain shapes are merged."""
    source, out = tmp_path / "meta-data.orig", tmp_path / "meta-data"
    source.write_text(image)
    no_yaml = tmp_path / "no-yaml"
    no_yaml.mkdir()
    (no_yaml / "yaml.py").write_text("raise ImportError('not installed')\n")
    checked = subprocess.run([sys.executable, str(SCRIPT), str(source), NEW, str(out)], capture_output=True, text=True,
                             timeout=30)
    assert checked.returncode == 0 and yaml.safe_load(out.read_text())["instance-id"] == NEW
    expected = {k: v for k, v in yaml.safe_load(image).items() if k != "instance-id"}
    kept = {k: v for k, v in yaml.safe_load(out.read_text()).items() if k != "instance-id"}
    assert kept == expected or (kept == {} and "replaced" in checked.stdout), (out.read_text(), checked.stdout)
    unchecked = subprocess.run([sys.executable, str(SCRIPT), str(source), NEW, str(out)], capture_output=True,
                               text=True, timeout=30, env={**os.environ, "PYTHONPATH": str(no_yaml)})
    assert unchecked.returncode == 0 and yaml.safe_load(out.read_text())["instance-id"] == NEW


def test_usage_errors_exit_2():
    r = subprocess.run([sys.executable, str(SCRIPT), "one"], capture_output=True, text=True, timeout=30)
    assert r.returncode == 2 and "usage:" in r.stderr
