# Secure aggregation's last stage on the coordinator: each survivor's one view of who survived (confirmed to its
# neighbours), the seed shares that view allows, secrets rebuilt (telling forged shares), masks stripped, sum decoded.
from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from coordinator.secure.secagg_round import DONE, MASKED, UNMASK, VIEW, SecAggRound
from protocol import wire
from protocol.messages import RejectionKind, SurvivorView, UnmaskRequest, UnmaskResponse, ViewConfirmation
from protocol.secagg import keys, masks, shamir
from protocol.secagg.checks import check_pairs, check_stage, check_unique, check_within
from protocol.secagg.errors import SecAggAbandoned, SecAggRefusal
from protocol.secagg.fixed_point import flat, layout_of, shaped
from protocol.secagg.identity import SIGNATURE_BYTES
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


def unmasked(total: np.ndarray, seeds: Sequence[bytes], pairs: Sequence[tuple[int, bytes]]) -> np.ndarray:
    """The masked sum less each survivor's self mask (from its rebuilt seed) and less each pairwise mask a survivor
    added with a neighbour that did not survive (sign, revealed seed); masks between survivors cancelled in the sum."""
    result = total.astype(np.uint32, copy=True)
    for seed in seeds:
        result -= masks.prg(seed, result.size)
    for sign, seed in pairs:
        mask = masks.prg(seed, result.size)
        result = result - mask if sign > 0 else result + mask
    return result


@dataclass(frozen=True)
class SecAggResult:
    """An unmasked round: the sum of the survivors' updates (float64, within the fixed point's bound of the plain
    sum), who is in it, its error bound, and the holders whose returned shares were forged (outvoted)."""

    total: Weights
    survivors: list[str]
    error_bound: float
    forgers: list[str]


class UnmaskStage(SecAggRound):
    """Stage 4 of a secure round: (a) each survivor's view of its surviving neighbours, confirmed to them and
    answered with the pairwise seeds of the others; (b) the seed shares the confirmations allow; the unmasked sum."""

    def view_requests(self) -> list[SurvivorView]:
        """Closes stage 3: tells each survivor which of its neighbours survived, only once every survivor's seed can
        still be rebuilt (else abandons before asking anything)."""
        state = self.state
        check_stage(state.stage, MASKED, "the close of the masked stage")
        survivors = set(state.masked_from)
        self._enough(state.masked_from, "sent masked inputs")
        short = [d for d in sorted(survivors) if len(self.holders(d, survivors)) < self.threshold]
        if short:
            self._abandon(f"{wire.shown_names(short)} have fewer than {self.threshold} surviving holders")
        state.stage = VIEW
        return [
            SurvivorView(device, state.round_id, self._surviving(device), len(survivors))
            for device in state.masked_from
        ]

    def on_confirm(self, confirmation: ViewConfirmation) -> None:
        """Stage 4a: a survivor's confirmations, one for each surviving neighbour, and its pairwise seeds, one for each
        other neighbour (exactly those: a seed missing would leave a mask in the sum)."""
        state = self.state
        device = confirmation.device_id
        self._check(device, confirmation.round_id, VIEW, "a view confirmation", state.masked_from)
        self._once(device, state.viewers, "a view confirmation")
        check_pairs(confirmation.recipients, confirmation.tags, "the confirmations")
        check_pairs(confirmation.dropped, confirmation.pair_seeds, "the pairwise seeds")
        surviving = self._surviving(device)
        gone = [peer for peer in self.partners(device) if peer not in surviving]
        if sorted(confirmation.recipients) != surviving or sorted(confirmation.dropped) != gone:
            raise SecAggRefusal(RejectionKind.WRONG_RECIPIENT, "confirmations or seeds for other neighbours than asked")
        if any(len(tag) != keys.TAG_BYTES for tag in confirmation.tags) or any(
            len(seed) != masks.SEED_BYTES for seed in confirmation.pair_seeds
        ):
            raise SecAggRefusal(RejectionKind.UNDECODABLE, f"a tag or a pairwise seed is not {keys.TAG_BYTES} bytes")
        self._check_confirmations_signed(confirmation)
        state.viewers.append(device)
        state.tag_senders += [device] * len(confirmation.recipients)
        state.tag_recipients += confirmation.recipients
        state.tags += confirmation.tags
        state.tag_signatures += confirmation.signatures
        state.pair_owners += [device] * len(confirmation.dropped)
        state.pair_peers += confirmation.dropped
        state.pair_seeds += confirmation.pair_seeds

    def _check_confirmations_signed(self, confirmation: ViewConfirmation) -> None:
        """On a provisioned fleet, one 64-byte signature per confirmation, routed with it. Whose signature it is only
        its recipient needs to know (a valid one on a confirmation that does not check is its proof against the
        sender); checking n k of them here would cost the coordinator seconds a round at 500 devices and prove
        nothing more: a device whose signatures are bad proves nothing against itself, and is blamed as unproven."""
        if not self.state.identities:
            return
        check_pairs(confirmation.recipients, confirmation.signatures, "the confirmations' signatures")
        if any(len(signature) != SIGNATURE_BYTES for signature in confirmation.signatures):
            raise SecAggRefusal(RejectionKind.UNDECODABLE, f"a confirmation's signature is not {SIGNATURE_BYTES} bytes")

    def unmask_requests(self) -> list[UnmaskRequest]:
        """Closes stage 4a: asks each survivor for the seed shares of its surviving neighbours, each with that
        neighbour's confirmation; a survivor that confirmed nothing abandons the round (without its confirmation no
        honest holder gives a share of its seed, and its masks with dropped neighbours stay in the sum)."""
        state = self.state
        check_stage(state.stage, VIEW, "the close of the view stage")
        silent = sorted(set(state.masked_from) - set(state.viewers))
        if silent:
            self._abandon(f"{wire.shown_names(silent)} sent a masked input and confirmed no view")
        state.stage = UNMASK
        inbox: dict[str, tuple[list[str], list[bytes], list[bytes]]] = {d: ([], [], []) for d in state.masked_from}
        signatures = state.tag_signatures or [b""] * len(state.tags)
        for sender, recipient, tag, signature in zip(state.tag_senders, state.tag_recipients, state.tags, signatures):
            if recipient in self.held_by.get(sender, set()):
                inbox[recipient][0].append(sender)
                inbox[recipient][1].append(tag)
                inbox[recipient][2].append(signature)
        state.tag_senders, state.tag_recipients, state.tags, state.tag_signatures = [], [], [], []
        return [
            UnmaskRequest(device, state.round_id, *inbox[device][:2], inbox[device][2] if state.identities else [])
            for device in state.masked_from
        ]

    def on_reveal(self, response: UnmaskResponse) -> None:
        """Stage 4b: a survivor's seed shares, only of its surviving neighbours, and those of them whose confirmation
        it says did not check."""
        state = self.state
        self._check(response.device_id, response.round_id, UNMASK, "an unmask response", state.masked_from)
        self._once(response.device_id, state.responders, "an unmask response")
        check_pairs(response.seed_owners, response.seed_shares, "the seed shares")
        surviving = self._surviving(response.device_id)
        check_within(response.seed_owners, surviving, RejectionKind.WRONG_RECIPIENT, "seed shares nobody asked for:")
        check_within(
            response.refused, surviving, RejectionKind.WRONG_RECIPIENT, "refuses confirmations of non-partners"
        )
        check_unique([*response.seed_owners, *response.refused], "the unmask response")
        check_pairs(response.proven, response.pair_seeds, "the proven cheats' pairwise seeds")
        check_within(response.proven, response.refused, RejectionKind.WRONG_RECIPIENT, "proves unrefused senders:")
        if any(len(seed) != masks.SEED_BYTES for seed in response.pair_seeds):
            raise SecAggRefusal(RejectionKind.UNDECODABLE, f"a pairwise seed is not {masks.SEED_BYTES} bytes")
        for share in response.seed_shares:
            shamir.Share.from_bytes(share)
        state.responders.append(response.device_id)
        state.seed_owners += response.seed_owners
        state.seed_holders += [response.device_id] * len(response.seed_owners)
        state.seed_shares += response.seed_shares
        state.refused_owners += response.refused
        state.refusing_holders += [response.device_id] * len(response.refused)
        state.proven_owners += response.proven
        state.proven_holders += [response.device_id] * len(response.proven)
        state.proven_seeds += response.pair_seeds

    def finish(self) -> SecAggResult:
        """Closes stage 4b: rebuilds the survivors' seeds (each checked against its commitment), strips the self masks
        and the pairwise masks with dropped neighbours, and decodes the sum; too few good shares abandons the round.
        A finished round (saved by a process that died before committing it) gives the same sum again, unless it took
        a proven cheat out of the sum: that needs the masked inputs kept in memory, so it is abandoned instead."""
        state = self.state
        if state.stage != DONE:
            check_stage(state.stage, UNMASK, "the close of the unmask stage")
        cheats = self._left_out()
        survivors = sorted(set(state.masked_from) - set(cheats))
        self._enough(survivors, "are left in the sum")
        try:
            seeds = self._rebuilt(cheats)
        except SecAggAbandoned as error:
            self._abandon(str(error))
        missing = sorted(set(survivors) - set(seeds))
        if missing:
            self._abandon(f"no shares came back for {wire.shown_names(missing)}")
        pairs = [
            (masks.pairwise_sign(owner, peer), seed)
            for owner, peer, seed in zip(state.pair_owners, state.pair_peers, state.pair_seeds)
        ] + [
            (masks.pairwise_sign(holder, cheat), seed)
            for cheat, holder, seed in zip(state.proven_owners, state.proven_holders, state.proven_seeds)
            if cheat in cheats and holder not in cheats
        ]
        fixed = self.fixed_point
        masked = flat(state.masked_sum)
        for cheat in cheats:
            masked = masked - self.inputs[cheat]
        total = fixed.decode_sum(unmasked(masked, [seeds[d].secret for d in survivors], pairs))
        state.stage = DONE
        forgers = sorted({holder for rebuilt in seeds.values() for holder in rebuilt.forgers})
        return SecAggResult(
            shaped(total, layout_of(state.masked_sum)), survivors, fixed.error_bound(len(survivors)), forgers
        )

    def _left_out(self) -> list[str]:
        """Survivors whose confirmations did not check at their holders, so that fewer than t gave a share of their
        seed: each alone is to blame (excluded, bad_signature, naming the holders that refused it). Where every
        surviving partner of such a device proved it (its own signature on a confirmation that did not check) and
        gave its pairwise seed with it, it is taken back out of the sum: its masked input, kept apart (`inputs`),
        is subtracted and those pairwise masks stripped, so the round commits without it. Otherwise (no proof, or
        no kept input: a restarted process, a finished round finished again) its self mask cannot come out of the
        sum, and the round is abandoned with a reason naming it, not the honest devices."""
        state = self.state
        returned = Counter(state.seed_owners)
        refused: dict[str, list[str]] = {}
        for owner, holder in zip(state.refused_owners, state.refusing_holders):
            refused.setdefault(owner, []).append(holder)
        blamed = sorted(owner for owner in refused if returned[owner] < self.threshold)
        proven = set(zip(state.proven_owners, state.proven_holders))
        stuck = [
            owner
            for owner in blamed
            if owner not in self.inputs
            or any((owner, partner) not in proven for partner in set(self._surviving(owner)) - set(blamed))
        ]
        for owner in blamed:
            holders = wire.shown_names(sorted(refused[owner]))
            outcome = "its self mask stays in the sum" if stuck else "taken out of the sum"
            self._exclude(
                owner,
                f"sent view confirmations that did not check at {holders}: {outcome}",
                RejectionKind.BAD_SIGNATURE,
            )
        if stuck:
            self._abandon(
                f"{wire.shown_names(stuck)} sent view confirmations that did not check, so fewer than "
                f"{self.threshold} holders gave shares of their seeds: their self masks cannot be taken out of the sum"
            )
        return blamed

    def _surviving(self, device: str) -> list[str]:
        """The device's partners that sent a masked input (sorted)."""
        return sorted(set(self.state.masked_from).intersection(self.partners(device)))

    def _rebuilt(self, cheats: list[str]) -> dict[str, Rebuilt]:
        """Each survivor's seed (but the cheats' taken out of the sum) from the shares its neighbours returned,
        checked against its commitment."""
        state = self.state
        held: dict[str, list[tuple[str, shamir.Share]]] = {}
        for owner, holder, share in zip(state.seed_owners, state.seed_holders, state.seed_shares):
            if owner not in cheats:
                held.setdefault(owner, []).append((holder, shamir.Share.from_bytes(share)))
        return {owner: rebuild(owner, pairs, self.threshold, self._seed_valid) for owner, pairs in held.items()}

    def _seed_valid(self, owner: str, seed: bytes) -> bool:
        commitment = self.state.commitments[self.state.sharers.index(owner)]
        return masks.seed_commitment(self.context, owner, seed) == commitment
