import Foundation
@testable import MuseflashRuntime
import XCTest

/// The rule an automatic generation chooses its steps by (StepPlanner): the kind with the most
/// expected tokens per second, from the costs and acceptance it has seen.
final class StepPlannerTests: XCTestCase {
    /// This CPU's costs in seconds (docs/trees.md): a 4-row tree costs half again a decode.
    static let cpu = ["decode": 0.040, "tree": 0.061, "main": 0.061, "draft": 0.010, "inject_kv": 0.001]

    /// A planner past its first steps, whose tree steps accepted `accepted` on average.
    func planner(costs: [String: Double], treeAccepted: [Int], chainAccepted: [Int] = []) -> StepPlanner {
        var planner = StepPlanner(fixedCosts: costs)
        for accepted in treeAccepted { planner.record(.tree, accepted: accepted) }
        for accepted in chainAccepted { planner.record(.chain, accepted: accepted) }
        return planner
    }

    func testTheTreePaysOnThisCPUOnlyWhenEnoughIsAccepted() {
        // (1 + 0.9) / 72 ms = 26.4 tokens/s against 1 / 40 ms = 25: the tree.
        var good = planner(costs: Self.cpu, treeAccepted: [1, 1, 1, 1, 1, 1, 1, 1, 1, 0])
        XCTAssertEqual(good.next(among: [.tree, .alone]), .tree)
        // (1 + 0.5) / 72 ms = 20.8: the target alone.
        var poor = planner(costs: Self.cpu, treeAccepted: [1, 0, 1, 0, 1, 0, 1, 0])
        XCTAssertEqual(poor.next(among: [.tree, .alone]), .alone)
        XCTAssertEqual(poor.tokensPerSecond(.alone)!, 25, accuracy: 1e-9)
        XCTAssertEqual(poor.tokensPerSecond(.tree)!, 1.5 / 0.072, accuracy: 1e-9)
    }

    func testWhereRowsCostWhatOneRowCostsEvenALittleAcceptancePays() {
        // A weight-bound device: 4 rows cost what 1 row costs; 1.3 / 51 ms beats 1 / 40 ms.
        var mac = Self.cpu
        mac["tree"] = mac["decode"]
        var planner = planner(costs: mac, treeAccepted: [0, 0, 1, 0, 0, 1, 0, 0, 1, 0])
        XCTAssertEqual(planner.next(among: [.tree, .alone]), .tree)
    }

    func testTheChainWinsWhenItIsCheaperPerToken() {
        // A 16-node tree at 100 ms accepting 1.5 against a 4-row chain accepting 1.2.
        var costs = Self.cpu
        costs["tree"] = 0.100
        var planner = planner(costs: costs, treeAccepted: [2, 1, 2, 1], chainAccepted: [1, 1, 2, 1, 1])
        XCTAssertEqual(planner.next(among: [.tree, .chain, .alone]), .chain)
    }

    func testWhileTheTargetAloneLeadsProbesComeLessAndLessOften() {
        var planner = planner(costs: Self.cpu, treeAccepted: [0, 0, 0, 0])
        let kinds = (0..<1000).map { _ in planner.next(among: [.tree, .alone]) }
        let probes = kinds.indices.filter { kinds[$0] == .tree }
        // The 16th step, then one in 32, 64, 128, 256 and 256: a few in a thousand.
        XCTAssertEqual(probes, [15, 47, 111, 239, 495, 751])
    }

    func testAProbeThatPaysMakesTheKindLeadAgain() {
        var planner = planner(costs: Self.cpu, treeAccepted: [0, 0, 0, 0])
        var kinds = (0..<16).map { _ in planner.next(among: [.tree, .alone]) }
        XCTAssertEqual(kinds.last, .tree, "the first probe")
        // The probe and the steps the mean keeps from then on accept 3: the tree leads.
        for _ in 0..<StepPlanner.window { planner.record(.tree, accepted: 3) }
        kinds = (0..<4).map { _ in planner.next(among: [.tree, .alone]) }
        XCTAssertEqual(kinds, [.tree, .tree, .tree, .tree])
    }

    func testUnknownKindsAreTriedFirstAndAFirstStepDoesNotSetTheCost() {
        var planner = StepPlanner()
        XCTAssertEqual(planner.next(among: [.tree, .alone]), .tree, "nothing measured: the first kind")
        planner.observeStep(.tree, seconds: 0.5)
        planner.record(.tree, accepted: 2)
        XCTAssertEqual(planner.next(among: [.tree, .alone]), .tree, "one tree step: its cost is not known yet")
        planner.observeStep(.tree, seconds: 0.071)
        XCTAssertEqual(planner.secondsPerStep(.tree)!, 0.071, accuracy: 1e-12, "the second step replaces the first's warm-up")
        planner.record(.tree, accepted: 2)
        XCTAssertEqual(planner.next(among: [.tree, .alone]), .alone, "the target alone not measured yet")
        planner.observeStep(.alone, seconds: 0.040)
        planner.observeStep(.alone, seconds: 0.040)
        // (1 + 2) / 71 ms = 42 tokens/s against 25.
        XCTAssertEqual(planner.next(among: [.tree, .alone]), .tree)
        planner.observeStep(.alone, seconds: 0.001)
        XCTAssertEqual(planner.secondsPerStep(.alone)!, 0.25 * 0.001 + 0.75 * 0.040, accuracy: 1e-12, "a running cost")
    }

    /// A step's calls, then its host work, on `clock`: each call observed as a function's cost,
    /// the whole step as the kind's.
    func step(_ kind: StepPlanner.Kind, calls: [(String, Double)], host: Double, accepted: Int = 0,
              on clock: FakeClock, _ planner: inout StepPlanner) {
        let start = clock.now()
        for (function, seconds) in calls {
            clock.advance(seconds)
            planner.observe(function, seconds: seconds)
        }
        clock.advance(host)
        if kind != .alone { planner.record(kind, accepted: accepted) }
        planner.observeStep(kind, seconds: clock.now() - start)
    }

    func testAKindWhoseCallsAreCheapButWhoseHostWorkIsSlowLosesToTheTargetAlone() {
        // A tree step's calls take 16 ms and accept 2 (3 tokens: 187 tokens/s on its calls);
        // the target alone takes 40 ms a token. With `host` seconds of the host's work a step:
        func choice(host: Double) -> (StepPlanner.Kind, StepPlanner) {
            let clock = FakeClock()
            var planner = StepPlanner()
            for _ in 0..<4 {
                step(.tree, calls: [("draft", 0.005), ("tree", 0.010), ("inject_kv", 0.001)], host: host, accepted: 2,
                     on: clock, &planner)
                step(.alone, calls: [("decode", 0.040)], host: 0.0005, on: clock, &planner)
            }
            return (planner.next(among: [.tree, .alone]), planner)
        }
        // 3 tokens in 216 ms: 13.9 tokens/s against the target alone's 24.7.
        let (slow, planner) = choice(host: 0.200)
        XCTAssertEqual(slow, .alone)
        XCTAssertEqual(planner.secondsPerStep(.tree)!, 0.216, accuracy: 1e-9, "the whole step")
        XCTAssertEqual(planner.callSecondsPerStep(.tree)!, 0.016, accuracy: 1e-9, "its calls, kept for the report")
        XCTAssertTrue(planner.summary(among: [.tree, .alone]).contains("in 216.0 ms, model calls 16.0"))
        // The same calls with little host work: the tree.
        XCTAssertEqual(choice(host: 0.002).0, .tree)
    }

    func testCatchingUpIsChargedToTheTargetAloneSteps() {
        var planner = StepPlanner()
        for _ in 0..<2 { planner.observeStep(.alone, seconds: 0.040) }
        planner.observeCatchUp(seconds: 0.016, steps: 8)
        XCTAssertEqual(planner.secondsPerStep(.alone)!, 0.042, accuracy: 1e-12)
        XCTAssertEqual(planner.tokensPerSecond(.alone)!, 1 / 0.042, accuracy: 1e-9)
    }

    /// Whole steps reach the planner from the engine: on the Markov stand-ins (StandInBundle.swift)
    /// with every call's cost on a fake clock, the tree leads; a host delay planted in every tree
    /// step makes the planner leave trees for the target alone, and the tokens stay the same.
    func testAHostDelayInTreeStepsMakesThePlannerLeaveThem() throws {
        func generate(treeHostDelay: Double) throws -> GenerationResult {
            let clock = FakeClock()
            let costs = ["prefill": 0.050, "main": 0.040, "tree": 0.045, "draft": 0.005, "inject_kv": 0.001]
            let decoder = try SpeculativeDecoder(bundle: StandIn.bundle(treeNodes: StandIn.block),
                                                 backend: TimedBackend(MarkovBackend(close: true), clock: clock, costs: costs))
            decoder.clock = clock
            if treeHostDelay > 0 { decoder.faults.treeHostWork = { clock.advance(treeHostDelay) } }
            return try decoder.generate(prompt: [0, 1, 2, 3], options: GenerationOptions(maxNewTokens: 200, lookupMinMatch: 0,
                                                                                         automatic: true))
        }
        let quick = try generate(treeHostDelay: 0)
        let slow = try generate(treeHostDelay: 0.200)
        XCTAssertEqual(slow.tokens, quick.tokens, "greedy: the target's tokens whatever the choice")
        let quickTree = quick.steps["tree"] ?? 0, slowTree = slow.steps["tree"] ?? 0
        XCTAssertGreaterThan(quickTree, 2 * (quick.steps["alone"] ?? 0), "without the delay the tree leads")
        XCTAssertGreaterThan(slow.steps["alone"] ?? 0, 10 * slowTree, "with it the target alone leads")
        // Each tree step's delay is in its whole time, not in its calls.
        let stats = try XCTUnwrap(slow.stepStats["tree"])
        XCTAssertEqual(stats.hostSeconds, 0.200 * Double(stats.steps), accuracy: 1e-9)
        XCTAssertEqual(stats.callSeconds, 0.051 * Double(stats.steps), accuracy: 1e-9)
    }
}

/// A clock that moves only when told.
final class FakeClock: StepClock {
    private(set) var time = 0.0
    func now() -> Double { time }
    func advance(_ seconds: Double) { time += seconds }
}

/// A backend whose every call advances `clock` by its function's cost (`costs`, seconds by
/// function name), around another backend's functions.
final class TimedBackend: InferenceBackend {
    let inner: any InferenceBackend
    let clock: FakeClock
    let costs: [String: Double]
    var name: String { inner.name }

    init(_ inner: any InferenceBackend, clock: FakeClock, costs: [String: Double]) {
        self.inner = inner
        self.clock = clock
        self.costs = costs
    }

    func loadFunction(_ function: String, of package: URL) throws -> any BackendFunction {
        TimedFunction(try inner.loadFunction(function, of: package), clock: clock, seconds: costs[function] ?? 0)
    }

    func makeState(for functions: [any BackendFunction]) throws -> any BackendState { NoState() }
    func checkSameStates(_ functions: [any BackendFunction]) throws {}
    func functionNames(of package: URL) throws -> [String]? { nil }
}

final class TimedFunction: BackendFunction {
    let inner: any BackendFunction
    let clock: FakeClock
    let seconds: Double
    var name: String { inner.name }

    init(_ inner: any BackendFunction, clock: FakeClock, seconds: Double) {
        self.inner = inner
        self.clock = clock
        self.seconds = seconds
    }

    func predict(_ inputs: [String: ShapedArray], state: any BackendState) throws -> [String: ShapedArray] {
        clock.advance(seconds)
        return try inner.predict(inputs, state: state)
    }
}
