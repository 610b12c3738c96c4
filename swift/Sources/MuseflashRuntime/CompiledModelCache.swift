import Foundation
#if canImport(CoreML)
import CoreML
#else
import CoreMLStandIn
#endif

/// How the Core ML backend got the compiled model (`.mlmodelc`) it loads for a package.
public enum CompiledModelSource: String, Sendable, Equatable {
    /// The bundle ships the `.mlmodelc` (as an app bundle that Xcode compiled does).
    case shipped = "shipped"
    /// A cache entry of an earlier launch with the same package digest.
    case cached = "cached"
    /// Compiled now and kept in the cache for later launches.
    case compiledIntoCache = "compiled_into_cache"
    /// Compiled now to a temporary location (no cache, or the cache could not be written).
    case compiledTemporarily = "compiled_temporarily"
}

/// Compiled models kept across launches in a directory the app chooses, one entry per package
/// content digest: `<directory>/<package name>-<digest>.mlmodelc`. An entry appears only once
/// it is complete (compiled elsewhere, then renamed into place), so a crashed launch leaves no
/// half-written entry; a package whose digest changed is compiled again and its old entries
/// removed.
public struct CompiledModelCache: Sendable {
    public let directory: URL

    public init(directory: URL) { self.directory = directory }

    /// The platform's caches folder (macOS/iOS: the app's Library/Caches; Linux: ~/.cache),
    /// `museflash/compiled-models` inside it.
    public static var defaultDirectory: URL? {
        FileManager.default.urls(for: .cachesDirectory, in: .userDomainMask).first?
            .appendingPathComponent("museflash", isDirectory: true)
            .appendingPathComponent("compiled-models", isDirectory: true)
    }

    public func entry(for package: URL, digest: String) -> URL {
        directory.appendingPathComponent("\(package.deletingPathExtension().lastPathComponent)-\(digest.prefix(32)).mlmodelc",
                                         isDirectory: true)
    }

    /// The compiled model of `package`: the cache's entry when there is one for its digest, else
    /// compiled by `compile` and moved into the cache. When the cache cannot be written, `warn`
    /// gets one line naming the directory and the model compiled to a temporary location is used.
    func compiledModel(of package: URL, compile: (URL) throws -> URL,
                       warn: (String) -> Void) throws -> (URL, CompiledModelSource) {
        let fileManager = FileManager.default
        let digest = try PackageDigest.of(package)
        let entry = entry(for: package, digest: digest)
        if fileManager.fileExists(atPath: entry.path) { return (entry, .cached) }
        let compiled = try compile(package)
        do {
            try fileManager.createDirectory(at: directory, withIntermediateDirectories: true)
            // Moved beside the entry first (a copy when the temporary folder is another volume),
            // then renamed: readers never see a partial entry.
            let partial = directory.appendingPathComponent(".\(entry.lastPathComponent).\(UUID().uuidString).partial")
            try fileManager.moveItem(at: compiled, to: partial)
            do {
                try fileManager.moveItem(at: partial, to: entry)
            } catch where fileManager.fileExists(atPath: entry.path) {
                try? fileManager.removeItem(at: partial)  // another launch put it there first
            }
            removeStaleEntries(of: package, keeping: entry)
            return (entry, .compiledIntoCache)
        } catch {
            let reason = (error as NSError).localizedDescription.replacingOccurrences(of: "\n", with: " ")
            warn("museflash: cannot write the compiled-model cache \(directory.path) (\(reason)); using a temporary compile of \(package.lastPathComponent) for this launch; fix: make that folder writable or choose another with CoreMLBackend.Options.cacheDirectory (swift-generate --model-cache DIR)")
            let usable = fileManager.fileExists(atPath: compiled.path) ? compiled : try compile(package)
            return (usable, .compiledTemporarily)
        }
    }

    private func removeStaleEntries(of package: URL, keeping entry: URL) {
        let prefix = package.deletingPathExtension().lastPathComponent + "-"
        let names = (try? FileManager.default.contentsOfDirectory(atPath: directory.path)) ?? []
        for name in names where name.hasPrefix(prefix) && name.hasSuffix(".mlmodelc") && name != entry.lastPathComponent {
            try? FileManager.default.removeItem(at: directory.appendingPathComponent(name))
        }
    }
}

/// The cache key of a package: SHA-256 over what changes when the package does, without
/// reading gigabytes of weights on every launch. It covers
///   - the OS version (a new Core ML may compile differently) and a format tag;
///   - every file's path inside the package and its size;
///   - the whole content of every file up to 1 MiB: Manifest.json and the model spec, which
///     holds the program (every op, shape and weight offset);
///   - for larger files (the weight blobs), their modification time and 17 samples of 64 KiB
///     at evenly spaced offsets, the first and last included.
/// A re-export changes the spec or the weight files' times; a retrained weight file changes
/// every sample. What it misses: weight bytes edited in place between the samples with the
/// file's size and modification time kept, which no exporter does.
enum PackageDigest {
    static let wholeFileLimit = 1 << 20
    static let sampleBytes = 1 << 16
    static let samples = 17

    static func of(_ package: URL) throws -> String {
        let fileManager = FileManager.default
        let root = package.resolvingSymlinksInPath()
        var hash = SHA256()
        hash.update("museflash compiled-model cache 1\n\(ProcessInfo.processInfo.operatingSystemVersionString)\n")
        let files = (fileManager.enumerator(atPath: root.path)?.allObjects as? [String] ?? []).sorted()
        for relative in files {
            let url = root.appendingPathComponent(relative).resolvingSymlinksInPath()
            let attributes = try fileManager.attributesOfItem(atPath: url.path)
            guard attributes[.type] as? FileAttributeType == .typeRegular else { continue }
            let size = (attributes[.size] as? NSNumber)?.intValue ?? 0
            hash.update("\(relative)\n\(size)\n")
            guard let handle = FileHandle(forReadingAtPath: url.path) else {
                throw RuntimeError.backend(function: "-", reason: "cannot read \(url.path) to key the compiled-model cache")
            }
            defer { try? handle.close() }
            if size <= wholeFileLimit {
                hash.update(handle.readDataToEndOfFile())
                continue
            }
            let modified = (attributes[.modificationDate] as? Date)?.timeIntervalSince1970 ?? 0
            hash.update("\(modified)\n")
            for sample in 0..<samples {
                let offset = sample == samples - 1 ? size - sampleBytes : (size - sampleBytes) / (samples - 1) * sample
                handle.seek(toFileOffset: UInt64(offset))
                hash.update(handle.readData(ofLength: sampleBytes))
            }
        }
        return hash.hex()
    }
}
