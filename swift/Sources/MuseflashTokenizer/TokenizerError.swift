import Foundation

/// Why a tokenizer cannot be loaded. Every description is one line that names the file and says
/// what to do about it.
public enum TokenizerError: Error, Equatable, CustomStringConvertible, Sendable {
    /// The file does not exist (or is a directory).
    case missingFile(path: String)
    /// The file exists but cannot be read.
    case unreadable(path: String, reason: String)
    /// The file is not JSON at all.
    case notJSON(path: String, reason: String)
    /// The file is JSON but not a Hugging Face tokenizer file: `key` is missing or has the wrong shape.
    case malformed(path: String, key: String, problem: String)
    /// A component this library does not implement: `component` is the key (`normalizer`,
    /// `pre_tokenizer`, `model`, `added_tokens[3].single_word`, ...), `value` what the file says.
    case unsupported(path: String, component: String, value: String)

    public var description: String {
        let text: String
        switch self {
        case .missingFile(let path):
            text = "\(path) does not exist; export a checkpoint whose folder holds tokenizer.json, or point at the right directory"
        case .unreadable(let path, let reason):
            text = "\(path) cannot be read (\(reason)); check its permissions"
        case .notJSON(let path, let reason):
            text = "\(path) is not valid JSON (\(reason)); re-export it or copy the checkpoint's original file"
        case .malformed(let path, let key, let problem):
            text = "\(path) is not a Hugging Face tokenizer file: \(key) \(problem); re-export it or copy the checkpoint's original file"
        case .unsupported(let path, let component, let value):
            text = "\(path): \(component) \(value) is not supported by MuseflashTokenizer (byte-level BPE "
                + "and WordLevel only, see docs/tokenizer.md); tokenize with the Python tokenizers library instead"
        }
        return text.split(whereSeparator: \.isNewline).joined(separator: " ")
    }
}
