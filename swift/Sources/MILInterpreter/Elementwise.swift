import Foundation

// Elementwise kernels. Floats compute in fp32, integers in int32 (wrapping), as the numpy
// reference does; the interpreter then stores each result in its declared type.

enum Numeric {
    case float([Float])
    case int([Int32])
    case bool([Bool])

    init(_ tensor: Tensor) {
        switch tensor.data {
        case .float, .half: self = .float(tensor.floats())
        case .int: self = .int(tensor.ints())
        case .bool: self = .bool(tensor.bools())
        case .string: self = .float([])
        }
    }
}

/// How an input of `input`'s shape is read for each element of `output`: at
/// `(i / divisor) % modulus` when its non-1 dimensions are one contiguous run of the output's
/// (a bias row, a per-row scale, a scalar, the same shape), else nil.
func affineIndex(from input: [Int], to output: [Int]) -> (divisor: Int, modulus: Int)? {
    let padded = [Int](repeating: 1, count: output.count - input.count) + input
    guard let first = padded.firstIndex(where: { $0 != 1 }) else { return (1, 1) }
    let last = padded.lastIndex(where: { $0 != 1 })!
    for axis in first...last where padded[axis] != output[axis] { return nil }
    return (elementCount(Array(output[(last + 1)...])), elementCount(Array(output[first...last])))
}

@inline(__always)
func mapBroadcast<A, B, R>(_ x: [A], _ xShape: [Int], _ y: [B], _ yShape: [Int],
                           _ body: (A, B) -> R) throws -> ([R], [Int]) {
    let shape = try broadcastShape([xShape, yShape])
    let count = elementCount(shape)
    if xShape == yShape {
        return (x.withUnsafeBufferPointer { xs in y.withUnsafeBufferPointer { ys in
            (0..<count).map { body(xs[$0], ys[$0]) } } }, shape)
    }
    if y.count == 1, elementCount(xShape) == count {
        let scalar = y[0]
        return (x.map { body($0, scalar) }, shape)
    }
    if x.count == 1, elementCount(yShape) == count {
        let scalar = x[0]
        return (y.map { body(scalar, $0) }, shape)
    }
    if let xa = affineIndex(from: xShape, to: shape), let ya = affineIndex(from: yShape, to: shape) {
        return (x.withUnsafeBufferPointer { xs in y.withUnsafeBufferPointer { ys in
            (0..<count).map { body(xs[($0 / xa.divisor) % xa.modulus], ys[($0 / ya.divisor) % ya.modulus]) } } }, shape)
    }
    let xIndex = broadcastIndices(from: xShape, to: shape)
    let yIndex = broadcastIndices(from: yShape, to: shape)
    return (x.withUnsafeBufferPointer { xs in y.withUnsafeBufferPointer { ys in
        (0..<count).map { body(xs[xIndex?[$0] ?? $0], ys[yIndex?[$0] ?? $0]) } } }, shape)
}

func floatBinary(_ f: @escaping (Float, Float) -> Float, int: ((Int32, Int32) throws -> Int32)? = nil) -> Kernel {
    { args in
        let x = try args.tensor("x"), y = try args.tensor("y")
        if let int = int, !x.type.isFloat, !y.type.isFloat {
            var failure: KernelError?
            let (values, shape) = try mapBroadcast(x.ints(), x.shape, y.ints(), y.shape) { a, b -> Int32 in
                do { return try int(a, b) } catch { failure = error as? KernelError; return 0 }
            }
            if let failure = failure { throw failure }
            return [.ints(values, shape: shape)]
        }
        let (values, shape) = try mapBroadcast(x.floats(), x.shape, y.floats(), y.shape, f)
        return [.floats(values, shape: shape)]
    }
}

/// An elementwise binary op known at compile time, so that its generic kernel is specialised
/// and the per-element call inlined (a stored closure would be an indirect call per element).
protocol BinaryArithmetic {
    static func apply(_ a: Float, _ b: Float) -> Float
    static func apply(_ a: Int32, _ b: Int32) -> Int32
}

enum Addition: BinaryArithmetic {
    @inline(__always) static func apply(_ a: Float, _ b: Float) -> Float { a + b }
    @inline(__always) static func apply(_ a: Int32, _ b: Int32) -> Int32 { a &+ b }
}

enum Subtraction: BinaryArithmetic {
    @inline(__always) static func apply(_ a: Float, _ b: Float) -> Float { a - b }
    @inline(__always) static func apply(_ a: Int32, _ b: Int32) -> Int32 { a &- b }
}

enum Multiplication: BinaryArithmetic {
    @inline(__always) static func apply(_ a: Float, _ b: Float) -> Float { a * b }
    @inline(__always) static func apply(_ a: Int32, _ b: Int32) -> Int32 { a &* b }
}

func arithmetic<Op: BinaryArithmetic>(_: Op.Type) -> Kernel {
    { args in
        let x = try args.tensor("x"), y = try args.tensor("y")
        if !x.type.isFloat, !y.type.isFloat {
            let (values, shape) = try mapBroadcast(x.ints(), x.shape, y.ints(), y.shape) { Op.apply($0, $1) }
            return [.ints(values, shape: shape)]
        }
        let (values, shape) = try mapBroadcast(x.floats(), x.shape, y.floats(), y.shape) { Op.apply($0, $1) }
        return [.floats(values, shape: shape)]
    }
}

func comparison(_ f: @escaping (Float, Float) -> Bool, int: @escaping (Int32, Int32) -> Bool) -> Kernel {
    { args in
        let x = try args.tensor("x"), y = try args.tensor("y")
        if !x.type.isFloat, !y.type.isFloat {
            let (values, shape) = try mapBroadcast(x.ints(), x.shape, y.ints(), y.shape, int)
            return [.bools(values, shape: shape)]
        }
        let (values, shape) = try mapBroadcast(x.floats(), x.shape, y.floats(), y.shape, f)
        return [.bools(values, shape: shape)]
    }
}

func logical(_ f: @escaping (Bool, Bool) -> Bool) -> Kernel {
    { args in
        let x = try args.tensor("x"), y = try args.tensor("y")
        let (values, shape) = try mapBroadcast(x.bools(), x.shape, y.bools(), y.shape, f)
        return [.bools(values, shape: shape)]
    }
}

func floatUnary(_ f: @escaping (Float) -> Float) -> Kernel {
    { args in
        let x = try args.tensor("x")
        return [.floats(x.floats().map(f), shape: x.shape)]
    }
}

/// Unary ops whose integer inputs stay integers (abs, sign, square, ...).
func numericUnary(_ f: @escaping (Float) -> Float, int: @escaping (Int32) -> Int32) -> Kernel {
    { args in
        let x = try args.tensor("x")
        if x.type.isInteger { return [.ints(x.ints().map(int), shape: x.shape)] }
        return [.floats(x.floats().map(f), shape: x.shape)]
    }
}

func withEpsilon(_ fallback: Float, _ f: @escaping (Float) -> Float) -> Kernel {
    { args in
        let x = try args.tensor("x")
        let epsilon = try args.float("epsilon", default: fallback)
        return [.floats(x.floats().map { f($0 + epsilon) }, shape: x.shape)]
    }
}

@inline(__always)
func sigmoid(_ x: Float) -> Float {
    // Split by sign so exp never overflows (the reference's formulation).
    let e = viaDouble(Foundation.exp, -Swift.abs(x))
    return x >= 0 ? 1 / (1 + e) : e / (1 + e)
}

func floorDivide(_ a: Int32, _ b: Int32) throws -> Int32 {
    guard b != 0 else { throw KernelError("integer division by zero") }
    let quotient = a / b
    return (a % b != 0 && ((a < 0) != (b < 0))) ? quotient - 1 : quotient
}

func floorModulo(_ a: Int32, _ b: Int32) throws -> Int32 {
    guard b != 0 else { throw KernelError("integer modulo by zero") }
    let remainder = a % b
    return (remainder != 0 && ((remainder < 0) != (b < 0))) ? remainder + b : remainder
}

func integerPower(_ a: Int32, _ b: Int32) throws -> Int32 {
    guard b >= 0 else { throw KernelError("integers to negative powers") }
    var result: Int32 = 1
    for _ in 0..<b { result = result &* a }
    return result
}

func floatPower(_ x: Float, _ y: Float) -> Float {
    // x * x is what float64 pow rounds to for y = 2 (the product is exact in float64).
    y == 2 ? x * x : Float(Foundation.pow(Double(x), Double(y)))
}

/// A transcendental function evaluated in float64 and rounded once to fp32, as the numpy
/// reference does: the correctly rounded value in all but a vanishing fraction of cases, so
/// the two interpreters agree whatever their math libraries.
@inline(__always)
func viaDouble(_ f: (Double) -> Double, _ x: Float) -> Float { Float(f(Double(x))) }

func floatModulo(_ x: Float, _ y: Float) -> Float {
    // numpy's mod: the result takes the divisor's sign.
    let remainder = Foundation.fmod(x, y)
    return (remainder != 0 && ((remainder < 0) != (y < 0))) ? remainder + y : remainder
}

func roundHalfAway(_ x: Float) -> Float {
    (x.sign == .minus ? -1 : 1) * Foundation.floor(Swift.abs(x) + 0.5)
}

func signOf(_ x: Float) -> Float { x > 0 ? 1 : (x < 0 ? -1 : x) }

let elementwiseKernels: [String: Kernel] = [
    "add": arithmetic(Addition.self),
    "sub": arithmetic(Subtraction.self),
    "mul": arithmetic(Multiplication.self),
    "real_div": floatBinary(/),
    "floor_div": floatBinary({ Foundation.floor($0 / $1) }, int: floorDivide),
    "mod": floatBinary(floatModulo, int: floorModulo),
    "pow": floatBinary(floatPower, int: integerPower),
    "maximum": floatBinary({ $0.isNaN || $1.isNaN ? .nan : Swift.max($0, $1) }, int: { Swift.max($0, $1) }),
    "minimum": floatBinary({ $0.isNaN || $1.isNaN ? .nan : Swift.min($0, $1) }, int: { Swift.min($0, $1) }),
    "equal": comparison(==, int: ==),
    "not_equal": comparison(!=, int: !=),
    "less": comparison(<, int: <),
    "less_equal": comparison(<=, int: <=),
    "greater": comparison(>, int: >),
    "greater_equal": comparison(>=, int: >=),
    "logical_and": logical { $0 && $1 },
    "logical_or": logical { $0 || $1 },
    "logical_xor": logical { $0 != $1 },
    "logical_not": { args in
        let x = try args.tensor("x")
        return [.bools(x.bools().map { !$0 }, shape: x.shape)]
    },
    "abs": numericUnary({ Swift.abs($0) }, int: { $0 == Int32.min ? $0 : Swift.abs($0) }),
    "sign": numericUnary(signOf, int: { $0.signum() }),
    "square": numericUnary({ $0 * $0 }, int: { $0 &* $0 }),
    "ceil": floatUnary { Foundation.ceil($0) },
    "floor": floatUnary { Foundation.floor($0) },
    "round": floatUnary(roundHalfAway),
    "sqrt": floatUnary { $0.squareRoot() },
    "exp": floatUnary { viaDouble(Foundation.exp, $0) },
    "exp2": floatUnary { viaDouble(Foundation.exp2, $0) },
    "sin": floatUnary { viaDouble(Foundation.sin, $0) },
    "cos": floatUnary { viaDouble(Foundation.cos, $0) },
    "tan": floatUnary { viaDouble(Foundation.tan, $0) },
    "tanh": floatUnary { viaDouble(Foundation.tanh, $0) },
    "relu": floatUnary { Swift.max($0, 0) },
    "sigmoid": floatUnary(sigmoid),
    "silu": floatUnary { $0 * sigmoid($0) },
    "softplus": floatUnary { x in viaDouble({ Swift.max($0, 0) + Foundation.log1p(Foundation.exp(-Swift.abs($0))) }, x) },
    "rsqrt": withEpsilon(1e-12) { 1 / $0.squareRoot() },
    "inverse": withEpsilon(1e-4) { 1 / $0 },
    "log": withEpsilon(Float.leastNonzeroMagnitude) { viaDouble(Foundation.log, $0) },
    "clip": { args in
        let x = try args.tensor("x")
        let alpha = try args.tensor("alpha").floats().first ?? -.infinity
        let beta = try args.tensor("beta").floats().first ?? .infinity
        return [.floats(x.floats().map { Swift.min(Swift.max($0, alpha), beta) }, shape: x.shape)]
    },
    "identity": { args in [try args.tensor("x")] },
    "cast": { args in
        // The declared output type does the conversion (float -> int truncates toward zero).
        let x = try args.tensor("x")
        if let name = try args.string("dtype"), ElementType(castName: name) == nil {
            throw KernelError("cast to \(name) is not supported")
        }
        return [x]
    },
    "select": { args in
        let condition = try args.tensor("cond"), a = try args.tensor("a"), b = try args.tensor("b")
        let shape = try broadcastShape([condition.shape, a.shape, b.shape])
        let count = elementCount(shape)
        let cIndex = broadcastIndices(from: condition.shape, to: shape)
        let aIndex = broadcastIndices(from: a.shape, to: shape)
        let bIndex = broadcastIndices(from: b.shape, to: shape)
        let flags = condition.bools()
        if !a.type.isFloat, !b.type.isFloat, a.type != .bool {
            let av = a.ints(), bv = b.ints()
            return [.ints((0..<count).map { flags[cIndex?[$0] ?? $0] ? av[aIndex?[$0] ?? $0] : bv[bIndex?[$0] ?? $0] }, shape: shape)]
        }
        if a.type == .bool, b.type == .bool {
            let av = a.bools(), bv = b.bools()
            return [.bools((0..<count).map { flags[cIndex?[$0] ?? $0] ? av[aIndex?[$0] ?? $0] : bv[bIndex?[$0] ?? $0] }, shape: shape)]
        }
        let av = a.floats(), bv = b.floats()
        return [.floats((0..<count).map { flags[cIndex?[$0] ?? $0] ? av[aIndex?[$0] ?? $0] : bv[bIndex?[$0] ?? $0] }, shape: shape)]
    },
]
