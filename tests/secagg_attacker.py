# Malicious parties of secure aggregation written only from the message layouts (docs/ALGORITHMS.md section 14): a
# coordinator, and a device's stages (`PlainDevice`, driven by the attack tests' forger and by tests/secagg_cheat.py);
# plain paho-mqtt, msgpack and `cryptography`, none of the project's code, so an attack test does not share its bugs.
from __future__ import annotations

import hashlib
import math
import os
import queue
import secrets
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import msgpack
import numpy as np
import paho.mqtt.client as paho
from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives import hashes, hmac, serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey, X25519PublicKey
from cryptography.hazmat.primitives.ciphers import Cipher, algorithms, modes
from cryptography.hazmat.primitives.ciphers.aead import AESGCM
from cryptography.hazmat.primitives.kdf.hkdf import HKDF

PRIME = 2**521 - 1
SHARE_PURPOSE, MASK_PURPOSE = b"secagg-share-encryption", b"secagg-pairwise-mask"
CONFIRM_PURPOSE, RECORD_PURPOSE = b"secagg-view-confirmation", b"secagg-record-authentication"
WAIT = 30.0


def envelope(kind: str, **fields: Any) -> bytes:
    """A wire v2 message: a msgpack map of the version, the kind and the fields."""
    return msgpack.packb({"v": 2, "kind": kind, **fields}, use_bin_type=True)


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


def split(secret: bytes, threshold: int, holders: int) -> list[bytes]:
    """Shamir shares (2-byte x, 66-byte y) of the secret for x = 1..holders, on one random polynomial of degree
    threshold - 1 whose value at 0 is the secret."""
    coefficients = [int.from_bytes(secret, "big"), *(secrets.randbelow(PRIME) for _ in range(threshold - 1))]
    values = (sum(c * pow(x, i, PRIME) for i, c in enumerate(coefficients)) % PRIME for x in range(1, holders + 1))
    return [x.to_bytes(2, "big") + y.to_bytes(66, "big") for x, y in enumerate(values, start=1)]


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


def commitment(context: bytes, owner: str, seed: bytes) -> bytes:
    """The owner's commitment to its self-mask seed: SHA-256 of "secagg-seed", the round, its id and the seed."""
    return hashlib.sha256(b"|".join((b"secagg-seed", context, owner.encode(), seed))).digest()


def fraction_bits(clip: float, summands: int) -> int:
    """The fixed point's fraction bits: the largest b with summands * (clip * 2^b + 1/2) below 2^31."""
    return math.floor(math.log2(((2**31 - 1) / summands - 0.5) / clip))


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


# Each stage message a device answers: the answer's kind and the PlainDevice method that makes it.
ANSWERS = {
    "secagg_roster": ("secagg_shares", "shares"),
    "secagg_delivery": ("secagg_ack", "ack"),
    "secagg_key_request": ("secagg_key_reveal", "key_reveal"),
    "secagg_mask": ("secagg_masked", "masked"),
    "secagg_view": ("secagg_confirm", "confirm"),
    "secagg_unmask": ("secagg_reveal", "reveal"),
}


def no_one(peers: list[str]) -> list[str]:
    """Nobody: the neighbours an honest device forges a record for."""
    return []


@dataclass
class PlainDevice:
    """A device's side of a secure round, written from the message layouts: `answer` takes a coordinator's stage
    message and returns the device's answer, the transport left to whoever drives it. It follows the protocol but
    where told otherwise: `victims` picks the neighbours whose record it seals with no share in it, `inputs` is
    what it masks by tensor name (already weighted, never clipped: any value the fixed point's 32 bits hold),
    `forge` alters the first seed share it reveals at unmasking, and `bad_tags` sends every partner a view
    confirmation of random bytes. With an `identity` (a provisioned fleet's Ed25519 secret, raw) it signs its advert
    (over "secagg-key-advert" | run/round | id | both keys) and each confirmation (over "secagg-signed-confirmation"
    | run/round | id | recipient | tag), random ones included."""

    device_id: str
    keys: Party = field(default_factory=Party.fresh)
    victims: Callable[[list[str]], list[str]] = no_one
    inputs: dict[str, np.ndarray] = field(default_factory=dict)
    forge: bool = False
    bad_tags: bool = False
    identity: bytes = b""
    run_id: str = "run"
    seed: bytes = field(default_factory=lambda: os.urandom(32))
    roster: dict[str, Any] = field(default_factory=dict)
    ephemeral: dict[str, bytes] = field(default_factory=dict)
    held: dict[str, bytes] = field(default_factory=dict)
    partners: list[str] = field(default_factory=list)

    def advert(self, round_id: int) -> bytes:
        """Stage 1: its two public keys."""
        keys = self.keys
        body = (f"{self.run_id}/{round_id}".encode(), self.device_id.encode(), keys.cipher_public, keys.mask_public)
        return envelope(
            "secagg_keys",
            device_id=self.device_id,
            round_id=round_id,
            cipher_key=keys.cipher_public,
            mask_key=keys.mask_public,
            signature=self.signed(b"secagg-key-advert", *body),
        )

    def signed(self, *parts: bytes) -> bytes:
        """Its identity's Ed25519 signature over the parts joined by "|" (empty without an identity)."""
        return Ed25519PrivateKey.from_private_bytes(self.identity).sign(b"|".join(parts)) if self.identity else b""

    def answer(self, message: dict[str, Any]) -> bytes:
        """Its answer to one of the coordinator's stage messages, as the wire's envelope."""
        kind, method = ANSWERS[message["kind"]]
        fields = getattr(self, method)(message)
        return envelope(kind, device_id=self.device_id, round_id=message["round_id"], **fields)

    @property
    def context(self) -> bytes:
        """The round's binding (run and round) every key, seal and commitment uses."""
        return f"{self.roster['run_id']}/{self.roster['round_id']}".encode()

    def peer(self, name: str) -> Party:
        """A neighbour's public keys, as the roster gives them."""
        index = self.roster["neighbours"].index(name)
        return Party(self.roster["cipher_keys"][index], self.roster["mask_keys"][index])

    def mask_seed(self, name: str) -> bytes:
        """The pairwise mask seed it shares with a neighbour."""
        return agreed(self.keys.mask_secret, self.peer(name).mask_public, MASK_PURPOSE, self.context)

    def shares(self, roster: dict[str, Any]) -> dict[str, Any]:
        """Stage 2: its seed split t-of-k among its neighbours (x = the place in the roster), each share sealed in
        a record for its holder (a victim's record holds 68 zero bytes), and the seed's commitment."""
        self.roster = roster
        peers = roster["neighbours"]
        hit, records = self.victims(peers), []
        for peer, share in zip(peers, split(self.seed, roster["threshold"], len(peers))):
            plaintext = bytes(len(share)) if peer in hit else share
            record, self.ephemeral[peer] = seal(
                self.keys, self.peer(peer).cipher_public, self.context, (self.device_id, peer), plaintext
            )
            records.append(record)
        return {
            "recipients": peers,
            "ciphertexts": records,
            "seed_commitment": commitment(self.context, self.device_id, self.seed),
        }

    def ack(self, delivery: dict[str, Any]) -> dict[str, Any]:
        """Stage 2's check: keeps the share of each record that opens and says whose it holds (it accuses no one)."""
        for sender, sealed in zip(delivery["senders"], delivery["ciphertexts"]):
            share = unseal(self.keys, sealed, self.context, (sender, self.device_id))
            if share is not None:
                self.held[sender] = share
        return {"held": list(self.held), "accused": [], "pair_keys": []}

    def key_reveal(self, request: dict[str, Any]) -> dict[str, Any]:
        """A complaint against its records: the ephemeral secret of its record to each accuser."""
        accusers = request["accusers"]
        return {"accusers": accusers, "ephemeral_secrets": [self.ephemeral[accuser] for accuser in accusers]}

    def masked(self, request: dict[str, Any]) -> dict[str, Any]:
        """Stage 3: its inputs in fixed point (unclipped), plus its self mask and a pairwise mask with every partner
        the request names."""
        self.partners = sorted(request["partners"])
        names = sorted(self.inputs)
        scale = 2.0 ** fraction_bits(self.roster["clip"], self.roster["max_summands"])
        flat = np.concatenate([np.ravel(self.inputs[name]).astype(np.float64) for name in names])
        total = np.rint(flat * scale).astype(np.int64).astype(np.uint32) + prg(self.seed, flat.size)
        for peer in self.partners:
            mask = prg(self.mask_seed(peer), flat.size)
            total = total + mask if self.device_id < peer else total - mask
        tensors, start = {}, 0
        for name in names:
            shape = list(np.shape(self.inputs[name]))
            size = math.prod(shape)
            data = total[start : start + size].astype("<u4").tobytes()
            tensors[name] = {"dtype": "<u4", "shape": shape, "data": data}
            start += size
        return {"masked": tensors}

    def confirm(self, view: dict[str, Any]) -> dict[str, Any]:
        """Stage 4a: a confirmation to each partner the view calls a survivor, and its pairwise seed with each
        other partner."""
        survivors = sorted(view["survivors"])
        dropped = [peer for peer in self.partners if peer not in survivors]
        keys = [
            agreed(self.keys.cipher_secret, self.peer(p).cipher_public, CONFIRM_PURPOSE, self.context)
            for p in survivors
        ]
        tags = [confirmation(key, self.context, self.device_id, peer) for key, peer in zip(keys, survivors)]
        if self.bad_tags:
            tags = [os.urandom(len(tag)) for tag in tags]
        purpose, me = b"secagg-signed-confirmation", self.device_id.encode()
        return {
            "recipients": survivors,
            "tags": tags,
            "dropped": dropped,
            "pair_seeds": [self.mask_seed(peer) for peer in dropped],
            "signatures": [
                self.signed(purpose, self.context, me, peer.encode(), tag) for peer, tag in zip(survivors, tags)
            ]
            if self.identity
            else [],
        }

    def reveal(self, request: dict[str, Any]) -> dict[str, Any]:
        """Stage 4b: the seed share of each sender asked for (the confirmations unchecked); with `forge`, the first
        one altered."""
        shares = [self.held[sender] for sender in request["senders"]]
        if self.forge and shares:
            shares[0] = shares[0][:-1] + bytes([shares[0][-1] ^ 1])
        return {"seed_owners": request["senders"], "seed_shares": shares}


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
        payload = envelope(kind, **fields)
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
