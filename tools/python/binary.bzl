"""museflash_tool: a command line of python/museflash/cli/ (every entry point lives there),
runnable with `./bazelw run //:NAME -- FLAGS`; `main` is the file name in cli/, `args` presets
flags."""

def museflash_tool(name, main, args = [], **kwargs):
    script = "//python:museflash/cli/" + main
    native.py_binary(
        name = name,
        srcs = [script],
        main = script,
        args = args,
        python_version = "PY3",
        deps = ["//python:museflash"],
        **kwargs
    )
