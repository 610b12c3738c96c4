import XCTest
import Foundation
import ExportMetadata
import MuseflashContract
import TestSupport

/// A package that exists but cannot be read is unreadable input (exit 2), not
/// a contract verdict; without compression weights are never read, so damage there is
/// invisible (CompressionContractTests damages the weight file of a compressed export).
final class DamagedPackageTests: XCTestCase {
    private let export = SyntheticExport.fusedTargetWithDFlashDrafter()

    private func assertUnreadable(_ role: ExportMetadata.AssetRole, mentioning fragment: String,
                                  in export: SyntheticExport? = nil,
                                  damage: (URL) throws -> Void, file: StaticString = #filePath, line: UInt = #line) throws {
        let error = try ContractAssertions.inputError(export ?? self.export, damage: damage)
        guard case .unreadablePackage(let failedRole, _, let reason)? = error else {
            return XCTFail("expected unreadablePackage, got \(String(describing: error))", file: file, line: line)
        }
        XCTAssertEqual(failedRole, role, file: file, line: line)
        XCTAssertTrue(reason.contains(fragment), reason, file: file, line: line)
    }

    func testMissingManifestIsUnreadableInput() throws {
        try assertUnreadable(.dflashDrafter, mentioning: "Manifest.json is missing",
                             in: .fusedTargetWithSeparateDFlashDrafter()) { directory in
            try FileManager.default.removeItem(
                at: ContractAssertions.packageURL(directory, role: "dflash_drafter").appendingPathComponent("Manifest.json"))
        }
    }

    /// A shared package that cannot be read is reported once, as its owner's.
    func testUnreadableSharedPackageIsReportedAsItsOwners() throws {
        try assertUnreadable(.target, mentioning: "Manifest.json is missing") { directory in
            try FileManager.default.removeItem(
                at: ContractAssertions.packageURL(directory, role: "target").appendingPathComponent("Manifest.json"))
        }
    }

    func testTruncatedSpecIsUnreadableInput() throws {
        try assertUnreadable(.target, mentioning: "corrupt or truncated") { directory in
            let model = ContractAssertions.modelURL(directory, role: "target")
            let bytes = try Data(contentsOf: model)
            try bytes.prefix(bytes.count / 2).write(to: model)
        }
    }

    func testEveryTruncationOfASpecEitherFailsCleanlyOrStillDecodes() throws {
        let directory = try ScratchDirectory.make()
        defer { ScratchDirectory.remove(directory) }
        try export.write(to: directory)
        let model = ContractAssertions.modelURL(directory, role: "target")
        let bytes = try Data(contentsOf: model)
        for length in stride(from: 0, to: bytes.count, by: 13) {
            try bytes.prefix(length).write(to: model)
            do {
                _ = try ContractChecker().check(exportDirectory: directory)
            } catch is ContractInputError {
                continue
            }
        }
    }

    func testManifestPathWithParentComponentIsRefused() throws {
        try assertUnreadable(.target, mentioning: "points outside the package") { directory in
            let manifestURL = ContractAssertions.packageURL(directory, role: "target").appendingPathComponent("Manifest.json")
            var manifest = try XCTUnwrap(JSONSerialization.jsonObject(with: Data(contentsOf: manifestURL)) as? [String: Any])
            let root = try XCTUnwrap(manifest["rootModelIdentifier"] as? String)
            var entries = try XCTUnwrap(manifest["itemInfoEntries"] as? [String: Any])
            var item = try XCTUnwrap(entries[root] as? [String: Any])
            item["path"] = "../../dflash_drafter.mlpackage/Data/com.apple.CoreML/model.mlmodel"
            entries[root] = item
            manifest["itemInfoEntries"] = entries
            try JSONSerialization.data(withJSONObject: manifest).write(to: manifestURL)
        }
    }

    func testPackageThatIsAFileFailsAssetsExist() throws {
        let report = try ContractAssertions.check(export) { directory in
            let package = ContractAssertions.packageURL(directory, role: "target")
            try FileManager.default.removeItem(at: package)
            try Data("not a package".utf8).write(to: package)
        }
        XCTAssertTrue(ContractAssertions.detail("metadata.assets_exist", in: report).contains("is a file"))
        XCTAssertEqual(report.result(named: "drafter.functions")?.holds, false)
        let separate = try ContractAssertions.check(.fusedTargetWithSeparateDFlashDrafter()) { directory in
            let package = ContractAssertions.packageURL(directory, role: "target")
            try FileManager.default.removeItem(at: package)
            try Data("not a package".utf8).write(to: package)
        }
        XCTAssertTrue(ContractAssertions.detail("metadata.assets_exist", in: separate).contains("is a file"))
        XCTAssertEqual(separate.result(named: "drafter.functions")?.holds, true)
    }

    func testReadingTheSpecNeverTouchesWeights() throws {
        for export in [export, .fusedTargetWithSeparateDFlashDrafter()] {
            let roles = export.packages.keys.sorted()
            let replaceWeightsWithDirectory: (URL) throws -> Void = { directory in
                for role in roles {
                    let weights = ContractAssertions.packageURL(directory, role: role).appendingPathComponent(PackageSpec.weightPath)
                    try FileManager.default.removeItem(at: weights)
                    try FileManager.default.createDirectory(at: weights, withIntermediateDirectories: false)
                }
            }
            XCTAssertTrue(try ContractAssertions.check(export, damage: replaceWeightsWithDirectory).allHold, "\(roles)")

            let deleteWeights: (URL) throws -> Void = { directory in
                for role in roles {
                    try FileManager.default.removeItem(
                        at: ContractAssertions.packageURL(directory, role: role).appendingPathComponent("Data/com.apple.CoreML/weights"))
                }
            }
            XCTAssertTrue(try ContractAssertions.check(export, damage: deleteWeights).allHold, "\(roles)")
        }
    }
}
