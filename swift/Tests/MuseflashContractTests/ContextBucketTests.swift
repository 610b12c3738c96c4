import XCTest
import Foundation
import ExportMetadata
import MuseflashContract
import TestSupport

/// Context buckets (metadata.json `assets.target.buckets`, python/museflash/bundle.py
/// `ContextBucket`): a bucket of `c` slots adds `main_<c>` and `prefill_<c>` to the target's
/// package, which compute what `main` and `prefill` compute over the global caches' first `c`
/// slots. Each is checked like its whole-capacity twin, none is "listed by no asset", and
/// `target.buckets` holds metadata.json's buckets to the graph.
///
/// The synthetic target has one global layer of 32 slots (`SyntheticExport.Size`), so the
/// buckets here are 8 and 16 slots. Its package gets an ML program whose target functions read
/// the global caches as the exporter writes them: `read_state`, a `slice_by_index` of the layer,
/// and in a bucket function a `slice_by_index` of that layer down to the bucket's slots.
final class ContextBucketTests: XCTestCase {
    private typealias Size = SyntheticExport.Size

    /// `export` with context buckets of `contexts` slots for `role`: metadata.json lists each
    /// with copies of the asset's functions, and the package has `<name>_<c>` for each (before
    /// the others, as the exporter orders them) with the whole-capacity interfaces.
    private static func bucketed(_ contexts: [Int] = [8, 16], _ base: SyntheticExport = .fusedTargetWithDFlashDrafter(),
                                 role: String = "target") -> SyntheticExport {
        var export = base
        let asset = (export.metadata["assets"] as? [String: Any])?[role] as? [String: Any]
        let functions = asset?["functions"] as? [String: Any] ?? [:]
        export.setMetadata(["assets", role, "buckets"], to: contexts.map { ["context": $0, "functions": functions] })
        let key = export.packageKey(role: role)
        var package = export.packages[key]!
        let whole = package.functions.filter { functions[$0.name] != nil }
        package.functions = contexts.flatMap { context in
            whole.map { function -> FunctionSpec in
                var copy = function
                copy.name = "\(function.name)_\(context)"
                return copy
            }
        } + package.functions
        export.packages[key] = package
        return export
    }

    /// `export` with the target's one-token `decode` (metadata.json `assets.target.decode`, and
    /// in each bucket) and the package's `decode` and `decode_<c>`: copies of `main` and
    /// `main_<c>` taking one token.
    private static func withDecode(_ base: SyntheticExport = bucketed()) -> SyntheticExport {
        var export = base
        let target = (export.metadata["assets"] as? [String: Any])?["target"] as? [String: Any]
        var decode = (target?["functions"] as? [String: Any])?["main"] as? [String: Any] ?? [:]
        decode["query_length"] = 1
        export.setMetadata(["assets", "target", "decode"], to: decode)
        if var buckets = target?["buckets"] as? [[String: Any]] {
            for index in buckets.indices {
                var functions = buckets[index]["functions"] as? [String: Any] ?? [:]
                functions["decode"] = decode
                buckets[index]["functions"] = functions
            }
            export.setMetadata(["assets", "target", "buckets"], to: buckets)
        }
        let key = export.packageKey(role: "target")
        var package = export.packages[key]!
        package.functions += package.functions.filter { $0.name == "main" || $0.name.hasPrefix("main_") }.map { main in
            var copy = main
            copy.name = "decode" + main.name.dropFirst("main".count)
            copy.inputs = main.inputs.map { var input = $0; input.shape[input.shape.count - 1] = 1; return input }
            copy.outputs = main.outputs.map { var output = $0; output.shape[1] = 1; return output }
            return copy
        }
        export.packages[key] = package
        return export
    }

    /// The caches a bucket slices, by the functions that read them: the target's global caches
    /// (one layer of 32 slots), the DFlash drafter's (two layers of 16).
    private static let caches: [(functions: [String], states: [(name: String, layers: Int64, capacity: Int64)])] = [
        (["main", "prefill", "decode"], ["globalKeyCache", "globalValueCache"].map { ($0, Size.globalLayers, Size.contextLength) }),
        (["inject_kv", "draft"], ["drafterKeyCache", "drafterValueCache"].map { ($0, Size.drafterLayers, Size.ringCapacity) }),
    ]

    /// An int32 vector given as a `const` op's value.
    private static func intTensor(_ values: [Int64]) -> [UInt8] {
        SpecBytes.message(2, MILBytes.valueType(MILBytes.tensorType(MILBytes.int32, [Int64(values.count)])))  // Value.type
            + SpecBytes.message(3, SpecBytes.message(1,                   // Value.immediateValue.tensor
                SpecBytes.message(3, SpecBytes.packed(1, values))))       // TensorValue.ints.values
    }

    /// A function's block reading `states` as the exporter's graphs do: `read_state`, a
    /// `slice_by_index` of each layer, and for the states `slots` names a `slice_by_index` of
    /// that layer down to slots [0, n).
    private static func block(_ states: [(name: String, layers: Int64, capacity: Int64)], reading slots: [String: Int]) -> [UInt8] {
        var operations = [
            MILBytes.operation("const", outputs: [MILBytes.namedValueType("begin3", MILBytes.int32, [3])],
                               attributes: [("val", intTensor([0, 0, 0]))]),
        ]
        for state in states {
            operations.append(MILBytes.operation("read_state", inputs: [("input", [.name(state.name)])], outputs: [
                MILBytes.namedValueType("\(state.name)_read", MILBytes.float16, [state.layers, Size.kvHeads, state.capacity, Size.headDim]),
            ]))
            for layer in 0..<state.layers {
                let name = "\(state.name)_\(layer)"
                operations.append(MILBytes.operation("const", outputs: [MILBytes.namedValueType("\(name)_begin", MILBytes.int32, [4])],
                                                     attributes: [("val", intTensor([layer, 0, 0, 0]))]))
                operations.append(MILBytes.operation("slice_by_index", inputs: [
                    ("x", [.name("\(state.name)_read")]), ("begin", [.name("\(name)_begin")]),
                ], outputs: [MILBytes.namedValueType(name, MILBytes.float16, [Size.kvHeads, state.capacity, Size.headDim])]))
                if let count = slots[state.name] {
                    operations.append(MILBytes.operation("slice_by_index", inputs: [
                        ("x", [.name(name)]), ("begin", [.name("begin3")]),
                    ], outputs: [MILBytes.namedValueType("\(name)_slots", MILBytes.float16, [Size.kvHeads, Int64(count), Size.headDim])]))
                }
            }
        }
        return MILBytes.block(operations: operations)
    }

    /// Writes and checks `export` like `ContractAssertions.check`, the target's package's ML
    /// program replaced by one in which every function reads its caches (`caches`):
    /// `slots[function]` (state name -> slots read), by default every slot for a whole-capacity
    /// function and the bucket's `c` for `<name>_<c>`.
    private static func check(_ export: SyntheticExport, slots: [String: [String: Int]] = [:]) throws -> ContractReport {
        try ContractAssertions.check(export) { directory in
            let package = export.packages[export.packageKey(role: "target")]!
            let program = MILBytes.program(package.functions.map { function in
                let separator = function.name.lastIndex(of: "_")
                let bucket = separator.flatMap { Int(function.name[function.name.index(after: $0)...]) }
                let base = bucket == nil ? function.name : String(function.name[..<separator!])
                let states = caches.first { $0.functions.contains(base) }?.states ?? []
                let reads = slots[function.name] ?? bucket.map { context in
                    Dictionary(uniqueKeysWithValues: states.map { ($0.name, context) })
                } ?? [:]
                return (function.name, MILBytes.function(block: block(states, reading: reads)))
            })
            let url = ContractAssertions.packageURL(directory, role: "target").appendingPathComponent(PackageSpec.modelPath)
            let bytes = package.modelBytes(metadataText: try export.metadataText())
            // A package without weights ends in an empty program (with the unknown fields).
            let empty = SpecBytes.message(502, SpecBytes.unknownFields)
            XCTAssertEqual(Array(bytes.suffix(empty.count)), empty)
            try Data(bytes.dropLast(empty.count) + SpecBytes.message(502, program + SpecBytes.unknownFields)).write(to: url)
        }
    }

    private func detail(_ name: String, _ report: ContractReport) -> String {
        ContractAssertions.detail(name, in: report)
    }

    private func assertDetail(_ name: String, _ report: ContractReport, contains fragments: [String],
                              file: StaticString = #filePath, line: UInt = #line) {
        let text = detail(name, report)
        for fragment in fragments {
            XCTAssertTrue(text.contains(fragment), "\(name): \(text)\nlacks: \(fragment)", file: file, line: line)
        }
    }

    // MARK: Bundles that keep the contract

    func testBucketedBundlePassesEveryProperty() throws {
        let report = try Self.check(Self.bucketed())
        ContractAssertions.assertFailing([], in: report)
        XCTAssertEqual(detail("target.buckets", report),
                       "buckets 8, 16: main and prefill read 8/16 slots, the whole-capacity main and prefill all 32")
        XCTAssertEqual(detail("target.function_map", report), "main, main_16, main_8, prefill, prefill_16, prefill_8")
        XCTAssertEqual(detail("package.functions", report), "target.mlpackage (target, dflash_drafter): main_8, "
                       + "prefill_8, main_16, prefill_16, main, prefill, inject_kv, draft")
        assertDetail("target.inputs", report, contains: ["main_8, main_16, main take input_ids and position_ids"])
        assertDetail("target.kv_write", report, contains: ["main_8 0, prefill_8 0, main_16 0, prefill_16 0, main 0, prefill 0"])
        let summary = report.summaryLines.joined(separator: "\n")
        XCTAssertFalse(summary.contains("listed by no asset"), summary)
        XCTAssertTrue(summary.contains("  context buckets: 8, 16\n  default function: main\n  function main_8\n"), summary)
    }

    /// Before schema version 3 the target's package is its own: every function is the target's.
    func testBucketedTargetInAPackageOfItsOwnPassesEveryProperty() throws {
        let report = try Self.check(Self.bucketed([8], .fusedTargetWithSeparateDFlashDrafter()))
        ContractAssertions.assertFailing([], in: report, expected: ContractAssertions.separateDFlashBundleProperties)
        XCTAssertEqual(detail("target.buckets", report),
                       "buckets 8: main and prefill read 8 slots, the whole-capacity main and prefill all 32")
    }

    func testUnbucketedBundleSaysItHasNoBuckets() throws {
        let report = try Self.check(.fusedTargetWithDFlashDrafter())
        ContractAssertions.assertFailing([], in: report)
        XCTAssertEqual(detail("target.buckets", report), "no buckets: main and prefill read all 32 slots of the global caches")
        XCTAssertFalse(report.summaryLines.contains { $0.contains("context buckets") })
    }

    // MARK: The one-token decode

    func testBucketedBundleWithDecodePassesEveryProperty() throws {
        let report = try Self.check(Self.withDecode())
        ContractAssertions.assertFailing([], in: report)
        assertDetail("target.inputs", report, contains: ["decode_8, decode_16, decode one token a call"])
    }

    func testDecodeThatTakesABlockFailsTargetInputs() throws {
        var export = Self.withDecode()
        export.editFunction(role: "target", "decode_16") { $0.inputs[0].shape = [1, Size.blockSize] }
        let report = try Self.check(export)
        ContractAssertions.assertFailing(["target.inputs"], in: report)
        assertDetail("target.inputs", report, contains: ["decode_16 input_ids is int32 [1, 4]", "one token"])
    }

    func testDecodeThePackageLacksFailsPackageFunctions() throws {
        var export = Self.withDecode()
        export.packages["target"]?.functions.removeAll { $0.name == "decode" }
        let report = try Self.check(export)
        XCTAssertTrue(report.failures.map(\.name).contains("package.functions"), "\(report.failures.map(\.name))")
        assertDetail("package.functions", report, contains: ["has no function decode, which the target lists"])
    }

    /// Older readers drive `functions`, whose names are closed: decode is kept out of it.
    func testDecodeListedAmongTheFunctionsFailsBuckets() throws {
        var export = Self.withDecode()
        let decode = try XCTUnwrap(((export.metadata["assets"] as? [String: Any])?["target"] as? [String: Any])?["decode"])
        export.setMetadata(["assets", "target", "functions", "decode"], to: decode)
        let report = try Self.check(export)
        XCTAssertTrue(report.failures.map(\.name).contains("target.buckets"), "\(report.failures.map(\.name))")
        assertDetail("target.buckets", report, contains: ["`decode` is listed among the functions"])
    }

    // MARK: metadata.json describes the buckets wrongly

    func testBucketsNotAscendingFailBuckets() throws {
        var export = Self.bucketed()
        let buckets = try XCTUnwrap((export.metadata["assets"] as? [String: Any])?["target"] as? [String: Any])["buckets"]
        export.setMetadata(["assets", "target", "buckets"], to: try XCTUnwrap(buckets as? [Any]).reversed() as [Any])
        let report = try Self.check(export)
        ContractAssertions.assertFailing(["target.buckets"], in: report)
        assertDetail("target.buckets", report, contains: ["metadata.json: bucket contexts [16, 8] are not strictly ascending",
                                                          "re-export with --context-buckets"])
    }

    func testBucketFunctionThatDiffersFromTheAssetsOwnFailsBuckets() throws {
        var export = Self.bucketed()
        var buckets = try XCTUnwrap(((export.metadata["assets"] as? [String: Any])?["target"] as? [String: Any])?["buckets"]
                                    as? [[String: Any]])
        var functions = try XCTUnwrap(buckets[1]["functions"] as? [String: [String: Any]])
        functions["prefill"]?["query_length"] = Int(Size.prefillChunk) + 1
        buckets[1]["functions"] = functions
        export.setMetadata(["assets", "target", "buckets"], to: buckets)
        let report = try Self.check(export)
        ContractAssertions.assertFailing(["target.buckets"], in: report)
        assertDetail("target.buckets", report, contains: [
            "the bucket of 16 slots has a function prefill that differs from (or is missing among) the asset's own",
        ])
    }

    /// A bucket as wide as the global caches is no bucket (its functions read every slot).
    func testBucketOfTheWholeCapacityFailsBuckets() throws {
        let report = try Self.check(Self.bucketed([8, Int(Size.contextLength)]))
        ContractAssertions.assertFailing(["target.buckets"], in: report)
        assertDetail("target.buckets", report, contains: [
            "the bucket of 32 slots is not inside the",
        ])
    }

    func testBucketFunctionsThePackageLacksFail() throws {
        var export = Self.bucketed()
        export.packages["target"]?.functions.removeAll { $0.name.hasSuffix("_16") }
        let report = try Self.check(export)
        ContractAssertions.assertFailing(["package.functions", "target.function_map", "target.buckets"], in: report)
        assertDetail("target.buckets", report, contains: [
            "the package has no program for main_16, prefill_16, which metadata.json's buckets list",
        ])
        assertDetail("package.functions", report, contains: ["has no function main_16, which the target lists",
                                                             "has no function prefill_16, which the target lists"])
        assertDetail("target.function_map", report, contains: ["metadata lists function main_16 but the package has"])
    }

    /// Without `buckets` in metadata.json the bucket functions are nobody's.
    func testBucketFunctionsNoAssetListsFailPackageFunctions() throws {
        var export = Self.bucketed()
        export.removeMetadata(["assets", "target", "buckets"])
        let report = try Self.check(export)
        ContractAssertions.assertFailing(["package.functions"], in: report)
        assertDetail("package.functions", report, contains: [
            "has functions [\"main_8\", \"prefill_8\", \"main_16\", \"prefill_16\"] that no asset stored in it lists",
        ])
        XCTAssertTrue(report.summaryLines.contains("  function main_8 (listed by no asset)"),
                      report.summaryLines.joined(separator: "\n"))
    }

    // MARK: Bucket functions are checked like their whole-capacity twins

    func testBucketFunctionWithOtherStatesFailsTargetStates() throws {
        var export = Self.bucketed()
        export.editFunction(role: "target", "main_8") { $0.states.removeLast() }
        let report = try Self.check(export)
        ContractAssertions.assertFailing(["target.states"], in: report)
        assertDetail("target.states", report, contains: ["function main_8 binds states"])
    }

    func testBucketMainThatDoesNotTakeABlockFailsTargetInputs() throws {
        var export = Self.bucketed()
        export.editFunction(role: "target", "main_16") { $0.inputs[0].shape = [1, Size.blockSize + 1] }
        let report = try Self.check(export)
        ContractAssertions.assertFailing(["target.inputs"], in: report)
        assertDetail("target.inputs", report, contains: ["main_16 input_ids is int32 [1, 5]"])
    }

    func testBucketMainWithoutDrafterFeaturesFailsOutputsAndFunctionMap() throws {
        var export = Self.bucketed()
        export.editFunction(role: "target", "main_8") { $0.outputs.removeAll { $0.name == "drafter_features" } }
        let report = try Self.check(export)
        ContractAssertions.assertFailing(["target.outputs", "target.function_map"], in: report)
        assertDetail("target.outputs", report, contains: ["main_8 has no output drafter_features"])
        assertDetail("target.function_map", report, contains: ["main_8 outputs are [\"logits\"]"])
    }

    // MARK: The graph against the buckets

    func testBucketFunctionReadingOtherSlotsFailsBuckets() throws {
        let report = try Self.check(Self.bucketed(), slots: ["main_16": ["globalKeyCache": 8, "globalValueCache": 8]])
        ContractAssertions.assertFailing(["target.buckets"], in: report)
        assertDetail("target.buckets", report, contains: [
            "main_16 reads slots [0, 8) of the global caches, not [0, 16)",
            "the buckets in metadata.json do not describe this graph",
        ])
        XCTAssertFalse(detail("target.buckets", report).contains("prefill_16"), detail("target.buckets", report))
    }

    func testBucketFunctionReadingAWholeLayerFailsBuckets() throws {
        let report = try Self.check(Self.bucketed(), slots: ["prefill_8": ["globalKeyCache": 8]])
        ContractAssertions.assertFailing(["target.buckets"], in: report)
        assertDetail("target.buckets", report, contains: ["prefill_8 reads no [0, 8) slice of globalValueCache layer 0"])
        XCTAssertFalse(detail("target.buckets", report).contains("globalKeyCache"), detail("target.buckets", report))
    }

    func testWholeCapacityFunctionReadingABucketFailsBuckets() throws {
        for export in [Self.bucketed(), SyntheticExport.fusedTargetWithDFlashDrafter()] {
            let report = try Self.check(export, slots: ["main": ["globalKeyCache": 16, "globalValueCache": 16]])
            ContractAssertions.assertFailing(["target.buckets"], in: report)
            assertDetail("target.buckets", report, contains: [
                "main runs over the whole capacity but reads only slots [0, 16) of the global caches",
            ])
        }
    }

    /// A package whose program lacks a bucket function (its interface declares it) fails only the buckets.
    func testBucketFunctionWithoutAProgramFailsBuckets() throws {
        let report = try ContractAssertions.check(Self.bucketed())  // the synthetic package's program has no functions
        ContractAssertions.assertFailing(["target.buckets"], in: report)
        assertDetail("target.buckets", report, contains: [
            "the package has no program for main_8, prefill_8, main_16, prefill_16",
        ])
    }

    // MARK: A DFlash drafter with buckets (a full-attention drafter's ring is as long as the context)

    func testBucketedDrafterPassesEveryPropertyAndIsHeldToItsGraph() throws {
        let export = Self.bucketed([8], Self.bucketed(), role: "dflash_drafter")
        let report = try Self.check(export)
        ContractAssertions.assertFailing([], in: report,
                                         expected: ContractAssertions.dflashBundleProperties + ["dflash_drafter.buckets"])
        XCTAssertEqual(detail("dflash_drafter.buckets", report),
                       "buckets 8: inject_kv and draft read 8 slots, the whole-capacity inject_kv and draft all 16")
        XCTAssertEqual(detail("drafter.functions", report), "inject_kv, draft (and inject_kv_8, draft_8)")
        XCTAssertEqual(detail("dflash_drafter.function_map", report), "draft, draft_8, inject_kv, inject_kv_8")

        let wrong = try Self.check(export, slots: ["draft_8": ["drafterKeyCache": 4, "drafterValueCache": 8]])
        ContractAssertions.assertFailing(["dflash_drafter.buckets"], in: wrong,
                                         expected: ContractAssertions.dflashBundleProperties + ["dflash_drafter.buckets"])
        assertDetail("dflash_drafter.buckets", wrong, contains: [
            "draft_8 reads slots [0, 4) of the dflash_drafter caches, not [0, 8)",
        ])
    }

    func testBucketDrafterFunctionsThePackageLacksFail() throws {
        var export = Self.bucketed([8], Self.bucketed(), role: "dflash_drafter")
        export.packages["target"]?.functions.removeAll { $0.name == "draft_8" }
        let report = try Self.check(export)
        ContractAssertions.assertFailing(["package.functions", "drafter.functions", "dflash_drafter.function_map",
                                          "dflash_drafter.buckets"], in: report,
                                         expected: ContractAssertions.dflashBundleProperties + ["dflash_drafter.buckets"])
        assertDetail("drafter.functions", report, contains: ["lacks [\"draft_8\"]"])
        assertDetail("dflash_drafter.buckets", report, contains: ["the package has no program for draft_8"])
    }

    func testBucketDraftWithAnotherLogitsShapeFailsDraftSignature() throws {
        var export = Self.bucketed([8], Self.bucketed(), role: "dflash_drafter")
        export.editFunction(role: "dflash_drafter", "draft_8") { $0.outputs[0].shape = [1, Size.blockSize, Size.vocab + 1] }
        let report = try Self.check(export)
        ContractAssertions.assertFailing(["drafter.draft_signature"], in: report,
                                         expected: ContractAssertions.dflashBundleProperties + ["dflash_drafter.buckets"])
        assertDetail("drafter.draft_signature", report, contains: ["draft_8 logits is fp16 [1, 4, 65]"])
    }
}
