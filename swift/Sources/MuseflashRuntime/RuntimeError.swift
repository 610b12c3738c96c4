/// Why a bundle cannot be opened or decoded. Each description is one line naming the file or
/// the setting, and the fix.
public enum RuntimeError: Error, Sendable, Equatable, CustomStringConvertible {
    case exportDirectoryMissing(path: String)
    case unsupportedSchema(path: String, version: Int, supported: [Int])
    case badMetadata(reason: String)
    case packageMissing(path: String)
    case compiledModelMismatch(model: String, function: String, reason: String)
    case compiledModelFromAnotherExport(model: String, difference: String)
    case functionMissing(package: String, function: String, available: [String])
    case notSpeculative(reason: String)
    case emptyPrompt
    case tokenOutOfVocabulary(index: Int, id: Int32, vocabSize: Int)
    case promptTooLong(length: Int, limit: Int, contextLength: Int)
    case badOption(reason: String)
    case backend(function: String, reason: String)
    case badOutput(function: String, reason: String)
    /// A token tree or ancestor mask a tree call cannot take (TokenTree).
    case badTree(reason: String)

    public var description: String {
        switch self {
        case .exportDirectoryMissing(let path):
            return "export directory \(path) does not exist; point --export-dir at a directory written by the museflash exporter"
        case .unsupportedSchema(let path, let version, let supported):
            return "\(path): schema_version \(version) is not one this runtime reads (\(supported.map(String.init).joined(separator: ", "))); re-export with a matching museflash or update the runtime"
        case .badMetadata(let reason):
            return "metadata.json: \(reason)"
        case .packageMissing(let path):
            return "package \(path) listed in metadata.json does not exist (nor its compiled .mlmodelc); re-export the bundle"
        case .compiledModelMismatch(let model, let function, let reason):
            return "compiled model \(model) cannot load function \(function) that metadata.json lists (\(reason)); ship the .mlmodelc compiled from this export's .mlpackage"
        case .compiledModelFromAnotherExport(let model, let difference):
            return "compiled model \(model) was not compiled from this export: its embedded museflash.metadata \(difference); ship the .mlmodelc compiled from this export's .mlpackage"
        case .functionMissing(let package, let function, let available):
            return "package \(package) has no function \(function) that metadata.json lists (it has \(available.sorted().joined(separator: ", "))); re-export the bundle"
        case .notSpeculative(let reason):
            return reason
        case .emptyPrompt:
            return "the prompt is empty; give at least one token id"
        case .tokenOutOfVocabulary(let index, let id, let vocabSize):
            return "prompt token \(index) is \(id), outside the vocabulary 0..<\(vocabSize)"
        case .promptTooLong(let length, let limit, let contextLength):
            return "the prompt has \(length) tokens, but this bundle (context_length \(contextLength)) decodes at most \(limit)-token prompts; shorten the prompt or re-export with a larger --max-context-length"
        case .badOption(let reason):
            return reason
        case .backend(let function, let reason):
            return "\(function): \(reason)"
        case .badOutput(let function, let reason):
            return "\(function) returned \(reason); the bundle does not match metadata.json, re-export it"
        case .badTree(let reason):
            return reason
        }
    }
}
