"""`python -m keras_attn.export check PATH`: the servability check."""

from __future__ import annotations

import argparse
import sys


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m keras_attn.export")
    commands = parser.add_subparsers(dest="command", required=True)
    check = commands.add_parser("check", help="check that TF Serving can serve PATH")
    check.add_argument(
        "path", help="an export's version directory, e.g. export/sentiment/1"
    )
    check.add_argument("--atol", type=float, default=1e-4)
    check.add_argument(
        "--example",
        action="append",
        metavar="TEXT",
        help="also send TEXT to every signature and print the TF Serving REST "
        "request and response (repeat for a batch)",
    )
    args = parser.parse_args(argv)
    from keras_attn.export.check import check_servable

    report = check_servable(args.path, atol=args.atol, examples=args.example)
    return 0 if report.ok else 1


if __name__ == "__main__":
    sys.exit(main())
