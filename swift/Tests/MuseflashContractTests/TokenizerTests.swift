import XCTest
import Foundation
import MuseflashContract
import TestSupport

/// The optional tokenizer: metadata.json's `tokenizer` against the tokenizer files in the export.
final class TokenizerTests: XCTestCase {
    private typealias Token = SyntheticTokenizer.AddedToken

    private static let dflashProperties = ContractAssertions.dflashBundleProperties + ContractAssertions.tokenizerProperties
    private static let mask = SyntheticExport.maskTokenID
    private static let vocab = Int(SyntheticExport.Size.vocab)

    private func export(_ tokenizer: SyntheticTokenizer = SyntheticExport.defaultTokenizer) throws -> SyntheticExport {
        try SyntheticExport.fusedTargetWithDFlashDrafter().withTokenizer(tokenizer)
    }

    /// Checks `export` and expects exactly `failing` to fail, each saying `fragments[name]`.
    @discardableResult
    private func assertFailing(_ failing: Set<String>, _ export: SyntheticExport,
                               saying fragments: [String: String] = [:],
                               damage: (URL) throws -> Void = { _ in },
                               file: StaticString = #filePath, line: UInt = #line) throws -> ContractReport {
        let report = try ContractAssertions.check(export, damage: damage)
        ContractAssertions.assertFailing(failing, in: report, expected: Self.dflashProperties, file: file, line: line)
        for (name, fragment) in fragments {
            let detail = ContractAssertions.detail(name, in: report)
            XCTAssertTrue(detail.contains(fragment), "\(name): \"\(fragment)\" not in \"\(detail)\"", file: file, line: line)
        }
        return report
    }

    private func remove(_ path: String) -> (URL) throws -> Void {
        { try FileManager.default.removeItem(at: $0.appendingPathComponent(path)) }
    }

    private func overwrite(_ path: String, with text: String) -> (URL) throws -> Void {
        { try Data(text.utf8).write(to: $0.appendingPathComponent(path)) }
    }

    // MARK: Valid

    func testExportWithTokenizerPassesEveryProperty() throws {
        let report = try assertFailing([], try export(), saying: [
            "tokenizer.files": "tokenizer.json (WordLevel, 64 ids), tokenizer_config.json",
            "tokenizer.vocab_size": "tokenizer.json has ids 0..63 = tokenizer.vocab_size, vocab_size 64",
            "tokenizer.mask_token": "mask_token_id 63 is the special token \"<mask>\"",
        ])
        XCTAssertTrue(report.allHold)
        XCTAssertEqual(report.metadata?.tokenizer?.files, SyntheticExport.tokenizerFiles)
        XCTAssertTrue(report.summaryLines.contains(
            "  tokenizer: tokenizer.json, tokenizer_config.json; vocab_size 64, special tokens \"<mask>\"=63"),
            report.summaryLines.joined(separator: "\n"))
    }

    func testRingExportWithTokenizerPassesEveryProperty() throws {
        let report = try ContractAssertions.check(try SyntheticExport.targetWithRingDrafter().withTokenizer())
        ContractAssertions.assertFailing([], in: report,
                                         expected: ContractAssertions.ringBundleProperties + ContractAssertions.tokenizerProperties)
    }

    /// Like a missing drafter: no tokenizer, no tokenizer properties.
    func testExportsWithoutTokenizerReportNoTokenizerProperties() throws {
        let dflash = try ContractAssertions.check(.fusedTargetWithDFlashDrafter())
        ContractAssertions.assertFailing([], in: dflash)
        XCTAssertTrue(dflash.summaryLines.contains("  tokenizer: none"))
        let ring = try ContractAssertions.check(.targetWithRingDrafter())
        ContractAssertions.assertFailing([], in: ring, expected: ContractAssertions.ringBundleProperties)
        var nullTokenizer = SyntheticExport.fusedTargetWithDFlashDrafter()
        nullTokenizer.setMetadata(["tokenizer"], to: NSNull())
        ContractAssertions.assertFailing([], in: try ContractAssertions.check(nullTokenizer))
    }

    /// The mask token belongs to speculative decoding; without it there is nothing to check.
    func testWithoutSpeculativeDecodingThereIsNoMaskTokenProperty() throws {
        var export = try SyntheticExport.targetWithRingDrafter().withTokenizer()
        export.setMetadata(["speculative_decoding"], to: NSNull())
        let report = try ContractAssertions.check(export)
        let names = report.results.map(\.name).filter { $0.hasPrefix("tokenizer.") }
        XCTAssertEqual(names, ["tokenizer.files", "tokenizer.vocab_size"], report.verdictLines.joined(separator: "\n"))
        for name in names { XCTAssertEqual(report.result(named: name)?.holds, true, name) }
    }

    func testAddedTokensAlreadyInTheVocabularyAreCountedOnce() throws {
        var tokenizer = SyntheticExport.defaultTokenizer
        tokenizer.vocab["<mask>"] = Self.mask
        tokenizer.addedTokens.append(Token(id: 0, content: "w0", special: false))
        try assertFailing([], try export(tokenizer))
    }

    func testUnigramAndBPEVocabulariesAreRead() throws {
        for type in ["Unigram", "BPE", "WordPiece"] {
            var tokenizer = SyntheticExport.defaultTokenizer
            tokenizer.modelType = type
            tokenizer.vocab["<mask>"] = Self.mask  // a Unigram vocabulary lists every id
            try assertFailing([], try export(tokenizer), saying: ["tokenizer.files": "tokenizer.json (\(type), 64 ids)"])
        }
    }

    // MARK: tokenizer.files

    func testMissingListedFileFailsOnlyTokenizerFiles() throws {
        try assertFailing(["tokenizer.files"], try export(),
                          saying: ["tokenizer.files": "tokenizer_config.json does not exist"],
                          damage: remove("tokenizer_config.json"))
    }

    func testMissingTokenizerJSONFailsFilesAndLeavesTheRestUnchecked() throws {
        try assertFailing(Set(ContractAssertions.tokenizerProperties), try export(), saying: [
            "tokenizer.files": "tokenizer.json does not exist",
            "tokenizer.vocab_size": "not checked against tokenizer.json",
            "tokenizer.mask_token": "(see tokenizer.files)",
        ], damage: remove("tokenizer.json"))
    }

    func testTokenizerJSONNotFirstFailsTokenizerFiles() throws {
        var export = try export()
        export.setMetadata(["tokenizer", "files"], to: Array(SyntheticExport.tokenizerFiles.reversed()))
        try assertFailing(["tokenizer.files"], export,
                          saying: ["tokenizer.files": "the first file is \"tokenizer_config.json\", not tokenizer.json"])
    }

    func testListedPathOutsideTheExportFailsTokenizerFiles() throws {
        var export = try export()
        export.setMetadata(["tokenizer", "files"], to: ["tokenizer.json", "../tokenizer_config.json"])
        try assertFailing(["tokenizer.files"], export,
                          saying: ["tokenizer.files": "\"../tokenizer_config.json\" is not a relative path inside"])
    }

    /// Unreadable or wrongly shaped: a violation naming the file, not a crash or an input error.
    func testUnparseableTokenizerJSONFailsNamingTheFile() throws {
        let cases: [(text: String, fragment: String)] = [
            ("{\"model\": {\"type\": \"WordLevel\", \"vocab\": {\"a\": 0", "not valid JSON"),
            ("", "not valid JSON"),
            ("[1, 2]", "<root> is not an object"),
            ("{\"added_tokens\": []}", "model is missing"),
            ("{\"model\": {\"type\": \"BPE\", \"vocab\": [\"a\", \"b\"]}}", "model.vocab is not an object"),
            ("{\"model\": {\"type\": \"Unigram\", \"vocab\": {\"a\": 0}}}", "model.vocab is not an array"),
            ("{\"model\": {\"type\": \"WordLevel\", \"vocab\": {\"a\": \"zero\"}}}", "model.vocab.a is not an integer"),
            ("{\"model\": {\"type\": \"WordLevel\", \"vocab\": {\"a\": 0.5}}}", "model.vocab.a"),
            ("{\"model\": {\"type\": \"SentencePiece\", \"vocab\": {}}}", "model type \"SentencePiece\" is not one of"),
            ("{\"model\": {\"type\": \"WordLevel\", \"vocab\": {\"a\": 0}}, \"added_tokens\": [{\"id\": \"1\", \"content\": \"x\"}]}",
             "added_tokens[0].id is not an integer"),
        ]
        for (text, fragment) in cases {
            let report = try assertFailing(Set(ContractAssertions.tokenizerProperties), try export(), saying: [
                "tokenizer.files": "tokenizer.json is not a Hugging Face tokenizer.json: ",
                "tokenizer.vocab_size": "not checked against tokenizer.json",
                "tokenizer.mask_token": "not checked against tokenizer.json",
            ], damage: overwrite("tokenizer.json", with: text))
            let detail = ContractAssertions.detail("tokenizer.files", in: report)
            XCTAssertTrue(detail.contains(fragment), "\(text): \"\(fragment)\" not in \"\(detail)\"")
        }
    }

    func testTokenizerJSONThatIsADirectoryFailsTokenizerFiles() throws {
        try assertFailing(Set(ContractAssertions.tokenizerProperties), try export(),
                          saying: ["tokenizer.files": "tokenizer.json is a directory, not a file"]) { directory in
            let url = directory.appendingPathComponent("tokenizer.json")
            try FileManager.default.removeItem(at: url)
            try FileManager.default.createDirectory(at: url, withIntermediateDirectories: false)
        }
    }

    // MARK: tokenizer.vocab_size

    func testTokenizerWithADifferentVocabSizeFailsVocabSize() throws {
        var tokenizer = SyntheticExport.defaultTokenizer
        tokenizer.vocab["w64"] = Self.vocab
        try assertFailing(["tokenizer.vocab_size"], try export(tokenizer),
                          saying: ["tokenizer.vocab_size": "tokenizer.json has 65 ids but vocab_size is 64"])
        var smaller = SyntheticExport.defaultTokenizer
        smaller.vocab["w62"] = nil
        smaller.addedTokens = [Token(id: 62, content: "<mask>")]
        var export = try export(smaller)
        export.setMetadata(["speculative_decoding", "mask_token_id"], to: 62)
        try assertFailing(["tokenizer.vocab_size"], export,
                          saying: ["tokenizer.vocab_size": "tokenizer.json has 63 ids but tokenizer.vocab_size is 64"])
    }

    /// Embedding rows past the tokenizer are padding (Qwen3: 151936 rows, 151669 tokens).
    func testTokenizerWithFewerIDsThanTheVocabularyPasses() throws {
        var smaller = SyntheticExport.defaultTokenizer
        smaller.vocab["w62"] = nil
        smaller.addedTokens = [Token(id: 62, content: "<mask>")]
        var export = try export(smaller)
        export.setMetadata(["speculative_decoding", "mask_token_id"], to: 62)
        export.setMetadata(["tokenizer", "vocab_size"], to: 63)
        export.setMetadata(["tokenizer", "special_tokens"], to: ["<mask>": 62])
        try assertFailing([], export, saying: [
            "tokenizer.vocab_size": "tokenizer.json has ids 0..62 = tokenizer.vocab_size, vocab_size 64",
        ])
    }

    func testMetadataTokenizerVocabSizeDifferingFailsVocabSize() throws {
        var export = try export()
        export.setMetadata(["tokenizer", "vocab_size"], to: 65)
        try assertFailing(["tokenizer.vocab_size"], export, saying: [
            "tokenizer.vocab_size": "tokenizer.vocab_size 65 exceeds vocab_size 64",
        ])
    }

    func testIDsWithAHoleFailVocabSize() throws {
        var tokenizer = SyntheticExport.defaultTokenizer
        tokenizer.vocab["w10"] = nil
        tokenizer.vocab["w64"] = Self.vocab  // 64 distinct ids, but not 0..63
        try assertFailing(["tokenizer.vocab_size"], try export(tokenizer), saying: [
            "tokenizer.vocab_size": "tokenizer.json: its 64 distinct ids are not 0..63: the largest is 64, so 1 id is missing (10)",
        ])
    }

    func testNegativeIDsFailVocabSize() throws {
        var tokenizer = SyntheticExport.defaultTokenizer
        tokenizer.vocab["w0"] = -1
        try assertFailing(["tokenizer.vocab_size"], try export(tokenizer),
                          saying: ["tokenizer.vocab_size": "negative ids [-1]"])
    }

    // MARK: tokenizer.mask_token

    func testMaskTokenThatIsNotSpecialInTokenizerJSONFailsMaskToken() throws {
        var tokenizer = SyntheticExport.defaultTokenizer
        tokenizer.addedTokens = [Token(id: Self.mask, content: "<mask>", special: false)]
        var export = try export(tokenizer)
        export.setMetadata(["tokenizer", "special_tokens"], to: ["<mask>": Self.mask])
        try assertFailing(["tokenizer.mask_token"], export, saying: [
            "tokenizer.mask_token": "mask_token_id 63 is tokenizer.json's added token \"<mask>\", which is not special",
        ])
    }

    func testMaskTokenIDThatIsAnOrdinaryWordFailsMaskToken() throws {
        var export = try export()
        export.setMetadata(["speculative_decoding", "mask_token_id"], to: 5)
        try assertFailing(["tokenizer.mask_token"], export, saying: [
            "tokenizer.mask_token": "mask_token_id 5 is not in tokenizer.special_tokens (\"<mask>\"=63); "
                + "mask_token_id 5 is not an added token of tokenizer.json (special tokens: \"<mask>\"=63)",
        ])
    }

    func testMaskTokenMissingFromMetadataSpecialTokensFailsMaskToken() throws {
        var export = try export()
        export.setMetadata(["tokenizer", "special_tokens"], to: [String: Int]())
        try assertFailing(["tokenizer.mask_token"], export,
                          saying: ["tokenizer.mask_token": "mask_token_id 63 is not in tokenizer.special_tokens (none)"])
        export.setMetadata(["tokenizer", "special_tokens"], to: ["[MASK]": Self.mask])
        try assertFailing(["tokenizer.mask_token"], export, saying: [
            "tokenizer.mask_token": "tokenizer.special_tokens calls id 63 \"[MASK]\" but tokenizer.json calls it \"<mask>\"",
        ])
    }
}
