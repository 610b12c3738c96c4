import Foundation

/// tokenizer.json read with JSONSerialization, checked key by key against what this library
/// implements. `path` labels every error.
struct TokenizerJSON {
    let root: [String: Any]
    let path: String

    struct Specification {
        var kind: Tokenizer.Kind
        var model: Tokenizer.Model
        var normalizer: Normalizer
        var preTokenizer: PreTokenizer
        var decoder: Tokenizer.Decoder
        var vocabulary: [String: Int32]
        var addedTokens: [AddedToken]
    }

    init(data: Data, path: String) throws {
        root = try Self.object(data, path: path)
        self.path = path
    }

    static func object(_ data: Data, path: String) throws -> [String: Any] {
        let value: Any
        do {
            value = try JSONSerialization.jsonObject(with: data, options: [.fragmentsAllowed])
        } catch {
            let reason = (error as NSError).userInfo[NSDebugDescriptionErrorKey] as? String ?? "\(error)"
            throw TokenizerError.notJSON(path: path, reason: reason)
        }
        guard let object = value as? [String: Any] else {
            throw TokenizerError.malformed(path: path, key: "the top level", problem: "is not a JSON object")
        }
        return object
    }

    // MARK: Reading values

    private func malformed(_ key: String, _ problem: String) -> TokenizerError {
        .malformed(path: path, key: key, problem: problem)
    }

    private func unsupported(_ component: String, _ value: String) -> TokenizerError {
        .unsupported(path: path, component: component, value: value)
    }

    private static func isNull(_ value: Any?) -> Bool { value == nil || value is NSNull }

    /// JSONSerialization gives numbers and booleans as NSNumber, and `1 as? Bool` succeeds;
    /// a JSON true/false is the NSNumber whose type is a C char or bool.
    private static func isBoolean(_ value: Any?) -> Bool {
        guard let number = value as? NSNumber else { return false }
        let type = String(cString: number.objCType)
        return type == "c" || type == "B"
    }

    private func object(_ value: Any?, _ key: String) throws -> [String: Any]? {
        if Self.isNull(value) { return nil }
        guard let object = value as? [String: Any] else { throw malformed(key, "is not an object") }
        return object
    }

    private func bool(_ object: [String: Any], _ name: String, in key: String, default fallback: Bool) throws -> Bool {
        let value = object[name]
        if Self.isNull(value) { return fallback }
        guard Self.isBoolean(value), let flag = value as? Bool else {
            throw malformed("\(key).\(name)", "is not true or false")
        }
        return flag
    }

    private func string(_ object: [String: Any], _ name: String, in key: String) throws -> String? {
        let value = object[name]
        if Self.isNull(value) { return nil }
        guard let text = value as? String else { throw malformed("\(key).\(name)", "is not a string") }
        return text
    }

    private func typeName(_ object: [String: Any], _ key: String) throws -> String {
        guard let type = try string(object, "type", in: key) else { throw malformed("\(key).type", "is missing") }
        return type
    }

    /// Refuses keys this library does not know for a component.
    private func onlyKeys(_ object: [String: Any], _ known: Set<String>, in key: String) throws {
        if let extra = object.keys.sorted().first(where: { !known.contains($0) }) {
            throw unsupported("\(key).\(extra)", "(a setting this library does not know)")
        }
    }

    private func id(_ value: Any?, _ key: String) throws -> Int32 {
        guard let number = value as? NSNumber, !Self.isBoolean(value), let id = Int32(exactly: number.doubleValue), id >= 0 else {
            throw malformed(key, "is not a non-negative integer id")
        }
        return id
    }

    // MARK: The specification

    func specification() throws -> Specification {
        for key in ["truncation", "padding"] where !Self.isNull(root[key]) {
            throw unsupported(key, "(it changes the ids; save the tokenizer with \(key) disabled)")
        }
        var normalizer = Normalizer.none
        if let object = try object(root["normalizer"], "normalizer") {
            guard object["type"] as? String == "NFC" else {
                throw unsupported("normalizer", "\"\((object["type"] as? String) ?? "untyped")\" (only NFC)")
            }
            try onlyKeys(object, ["type"], in: "normalizer")
            normalizer = .nfc
        }
        try checkPostProcessor(try object(root["post_processor"], "post_processor"), key: "post_processor")

        guard let model = try object(root["model"], "model") else { throw malformed("model", "is missing") }
        guard let vocabObject = try object(model["vocab"], "model.vocab") else {
            throw malformed("model.vocab", "is missing or not an object of token -> id")
        }
        var vocabulary: [String: Int32] = [:]
        vocabulary.reserveCapacity(vocabObject.count)
        for (token, value) in vocabObject { vocabulary[token] = try id(value, "model.vocab.\(token)") }
        let modelType = try string(model, "type", in: "model") ?? (model["merges"] != nil ? "BPE" : "WordLevel")

        let addedTokens = try readAddedTokens(vocabulary: vocabulary)
        let preTokenizerObject = try object(root["pre_tokenizer"], "pre_tokenizer")
        let decoder = try readDecoder()

        switch modelType {
        case "BPE":
            let name = try preTokenizerObject.map { try typeName($0, "pre_tokenizer") }
            let preTokenizer: PreTokenizer
            switch (name, preTokenizerObject) {
            case ("ByteLevel", let object?):
                preTokenizer = try readByteLevel(object)
            case ("Sequence", let object?):
                preTokenizer = try readSequence(object)
            default:
                throw unsupported("pre_tokenizer", "\(name.map { "\"\($0)\"" } ?? "null") with a BPE model (only ByteLevel, "
                                  + "Sequence[Split, ByteLevel] as Qwen2 and Llama 3 write it, or Sequence[Digits, ByteLevel] "
                                  + "as SmolLM2 does, for byte-level BPE)")
            }
            let bpe = try readBPE(model, vocabulary: vocabulary)
            return Specification(kind: .byteLevelBPE, model: .bpe(bpe), normalizer: normalizer, preTokenizer: preTokenizer,
                                 decoder: decoder, vocabulary: vocabulary, addedTokens: addedTokens)
        case "WordLevel":
            try onlyKeys(model, ["type", "vocab", "unk_token"], in: "model")
            let name = try preTokenizerObject.map { try typeName($0, "pre_tokenizer") }
            guard name == "Whitespace", let preTokenizerObject else {
                throw unsupported("pre_tokenizer", "\(name.map { "\"\($0)\"" } ?? "null") with a WordLevel model (only Whitespace)")
            }
            try onlyKeys(preTokenizerObject, ["type"], in: "pre_tokenizer")
            guard let unknown = try string(model, "unk_token", in: "model") else {
                throw unsupported("model.unk_token", "null (a WordLevel model without an unknown token cannot encode every text)")
            }
            guard let unknownID = vocabulary[unknown] else {
                throw malformed("model.unk_token", "\"\(unknown)\" is not in model.vocab")
            }
            return Specification(kind: .wordLevel, model: .wordLevel(WordLevelModel(vocabulary: vocabulary, unknownID: unknownID)),
                                 normalizer: normalizer, preTokenizer: .whitespace, decoder: decoder, vocabulary: vocabulary, addedTokens: addedTokens)
        default:
            throw unsupported("model.type", "\"\(modelType)\"")
        }
    }

    private func readByteLevel(_ object: [String: Any]) throws -> PreTokenizer {
        try onlyKeys(object, ["type", "add_prefix_space", "trim_offsets", "use_regex"], in: "pre_tokenizer")
        // trim_offsets only moves offsets, never ids.
        _ = try bool(object, "trim_offsets", in: "pre_tokenizer", default: true)
        return .byteLevel(addPrefixSpace: try bool(object, "add_prefix_space", in: "pre_tokenizer", default: true),
                          useRegex: try bool(object, "use_regex", in: "pre_tokenizer", default: true))
    }

    /// The Sequence pre-tokenizers read: [Split, ByteLevel] (Qwen2, Llama 3) and [Digits,
    /// ByteLevel] (SmolLM2).
    private func readSequence(_ object: [String: Any]) throws -> PreTokenizer {
        try onlyKeys(object, ["type", "pretokenizers"], in: "pre_tokenizer")
        guard let list = object["pretokenizers"] as? [Any] else {
            throw malformed("pre_tokenizer.pretokenizers", "is not an array")
        }
        let types = try list.enumerated().map { index, item -> String in
            let key = "pre_tokenizer.pretokenizers[\(index)]"
            guard let step = try self.object(item, key) else { throw malformed(key, "is null") }
            return try typeName(step, key)
        }
        guard types.count == 2, types[1] == "ByteLevel", let first = list[0] as? [String: Any],
              let byteLevel = list[1] as? [String: Any], ["Split", "Digits"].contains(types[0]) else {
            throw unsupported("pre_tokenizer", "Sequence of \(types) (only [Split, ByteLevel], as Qwen2 and Llama 3 write it, "
                              + "or [Digits, ByteLevel], as SmolLM2 does)")
        }
        return types[0] == "Split" ? try readSplitSequence(first, byteLevel) : try readDigitsSequence(first, byteLevel)
    }

    /// Sequence[Digits(individual_digits true), ByteLevel(add_prefix_space false)].
    private func readDigitsSequence(_ digits: [String: Any], _ byteLevel: [String: Any]) throws -> PreTokenizer {
        let key = "pre_tokenizer.pretokenizers[0]"
        try onlyKeys(digits, ["type", "individual_digits"], in: key)
        guard try bool(digits, "individual_digits", in: key, default: false) else {
            throw unsupported("\(key).individual_digits", "false (only true: one piece per digit)")
        }
        let byteKey = "pre_tokenizer.pretokenizers[1]"
        try onlyKeys(byteLevel, ["type", "add_prefix_space", "trim_offsets", "use_regex"], in: byteKey)
        _ = try bool(byteLevel, "trim_offsets", in: byteKey, default: true)  // offsets only
        if try bool(byteLevel, "add_prefix_space", in: byteKey, default: true) {
            throw unsupported("\(byteKey).add_prefix_space", "true (after Digits, only false)")
        }
        return .digitsThenByteLevel(useRegex: try bool(byteLevel, "use_regex", in: byteKey, default: true))
    }

    /// Sequence[Split(Qwen2's or Llama 3's pattern, Isolated, invert false),
    /// ByteLevel(add_prefix_space false, use_regex false)]: the only Split pre-tokenizers read.
    private func readSplitSequence(_ split: [String: Any], _ byteLevel: [String: Any]) throws -> PreTokenizer {
        let key = "pre_tokenizer.pretokenizers[0]"
        try onlyKeys(split, ["type", "pattern", "behavior", "invert"], in: key)
        guard let pattern = try self.object(split["pattern"], "\(key).pattern") else { throw malformed("\(key).pattern", "is missing") }
        try onlyKeys(pattern, ["Regex"], in: "\(key).pattern")
        guard let regex = try string(pattern, "Regex", in: "\(key).pattern") else {
            throw malformed("\(key).pattern.Regex", "is missing")
        }
        let digits: Int
        switch regex {
        case PreTokenizer.llama3Pattern: digits = 3
        case PreTokenizer.qwen2Pattern: digits = 1
        default:
            throw unsupported("\(key).pattern.Regex", "\"\(regex.prefix(80))\" (only the split patterns of Llama 3 and Qwen2)")
        }
        let behavior = try string(split, "behavior", in: key)
        guard behavior == "Isolated" else { throw unsupported("\(key).behavior", "\"\(behavior ?? "null")\" (only Isolated)") }
        if try bool(split, "invert", in: key, default: false) { throw unsupported("\(key).invert", "true") }

        let byteKey = "pre_tokenizer.pretokenizers[1]"
        try onlyKeys(byteLevel, ["type", "add_prefix_space", "trim_offsets", "use_regex"], in: byteKey)
        _ = try bool(byteLevel, "trim_offsets", in: byteKey, default: true)  // offsets only
        for name in ["add_prefix_space", "use_regex"] where try bool(byteLevel, name, in: byteKey, default: true) {
            throw unsupported("\(byteKey).\(name)", "true (after a Split, only false)")
        }
        return .splitThenByteLevel(digitsPerPiece: digits)
    }

    private func readDecoder() throws -> Tokenizer.Decoder {
        guard let decoder = try object(root["decoder"], "decoder") else { return .none }
        let type = try typeName(decoder, "decoder")
        guard type == "ByteLevel" else { throw unsupported("decoder", "\"\(type)\"") }
        // The ByteLevel decoder maps bytes back whatever these say.
        try onlyKeys(decoder, ["type", "add_prefix_space", "trim_offsets", "use_regex"], in: "decoder")
        return .byteLevel
    }

    /// Post-processors only add template tokens, which `encode` (add_special_tokens=False) leaves
    /// out, and move offsets; unknown ones are refused.
    private func checkPostProcessor(_ processor: [String: Any]?, key: String) throws {
        guard let processor else { return }
        let type = try typeName(processor, key)
        switch type {
        case "ByteLevel", "TemplateProcessing", "RobertaProcessing", "BertProcessing":
            return
        case "Sequence":
            guard let list = processor["processors"] as? [Any] else { throw malformed("\(key).processors", "is not an array") }
            for (index, item) in list.enumerated() {
                try checkPostProcessor(try object(item, "\(key).processors[\(index)]"), key: "\(key).processors[\(index)]")
            }
        default:
            throw unsupported(key, "\"\(type)\"")
        }
    }

    private func readBPE(_ model: [String: Any], vocabulary: [String: Int32]) throws -> BPEModel {
        try onlyKeys(model, ["type", "dropout", "unk_token", "continuing_subword_prefix", "end_of_word_suffix",
                             "fuse_unk", "byte_fallback", "ignore_merges", "vocab", "merges"], in: "model")
        if let dropout = model["dropout"] as? NSNumber, dropout.doubleValue != 0 {
            throw unsupported("model.dropout", "\(dropout) (random merges)")
        } else if !Self.isNull(model["dropout"]) && !(model["dropout"] is NSNumber) {
            throw malformed("model.dropout", "is not a number")
        }
        for name in ["continuing_subword_prefix", "end_of_word_suffix"] {
            if let affix = try string(model, name, in: "model"), !affix.isEmpty {
                throw unsupported("model.\(name)", "\"\(affix)\"")
            }
        }
        if try bool(model, "byte_fallback", in: "model", default: false) {
            throw unsupported("model.byte_fallback", "true")
        }
        let unknown = try string(model, "unk_token", in: "model")
        var unknownID: Int32?
        if let unknown {
            guard let id = vocabulary[unknown] else { throw malformed("model.unk_token", "\"\(unknown)\" is not in model.vocab") }
            unknownID = id
            if try bool(model, "fuse_unk", in: "model", default: false) {
                throw unsupported("model.fuse_unk", "true")
            }
        }
        let ignoreMerges = try bool(model, "ignore_merges", in: "model", default: false)

        guard let mergeList = model["merges"] as? [Any] else { throw malformed("model.merges", "is missing or not an array") }
        var merges: [UInt64: UInt64] = [:]
        merges.reserveCapacity(mergeList.count)
        for (rank, entry) in mergeList.enumerated() {
            let key = "model.merges[\(rank)]"
            let pair: [String]
            if let text = entry as? String {
                pair = text.split(separator: " ", omittingEmptySubsequences: false).map(String.init)
            } else if let list = entry as? [Any], let strings = list as? [String] {
                pair = strings
            } else {
                throw malformed(key, "is neither \"a b\" nor [\"a\", \"b\"]")
            }
            guard pair.count == 2 else { throw malformed(key, "is not a pair of tokens") }
            guard let left = vocabulary[pair[0]], let right = vocabulary[pair[1]] else {
                throw malformed(key, "names a token that is not in model.vocab")
            }
            guard let merged = vocabulary[pair[0] + pair[1]] else {
                throw malformed(key, "makes \"\(pair[0] + pair[1])\", which is not in model.vocab")
            }
            let pairKey = UInt64(UInt32(bitPattern: left)) << 32 | UInt64(UInt32(bitPattern: right))
            if merges[pairKey] == nil {  // the first (lowest) rank of a repeated pair wins
                merges[pairKey] = UInt64(rank) << 32 | UInt64(UInt32(bitPattern: merged))
            }
        }
        let byteIDs: [Int32] = (0..<256).map { vocabulary[String(Character(ByteLevel.scalarForByte[$0]))] ?? -1 }
        return BPEModel(byteIDs: byteIDs, merges: merges, unknownID: unknownID,
                        wholePieces: ignoreMerges ? vocabulary : nil)
    }

    private func readAddedTokens(vocabulary: [String: Int32]) throws -> [AddedToken] {
        let value = root["added_tokens"]
        if Self.isNull(value) { return [] }
        guard let list = value as? [Any] else { throw malformed("added_tokens", "is not an array") }
        var tokens: [AddedToken] = []
        for (index, item) in list.enumerated() {
            let key = "added_tokens[\(index)]"
            guard let entry = try object(item, key) else { throw malformed(key, "is null") }
            try onlyKeys(entry, ["id", "content", "single_word", "lstrip", "rstrip", "normalized", "special"], in: key)
            let id = try id(entry["id"], "\(key).id")
            guard let content = try string(entry, "content", in: key) else { throw malformed("\(key).content", "is missing") }
            if let inVocabulary = vocabulary[content], inVocabulary != id {
                throw malformed("\(key).id", "is \(id) but model.vocab gives \"\(content)\" id \(inVocabulary)")
            }
            let special = try bool(entry, "special", in: key, default: false)
            tokens.append(AddedToken(
                id: id, content: content, bytes: Array(content.utf8),
                singleWord: try bool(entry, "single_word", in: key, default: false),
                lstrip: try bool(entry, "lstrip", in: key, default: false),
                rstrip: try bool(entry, "rstrip", in: key, default: false),
                normalized: try bool(entry, "normalized", in: key, default: !special),
                special: special))
        }
        return tokens
    }
}
