"""museflash_export: runs the Python exporter as a build action; the bundle is a tree artifact.

Tests that read the bundle depend on this target, so a change to the exporter, the models or
the demo checkpoint re-exports and re-checks; nothing is exported by hand.

museflash_export_output: one of the bundles a museflash_export writes with `also_export`
(the exporter's --also-export: more compressions from the same conversion), as a target of
its own.
"""

def _museflash_export_impl(ctx):
    bundle = ctx.actions.declare_directory(ctx.label.name)
    also = {preset: ctx.actions.declare_directory(name) for preset, name in ctx.attr.also_export.items()}
    # One conversion process: Bazel already runs an action per core, and a second process only
    # adds its own imports (tiny-llama: 26.3 s of CPU in one process, 31.5 s in two; docs/ci.md).
    processes = [] if [a for a in ctx.attr.export_args if a.startswith("--conversion-processes")] else ["--conversion-processes=1"]
    # coremltools prints progress bars for every pass; show them only when the export fails
    # (--verbose: this action keeps the whole output in its own log instead of the exporter).
    ctx.actions.run_shell(
        command = 'log="$(mktemp)"; "$@" >"$log" 2>&1 || { status=$?; cat "$log" >&2; exit $status; }',
        arguments = [ctx.executable.exporter.path, "--output-dir=" + bundle.path, "--overwrite", "--verbose"] +
                    processes + [ctx.expand_location(arg, ctx.attr.data) for arg in ctx.attr.export_args] +
                    ["--also-export=%s=%s" % (preset, directory.path) for preset, directory in also.items()],
        inputs = ctx.files.data,
        tools = [ctx.attr.exporter[DefaultInfo].files_to_run],
        outputs = [bundle] + also.values(),
        mnemonic = "MuseflashExport",
        progress_message = "Exporting %s to Core ML" % ctx.label,
        # torch and coremltools look for a writable home for their caches. One math thread:
        # Bazel runs an action per core already (the same setting as tests, .bazelrc).
        env = {
            "HOME": "/tmp",
            "MKL_NUM_THREADS": "1",
            "OMP_NUM_THREADS": "1",
            "OPENBLAS_NUM_THREADS": "1",
            "PYTHONDONTWRITEBYTECODE": "1",
        },
    )
    return [
        DefaultInfo(files = depset([bundle]), runfiles = ctx.runfiles(files = [bundle])),
        OutputGroupInfo(**{name: depset([also[preset]]) for preset, name in ctx.attr.also_export.items()}),
    ]

museflash_export = rule(
    implementation = _museflash_export_impl,
    attrs = {
        "exporter": attr.label(
            default = "//:export",
            executable = True,
            cfg = "exec",
        ),
        "export_args": attr.string_list(
            doc = "Flags for the exporter, e.g. --fused-target; $(location X) names a file of `data`.",
        ),
        "also_export": attr.string_dict(
            doc = "Compression preset -> the name of another bundle this export writes with it " +
                  "(--also-export); a museflash_export_output of that name makes it a target.",
        ),
        "data": attr.label_list(
            allow_files = True,
            doc = "Files the flags name (e.g. --compression-config=$(location rules.json)); inputs of the export.",
        ),
    },
)

def _museflash_export_output_impl(ctx):
    bundle = getattr(ctx.attr.export[OutputGroupInfo], ctx.label.name).to_list()
    return [DefaultInfo(files = depset(bundle), runfiles = ctx.runfiles(files = bundle))]

museflash_export_output = rule(
    implementation = _museflash_export_output_impl,
    doc = "The bundle named like this target that `export` writes by its also_export.",
    attrs = {
        "export": attr.label(
            mandatory = True,
            providers = [OutputGroupInfo],
            doc = "The museflash_export whose also_export names this target.",
        ),
    },
)
