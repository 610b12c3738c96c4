"""The runtime's user-facing choices and defaults, in a module that imports nothing heavy: the
`generate` command line defines its flags from these and answers --help without loading torch.
The modules that act on them (generate, chat, speculative) import them from here."""

# generate's --backend: the exported packages (numpy interpreter), or the eager torch modules.
BACKENDS = ("export", "eager")

# What a chat does when its history outgrows the context (generate's --on-context-full).
REFUSE = "refuse"
DROP_OLDEST = "drop-oldest"
CONTEXT_POLICIES = (REFUSE, DROP_OLDEST)

# A step copies from the context when its last DEFAULT_LOOKUP_MIN_MATCH tokens occurred before;
# chosen by //:demo_figures (docs/benchmarks.md). The Swift engine's GenerationOptions default
# is the same number (checked by tests/runtime's goldens).
DEFAULT_LOOKUP_MIN_MATCH = 2
