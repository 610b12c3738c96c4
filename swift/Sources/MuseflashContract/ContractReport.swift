import Foundation
import ExportMetadata

public struct PropertyResult: Sendable, Equatable, CustomStringConvertible {
    public var name: String
    public var holds: Bool
    public var detail: String

    public init(name: String, holds: Bool, detail: String) {
        self.name = name
        self.holds = holds
        self.detail = detail
    }

    /// `PASS name` or `FAIL name: detail`.
    public var description: String {
        holds ? "PASS \(name)" : "FAIL \(name): \(detail)"
    }
}

public struct ContractReport: Sendable {
    public var exportDirectory: URL
    /// Nil when metadata.json declares a schema version this checker cannot decode.
    public var metadata: ExportMetadata?
    /// Role -> interface, for the packages that exist; roles sharing a package (schema version
    /// 3) map to the same interface, read once.
    public var packages: [ExportMetadata.AssetRole: PackageInterface]
    public var results: [PropertyResult]
    /// The Neural Engine audit (docs/ane.md); it never changes `allHold`.
    public var audit: DeviceAudit = DeviceAudit()

    public var allHold: Bool { results.allSatisfy(\.holds) }
    public var passedCount: Int { results.filter(\.holds).count }
    public var failedCount: Int { results.count - passedCount }
    public var failures: [PropertyResult] { results.filter { !$0.holds } }

    public func result(named name: String) -> PropertyResult? {
        results.first { $0.name == name }
    }

    public var verdictLines: [String] {
        results.map(\.description) + ["\(passedCount) passed, \(failedCount) failed"]
    }
}

/// Input the checker cannot judge at all, as opposed to a contract violation.
public enum ContractInputError: Error, Sendable, CustomStringConvertible {
    case exportDirectoryMissing(path: String)
    case metadata(ExportMetadataError)
    /// The package directory exists but cannot be read as a package.
    case unreadablePackage(role: ExportMetadata.AssetRole, path: String, reason: String)

    public var description: String {
        switch self {
        case .exportDirectoryMissing(let path):
            return "export directory \(path) does not exist or is not a directory"
        case .metadata(let error):
            return error.description
        case .unreadablePackage(let role, let path, let reason):
            return "the \(role) package \(path) is unreadable: \(reason)"
        }
    }
}
