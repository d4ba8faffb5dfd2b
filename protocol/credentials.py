# A device's (or the coordinator's) credential file: who it is on the broker, its HMAC key, its TLS files, its identity
# signing key and the fleet's roster of identity public keys (secure aggregation's signed key adverts).
from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

from protocol import wire
from protocol.errors import UsageError
from protocol.files import atomic_write_bytes
from protocol.mqtt import BrokerAddress

CREDENTIALS_VERSION = 1
TLS_FIELDS = ("ca_file", "cert_file", "key_file")


@dataclass(frozen=True)
class DeviceIdentity:
    """Who a device is to secure aggregation: its Ed25519 identity secret (raw, 32 bytes; empty for the coordinator
    and on an open fleet) and the fleet's roster of identity public keys by device id (empty on an open fleet: then
    key adverts go unsigned and unchecked)."""

    secret: bytes = field(default=b"", repr=False)
    roster: Mapping[str, bytes] = field(default_factory=dict)


@dataclass(frozen=True)
class Credentials:
    """What one MQTT client needs to join a secured fleet; TLS paths are absolute once loaded."""

    fleet: str
    username: str
    password: str
    device_id: str = ""
    hmac_key: bytes = b""
    ca_file: str | None = None
    cert_file: str | None = None
    key_file: str | None = None
    identity_key: bytes = b""
    identities: dict[str, bytes] = field(default_factory=dict)

    @property
    def identity(self) -> DeviceIdentity:
        """This client's identity key and the fleet's roster, as secure aggregation takes them."""
        return DeviceIdentity(self.identity_key, dict(self.identities))

    def apply_to(self, address: BrokerAddress) -> BrokerAddress:
        """The broker address with this client's username, password and TLS files filled in."""
        return dataclasses.replace(
            address,
            username=self.username,
            password=self.password,
            ca_file=self.ca_file,
            cert_file=self.cert_file,
            key_file=self.key_file,
        )


def save_credentials(path: Path, credentials: Credentials) -> None:
    """Writes the file with 0600 permissions; TLS paths are stored relative to its folder so it can be copied."""
    body = {
        "version": CREDENTIALS_VERSION,
        **dataclasses.asdict(credentials),
        "hmac_key": credentials.hmac_key.hex(),
        "identity_key": credentials.identity_key.hex(),
        "identities": {device: key.hex() for device, key in sorted(credentials.identities.items())},
    }
    for name in TLS_FIELDS:
        if body[name] is not None:
            body[name] = os.path.relpath(Path(body[name]).resolve(), path.parent.resolve())
    atomic_write_bytes(path, (json.dumps(body, indent=2, sort_keys=True) + "\n").encode())


def load_credentials(path: Path) -> Credentials:
    """Reads a credential file written by `fl-coordinator provision`; ValueError saying what is wrong otherwise."""
    path = Path(path)
    try:
        body = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as error:
        raise UsageError(f"credential file {path}: cannot read it ({error})") from None
    if not isinstance(body, dict) or body.get("version") != CREDENTIALS_VERSION:
        raise UsageError(f"credential file {path}: not a version {CREDENTIALS_VERSION} credential file")
    try:
        credentials = Credentials(
            fleet=wire.check_identifier("fleet", body["fleet"]),
            username=wire.check_identifier("username", body["username"]),
            password=_string(body["password"], "password"),
            device_id=_optional_identifier(body.get("device_id", ""), "device id"),
            hmac_key=bytes.fromhex(_string(body.get("hmac_key", ""), "hmac_key")),
            identity_key=bytes.fromhex(_string(body.get("identity_key", ""), "identity_key")),
            identities=_identities(body.get("identities", {})),
            **{name: _tls_path(path, body.get(name), name) for name in TLS_FIELDS},
        )
    # bytes.fromhex and the field checks raise ValueError for a bad credential file: the person's to fix
    except (KeyError, ValueError) as error:
        raise UsageError(f"credential file {path}: {error}") from None
    return credentials


def _string(value: object, name: str) -> str:
    if not isinstance(value, str):
        raise UsageError(f"{name} must be a string")
    return value


def _identities(value: object) -> dict[str, bytes]:
    """The fleet's roster of identity public keys: device id -> 32-byte key, written as hex."""
    if not isinstance(value, dict):
        raise UsageError("identities must map device ids to hex keys")
    roster = {
        wire.check_identifier("device id", device): bytes.fromhex(_string(key, "identity"))
        for device, key in value.items()
    }
    if any(len(key) != 32 for key in roster.values()):
        raise UsageError("an identity public key is not 32 bytes")
    return roster


def _optional_identifier(value: object, kind: str) -> str:
    return "" if value == "" else wire.check_identifier(kind, _string(value, kind))


def _tls_path(credential_file: Path, value: object, name: str) -> str | None:
    if value is None:
        return None
    resolved = (credential_file.parent / _string(value, name)).resolve()
    if not resolved.is_file():
        raise UsageError(f"{name} {resolved} does not exist")
    return str(resolved)
