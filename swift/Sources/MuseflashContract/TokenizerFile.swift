import Foundation
import ExportMetadata

/// The parts of a Hugging Face `tokenizer.json` the contract looks at: the model's vocabulary
/// and the added tokens. Every other key is ignored.
///
/// `model.vocab` is an object `{text: id}` for `BPE`, `WordLevel` and `WordPiece`, and an array
/// of `[text, score]` pairs whose index is the id for `Unigram`. Without `model.type` the shape
/// of `model.vocab` decides.
struct TokenizerFile: Decodable {
    static let vocabularyTypes = ["BPE", "WordLevel", "WordPiece"]
    static let unigramType = "Unigram"

    struct AddedToken: Decodable {
        var id: Int
        var content: String
        /// Absent means not special.
        var special: Bool

        enum CodingKeys: String, CodingKey { case id, content, special }

        init(from decoder: Decoder) throws {
            let container = try decoder.container(keyedBy: CodingKeys.self)
            id = try container.decode(Int.self, forKey: .id)
            content = try container.decode(String.self, forKey: .content)
            special = try container.decodeIfPresent(Bool.self, forKey: .special) ?? false
        }
    }

    struct Model: Decodable {
        /// `BPE`, `WordLevel`, `WordPiece` or `Unigram`; nil when the file does not say.
        var type: String?
        /// The id of every vocabulary entry (one per entry, so possibly repeated).
        var ids: [Int]

        enum CodingKeys: String, CodingKey { case type, vocab }

        /// One `[text, score]` pair of a Unigram vocabulary.
        private struct UnigramEntry: Decodable {
            init(from decoder: Decoder) throws {
                var pair = try decoder.unkeyedContainer()
                _ = try pair.decode(String.self)
                _ = try pair.decode(Double.self)
            }
        }

        init(from decoder: Decoder) throws {
            let container = try decoder.container(keyedBy: CodingKeys.self)
            type = try container.decodeIfPresent(String.self, forKey: .type)
            let isUnigram: Bool
            switch type {
            case let type? where TokenizerFile.vocabularyTypes.contains(type):
                isUnigram = false
            case TokenizerFile.unigramType?:
                isUnigram = true
            case let type?:
                let known = (TokenizerFile.vocabularyTypes + [TokenizerFile.unigramType]).joined(separator: ", ")
                throw DecodingError.dataCorruptedError(
                    forKey: .type, in: container,
                    debugDescription: "model type \"\(type)\" is not one of \(known)")
            case nil:
                isUnigram = (try? container.decode([UnigramEntry].self, forKey: .vocab)) != nil
            }
            if isUnigram {
                ids = Array(try container.decode([UnigramEntry].self, forKey: .vocab).indices)
            } else {
                ids = Array(try container.decode([String: Int].self, forKey: .vocab).values)
            }
        }
    }

    var model: Model
    var addedTokens: [AddedToken]

    enum CodingKeys: String, CodingKey {
        case model
        case addedTokens = "added_tokens"
    }

    init(from decoder: Decoder) throws {
        let container = try decoder.container(keyedBy: CodingKeys.self)
        model = try container.decode(Model.self, forKey: .model)
        addedTokens = try container.decodeIfPresent([AddedToken].self, forKey: .addedTokens) ?? []
    }

    /// Why a tokenizer file cannot be used, naming it.
    struct Unusable: Error, CustomStringConvertible {
        var description: String
    }

    /// Reads and decodes `url`; `name` (its path in the export) labels every problem.
    static func load(from url: URL, name: String) throws -> TokenizerFile {
        var isDirectory: ObjCBool = false
        guard FileManager.default.fileExists(atPath: url.path, isDirectory: &isDirectory) else {
            throw Unusable(description: "\(name) does not exist")
        }
        guard !isDirectory.boolValue else { throw Unusable(description: "\(name) is a directory, not a file") }
        let data: Data
        do {
            data = try Data(contentsOf: url)
        } catch {
            throw Unusable(description: "\(name) cannot be read (\(error.localizedDescription))")
        }
        do {
            return try JSONDecoder().decode(TokenizerFile.self, from: data)
        } catch let error as DecodingError {
            // swift-foundation (Linux) reports a number that does not fit an integer field as
            // invalid JSON at no key; name the ids that are not integers instead.
            if case .dataCorrupted(let context) = error, context.codingPath.isEmpty,
               let value = try? JSONDecoder().decode(JSONValue.self, from: data) {
                let suspects = nonIntegerIDPaths(in: value)
                if !suspects.isEmpty {
                    throw Unusable(description: "\(name) is not a Hugging Face tokenizer.json: "
                                   + "\(suspects.joined(separator: ", ")) is not an integer id")
                }
            }
            throw Unusable(description: "\(name) is not a Hugging Face tokenizer.json: \(explain(error))")
        } catch {
            throw Unusable(description: "\(name) is not a Hugging Face tokenizer.json: \(error)")
        }
    }

    /// The paths of `model.vocab` values and `added_tokens[i].id` that are numbers but not integers.
    private static func nonIntegerIDPaths(in value: JSONValue) -> [String] {
        guard case .object(let root) = value else { return [] }
        var paths: [String] = []
        if case .object(let model)? = root["model"], case .object(let vocab)? = model["vocab"] {
            paths += vocab.keys.sorted().filter { if case .number = vocab[$0]! { return true } else { return false } }
                .map { "model.vocab.\($0)" }
        }
        if case .array(let added)? = root["added_tokens"] {
            for (index, token) in added.enumerated() {
                if case .object(let members) = token, case .number? = members["id"] {
                    paths.append("added_tokens[\(index)].id")
                }
            }
        }
        return paths
    }

    private static func explain(_ error: DecodingError) -> String {
        switch error {
        case .keyNotFound(let key, let context):
            return "\(ExportMetadataError.keyPath(context.codingPath + [key])) is missing"
        case .typeMismatch(let type, let context):
            return "\(ExportMetadataError.keyPath(context.codingPath)) is not \(describe(type))"
        case .valueNotFound(let type, let context):
            return "\(ExportMetadataError.keyPath(context.codingPath)) is null, not \(describe(type))"
        case .dataCorrupted(let context):
            if context.codingPath.isEmpty {
                return "not valid JSON (\(context.debugDescription))"
            }
            return "\(ExportMetadataError.keyPath(context.codingPath)): \(context.debugDescription)"
        @unknown default:
            return String(describing: error)
        }
    }

    private static func describe(_ type: Any.Type) -> String {
        switch type {
        case is Int.Type: return "an integer"
        case is Double.Type: return "a number"
        case is String.Type: return "a string"
        case is Bool.Type: return "a boolean"
        default:
            let name = String(describing: type)
            if name.hasPrefix("Array") { return "an array" }
            return "an object"
        }
    }

    // MARK: What the contract needs

    var specialTokens: [AddedToken] { addedTokens.filter(\.special) }

    /// The vocabulary size: the distinct ids of `model.vocab` and `added_tokens`, which must be
    /// exactly 0..<n; anything else is described instead.
    enum IDRange {
        case contiguous(count: Int)
        case notContiguous(String)
    }

    var idRange: IDRange {
        let ids = Set(model.ids).union(addedTokens.map(\.id))
        guard !ids.isEmpty else { return .notContiguous("it has no token ids at all") }
        let negative = ids.filter { $0 < 0 }.sorted()
        if !negative.isEmpty {
            return .notContiguous("it has negative ids \(Self.sample(negative))")
        }
        let largest = ids.max()!
        guard largest == ids.count - 1 else {
            let holes = (0..<largest).lazy.filter { !ids.contains($0) }
            let first = Array(holes.prefix(5))
            let count = largest + 1 - ids.count
            return .notContiguous("its \(ids.count) distinct ids are not 0..\(ids.count - 1): the largest is \(largest), "
                                  + "so \(count) id\(count == 1 ? " is" : "s are") missing "
                                  + "(\(count > first.count ? "first " : "")\(first.map(String.init).joined(separator: ", ")))")
        }
        return .contiguous(count: ids.count)
    }

    private static func sample(_ values: [Int]) -> String {
        values.count <= 5 ? "\(values)" : "\(Array(values.prefix(5))) and \(values.count - 5) more"
    }

    /// `WordLevel, 512 ids`.
    var summary: String {
        let size: String
        switch idRange {
        case .contiguous(let count): size = "\(count) ids"
        case .notContiguous: size = "ids not contiguous"
        }
        return "\(model.type ?? "untyped model"), \(size)"
    }
}
