import XCTest
import Foundation
import ExportMetadata
import TestSupport

/// metadata.json `compression` (schema version 2; here of version 3, counted per package under
/// its owner) as ExportMetadata decodes and encodes it.
final class CompressionMetadataTests: XCTestCase {
    private func data(_ edit: (inout SyntheticExport) -> Void = { _ in }) throws -> Data {
        var export = SyntheticExport.compressedFusedTargetWithDFlashDrafter()
        edit(&export)
        return Data(try export.metadataText().utf8)
    }

    private func decodingError(_ edit: (inout SyntheticExport) -> Void) throws -> ExportMetadataError? {
        do {
            _ = try ExportMetadata.decode(from: try data(edit), path: "metadata.json")
            XCTFail("decoding succeeded")
            return nil
        } catch let error as ExportMetadataError {
            return error
        }
    }

    private func withoutNulls(_ value: JSONValue) -> JSONValue {
        switch value {
        case .object(let members): return .object(members.filter { $0.value != .null }.mapValues(withoutNulls))
        case .array(let values): return .array(values.map(withoutNulls))
        default: return value
        }
    }

    func testCompressionDecodesEveryField() throws {
        let metadata = try ExportMetadata.decode(from: try data())
        XCTAssertEqual(metadata.schemaVersion, 3)
        XCTAssertTrue(metadata.isSchemaVersionSupported)
        let compression = try XCTUnwrap(metadata.compression)
        XCTAssertNil(compression.preset)
        XCTAssertEqual(compression.rules.map(\.match), ["*embed_tokens.weight", "lm_head.weight", "*mlp.down_proj*", "*"])
        XCTAssertEqual(compression.rules.map(\.mode), [.linear, .linear, .palettize, .linear])
        XCTAssertEqual(compression.rules[2], ExportMetadata.CompressionRule(match: "*mlp.down_proj*", mode: .palettize,
                                                                             bits: 4, groupSize: 4))
        XCTAssertEqual(compression.rules[3].blockSize, 8)
        XCTAssertNil(compression.rules[0].blockSize)
        XCTAssertEqual(compression.groups.map(\.rule), [0, 1, 2, 3])
        // The embedding is one checkpoint tensor, stored once in the package the target and the
        // drafter share, and counted under its owner.
        let embedding = compression.groups[0]
        XCTAssertEqual(embedding.mode, .linear)
        XCTAssertEqual(embedding.bits, 8)
        XCTAssertNil(embedding.blockSize)
        XCTAssertEqual(embedding.tensors, 1)
        XCTAssertEqual(embedding.bytesBefore, 64 * 16 * 2)
        XCTAssertEqual(embedding.bytesAfter, 64 * 16 + 64 * 2)
        XCTAssertEqual(embedding.packages, [.target: .init(tensors: 1, bytes: 1152)])
        // The target's and the drafter's down projections.
        let palettized = compression.groups[2]
        XCTAssertEqual(palettized.groupSize, 4)
        XCTAssertEqual(palettized.tensors, 2)
        XCTAssertEqual(palettized.packages, [.target: .init(tensors: 2, bytes: 2 * (16 * 32 / 2 + 4 * 16 * 2))])
        XCTAssertEqual(compression.fp16Tensors, 1)
        XCTAssertEqual(compression.fp16Bytes, 16 * 16 * 2)
    }

    /// `min_compressible_elements` is read when present; a bundle that does not record it
    /// (null or absent) decodes with nil.
    func testTheSmallestCompressibleSizeIsReadWhenRecorded() throws {
        let recorded = try ExportMetadata.decode(from: try data {
            $0.setMetadata(["compression", "min_compressible_elements"], to: 65536)
        })
        XCTAssertEqual(recorded.compression?.minCompressibleElements, 65536)
        XCTAssertNil(try ExportMetadata.decode(from: try data()).compression?.minCompressibleElements)
        let null = try ExportMetadata.decode(from: try data {
            $0.setMetadata(["compression", "min_compressible_elements"], to: NSNull())
        })
        XCTAssertNil(null.compression?.minCompressibleElements)
        XCTAssertEqual(try decodingError {
            $0.setMetadata(["compression", "min_compressible_elements"], to: "large")
        }, .wrongType(path: "metadata.json", keyPath: "compression.min_compressible_elements", expected: "an integer"))
    }

    func testPresetsAndVersionOneDecode() throws {
        for preset in ["4bit", "8bit", "palettize4"] {
            let metadata = try ExportMetadata.decode(from: try data { $0.setMetadata(["compression", "preset"], to: preset) })
            XCTAssertEqual(metadata.compression?.preset?.rawValue, preset)
        }
        // A version-1 document is one without compression; null and absent are the same.
        for edit in [{ (export: inout SyntheticExport) in export.setMetadata(["compression"], to: NSNull()) },
                     { (export: inout SyntheticExport) in export.removeMetadata(["compression"]) }] {
            let metadata = try ExportMetadata.decode(from: try data {
                edit(&$0)
                $0.setMetadata(["schema_version"], to: 1)
            })
            XCTAssertNil(metadata.compression)
            XCTAssertTrue(metadata.isSchemaVersionSupported)
        }
    }

    /// Encoding gives back the JSON that was decoded; Swift leaves out what Python writes as null.
    func testEncodingRoundTrips() throws {
        let original = try JSONDecoder().decode(JSONValue.self, from: try data())
        let encoded = try JSONEncoder().encode(try ExportMetadata.decode(from: try data()))
        XCTAssertEqual(withoutNulls(try JSONDecoder().decode(JSONValue.self, from: encoded)), withoutNulls(original))
    }

    func testUnknownNamesAreRejectedNamingTheirPath() throws {
        let cases: [(edit: (inout SyntheticExport) -> Void, reported: String)] = [
            ({ $0.editCompressionGroup(0) { $0["mode"] = "sparse" } }, "compression.groups[0].mode"),
            ({ $0.editCompressionGroup(1) { $0["packages"] = ["vision": ["tensors": 1, "bytes": 2]] } },
             "compression.groups[1].packages.vision"),
            ({ $0.setMetadata(["compression", "preset"], to: "2bit") }, "compression.preset"),
            ({ $0.setMetadata(["compression", "rules"], to: [["match": "*", "mode": "prune"]]) }, "compression.rules[0].mode"),
        ]
        for (edit, reported) in cases {
            let error = try decodingError(edit)
            guard case .invalidValue(_, let path, let reason)? = error else {
                XCTFail("\(reported): \(String(describing: error))")
                continue
            }
            XCTAssertEqual(path, reported)
            XCTAssertTrue(reason.hasPrefix("unknown "), reason)
        }
    }

    func testMissingRequiredKeyIsNamed() throws {
        XCTAssertEqual(try decodingError { $0.editCompressionGroup(2) { $0.removeValue(forKey: "bits") } },
                       .missingKey(path: "metadata.json", keyPath: "compression.groups[2].bits"))
        XCTAssertEqual(try decodingError { $0.removeMetadata(["compression", "fp16_bytes"]) },
                       .missingKey(path: "metadata.json", keyPath: "compression.fp16_bytes"))
    }

    func testUnknownKeysAndAbsentOptionalsAreTolerated() throws {
        let plain = try ExportMetadata.decode(from: try data())
        let extended = try ExportMetadata.decode(from: try data { export in
            export.setMetadata(["compression", "added_later"], to: ["x": 1])
            export.editCompressionGroup(3) { group in
                group["added_later"] = [1]
                var packages = group["packages"] as! [String: Any]
                var target = packages["target"] as! [String: Any]
                target["added_later"] = "x"
                packages["target"] = target
                group["packages"] = packages
                group.removeValue(forKey: "group_size")
            }
            var rules = SyntheticExport.compressionRules
            rules[0]["added_later"] = true
            rules[0].removeValue(forKey: "block_size")
            export.setMetadata(["compression", "rules"], to: rules)
        })
        XCTAssertEqual(extended, plain)
    }
}
