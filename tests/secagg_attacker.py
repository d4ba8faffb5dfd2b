# A malicious party of secure aggregation written only from the message layouts (docs/ALGORITHMS.md section 14):
# plain paho-mqtt, msgpack and `cryptography`, none of the project's code, so an attack test does not share its bugs.
from __future__ import annotations

import os
import queue
import secrets
import time
from dataclasses import dataclass, field
from typing import Any

import msgpack
import numpy as np
import paho.mqtt.client as paho
from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives import hashes, hmac, serialization
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey, X25519PublicKey
from cryptography.hazmat.primitives.ciphers import Cipher, algorithms, modes
from cryptography.hazmat.primitives.ciphers.aead import AESGCM
from cryptography.hazmat.primitives.kdf.hkdf import HKDF

PRIME = 2**521 - 1
SHARE_PURPOSE, MASK_PURPOSE = b"secagg-share-encryption", b"secagg-pairwise-mask"
CONFIRM_PURPOSE, RECORD_PURPOSE = b"secagg-view-confirmation", b"secagg-record-authentication"
WAIT = 30.0


def raw(secret: X25519PrivateKey) -> tuple[bytes, bytes]:
    """(secret, public) raw bytes of an X25519 key."""
    public = secret.public_key().public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)
    return secret.private_bytes_raw(), public


def agreed(secret: bytes, public: bytes, purpose: bytes, context: bytes) -> bytes:
    """HKDF-SHA256 of the X25519 secret two parties share, bound to a purpose and the round."""
    shared = X25519PrivateKey.from_private_bytes(secret).exchange(X25519PublicKey.from_public_bytes(public))
    return HKDF(hashes.SHA256(), 32, salt=None, info=purpose + b"|" + context).derive(shared)


def bound(context: bytes, sender: str, recipient: str) -> bytes:
    """The associated data of a sealed record (and the body of a confirmation): round, sender, recipient."""
    return b"|".join((context, sender.encode(), recipient.encode()))


def mac(key: bytes, data: bytes) -> bytes:
    """HMAC-SHA256."""
    digest = hmac.HMAC(key, hashes.SHA256())
    digest.update(data)
    return digest.finalize()


def seal(
    sender: Party, recipient_public: bytes, context: bytes, names: tuple[str, str], plaintext: bytes
) -> tuple[bytes, bytes]:
    """A record as the layout has it: a fresh ephemeral public key E, the nonce, AES-256-GCM under
    HKDF(X25519(e, recipient)), and the HMAC under the pair's record key; with the ephemeral secret."""
    ephemeral, public = raw(X25519PrivateKey.generate())
    associated = bound(context, *names)
    nonce = os.urandom(12)
    body = (
        public
        + nonce
        + AESGCM(agreed(ephemeral, recipient_public, SHARE_PURPOSE, context)).encrypt(nonce, plaintext, associated)
    )
    pair_key = agreed(sender.cipher_secret, recipient_public, RECORD_PURPOSE, context)
    return body + mac(pair_key, associated + body), ephemeral


def unseal(recipient: Party, sealed: bytes, context: bytes, names: tuple[str, str]) -> bytes | None:
    """A record's plaintext opened by its recipient, or None when it does not open."""
    key = agreed(recipient.cipher_secret, sealed[:32], SHARE_PURPOSE, context)
    try:
        return AESGCM(key).decrypt(sealed[32:44], sealed[44:-32], bound(context, *names))
    except InvalidTag:
        return None


def confirmation(key: bytes, context: bytes, sender: str, recipient: str) -> bytes:
    """The MAC saying "the sender saw the recipient survive"."""
    return mac(key, b"survivor|" + bound(context, sender, recipient))


def share_of(secret: bytes, threshold: int, x: int) -> tuple[bytes, list[int]]:
    """One Shamir share (2-byte x, 66-byte y) of a random polynomial through the secret, and its coefficients."""
    coefficients = [int.from_bytes(secret, "big"), *(secrets.randbelow(PRIME) for _ in range(threshold - 1))]
    y = sum(c * pow(x, i, PRIME) for i, c in enumerate(coefficients)) % PRIME
    return x.to_bytes(2, "big") + y.to_bytes(66, "big"), coefficients


def combine(shares: list[bytes]) -> bytes:
    """The 32-byte secret at x = 0 of the polynomial through these shares (Lagrange)."""
    points = [(int.from_bytes(s[:2], "big"), int.from_bytes(s[2:], "big")) for s in shares]
    total = 0
    for xi, yi in points:
        term = yi
        for xj, _ in points:
            if xj != xi:
                term = term * xj % PRIME * pow(xj - xi, -1, PRIME) % PRIME
        total = (total + term) % PRIME
    return (total % (1 << 256)).to_bytes(32, "big")


def prg(seed: bytes, length: int) -> np.ndarray:
    """The AES-256-CTR keystream of a seed as uint32 (the masks)."""
    encryptor = Cipher(algorithms.AES(seed), modes.CTR(bytes(16))).encryptor()
    return np.frombuffer(encryptor.update(bytes(4 * length)) + encryptor.finalize(), dtype="<u4").astype(np.uint32)


def flat_tensors(tensors: dict[str, dict[str, Any]]) -> np.ndarray:
    """A masked input's tensors (wire maps of dtype, shape, data), flattened in sorted-name order."""
    return np.concatenate([np.frombuffer(tensors[name]["data"], dtype="<u4") for name in sorted(tensors)])


@dataclass
class Party:
    """Someone's round keys: the attacker's own, or an honest device's public ones as advertised."""

    cipher_public: bytes
    mask_public: bytes
    cipher_secret: bytes = b""
    mask_secret: bytes = b""

    @classmethod
    def fresh(cls) -> Party:
        """A party with new key pairs (the attacker's)."""
        (cipher_secret, cipher_public), (mask_secret, mask_public) = (
            raw(X25519PrivateKey.generate()),
            raw(X25519PrivateKey.generate()),
        )
        return cls(cipher_public, mask_public, cipher_secret, mask_secret)


@dataclass
class MaliciousCoordinator:
    """A plain MQTT client that plays the coordinator of a fleet's secure round (and, colluding, one of its devices
    named `me`): it reads the devices' stage messages and sends them whatever it likes. `listen` is the topic it
    reads under the fleet's devices (a device of its own reads its `secagg_in`)."""

    host: str
    port: int
    fleet: str
    me: str = "mal"
    listen: str = "+/secagg"
    inbox: queue.Queue = field(default_factory=queue.Queue)

    def __post_init__(self) -> None:
        self.client = paho.Client(paho.CallbackAPIVersion.VERSION2, client_id="malicious", protocol=paho.MQTTv5)
        self.client.on_message = lambda c, u, m: self.inbox.put((m.topic.split("/")[3], msgpack.unpackb(m.payload)))
        self.client.connect(self.host, self.port)
        self.client.loop_start()
        self.client.subscribe(f"fl/{self.fleet}/devices/{self.listen}", qos=1)
        self.keys = Party.fresh()

    def send(self, device: str, kind: str, **fields: Any) -> None:
        """A stage message to one device, as the wire's msgpack envelope."""
        payload = msgpack.packb({"v": 2, "kind": kind, **fields}, use_bin_type=True)
        self.client.publish(f"fl/{self.fleet}/devices/{device}/secagg_in", payload, qos=1).wait_for_publish(WAIT)

    def collect(self, kind: str, count: int, timeout: float = WAIT) -> dict[str, dict[str, Any]]:
        """The next `count` messages of a kind, by sender (others read meanwhile are dropped)."""
        got: dict[str, dict[str, Any]] = {}
        deadline = time.monotonic() + timeout
        while len(got) < count:
            sender, message = self.inbox.get(timeout=max(0.01, deadline - time.monotonic()))
            if message.get("kind") == kind:
                got[sender] = message
        return got

    def quiet(self, wait: float) -> list[dict[str, Any]]:
        """Every message that arrives within `wait` seconds."""
        seen = []
        deadline = time.monotonic() + wait
        while time.monotonic() < deadline:
            try:
                seen.append(self.inbox.get(timeout=0.05)[1])
            except queue.Empty:
                continue
        return seen

    def close(self) -> None:
        """Disconnects."""
        self.client.disconnect()
        self.client.loop_stop()
