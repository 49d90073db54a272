"""The `pagoda` command. Each subcommand lives in its own module and registers itself here."""

from __future__ import annotations

import argparse
import importlib
import sys

# module -> it defines `register(subparsers)`, which adds its subcommand(s) with set_defaults(func=handler).
_SUBCOMMAND_MODULES = (
    "pagoda.entrypoints.serve_cli",  # serve, generate, chat
    "pagoda.entrypoints.quantize_cli",  # quantize
    "pagoda.bench.cli",  # bench offline / serve / sweep
    "pagoda.router.cli",  # router, launch
    "pagoda.entrypoints.info_cli",  # info
)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="pagoda", description="pagoda: a small, fast LLM inference and serving engine."
    )
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name in _SUBCOMMAND_MODULES:
        importlib.import_module(name).register(subparsers)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
