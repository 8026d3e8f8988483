"""A new server certificate for a fleet's broker, from the CA `fedal fleet init --tls` kept.

The broker's certificate expires (825 days by default); the devices trust the CA, not the
certificate, so a new one from the same CA and for the same names changes nothing on them. The
alternative, `fleet init --force`, makes a new CA and new passwords: every device re-provisioned.
"""

from __future__ import annotations

import datetime as dt
import ipaddress
import json
from pathlib import Path

from cryptography import x509
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec

from fleet import tls
from fleet.generate import FleetError, _write

__all__ = ["renew_server_cert"]


def _names(cert: x509.Certificate) -> list[str]:
    """The certificate's subjectAltName entries, as `make_server_cert` takes them (its first: the CN)."""
    try:
        san = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    except x509.ExtensionNotFound:
        return []
    names: list[str] = []
    for entry in san:
        if isinstance(entry, x509.IPAddress):
            names.append(str(ipaddress.ip_address(entry.value)))
        elif isinstance(entry, x509.DNSName):
            names.append(entry.value)
    return names


def renew_server_cert(out: Path, days: int = 825) -> dict[str, object]:
    """Write OUT/broker/server.{crt,key} anew, signed by OUT/ca, for the names the current one has."""
    files = {name: out / name for name in ("ca/ca.crt", "ca/ca.key", "broker/server.crt")}
    missing = [name for name, path in files.items() if not path.is_file()]
    if missing:
        raise FleetError(f"{out} has no {', '.join(missing)}: renew-cert needs the fleet `fedal fleet init --tls` "
                         f"wrote there (ca/ holds the CA it keeps)")
    try:
        ca_cert = x509.load_pem_x509_certificate(files["ca/ca.crt"].read_bytes())
        ca_key = serialization.load_pem_private_key(files["ca/ca.key"].read_bytes(), password=None)
        current = x509.load_pem_x509_certificate(files["broker/server.crt"].read_bytes())
    except (ValueError, TypeError) as exc:
        raise FleetError(f"cannot read the fleet's CA or server certificate in {out}: {exc}") from None
    if not isinstance(ca_key, ec.EllipticCurvePrivateKey):
        raise FleetError(f"{files['ca/ca.key']} is not the EC key `fleet init --tls` writes")
    if ca_key.public_key() != ca_cert.public_key():  # another fleet's key: devices would refuse what it signs
        raise FleetError(f"{files['ca/ca.key']} is not the key of {files['ca/ca.crt']} (another fleet's?): nothing "
                         "was written; put back the key `fleet init --tls` made with this CA")
    try:  # the name alone is the same for every fleet of one run id: the signature says whose it is
        current.verify_directly_issued_by(ca_cert)
    except (ValueError, TypeError, InvalidSignature):
        raise FleetError(f"{files['broker/server.crt']} was not issued by {files['ca/ca.crt']}") from None
    names = _names(current)
    if not names:
        raise FleetError(f"{files['broker/server.crt']} names no host (no subjectAltName)")
    ca_days_left = (ca_cert.not_valid_after_utc - dt.datetime.now(dt.UTC)).days
    if ca_days_left < 1:
        raise FleetError(f"the fleet's CA expired on {tls.not_after(files['ca/ca.crt'].read_bytes())}: a certificate "
                         "it signs is refused by every verifier; make a new fleet (`fleet init --force`)")
    days = min(days, ca_days_left)  # never past the CA that vouches for it
    pem = tls.make_server_cert(ca_key, ca_cert, names, days=days)
    x509.load_pem_x509_certificate(pem.cert).verify_directly_issued_by(ca_cert)  # what devices will check
    try:
        _write(out / "broker" / "server.crt", pem.cert, 0o644)
        _write(out / "broker" / "server.key", pem.key, 0o600)
        summary_path = out / "fleet.json"
        try:  # the date fleet init recorded: this certificate's now
            summary = json.loads(summary_path.read_text())
        except (OSError, ValueError):
            summary = None
        if isinstance(summary, dict):
            summary["server_cert_not_after"] = tls.not_after(pem.cert)
            _write(summary_path, json.dumps(summary, indent=2) + "\n", 0o644)
    except OSError as exc:  # a full disk, a read-only folder: the new certificate may be there without its key
        raise FleetError(f"cannot write {Path(exc.filename or '').name or 'the new certificate'} in {out}: "
                         f"{exc.strerror or exc}; do not copy broker/server.crt and server.key to the broker now "
                         "(they may not match): run the same command again once it can write there") from None
    return {"names": names, "not_after": tls.not_after(pem.cert), "ca_not_after": tls.not_after(files["ca/ca.crt"].read_bytes())}
