/// How the engine times its steps (docs/trees.md, "The budget the engine chooses"): each step
/// whole, from its start until its tokens are handed back, on `SpeculativeDecoder.clock`; the
/// part of it spent in model calls; and the host's own work by part.

/// The step under way: when it started, the seconds its model calls took, the seconds left out
/// of it (loading a function, catching the drafter up), and the tokens before it.
struct StepTiming {
    var start = 0.0
    var calls = 0.0
    var excluded = 0.0
    var tokens = 0
}

/// A point within a step, to charge the host's work after it to a part (`charge`).
struct StepMark {
    let time: Double
    let calls: Double
    let excluded: Double
}

extension SpeculativeDecoder.Run {
    mutating func beginStep() {
        timing = StepTiming(start: decoder.clock.now(), tokens: result.tokens.count)
    }

    /// The step under way was of `kind`: its whole time goes to the result's figures and, unless
    /// `planned` is false (a generation without the drafter), to the planner.
    mutating func endStep(_ kind: StepPlanner.Kind, planned: Bool = true) {
        let seconds = decoder.clock.now() - timing.start - timing.excluded
        if planned { decoder.planner.observeStep(kind, seconds: seconds) }
        var stats = result.stepStats[kind.rawValue, default: StepStats()]
        stats.steps += 1
        stats.seconds += seconds
        stats.callSeconds += timing.calls
        stats.tokens += result.tokens.count - timing.tokens
        result.stepStats[kind.rawValue] = stats
    }

    func mark() -> StepMark {
        StepMark(time: decoder.clock.now(), calls: timing.calls, excluded: timing.excluded)
    }

    /// The host's work since `mark` (model calls and what the step leaves out apart), charged
    /// to `part` of `kind`'s steps.
    /// `besides`: seconds within it already charged to another part.
    mutating func charge(_ part: String, of kind: StepPlanner.Kind, since mark: StepMark, besides: Double = 0) {
        let seconds = decoder.clock.now() - mark.time - (timing.calls - mark.calls) - (timing.excluded - mark.excluded)
        charge(part, of: kind, seconds: seconds - besides)
    }

    mutating func charge(_ part: String, of kind: StepPlanner.Kind, seconds: Double) {
        result.hostSeconds[kind.rawValue, default: [:]][part, default: 0] += seconds
    }
}
