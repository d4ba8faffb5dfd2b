# Who may talk: writes a fleet's broker passwords, ACL, per-device credentials, HMAC and identity keys, optional TLS.
from __future__ import annotations

import base64
import datetime
import hashlib
import ipaddress
import json
import os
import secrets
from dataclasses import dataclass
from pathlib import Path
from typing import TypedDict

from protocol import topics, wire
from protocol.credentials import Credentials, load_credentials, save_credentials
from protocol.errors import UsageError
from protocol.files import atomic_write_bytes
from protocol.label_signing import labelling_key

COORDINATOR_USERNAME = "coordinator"
LABELLING_USERNAME = "labelling"  # the labelling desk's own login (`fl-coordinator labelling serve --credentials`)
HA_BRIDGE_USERNAME = "ha-bridge"  # the Home Assistant bridge's own login (`fl-coordinator ha-bridge --credentials`)
HOME_ASSISTANT_USERNAME = "home-assistant"  # Home Assistant's or Node-RED's login: reads what the bridge writes
SERVICE_USERNAMES = (COORDINATOR_USERNAME, LABELLING_USERNAME, HA_BRIDGE_USERNAME, HOME_ASSISTANT_USERNAME)
PASSWORD_ITERATIONS = 101  # what mosquitto_passwd 2.0 writes for its $7$ (PBKDF2-SHA512) hashes
DEFAULT_TLS_HOSTS = ("localhost", "127.0.0.1")
LABELLING_KEYS = "labelling-keys.json"  # the labelling desk's keys, beside its labelling.json
CERT_DAYS = 825


@dataclass(frozen=True)
class SecureFleet:
    """A provisioned folder as the coordinator and its broker use it: the files, the device keys, and the roster of
    device identity public keys (empty for a folder provisioned before identity keys existed)."""

    folder: Path
    fleet: str
    coordinator: Credentials
    device_keys: dict[str, bytes]

    @property
    def identities(self) -> dict[str, bytes]:
        """Device id -> Ed25519 identity public key: what checks each device's signed key advert."""
        return dict(self.coordinator.identities)

    @property
    def password_file(self) -> Path:
        """mosquitto's password_file."""
        return self.folder / "passwd"

    @property
    def acl_file(self) -> Path:
        """mosquitto's acl_file."""
        return self.folder / "acl"

    @property
    def tls_dir(self) -> Path:
        """Where the CA, broker and client certificates are (if provisioned with --tls)."""
        return self.folder / "tls"

    @property
    def tls(self) -> bool:
        """Whether this fleet talks TLS."""
        return (self.tls_dir / "broker.crt").is_file()

    def device_credentials(self, device_id: str) -> Path:
        """The credential file of one device, to hand to its agent."""
        return self.folder / "devices" / f"{wire.check_identifier('device id', device_id)}.json"


class TlsPaths(TypedDict, total=False):
    """A client's TLS files, as keyword arguments of Credentials."""

    ca_file: str
    cert_file: str
    key_file: str


def device_names(count: int, prefix: str = "dev") -> list[str]:
    """prefix-00, prefix-01, ...: stable names that sort in order and are valid topic levels and usernames."""
    if count < 1:
        raise UsageError(f"--devices must be at least 1, got {count}")
    names = [wire.check_identifier("device id", f"{prefix}-{index:02d}") for index in range(count)]
    taken = sorted(set(SERVICE_USERNAMES) & set(names))
    if taken:
        raise UsageError(f"a device may not be called {taken[0]!r}")
    return names


def password_hash(password: str, salt: bytes | None = None) -> str:
    """mosquitto 2.0's $7$ password hash: PBKDF2-HMAC-SHA512, 101 iterations, 12-byte salt, base64 parts."""
    salt = salt if salt is not None else secrets.token_bytes(12)
    digest = hashlib.pbkdf2_hmac("sha512", password.encode(), salt, PASSWORD_ITERATIONS, 64)
    return f"$7${PASSWORD_ITERATIONS}${base64.b64encode(salt).decode()}${base64.b64encode(digest).decode()}"


def acl_text(fleet: str) -> str:
    """The coordinator may do anything in the fleet; the labelling desk reads the devices' queries and receipts and
    writes their answers; the Home Assistant bridge reads their status and predictions and writes its sensors'
    topics, which Home Assistant's login reads (under the default discovery prefix); a device writes only under its own topics (by username, %u, never the spoofable client
    id) and reads only the round, the models, their ONNX bundles, the FAST encoder and its own acks and answers,
    each with its chunks (protocol.topics writes the lines from the topic patterns)."""
    coordinator = [f"user {COORDINATOR_USERNAME}", f"topic readwrite {topics.FLEET_ALL.acl(fleet=fleet)}"]
    labelling = [f"user {LABELLING_USERNAME}", *topics.labelling_acl(fleet)]
    bridge = [f"user {HA_BRIDGE_USERNAME}", *topics.ha_bridge_acl(fleet)]
    home_assistant = [f"user {HOME_ASSISTANT_USERNAME}", *topics.home_assistant_acl(fleet)]
    services = [*coordinator, "", *labelling, "", *bridge, "", *home_assistant]
    return "\n".join([*services, "", *topics.device_acl(fleet), ""])


def broker_config_lines(secure: SecureFleet) -> tuple[str, ...]:
    """mosquitto.conf lines that lock the broker to the fleet's passwords and ACL, and TLS on the last listener.

    Every client's id is its login (use_username_as_clientid): a device's valid login connecting under the
    coordinator's or another device's client id gets its own session, so it cannot take theirs over."""
    lines = [
        "allow_anonymous false",
        "use_username_as_clientid true",
        f"password_file {secure.password_file}",
        f"acl_file {secure.acl_file}",
    ]
    if secure.tls:
        tls = secure.tls_dir
        lines += [
            f"cafile {tls / 'ca.crt'}",
            f"certfile {tls / 'broker.crt'}",
            f"keyfile {tls / 'broker.key'}",
            "require_certificate true",
            "tls_version tlsv1.2",
        ]
    return tuple(lines)


def provision(
    fleet: str,
    devices: int,
    out: Path,
    tls: bool = False,
    prefix: str = "dev",
    tls_hosts: tuple[str, ...] = DEFAULT_TLS_HOSTS,
) -> SecureFleet:
    """Writes passwd, acl, keys.json, labelling-keys.json (the desk's: each device's labelling key, which signs no
    update), coordinator.json, devices/<id>.json, broker.conf and (with tls) tls/ into out.

    Refuses a folder that already holds a provisioned fleet: re-provisioning would silently lock every device out.
    """
    wire.check_identifier("fleet", fleet)
    names = device_names(devices, prefix)
    out = Path(out)
    if (out / "keys.json").exists():
        raise UsageError(f"{out} already holds a provisioned fleet; choose a new --out folder")
    out.mkdir(parents=True, exist_ok=True)
    passwords = {name: secrets.token_urlsafe(24) for name in [*SERVICE_USERNAMES, *names]}
    keys = {name: secrets.token_bytes(32) for name in names}
    identities = {name: identity_secret() for name in names}
    tls_files = write_tls_files(out / "tls", names, tls_hosts) if tls else {}
    write_secret(out / "passwd", "".join(f"{user}:{password_hash(pw)}\n" for user, pw in passwords.items()))
    write_public(out / "acl", acl_text(fleet))
    write_secret(out / "keys.json", json.dumps({name: key.hex() for name, key in keys.items()}, indent=2) + "\n")
    labelling = {name: labelling_key(key).hex() for name, key in keys.items()}
    write_secret(out / LABELLING_KEYS, json.dumps(labelling, indent=2) + "\n")
    write_credentials(out, fleet, names, passwords, keys, identities, tls_files)
    secure = load_secure_fleet(out)
    write_public(
        out / "broker.conf",
        "\n".join(
            ["# Add to an external mosquitto's config (after its listener line)", *broker_config_lines(secure), ""]
        ),
    )
    return secure


def write_credentials(
    out: Path,
    fleet: str,
    names: list[str],
    passwords: dict[str, str],
    keys: dict[str, bytes],
    identities: dict[str, bytes],
    tls_files: dict[str, TlsPaths],
) -> None:
    """coordinator.json, labelling.json (the labelling desk's), ha-bridge.json and home-assistant.json (the Home
    Assistant bridge's and Home Assistant's) and one devices/<id>.json per device: login, signing
    key (devices), identity key (devices) and TLS files; the coordinator's and every device's carry the fleet's
    roster of identity public keys (a device checks its neighbours' key adverts with it, trusting no coordinator)."""
    from protocol.secagg.identity import public_of

    roster = {name: public_of(secret) for name, secret in identities.items()}
    tls_of = {name: tls_files.get(name, TlsPaths()) for name in [*SERVICE_USERNAMES, *names]}
    for service in SERVICE_USERNAMES:
        known = roster if service == COORDINATOR_USERNAME else {}
        save_credentials(
            out / f"{service}.json",
            Credentials(fleet, service, passwords[service], identities=known, **tls_of[service]),
        )
    for name in names:
        save_credentials(
            out / "devices" / f"{name}.json",
            Credentials(
                fleet,
                name,
                passwords[name],
                device_id=name,
                hmac_key=keys[name],
                identity_key=identities[name],
                identities=roster,
                **tls_of[name],
            ),
        )


def labelling_keys(folder: Path) -> dict[str, bytes]:
    """The labelling desk's keys of a provisioned folder (labelling-keys.json; derived from keys.json in a folder
    provisioned before that file existed); a UsageError when the folder holds neither or a damaged one."""
    folder = Path(folder)
    if not (folder / LABELLING_KEYS).is_file():
        return {device: labelling_key(key) for device, key in device_keys(folder, "keys.json").items()}
    return device_keys(folder, LABELLING_KEYS)


def device_keys(folder: Path, name: str) -> dict[str, bytes]:
    """A provisioned map of device ids to hex keys; a UsageError naming the file when it is missing or damaged."""
    try:
        raw_keys = json.loads((folder / name).read_text())
        return {wire.check_identifier("device id", device): bytes.fromhex(key) for device, key in raw_keys.items()}
    # a missing file (OSError); json and bytes.fromhex raise ValueError for a damaged one: the operator's to fix
    except (OSError, ValueError, AttributeError, TypeError) as error:
        raise UsageError(f"{folder / name}: not a provisioned map of device ids to hex keys ({error})") from None


def identity_secret() -> bytes:
    """A device's new Ed25519 identity secret (raw bytes; only its own credential file holds it)."""
    from protocol.secagg.identity import new_identity

    return new_identity()[0]


def load_secure_fleet(folder: Path) -> SecureFleet:
    """The coordinator's view of a provisioned folder; ValueError naming what is missing or malformed."""
    folder = Path(folder)
    for name in ("passwd", "acl", "keys.json", "coordinator.json"):
        if not (folder / name).is_file():
            raise UsageError(
                f"{folder} is not a provisioned fleet: {name} is missing "
                f"(run `fl-coordinator provision --out {folder}` first)"
            )
    keys = device_keys(folder, "keys.json")
    coordinator = load_credentials(folder / "coordinator.json")
    return SecureFleet(folder, coordinator.fleet, coordinator, keys)


def write_secret(path: Path, text: str) -> None:
    """A file only its owner may read (0600)."""
    atomic_write_bytes(path, text.encode())


def write_public(path: Path, text: str) -> None:
    """A file anyone may read (0644), e.g. the ACL or a certificate."""
    atomic_write_bytes(path, text.encode())
    os.chmod(path, 0o644)


def write_tls_files(folder: Path, names: list[str], hosts: tuple[str, ...]) -> dict[str, TlsPaths]:
    """A CA, a broker certificate for `hosts` and one client certificate per user (CN = username), all signed by
    the CA; returns username -> the ca_file/cert_file/key_file paths for its credential file."""
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric import ec

    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_cert = _certificate(ca_key, "edge-fal fleet CA", ca_key, None, is_ca=True)
    broker_key = ec.generate_private_key(ec.SECP256R1())
    broker_cert = _certificate(broker_key, hosts[0], ca_key, ca_cert, hosts=hosts)

    def save(stem: str, key, cert) -> None:
        write_public(folder / f"{stem}.crt", cert.public_bytes(serialization.Encoding.PEM).decode())
        write_secret(
            folder / f"{stem}.key",
            key.private_bytes(
                serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
            ).decode(),
        )

    save("ca", ca_key, ca_cert)
    save("broker", broker_key, broker_cert)
    files: dict[str, TlsPaths] = {}
    for user in [*SERVICE_USERNAMES, *names]:
        key = ec.generate_private_key(ec.SECP256R1())
        save(f"clients/{user}", key, _certificate(key, user, ca_key, ca_cert, client=True))
        files[user] = TlsPaths(
            ca_file=str(folder / "ca.crt"),
            cert_file=str(folder / "clients" / f"{user}.crt"),
            key_file=str(folder / "clients" / f"{user}.key"),
        )
    return files


def _certificate(
    key,
    common_name: str,
    issuer_key,
    issuer_cert,
    is_ca: bool = False,
    hosts: tuple[str, ...] = (),
    client: bool = False,
):
    """One X.509 certificate: a self-signed CA, a server certificate with SANs, or a client certificate."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)])
    now = datetime.datetime.now(datetime.UTC)
    builder = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(issuer_cert.subject if issuer_cert else name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=CERT_DAYS))
        .add_extension(x509.BasicConstraints(ca=is_ca, path_length=None), critical=True)
    )
    if is_ca:
        builder = builder.add_extension(_ca_key_usage(), critical=True)
    if hosts:
        builder = builder.add_extension(x509.SubjectAlternativeName([_san(host) for host in hosts]), critical=False)
        builder = builder.add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
    if client:
        builder = builder.add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.CLIENT_AUTH]), critical=False)
    return builder.sign(issuer_key, hashes.SHA256())


def _ca_key_usage():
    """A CA's key usage: it signs certificates and revocation lists, nothing else."""
    from cryptography import x509

    return x509.KeyUsage(
        digital_signature=True,
        key_cert_sign=True,
        crl_sign=True,
        content_commitment=False,
        key_encipherment=False,
        data_encipherment=False,
        key_agreement=False,
        encipher_only=False,
        decipher_only=False,
    )


def _san(host: str):
    """A SAN entry: an IP address if the host parses as one, else a DNS name."""
    from cryptography import x509

    try:
        return x509.IPAddress(ipaddress.ip_address(host))
    # ipaddress raises ValueError for a host that is no address: it is a DNS name
    except ValueError:
        return x509.DNSName(host)
