import XCTest
import Foundation
@testable import MuseflashTokenizer

/// Tokenizer kinds and settings this library does not implement are refused with one line that
/// names the file and the component, never tokenized differently.
final class RefusalTests: XCTestCase {
    private func refusal(_ edit: (inout [String: Any]) -> Void, base: [String: Any] = SyntheticTokenizers.byteLevel(),
                         file: StaticString = #filePath, line: UInt = #line) -> TokenizerError? {
        var document = base
        edit(&document)
        do {
            _ = try SyntheticTokenizers.load(document, path: "bundle/tokenizer.json")
            XCTFail("loaded", file: file, line: line)
            return nil
        } catch let error as TokenizerError {
            let text = error.description
            XCTAssertFalse(text.contains("\n"), text, file: file, line: line)
            XCTAssertTrue(text.contains("bundle/tokenizer.json"), text, file: file, line: line)
            return error
        } catch {
            XCTFail("not a TokenizerError: \(error)", file: file, line: line)
            return nil
        }
    }

    private func assertUnsupported(_ keyword: String, _ edit: (inout [String: Any]) -> Void,
                                   base: [String: Any] = SyntheticTokenizers.byteLevel(),
                                   file: StaticString = #filePath, line: UInt = #line) {
        guard let error = refusal(edit, base: base, file: file, line: line) else { return }
        guard case .unsupported = error else {
            return XCTFail("\(error) is not .unsupported", file: file, line: line)
        }
        XCTAssertTrue(error.description.contains(keyword), "\(error) does not name \(keyword)", file: file, line: line)
    }

    private static func model(_ document: inout [String: Any], _ key: String, _ value: Any) {
        var model = document["model"] as! [String: Any]
        model[key] = value
        document["model"] = model
    }

    func testTheSyntheticTokenizersLoad() throws {
        XCTAssertEqual(try SyntheticTokenizers.load(SyntheticTokenizers.byteLevel()).kind, .byteLevelBPE)
        XCTAssertEqual(try SyntheticTokenizers.load(SyntheticTokenizers.wordLevel()).kind, .wordLevel)
    }

    func testOtherModelTypes() {
        for type in ["Unigram", "WordPiece", "SomethingNew"] {
            assertUnsupported(type) { Self.model(&$0, "type", type) }
        }
    }

    func testNormalizers() throws {
        for type in ["NFKC", "NFD", "NFKD", "Lowercase", "Sequence"] {
            assertUnsupported("normalizer") { $0["normalizer"] = ["type": type] }
            assertUnsupported(type) { $0["normalizer"] = ["type": type] }
        }
        // NFC (Qwen2's) is read; with a setting it does not have, refused.
        var document = SyntheticTokenizers.byteLevel()
        document["normalizer"] = ["type": "NFC"]
        XCTAssertEqual(try SyntheticTokenizers.load(document).encode("e\u{301}"), [0xC3, 0xA9])
        assertUnsupported("normalizer.strip") { $0["normalizer"] = ["type": "NFC", "strip": true] }
    }

    func testPreTokenizers() {
        for type in ["Metaspace", "Split", "Whitespace"] {
            assertUnsupported(type) { $0["pre_tokenizer"] = ["type": type] }
        }
        assertUnsupported("Sequence") { $0["pre_tokenizer"] = ["type": "Sequence", "pretokenizers": [["type": "Metaspace"]]] }
        assertUnsupported("pre_tokenizer") { $0["pre_tokenizer"] = NSNull() }
        assertUnsupported("ByteLevel", { $0["pre_tokenizer"] = ["type": "ByteLevel"] }, base: SyntheticTokenizers.wordLevel())
    }

    /// Only Qwen2's and Llama 3's Split, isolated, before a ByteLevel without regex or prefix space.
    func testSplitSequencesOtherThanQwen2AndLlama3() throws {
        let base = SyntheticTokenizers.splitLayout(digitsPerPiece: 3)
        XCTAssertEqual(try SyntheticTokenizers.load(base).encode("a 1234"), [97, 32, 49, 50, 51, 52])
        let gpt2 = #"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"#
        assertUnsupported("pattern.Regex", { $0["pre_tokenizer"] = SyntheticTokenizers.splitSequence(pattern: gpt2) }, base: base)
        assertUnsupported("pattern.Regex", {
            $0["pre_tokenizer"] = SyntheticTokenizers.splitSequence(pattern: PreTokenizer.llama3Pattern + "|x")
        }, base: base)
        for behavior in ["Removed", "MergedWithPrevious", "MergedWithNext", "Contiguous"] {
            assertUnsupported("behavior", {
                $0["pre_tokenizer"] = SyntheticTokenizers.splitSequence(pattern: PreTokenizer.qwen2Pattern, behavior: behavior)
            }, base: base)
        }
        assertUnsupported("invert", {
            $0["pre_tokenizer"] = SyntheticTokenizers.splitSequence(pattern: PreTokenizer.qwen2Pattern, invert: true)
        }, base: base)
        assertUnsupported("add_prefix_space", {
            $0["pre_tokenizer"] = SyntheticTokenizers.splitSequence(pattern: PreTokenizer.qwen2Pattern, addPrefixSpace: true)
        }, base: base)
        assertUnsupported("use_regex", {
            $0["pre_tokenizer"] = SyntheticTokenizers.splitSequence(pattern: PreTokenizer.qwen2Pattern, useRegex: true)
        }, base: base)
        assertUnsupported("pattern.String", {
            $0["pre_tokenizer"] = ["type": "Sequence", "pretokenizers": [
                ["type": "Split", "pattern": ["String": " "], "behavior": "Isolated", "invert": false],
                ["type": "ByteLevel", "add_prefix_space": false, "trim_offsets": false, "use_regex": false]]]
        }, base: base)
        assertUnsupported("Sequence", {
            $0["pre_tokenizer"] = ["type": "Sequence", "pretokenizers": [
                ["type": "ByteLevel", "add_prefix_space": false, "trim_offsets": false, "use_regex": false]]]
        }, base: base)
    }

    func testUnknownByteLevelSetting() {
        assertUnsupported("split_on_digits") {
            $0["pre_tokenizer"] = ["type": "ByteLevel", "add_prefix_space": false, "use_regex": true, "split_on_digits": true]
        }
    }

    func testDecoders() {
        for type in ["WordPiece", "Metaspace", "Sequence", "BPEDecoder"] {
            assertUnsupported(type) { $0["decoder"] = ["type": type] }
        }
    }

    func testPostProcessors() throws {
        assertUnsupported("post_processor") { $0["post_processor"] = ["type": "SomethingNew"] }
        // Template tokens are added only with add_special_tokens, which encode leaves out.
        var document = SyntheticTokenizers.byteLevel()
        document["post_processor"] = ["type": "Sequence", "processors": [["type": "ByteLevel"], ["type": "TemplateProcessing"]]]
        XCTAssertEqual(try SyntheticTokenizers.load(document).encode("ab"), [97, 98])
    }

    func testTruncationAndPadding() {
        assertUnsupported("truncation") { $0["truncation"] = ["max_length": 8] }
        assertUnsupported("padding") { $0["padding"] = ["strategy": "BatchLongest"] }
    }

    func testBPESettingsThatChangeIds() {
        assertUnsupported("byte_fallback") { Self.model(&$0, "byte_fallback", true) }
        assertUnsupported("dropout") { Self.model(&$0, "dropout", 0.1) }
        assertUnsupported("continuing_subword_prefix") { Self.model(&$0, "continuing_subword_prefix", "##") }
        assertUnsupported("end_of_word_suffix") { Self.model(&$0, "end_of_word_suffix", "</w>") }
        assertUnsupported("some_new_knob") { Self.model(&$0, "some_new_knob", 1) }
    }

    func testAddedTokenWithUnknownFlag() {
        assertUnsupported("added_tokens[0]") {
            $0["added_tokens"] = [["id": 300, "content": "<x>", "special": true, "new_flag": true]]
        }
    }

    func testWordLevelWithoutUnknownToken() {
        assertUnsupported("unk_token", { Self.model(&$0, "unk_token", NSNull()) }, base: SyntheticTokenizers.wordLevel())
    }

    func testMalformedFiles() {
        for edit: (inout [String: Any]) -> Void in [
            { $0["model"] = NSNull() },
            { Self.model(&$0, "merges", [["Ġ", "nowhere"]]) },
            { Self.model(&$0, "merges", [["a", "b"]]) },  // "ab" is not in the vocabulary
            { Self.model(&$0, "vocab", ["a": "zero"]) },
            { $0["added_tokens"] = [["id": 1, "content": "b", "special": true]] },  // "b" is 98
            { $0["added_tokens"] = [["id": 300, "content": "<x>", "special": "yes"]] },
        ] {
            guard let error = refusal(edit) else { continue }
            guard case .malformed = error else { XCTFail("\(error) is not .malformed"); continue }
        }
    }

    func testNotJSON() {
        for text in ["", "{", "not json", "{\"model\": }"] {
            XCTAssertThrowsError(try Tokenizer(tokenizerJSON: Data(text.utf8), path: "x/tokenizer.json")) { error in
                guard case TokenizerError.notJSON = error else { return XCTFail("\(error) is not .notJSON") }
                XCTAssertTrue("\(error)".contains("x/tokenizer.json"))
            }
        }
        XCTAssertThrowsError(try Tokenizer(tokenizerJSON: Data("[1, 2]".utf8))) { error in
            guard case TokenizerError.malformed = error else { return XCTFail("\(error) is not .malformed") }
        }
    }

    func testMissingFile() throws {
        let directory = FileManager.default.temporaryDirectory.appendingPathComponent("tokenizer-missing-\(getpid())")
        try FileManager.default.createDirectory(at: directory, withIntermediateDirectories: true)
        defer { try? FileManager.default.removeItem(at: directory) }
        XCTAssertThrowsError(try Tokenizer(directory: directory)) { error in
            guard case TokenizerError.missingFile(let path) = error else { return XCTFail("\(error)") }
            XCTAssertTrue(path.hasSuffix("tokenizer.json"))
        }
    }

    func testConfigFilesGiveTheRoles() throws {
        let directory = FileManager.default.temporaryDirectory.appendingPathComponent("tokenizer-roles-\(getpid())")
        try FileManager.default.createDirectory(at: directory, withIntermediateDirectories: true)
        defer { try? FileManager.default.removeItem(at: directory) }
        try SyntheticTokenizers.data(SyntheticTokenizers.byteLevel()).write(to: directory.appendingPathComponent("tokenizer.json"))
        try Data(#"{"bos_token": "<s>", "add_bos_token": false, "unk_token": "<nowhere>"}"#.utf8)
            .write(to: directory.appendingPathComponent("tokenizer_config.json"))
        try Data(#"{"bos_token": "</s>", "eos_token": {"content": "</s>"}}"#.utf8)
            .write(to: directory.appendingPathComponent("special_tokens_map.json"))
        let tokenizer = try Tokenizer(directory: directory)
        XCTAssertEqual(tokenizer.bosTokenID, 256)  // tokenizer_config.json wins
        XCTAssertEqual(tokenizer.eosTokenID, 257)
        XCTAssertNil(tokenizer.specialTokenRoles["unk_token"])
        XCTAssertEqual(tokenizer.addBOSToken, false)
        XCTAssertEqual(tokenizer.specialTokenIDs, [256, 257])

        try Data("{oops".utf8).write(to: directory.appendingPathComponent("tokenizer_config.json"))
        XCTAssertThrowsError(try Tokenizer(directory: directory)) { error in
            guard case TokenizerError.notJSON(let path, _) = error else { return XCTFail("\(error)") }
            XCTAssertTrue(path.hasSuffix("tokenizer_config.json"))
        }
    }
}
