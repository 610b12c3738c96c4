import XCTest
import Foundation
import ExportMetadata
import MuseflashContract
import TestSupport

/// Schema version 3: the fused target and the DFlash drafter are one package, `target.mlpackage`,
/// owned by `target`. Its functions are exactly the union of both assets' functions, its default
/// is the owner's, and each asset's functions bind that asset's states only.
final class SharedPackageTests: XCTestCase {
    private var export = SyntheticExport.fusedTargetWithDFlashDrafter()

    private func report() throws -> ContractReport {
        try ContractAssertions.check(export)
    }

    private func detail(_ name: String, _ report: ContractReport) -> String {
        ContractAssertions.detail(name, in: report)
    }

    /// Replaces the package's functions (the package is under its owner, `target`).
    private func editPackage(_ edit: (inout PackageSpec) -> Void) throws {
        var package = try XCTUnwrap(export.packages["target"])
        edit(&package)
        export.packages["target"] = package
    }

    private func setAsset(_ role: String, _ key: String, to value: Any) {
        export.setMetadata(["assets", role, key], to: value)
    }

    // MARK: The package's functions

    func testSharedPackageMissingDraftFailsEveryPropertyThatNeedsIt() throws {
        try editPackage { $0.functions.removeAll { $0.name == "draft" } }
        let report = try report()
        ContractAssertions.assertFailing(["package.functions", "drafter.functions", "drafter.shared_states",
                                          "drafter.draft_signature", "drafter.draft_tokens", "target.drafter_vocab_agree",
                                          "dflash_drafter.function_map"], in: report)
        let functions = detail("package.functions", report)
        XCTAssertTrue(functions.contains("target.mlpackage (target, dflash_drafter) has no function draft"), functions)
        XCTAssertTrue(detail("drafter.functions", report).contains("[\"draft\"]"), detail("drafter.functions", report))
    }

    /// A function neither asset lists belongs to neither: only the package's function set is wrong.
    func testSharedPackageWithAnUndeclaredFunctionFailsPackageFunctions() throws {
        for source in [1, 3] {  // a copy of prefill (target states) or of draft (drafter states)
            export = SyntheticExport.fusedTargetWithDFlashDrafter()
            try editPackage { package in
                var extra = package.functions[source]
                extra.name = "verify"
                package.functions.append(extra)
            }
            let report = try report()
            ContractAssertions.assertFailing(["package.functions"], in: report)
            XCTAssertTrue(detail("package.functions", report).contains("[\"verify\"] that no asset stored in it lists"),
                          detail("package.functions", report))
            XCTAssertTrue(report.summaryLines.contains("  function verify (listed by no asset)"),
                          report.summaryLines.joined(separator: "\n"))
        }
    }

    /// The target's asset also lists the drafter's `draft`: each asset lists its own functions.
    func testFunctionListedByBothAssetsFailsPackageFunctions() throws {
        let drafter = try XCTUnwrap((export.metadata["assets"] as? [String: Any])?["dflash_drafter"] as? [String: Any])
        let draft = try XCTUnwrap((drafter["functions"] as? [String: Any])?["draft"])
        var functions = try XCTUnwrap(((export.metadata["assets"] as? [String: Any])?["target"] as? [String: Any])?["functions"]
                                      as? [String: Any])
        functions["draft"] = draft
        setAsset("target", "functions", to: functions)
        let report = try report()
        XCTAssertEqual(report.result(named: "package.functions")?.holds, false, report.verdictLines.joined(separator: "\n"))
        XCTAssertTrue(detail("package.functions", report).contains("function draft is listed by both target and dflash_drafter"),
                      detail("package.functions", report))
    }

    // MARK: Default functions

    /// The package's default is its owner's (`target`: `main`), not the drafter's `draft`.
    func testPackageDefaultFunctionOtherThanTheOwnersFailsTheOwnersFunctionMap() throws {
        try editPackage { $0.defaultFunction = "draft" }
        let report = try report()
        ContractAssertions.assertFailing(["target.function_map"], in: report)
        XCTAssertTrue(detail("target.function_map", report).contains("default function is \"draft\""),
                      detail("target.function_map", report))
    }

    /// The owner's default names a function of the other asset: the package default agrees, but
    /// it is not one of the owner's functions.
    func testOwnersDefaultFunctionOfAnotherAssetFailsItsFunctionMap() throws {
        try editPackage { $0.defaultFunction = "draft" }
        setAsset("target", "default_function", to: "draft")
        let report = try report()
        ContractAssertions.assertFailing(["target.function_map"], in: report)
        XCTAssertTrue(detail("target.function_map", report).contains("default_function draft is not one of the asset's functions"),
                      detail("target.function_map", report))
    }

    /// The drafter does not own the package, so its default need not be the package's, but it
    /// must be one of its own functions.
    func testDrafterDefaultFunctionOfTheTargetFailsItsFunctionMap() throws {
        setAsset("dflash_drafter", "default_function", to: "inject_kv")
        ContractAssertions.assertFailing([], in: try report())
        setAsset("dflash_drafter", "default_function", to: "main")
        let report = try report()
        ContractAssertions.assertFailing(["dflash_drafter.function_map"], in: report)
        XCTAssertTrue(detail("dflash_drafter.function_map", report).contains("default_function main"))
    }

    // MARK: States

    /// The drafter's functions bind the target's four states instead of the drafter's two.
    func testDrafterFunctionsBindingTheTargetsStatesFail() throws {
        for name in ["inject_kv", "draft"] {
            export.editFunction(role: "dflash_drafter", name) { $0.states = SyntheticExport.targetStateSpecs }
        }
        let report = try report()
        ContractAssertions.assertFailing(["drafter.shared_states", "dflash_drafter.states"], in: report)
        let shared = detail("drafter.shared_states", report)
        XCTAssertTrue(shared.contains("the dflash_drafter asset's states are [\"drafterKeyCache\", \"drafterValueCache\"]"), shared)
        XCTAssertTrue(detail("dflash_drafter.states", report).contains("function draft binds states"),
                      detail("dflash_drafter.states", report))
    }

    /// Only one of them binds the target's states: the two no longer agree either.
    func testInjectKVBindingTheTargetsStatesFails() throws {
        export.editFunction(role: "dflash_drafter", "inject_kv") { $0.states = SyntheticExport.targetStateSpecs }
        let report = try report()
        ContractAssertions.assertFailing(["drafter.shared_states", "dflash_drafter.states"], in: report)
        XCTAssertTrue(detail("drafter.shared_states", report).contains("but draft binds"), detail("drafter.shared_states", report))
    }

    /// The drafter's caches under the pre-3 names, which in the shared package are the target's.
    func testDrafterStatesNamedLikeTheTargetsFailDrafterStates() throws {
        for name in ["inject_kv", "draft"] {
            export.editFunction(role: "dflash_drafter", name) { function in
                for index in function.states.indices {
                    function.states[index].name = function.states[index].name.replacingOccurrences(of: "drafter", with: "sliding")
                }
            }
        }
        var drafter = try XCTUnwrap((export.metadata["assets"] as? [String: Any])?["dflash_drafter"] as? [String: Any])
        var states = try XCTUnwrap(drafter["states"] as? [[String: Any]])
        for index in states.indices {
            states[index]["name"] = (states[index]["name"] as! String).replacingOccurrences(of: "drafter", with: "sliding")
        }
        drafter["states"] = states
        export.setMetadata(["assets", "dflash_drafter"], to: drafter)
        let report = try report()
        ContractAssertions.assertFailing(["dflash_drafter.states"], in: report)
        XCTAssertTrue(detail("dflash_drafter.states", report).contains("state slidingKeyCache is also the target's"),
                      detail("dflash_drafter.states", report))
    }

    /// A state entry's kind and role follow from its name.
    func testDrafterStateEntryOfTheWrongKindOrRoleFailsDrafterStates() throws {
        for (key, value) in [("kind", "global_kv"), ("role", "value")] {
            export = SyntheticExport.fusedTargetWithDFlashDrafter()
            var drafter = try XCTUnwrap((export.metadata["assets"] as? [String: Any])?["dflash_drafter"] as? [String: Any])
            var states = try XCTUnwrap(drafter["states"] as? [[String: Any]])
            states[0][key] = value
            drafter["states"] = states
            export.setMetadata(["assets", "dflash_drafter"], to: drafter)
            let report = try report()
            XCTAssertEqual(report.failures.map(\.name), ["dflash_drafter.states"], "\(key) \(value)")
            XCTAssertTrue(detail("dflash_drafter.states", report).contains("metadata state drafterKeyCache has \(key) \(value)"),
                          detail("dflash_drafter.states", report))
        }
    }

    // MARK: The decoded layout

    func testPackagesGroupAssetsByPathFromSchemaVersionThree() throws {
        let metadata = try ExportMetadata.decode(from: Data(try export.metadataText().utf8))
        XCTAssertEqual(metadata.packages.map(\.path), ["target.mlpackage"])
        XCTAssertEqual(metadata.packages.first?.owner, .target)
        XCTAssertEqual(metadata.package(of: .dflashDrafter)?.roles, [.target, .dflashDrafter])
        XCTAssertEqual(metadata.assets[.dflashDrafter]?.states.map(\.name), [.drafterKeyCache, .drafterValueCache])

        export.setMetadata(["schema_version"], to: 2)
        let older = try ExportMetadata.decode(from: Data(try export.metadataText().utf8))
        XCTAssertEqual(older.packages.map(\.roles), [[.target], [.dflashDrafter]])

        let ring = try ExportMetadata.decode(from: Data(try SyntheticExport.targetWithRingDrafter(schemaVersion: 3).metadataText().utf8))
        XCTAssertEqual(ring.packages.map(\.owner), [.target, .ringDrafter])
    }
}
