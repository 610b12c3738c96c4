import Foundation

public struct GenerationOptions: Sendable {
    public var maxNewTokens: Int
    /// false: the target alone, one new token per `main` call (`--no-draft`).
    public var useDrafter: Bool
    /// Drafted tokens judged per step, 1 ... block_size - 1; nil: metadata.json's
    /// `speculative_decoding.num_draft_tokens`.
    public var numDraftTokens: Int?
    /// Stop after the bundle's end-of-sequence token (the token is the last one returned).
    public var stopAtEndOfSequence: Bool
    /// More ids that end the generation the same way (a chat's end-of-turn tokens).
    public var stopTokenIDs: Set<Int32> = []
    /// nil or temperature 0: greedy, token for token the target's own greedy output. Otherwise
    /// drafts are sampled from the drafter's rows and accepted by the rejection rule, so the
    /// output is distributed as the target's own sampling.
    public var sampling: Sampling?
    /// The seed of the generation's only randomness (`SeededGenerator`).
    public var seed: UInt64
    /// A step whose context ends in this many tokens that occurred before proposes what
    /// followed them (`ContextLookup.proposal`) instead of calling `draft`; 0 drafts every step.
    public var lookupMinMatch: Int
    /// Verify trees of up to this many nodes (the root counted) through the target's `tree`
    /// function instead of the drafter's chain through `main` (docs/trees.md); nil or
    /// 0: the chain (`--no-tree`).
    public var treeBudget: Int?
    /// Choose each step's kind by measured cost instead (`StepPlanner`): the target alone, the
    /// chain of `numDraftTokens`, or a tree as large as the bundle's `tree` function.
    /// A `treeBudget` given besides is refused.
    public var automatic: Bool

    /// The default `lookupMinMatch`, the same as the Python loop's DEFAULT_LOOKUP_MIN_MATCH
    /// (tests/runtime's goldens check that they agree).
    public static let defaultLookupMinMatch = 2

    public init(maxNewTokens: Int = 64, useDrafter: Bool = true, numDraftTokens: Int? = nil,
                stopAtEndOfSequence: Bool = true, sampling: Sampling? = nil, seed: UInt64 = 0,
                lookupMinMatch: Int = GenerationOptions.defaultLookupMinMatch, treeBudget: Int? = nil,
                automatic: Bool = false) {
        self.maxNewTokens = maxNewTokens
        self.treeBudget = treeBudget
        self.automatic = automatic
        self.useDrafter = useDrafter
        self.numDraftTokens = numDraftTokens
        self.stopAtEndOfSequence = stopAtEndOfSequence
        self.sampling = sampling
        self.seed = seed
        self.lookupMinMatch = lookupMinMatch
    }

    var sampled: Bool { sampling.map { !$0.isGreedy } ?? false }
}

public enum StopReason: String, Sendable, Equatable {
    case endOfSequence = "eos"
    case maxNewTokens = "max_new_tokens"
    /// The next step would write positions at or past the bundle's context_length.
    case contextFull = "context_full"
}

/// One function call: which function, its first position and how many positions it covers.
public struct FunctionCall: Sendable, Equatable, CustomStringConvertible {
    public var function: String
    public var firstPosition: Int
    public var length: Int

    public init(function: String, firstPosition: Int, length: Int) {
        self.function = function
        self.firstPosition = firstPosition
        self.length = length
    }

    public var description: String { "\(function)@\(firstPosition)+\(length)" }
}

public struct FunctionStats: Sendable, Equatable {
    public var calls = 0
    public var seconds = 0.0
}

/// Whole steps of one kind (`StepPlanner.Kind`): how many, their wall time from each start until
/// its tokens were handed back (loading a function and catching the drafter up left out), the
/// part of it spent in model calls, and the tokens they gave.
public struct StepStats: Sendable, Equatable {
    public var steps = 0
    public var seconds = 0.0
    public var callSeconds = 0.0
    public var tokens = 0
    /// The host's own work: the steps' time outside model calls.
    public var hostSeconds: Double { seconds - callSeconds }
}

public struct GenerationResult: Sendable {
    public var promptIDs: [Int32]
    /// Generated ids, the prompt excluded (ending with the end-of-sequence token when that
    /// stopped the generation).
    public var tokens: [Int32] = []
    /// Drafted tokens accepted at each verify step (empty without the drafter).
    public var accepted: [Int] = []
    /// Proposed tokens accepted at each step that copied from the context instead of drafting.
    public var lookupAccepted: [Int] = []
    public var lookupSteps: Int { lookupAccepted.count }
    public var stopReason: StopReason = .maxNewTokens
    /// Function name -> calls and seconds spent in them (a context bucket's calls count as
    /// its function's: `main_512` as `main`).
    public var functions: [String: FunctionStats] = [:]
    /// Core ML function name -> calls: which context bucket each call ran in (docs/buckets.md).
    public var ranFunctions: [String: Int] = [:]
    public var trace: [FunctionCall] = []
    public var numDraftTokens = 0
    public var seconds = 0.0
    /// Prompt ids whose cache entries a `keepingCaches` call kept from the decoder's earlier
    /// calls; the call computed the other promptIDs.count - reusedTokens.
    public var reusedTokens = 0

    public var targetCalls: Int { ["prefill", "main", "decode", "tree"].reduce(0) { $0 + (functions[$1]?.calls ?? 0) } }
    /// Accepted tree nodes whose cache rows were moved into place (docs/trees.md).
    public var movedRows = 0
    /// Steps after the prompt by kind (`StepPlanner.Kind`: tree, chain, alone).
    public var steps: [String: Int] = [:]
    /// Steps after the prompt by kind, timed whole (`StepStats`).
    public var stepStats: [String: StepStats] = [:]
    /// The host's work in those steps by kind, then by part (`lookup`, `top_k`: the drafter's
    /// rows, `tree`: building it and its inputs, `accept`, `recycled`: the table's update,
    /// `move`: the accepted rows, `features`: the path's to the drafter), in seconds.
    public var hostSeconds: [String: [String: Double]] = [:]
    /// Seconds spent catching the drafter up after target-alone steps (left out of the steps).
    public var catchUpSeconds = 0.0
    /// With `GenerationOptions.automatic`: the planner's figures when the generation ended
    /// (`StepPlanner.summary`), and its expected tokens per second by kind.
    public var plan: String?
    public var expectedTokensPerSecond: [String: Double] = [:]
    public var tokensPerTargetCall: Double { targetCalls == 0 ? 0 : Double(tokens.count) / Double(targetCalls) }
    public var meanAcceptedLength: Double { accepted.isEmpty ? 0 : Double(accepted.reduce(0, +)) / Double(accepted.count) }
    /// Mean fraction of the judged drafts that were accepted.
    public var acceptanceRate: Double { numDraftTokens == 0 ? 0 : meanAcceptedLength / Double(numDraftTokens) }
    public var tokensPerSecond: Double { seconds > 0 ? Double(tokens.count) / seconds : 0 }
}
