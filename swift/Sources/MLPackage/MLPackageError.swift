/// Everything that can make a `.mlpackage` unreadable. Each case carries the
/// path involved, and `description` says what to do about it.
public enum MLPackageError: Error, Sendable, Equatable, CustomStringConvertible {
    /// The package directory itself does not exist or is not a directory.
    case packageNotFound(path: String)
    case missingManifest(path: String)
    case malformedManifest(path: String, reason: String)
    /// Manifest.json has no `rootModelIdentifier` string.
    case missingRootModelIdentifier(manifestPath: String)
    /// `rootModelIdentifier` names no entry of `itemInfoEntries`.
    case rootItemMissing(manifestPath: String, identifier: String)
    /// A manifest item path is absolute, contains `..`, or resolves (through
    /// symlinks) outside the package. `path` is the path as the manifest wrote it.
    case pathEscapesPackage(path: String)
    case missingModelFile(path: String)
    case unreadableModelFile(path: String, reason: String)
    case malformedSpec(path: String, error: SpecDecodingError)

    public var description: String {
        let reexport = "Re-export the bundle with coremltools (ct.convert(...).save(\"X.mlpackage\"))."
        switch self {
        case .packageNotFound(let path):
            return "No .mlpackage directory at \(path). Check the path, or export the model first."
        case .missingManifest(let path):
            return "\(path) is missing, so this is not a complete .mlpackage. \(reexport)"
        case .malformedManifest(let path, let reason):
            return "\(path) is not a valid package manifest: \(reason). \(reexport)"
        case .missingRootModelIdentifier(let manifestPath):
            return "\(manifestPath) has no rootModelIdentifier, so the model spec cannot be located. \(reexport)"
        case .rootItemMissing(let manifestPath, let identifier):
            return "\(manifestPath) names root model \(identifier), but itemInfoEntries has no such item. \(reexport)"
        case .pathEscapesPackage(let path):
            return "Manifest item path \"\(path)\" points outside the package; refusing to follow it. "
                + "Item paths must be relative to Data/ without '..' or outward symlinks. \(reexport)"
        case .missingModelFile(let path):
            return "The model spec \(path) named by the manifest does not exist. "
                + "The bundle was copied incompletely; copy it again or re-export it."
        case .unreadableModelFile(let path, let reason):
            return "The model spec \(path) cannot be read: \(reason). Check file permissions, or re-export the bundle."
        case .malformedSpec(let path, let error):
            return "The model spec \(path) is corrupt or truncated (\(error)). "
                + "Copy the bundle again or re-export it; if that persists, the exporter wrote an invalid spec."
        }
    }
}
