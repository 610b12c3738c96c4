"""//:export with the graph from before the fp16 work (plain norms, no residual scaling), for
the tests that show what that graph does on planted massive activations (docs/fp16.md). Test
only: the exporter's own flags never give this graph."""

import dataclasses

from museflash.cli import export_main

_options_from_flags = export_main.options_from_flags


def _legacy_options():
    # The self-check would refuse this graph: publishing it is the point.
    return dataclasses.replace(_options_from_flags(), legacy_fp16=True, self_check=False)


export_main.options_from_flags = _legacy_options

if __name__ == "__main__":
    export_main.run()
