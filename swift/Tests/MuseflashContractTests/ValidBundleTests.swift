import XCTest
import Foundation
import ExportMetadata
import MuseflashContract
import TestSupport

final class ValidBundleTests: XCTestCase {
    func testFusedTargetWithDFlashDrafterPassesEveryProperty() throws {
        let report = try ContractAssertions.check(.fusedTargetWithDFlashDrafter())
        ContractAssertions.assertFailing([], in: report)
        XCTAssertTrue(report.allHold)
        XCTAssertEqual(report.passedCount, ContractAssertions.dflashBundleProperties.count)
        XCTAssertEqual(report.failedCount, 0)
    }

    func testTargetWithSingleFunctionRingDrafterPassesEveryProperty() throws {
        let report = try ContractAssertions.check(.targetWithRingDrafter())
        ContractAssertions.assertFailing([], in: report, expected: ContractAssertions.ringBundleProperties)
        XCTAssertEqual(report.packages[.ringDrafter]?.functionNames, [ExportMetadata.FunctionName.main.rawValue])
        XCTAssertEqual(report.packages[.ringDrafter]?.defaultFunctionName, ExportMetadata.FunctionName.main.rawValue)
    }

    func testSummaryShowsInterfacesAndKeyValues() throws {
        let summary = try ContractAssertions.check(.fusedTargetWithDFlashDrafter()).summaryLines.joined(separator: "\n")
        for fragment in [
            "Model: muse-glimmer-demo (schema 1, museflash 0.1.0)",
            "vocab_size 64, context_length 32",
            "speculative decoding: dflash, block_size 4",
            "Asset dflash_drafter (dflash_drafter): dflash_drafter.mlpackage",
            "function inject_kv",
            "in    features: fp16 [1, 8, 16]",
            "out   logits: fp16 [1, 4, 64]",
            "state globalKeyCache: state fp16 [1, 1, 32, 8]",
        ] {
            XCTAssertTrue(summary.contains(fragment), "missing \"\(fragment)\" in\n\(summary)")
        }
    }

    func testEmbeddedMetadataIsComparedAsJSONNotAsText() throws {
        var export = SyntheticExport.fusedTargetWithDFlashDrafter()
        let text = try export.metadataText()
        let reformatted = try JSONSerialization.data(
            withJSONObject: try JSONSerialization.jsonObject(with: Data(text.utf8)), options: [.prettyPrinted])
        export.packages["dflash_drafter"]?.embeddedMetadata = String(decoding: reformatted, as: UTF8.self)
        XCTAssertNotEqual(export.packages["dflash_drafter"]?.embeddedMetadata, text)
        ContractAssertions.assertFailing([], in: try ContractAssertions.check(export))
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
