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
from protocol.messages import RejectionKind, ShareDelivery, UnmaskRequest
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
    assert result.survivors == sorted(updates) and result.forged == []
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
        secure.server.unmask_requests()
    state = secure.server.state
    assert state.stage == ABANDONED and state.seed_shares == state.key_shares == []
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
    forged = dataclasses.replace(
        target, ciphertexts=[bytes([target.ciphertexts[0][0] ^ 1]) + target.ciphertexts[0][1:], *target.ciphertexts[1:]]
    )
    refused(RejectionKind.FORGED_SHARE, devices["dev003"].on_delivery, forged)
    sender = target.senders[0]  # its record sealed for dev003, handed to another of its neighbours
    other = next(peer for peer in rosters[sender].neighbours if peer != "dev003")
    readdressed = ShareDelivery(other, target.round_id, [sender], [target.ciphertexts[0]])
    refused(RejectionKind.FORGED_SHARE, devices[other].on_delivery, readdressed)
    for device, delivery in deliveries.items():
        devices[device].on_delivery(delivery)
    refused(RejectionKind.WRONG_STAGE, devices["dev003"].on_delivery, target)
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
    for request in secure.server.unmask_requests():
        response = secure.devices[request.device_id].on_unmask(request)
        if request.device_id == forger:
            share = bytearray(response.seed_shares[0])
            share[-1] ^= 1
            response = dataclasses.replace(response, seed_shares=[bytes(share), *response.seed_shares[1:]])
        secure.server.on_reveal(response)
    result = secure.server.finish()
    assert [refusal.kind for refusal in result.forged] == [RejectionKind.FORGED_SHARE]
    assert forger in result.forged[0].reason
    assert largest_error(result.total, plain_sum(updates, updates)) <= result.error_bound


def test_an_honest_device_refuses_both_shares_of_one_peer() -> None:
    updates = head_updates(6, seed=8)
    secure = SecureRound.started(updates)
    secure.share()
    secure.mask(updates)
    request = next(r for r in secure.server.unmask_requests() if r.device_id == "dev000")
    device = secure.devices["dev000"]
    peer = request.survivors[0]
    both = UnmaskRequest("dev000", request.round_id, request.survivors, [peer], request.survivor_count)
    refused(RejectionKind.UNSAFE_REQUEST, device.on_unmask, both)
    device.on_unmask(request)
    later = UnmaskRequest("dev000", request.round_id, [], [peer], request.survivor_count)
    refused(RejectionKind.UNSAFE_REQUEST, device.on_unmask, later)
    refused(RejectionKind.UNSAFE_REQUEST, device.on_unmask, dataclasses.replace(request, survivor_count=1))
    refused(
        RejectionKind.UNSAFE_REQUEST, device.on_unmask, dataclasses.replace(request, dropped=["dev000"], survivors=[])
    )


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
    secure.share()
    restart()
    secure.mask(updates)
    restart()
    result = secure.unmask(updates)
    assert largest_error(result.total, plain_sum(updates, updates)) <= result.error_bound
    again = SecAggServer.restored(secure.server.snapshot()).finish()  # died after finishing, before committing
    assert all(np.array_equal(again.total[name], result.total[name]) for name in result.total)


def test_settings_that_do_not_fit_are_usage_errors() -> None:
    with pytest.raises(UsageError):
        SecureRound.started(head_updates(3), dropout=0.5)
    with pytest.raises(UsageError):
        SecureRound.started(head_updates(3), clip=1e10)
