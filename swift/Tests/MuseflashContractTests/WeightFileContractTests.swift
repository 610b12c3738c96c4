import XCTest
import Foundation
import ExportMetadata
import MLPackage
import MuseflashContract
import TestSupport

/// `<owner>.weight_file`: every blob any function's program references has a valid header inside
/// weight.bin and a payload that fits in it, with or without compression declared. A weight.bin
/// cut short, shortened or zero-filled fails the property by name, and truncating it anywhere
/// (seeded, many offsets) never crashes the checker.
final class WeightFileContractTests: XCTestCase {
    /// The compressed synthetic export with every weight stored as a plain fp16 const and no
    /// compression declared: the checker read no weight file for such a bundle before.
    private static var fp16Export: SyntheticExport {
        var export = SyntheticExport.compressedFusedTargetWithDFlashDrafter()
        let key = export.packageKey(role: "target")
        export.packages[key]!.weights = export.packages[key]!.weights.map {
            WeightSpec($0.name, key: $0.key, $0.shape, .fp16)
        }
        export.metadata["compression"] = nil
        return export
    }

    private let exports: [(label: String, export: SyntheticExport, expected: [String])] = [
        ("fp16", fp16Export, ContractAssertions.dflashBundleProperties),
        ("compressed", .compressedFusedTargetWithDFlashDrafter(), ContractAssertions.compressedDFlashBundleProperties),
    ]

    private static func weightFile(_ directory: URL) -> URL {
        ContractAssertions.packageURL(directory, role: "target").appendingPathComponent(PackageSpec.weightPath)
    }

    /// Where the last blob's payload ends: the file may not be cut anywhere before it.
    private static func payloadEnd(of export: SyntheticExport) throws -> Int {
        let offsets = try XCTUnwrap(export.packages[export.packageKey(role: "target")]?.storage().offsets)
        let all = Set(offsets.values.flatMap { [$0.data, $0.side, $0.fp16].compactMap { $0 } })
        let directory = try ScratchDirectory.make()
        defer { ScratchDirectory.remove(directory) }
        try export.write(to: directory)
        let headers = try WeightFile.readHeaders(at: all, of: weightFile(directory))
        return try headers.values.map { Int(try $0.get().dataOffset + $0.get().size) }.max() ?? 0
    }

    func testEveryReferencedBlobIsCheckedWithOrWithoutCompression() throws {
        for (label, export, expected) in exports {
            let report = try ContractAssertions.check(export)
            ContractAssertions.assertFailing([], in: report, expected: expected)
            let detail = ContractAssertions.detail("target.weight_file", in: report)
            XCTAssertTrue(detail.contains("blobs, each header and payload inside the file"), "\(label): \(detail)")
        }
    }

    func testTruncatedShortenedOrZeroFilledWeightFileFailsByName() throws {
        let damages: [(String, (inout Data) -> Void)] = [
            ("cut to a third", { $0 = $0.prefix($0.count / 3) }),
            ("last byte cut", { $0 = $0.dropLast() }),
            ("zero-filled", { $0 = Data(count: $0.count) }),
            ("emptied", { $0 = Data() }),
        ]
        for (label, export, expected) in exports {
            for (damageLabel, damage) in damages {
                let report = try ContractAssertions.check(export) { directory in
                    let url = Self.weightFile(directory)
                    var data = try Data(contentsOf: url)
                    damage(&data)
                    try data.write(to: url)
                }
                let verdict = "\(label), \(damageLabel):\n" + report.verdictLines.joined(separator: "\n")
                XCTAssertEqual(report.results.map(\.name), expected, verdict)
                XCTAssertEqual(report.result(named: "target.weight_file")?.holds, false, verdict)
                let detail = ContractAssertions.detail("target.weight_file", in: report)
                XCTAssertTrue(detail.contains("weight.bin"), verdict)
                // Only the weight file's own properties may fail.
                let others = Set(report.failures.map(\.name)).subtracting(["target.weight_file", "target.compression.bytes"])
                XCTAssertEqual(others, [], verdict)
            }
        }
    }

    func testAMissingWeightFileFailsByName() throws {
        let report = try ContractAssertions.check(Self.fp16Export) { directory in
            try FileManager.default.removeItem(at: Self.weightFile(directory))
        }
        ContractAssertions.assertFailing(["target.weight_file"], in: report)
        XCTAssertTrue(ContractAssertions.detail("target.weight_file", in: report).contains("does not exist"))
    }

    /// Truncation at seeded pseudo-random offsets before the last payload's end, of both exports:
    /// the checker returns a report every time (never throws nor crashes) in which the property
    /// fails. MUSEFLASH_RANDOM_DAMAGE_SEED=<seed> replays a run, as in RandomDamageTests.
    func testTruncationAtRandomOffsetsAlwaysFailsTheProperty() throws {
        let seed = try RandomDamageTests.seed()
        print("WeightFileContractTests seed: \(seed)")
        var generator = FuzzGenerator(seed: seed)
        for (label, export, expected) in exports {
            let end = try Self.payloadEnd(of: export)
            let pristine = try ScratchDirectory.make()
            defer { ScratchDirectory.remove(pristine) }
            try export.write(to: pristine)
            let original = try Data(contentsOf: Self.weightFile(pristine))
            XCTAssertGreaterThan(end, 1024, label)
            for round in 0..<64 {
                let cut = Int.random(in: 0..<end, using: &generator)
                let scratch = try ScratchDirectory.make()
                defer { ScratchDirectory.remove(scratch) }
                let directory = scratch.appendingPathComponent("export")
                try FileManager.default.copyItem(at: pristine, to: directory)
                try original.prefix(cut).write(to: Self.weightFile(directory))
                let report = try ContractChecker().check(exportDirectory: directory)
                let verdict = "seed \(seed) \(label) round \(round), cut at \(cut) of \(original.count):\n"
                    + report.verdictLines.joined(separator: "\n")
                XCTAssertEqual(report.results.map(\.name), expected, verdict)
                XCTAssertEqual(report.result(named: "target.weight_file")?.holds, false, verdict)
            }
        }
    }
}
