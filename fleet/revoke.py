"""`fedal fleet revoke`: take devices out of a fleet, or give them new credentials (`--reissue`),
leaving every other account as it is.

A device whose SD card left your hands carries its broker password. Revoking removes its line
from the broker's `passwd` and its block from `acl` (Mosquitto re-reads both on a reload and
drops a connected client they no longer admit), its config from `devices/`, and its id from the
coordinator's `client_ids`. `--reissue` instead gives it a new password (and its ACL block back,
if it was revoked) and writes its config to flash again, with only what the fleet owns changed: the
old card is locked out, the device stays in the fleet. `fleet init --force` would change every device's password.
"""

from __future__ import annotations

import json
import re
import tomllib
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path

import tomlkit
from tomlkit.exceptions import TOMLKitError
from tomlkit.items import Array

from edge_agent.config import AgentConfig
from fedal.protocol import topics
from fleet import acl, passwords
from fleet.generate import (
    _PLAN,
    MARKER,
    FleetError,
    _generated_before,
    _marker_text,
    _write,
    linked_folders,
    write_device,
)

__all__ = ["Revoked", "revoke_devices"]


@dataclass(frozen=True)
class Revoked:
    done: dict[str, str]  # device id -> "revoked", "reissued" (and how its config was kept) or "already revoked"
    devices: list[str]  # the fleet's devices afterwards (the coordinator's client_ids)
    revoked: list[str]  # every device revoked so far


def _natural(cid: str) -> list[object]:
    """pi-2 before pi-10."""
    return [(0, int(t)) if t.isdigit() else (1, t) for t in re.split(r"(\d+)", cid)]


def _read(path: Path) -> str:
    try:
        return path.read_text(encoding="utf-8")
    except OSError as exc:
        raise FleetError(f"cannot read {path}: {exc.strerror or exc} (revoke needs the fleet `fedal fleet init` "
                         f"wrote there)") from None
    except UnicodeDecodeError as exc:
        raise FleetError(f"{path} is not UTF-8 text (byte {exc.start}): not a file `fedal fleet init` wrote, "
                         "or damaged") from None


def _summary(out: Path) -> dict:
    try:
        summary = json.loads(_read(out / "fleet.json"))
        if not isinstance(summary, dict) or not isinstance(summary.get("devices"), list):
            raise ValueError("no devices list")
        for key in ("run_id", "broker", "coordinator_user", "model", "tls"):
            if key not in summary:
                raise ValueError(f"no {key}")
        if not all(isinstance(cid, str) and cid for cid in summary["devices"]):
            raise ValueError("a device id that is not a name")
        revoked = summary.get("revoked")
        if revoked is not None and not (isinstance(revoked, dict) and all(
                isinstance(k, str) and isinstance(v, str) for k, v in revoked.items())):
            raise ValueError("`revoked` is not a table of device ids and times")
        if not all(isinstance(summary[key], str) for key in ("run_id", "broker", "coordinator_user", "model")):
            raise ValueError("run_id, broker, coordinator_user and model must be text")
    except ValueError as exc:
        raise FleetError(f"{out / 'fleet.json'} is not a fleet summary `fedal fleet init` writes ({exc})") from None
    return summary


def _passwd_user(line: str) -> tuple[str, str] | None:
    """(user, hash) of a password-file line as Mosquitto 2.0 reads it (`pwfile__parse`): a line
    starting with # or without a colon is no account; the name is the first colon-separated token,
    blanks around it trimmed (` pi-2 :...` is pi-2's), so a hand-edited line is found by its name."""
    if line.startswith("#") or ":" not in line:
        return None
    tokens = [t for t in line.split(":") if t]  # strtok: a run of colons is one separator
    if not tokens or not tokens[0].strip():
        return None
    return tokens[0].strip(), (tokens[1].strip() if len(tokens) > 1 else "")


def _passwd_entries(text: str) -> dict[str, str]:
    entries: dict[str, str] = {}
    for line in text.splitlines():
        account = _passwd_user(line)
        if account is not None:
            entries.setdefault(*account)
    return entries


def _passwd_text(text: str, entries: dict[str, str], targets: set[str]) -> str:
    """The password file with the `targets`' accounts as `entries` has them: every other line as
    it is (an operator's comments and accounts, a duplicate line of theirs included), a target's
    first line given its new hash, its other lines (or all, for one removed) gone, a new one at
    the end."""
    lines, written = [], set()
    for line in text.splitlines():
        account = _passwd_user(line)
        if account is None or account[0] not in targets:
            lines.append(line)
        elif account[0] in entries and account[0] not in written:
            lines.append(f"{account[0]}:{entries[account[0]]}")
            written.add(account[0])
    lines += [f"{user}:{hashed}" for user, hashed in entries.items() if user in targets and user not in written]
    return "".join(f"{line}\n" for line in lines)


def _acl_word(line: str) -> tuple[str, str] | None:
    """(keyword, the rest) of an ACL line as Mosquitto 2.0 reads it (`aclfile__parse`): trailing
    blanks dropped, a line starting with # skipped, the keyword the first space-separated word
    (`  user ops` is a user line)."""
    stripped = line.rstrip()
    if not stripped or stripped.startswith("#"):
        return None
    word, _, rest = stripped.lstrip(" ").partition(" ")
    return word, rest.strip()


def _acl_blocks(text: str) -> tuple[list[str | tuple[str, str]], dict[str, list[str]]]:
    """The ACL in order: each `user` block as (user, its `user` line), every other line (comments,
    blank lines, `pattern` rules, which apply to every user) as it is; and each user's rules by
    name. As Mosquitto reads the file, a `topic` line is the rule of the last `user` line above
    it: a device's rules are those, and nothing else is the device's to remove."""
    items: list[str | tuple[str, str]] = []
    blocks: dict[str, list[str]] = {}
    current: list[str] | None = None
    for line in text.splitlines():
        word = _acl_word(line)
        if word is not None and word[0] == "user":
            current = blocks.setdefault(word[1], [])
            items.append((word[1], line))  # the user line as written (its indentation kept)
        elif current is not None and word is not None and word[0] == "topic":
            current.append(line)
        else:
            items.append(line)
    return items, blocks


def _check_locked_out(passwd: str, acl_text: str, gone: list[str], new_hashes: dict[str, str]) -> None:
    """The files about to be written read back as Mosquitto reads them: no revoked device has an
    account or rules left, a reissued one has its new hash only. Refused before anything is
    written otherwise (a line this reader and Mosquitto's would see differently)."""
    accounts: dict[str, list[str]] = {}
    for line in passwd.splitlines():
        account = _passwd_user(line)
        if account is not None:
            accounts.setdefault(account[0], []).append(account[1])
    users = {word[1] for word in map(_acl_word, acl_text.splitlines()) if word is not None and word[0] == "user"}
    left = [cid for cid in gone if cid in accounts or cid in users]
    left += [cid for cid, hashed in new_hashes.items() if accounts.get(cid) != [hashed]]
    if left:
        raise FleetError(f"the broker's passwd or acl would still admit {', '.join(left)} as before (a line there "
                         "names it in a way this command does not rewrite); nothing was changed: edit those lines "
                         "by hand, then run the command again")


def _acl_text(items: list[str | tuple[str, str]], blocks: dict[str, list[str]]) -> str:
    """The ACL with `blocks` as they are now: a block removed leaves the lines around it, a block
    new (a revoked device reissued) goes at the end."""
    lines: list[str] = []
    placed: set[str] = set()
    removed = False  # the line before was a removed block: the blank line after it goes with it
    for item in items:
        if isinstance(item, str):
            if not (removed and not item.strip()):
                lines.append(item)
            removed = False
        elif item[0] in blocks and item[0] not in placed:
            placed.add(item[0])
            lines += [item[1], *blocks[item[0]]]
            removed = False
        else:
            removed = True
    for user, rules in blocks.items():
        if user not in placed:
            if lines and lines[-1].strip():
                lines.append("")
            lines += [f"user {user}", *rules, ""]
    return "\n".join(lines) + ("\n" if lines and lines[-1] else "")


def _acl_run(blocks: dict[str, list[str]], summary: dict) -> str:
    """The run level the broker's ACL gives devices now (the docs move a fleet to another run id
    by editing the ACL): read from a device's block, else what fleet init recorded."""
    level = topics.acl_run_level("\n".join(rule for rules in blocks.values() for rule in rules))
    if level is not None:
        return level
    return str(summary.get("acl_run_id", "+"))  # fleets from before the ACL named the run id had a +


def _ca_cert(out: Path) -> bytes:
    """The CA the devices trust: ca/ may be kept offline (its key), the broker and coordinator copies stay."""
    for name in ("ca/ca.crt", "broker/ca.crt", "coordinator/ca.crt"):
        if (out / name).is_file():
            return (out / name).read_bytes()
    raise FleetError(f"{out} holds no ca.crt (ca/, broker/ or coordinator/): a reissued TLS device needs the CA "
                     "its broker's certificate was issued by")


def _kept_config(path: Path, cid: str, password: str, planned: dict[Path, tuple[str, int]]) -> str | None:
    """A reissued device's config with its identity, run id and password the fleet's: the other
    settings edited into the one there (a data file, a model of its own, broker options), its
    comments and its layout stay (tomlkit edits the file's own document in place). Changes
    `planned` (the config `write_device` planned) to that; says what happened, None where there
    was no config. One it cannot keep is an error before anything is written: the user's edits
    are not dropped for a fresh file without a word."""
    if path.is_symlink():
        raise FleetError(f"{path} is a symbolic link: reissue writes the device's config there. Replace the link with "
                         f"the file (to keep its settings), or remove it for a new config")
    if not path.is_file():
        return None
    fresh = tomllib.loads(planned[path][0])
    try:
        text = path.read_text()
        tomllib.loads(text)  # the standard reader's verdict and message first
        document = tomlkit.parse(text)
        broker = document.get("broker")
        if not isinstance(broker, dict):
            raise ValueError("it has no [broker] table")
        # the fleet's own: who the device is, the run its ACL admits, its new credentials
        document["client_id"], document["run_id"] = cid, fresh["run_id"]
        broker["username"], broker["password"] = cid, password
        if "ca_file" in fresh["broker"] and "ca_file" not in broker:
            broker["ca_file"] = fresh["broker"]["ca_file"]
        config = document.unwrap()
        AgentConfig.model_validate(config)
        kept = tomlkit.dumps(document)
        if tomllib.loads(kept) != config:  # what is written reads back as what was checked
            raise ValueError("its layout cannot be kept by the edit (rewrite it as plain tables)")
    except (OSError, UnicodeDecodeError, tomllib.TOMLDecodeError, TOMLKitError, ValueError) as exc:
        raise FleetError(f"{path} is not a valid agent config, so its settings cannot be kept: {exc}\n"
                         f"Fix it, or remove it for a new config") from None
    planned[path] = (kept, planned[path][1])
    note = "its config's other settings kept"
    if "ca_file" in fresh["broker"] and config["broker"]["ca_file"] != fresh["broker"]["ca_file"]:
        note += (f"; its ca_file stays {config['broker']['ca_file']}, not the fleet's "
                 f"{fresh['broker']['ca_file']} (flash it without --ca, or point ca_file there)")
    return note


def _set_client_ids(document: tomlkit.TOMLDocument, devices: list[str]) -> None:
    """broker.toml's client_ids made `devices`: the array there edited in place (the comments on
    its lines stay), ids taken out and new ones put where `devices` orders them; replaced by a new
    one (one per line, as `fleet init` writes it) only where it is missing or not a list of ids."""
    ids = document.get("client_ids")
    if isinstance(ids, Array) and all(isinstance(x, str) for x in ids):
        for i in reversed(range(len(ids))):
            if ids[i] not in devices:
                del ids[i]
        rank = {cid: i for i, cid in enumerate(devices)}
        for cid in devices:
            if cid not in ids:
                later = [j for j, x in enumerate(ids) if rank[x] > rank[cid]]
                if later:
                    ids.insert(later[0], cid)
                else:
                    ids.append(cid)
        if list(ids) == devices:
            return
    fresh = tomlkit.array()
    fresh.extend(devices)
    document["client_ids"] = fresh.multiline(True)


def revoke_devices(out: Path, ids: list[str], reissue: bool = False) -> Revoked:
    """Revoke (or, with reissue, re-key) each device of `ids` in the fleet under `out`."""
    summary = _summary(out)
    devices: list[str] = list(summary["devices"])
    revoked: dict[str, str] = dict(summary.get("revoked") or {})
    coordinator_user = summary["coordinator_user"]
    for cid in ids:
        if cid == coordinator_user:
            raise FleetError(f"{cid!r} is the coordinator's account, not a device: `fleet init --force` renews it")
        if cid not in devices and cid not in revoked:
            raise FleetError(f"{cid!r} is not a device of the fleet in {out} (its devices: {', '.join(devices) or 'none'})")
    passwd_path, acl_path = out / "broker" / "passwd", out / "broker" / "acl"
    passwd_text = _read(passwd_path)
    entries = _passwd_entries(passwd_text)
    acl_items, blocks = _acl_blocks(_read(acl_path))
    coordinator_toml = out / "coordinator" / "broker.toml"
    coordinator_text = _read(coordinator_toml)
    try:
        tomllib.loads(coordinator_text)
        coordinator = tomlkit.parse(coordinator_text)  # edited in place: its comments and layout stay
    except (tomllib.TOMLDecodeError, TOMLKitError) as exc:
        raise FleetError(f"{coordinator_toml} is not TOML: {exc}") from None
    files = _generated_before(out)
    acl_run = _acl_run(blocks, summary)
    run_id = acl_run if acl_run != "+" else summary["run_id"]
    ca_cert = _ca_cert(out) if reissue and summary["tls"] else None

    done: dict[str, str] = {}
    new_passwords: dict[str, str] = {}
    gone: list[str] = []
    for cid in dict.fromkeys(ids):
        if reissue:
            new_passwords[cid] = passwords.new_password()
            entries[cid] = passwords.mosquitto_hash(new_passwords[cid])
            if cid not in blocks:  # a revoked device's rules again; a listed device keeps its block as it is
                blocks[cid] = acl.device_rules(cid, None if acl_run == "+" else acl_run)
            revoked.pop(cid, None)
            if cid not in devices:
                devices.append(cid)
            done[cid] = "reissued"
        elif cid in revoked and cid not in entries and cid not in blocks:
            done[cid] = "already revoked"
        else:
            entries.pop(cid, None)
            blocks.pop(cid, None)
            gone.append(cid)
            if cid in devices:
                devices.remove(cid)
            revoked[cid] = datetime.now(UTC).isoformat(timespec="seconds")
            done[cid] = "revoked"
    devices.sort(key=_natural)

    # its files go from, and a reissued device's to, folders of the fleet's own only: through a
    # link they would be another's
    linked = [f"devices/{cid}" for cid in [*gone, *new_passwords]
              if linked_folders(out, out / "devices" / cid / "agent.toml")]
    if linked:
        raise FleetError(f"--out {out}: {', '.join(linked)} is a link, not a folder `fedal fleet init` wrote; nothing "
                         "was changed (replace the link by the folder it should be, or remove it)")
    # the new device configs planned (and checked) before anything is written
    token = _PLAN.set({})
    try:
        for cid, password in new_passwords.items():
            write_device(out, cid, run_id, summary["model"], summary["broker"], password, ca_cert)
        device_files = _PLAN.get() or {}
    except ValueError as exc:
        raise FleetError(f"cannot write a new config for the fleet's devices: {exc}") from None
    finally:
        _PLAN.reset(token)
    foreign = [path.relative_to(out).as_posix() for path in device_files
               if path.name != "agent.toml" and (path.exists() or path.is_symlink())
               and path.relative_to(out).as_posix() not in files]
    if foreign:  # (a device's config is kept, edited: _kept_config) a ca.crt of the user's is not replaced
        raise FleetError(f"--out {out}: {', '.join(foreign)} exist(s) and no `fedal fleet` command wrote them; "
                         "nothing was changed (move them away)")
    for cid, password in new_passwords.items():
        kept = _kept_config(out / "devices" / cid / "agent.toml", cid, password, device_files)
        if kept is not None:
            done[cid] = f"reissued ({kept})"
    new_passwd, new_acl = _passwd_text(passwd_text, entries, set(ids)), _acl_text(acl_items, blocks)
    _check_locked_out(new_passwd, new_acl, gone, {cid: entries[cid] for cid in new_passwords})
    try:
        # the accounts first: once these two are on the broker, a revoked card is locked out
        _write(passwd_path, new_passwd, 0o600)
        _write(acl_path, new_acl, 0o644)
        for path, (text, mode) in device_files.items():
            _write(path, text, mode)
            files.add(path.relative_to(out).as_posix())
        for cid in gone:  # its password no longer opens the broker: a card flashed with it could not log in
            for name in ("agent.toml", "ca.crt"):
                path = out / "devices" / cid / name
                if f"devices/{cid}/{name}" in files and (path.is_file() or path.is_symlink()):
                    path.unlink()
                files.discard(f"devices/{cid}/{name}")
            folder = out / "devices" / cid
            if folder.is_dir() and not any(folder.iterdir()):
                folder.rmdir()
        _set_client_ids(coordinator, devices)
        _write(coordinator_toml, tomlkit.dumps(coordinator), 0o600)
        summary["devices"] = devices
        summary["revoked"] = dict(sorted(revoked.items(), key=lambda kv: _natural(kv[0])))
        _write(out / "fleet.json", json.dumps(summary, indent=2) + "\n", 0o644)
        _write(out / MARKER, _marker_text(files), 0o644)
    except OSError as exc:  # a full disk, a read-only folder: said, and the same command finishes it
        raise FleetError(f"--out {out}: cannot write {Path(exc.filename or '').name or 'the fleet'}: "
                         f"{exc.strerror or exc}; what was written stays (the accounts go first): run the same "
                         "command again once it can write there") from None
    return Revoked(done, devices, list(summary["revoked"]))
