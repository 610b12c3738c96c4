import XCTest
import Foundation
import MuseflashContract
import TestSupport

/// metadata.json disagreeing with packages that are themselves well formed.
/// Unless a test says otherwise the packages embed the changed metadata too,
/// so only the changed value is wrong.
final class MetadataViolationTests: XCTestCase {
    private var export = SyntheticExport.fusedTargetWithDFlashDrafter()

    private func report() throws -> ContractReport {
        try ContractAssertions.check(export)
    }

    /// check-contract reports a bundle the export did not self-check (docs/fp16.md, section 4),
    /// without failing it, and fails a record that claims a check of no function.
    func testSelfCheckRecordIsReported() throws {
        export.setMetadata(["self_check"], to: ["checked": false, "reason": "--no-self-check"])
        var report = try report()
        XCTAssertTrue(report.result(named: "metadata.self_check")?.holds ?? false)
        XCTAssertTrue(ContractAssertions.detail("metadata.self_check", in: report).hasPrefix("NOT self-checked"))
        XCTAssertTrue(ContractAssertions.detail("metadata.self_check", in: report).contains("--no-self-check"))
        export.setMetadata(["self_check"], to: ["checked": true, "functions": ["prefill", "main"]])
        report = try self.report()
        XCTAssertTrue(report.result(named: "metadata.self_check")?.holds ?? false)
        XCTAssertFalse(ContractAssertions.detail("metadata.self_check", in: report).contains("NOT"))
        export.setMetadata(["self_check"], to: ["checked": true, "functions": [String]()])
        report = try self.report()
        ContractAssertions.assertFailing(["metadata.self_check"], in: report)
    }

    func testWrongVocabSizeFailsEveryLogitsWidthCheck() throws {
        export.setMetadata(["vocab_size"], to: 65)
        let report = try report()
        ContractAssertions.assertFailing(["target.outputs", "drafter.draft_signature"], in: report)
        XCTAssertTrue(ContractAssertions.detail("target.outputs", in: report).contains("vocab_size = 65"))
    }

    /// The block is the query length of draft and of the main call that verifies it.
    func testWrongBlockSizeFailsDraftSignatureAndTheVerifyingMain() throws {
        export.setMetadata(["speculative_decoding", "block_size"], to: 5)
        let report = try report()
        ContractAssertions.assertFailing(["drafter.draft_signature", "target.inputs"], in: report)
        XCTAssertTrue(ContractAssertions.detail("target.inputs", in: report).contains("block_size = 5"))
    }

    func testMainQueryLengthOtherThanTheBlockFailsTargetInputs() throws {
        export.setMetadata(["assets", "target", "functions", "main", "query_length"], to: 1)
        let report = try report()
        XCTAssertFalse(try XCTUnwrap(report.result(named: "target.inputs")).holds)
        XCTAssertTrue(ContractAssertions.detail("target.inputs", in: report).contains("query_length 1"))
    }

    func testDrafterWindowBeyondRingCapacityFailsDrafterStates() throws {
        export.setMetadata(["speculative_decoding", "drafter", "sliding_window"], to: 17)
        let report = try report()
        ContractAssertions.assertFailing(["dflash_drafter.states"], in: report)
        XCTAssertTrue(ContractAssertions.detail("dflash_drafter.states", in: report).contains("sliding_window 17"))
    }

    func testContextLengthDifferentFromGlobalCapacityFailsTargetStates() throws {
        export.setMetadata(["context_length"], to: 64)
        ContractAssertions.assertFailing(["target.states"], in: try report())
    }

    func testLayerTypesDisagreeingWithCacheDepthFailTargetStates() throws {
        export.setMetadata(["target", "layer_types"], to: ["sliding_attention", "sliding_attention", "full_attention", "full_attention"])
        ContractAssertions.assertFailing(["target.states"], in: try report())
    }

    func testUnsupportedSchemaVersionFailsSchemaVersion() throws {
        for version in [4, 17] {
            export.setMetadata(["schema_version"], to: version)
            let report = try report()
            ContractAssertions.assertFailing(["metadata.schema_version"], in: report)
            XCTAssertTrue(ContractAssertions.detail("metadata.schema_version", in: report).contains("schema_version \(version)"))
        }
    }

    func testFutureSchemaThatNoLongerDecodesReportsOnlyTheVersion() throws {
        export.metadata = ["schema_version": 4, "everything": "different"]
        let report = try report()
        XCTAssertEqual(report.results.map(\.name), ["metadata.schema_version"])
        XCTAssertFalse(report.allHold)
        XCTAssertNil(report.metadata)
    }

    func testMissingAssetFailsAssetsExistAndEverythingAboutIt() throws {
        let separate = SyntheticExport.fusedTargetWithSeparateDFlashDrafter()
        let report = try ContractAssertions.check(separate) { directory in
            try FileManager.default.removeItem(at: ContractAssertions.packageURL(directory, role: "dflash_drafter"))
        }
        ContractAssertions.assertFailing([
            "metadata.assets_exist", "dflash_drafter.embedded_metadata", "package.functions", "target.drafter_vocab_agree",
            "drafter.functions", "drafter.shared_states", "drafter.inject_kv_signature", "drafter.draft_signature",
            "drafter.draft_tokens", "dflash_drafter.states", "dflash_drafter.function_map", "dflash_drafter.compression.ops_declared",
            "dflash_drafter.weight_file",
        ], in: report, expected: ContractAssertions.separateDFlashBundleProperties)
        XCTAssertTrue(ContractAssertions.detail("drafter.functions", in: report).contains("see metadata.assets_exist"))
    }

    /// The package the target and the drafter share is missing: everything about either fails.
    func testMissingSharedPackageFailsEverythingAboutBothAssets() throws {
        let report = try ContractAssertions.check(export) { directory in
            try FileManager.default.removeItem(at: ContractAssertions.packageURL(directory, role: "target"))
        }
        let expected = ContractAssertions.dflashBundleProperties
        // The metadata-only properties hold without any package.
        ContractAssertions.assertFailing(Set(expected).subtracting(["metadata.schema_version", "metadata.drafter_kind",
                                                                    "metadata.self_check"]),
                                         in: report)
        let missing = ContractAssertions.detail("metadata.assets_exist", in: report)
        XCTAssertTrue(missing.contains("target, dflash_drafter: target.mlpackage does not exist"), missing)
        XCTAssertTrue(ContractAssertions.detail("drafter.functions", in: report).contains("shared with target"))
    }

    /// Before schema version 3 every asset has a package of its own.
    func testAssetsSharingAPackageBeforeSchemaVersionThreeFailAssetsExist() throws {
        for version in [1, 2] {
            export.setMetadata(["schema_version"], to: version)
            let report = try report()
            XCTAssertEqual(report.result(named: "metadata.assets_exist")?.holds, false, report.verdictLines.joined(separator: "\n"))
            XCTAssertTrue(ContractAssertions.detail("metadata.assets_exist", in: report)
                .contains("target and dflash_drafter name the same package target.mlpackage"))
            // Read as two packages, each has functions its asset does not list.
            XCTAssertEqual(report.result(named: "package.functions")?.holds, false)
            XCTAssertNotNil(report.result(named: "dflash_drafter.embedded_metadata"))
        }
    }

    func testAssetPathLeavingTheExportDirectoryFailsAssetsExist() throws {
        export.setMetadata(["assets", "dflash_drafter", "path"], to: "../dflash_drafter.mlpackage")
        let report = try report()
        XCTAssertFalse(try XCTUnwrap(report.result(named: "metadata.assets_exist")).holds)
        XCTAssertTrue(ContractAssertions.detail("metadata.assets_exist", in: report).contains("not a relative path inside"))
    }

    func testEmbeddedMetadataDifferingFailsOnlyThatPackage() throws {
        var separate = SyntheticExport.fusedTargetWithSeparateDFlashDrafter()
        var changed = separate
        changed.setMetadata(["speculative_decoding", "num_draft_tokens"], to: 2)
        separate.packages["dflash_drafter"]?.embeddedMetadata = try changed.metadataText()
        let report = try ContractAssertions.check(separate)
        ContractAssertions.assertFailing(["dflash_drafter.embedded_metadata"], in: report,
                                         expected: ContractAssertions.separateDFlashBundleProperties)
        XCTAssertTrue(ContractAssertions.detail("dflash_drafter.embedded_metadata", in: report)
            .contains("speculative_decoding.num_draft_tokens: 3 vs 2"))
    }

    /// The shared package's embedded metadata is checked once, as its owner's.
    func testSharedPackageEmbeddedMetadataDifferingFailsTheOwnersProperty() throws {
        var changed = export
        changed.setMetadata(["speculative_decoding", "num_draft_tokens"], to: 2)
        export.packages["target"]?.embeddedMetadata = try changed.metadataText()
        ContractAssertions.assertFailing(["target.embedded_metadata"], in: try report())
    }

    func testEmbeddedMetadataThatIsNotJSONFails() throws {
        export.packages["target"]?.embeddedMetadata = "{\"schema_version\": 1,"
        ContractAssertions.assertFailing(["target.embedded_metadata"], in: try report())
    }

    func testFunctionIONamesDifferingFromMetadataFailFunctionMap() throws {
        export.setMetadata(["assets", "dflash_drafter", "functions", "inject_kv", "outputs"], to: ["logits"])
        ContractAssertions.assertFailing(["dflash_drafter.function_map"], in: try report())
    }

    /// The target lists `main` and `verify` (a known name, of no function of the package) instead
    /// of `main` and `prefill`: the function map misses it, and the package has a function no
    /// asset lists.
    func testFunctionMissingFromThePackageFailsFunctionMap() throws {
        var ring = SyntheticExport.targetWithRingDrafter()
        let target = try XCTUnwrap((ring.metadata["assets"] as? [String: Any])?["target"] as? [String: Any])
        var functions = try XCTUnwrap(target["functions"] as? [String: Any])
        functions["draft"] = functions.removeValue(forKey: "prefill")
        ring.setMetadata(["assets", "target", "functions"], to: functions)
        let report = try ContractAssertions.check(ring)
        ContractAssertions.assertFailing(["target.function_map", "package.functions"], in: report,
                                         expected: ContractAssertions.ringBundleProperties)
        XCTAssertTrue(ContractAssertions.detail("target.function_map", in: report).contains("metadata lists function draft"))
        let functionsDetail = ContractAssertions.detail("package.functions", in: report)
        XCTAssertTrue(functionsDetail.contains("prefill"), functionsDetail)
    }

    /// Names are closed, so an unknown one is unreadable input rather than a verdict.
    func testUnknownNameInMetadataIsUnreadableInput() throws {
        export.setMetadata(["assets", "dflash_drafter", "functions", "draft_v2"], to: ["role": "draft"])
        let error = try ContractAssertions.inputError(export) { _ in }
        guard case .metadata(.invalidValue(_, let keyPath, let reason))? = error else {
            return XCTFail("expected an invalid value, got \(String(describing: error))")
        }
        XCTAssertEqual(keyPath, "assets.dflash_drafter.functions.draft_v2")
        XCTAssertTrue(reason.contains("unknown function name \"draft_v2\""), reason)
    }

    func testDefaultFunctionDifferingFromMetadataFailsFunctionMap() throws {
        export.setMetadata(["assets", "target", "default_function"], to: "prefill")
        ContractAssertions.assertFailing(["target.function_map"], in: try report())
    }

    func testMalformedStateEntryFailsStates() throws {
        let data = try JSONSerialization.data(withJSONObject: export.metadata)
        var metadata = try XCTUnwrap(JSONSerialization.jsonObject(with: data) as? [String: Any])
        var assets = try XCTUnwrap(metadata["assets"] as? [String: Any])
        var target = try XCTUnwrap(assets["target"] as? [String: Any])
        var states = try XCTUnwrap(target["states"] as? [[String: Any]])
        states[0]["shape"] = [1, 32, 1, 8]
        target["states"] = states
        assets["target"] = target
        metadata["assets"] = assets
        export.metadata = metadata
        ContractAssertions.assertFailing(["target.states"], in: try report())
    }
}
