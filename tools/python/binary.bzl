"""museflash_tool: a command line of python/museflash/cli/ (every entry point lives there),
runnable with `./bazelw run //:NAME -- FLAGS`; `main` is the file name in cli/, `args` presets
flags; `deps` are the libraries of //python it imports (by default all of them)."""

def museflash_tool(name, main, args = [], deps = ["//python:museflash"], **kwargs):
    script = "//python:museflash/cli/" + main
    native.py_binary(
        name = name,
        srcs = [script],
        main = script,
        args = args,
        python_version = "PY3",
        deps = deps,
        **kwargs
    )
