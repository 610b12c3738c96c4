import XCTest
import Foundation
@testable import MuseflashTokenizer

/// Swift ids and decoded text against the `tokenizers` library's, from the goldens the Python
/// side writes in the same build (//python:tokenizer_goldens, python/museflash/tools/tokenizer_goldens.py):
/// every held-out file of the demo corpus, hand-made hard cases and seeded random strings, for the
/// demo tokenizer, variants of it, the tiny WordLevel tokenizer, and fixtures in the tokenizer.json
/// layouts of Qwen2/Qwen3 and Llama 3 (python/museflash/tokenizer_layouts.py). MUSEFLASH_TOKENIZER_GOLDENS
/// names the file; missing it is a failure, not a skip. SwiftPM: `bazel build //python:tokenizer_goldens`,
/// then `MUSEFLASH_TOKENIZER_GOLDENS=$PWD/../bazel-bin/python/tokenizer_goldens.json swift test --filter MuseflashTokenizerTests`.
final class ParityTests: XCTestCase {
    struct Goldens: Decodable {
        var tokenizersVersion: String
        var tokenizerFiles: [String: String]
        /// tokenizer_config.json text of the Qwen2 and Llama 3 layouts.
        var tokenizerConfigs: [String: String]
        var vocabSizes: [String: Int]
        var heldOut: HeldOut
        var cases: [Case]
        var decodes: [Decode]

        enum CodingKeys: String, CodingKey {
            case tokenizersVersion = "tokenizers_version"
            case tokenizerFiles = "tokenizer_files"
            case tokenizerConfigs = "tokenizer_configs"
            case vocabSizes = "vocab_sizes"
            case heldOut = "held_out"
            case cases, decodes
        }
    }

    struct HeldOut: Decodable {
        var files: Int
        var bytes: Int
    }

    struct Case: Decodable {
        var tokenizer: String
        var name: String
        var text: String
        var ids: [Int32]
        /// nil: equals `text`.
        var decoded: String?
        /// nil: equals the decode with special tokens.
        var decodedSkippingSpecial: String?

        enum CodingKeys: String, CodingKey {
            case tokenizer, name, text, ids, decoded
            case decodedSkippingSpecial = "decoded_skipping_special"
        }
    }

    struct Decode: Decodable {
        var tokenizer: String
        var ids: [Int32]
        var decoded: String
        var decodedSkippingSpecial: String

        enum CodingKeys: String, CodingKey {
            case tokenizer, ids, decoded
            case decodedSkippingSpecial = "decoded_skipping_special"
        }
    }

    private struct GoldensUnavailable: Error, CustomStringConvertible {
        var description: String
    }

    /// Read once: the file is large.
    private static let loaded: Result<(Goldens, [String: Tokenizer]), Error> = Result {
        let variable = "MUSEFLASH_TOKENIZER_GOLDENS"
        guard let path = ProcessInfo.processInfo.environment[variable], !path.isEmpty else {
            throw GoldensUnavailable(description: "\(variable) is required: set it to the tokenizer_goldens.json "
                                     + "that //python:tokenizer_goldens builds")
        }
        let url = path.hasPrefix("/") ? URL(fileURLWithPath: path)
            : URL(fileURLWithPath: FileManager.default.currentDirectoryPath).appendingPathComponent(path)
        let goldens = try JSONDecoder().decode(Goldens.self, from: Data(contentsOf: url))
        var tokenizers: [String: Tokenizer] = [:]
        for (name, text) in goldens.tokenizerFiles {
            tokenizers[name] = try Tokenizer(tokenizerJSON: Data(text.utf8), path: "goldens:\(name)")
        }
        return (goldens, tokenizers)
    }

    private func goldens() throws -> (Goldens, [String: Tokenizer]) { try Self.loaded.get() }

    /// Where two id lists first differ, for a readable failure.
    private func difference(_ expected: [Int32], _ actual: [Int32]) -> String {
        let first = (0..<min(expected.count, actual.count)).first { expected[$0] != actual[$0] } ?? min(expected.count, actual.count)
        let window = { (ids: [Int32]) in Array(ids[max(0, first - 2)..<min(ids.count, first + 5)]) }
        return "\(expected.count) vs \(actual.count) ids, first difference at \(first): "
            + "expected \(window(expected)), got \(window(actual))"
    }

    func testGoldensCoverWhatTheyShould() throws {
        let (goldens, tokenizers) = try goldens()
        XCTAssertEqual(Set(tokenizers.keys), ["demo", "demo_prefix_space", "demo_no_regex", "demo_ignore_merges", "demo_digits",
                                              "demo_added_tokens", "word_level", "qwen2_layout", "llama3_layout"])
        let heldOut = goldens.cases.filter { $0.tokenizer == "demo" && $0.name.hasPrefix("held_out/") }
        XCTAssertEqual(heldOut.count, goldens.heldOut.files)
        XCTAssertGreaterThan(heldOut.count, 10)
        XCTAssertEqual(heldOut.map { $0.text.utf8.count }.reduce(0, +), goldens.heldOut.bytes)
        let names = Set(goldens.cases.map(\.name))
        for name in ["empty", "crlf", "tabs", "zwj sequences", "cjk", "combining marks", "special tokens", "100 kB line"] {
            XCTAssertTrue(names.contains(name), "no hard case \(name)")
        }
        for layout in ["qwen2_layout", "llama3_layout"] {
            let cases = goldens.cases.filter { $0.tokenizer == layout }
            XCTAssertEqual(cases.filter { $0.name.hasPrefix("held_out/") }.count, goldens.heldOut.files, layout)
            let names = Set(cases.map(\.name))
            for name in ["digit runs", "contraction long s", "nfc composes", "whitespace before newlines", "llama chat", "qwen chat"] {
                XCTAssertTrue(names.contains(name), "\(layout) has no case \(name)")
            }
        }
    }

    /// The fixtures are in the layouts they stand for (what the Swift side reads from them).
    func testLayoutFixturesAreWhatTheyStandFor() throws {
        let (goldens, tokenizers) = try goldens()
        XCTAssertEqual(tokenizers["qwen2_layout"]?.preTokenizer, .splitThenByteLevel(digitsPerPiece: 1))
        XCTAssertEqual(tokenizers["qwen2_layout"]?.normalizer, .nfc)
        XCTAssertEqual(tokenizers["llama3_layout"]?.preTokenizer, .splitThenByteLevel(digitsPerPiece: 3))
        XCTAssertEqual(tokenizers["llama3_layout"]?.normalizer, Normalizer.none)
        let llama = try XCTUnwrap(goldens.tokenizerFiles["llama3_layout"])
        let model = try XCTUnwrap((JSONSerialization.jsonObject(with: Data(llama.utf8)) as? [String: Any])?["model"] as? [String: Any])
        XCTAssertEqual(model["ignore_merges"] as? Bool, true)
    }

    /// Qwen3 has no BOS (its tokenizer_config.json: bos_token null, add_bos_token false); Llama 3's
    /// is <|begin_of_text|>, named by bos_token (runtime's BundleText puts it in front).
    func testBOSConventionOfTheLayouts() throws {
        let (goldens, _) = try goldens()
        func load(_ name: String) throws -> Tokenizer {
            try Tokenizer(tokenizerJSON: Data(goldens.tokenizerFiles[name]!.utf8), path: name,
                          tokenizerConfig: Data(try XCTUnwrap(goldens.tokenizerConfigs[name]).utf8))
        }
        let qwen = try load("qwen2_layout")
        XCTAssertNil(qwen.bosTokenID)
        XCTAssertEqual(qwen.addBOSToken, false)
        XCTAssertEqual(qwen.eosTokenID, qwen.id(for: "<|im_end|>"))
        let llama = try load("llama3_layout")
        XCTAssertNotNil(llama.bosTokenID)
        XCTAssertEqual(llama.bosTokenID, llama.id(for: "<|begin_of_text|>"))
        XCTAssertNil(llama.addBOSToken)
        XCTAssertTrue(llama.specialTokenIDs.contains(llama.bosTokenID!))
    }

    func testVocabularySizesAgree() throws {
        let (goldens, tokenizers) = try goldens()
        for (name, tokenizer) in tokenizers {
            XCTAssertEqual(tokenizer.vocabularySize, goldens.vocabSizes[name], name)
        }
    }

    func testKinds() throws {
        let (_, tokenizers) = try goldens()
        XCTAssertEqual(tokenizers["demo"]?.kind, .byteLevelBPE)
        XCTAssertEqual(tokenizers["word_level"]?.kind, .wordLevel)
        XCTAssertEqual(tokenizers["qwen2_layout"]?.kind, .byteLevelBPE)
        XCTAssertEqual(tokenizers["llama3_layout"]?.kind, .byteLevelBPE)
    }

    func testEncodeEqualsTheTokenizersLibrary() throws {
        let (goldens, tokenizers) = try goldens()
        var failures = 0
        for item in goldens.cases {
            let ids = tokenizers[item.tokenizer]!.encode(item.text)
            if ids != item.ids {
                failures += 1
                if failures <= 10 {
                    XCTFail("\(item.tokenizer) \(item.name): \(difference(item.ids, ids))")
                }
            }
        }
        XCTAssertEqual(failures, 0, "\(failures) of \(goldens.cases.count) texts encode differently")
    }

    func testDecodeOfEncodedTextEqualsTheTokenizersLibrary() throws {
        let (goldens, tokenizers) = try goldens()
        var failures = 0
        for item in goldens.cases {
            let tokenizer = tokenizers[item.tokenizer]!
            let decoded = item.decoded ?? item.text
            let skipping = item.decodedSkippingSpecial ?? decoded
            let mine = tokenizer.decode(item.ids)
            let mineSkipping = tokenizer.decode(item.ids, skipSpecialTokens: true)
            if mine != decoded || mineSkipping != skipping {
                failures += 1
                if failures <= 10 {
                    XCTFail("\(item.tokenizer) \(item.name): decode gives \(mine.prefix(60).debugDescription) / "
                            + "\(mineSkipping.prefix(60).debugDescription), expected \(decoded.prefix(60).debugDescription) / "
                            + "\(skipping.prefix(60).debugDescription)")
                }
            }
        }
        XCTAssertEqual(failures, 0)
    }

    /// Byte-level BPE gives any text back exactly; after an NFC normalizer, its NFC form.
    func testByteLevelRoundTrips() throws {
        let (goldens, tokenizers) = try goldens()
        for item in goldens.cases where ["demo", "llama3_layout", "qwen2_layout"].contains(item.tokenizer) {
            let tokenizer = tokenizers[item.tokenizer]!
            let expected = item.tokenizer == "qwen2_layout" ? item.text.precomposedStringWithCanonicalMapping : item.text
            XCTAssertEqual(tokenizer.decode(tokenizer.encode(item.text)), expected, "\(item.tokenizer) \(item.name)")
        }
    }

    func testDecodeOfRandomIdsEqualsTheTokenizersLibrary() throws {
        let (goldens, tokenizers) = try goldens()
        XCTAssertGreaterThan(goldens.decodes.count, 100)
        for item in goldens.decodes {
            let tokenizer = tokenizers[item.tokenizer]!
            XCTAssertEqual(tokenizer.decode(item.ids), item.decoded, "\(item.tokenizer) \(item.ids)")
            XCTAssertEqual(tokenizer.decode(item.ids, skipSpecialTokens: true), item.decodedSkippingSpecial,
                           "\(item.tokenizer) \(item.ids) skipping special tokens")
        }
    }

    /// Streaming one id at a time gives the same text as decoding all at once, on real text.
    func testStreamingEqualsDecodeOnGoldens() throws {
        let (goldens, tokenizers) = try goldens()
        for item in goldens.cases where !item.name.hasPrefix("held_out/") && item.ids.count < 2000 {
            let tokenizer = tokenizers[item.tokenizer]!
            var stream = tokenizer.streamingDecoder()
            var text = ""
            for id in item.ids {
                let piece = stream.push(id)
                XCTAssertFalse(piece.unicodeScalars.contains("\u{FFFD}") && !item.text.unicodeScalars.contains("\u{FFFD}")
                               && tokenizer.kind == .byteLevelBPE, "\(item.tokenizer) \(item.name)")
                text += piece
            }
            text += stream.finish()
            XCTAssertEqual(text, tokenizer.decode(item.ids), "\(item.tokenizer) \(item.name)")
        }
        for item in goldens.decodes {
            let tokenizer = tokenizers[item.tokenizer]!
            var stream = tokenizer.streamingDecoder(skipSpecialTokens: true)
            let text = item.ids.map { stream.push($0) }.joined() + stream.finish()
            XCTAssertEqual(text, item.decodedSkippingSpecial, "\(item.tokenizer) \(item.ids)")
        }
    }
}
