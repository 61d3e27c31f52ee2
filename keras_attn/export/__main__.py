"""`python -m keras_attn.export check PATH`: the servability check.

Exit status: 0 servable, 1 not servable, 3 not verified (some of the check
could not run in the runtime asked for; the report says what); 2 for usage
errors, as argparse.
"""

from __future__ import annotations

import argparse
import sys

EXIT_STATUS = {"SERVABLE": 0, "NOT SERVABLE": 1, "NOT VERIFIED": 3}


def main(argv=None) -> int:
    from keras_attn.export.releases import SERVING_RELEASES

    parser = argparse.ArgumentParser(prog="python -m keras_attn.export")
    commands = parser.add_subparsers(dest="command", required=True)
    check = commands.add_parser(
        "check",
        help="check that TF Serving can serve PATH",
        description="Check that TF Serving can serve an export. Exit status: "
        "0 servable, 1 not servable, 3 not verified (2: usage errors).",
    )
    check.add_argument(
        "path",
        help="an export's version directory (export/sentiment/1), or its model "
        "directory (export/sentiment: the highest version is checked)",
    )
    check.add_argument("--atol", type=float, default=1e-4)
    check.add_argument(
        "--example",
        action="append",
        metavar="TEXT",
        help="also send TEXT to every signature and print the TF Serving REST "
        "request and response (repeat for a batch)",
    )
    check.add_argument(
        "--serving-release",
        metavar="X.Y.Z",
        choices=[release.version for release in SERVING_RELEASES],
        help="check in the runtime of this TF Serving release: its TensorFlow "
        "and TensorFlow Text, in a virtual environment built on first use under "
        "the cache directory (a TensorFlow installation, from PyPI); one of "
        + ", ".join(release.version for release in SERVING_RELEASES),
    )
    args = parser.parse_args(argv)
    from keras_attn.export.check import check_servable, resolve_version_dir

    try:
        resolve_version_dir(args.path)
    except ValueError as error:
        check.error(str(error))
    report = check_servable(
        args.path,
        atol=args.atol,
        examples=args.example,
        serving_release=args.serving_release,
    )
    return EXIT_STATUS[report.status]


if __name__ == "__main__":
    sys.exit(main())
