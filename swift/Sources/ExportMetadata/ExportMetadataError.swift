import Foundation

/// Why metadata.json could not be read. Decoding failures name the key path
/// (e.g. `assets.target.states[0].kv_heads`) so the exporter bug is findable.
public enum ExportMetadataError: Error, Equatable, Sendable, CustomStringConvertible {
    case missingFile(path: String)
    case unreadableFile(path: String, reason: String)
    case invalidJSON(path: String, reason: String)
    case missingKey(path: String, keyPath: String)
    case wrongType(path: String, keyPath: String, expected: String)
    case invalidValue(path: String, keyPath: String, reason: String)

    public var description: String {
        switch self {
        case .missingFile(let path):
            return "\(path) does not exist; point --export-dir at a directory written by the museflash exporter."
        case .unreadableFile(let path, let reason):
            return "\(path) cannot be read: \(reason)."
        case .invalidJSON(let path, let reason):
            return "\(path) is not valid JSON: \(reason.hasSuffix(".") ? String(reason.dropLast()) : reason)."
        case .missingKey(let path, let keyPath):
            return "\(path): required key \(keyPath) is missing (see docs/metadata.md)."
        case .wrongType(let path, let keyPath, let expected):
            return "\(path): \(keyPath) is not \(expected) (see docs/metadata.md)."
        case .invalidValue(let path, let keyPath, let reason):
            return "\(path): \(keyPath) is invalid: \(reason)."
        }
    }
}

extension ExportMetadata {
    /// Only the version, so an unknown schema can be reported as such even
    /// when the rest of the file no longer matches this model.
    private struct VersionProbe: Decodable {
        var schemaVersion: Int
        enum CodingKeys: String, CodingKey { case schemaVersion = "schema_version" }
    }

    /// `path` only labels errors.
    public static func decode(from data: Data, path: String = BundleContract.metadataFileName) throws -> ExportMetadata {
        try decode(ExportMetadata.self, from: data, path: path)
    }

    public static func decodeSchemaVersion(from data: Data, path: String = BundleContract.metadataFileName) throws -> Int {
        try decode(VersionProbe.self, from: data, path: path).schemaVersion
    }

    public static func load(fromExportDirectory directory: URL) throws -> (metadata: ExportMetadata, data: Data) {
        let url = directory.appendingPathComponent(BundleContract.metadataFileName)
        let data = try readFile(at: url)
        return (try decode(from: data, path: url.path), data)
    }

    public static func readFile(at url: URL) throws -> Data {
        var isDirectory: ObjCBool = false
        guard FileManager.default.fileExists(atPath: url.path, isDirectory: &isDirectory) else {
            throw ExportMetadataError.missingFile(path: url.path)
        }
        guard !isDirectory.boolValue else {
            throw ExportMetadataError.unreadableFile(path: url.path, reason: "it is a directory")
        }
        do {
            return try Data(contentsOf: url)
        } catch {
            throw ExportMetadataError.unreadableFile(path: url.path, reason: error.localizedDescription)
        }
    }

    private static func decode<T: Decodable>(_ type: T.Type, from data: Data, path: String) throws -> T {
        do {
            return try JSONDecoder().decode(type, from: data)
        } catch let error as DecodingError {
            // swift-foundation (Linux) reports a number that does not fit an integer field as
            // invalid JSON at no key; name the numbers that cannot be integers instead.
            if case .dataCorrupted(let context) = error, context.codingPath.isEmpty,
               let value = try? JSONDecoder().decode(JSONValue.self, from: data) {
                let suspects = value.nonIntegerNumberPaths()
                if !suspects.isEmpty {
                    throw ExportMetadataError.invalidValue(
                        path: path, keyPath: suspects.joined(separator: " or "),
                        reason: "the number does not fit its field (an integer is expected)")
                }
            }
            throw ExportMetadataError(decodingError: error, path: path)
        }
    }
}

extension ExportMetadataError {
    public init(decodingError: DecodingError, path: String) {
        switch decodingError {
        case .keyNotFound(let key, let context):
            self = .missingKey(path: path, keyPath: Self.keyPath(context.codingPath + [key]))
        case .typeMismatch(let type, let context):
            self = .wrongType(path: path, keyPath: Self.keyPath(context.codingPath),
                              expected: Self.typeName(type))
        case .valueNotFound(let type, let context):
            self = .wrongType(path: path, keyPath: Self.keyPath(context.codingPath),
                              expected: "\(Self.typeName(type)) (found null)")
        case .dataCorrupted(let context):
            if context.codingPath.isEmpty {
                let reason = (context.underlyingError?.localizedDescription).map { "\(context.debugDescription) (\($0))" }
                    ?? context.debugDescription
                self = .invalidJSON(path: path, reason: reason)
            } else {
                self = .invalidValue(path: path, keyPath: Self.keyPath(context.codingPath),
                                     reason: context.debugDescription)
            }
        @unknown default:
            self = .invalidJSON(path: path, reason: String(describing: decodingError))
        }
    }

    /// `a.b[0].c`; `<root>` for the document itself.
    public static func keyPath(_ codingPath: [CodingKey]) -> String {
        var text = ""
        for key in codingPath {
            if let index = key.intValue, key.stringValue == "Index \(index)" {
                text += "[\(index)]"
            } else {
                text += text.isEmpty ? key.stringValue : ".\(key.stringValue)"
            }
        }
        return text.isEmpty ? "<root>" : text
    }

    private static func typeName(_ type: Any.Type) -> String {
        switch type {
        case is Int.Type: return "an integer"
        case is Double.Type: return "a number"
        case is String.Type: return "a string"
        case is Bool.Type: return "a boolean"
        case is [Any].Type: return "an array"
        default:
            let name = String(describing: type)
            if name.hasPrefix("Array") { return "an array" }
            if name.hasPrefix("Dictionary") || name.contains("KeyedDecodingContainer") { return "an object" }
            return "a \(name) object"
        }
    }
}

extension JSONValue {
    /// Key paths (`a.b[2]`) of numbers that no integer field can hold.
    func nonIntegerNumberPaths(_ path: String = "") -> [String] {
        switch self {
        case .number: return [path.isEmpty ? "<root>" : path]
        case .array(let values):
            return values.enumerated().flatMap { $0.element.nonIntegerNumberPaths("\(path)[\($0.offset)]") }
        case .object(let members):
            return members.keys.sorted().flatMap { members[$0]!.nonIntegerNumberPaths(path.isEmpty ? $0 : "\(path).\($0)") }
        default: return []
        }
    }
}
