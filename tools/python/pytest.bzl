"""pytest_test: a py_test whose sources are plain pytest files, one Bazel target per call."""

def pytest_test(name, srcs, deps = [], data = [], args = [], **kwargs):
    # Export tests convert real models; on a busy 2-core machine they exceed the default
    # 300 s, so every pytest target gets Bazel's long timeout unless it asks otherwise.
    if "timeout" not in kwargs and "size" not in kwargs:
        kwargs["timeout"] = "long"
    native.py_test(
        name = name,
        srcs = srcs + ["//tools/python:pytest_runner.py"],
        main = "//tools/python:pytest_runner.py",
        args = ["$(rootpath %s)" % src for src in srcs] + args,
        deps = deps,
        data = data,
        python_version = "PY3",
        srcs_version = "PY3",
        **kwargs
    )

def pytest_test_per_file(srcs, deps_by_file = {}, deps = [], **kwargs):
    """One pytest_test per test_*.py file, named after the file; its deps are
    `deps_by_file[file]` when the file is there, `deps` otherwise."""
    for src in srcs:
        pytest_test(name = src[:-len(".py")], srcs = [src], deps = deps_by_file.get(src, deps), **kwargs)
