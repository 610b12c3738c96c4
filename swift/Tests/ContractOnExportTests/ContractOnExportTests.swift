import XCTest
import Foundation
import ExportMetadata
import MuseflashContract

/// Runs the contract on a real export named by MUSEFLASH_EXPORT_DIR. Missing
/// the variable is a failure, not a skip, so the Bazel target that sets it
/// can never pass vacuously; SwiftPM users run `swift test --skip ContractOnExportTests`.
final class ContractOnExportTests: XCTestCase {
    private var scratch: URL?

    override func tearDown() {
        if let scratch = scratch { try? FileManager.default.removeItem(at: scratch) }
        super.tearDown()
    }

    private struct ExportDirectoryUnavailable: Error, CustomStringConvertible {
        var description: String
    }

    private func exportDirectory() throws -> URL {
        guard let path = ProcessInfo.processInfo.environment["MUSEFLASH_EXPORT_DIR"], !path.isEmpty else {
            throw ExportDirectoryUnavailable(description: "MUSEFLASH_EXPORT_DIR is required: set it to an export "
                                             + "directory, or run `swift test --skip ContractOnExportTests`")
        }
        let base = ProcessInfo.processInfo.environment["BUILD_WORKING_DIRECTORY"] ?? FileManager.default.currentDirectoryPath
        let url = path.hasPrefix("/") ? URL(fileURLWithPath: path) : URL(fileURLWithPath: base).appendingPathComponent(path)
        var isDirectory: ObjCBool = false
        guard FileManager.default.fileExists(atPath: url.path, isDirectory: &isDirectory), isDirectory.boolValue else {
            throw ExportDirectoryUnavailable(description: "MUSEFLASH_EXPORT_DIR=\(path) is not a directory")
        }
        return url
    }

    /// Copies the export, weight files included: the checker reads every blob header they hold
    /// (`<owner>.weight_file`). The test exports are a few megabytes.
    private func interfaceCopy() throws -> URL {
        let source = try exportDirectory()
        let copy = FileManager.default.temporaryDirectory
            .appendingPathComponent("museflash-export-\(UUID().uuidString)", isDirectory: true)
        scratch = copy
        let fileManager = FileManager.default
        try fileManager.createDirectory(at: copy, withIntermediateDirectories: true)
        let sourcePath = source.standardizedFileURL.resolvingSymlinksInPath().path
        guard let walker = fileManager.enumerator(atPath: sourcePath) else {
            throw ExportDirectoryUnavailable(description: "cannot list \(sourcePath)")
        }
        while let relative = walker.nextObject() as? String {
            let from = URL(fileURLWithPath: sourcePath).appendingPathComponent(relative)
            let to = copy.appendingPathComponent(relative)
            var isDirectory: ObjCBool = false
            _ = fileManager.fileExists(atPath: from.path, isDirectory: &isDirectory)
            if isDirectory.boolValue {
                try fileManager.createDirectory(at: to, withIntermediateDirectories: true)
            } else {
                // Contents, not links: Bazel presents the export as symlinks to read-only files.
                try Data(contentsOf: from).write(to: to)
            }
        }
        return copy
    }

    private func editMetadata(in directory: URL, _ edit: (inout [String: Any]) throws -> Void) throws {
        let url = directory.appendingPathComponent("metadata.json")
        var object = try XCTUnwrap(JSONSerialization.jsonObject(with: Data(contentsOf: url)) as? [String: Any])
        try edit(&object)
        try JSONSerialization.data(withJSONObject: object).write(to: url)
    }

    private func verdict(_ report: ContractReport) -> String {
        report.verdictLines.joined(separator: "\n")
    }

    func testEveryPropertyHoldsOnTheExport() throws {
        let report = try ContractChecker().check(exportDirectory: try exportDirectory())
        print((report.summaryLines + [""] + report.verdictLines).joined(separator: "\n"))
        XCTAssertGreaterThan(report.results.count, 2)
        XCTAssertTrue(report.allHold, verdict(report))
    }

    func testChangedVocabSizeInMetadataIsCaught() throws {
        let copy = try interfaceCopy()
        XCTAssertTrue(try ContractChecker().check(exportDirectory: copy).allHold, "the copy must pass before the change")
        try editMetadata(in: copy) { metadata in
            metadata["vocab_size"] = try XCTUnwrap(metadata["vocab_size"] as? Int) + 1
        }
        let report = try ContractChecker().check(exportDirectory: copy)
        XCTAssertEqual(report.result(named: "target.outputs")?.holds, false, verdict(report))
        XCTAssertEqual(report.result(named: "target.embedded_metadata")?.holds, false, verdict(report))
        XCTAssertEqual(report.result(named: "metadata.schema_version")?.holds, true, verdict(report))
    }

    /// With compression declared, every package's compression properties hold, and a byte
    /// count that disagrees with the blob headers is caught; without, no package holds a
    /// constexpr op. The properties are per package, named by its owner (a package the target
    /// and the DFlash drafter share, schema version 3, is `target`'s).
    func testCompressionIsAsDeclared() throws {
        let report = try ContractChecker().check(exportDirectory: try exportDirectory())
        let metadata = try XCTUnwrap(report.metadata)
        let roles = metadata.packages.map(\.owner.rawValue)
        for role in metadata.assets.keys.map(\.rawValue) where !roles.contains(role) {
            XCTAssertNil(report.result(named: "\(role).compression.ops_declared"), verdict(report))
        }
        guard let compression = metadata.compression else {
            for role in roles {
                XCTAssertEqual(report.result(named: "\(role).compression.ops_declared")?.holds, true, verdict(report))
            }
            XCTAssertNil(report.result(named: "metadata.compression"), verdict(report))
            return
        }
        for role in roles {
            for name in ["ops_declared", "stored_compressed", "bytes", "functions_agree"] {
                XCTAssertEqual(report.result(named: "\(role).compression.\(name)")?.holds, true, verdict(report))
            }
        }
        let group = try XCTUnwrap(compression.groups.firstIndex { $0.packages[.target] != nil })
        let copy = try interfaceCopy()
        try editMetadata(in: copy) { metadata in
            var compression = try XCTUnwrap(metadata["compression"] as? [String: Any])
            var groups = try XCTUnwrap(compression["groups"] as? [[String: Any]])
            var packages = try XCTUnwrap(groups[group]["packages"] as? [String: [String: Int]])
            packages["target"]?["bytes"]? += 2
            groups[group]["packages"] = packages
            compression["groups"] = groups
            metadata["compression"] = compression
        }
        let damaged = try ContractChecker().check(exportDirectory: copy)
        XCTAssertEqual(damaged.result(named: "target.compression.bytes")?.holds, false, verdict(damaged))
        XCTAssertEqual(damaged.result(named: "target.compression.stored_compressed")?.holds, true, verdict(damaged))
    }

    /// Metadata naming a function the package does not have (under another known name).
    func testRenamedFunctionInMetadataIsCaught() throws {
        let copy = try interfaceCopy()
        var role = ExportMetadata.AssetRole.target
        try editMetadata(in: copy) { metadata in
            var assets = try XCTUnwrap(metadata["assets"] as? [String: Any])
            role = assets[ExportMetadata.AssetRole.dflashDrafter.rawValue] != nil ? .dflashDrafter : .target
            var asset = try XCTUnwrap(assets[role.rawValue] as? [String: Any])
            var functions = try XCTUnwrap(asset["functions"] as? [String: Any])
            let (name, renamed): (ExportMetadata.FunctionName, ExportMetadata.FunctionName) =
                role == .dflashDrafter ? (.draft, .main) : (.main, .draft)
            functions[renamed.rawValue] = functions.removeValue(forKey: name.rawValue)
            asset["functions"] = functions
            assets[role.rawValue] = asset
            metadata["assets"] = assets
        }
        let report = try ContractChecker().check(exportDirectory: copy)
        XCTAssertEqual(report.result(named: "\(role).function_map")?.holds, false, verdict(report))
    }

    /// Enumerated names are closed: an unknown one is unreadable input, naming its key.
    func testUnknownNameInMetadataIsRefused() throws {
        let copy = try interfaceCopy()
        try editMetadata(in: copy) { metadata in
            var target = try XCTUnwrap((metadata["assets"] as? [String: Any])?["target"] as? [String: Any])
            target["kind"] = "future_target"
            var assets = try XCTUnwrap(metadata["assets"] as? [String: Any])
            assets["target"] = target
            metadata["assets"] = assets
        }
        XCTAssertThrowsError(try ContractChecker().check(exportDirectory: copy)) { error in
            guard case .metadata(.invalidValue(_, let keyPath, _))? = error as? ContractInputError else {
                return XCTFail("expected an invalid value, got \(error)")
            }
            XCTAssertEqual(keyPath, "assets.target.kind")
        }
    }

    func testManifestPathLeavingThePackageIsRefused() throws {
        let copy = try interfaceCopy()
        let metadata = try ExportMetadata.load(fromExportDirectory: copy).metadata
        let target = try XCTUnwrap(metadata.assets[.target])
        let manifestURL = copy.appendingPathComponent(target.path).appendingPathComponent("Manifest.json")
        var manifest = try XCTUnwrap(JSONSerialization.jsonObject(with: Data(contentsOf: manifestURL)) as? [String: Any])
        let root = try XCTUnwrap(manifest["rootModelIdentifier"] as? String)
        var entries = try XCTUnwrap(manifest["itemInfoEntries"] as? [String: Any])
        var item = try XCTUnwrap(entries[root] as? [String: Any])
        item["path"] = "../../metadata.json"
        entries[root] = item
        manifest["itemInfoEntries"] = entries
        try JSONSerialization.data(withJSONObject: manifest).write(to: manifestURL)
        XCTAssertThrowsError(try ContractChecker().check(exportDirectory: copy)) { error in
            guard case .unreadablePackage(let role, _, let reason)? = error as? ContractInputError else {
                return XCTFail("expected unreadablePackage, got \(error)")
            }
            XCTAssertEqual(role, .target)
            XCTAssertTrue(reason.contains("points outside the package"), reason)
        }
    }
}
