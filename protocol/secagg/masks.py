# Masks: a pseudorandom uint32 vector from a 32-byte seed (AES-256 in counter mode), and a vector masked with them.
from __future__ import annotations

import hashlib
from collections.abc import Iterable

import numpy as np
from cryptography.hazmat.primitives.ciphers import Cipher, algorithms, modes

SEED_BYTES = 32
ZERO_NONCE = bytes(16)  # every seed masks one vector of one round, so one counter stream per key is enough


def prg(seed: bytes, length: int) -> np.ndarray:
    """`length` uint32 values from the AES-256-CTR keystream of `seed`: the same seed gives the same mask everywhere."""
    if len(seed) != SEED_BYTES:
        raise ValueError(f"a mask seed has {SEED_BYTES} bytes, not {len(seed)}")
    encryptor = Cipher(algorithms.AES(seed), modes.CTR(ZERO_NONCE)).encryptor()
    stream = encryptor.update(bytes(4 * length)) + encryptor.finalize()
    return np.frombuffer(stream, dtype="<u4").astype(np.uint32)


def seed_commitment(context: bytes, device_id: str, seed: bytes) -> bytes:
    """SHA-256 of a device's self-mask seed bound to its round and id: sent with its shares, so the coordinator can
    tell a seed rebuilt from forged shares (a 256-bit random seed makes the hash reveal nothing about the mask)."""
    return hashlib.sha256(b"|".join((b"secagg-seed", context, device_id.encode(), seed))).digest()


def pairwise_sign(own_id: str, peer_id: str) -> int:
    """+1 when the device adds the pair's mask, -1 when it subtracts it: the smaller id adds, so the pair cancels."""
    return 1 if own_id < peer_id else -1


def masked(encoded: np.ndarray, self_seed: bytes, pairs: Iterable[tuple[int, bytes]]) -> np.ndarray:
    """The encoded vector plus the self mask and each pairwise mask times its sign, mod 2^32."""
    total = encoded.astype(np.uint32) + prg(self_seed, encoded.size)
    for sign, seed in pairs:
        mask = prg(seed, encoded.size)
        total = total + mask if sign > 0 else total - mask
    return total
