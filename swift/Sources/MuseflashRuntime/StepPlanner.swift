import Foundation

/// Where the engine reads the time (seconds since some fixed start, never going back): the
/// system's monotonic clock, or a test's fake one. Every step, function call and host part the
/// engine times reads it (`SpeculativeDecoder.clock`).
public protocol StepClock: AnyObject {
    func now() -> Double
}

/// `ContinuousClock`, in seconds since the clock was made.
public final class SystemStepClock: StepClock {
    private let clock = ContinuousClock()
    private let origin: ContinuousClock.Instant

    public init() { origin = clock.now }

    public func now() -> Double { (clock.now - origin).seconds }
}

/// The choice of each step when no budget is forced (swift-generate's default; docs/trees.md,
/// "The budget the engine chooses"): the target alone through its one-token `decode`, the
/// drafter's chain through `main`, or a tree through `tree`, whichever is expected to give the
/// most tokens per second on the machine at hand.
///
///   expected tokens/s of the target alone   1 / (its step + its share of catching up)
///   of the chain or a tree                  (1 + accepted) / its step
///
/// where a step's cost is the wall time of the kind's whole steps in this process, from the
/// step's start until its tokens are handed back: the model calls and the host's own work
/// (the drafter's top-k, the tree, the recycled table, lookup, moving rows, the features).
/// Loading a function is left out, and so is catching the drafter up after target-alone steps,
/// which is charged to those steps instead (per step caught up): a speculative step after a
/// run of them pays for their features. The first step of a kind stands alone until a second
/// replaces it (it holds a Core ML function's warm-up), then each step moves the running cost
/// by `costWeight`. `accepted` is the mean over the kind's last `window` steps. A tree step
/// also tells what the chain would have accepted (the drafter's top-1 tokens against the
/// target's path), so the chain's figure follows the tree's.
///
/// Each function's cost per call is kept too (`cost`), for the report; a given table of them
/// (`fixedCosts`: a stored calibration, or a test's) costs a step as the sum of its calls until
/// whole steps of that kind are measured.
///
/// Each kind is tried until its cost and acceptance are known; while the target alone leads,
/// a step now and then is the best speculative kind, so drafts that start to pay later in a
/// conversation are seen: after `probeInterval` alone steps, then twice as many after each
/// probe that leaves the target alone ahead (at most `longestProbeInterval`). The target alone
/// costs what a bundle exported without a drafter costs (`decode`), so the choice is never
/// slower than that bundle by more than the probes and the first steps. Greedy or sampled,
/// every kind keeps the target's output: the choice changes the speed only.
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
    /// instead of measured: a stored calibration, or a test's. A kind's measured whole steps
    /// replace the sum of its calls.
    public var fixedCosts: [String: Double]?
    private var calls: [String: Int] = [:]
    private var costs: [String: Double] = [:]
    /// Whole steps measured by kind, and their running cost in seconds.
    private var measuredSteps: [Kind: Int] = [:]
    private var stepCosts: [Kind: Double] = [:]
    /// Catching the drafter up after target-alone steps, in seconds per alone step caught up.
    private var catchUpCost: Double?
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

    /// A running cost after its `count`th figure, `seconds`: the first stands alone until a
    /// second replaces it (a first call holds its warm-up), then each moves it by `costWeight`.
    static func running(_ cost: Double?, count: Int, seconds: Double) -> Double {
        guard count > 2, let cost else { return seconds }
        return costWeight * seconds + (1 - costWeight) * cost
    }

    /// One call of `function` took `seconds` (the report's figure; steps are costed whole).
    public mutating func observe(_ function: String, seconds: Double) {
        let count = calls[function, default: 0] + 1
        calls[function] = count
        costs[function] = StepPlanner.running(costs[function], count: count, seconds: seconds)
    }

    /// One whole step of `kind` took `seconds`, from its start until its tokens were handed
    /// back (function loads and catching up left out).
    public mutating func observeStep(_ kind: Kind, seconds: Double) {
        let count = measuredSteps[kind, default: 0] + 1
        measuredSteps[kind] = count
        stepCosts[kind] = StepPlanner.running(stepCosts[kind], count: count, seconds: seconds)
    }

    /// Injecting the features of `steps` target-alone steps into the drafter took `seconds`.
    public mutating func observeCatchUp(seconds: Double, steps: Int) {
        guard steps > 0 else { return }
        let perStep = seconds / Double(steps)
        catchUpCost = catchUpCost.map { StepPlanner.costWeight * perStep + (1 - StepPlanner.costWeight) * $0 } ?? perStep
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

    /// Seconds per step of `kind`: its measured whole steps (an alone step with its share of
    /// catching up), else, with `fixedCosts`, the sum of its calls.
    public func secondsPerStep(_ kind: Kind) -> Double? {
        if let measured = stepCosts[kind] { return measured + (kind == .alone ? catchUpCost ?? 0 : 0) }
        guard fixedCosts != nil else { return nil }
        return callSecondsPerStep(kind)
    }

    /// The sum of the calls a step of `kind` makes (`draft`, the verify function and
    /// `inject_kv`; the alone step's one call), from the per-function costs: a step's model
    /// calls, without the host's work.
    public func callSecondsPerStep(_ kind: Kind) -> Double? {
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
        if fixedCosts == nil, measuredSteps[kind, default: 0] < 2 { return true }
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

    /// One line: each kind's expected tokens/s, tokens per step and milliseconds per step (and
    /// of them, its model calls').
    public func summary(among kinds: [Kind] = Kind.allCases) -> String {
        kinds.map { kind in
            guard let rate = tokensPerSecond(kind), let tokens = tokensPerStep(kind), let seconds = secondsPerStep(kind) else {
                return "\(kind.rawValue) not measured"
            }
            let calls = callSecondsPerStep(kind).map { String(format: ", model calls %.1f", 1000 * $0) } ?? ""
            return String(format: "%@ %.1f tokens/s (%.2f tokens per step in %.1f ms%@)", kind.rawValue, rate, tokens, 1000 * seconds, calls)
        }.joined(separator: ", ")
    }
}
