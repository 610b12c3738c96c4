"""A command line of museflash.cli run in the test's process, as `run_command` runs it: its absl
flags parsed from the arguments (`--no-flag` spelled as absl's `--noflag`), then its `main` on
what is left. The flags are reset afterwards, whatever happened, so the next test starts from
their defaults."""

from absl import flags

from museflash.cli.command import dashed_negations


def run_main(main, *args: str) -> int:
    remaining = flags.FLAGS(dashed_negations(["command", *args]))
    try:
        return main(remaining)
    finally:
        flags.FLAGS.unparse_flags()
