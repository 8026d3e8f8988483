"""flash.sh's cloud-init meta-data (firmware_scripts/cloud-init-meta.py): every shape an image's
meta-data may take comes out as a file cloud-init can read, holding flash.sh's new instance-id as
its only one (a second, which YAML readers take last, brought the old id back, and with it a
`runcmd` that never ran), with the image's other keys kept where the shape allows."""

from __future__ import annotations

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


def test_usage_errors_exit_2():
    r = subprocess.run([sys.executable, str(SCRIPT), "one"], capture_output=True, text=True, timeout=30)
    assert r.returncode == 2 and "usage:" in r.stderr
