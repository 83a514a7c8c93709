"""The ``turnbus`` command."""

from __future__ import annotations

import argparse


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="turnbus", description="Durable agent turns over Redis.")
    parser.add_subparsers(dest="command", required=True)
    parser.parse_args(argv)
    return 0
