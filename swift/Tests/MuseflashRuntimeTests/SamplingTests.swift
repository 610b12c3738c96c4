import Foundation
@testable import MuseflashRuntime
import XCTest

/// Sampled speculative decoding keeps the target's distribution, checked statistically on the
/// Markov stand-ins (StandInBundle.swift), as tests/python/test_sampling.py checks the Python loop.
///
/// The bound. With x_0 the last prompt token and x_1..x_N the output, an exact loop gives
/// P(x_t = b | the past) = P[x_{t-1}][b], so D_b = sum_t (1[x_t = b] - P[x_{t-1}][b]) is a sum of
/// martingale differences with variance sigma_b^2 = sum_t P(1 - P), and D_b / sigma_b is about
/// standard normal. Every |D_b| must stay within Z = 4.5 sigma_b (a correct sampler crosses one
/// of the 6 with probability ~4e-5; the seeds are fixed anyway). A sampler that gives one token
/// 1% more probability at every step moves its D_b by 0.01 N; each run asserts that this exceeds
/// (Z + 3) sigma_b for every token, so such a bias is always caught, and
/// `testAOnePercentBiasIsCaught` shows it is.
final class SamplingTests: XCTestCase {
    static let tokens = 100_000
    static let z = 4.5
    static let prompt: [Int32] = [0, 1, 2, 3]

    /// The exact next-token distribution after each token, computed here independently of
    /// Sampling.swift: temperature softmax, then the nucleus in descending order, ties by id.
    static func exact(temperature: Double, topP: Double) -> [[Double]] {
        StandIn.logits.map { row in
            let values = row.map { Double(Float($0)) / temperature }
            let peak = values.max()!
            let weights = values.map { Foundation.exp($0 - peak) }
            let total = weights.reduce(0, +)
            let probabilities = weights.map { $0 / total }
            var kept = [Double](repeating: 0, count: row.count)
            var mass = 0.0
            for token in probabilities.indices.sorted(by: { (probabilities[$0], -$0) > (probabilities[$1], -$1) }) {
                if mass >= topP { break }
                kept[token] = probabilities[token]
                mass += probabilities[token]
            }
            return kept.map { $0 / mass }
        }
    }

    /// (D_b, sigma_b) for every token b.
    static func statistics(_ output: [Int32], _ exact: [[Double]]) -> [(d: Double, sigma: Double)] {
        var previous = Int(prompt.last!)
        var d = [Double](repeating: 0, count: StandIn.vocab)
        var variance = [Double](repeating: 0, count: StandIn.vocab)
        for token in output.map(Int.init) {
            for b in 0..<StandIn.vocab {
                let p = exact[previous][b]
                d[b] += (token == b ? 1 : 0) - p
                variance[b] += p * (1 - p)
            }
            previous = token
        }
        return zip(d, variance).map { ($0, $1.squareRoot()) }
    }

    /// lookupMinMatch 0: every step drafts (over 6 tokens a 2-token match is found nearly every
    /// step, so the default would hardly ever call the drafter).
    /// A tree of this many nodes, the stand-in's vocabulary and more: a node has several children.
    static let treeNodes = 8

    func generate(close: Bool, sampling: Sampling, seed: UInt64, useDrafter: Bool = true, lookupMinMatch: Int = 0,
                  treeBudget: Int? = nil, configure: (inout SpeculativeDecoder.Faults) -> Void = { _ in }) throws -> GenerationResult {
        let bundle = try StandIn.bundle(treeNodes: Self.treeNodes)
        let decoder = try SpeculativeDecoder(bundle: bundle, backend: MarkovBackend(close: close))
        configure(&decoder.faults)
        return try decoder.generate(prompt: Self.prompt, options: GenerationOptions(
            maxNewTokens: Self.tokens, useDrafter: useDrafter, sampling: sampling, seed: seed, lookupMinMatch: lookupMinMatch,
            treeBudget: treeBudget))
    }

    @discardableResult
    func checkDistribution(close: Bool, temperature: Double, topP: Double, useDrafter: Bool = true,
                           lookupMinMatch: Int = 0, treeBudget: Int? = nil) throws -> GenerationResult {
        let sampling = try Sampling(temperature: temperature, topP: topP)
        let result = try generate(close: close, sampling: sampling, seed: 1, useDrafter: useDrafter, lookupMinMatch: lookupMinMatch,
                                  treeBudget: treeBudget)
        XCTAssertEqual(result.tokens.count, Self.tokens)
        let exact = Self.exact(temperature: temperature, topP: topP)
        for (token, stat) in Self.statistics(result.tokens, exact).enumerated() {
            XCTAssertLessThanOrEqual(abs(stat.d), Self.z * stat.sigma + 1e-6, "token \(token): D \(stat.d), sigma \(stat.sigma)")
            XCTAssertGreaterThanOrEqual(0.01 * Double(Self.tokens), (Self.z + 3) * stat.sigma, "token \(token): a 1% bias would hide")
        }
        if useDrafter {
            // The check is only worth something if drafts are both accepted and rejected.
            XCTAssertGreaterThan(result.accepted.reduce(0, +), 0)
            XCTAssertLessThan(result.meanAcceptedLength, Double(StandIn.block - 1))
        }
        return result
    }

    /// Copied proposals are judged with a one-hot q: the output keeps the target's distribution.
    func testCopyingStepsKeepTheTargetDistribution() throws {
        for topP in [1, 0.9] {
            let result = try checkDistribution(close: false, temperature: 0.8, topP: topP, lookupMinMatch: 2)
            XCTAssertGreaterThan(Double(result.lookupSteps), 0.9 * Double(result.accepted.count))
            XCTAssertEqual(result.lookupAccepted.max(), StandIn.block - 1)
            XCTAssertEqual(result.lookupAccepted.min(), 0)
        }
    }

    func testCloseDrafterKeepsTheTargetDistribution() throws {
        try checkDistribution(close: true, temperature: 0.8, topP: 1)
        try checkDistribution(close: true, temperature: 0.8, topP: 0.9)
    }

    func testWrongDrafterKeepsTheTargetDistribution() throws {
        try checkDistribution(close: false, temperature: 0.8, topP: 1)
        try checkDistribution(close: false, temperature: 0.8, topP: 0.9)
    }

    /// Trees judged by recursive rejection (SpeculativeSampling.acceptTree): a close drafter's
    /// trees accept deep paths, a wrong one's reject child after child.
    func testTreesKeepTheTargetDistribution() throws {
        for close in [true, false] {
            for topP in [1, 0.9] {
                let result = try checkDistribution(close: close, temperature: 0.8, topP: topP, treeBudget: Self.treeNodes)
                XCTAssertEqual(result.functions["tree"]?.calls, result.accepted.count, "every step a tree")
                XCTAssertGreaterThan(result.movedRows, 0, "children after the first accepted too")
            }
        }
    }

    /// The same check catches a wrong tree rule: a residual skipped after a rejected child, or
    /// a child judged by a q that still holds its elder siblings' tokens; and the 1% bias.
    func testABiasInTheTreeRuleIsCaught() throws {
        let sampling = try Sampling(temperature: 0.8)
        let exact = Self.exact(temperature: 0.8, topP: 1)
        func caught(close: Bool, _ configure: (inout SpeculativeDecoder.Faults) -> Void) throws -> Bool {
            let result = try generate(close: close, sampling: sampling, seed: 1, treeBudget: Self.treeNodes, configure: configure)
            return Self.statistics(result.tokens, exact).contains { abs($0.d) > Self.z * $0.sigma }
        }
        XCTAssertTrue(try caught(close: false) { $0.treeSampling.keepTargetAfterRejection = true }, "the residual skipped")
        XCTAssertTrue(try caught(close: false) { $0.treeSampling.ignoreDrawnSiblings = true }, "siblings judged by the whole q")
        XCTAssertTrue(try caught(close: true) { $0.probabilityBias = (3, 0.01) }, "a 1% bias on token 3 with trees")
    }

    func testTargetAloneSamplesTheTargetDistribution() throws {
        try checkDistribution(close: true, temperature: 0.8, topP: 0.9, useDrafter: false)
    }

    func testAOnePercentBiasIsCaught() throws {
        let sampling = try Sampling(temperature: 0.8)
        let exact = Self.exact(temperature: 0.8, topP: 1)
        for token in [0, 3] {
            let result = try generate(close: true, sampling: sampling, seed: 1) { $0.probabilityBias = (token, 0.01) }
            let stat = Self.statistics(result.tokens, exact)[token]
            XCTAssertGreaterThan(abs(stat.d), Self.z * stat.sigma, "a 1% bias on token \(token) went unnoticed")
        }
    }

    func testSameSeedSameTokensOtherSeedOtherTokens() throws {
        let sampling = try Sampling(temperature: 0.8, topP: 0.9)
        let decoder = try SpeculativeDecoder(bundle: StandIn.bundle(), backend: MarkovBackend(close: true))
        let run = { (seed: UInt64) in try decoder.generate(prompt: Self.prompt, options: GenerationOptions(maxNewTokens: 200, sampling: sampling, seed: seed)).tokens }
        XCTAssertEqual(try run(5), try run(5))
        XCTAssertNotEqual(try run(5), try run(6))
    }

    func testTemperatureZeroIsTheGreedyPath() throws {
        let decoder = try SpeculativeDecoder(bundle: StandIn.bundle(), backend: MarkovBackend(close: true))
        let greedy = try decoder.generate(prompt: Self.prompt, options: GenerationOptions(maxNewTokens: 300))
        let zero = try decoder.generate(prompt: Self.prompt, options: GenerationOptions(maxNewTokens: 300, sampling: Sampling(temperature: 0), seed: 9))
        XCTAssertEqual(zero.tokens, greedy.tokens)
        XCTAssertEqual(zero.accepted, greedy.accepted)
        // Greedy Markov decoding follows each token's most likely successor.
        var previous = Int(Self.prompt.last!)
        for token in greedy.tokens.map(Int.init) {
            let row = StandIn.logits[previous].map(Float.init)
            XCTAssertEqual(token, row.firstIndex(of: row.max()!))
            previous = token
        }
    }

    func testABundleWithoutADrafterIsDecodedAloneOnlyWhenAsked() throws {
        let decoder = try SpeculativeDecoder(bundle: StandIn.bundle(drafter: false), backend: MarkovBackend(close: true))
        XCTAssertFalse(decoder.hasDrafter)
        XCTAssertThrowsError(try decoder.generate(prompt: Self.prompt, options: GenerationOptions(maxNewTokens: 5))) {
            XCTAssertTrue("\($0)".contains("--no-draft"))
        }
        let alone = try decoder.generate(prompt: Self.prompt, options: GenerationOptions(maxNewTokens: 5, useDrafter: false))
        XCTAssertEqual(alone.tokens.count, 5)
        XCTAssertNil(alone.functions["draft"])
    }

    func testSettingsAreValidatedNamingTheFlag() {
        XCTAssertThrowsError(try Sampling(temperature: -1)) { XCTAssertTrue("\($0)".contains("--temperature")) }
        XCTAssertThrowsError(try Sampling(temperature: .nan)) { XCTAssertTrue("\($0)".contains("--temperature")) }
        XCTAssertThrowsError(try Sampling(temperature: 1, topP: 0)) { XCTAssertTrue("\($0)".contains("--top-p")) }
        XCTAssertThrowsError(try Sampling(temperature: 1, topP: 1.5)) { XCTAssertTrue("\($0)".contains("--top-p")) }
    }

    /// The generator's stated algorithm: the same stream on every platform.
    func testGeneratorIsXoshiroSeededBySplitMix() {
        var generator = SeededGenerator(seed: 0)
        // SplitMix64 from 0 gives 0xE220A8397B1DCDAF first; xoshiro256** then outputs
        // rotl(s1 * 5, 7) * 9 for the second state word.
        var mix: UInt64 = 0
        mix &+= 0x9E37_79B9_7F4A_7C15
        var z = mix
        z = (z ^ (z >> 30)) &* 0xBF58_476D_1CE4_E5B9
        z = (z ^ (z >> 27)) &* 0x94D0_49BB_1331_11EB
        XCTAssertEqual(z ^ (z >> 31), 0xE220_A839_7B1D_CDAF)
        mix &+= 0x9E37_79B9_7F4A_7C15
        z = mix
        z = (z ^ (z >> 30)) &* 0xBF58_476D_1CE4_E5B9
        z = (z ^ (z >> 27)) &* 0x94D0_49BB_1331_11EB
        let s1 = z ^ (z >> 31)
        let product = s1 &* 5
        XCTAssertEqual(generator.next(), ((product << 7) | (product >> 57)) &* 9)
        let u = generator.uniform()
        XCTAssertTrue(u >= 0 && u < 1)
    }
}
