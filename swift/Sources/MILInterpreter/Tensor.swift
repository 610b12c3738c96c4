import MLPackage

/// The element type a tensor is declared with. Values are computed in fp32 (floats) or int32
/// (integers) and stored back in the declared type after every op, as the numpy reference
/// interpreter does (python/museflash/runtime/interpreter.py): an fp16 tensor holds only
/// fp16-representable values, an int16 one only values that fit, wrapping like a C cast.
public enum ElementType: Sendable, Hashable, CustomStringConvertible {
    case float16, float32
    case int32, int16, uint16, int8, uint8, int4, uint4, uint1, uint2, uint3, uint6, int64, uint32
    case bool, string

    public init?(_ type: MILDataType) {
        switch type {
        case .float16: self = .float16
        case .float32, .float64: self = .float32
        case .int32: self = .int32
        case .int16: self = .int16
        case .uint16: self = .uint16
        case .int8: self = .int8
        case .uint8: self = .uint8
        case .int4: self = .int4
        case .uint4: self = .uint4
        case .uint1: self = .uint1
        case .uint2: self = .uint2
        case .uint3: self = .uint3
        case .uint6: self = .uint6
        case .int64: self = .int64
        case .uint32: self = .uint32
        case .bool: self = .bool
        case .string: self = .string
        default: return nil
        }
    }

    /// MIL's dtype spelling, as `cast` names its target (`fp16`, `int32`, ...).
    public init?(castName: String) {
        switch castName {
        case "fp16": self = .float16
        case "fp32", "fp64": self = .float32
        case "int32": self = .int32
        case "int16": self = .int16
        case "uint16": self = .uint16
        case "int8": self = .int8
        case "uint8": self = .uint8
        case "int64": self = .int64
        case "uint32": self = .uint32
        case "bool": self = .bool
        default: return nil
        }
    }

    public var isFloat: Bool { self == .float16 || self == .float32 }
    public var isInteger: Bool { !isFloat && self != .bool && self != .string }

    public var description: String {
        switch self {
        case .float16: return "fp16"
        case .float32: return "fp32"
        case .int32: return "int32"
        case .int16: return "int16"
        case .uint16: return "uint16"
        case .int8: return "int8"
        case .uint8: return "uint8"
        case .int4: return "int4"
        case .uint4: return "uint4"
        case .uint1: return "uint1"
        case .uint2: return "uint2"
        case .uint3: return "uint3"
        case .uint6: return "uint6"
        case .int64: return "int64"
        case .uint32: return "uint32"
        case .bool: return "bool"
        case .string: return "string"
        }
    }

    /// An integer stored in this type, wrapped as a C cast would (int32 storage).
    @inline(__always)
    func wrap(_ value: Int32) -> Int32 {
        switch self {
        case .int16: return Int32(Int16(truncatingIfNeeded: value))
        case .uint16: return Int32(UInt16(truncatingIfNeeded: value))
        case .int8: return Int32(Int8(truncatingIfNeeded: value))
        case .uint8: return Int32(UInt8(truncatingIfNeeded: value))
        default: return value
        }
    }
}

/// fp16 values that are read, never written: weights inside a mapped weight file (no copy), or
/// an owned array of bit patterns.
public final class HalfStorage: @unchecked Sendable {
    public let values: UnsafeBufferPointer<UInt16>
    /// Keeps the mapping alive; nil when `values` is an allocation of this object's own.
    private let owner: AnyObject?

    init(mapped values: UnsafeBufferPointer<UInt16>, owner: AnyObject) {
        self.values = values
        self.owner = owner
    }

    init(bits: [UInt16]) {
        let buffer = UnsafeMutableBufferPointer<UInt16>.allocate(capacity: bits.count)
        _ = buffer.initialize(from: bits)
        self.values = UnsafeBufferPointer(buffer)
        self.owner = nil
    }

    deinit {
        if owner == nil { values.deallocate() }
    }
}

public enum TensorData: @unchecked Sendable {
    /// Float values (already rounded to fp16 when the tensor is declared fp16).
    case float([Float])
    /// fp16 weights, read in place.
    case half(HalfStorage)
    /// Every integer type, as int32 values that fit the declared type.
    case int([Int32])
    case bool([Bool])
    case string([String])
}

public struct Tensor: @unchecked Sendable {
    public var shape: [Int]
    public var type: ElementType
    public var data: TensorData

    public init(shape: [Int], type: ElementType, data: TensorData) {
        self.shape = shape
        self.type = type
        self.data = data
    }

    public static func floats(_ values: [Float], shape: [Int], type: ElementType = .float32) -> Tensor {
        Tensor(shape: shape, type: type, data: .float(values))
    }

    public static func ints(_ values: [Int32], shape: [Int], type: ElementType = .int32) -> Tensor {
        Tensor(shape: shape, type: type, data: .int(values))
    }

    public static func bools(_ values: [Bool], shape: [Int]) -> Tensor {
        Tensor(shape: shape, type: .bool, data: .bool(values))
    }

    /// No inf or NaN among its values (always true for integer, bool and string tensors).
    public var isFinite: Bool {
        switch data {
        case .float(let values): return values.withUnsafeBufferPointer(Tensor.allFinite)
        case .half(let storage): return !storage.values.contains { $0 & 0x7C00 == 0x7C00 }
        default: return true
        }
    }

    /// No inf or NaN among `values`: the largest exponent field of each block of 1024, a
    /// loop without a branch that vectorizes, where `contains` tests one element at a time.
    /// Every op's result is checked, so this runs over every value computed.
    static func allFinite(_ values: UnsafeBufferPointer<Float>) -> Bool {
        var start = 0
        while start < values.count {
            let end = Swift.min(start &+ 1024, values.count)
            var exponents: UInt32 = 0
            for index in start..<end { exponents = Swift.max(exponents, values[index].bitPattern & 0x7F80_0000) }
            if exponents == 0x7F80_0000 { return false }
            start = end
        }
        return true
    }

    /// A state's stand-in while an in-place write holds its value (CompiledFunction.run): the
    /// shape and type, no elements.
    var isHusk: Bool {
        guard count > 0 else { return false }
        switch data {
        case .float(let values): return values.isEmpty
        default: return false
        }
    }

    /// The float values, moved out: when this tensor held the only reference to them, mutating
    /// the result copies nothing. The tensor is left without elements.
    mutating func takeFloats() -> [Float] {
        guard case .float(let values) = data else { return floats() }
        data = .bool([])
        return values
    }

    /// As `takeFloats`, for integer tensors.
    mutating func takeInts() -> [Int32] {
        guard case .int(let values) = data else { return ints() }
        data = .bool([])
        return values
    }

    /// As `takeFloats`, for bool tensors.
    mutating func takeBools() -> [Bool] {
        guard case .bool(let values) = data else { return bools() }
        data = .int([])
        return values
    }

    public var rank: Int { shape.count }
    public var count: Int { shape.reduce(1, *) }

    /// The values as fp32 (integers and bools converted; fp16 weights widened).
    public func floats() -> [Float] {
        switch data {
        case .float(let values): return values
        case .half(let storage):
            let source = storage.values
            return [Float](unsafeUninitializedCapacity: source.count) { buffer, initialized in
                if let from = source.baseAddress, let to = buffer.baseAddress { Half.widen(from, into: to, count: source.count) }
                initialized = source.count
            }
        case .int(let values): return values.map { Float($0) }
        case .bool(let values): return values.map { $0 ? 1 : 0 }
        case .string: return []
        }
    }

    /// The values as int32 (floats truncated toward zero, bools 0 or 1).
    public func ints() -> [Int32] {
        switch data {
        case .int(let values): return values
        case .bool(let values): return values.map { $0 ? 1 : 0 }
        case .float(let values): return values.map { Tensor.truncate($0) }
        case .half(let storage): return storage.values.map { Tensor.truncate(Half.toFloat($0)) }
        case .string: return []
        }
    }

    public func bools() -> [Bool] {
        switch data {
        case .bool(let values): return values
        case .int(let values): return values.map { $0 != 0 }
        case .float(let values): return values.map { $0 != 0 }
        case .half(let storage): return storage.values.map { Half.toFloat($0) != 0 }
        case .string: return []
        }
    }

    public var strings: [String]? {
        if case .string(let values) = data { return values }
        return nil
    }

    @inline(__always)
    static func truncate(_ value: Float) -> Int32 {
        guard value.isFinite else { return Int32.min }
        if value >= 2_147_483_648 || value < -2_147_483_648 { return Int32.min }
        return Int32(value.rounded(.towardZero))
    }

    /// `converted(to:)` in place: an fp32 result becoming fp16 is rounded in its own buffer
    /// instead of a copy (the common case of every fp16 op's output).
    public mutating func convert(to target: ElementType) {
        if target == .float16, type != .float16, case .float(var values) = data {
            data = .bool([])  // drop the enum's reference, so `values` is unique
            Half.roundInPlace(&values)
            data = .float(values)
            type = .float16
            return
        }
        self = converted(to: target)
    }

    /// This tensor stored as `type`: the conversion every op's output goes through.
    public func converted(to target: ElementType) -> Tensor {
        switch target {
        case .float16:
            if type == .float16 { return self }
            if case .half = data { return Tensor(shape: shape, type: .float16, data: data) }
            var values = floats()
            Half.roundInPlace(&values)
            return Tensor(shape: shape, type: .float16, data: .float(values))
        case .float32:
            if case .float = data { return Tensor(shape: shape, type: .float32, data: data) }
            return Tensor(shape: shape, type: .float32, data: .float(floats()))
        case .bool:
            if case .bool = data { return self }
            return Tensor(shape: shape, type: .bool, data: .bool(bools()))
        case .string:
            return Tensor(shape: shape, type: .string, data: data)
        default:
            if type == target, case .int = data { return self }
            let values = ints()
            if target == .int32 || target == .int64 || target == .uint32 {
                return Tensor(shape: shape, type: target, data: .int(values))
            }
            return Tensor(shape: shape, type: target, data: .int(values.map { target.wrap($0) }))
        }
    }
}

extension Tensor: CustomStringConvertible {
    public var description: String { "\(type)\(shape)" }
}
