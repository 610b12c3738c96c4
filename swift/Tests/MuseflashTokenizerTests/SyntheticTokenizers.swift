import Foundation
@testable import MuseflashTokenizer

/// Small tokenizer.json documents made in the test, so refusals and streaming can be tested
/// without the goldens.
enum SyntheticTokenizers {
    /// The vocabulary spelling of a byte string.
    static func spell(_ bytes: [UInt8]) -> String { ByteLevel.spell(bytes) }

    /// Byte-level BPE over the 256 byte symbols (ids 0..<256 in byte order) plus `merges` of
    /// byte strings, each merge's result taking the next id; `<s>` and `</s>` are special
    /// tokens after them.
    static func byteLevel(merges: [([UInt8], [UInt8])] = []) -> [String: Any] {
        var vocab: [String: Int] = [:]
        for byte in 0..<256 { vocab[spell([UInt8(byte)])] = byte }
        var mergeList: [[String]] = []
        for (left, right) in merges {
            mergeList.append([spell(left), spell(right)])
            if vocab[spell(left + right)] == nil { vocab[spell(left + right)] = vocab.count }
        }
        let added: [[String: Any]] = ["<s>", "</s>"].enumerated().map { index, content in
            ["id": vocab.count + index, "content": content, "single_word": false, "lstrip": false,
             "rstrip": false, "normalized": false, "special": true]
        }
        return [
            "version": "1.0", "truncation": NSNull(), "padding": NSNull(), "added_tokens": added,
            "normalizer": NSNull(),
            "pre_tokenizer": ["type": "ByteLevel", "add_prefix_space": false, "trim_offsets": true, "use_regex": true],
            "post_processor": NSNull(),
            "decoder": ["type": "ByteLevel", "add_prefix_space": true, "trim_offsets": true, "use_regex": true],
            "model": ["type": "BPE", "dropout": NSNull(), "unk_token": NSNull(), "continuing_subword_prefix": NSNull(),
                      "end_of_word_suffix": NSNull(), "fuse_unk": false, "byte_fallback": false, "ignore_merges": false,
                      "vocab": vocab, "merges": mergeList],
        ]
    }

    /// `byteLevel(merges:)` with the pre-tokenizer Qwen2 (`digitsPerPiece` 1) or Llama 3 (3)
    /// writes: Sequence[Split(pattern, Isolated), ByteLevel without its regex].
    static func splitLayout(digitsPerPiece: Int, merges: [([UInt8], [UInt8])] = []) -> [String: Any] {
        var document = byteLevel(merges: merges)
        document["pre_tokenizer"] = splitSequence(
            pattern: digitsPerPiece == 1 ? PreTokenizer.qwen2Pattern : PreTokenizer.llama3Pattern)
        return document
    }

    static func splitSequence(pattern: String, behavior: String = "Isolated", invert: Bool = false,
                              addPrefixSpace: Bool = false, useRegex: Bool = false) -> [String: Any] {
        ["type": "Sequence", "pretokenizers": [
            ["type": "Split", "pattern": ["Regex": pattern], "behavior": behavior, "invert": invert],
            ["type": "ByteLevel", "add_prefix_space": addPrefixSpace, "trim_offsets": false, "use_regex": useRegex],
        ]]
    }

    static func wordLevel() -> [String: Any] {
        [
            "version": "1.0", "truncation": NSNull(), "padding": NSNull(),
            "added_tokens": [["id": 3, "content": "<mask>", "single_word": false, "lstrip": false, "rstrip": false,
                              "normalized": false, "special": true]],
            "normalizer": NSNull(), "pre_tokenizer": ["type": "Whitespace"], "post_processor": NSNull(), "decoder": NSNull(),
            "model": ["type": "WordLevel", "vocab": ["w0": 0, "hello": 1, "world": 2, "<mask>": 3], "unk_token": "w0"],
        ]
    }

    static func data(_ document: [String: Any]) -> Data {
        try! JSONSerialization.data(withJSONObject: document, options: [.sortedKeys])
    }

    static func load(_ document: [String: Any], path: String = "synthetic/tokenizer.json") throws -> Tokenizer {
        try Tokenizer(tokenizerJSON: data(document), path: path)
    }
}

/// SplitMix64: a stated, seeded generator, the same on every platform.
struct SplitMix64 {
    var state: UInt64

    mutating func next() -> UInt64 {
        state &+= 0x9E37_79B9_7F4A_7C15
        var z = state
        z = (z ^ (z >> 30)) &* 0xBF58_476D_1CE4_E5B9
        z = (z ^ (z >> 27)) &* 0x94D0_49BB_1331_11EB
        return z ^ (z >> 31)
    }

    mutating func below(_ bound: Int) -> Int { Int(next() % UInt64(bound)) }
}
