import Foundation
@_spi(Testing) import MILInterpreter
@testable import MuseflashRuntime
import XCTest

/// The Swift engine and interpreter against the Python reference, on a bundle Bazel exported
/// and the golden file Python wrote from it in the same build (tests/runtime/BUILD.bazel):
/// MUSEFLASH_EXPORT_DIR names the bundle, MUSEFLASH_GOLDENS the golden JSON
/// (python/museflash/tools/runtime_goldens.py). Run with `./bazelw test //tests/runtime/...`.
final class RuntimeGoldenTests: XCTestCase {
    struct Case {
        let name: String
        let speculative: Bool
        /// 0: every step drafts; else steps may copy from the context.
        let lookupMinMatch: Int
        /// Tree steps of up to this many nodes (docs/trees.md); nil: the chain.
        let treeBudget: Int?
        let prompt: [Int32]
        let maxNewTokens: Int
        let tokens: [Int32]
        let accepted: [Int]
        let calls: [String: Int]
        let trace: [FunctionCall]
    }

    static let root: URL = {
        let environment = ProcessInfo.processInfo.environment
        let base = environment["TEST_SRCDIR"].map { URL(fileURLWithPath: $0).appendingPathComponent(environment["TEST_WORKSPACE"] ?? "museflash") }
            ?? URL(fileURLWithPath: FileManager.default.currentDirectoryPath)
        return base
    }()

    static func path(_ variable: String) throws -> URL {
        guard let value = ProcessInfo.processInfo.environment[variable] else {
            throw XCTSkip("\(variable) is not set; run through Bazel (tests/runtime)")
        }
        return value.hasPrefix("/") ? URL(fileURLWithPath: value) : root.appendingPathComponent(value)
    }

    static let goldens: [String: Any] = {
        guard let url = try? path("MUSEFLASH_GOLDENS"), let data = try? Data(contentsOf: url),
              let object = try? JSONSerialization.jsonObject(with: data) as? [String: Any] else { return [:] }
        return object
    }()

    func bundle() throws -> MuseflashBundle { try Self.bundle() }
    func cases() throws -> [Case] { try Self.cases() }
    func options(_ golden: Case) -> GenerationOptions { Self.options(golden) }

    static func bundle() throws -> MuseflashBundle {
        try MuseflashBundle.open(Self.path("MUSEFLASH_EXPORT_DIR"))
    }

    static func cases() throws -> [Case] {
        guard let list = Self.goldens["cases"] as? [[String: Any]] else {
            throw XCTSkip("no golden file (MUSEFLASH_GOLDENS)")
        }
        return list.compactMap { entry in
            guard entry["skipped"] == nil, let name = entry["name"] as? String else { return nil }
            let trace = (entry["trace"] as? [[String: Any]] ?? []).map {
                FunctionCall(function: $0["function"] as? String ?? "", firstPosition: $0["first_position"] as? Int ?? -1,
                             length: $0["length"] as? Int ?? -1)
            }
            let mode = entry["mode"] as? String ?? ""
            return Case(name: name, speculative: mode.hasPrefix("speculative"),
                        lookupMinMatch: entry["lookup_min_match"] as? Int ?? 0,
                        treeBudget: entry["tree_budget"] as? Int,
                        prompt: (entry["prompt_ids"] as? [Int] ?? []).map(Int32.init),
                        maxNewTokens: entry["max_new_tokens"] as? Int ?? 0,
                        tokens: (entry["tokens"] as? [Int] ?? []).map(Int32.init),
                        accepted: entry["accepted"] as? [Int] ?? [],
                        calls: entry["calls"] as? [String: Int] ?? [:], trace: trace)
        }
    }

    static func options(_ golden: Case) -> GenerationOptions {
        // The Python loop does not stop at the end-of-sequence token; neither does this check.
        GenerationOptions(maxNewTokens: golden.maxNewTokens, useDrafter: golden.speculative, stopAtEndOfSequence: false,
                          lookupMinMatch: golden.lookupMinMatch, treeBudget: golden.treeBudget)
    }

    /// Tokens, accepted drafts, call counts and the whole call trace of every golden case.
    func checkAllCases(backend: any InferenceBackend, file: StaticString = #filePath, line: UInt = #line) throws {
        let decoder = try SpeculativeDecoder(bundle: bundle(), backend: backend)
        let all = try cases()
        XCTAssertFalse(all.isEmpty, "the golden file has no cases", file: file, line: line)
        for golden in all {
            let result = try decoder.generate(prompt: golden.prompt, options: options(golden))
            XCTAssertEqual(result.tokens, golden.tokens, "\(golden.name): tokens", file: file, line: line)
            XCTAssertEqual(result.accepted, golden.accepted, "\(golden.name): accepted per step", file: file, line: line)
            XCTAssertEqual(result.trace, golden.trace, "\(golden.name): call trace", file: file, line: line)
            for (function, count) in golden.calls {
                XCTAssertEqual(result.functions[function]?.calls ?? 0, count, "\(golden.name): \(function) calls", file: file, line: line)
            }
        }
    }

    /// The engine's tree builder gives the Python builder's tree, node for node, on every seeded
    /// example the goldens hold (drafter rows, recycled tables, lookup chains and mixes).
    func testTreeBuilderFollowsThePythonBuilder() throws {
        guard let examples = Self.goldens["trees"] as? [[String: Any]] else { throw XCTSkip("no golden file (MUSEFLASH_GOLDENS)") }
        XCTAssertGreaterThan(examples.count, 20)
        var mixed = 0
        for (index, example) in examples.enumerated() {
            let ints = { (key: String) in (example[key] as? [Int] ?? []) }
            let rows = { (value: Any?) in (value as? [[Double]])?.map { $0.map(Float.init) } }
            var table: TokenTree.RecycledTable?
            let tableTokens = ints("recycled_tokens").map(Int32.init)
            if !tableTokens.isEmpty {
                table = TokenTree.RecycledTable()
                table?.update(tokens: tableTokens, logits: rows(example["recycled_logits"]) ?? [])
            }
            let tree = try TokenTree.build(
                anchor: Int32(example["anchor"] as? Int ?? -1), budget: example["budget"] as? Int ?? 0,
                draftLogits: rows(example["draft_logits"]), recycled: table,
                lookup: (example["lookup"] as? [Int])?.map(Int32.init), maxDepth: example["max_depth"] as? Int)
            XCTAssertEqual(tree.tokens, ints("tokens").map(Int32.init), "tree example \(index): tokens")
            XCTAssertEqual(tree.parents, ints("parents"), "tree example \(index): parents")
            XCTAssertEqual(tree.sources.map { Int($0.rawValue) }, ints("sources"), "tree example \(index): sources")
            if Set(ints("sources")).count > 2 { mixed += 1 }
        }
        XCTAssertGreaterThan(mixed, 5, "too few trees mixing sources to check the merge")
    }

    /// The engine's copy of the lookup rule gives the Python rule's answer on every context the
    /// goldens hold, and its default is the Python loop's.
    func testContextLookupFollowsThePythonRule() throws {
        guard let examples = Self.goldens["lookups"] as? [[String: Any]],
              let defaults = Self.goldens["defaults"] as? [String: Any] else { throw XCTSkip("no golden file (MUSEFLASH_GOLDENS)") }
        XCTAssertEqual(GenerationOptions.defaultLookupMinMatch, defaults["lookup_min_match"] as? Int)
        XCTAssertGreaterThan(examples.count, 20)
        var found = 0
        for (index, example) in examples.enumerated() {
            let context = (example["context"] as? [Int] ?? []).map(Int32.init)
            let expected = (example["proposal"] as? [Int])?.map(Int32.init)
            let got = ContextLookup.proposal(context, count: example["count"] as? Int ?? 1, minMatch: example["min_match"] as? Int ?? 1)
            XCTAssertEqual(got, expected, "lookup example \(index) (\(context.count) tokens)")
            if expected != nil { found += 1 }
        }
        XCTAssertGreaterThan(found, 10, "too few examples with a match to check anything")
    }

    func testInterpreterBackendDecodesAsThePythonLoop() throws {
        try checkAllCases(backend: InterpreterBackend())
    }

    /// The Core ML backend's code path (on Linux, over CoreMLStandIn): MLModel per function,
    /// MLState per state set, MLMultiArray in and out.
    func testCoreMLBackendDecodesAsThePythonLoop() throws {
        try checkAllCases(backend: CoreMLBackend(.init(computeUnits: .cpuOnly, cacheDirectory: Self.scratch("cache"))))
    }

    /// A new empty directory for one test.
    static func scratch(_ name: String) -> URL {
        let base = ProcessInfo.processInfo.environment["TEST_TMPDIR"].map { URL(fileURLWithPath: $0) } ?? FileManager.default.temporaryDirectory
        let url = base.appendingPathComponent("\(name)-\(UUID().uuidString)", isDirectory: true)
        try? FileManager.default.createDirectory(at: url, withIntermediateDirectories: true)
        return url
    }

    /// Damaged cycles must fail the same check: it has to be able to see them. One case that
    /// notices is enough, so the cases after it are not decoded.
    func checkFaultIsCaught(_ configure: (inout SpeculativeDecoder.Faults) -> Void, what: String) throws {
        let decoder = try SpeculativeDecoder(bundle: bundle(), backend: InterpreterBackend())
        configure(&decoder.faults)
        var caught = false
        let speculative = try cases().filter(\.speculative)
        XCTAssertFalse(speculative.isEmpty)
        for golden in speculative where !caught {
            do {
                let result = try decoder.generate(prompt: golden.prompt, options: options(golden))
                caught = result.tokens != golden.tokens || result.trace != golden.trace || result.accepted != golden.accepted
            } catch {
                caught = true
            }
        }
        XCTAssertTrue(caught, "\(what): no golden case noticed it")
    }

    func testAnInjectWindowOffByOneIsCaught() throws {
        try checkFaultIsCaught({ $0.injectWindowShift = -1 }, what: "inject window one position early")
        try checkFaultIsCaught({ $0.injectWindowShift = 1 }, what: "inject window one position late")
    }

    func testARejectedSlotLeftUnwrittenIsCaught() throws {
        try checkFaultIsCaught({ $0.skipRejectedSlot = true }, what: "rejected slot not overwritten")
    }

    /// Rows the tree cases moved (accepted nodes off the first child): where a tree fault can
    /// show. A tiny random pair accepts little, so its goldens have few.
    func treeRowsMoved() throws -> Int {
        guard let list = Self.goldens["cases"] as? [[String: Any]] else { throw XCTSkip("no golden file (MUSEFLASH_GOLDENS)") }
        return list.reduce(0) { $0 + (($1["tree_budget"] as? Int ?? 0) > 0 ? $1["moved_rows"] as? Int ?? 0 : 0) }
    }

    /// A node that also sees its elder siblings changes its row only a little; the goldens of a
    /// trained pair (dozens of rows moved) show it, a random pair's few branches may not.
    func testATreeMaskThatLetsNodesSeeTheirSiblingsIsCaught() throws {
        guard try treeRowsMoved() >= 10 else { throw XCTSkip("the tree cases of these goldens accepted fewer than 10 branches") }
        try checkFaultIsCaught({ $0.treeMaskSeesEarlierNodes = true }, what: "tree nodes seeing every earlier node")
    }

    func testATreePathCopiedOneSlotOffIsCaught() throws {
        guard try treeRowsMoved() > 0 else { throw XCTSkip("no tree case of these goldens accepted a branch") }
        try checkFaultIsCaught({ $0.treeMoveShift = 1 }, what: "accepted tree rows moved one slot late")
    }

    // MARK: Steps chosen by measured cost

    /// Greedy cases decoded with each step's kind chosen by the planner, on this machine's
    /// costs: the target's own greedy tokens, whatever it chose.
    func testAutomaticStepsKeepTheGreedyTokens() throws {
        let decoder = try SpeculativeDecoder(bundle: bundle(), backend: InterpreterBackend())
        // Every kind taken: a schedule first, then the planner's choice on this machine's costs.
        decoder.faults.plannedKinds = [.alone, .alone, .chain, .alone] + (decoder.treeLength >= 2 ? [.tree, .alone, .tree] : [])
        // Three cases: each decodes at a whole-bundle call's cost.
        for golden in try cases().filter(\.speculative).prefix(3) {
            var options = options(golden)
            options.treeBudget = nil
            options.automatic = true
            let result = try decoder.generate(prompt: golden.prompt, options: options)
            XCTAssertEqual(result.tokens, golden.tokens, "\(golden.name): tokens")
            XCTAssertGreaterThan(result.steps["alone"] ?? 0, 0, "\(golden.name): steps \(result.steps)")
            XCTAssertNotNil(result.plan)
        }
    }

    /// After target-alone steps the drafter is given their features before it drafts again: the
    /// chain steps that follow accept what they accept from a fresh start at that position.
    /// Skipping that catch-up must show where the drafts are accepted at all.
    func testDraftsAfterTargetAloneStepsSeeTheirFeatures() throws {
        /// Whether every case's chain steps accepted what the fresh start's did; whether any accepted.
        func check(skipCatchUp: Bool) throws -> (same: Bool, acceptedAny: Bool) {
            let decoder = try SpeculativeDecoder(bundle: bundle(), backend: InterpreterBackend())
            let fresh = try SpeculativeDecoder(bundle: bundle(), backend: InterpreterBackend())
            decoder.faults.skipCatchUp = skipCatchUp
            let alone = decoder.blockSize + 2
            // Chain steps for every token the longest case decodes.
            let longest = try cases().map(\.maxNewTokens).max() ?? 0
            decoder.faults.plannedKinds = Array(repeating: .alone, count: alone) + Array(repeating: .chain, count: longest)
            var (same, acceptedAny) = (true, false)
            var prompts = Set<[Int32]>()
            // Two prompts: each decodes twice at a whole-bundle call's cost.
            let chosen = try cases().filter { $0.speculative && $0.maxNewTokens > alone + 4 && prompts.insert($0.prompt).inserted }
            for golden in chosen.prefix(2) {
                var options = options(golden)
                (options.treeBudget, options.automatic, options.lookupMinMatch) = (nil, true, 0)
                let mixed = try decoder.generate(prompt: golden.prompt, options: options)
                // The same position from a fresh start: the alone steps' tokens are in its prompt.
                var chain = self.options(golden)
                (chain.treeBudget, chain.lookupMinMatch, chain.maxNewTokens) = (nil, 0, golden.maxNewTokens - alone)
                let restart = try fresh.generate(prompt: golden.prompt + mixed.tokens[..<alone], options: chain)
                XCTAssertEqual(Array(mixed.tokens[alone...]), restart.tokens, "\(golden.name): tokens")
                XCTAssertEqual(mixed.steps["alone"], alone, "\(golden.name): the planned steps")
                same = same && mixed.accepted == restart.accepted
                acceptedAny = acceptedAny || restart.accepted.contains { $0 > 0 }
            }
            return (same, acceptedAny)
        }
        let good = try check(skipCatchUp: false)
        XCTAssertTrue(good.same, "chain steps after target-alone steps accept what a fresh start accepts")
        guard good.acceptedAny else { throw XCTSkip("these goldens' drafts accept nothing here: a missed catch-up cannot show") }
        XCTAssertFalse(try check(skipCatchUp: true).same, "drafting without the alone steps' features went unnoticed")
    }

    /// A conversation's next call keeps the ids the caches hold and assumes the drafter holds
    /// them too: a call that ended in target-alone steps injects them before it returns. The
    /// next call's chain steps accept what a fresh start's accept.
    func testACallEndingInAloneStepsLeavesTheDrafterCaughtUp() throws {
        func same(skipCatchUp: Bool) throws -> (same: Bool, acceptedAny: Bool) {
            let decoder = try SpeculativeDecoder(bundle: bundle(), backend: InterpreterBackend())
            let fresh = try SpeculativeDecoder(bundle: bundle(), backend: InterpreterBackend())
            decoder.faults.skipCatchUp = skipCatchUp
            // More alone steps than the next call's own inject block reaches back over.
            let first = 2 * decoder.blockSize + 3
            // A prompt of a prefill chunk or more: a shorter one is prefilled padded, from 0.
            guard let golden = try cases().first(where: {
                $0.speculative && $0.maxNewTokens > first + 4 && $0.prompt.count >= decoder.prefillLength
            }) else { throw XCTSkip("no speculative case long enough after a prompt of a chunk") }
            var options = options(golden)
            (options.treeBudget, options.automatic, options.lookupMinMatch, options.maxNewTokens) = (nil, true, 0, first)
            decoder.faults.plannedKinds = Array(repeating: .alone, count: first)
            let opening = try decoder.generate(prompt: golden.prompt, options: options)
            XCTAssertEqual(opening.steps, ["alone": first - 1], "the first token comes from prefill, then alone steps")
            decoder.faults.plannedKinds = Array(repeating: .chain, count: golden.maxNewTokens)
            options.maxNewTokens = golden.maxNewTokens - first
            let next = try decoder.generate(prompt: golden.prompt + opening.tokens, options: options, keepingCaches: true)
            XCTAssertGreaterThan(next.reusedTokens, golden.prompt.count, "the second call kept the first's caches")
            var chain = self.options(golden)
            (chain.treeBudget, chain.lookupMinMatch, chain.maxNewTokens) = (nil, 0, golden.maxNewTokens - first)
            let restart = try fresh.generate(prompt: golden.prompt + opening.tokens, options: chain)
            XCTAssertEqual(next.tokens, restart.tokens, "tokens")
            return (next.accepted == restart.accepted, restart.accepted.contains { $0 > 0 })
        }
        let good = try same(skipCatchUp: false)
        XCTAssertTrue(good.same, "the kept drafter caches accept what a fresh start's accept")
        guard good.acceptedAny else { throw XCTSkip("these goldens' drafts accept nothing here: a missed catch-up cannot show") }
        XCTAssertFalse(try same(skipCatchUp: true).same, "a call ending in alone steps left the drafter behind, unnoticed")
    }

    // MARK: Function by function

    struct GoldenFileError: Error, CustomStringConvertible {
        let description: String
    }

    static func tensor(_ object: Any?) throws -> Tensor {
        guard let entry = object as? [String: Any], let dtype = entry["dtype"] as? String,
              let shape = entry["shape"] as? [Int], let text = entry["base64"] as? String,
              let data = Data(base64Encoded: text) else { throw XCTSkip("malformed tensor in the golden file") }
        let count = shape.reduce(1, *)
        let width: Int
        switch dtype {
        case "float16": width = 2
        case "float32", "int32": width = 4
        default: throw XCTSkip("golden dtype \(dtype)")
        }
        guard data.count == count * width else {
            throw GoldenFileError(description: "a golden \(dtype)\(shape) tensor has \(data.count) bytes")
        }
        let words = littleEndianWords(data, count: count, width: width)
        switch dtype {
        case "float16": return .floats(words.map { Half.toFloat(UInt16(truncatingIfNeeded: $0)) }, shape: shape, type: .float16)
        case "float32": return .floats(words.map { Float(bitPattern: $0) }, shape: shape)
        default: return .ints(words.map { Int32(bitPattern: $0) }, shape: shape)
        }
    }

    /// The first `count` little-endian words of `width` bytes (2 or 4) in `data`, as numpy's
    /// tobytes() writes them. One load per word: this module is compiled -Onone, where folding
    /// the bytes with a closure each took twenty times longer, and the parity records hold
    /// millions of elements.
    static func littleEndianWords(_ data: Data, count: Int, width: Int) -> [UInt32] {
        data.withUnsafeBytes { raw in
            [UInt32](unsafeUninitializedCapacity: count) { words, initialized in
                for index in 0..<count {
                    let offset = index * width
                    words[index] = width == 2
                        ? UInt32(UInt16(littleEndian: raw.loadUnaligned(fromByteOffset: offset, as: UInt16.self)))
                        : UInt32(littleEndian: raw.loadUnaligned(fromByteOffset: offset, as: UInt32.self))
                }
                initialized = count
            }
        }
    }

    /// One parity record of the golden file: a call of `function`, its inputs, and the states
    /// before and after it and the outputs as the Python interpreter had them.
    struct ParityRecord {
        let function: String
        /// The Core ML function that computed it: a context bucket's (`main_64`) or `function`.
        let ran: String
        let label: String
        let inputs: [String: Tensor]
        let statesBefore: [String: Tensor]
        let outputs: [String: Tensor]
        let statesAfter: [String: Tensor]
        /// Every state it starts from is zero, as a new state is (the first prefill, the
        /// first inject_kv).
        let startsFromFreshStates: Bool

        init(_ record: [String: Any]) throws {
            guard let function = record["function"] as? String else {
                throw GoldenFileError(description: "a parity record without a function name")
            }
            func tensors(_ key: String) throws -> [String: Tensor] {
                try (record[key] as? [String: Any] ?? [:]).mapValues(RuntimeGoldenTests.tensor)
            }
            self.function = function
            ran = record["ran"] as? String ?? function
            label = record["label"] as? String ?? function
            inputs = try tensors("inputs")
            statesBefore = try tensors("states_before")
            outputs = try tensors("outputs")
            statesAfter = try tensors("states_after")
            startsFromFreshStates = !statesBefore.isEmpty && statesBefore.values.allSatisfy { $0.floats().allSatisfy { $0 == 0 } }
        }
    }

    /// The golden file's parity records, decoded once per process (millions of elements on the
    /// qwen3 and llama bundles): CoreMLStrictnessTests reads them twice for each fault, and two
    /// tests here read them too. nil when the file has none.
    static let parity: Result<[ParityRecord], Error>? = {
        guard let records = goldens["parity"] as? [[String: Any]] else { return nil }
        return Result { try records.map(ParityRecord.init) }
    }()

    /// The interpreter writes KV chains in place. In `main` and `prefill`, every write of a
    /// layer's keys or values that is its chain value's last reader updates it without a copy,
    /// and in every function the first write of each state's chain takes the state's value
    /// from the store (CompiledFunction.planInPlaceUpdates).
    func testKVStateWritesArePlannedInPlace() throws {
        let bundle = try bundle()
        let program = try InterpreterBackend().program(of: bundle.packageURL(of: .target))
        let layers = bundle.metadata.target.numHiddenLayers
        for name in ["main", "prefill", "inject_kv", "draft"] {
            let function = try program.function(named: name)
            let writes = function.inPlaceWrites
            if name == "main" || name == "prefill" {
                XCTAssertGreaterThanOrEqual(writes.total, 2 * layers, "\(name): in-place writes, two per layer at least")
            }
            XCTAssertEqual(writes.fromState, function.states.count, "\(name): one hand-over from the store per state")
        }
    }

    /// What the plan above buys: after a call, each state's elements are where they were
    /// before it. A write that copied would leave the state in a new buffer.
    func testACallUpdatesEachStateInItsOwnBuffer() throws {
        guard let records = try Self.parity?.get() else {
            throw XCTSkip("no parity records in the golden file")
        }
        let bundle = try bundle()
        let program = try InterpreterBackend().program(of: bundle.packageURL(of: .target))
        for name in ["main", "prefill", "inject_kv", "draft"] {
            let record = try XCTUnwrap(records.first { $0.function == name }, "a parity record of \(name)")
            let compiled = try program.function(named: name)
            let store = StateStore(specs: compiled.states)
            let before = compiled.states.map { store.values[$0.name]?.floatStorageAddress }
            _ = try compiled.run(inputs: record.inputs, states: store)
            let after = compiled.states.map { store.values[$0.name]?.floatStorageAddress }
            XCTAssertFalse(before.contains(nil), "\(name): every state holds floats")
            XCTAssertEqual(after, before, "\(name): states \(compiled.states.map(\.name)) kept their buffers")
        }
    }

    /// Each function's outputs and written states against the Python interpreter's, on the same
    /// inputs and states. Tolerance: both compute in fp32 from the same fp16 values, so they
    /// differ only by fp32 summation order (numpy's BLAS and pairwise sums against Swift's SIMD
    /// dot products), which can move a result across an fp16 rounding boundary: one fp16 unit
    /// in the last place, and that difference carried through the later layers' rounding.
    /// Allowed: |swift - python| <= 2^-7 * |python| + 2^-10 per element (a few fp16 ulps of
    /// the value, or of 1 near zero), and at least 99% of elements bit-identical.
    func testEachFunctionMatchesThePythonInterpreter() throws {
        guard let records = try Self.parity?.get(), !records.isEmpty else {
            throw XCTSkip("no parity records in the golden file")
        }
        let bundle = try bundle()
        let backend = InterpreterBackend()
        let program = try backend.program(of: bundle.packageURL(of: .target))
        var checked = Set<String>()
        for record in records {
            let label = record.label
            // The function that computed the record; a bundle without its context bucket (the
            // unbucketed twins held to a bucketed bundle's goldens) runs the whole-capacity
            // one, whose masked slots add exact zeros.
            let compiled = try (try? program.function(named: record.ran)) ?? program.function(named: record.function)
            let store = StateStore(specs: compiled.states)
            for spec in compiled.states {
                store.values[spec.name] = try XCTUnwrap(record.statesBefore[spec.name], "\(label): state \(spec.name)")
            }
            let outputs = try compiled.run(inputs: record.inputs, states: store)
            XCTAssertEqual(Set(outputs.keys), Set(record.outputs.keys), "\(label): output names")
            for (name, want) in record.outputs {
                try compare(try XCTUnwrap(outputs[name]), want, "\(label): output \(name)")
            }
            for spec in compiled.states {
                try compare(try XCTUnwrap(store.values[spec.name]), try XCTUnwrap(record.statesAfter[spec.name]), "\(label): state \(spec.name) after")
            }
            checked.insert(record.function)
        }
        XCTAssertEqual(checked, ["main", "prefill", "inject_kv", "draft"], "parity records cover every function")
    }

    /// How far `x` lies beyond the fp16 tolerance around `y` (<= 0: within it):
    /// |x - y| <= 2^-7 * |y| + 2^-10; infinite when either is not finite.
    static func fp16Excess(_ x: Float, _ y: Float) -> Float {
        guard x.isFinite && y.isFinite else { return .infinity }
        return abs(x - y) - (Float(1.0 / 128) * abs(y) + Float(1.0 / 1024))
    }

    func compare(_ got: Tensor, _ want: Tensor, _ what: String) throws {
        XCTAssertEqual(got.shape, want.shape, what)
        if want.type.isInteger {
            XCTAssertEqual(got.ints(), want.ints(), what)
            return
        }
        let a = got.floats(), b = want.floats()
        guard a.count == b.count else { return XCTFail("\(what): \(a.count) values, expected \(b.count)") }
        var identical = 0
        var worst: Float = 0
        // Indices into the buffers: zip's iterator costs about ten times more at -Onone, over
        // millions of state elements.
        a.withUnsafeBufferPointer { a in
            b.withUnsafeBufferPointer { b in
                for index in 0..<b.count {
                    let x = a[index], y = b[index]
                    if x.bitPattern == y.bitPattern { identical += 1; continue }
                    worst = max(worst, Self.fp16Excess(x, y))
                }
            }
        }
        XCTAssertLessThanOrEqual(worst, 0, "\(what): an element beyond the fp16 tolerance")
        XCTAssertGreaterThanOrEqual(Double(identical), 0.99 * Double(b.count), "\(what): \(identical) of \(b.count) bit-identical")
    }
}
