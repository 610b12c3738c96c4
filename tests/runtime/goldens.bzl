"""runtime_goldens: the reference decoding loop's golden JSON for one exported bundle, made by
//tests/runtime:runtime_goldens_tool (python/museflash/cli/runtime_goldens_main.py) as a build
action, so the Swift engine and interpreter tests read files made from exactly that bundle."""

def runtime_goldens(name, bundle, args = [], visibility = None):
    """Writes NAME.json from `bundle` (a museflash_export target); `args` are extra tool flags."""
    native.genrule(
        name = name,
        srcs = [bundle],
        outs = [name + ".json"],
        # One BLAS thread: the goldens are bitwise only at the thread count they were made with
        # (the test runs with the same), and the interpreter's small matmuls are faster so.
        # The tool's output (coremltools' warnings, the per-case lines) is shown on failure only.
        cmd = " ".join([
            'log="$$(mktemp)";',
            "HOME=/tmp PYTHONDONTWRITEBYTECODE=1 OPENBLAS_NUM_THREADS=1 OMP_NUM_THREADS=1 MKL_NUM_THREADS=1",
            "$(location :runtime_goldens_tool)",
            "--export-dir=$(location %s)" % bundle,
            "--output=$@",
        ] + args + [
            '>"$$log" 2>&1 || { status=$$?; cat "$$log" >&2; exit $$status; }',
        ]),
        tools = [":runtime_goldens_tool"],
        message = "Making the runtime goldens of %s" % bundle,
        visibility = visibility,
    )
