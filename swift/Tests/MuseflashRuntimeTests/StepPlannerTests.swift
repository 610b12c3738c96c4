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

    func testUnknownKindsAreTriedFirstAndAFirstCallDoesNotSetTheCost() {
        var planner = StepPlanner()
        XCTAssertEqual(planner.next(among: [.tree, .alone]), .tree, "nothing measured: the first kind")
        for (function, seconds) in [("draft", 0.010), ("tree", 0.5), ("inject_kv", 0.001)] {
            planner.observe(function, seconds: seconds)
        }
        planner.record(.tree, accepted: 2)
        XCTAssertEqual(planner.next(among: [.tree, .alone]), .tree, "one tree call: its cost is not known yet")
        planner.observe("tree", seconds: 0.060)
        XCTAssertEqual(planner.secondsPerStep(.tree)!, 0.071, accuracy: 1e-12, "the second call replaces the first's warm-up")
        planner.record(.tree, accepted: 2)
        XCTAssertEqual(planner.next(among: [.tree, .alone]), .alone, "decode not measured yet")
        planner.observe("decode", seconds: 0.040)
        planner.observe("decode", seconds: 0.040)
        // (1 + 2) / 71 ms = 42 tokens/s against 25.
        XCTAssertEqual(planner.next(among: [.tree, .alone]), .tree)
        planner.observe("decode", seconds: 0.001)
        XCTAssertEqual(planner.cost("decode")!, 0.25 * 0.001 + 0.75 * 0.040, accuracy: 1e-12, "a running cost")
    }
}
