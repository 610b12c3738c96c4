import CommandLineFlags
import Foundation
import ChatTemplate
import MuseflashRuntime

// swift-generate: speculative decoding over an exported bundle, in Swift.
//
//   swift-generate --export-dir DIR (--prompt TEXT | --prompt-file F | --prompt-ids 1,2,3)
//       [--max-new-tokens N] [--temperature T] [--top-p P] [--seed S] [--no-draft]
//       [--num-draft-tokens K] [--lookup-min-match N] [--tree-budget N | --no-tree]
//       [--backend interpreter|coreml]
//       [--compute-units cpu|gpu|ane|all] [--model-cache DIR | --no-model-cache]
//       [--format text|json] [--no-compare] [--profile-ops]
//   swift-generate --export-dir DIR --memory-probe [--backend ...] [--compute-units ...]
//   swift-generate --export-dir DIR (--messages FILE.json | --chat) [--system TEXT]
//       [--on-context-full refuse|drop-oldest] [--format text|json] [decoding flags above]
//
// With a drafter and none of --tree-budget, --no-tree or --num-draft-tokens, the engine chooses
// each step by what calls have cost so far and what drafts were accepted (StepPlanner): the
// target alone, the chain, or a tree as large as the bundle's tree function; it prints the
// steps it took and its figures. --tree-budget N forces a tree, --no-tree the chain.
//
// Chat (MuseflashRuntime ChatSession): the bundle's chat template renders the conversation and
// the caches live from turn to turn, so each turn prefills only what is new. --messages takes a
// JSON list of {"role", "content"}: each user message no assistant message follows gets a
// reply, in order. --chat reads one user message per line of standard input and streams each
// reply. JSON: `turns`, one object per reply (prompt_ids, tokens, prefilled_tokens,
// time_to_first_token_seconds, ...), and the final `messages`.
//
// Text: the continuation streamed as it is accepted (decoded text for a text prompt, ids for
// --prompt-ids), then the figures, and the drafter's speed-up against the target alone, timed in
// the same run (--no-compare skips that run; --compare adds it to JSON). JSON: one object. Bad input: one line on stderr and
// exit status 1. --memory-probe loads the target's and the drafter's functions (every context bucket's) one at a time and
// prints the resident memory after each as JSON (do per-function models share weights?
// coremltools#2351; tools/mac/first_run.sh reads it). --profile-ops (interpreter, JSON, one
// generation) adds op_ms_per_call: per function, the milliseconds per call spent in each op type. Relative paths resolve against $BUILD_WORKING_DIRECTORY (bazel run), else the
// current directory.

struct UsageError: Error, CustomStringConvertible {
    let description: String
}

struct Options {
    var exportDir = ""
    var promptIDs: [Int32] = []
    var promptText: String?
    var promptFile: String?
    var maxNewTokens = 64
    var useDrafter = true
    var numDraftTokens: Int?
    var lookupMinMatch = GenerationOptions.defaultLookupMinMatch
    /// Tree verification (docs/trees.md): nodes per tree call; 0 (--no-tree): the chain; nil:
    /// each step chosen by measured cost (StepPlanner), unless --num-draft-tokens forces the chain.
    var treeBudget: Int?
    /// Neither --tree-budget, --no-tree nor --num-draft-tokens: the engine chooses each step.
    var automatic: Bool { treeBudget == nil && numDraftTokens == nil }
    var backend = "interpreter"
    /// Core ML backend only: cpu, gpu, ane or all.
    var computeUnits = "all"
    /// Core ML backend only: where compiled models are kept (nil: the platform's caches folder).
    var modelCache: String?
    var noModelCache = false
    var memoryProbe = false
    var json = false
    var temperature = 0.0
    var topP = 1.0
    var seed: UInt64 = 0
    /// Time the target alone too; default: in text format only.
    var compare: Bool?
    var profileOps = false
    var messagesFile: String?
    var chat = false
    var system: String?
    var onContextFull = ContextPolicy.refuse
    var chatting: Bool { messagesFile != nil || chat }
}

let usage = "usage: swift-generate --export-dir DIR (--prompt TEXT | --prompt-file F | --prompt-ids 1,2,3) [--max-new-tokens N] [--temperature T] [--top-p P] [--seed S] [--no-draft] [--num-draft-tokens K] [--lookup-min-match N] [--tree-budget N | --no-tree] [--backend interpreter|coreml] [--compute-units cpu|gpu|ane|all] [--model-cache DIR | --no-model-cache] [--format text|json] [--compare | --no-compare] [--profile-ops] | --export-dir DIR (--messages FILE.json | --chat) [--system TEXT] [--on-context-full refuse|drop-oldest] [...] | --export-dir DIR --memory-probe [--backend ...]"

/// The flags as given (`--flag value` and `--flag=value` alike: CommandLineFlags), unchecked.
func readFlags(_ arguments: [String]) throws -> Options {
    var options = Options()
    var flags = CommandLineFlags(arguments, suffix: "; \(usage)")
    func value(_ flag: String) throws -> String { try flags.value(of: flag) }
    func integer(_ flag: String) throws -> Int { try flags.integer(of: flag) }
    func real(_ flag: String) throws -> Double { try flags.number(of: flag) }
    while var argument = try flags.next() {
        switch argument {
        case "--export-dir": options.exportDir = try value(argument)
        case "--prompt-ids":
            let text = try value(argument)
            let parts = text.split(separator: ",", omittingEmptySubsequences: false).map { $0.trimmingCharacters(in: .whitespaces) }
            guard !text.trimmingCharacters(in: .whitespaces).isEmpty else {
                throw UsageError(description: "--prompt-ids is empty; give at least one token id, e.g. --prompt-ids 1,2,3")
            }
            options.promptIDs = try parts.map { part in
                guard let id = Int32(part) else { throw UsageError(description: "--prompt-ids takes comma-separated integers, got \"\(part)\"") }
                return id
            }
        case "--prompt": options.promptText = try value(argument)
        case "--prompt-file": options.promptFile = try value(argument)
        case "--temperature": options.temperature = try real(argument)
        case "--top-p": options.topP = try real(argument)
        case "--seed":
            let text = try value(argument)
            guard let seed = UInt64(text) else { throw UsageError(description: "--seed takes a whole number >= 0, got \"\(text)\"") }
            options.seed = seed
        case "--no-compare": options.compare = false
        case "--compare": options.compare = true
        case "--max-new-tokens": options.maxNewTokens = try integer(argument)
        case "--num-draft-tokens": options.numDraftTokens = try integer(argument)
        case "--lookup-min-match": options.lookupMinMatch = try integer(argument)
        case "--tree-budget": options.treeBudget = try integer(argument)
        case "--no-tree": options.treeBudget = 0
        case "--no-draft": options.useDrafter = false
        case "--backend":
            options.backend = try value(argument)
            guard ["interpreter", "coreml"].contains(options.backend) else {
                throw UsageError(description: "--backend is interpreter or coreml, got \"\(options.backend)\"")
            }
        case "--compute-units":
            options.computeUnits = try value(argument)
            guard CoreMLBackend.computeUnits(named: options.computeUnits) != nil else {
                throw UsageError(description: "--compute-units is cpu, gpu, ane or all, got \"\(options.computeUnits)\"")
            }
        case "--model-cache": options.modelCache = try value(argument)
        case "--no-model-cache": options.noModelCache = true
        case "--memory-probe": options.memoryProbe = true
        case "--profile-ops": options.profileOps = true
        case "--messages": options.messagesFile = try value(argument)
        case "--chat": options.chat = true
        case "--system": options.system = try value(argument)
        case "--on-context-full":
            let policy = try value(argument)
            guard let parsed = ContextPolicy(rawValue: policy) else {
                throw UsageError(description: "--on-context-full is refuse or drop-oldest, got \"\(policy)\"")
            }
            options.onContextFull = parsed
        case "--format":
            let format = try value(argument)
            guard ["text", "json"].contains(format) else { throw UsageError(description: "--format is text or json, got \"\(format)\"") }
            options.json = format == "json"
        case "--help", "-h":
            print(usage)
            exit(0)
        default:
            argument = argument.isEmpty ? "\"\"" : argument
            throw UsageError(description: "unknown argument \(argument); \(usage)")
        }
    }
    return options
}

func parse(_ arguments: [String]) throws -> Options {
    let options: Options
    do {
        options = try readFlags(arguments)
    } catch let failure as CommandLineFlags.Failure {
        throw UsageError(description: failure.description)
    }
    guard !options.exportDir.isEmpty else { throw UsageError(description: "--export-dir is required; \(usage)") }
    let prompts = [!options.promptIDs.isEmpty, options.promptText != nil, options.promptFile != nil,
                   options.messagesFile != nil, options.chat].filter { $0 }.count
    guard prompts == 1 || (options.memoryProbe && prompts == 0) else {
        throw UsageError(description: "give exactly one of --prompt, --prompt-file, --prompt-ids, --messages and --chat; \(usage)")
    }
    if options.system != nil, !options.chatting {
        throw UsageError(description: "--system is the system prompt of --messages or --chat; \(usage)")
    }
    if options.chatting, options.profileOps || options.compare == true || options.memoryProbe {
        throw UsageError(description: "--messages and --chat decode a conversation; drop --profile-ops, --compare and --memory-probe")
    }
    if options.profileOps {
        guard options.backend == "interpreter" else {
            throw UsageError(description: "--profile-ops times the interpreter's ops; drop --backend coreml, or drop --profile-ops")
        }
        guard options.json, options.compare != true, !options.memoryProbe else {
            throw UsageError(description: "--profile-ops reports one generation in JSON; add --format json, and drop --compare and --memory-probe")
        }
    }
    guard options.maxNewTokens >= 1 else { throw UsageError(description: "--max-new-tokens must be at least 1, got \(options.maxNewTokens)") }
    guard options.temperature >= 0 else { throw UsageError(description: "--temperature must be >= 0, got \(options.temperature)") }
    guard options.topP > 0, options.topP <= 1 else { throw UsageError(description: "--top-p must be in (0, 1], got \(options.topP)") }
    return options
}

func resolve(_ path: String) -> URL {
    if path.hasPrefix("/") { return URL(fileURLWithPath: path) }
    let environment = ProcessInfo.processInfo.environment
    let base = environment["BUILD_WORKING_DIRECTORY"].flatMap { $0.isEmpty ? nil : $0 } ?? FileManager.default.currentDirectoryPath
    return URL(fileURLWithPath: base).appendingPathComponent(path)
}

func fail(_ message: String) -> Never {
    FileHandle.standardError.write(Data("swift-generate: error: \(message)\n".utf8))
    exit(1)
}

func write(_ text: String) {
    FileHandle.standardOutput.write(Data(text.utf8))
}

/// The process's peak resident set so far. Linux: VmHWM of /proc/self/status (getrusage's
/// ru_maxrss carries a parent's peak across exec); elsewhere getrusage (bytes on Darwin).
func peakResidentBytes() -> Int {
    #if os(Linux)
    let status = (try? String(contentsOfFile: "/proc/self/status", encoding: .utf8)) ?? ""
    for line in status.split(separator: "\n") where line.hasPrefix("VmHWM:") {
        return (Int(line.split(separator: " ").dropFirst().first ?? "") ?? 0) * 1024
    }
    return 0
    #else
    var usage = rusage()
    getrusage(RUSAGE_SELF, &usage)
    return Int(usage.ru_maxrss)
    #endif
}

func makeBackend(_ options: Options) throws -> any InferenceBackend {
    guard options.backend == "coreml" else {
        let backend = InterpreterBackend()
        backend.profileOps = options.profileOps
        return backend
    }
    return try CoreMLBackend(CoreMLBackend.Options(
        computeUnits: CoreMLBackend.computeUnits(named: options.computeUnits)!,
        cacheDirectory: options.noModelCache ? nil : options.modelCache.map(resolve) ?? CompiledModelCache.defaultDirectory))
}

/// The process's resident set now. Linux: VmRSS; Darwin: the task's resident size.
func residentBytes() -> Int {
    #if os(Linux)
    let status = (try? String(contentsOfFile: "/proc/self/status", encoding: .utf8)) ?? ""
    for line in status.split(separator: "\n") where line.hasPrefix("VmRSS:") {
        return (Int(line.split(separator: " ").dropFirst().first ?? "") ?? 0) * 1024
    }
    return 0
    #else
    var info = mach_task_basic_info()
    var count = mach_msg_type_number_t(MemoryLayout<mach_task_basic_info>.size / MemoryLayout<natural_t>.size)
    let result = withUnsafeMutablePointer(to: &info) {
        $0.withMemoryRebound(to: integer_t.self, capacity: Int(count)) {
            task_info(mach_task_self_, task_flavor_t(MACH_TASK_BASIC_INFO), $0, &count)
        }
    }
    return result == KERN_SUCCESS ? Int(info.resident_size) : 0
    #endif
}

/// --memory-probe: the functions of the bundle loaded one at a time (each its own model), the
/// resident set after each. If per-function models share a package's weights, loading the
/// second function of a package adds far less than its weight bytes.
func memoryProbe(bundle: MuseflashBundle, backend: any InferenceBackend) throws -> [String: Any] {
    var loaded: [any BackendFunction] = []
    var after: [[String: Any]] = []
    let before = residentBytes()
    // Every function of each asset's table: with context buckets, each bucket's (main_512, ...)
    // too, smallest first (coremltools#2351: memory may grow with each function loaded).
    let assets = bundle.metadata.assets
    var packages = [(try bundle.modelURL(of: .target), (assets[.target]?.functionTable ?? []).map(\.name))]
    if bundle.metadata.speculativeDecoding != nil, let drafter = try? bundle.modelURL(of: .dflashDrafter) {
        packages.append((drafter, (assets[.dflashDrafter]?.functionTable ?? []).map(\.name)))
    }
    for (url, functions) in packages {
        for function in functions {
            loaded.append(try backend.loadFunction(function, of: url))
            after.append(["function": function, "resident_bytes": residentBytes()])
        }
    }
    return ["backend": backend.name, "weight_bytes": bundle.weightFileBytes, "resident_bytes_before": before,
            "after_each_load": after, "functions_loaded": loaded.count]
}

/// Before anything is opened: the process's own cost, apart from the bundle.
let startupResidentBytes = peakResidentBytes()

#if os(Linux)
// glibc serves each large allocation with a fresh mmap and trims the heap after each large free,
// so every interpreter temporary of a MB or more (a layer taken out of its cache, the attention
// scores) costs page faults and zeroing, call after call. Keeping them in the heap costs no peak
// memory (measured: the same peak RSS) and about a quarter of a `main` call at 4K
// (docs/kv-write.md). Process-wide, so it is the CLI's choice, not the library's.
// mallopt is in <malloc.h>, which Swift's Glibc module leaves out: looked up by name. Its
// parameters' values are glibc's M_TRIM_THRESHOLD (-1) and M_MMAP_THRESHOLD (-3).
if let symbol = dlsym(UnsafeMutableRawPointer(bitPattern: 0), "mallopt") {
    let mallopt = unsafeBitCast(symbol, to: (@convention(c) (Int32, Int32) -> Int32).self)
    _ = mallopt(-3, 256 << 20)
    _ = mallopt(-1, 1 << 30)
}
#endif

func report(_ result: GenerationResult, options: Options, backend: String, bundle: MuseflashBundle,
            text: String?, alone: GenerationResult?) -> [String: Any] {
    var functions: [String: Any] = [:]
    for (name, stats) in result.functions {
        functions[name] = ["calls": stats.calls, "seconds": stats.seconds,
                           "ms_per_call": stats.calls == 0 ? 0 : 1000 * stats.seconds / Double(stats.calls)]
    }
    return [
        "step_times": stepTimes(result),
        "catch_up_seconds": result.catchUpSeconds,
        "prompt_ids": result.promptIDs.map(Int.init),
        "tokens": result.tokens.map(Int.init),
        "accepted": result.accepted,
        "lookup_min_match": options.lookupMinMatch,
        "lookup_steps": result.lookupSteps,
        "tree_budget": options.treeBudget ?? 0,
        "moved_rows": result.movedRows,
        "steps": result.steps,
        "automatic": result.plan != nil,
        "stop_reason": result.stopReason.rawValue,
        "num_draft_tokens": result.numDraftTokens,
        "calls": result.functions.mapValues { $0.calls },
        // Per Core ML function: which context bucket the calls ran in (docs/buckets.md).
        "ran_functions": result.ranFunctions,
        "functions": functions,
        "target_calls": result.targetCalls,
        "tokens_per_target_call": result.tokensPerTargetCall,
        "mean_accepted_length": result.meanAcceptedLength,
        "acceptance_rate": result.acceptanceRate,
        "seconds": result.seconds,
        "tokens_per_second": result.tokensPerSecond,
        "backend": backend,
        "drafter": options.useDrafter,
        "peak_rss_bytes": peakResidentBytes(),
        "startup_rss_bytes": startupResidentBytes,
        "weight_bytes": bundle.weightFileBytes,
        "state_bytes": bundle.stateBytes,
        "temperature": options.temperature,
        "top_p": options.topP,
        "seed": options.seed,
    ].merging(text.map { ["text": $0] } ?? [:]) { a, _ in a }
        .merging(result.plan.map { ["plan": $0, "expected_tokens_per_second": result.expectedTokensPerSecond] } ?? [:]) { a, _ in a }
        .merging(alone.map { ["target_alone_seconds": $0.seconds, "target_alone_tokens_per_second": $0.tokensPerSecond,
                              "speedup": $0.tokensPerSecond > 0 ? result.tokensPerSecond / $0.tokensPerSecond : 0] } ?? [:]) { a, _ in a }
}

/// The host's parts of a step kind, in milliseconds per step: those timed, then `other`, the
/// rest of the steps' time outside model calls.
func hostParts(_ result: GenerationResult, _ kind: String) -> [(String, Double)] {
    guard let stats = result.stepStats[kind], stats.steps > 0 else { return [] }
    let timed = (result.hostSeconds[kind] ?? [:]).sorted { $0.key < $1.key }
    let other = stats.hostSeconds - timed.reduce(0) { $0 + $1.value }
    return (timed + [("other", other)]).map { ($0.0, 1000 * $0.1 / Double(stats.steps)) }
}

/// Per step kind: steps, tokens, milliseconds per step whole, in model calls and on the host
/// (by part), and the tokens per second the steps delivered (JSON `step_times`).
func stepTimes(_ result: GenerationResult) -> [String: Any] {
    var times: [String: Any] = [:]
    for (kind, stats) in result.stepStats {
        let per = { (seconds: Double) in 1000 * seconds / Double(max(stats.steps, 1)) }
        times[kind] = ["steps": stats.steps, "tokens": stats.tokens, "ms_per_step": per(stats.seconds),
                       "call_ms_per_step": per(stats.callSeconds), "host_ms_per_step": per(stats.hostSeconds),
                       "tokens_per_second": stats.seconds > 0 ? Double(stats.tokens) / stats.seconds : 0,
                       "host_ms_per_step_by_part": Dictionary(uniqueKeysWithValues: hostParts(result, kind))] as [String: Any]
    }
    return times
}

func summary(_ result: GenerationResult, options: Options, backend: String, alone: GenerationResult?) -> String {
    var lines: [String] = []
    let stop = result.stopReason == .maxNewTokens ? "reached --max-new-tokens" : result.stopReason == .endOfSequence ? "end of sequence" : "context full"
    lines.append(String(format: "%d tokens in %.3f s (%.1f tokens/s, %@ backend), stopped: %@",
                        result.tokens.count, result.seconds, result.tokensPerSecond, backend, stop))
    if !result.accepted.isEmpty {
        lines.append(String(format: "%.2f tokens per target call (%d calls); accepted per step %.2f/%d (%.1f%%): %@",
                            result.tokensPerTargetCall, result.targetCalls, result.meanAcceptedLength, result.numDraftTokens,
                            100 * result.acceptanceRate, result.accepted.map(String.init).joined(separator: " ")))
        if result.lookupSteps > 0 {
            let copied = Double(result.lookupAccepted.reduce(0, +)) / Double(result.lookupSteps)
            lines.append(String(format: "%d of %d steps copied from the context (--lookup-min-match %d), accepting %.2f per step",
                                result.lookupSteps, result.accepted.count, options.lookupMinMatch, copied))
        }
    } else {
        lines.append(String(format: "%.2f tokens per target call (%d calls), target alone", result.tokensPerTargetCall, result.targetCalls))
    }
    if let plan = result.plan {
        let steps = ["tree", "chain", "alone"].compactMap { kind in result.steps[kind].map { "\(kind) \($0)" } }
        lines.append("steps chosen by measured cost (--tree-budget N or --no-tree forces one): " + steps.joined(separator: ", ")
                     + "; expected " + plan)
    }
    let timing = ["prefill", "main", "decode", "tree", "inject_kv", "draft"].compactMap { name -> String? in
        guard let stats = result.functions[name] else { return nil }
        return String(format: "%@ %d x %.2f ms", name, stats.calls, 1000 * stats.seconds / Double(max(stats.calls, 1)))
    }
    lines.append("time per call: " + timing.joined(separator: ", "))
    let steps = ["tree", "chain", "alone"].compactMap { kind -> String? in
        guard let stats = result.stepStats[kind], stats.steps > 0 else { return nil }
        let per = { (seconds: Double) in 1000 * seconds / Double(stats.steps) }
        let parts = hostParts(result, kind).map { String(format: "%@ %.2f", $0.0, $0.1) }.joined(separator: ", ")
        return String(format: "%@ %d x %.1f ms (model calls %.1f, host %.1f: %@; %.1f tokens/s)", kind, stats.steps,
                      per(stats.seconds), per(stats.callSeconds), per(stats.hostSeconds), parts,
                      stats.seconds > 0 ? Double(stats.tokens) / stats.seconds : 0)
    }
    if !steps.isEmpty { lines.append("time per step: " + steps.joined(separator: ", ")) }
    if let alone = alone {
        lines.append(String(format: "target alone, same prompt and settings: %d tokens in %.3f s (%.1f tokens/s); drafter speed-up %.2fx",
                            alone.tokens.count, alone.seconds, alone.tokensPerSecond,
                            alone.tokensPerSecond > 0 ? result.tokensPerSecond / alone.tokensPerSecond : 0))
    }
    return lines.joined(separator: "\n") + "\n"
}

/// --messages or --chat: a ChatSession over the bundle; replies stream as text (figures on
/// stderr), or one JSON object at the end.
func converse(bundle: MuseflashBundle, options: Options) throws {
    var script: [ChatMessage]?
    if let file = options.messagesFile {
        let url = resolve(file)
        guard let data = FileManager.default.contents(atPath: url.path) else { fail("--messages \(url.path) cannot be read") }
        script = try ChatMessage.conversation(fromJSON: data, source: "--messages \(url.path)")
    }
    let text = try BundleText(bundle: bundle)
    _ = try bundle.chatTemplate()  // a bundle without a usable template stops before loading
    let backend = try makeBackend(options)
    let decoder = try SpeculativeDecoder(bundle: bundle, backend: backend)
    let generation = GenerationOptions(maxNewTokens: options.maxNewTokens, useDrafter: options.useDrafter,
                                       numDraftTokens: options.numDraftTokens,
                                       sampling: try Sampling(temperature: options.temperature, topP: options.topP),
                                       seed: options.seed, lookupMinMatch: options.lookupMinMatch,
                                       treeBudget: options.treeBudget,
                                       automatic: options.automatic && options.useDrafter)
    let session = try ChatSession(decoder: decoder, text: text, options: generation, system: options.system,
                                  onContextFull: options.onContextFull)
    let show: ((String) -> Void)? = options.json ? nil : { write($0) }
    var turns: [ChatTurn] = []
    func finished(_ turn: ChatTurn) {
        turns.append(turn)
        if !options.json { write("\n") }
        let dropped = turn.droppedMessages > 0 ? String(format: "; dropped the %d oldest messages to fit the context", turn.droppedMessages) : ""
        FileHandle.standardError.write(Data(String(
            format: "[swift-generate] turn %d: %d history tokens, %d prefilled, %d new; first token after %.2f s, %.2f s in all, %.2f tokens per target call%@\n",
            turns.count, turn.promptIDs.count, turn.prefilledTokens, turn.tokens.count, turn.timeToFirstTokenSeconds,
            turn.seconds, turn.result.tokensPerTargetCall, dropped).utf8))
    }
    if let script {
        _ = try session.run(script: script, onText: show, onTurn: finished)
    } else {
        let interactive = isatty(0) != 0 && !options.json
        while true {
            if interactive { write("> ") }
            guard let line = readLine(strippingNewline: true) else { break }
            if line.trimmingCharacters(in: .whitespaces).isEmpty { continue }
            finished(try session.say(line, onText: show))
        }
    }
    if options.json {
        let body: [String: Any] = [
            "turns": turns.map { turn -> [String: Any] in [
                "prompt_ids": turn.promptIDs.map(Int.init), "tokens": turn.tokens.map(Int.init), "text": turn.text,
                "prefilled_tokens": turn.prefilledTokens, "time_to_first_token_seconds": turn.timeToFirstTokenSeconds,
                "seconds": turn.seconds, "accepted": turn.result.accepted, "target_calls": turn.result.targetCalls,
                "tokens_per_target_call": turn.result.tokensPerTargetCall, "verify_steps": turn.result.accepted.count,
                "mean_accepted_length": turn.result.meanAcceptedLength, "dropped_messages": turn.droppedMessages,
                "stop_reason": turn.result.stopReason.rawValue,
            ] },
            "messages": session.messages.map { ["role": $0.role, "content": $0.content] },
            "backend": backend.name, "drafter": options.useDrafter,
        ]
        let data = try JSONSerialization.data(withJSONObject: body, options: [.sortedKeys])
        write(String(decoding: data, as: UTF8.self) + "\n")
    }
}

let options: Options
do {
    options = try parse(Array(CommandLine.arguments.dropFirst()))
} catch {
    fail("\(error)")
}

do {
    let bundle = try MuseflashBundle.open(resolve(options.exportDir))
    if options.memoryProbe {
        let data = try JSONSerialization.data(withJSONObject: try memoryProbe(bundle: bundle, backend: try makeBackend(options)),
                                              options: [.sortedKeys])
        write(String(decoding: data, as: UTF8.self) + "\n")
        exit(0)
    }
    if options.chatting {
        try converse(bundle: bundle, options: options)
        exit(0)
    }
    var text: BundleText?
    var prompt = options.promptIDs
    var promptText = options.promptText
    if let file = options.promptFile {
        // The file's bytes as written (no newline stripped), as UTF-8.
        let url = resolve(file)
        guard let data = FileManager.default.contents(atPath: url.path) else { fail("--prompt-file \(url.path) cannot be read") }
        guard let given = String(data: data, encoding: .utf8) else { fail("--prompt-file \(url.path) is not UTF-8 text") }
        promptText = given
    }
    if let given = promptText {
        text = try BundleText(bundle: bundle)
        prompt = try text!.encode(given)
    } else if bundle.metadata.tokenizer != nil {
        text = try? BundleText(bundle: bundle)
    }
    let backend = try makeBackend(options)
    let opening = Date()
    let decoder = try SpeculativeDecoder(bundle: bundle, backend: backend)
    let openSeconds = Date().timeIntervalSince(opening)
    let sampling = try Sampling(temperature: options.temperature, topP: options.topP)
    var generation = GenerationOptions(maxNewTokens: options.maxNewTokens, useDrafter: options.useDrafter,
                                       numDraftTokens: options.numDraftTokens, sampling: sampling, seed: options.seed,
                                       lookupMinMatch: options.lookupMinMatch, treeBudget: options.treeBudget,
                                       automatic: options.automatic && options.useDrafter)
    let streamText = options.promptIDs.isEmpty && !options.json
    var stream = text?.stream()
    // The prompt is echoed with the first tokens, not before: generate checks the prompt (its
    // length against the context, its ids) first, and an error line must start a line.
    var echo = streamText ? promptText : nil
    let result = try decoder.generate(prompt: prompt, options: generation) { tokens in
        if options.json { return }
        if let given = echo { write(given); echo = nil }
        if streamText, stream != nil { write(stream!.push(tokens)) } else { write(tokens.map { String($0) }.joined(separator: " ") + " ") }
    }
    if let given = echo { write(given) }
    if streamText, stream != nil { write(stream!.finish()) }
    var alone: GenerationResult?
    if options.compare ?? !options.json, options.useDrafter {
        generation.useDrafter = false
        generation.numDraftTokens = nil
        generation.treeBudget = nil
        generation.automatic = false
        alone = try decoder.generate(prompt: prompt, options: generation)
    }
    if options.json {
        var body = report(result, options: options, backend: backend.name, bundle: bundle,
                          text: text?.decode(result.tokens), alone: alone)
        body["open_seconds"] = openSeconds
        // Loaded on first use: the whole-capacity functions, and the buckets calls ran in.
        body["loaded_functions"] = decoder.loadedFunctions
        if let interpreter = backend as? InterpreterBackend, options.profileOps {
            // A context bucket's function (`main_64`) counts as its function, as the calls do.
            var own: [String: String] = [:]
            for asset in bundle.metadata.assets.values {
                for row in asset.functionTable { own[row.name] = row.function.rawValue }
            }
            var seconds: [String: [String: Double]] = [:]
            for (name, ops) in interpreter.opSeconds {
                seconds[own[name] ?? name, default: [:]].merge(ops, uniquingKeysWith: +)
            }
            var perCall: [String: [String: Double]] = [:]
            for (function, ops) in seconds {
                let calls = max(1, result.functions[function]?.calls ?? 0)
                perCall[function] = ops.mapValues { 1000 * $0 / Double(calls) }
            }
            body["op_ms_per_call"] = perCall
        }
        if let coreML = backend as? CoreMLBackend {
            body["compute_units"] = options.computeUnits
            body["compiled_models"] = coreML.compiledModelSources.mapValues(\.rawValue)
        }
        let data = try JSONSerialization.data(withJSONObject: body, options: [.sortedKeys])
        write(String(decoding: data, as: UTF8.self) + "\n")
    } else {
        write("\n" + summary(result, options: options, backend: backend.name, alone: alone))
    }
} catch {
    fail("\(error)")
}
