# A cheating secure-aggregation device as a plain paho-mqtt + msgpack client written from the message layouts
# (protocol/secagg_messages.py, wire v2 envelopes): it takes part in every stage but masks whatever it chooses (no
# clip, any weight), can forge a share at unmasking and can claim a 17 MiB chunked message. Only the protocol's own
# arithmetic comes from protocol.secagg (Shamir over GF(2^521 - 1), the X25519 / HKDF / AES-GCM seal, the AES-CTR
# masks, the fixed point's scale): those are the protocol's definitions, and a copy of them would test nothing more.
from __future__ import annotations

import hashlib
import os
import queue
import threading
from typing import Any

import msgpack
import numpy as np
import paho.mqtt.client as paho
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey

from protocol.mqtt import BrokerAddress
from protocol.secagg import keys, masks, shamir
from protocol.secagg.fixed_point import FixedPoint

WAIT = 30.0


def envelope(kind: str, **fields: Any) -> bytes:
    """A wire v2 message: a msgpack map of the version, the kind and the fields."""
    return msgpack.packb({"v": 2, "kind": kind, **fields}, use_bin_type=True)


def raw_secret() -> bytes:
    """A fresh X25519 secret key as its 32 raw bytes."""
    return X25519PrivateKey.generate().private_bytes_raw()


def public_of(secret: bytes) -> bytes:
    """The raw public key of a raw X25519 secret."""
    public = X25519PrivateKey.from_private_bytes(secret).public_key()
    return public.public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)


class SecAggAttacker:
    """One malicious participant of a secure round on `fleet`: `values` is what it masks, by tensor name (the round's
    layout: the trained tensors, `secagg.weight` and `secagg.labels`, already weighted, never clipped); `forge`
    makes it return one altered seed share when asked to unmask."""

    def __init__(
        self, address: BrokerAddress, fleet: str, device_id: str, values: dict[str, np.ndarray], forge: bool = False
    ) -> None:
        self.fleet, self.device_id, self.values, self.forge = fleet, device_id, values, forge
        self.cipher_secret, self.mask_secret, self.seed = raw_secret(), raw_secret(), os.urandom(32)
        self.roster: dict[str, Any] = {}
        self.held: dict[str, bytes] = {}
        self.errors: queue.Queue[Exception] = queue.Queue()
        subscribed = threading.Event()
        self.client = paho.Client(paho.CallbackAPIVersion.VERSION2, client_id=device_id, protocol=paho.MQTTv5)
        self.client.on_message = self.on_message
        self.client.on_connect = lambda client, *_: client.subscribe(f"fl/{fleet}/devices/{device_id}/secagg_in", 1)
        self.client.on_subscribe = lambda *_: subscribed.set()
        self.client.connect(address.host, address.port)
        self.client.loop_start()
        if not subscribed.wait(WAIT):
            raise TimeoutError(f"{device_id} did not subscribe within {WAIT} s")

    @property
    def up(self) -> str:
        """The topic its stage messages go to."""
        return f"fl/{self.fleet}/devices/{self.device_id}/secagg"

    def publish(self, payload: bytes, topic: str | None = None) -> None:
        """One QoS 1 message, waited for (from the test's thread)."""
        self.client.publish(topic or self.up, payload, qos=1).wait_for_publish(WAIT)

    def advertise(self, round_id: int) -> None:
        """Stage 1: its two public keys."""
        cipher, mask = public_of(self.cipher_secret), public_of(self.mask_secret)
        kind = "secagg_keys"
        self.publish(envelope(kind, device_id=self.device_id, round_id=round_id, cipher_key=cipher, mask_key=mask))

    def claim_too_large(self, total_bytes: int) -> None:
        """The first chunk of a stage message that claims `total_bytes` (the rest never comes)."""
        digest = hashlib.sha256(b"never sent").hexdigest()
        chunk = envelope(
            "chunk", transfer_id="a" * 32, index=0, count=2, total_bytes=total_bytes, digest=digest, data=b"x" * 1024
        )
        self.publish(chunk, f"{self.up}/chunk/0")

    def on_message(self, client: paho.Client, userdata: object, message: paho.MQTTMessage) -> None:
        """Answers the coordinator's stage messages (an error is kept for the test to raise)."""
        try:
            fields = msgpack.unpackb(message.payload, raw=False)
            answer = {"secagg_roster": self.shares, "secagg_delivery": self.masked, "secagg_unmask": self.reveal}
            client.publish(self.up, answer[fields["kind"]](fields), qos=1)
        except Exception as error:  # reported to the test's thread by close(), not lost in paho's
            self.errors.put(error)

    def context(self) -> bytes:
        """The round's binding (run and round) every key, seal and commitment uses."""
        return keys.round_context(self.roster["run_id"], self.roster["round_id"])

    def peer_key(self, peer: str, which: str) -> bytes:
        """A neighbour's public key from the roster (`cipher_keys` or `mask_keys`)."""
        return self.roster[which][self.roster["neighbours"].index(peer)]

    def shares(self, roster: dict[str, Any]) -> bytes:
        """Stage 2: its seed and mask key split t-of-k among its neighbours, each pair sealed for one of them."""
        self.roster = roster
        peers, threshold = roster["neighbours"], roster["threshold"]
        seed_shares = shamir.split(self.seed, threshold, len(peers))
        key_shares = shamir.split(self.mask_secret, threshold, len(peers))
        sealed = []
        for peer, seed_share, key_share in zip(peers, seed_shares, key_shares):
            key = keys.agreed_key(
                self.cipher_secret, self.peer_key(peer, "cipher_keys"), keys.SHARE_PURPOSE, self.context()
            )
            associated = keys.share_context(self.context(), self.device_id, peer)
            sealed.append(keys.encrypt(key, seed_share.to_bytes() + key_share.to_bytes(), associated))
        commitment = masks.seed_commitment(self.context(), self.device_id, self.seed)
        return envelope(
            "secagg_shares",
            device_id=self.device_id,
            round_id=roster["round_id"],
            recipients=peers,
            ciphertexts=sealed,
            seed_commitment=commitment,
        )

    def masked(self, delivery: dict[str, Any]) -> bytes:
        """Stage 3: its chosen values in fixed point (unclipped), plus its self mask and a pairwise mask with every
        neighbour whose shares it holds."""
        for sender, sealed in zip(delivery["senders"], delivery["ciphertexts"]):
            key = keys.agreed_key(
                self.cipher_secret, self.peer_key(sender, "cipher_keys"), keys.SHARE_PURPOSE, self.context()
            )
            self.held[sender] = keys.decrypt(key, sealed, keys.share_context(self.context(), sender, self.device_id))
        bits = FixedPoint(self.roster["clip"], self.roster["max_summands"]).bits
        names = sorted(self.values)
        flat = np.concatenate([np.ravel(self.values[name]).astype(np.float64) for name in names])
        total = np.rint(flat * 2.0**bits).astype(np.int64).astype(np.uint32) + masks.prg(self.seed, flat.size)
        for peer in self.held:
            seed = keys.agreed_key(
                self.mask_secret, self.peer_key(peer, "mask_keys"), keys.MASK_PURPOSE, self.context()
            )
            mask = masks.prg(seed, flat.size)
            total = total + mask if self.device_id < peer else total - mask
        tensors, start = {}, 0
        for name in names:
            shape = list(np.shape(self.values[name]))
            size = int(np.prod(shape))
            data = total[start : start + size].astype("<u4").tobytes()
            tensors[name] = {"dtype": "<u4", "shape": shape, "data": data}
            start += size
        return envelope("secagg_masked", device_id=self.device_id, round_id=self.roster["round_id"], masked=tensors)

    def reveal(self, request: dict[str, Any]) -> bytes:
        """Stage 4: the seed shares of the surviving neighbours and the key shares of the dropped ones it was asked
        for; with `forge`, the first seed share altered."""
        size = shamir.SHARE_BYTES
        seeds = [self.held[peer][:size] for peer in request["survivors"]]
        if self.forge and seeds:
            seeds[0] = seeds[0][:-1] + bytes([seeds[0][-1] ^ 1])
        return envelope(
            "secagg_reveal",
            device_id=self.device_id,
            round_id=request["round_id"],
            seed_owners=request["survivors"],
            seed_shares=seeds,
            key_owners=request["dropped"],
            key_shares=[self.held[peer][size:] for peer in request["dropped"]],
        )

    def close(self) -> None:
        """Disconnects; any error its callbacks met is raised here."""
        self.client.loop_stop()
        self.client.disconnect()
        if not self.errors.empty():
            raise self.errors.get()
