import Foundation

/// The one pseudo-random generator of the fuzz and random-damage tests: SplitMix64, small,
/// seedable and the same on every platform, so a failing round replays exactly from its seed.
public struct FuzzGenerator: RandomNumberGenerator {
    public private(set) var state: UInt64

    public init(seed: UInt64) {
        state = seed
    }

    public mutating func next() -> UInt64 {
        state &+= 0x9E37_79B9_7F4A_7C15
        var mixed = state
        mixed = (mixed ^ (mixed >> 30)) &* 0xBF58_476D_1CE4_E5B9
        mixed = (mixed ^ (mixed >> 27)) &* 0x94D0_49BB_1331_11EB
        return mixed ^ (mixed >> 31)
    }

    /// The environment variable that replays a run of the random-damage tests.
    public static let seedVariable = "MUSEFLASH_RANDOM_DAMAGE_SEED"

    /// The seed `seedVariable` names (decimal, or hexadecimal after `0x`), else `fallback`; nil
    /// when the variable is set to something that is not a 64-bit unsigned integer.
    public static func seed(orElse fallback: UInt64,
                            environment: [String: String] = ProcessInfo.processInfo.environment) -> UInt64? {
        guard let text = environment[seedVariable], !text.isEmpty else { return fallback }
        return text.hasPrefix("0x") ? UInt64(text.dropFirst(2), radix: 16) : UInt64(text)
    }
}
