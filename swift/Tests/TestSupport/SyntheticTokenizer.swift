import Foundation

/// A small Hugging Face `tokenizer.json`, written independently of the reader under test:
/// a word-level vocabulary `w<id>` plus added tokens, as the tokenizers library saves it.
public struct SyntheticTokenizer {
    public struct AddedToken {
        public var id: Int
        public var content: String
        public var special: Bool

        public init(id: Int, content: String, special: Bool = true) {
            self.id = id
            self.content = content
            self.special = special
        }
    }

    /// `WordLevel`, `BPE`, `WordPiece` or `Unigram` (vocab written as `[text, score]` pairs in id order).
    public var modelType: String
    /// Text -> id of `model.vocab`.
    public var vocab: [String: Int]
    public var addedTokens: [AddedToken]

    public init(modelType: String = "WordLevel", vocab: [String: Int], addedTokens: [AddedToken]) {
        self.modelType = modelType
        self.vocab = vocab
        self.addedTokens = addedTokens
    }

    /// Ids 0..<vocabSize: `special` as special added tokens, every other id a word of `model.vocab`.
    public init(vocabSize: Int, special: [String: Int], modelType: String = "WordLevel") {
        let specialIDs = Set(special.values)
        var vocab: [String: Int] = [:]
        for id in 0..<vocabSize where !specialIDs.contains(id) { vocab["w\(id)"] = id }
        self.init(modelType: modelType, vocab: vocab,
                  addedTokens: special.sorted { $0.value < $1.value }.map { AddedToken(id: $0.value, content: $0.key) })
    }

    public var json: [String: Any] {
        let modelVocab: Any
        if modelType == "Unigram" {
            modelVocab = vocab.sorted { $0.value < $1.value }.map { [$0.key, -Double($0.value) - 1] as [Any] }
        } else {
            modelVocab = vocab
        }
        var model: [String: Any] = ["type": modelType, "vocab": modelVocab]
        if modelType == "WordLevel" { model["unk_token"] = "w0" }
        return [
            "version": "1.0",
            "truncation": NSNull(),
            "padding": NSNull(),
            "added_tokens": addedTokens.map {
                ["id": $0.id, "content": $0.content, "single_word": false, "lstrip": false, "rstrip": false,
                 "normalized": false, "special": $0.special] as [String: Any]
            },
            "normalizer": NSNull(),
            "pre_tokenizer": ["type": "Whitespace"],
            "post_processor": NSNull(),
            "decoder": NSNull(),
            "model": model,
        ]
    }

    public func data() throws -> Data {
        try JSONSerialization.data(withJSONObject: json, options: [.sortedKeys])
    }
}

extension SyntheticExport {
    public static let tokenizerFiles = ["tokenizer.json", "tokenizer_config.json"]
    /// The synthetic exports' `speculative_decoding.mask_token_id`.
    public static let maskTokenID = Int(Size.vocab) - 1

    /// The tokenizer every synthetic export with a tokenizer has: `Size.vocab` ids, the last
    /// being the special `<mask>`.
    public static var defaultTokenizer: SyntheticTokenizer {
        SyntheticTokenizer(vocabSize: Int(Size.vocab), special: ["<mask>": maskTokenID])
    }

    /// Adds the tokenizer files and metadata.json's `tokenizer`, as the exporter does when the
    /// target checkpoint has a tokenizer.
    public mutating func addTokenizer(_ tokenizer: SyntheticTokenizer = defaultTokenizer) throws {
        files["tokenizer.json"] = try tokenizer.data()
        files["tokenizer_config.json"] = try JSONSerialization.data(
            withJSONObject: ["tokenizer_class": "PreTrainedTokenizerFast", "mask_token": "<mask>"], options: [.sortedKeys])
        setMetadata(["tokenizer"], to: [
            "files": Self.tokenizerFiles,
            "vocab_size": Int(Size.vocab),
            "special_tokens": Dictionary(uniqueKeysWithValues: tokenizer.addedTokens.filter(\.special)
                .map { ($0.content, $0.id) }),
        ] as [String: Any])
    }

    public func withTokenizer(_ tokenizer: SyntheticTokenizer = defaultTokenizer) throws -> SyntheticExport {
        var copy = self
        try copy.addTokenizer(tokenizer)
        return copy
    }
}
