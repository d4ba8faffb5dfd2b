# `fl-coordinator methods`: every registered method with its options, and the reference page's generated tables.
from __future__ import annotations

import argparse

from coordinator.commands.method_flags import method_kinds, options_table
from coordinator.commands.recipe_options import recipe_table


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Plain text, or one of docs/reference.md's markdown tables."""
    parser.add_argument(
        "--markdown", action="store_true", help="docs/reference.md's method-options table (default: plain text)"
    )
    parser.add_argument("--recipe-markdown", action="store_true", help="docs/reference.md's recipe-flags table")
    parser.add_argument("--log-level", default="warning")


def run(args: argparse.Namespace) -> int:
    """Prints every registered method with its options: the reference page's markdown table, or plain lines."""
    if args.recipe_markdown:
        print(recipe_table())
        return 0
    if args.markdown:
        print(options_table())
        return 0
    for kind in method_kinds():
        for name, method in kind.registry.items():
            flags = ", ".join(
                f"{o.cli_flag} {o.kind.__name__} = {o.default:g} ({o.range_text})" for o in method.options
            )
            print(f"{kind.label:<11} {name:<17} {method.summary}" + (f"  [{flags}]" if flags else ""))
    return 0
