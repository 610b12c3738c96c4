import Foundation
import ExportMetadata
import MLPackage

/// Checks an export directory against the device-side contract. Violations
/// become failing properties; only input that cannot be judged at all (no
/// directory, no or unparsable metadata.json, a package that exists but
/// cannot be read) throws `ContractInputError`.
///
/// An asset whose package is absent fails `metadata.assets_exist`, and every
/// property about that package fails too, saying it was not checked: absence
/// is a contract violation, corruption is unreadable input. Weight files are read
/// (blob headers only) by the compression properties, and only when metadata.json
/// declares compression; a damaged weight file fails `<role>.compression.bytes`.
public struct ContractChecker {
    public typealias InterfaceLoader = (URL) throws -> PackageInterface

    public var loadInterface: InterfaceLoader

    public init(loadInterface: @escaping InterfaceLoader = PackageInterface.fromSpecification) {
        self.loadInterface = loadInterface
    }

    public static let embeddedMetadataKey = "museflash.metadata"

    public func check(exportDirectory: URL) throws -> ContractReport {
        var isDirectory: ObjCBool = false
        guard FileManager.default.fileExists(atPath: exportDirectory.path, isDirectory: &isDirectory),
              isDirectory.boolValue else {
            throw ContractInputError.exportDirectoryMissing(path: exportDirectory.path)
        }

        let metadataURL = exportDirectory.appendingPathComponent(ExportMetadata.fileName)
        let metadata: ExportMetadata
        let metadataJSON: JSONValue
        do {
            let data = try ExportMetadata.readFile(at: metadataURL)
            metadataJSON = try JSONDecoder().decode(JSONValue.self, from: data)
            let version = try ExportMetadata.decodeSchemaVersion(from: data, path: metadataURL.path)
            do {
                metadata = try ExportMetadata.decode(from: data, path: metadataURL.path)
            } catch where !ExportMetadata.supportedSchemaVersions.contains(version) {
                // A future schema may be shaped differently; say so rather
                // than blaming whichever key no longer decodes.
                let detail = "schema_version \(version) is not one of \(ExportMetadata.supportedSchemaVersions) "
                    + "and the file does not decode as any of them (\(error)); no other property was checked"
                return ContractReport(exportDirectory: exportDirectory, metadata: nil, packages: [:],
                                      results: [PropertyResult(name: "metadata.schema_version", holds: false, detail: detail)])
            }
        } catch let error as ExportMetadataError {
            throw ContractInputError.metadata(error)
        } catch let error as DecodingError {
            throw ContractInputError.metadata(ExportMetadataError(decodingError: error, path: metadataURL.path))
        }

        var bundle = LoadedBundle(directory: exportDirectory, metadata: metadata, metadataJSON: metadataJSON)
        for role in bundle.roles {
            guard let asset = metadata.assets[role] else { continue }
            switch bundle.locate(asset) {
            case .absent(let reason):
                bundle.missing[role] = reason
            case .found(let url):
                do {
                    bundle.packages[role] = try loadInterface(url)
                } catch let error as MLPackageError {
                    throw ContractInputError.unreadablePackage(role: role, path: url.path, reason: error.description)
                } catch {
                    throw ContractInputError.unreadablePackage(role: role, path: url.path, reason: String(describing: error))
                }
            }
        }

        return ContractReport(exportDirectory: exportDirectory, metadata: metadata,
                              packages: bundle.packages, results: bundle.evaluateAll())
    }
}

typealias AssetRole = ExportMetadata.AssetRole
typealias AssetKind = ExportMetadata.AssetKind
typealias FunctionName = ExportMetadata.FunctionName
typealias InputName = ExportMetadata.InputName
typealias OutputName = ExportMetadata.OutputName
typealias StateKind = ExportMetadata.StateKind
typealias LayerType = ExportMetadata.LayerType
typealias DrafterKind = ExportMetadata.DrafterKind

/// Everything the properties look at, after loading.
struct LoadedBundle {
    let directory: URL
    let metadata: ExportMetadata
    let metadataJSON: JSONValue
    var packages: [AssetRole: PackageInterface] = [:]
    /// Role -> why its package is absent.
    var missing: [AssetRole: String] = [:]

    init(directory: URL, metadata: ExportMetadata, metadataJSON: JSONValue) {
        self.directory = directory
        self.metadata = metadata
        self.metadataJSON = metadataJSON
    }

    var roles: [AssetRole] { metadata.orderedRoles }

    enum Location {
        case found(URL)
        case absent(String)
    }

    /// `path` inside the export directory, or nil when it is absolute or leaves the directory.
    func exportURL(_ path: String) -> URL? {
        let components = path.split(separator: "/", omittingEmptySubsequences: true)
        guard !path.hasPrefix("/"), !path.contains("\0"), !components.isEmpty, !components.contains("..") else {
            return nil
        }
        return components.reduce(directory) { $0.appendingPathComponent(String($1)) }
    }

    func locate(_ asset: ExportMetadata.Asset) -> Location {
        guard let url = exportURL(asset.path) else {
            return .absent("path \"\(asset.path)\" is not a relative path inside the export directory")
        }
        var isDirectory: ObjCBool = false
        guard FileManager.default.fileExists(atPath: url.path, isDirectory: &isDirectory) else {
            return .absent("\(asset.path) does not exist")
        }
        guard isDirectory.boolValue else {
            return .absent("\(asset.path) is a file, not a .mlpackage directory")
        }
        return .found(url)
    }

    /// The package of `role`, or a violation saying why it cannot be checked.
    func package(_ role: AssetRole) throws -> PackageInterface {
        if let package = packages[role] { return package }
        if let reason = missing[role] {
            throw Violation(detail: "not checked: the \(role) package is missing (\(reason); see metadata.assets_exist)")
        }
        throw Violation(detail: "not checked: metadata.json lists no \(role) asset")
    }

    func function(_ name: FunctionName, of role: AssetRole) throws -> FunctionDescription {
        let package = try package(role)
        guard let function = package.function(named: name.rawValue) else {
            throw Violation(detail: "the \(role) package has no function \(name) (it has \(package.functionNames))")
        }
        return function
    }

    func speculativeDecoding() throws -> ExportMetadata.SpeculativeDecoding {
        guard let settings = metadata.speculativeDecoding else {
            throw Violation(detail: "metadata.json has no speculative_decoding, which a drafter needs")
        }
        return settings
    }

    func evaluateAll() -> [PropertyResult] {
        var results = [schemaVersion(), assetsExist()]
        if let speculative = metadata.speculativeDecoding {
            results.append(drafterKindMetadata(speculative))
        }
        results += roles.map(embeddedMetadata)
        // Every bundle needs a target, so its properties run (and fail) even when none is listed.
        results += targetProperties()
        if metadata.assets[.dflashDrafter] != nil {
            results += dflashDrafterProperties()
        }
        if metadata.assets[.ringDrafter] != nil {
            results += ringDrafterProperties()
        }
        results += roles.map(states)
        results += roles.map(functionMap)
        results += compressionProperties()
        if let tokenizer = metadata.tokenizer {
            results += tokenizerProperties(tokenizer)
        }
        return results
    }
}

extension ExportMetadata {
    /// The roles present, in pipeline order.
    var orderedRoles: [AssetRole] {
        AssetRole.allCases.filter { assets[$0] != nil }
    }
}
