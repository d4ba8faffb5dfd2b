# Secure aggregation's last stage on the coordinator: ask survivors for shares, rebuild secrets from them (telling
# forged ones), strip the masks from the masked sum and decode the fixed-point total.
from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from coordinator.secure.secagg_round import DONE, MASKED, UNMASK, SecAggRound
from protocol import wire
from protocol.messages import RejectionKind, UnmaskRequest, UnmaskResponse
from protocol.secagg import keys, masks, shamir
from protocol.secagg.checks import check_pairs, check_stage, check_within
from protocol.secagg.errors import SecAggAbandoned, SecAggRefusal
from protocol.secagg.fixed_point import flat, layout_of, shaped
from protocol.tensors import Weights
from protocol.wire import shown

HeldShare = tuple[str, shamir.Share]  # (holder, share)
Validity = Callable[[str, bytes], bool]  # (owner, rebuilt secret) -> does it match what the owner committed to


@dataclass(frozen=True)
class Rebuilt:
    """A rebuilt secret and the holders whose shares do not lie on its polynomial (forged, or sealed wrong)."""

    secret: bytes
    forgers: list[str]


def rebuild(owner: str, shares: Sequence[HeldShare], threshold: int, valid: Validity) -> Rebuilt:
    """The owner's secret from `threshold` of the shares, trying each cyclic window of them until one rebuilds a
    secret that `valid` accepts (its commitment or its public key), so up to len - threshold consecutive forged
    shares are outvoted; none: the round is abandoned."""
    if len(shares) < threshold:
        raise SecAggAbandoned(f"{len(shares)} shares of {shown(owner)} came back, {threshold} are needed")
    for start in range(len(shares)):
        window = [share for _, share in (*shares[start:], *shares[:start])[:threshold]]
        try:
            secret = shamir.combine(window)
        except SecAggRefusal:
            continue
        if valid(owner, secret):
            polynomial = shamir.Polynomial(window)
            return Rebuilt(secret, [holder for holder, share in shares if polynomial.at(share.x) != share.y])
    raise SecAggAbandoned(f"no {threshold} of the {len(shares)} shares of {shown(owner)} rebuild its secret")


@dataclass(frozen=True)
class Unmasking:
    """What removing the masks needs: the round's context, every survivor's rebuilt seed, every dropped device's
    rebuilt mask key, the mask public keys, and which survivors masked with each dropped device."""

    context: bytes
    seeds: Mapping[str, bytes]
    dropped_keys: Mapping[str, bytes]
    mask_keys: Mapping[str, bytes]
    masked_with: Mapping[str, Sequence[str]]


def unmasked(total: np.ndarray, plan: Unmasking) -> np.ndarray:
    """The masked sum less each survivor's self mask and less each mask a survivor shares with a dropped device
    (the masks between survivors cancelled in the sum), mod 2^32."""
    result = total.astype(np.uint32, copy=True)
    for seed in plan.seeds.values():
        result -= masks.prg(seed, result.size)
    for dropped, secret in plan.dropped_keys.items():
        for survivor in plan.masked_with[dropped]:
            seed = keys.agreed_key(secret, plan.mask_keys[survivor], keys.MASK_PURPOSE, plan.context)
            mask = masks.prg(seed, result.size)
            result = result - mask if masks.pairwise_sign(survivor, dropped) > 0 else result + mask
    return result


@dataclass(frozen=True)
class SecAggResult:
    """An unmasked round: the sum of the survivors' updates (float64, within the fixed point's bound of the plain
    sum), who is in it, its error bound, and the holders whose returned shares were forged."""

    total: Weights
    survivors: list[str]
    error_bound: float
    forged: list[SecAggRefusal]


class UnmaskStage(SecAggRound):
    """Stage 4 of a secure round: the unmask requests, the shares that come back, the unmasked sum."""

    def unmask_requests(self) -> list[UnmaskRequest]:
        """Closes stage 3: asks each survivor for its surviving neighbours' seed shares and its dropped neighbours'
        key shares, only once every secret needed can still be rebuilt (else abandons before asking anything)."""
        state = self.state
        check_stage(state.stage, MASKED, "the close of the masked stage")
        survivors, dropped = set(state.masked_from), set(state.sharers) - set(state.masked_from)
        self._enough(state.masked_from, "sent masked inputs")
        short = [d for d in sorted(survivors | dropped) if len(survivors.intersection(self.graph[d])) < self.threshold]
        if short:
            self._abandon(f"{wire.shown_names(short)} have fewer than {self.threshold} surviving neighbours")
        state.stage = UNMASK
        return [
            UnmaskRequest(
                device,
                state.round_id,
                sorted(survivors.intersection(self.graph[device])),
                sorted(dropped.intersection(self.graph[device])),
                len(survivors),
            )
            for device in state.masked_from
        ]

    def on_reveal(self, response: UnmaskResponse) -> None:
        """Stage 4: a survivor's shares, only of the kinds and owners it was asked for."""
        state = self.state
        self._check(response.device_id, response.round_id, UNMASK, "an unmask response", state.masked_from)
        self._once(response.device_id, state.responders, "an unmask response")
        check_pairs(response.seed_owners, response.seed_shares, "the seed shares")
        check_pairs(response.key_owners, response.key_shares, "the key shares")
        peers = self.graph[response.device_id]
        survivors = [peer for peer in peers if peer in state.masked_from]
        dropped = [peer for peer in peers if peer in state.sharers and peer not in state.masked_from]
        check_within(response.seed_owners, survivors, RejectionKind.WRONG_RECIPIENT, "seed shares nobody asked for:")
        check_within(response.key_owners, dropped, RejectionKind.WRONG_RECIPIENT, "key shares nobody asked for:")
        for share in (*response.seed_shares, *response.key_shares):
            shamir.Share.from_bytes(share)
        state.responders.append(response.device_id)
        state.seed_owners += response.seed_owners
        state.seed_holders += [response.device_id] * len(response.seed_owners)
        state.seed_shares += response.seed_shares
        state.key_owners += response.key_owners
        state.key_holders += [response.device_id] * len(response.key_owners)
        state.key_shares += response.key_shares

    def finish(self) -> SecAggResult:
        """Closes stage 4: rebuilds the survivors' seeds and the dropped devices' mask keys (each checked against its
        commitment or public key), strips the masks and decodes the sum; too few good shares abandons the round. A
        finished round (saved by a process that died before committing it) gives the same sum again."""
        state = self.state
        if state.stage != DONE:
            check_stage(state.stage, UNMASK, "the close of the unmask stage")
        survivors = set(state.masked_from)
        try:
            seeds = self._rebuilt(state.seed_owners, state.seed_holders, state.seed_shares, self._seed_valid)
            dropped = self._rebuilt(state.key_owners, state.key_holders, state.key_shares, self._key_valid)
        except SecAggAbandoned as error:
            self._abandon(str(error))
        missing = (survivors - set(seeds)) | (set(state.sharers) - survivors - set(dropped))
        if missing:
            self._abandon(f"no shares came back for {wire.shown_names(sorted(missing))}")
        public = dict(zip(state.advertised, state.mask_keys))
        plan = Unmasking(
            self.context,
            {owner: rebuilt.secret for owner, rebuilt in seeds.items()},
            {owner: rebuilt.secret for owner, rebuilt in dropped.items()},
            public,
            {owner: sorted(survivors.intersection(self.graph[owner])) for owner in dropped},
        )
        fixed = self.fixed_point
        total = fixed.decode_sum(unmasked(flat(state.masked_sum), plan))
        state.stage = DONE
        forgers = sorted({holder for rebuilt in (*seeds.values(), *dropped.values()) for holder in rebuilt.forgers})
        forged = [
            SecAggRefusal(RejectionKind.FORGED_SHARE, f"{wire.shown(h)} returned a share off its polynomial")
            for h in forgers
        ]
        return SecAggResult(
            shaped(total, layout_of(state.masked_sum)), sorted(survivors), fixed.error_bound(len(survivors)), forged
        )

    def _rebuilt(
        self, owners: list[str], holders: list[str], shares: list[bytes], valid: Validity
    ) -> dict[str, Rebuilt]:
        """Each owner's secret from the shares its neighbours returned."""
        held: dict[str, list[tuple[str, shamir.Share]]] = {}
        for owner, holder, share in zip(owners, holders, shares):
            held.setdefault(owner, []).append((holder, shamir.Share.from_bytes(share)))
        return {owner: rebuild(owner, pairs, self.threshold, valid) for owner, pairs in held.items()}

    def _seed_valid(self, owner: str, seed: bytes) -> bool:
        commitment = self.state.commitments[self.state.sharers.index(owner)]
        return masks.seed_commitment(self.context, owner, seed) == commitment

    def _key_valid(self, owner: str, secret: bytes) -> bool:
        return keys.KeyPair.from_secret(secret).public == self.state.mask_keys[self.state.advertised.index(owner)]
