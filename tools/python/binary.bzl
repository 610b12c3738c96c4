"""museflash_tool: a command line from python/museflash/cli/ (or any module), runnable with
`./bazelw run //:NAME -- FLAGS`; `args` presets flags."""

def museflash_tool(name, main, args = [], **kwargs):
    script = "//python:museflash/" + main
    native.py_binary(
        name = name,
        srcs = [script],
        main = script,
        args = args,
        python_version = "PY3",
        deps = ["//python:museflash"],
        **kwargs
    )
