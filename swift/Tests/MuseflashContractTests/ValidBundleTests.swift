import XCTest
import Foundation
import ExportMetadata
import MuseflashContract
import TestSupport

final class ValidBundleTests: XCTestCase {
    /// Schema version 3: the fused target and the DFlash drafter in one package, read once.
    func testFusedTargetWithDFlashDrafterPassesEveryProperty() throws {
        let report = try ContractAssertions.check(.fusedTargetWithDFlashDrafter())
        ContractAssertions.assertFailing([], in: report)
        XCTAssertTrue(report.allHold)
        XCTAssertEqual(report.passedCount, ContractAssertions.dflashBundleProperties.count)
        XCTAssertEqual(report.failedCount, 0)
        XCTAssertEqual(report.metadata?.schemaVersion, 3)
        let shared = try XCTUnwrap(report.packages[.target])
        XCTAssertEqual(report.packages[.dflashDrafter], shared)
        XCTAssertEqual(shared.functionNames, ["main", "prefill", "inject_kv", "draft"])
        XCTAssertEqual(shared.defaultFunctionName, "main")
        XCTAssertEqual(report.metadata?.packages, [ExportMetadata.Package(path: "target.mlpackage",
                                                                          roles: [.target, .dflashDrafter])])
    }

    /// What each kind of bundle must be checked for, whatever else the checker grows: the lists
    /// in ContractAssertions come from the checker itself, so this pins them from outside.
    func testEachKindOfBundleIsCheckedForWhatItMustBe() {
        let everyBundle: Set = ["metadata.schema_version", "metadata.assets_exist", "metadata.drafter_kind",
                                "package.functions", "target.inputs", "target.outputs", "target.states",
                                "target.function_map", "target.embedded_metadata", "target.weight_file"]
        let dflash = everyBundle.union(["drafter.functions", "drafter.shared_states", "drafter.inject_kv_signature",
                                        "drafter.draft_signature", "drafter.draft_tokens", "dflash_drafter.states",
                                        "dflash_drafter.function_map"])
        let ownPackage: Set = ["dflash_drafter.embedded_metadata", "dflash_drafter.weight_file"]
        let compressed: Set = ["metadata.compression", "target.compression.ops_declared",
                               "target.compression.stored_compressed", "target.compression.bytes",
                               "target.compression.functions_agree"]
        let cases: [(String, [String], Set<String>, Set<String>)] = [
            ("dflash", ContractAssertions.dflashBundleProperties, dflash, ownPackage.union(["metadata.compression"])),
            ("separate dflash", ContractAssertions.separateDFlashBundleProperties, dflash.union(ownPackage), []),
            ("compressed dflash", ContractAssertions.compressedDFlashBundleProperties, dflash.union(compressed), ownPackage),
            ("compressed separate dflash", ContractAssertions.compressedSeparateDFlashBundleProperties,
             dflash.union(ownPackage).union(compressed).union(["dflash_drafter.compression.stored_compressed"]), []),
            ("ring", ContractAssertions.ringBundleProperties,
             everyBundle.union(["ring_drafter.main_signature", "ring_drafter.states", "ring_drafter.weight_file"]),
             ["drafter.draft_signature", "dflash_drafter.states", "metadata.compression"]),
        ]
        for (kind, properties, required, absent) in cases {
            let ran = Set(properties)
            XCTAssertTrue(required.isSubset(of: ran), "\(kind) bundle is not checked for \(required.subtracting(ran).sorted())")
            XCTAssertTrue(absent.isDisjoint(with: ran), "\(kind) bundle is checked for \(absent.intersection(ran).sorted())")
            XCTAssertTrue(Set(ContractAssertions.tokenizerProperties).isDisjoint(with: ran), "\(kind) has no tokenizer")
        }
    }

    /// Before schema version 3 the DFlash drafter has a package of its own, with `sliding*` states.
    func testSeparateDFlashDrafterOfSchemaVersionsOneAndTwoPassesEveryProperty() throws {
        for version in [1, 2] {
            let report = try ContractAssertions.check(.fusedTargetWithSeparateDFlashDrafter(schemaVersion: version))
            ContractAssertions.assertFailing([], in: report, expected: ContractAssertions.separateDFlashBundleProperties)
            XCTAssertEqual(report.metadata?.schemaVersion, version)
            XCTAssertEqual(report.packages[.dflashDrafter]?.functionNames, ["inject_kv", "draft"])
            XCTAssertEqual(report.packages[.dflashDrafter]?.defaultFunctionName, "draft")
            XCTAssertEqual(report.metadata?.assets[.dflashDrafter]?.states.map(\.name), [.slidingKeyCache, .slidingValueCache])
        }
    }

    /// Version 3 lets assets share a package; it does not require it.
    func testSeparateDFlashDrafterOfSchemaVersionThreePassesEveryProperty() throws {
        let report = try ContractAssertions.check(.fusedTargetWithSeparateDFlashDrafter(schemaVersion: 3))
        ContractAssertions.assertFailing([], in: report, expected: ContractAssertions.separateDFlashBundleProperties)
    }

    func testTargetWithSingleFunctionRingDrafterPassesEveryProperty() throws {
        for version in [1, 2, 3] {
            let report = try ContractAssertions.check(.targetWithRingDrafter(schemaVersion: version))
            ContractAssertions.assertFailing([], in: report, expected: ContractAssertions.ringBundleProperties)
            XCTAssertEqual(report.packages[.ringDrafter]?.functionNames, [ExportMetadata.FunctionName.main.rawValue])
            XCTAssertEqual(report.packages[.ringDrafter]?.defaultFunctionName, ExportMetadata.FunctionName.main.rawValue)
        }
    }

    /// Each distinct package is read once, however many assets it holds.
    func testEachPackageIsReadOnce() throws {
        let directory = try ScratchDirectory.make()
        defer { ScratchDirectory.remove(directory) }
        try SyntheticExport.fusedTargetWithDFlashDrafter().write(to: directory)
        let loaded = LoadLog()
        let checker = ContractChecker { url in
            loaded.urls.append(url.lastPathComponent)
            return try PackageInterface.fromSpecification(at: url)
        }
        XCTAssertTrue(try checker.check(exportDirectory: directory).allHold)
        XCTAssertEqual(loaded.urls, ["target.mlpackage"])

        let separate = directory.appendingPathComponent("separate")
        try SyntheticExport.fusedTargetWithSeparateDFlashDrafter().write(to: separate)
        loaded.urls = []
        XCTAssertTrue(try checker.check(exportDirectory: separate).allHold)
        XCTAssertEqual(loaded.urls, ["target.mlpackage", "dflash_drafter.mlpackage"])
    }

    private final class LoadLog: @unchecked Sendable {
        var urls: [String] = []
    }

    func testSummaryShowsInterfacesAndKeyValues() throws {
        let summary = try ContractAssertions.check(.fusedTargetWithDFlashDrafter()).summaryLines.joined(separator: "\n")
        for fragment in [
            "Model: muse-glimmer-demo (schema 3, museflash 0.1.0)",
            "vocab_size 64, context_length 32",
            "speculative decoding: dflash, block_size 4",
            "Asset dflash_drafter (dflash_drafter): target.mlpackage (shared with target",
            "function inject_kv",
            "in    features: fp16 [1, 8, 16]",
            "out   logits: fp16 [1, 4, 64]",
            "state globalKeyCache: state fp16 [1, 1, 32, 8]",
            "state drafterKeyCache: state fp16 [2, 1, 16, 8]",
        ] {
            XCTAssertTrue(summary.contains(fragment), "missing \"\(fragment)\" in\n\(summary)")
        }
        // Each function of the shared package is shown once, under the asset it belongs to.
        XCTAssertEqual(summary.components(separatedBy: "function draft\n").count - 1, 1, summary)
        XCTAssertEqual(summary.components(separatedBy: "function main\n").count - 1, 1, summary)
        XCTAssertEqual(summary.components(separatedBy: "default function:").count - 1, 1, summary)
    }

    func testEmbeddedMetadataIsComparedAsJSONNotAsText() throws {
        for var export in [SyntheticExport.fusedTargetWithDFlashDrafter(), .fusedTargetWithSeparateDFlashDrafter()] {
            let role = export.packages.keys.sorted().last!
            let text = try export.metadataText()
            let reformatted = try JSONSerialization.data(
                withJSONObject: try JSONSerialization.jsonObject(with: Data(text.utf8)), options: [.prettyPrinted])
            export.packages[role]?.embeddedMetadata = String(decoding: reformatted, as: UTF8.self)
            XCTAssertNotEqual(export.packages[role]?.embeddedMetadata, text)
            let report = try ContractAssertions.check(export)
            XCTAssertTrue(report.allHold, report.verdictLines.joined(separator: "\n"))
        }
    }

    func testUnknownMetadataKeysAreTolerated() throws {
        var export = SyntheticExport.fusedTargetWithDFlashDrafter()
        export.setMetadata(["added_in_a_later_release"], to: ["anything": [1, 2]])
        export.setMetadata(["assets", "target", "notes"], to: "additive")
        ContractAssertions.assertFailing([], in: try ContractAssertions.check(export))
    }

    func testFlexibleDraftInputAdmittingTheBlockPasses() throws {
        var export = SyntheticExport.fusedTargetWithDFlashDrafter()
        export.editFunction(role: "dflash_drafter", "draft") {
            $0.inputs[0].flexibility = SpecBytes.enumeratedShapes([[1, 1], [1, 4], [1, 8]])
        }
        ContractAssertions.assertFailing([], in: try ContractAssertions.check(export))
        export.editFunction(role: "dflash_drafter", "draft") {
            $0.inputs[0].flexibility = SpecBytes.shapeRange([(1, 1), (1, -1)])
        }
        ContractAssertions.assertFailing([], in: try ContractAssertions.check(export))
    }
}
