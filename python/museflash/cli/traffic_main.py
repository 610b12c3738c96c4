"""museflash traffic: the first-order bytes each function of a bundle moves per call, by part
(state-sized ops, weights, the rest), against the floor (docs/traffic.md). A model, counted from
the saved program's types, not a device measurement.

  ./bazelw run //:traffic -- --export-dir DIR [--function main]
  ./bazelw run //:traffic -- --geometry-context 1024,4096 [--layers 4] [--function main]
      [--kv-write blend|slice]

The second form exports the 52-layer test geometry (synthetic weights, deleted afterwards) at
each context; with --layers it exports that depth and one [S,S,S,G] group more, and carries
every figure linearly to 52 layers.
Relative paths resolve against the directory Bazel was run from.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

from absl import flags, logging

from museflash.cli.command import run_command
from museflash.paths import resolve_user_path

flags.DEFINE_string("export-dir", None, "Export directory (holds metadata.json).")
flags.DEFINE_string("function", None, "Only this function (default: every function).")
flags.DEFINE_list("geometry-context", None,
                  "Instead of --export-dir: export the 52-layer geometry at these contexts "
                  "(multiples of 32, e.g. 1024,4096,16384,32768) and count it.")
flags.DEFINE_integer("layers", None,
                     "Geometry mode: export this many layers (a multiple of 4) and one group "
                     "more, then extrapolate linearly to 52 (default: all 52).")
flags.DEFINE_string("kv-write", "blend",
                    "Geometry mode: how the export writes the global caches (blend or slice, as "
                    "the export's --kv-write; docs/kv-write.md).")
flags.DEFINE_string("work-dir", None,
                    "Geometry mode: where the synthetic checkpoints and bundles are written "
                    "(default: the system's temporary directory).")

FLAGS = flags.FLAGS


def _error(message: str) -> int:
    print(f"traffic: error: {message}", file=sys.stderr)
    return 2


def _contexts(values: list[str]) -> list[int] | None:
    try:
        return [int(v) for v in values]
    except ValueError:
        return None


def main(argv: list[str]) -> int:
    if len(argv) > 1:
        return _error(f"unexpected arguments {argv[1:]}; all options are --flags")
    export_dir = FLAGS["export-dir"].value
    contexts = FLAGS["geometry-context"].value
    if (export_dir is None) == (contexts is None):
        return _error("give exactly one of --export-dir DIR (a bundle) or --geometry-context "
                      "N[,N...] (the 52-layer geometry exported at context N)")
    if contexts is not None and (not contexts or _contexts(contexts) is None):
        return _error(f"--geometry-context {','.join(contexts)} must be whole numbers, e.g. "
                      "1024,4096")
    if FLAGS["kv-write"].present and contexts is None:
        return _error("--kv-write is for the geometry mode (an export's strategy is in its "
                      "metadata.json); add --geometry-context N, or drop --kv-write")
    if FLAGS.layers is not None and contexts is None:
        return _error("--layers is for the geometry mode; add --geometry-context N, or drop "
                      "--layers")
    logging.set_verbosity(logging.ERROR)
    from museflash.export.options import ExportError
    from museflash.tools import traffic

    try:
        if export_dir is not None:
            path = resolve_user_path(export_dir)
            summaries = [f.summary() for f in traffic.bundle_traffic(path, FLAGS.function)]
            lines = traffic.format_report(
                summaries, f"traffic of {path} (first-order model, docs/traffic.md)")
        else:
            lines = _geometry(_contexts(contexts), traffic)
    except (traffic.TrafficError, ExportError) as error:
        return _error(str(error))
    print("\n".join(lines))
    return 0


def _geometry(contexts: list[int], traffic) -> list[str]:
    from museflash.export.progress import quiet_console

    work_dir = resolve_user_path(FLAGS["work-dir"].value)
    if work_dir is not None and not work_dir.is_dir():
        raise traffic.TrafficError(f"--work-dir {work_dir} is not a directory; create it or "
                                   "leave the flag out")
    # The export's progress lines go to stderr; coremltools' own output is dropped.
    def echo(line: str) -> None:
        os.write(saved, (line + "\n").encode())

    saved = os.dup(2)
    try:
        with quiet_console(Path(os.devnull)):
            counted = traffic.geometry_report(contexts, FLAGS.layers, FLAGS.function, work_dir,
                                              echo, FLAGS["kv-write"].value)
    finally:
        os.close(saved)
    lines = []
    for context, summaries in counted.items():
        lines += traffic.format_report(
            summaries, f"traffic of the 52-layer geometry at context {context}, --kv-write "
                       f"{FLAGS['kv-write'].value} (first-order model, docs/traffic.md)") + [""]
    return lines[:-1]


def run() -> None:
    run_command(main, "traffic")


if __name__ == "__main__":
    run()
