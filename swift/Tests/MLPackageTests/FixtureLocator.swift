import Foundation

/// Fixtures are found without SwiftPM resources so the same tests run under
/// plain swiftc (Bazel): MUSEFLASH_FIXTURES_DIR wins, else the source tree.
enum FixtureLocator {
    static var directory: URL {
        if let override = ProcessInfo.processInfo.environment["MUSEFLASH_FIXTURES_DIR"], !override.isEmpty {
            return URL(fileURLWithPath: override, isDirectory: true)
        }
        return URL(fileURLWithPath: #filePath).deletingLastPathComponent().appendingPathComponent("Fixtures")
    }

    static func url(_ name: String) -> URL {
        directory.appendingPathComponent(name)
    }

    /// Tests that mutate a package work on a private copy.
    static func temporaryCopy(of name: String) throws -> URL {
        let scratch = FileManager.default.temporaryDirectory
            .appendingPathComponent("museflash-tests-\(UUID().uuidString)", isDirectory: true)
        try FileManager.default.createDirectory(at: scratch, withIntermediateDirectories: true)
        let copy = scratch.appendingPathComponent(name)
        try copyDereferencingSymlinks(from: url(name), to: copy)
        return copy
    }

    /// Bazel presents fixtures as symlinks to read-only sources; a mutable copy needs real
    /// files, so contents are copied rather than the links.
    private static func copyDereferencingSymlinks(from source: URL, to destination: URL) throws {
        let fileManager = FileManager.default
        let sourcePath = source.resolvingSymlinksInPath().path
        try fileManager.createDirectory(at: destination, withIntermediateDirectories: true)
        guard let walker = fileManager.enumerator(atPath: sourcePath) else { return }
        while let relative = walker.nextObject() as? String {
            let from = URL(fileURLWithPath: sourcePath).appendingPathComponent(relative)
            let to = destination.appendingPathComponent(relative)
            var isDirectory: ObjCBool = false
            _ = fileManager.fileExists(atPath: from.path, isDirectory: &isDirectory)
            if isDirectory.boolValue {
                try fileManager.createDirectory(at: to, withIntermediateDirectories: true)
            } else {
                try Data(contentsOf: from).write(to: to)
            }
        }
    }

    static func removeTemporaryCopy(_ copy: URL) {
        try? FileManager.default.removeItem(at: copy.deletingLastPathComponent())
    }
}
