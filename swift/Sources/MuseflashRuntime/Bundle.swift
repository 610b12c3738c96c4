import ExportMetadata
import Foundation
import MLPackage

/// An export directory opened for decoding: its metadata.json (read with the contract's own
/// `ExportMetadata` types) and the packages and functions it lists, each checked to exist.
/// Nothing about the model is hard-coded: query lengths, block size, mask id, the number of
/// drafted tokens, the states and the drafter kind all come from the metadata.
public struct MuseflashBundle: Sendable {
    public let url: URL
    public let metadata: ExportMetadata
    /// Token ids named in tokenizer_config.json (`pad_token`, `eos_token`), resolved through
    /// metadata.json's `tokenizer.special_tokens`; nil when the bundle does not name one.
    public let padTokenID: Int32?
    public let eosTokenID: Int32?
    /// metadata.json as JSON, to compare with what a shipped compiled model embeds (nil for a
    /// bundle made in memory).
    public var metadataJSON: JSONValue? = nil

    public static func open(_ url: URL) throws -> MuseflashBundle {
        var isDirectory: ObjCBool = false
        guard FileManager.default.fileExists(atPath: url.path, isDirectory: &isDirectory), isDirectory.boolValue else {
            throw RuntimeError.exportDirectoryMissing(path: url.path)
        }
        let metadataURL = url.appendingPathComponent(BundleContract.metadataFileName)
        let data = try ExportMetadata.readFile(at: metadataURL)
        let version = try ExportMetadata.decodeSchemaVersion(from: data, path: metadataURL.path)
        guard ExportMetadata.supportedSchemaVersions.contains(version) else {
            throw RuntimeError.unsupportedSchema(path: metadataURL.path, version: version,
                                                 supported: ExportMetadata.supportedSchemaVersions)
        }
        let metadata = try ExportMetadata.decode(from: data, path: metadataURL.path)
        for package in metadata.packages {
            let packageURL = url.appendingPathComponent(package.path)
            guard FileManager.default.fileExists(atPath: packageURL.path) else {
                // A bundle may ship the compiled form instead (an app that Xcode built); Core ML
                // checks its functions against metadata.json when the backend loads them.
                guard FileManager.default.fileExists(atPath: Self.compiledForm(of: packageURL).path) else {
                    throw RuntimeError.packageMissing(path: packageURL.path)
                }
                continue
            }
            let opened = try MLPackage.open(at: packageURL)
            let available = opened.specification.program?.functions.map { $0.name } ?? []
            for role in package.roles {
                for function in metadata.assets[role]?.functions.keys.map(\.rawValue).sorted() ?? [] where !available.contains(function) {
                    throw RuntimeError.functionMissing(package: packageURL.path, function: function, available: available)
                }
            }
        }
        let special = metadata.tokenizer?.specialTokens ?? [:]
        let config = Self.tokenizerConfig(in: url)
        func named(_ key: String) -> Int32? {
            guard let text = config[key], let id = special[text] else { return nil }
            return Int32(id)
        }
        return MuseflashBundle(url: url, metadata: metadata, padTokenID: named("pad_token"), eosTokenID: named("eos_token"),
                               metadataJSON: try? JSONDecoder().decode(JSONValue.self, from: data))
    }

    /// tokenizer_config.json's token names (a token is written as its text or as
    /// `{"content": text}`); empty when the file is absent or unreadable.
    static func tokenizerConfig(in url: URL) -> [String: String] {
        guard let data = try? Data(contentsOf: url.appendingPathComponent(BundleContract.tokenizerConfigFileName)),
              let object = try? JSONSerialization.jsonObject(with: data) as? [String: Any] else { return [:] }
        var names: [String: String] = [:]
        for (key, value) in object {
            if let text = value as? String { names[key] = text }
            if let entry = value as? [String: Any], let text = entry["content"] as? String { names[key] = text }
        }
        return names
    }

    /// Bytes of every package's weight files (`Data/**/weights/*`).
    public var weightFileBytes: Int {
        var total = 0
        for package in metadata.packages {
            let root = url.appendingPathComponent(package.path)
            guard let walker = FileManager.default.enumerator(at: root, includingPropertiesForKeys: [.fileSizeKey]) else { continue }
            for case let file as URL in walker where file.deletingLastPathComponent().lastPathComponent == "weights" {
                total += (try? file.resourceValues(forKeys: [.fileSizeKey]).fileSize) ?? 0
            }
        }
        return total
    }

    /// Bytes of every state the bundle declares, at their fp16 size.
    public var stateBytes: Int {
        metadata.assets.values.flatMap(\.states).reduce(0) { $0 + 2 * $1.shape.reduce(1, *) }
    }

    public func packageURL(of role: ExportMetadata.AssetRole) throws -> URL {
        guard let asset = metadata.assets[role] else {
            throw RuntimeError.badMetadata(reason: "no \(role) asset")
        }
        return url.appendingPathComponent(asset.path)
    }

    /// What a backend loads for `role`: its `.mlpackage`, or the `.mlmodelc` the bundle ships
    /// in its place.
    public func modelURL(of role: ExportMetadata.AssetRole) throws -> URL {
        let package = try packageURL(of: role)
        if FileManager.default.fileExists(atPath: package.path) { return package }
        return Self.compiledForm(of: package)
    }

    /// `name.mlmodelc` beside `name.mlpackage`.
    public static func compiledForm(of package: URL) -> URL {
        package.deletingPathExtension().appendingPathExtension("mlmodelc")
    }
}
