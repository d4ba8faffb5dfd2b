# Parsed command-line arguments as the coordinator's settings: the round policy, the recipe, the server's settings.
from __future__ import annotations

import argparse
import time
from pathlib import Path

from coordinator.asynchronous.intake import AsyncPolicy
from coordinator.commands.method_flags import check_recipe_options, chosen_options
from coordinator.commands.recipe_options import recipe_from
from coordinator.commands.round_options import DEFAULT_MAX_STALENESS
from coordinator.intake.round_aggregator import SuspectPolicy
from coordinator.privacy.rounds import DpSettings
from coordinator.rounds.promotion import PromotionGate
from coordinator.rounds.rules import RoundPolicy
from coordinator.setup.encoder import load_encoder
from coordinator.setup.settings import InitSettings, ServerSettings
from coordinator.strategies.registry import make_strategy
from edge_agent.learning.local_rules import LOCAL_RULES, make_local_rule
from edge_agent.learning.pretrained_backbone import check_pretrained_installed
from edge_agent.learning.sampling import make_sampler
from protocol import wire
from protocol.chunks import given_packet_limit
from protocol.errors import UsageError
from protocol.model_spec import DEFAULT_SPEC, SpecFile, load_model_spec
from protocol.update_codec import UpdateCodec

ASYNC_ONLY_FLAGS = ("buffer", "max_staleness", "async_server_lr")


def async_policy(args: argparse.Namespace) -> AsyncPolicy | None:
    """The AsyncPolicy of --mode async, or None for synchronous rounds (an async-only flag is then refused)."""
    if args.mode == "sync":
        given = ["--" + name.replace("_", "-") for name in ASYNC_ONLY_FLAGS if getattr(args, name) is not None]
        if given:
            raise UsageError(f"{', '.join(given)} only apply to --mode async")
        return None
    if args.buffer is None:
        raise UsageError("--mode async needs --buffer K, the updates folded into each version")
    staleness = DEFAULT_MAX_STALENESS if args.max_staleness is None else args.max_staleness
    server_lr = AsyncPolicy.server_lr if args.async_server_lr is None else args.async_server_lr
    return AsyncPolicy(args.buffer, staleness, server_lr)


def round_policy(args: argparse.Namespace) -> RoundPolicy:
    """When rounds close (quorum, minimum, deadline, participation) and how many updates share one fsync."""
    return RoundPolicy(
        args.rounds,
        args.min_devices,
        args.quorum,
        args.round_timeout,
        participation=args.participation,
        batch=args.spool_batch,
    )


def server_settings(args: argparse.Namespace, default_fleet: str) -> ServerSettings:
    """ServerSettings from parsed arguments."""
    fleet = wire.given_identifier("fleet", args.fleet or default_fleet)
    recipe_options, strategy_options = chosen_options(args)
    run_dir = args.run_dir or Path("runs") / f"{time.strftime('%Y%m%d-%H%M%S')}-{fleet}-{args.strategy}"
    spec_file = load_model_spec(args.model_spec) if args.model_spec else SpecFile(DEFAULT_SPEC)
    return ServerSettings(
        run_dir=run_dir,
        fleet=fleet,
        strategy=args.strategy,
        recipe=recipe_from(args, recipe_options),
        policy=round_policy(args),
        init=InitSettings(
            args.init_samples, args.init_epochs, args.init_lr, optimizer=args.init_optimizer, seed=args.seed
        ),
        validation_samples=args.validation_samples,
        selection_passes=args.selection_passes,
        test_samples=args.test_samples,
        evaluate_devices=not args.no_device_eval,
        data_dir=args.data_dir,
        dataset=args.dataset,
        spec=spec_file.spec,
        initial_weights=spec_file.initial_weights,
        torch_threads=args.torch_threads,
        strategy_options=strategy_options,
        suspects=SuspectPolicy(threshold=args.suspect_threshold, exclude=args.exclude_suspects),
        ship_bundles=not args.no_bundles,
        encoder_path=args.encoder,
        keep_updates=args.keep_updates,
        broker_max_packet_bytes=given_packet_limit(args.max_message_bytes),
        transfer_memory_mb=args.transfer_memory_mb,
        transfer_timeout=args.transfer_timeout,
        asynchronous=async_policy(args),
        seed_labels=getattr(args, "seed_labels", None),
        max_sample_share=args.max_sample_share,
        relays=tuple(wire.given_identifier("--relay", name) for name in getattr(args, "relay", [])),
        dp=DpSettings(args.dp_delta, args.dp_epsilon_budget),
        promotion=PromotionGate(
            args.promotion_tolerance,
            args.promotion_max_class_drop,
            args.promotion_confidence,
            args.promotion_field_images,
            args.field_test_window,
        ),
        publish_predictions=args.publish_predictions,
        secagg_open_fleet_unsafe=getattr(args, "secagg_open_fleet_unsafe", False),
    )


def validate_recipe_names(settings: ServerSettings) -> None:
    """Fails fast, before any process starts, on a sampler, rule, strategy or update encoding nobody knows, a bad
    method parameter, a strategy that weighs updates by a metric the local rule does not report, or a spec whose
    pretrained weights are not installed."""
    check_pretrained_installed(settings.spec)
    make_sampler(settings.recipe.sampler)
    rule = make_local_rule(settings.recipe.local_rule)
    strategy = make_strategy(settings.strategy, **settings.strategy_options)
    check_recipe_options(settings.recipe.sampler, settings.recipe.local_rule, settings.recipe.options)
    missing = sorted(set(strategy.required_metrics) - set(rule.reported_metrics))
    if missing:
        fitting = LOCAL_RULES.select(lambda known: set(missing) <= set(known.reported_metrics))
        raise UsageError(
            f"strategy {strategy.name!r} weighs updates by {', '.join(missing)}, which local rule "
            f"{rule.name!r} does not report; use --local-rule {' or '.join(sorted(fitting))}"
        )
    UpdateCodec.of(settings.recipe)
    if settings.encoder_path is not None:
        load_encoder(settings.encoder_path, settings.spec)
