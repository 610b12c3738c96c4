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

/// `body` over two inputs broadcast to their common shape, one row of the output at a time
/// (see `BroadcastPlan`); the loop over a row is plain enough to vectorize.
@inline(__always)
func mapBroadcast<A, B, R>(_ x: [A], _ xShape: [Int], _ y: [B], _ yShape: [Int],
                           _ body: (A, B) -> R) throws -> ([R], [Int]) {
    let shape = try broadcastShape([xShape, yShape])
    let plan = BroadcastPlan(output: shape, inputs: [xShape, yShape])
    guard plan.count > 0 else { return ([], shape) }
    let length = plan.length
    let values = [R](unsafeUninitializedCapacity: plan.count) { buffer, initialized in
        x.withUnsafeBufferPointer { xs in
            y.withUnsafeBufferPointer { ys in
                let out = buffer.baseAddress!, xBase = xs.baseAddress!, yBase = ys.baseAddress!
                for row in 0..<plan.rows {
                    let o = out + row * length
                    let a = xBase + plan.offsets[2 * row], b = yBase + plan.offsets[2 * row + 1]
                    switch (plan.steps[0], plan.steps[1]) {
                    case (1, 1):
                        for t in 0..<length { (o + t).initialize(to: body(a[t], b[t])) }
                    case (1, _):
                        let bv = b[0]
                        for t in 0..<length { (o + t).initialize(to: body(a[t], bv)) }
                    case (_, 1):
                        let av = a[0]
                        for t in 0..<length { (o + t).initialize(to: body(av, b[t])) }
                    default:
                        let value = body(a[0], b[0])
                        for t in 0..<length { (o + t).initialize(to: value) }
                    }
                }
            }
        }
        initialized = plan.count
    }
    return (values, shape)
}

func floatBinary(_ f: @escaping (Float, Float) -> Float, int: ((Int32, Int32) throws -> Int32)? = nil) -> Kernel {
    { args in
        let x = try args.tensor("x"), y = try args.tensor("y")
        if let int = int, !x.type.isFloat, !y.type.isFloat {
            return [try integerBinary(x, y, int)]
        }
        let (values, shape) = try mapBroadcast(x.floats(), x.shape, y.floats(), y.shape, f)
        return [.floats(values, shape: shape)]
    }
}

/// An integer op that can fail (division by zero): the first failure is the op's error.
func integerBinary(_ x: Tensor, _ y: Tensor, _ int: (Int32, Int32) throws -> Int32) throws -> Tensor {
    var failure: KernelError?
    let (values, shape) = try mapBroadcast(x.ints(), x.shape, y.ints(), y.shape) { a, b -> Int32 in
        do { return try int(a, b) } catch { failure = failure ?? (error as? KernelError); return 0 }
    }
    if let failure = failure { throw failure }
    return .ints(values, shape: shape)
}

/// An elementwise binary op known at compile time, so that its generic kernel is specialised
/// and the per-element call inlined (a stored closure would be an indirect call per element).
protocol BinaryArithmetic {
    static func apply(_ a: Float, _ b: Float) -> Float
    /// Integer inputs: computed as integers by this, or (nil) as floats.
    static var integer: ((Int32, Int32) throws -> Int32)? { get }
}

enum Addition: BinaryArithmetic {
    @inline(__always) static func apply(_ a: Float, _ b: Float) -> Float { a + b }
    static var integer: ((Int32, Int32) throws -> Int32)? { { $0 &+ $1 } }
}

enum Subtraction: BinaryArithmetic {
    @inline(__always) static func apply(_ a: Float, _ b: Float) -> Float { a - b }
    static var integer: ((Int32, Int32) throws -> Int32)? { { $0 &- $1 } }
}

enum Multiplication: BinaryArithmetic {
    @inline(__always) static func apply(_ a: Float, _ b: Float) -> Float { a * b }
    static var integer: ((Int32, Int32) throws -> Int32)? { { $0 &* $1 } }
}

enum Division: BinaryArithmetic {
    @inline(__always) static func apply(_ a: Float, _ b: Float) -> Float { a / b }
    static var integer: ((Int32, Int32) throws -> Int32)? { nil }
}

enum Power: BinaryArithmetic {
    @inline(__always) static func apply(_ a: Float, _ b: Float) -> Float { floatPower(a, b) }
    static var integer: ((Int32, Int32) throws -> Int32)? { integerPower }
}

enum Maximum: BinaryArithmetic {
    @inline(__always) static func apply(_ a: Float, _ b: Float) -> Float { a.isNaN || b.isNaN ? .nan : Swift.max(a, b) }
    static var integer: ((Int32, Int32) throws -> Int32)? { { Swift.max($0, $1) } }
}

enum Minimum: BinaryArithmetic {
    @inline(__always) static func apply(_ a: Float, _ b: Float) -> Float { a.isNaN || b.isNaN ? .nan : Swift.min(a, b) }
    static var integer: ((Int32, Int32) throws -> Int32)? { { Swift.min($0, $1) } }
}

func arithmetic<Op: BinaryArithmetic>(_: Op.Type) -> Kernel {
    { args in
        let x = try args.tensor("x"), y = try args.tensor("y")
        if let int = Op.integer, !x.type.isFloat, !y.type.isFloat {
            return [try integerBinary(x, y, int)]
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

/// `f` at each of the 65536 fp16 values, computed on first use: for an fp16 input the result
/// is then one load instead of a float64 transcendental, and the same value, since the entry
/// is `f` of that very input.
final class HalfTable: @unchecked Sendable {
    private let f: (Float) -> Float
    private var built: UnsafeMutablePointer<Float>?
    private let lock = NSLock()

    init(_ f: @escaping (Float) -> Float) { self.f = f }

    /// The 65536 entries, built on first use.
    var table: UnsafePointer<Float> {
        lock.lock()
        defer { lock.unlock() }
        if let built = built { return UnsafePointer(built) }
        let made = UnsafeMutablePointer<Float>.allocate(capacity: 65536)
        for bits in 0..<65536 { made[bits] = f(Half.toFloat(UInt16(bits))) }
        built = made
        return UnsafePointer(made)
    }

    /// `f` of every element of an fp16 tensor. A value that is not exactly an fp16 (which an
    /// fp16 tensor should not hold), or a NaN with its payload, is computed directly.
    func map(_ tensor: Tensor) -> [Float] {
        let table = self.table
        if case .half(let storage) = tensor.data { return storage.values.map { table[Int($0)] } }
        let values = tensor.floats()
        let count = values.count
        guard count > 0 else { return [] }
        // Two plain loops: the fp16 bits of every value (and whether each is exact), then the
        // look-ups.
        let keys = UnsafeMutablePointer<UInt16>.allocate(capacity: count)
        defer { keys.deallocate() }
        let exact = values.withUnsafeBufferPointer { source -> Bool in
            var mismatch: UInt32 = 0
            for index in 0..<count {
                let bits = halfBits(source[index])
                keys[index] = bits
                mismatch |= Half.toFloat(bits).bitPattern ^ source[index].bitPattern
            }
            return mismatch == 0
        }
        if exact {
            return [Float](unsafeUninitializedCapacity: count) { buffer, initialized in
                for index in 0..<count { buffer[index] = table[Int(keys[index])] }
                initialized = count
            }
        }
        return values.map { lookUp($0, in: table) }
    }

    /// `f(value)`: from the table when `value` is exactly an fp16 (see `map`).
    @inline(__always)
    func lookUp(_ value: Float, in table: UnsafePointer<Float>) -> Float {
        let bits = halfBits(value)
        return Half.toFloat(bits).bitPattern == value.bitPattern ? table[Int(bits)] : f(value)
    }
}

/// The fp16 nearest `value` (exact when `value` is an fp16).
@inline(__always)
func halfBits(_ value: Float) -> UInt16 {
    #if MILINTERPRETER_HASWELL
    return Float16(value).bitPattern
    #else
    return Half.fromFloat(value)
    #endif
}

/// exp in float64 rounded to fp32, as the exp op and softmax compute it; tabulated.
let expTable = HalfTable { viaDouble(Foundation.exp, $0) }

/// A unary float op that is costly per element (float64 transcendentals): fp16 inputs of some
/// size read a `HalfTable`, others compute.
func tabulatedUnary(_ f: @escaping (Float) -> Float) -> Kernel {
    tabulatedUnary(HalfTable(f), f)
}

func tabulatedUnary(_ table: HalfTable, _ f: @escaping (Float) -> Float) -> Kernel {
    { args in
        let x = try args.tensor("x")
        if x.type == .float16, x.count >= 1024 {
            return [.floats(table.map(x), shape: x.shape)]
        }
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

/// `flags ? a : b` elementwise, broadcast by `plan`.
func choose<T>(_ plan: BroadcastPlan, _ flags: [Bool], _ a: [T], _ b: [T]) -> [T] {
    guard plan.count > 0 else { return [] }
    let length = plan.length
    let (fs, asStep, bs) = (plan.steps[0], plan.steps[1], plan.steps[2])
    return [T](unsafeUninitializedCapacity: plan.count) { buffer, initialized in
        flags.withUnsafeBufferPointer { fp in
            a.withUnsafeBufferPointer { ap in
                b.withUnsafeBufferPointer { bp in
                    for row in 0..<plan.rows {
                        let o = buffer.baseAddress! + row * length
                        let f = fp.baseAddress! + plan.offsets[3 * row]
                        let x = ap.baseAddress! + plan.offsets[3 * row + 1], y = bp.baseAddress! + plan.offsets[3 * row + 2]
                        if fs == 1, asStep == 1, bs == 1 {
                            for t in 0..<length { (o + t).initialize(to: f[t] ? x[t] : y[t]) }
                        } else {
                            for t in 0..<length { (o + t).initialize(to: f[t * fs] ? x[t * asStep] : y[t * bs]) }
                        }
                    }
                }
            }
        }
        initialized = plan.count
    }
}

/// `choose` for float values, as bit masks: a Bool is stored as the byte 0 or 1, so
/// `0 - flag` is all zeros or all ones, and the chosen value's bits are copied whole. A plain
/// loop of loads, masks and stores that vectorizes, where the branch on each flag does not.
func chooseFloats(_ plan: BroadcastPlan, _ flags: [Bool], _ a: [Float], _ b: [Float]) -> [Float] {
    guard plan.count > 0 else { return [] }
    let (fs, asStep, bs) = (plan.steps[0], plan.steps[1], plan.steps[2])
    guard fs == 1, asStep == 1, bs == 1 else { return choose(plan, flags, a, b) }
    let length = plan.length
    return [Float](unsafeUninitializedCapacity: plan.count) { buffer, initialized in
        flags.withUnsafeBufferPointer { fp in
            a.withUnsafeBufferPointer { ap in
                b.withUnsafeBufferPointer { bp in
                    let flagBytes = UnsafeRawPointer(fp.baseAddress!).assumingMemoryBound(to: UInt8.self)
                    let aBits = UnsafeRawPointer(ap.baseAddress!).assumingMemoryBound(to: UInt32.self)
                    let bBits = UnsafeRawPointer(bp.baseAddress!).assumingMemoryBound(to: UInt32.self)
                    let out = UnsafeMutableRawPointer(buffer.baseAddress!).assumingMemoryBound(to: UInt32.self)
                    for row in 0..<plan.rows {
                        let o = out + row &* length
                        let f = flagBytes + plan.offsets[3 &* row]
                        let x = aBits + plan.offsets[3 &* row &+ 1], y = bBits + plan.offsets[3 &* row &+ 2]
                        for t in 0..<length {
                            let mask = UInt32(0) &- UInt32(f[t])
                            o[t] = (x[t] & mask) | (y[t] & ~mask)
                        }
                    }
                }
            }
        }
        initialized = plan.count
    }
}

let elementwiseKernels: [String: Kernel] = [
    "add": arithmetic(Addition.self),
    "sub": arithmetic(Subtraction.self),
    "mul": arithmetic(Multiplication.self),
    "real_div": arithmetic(Division.self),
    "floor_div": floatBinary({ Foundation.floor($0 / $1) }, int: floorDivide),
    "mod": floatBinary(floatModulo, int: floorModulo),
    "pow": arithmetic(Power.self),
    "maximum": arithmetic(Maximum.self),
    "minimum": arithmetic(Minimum.self),
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
    "exp": tabulatedUnary(expTable) { viaDouble(Foundation.exp, $0) },
    "exp2": tabulatedUnary { viaDouble(Foundation.exp2, $0) },
    "sin": tabulatedUnary { viaDouble(Foundation.sin, $0) },
    "cos": tabulatedUnary { viaDouble(Foundation.cos, $0) },
    "tan": tabulatedUnary { viaDouble(Foundation.tan, $0) },
    "tanh": tabulatedUnary { viaDouble(Foundation.tanh, $0) },
    "relu": floatUnary { Swift.max($0, 0) },
    "sigmoid": tabulatedUnary(sigmoid),
    "silu": tabulatedUnary { $0 * sigmoid($0) },
    "softplus": tabulatedUnary { x in viaDouble({ Swift.max($0, 0) + Foundation.log1p(Foundation.exp(-Swift.abs($0))) }, x) },
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
        let plan = BroadcastPlan(output: shape, inputs: [condition.shape, a.shape, b.shape])
        let flags = condition.bools()
        if !a.type.isFloat, !b.type.isFloat, a.type != .bool {
            return [.ints(choose(plan, flags, a.ints(), b.ints()), shape: shape)]
        }
        if a.type == .bool, b.type == .bool {
            return [.bools(choose(plan, flags, a.bools(), b.bools()), shape: shape)]
        }
        return [.floats(chooseFloats(plan, flags, a.floats(), b.floats()), shape: shape)]
    },
]
