# Device identity keys (Ed25519 through `cryptography`): a device signs its key advert and its view confirmations, and
# anyone holding the fleet's roster of identity public keys checks them: nobody can advertise keys in its name, and a
# confirmation that does not check under its valid signature proves its sender cheated.
from __future__ import annotations

from collections.abc import Mapping

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

from protocol.secagg import keys

ADVERT_PURPOSE = b"secagg-key-advert"
CONFIRMATION_PURPOSE = b"secagg-signed-confirmation"
SIGNATURE_BYTES = 64


def new_identity() -> tuple[bytes, bytes]:
    """A fresh identity key pair as raw bytes: (secret, public), 32 bytes each."""
    secret = Ed25519PrivateKey.generate()
    return secret.private_bytes_raw(), secret.public_key().public_bytes_raw()


def public_of(secret: bytes) -> bytes:
    """The identity public key of a raw secret (how `provision` lists it in the fleet's roster)."""
    return Ed25519PrivateKey.from_private_bytes(secret).public_key().public_bytes_raw()


def advert_body(context: bytes, device_id: str, cipher_key: bytes, mask_key: bytes) -> bytes:
    """What a key advert's signature covers: its purpose, the run and round, the device and its two public keys (the
    keys have a fixed length, so the joined bytes read back one way only)."""
    return b"|".join((ADVERT_PURPOSE, context, device_id.encode(), cipher_key, mask_key))


def confirmation_body(context: bytes, sender: str, recipient: str, tag: bytes) -> bytes:
    """What a view confirmation's signature covers: its purpose, the run and round, who sent it to whom, and the tag
    (so a tag that does not check, under a valid signature, is its sender's own doing)."""
    return b"|".join((CONFIRMATION_PURPOSE, context, sender.encode(), recipient.encode(), tag))


def sign(secret: bytes, body: bytes) -> bytes:
    """The Ed25519 signature of an identity secret over a body (advert_body, confirmation_body)."""
    return Ed25519PrivateKey.from_private_bytes(secret).sign(body)


def signed(public: bytes, signature: bytes, body: bytes) -> bool:
    """Whether `signature` is the identity key `public`'s over `body` (False for any malformed part)."""
    if len(public) != keys.KEY_BYTES or len(signature) != SIGNATURE_BYTES:
        return False
    try:
        Ed25519PublicKey.from_public_bytes(public).verify(signature, body)
    except (InvalidSignature, ValueError):
        return False
    return True


def sign_advert(secret: bytes, context: bytes, device_id: str, cipher_key: bytes, mask_key: bytes) -> bytes:
    """The device's signature of its advert for this round."""
    return sign(secret, advert_body(context, device_id, cipher_key, mask_key))


def advert_signed(
    public: bytes, signature: bytes, context: bytes, device_id: str, cipher_key: bytes, mask_key: bytes
) -> bool:
    """Whether `signature` is the identity key `public`'s over this advert."""
    return signed(public, signature, advert_body(context, device_id, cipher_key, mask_key))


def unsigned(
    roster: Mapping[str, bytes], context: bytes, adverts: list[tuple[str, bytes, bytes, bytes]]
) -> tuple[list[str], list[str]]:
    """Of (device, cipher key, mask key, signature) adverts: the devices the roster has no identity key for, and the
    devices whose signature is not their identity key's over the advert."""
    unknown = sorted(device for device, *_ in adverts if device not in roster)
    forged = sorted(
        device
        for device, cipher, mask, signature in adverts
        if device in roster and not advert_signed(roster[device], signature, context, device, cipher, mask)
    )
    return unknown, forged
