import Foundation

/// The choice of each step when no budget is forced (swift-generate's default; docs/trees.md,
/// "The budget the engine chooses"): the target alone through its one-token `decode`, the
/// drafter's chain through `main`, or a tree through `tree`, whichever is expected to give the
/// most tokens per second on the machine at hand.
///
///   expected tokens/s of the target alone   1 / decode
///   of the chain                            (1 + accepted) / (draft + main + inject_kv)
///   of a tree                               (1 + accepted) / (draft + tree + inject_kv)
///
/// where each function's cost is what its calls have taken so far in this process (its first
/// call left out while there are others: a Core ML function's first prediction includes its
/// warm-up), or a given table (`fixedCosts`), and `accepted` is the mean over the kind's last
/// `window` steps. A tree step also tells what the chain would have accepted (the drafter's
/// top-1 tokens against the target's path), so the chain's figure follows the tree's.
///
/// Each kind is tried until its cost and acceptance are known; while the target alone leads,
/// a step now and then is the best speculative kind, so drafts that start to pay later in a
/// conversation are seen: after `probeInterval` alone steps, then twice as many after each
/// probe that leaves the target alone ahead (at most `longestProbeInterval`). The target alone costs what a bundle exported without a
/// drafter costs (`decode`), so the choice is never slower than that bundle by more than the
/// probes and the first steps. Greedy or sampled, every kind keeps the target's output: the
/// choice changes the speed only.
public struct StepPlanner: Sendable {
    public enum Kind: String, Sendable, CaseIterable {
        case tree, chain, alone
    }

    /// Steps of each kind taken before its acceptance counts as known.
    public static let warmupSteps = 2
    /// While the target alone leads, the first probe comes after this many alone steps.
    public static let probeInterval = 16
    /// The longest run of alone steps between probes.
    public static let longestProbeInterval = 256
    /// Steps of each kind whose accepted drafts make its mean.
    public static let window = 32
    /// The weight of a function's newest call in its running cost.
    public static let costWeight = 0.25

    /// Seconds per call by function name (`decode`, `main`, `tree`, `draft`, `inject_kv`), given
    /// instead of measured: a stored calibration, or a test's.
    public var fixedCosts: [String: Double]?
    private var calls: [String: Int] = [:]
    private var costs: [String: Double] = [:]
    private var recent: [Kind: [Int]] = [:]
    private var taken: [Kind: Int] = [:]
    private var aloneRun = 0
    private var probeEvery = StepPlanner.probeInterval
    /// The target-alone step's function: `decode` where the bundle has one, else `main`.
    let aloneFunction: String

    public init(aloneFunction: String = "decode", fixedCosts: [String: Double]? = nil) {
        self.aloneFunction = aloneFunction
        self.fixedCosts = fixedCosts
    }

    /// One call of `function` took `seconds`.
    public mutating func observe(_ function: String, seconds: Double) {
        let count = calls[function, default: 0] + 1
        calls[function] = count
        // The first call stands alone until a second replaces it.
        if count <= 2 {
            costs[function] = seconds
        } else {
            costs[function] = StepPlanner.costWeight * seconds + (1 - StepPlanner.costWeight) * costs[function]!
        }
    }

    /// A step of `kind` accepted `accepted` drafts (or, `estimated`, would have: the chain's
    /// figure from a tree step).
    public mutating func record(_ kind: Kind, accepted: Int, estimated: Bool = false) {
        var list = recent[kind, default: []]
        list.append(accepted)
        recent[kind] = Array(list.suffix(StepPlanner.window))
        if !estimated { taken[kind, default: 0] += 1 }
    }

    public func cost(_ function: String) -> Double? {
        if let fixedCosts { return fixedCosts[function] }
        return costs[function]
    }

    /// The mean accepted drafts per step of `kind` over its recent steps; nil before any.
    public func meanAccepted(_ kind: Kind) -> Double? {
        guard let list = recent[kind], !list.isEmpty else { return nil }
        return Double(list.reduce(0, +)) / Double(list.count)
    }

    /// The target function a step of `kind` calls: `decode` (or `main`), `main` or `tree`.
    func targetFunction(_ kind: Kind) -> String {
        switch kind {
        case .alone: return aloneFunction
        case .chain: return "main"
        case .tree: return "tree"
        }
    }

    /// Seconds per step of `kind`, from the costs known so far.
    public func secondsPerStep(_ kind: Kind) -> Double? {
        guard let verify = cost(targetFunction(kind)) else { return nil }
        if kind == .alone { return verify }
        guard let draft = cost("draft"), let inject = cost("inject_kv") else { return nil }
        return draft + verify + inject
    }

    /// Tokens per step of `kind`: 1 alone, 1 + the mean accepted otherwise.
    public func tokensPerStep(_ kind: Kind) -> Double? {
        kind == .alone ? 1 : meanAccepted(kind).map { 1 + $0 }
    }

    /// The expected tokens per second of `kind`; nil while it is not known.
    public func tokensPerSecond(_ kind: Kind) -> Double? {
        guard let seconds = secondsPerStep(kind), seconds > 0, let tokens = tokensPerStep(kind) else { return nil }
        return tokens / seconds
    }

    /// Whether `kind` still needs trying: its cost unknown, or (speculative) fewer than
    /// `warmupSteps` of its own steps taken.
    func exploring(_ kind: Kind) -> Bool {
        if secondsPerStep(kind) == nil || tokensPerStep(kind) == nil { return true }
        if fixedCosts == nil, calls[targetFunction(kind), default: 0] < 2 { return true }
        return kind != .alone && taken[kind, default: 0] < StepPlanner.warmupSteps
    }

    /// The kind of the next step, among `kinds` (those the bundle, the options and the room
    /// left allow, in the order tried first).
    public mutating func next(among kinds: [Kind]) -> Kind {
        precondition(!kinds.isEmpty, "a step needs a kind to choose from")
        if let unknown = kinds.first(where: exploring) { return unknown }
        let rates = kinds.map { ($0, tokensPerSecond($0) ?? 0) }
        // The first of the fastest (ties go to the kind listed first).
        var best = rates[0]
        for rate in rates.dropFirst() where rate.1 > best.1 { best = rate }
        guard best.0 == .alone else {
            aloneRun = 0
            probeEvery = StepPlanner.probeInterval
            return best.0
        }
        aloneRun += 1
        let speculative = rates.filter { $0.0 != .alone }
        if aloneRun >= probeEvery, var probe = speculative.first {
            for rate in speculative.dropFirst() where rate.1 > probe.1 { probe = rate }
            aloneRun = 0
            probeEvery = min(2 * probeEvery, StepPlanner.longestProbeInterval)
            return probe.0
        }
        return .alone
    }

    /// One line: each kind's expected tokens/s, tokens per step and milliseconds per step.
    public func summary(among kinds: [Kind] = Kind.allCases) -> String {
        kinds.map { kind in
            guard let rate = tokensPerSecond(kind), let tokens = tokensPerStep(kind), let seconds = secondsPerStep(kind) else {
                return "\(kind.rawValue) not measured"
            }
            return String(format: "%@ %.1f tokens/s (%.2f tokens per step in %.1f ms)", kind.rawValue, rate, tokens, 1000 * seconds)
        }.joined(separator: ", ")
    }
}
