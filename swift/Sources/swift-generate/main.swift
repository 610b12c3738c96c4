import Foundation
import MuseflashRuntime

// swift-generate: speculative decoding over an exported bundle, in Swift.
//
//   swift-generate --export-dir DIR --prompt-ids 1,2,3 [--max-new-tokens N] [--no-draft]
//       [--num-draft-tokens K] [--backend interpreter|coreml] [--format text|json]
//
// Text: the generated ids as they are accepted, then the figures. JSON: one object. Bad input:
// one line on stderr and exit status 1. Relative paths resolve against $BUILD_WORKING_DIRECTORY
// (bazel run), else the current directory.

struct UsageError: Error, CustomStringConvertible {
    let description: String
}

struct Options {
    var exportDir = ""
    var promptIDs: [Int32] = []
    var maxNewTokens = 64
    var useDrafter = true
    var numDraftTokens: Int?
    var backend = "interpreter"
    var json = false
}

let usage = "usage: swift-generate --export-dir DIR --prompt-ids 1,2,3 [--max-new-tokens N] [--no-draft] [--num-draft-tokens K] [--backend interpreter|coreml] [--format text|json]"

func parse(_ arguments: [String]) throws -> Options {
    var options = Options()
    var index = 0
    func value(_ flag: String) throws -> String {
        index += 1
        guard index < arguments.count else { throw UsageError(description: "\(flag) needs a value; \(usage)") }
        return arguments[index]
    }
    func integer(_ flag: String) throws -> Int {
        let text = try value(flag)
        guard let number = Int(text) else { throw UsageError(description: "\(flag) takes a whole number, got \"\(text)\"") }
        return number
    }
    while index < arguments.count {
        var argument = arguments[index]
        // --flag=value spells the same as --flag value.
        if argument.hasPrefix("--"), let equals = argument.firstIndex(of: "=") {
            var split = arguments
            split.replaceSubrange(index...index, with: [String(argument[..<equals]), String(argument[argument.index(after: equals)...])])
            return try parse(split)
        }
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
        case "--max-new-tokens": options.maxNewTokens = try integer(argument)
        case "--num-draft-tokens": options.numDraftTokens = try integer(argument)
        case "--no-draft": options.useDrafter = false
        case "--backend":
            options.backend = try value(argument)
            guard ["interpreter", "coreml"].contains(options.backend) else {
                throw UsageError(description: "--backend is interpreter or coreml, got \"\(options.backend)\"")
            }
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
        index += 1
    }
    guard !options.exportDir.isEmpty else { throw UsageError(description: "--export-dir is required; \(usage)") }
    guard !options.promptIDs.isEmpty else { throw UsageError(description: "--prompt-ids is required; \(usage)") }
    guard options.maxNewTokens >= 1 else { throw UsageError(description: "--max-new-tokens must be at least 1, got \(options.maxNewTokens)") }
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

/// Before anything is opened: the process's own cost, apart from the bundle.
let startupResidentBytes = peakResidentBytes()

func report(_ result: GenerationResult, options: Options, backend: String, bundle: MuseflashBundle) -> [String: Any] {
    var functions: [String: Any] = [:]
    for (name, stats) in result.functions {
        functions[name] = ["calls": stats.calls, "seconds": stats.seconds,
                           "ms_per_call": stats.calls == 0 ? 0 : 1000 * stats.seconds / Double(stats.calls)]
    }
    return [
        "prompt_ids": result.promptIDs.map(Int.init),
        "tokens": result.tokens.map(Int.init),
        "accepted": result.accepted,
        "stop_reason": result.stopReason.rawValue,
        "num_draft_tokens": result.numDraftTokens,
        "calls": result.functions.mapValues { $0.calls },
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
    ]
}

func summary(_ result: GenerationResult, backend: String) -> String {
    var lines: [String] = []
    let stop = result.stopReason == .maxNewTokens ? "reached --max-new-tokens" : result.stopReason == .endOfSequence ? "end of sequence" : "context full"
    lines.append(String(format: "%d tokens in %.3f s (%.1f tokens/s, %@ backend), stopped: %@",
                        result.tokens.count, result.seconds, result.tokensPerSecond, backend, stop))
    if !result.accepted.isEmpty {
        lines.append(String(format: "%.2f tokens per target call (%d calls); accepted per step %.2f/%d (%.1f%%): %@",
                            result.tokensPerTargetCall, result.targetCalls, result.meanAcceptedLength, result.numDraftTokens,
                            100 * result.acceptanceRate, result.accepted.map(String.init).joined(separator: " ")))
    } else {
        lines.append(String(format: "%.2f tokens per target call (%d calls), target alone", result.tokensPerTargetCall, result.targetCalls))
    }
    let timing = ["prefill", "main", "inject_kv", "draft"].compactMap { name -> String? in
        guard let stats = result.functions[name] else { return nil }
        return String(format: "%@ %d x %.2f ms", name, stats.calls, 1000 * stats.seconds / Double(max(stats.calls, 1)))
    }
    lines.append("time per call: " + timing.joined(separator: ", "))
    return lines.joined(separator: "\n") + "\n"
}

let options: Options
do {
    options = try parse(Array(CommandLine.arguments.dropFirst()))
} catch {
    fail("\(error)")
}

do {
    let bundle = try MuseflashBundle.open(resolve(options.exportDir))
    let backend: any InferenceBackend = options.backend == "coreml" ? try CoreMLBackend() : InterpreterBackend()
    let decoder = try SpeculativeDecoder(bundle: bundle, backend: backend)
    if options.useDrafter && !decoder.hasDrafter {
        fail("\(bundle.url.path) has no DFlash drafter; export with --fused-target --dflash-drafter, or pass --no-draft")
    }
    let generation = GenerationOptions(maxNewTokens: options.maxNewTokens, useDrafter: options.useDrafter,
                                       numDraftTokens: options.numDraftTokens)
    let result = try decoder.generate(prompt: options.promptIDs, options: generation) { tokens in
        if !options.json { write(tokens.map { String($0) }.joined(separator: " ") + " ") }
    }
    if options.json {
        let data = try JSONSerialization.data(withJSONObject: report(result, options: options, backend: backend.name, bundle: bundle), options: [.sortedKeys])
        write(String(decoding: data, as: UTF8.self) + "\n")
    } else {
        write("\n" + summary(result, backend: backend.name))
    }
} catch {
    fail("\(error)")
}
