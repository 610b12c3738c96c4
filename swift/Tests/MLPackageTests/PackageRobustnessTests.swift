import XCTest
import Foundation
import MLPackage

/// Damaged packages: each kind of damage must surface as its own error case.
final class PackageRobustnessTests: XCTestCase {
    private var copies: [URL] = []

    override func tearDown() {
        copies.forEach(FixtureLocator.removeTemporaryCopy)
        copies = []
        super.tearDown()
    }

    private func damagedCopy() throws -> URL {
        let copy = try FixtureLocator.temporaryCopy(of: "Stateful.mlpackage")
        copies.append(copy)
        return copy
    }

    private func manifestURL(_ package: URL) -> URL { package.appendingPathComponent("Manifest.json") }

    private func modelURL(_ package: URL) -> URL {
        package.appendingPathComponent("Data/com.apple.CoreML/model.mlmodel")
    }

    private func editManifest(_ package: URL, _ edit: (inout [String: Any]) throws -> Void) throws {
        let data = try Data(contentsOf: manifestURL(package))
        var manifest = try XCTUnwrap(JSONSerialization.jsonObject(with: data) as? [String: Any])
        try edit(&manifest)
        try JSONSerialization.data(withJSONObject: manifest).write(to: manifestURL(package))
    }

    private func setRootItemPath(_ package: URL, _ path: String) throws {
        try editManifest(package) { manifest in
            let root = try XCTUnwrap(manifest["rootModelIdentifier"] as? String)
            var entries = try XCTUnwrap(manifest["itemInfoEntries"] as? [String: Any])
            var item = try XCTUnwrap(entries[root] as? [String: Any])
            item["path"] = path
            entries[root] = item
            manifest["itemInfoEntries"] = entries
        }
    }

    private func assertOpenFails(_ package: URL, with expected: MLPackageError,
                                 file: StaticString = #filePath, line: UInt = #line) {
        XCTAssertThrowsError(try MLPackage.open(at: package), file: file, line: line) { error in
            XCTAssertEqual(error as? MLPackageError, expected, file: file, line: line)
            XCTAssertFalse(String(describing: error).isEmpty, file: file, line: line)
        }
    }

    func testNonexistentPackage() throws {
        let missing = try damagedCopy().deletingLastPathComponent().appendingPathComponent("Nope.mlpackage")
        assertOpenFails(missing, with: .packageNotFound(path: missing.path))
    }

    func testMissingManifest() throws {
        let package = try damagedCopy()
        try FileManager.default.removeItem(at: manifestURL(package))
        assertOpenFails(package, with: .missingManifest(path: manifestURL(package).path))
    }

    func testMalformedManifestJSON() throws {
        let package = try damagedCopy()
        try Data("{\"itemInfoEntries\": {".utf8).write(to: manifestURL(package))
        XCTAssertThrowsError(try MLPackage.open(at: package)) { error in
            guard case .malformedManifest(let path, let reason)? = error as? MLPackageError else {
                return XCTFail("expected malformedManifest, got \(error)")
            }
            XCTAssertEqual(path, self.manifestURL(package).path)
            XCTAssertTrue(reason.hasPrefix("invalid JSON"), reason)
        }
    }

    func testManifestThatIsNotAnObject() throws {
        let package = try damagedCopy()
        try Data("[1, 2]".utf8).write(to: manifestURL(package))
        assertOpenFails(package, with: .malformedManifest(path: manifestURL(package).path,
                                                           reason: "top level is not a JSON object"))
    }

    func testRootModelIdentifierAbsent() throws {
        let package = try damagedCopy()
        try editManifest(package) { $0.removeValue(forKey: "rootModelIdentifier") }
        assertOpenFails(package, with: .missingRootModelIdentifier(manifestPath: manifestURL(package).path))
    }

    func testRootModelIdentifierNamesNoItem() throws {
        let package = try damagedCopy()
        try editManifest(package) { $0["rootModelIdentifier"] = "00000000-dead-beef-0000-000000000000" }
        assertOpenFails(package, with: .rootItemMissing(manifestPath: manifestURL(package).path,
                                                        identifier: "00000000-dead-beef-0000-000000000000"))
    }

    func testParentDirectoryComponentIsRejected() throws {
        let package = try damagedCopy()
        try setRootItemPath(package, "com.apple.CoreML/../../../Manifest.json")
        assertOpenFails(package, with: .pathEscapesPackage(path: "com.apple.CoreML/../../../Manifest.json"))
    }

    func testAbsolutePathIsRejected() throws {
        let package = try damagedCopy()
        let absolute = modelURL(package).path
        try setRootItemPath(package, absolute)
        assertOpenFails(package, with: .pathEscapesPackage(path: absolute))
    }

    func testSymlinkedDirectoryPointingOutsideIsRejected() throws {
        let package = try damagedCopy()
        let coreMLDirectory = modelURL(package).deletingLastPathComponent()
        let outside = package.deletingLastPathComponent().appendingPathComponent("outside")
        try FileManager.default.moveItem(at: coreMLDirectory, to: outside)
        try FileManager.default.createSymbolicLink(at: coreMLDirectory, withDestinationURL: outside)
        assertOpenFails(package, with: .pathEscapesPackage(path: "com.apple.CoreML/model.mlmodel"))
    }

    func testSymlinkedModelFileIsReadLikeBazelRunfiles() throws {
        let package = try damagedCopy()
        let outside = package.deletingLastPathComponent().appendingPathComponent("outside.mlmodel")
        try FileManager.default.copyItem(at: modelURL(package), to: outside)
        try FileManager.default.removeItem(at: modelURL(package))
        try FileManager.default.createSymbolicLink(at: modelURL(package), withDestinationURL: outside)
        XCTAssertEqual(try MLPackage.open(at: package).specificationVersion, 9)
    }

    func testSymlinkStayingInsideIsAllowed() throws {
        let package = try damagedCopy()
        let moved = package.appendingPathComponent("Data/com.apple.CoreML/moved.mlmodel")
        try FileManager.default.moveItem(at: modelURL(package), to: moved)
        try FileManager.default.createSymbolicLink(atPath: modelURL(package).path, withDestinationPath: "moved.mlmodel")
        XCTAssertEqual(try MLPackage.open(at: package).specificationVersion, 9)
    }

    func testMissingModelFile() throws {
        let package = try damagedCopy()
        try FileManager.default.removeItem(at: modelURL(package))
        assertOpenFails(package, with: .missingModelFile(path: modelURL(package).path))
    }

    func testModelPathThatIsADirectory() throws {
        let package = try damagedCopy()
        try setRootItemPath(package, "com.apple.CoreML/weights")
        let directory = package.appendingPathComponent("Data/com.apple.CoreML/weights")
        assertOpenFails(package, with: .unreadableModelFile(path: directory.path, reason: "it is a directory, not a file"))
    }

    func testTruncatedModelFile() throws {
        let package = try damagedCopy()
        let original = [UInt8](try Data(contentsOf: modelURL(package)))
        // The fixture starts: 08 09 (specificationVersion 9), 12 (description tag), then its length.
        XCTAssertEqual(Array(original.prefix(3)), [0x08, 0x09, 0x12])
        var lengthEnd = 3
        var descriptionLength: UInt64 = 0
        var shift: UInt64 = 0
        repeat {
            descriptionLength |= UInt64(original[lengthEnd] & 0x7F) << shift
            shift += 7
            lengthEnd += 1
        } while original[lengthEnd - 1] & 0x80 != 0
        let cut = lengthEnd + 10
        try Data(original.prefix(cut)).write(to: modelURL(package))
        assertOpenFails(package, with: .malformedSpec(
            path: modelURL(package).path,
            error: .wire(.truncated(offset: lengthEnd, needed: descriptionLength, available: 10))))
    }

    func testEmptyModelFile() throws {
        let package = try damagedCopy()
        try Data().write(to: modelURL(package))
        assertOpenFails(package, with: .malformedSpec(path: modelURL(package).path,
                                                      error: .missingField("Model.specificationVersion")))
    }

    func testEveryTruncationOfARealSpecFailsCleanly() throws {
        let bytes = [UInt8](try Data(contentsOf: FixtureLocator.url("MultiFunction.mlpackage")
            .appendingPathComponent("Data/com.apple.CoreML/model.mlmodel")))
        for length in 0..<bytes.count {
            do {
                let spec = try ModelSpecification(serializedBytes: Array(bytes[0..<length]))
                // Only a cut at a top-level field boundary after the description can decode.
                XCTAssertEqual(spec.specificationVersion, 9)
            } catch {
                XCTAssertTrue(error is SpecDecodingError, "prefix \(length): unexpected error \(error)")
            }
        }
    }

    func testErrorDescriptionsSayHowToFix() {
        let errors: [MLPackageError] = [
            .missingManifest(path: "/p/Manifest.json"),
            .malformedManifest(path: "/p/Manifest.json", reason: "bad"),
            .missingRootModelIdentifier(manifestPath: "/p/Manifest.json"),
            .rootItemMissing(manifestPath: "/p/Manifest.json", identifier: "x"),
            .pathEscapesPackage(path: "../x"),
            .malformedSpec(path: "/p/model.mlmodel", error: .missingField("Model.description")),
        ]
        for error in errors {
            XCTAssertTrue(error.description.contains("re-export") || error.description.contains("Re-export"),
                          error.description)
        }
        XCTAssertTrue(MLPackageError.pathEscapesPackage(path: "../x").description.contains("../x"))
    }
}
