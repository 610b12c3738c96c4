import Foundation

/// What the engine needs from whatever runs a package's functions: load a function, make one
/// state for a set of functions that declare the same states, and run a function with named
/// inputs and a state. Two backends implement it: `InterpreterBackend` (the package's ML
/// program run by the Swift interpreter, on any platform) and `CoreMLBackend` (Core ML on Apple
/// platforms; on Linux the same source runs against a stand-in of Core ML's API).
public protocol InferenceBackend: AnyObject {
    /// A short name for reports (`interpreter`, `coreml`).
    var name: String { get }
    func loadFunction(_ function: String, of package: URL) throws -> any BackendFunction
    /// One state for every function in `functions`; they must declare the same states. The
    /// engine makes one for the target's functions and one for the drafter's.
    func makeState(for functions: [any BackendFunction]) throws -> any BackendState
    /// Throws unless `functions` declare the same states (what `makeState(for:)` checks): a
    /// function loaded after its state was made may then use it.
    func checkSameStates(_ functions: [any BackendFunction]) throws
    /// The functions `package` holds, when the backend can tell without loading them (nil
    /// when it cannot: Core ML has no synchronous call for it).
    func functionNames(of package: URL) throws -> [String]?
}

public protocol BackendFunction: AnyObject {
    var name: String { get }
    /// Runs the function once, reading and writing `state` in place.
    func predict(_ inputs: [String: ShapedArray], state: any BackendState) throws -> [String: ShapedArray]
}

public protocol BackendState: AnyObject {
    /// Every state buffer back to zeros, as a fresh state is.
    func reset() throws
    /// In each named state ([..., capacity, head_dim]: position p in slot p % capacity), the
    /// rows of positions `moves[i].from` copied over those of `moves[i].to`, in order, between
    /// predictions: after a tree call, the accepted path's rows moved to their own positions
    /// (docs/trees.md).
    func moveRows(_ moves: [(from: Int, to: Int)], inStates names: [String]) throws
}

/// A function loaded from a compiled model the bundle ships (`.mlmodelc`) tells what that model
/// embeds: its creator-defined `museflash.metadata` (nil when it has none). The engine compares
/// it with metadata.json, so a compiled model of another export of the same geometry is refused
/// instead of decoding other tokens silently. A package's own embedded copy is check-contract's.
public protocol ShippedCompiledModel {
    var compiledModelPath: String { get }
    var embeddedMetadata: String? { get }
}
