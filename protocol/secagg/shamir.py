# Shamir secret sharing of 32-byte secrets over the prime field of M521 = 2^521 - 1, each share one field element.
from __future__ import annotations

import secrets
from collections.abc import Sequence
from dataclasses import dataclass

from protocol.messages import RejectionKind
from protocol.secagg.errors import SecAggRefusal

PRIME = 2**521 - 1  # a Mersenne prime: every 256-bit secret is a field element
SHARE_BYTES = 2 + 66  # x as 2 bytes, y as 66 (521 bits) big-endian
MAX_HOLDERS = 2**16 - 1


@dataclass(frozen=True)
class Share:
    """One point (x, y) of the polynomial whose value at 0 is the secret; x in 1..65535 names the holder."""

    x: int
    y: int

    def to_bytes(self) -> bytes:
        """The share as SHARE_BYTES bytes."""
        return self.x.to_bytes(2, "big") + self.y.to_bytes(66, "big")

    @classmethod
    def from_bytes(cls, data: bytes) -> Share:
        """The share a SHARE_BYTES record holds (a forged_share refusal when it is not one)."""
        if len(data) != SHARE_BYTES:
            raise SecAggRefusal(RejectionKind.FORGED_SHARE, f"a share has {len(data)} bytes, not {SHARE_BYTES}")
        x, y = int.from_bytes(data[:2], "big"), int.from_bytes(data[2:], "big")
        if not (x > 0 and y < PRIME):
            raise SecAggRefusal(RejectionKind.FORGED_SHARE, "a share's point is outside the field")
        return cls(x, y)


def split(secret: bytes, threshold: int, holders: int) -> list[Share]:
    """`holders` shares (x = 1..holders) of which any `threshold` rebuild the secret and fewer reveal nothing."""
    if not 1 <= threshold <= holders <= MAX_HOLDERS:
        raise ValueError(f"threshold {threshold} of {holders} holders is not a sharing")
    coefficients = [int.from_bytes(secret, "big"), *(secrets.randbelow(PRIME) for _ in range(threshold - 1))]
    return [Share(x, _evaluate(coefficients, x)) for x in range(1, holders + 1)]


def _evaluate(coefficients: Sequence[int], x: int) -> int:
    """The polynomial with these coefficients (constant first) at x, by Horner's rule mod PRIME."""
    value = 0
    for coefficient in reversed(coefficients):
        value = (value * x + coefficient) % PRIME
    return value


def interpolate(shares: Sequence[Share], at: int = 0) -> int:
    """The value at `at` of the polynomial through these points (Lagrange); their x must differ."""
    return Polynomial(shares).at(at)


class Polynomial:
    """The polynomial through a set of points, ready to evaluate anywhere in O(len) multiplications: its Lagrange
    denominators are inverted once (how the coordinator checks every returned share against a rebuilt secret)."""

    def __init__(self, shares: Sequence[Share]) -> None:
        if len({share.x for share in shares}) != len(shares):
            raise SecAggRefusal(RejectionKind.FORGED_SHARE, "two shares of one secret name the same point")
        self.xs = [share.x for share in shares]
        self.scaled = []  # y_i / prod_{j != i} (x_i - x_j)
        for share in shares:
            denominator = 1
            for x in self.xs:
                if x != share.x:
                    denominator = denominator * (share.x - x) % PRIME
            self.scaled.append(share.y * pow(denominator, -1, PRIME) % PRIME)

    def at(self, point: int) -> int:
        """The polynomial's value at `point`: sum_i scaled_i * prod_{j != i} (point - x_j), by prefix and suffix products."""
        factors = [(point - x) % PRIME for x in self.xs]
        suffix = [1] * (len(factors) + 1)
        for i in range(len(factors) - 1, -1, -1):
            suffix[i] = suffix[i + 1] * factors[i] % PRIME
        total, prefix = 0, 1
        for i, scaled in enumerate(self.scaled):
            total = (total + scaled * prefix * suffix[i + 1]) % PRIME
            prefix = prefix * factors[i] % PRIME
        return total


def combine(shares: Sequence[Share], size: int = 32) -> bytes:
    """The `size`-byte secret these shares rebuild (a forged_share refusal when the value does not fit)."""
    value = interpolate(shares)
    if value >= 1 << (8 * size):
        raise SecAggRefusal(RejectionKind.FORGED_SHARE, f"the shares rebuild no {size}-byte secret")
    return value.to_bytes(size, "big")
