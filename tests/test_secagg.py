# Secure aggregation end to end in process, with real crypto: the unmasked sum, dropouts, abandonment, what the
# coordinator stores, every refused message with its kind, and restarts between stages.
from __future__ import annotations

import dataclasses
from collections.abc import Callable

import numpy as np
import pytest

from bench.secagg_fleet import ROUND, SecureRound, head_updates, largest_error, plain_sum
from coordinator.secure.secagg_round import ABANDONED
from coordinator.secure.secagg_server import SecAggServer
from edge_agent.loop.secagg_device import SecAggDevice
from protocol.errors import UsageError
from protocol.messages import (
    DeliveryAck,
    MaskRequest,
    RecordKeyRequest,
    RejectionKind,
    ShareBundle,
    ShareDelivery,
    SurvivorView,
    UnmaskRequest,
    UnmaskResponse,
)
from protocol.secagg import keys
from protocol.secagg.errors import SecAggAbandoned, SecAggRefusal
from protocol.secagg.fixed_point import FixedPoint, flat


def refused(kind: RejectionKind, call: Callable[..., object], *args: object) -> SecAggRefusal:
    """The refusal a call raises, checked for its kind and a bounded reason."""
    with pytest.raises(SecAggRefusal) as caught:
        call(*args)
    assert caught.value.kind == kind, caught.value.reason
    assert 0 < len(caught.value.reason) <= 300
    return caught.value


def test_the_unmasked_sum_is_the_plain_sum_within_the_fixed_point_bound() -> None:
    updates = head_updates(10)
    secure = SecureRound.started(updates)
    secure.share()
    secure.mask(updates)
    result = secure.unmask(updates)
    assert result.survivors == sorted(updates) and result.forgers == []
    assert 0 < result.error_bound < 1e-5
    assert largest_error(result.total, plain_sum(updates, updates)) <= result.error_bound


def test_a_weighted_sum_gives_fedavg_within_the_bound() -> None:
    updates = head_updates(6, seed=1)
    samples = dict(zip(sorted(updates), [10, 50, 200, 7, 90, 33]))
    weights = {device: count / max(samples.values()) for device, count in samples.items()}
    weighted = {
        device: {
            **{name: array * weights[device] for name, array in tensors.items()},
            "weight": np.array([weights[device]]),
        }
        for device, tensors in updates.items()
    }
    secure = SecureRound.started(weighted)
    secure.share()
    secure.mask(weighted)
    result = secure.unmask(weighted)
    fedavg = {
        name: np.average(
            [updates[d][name] for d in sorted(updates)], axis=0, weights=[samples[d] for d in sorted(updates)]
        )
        for name in updates["dev000"]
    }
    mean = {name: result.total[name] / result.total["weight"][0] for name in fedavg}
    assert largest_error(mean, fedavg) <= 2 * result.error_bound / result.total["weight"][0]


@pytest.mark.parametrize("when", ["after masking", "before masking"])
def test_thirty_percent_of_devices_dropping_still_gives_the_right_sum(when: str) -> None:
    updates = head_updates(10, seed=2)
    ids = sorted(updates)
    dropped = ids[1:8:3] + ids[9:]  # 3 of 10
    survivors = [device for device in ids if device not in dropped]
    secure = SecureRound.started(updates)
    secure.share()
    secure.mask(ids if when == "after masking" else survivors)
    result = secure.unmask(survivors)
    counted = ids if when == "after masking" else survivors
    assert result.survivors == counted
    assert largest_error(result.total, plain_sum(updates, counted)) <= result.error_bound


def test_more_drops_than_the_threshold_abandon_the_round_before_anything_is_asked() -> None:
    updates = head_updates(10, seed=3)
    ids = sorted(updates)
    secure = SecureRound.started(updates)
    secure.share()
    secure.mask(ids[:4])  # 6 of 10 drop: no device keeps the 5 surviving neighbours of 8 that a secret needs
    with pytest.raises(SecAggAbandoned):
        secure.server.view_requests()
    state = secure.server.state
    assert state.stage == ABANDONED and state.seed_shares == state.pair_seeds == []
    assert all(not array.any() for array in state.masked_sum.values())
    with pytest.raises(SecAggRefusal):
        secure.server.finish()


def test_too_few_answers_to_the_unmask_requests_abandon_the_round() -> None:
    updates = head_updates(10, seed=4)
    secure = SecureRound.started(updates)
    secure.share()
    secure.mask(updates)
    with pytest.raises(SecAggAbandoned):
        secure.unmask(sorted(updates)[:4])
    assert secure.server.state.stage == ABANDONED and secure.server.state.seed_shares == []


def test_a_survivor_that_confirms_no_view_abandons_the_round_before_any_share_is_asked() -> None:
    updates = head_updates(10, seed=14)
    ids = sorted(updates)
    secure = SecureRound.started(updates)
    secure.share()
    secure.mask(ids)
    with pytest.raises(SecAggAbandoned, match="confirmed no view"):
        secure.unmask(ids, confirming=ids[1:])  # dev000 masked, then went silent
    state = secure.server.state
    assert state.stage == ABANDONED and state.seed_shares == state.pair_seeds == []


def test_the_coordinator_never_holds_an_individual_update() -> None:
    updates = head_updates(5, seed=5)
    secure = SecureRound.started(updates)
    secure.share()
    device = "dev002"
    masked = secure.devices[device].masked_input(updates[device])
    fixed = FixedPoint(1.0, 5)
    plain = fixed.encode(flat(updates[device]))
    assert np.mean(flat(masked.masked) == plain) < 0.01
    secure.server.on_masked(secure.sent(device, masked))
    snapshot = secure.server.snapshot()
    for secret in (plain.tobytes(), flat(updates[device]).astype(np.float32).tobytes()):
        assert secret[:64] not in snapshot


def test_forged_and_misaddressed_messages_are_refused_with_their_kinds() -> None:
    updates = head_updates(40, seed=6)
    secure = SecureRound.started(updates, dropout=0.05)
    server, devices = secure.server, secure.devices
    first = devices["dev000"]
    refused(RejectionKind.REPLAY, server.on_keys, secure.sent("dev000", first.advert()))
    refused(RejectionKind.STALE_ROUND, server.on_keys, dataclasses.replace(first.advert(), round_id=6))
    other = SecAggDevice.start("dev001", 7, 1.0, 0.05).advert()
    refused(RejectionKind.DUPLICATE, server.on_keys, other)
    refused(RejectionKind.NOT_SELECTED, server.on_keys, dataclasses.replace(other, device_id="x" * 5000))
    rosters = {roster.device_id: roster for roster in server.rosters()}
    stranger = next(d for d in sorted(updates) if d not in rosters["dev000"].neighbours and d != "dev000")
    bundle = first.on_roster(rosters["dev000"])
    misaddressed = dataclasses.replace(bundle, recipients=[stranger, *bundle.recipients[1:]])
    refused(RejectionKind.WRONG_RECIPIENT, server.on_shares, misaddressed)
    server.on_shares(bundle)
    refused(RejectionKind.DUPLICATE, server.on_shares, bundle)
    for device, roster in rosters.items():
        if device != "dev000":
            server.on_shares(devices[device].on_roster(roster))
    deliveries = {delivery.device_id: delivery for delivery in server.deliveries()}
    target = deliveries["dev003"]
    refused(RejectionKind.WRONG_RECIPIENT, devices["dev004"].on_delivery, target)
    sender = target.senders[0]  # its record altered on the way, or sealed for dev003 and handed to another
    altered = dataclasses.replace(target, ciphertexts=[b"\x01" + target.ciphertexts[0][1:], *target.ciphertexts[1:]])
    other = next(peer for peer in rosters[sender].neighbours if peer != "dev003")
    theirs = deliveries[other]
    records = [
        target.ciphertexts[0] if peer == sender else sealed for peer, sealed in zip(theirs.senders, theirs.ciphertexts)
    ]
    for device, delivery in (("dev003", altered), (other, dataclasses.replace(theirs, ciphertexts=records))):
        ack = SecAggDevice.restored(devices[device].snapshot()).on_delivery(delivery)  # passed over, nobody blamed
        assert sender not in ack.held and ack.accused == [] and len(ack.held) == len(delivery.senders) - 1
    for device, delivery in deliveries.items():
        server.on_ack(devices[device].on_delivery(delivery))
    refused(RejectionKind.WRONG_STAGE, devices["dev003"].on_delivery, target)
    refused(RejectionKind.WRONG_STAGE, devices["dev000"].masked_input, updates["dev000"])  # its partners not known
    assert server.key_requests() == []
    for request in server.mask_requests():
        devices[request.device_id].on_mask_request(request)
    masked = devices["dev000"].masked_input(updates["dev000"])
    server.on_masked(masked)
    refused(RejectionKind.DUPLICATE, server.on_masked, masked)
    refused(RejectionKind.WRONG_STAGE, devices["dev000"].masked_input, updates["dev000"])


def test_a_forged_share_at_unmasking_is_outvoted_and_named() -> None:
    updates = head_updates(10, seed=7)
    secure = SecureRound.started(updates)
    secure.share()
    secure.mask(updates)
    forger = "dev004"
    secure.confirm()
    for request in secure.server.unmask_requests():
        response = secure.devices[request.device_id].on_unmask(request)
        if request.device_id == forger:
            share = bytearray(response.seed_shares[0])
            share[-1] ^= 1
            response = dataclasses.replace(response, seed_shares=[bytes(share), *response.seed_shares[1:]])
        secure.server.on_reveal(response)
    result = secure.server.finish()
    assert result.forgers == [forger]
    assert largest_error(result.total, plain_sum(updates, updates)) <= result.error_bound


def test_a_device_with_fewer_than_threshold_shares_refuses_to_mask() -> None:
    updates = head_updates(6, seed=12)
    secure = SecureRound.started(updates)
    secure.send_shares()
    deliveries = {delivery.device_id: delivery for delivery in secure.server.deliveries()}
    device, delivery = secure.devices["dev001"], deliveries["dev001"]
    threshold = device.state.threshold
    for count in (0, threshold - 1):
        short = ShareDelivery("dev001", delivery.round_id, delivery.senders[:count], delivery.ciphertexts[:count])
        refused(RejectionKind.UNSAFE_REQUEST, device.on_delivery, short)
        assert device.state.stage == "shared" and device.state.held_from == []
        refused(RejectionKind.WRONG_STAGE, device.masked_input, updates["dev001"])
    device.on_delivery(delivery)
    few = MaskRequest("dev001", ROUND, device.state.neighbours[: threshold - 1])
    refused(RejectionKind.UNSAFE_REQUEST, device.on_mask_request, few)  # fewer partners than the threshold
    assert device.state.stage == "delivered"
    device.on_mask_request(MaskRequest("dev001", ROUND, device.state.neighbours))
    assert device.masked_input(updates["dev001"]).device_id == "dev001"


def viewed(seed: int) -> tuple[SecureRound, dict[str, SurvivorView]]:
    """A round of six devices, all masked, and the survivor view the coordinator sends each."""
    updates = head_updates(6, seed=seed)
    secure = SecureRound.started(updates)
    secure.share()
    secure.mask(updates)
    return secure, {view.device_id: view for view in secure.server.view_requests()}


def test_an_honest_device_keeps_one_view_and_reveals_only_what_it_allows() -> None:
    secure, views = viewed(8)
    device, view = secure.devices["dev000"], views["dev000"]
    refused(RejectionKind.UNSAFE_REQUEST, device.on_view, dataclasses.replace(view, survivor_count=1))
    refused(RejectionKind.UNSAFE_REQUEST, device.on_view, dataclasses.replace(view, survivors=["dev000"]))
    confirmation = device.on_view(view)
    assert device.on_view(view) == confirmation  # the same view again (a restart's resend): the same answer
    assert confirmation.dropped == [] and len(confirmation.tags) == len(view.survivors) == 5
    fewer = dataclasses.replace(view, survivors=view.survivors[1:])
    refused(RejectionKind.UNSAFE_REQUEST, device.on_view, fewer)  # a second view would reveal a pairwise seed
    for other, other_view in views.items():
        secure.server.on_confirm(secure.devices[other].on_view(other_view) if other != "dev000" else confirmation)
    requests = {request.device_id: request for request in secure.server.unmask_requests()}
    request = requests["dev000"]
    assert len(device.on_unmask(request).seed_shares) == 5
    wrong_tag = dataclasses.replace(request, tags=[request.tags[1], request.tags[0], *request.tags[2:]])
    swapped = device.on_unmask(wrong_tag)  # the two swapped confirmations check for neither: only they get no share
    assert (swapped.refused, swapped.seed_owners) == (request.senders[:2], request.senders[2:])
    untagged = UnmaskRequest("dev000", request.round_id, request.senders[:1], [bytes(32)])
    assert device.on_unmask(untagged) == UnmaskResponse("dev000", request.round_id, [], [], request.senders[:1])
    elsewhere = requests["dev002"]  # dev001's confirmation to dev002, replayed to dev000
    replayed = UnmaskRequest(
        "dev000", request.round_id, ["dev001"], [elsewhere.tags[elsewhere.senders.index("dev001")]]
    )
    assert device.on_unmask(replayed).refused == ["dev001"]


def test_a_device_told_its_neighbours_dropped_gives_no_seed_share_without_their_confirmation() -> None:
    secure, views = viewed(13)
    device = secure.devices["dev002"]
    alone = SurvivorView("dev002", ROUND, ["dev003"], 6)  # a lie: four living neighbours called dropped
    confirmation = device.on_view(alone)
    assert confirmation.dropped == ["dev000", "dev001", "dev004", "dev005"] and len(confirmation.pair_seeds) == 4
    assert views["dev002"].survivors != alone.survivors
    refused(RejectionKind.UNSAFE_REQUEST, device.on_unmask, UnmaskRequest("dev002", ROUND, ["dev000"], [bytes(32)]))


def forging(forger: SecureRound, name: str, victims: Callable[[list[str]], list[str]]) -> Callable:
    """A bundle alteration: the named device's records to its victims replaced by authentic ones (the pair's MAC)
    that hold no share."""

    def altered(bundle: ShareBundle) -> ShareBundle:
        if bundle.device_id != name:
            return bundle
        state, hit = forger.devices[name].state, victims(bundle.recipients)
        records = [
            keys.seal_record(state.cipher_secret, state.peer_key(peer, True), state.context, name, peer, bytes(68))
            if peer in hit
            else sealed
            for peer, sealed in zip(bundle.recipients, bundle.ciphertexts)
        ]
        return dataclasses.replace(bundle, ciphertexts=records)

    return altered


@pytest.mark.parametrize("victims", [lambda peers: peers[:1], lambda peers: peers], ids=["one", "every"])
@pytest.mark.parametrize("answers", [True, False], ids=["reveals", "silent"])
def test_a_forged_record_excludes_its_sender_and_the_round_commits_without_it(victims, answers) -> None:
    updates = head_updates(6, seed=15)
    secure = SecureRound.started(updates)
    forger, honest = "dev002", [d for d in sorted(updates) if d != "dev002"]
    secure.send_shares(forging(secure, forger, victims))
    secure.deliver()
    secure.partner(silent=[] if answers else [forger])
    state = secure.server.state
    assert state.excluded == [forger] and forger not in state.maskers
    reason = state.exclusion_reasons[0]
    assert reason.startswith(repr(forger)) and len(reason) <= 300
    assert ("does not open" in reason) == answers and ("did not reveal" in reason) == (not answers)
    refused(RejectionKind.WRONG_STAGE, secure.devices[forger].masked_input, updates[forger])  # never asked to mask
    secure.mask(honest)
    result = secure.unmask(honest)
    assert result.survivors == honest
    assert largest_error(result.total, plain_sum(updates, honest)) <= result.error_bound


def test_a_false_complaint_excludes_the_accuser_and_keeps_the_accused() -> None:
    updates = head_updates(6, seed=16)
    secure = SecureRound.started(updates)
    liar, victim = "dev004", "dev001"

    def lie(ack: DeliveryAck) -> DeliveryAck:
        if ack.device_id != liar:
            return ack
        state = secure.devices[liar].state
        key = keys.agreed_key(state.cipher_secret, state.peer_key(victim, True), keys.RECORD_PURPOSE, state.context)
        return dataclasses.replace(ack, held=[d for d in ack.held if d != victim], accused=[victim], pair_keys=[key])

    secure.send_shares()
    secure.deliver(lie)
    secure.partner()
    state = secure.server.state
    assert state.excluded == [liar] and "opens as a share" in state.exclusion_reasons[0]
    kept = [d for d in sorted(updates) if d != liar]
    secure.mask(kept)
    result = secure.unmask(kept)
    assert result.survivors == kept and largest_error(result.total, plain_sum(updates, kept)) <= result.error_bound


def test_a_complaint_whose_key_does_not_check_excludes_the_accuser() -> None:
    updates = head_updates(6, seed=17)
    secure = SecureRound.started(updates)
    secure.send_shares()
    liar = "dev003"
    wrong = bytes(32)
    secure.deliver(
        lambda ack: (
            dataclasses.replace(ack, accused=["dev000"], pair_keys=[wrong], held=ack.held[1:])
            if ack.device_id == liar
            else ack
        )
    )
    assert secure.server.state.excluded == [liar] and secure.server.state.accused == []
    device = secure.devices["dev000"]
    refused(RejectionKind.UNSAFE_REQUEST, device.on_key_request, RecordKeyRequest("dev000", ROUND, [liar], [wrong]))


def test_bad_acknowledgements_reveals_and_confirmations_are_refused_with_bounded_reasons() -> None:
    updates = head_updates(6, seed=18)
    secure = SecureRound.started(updates)
    server, forger = secure.server, "dev005"
    secure.send_shares(forging(secure, forger, lambda peers: peers[:1]))
    deliveries = {delivery.device_id: delivery for delivery in server.deliveries()}
    acks = {device: secure.devices[device].on_delivery(delivery) for device, delivery in deliveries.items()}
    victim = next(device for device, ack in acks.items() if ack.accused)
    stranger = dataclasses.replace(acks["dev000"], held=["x" * 5000])
    refused(RejectionKind.WRONG_RECIPIENT, server.on_ack, stranger)
    twice = dataclasses.replace(acks["dev000"], held=acks["dev000"].held * 2)
    refused(RejectionKind.DUPLICATE, server.on_ack, twice)
    for ack in acks.values():
        server.on_ack(ack)
    refused(RejectionKind.DUPLICATE, server.on_ack, acks["dev000"])
    (request,) = server.key_requests()
    assert request.device_id == forger and request.accusers == [victim]
    reveal = secure.devices[forger].on_key_request(request)
    bystander = next(device for device in sorted(updates) if device not in (victim, forger))
    refused(RejectionKind.WRONG_RECIPIENT, server.on_key_reveal, dataclasses.replace(reveal, accusers=[bystander]))
    refused(RejectionKind.WRONG_STAGE, server.on_key_reveal, dataclasses.replace(reveal, device_id=bystander))
    server.on_key_reveal(reveal)
    refused(RejectionKind.DUPLICATE, server.on_key_reveal, reveal)
    for mask_request in server.mask_requests():
        secure.devices[mask_request.device_id].on_mask_request(mask_request)
    kept = sorted(server.state.maskers)
    secure.mask(kept)
    views = {view.device_id: view for view in server.view_requests()}
    confirmation = secure.devices["dev000"].on_view(views["dev000"])
    wrong = dataclasses.replace(confirmation, recipients=confirmation.recipients[1:], tags=confirmation.tags[1:])
    refused(RejectionKind.WRONG_RECIPIENT, server.on_confirm, wrong)
    short = dataclasses.replace(confirmation, tags=[b"x", *confirmation.tags[1:]])
    refused(RejectionKind.UNDECODABLE, server.on_confirm, short)
    server.on_confirm(confirmation)
    refused(RejectionKind.DUPLICATE, server.on_confirm, confirmation)


def test_a_device_refuses_a_roster_whose_threshold_is_no_majority() -> None:
    updates = head_updates(6, seed=9)
    secure = SecureRound.started(updates)
    roster = secure.server.rosters()[0]
    device = secure.devices[roster.device_id]
    refused(
        RejectionKind.UNSAFE_REQUEST,
        device.on_roster,
        dataclasses.replace(roster, threshold=len(roster.neighbours) // 2),
    )
    refused(RejectionKind.UNSAFE_REQUEST, device.on_roster, dataclasses.replace(roster, min_survivors=1))
    refused(RejectionKind.OUT_OF_RANGE, device.on_roster, dataclasses.replace(roster, clip=1e12))


def test_a_device_refuses_a_roster_that_departs_from_the_recipe() -> None:
    updates = head_updates(40, seed=11)
    secure = SecureRound.started(updates, dropout=0.05)
    roster = secure.server.rosters()[0]
    device = secure.devices[roster.device_id]
    refused(RejectionKind.UNSAFE_REQUEST, device.on_roster, dataclasses.replace(roster, clip=0.5))
    refused(RejectionKind.UNSAFE_REQUEST, device.on_roster, dataclasses.replace(roster, advertised=41))
    sparser = dataclasses.replace(
        roster,
        neighbours=roster.neighbours[:6],
        cipher_keys=roster.cipher_keys[:6],
        mask_keys=roster.mask_keys[:6],
        threshold=4,
    )
    refused(RejectionKind.UNSAFE_REQUEST, device.on_roster, sparser)
    careful = SecAggDevice.start(roster.device_id, ROUND, 1.0, 0.3)
    refused(RejectionKind.UNSAFE_REQUEST, careful.on_roster, roster)
    assert len(device.on_roster(roster).recipients) == 14


def test_both_sides_survive_a_restart_between_every_stage() -> None:
    updates = head_updates(8, seed=10)
    secure = SecureRound.started(updates)

    def restart() -> None:
        secure.server = SecAggServer.restored(secure.server.snapshot())
        secure.devices = {d: SecAggDevice.restored(device.snapshot()) for d, device in secure.devices.items()}

    restart()
    secure.send_shares()
    restart()
    secure.deliver()
    restart()
    secure.partner()
    restart()
    secure.mask(updates)
    restart()
    secure.confirm()
    restart()
    result = secure.reveal(updates)
    assert largest_error(result.total, plain_sum(updates, updates)) <= result.error_bound
    again = SecAggServer.restored(secure.server.snapshot()).finish()  # died after finishing, before committing
    assert all(np.array_equal(again.total[name], result.total[name]) for name in result.total)


def test_settings_that_do_not_fit_are_usage_errors() -> None:
    with pytest.raises(UsageError):
        SecureRound.started(head_updates(3), dropout=0.5)
    with pytest.raises(UsageError):
        SecureRound.started(head_updates(3), clip=1e10)
