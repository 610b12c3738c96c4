import XCTest
import Foundation
import MuseflashContract
import TestSupport

final class CommandLineTests: XCTestCase {
    private var directory: URL!

    override func setUpWithError() throws {
        directory = try ScratchDirectory.make()
    }

    override func tearDown() {
        ScratchDirectory.remove(directory)
        super.tearDown()
    }

    private func writeBundle(_ edit: (inout SyntheticExport) -> Void = { _ in }) throws -> URL {
        var export = SyntheticExport.fusedTargetWithDFlashDrafter()
        edit(&export)
        let exportDirectory = directory.appendingPathComponent("export")
        try export.write(to: exportDirectory)
        return exportDirectory
    }

    private func run(_ arguments: [String], environment: [String: String] = [:]) -> ContractCommand.Outcome {
        ContractCommand.run(arguments: arguments, environment: environment, currentDirectory: "/nonexistent-cwd")
    }

    /// The property names on PASS and FAIL lines, in order.
    private func verdicts(_ output: String) -> (passed: [String], failed: [String]) {
        let lines = output.split(separator: "\n").map(String.init)
        let name = { (line: String) in String(line.split(separator: " ")[1]).trimmingCharacters(in: [":"]) }
        return (lines.filter { $0.hasPrefix("PASS ") }.map(name), lines.filter { $0.hasPrefix("FAIL ") }.map(name))
    }

    private func assertOneLineError(_ outcome: ContractCommand.Outcome, containing fragment: String,
                                    file: StaticString = #filePath, line: UInt = #line) {
        XCTAssertEqual(outcome.status, 2, file: file, line: line)
        XCTAssertEqual(outcome.standardOutput, "", file: file, line: line)
        XCTAssertEqual(outcome.standardError.filter { $0 == "\n" }.count, 1, outcome.standardError, file: file, line: line)
        XCTAssertTrue(outcome.standardError.contains(fragment), outcome.standardError, file: file, line: line)
    }

    func testValidBundleExitsZeroWithSummaryAndVerdict() throws {
        let outcome = run(["--export-dir", try writeBundle().path])
        XCTAssertEqual(outcome.status, 0, outcome.standardOutput)
        let (passed, failed) = verdicts(outcome.standardOutput)
        XCTAssertEqual(passed, ContractAssertions.dflashBundleProperties, outcome.standardOutput)
        XCTAssertEqual(failed, [], outcome.standardOutput)
        let lines = outcome.standardOutput.split(separator: "\n").map(String.init)
        XCTAssertTrue(lines.contains { $0.hasPrefix("Asset target (fused_target)") })
        XCTAssertEqual(outcome.standardError, "")
    }

    func testViolationExitsOneAndNamesTheProperty() throws {
        let path = try writeBundle { $0.setMetadata(["speculative_decoding", "block_size"], to: 5) }.path
        let outcome = run(["--export-dir=\(path)"])
        XCTAssertEqual(outcome.status, 1)
        let (passed, failed) = verdicts(outcome.standardOutput)
        let violated = ["target.inputs", "drafter.draft_signature"]
        XCTAssertEqual(Set(failed), Set(violated), outcome.standardOutput)
        XCTAssertEqual(passed, ContractAssertions.dflashBundleProperties.filter { !violated.contains($0) },
                       outcome.standardOutput)
    }

    func testRelativePathResolvesAgainstBuildWorkingDirectory() throws {
        _ = try writeBundle()
        let outcome = run(["--export-dir", "export"], environment: ["BUILD_WORKING_DIRECTORY": directory.path])
        XCTAssertEqual(outcome.status, 0, outcome.standardError)
        let fromCurrentDirectory = ContractCommand.run(arguments: ["--export-dir", "export"], environment: [:],
                                                       currentDirectory: directory.path)
        XCTAssertEqual(fromCurrentDirectory.status, 0, fromCurrentDirectory.standardError)
    }

    func testHelpExitsZero() {
        let outcome = run(["--help"])
        XCTAssertEqual(outcome.status, 0)
        XCTAssertTrue(outcome.standardOutput.hasPrefix("usage: check-contract --export-dir DIR"))
    }

    func testBadUsageExitsTwo() {
        assertOneLineError(run([]), containing: "--export-dir is required")
        assertOneLineError(run(["--export-dir"]), containing: "--export-dir needs a value")
        assertOneLineError(run(["--export-dir=."] + ["--verbose=1"]), containing: "unexpected argument --verbose")
        assertOneLineError(run(["--verbose"]), containing: "unexpected argument --verbose")
    }

    func testMissingDirectoryExitsTwo() {
        assertOneLineError(run(["--export-dir", directory.appendingPathComponent("nope").path]), containing: "does not exist")
    }

    func testMissingOrInvalidMetadataExitsTwo() throws {
        let exportDirectory = try writeBundle()
        let metadataURL = exportDirectory.appendingPathComponent("metadata.json")
        try Data([0x7B, 0xFF, 0x00, 0x22]).write(to: metadataURL)
        assertOneLineError(run(["--export-dir", exportDirectory.path]), containing: "metadata.json is not valid JSON")
        try Data("{\"schema_version\": 1}".utf8).write(to: metadataURL)
        assertOneLineError(run(["--export-dir", exportDirectory.path]), containing: "required key generator is missing")
        try FileManager.default.removeItem(at: metadataURL)
        assertOneLineError(run(["--export-dir", exportDirectory.path]), containing: "metadata.json does not exist")
    }

    func testUnreadablePackageExitsTwo() throws {
        let exportDirectory = try writeBundle()
        try Data([0x08]).write(to: exportDirectory.appendingPathComponent("target.mlpackage/" + PackageSpec.modelPath))
        assertOneLineError(run(["--export-dir", exportDirectory.path]), containing: "the target package")
    }
}
