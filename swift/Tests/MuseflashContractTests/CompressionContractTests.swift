import XCTest
import Foundation
import ExportMetadata
import MuseflashContract
import TestSupport

/// A compressed export (constexpr ops over blobs of weight.bin, declared in metadata.json),
/// broken one way at a time.
final class CompressionContractTests: XCTestCase {
    private var export = SyntheticExport.compressedFusedTargetWithDFlashDrafter()
    private let expected = ContractAssertions.compressedDFlashBundleProperties

    private func report(damage: (URL) throws -> Void = { _ in }) throws -> ContractReport {
        try ContractAssertions.check(export, damage: damage)
    }

    private func detail(_ name: String, _ report: ContractReport) -> String {
        ContractAssertions.detail(name, in: report)
    }

    private func weightFile(_ directory: URL, role: String) -> URL {
        ContractAssertions.packageURL(directory, role: role).appendingPathComponent(PackageSpec.weightPath)
    }

    /// Overwrites `bytes` at `offset` of the role's weight.bin.
    private func patch(_ directory: URL, role: String, at offset: UInt64, _ bytes: [UInt8]) throws {
        let url = weightFile(directory, role: role)
        var data = try Data(contentsOf: url)
        data.replaceSubrange(Int(offset)..<Int(offset) + bytes.count, with: bytes)
        try data.write(to: url)
    }

    private func offsets(_ role: String, _ weight: String) throws -> PackageSpec.BlobOffsets {
        try XCTUnwrap(export.packages[role]?.storage().offsets[weight])
    }

    func testCompressedExportPassesEveryProperty() throws {
        let report = try report()
        ContractAssertions.assertFailing([], in: report, expected: expected)
        // The embedding and the head are both int8 per output channel: the ops cannot say which
        // rule each came from, so the two groups are counted together.
        XCTAssertTrue(detail("target.compression.stored_compressed", report)
            .contains("groups 0, 1 (linear int8 per output channel): 2"), detail("target.compression.stored_compressed", report))
        XCTAssertTrue(detail("target.compression.ops_declared", report).contains("2 constexpr_lut_to_dense"),
                      detail("target.compression.ops_declared", report))
        XCTAssertTrue(detail("dflash_drafter.compression.functions_agree", report).contains("1 of them used by several"),
                      detail("dflash_drafter.compression.functions_agree", report))
    }

    func testExportWithoutCompressionPassesOpsDeclared() throws {
        let report = try ContractAssertions.check(.fusedTargetWithDFlashDrafter())
        ContractAssertions.assertFailing([], in: report)
        XCTAssertEqual(detail("target.compression.ops_declared", report),
                       "no constexpr ops, and metadata.json declares no compression")
    }

    // MARK: A weight stored as fp16

    func testWeightStoredAsFP16LeavesItsGroupShort() throws {
        export.editWeight(role: "target", "p_layers_0_mlp_up_proj_weight") { $0.storage = .fp16 }
        let report = try report()
        ContractAssertions.assertFailing(["target.compression.stored_compressed", "target.compression.bytes"],
                                         in: report, expected: expected)
        XCTAssertTrue(detail("target.compression.stored_compressed", report).contains(
            "group 3 (linear int4 block_size 8): metadata.json declares 2 target weights, the package stores 1 compressed"),
            detail("target.compression.stored_compressed", report))
    }

    func testWeightCompressedInOneFunctionOnlyFailsFunctionsAgree() throws {
        export.editFunction(role: "target", "prefill") { $0.plainWeights = ["p_layers_0_mlp_down_proj_weight"] }
        let report = try report()
        ContractAssertions.assertFailing(["target.compression.functions_agree"], in: report, expected: expected)
        XCTAssertTrue(detail("target.compression.functions_agree", report).contains(
            "prefill.p_layers_0_mlp_down_proj_weight [16, 32] is a plain fp16 const but "
            + "main.p_layers_0_mlp_down_proj_weight is constexpr_lut_to_dense"), detail("target.compression.functions_agree", report))
    }

    // MARK: Ops of no declared group

    func testWrongBlockSizeFailsOpsDeclared() throws {
        export.editWeight(role: "target", "p_layers_0_mlp_gate_proj_weight") { $0.storage = .linear(bits: 4, blockSize: 4) }
        let report = try report()
        ContractAssertions.assertFailing(["target.compression.ops_declared", "target.compression.stored_compressed",
                                          "target.compression.bytes"], in: report, expected: expected)
        let ops = detail("target.compression.ops_declared", report)
        XCTAssertTrue(ops.contains("main.p_layers_0_mlp_gate_proj_weight (constexpr_blockwise_shift_scale data INT4 [32, 16], "
                                   + "scale FLOAT16 [32, 4]) is linear int4 block_size 4"), ops)
        XCTAssertTrue(ops.contains("linear int4 block_size 8"), ops)
        XCTAssertTrue(detail("target.compression.stored_compressed", report).contains("1 compressed weights match no declared group"))
    }

    func testWrongBitsOrGroupSizeFailOpsDeclared() throws {
        let cases: [(String, String, WeightSpec.Storage, String)] = [
            ("target", "p_layers_0_mlp_up_proj_weight", .linear(bits: 8, blockSize: 8), "is linear int8 block_size 8"),
            ("dflash_drafter", "p_layers_0_mlp_down_proj_weight", .palettize(bits: 4, groupSize: 8), "is palettize uint4 group_size 8"),
            ("dflash_drafter", "p_layers_0_mlp_down_proj_weight", .palettize(bits: 8, groupSize: 4), "is palettize uint8 group_size 4"),
            ("target", "p_embed_tokens_weight", .linear(bits: 8, blockSize: 8), "is linear int8 block_size 8"),
        ]
        for (role, weight, storage, fragment) in cases {
            var broken = SyntheticExport.compressedFusedTargetWithDFlashDrafter()
            broken.editWeight(role: role, weight) { $0.storage = storage }
            let report = try ContractAssertions.check(broken)
            let verdict = report.verdictLines.joined(separator: "\n")
            XCTAssertEqual(report.result(named: "\(role).compression.ops_declared")?.holds, false, verdict)
            XCTAssertTrue(detail("\(role).compression.ops_declared", report).contains(fragment), verdict)
            let other = role == "target" ? "dflash_drafter" : "target"
            XCTAssertEqual(report.result(named: "\(other).compression.ops_declared")?.holds, true, verdict)
        }
    }

    func testCompressionOpsWithoutDeclarationFailOpsDeclared() throws {
        export.removeMetadata(["compression"])
        export.setMetadata(["schema_version"], to: 1)
        let report = try report()
        ContractAssertions.assertFailing(["target.compression.ops_declared", "dflash_drafter.compression.ops_declared"],
                                         in: report)
        XCTAssertTrue(detail("target.compression.ops_declared", report).hasPrefix(
            "metadata.json declares no compression, but 10 weight ops are constexpr ops: main.p_embed_tokens_weight "
            + "(constexpr_blockwise_shift_scale)"), detail("target.compression.ops_declared", report))
    }

    // MARK: Bytes

    func testLyingByteCountFailsBytesOnly() throws {
        let group = export.compressionGroupIndex(rule: 3)
        export.editCompressionGroup(group) { group in
            var packages = group["packages"] as! [String: [String: Int]]
            packages["target"]!["bytes"]! += 64
            group["packages"] = packages
            group["bytes_after"] = group["bytes_after"] as! Int + 64
        }
        let report = try report()
        ContractAssertions.assertFailing(["target.compression.bytes"], in: report, expected: expected)
        let bytes = detail("target.compression.bytes", report)
        XCTAssertTrue(bytes.contains("group 3 (linear int4 block_size 8): metadata.json declares 832 target bytes, "
                                     + "the blob headers give 768"), bytes)
        XCTAssertTrue(bytes.contains("in total metadata.json declares"), bytes)
    }

    func testLyingTensorCountFailsStoredCompressedOnly() throws {
        export.editCompressionGroup(export.compressionGroupIndex(rule: 2)) { group in
            var packages = group["packages"] as! [String: [String: Int]]
            packages["dflash_drafter"]!["tensors"]! += 1
            group["packages"] = packages
            group["tensors"] = group["tensors"] as! Int + 1
        }
        ContractAssertions.assertFailing(["dflash_drafter.compression.stored_compressed"], in: try report(), expected: expected)
    }

    /// Groups the ops cannot tell apart (the embedding's and the head's, both int8 per output
    /// channel) are compared together, so moving the head into the embedding's group is not seen.
    func testGroupsOfTheSameSchemeAreComparedTogether() throws {
        export.editCompressionGroup(0) { group in
            var packages = group["packages"] as! [String: [String: Int]]
            packages["target"] = ["tensors": 2, "bytes": 2304]
            group["packages"] = packages
            group["tensors"] = 2
            group["bytes_after"] = 2304
        }
        export.editCompressionGroup(1) { group in
            group["packages"] = [:] as [String: Any]
            group["tensors"] = 0
            group["bytes_after"] = 0
        }
        ContractAssertions.assertFailing([], in: try report(), expected: expected)
    }

    func testBlobSizeDisagreeingWithItsTensorFailsBytes() throws {
        let lut = try XCTUnwrap(offsets("target", "p_layers_0_mlp_down_proj_weight").side)
        let report = try report { directory in
            try self.patch(directory, role: "target", at: lut + 8, WeightFileBuilder.little(UInt64(64)))
        }
        ContractAssertions.assertFailing(["target.compression.bytes"], in: report, expected: expected)
        let bytes = detail("target.compression.bytes", report)
        XCTAssertTrue(bytes.contains("main.p_layers_0_mlp_down_proj_weight lut at offset \(lut): the blob holds 64 bytes, "
                                     + "FLOAT16 [4, 1, 16, 1] takes 128"), bytes)
    }

    func testBlobDTypeDisagreeingWithItsTensorFailsBytes() throws {
        let data = try XCTUnwrap(offsets("dflash_drafter", "p_fc_weight").data)
        let report = try report { directory in
            try self.patch(directory, role: "dflash_drafter", at: data + 4, WeightFileBuilder.little(WeightFileBuilder.uint4))
        }
        ContractAssertions.assertFailing(["dflash_drafter.compression.bytes"], in: report, expected: expected)
        XCTAssertTrue(detail("dflash_drafter.compression.bytes", report).contains("the blob stores UINT4, the op says INT4"))
    }

    func testCorruptBlobHeaderIsNamedByFileAndOffset() throws {
        let data = try XCTUnwrap(offsets("target", "p_lm_head_weight").data)
        let report = try report { directory in
            try self.patch(directory, role: "target", at: data, [0, 0, 0, 0])
        }
        ContractAssertions.assertFailing(["target.compression.bytes"], in: report, expected: expected)
        let bytes = detail("target.compression.bytes", report)
        XCTAssertTrue(bytes.contains("main.p_lm_head_weight data: "), bytes)
        XCTAssertTrue(bytes.contains("target.mlpackage/Data/com.apple.CoreML/weights/weight.bin at offset \(data): "
                                     + "no blob header there (sentinel 0x0, expected 0xdeadbeef)"), bytes)
        XCTAssertTrue(bytes.contains("not compared with the declared"), bytes)
    }

    func testTruncatedWeightFileFailsBytes() throws {
        let report = try report { directory in
            let url = self.weightFile(directory, role: "dflash_drafter")
            let data = try Data(contentsOf: url)
            try data.prefix(data.count - 100).write(to: url)
        }
        ContractAssertions.assertFailing(["dflash_drafter.compression.bytes"], in: report, expected: expected)
        XCTAssertTrue(detail("dflash_drafter.compression.bytes", report).contains("do not lie after its header within the file"))
    }

    func testMissingWeightFileFailsBytes() throws {
        let report = try report { directory in
            try FileManager.default.removeItem(at: self.weightFile(directory, role: "target"))
        }
        ContractAssertions.assertFailing(["target.compression.bytes"], in: report, expected: expected)
        XCTAssertTrue(detail("target.compression.bytes", report).hasSuffix("weights/weight.bin does not exist"))
    }

    // MARK: Metadata

    func testCompressionInSchemaVersionOneFailsMetadataCompression() throws {
        export.setMetadata(["schema_version"], to: 1)
        let report = try report()
        ContractAssertions.assertFailing(["metadata.compression"], in: report, expected: expected)
        XCTAssertTrue(detail("metadata.compression", report).contains("schema_version 1 has no compression"))
    }

    func testMalformedGroupFailsMetadataCompression() throws {
        export.editCompressionGroup(2) { $0["rule"] = 9 }
        export.editCompressionGroup(3) { $0["group_size"] = 32 }
        let report = try report()
        XCTAssertEqual(report.result(named: "metadata.compression")?.holds, false)
        let text = detail("metadata.compression", report)
        XCTAssertTrue(text.contains("groups[2].rule 9 is not an index of rules"), text)
        XCTAssertTrue(text.contains("groups[3] is linear but has group_size 32"), text)
    }

    func testSummaryNamesTheCompression() throws {
        let summary = try report().summaryLines.joined(separator: "\n")
        XCTAssertTrue(summary.contains("compression: rules from --compression-config, 4 groups of 7 weights"), summary)
    }
}
