import XCTest
import Foundation
import ExportMetadata
import MuseflashContract
import TestSupport

/// Random damage of kinds whose verdict is known, each round asserting the verdict its damage
/// must produce. The generator is seeded: the seed is printed, and
/// MUSEFLASH_RANDOM_DAMAGE_SEED=<seed> replays a run.
final class RandomDamageTests: XCTestCase {
    static let defaultSeed: UInt64 = 0x6D75_7365_666C_6173

    enum Damage: CaseIterable {
        /// One byte of metadata.json replaced by another byte.
        case metadataByte
        /// One byte of the metadata text embedded in a package's spec replaced by another
        /// printable character; the spec stays well formed.
        case embeddedMetadataByte
        /// Bytes of a weight file replaced; weights are never read.
        case weightBytes
        /// A package's Manifest.json cut short.
        case manifestTruncation
    }

    /// The export, the owner roles of its packages (which name the per-package properties) and
    /// its properties: schema version 3 (one shared package) and 2 (a package per asset), in turn.
    private let exports: [(export: SyntheticExport, roles: [ExportMetadata.AssetRole], properties: [String])] = [
        (.fusedTargetWithDFlashDrafter(), [.target], ContractAssertions.dflashBundleProperties),
        (.fusedTargetWithSeparateDFlashDrafter(), [.target, .dflashDrafter], ContractAssertions.separateDFlashBundleProperties),
    ]

    static func seed() throws -> UInt64 {
        try XCTUnwrap(FuzzGenerator.seed(orElse: defaultSeed),
                      "\(FuzzGenerator.seedVariable) is not a 64-bit unsigned integer")
    }

    func testRandomDamageYieldsTheVerdictItMust() throws {
        let seed = try Self.seed()
        print("RandomDamageTests seed: \(seed) (replay with MUSEFLASH_RANDOM_DAMAGE_SEED=\(seed))")
        var generator = FuzzGenerator(seed: seed)
        var pristine: [URL] = []
        defer { pristine.forEach(ScratchDirectory.remove) }
        for (export, _, _) in exports {
            pristine.append(try ScratchDirectory.make())
            try export.write(to: pristine.last!)
        }

        for round in 0..<48 {
            let scratch = try ScratchDirectory.make()
            defer { ScratchDirectory.remove(scratch) }
            let directory = scratch.appendingPathComponent("export")
            let which = round / Damage.allCases.count % exports.count
            let (export, roles, properties) = exports[which]
            try FileManager.default.copyItem(at: pristine[which], to: directory)
            let embeddedText = Data(try export.metadataText().utf8)
            let damage = Damage.allCases[round % Damage.allCases.count]
            let role = roles.randomElement(using: &generator)!
            let label = "seed \(seed) round \(round) (schema \(export.metadata["schema_version"] ?? "?"))"

            switch damage {
            case .metadataByte:
                let url = directory.appendingPathComponent(BundleContract.metadataFileName)
                let change = try replaceByte(in: url, range: nil, using: &generator) { old, generator in
                    old &+ UInt8.random(in: 1...255, using: &generator)
                }
                try assertMetadataDamageIsCaught(in: directory, roles: roles, "\(label): metadata.json \(change)")
            case .embeddedMetadataByte:
                let url = ContractAssertions.modelURL(directory, role: role.rawValue)
                let spec = try Data(contentsOf: url)
                let text = try XCTUnwrap(spec.range(of: embeddedText), "\(label): no embedded metadata in the \(role) spec")
                let change = try replaceByte(in: url, range: text, using: &generator) { old, generator in
                    var byte = old
                    while byte == old { byte = UInt8.random(in: 0x20...0x7E, using: &generator) }
                    return byte
                }
                let report = try ContractChecker().check(exportDirectory: directory)
                let verdict = "\(label): \(role) embedded metadata \(change)\n" + report.verdictLines.joined(separator: "\n")
                XCTAssertEqual(report.results.map(\.name), properties, verdict)
                XCTAssertEqual(report.failures.map(\.name), ["\(role).embedded_metadata"], verdict)
            case .weightBytes:
                let url = ContractAssertions.packageURL(directory, role: role.rawValue)
                    .appendingPathComponent(PackageSpec.weightPath)
                for _ in 0..<Int.random(in: 1...8, using: &generator) {
                    _ = try replaceByte(in: url, range: nil, using: &generator) { old, _ in ~old }
                }
                let report = try ContractChecker().check(exportDirectory: directory)
                XCTAssertTrue(report.allHold, "\(label): damaged \(role) weights must not matter\n"
                              + report.verdictLines.joined(separator: "\n"))
            case .manifestTruncation:
                let url = ContractAssertions.packageURL(directory, role: role.rawValue).appendingPathComponent("Manifest.json")
                let bytes = try Data(contentsOf: url)
                let length = Int.random(in: 0..<bytes.count, using: &generator)
                try bytes.prefix(length).write(to: url)
                do {
                    let report = try ContractChecker().check(exportDirectory: directory)
                    XCTFail("\(label): \(role) Manifest.json cut to \(length) bytes gave a report:\n"
                            + report.verdictLines.joined(separator: "\n"))
                } catch ContractInputError.unreadablePackage(let failedRole, _, _) {
                    XCTAssertEqual(failedRole, role, "\(label): \(role) Manifest.json cut to \(length) bytes")
                } catch {
                    XCTFail("\(label): \(role) Manifest.json cut to \(length) bytes: unexpected \(error)")
                }
            }
        }
    }

    /// Replaces one byte at a random offset (within `range` if given) by `replacement(old)`
    /// and says what it did.
    private func replaceByte(in url: URL, range: Range<Data.Index>?, using generator: inout FuzzGenerator,
                             _ replacement: (UInt8, inout FuzzGenerator) -> UInt8) throws -> String {
        var bytes = try Data(contentsOf: url)
        let offset = Int.random(in: range ?? bytes.startIndex..<bytes.endIndex, using: &generator)
        let old = bytes[offset]
        let new = replacement(old, &generator)
        XCTAssertNotEqual(old, new)
        bytes[offset] = new
        try bytes.write(to: url)
        return "byte \(offset) \(old) -> \(new)"
    }

    /// metadata.json no longer equals the text every package embeds, so the checker must refuse
    /// it as input, report only an unknown schema version, or fail every embedded_metadata (one
    /// per package, named by the owner `roles`).
    private func assertMetadataDamageIsCaught(in directory: URL, roles: [ExportMetadata.AssetRole], _ label: String) throws {
        let report: ContractReport
        do {
            report = try ContractChecker().check(exportDirectory: directory)
        } catch let error as ContractInputError {
            guard case .metadata = error else { return XCTFail("\(label): unexpected input error \(error)") }
            return
        }
        let verdict = "\(label)\n" + report.verdictLines.joined(separator: "\n")
        if report.metadata == nil {
            XCTAssertEqual(report.results.map(\.name), ["metadata.schema_version"], verdict)
            XCTAssertFalse(report.allHold, verdict)
            return
        }
        for role in roles {
            XCTAssertEqual(report.result(named: "\(role).embedded_metadata")?.holds, false, verdict)
        }
    }
}
