import Foundation

/// A `.mlpackage` directory as written by coremltools: Manifest.json plus a
/// `Data/` tree holding the model spec and its weights. Opening one reads only
/// the manifest and the spec; weight files are never touched, so the cost is
/// proportional to the interface, not to the model size.
public struct MLPackage: Sendable {
    /// Manifests are a few hundred bytes; anything vastly larger is not one.
    public static let maximumManifestSize = 1 << 20

    public let url: URL
    public let manifest: PackageManifest
    /// The root model item's file, normally Data/com.apple.CoreML/model.mlmodel.
    public let modelURL: URL
    public let specification: ModelSpecification

    public var specificationVersion: Int { specification.specificationVersion }
    public var description: ModelDescription { specification.description }
    public var functions: [FunctionDescription] { specification.description.functions }
    public var userDefinedMetadata: [String: String] { specification.description.metadata.userDefined }
    public var isMultiFunction: Bool { !functions.isEmpty }

    public static func open(at url: URL) throws -> MLPackage {
        let fileManager = FileManager.default
        var isDirectory: ObjCBool = false
        guard fileManager.fileExists(atPath: url.path, isDirectory: &isDirectory), isDirectory.boolValue else {
            throw MLPackageError.packageNotFound(path: url.path)
        }

        let manifestURL = url.appendingPathComponent("Manifest.json")
        let manifest = try readManifest(at: manifestURL)
        guard let rootItem = manifest.rootItem else {
            throw MLPackageError.rootItemMissing(
                manifestPath: manifestURL.path, identifier: manifest.rootModelIdentifier)
        }
        let modelURL = try resolveItem(path: rootItem.path, inPackage: url)

        let bytes: [UInt8]
        do {
            bytes = [UInt8](try Data(contentsOf: modelURL))
        } catch {
            throw MLPackageError.unreadableModelFile(path: modelURL.path, reason: error.localizedDescription)
        }
        let specification: ModelSpecification
        do {
            specification = try ModelSpecification(serializedBytes: bytes)
        } catch let error as SpecDecodingError {
            throw MLPackageError.malformedSpec(path: modelURL.path, error: error)
        }
        return MLPackage(url: url, manifest: manifest, modelURL: modelURL, specification: specification)
    }

    private static func readManifest(at manifestURL: URL) throws -> PackageManifest {
        let path = manifestURL.path
        guard FileManager.default.fileExists(atPath: path) else {
            throw MLPackageError.missingManifest(path: path)
        }
        let data: Data
        do {
            let attributes = try FileManager.default.attributesOfItem(atPath: path)
            if let size = attributes[.size] as? NSNumber, size.intValue > maximumManifestSize {
                throw MLPackageError.malformedManifest(
                    path: path, reason: "file is \(size.intValue) bytes, larger than any real manifest")
            }
            data = try Data(contentsOf: manifestURL)
        } catch let error as MLPackageError {
            throw error
        } catch {
            throw MLPackageError.malformedManifest(path: path, reason: "unreadable (\(error.localizedDescription))")
        }
        return try PackageManifest(jsonData: data, manifestPath: path)
    }

    /// Maps a manifest item path to a file inside the package. Rejects paths
    /// that could read outside it: the manifest is input, not trusted code.
    static func resolveItem(path itemPath: String, inPackage packageURL: URL) throws -> URL {
        let components = itemPath.split(separator: "/", omittingEmptySubsequences: true)
        guard !itemPath.hasPrefix("/"),
              !itemPath.contains("\0"),
              !components.isEmpty,
              !components.contains("..")
        else {
            throw MLPackageError.pathEscapesPackage(path: itemPath)
        }

        let itemURL = components.reduce(packageURL.appendingPathComponent("Data")) {
            $0.appendingPathComponent(String($1))
        }
        var isDirectory: ObjCBool = false
        guard FileManager.default.fileExists(atPath: itemURL.path, isDirectory: &isDirectory) else {
            throw MLPackageError.missingModelFile(path: itemURL.path)
        }

        // Compare fully resolved directories so a symlinked directory along the way
        // (Data/ itself included) cannot lead outside the package. The item file itself may
        // be a symlink: Bazel's runfiles and sandboxes present every data file that way, and
        // the file is only read as bytes and parsed, never followed further.
        let resolvedRoot = packageURL.resolvingSymlinksInPath().standardizedFileURL.path
        let resolvedItem = itemURL.deletingLastPathComponent().resolvingSymlinksInPath()
            .standardizedFileURL.appendingPathComponent(itemURL.lastPathComponent).path
        let rootPrefix = resolvedRoot.hasSuffix("/") ? resolvedRoot : resolvedRoot + "/"
        guard resolvedItem.hasPrefix(rootPrefix) else {
            throw MLPackageError.pathEscapesPackage(path: itemPath)
        }

        if isDirectory.boolValue {
            throw MLPackageError.unreadableModelFile(path: itemURL.path, reason: "it is a directory, not a file")
        }
        return itemURL
    }
}
