"""The symbol graph of a swift_test, without its executable or runfiles (see BUILD.bazel)."""

def _symbol_graph_impl(ctx):
    graph = ctx.attr.test[OutputGroupInfo].symbol_graph
    return [DefaultInfo(files = graph, runfiles = ctx.runfiles(transitive_files = graph))]

symbol_graph = rule(
    implementation = _symbol_graph_impl,
    attrs = {"test": attr.label(mandatory = True)},
)
