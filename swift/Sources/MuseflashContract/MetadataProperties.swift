import Foundation
import ExportMetadata

extension LoadedBundle {
    func schemaVersion() -> PropertyResult {
        evaluate("metadata.schema_version") {
            guard metadata.isSchemaVersionSupported else {
                throw Violation(detail: "schema_version \(metadata.schemaVersion) is not one of "
                                + "\(ExportMetadata.supportedSchemaVersions); update the checker or re-export")
            }
            return "schema_version \(metadata.schemaVersion)"
        }
    }

    func assetsExist() -> PropertyResult {
        evaluate("metadata.assets_exist") {
            var problems = Problems()
            if metadata.assets.isEmpty { problems.add("metadata.json lists no assets") }
            for role in roles {
                if let reason = missing[role] { problems.add("\(role): \(reason)") }
            }
            return try problems.verdict(roles.map { "\($0)=\(metadata.assets[$0]!.path)" }.joined(separator: ", "))
        }
    }

    func embeddedMetadata(_ role: AssetRole) -> PropertyResult {
        evaluate("\(role).embedded_metadata") {
            let package = try package(role)
            let key = ContractChecker.embeddedMetadataKey
            guard let text = package.userDefinedMetadata[key] else {
                throw Violation(detail: "the package has no user-defined metadata entry \(key)")
            }
            let embedded: JSONValue
            do {
                embedded = try JSONDecoder().decode(JSONValue.self, from: Data(text.utf8))
            } catch {
                throw Violation(detail: "\(key) is not valid JSON (\(error))")
            }
            guard embedded == metadataJSON else {
                let differences = metadataJSON.differences(from: embedded)
                throw Violation(detail: "\(key) differs from metadata.json (first: metadata.json, second: embedded): "
                                + differences.joined(separator: "; "))
            }
            return "\(key) equals metadata.json"
        }
    }
}
