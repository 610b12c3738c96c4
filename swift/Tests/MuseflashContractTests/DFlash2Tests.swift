import XCTest
import Foundation
import ExportMetadata
import MuseflashContract
import TestSupport

/// The DFlash2 drafter kind: a DFlash bundle whose metadata has `speculative_decoding.dflash2`
/// and whose `draft` also outputs `draft_tokens`, int32 [1, block_size - 1].
final class DFlash2ContractTests: XCTestCase {
    private var export = SyntheticExport.fusedTargetWithDFlash2Drafter()

    private func report() throws -> ContractReport {
        try ContractAssertions.check(export)
    }

    private func assertFailing(_ failing: Set<String>, _ export: SyntheticExport? = nil,
                               file: StaticString = #filePath, line: UInt = #line) throws {
        let report = try ContractAssertions.check(export ?? self.export)
        ContractAssertions.assertFailing(failing, in: report, file: file, line: line)
    }

    private func setDFlash2(_ key: String, to value: Any) {
        export.setMetadata(["speculative_decoding", "dflash2", key], to: value)
    }

    // MARK: A valid bundle

    /// The same properties as a DFlash bundle, all holding.
    func testValidDFlash2BundlePassesEveryProperty() throws {
        let report = try report()
        ContractAssertions.assertFailing([], in: report)
        XCTAssertTrue(report.allHold)
        XCTAssertEqual(report.metadata?.speculativeDecoding?.drafterKind, .dflash2)
        XCTAssertEqual(report.packages[.dflashDrafter]?.function(named: "draft")?.outputs.map(\.name),
                       ["logits", "draft_tokens"])
    }

    func testSummaryShowsTheDFlash2Settings() throws {
        let summary = try report().summaryLines.joined(separator: "\n")
        for fragment in ["speculative decoding: dflash2", "conv_kernel_size 3", "conv_group_size 4", "selector_rank 6",
                         "selector_top_k 5", "selector_decoding greedy", "output_multiplier 0.5",
                         "final_logit_softcapping 20.0", "out   draft_tokens: int32 [1, 3]"] {
            XCTAssertTrue(summary.contains(fragment), "missing \"\(fragment)\" in\n\(summary)")
        }
        let dflash = try ContractAssertions.check(.fusedTargetWithDFlashDrafter()).summaryLines.joined(separator: "\n")
        XCTAssertFalse(dflash.contains("selector_top_k"), dflash)
    }

    func testSettingsAtTheirBoundsPass() throws {
        setDFlash2("conv_kernel_size", to: Int(SyntheticExport.Size.blockSize))
        setDFlash2("conv_group_size", to: Int(SyntheticExport.Size.drafterHidden))
        setDFlash2("selector_top_k", to: Int(SyntheticExport.Size.vocab))
        setDFlash2("selector_rank", to: 1)
        setDFlash2("final_logit_softcapping", to: NSNull())
        try assertFailing([])
    }

    // MARK: drafter.draft_tokens

    func testMissingDraftTokensFailsDraftTokens() throws {
        export.editFunction(role: "dflash_drafter", "draft") { $0.outputs.removeAll { $0.name == "draft_tokens" } }
        let report = try report()
        // metadata.json still declares the output, so the function map disagrees too.
        ContractAssertions.assertFailing(["drafter.draft_tokens", "dflash_drafter.function_map"], in: report)
        XCTAssertTrue(ContractAssertions.detail("drafter.draft_tokens", in: report).contains("no output draft_tokens"))
    }

    func testDraftTokensOfTheWholeBlockFailDraftTokens() throws {
        export.editFunction(role: "dflash_drafter", "draft") { $0.outputs[1].shape = [1, SyntheticExport.Size.blockSize] }
        try assertFailing(["drafter.draft_tokens"])
    }

    func testDraftTokensWithoutTheBatchAxisFailDraftTokens() throws {
        export.editFunction(role: "dflash_drafter", "draft") { $0.outputs[1].shape = [SyntheticExport.Size.blockSize - 1] }
        try assertFailing(["drafter.draft_tokens"])
    }

    func testFloat16DraftTokensFailDraftTokens() throws {
        export.editFunction(role: "dflash_drafter", "draft") { $0.outputs[1].dataType = TensorSpec.float16 }
        let report = try report()
        ContractAssertions.assertFailing(["drafter.draft_tokens"], in: report)
        XCTAssertTrue(ContractAssertions.detail("drafter.draft_tokens", in: report).contains("fp16"))
    }

    /// The draft_tokens shape follows block_size, as the logits and the verifying main do.
    func testLargerBlockSizeFailsBothDraftOutputsAndMain() throws {
        export.setMetadata(["speculative_decoding", "block_size"], to: 5)
        try assertFailing(["drafter.draft_signature", "target.inputs", "drafter.draft_tokens"])
    }

    func testDFlashDrafterWithDraftTokensFailsDraftTokens() throws {
        var dflash = SyntheticExport.fusedTargetWithDFlashDrafter()
        dflash.editFunction(role: "dflash_drafter", "draft") {
            $0.outputs.append(TensorSpec("draft_tokens", [1, SyntheticExport.Size.blockSize - 1], TensorSpec.int32))
        }
        try assertFailing(["drafter.draft_tokens", "dflash_drafter.function_map"], dflash)
        // Declared in metadata.json as well: the function map agrees, the drafter kind does not.
        dflash.setMetadata(["assets", "dflash_drafter", "functions", "draft", "outputs"], to: ["logits", "draft_tokens"])
        try assertFailing(["drafter.draft_tokens", "metadata.drafter_kind"], dflash)
    }

    // MARK: metadata.drafter_kind

    func testDFlash2KindWithoutSettingsFailsDrafterKind() throws {
        setDFlash2Block(to: NSNull())
        try assertFailing(["metadata.drafter_kind"])
        export.removeMetadata(["speculative_decoding", "dflash2"])
        let report = try report()
        ContractAssertions.assertFailing(["metadata.drafter_kind"], in: report)
        XCTAssertTrue(ContractAssertions.detail("metadata.drafter_kind", in: report).contains("dflash2"))
    }

    func testDFlashKindWithSettingsFailsDrafterKind() throws {
        var dflash = SyntheticExport.fusedTargetWithDFlashDrafter()
        dflash.setMetadata(["speculative_decoding", "dflash2"], to: SyntheticExport.dflash2Settings)
        try assertFailing(["metadata.drafter_kind"], dflash)
        dflash.setMetadata(["speculative_decoding", "dflash2"], to: NSNull())
        try assertFailing([], dflash)
    }

    func testRingKindWithSettingsFailsDrafterKind() throws {
        var ring = SyntheticExport.targetWithRingDrafter()
        ContractAssertions.assertFailing([], in: try ContractAssertions.check(ring),
                                         expected: ContractAssertions.ringBundleProperties)
        ring.setMetadata(["speculative_decoding", "dflash2"], to: SyntheticExport.dflash2Settings)
        ContractAssertions.assertFailing(["metadata.drafter_kind"], in: try ContractAssertions.check(ring),
                                         expected: ContractAssertions.ringBundleProperties)
    }

    /// The kind alone changed to dflash: the settings, the declared draft outputs and the
    /// package's draft_tokens all belong to the other kind.
    func testDFlash2BundleDeclaredAsDFlashFails() throws {
        export.setMetadata(["speculative_decoding", "drafter_kind"], to: "dflash")
        try assertFailing(["metadata.drafter_kind", "drafter.draft_tokens"])
    }

    func testSelectorTopKBeyondTheVocabularyFailsDrafterKind() throws {
        setDFlash2("selector_top_k", to: Int(SyntheticExport.Size.vocab) + 1)
        let report = try report()
        ContractAssertions.assertFailing(["metadata.drafter_kind"], in: report)
        XCTAssertTrue(ContractAssertions.detail("metadata.drafter_kind", in: report).contains("selector_top_k"))
    }

    func testConvGroupSizeNotDividingDrafterHiddenSizeFailsDrafterKind() throws {
        setDFlash2("conv_group_size", to: 3)
        let report = try report()
        ContractAssertions.assertFailing(["metadata.drafter_kind"], in: report)
        XCTAssertTrue(ContractAssertions.detail("metadata.drafter_kind", in: report).contains("conv_group_size"))
    }

    func testConvKernelLongerThanTheBlockFailsDrafterKind() throws {
        setDFlash2("conv_kernel_size", to: Int(SyntheticExport.Size.blockSize) + 1)
        try assertFailing(["metadata.drafter_kind"])
    }

    func testNonPositiveCountsFailDrafterKind() throws {
        for key in ["conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k"] {
            for value in [0, -2] {
                export = SyntheticExport.fusedTargetWithDFlash2Drafter()
                setDFlash2(key, to: value)
                let report = try report()
                XCTAssertEqual(report.failures.map(\.name), ["metadata.drafter_kind"], "\(key) \(value)")
                XCTAssertTrue(ContractAssertions.detail("metadata.drafter_kind", in: report).contains(key), "\(key) \(value)")
            }
        }
    }

    func testNonPositiveOutputMultiplierFailsDrafterKind() throws {
        for value in [0.0, -0.5] {
            setDFlash2("output_multiplier", to: value)
            try assertFailing(["metadata.drafter_kind"])
        }
    }

    func testNonPositiveSoftcappingFailsDrafterKind() throws {
        for value in [0.0, -30.0] {
            setDFlash2("final_logit_softcapping", to: value)
            try assertFailing(["metadata.drafter_kind"])
        }
    }

    /// Declared draft outputs are exactly [logits, draft_tokens], in that order.
    func testDeclaredDraftOutputsOtherThanTheKindsFailDrafterKind() throws {
        let outputs = ["assets", "dflash_drafter", "functions", "draft", "outputs"]
        export.setMetadata(outputs, to: ["draft_tokens", "logits"])
        try assertFailing(["metadata.drafter_kind"])  // the function map ignores order
        export.setMetadata(outputs, to: ["logits"])
        try assertFailing(["metadata.drafter_kind", "dflash_drafter.function_map"])
    }

    private func setDFlash2Block(to value: Any) {
        export.setMetadata(["speculative_decoding", "dflash2"], to: value)
    }
}

/// Reading `speculative_decoding.dflash2` and the names DFlash2 adds.
final class DFlash2MetadataDecodingTests: XCTestCase {
    private func metadataData(_ export: SyntheticExport = .fusedTargetWithDFlash2Drafter(),
                              _ edit: (inout SyntheticExport) -> Void = { _ in }) throws -> Data {
        var export = export
        edit(&export)
        return Data(try export.metadataText().utf8)
    }

    private func decodingError(_ edit: (inout SyntheticExport) -> Void) throws -> ExportMetadataError? {
        do {
            _ = try ExportMetadata.decode(from: try metadataData(.fusedTargetWithDFlash2Drafter(), edit))
            XCTFail("decoding succeeded")
            return nil
        } catch let error as ExportMetadataError {
            return error
        }
    }

    func testDFlash2MetadataDecodesEveryField() throws {
        let metadata = try ExportMetadata.decode(from: try metadataData())
        let speculative = try XCTUnwrap(metadata.speculativeDecoding)
        XCTAssertEqual(speculative.drafterKind, .dflash2)
        XCTAssertEqual(speculative.drafterKind.assetRole, .dflashDrafter)
        XCTAssertEqual(speculative.dflash2, ExportMetadata.DFlash2Settings(
            convKernelSize: 3, convGroupSize: 4, selectorRank: 6, selectorTopK: 5, selectorDecoding: .greedy,
            outputMultiplier: 0.5, finalLogitSoftcapping: 20.0))
        let drafter = try XCTUnwrap(metadata.assets[.dflashDrafter])
        XCTAssertEqual(drafter.kind, .dflashDrafter)
        XCTAssertEqual(drafter.functions[.draft]?.outputs, [.logits, .draftTokens])
        XCTAssertEqual(drafter.functions[.injectKV]?.outputs, [.lastInjectedPosition])
    }

    func testNullAndAbsentSettingsDecodeAsNil() throws {
        let dflash = SyntheticExport.fusedTargetWithDFlashDrafter()
        XCTAssertNil(try ExportMetadata.decode(from: try metadataData(dflash)).speculativeDecoding?.dflash2)
        let null = try ExportMetadata.decode(from: try metadataData(dflash) {
            $0.setMetadata(["speculative_decoding", "dflash2"], to: NSNull())
        })
        XCTAssertNotNil(null.speculativeDecoding)
        XCTAssertNil(null.speculativeDecoding?.dflash2)
        let noSoftcapping = try ExportMetadata.decode(from: try metadataData {
            $0.setMetadata(["speculative_decoding", "dflash2", "final_logit_softcapping"], to: NSNull())
        })
        XCTAssertNotNil(noSoftcapping.speculativeDecoding?.dflash2)
        XCTAssertNil(noSoftcapping.speculativeDecoding?.dflash2?.finalLogitSoftcapping)
    }

    func testUnknownSelectorDecodingIsRejectedNamingItsPath() throws {
        for spelling in ["beam", "Greedy", "sample"] {
            let error = try decodingError { $0.setMetadata(["speculative_decoding", "dflash2", "selector_decoding"], to: spelling) }
            guard case .invalidValue(_, let keyPath, let reason)? = error else {
                XCTFail("\(spelling): \(String(describing: error))")
                continue
            }
            XCTAssertEqual(keyPath, "speculative_decoding.dflash2.selector_decoding")
            XCTAssertTrue(reason.hasPrefix("unknown "), reason)
            XCTAssertTrue(reason.contains("\"\(spelling)\""), reason)
        }
    }

    func testMissingOrMistypedSettingIsNamedByItsPath() throws {
        for key in ["conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k", "selector_decoding",
                    "output_multiplier"] {
            let error = try decodingError { $0.removeMetadata(["speculative_decoding", "dflash2", key]) }
            XCTAssertEqual(error, .missingKey(path: "metadata.json", keyPath: "speculative_decoding.dflash2.\(key)"))
        }
        let wrongType = try decodingError { $0.setMetadata(["speculative_decoding", "dflash2", "selector_rank"], to: "six") }
        guard case .wrongType(_, let keyPath, _)? = wrongType else { return XCTFail("\(String(describing: wrongType))") }
        XCTAssertEqual(keyPath, "speculative_decoding.dflash2.selector_rank")
    }

    func testUnknownKeysInsideSettingsAreIgnored() throws {
        let plain = try ExportMetadata.decode(from: try metadataData())
        let extended = try ExportMetadata.decode(from: try metadataData {
            $0.setMetadata(["speculative_decoding", "dflash2", "added_later"], to: ["nested": [1, 2]])
        })
        XCTAssertEqual(extended, plain)
    }

    /// Encoding gives back the JSON that was decoded; a null `dflash2`, as Python writes it for
    /// the other kinds, is left out like every nil optional.
    func testEncodingRoundTrips() throws {
        let decode = { (data: Data) in try JSONDecoder().decode(JSONValue.self, from: data) }
        let data = try metadataData()
        XCTAssertEqual(try decode(try JSONEncoder().encode(try ExportMetadata.decode(from: data))), try decode(data))

        let withNull = try metadataData(.fusedTargetWithDFlashDrafter()) {
            $0.setMetadata(["speculative_decoding", "dflash2"], to: NSNull())
        }
        let encoded = try JSONEncoder().encode(try ExportMetadata.decode(from: withNull))
        XCTAssertEqual(try decode(encoded), try decode(try metadataData(.fusedTargetWithDFlashDrafter())))
    }
}
