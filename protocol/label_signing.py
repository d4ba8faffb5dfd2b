# Who said what in central labelling: in a secured fleet the desk and each device MAC the labelling messages the
# other acts on (answers and query receipts one way, answer receipts and local answers the other) with a key derived
# from the device's provisioned key, so a party that can only publish on the broker cannot answer for the desk.
from __future__ import annotations

import dataclasses
import hashlib
import hmac
from typing import Any, TypeVar

import msgpack

PURPOSE = b"edge-fal central labelling v1"
S = TypeVar("S")


def labelling_key(device_key: bytes) -> bytes:
    """The key a device and the desk sign labelling messages with: derived from the device's provisioned update key
    (HMAC-SHA256 under it of a fixed purpose), so the desk holds no key that signs updates."""
    return hmac.digest(device_key, PURPOSE, "sha256")


def signed_bytes(message: Any, fleet: str, device: str) -> bytes:
    """What a signature covers: the fleet, the device, the message's kind and every field but the signature, in
    field order (msgpack), so a signed message cannot be moved to another device, fleet or kind."""
    fields = [getattr(message, f.name) for f in dataclasses.fields(message) if f.name != "signature"]
    return msgpack.packb([fleet, device, message.KIND, *fields], use_bin_type=True)


def sign(message: S, key: bytes, fleet: str, device: str) -> S:
    """The message with its signature under `key`."""
    tag = hmac.digest(key, signed_bytes(message, fleet, device), hashlib.sha256)
    return dataclasses.replace(message, signature=tag)  # type: ignore[type-var]


def signature_valid(message: Any, key: bytes, fleet: str, device: str) -> bool:
    """Constant-time check of a message's signature under `key` (False for an unsigned one)."""
    expected = hmac.digest(key, signed_bytes(message, fleet, device), hashlib.sha256)
    return hmac.compare_digest(expected, message.signature)
