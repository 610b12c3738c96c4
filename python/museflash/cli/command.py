"""How every command line of this package runs.

A command is a `<name>_main.py` module of this package: its absl flags, defined once when it is
imported and spelled as users type them (`--flag=value` or `--flag value`; a boolean `--flag`,
`--noflag` or `--no-flag`), a `main(argv) -> exit status`, and `run()`, which calls
`run_command`. That is absl's `app.run` with two differences: a flag that cannot be parsed
(unknown, or a value of the wrong type) is one line on stderr, `NAME: error: ...; see --help`,
and exit status 2, like every other unusable input of these commands; and a boolean `flag` is
also turned off by `--no-flag`, beside absl's `--noflag`. Help (`--help`, `--helpfull`) is
absl's.
"""

from __future__ import annotations

import sys
from collections.abc import Callable

from absl import app, flags

USAGE_ERROR = 2


def dashed_negations(argv: list[str]) -> list[str]:
    """`argv` with each `--no-NAME` of a boolean flag NAME spelled absl's way, `--noNAME`."""
    spelled = list(argv[:1])
    for index, arg in enumerate(argv[1:], start=1):
        if arg == "--":
            return spelled + argv[index:]
        name = arg[len("--no-"):] if arg.startswith("--no-") else None
        if (name and name in flags.FLAGS and arg[2:] not in flags.FLAGS
                and isinstance(flags.FLAGS[name], flags.BooleanFlag)):
            arg = "--no" + name
        spelled.append(arg)
    return spelled


def parse_flags(argv: list[str], name: str) -> list[str]:
    """absl's FLAGS parsed from `argv`; returns the arguments left over (the program first)."""
    try:
        return flags.FLAGS(dashed_negations(argv))
    except flags.Error as error:
        print(f"{name}: error: {str(error).rstrip('.')}; see --help", file=sys.stderr)
        sys.exit(USAGE_ERROR)


def run_command(main: Callable[[list[str]], int], name: str) -> None:
    """app.run(main), its flags parsed by `parse_flags`."""
    app.run(main, flags_parser=lambda argv: parse_flags(argv, name))
