import ExportMetadata
import Foundation

/// The DFlash cycle over an exported bundle, exactly as python/museflash/runtime/speculative.py
/// states it (docs/positions.md):
///
///   prefill  prompt chunks of `prefill`'s query length; the last chunk overlaps its
///            predecessor when the prompt is not a multiple; a prompt shorter than one chunk is
///            padded, and its last token goes through `main` once more for its logits.
///   inject   the drafter gets target features in blocks of exactly block_size rows ending at
///            the newest accepted position (a context shorter than a block goes in as one block
///            from position 0).
///   step     `draft([anchor, MASK x (K-1)])` at anchor .. anchor+K-1; the drafted tokens are
///            each row's argmax, or a DFlash2 drafter's `draft_tokens`; ONE `main` call verifies
///            the same positions; the longest agreeing prefix plus the target's own token is
///            accepted; decoding goes on from the first unaccepted position. Nothing is
///            truncated: rejected slots are overwritten by the next call.
///   lookup   with `lookupMinMatch` n > 0, a step whose context ends in n or more tokens seen
///            before proposes what followed them instead of calling `draft`
///            (`ContextLookup.proposal`); sampled, the copy is judged with a one-hot q.
///   tree     with a tree budget, a step verifies a tree of candidates instead: the draft
///            call's rows, the recycled table of the target's own earlier rows and the lookup
///            proposal merged best first (`TokenTree.build`), ONE `tree` call, the longest path
///            the target's argmax follows accepted, its cache rows moved to their own positions
///            (`BackendState.moveRows`), its features injected. Sampled, the tree's tokens are
///            drawn from the drafter's rows and judged by recursive rejection
///            (`TokenTree.filledBySampling`, `SpeculativeSampling.acceptTree`).
///   choice   with `automatic`, each step is the target alone (`decode`), the chain or a tree,
///            whichever `planner` expects to give the most tokens per second; the drafter is
///            given the alone steps' features before it drafts again (`catchUp`).
///
/// The target's functions share one state and the drafter's another (`makeState(for:)`).
///
/// Caches that outlive a call (`generate(prompt:options:keepingCaches: true)`, what a
/// ChatSession uses), as the Python loop's DecodeSession keeps them: `heldIDs` are the ids at
/// positions 0 ..< heldIDs.count whose K/V and drafter features the states hold. A call keeps
/// the longest prefix of its prompt they share (at most all but the prompt's last id) and
/// computes from there; the first call, a prompt shorter than a prefill chunk, and a rewind
/// further back than the rings' slack (`ringSlack`) start from reset states.
public final class SpeculativeDecoder {
    public let bundle: MuseflashBundle
    public let backend: any InferenceBackend
    public let blockSize: Int
    public let prefillLength: Int
    public let verifyLength: Int
    /// What a target-alone step calls: `decode` (one token) when the bundle has it, else `main`.
    public let stepFunction: ExportMetadata.FunctionName
    public let vocabSize: Int
    public let contextLength: Int
    public let hasDrafter: Bool
    /// Nodes of the target's `tree` function; 0 when the bundle has none.
    public let treeLength: Int
    /// The target's own states (its KV caches), which a tree step's rows move in.
    let targetStateNames: [String]
    /// The target's likeliest next tokens, from every tree call's rows; kept across the calls
    /// that keep the caches (a chat), new for every other.
    var recycled = TokenTree.RecycledTable()
    /// What each function's calls have cost in this process, and the session's recent
    /// acceptance by step kind: what `GenerationOptions.automatic` chooses by. Set
    /// `planner.fixedCosts` to choose by a stored calibration instead.
    public var planner: StepPlanner
    /// What steps, calls and the host's work are timed by (a test's fake clock, or the system's).
    public var clock: any StepClock = SystemStepClock()

    /// The target's `prefill` and `main` of every context bucket, on one state; the DFlash
    /// drafter's `inject_kv` and `draft` on another (nil without one; a full-attention
    /// drafter's have buckets too).
    let targetFunctions: AssetFunctions
    private let drafterFunctions: AssetFunctions?
    private let fusedTarget: Bool
    private let maskTokenID: Int32
    private let defaultDraftTokens: Int

    /// The ids whose cache entries the states hold (positions 0 ..< count).
    public private(set) var heldIDs: [Int32] = []
    /// The furthest position any call since the last reset wrote.
    public private(set) var writtenTo = -1
    /// The smallest capacity - window among the bundle's ring caches smaller than its context
    /// (a sliding layer's, a sliding drafter's); nil without one. A sliding ring slot holds the
    /// newest position written there, so after position W was written, a call that parts from
    /// the held ids at k keeps them only when k >= W - ringSlack: every position its first
    /// query sees is then still in its slot (python/museflash/runtime/speculative.py).
    public let ringSlack: Int?

    /// Deliberate damage, for the tests that show the cross-language check catches a broken
    /// cycle (tests/runtime). Internal: only `@testable` code can set it.
    struct Faults {
        /// Added to the first position of every inject window after a verify step.
        var injectWindowShift = 0
        /// After a rejection, continue one position later, leaving the rejected slot's stale
        /// K/V in the caches instead of overwriting it.
        var skipRejectedSlot = false
        /// Adds this much probability to one token in every sampled distribution (then
        /// renormalises): the kind of bias the sampling test must detect.
        var probabilityBias: (token: Int, amount: Double)?
        /// Each tree node sees every earlier node (a chain's causal mask), siblings included.
        var treeMaskSeesEarlierNodes = false
        /// Added to the destination of every accepted tree row moved into place.
        var treeMoveShift = 0
        /// Damage to the sampled tree's acceptance rule (SpeculativeSampling.TreeFaults).
        var treeSampling = SpeculativeSampling.TreeFaults()
        /// After target-alone steps, draft without injecting their features first.
        var skipCatchUp = false
        /// Step kinds taken in this order (then the planner's), in place of the planner's.
        var plannedKinds: [StepPlanner.Kind] = []
        /// Run in every tree step's host work (a test's planted delay: it advances a fake clock).
        var treeHostWork: (() -> Void)?
    }
    var faults = Faults()

    public init(bundle: MuseflashBundle, backend: any InferenceBackend) throws {
        self.bundle = bundle
        self.backend = backend
        let metadata = bundle.metadata
        guard let target = metadata.assets[.target] else { throw RuntimeError.badMetadata(reason: "no target asset") }
        func queryLength(_ asset: ExportMetadata.Asset, _ function: ExportMetadata.FunctionName) throws -> Int {
            guard let spec = asset.functions[function] else {
                throw RuntimeError.badMetadata(reason: "asset \(asset.path) lists no \(function) function")
            }
            return spec.queryLength
        }
        prefillLength = try queryLength(target, .prefill)
        verifyLength = try queryLength(target, .main)
        vocabSize = metadata.vocabSize
        contextLength = metadata.contextLength
        fusedTarget = target.kind == .fusedTarget
        // Target-alone steps run the one-token `decode` where the export has one, else main.
        stepFunction = target.decode == nil ? .main : .decode
        planner = StepPlanner(aloneFunction: stepFunction.rawValue)
        treeLength = target.tree?.queryLength ?? 0
        targetStateNames = target.states.map(\.name.rawValue)
        targetFunctions = try AssetFunctions(.target, target, Set([.prefill, .main, stepFunction] + (treeLength > 0 ? [.tree] : [])),
                                             backend: backend, bundle: bundle)
        if let speculative = metadata.speculativeDecoding, speculative.drafterKind != .ring,
           let drafter = metadata.assets[.dflashDrafter], fusedTarget {
            drafterFunctions = try AssetFunctions(.dflashDrafter, drafter, [.injectKV, .draft], backend: backend, bundle: bundle)
            blockSize = try queryLength(drafter, .draft)
            guard try queryLength(drafter, .injectKV) == blockSize else {
                throw RuntimeError.badMetadata(reason: "inject_kv and draft take different query lengths")
            }
            guard verifyLength == blockSize else {
                throw RuntimeError.badMetadata(reason: "target main takes \(verifyLength) tokens but the drafter's block is \(blockSize); verification needs one main call per block")
            }
            maskTokenID = Int32(speculative.maskTokenId)
            defaultDraftTokens = speculative.numDraftTokens
            hasDrafter = true
        } else {
            drafterFunctions = nil
            blockSize = verifyLength
            maskTokenID = 0
            defaultDraftTokens = 0
            hasDrafter = false
        }
        var windows: [ExportMetadata.AssetRole: Int] = [.target: metadata.target.slidingWindow]
        if let speculative = metadata.speculativeDecoding { windows[.dflashDrafter] = speculative.drafter.slidingWindow }
        let slacks = metadata.assets.flatMap { role, asset in
            asset.states.filter { $0.capacity < metadata.contextLength }.map { $0.capacity - (windows[role] ?? $0.capacity) }
        }
        ringSlack = slacks.min()
    }

    /// How many of the prompt's leading ids the states can keep.
    public func reusable(_ prompt: [Int32]) -> Int {
        var keep = 0
        while keep < min(heldIDs.count, prompt.count - 1), heldIDs[keep] == prompt[keep] { keep += 1 }
        if keep > 0, prompt.count < prefillLength { return 0 }  // prefilled padded, from 0
        if keep > 0, let slack = ringSlack, keep < writtenTo - slack { return 0 }
        return keep
    }

    /// The Core ML functions loaded so far, sorted: the whole-capacity ones from the start,
    /// `decode` and a context bucket's once a call has run in it.
    public var loadedFunctions: [String] {
        var names = Array(targetFunctions.loaded.keys)
        if let drafter = drafterFunctions { names += drafter.loaded.keys }
        return names.sorted()
    }

    /// Forget every cache entry: the next call decodes from scratch.
    public func resetCaches() throws {
        try targetFunctions.state.reset()
        try drafterFunctions?.state.reset()
        heldIDs = []
        writtenTo = -1
    }

    /// One asset's functions by Core ML name, every context bucket's, and the state they all
    /// share (an assumption Core ML does not document: CoreMLBackend, docs/mac.md).
    /// `function(_:lastPosition:)` gives the one a call runs in. The asset's whole-capacity
    /// `functions` load up front and make the state; `decode` and a context bucket's functions
    /// load on first use, checked to declare the same states (coremltools#2351: each function
    /// loaded costs memory, so a short conversation never loads the large buckets).
    final class AssetFunctions {
        let role: ExportMetadata.AssetRole
        let asset: ExportMetadata.Asset
        let state: any BackendState
        private let url: URL
        private let backend: any InferenceBackend
        private let bundle: MuseflashBundle
        private let whole: [any BackendFunction]
        /// The functions loaded so far, by Core ML name.
        private(set) var loaded: [String: any BackendFunction]

        init(_ role: ExportMetadata.AssetRole, _ asset: ExportMetadata.Asset, _ names: Set<ExportMetadata.FunctionName>,
             backend: any InferenceBackend, bundle: MuseflashBundle) throws {
            if let problem = asset.bucketProblem { throw RuntimeError.badMetadata(reason: "\(role.rawValue): \(problem)") }
            let url = try bundle.modelURL(of: role)
            let rows = asset.functionTable.filter { names.contains($0.function) }
            if let present = try backend.functionNames(of: url) {
                // A missing bucket function is refused now, not when a conversation reaches it.
                for row in rows where !present.contains(row.name) {
                    throw RuntimeError.functionMissing(package: url.lastPathComponent, function: row.name, available: present)
                }
            }
            var loaded: [String: any BackendFunction] = [:]
            for row in rows where row.context == nil && asset.functions[row.function] != nil {
                loaded[row.name] = try SpeculativeDecoder.load(backend, row.name, url, bundle)
            }
            self.role = role
            self.asset = asset
            self.url = url
            self.backend = backend
            self.bundle = bundle
            self.loaded = loaded
            whole = rows.compactMap { loaded[$0.name] }
            state = try backend.makeState(for: whole)
        }

        /// `name` in the smallest context bucket holding `lastPosition` (Asset.pick), loaded on
        /// its first use.
        func function(_ name: ExportMetadata.FunctionName, lastPosition: Int) throws -> any BackendFunction {
            guard let row = asset.pick(name, lastPosition: lastPosition) else {
                throw RuntimeError.badOption(reason: "position \(lastPosition) is past the \(asset.contextCapacity ?? 0) slots of the \(role.rawValue)'s caches; re-export with a larger --max-context-length, or start a new conversation")
            }
            if let function = loaded[row.name] { return function }
            let function = try SpeculativeDecoder.load(backend, row.name, url, bundle)
            try backend.checkSameStates(whole + [function])
            loaded[row.name] = function
            return function
        }
    }

    private static func load(_ backend: any InferenceBackend, _ function: String, _ url: URL,
                             _ bundle: MuseflashBundle) throws -> any BackendFunction {
        let loaded = try backend.loadFunction(function, of: url)
        if let shipped = loaded as? ShippedCompiledModel, let expected = bundle.metadataJSON {
            try checkEmbeddedMetadata(shipped, expected: expected)
        }
        return loaded
    }

    /// A shipped compiled model must embed this bundle's metadata.json (ShippedCompiledModel).
    static func checkEmbeddedMetadata(_ shipped: ShippedCompiledModel, expected: JSONValue) throws {
        let model = shipped.compiledModelPath
        guard let text = shipped.embeddedMetadata else {
            throw RuntimeError.compiledModelFromAnotherExport(model: model, difference: "is missing")
        }
        guard let embedded = try? JSONDecoder().decode(JSONValue.self, from: Data(text.utf8)) else {
            throw RuntimeError.compiledModelFromAnotherExport(model: model, difference: "is not JSON")
        }
        guard embedded == expected else {
            let first = expected.differences(from: embedded, limit: 1).first ?? "differs"
            throw RuntimeError.compiledModelFromAnotherExport(model: model, difference: "differs from metadata.json (\(first))")
        }
    }

    /// The longest prompt this bundle decodes: its first verify block must fit the context.
    public var maximumPromptLength: Int { contextLength - verifyLength + 1 }

    /// Decodes after `prompt`. `keepingCaches`: from the longest prefix the states already
    /// hold (`reusable`) instead of reset states.
    public func generate(prompt: [Int32], options: GenerationOptions = GenerationOptions(),
                         keepingCaches: Bool = false,
                         onTokens: (([Int32]) -> Void)? = nil) throws -> GenerationResult {
        guard !prompt.isEmpty else { throw RuntimeError.emptyPrompt }
        if let index = prompt.firstIndex(where: { $0 < 0 || Int($0) >= vocabSize }) {
            throw RuntimeError.tokenOutOfVocabulary(index: index, id: prompt[index], vocabSize: vocabSize)
        }
        guard prompt.count <= maximumPromptLength, prefillLength <= contextLength else {
            throw RuntimeError.promptTooLong(length: prompt.count, limit: maximumPromptLength, contextLength: contextLength)
        }
        guard options.maxNewTokens >= 1 else {
            throw RuntimeError.badOption(reason: "--max-new-tokens must be at least 1, got \(options.maxNewTokens)")
        }
        guard options.lookupMinMatch >= 0 else {
            throw RuntimeError.badOption(reason: "--lookup-min-match must be >= 0 (0 drafts every step), got \(options.lookupMinMatch)")
        }
        // A bundle without a drafter is never decoded with the target alone unasked.
        if options.useDrafter && !hasDrafter {
            throw RuntimeError.notSpeculative(reason: "\(bundle.url.path) has no DFlash drafter; export with --fused-target --dflash-drafter, or pass --no-draft")
        }
        let speculative = options.useDrafter
        let proposals = speculative ? (options.numDraftTokens ?? defaultDraftTokens) : 0
        if speculative, !(1...(blockSize - 1)).contains(proposals) {
            throw RuntimeError.badOption(reason: "--num-draft-tokens \(proposals) must be in 1...\(blockSize - 1) for this bundle's block of \(blockSize)")
        }
        let budget = try checkTreeBudget(options)
        let keep = keepingCaches ? reusable(prompt) : 0
        if !keepingCaches { recycled = TokenTree.RecycledTable() }
        let start = clock.now()
        if keep == 0 { try resetCaches() }
        var run = Run(decoder: self, prompt: prompt, options: options, onTokens: onTokens, keep: keep, writtenTo: writtenTo)
        run.result.numDraftTokens = proposals
        run.result.reusedTokens = keep
        // A call that fails midway leaves states nobody can vouch for: the next starts over.
        heldIDs = []
        if speculative {
            try run.speculative(proposals: proposals, treeBudget: budget, automatic: options.automatic)
            if options.automatic {
                run.result.plan = planner.summary(among: run.kinds)
                for kind in run.kinds { run.result.expectedTokensPerSecond[kind.rawValue] = planner.tokensPerSecond(kind) }
            }
        } else {
            try run.targetOnly()
        }
        heldIDs = prompt + run.result.tokens.dropLast()
        writtenTo = run.writtenTo
        run.result.seconds = clock.now() - start
        return run.result
    }

    /// The tree budget `options` ask for (0: the chain), or a one-line refusal.
    private func checkTreeBudget(_ options: GenerationOptions) throws -> Int {
        if options.automatic, let budget = options.treeBudget {
            throw RuntimeError.badOption(reason: "--tree-budget \(budget) forces a budget; drop it to let the engine choose each step, or give --no-tree for the chain")
        }
        guard let budget = options.treeBudget, budget != 0 else { return 0 }
        guard options.useDrafter else {
            throw RuntimeError.badOption(reason: "--tree-budget verifies the drafter's candidates; drop it or --no-draft")
        }
        guard treeLength >= 2 else {
            throw RuntimeError.badOption(reason: "--tree-budget \(budget): this bundle has no tree function; re-export it with this museflash (--dflash-drafter adds one; --tree-nodes N sets its size)")
        }
        guard (1...treeLength).contains(budget) else {
            throw RuntimeError.badOption(reason: "--tree-budget \(budget): the bundle's tree function takes \(treeLength) nodes; give 1 to \(treeLength)")
        }
        return budget
    }

    /// One generation's mutable state.
    struct Run {
        let decoder: SpeculativeDecoder
        let prompt: [Int32]
        let options: GenerationOptions
        let onTokens: (([Int32]) -> Void)?
        var result: GenerationResult
        var generator: SeededGenerator
        /// Target features of positions the drafter may still be given, by position.
        var features: [Int: ArraySlice<Float>] = [:]
        let pad: Int32
        /// Prompt positions whose cache entries the states already hold.
        let keep: Int
        /// The furthest position written, this call's calls included.
        var writtenTo: Int
        let stops: Set<Int32>
        /// The kinds an automatic generation chooses among, in the order the planner tries them.
        var kinds: [StepPlanner.Kind] = []
        /// The last position whose features the drafter's ring holds from its true token (later
        /// slots may hold a verify block's unaccepted rows).
        var injectedThrough = -1
        /// The step under way's timing (`beginStep`, `endStep`).
        var timing = StepTiming()

        init(decoder: SpeculativeDecoder, prompt: [Int32], options: GenerationOptions, onTokens: (([Int32]) -> Void)?,
             keep: Int = 0, writtenTo: Int = -1) {
            self.decoder = decoder
            self.prompt = prompt
            self.options = options
            self.onTokens = onTokens
            self.result = GenerationResult(promptIDs: prompt)
            self.pad = decoder.bundle.padTokenID ?? 0
            self.generator = SeededGenerator(seed: options.seed)
            self.keep = keep
            self.writtenTo = writtenTo
            var stops = options.stopTokenIDs
            if options.stopAtEndOfSequence, let eos = decoder.bundle.eosTokenID { stops.insert(eos) }
            self.stops = stops
        }

        /// The token after one row of logits: its argmax, or a sample under the settings.
        mutating func next(_ logits: ArraySlice<Float>) -> Int32 {
            guard options.sampled, let sampling = options.sampling else { return argmax(logits) }
            return Int32(SpeculativeSampling.sample(probabilities(sampling, logits), &generator))
        }

        func probabilities(_ sampling: Sampling, _ logits: ArraySlice<Float>) -> [Double] {
            var result = sampling.probabilities(logits)
            if let bias = decoder.faults.probabilityBias, bias.token < result.count {
                result[bias.token] += bias.amount
                let total = result.reduce(0, +)
                result = result.map { $0 / total }
            }
            return result
        }

        var done: Bool { result.stopReason != .maxNewTokens || result.tokens.count >= options.maxNewTokens }

        /// Appends tokens up to the limit, stopping at the end-of-sequence token (or another
        /// of `stopTokenIDs`).
        mutating func emit(_ tokens: [Int32]) {
            var new = Array(tokens.prefix(max(0, options.maxNewTokens - result.tokens.count)))
            if let index = new.firstIndex(where: { stops.contains($0) }) {
                new = Array(new[...index])
                result.stopReason = .endOfSequence
            }
            result.tokens += new
            if !new.isEmpty { onTokens?(new) }
        }

        /// Runs `name` of `asset` in the smallest context bucket holding the call's last position,
        /// on the asset's state, counted and traced under `name` (a bucket's `main_512` as `main`).
        mutating func call(_ name: ExportMetadata.FunctionName, of asset: AssetFunctions, _ inputs: [String: ShapedArray],
                           first: Int, length: Int) throws -> [String: ShapedArray] {
            let clock = decoder.clock
            let loading = clock.now()
            let function = try asset.function(name, lastPosition: first + length - 1)
            let start = clock.now()
            // Loading a function (its first use) is no step's cost.
            timing.excluded += start - loading
            let outputs: [String: ShapedArray]
            do {
                outputs = try function.predict(inputs, state: asset.state)
            } catch let error as RuntimeError {
                throw error
            } catch {
                throw RuntimeError.backend(function: function.name, reason: "\(error)")
            }
            result.functions[name.rawValue, default: FunctionStats()].calls += 1
            let seconds = clock.now() - start
            timing.calls += seconds
            result.functions[name.rawValue, default: FunctionStats()].seconds += seconds
            decoder.planner.observe(name.rawValue, seconds: seconds)
            result.ranFunctions[function.name, default: 0] += 1
            result.trace.append(FunctionCall(function: name.rawValue, firstPosition: first, length: length))
            writtenTo = max(writtenTo, first + length - 1)
            return outputs
        }

        /// Calls `prefill` or `main` on ids at positions first ..< first + ids.count, in the
        /// smallest context bucket that holds the last one; returns the logits rows and the
        /// drafter features (nil from a plain target).
        mutating func target(_ name: ExportMetadata.FunctionName, ids: [Int32], first: Int) throws -> (logits: [Float], rows: Int, features: [Float]?, width: Int) {
            let count = ids.count
            let outputs = try call(name, of: decoder.targetFunctions, [
                "input_ids": ShapedArray(int32: ids, shape: [1, count]),
                "position_ids": ShapedArray(int32: (0..<count).map { Int32(first + $0) }, shape: [count]),
            ], first: first, length: count)
            guard let logits = outputs["logits"], logits.count % decoder.vocabSize == 0, logits.count > 0 else {
                throw RuntimeError.badOutput(function: name.rawValue, reason: "no logits of \(decoder.vocabSize) columns")
            }
            var features: [Float]?
            var width = 0
            if decoder.fusedTarget {
                guard let value = outputs["drafter_features"], value.count % count == 0, value.count > 0 else {
                    throw RuntimeError.badOutput(function: name.rawValue, reason: "no drafter_features of \(count) rows")
                }
                features = value.floats
                width = value.count / count
            }
            return (logits.floats, logits.count / decoder.vocabSize, features, width)
        }

        mutating func store(features: [Float]?, width: Int, first: Int, rows: Int) {
            guard let features = features else { return }
            for row in 0..<rows {
                self.features[first + row] = features[(row * width)..<((row + 1) * width)]
            }
        }

        /// The prompt from position `first` through `prefill` (and, for a prompt shorter than a
        /// chunk, its last token once more through `main`); returns the logits after the prompt.
        mutating func prefillPrompt(first: Int = 0) throws -> [Float] {
            let length = decoder.prefillLength
            var ids = prompt
            if ids.count < length { ids += [Int32](repeating: pad, count: length - ids.count) }
            var logits: [Float] = []
            for start in try chunkStarts(ids.count, length, first: first) {
                let out = try target(.prefill, ids: Array(ids[start..<(start + length)]), first: start)
                logits = Array(out.logits[((out.rows - 1) * decoder.vocabSize)...])
                store(features: out.features, width: out.width, first: start, rows: length)
            }
            if prompt.count < length {
                let last = prompt.count - 1
                let verify = decoder.verifyLength
                let out = try target(.main, ids: [prompt[last]] + [Int32](repeating: pad, count: verify - 1), first: last)
                logits = Array(out.logits[0..<decoder.vocabSize])
                store(features: out.features, width: out.width, first: last, rows: verify)
            }
            return logits
        }

        /// `fallback`: the row of a position without features (a tree step's placeholder).
        mutating func inject(first: Int, fallback: ArraySlice<Float>? = nil) throws {
            let block = decoder.blockSize
            var rows: [Float] = []
            for position in first..<(first + block) {
                guard let row = features[position] ?? fallback else {
                    throw RuntimeError.badOutput(function: "inject_kv", reason: "no target features for position \(position)")
                }
                rows += row
            }
            let width = rows.count / block
            _ = try call(.injectKV, of: decoder.drafterFunctions!, [
                "features": ShapedArray(float: rows, shape: [1, block, width]),
                "position_ids": ShapedArray(int32: (0..<block).map { Int32(first + $0) }, shape: [block]),
            ], first: first, length: block)
        }

        /// Injects the features of target-alone steps (positions after `injectedThrough`
        /// through `last`) in blocks, so the next draft sees them. Its time is left out of the
        /// step under way and charged to the alone steps it caught up (`observeCatchUp`).
        mutating func catchUp(through last: Int) throws {
            guard injectedThrough < last, !decoder.faults.skipCatchUp else { return }
            let mark = self.mark()
            let steps = last - injectedThrough
            defer {
                let seconds = decoder.clock.now() - mark.time - (timing.excluded - mark.excluded)
                timing.excluded += seconds
                timing.calls = mark.calls
                result.catchUpSeconds += seconds
                decoder.planner.observeCatchUp(seconds: seconds, steps: steps)
            }
            let block = decoder.blockSize
            if last + 1 < block {
                try inject(first: 0, fallback: features[last])
            } else {
                for start in try chunkStarts(last + 1, block, first: injectedThrough + 1) { try inject(first: start) }
            }
            injectedThrough = last
        }

        /// One target-alone step inside a speculative generation: `decode` (or a padded `main`)
        /// on the anchor; its features wait for `catchUp`. -> the next anchor and its position.
        mutating func aloneStep(anchor: Int32, at position: Int) throws -> (Int32, Int) {
            let step = decoder.stepFunction
            let length = step == .decode ? 1 : decoder.verifyLength
            let out = try target(step, ids: [anchor] + [Int32](repeating: pad, count: length - 1), first: position)
            store(features: out.features, width: out.width, first: position, rows: 1)
            let token = next(out.logits[0..<decoder.vocabSize])
            emit([token])
            return (token, position + 1)
        }

        /// Whether a block of `length` positions from `first` fits the context; if not,
        /// generation stops there.
        mutating func roomFor(first: Int, length: Int) -> Bool {
            if first + length > decoder.contextLength {
                result.stopReason = .contextFull
                return false
            }
            return true
        }

        /// The newest ids of prompt + generated tokens that a lookup can look at.
        func contextTail() -> [Int32] {
            let size = ContextLookup.window + ContextLookup.maxMatch
            let tail = result.tokens.suffix(size)
            return tail.count < size ? Array(prompt.suffix(size - tail.count)) + tail : Array(tail)
        }

        /// `draft([anchor, MASK x (K-1)])` at anchorPosition ..< anchorPosition + K.
        mutating func draft(anchor: Int32, at anchorPosition: Int) throws -> [String: ShapedArray] {
            let block = decoder.blockSize
            return try call(.draft, of: decoder.drafterFunctions!, [
                "input_ids": ShapedArray(int32: [anchor] + [Int32](repeating: decoder.maskTokenID, count: block - 1), shape: [1, block]),
                "position_ids": ShapedArray(int32: (0..<block).map { Int32(anchorPosition + $0) }, shape: [block]),
            ], first: anchorPosition, length: block)
        }

        /// One `draft` call: the proposed tokens (the selector's path or each row's argmax;
        /// sampled, the judged ones drawn from their rows) and the judged rows' q.
        mutating func draftStep(anchor: Int32, at anchorPosition: Int, proposals: Int) throws -> ([Int32], [[Double]]) {
            let block = decoder.blockSize
            let vocab = decoder.vocabSize
            let drafted = try draft(anchor: anchor, at: anchorPosition)
            var guesses: [Int32]
            if let selected = drafted["draft_tokens"] {
                guesses = selected.int32s
                guard guesses.count == block - 1 else {
                    throw RuntimeError.badOutput(function: "draft", reason: "\(guesses.count) draft_tokens for a block of \(block)")
                }
            } else {
                guard let rows = drafted["logits"], rows.count == block * vocab else {
                    throw RuntimeError.badOutput(function: "draft", reason: "no logits of \(block) x \(vocab)")
                }
                let values = rows.floats
                guesses = (1..<block).map { argmax(values[($0 * vocab)..<(($0 + 1) * vocab)]) }
            }
            // Sampled: the judged drafts come from each drafter row's own distribution (a
            // DFlash2 selector path is greedy only); later slots keep their greedy draft and
            // their target rows are never used.
            var q: [[Double]] = []
            if options.sampled, let sampling = options.sampling {
                guard let rows = drafted["logits"], rows.count == block * vocab else {
                    throw RuntimeError.badOutput(function: "draft", reason: "no logits of \(block) x \(vocab)")
                }
                let values = rows.floats
                q = (1...proposals).map { probabilities(sampling, values[($0 * vocab)..<(($0 + 1) * vocab)]) }
                for index in 0..<proposals { guesses[index] = Int32(SpeculativeSampling.sample(q[index], &generator)) }
            }
            return (guesses, q)
        }

        mutating func speculative(proposals: Int, treeBudget: Int = 0, automatic: Bool = false) throws {
            let block = decoder.blockSize
            let vocab = decoder.vocabSize
            // The inject blocks end at the prompt's last position, so they may reach before `keep`.
            let logits = try prefillPrompt(first: keep == 0 ? 0 : min(keep, max(0, prompt.count - block)))
            var anchor = next(logits[...])
            emit([anchor])
            for start in prompt.count >= block ? try chunkStarts(prompt.count, block, first: keep) : [0] {
                try inject(first: start)
            }
            injectedThrough = prompt.count - 1
            var anchorPosition = prompt.count
            let widest = treeBudget > 0 ? max(block, decoder.treeLength) : block
            if automatic {
                // A tree of at least the chain's rows costs what main costs and holds its paths:
                // the chain is then no candidate (measured: 1.89 against 1.72 tokens per call).
                let tree = decoder.treeLength >= 2
                kinds = (tree ? [.tree] : []) + (tree && decoder.treeLength <= block ? [] : [.chain]) + [.alone]
            }
            let planned = decoder.faults.plannedKinds
            while !done {
                beginStep()
                var kind: StepPlanner.Kind = treeBudget > 0 ? .tree : .chain
                if automatic {
                    // The kinds whose call still fits the context; none: the context is full.
                    let widths: [StepPlanner.Kind: Int] = [.tree: decoder.treeLength, .chain: block,
                                                           .alone: decoder.stepFunction == .decode ? 1 : block]
                    let fitting = kinds.filter { anchorPosition + widths[$0]! <= decoder.contextLength }
                    guard roomFor(first: anchorPosition, length: fitting.map { widths[$0]! }.min() ?? widths[.chain]!) else { break }
                    let index = result.steps.values.reduce(0, +)
                    let forced = index < planned.count && anchorPosition + widths[planned[index]]! <= decoder.contextLength
                    kind = forced ? planned[index] : decoder.planner.next(among: fitting)
                } else if !roomFor(first: anchorPosition, length: widest) {
                    break
                }
                result.steps[kind.rawValue, default: 0] += 1
                if kind == .alone {
                    (anchor, anchorPosition) = try aloneStep(anchor: anchor, at: anchorPosition)
                    endStep(.alone)
                    continue
                }
                try catchUp(through: anchorPosition - 1)
                // A copy from the context, judged (sampled) with a one-hot q; else a draft.
                var guesses: [Int32]
                var q: [[Double]] = []
                let looking = mark()
                let copied = options.lookupMinMatch > 0
                    ? ContextLookup.proposal(contextTail(), count: block - 1, minMatch: options.lookupMinMatch) : nil
                charge("lookup", of: kind, since: looking)
                if kind == .tree {
                    let accepted: Int, chain: Int?
                    (anchor, anchorPosition, accepted, chain) = try treeStep(
                        anchor: anchor, at: anchorPosition, budget: treeBudget > 0 ? treeBudget : decoder.treeLength,
                        copied: copied, chainOf: kinds.contains(.chain) ? proposals : nil)
                    decoder.planner.record(.tree, accepted: accepted)
                    if let chain { decoder.planner.record(.chain, accepted: chain, estimated: true) }
                    endStep(.tree)
                    continue
                }
                if let copied = copied {
                    guesses = copied
                    if options.sampled {
                        q = (0..<proposals).map { index in
                            var row = [Double](repeating: 0, count: vocab)
                            row[Int(copied[index])] = 1
                            return row
                        }
                    }
                } else {
                    (guesses, q) = try draftStep(anchor: anchor, at: anchorPosition, proposals: proposals)
                }
                let verified = try target(.main, ids: [anchor] + guesses, first: anchorPosition)
                guard verified.rows == block else {
                    throw RuntimeError.badOutput(function: "main", reason: "\(verified.rows) logits rows for a block of \(block)")
                }
                var accepted = 0
                var token: Int32
                if options.sampled, let sampling = options.sampling {
                    let p = (0...proposals).map { probabilities(sampling, verified.logits[($0 * vocab)..<(($0 + 1) * vocab)]) }
                    (accepted, token) = SpeculativeSampling.accept(p: p, q: q, drafted: Array(guesses[..<proposals]), &generator)
                } else {
                    token = argmax(verified.logits[0..<vocab])
                    while accepted < proposals, guesses[accepted] == token {
                        accepted += 1
                        token = argmax(verified.logits[(accepted * vocab)..<((accepted + 1) * vocab)])
                    }
                }
                result.accepted.append(accepted)
                decoder.planner.record(.chain, accepted: accepted)
                if copied != nil { result.lookupAccepted.append(accepted) }
                emit(Array(guesses[..<accepted]) + [token])
                // Rows 0 ... accepted saw correct tokens; later rows stand at positions the next
                // verify call re-writes (they fill the inject window while fewer than a block
                // of positions are known).
                let last = anchorPosition + accepted
                store(features: verified.features, width: verified.width, first: anchorPosition, rows: block)
                try inject(first: max(0, last - block + 1 + decoder.faults.injectWindowShift))
                injectedThrough = last
                for position in features.keys where position <= last - block { features[position] = nil }
                anchor = token
                anchorPosition = last + 1 + (decoder.faults.skipRejectedSlot && accepted < proposals ? 1 : 0)
                endStep(.chain)
            }
            // The drafter keeps every position the caches hold, as a conversation's next call
            // assumes of the ids it keeps: target-alone steps at the end are injected now.
            if automatic { try catchUp(through: anchorPosition - 1) }
        }

        mutating func targetOnly() throws {
            let step = decoder.stepFunction
            let block = step == .decode ? 1 : decoder.verifyLength
            let vocab = decoder.vocabSize
            let logits = try prefillPrompt(first: keep)
            features = [:]
            var token = next(logits[...])
            emit([token])
            var position = prompt.count
            while !done, roomFor(first: position, length: block) {
                beginStep()
                let out = try target(step, ids: [token] + [Int32](repeating: pad, count: block - 1), first: position)
                token = next(out.logits[0..<vocab])
                emit([token])
                position += 1
                endStep(.alone, planned: false)
            }
        }
    }
}

/// Starts of fixed-size chunks covering first ..< length; the last one overlaps its predecessor
/// (or, when fewer than `chunk` positions are left, positions before `first`) instead of
/// running past the end.
func chunkStarts(_ length: Int, _ chunk: Int, first: Int = 0) throws -> [Int] {
    guard length >= chunk, chunk > 0 else {
        throw RuntimeError.badOption(reason: "\(length) positions cannot fill one chunk of \(chunk)")
    }
    if length - first < chunk { return [length - chunk] }
    var starts = Array(stride(from: first, through: length - chunk, by: chunk))
    if let last = starts.last, last + chunk < length { starts.append(length - chunk) }
    return starts
}

/// The first index of the largest value (numpy's argmax; NaN counts as the largest).
func argmax(_ values: ArraySlice<Float>) -> Int32 {
    var best = values.startIndex
    for index in values.indices {
        if values[best].isNaN { break }
        if values[index].isNaN || values[index] > values[best] { best = index }
    }
    return Int32(best - values.startIndex)
}

extension Duration {
    var seconds: Double {
        let parts = components
        return Double(parts.seconds) + Double(parts.attoseconds) / 1e18
    }
}
