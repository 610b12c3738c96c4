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
/// (blob headers only): every blob any function references must lie inside its file
/// (`<role>.weight_file`, per package), and with compression declared the compressed
/// weights' blobs must fit their tensors (`<role>.compression.bytes`).
///
/// Each distinct package (`ExportMetadata.packages`: from schema version 3 the fused target
/// and the DFlash drafter share one) is read once. Properties of a package as a whole
/// (`<role>.embedded_metadata`, `<role>.compression.*`) run once per package, named by its
/// owner's role; properties of an asset (`<role>.states`, `<role>.function_map`, the target's
/// and drafters' signatures) look only at that asset's functions of the package.
///
/// An asset's functions are its function table (`ExportMetadata.Asset.functionTable`): with
/// context buckets, each bucket's (`main_64`, `prefill_64`) beside the whole-capacity ones, each
/// checked like its whole-capacity twin; `target.buckets` holds the buckets to the graph.
public struct ContractChecker {
    public typealias InterfaceLoader = (URL) throws -> PackageInterface

    public var loadInterface: InterfaceLoader

    public init(loadInterface: @escaping InterfaceLoader = PackageInterface.fromSpecification) {
        self.loadInterface = loadInterface
    }

    public func check(exportDirectory: URL) throws -> ContractReport {
        var isDirectory: ObjCBool = false
        guard FileManager.default.fileExists(atPath: exportDirectory.path, isDirectory: &isDirectory),
              isDirectory.boolValue else {
            throw ContractInputError.exportDirectoryMissing(path: exportDirectory.path)
        }

        let metadataURL = exportDirectory.appendingPathComponent(BundleContract.metadataFileName)
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
        for file in bundle.packageFiles {
            switch bundle.locate(file.path) {
            case .absent(let reason):
                for role in file.roles { bundle.missing[role] = reason }
            case .found(let url):
                let interface: PackageInterface
                do {
                    interface = try loadInterface(url)
                } catch let error as MLPackageError {
                    throw ContractInputError.unreadablePackage(role: file.owner, path: url.path, reason: error.description)
                } catch {
                    throw ContractInputError.unreadablePackage(role: file.owner, path: url.path,
                                                               reason: String(describing: error))
                }
                for role in file.roles { bundle.packages[role] = interface }
            }
        }

        return ContractReport(exportDirectory: exportDirectory, metadata: metadata,
                              packages: bundle.packages, results: bundle.evaluateAll(), audit: bundle.deviceAudit())
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
typealias PackageFile = ExportMetadata.Package

/// Everything the properties look at, after loading.
struct LoadedBundle {
    let directory: URL
    let metadata: ExportMetadata
    let metadataJSON: JSONValue
    /// The distinct packages, each with the roles stored in it, owners in pipeline order.
    let packageFiles: [PackageFile]
    /// Role -> the interface of its package; roles sharing a package share one interface.
    var packages: [AssetRole: PackageInterface] = [:]
    /// Role -> why its package is absent.
    var missing: [AssetRole: String] = [:]

    init(directory: URL, metadata: ExportMetadata, metadataJSON: JSONValue) {
        self.directory = directory
        self.metadata = metadata
        self.metadataJSON = metadataJSON
        self.packageFiles = metadata.packages
    }

    var roles: [AssetRole] { metadata.orderedRoles }

    /// The owner role of every distinct package, in pipeline order.
    var owners: [AssetRole] { packageFiles.map(\.owner) }

    /// The package `role`'s asset is stored in.
    func packageFile(of role: AssetRole) -> PackageFile? {
        packageFiles.first { $0.roles.contains(role) }
    }

    /// `the dflash_drafter package` for a package of its own, `the dflash_drafter package
    /// (target.mlpackage, shared with target)` for a shared one.
    func packageLabel(_ role: AssetRole) -> String {
        guard let file = packageFile(of: role), file.isShared else { return "the \(role) package" }
        let others = file.roles.filter { $0 != role }.map(\.rawValue).joined(separator: ", ")
        return "the \(role) package (\(file.path), shared with \(others))"
    }

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

    /// `path` (an asset's) in the export directory.
    func locate(_ path: String) -> Location {
        guard let url = exportURL(path) else {
            return .absent("path \"\(path)\" is not a relative path inside the export directory")
        }
        var isDirectory: ObjCBool = false
        guard FileManager.default.fileExists(atPath: url.path, isDirectory: &isDirectory) else {
            return .absent("\(path) does not exist")
        }
        guard isDirectory.boolValue else {
            return .absent("\(path) is a file, not a .mlpackage directory")
        }
        return .found(url)
    }

    /// The package of `role` (shared or not), or a violation saying why it cannot be checked.
    func package(_ role: AssetRole) throws -> PackageInterface {
        if let package = packages[role] { return package }
        if let reason = missing[role] {
            throw Violation(detail: "not checked: \(packageLabel(role)) is missing (\(reason); see metadata.assets_exist)")
        }
        throw Violation(detail: "not checked: metadata.json lists no \(role) asset")
    }

    func function(_ name: FunctionName, of role: AssetRole) throws -> FunctionDescription {
        let package = try package(role)
        guard let function = package.function(named: name.rawValue) else {
            throw Violation(detail: "\(packageLabel(role)) has no function \(name) (it has \(package.functionNames))")
        }
        return function
    }

    /// Function `name` of `role` and each of its context buckets' copies (`main_64`) that the
    /// package has, buckets first, so that each is checked like the whole-capacity one. That one
    /// must exist (`function(_:of:)` throws); a bucket function the package lacks is
    /// package.functions' and function_map's to report.
    func functionAndBuckets(_ name: FunctionName, of role: AssetRole) throws -> [FunctionDescription] {
        let whole = try function(name, of: role)
        let package = try package(role)
        let buckets = (metadata.assets[role]?.functionTable ?? []).filter { $0.function == name && $0.context != nil }
        return buckets.compactMap { package.function(named: $0.name) } + [whole]
    }

    /// The functions of `role`'s package that are `role`'s (`ExportMetadata.functions(of:in:)`).
    func functions(of role: AssetRole) throws -> [FunctionDescription] {
        metadata.functions(of: role, in: try package(role))
    }

    /// The target's `main` and `prefill` over its graph: each context bucket's (`main_64`,
    /// `prefill_64`, in function-table order), then the whole-capacity ones, which the graph
    /// properties (`target.kv_write`, `target.norm_form`) judge alike.
    var targetGraphFunctions: [String] {
        let buckets = (metadata.assets[.target]?.functionTable ?? [])
            .filter { $0.context != nil && [FunctionName.main, .prefill].contains($0.function) }
        return buckets.map(\.name) + [FunctionName.main, .prefill].map(\.rawValue)
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
        results += owners.map(embeddedMetadata)
        results.append(packageFunctions())
        // Every bundle needs a target, so its properties run (and fail) even when none is listed.
        results += targetProperties()
        results += kvWriteProperties()
        results += normFormProperties()
        results.append(selfCheckRecord())
        results += bucketProperties()
        if metadata.assets[.dflashDrafter] != nil {
            results += dflashDrafterProperties()
        }
        if metadata.assets[.ringDrafter] != nil {
            results += ringDrafterProperties()
        }
        results += roles.map(states)
        results += roles.map(functionMap)
        results += compressionProperties()
        results += owners.map(weightFile)
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

    /// The Core ML names of every function `role`'s asset lists: its function table
    /// (`Asset.functionTable`), each context bucket's (`main_64`) and the whole-capacity ones;
    /// without buckets, the keys of its `functions`. Empty when there is no such asset.
    func functionNames(of role: AssetRole) -> [String] {
        assets[role]?.functionTable.map(\.name) ?? []
    }

    /// The functions of `package` (the package of `role`) that are `role`'s, in package order.
    /// For a package of its own that is every function (as before schema version 3); in a
    /// shared package those its asset lists (bucket functions included), so the target's
    /// properties never judge the drafter's functions nor the other way round. A function no
    /// asset of a shared package lists is nobody's (`package.functions` fails for it).
    func functions(of role: AssetRole, in package: PackageInterface) -> [FunctionDescription] {
        guard let file = self.package(of: role), file.isShared else { return package.functions }
        let own = Set(functionNames(of: role))
        return package.functions.filter { own.contains($0.name) }
    }

    /// The functions of a shared `package` that none of its assets lists.
    func unlistedFunctions(of file: Package, in package: PackageInterface) -> [FunctionDescription] {
        let listed = Set(file.roles.flatMap(functionNames(of:)))
        return package.functions.filter { !listed.contains($0.name) }
    }
}
