# Key agreement (X25519 through `cryptography`), the keys derived from it (HKDF-SHA256), and share encryption (AES-GCM).
from __future__ import annotations

import functools
import hmac
import os
from dataclasses import dataclass

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives import hmac as crypto_hmac
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey, X25519PublicKey
from cryptography.hazmat.primitives.ciphers.aead import AESGCM
from cryptography.hazmat.primitives.kdf.hkdf import HKDF

from protocol.messages import RejectionKind
from protocol.secagg.errors import SecAggRefusal

KEY_BYTES = 32
NONCE_BYTES = 12
MASK_PURPOSE = b"secagg-pairwise-mask"
SHARE_PURPOSE = b"secagg-share-encryption"
CONFIRM_PURPOSE = b"secagg-view-confirmation"
RECORD_PURPOSE = b"secagg-record-authentication"
EPHEMERAL_PURPOSE = b"secagg-record-ephemeral"
TAG_BYTES = 32


@dataclass(frozen=True)
class KeyPair:
    """An X25519 key pair as raw bytes (what a device's saved state holds)."""

    secret: bytes
    public: bytes

    @classmethod
    def generate(cls) -> KeyPair:
        """A fresh key pair."""
        return cls.from_secret(X25519PrivateKey.generate().private_bytes_raw())

    @classmethod
    def from_secret(cls, secret: bytes) -> KeyPair:
        """The pair a raw secret key makes (how the coordinator checks a rebuilt key against the advertised one)."""
        public = X25519PrivateKey.from_private_bytes(secret).public_key()
        return cls(secret, public.public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw))


def agreed_key(secret: bytes, peer_public: bytes, purpose: bytes, context: bytes) -> bytes:
    """The 32-byte key two devices share for one purpose and one round: HKDF-SHA256 of their X25519 secret, with the
    purpose and the round's context (run, round) as info, so no key serves two rounds or two jobs."""
    if len(peer_public) != KEY_BYTES:
        raise SecAggRefusal(RejectionKind.UNDECODABLE, f"a public key has {len(peer_public)} bytes, not {KEY_BYTES}")
    try:
        shared = _exchanged(secret, peer_public)
    except ValueError:  # a low-order point: the exchange would give all zeros
        raise SecAggRefusal(RejectionKind.UNDECODABLE, "a public key is not a usable X25519 key") from None
    return HKDF(hashes.SHA256(), KEY_BYTES, salt=None, info=purpose + b"|" + context).derive(shared)


@functools.lru_cache(maxsize=4096)
def _exchanged(secret: bytes, peer_public: bytes) -> bytes:
    """The X25519 secret of a key pair and a public key, computed once in this process: a device derives keys for
    several purposes from the same pair (records, confirmations), each exchange costing about 0.1 ms."""
    return _private_key(secret).exchange(X25519PublicKey.from_public_bytes(peer_public))


@functools.lru_cache(maxsize=256)
def _private_key(secret: bytes) -> X25519PrivateKey:
    """The key object of a raw secret, built once: building it costs as much as an exchange."""
    return X25519PrivateKey.from_private_bytes(secret)


def round_context(run_id: str, round_id: int) -> bytes:
    """What every key and sealed share of one round is bound to: the run and the round."""
    return f"{run_id}/{round_id}".encode()


def share_context(context: bytes, sender: str, recipient: str) -> bytes:
    """The associated data that binds an encrypted share to its round, sender and recipient."""
    return b"|".join((context, sender.encode(), recipient.encode()))


def encrypt(key: bytes, plaintext: bytes, associated: bytes) -> bytes:
    """AES-256-GCM with a random nonce, the nonce first."""
    nonce = os.urandom(NONCE_BYTES)
    return nonce + AESGCM(key).encrypt(nonce, plaintext, associated)


def decrypt(key: bytes, ciphertext: bytes, associated: bytes) -> bytes:
    """The plaintext of encrypt's output; anything altered, or sealed for another sender, recipient or round, is a
    forged_share refusal."""
    try:
        return AESGCM(key).decrypt(ciphertext[:NONCE_BYTES], ciphertext[NONCE_BYTES:], associated)
    except (InvalidTag, ValueError):
        raise SecAggRefusal(
            RejectionKind.FORGED_SHARE, "an encrypted share does not open with the pair's key"
        ) from None


def survivor_tag(key: bytes, context: bytes, sender: str, recipient: str) -> bytes:
    """HMAC-SHA256, under the pair's confirmation key, of "the sender's view calls the recipient a survivor" in this
    round: the recipient reveals a share of the sender's self-mask seed only with it (the coordinator routes it and
    cannot make one)."""
    return _mac(key, b"|".join((b"survivor", share_context(context, sender, recipient))))


def tag_valid(key: bytes, context: bytes, sender: str, recipient: str, tag: bytes) -> bool:
    """Whether a tag is the sender's confirmation that it saw the recipient survive (compared in constant time)."""
    return hmac.compare_digest(survivor_tag(key, context, sender, recipient), tag)


def record_ephemeral(cipher_secret: bytes, context: bytes, recipient: str) -> bytes:
    """The sender's one-record X25519 secret for a recipient, derived from its cipher secret (so a restart gives it
    again) by HKDF (so revealing it, to settle a complaint, exposes that one record and nothing else)."""
    info = b"|".join((EPHEMERAL_PURPOSE, context, recipient.encode()))
    return HKDF(hashes.SHA256(), KEY_BYTES, salt=None, info=info).derive(cipher_secret)


def seal_record(
    cipher_secret: bytes, recipient_public: bytes, context: bytes, sender: str, recipient: str, plaintext: bytes
) -> bytes:
    """A record only the recipient opens, whose sender the coordinator can later hold to it: the ephemeral public
    key E, then AES-GCM under HKDF(X25519(e, recipient)), then an HMAC under the pair's record key (the recipient
    knows the record is the sender's as sent: the coordinator cannot make one)."""
    ephemeral = record_ephemeral(cipher_secret, context, recipient)
    associated = share_context(context, sender, recipient)
    key = agreed_key(ephemeral, recipient_public, SHARE_PURPOSE, context)
    body = KeyPair.from_secret(ephemeral).public + encrypt(key, plaintext, associated)
    pair_key = agreed_key(cipher_secret, recipient_public, RECORD_PURPOSE, context)
    return body + _mac(pair_key, associated + body)


def record_authentic(pair_key: bytes, sealed: bytes, associated: bytes) -> bool:
    """Whether a record carries the pair's MAC (it left its sender as it is)."""
    body = sealed[:-TAG_BYTES]
    return len(sealed) > KEY_BYTES + TAG_BYTES and hmac.compare_digest(
        _mac(pair_key, associated + body), sealed[-TAG_BYTES:]
    )


def open_record(secret: bytes, other_public: bytes, sealed: bytes, associated: bytes, context: bytes) -> bytes:
    """A record's plaintext, opened by the recipient (its cipher secret, the record's E) or by whoever the sender
    revealed the record's ephemeral secret to (that secret, the recipient's cipher key): forged_share when it does
    not open."""
    return decrypt(agreed_key(secret, other_public, SHARE_PURPOSE, context), sealed[KEY_BYTES:-TAG_BYTES], associated)


def _mac(key: bytes, data: bytes) -> bytes:
    mac = crypto_hmac.HMAC(key, hashes.SHA256())
    mac.update(data)
    return mac.finalize()
