/// A named input or output of a function call as the engine sees it: a shape and row-major
/// int32 or fp32 scalars. fp16 outputs arrive as fp32 values that are exactly representable in
/// fp16; fp16 inputs are rounded to fp16 by the backend, as Core ML would store them.
public struct ShapedArray: Sendable, Equatable {
    public enum Scalars: Sendable, Equatable {
        case int32([Int32])
        case float([Float])
    }

    public var shape: [Int]
    public var scalars: Scalars

    public init(shape: [Int], scalars: Scalars) {
        self.shape = shape
        self.scalars = scalars
    }

    public init(int32 values: [Int32], shape: [Int]) {
        self.init(shape: shape, scalars: .int32(values))
    }

    public init(float values: [Float], shape: [Int]) {
        self.init(shape: shape, scalars: .float(values))
    }

    public var count: Int { shape.reduce(1, *) }

    public var floats: [Float] {
        switch scalars {
        case .float(let values): return values
        case .int32(let values): return values.map(Float.init)
        }
    }

    public var int32s: [Int32] {
        switch scalars {
        case .int32(let values): return values
        case .float(let values): return values.map { Int32($0) }
        }
    }
}
