import XCTest
import Foundation
import MuseflashContract
import TestSupport

/// Shared by the contract test classes; holds no tests itself.
enum ContractAssertions {
    /// The properties of a DFlash export without compression up to the function maps; a DFlash2
    /// bundle has the same ones. `owners`: the roles owning a package, which name the
    /// per-package properties.
    private static func dflashInterfaceProperties(owners: [String]) -> [String] {
        ["metadata.schema_version", "metadata.assets_exist", "metadata.drafter_kind"]
            + owners.map { "\($0).embedded_metadata" } + ["package.functions"]
            + ["target.inputs", "target.outputs", "target.drafter_vocab_agree",
               "drafter.functions", "drafter.shared_states", "drafter.inject_kv_signature", "drafter.draft_signature",
               "drafter.draft_tokens",
               "target.states", "dflash_drafter.states",
               "target.function_map", "dflash_drafter.function_map"]
    }

    /// Schema version 3: the target and the DFlash drafter share `target.mlpackage`, owned by
    /// `target`, so every per-package property runs once, as `target`'s.
    static let dflashBundleProperties = dflashInterfaceProperties(owners: ["target"])
        + ["target.compression.ops_declared", "target.weight_file"]

    /// Before schema version 3: a package per asset.
    static let separateDFlashBundleProperties = dflashInterfaceProperties(owners: ["target", "dflash_drafter"])
        + ["target.compression.ops_declared", "dflash_drafter.compression.ops_declared"]
        + ["target.weight_file", "dflash_drafter.weight_file"]

    static let compressionProperties = ["ops_declared", "stored_compressed", "bytes", "functions_agree"]

    /// With `compression` in metadata.json.
    static let compressedDFlashBundleProperties = dflashInterfaceProperties(owners: ["target"]) + ["metadata.compression"]
        + compressionProperties.map { "target.compression.\($0)" } + ["target.weight_file"]

    static let compressedSeparateDFlashBundleProperties = dflashInterfaceProperties(owners: ["target", "dflash_drafter"])
        + ["metadata.compression"]
        + ["target", "dflash_drafter"].flatMap { role in compressionProperties.map { "\(role).compression.\($0)" } }
        + ["target.weight_file", "dflash_drafter.weight_file"]

    static let ringBundleProperties = [
        "metadata.schema_version", "metadata.assets_exist", "metadata.drafter_kind",
        "target.embedded_metadata", "ring_drafter.embedded_metadata", "package.functions",
        "target.inputs", "target.outputs", "target.drafter_vocab_agree",
        "ring_drafter.main_signature",
        "target.states", "ring_drafter.states",
        "target.function_map", "ring_drafter.function_map",
        "target.compression.ops_declared", "ring_drafter.compression.ops_declared",
        "target.weight_file", "ring_drafter.weight_file",
    ]

    /// Evaluated only when metadata.json has a tokenizer; the last only with speculative_decoding.
    static let tokenizerProperties = ["tokenizer.files", "tokenizer.vocab_size", "tokenizer.mask_token"]

    /// Writes `export` to a fresh directory, lets `damage` alter the files,
    /// checks it and removes the directory.
    static func check(_ export: SyntheticExport, damage: (URL) throws -> Void = { _ in }) throws -> ContractReport {
        let directory = try ScratchDirectory.make()
        defer { ScratchDirectory.remove(directory) }
        try export.write(to: directory)
        try damage(directory)
        return try ContractChecker().check(exportDirectory: directory)
    }

    /// Writes and damages like `check`, and expects the checker to refuse the input.
    static func inputError(_ export: SyntheticExport, damage: (URL) throws -> Void) throws -> ContractInputError? {
        let directory = try ScratchDirectory.make()
        defer { ScratchDirectory.remove(directory) }
        try export.write(to: directory)
        try damage(directory)
        do {
            let report = try ContractChecker().check(exportDirectory: directory)
            XCTFail("expected an input error, got a report:\n" + report.verdictLines.joined(separator: "\n"))
            return nil
        } catch let error as ContractInputError {
            return error
        }
    }

    /// Exactly `failing` fail, and every other property of `expected` runs and holds.
    static func assertFailing(_ failing: Set<String>, in report: ContractReport,
                              expected names: [String] = dflashBundleProperties,
                              file: StaticString = #filePath, line: UInt = #line) {
        let verdict = report.verdictLines.joined(separator: "\n")
        XCTAssertEqual(report.results.map(\.name), names, verdict, file: file, line: line)
        XCTAssertEqual(Set(report.failures.map(\.name)), failing, verdict, file: file, line: line)
        for result in report.failures {
            XCTAssertFalse(result.detail.isEmpty, "\(result.name) fails without a reason", file: file, line: line)
        }
    }

    static func detail(_ name: String, in report: ContractReport) -> String {
        report.result(named: name)?.detail ?? "<no property \(name)>"
    }

    /// `<role>.mlpackage`: the package a role owns (from schema version 3 the DFlash drafter's
    /// asset is in `target.mlpackage`).
    static func packageURL(_ directory: URL, role: String) -> URL {
        directory.appendingPathComponent(role + ".mlpackage")
    }

    static func modelURL(_ directory: URL, role: String) -> URL {
        packageURL(directory, role: role).appendingPathComponent(PackageSpec.modelPath)
    }
}
