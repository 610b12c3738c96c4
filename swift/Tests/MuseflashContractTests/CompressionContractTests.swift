import XCTest
import Foundation
import ExportMetadata
import MuseflashContract
import TestSupport

/// A compressed export (constexpr ops over blobs of weight.bin, declared in metadata.json),
/// broken one way at a time. It is of schema version 3: the target and the DFlash drafter share
/// `target.mlpackage`, whose compression properties are `target`'s and whose counts in
/// `compression.groups[i].packages` are under `target`, every weight once.
final class CompressionContractTests: XCTestCase {
    private var export = SyntheticExport.compressedFusedTargetWithDFlashDrafter()
    private let expected = ContractAssertions.compressedDFlashBundleProperties

    private func report(damage: (URL) throws -> Void = { _ in }) throws -> ContractReport {
        try ContractAssertions.check(export, damage: damage)
    }

    private func detail(_ name: String, _ report: ContractReport) -> String {
        ContractAssertions.detail(name, in: report)
    }

    /// The weight.bin of the package `role`'s asset is stored in.
    private func weightFile(_ directory: URL, role: String) -> URL {
        ContractAssertions.packageURL(directory, role: export.packageKey(role: role)).appendingPathComponent(PackageSpec.weightPath)
    }

    /// Overwrites `bytes` at `offset` of the role's weight.bin.
    private func patch(_ directory: URL, role: String, at offset: UInt64, _ bytes: [UInt8]) throws {
        let url = weightFile(directory, role: role)
        var data = try Data(contentsOf: url)
        data.replaceSubrange(Int(offset)..<Int(offset) + bytes.count, with: bytes)
        try data.write(to: url)
    }

    private func offsets(_ role: String, _ weight: String) throws -> PackageSpec.BlobOffsets {
        try XCTUnwrap(export.packages[export.packageKey(role: role)]?.storage().offsets[weight])
    }

    func testCompressedExportPassesEveryProperty() throws {
        let report = try report()
        ContractAssertions.assertFailing([], in: report, expected: expected)
        // The embedding and the head are both int8 per output channel: the ops cannot say which
        // rule each came from, so the two groups are counted together.
        XCTAssertTrue(detail("target.compression.stored_compressed", report)
            .contains("groups 0, 1 (linear int8 per output channel): 2"), detail("target.compression.stored_compressed", report))
        // The target's down projection in main and prefill, the drafter's in draft.
        XCTAssertTrue(detail("target.compression.ops_declared", report).contains("3 constexpr_lut_to_dense"),
                      detail("target.compression.ops_declared", report))
        // Only the drafter's down projection is used by one function; the embedding and the head
        // are stored once and used by main, prefill and draft.
        XCTAssertTrue(detail("target.compression.functions_agree", report).contains("7 compressed weights, 6 of them used by several"),
                      detail("target.compression.functions_agree", report))
    }

    /// Before schema version 3: a package per asset, each counted under its own role, the
    /// embedding stored (and counted) by both.
    func testSeparatePackagesOfSchemaVersionTwoPassEveryProperty() throws {
        let separate = SyntheticExport.compressedFusedTargetWithSeparateDFlashDrafter()
        let report = try ContractAssertions.check(separate)
        ContractAssertions.assertFailing([], in: report, expected: ContractAssertions.compressedSeparateDFlashBundleProperties)
        XCTAssertEqual(report.metadata?.compression?.groups[0].packages.keys.map(\.rawValue).sorted(), ["dflash_drafter", "target"])
        XCTAssertTrue(detail("dflash_drafter.compression.functions_agree", report).contains("1 of them used by several"),
                      detail("dflash_drafter.compression.functions_agree", report))
    }

    /// The shared package stores the embedding once and is counted once, under its owner.
    func testSharedPackageIsCountedOnceUnderItsOwner() throws {
        let metadata = try XCTUnwrap(try report().metadata)
        let groups = try XCTUnwrap(metadata.compression?.groups)
        XCTAssertEqual(Set(groups.flatMap(\.packages.keys)), [.target])
        XCTAssertEqual(groups[0].packages[.target], .init(tensors: 1, bytes: 1152))
        XCTAssertEqual(groups.map(\.tensors), groups.map { $0.packages[.target]?.tensors ?? 0 })
    }

    /// `packages` naming the DFlash drafter, whose asset is stored in the package `target` owns.
    func testNonOwnerRoleInPackagesFailsMetadataCompression() throws {
        export.editCompressionGroup(0) { group in
            var packages = group["packages"] as! [String: [String: Int]]
            packages["dflash_drafter"] = packages["target"]
            group["packages"] = packages
        }
        let report = try report()
        ContractAssertions.assertFailing(["metadata.compression"], in: report, expected: expected)
        XCTAssertTrue(detail("metadata.compression", report).contains(
            "groups[0].packages names dflash_drafter, whose asset is stored in target.mlpackage, owned by target"),
            detail("metadata.compression", report))
        // With the drafter in a package of its own, the same entry is right.
        let separate = SyntheticExport.compressedFusedTargetWithSeparateDFlashDrafter()
        XCTAssertNotNil((separate.metadata["compression"] as? [String: Any]).flatMap {
            (($0["groups"] as? [[String: Any]])?[0]["packages"] as? [String: Any])?["dflash_drafter"]
        })
        XCTAssertTrue(try ContractAssertions.check(separate).allHold)
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
            "group 3 (linear int4 block_size 8): metadata.json declares 3 target weights, the package stores 2 compressed"),
            detail("target.compression.stored_compressed", report))
    }

    /// A group left short names the fp16 consts the exporter could have compressed instead:
    /// those of at least metadata.json's `compression.min_compressible_elements` elements.
    func testShortGroupListsTheFP16ConstsOfAtLeastTheRecordedSize() throws {
        export.editWeight(role: "target", "p_layers_0_mlp_up_proj_weight") { $0.storage = .fp16 }
        export.setMetadata(["compression", "min_compressible_elements"], to: 16 * 32)
        let listed = detail("target.compression.stored_compressed", try report())
        XCTAssertTrue(listed.contains("fp16 consts of at least 512 elements"), listed)
        XCTAssertTrue(listed.contains(".p_layers_0_mlp_up_proj_weight [32, 16]"), listed)
        // Recorded one larger, the weight is too small to have been compressed: not listed.
        export.setMetadata(["compression", "min_compressible_elements"], to: 16 * 32 + 1)
        let larger = try report()
        XCTAssertEqual(larger.result(named: "target.compression.stored_compressed")?.holds, false)
        let unlisted = detail("target.compression.stored_compressed", larger)
        XCTAssertFalse(unlisted.contains("p_layers_0_mlp_up_proj_weight"), unlisted)
    }

    func testWeightCompressedInOneFunctionOnlyFailsFunctionsAgree() throws {
        export.editFunction(role: "target", "prefill") { $0.plainWeights = ["p_layers_0_mlp_down_proj_weight"] }
        let report = try report()
        ContractAssertions.assertFailing(["target.compression.functions_agree"], in: report, expected: expected)
        XCTAssertTrue(detail("target.compression.functions_agree", report).contains(
            "prefill.p_layers_0_mlp_down_proj_weight [16, 32] is a plain fp16 const but "
            + "main.p_layers_0_mlp_down_proj_weight is constexpr_lut_to_dense"), detail("target.compression.functions_agree", report))
    }

    /// Target and drafter are different models merged into one package: the drafter's op in
    /// `draft` may have the name of an fp16 weight of the target's functions (the exporter names
    /// both models' layers alike). That is not one weight compressed in one function only.
    func testSameOpNameInAnotherAssetsFunctionIsAnotherWeight() throws {
        export.editFunction(role: "dflash_drafter", "draft") {
            $0.opNames = ["p_fc_weight": "p_layers_0_self_attn_q_proj_weight"]
        }
        ContractAssertions.assertFailing([], in: try report(), expected: expected)
        // Within one asset, the same name is still the same weight.
        export.editFunction(role: "target", "prefill") {
            $0.opNames = ["p_layers_0_mlp_up_proj_weight": "p_layers_0_self_attn_q_proj_weight"]
        }
        let report = try report()
        XCTAssertEqual(report.result(named: "target.compression.functions_agree")?.holds, false,
                       report.verdictLines.joined(separator: "\n"))
        XCTAssertTrue(detail("target.compression.functions_agree", report).contains(
            "main.p_layers_0_self_attn_q_proj_weight [16, 16] is a plain fp16 const but prefill.p_layers_0_self_attn_q_proj_weight"),
            detail("target.compression.functions_agree", report))
    }

    // MARK: Affine weights

    /// An affine weight (uint4 data, fp16 scale and offset of one shape) declared as its own
    /// group passes every property; its offset blob counts in its bytes.
    func testAffineWeightDeclaredAsSuchPassesEveryProperty() throws {
        export.editWeight(role: "target", "p_layers_0_mlp_gate_proj_weight") { $0.storage = .affine(bits: 4, blockSize: 8) }
        export.declareCompression()
        let report = try report()
        ContractAssertions.assertFailing([], in: report, expected: expected)
        let ops = detail("target.compression.ops_declared", report)
        XCTAssertTrue(detail("metadata.compression", report).contains("groups"), detail("metadata.compression", report))
        XCTAssertTrue(detail("target.compression.stored_compressed", report).contains("(affine uint4 block_size 8): 1"),
                      detail("target.compression.stored_compressed", report))
        XCTAssertTrue(ops.contains("each of a declared group"), ops)
    }

    /// linear and affine share constexpr_blockwise_shift_scale: an op with an offset is affine
    /// whatever metadata.json says, and one declared affine without an offset is linear.
    func testAffineAndLinearAreToldApartByTheOffset() throws {
        var affine = SyntheticExport.compressedFusedTargetWithDFlashDrafter()
        affine.editWeight(role: "target", "p_layers_0_mlp_gate_proj_weight") { $0.storage = .affine(bits: 4, blockSize: 8) }
        // metadata.json as before: the weight declared linear int4.
        let undeclared = try ContractAssertions.check(affine)
        XCTAssertEqual(undeclared.result(named: "target.compression.ops_declared")?.holds, false)
        let ops = detail("target.compression.ops_declared", undeclared)
        XCTAssertTrue(ops.contains("offset FLOAT16 [32, 2]) is affine uint4 block_size 8, but the declared affine groups are none"), ops)

        var linear = SyntheticExport.compressedFusedTargetWithDFlashDrafter()
        linear.editWeight(role: "target", "p_layers_0_mlp_gate_proj_weight") { $0.storage = .affine(bits: 4, blockSize: 8) }
        linear.declareCompression()
        linear.editWeight(role: "target", "p_layers_0_mlp_gate_proj_weight") { $0.storage = .linear(bits: 4, blockSize: 8) }
        let short = try ContractAssertions.check(linear)
        XCTAssertEqual(short.result(named: "target.compression.stored_compressed")?.holds, false,
                       short.verdictLines.joined(separator: "\n"))
        XCTAssertTrue(detail("target.compression.stored_compressed", short)
            .contains("(affine uint4 block_size 8): metadata.json declares 1 target weights, the package stores 0"),
                      detail("target.compression.stored_compressed", short))
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
            ("dflash_drafter", "p_drafter_layers_0_mlp_down_proj_weight", .palettize(bits: 4, groupSize: 8),
             "is palettize uint4 group_size 8"),
            ("dflash_drafter", "p_drafter_layers_0_mlp_down_proj_weight", .palettize(bits: 8, groupSize: 4),
             "is palettize uint8 group_size 4"),
            ("target", "p_embed_tokens_weight", .linear(bits: 8, blockSize: 8), "is linear int8 block_size 8"),
        ]
        for (role, weight, storage, fragment) in cases {
            var broken = SyntheticExport.compressedFusedTargetWithDFlashDrafter()
            broken.editWeight(role: role, weight) { $0.storage = storage }
            let report = try ContractAssertions.check(broken)
            let verdict = report.verdictLines.joined(separator: "\n")
            // Either asset's weight: the shared package's property, its owner's.
            XCTAssertEqual(report.result(named: "target.compression.ops_declared")?.holds, false, verdict)
            XCTAssertTrue(detail("target.compression.ops_declared", report).contains(fragment), verdict)
            XCTAssertNil(report.result(named: "dflash_drafter.compression.ops_declared"), verdict)
        }
    }

    /// Before schema version 3 each package's weights are its own property's.
    func testWrongBitsOrGroupSizeInSeparatePackagesFailTheirOpsDeclared() throws {
        let cases: [(String, String, WeightSpec.Storage, String)] = [
            ("target", "p_layers_0_mlp_up_proj_weight", .linear(bits: 8, blockSize: 8), "is linear int8 block_size 8"),
            ("dflash_drafter", "p_layers_0_mlp_down_proj_weight", .palettize(bits: 4, groupSize: 8), "is palettize uint4 group_size 8"),
            ("dflash_drafter", "p_layers_0_mlp_down_proj_weight", .palettize(bits: 8, groupSize: 4), "is palettize uint8 group_size 4"),
        ]
        for (role, weight, storage, fragment) in cases {
            var broken = SyntheticExport.compressedFusedTargetWithSeparateDFlashDrafter()
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
        let report = try report()
        ContractAssertions.assertFailing(["target.compression.ops_declared"], in: report)
        // main and prefill 5 each, inject_kv 1, draft 4 (the shared embedding and head among them).
        XCTAssertTrue(detail("target.compression.ops_declared", report).hasPrefix(
            "metadata.json declares no compression, but 15 weight ops are constexpr ops: main.p_embed_tokens_weight "
            + "(constexpr_blockwise_shift_scale)"), detail("target.compression.ops_declared", report))

        var separate = SyntheticExport.compressedFusedTargetWithSeparateDFlashDrafter()
        separate.removeMetadata(["compression"])
        separate.setMetadata(["schema_version"], to: 1)
        let separateReport = try ContractAssertions.check(separate)
        ContractAssertions.assertFailing(["target.compression.ops_declared", "dflash_drafter.compression.ops_declared"],
                                         in: separateReport, expected: ContractAssertions.separateDFlashBundleProperties)
        XCTAssertTrue(detail("target.compression.ops_declared", separateReport).contains("10 weight ops"),
                      detail("target.compression.ops_declared", separateReport))
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
        // gate, up and the drafter's fc: 256 bytes of int4 data and 128 of scales each.
        XCTAssertTrue(bytes.contains("group 3 (linear int4 block_size 8): metadata.json declares 1216 target bytes, "
                                     + "the blob headers give 1152"), bytes)
        XCTAssertTrue(bytes.contains("in total metadata.json declares"), bytes)
    }

    func testLyingTensorCountFailsStoredCompressedOnly() throws {
        export.editCompressionGroup(export.compressionGroupIndex(rule: 2)) { group in
            var packages = group["packages"] as! [String: [String: Int]]
            packages["target"]!["tensors"]! += 1
            group["packages"] = packages
            group["tensors"] = group["tensors"] as! Int + 1
        }
        ContractAssertions.assertFailing(["target.compression.stored_compressed"], in: try report(), expected: expected)
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
        // The blob is not in the file as the program says either (`target.weight_file`).
        ContractAssertions.assertFailing(["target.compression.bytes", "target.weight_file"], in: report, expected: expected)
        let bytes = detail("target.compression.bytes", report)
        XCTAssertTrue(bytes.contains("main.p_layers_0_mlp_down_proj_weight lut at offset \(lut): the blob holds 64 bytes, "
                                     + "FLOAT16 [4, 1, 16, 1] takes 128"), bytes)
    }

    func testBlobDTypeDisagreeingWithItsTensorFailsBytes() throws {
        let data = try XCTUnwrap(offsets("dflash_drafter", "p_fc_weight").data)
        let report = try report { directory in
            try self.patch(directory, role: "dflash_drafter", at: data + 4, WeightFileBuilder.little(WeightFileBuilder.uint4))
        }
        // The blob is not in the file as the program says either (`target.weight_file`).
        ContractAssertions.assertFailing(["target.compression.bytes", "target.weight_file"], in: report, expected: expected)
        XCTAssertTrue(detail("target.compression.bytes", report).contains("inject_kv.p_fc_weight data at offset \(data): "
                                                                          + "the blob stores UINT4, the op says INT4"),
                      detail("target.compression.bytes", report))
    }

    func testCorruptBlobHeaderIsNamedByFileAndOffset() throws {
        let data = try XCTUnwrap(offsets("target", "p_lm_head_weight").data)
        let report = try report { directory in
            try self.patch(directory, role: "target", at: data, [0, 0, 0, 0])
        }
        // The blob is not in the file as the program says either (`target.weight_file`).
        ContractAssertions.assertFailing(["target.compression.bytes", "target.weight_file"], in: report, expected: expected)
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
        // The blob is not in the file as the program says either (`target.weight_file`).
        ContractAssertions.assertFailing(["target.compression.bytes", "target.weight_file"], in: report, expected: expected)
        XCTAssertTrue(detail("target.compression.bytes", report).contains("do not lie after its header within the file"))
    }

    func testMissingWeightFileFailsBytes() throws {
        let report = try report { directory in
            try FileManager.default.removeItem(at: self.weightFile(directory, role: "target"))
        }
        // The blob is not in the file as the program says either (`target.weight_file`).
        ContractAssertions.assertFailing(["target.compression.bytes", "target.weight_file"], in: report, expected: expected)
        XCTAssertTrue(detail("target.compression.bytes", report).hasSuffix("weights/weight.bin does not exist"))
    }

    // MARK: Metadata

    func testCompressionInSchemaVersionOneFailsMetadataCompression() throws {
        var separate = SyntheticExport.compressedFusedTargetWithSeparateDFlashDrafter()
        separate.setMetadata(["schema_version"], to: 1)
        let report = try ContractAssertions.check(separate)
        ContractAssertions.assertFailing(["metadata.compression"], in: report,
                                         expected: ContractAssertions.compressedSeparateDFlashBundleProperties)
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
