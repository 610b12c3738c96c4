/// Why a program cannot be loaded or run. Each description is one line that names the function,
/// the op (its type and its first output's name) or the file, so a failure can be found.
public enum InterpreterError: Error, Sendable, Equatable, CustomStringConvertible {
    /// Op types without a kernel here, each with the name of one op that uses it. The
    /// interpreter refuses the whole function rather than guess.
    case unsupportedOps(function: String, ops: [String])
    case opFailed(function: String, op: String, reason: String)
    case badProgram(function: String, reason: String)
    case noSuchFunction(name: String, available: [String])
    case badInput(function: String, name: String, reason: String)
    case badState(function: String, name: String, reason: String)
    case weightFile(path: String, reason: String)
    /// The first op whose fp16 or fp32 result holds inf or NaN, and the weight nearest to it
    /// (its name carries the layer: `p_layers_3_...`).
    case nonFinite(function: String, op: String, nearestWeight: String?)

    public var description: String {
        switch self {
        case .unsupportedOps(let function, let ops):
            return "function \(function) uses ops the Swift interpreter has no kernel for: "
                + ops.joined(separator: ", ") + "; it runs only the ops museflash exports use"
        case .opFailed(let function, let op, let reason):
            return "function \(function), op \(op): \(reason)"
        case .badProgram(let function, let reason):
            return "function \(function) cannot be interpreted: \(reason)"
        case .noSuchFunction(let name, let available):
            return "the package has no function \(name); it has \(available.sorted().joined(separator: ", "))"
        case .badInput(let function, let name, let reason):
            return "function \(function), input \(name): \(reason)"
        case .badState(let function, let name, let reason):
            return "function \(function), state \(name): \(reason)"
        case .weightFile(let path, let reason):
            return "weight file \(path): \(reason); re-export the bundle"
        case .nonFinite(let function, let op, let weight):
            var place = ""
            if let weight {
                let parts = weight.split(separator: "_")
                if let at = parts.firstIndex(of: "layers"), at + 1 < parts.count, Int(parts[at + 1]) != nil {
                    place = " in layer \(parts[at + 1])"
                }
                place += " (nearest weight \(weight))"
            }
            return "function \(function): \(op) is the first op whose result is not finite\(place); "
                + "the bundle overflows fp16 here, re-export it with this museflash (docs/fp16.md)"
        }
    }
}

/// A kernel's own failure; the interpreter adds the function and op.
struct KernelError: Error {
    let reason: String
    init(_ reason: String) { self.reason = reason }
}
