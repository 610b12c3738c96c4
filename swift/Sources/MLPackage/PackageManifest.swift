import Foundation

/// One entry of Manifest.json's `itemInfoEntries`.
public struct ManifestItem: Sendable, Equatable {
    public var identifier: String
    public var name: String
    /// Relative to the package's `Data/` directory.
    public var path: String
    public var author: String
    public var description: String

    public init(identifier: String, name: String, path: String, author: String = "", description: String = "") {
        self.identifier = identifier
        self.name = name
        self.path = path
        self.author = author
        self.description = description
    }
}

/// The `Manifest.json` at the root of every `.mlpackage`.
public struct PackageManifest: Sendable, Equatable {
    public var fileFormatVersion: String?
    public var items: [String: ManifestItem]
    public var rootModelIdentifier: String

    public var rootItem: ManifestItem? { items[rootModelIdentifier] }

    public init(fileFormatVersion: String?, items: [String: ManifestItem], rootModelIdentifier: String) {
        self.fileFormatVersion = fileFormatVersion
        self.items = items
        self.rootModelIdentifier = rootModelIdentifier
    }

    /// Parses manifest JSON. `manifestPath` only labels errors.
    public init(jsonData: Data, manifestPath: String) throws {
        func malformed(_ reason: String) -> MLPackageError {
            .malformedManifest(path: manifestPath, reason: reason)
        }
        let parsed: Any
        do {
            parsed = try JSONSerialization.jsonObject(with: jsonData)
        } catch {
            throw malformed("invalid JSON (\(error.localizedDescription))")
        }
        guard let root = parsed as? [String: Any] else {
            throw malformed("top level is not a JSON object")
        }

        let version = root["fileFormatVersion"]
        if version != nil && !(version is String) {
            throw malformed("fileFormatVersion is not a string")
        }

        guard let entries = root["itemInfoEntries"] as? [String: Any] else {
            throw malformed("itemInfoEntries is missing or not an object")
        }
        var items: [String: ManifestItem] = [:]
        for (identifier, value) in entries {
            guard let entry = value as? [String: Any] else {
                throw malformed("item \(identifier) is not an object")
            }
            guard let path = entry["path"] as? String else {
                throw malformed("item \(identifier) has no string path")
            }
            items[identifier] = ManifestItem(
                identifier: identifier,
                name: entry["name"] as? String ?? "",
                path: path,
                author: entry["author"] as? String ?? "",
                description: entry["description"] as? String ?? ""
            )
        }

        guard let rootValue = root["rootModelIdentifier"], !(rootValue is NSNull) else {
            throw MLPackageError.missingRootModelIdentifier(manifestPath: manifestPath)
        }
        guard let rootIdentifier = rootValue as? String else {
            throw malformed("rootModelIdentifier is not a string")
        }
        guard items[rootIdentifier] != nil else {
            throw MLPackageError.rootItemMissing(manifestPath: manifestPath, identifier: rootIdentifier)
        }

        self.init(fileFormatVersion: version as? String, items: items, rootModelIdentifier: rootIdentifier)
    }
}
