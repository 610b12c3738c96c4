import XCTest
import Foundation
import MuseflashContract
import TestSupport

/// Shared by the contract test classes; holds no tests itself.
enum ContractAssertions {
    /// The properties the checker evaluates on an intact export, in its order. A damaged copy of
    /// that export must still evaluate every one of them (`assertFailing`), so damage cannot hide
    /// a property by making it not run; taken from the checker, so a new property needs no list
    /// edited here. ValidBundleTests pins the properties each kind of bundle must have.
    static func properties(of export: SyntheticExport) -> [String] {
        do {
            return try check(export).results.map(\.name)
        } catch {
            XCTFail("the intact export does not check: \(error)")
            return []
        }
    }

    /// Schema version 3: the target and the DFlash drafter share `target.mlpackage`, owned by
    /// `target`, so every per-package property runs once, as `target`'s.
    static let dflashBundleProperties = properties(of: .fusedTargetWithDFlashDrafter())

    /// Before schema version 3: a package per asset.
    static let separateDFlashBundleProperties = properties(of: .fusedTargetWithSeparateDFlashDrafter())

    /// With `compression` in metadata.json.
    static let compressedDFlashBundleProperties = properties(of: .compressedFusedTargetWithDFlashDrafter())

    static let compressedSeparateDFlashBundleProperties = properties(of: .compressedFusedTargetWithSeparateDFlashDrafter())

    static let ringBundleProperties = properties(of: .targetWithRingDrafter())

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

    /// Exactly `failing` fail, and every other property of `expected` runs and holds; nothing
    /// else runs, and nothing runs twice. Order is not compared.
    static func assertFailing(_ failing: Set<String>, in report: ContractReport,
                              expected names: [String] = dflashBundleProperties,
                              file: StaticString = #filePath, line: UInt = #line) {
        let verdict = report.verdictLines.joined(separator: "\n")
        let ran = report.results.map(\.name)
        XCTAssertEqual(Set(ran).count, ran.count, "a property ran twice: " + verdict, file: file, line: line)
        XCTAssertEqual(Set(ran), Set(names), verdict, file: file, line: line)
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
