"""Finds the Swift toolchain on the host: $SWIFT_HOME first, then swiftc on PATH.

When none is found the repository still loads, so `bazel query //...` works, but every Swift
compile fails with MISSING_MESSAGE (the same text ./bazelw prints).
"""

def _missing_message(looked_in):
    return (
        "museflash: no Swift toolchain found (looked for swiftc in: " + ", ".join(looked_in) + "). " +
        "Fix: install the Swift 6 toolchain for Linux and put its usr/bin on PATH, or set SWIFT_HOME " +
        "to the toolchain root (the directory that contains usr/bin/swiftc)."
    )

# What -target-cpu haswell lets the compiler use, as /proc/cpuinfo spells it (LZCNT is "abm").
_HASWELL_FLAGS = ["avx", "avx2", "fma", "f16c", "bmi1", "bmi2", "movbe", "abm", "popcnt"]

def _host_cpu_copts(rctx):
    """Flags for the hot Swift modules on this machine: Haswell's instruction set (AVX2, FMA,
    F16C) when the host has all of it, else none (the portable x86-64 baseline). Bazel runs
    what it builds on the host; an x86-64 CPU without these gets a build that runs everywhere."""
    if rctx.os.name.lower().find("linux") < 0:
        return []
    machine = rctx.execute(["uname", "-m"])
    if machine.return_code != 0 or machine.stdout.strip() != "x86_64":
        return []
    cpuinfo = rctx.execute(["cat", "/proc/cpuinfo"])
    if cpuinfo.return_code != 0:
        return []
    flags = []
    for line in cpuinfo.stdout.split("\n"):
        if line.startswith("flags"):
            flags = line.split(":", 1)[1].split(" ")
            break
    for flag in _HASWELL_FLAGS:
        if flag not in flags:
            return []
    return ["-target-cpu", "haswell", "-DMILINTERPRETER_HASWELL"]

def _swift_toolchain_repo_impl(rctx):
    looked_in = []
    swiftc = None
    swift_home = rctx.os.environ.get("SWIFT_HOME", "")
    if swift_home:
        for candidate in [swift_home + "/usr/bin/swiftc", swift_home + "/bin/swiftc"]:
            looked_in.append(candidate)
            if rctx.path(candidate).exists:
                swiftc = rctx.path(candidate)
                break
    if swiftc == None:
        looked_in.append("PATH")
        swiftc = rctx.which("swiftc")

    version = ""
    if swiftc != None:
        probe = rctx.execute([swiftc, "--version"])
        if probe.return_code == 0:
            version = (probe.stdout + probe.stderr).strip().split("\n")[0]
        else:
            swiftc = None

    rctx.file("BUILD.bazel", "exports_files(['defs.bzl'])\n")
    host_cpu_copts = _host_cpu_copts(rctx)
    rctx.file("defs.bzl", "\n".join([
        "SWIFTC = %r" % (str(swiftc) if swiftc else ""),
        "SWIFT_VERSION = %r" % version,
        "SWIFT_MISSING_MESSAGE = %r" % _missing_message(looked_in),
        "HOST_CPU_COPTS = %r" % host_cpu_copts,
        "",
    ]))

swift_toolchain_repo = repository_rule(
    implementation = _swift_toolchain_repo_impl,
    environ = ["SWIFT_HOME", "PATH"],
    local = True,
)
