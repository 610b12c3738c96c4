"""Small Swift rules that call the host swiftc (found by //tools/swift:toolchain.bzl).

swift_library emits a static library plus its .swiftmodule; dependents find the module with -I
and link the archives in topological order.

swift_test compiles `srcs` to a module, has swiftc emit its symbol graph (output group
`symbol_graph`), and links a main.swift that calls XCTMain with every test in it, written by
//tools/swift:xctest_discovery.swift: each `test*` instance method taking no arguments and
returning Void on a subclass of XCTestCase (directly or through classes of the same module),
including methods in extensions and inherited ones. A test it cannot call (private, or on a class
whose superclass is in another module) or a module without tests fails the build rather than
being skipped. `env` values expand $(rootpath) of `data`.

swift_run_test runs a swift_test already compiled elsewhere with data and env of its own, so one
test module is compiled and linked once and run over many bundles, each its own Bazel test; its
`args` (Bazel's own attribute) can name the XCTest classes to run, e.g. `["Module.Class"]`.
"""

load("@museflash_swift//:defs.bzl", "SWIFTC", "SWIFT_MISSING_MESSAGE")

SwiftModuleInfo = provider(
    doc = "A compiled Swift module and everything needed to link against it.",
    fields = {
        "modules": "depset of .swiftmodule files of this module and its dependencies",
        "archives": "depset (topological) of static archives to link",
    },
)

_COMMON_FLAGS = ["-swift-version", "5", "-g", "-Onone"]

def _testing_flags(ctx):
    # -enable-testing lets `@testable import` reach internal declarations; it also keeps the
    # optimiser from treating them as private, so hot libraries turn it off (`testable = False`).
    return ["-enable-testing"] if getattr(ctx.attr, "testable", True) else []

def _module_name(ctx):
    return ctx.attr.module_name or ctx.label.name

def _collect(infos):
    modules = depset(transitive = [i.modules for i in infos])
    archives = depset(order = "topological", transitive = [i.archives for i in infos])
    return modules, archives

def _run_swiftc(ctx, inputs, outputs, arguments, mnemonic, progress):
    # The guard runs inside the action so a missing toolchain fails the build with the wrapper's
    # message instead of silently skipping Swift targets.
    script = """
set -eu
if [ -z "{swiftc}" ] || [ ! -x "{swiftc}" ]; then
  echo {message} >&2
  exit 1
fi
cache="$(mktemp -d)"
trap 'rm -rf "$cache"' EXIT
"{swiftc}" -module-cache-path "$cache" "$@"
""".format(swiftc = SWIFTC, message = _shell_quote(SWIFT_MISSING_MESSAGE))
    ctx.actions.run_shell(
        inputs = inputs,
        outputs = outputs,
        command = script,
        arguments = arguments,
        mnemonic = mnemonic,
        progress_message = progress,
        use_default_shell_env = False,
        env = {"HOME": "/tmp", "PATH": "/usr/bin:/bin"},
    )

def _shell_quote(text):
    return "'" + text.replace("'", "'\\''") + "'"

def _include_flags(modules):
    dirs = {}
    for module in modules.to_list():
        dirs[module.dirname] = True
    flags = []
    for directory in dirs.keys():
        flags.extend(["-I", directory])
    return flags

def _compile_module(ctx, name, prefix = "", symbol_graph = None):
    """Compiles srcs to lib<name>.a and <name>.swiftmodule under prefix; returns both and the info.

    symbol_graph: a declared directory that receives <name>.symbols.json, every access level.
    """
    archive = ctx.actions.declare_file(prefix + "lib%s.a" % name)
    module = ctx.actions.declare_file(prefix + "%s.swiftmodule" % name)
    deps = [d[SwiftModuleInfo] for d in ctx.attr.deps]
    modules, archives = _collect(deps)
    outputs = [archive, module]
    args = ["-parse-as-library", "-emit-library", "-static", "-emit-module"]
    args += ["-module-name", name, "-o", archive.path, "-emit-module-path", module.path]
    if symbol_graph:
        outputs.append(symbol_graph)
        args += ["-emit-symbol-graph", "-emit-symbol-graph-dir", symbol_graph.path]
        args += ["-symbol-graph-minimum-access-level", "private"]
    args += _COMMON_FLAGS + _testing_flags(ctx) + _include_flags(modules) + ctx.attr.copts
    args += [f.path for f in ctx.files.srcs]
    _run_swiftc(
        ctx,
        inputs = depset(ctx.files.srcs, transitive = [modules]),
        outputs = outputs,
        arguments = args,
        mnemonic = "SwiftCompile",
        progress = "Compiling Swift module %s" % name,
    )
    return [archive, module], SwiftModuleInfo(
        modules = depset([module], transitive = [modules]),
        archives = depset([archive], order = "topological", transitive = [archives]),
    )

def _swift_library_impl(ctx):
    files, info = _compile_module(ctx, _module_name(ctx))
    return [DefaultInfo(files = depset(files)), info]

def _link_executable(ctx, srcs, name, linked = []):
    """Compiles srcs as the main module `name` and links it with deps and `linked` modules."""
    executable = ctx.actions.declare_file(ctx.label.name)
    modules, archives = _collect(linked + [d[SwiftModuleInfo] for d in ctx.attr.deps])
    args = ["-module-name", name, "-o", executable.path] + _COMMON_FLAGS + _testing_flags(ctx)
    args += _include_flags(modules) + ctx.attr.copts
    args += [f.path for f in srcs]
    args += [a.path for a in archives.to_list()]
    _run_swiftc(
        ctx,
        inputs = depset(srcs, transitive = [modules, archives]),
        outputs = [executable],
        arguments = args,
        mnemonic = "SwiftLink",
        progress = "Linking Swift executable %s" % ctx.label.name,
    )
    runfiles = ctx.runfiles(files = ctx.files.data)
    for target in ctx.attr.data:
        runfiles = runfiles.merge(target[DefaultInfo].default_runfiles)
    return executable, runfiles

def _swift_binary_impl(ctx):
    executable, runfiles = _link_executable(ctx, ctx.files.srcs, _module_name(ctx))
    return [DefaultInfo(executable = executable, runfiles = runfiles)]

def _swift_test_impl(ctx):
    name = _module_name(ctx)
    scratch = ctx.label.name + ".xctest/"
    graph = ctx.actions.declare_directory(scratch + "symbol_graph")
    _, test_module = _compile_module(ctx, name, scratch, symbol_graph = graph)
    main = ctx.actions.declare_file(scratch + "main.swift")
    ctx.actions.run(
        executable = ctx.executable._xctest_discovery,
        arguments = [name, graph.path, main.path],
        inputs = [graph],
        outputs = [main],
        mnemonic = "SwiftTestDiscovery",
        progress_message = "Listing XCTest methods of %s from its symbol graph" % name,
    )
    executable, runfiles = _link_executable(ctx, [main], name + "_main", [test_module])
    env = {k: ctx.expand_location(v, ctx.attr.data) for k, v in ctx.attr.env.items()}
    return [
        DefaultInfo(executable = executable, runfiles = runfiles),
        testing.TestEnvironment(env),
        OutputGroupInfo(symbol_graph = depset([graph])),
    ]

_COMMON_ATTRS = {
    "srcs": attr.label_list(allow_files = [".swift"], mandatory = True),
    "deps": attr.label_list(providers = [SwiftModuleInfo]),
    "module_name": attr.string(doc = "Defaults to the target name."),
    "copts": attr.string_list(),
}

_RUNNABLE_ATTRS = dict(_COMMON_ATTRS, data = attr.label_list(allow_files = True))

swift_library = rule(
    implementation = _swift_library_impl,
    attrs = dict(
        _COMMON_ATTRS,
        testable = attr.bool(
            default = True,
            doc = "Compile with -enable-testing, so tests can `@testable import` the module.",
        ),
    ),
)

swift_binary = rule(
    implementation = _swift_binary_impl,
    attrs = _RUNNABLE_ATTRS,
    executable = True,
)

swift_test = rule(
    implementation = _swift_test_impl,
    attrs = dict(
        _RUNNABLE_ATTRS,
        env = attr.string_dict(doc = "Environment for the test run; values expand $(rootpath) of data."),
        _xctest_discovery = attr.label(
            default = Label("//tools/swift:xctest_discovery"),
            executable = True,
            cfg = "exec",
        ),
    ),
    test = True,
)

def _swift_run_test_impl(ctx):
    executable = ctx.actions.declare_file(ctx.label.name)
    ctx.actions.symlink(output = executable, target_file = ctx.executable.test, is_executable = True)
    runfiles = ctx.runfiles(files = ctx.files.data).merge(ctx.attr.test[DefaultInfo].default_runfiles)
    for target in ctx.attr.data:
        runfiles = runfiles.merge(target[DefaultInfo].default_runfiles)
    env = {k: ctx.expand_location(v, ctx.attr.data) for k, v in ctx.attr.env.items()}
    return [DefaultInfo(executable = executable, runfiles = runfiles), testing.TestEnvironment(env)]

swift_run_test = rule(
    implementation = _swift_run_test_impl,
    doc = "Runs the swift_test `test` (compiled once, usually tagged manual) with this data and env.",
    attrs = {
        "test": attr.label(
            mandatory = True,
            executable = True,
            cfg = "target",
            doc = "A swift_test target; its binary is linked here, not rebuilt.",
        ),
        "data": attr.label_list(allow_files = True),
        "env": attr.string_dict(doc = "Environment for the run; values expand $(rootpath) of data."),
    },
    test = True,
)
