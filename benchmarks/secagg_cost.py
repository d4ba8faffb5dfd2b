# Secure aggregation's cost against plain summation in the same run: bytes and compute per device, coordinator
# compute and state, at 10, 100 and 500 in-process devices with a head-sized update; `mqtt`: over a real broker.
"""Each run drives one SecAgg+ round through bench.secagg_fleet (every message encoded and decoded by the wire,
real X25519, HKDF, AES-GCM, AES-CTR and Shamir) and, over the same updates, the plain round: each device sends an
float32 `Update` of its head and the coordinator sums the decoded tensors. Per fleet size and seed it reports

  neighbours, threshold          the graph's degree (grows as log n for a fixed tolerated dropout) and its threshold
  device_bytes_sent/received     mean over devices, every stage message as the wire encodes it
  plain_device_bytes_sent        the plain update message
  device_seconds                 mean and max compute per device (keys, records, masks, confirmations, reveals)
  server_seconds                 the coordinator's compute over every stage
  plain_server_seconds           decoding and summing the plain updates
  server_state_bytes             the largest saved state of the round (the sealed shares it routes, the sum)
  server_state_masked_bytes      its saved state once the masked inputs are in
  server_kept_inputs_bytes       the masked inputs it keeps apart in memory (a provisioned fleet's only)
  max_error, error_bound         the unmasked sum against the plain sum, and the fixed point's stated bound
  peak_rss_mb                    the process's peak RSS (all devices and the coordinator share it)

and, in the same run over the same updates and graph, the round again on a provisioned fleet (issue 43: each key
advert and view confirmation signed by its device's Ed25519 identity key, each advert checked by the coordinator and
by every device whose roster lists it; the coordinator also keeps each masked input apart, in memory):

  signed_device_bytes_sent/received, signed_device_seconds, signed_server_seconds, signed_server_state_bytes,
  signed_server_state_masked_bytes, signed_server_kept_inputs_bytes: as above, signed
  sign_seconds                   mean per device: signing its advert and its k view confirmations (Ed25519)
  roster_check_seconds           mean per device: checking its roster's k neighbour signatures
  server_check_seconds           the coordinator: checking every advert's signature

Usage: python benchmarks/secagg_cost.py [--devices 10 100 500] [--seeds 0 1 2] [--features 1280]
       [--dropout 0.1] [--drop-before 0.05] [--drop-after 0.05]
       python benchmarks/secagg_cost.py mqtt [--devices 10 100] [--rounds 2] [--out DIR] [--trees NAME=DIR ...]
         (`fl-bench simulate` with virtual devices, plain then secure rounds on one embedded broker:
          see secagg_mqtt.py for what it reports)
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import secagg_mqtt
from load import add_trees_option

from bench.secagg_fleet import SecureRound, head_updates, largest_error, plain_sum
from coordinator.fleet.broker import DEFAULT_MAX_PACKET_BYTES, EmbeddedBroker
from protocol import wire
from protocol.messages import Update
from protocol.secagg import keys
from protocol.secagg.identity import confirmation_body, sign, sign_advert, unsigned
from protocol.tensors import Weights


def plain_round(updates: dict[str, Weights]) -> tuple[float, float]:
    """Mean bytes of a plain float32 update message, and the coordinator's seconds to decode and sum them all."""
    messages = [
        wire.encode(Update(d, 7, f"u-{d}", "base", 10, [1] * 10, 10, {}, tensors)) for d, tensors in updates.items()
    ]
    start = time.perf_counter()
    total: dict[str, np.ndarray] = {}
    for data in messages:
        for name, array in wire.decode(data, Update).tensors.items():
            total[name] = total.get(name, 0) + array.astype(np.float64)
    return statistics.fmean(len(m) for m in messages), time.perf_counter() - start


def secure_round(updates: dict[str, Weights], args: argparse.Namespace, signed: bool = False) -> dict[str, Any]:
    """One secure round with the asked dropouts (`signed`: on a provisioned fleet), and what it cost."""
    ids = sorted(updates)
    before = ids[: round(args.drop_before * len(ids))]
    after = ids[len(before) : len(before) + round(args.drop_after * len(ids))]
    secure = SecureRound.started(updates, signed, dropout=args.dropout, min_survivors=2)
    secure.send_shares()
    state_bytes = len(secure.server.snapshot())
    secure.deliver()
    secure.partner()
    masked = [d for d in ids if d not in before]
    secure.mask(masked)
    masked_state_bytes = len(secure.server.snapshot())
    kept_bytes = sum(array.nbytes for array in secure.server.inputs.values())
    result = secure.unmask([d for d in masked if d not in after])
    costs = secure.costs
    return {
        "neighbours": secure.server.degree,
        "threshold": secure.server.threshold,
        "device_bytes_sent": statistics.fmean(costs.sent[d] for d in masked),
        "device_bytes_received": statistics.fmean(costs.received[d] for d in masked),
        "device_seconds": statistics.fmean(costs.device_seconds[d] for d in masked),
        "device_seconds_max": max(costs.device_seconds.values()),
        "server_seconds": costs.server_seconds,
        "server_state_bytes": state_bytes,
        "server_state_masked_bytes": masked_state_bytes,
        "server_kept_inputs_bytes": kept_bytes,
        "max_error": largest_error(result.total, plain_sum(updates, masked)),
        "error_bound": result.error_bound,
    } | (signing_seconds(secure) if signed else {})


def signing_seconds(secure: SecureRound) -> dict[str, float]:
    """The signatures' own compute in a signed round, timed apart from the rest: each device signing its advert and
    one confirmation per neighbour (a 32-byte tag, as in the round) and checking the k advert signatures of its
    roster; the coordinator checking every advert (confirmation signatures are checked only by a recipient whose
    confirmation does not check, against its sender)."""
    state, context = secure.server.state, secure.server.context
    adverts = list(zip(state.advertised, state.cipher_keys, state.mask_keys, state.signatures))
    by_device = {advert[0]: advert for advert in adverts}
    tag = bytes(keys.TAG_BYTES)
    signing, checking = [], []
    for device, cipher, mask, _ in adverts:
        identity, peers = secure.devices[device].identity, secure.server.graph[device]
        start = time.perf_counter()
        sign_advert(identity.secret, context, device, cipher, mask)
        for peer in peers:
            sign(identity.secret, confirmation_body(context, device, peer, tag))
        signing.append(time.perf_counter() - start)
        start = time.perf_counter()
        unsigned(identity.roster, context, [by_device[peer] for peer in peers])
        checking.append(time.perf_counter() - start)
    roster = secure.devices[state.advertised[0]].identity.roster
    start = time.perf_counter()
    assert not any(unsigned(roster, context, adverts))
    return {
        "sign_seconds": statistics.fmean(signing),
        "roster_check_seconds": statistics.fmean(checking),
        "server_check_seconds": time.perf_counter() - start,
    }


SIGNED = (
    *("device_bytes_sent", "device_bytes_received", "device_seconds"),
    *("server_seconds", "server_state_bytes", "server_state_masked_bytes", "server_kept_inputs_bytes"),
)


def over_mqtt(argv: list[str]) -> None:
    """The `mqtt` mode: plain and secure simulate runs per fleet size on one embedded broker; one JSON line each,
    then the whole report."""
    parser = argparse.ArgumentParser(description=secagg_mqtt.__doc__)
    parser.add_argument("--devices", type=int, nargs="+", default=[10, 100])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--out", type=Path, help="keep the runs here (default: a temporary folder)")
    add_trees_option(
        parser, "checkouts whose simulate runs each size in turn (before=DIR after=DIR: a change's cost in one run)"
    )
    args = parser.parse_args(argv)
    folder = args.out or Path(tempfile.mkdtemp(prefix="secagg-mqtt-"))
    folder.mkdir(parents=True, exist_ok=True)
    with EmbeddedBroker(folder / "broker", max_packet_bytes=DEFAULT_MAX_PACKET_BYTES) as broker:
        report = secagg_mqtt.compare(broker.address, args.devices, args.rounds, folder, args.trees)
    print(json.dumps({"machine": {"cores": os.cpu_count()}, **report}), flush=True)


def main() -> None:
    """Runs every fleet size and seed and prints one JSON line each, then the means per size (or, with `mqtt` first,
    the bench over a broker)."""
    if sys.argv[1:2] == ["mqtt"]:
        over_mqtt(sys.argv[2:])
        return
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--devices", type=int, nargs="+", default=[10, 100, 500])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--features", type=int, default=1280, help="head inputs: 10 x F + 10 floats per update")
    parser.add_argument("--dropout", type=float, default=0.1, help="the dropout the graph is sized to survive")
    parser.add_argument("--drop-before", type=float, default=0.05, help="fraction that drops before masking")
    parser.add_argument(
        "--drop-after", type=float, default=0.05, help="fraction that drops after masking and confirming its view"
    )
    args = parser.parse_args()
    summary = []
    for devices in args.devices:
        rows = []
        for seed in args.seeds:
            updates = head_updates(devices, seed=seed, features=args.features)
            plain_bytes, plain_seconds = plain_round(updates)
            row = {"devices": devices, "seed": seed, "floats": 10 * args.features + 10, **secure_round(updates, args)}
            signed = secure_round(updates, args, signed=True)
            row |= {f"signed_{key}": signed[key] for key in SIGNED} | {
                key: signed[key] for key in ("sign_seconds", "roster_check_seconds", "server_check_seconds")
            }
            row |= {"plain_device_bytes_sent": plain_bytes, "plain_server_seconds": plain_seconds}
            print(json.dumps(row), flush=True)
            rows.append(row)
        summary.append({key: statistics.fmean(r[key] for r in rows) for key in rows[0] if key != "seed"})
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(json.dumps({"summary": summary, "peak_rss_mb": peak, "dropout": args.dropout}), flush=True)


if __name__ == "__main__":
    main()
