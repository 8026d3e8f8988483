"""Device passwords and Mosquitto's password-file hash.

Mosquitto 2.0 stores `user:$7$<iterations>$<salt b64>$<hash b64>`: PBKDF2-HMAC-SHA512 over a
12-byte salt, 64-byte digest. Hashing here (instead of calling `mosquitto_passwd`) lets the
fleet be generated on a machine without Mosquitto installed; the tests check that a real
Mosquitto accepts the result and that hashes made by `mosquitto_passwd` verify here.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import secrets

ITERATIONS = 101  # mosquitto_passwd's default; the broker reads the count from each line
SALT_BYTES = 12
DIGEST_BYTES = 64


def new_password() -> str:
    """24 URL-safe characters (144 bits): no quoting needed in TOML, URLs or shells."""
    return secrets.token_urlsafe(18)


def mosquitto_hash(password: str, salt: bytes | None = None, iterations: int = ITERATIONS) -> str:
    salt = secrets.token_bytes(SALT_BYTES) if salt is None else salt
    digest = hashlib.pbkdf2_hmac("sha512", password.encode(), salt, iterations, DIGEST_BYTES)
    return f"$7${iterations}${base64.b64encode(salt).decode()}${base64.b64encode(digest).decode()}"


def verify(password: str, hashed: str) -> bool:
    """True if `hashed` (a `$7$` entry, without the user) is the hash of `password`."""
    parts = hashed.split("$")
    if len(parts) != 5 or parts[0] or parts[1] != "7":
        raise ValueError(f"not a Mosquitto $7$ (PBKDF2-SHA512) hash: {hashed[:12]}...")
    iterations, salt, digest = int(parts[2]), base64.b64decode(parts[3]), base64.b64decode(parts[4])
    candidate = hashlib.pbkdf2_hmac("sha512", password.encode(), salt, iterations, len(digest))
    return hmac.compare_digest(candidate, digest)


def password_file(users: dict[str, str]) -> str:
    """The text of a Mosquitto password file for {user: plain password}."""
    for user in users:
        if not user or ":" in user or any(c.isspace() for c in user):
            raise ValueError(f"user name {user!r} cannot go into a Mosquitto password file")
    return "".join(f"{user}:{mosquitto_hash(pw)}\n" for user, pw in users.items())
