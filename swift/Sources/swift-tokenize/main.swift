import Foundation
import CommandLineFlags
import ExportMetadata
import MuseflashTokenizer

// swift-tokenize: the bundle's tokenizer from the command line, for debugging a prompt and for
// checks from outside (docs/tokenizer.md). Bad input: one line on stderr, exit status 1.

let usage = """
    usage: swift-tokenize --export-dir DIR (--prompt TEXT | --prompt-file F | --decode IDS | --benchmark F...)

    Reads the export's tokenizer.json (with tokenizer_config.json / special_tokens_map.json),
    checks its vocabulary size against metadata.json, then:

      --prompt TEXT        prints the ids of TEXT as a JSON array
      --prompt-file F      the same for the UTF-8 bytes of file F, exactly as written
      --decode 1,2,3       prints the text of the ids (comma-separated), special tokens included
      --skip-special-tokens  with --decode, leave the special tokens out
      --benchmark F...     encodes the files (one first pass, then the best of --repeat passes,
                           one thread) and prints a JSON object with bytes, tokens, seconds and MB/s
      --repeat N           passes timed by --benchmark (default 5)

    Relative paths resolve against $BUILD_WORKING_DIRECTORY when set (bazel run), else the current
    directory. Encoding equals the tokenizers library's encode(text, add_special_tokens=False).
    """

struct Failure: Error, CustomStringConvertible {
    var description: String
}

enum Action {
    case encode(String)
    case decode([Int32])
    case benchmark([String])
}

func resolve(_ path: String) -> URL {
    if path.hasPrefix("/") { return URL(fileURLWithPath: path).standardizedFileURL }
    let environment = ProcessInfo.processInfo.environment
    let base = environment["BUILD_WORKING_DIRECTORY"].flatMap { $0.isEmpty ? nil : $0 }
        ?? FileManager.default.currentDirectoryPath
    return URL(fileURLWithPath: base, isDirectory: true).appendingPathComponent(path).standardizedFileURL
}

/// The exact UTF-8 text of a file.
func readText(_ path: String, what: String) throws -> String {
    let url = resolve(path)
    var isDirectory: ObjCBool = false
    guard FileManager.default.fileExists(atPath: url.path, isDirectory: &isDirectory), !isDirectory.boolValue else {
        throw Failure(description: "\(what) \(url.path) does not exist or is a directory")
    }
    let data: Data
    do {
        data = try Data(contentsOf: url)
    } catch {
        throw Failure(description: "\(what) \(url.path) cannot be read (\(error.localizedDescription))")
    }
    guard let text = String(data: data, encoding: .utf8) else {
        throw Failure(description: "\(what) \(url.path) is not UTF-8 text")
    }
    return text
}

func parseIDs(_ list: String) throws -> [Int32] {
    let parts = list.split(separator: ",", omittingEmptySubsequences: false)
        .map { $0.trimmingCharacters(in: .whitespaces) }
    guard !(parts.count == 1 && parts[0].isEmpty) else {
        throw Failure(description: "--decode needs comma-separated token ids, e.g. --decode 1,2,3")
    }
    return try parts.map { part in
        guard let id = Int32(part), id >= 0 else {
            throw Failure(description: "--decode: \"\(part)\" is not a token id (a non-negative integer); "
                          + "give comma-separated ids, e.g. --decode 1,2,3")
        }
        return id
    }
}

/// Loads the tokenizer of an export and checks it against metadata.json.
func loadTokenizer(exportDirectory path: String) throws -> Tokenizer {
    let directory = resolve(path)
    var isDirectory: ObjCBool = false
    guard FileManager.default.fileExists(atPath: directory.path, isDirectory: &isDirectory), isDirectory.boolValue else {
        throw Failure(description: "export directory \(directory.path) does not exist; give --export-dir the "
                      + "directory the exporter wrote")
    }
    let metadata = try ExportMetadata.load(fromExportDirectory: directory).metadata
    guard let listed = metadata.tokenizer else {
        throw Failure(description: "\(directory.path) has no tokenizer (metadata.json tokenizer is null); "
                      + "export a checkpoint whose folder holds tokenizer.json")
    }
    let tokenizer = try Tokenizer(directory: directory)
    let metadataPath = directory.appendingPathComponent(BundleContract.metadataFileName).path
    let tokenizerPath = directory.appendingPathComponent(BundleContract.tokenizerFileName).path
    for (key, size) in [("vocab_size", metadata.vocabSize), ("tokenizer.vocab_size", listed.vocabSize)]
    where size != tokenizer.vocabularySize {
        throw Failure(description: "\(tokenizerPath) has \(tokenizer.vocabularySize) token ids but \(metadataPath) "
                      + "\(key) is \(size); the tokenizer does not belong to this export, re-export it")
    }
    return tokenizer
}

func json(_ ids: [Int32]) -> String {
    "[" + ids.map(String.init).joined(separator: ", ") + "]"
}

func benchmark(_ tokenizer: Tokenizer, files: [String], repeats: Int) throws -> String {
    let texts = try files.map { try readText($0, what: "benchmark file") }
    let bytes = texts.reduce(0) { $0 + $1.utf8.count }
    var tokens = 0
    let firstStart = DispatchTime.now().uptimeNanoseconds
    for text in texts { tokens += tokenizer.encode(text).count }  // warm-up: fills the piece cache
    let first = Double(DispatchTime.now().uptimeNanoseconds - firstStart) / 1e9
    var best = Double.infinity
    for _ in 0..<repeats {
        let start = DispatchTime.now().uptimeNanoseconds
        var count = 0
        for text in texts { count += tokenizer.encode(text).count }
        let seconds = Double(DispatchTime.now().uptimeNanoseconds - start) / 1e9
        precondition(count == tokens)
        best = min(best, seconds)
    }
    return "{\"files\": \(texts.count), \"bytes\": \(bytes), \"tokens\": \(tokens), \"first_pass_seconds\": \(first), "
        + "\"seconds\": \(best), \"mb_per_s\": \(Double(bytes) / best / 1e6)}"
}

func run(_ arguments: [String]) throws -> String {
    var exportDirectory: String?
    var action: Action?
    var skipSpecial = false
    var repeats = 5
    var flags = CommandLineFlags(arguments, suffix: " (see --help)")
    func set(_ new: Action) throws {
        guard action == nil else {
            throw Failure(description: "give one of --prompt, --prompt-file, --decode, --benchmark (see --help)")
        }
        action = new
    }
    while let argument = try flags.next() {
        switch argument {
        case "-h", "--help": return usage
        case "--export-dir": exportDirectory = try flags.value(of: argument)
        case "--prompt": try set(.encode(try flags.value(of: argument)))
        case "--prompt-file": try set(.encode(try readText(try flags.value(of: argument), what: "--prompt-file")))
        case "--decode": try set(.decode(try parseIDs(try flags.value(of: argument))))
        case "--skip-special-tokens": skipSpecial = true
        case "--repeat":
            guard let count = Int(try flags.value(of: argument)), count >= 1 else {
                throw Failure(description: "--repeat needs a whole number of at least 1")
            }
            repeats = count
        case "--benchmark":
            let files = flags.values(of: argument)
            guard !files.isEmpty else { throw Failure(description: "--benchmark needs at least one file") }
            try set(.benchmark(files))
        default:
            throw Failure(description: "unexpected argument \(argument) (see --help)")
        }
    }
    guard let exportDirectory, !exportDirectory.isEmpty else { throw Failure(description: "--export-dir is required (see --help)") }
    guard let action else { throw Failure(description: "give one of --prompt, --prompt-file, --decode, --benchmark (see --help)") }
    let tokenizer = try loadTokenizer(exportDirectory: exportDirectory)
    switch action {
    case .encode(let text):
        return json(tokenizer.encode(text))
    case .decode(let ids):
        if let bad = ids.first(where: { tokenizer.token(for: $0) == nil }) {
            throw Failure(description: "--decode: \(bad) is not a token id of this tokenizer "
                          + "(ids are 0..\(tokenizer.vocabularySize - 1))")
        }
        return tokenizer.decode(ids, skipSpecialTokens: skipSpecial)
    case .benchmark(let files):
        return try benchmark(tokenizer, files: files, repeats: repeats)
    }
}

do {
    let output = try run(Array(CommandLine.arguments.dropFirst()))
    FileHandle.standardOutput.write(Data((output + "\n").utf8))
    exit(0)
} catch {
    let line = String(describing: error).split(whereSeparator: \.isNewline).joined(separator: " ")
    FileHandle.standardError.write(Data("swift-tokenize: \(line)\n".utf8))
    exit(1)
}
