import MLPackage

/// Shape questions asked of spec features, where a flexible input is
/// described by a default shape plus either size ranges or a list of shapes.
extension MultiArrayType {
    /// Every shape the feature accepts at `axis` (counted from the end when
    /// negative) admits `size`.
    func admits(size: Int64, atAxis axis: Int) -> Bool {
        if let shapes = enumeratedShapes, !shapes.isEmpty {
            return shapes.contains { Self.dimension(of: $0, axis: axis) == size }
        }
        if let ranges = shapeRange, let index = Self.index(axis, count: ranges.count) {
            let range = ranges[index]
            return size >= 0 && UInt64(size) >= range.lowerBound && (range.isUnbounded || size <= range.upperBound)
        }
        return Self.dimension(of: shape, axis: axis) == size
    }

    /// The size at `axis` if every accepted shape agrees on it, else nil.
    func fixedDimension(atAxis axis: Int) -> Int64? {
        if let shapes = enumeratedShapes, !shapes.isEmpty {
            let sizes = Set(shapes.map { Self.dimension(of: $0, axis: axis) })
            return sizes.count == 1 ? sizes.first! : nil
        }
        if let ranges = shapeRange, let index = Self.index(axis, count: ranges.count) {
            let range = ranges[index]
            guard !range.isUnbounded, range.lowerBound == UInt64(clamping: range.upperBound) else { return nil }
            return range.upperBound
        }
        return Self.dimension(of: shape, axis: axis)
    }

    private static func index(_ axis: Int, count: Int) -> Int? {
        let index = axis < 0 ? count + axis : axis
        return index >= 0 && index < count ? index : nil
    }

    private static func dimension(of shape: [Int64], axis: Int) -> Int64? {
        index(axis, count: shape.count).map { shape[$0] }
    }
}

/// `[layers, kv_heads, capacity, head_dim]` from a KV state shape that may be
/// preceded by 1s, or nil if the shape is not of that form.
func kvDimensions<Size: BinaryInteger>(_ shape: [Size]) -> [Size]? {
    guard shape.count >= 4, shape.dropLast(4).allSatisfy({ $0 == 1 }) else { return nil }
    return Array(shape.suffix(4))
}

func describe(_ shape: [Int64]) -> String {
    "[" + shape.map(String.init).joined(separator: ", ") + "]"
}

func describe(_ type: FeatureType) -> String {
    switch type {
    case .multiArray(let array): return describe(array)
    case .state(let array?): return "state " + describe(array)
    case .state(nil): return "state (no array type)"
    case .int64: return "int64"
    case .double: return "double"
    case .string: return "string"
    case .image: return "image"
    case .dictionary: return "dictionary"
    case .sequence: return "sequence"
    case .unknown(let number?): return "unknown type (field \(number))"
    case .unknown(nil): return "no type"
    }
}

func describe(_ array: MultiArrayType) -> String {
    var text = "\(array.dataType.shortName) \(describe(array.shape))"
    if let ranges = array.shapeRange, !ranges.isEmpty {
        text += " ranges " + ranges.map { "\($0.lowerBound)...\($0.isUnbounded ? "inf" : String($0.upperBound))" }
            .joined(separator: "x")
    }
    if let shapes = array.enumeratedShapes, !shapes.isEmpty {
        text += " one of " + shapes.map(describe).joined(separator: " ")
    }
    return text
}

extension ArrayDataType {
    var shortName: String {
        switch self {
        case .float16: return "fp16"
        case .float32: return "fp32"
        case .double: return "fp64"
        case .int32: return "int32"
        case .int8: return "int8"
        case .invalid: return "invalid-dtype"
        case .unrecognized(let raw): return "dtype(\(raw))"
        }
    }
}
