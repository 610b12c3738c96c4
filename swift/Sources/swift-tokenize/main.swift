import Foundation
import ChatTemplate
import CommandLineFlags
import ExportMetadata
import MuseflashTokenizer

// swift-tokenize: the bundle's tokenizer from the command line, for debugging a prompt and for
// checks from outside (docs/tokenizer.md). Bad input: one line on stderr, exit status 1.

let usage = """
    usage: swift-tokenize --export-dir DIR (--prompt TEXT | --prompt-file F | --messages F.json | --decode IDS | --benchmark F...)

    Reads the export's tokenizer.json (with tokenizer_config.json / special_tokens_map.json),
    checks its vocabulary size against metadata.json, then:

      --prompt TEXT        prints the ids of TEXT as a JSON array
      --prompt-file F      the same for the UTF-8 bytes of file F, exactly as written
      --messages F.json    renders the conversation in F (a JSON list of {"role", "content"}) with the
                           export's chat template (tokenizer_config.json chat_template, or
                           chat_template.jinja beside it) and prints {"text": ..., "ids": [...]}
      --no-generation-prompt  with --messages, render with add_generation_prompt false
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
    case chat(messagesFile: String)
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

/// The export's chat template and special tokens by role, as Python's read_chat_template reads
/// them: tokenizer_config.json `chat_template`, overridden by a chat_template.jinja beside it.
func readChatTemplate(exportDirectory path: String) throws -> (template: ChatTemplate, variables: [String: String]) {
    let directory = resolve(path)
    let configURL = directory.appendingPathComponent("tokenizer_config.json")
    var config = ChatObject()
    if FileManager.default.fileExists(atPath: configURL.path) {
        let text = try readText(configURL.path, what: "tokenizer config")
        do {
            guard case .object(let object) = try ChatValue.parseJSON(text) else {
                throw Failure(description: "\(configURL.path) is not a JSON object")
            }
            config = object
        } catch let error as ChatJSONError {
            throw Failure(description: "\(configURL.path): \(error)")
        }
    }
    var source: String?
    var origin = "\(configURL.path) chat_template"
    if case .string(let text)? = config["chat_template"] { source = text }
    let jinjaURL = directory.appendingPathComponent("chat_template.jinja")
    if FileManager.default.fileExists(atPath: jinjaURL.path) {
        source = try readText(jinjaURL.path, what: "chat template")
        origin = jinjaURL.path
    }
    guard let source else {
        throw Failure(description: "\(directory.path) has no chat template (no chat_template in tokenizer_config.json, "
                      + "no chat_template.jinja); --messages needs one, or give the rendered text to --prompt-file")
    }
    var variables: [String: String] = [:]
    for role in ["bos_token", "eos_token", "unk_token", "pad_token"] {
        if case .string(let token)? = config[role] { variables[role] = token }
    }
    do {
        return (try ChatTemplate(source), variables)
    } catch let error as ChatTemplateError {
        throw Failure(description: "\(origin): \(error)")
    }
}

/// The conversation of a --messages file: a JSON list of objects with string "role" and "content".
func readMessages(_ path: String) throws -> [ChatValue] {
    let text = try readText(path, what: "--messages file")
    let value: ChatValue
    do {
        value = try ChatValue.parseJSON(text)
    } catch {
        throw Failure(description: "--messages file \(resolve(path).path): \(error)")
    }
    guard case .array(let messages) = value else {
        throw Failure(description: "--messages file \(resolve(path).path) must hold a JSON list of "
                      + "{\"role\", \"content\"} objects")
    }
    for (index, message) in messages.enumerated() {
        guard case .object(let object) = message, case .string? = object["role"], case .string? = object["content"] else {
            throw Failure(description: "--messages file \(resolve(path).path): message \(index) is not an object with "
                          + "string \"role\" and \"content\"")
        }
    }
    return messages
}

/// A JSON string literal of `text`.
func jsonString(_ text: String) -> String {
    var out = "\""
    for scalar in text.unicodeScalars {
        switch scalar {
        case "\"": out += "\\\""
        case "\\": out += "\\\\"
        case "\n": out += "\\n"
        case "\r": out += "\\r"
        case "\t": out += "\\t"
        default:
            if scalar.value < 0x20 {
                out += String(format: "\\u%04x", scalar.value)
            } else {
                out.unicodeScalars.append(scalar)
            }
        }
    }
    return out + "\""
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
    var generationPrompt = true
    var repeats = 5
    var flags = CommandLineFlags(arguments, suffix: " (see --help)")
    func set(_ new: Action) throws {
        guard action == nil else {
            throw Failure(description: "give one of --prompt, --prompt-file, --messages, --decode, --benchmark (see --help)")
        }
        action = new
    }
    while let argument = try flags.next() {
        switch argument {
        case "-h", "--help": return usage
        case "--export-dir": exportDirectory = try flags.value(of: argument)
        case "--prompt": try set(.encode(try flags.value(of: argument)))
        case "--prompt-file": try set(.encode(try readText(try flags.value(of: argument), what: "--prompt-file")))
        case "--messages": try set(.chat(messagesFile: try flags.value(of: argument)))
        case "--no-generation-prompt": generationPrompt = false
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
    guard let action else { throw Failure(description: "give one of --prompt, --prompt-file, --messages, --decode, --benchmark (see --help)") }
    let tokenizer = try loadTokenizer(exportDirectory: exportDirectory)
    switch action {
    case .encode(let text):
        return json(tokenizer.encode(text))
    case .chat(let messagesFile):
        let messages = try readMessages(messagesFile)
        let (template, variables) = try readChatTemplate(exportDirectory: exportDirectory)
        let text = try template.render(messages: messages, addGenerationPrompt: generationPrompt, variables: variables)
        return "{\"text\": \(jsonString(text)), \"ids\": \(json(tokenizer.encode(text)))}"
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
