import XCTest
import Foundation
import MuseflashContract
import TestSupport

/// Packages whose spec disagrees with the contract; metadata.json stays valid.
final class SpecViolationTests: XCTestCase {
    private var export = SyntheticExport.fusedTargetWithDFlashDrafter()

    private func report() throws -> ContractReport {
        try ContractAssertions.check(export)
    }

    func testRenamedTargetFunctionFailsOnlyTheFunctionMaps() throws {
        export.editFunction(role: "target", "prefill") { $0.name = "prefill_chunk" }
        let report = try report()
        ContractAssertions.assertFailing(["target.function_map", "package.functions"], in: report)
        XCTAssertTrue(ContractAssertions.detail("target.function_map", in: report).contains("metadata lists function prefill"))
        let functions = ContractAssertions.detail("package.functions", in: report)
        XCTAssertTrue(functions.contains("prefill_chunk"), functions)
    }

    func testRenamedDraftFunctionFailsEveryPropertyThatNeedsIt() throws {
        export.editFunction(role: "dflash_drafter", "draft") { $0.name = "draft_block" }
        let report = try report()
        ContractAssertions.assertFailing(["drafter.functions", "drafter.shared_states", "drafter.draft_signature",
                                          "drafter.draft_tokens", "target.drafter_vocab_agree", "package.functions",
                                          "dflash_drafter.function_map"], in: report)
        XCTAssertTrue(ContractAssertions.detail("drafter.functions", in: report).contains("draft_block"))
    }

    /// Before schema version 3, the drafter's own package has exactly its two functions.
    func testExtraDrafterFunctionFailsPackageFunctions() throws {
        var separate = SyntheticExport.fusedTargetWithSeparateDFlashDrafter()
        var package = try XCTUnwrap(separate.packages["dflash_drafter"])
        var extra = package.functions[1]
        extra.name = "decode"
        package.functions.append(extra)
        separate.packages["dflash_drafter"] = package
        let report = try ContractAssertions.check(separate)
        ContractAssertions.assertFailing(["package.functions"], in: report,
                                         expected: ContractAssertions.separateDFlashBundleProperties)
        let functions = ContractAssertions.detail("package.functions", in: report)
        XCTAssertTrue(functions.contains("dflash_drafter.mlpackage") && functions.contains("decode"), functions)
    }

    func testTargetStateShapeDisagreeingWithMetadataFailsTargetStates() throws {
        export.editFunction(role: "target", "prefill") { $0.states[2].shape[2] = 12 }
        let report = try report()
        ContractAssertions.assertFailing(["target.states"], in: report)
        XCTAssertTrue(ContractAssertions.detail("target.states", in: report).contains("prefill.slidingKeyCache"))
    }

    func testDrafterFunctionsWithDifferentStateShapesFailSharedStates() throws {
        export.editFunction(role: "dflash_drafter", "draft") { $0.states[0].shape = [2, 1, 24, 8] }
        let report = try report()
        ContractAssertions.assertFailing(["drafter.shared_states", "dflash_drafter.states"], in: report)
        XCTAssertTrue(ContractAssertions.detail("drafter.shared_states", in: report).contains("drafterKeyCache"))
    }

    func testFloat32StateFailsSharedStatesAndStates() throws {
        export.editFunction(role: "dflash_drafter", "inject_kv") { $0.states[1].dataType = TensorSpec.float32 }
        ContractAssertions.assertFailing(["drafter.shared_states", "dflash_drafter.states"], in: try report())
    }

    func testDroppedDrafterFeaturesOutputFailsTargetOutputs() throws {
        export.editFunction(role: "target", "main") { $0.outputs.removeAll { $0.name == "drafter_features" } }
        let report = try report()
        ContractAssertions.assertFailing(["target.outputs", "target.function_map"], in: report)
        XCTAssertTrue(ContractAssertions.detail("target.outputs", in: report).contains("no output drafter_features"))
    }

    func testWrongFeatureWidthFailsInjectKVSignature() throws {
        export.editFunction(role: "dflash_drafter", "inject_kv") { $0.inputs[0].shape = [1, 8, 32] }
        ContractAssertions.assertFailing(["drafter.inject_kv_signature"], in: try report())
    }

    func testDraftInputThatCannotHoldTheBlockFailsDraftSignature() throws {
        export.editFunction(role: "dflash_drafter", "draft") {
            $0.inputs[0].flexibility = SpecBytes.shapeRange([(1, 1), (1, 3)])
        }
        ContractAssertions.assertFailing(["drafter.draft_signature"], in: try report())
    }

    func testDraftLogitsOfTheWrongLengthFailDraftSignature() throws {
        export.editFunction(role: "dflash_drafter", "draft") { $0.outputs[0].shape = [1, 1, 64] }
        ContractAssertions.assertFailing(["drafter.draft_signature"], in: try report())
    }

    func testDrafterVocabularyDifferingFromTargetFailsAgreement() throws {
        export.editFunction(role: "dflash_drafter", "draft") { $0.outputs[0].shape = [1, 4, 65] }
        let report = try report()
        ContractAssertions.assertFailing(["drafter.draft_signature", "target.drafter_vocab_agree"], in: report)
        XCTAssertTrue(ContractAssertions.detail("target.drafter_vocab_agree", in: report).contains("65"))
    }

    func testUndeclaredLogitsShapeCannotPassTargetOutputs() throws {
        export.editFunction(role: "target", "main") { $0.outputs[0].shape = [] }
        ContractAssertions.assertFailing(["target.outputs", "target.drafter_vocab_agree"], in: try report())
    }

    func testMissingPositionIDsFailsTargetInputs() throws {
        export.editFunction(role: "target", "main") { $0.inputs[1].name = "positions" }
        ContractAssertions.assertFailing(["target.inputs", "target.function_map"], in: try report())
    }

    func testRingDrafterWithoutLogitsFailsMainSignature() throws {
        var ring = SyntheticExport.targetWithRingDrafter()
        ring.editFunction(role: "ring_drafter", "main") { $0.outputs[0].name = "scores" }
        let report = try ContractAssertions.check(ring)
        ContractAssertions.assertFailing(["ring_drafter.main_signature", "target.drafter_vocab_agree",
                                          "ring_drafter.function_map"],
                                         in: report, expected: ContractAssertions.ringBundleProperties)
    }
}
