import XCTest
import Foundation
import MuseflashContract
import TestSupport

/// The Neural Engine audit (`check-contract --device`, docs/ane.md): each rule can fail. A
/// bundle laid out as the Neural Engine wants (one fp16 state 32 wide per function, written by a
/// `slice_update` at a runtime position) passes every rule on every device; each mutation below
/// breaks one rule, which must then be the one that reports it, with the figure found.
final class DeviceAuditTests: XCTestCase {
    private static let cacheShape: [Int64] = [2, 1, 64, 32]
    private static let layerShape: [Int64] = [1, 1, 64, 32]
    private static let rowsShape: [Int64] = [1, 1, 4, 32]

    /// A function's ML program built op by op (MIL.proto through TestSupport's `MILBytes`).
    private struct Graph {
        static let fp16 = MILBytes.float16
        static let int32 = MILBytes.int32
        static let bool: Int64 = 1  // MIL.proto DataType.BOOL

        var inputs: [[UInt8]] = []
        var operations: [[UInt8]] = []
        var outputs: [String] = []

        mutating func state(_ name: String, _ shape: [Int64]) {
            inputs.append(SpecBytes.string(1, name) + SpecBytes.message(2, SpecBytes.message(5,  // ValueType.stateType
                SpecBytes.message(1, MILBytes.valueType(MILBytes.tensorType(Self.fp16, shape))))))  // StateType.wrappedType
        }

        mutating func input(_ name: String, _ dataType: Int64, _ shape: [Int64]) {
            inputs.append(MILBytes.namedValueType(name, dataType, shape))
        }

        mutating func constant(_ name: String, _ values: [Int64]) {
            let value = SpecBytes.message(2, MILBytes.valueType(MILBytes.tensorType(Self.int32, [Int64(values.count)])))
                + SpecBytes.message(3, SpecBytes.message(1, SpecBytes.message(3, SpecBytes.packed(1, values))))
            operations.append(MILBytes.operation("const", outputs: [MILBytes.namedValueType(name, Self.int32, [Int64(values.count)])],
                                                 attributes: [("val", value)]))
        }

        mutating func op(_ type: String, _ inputs: [(String, String)], _ output: String, _ dataType: Int64 = fp16,
                         _ shape: [Int64]) {
            operations.append(MILBytes.operation(type, inputs: inputs.map { ($0.0, [.name($0.1)]) },
                                                 outputs: [MILBytes.namedValueType(output, dataType, shape)]))
        }

        /// A `coreml_update_state` as coremltools saves it: `write_state`, then `read_state`.
        mutating func write(_ state: String, _ data: String, result: String, _ shape: [Int64]) {
            operations.append(MILBytes.operation("write_state", inputs: [("input", [.name(state)]), ("data", [.name(data)])],
                                                 outputs: []))
            op("read_state", [("input", state)], result, Self.fp16, shape)
        }

        var bytes: [UInt8] {
            MILBytes.function(block: MILBytes.block(operations: operations, outputs: outputs), inputs: inputs)
        }
    }

    private enum Mutation {
        case none, rankFive, readAfterWrite, outputIsWriteSource, cpuOps, longTopk
        /// The first `slots` slots of a layer blended (all 64, or a context bucket's), by a
        /// `select` or a mul-add.
        case blendWrite(slots: Int64, mulAdd: Bool)
    }

    /// One state `kvCache`, written with T rows at a runtime `begin` (or, `.blendWrite`, with a
    /// whole layer blended by a runtime compare, as today's default `blend` does).
    private static func graph(_ mutation: Mutation) -> Graph {
        var graph = Graph()
        graph.state("kvCache", cacheShape)
        graph.input("rows", Graph.fp16, rowsShape)
        graph.input("begin", Graph.int32, [4])
        graph.input("end", Graph.int32, [4])
        graph.op("read_state", [("input", "kvCache")], "cache", Graph.fp16, cacheShape)
        if case .blendWrite(let slots, let mulAdd) = mutation {
            let shape: [Int64] = [1, 1, slots, 32]
            graph.input("slots", Graph.int32, shape)
            graph.input("position", Graph.int32, shape)
            graph.input("newLayer", Graph.fp16, shape)
            graph.constant("layerBegin", [0, 0, 0, 0])
            graph.op("equal", [("x", "slots"), ("y", "position")], "hit", Graph.bool, shape)
            graph.op("slice_by_index", [("x", "cache"), ("begin", "layerBegin")], "layer", Graph.fp16, shape)
            if mulAdd {
                graph.op("cast", [("x", "hit")], "hitHalf", Graph.fp16, shape)
                graph.op("not_equal", [("x", "slots"), ("y", "position")], "miss", Graph.bool, shape)
                graph.op("cast", [("x", "miss")], "missHalf", Graph.fp16, shape)
                graph.op("mul", [("x", "newLayer"), ("y", "hitHalf")], "newPart", Graph.fp16, shape)
                graph.op("mul", [("x", "layer"), ("y", "missHalf")], "oldPart", Graph.fp16, shape)
                graph.op("add", [("x", "newPart"), ("y", "oldPart")], "blended", Graph.fp16, shape)
            } else {
                graph.op("select", [("cond", "hit"), ("a", "newLayer"), ("b", "layer")], "blended", Graph.fp16, shape)
            }
            graph.op("slice_update", [("x", "cache"), ("update", "blended"), ("begin", "layerBegin")], "updated",
                     Graph.fp16, cacheShape)
        } else {
            graph.op("slice_update", [("x", "cache"), ("update", "rows"), ("begin", "begin"), ("end", "end")], "updated",
                     Graph.fp16, cacheShape)
        }
        graph.write("kvCache", "updated", result: "cacheAfter", cacheShape)
        graph.op("mul", [("x", "rows"), ("y", "rows")], "out", Graph.fp16, rowsShape)
        graph.outputs = ["out"]
        switch mutation {
        case .none, .blendWrite:
            break
        case .rankFive:
            graph.op("reshape", [("x", "cacheAfter")], "cacheByHalves", Graph.fp16, [2, 1, 2, 32, 32])
        case .readAfterWrite:
            graph.op("read_state", [("input", "kvCache")], "cacheAgain", Graph.fp16, cacheShape)
        case .outputIsWriteSource:
            graph.outputs.append("updated")
        case .cpuOps:
            graph.input("table", Graph.fp16, [64, 32])
            graph.input("ids", Graph.int32, [4])
            graph.op("gather", [("x", "table"), ("indices", "ids")], "embedded", Graph.fp16, [4, 32])
            graph.op("gather", [("x", "table"), ("indices", "ids")], "embeddedAgain", Graph.fp16, [4, 32])
            graph.op("cast", [("x", "ids")], "idsNarrow", Graph.int32, [4])
            graph.op("cast", [("x", "ids")], "idsAsHalf", Graph.fp16, [4])  // not integer: not counted
            graph.op("equal", [("x", "ids"), ("y", "ids")], "same", Graph.bool, [4])
            graph.op("select", [("cond", "same"), ("a", "ids"), ("b", "ids")], "chosen", Graph.int32, [4])
            graph.op("select", [("cond", "same"), ("a", "idsAsHalf"), ("b", "idsAsHalf")], "chosenHalf", Graph.fp16, [4])
        case .longTopk:
            graph.input("scores", Graph.fp16, [1, 70_000])
            graph.constant("lastAxis", [1])
            graph.op("topk", [("x", "scores"), ("axis", "lastAxis")], "best", Graph.fp16, [1, 4])
        }
        return graph
    }

    /// The synthetic bundle (schema 3: the target and the DFlash drafter in one package) with
    /// every function holding `states` and running `graph(mutation)`.
    private static func export(_ mutation: Mutation = .none,
                               states: [TensorSpec] = [TensorSpec("kvCache", cacheShape, TensorSpec.float16)],
                               edit: (inout SyntheticExport) -> Void = { _ in }) -> SyntheticExport {
        var export = SyntheticExport.fusedTargetWithDFlashDrafter()
        var package = export.packages["target"]!
        for index in package.functions.indices { package.functions[index].states = states }
        package.program = MILBytes.program(package.functions.map { ($0.name, graph(mutation).bytes) })
        export.packages["target"] = package
        edit(&export)
        return export
    }

    private func audit(_ export: SyntheticExport, damage: (URL) throws -> Void = { _ in }) throws -> DeviceAudit {
        try ContractAssertions.check(export, damage: damage).audit
    }

    /// `rule` has `statuses` on iphone, mac and gpu, and the figure `value`; nothing else fails
    /// on the Neural Engine's devices unless `alsoFailing` says so.
    private func assertRule(_ rule: AuditRule, _ statuses: [AuditStatus], value: Int64, in audit: DeviceAudit,
                            alsoFailing: Set<AuditRule> = [], file: StaticString = #filePath, line: UInt = #line) {
        let text = audit.lines(device: nil).joined(separator: "\n")
        guard let finding = audit.finding(rule) else { return XCTFail("no \(rule.rawValue):\n\(text)", file: file, line: line) }
        XCTAssertEqual(AuditDevice.allCases.map(finding.status(on:)), statuses, text, file: file, line: line)
        XCTAssertEqual(finding.value, value, text, file: file, line: line)
        for device in [AuditDevice.iphone, .mac] {
            let expected = statuses[device == .iphone ? 0 : 1] == .fail ? alsoFailing.union([rule]) : alsoFailing
            XCTAssertEqual(Set(audit.failures(on: device)), expected, "\(device):\n\(text)", file: file, line: line)
        }
    }

    // MARK: The Neural Engine's layout passes

    func testOneStateWrittenBySliceFailsNoRule() throws {
        let audit = try audit(Self.export())
        XCTAssertEqual(audit.findings.map(\.rule), AuditRule.allCases)
        for device in AuditDevice.allCases {
            XCTAssertEqual(audit.failures(on: device), [], audit.lines(device: device).joined(separator: "\n"))
        }
        assertRule(.statesPerFunction, [.pass, .pass, .notApplicable], value: 1, in: audit)
        assertRule(.stateWidth, [.pass, .pass, .notApplicable], value: 0, in: audit)
        assertRule(.kvWrite, [.pass, .pass, .warn], value: 0, in: audit)  // a runtime-indexed slice: the GPU's crash reports
        assertRule(.readAfterWrite, [.pass, .pass, .pass], value: 0, in: audit)
        assertRule(.rank, [.pass, .pass, .notApplicable], value: 4, in: audit)
        assertRule(.cpuOps, [.pass, .pass, .notApplicable], value: 0, in: audit)
        assertRule(.specificationVersion, [.pass, .pass, .pass], value: 9, in: audit)
    }

    // MARK: Each mutation is caught by its rule

    func testWeightFileAbove1GBFailsOnIPhoneOnly() throws {
        let export = SyntheticExport.compressedFusedTargetWithDFlashDrafter()
        let size: UInt64 = 1_100_000_000
        let audit = try audit(export) { directory in
            try Self.extendWeightFile(in: directory, to: size)
        }
        assertRule(.weightFile, [.fail, .pass, .notApplicable], value: Int64(size), in: audit,
                   alsoFailing: [.statesPerFunction])
    }

    func testWeightFileAbove2GiBFailsOnMacToo() throws {
        let export = SyntheticExport.compressedFusedTargetWithDFlashDrafter()
        let atLimit = try audit(export) { try Self.extendWeightFile(in: $0, to: 2_147_483_648) }
        XCTAssertEqual(atLimit.status(.weightFile, on: .mac), .pass)
        let above = try audit(export) { try Self.extendWeightFile(in: $0, to: 2_147_483_649) }
        assertRule(.weightFile, [.fail, .fail, .notApplicable], value: 2_147_483_649, in: above,
                   alsoFailing: [.statesPerFunction])
    }

    /// A sparse file: the blobs stay where they were, the rest reads as zeros and takes no disk.
    private static func extendWeightFile(in directory: URL, to size: UInt64) throws {
        let url = ContractAssertions.packageURL(directory, role: "target").appendingPathComponent(PackageSpec.weightPath)
        let handle = try FileHandle(forWritingTo: url)
        defer { try? handle.close() }
        try handle.truncate(atOffset: size)
    }

    func testSecondStateWarnsOnMacAndThirdFails() throws {
        let state = { (name: String) in TensorSpec(name, Self.cacheShape, TensorSpec.float16) }
        let two = try audit(Self.export(states: [state("keyCache"), state("valueCache")]))
        assertRule(.statesPerFunction, [.fail, .warn, .notApplicable], value: 2, in: two)
        let three = try audit(Self.export(states: [state("keyCache"), state("valueCache"), state("thirdCache")]))
        assertRule(.statesPerFunction, [.fail, .fail, .notApplicable], value: 3, in: three)
    }

    func testBlendWriteFailsOnTheNeuralEngineAndPassesOnGPU() throws {
        let audit = try audit(Self.export(.blendWrite(slots: 64, mulAdd: false)))
        // One write in each of the 4 functions; the blend's compare is also an op the CPU runs.
        assertRule(.kvWrite, [.fail, .fail, .pass], value: 4, in: audit)
        XCTAssertEqual(audit.finding(.cpuOps)?.value, 1)
    }

    /// A context bucket blends only its first slots, and a mul-add blends as a select does.
    func testBucketAndMulAddBlendsAreBlends() throws {
        assertRule(.kvWrite, [.fail, .fail, .pass], value: 4, in: try audit(Self.export(.blendWrite(slots: 16, mulAdd: false))))
        assertRule(.kvWrite, [.fail, .fail, .pass], value: 4, in: try audit(Self.export(.blendWrite(slots: 64, mulAdd: true))))
    }

    func testRankFiveFailsOnTheNeuralEngine() throws {
        assertRule(.rank, [.fail, .fail, .notApplicable], value: 5, in: try audit(Self.export(.rankFive)))
    }

    func testReadStateAfterAWriteFailsEverywhere() throws {
        // One re-read in each of the 4 functions; the read coremltools saves with each write is not one.
        assertRule(.readAfterWrite, [.fail, .fail, .fail], value: 4, in: try audit(Self.export(.readAfterWrite)))
    }

    func testOutputThatIsAWriteSourceFailsEverywhere() throws {
        assertRule(.outputWriteSource, [.fail, .fail, .fail], value: 4, in: try audit(Self.export(.outputIsWriteSource)))
    }

    func testCPUOpCensusCountsIntegerOpsOnly() throws {
        // gather 2, integer cast 1, compare 1, integer select 1; the fp16 cast and select are not counted.
        assertRule(.cpuOps, [.warn, .warn, .notApplicable], value: 5, in: try audit(Self.export(.cpuOps)))
    }

    func testTopkOver65536FailsOnTheNeuralEngineAndWarnsOnGPU() throws {
        let audit = try audit(Self.export(.longTopk))
        assertRule(.topk, [.fail, .fail, .warn], value: 70_000, in: audit)
        assertRule(.largeDimensions, [.warn, .warn, .notApplicable], value: 70_000, in: audit, alsoFailing: [.topk])
    }

    func testSpecificationVersionBelow9FailsEverywhere() throws {
        let audit = try audit(Self.export { $0.packages["target"]!.specificationVersion = 8 })
        assertRule(.specificationVersion, [.fail, .fail, .fail], value: 8, in: audit)
    }

    func testFlexibleInputFailsOnTheNeuralEngine() throws {
        let audit = try audit(Self.export { export in
            export.editFunction(role: "target", "main") {
                $0.inputs[0].flexibility = SpecBytes.shapeRange([(1, 1), (1, 8)])
            }
        })
        assertRule(.fixedShapes, [.fail, .fail, .notApplicable], value: 1, in: audit)
    }

    func testStateTypeAndWidth() throws {
        let fp32 = try audit(Self.export(states: [TensorSpec("kvCache", Self.cacheShape, TensorSpec.float32)]))
        assertRule(.stateDataType, [.fail, .fail, .fail], value: 1, in: fp32)
        let narrow = try audit(Self.export(states: [TensorSpec("kvCache", [2, 1, 64, 48], TensorSpec.float16)]))
        assertRule(.stateWidth, [.warn, .warn, .notApplicable], value: 1, in: narrow)
    }

    // MARK: The command line

    private func run(_ arguments: [String]) -> ContractCommand.Outcome {
        ContractCommand.run(arguments: arguments, environment: [:], currentDirectory: "/nonexistent-cwd")
    }

    private func withBundle(_ export: SyntheticExport, _ body: (String) throws -> Void) throws {
        let directory = try ScratchDirectory.make()
        defer { ScratchDirectory.remove(directory) }
        try export.write(to: directory)
        try body(directory.path)
    }

    private func jsonRules(_ outcome: ContractCommand.Outcome) throws -> [String: [String: Any]] {
        let object = try JSONSerialization.jsonObject(with: Data(outcome.standardOutput.utf8)) as? [String: Any]
        let rules = (object?["audit"] as? [String: Any])?["rules"] as? [[String: Any]] ?? []
        return Dictionary(uniqueKeysWithValues: rules.map { ($0["id"] as? String ?? "", $0) })
    }

    /// Today's default layout (Muse Glimmer's four states in every target function) keeps the
    /// contract, so without --device it passes; --device iphone fails it on the states rule.
    func testDefaultLayoutFailsIPhoneOnStatesButPassesWithoutDevice() throws {
        try withBundle(.fusedTargetWithDFlashDrafter()) { path in
            let plain = run(["--export-dir", path])
            XCTAssertEqual(plain.status, 0, plain.standardOutput)
            XCTAssertTrue(plain.standardOutput.contains(AuditRule.statesPerFunction.rawValue), plain.standardOutput)
            // The audit's lines never read as the contract's PASS/FAIL lines.
            XCTAssertFalse(plain.standardOutput.split(separator: "\n").contains { $0.hasPrefix("FAIL ") || $0.hasPrefix("PASS ane.") })

            let iphone = run(["--export-dir", path, "--device", "iphone", "--format", "json"])
            XCTAssertEqual(iphone.status, 1, iphone.standardOutput)
            let rules = try jsonRules(iphone)
            XCTAssertEqual(rules[AuditRule.statesPerFunction.rawValue]?["status"] as? String, "FAIL")
            XCTAssertEqual(rules[AuditRule.statesPerFunction.rawValue]?["value"] as? Int, 4)
            XCTAssertEqual(Set(rules.keys), Set(AuditRule.allCases.map(\.rawValue)))
            let failing = rules.filter { $0.value["status"] as? String == "FAIL" }.map(\.key)
            XCTAssertEqual(failing, [AuditRule.statesPerFunction.rawValue])
            let object = try JSONSerialization.jsonObject(with: Data(iphone.standardOutput.utf8)) as? [String: Any]
            XCTAssertEqual(object?["status"] as? Int, 1)
            XCTAssertEqual((object?["contract"] as? [String: Any])?["failed"] as? Int, 0)

            let gpu = run(["--export-dir", path, "--device", "gpu", "--format", "json"])
            XCTAssertEqual(gpu.status, 0, gpu.standardOutput)
            XCTAssertEqual(try jsonRules(gpu)[AuditRule.statesPerFunction.rawValue]?["status"] as? String, "N/A")
        }
    }

    func testTextNamesEachRuleOnceWithItsSource() throws {
        try withBundle(.fusedTargetWithDFlashDrafter()) { path in
            let outcome = run(["--export-dir", path, "--device=mac"])
            XCTAssertEqual(outcome.status, 1)
            let lines = outcome.standardOutput.split(separator: "\n").map(String.init)
            for rule in AuditRule.allCases {
                let matching = lines.filter { $0.contains(" \(rule.rawValue): ") }
                XCTAssertEqual(matching.count, 1, rule.rawValue)
                XCTAssertTrue(matching.first?.contains("[docs/ane.md#\(rule.section)]") ?? false, matching.first ?? "")
            }
            XCTAssertTrue(lines.contains { $0.hasPrefix("  FAIL ane.states_per_function: ") }, outcome.standardOutput)
        }
    }

    func testUnknownDeviceOrFormatIsRefusedInOneLine() throws {
        try withBundle(.fusedTargetWithDFlashDrafter()) { path in
            for arguments in [["--device", "ipad"], ["--device=ane"], ["--format", "yaml"]] {
                let outcome = run(["--export-dir", path] + arguments)
                XCTAssertEqual(outcome.status, 2, arguments.joined(separator: " "))
                XCTAssertEqual(outcome.standardOutput, "")
                XCTAssertEqual(outcome.standardError.filter { $0 == "\n" }.count, 1, outcome.standardError)
                let value = arguments.last!.split(separator: "=").last.map(String.init)!
                XCTAssertTrue(outcome.standardError.contains(value), outcome.standardError)
            }
            let device = run(["--export-dir", path, "--device", "ipad"]).standardError
            for accepted in AuditDevice.allCases {
                XCTAssertTrue(device.contains(accepted.rawValue), device)
            }
            XCTAssertEqual(run(["--export-dir", path, "--device"]).status, 2)
        }
    }
}
