import Foundation
import MILInterpreter

/// A multi-array that owns its bytes, in one of three layouts: contiguous first-major (what
/// `init(shape:dataType:)` makes, as Apple's header says), padded (every row of the last axis
/// followed by a gap: what predictions return) or spread (padded, and every scalar followed by
/// a gap too: what `withUnsafeMutableBytes` may switch a contiguous array to). Offsets are `sum(index[d] * strides[d])` scalars.
@available(macOS 10.13, iOS 11.0, *)
public final class MLMultiArray: @unchecked Sendable {
    @available(macOS 10.13, iOS 11.0, *)
    public let shape: [NSNumber]
    @available(macOS 10.13, iOS 11.0, *)
    public private(set) var strides: [NSNumber]
    @available(macOS 10.13, iOS 11.0, *)
    public let dataType: MLMultiArrayDataType
    @available(macOS 10.13, iOS 11.0, *)
    public var count: Int { shape.reduce(1) { $0 * $1.intValue } }

    private var storage: [UInt8]
    enum Layout { case contiguous, padded, spread }
    private var layout: Layout

    /// Scalars a padded layout leaves after each row of the last axis.
    static let rowGap = 5

    /// Contents uninitialised per Apple's documentation: NaN here (`MLMultiArrayDataType.poison`).
    @available(macOS 10.13, iOS 11.0, *)
    public init(shape: [NSNumber], dataType: MLMultiArrayDataType) throws {
        guard shape.allSatisfy({ $0.intValue >= 0 }) else { throw MLStandInError("MLMultiArray shape \(shape) has a negative size") }
        self.shape = shape
        self.dataType = dataType
        layout = .contiguous
        let strides = Self.strides(shape.map(\.intValue), layout: .contiguous)
        self.strides = strides.map { NSNumber(value: $0) }
        storage = Self.poisoned(Self.span(shape.map(\.intValue), strides), dataType)
    }

    /// A NaN-filled array in the padded layout, as prediction outputs come.
    static func padded(shape: [Int], dataType: MLMultiArrayDataType) -> MLMultiArray {
        let array = try! MLMultiArray(shape: shape.map { NSNumber(value: $0) }, dataType: dataType)
        array.relayout(.padded)
        return array
    }

    static func strides(_ shape: [Int], layout: Layout) -> [Int] {
        var strides = [Int](repeating: 1, count: shape.count)
        var running = layout == .spread ? 2 : 1
        let padded = layout != .contiguous
        for axis in stride(from: shape.count - 1, through: 0, by: -1) {
            strides[axis] = running
            running *= shape[axis]
            if padded, axis == shape.count - 1, shape.count > 1 { running += rowGap }
        }
        return strides
    }

    /// Scalars from the first element to one past the last.
    static func span(_ shape: [Int], _ strides: [Int]) -> Int {
        guard !shape.contains(0) else { return 0 }
        return zip(shape, strides).reduce(1) { $0 + ($1.0 - 1) * $1.1 }
    }

    static func poisoned(_ scalars: Int, _ type: MLMultiArrayDataType) -> [UInt8] {
        let pattern = type.poison
        return [UInt8](unsafeUninitializedCapacity: scalars * pattern.count) { bytes, initialized in
            for scalar in 0..<scalars {
                for (index, byte) in pattern.enumerated() { bytes[scalar * pattern.count + index] = byte }
            }
            initialized = scalars * pattern.count
        }
    }

    /// Byte offset of every element in row-major order.
    func byteOffsets() -> [Int] {
        let width = dataType.byteWidth
        var offsets = [Int](repeating: 0, count: count)
        offsets.withUnsafeMutableBufferPointer { offsets in
            forEachOffset(shape: shape.map(\.intValue), strides: strides.map(\.intValue)) { index, offset in
                offsets[index] = offset * width
            }
        }
        return offsets
    }

    @available(macOS 12.3, iOS 15.4, *)
    public func withUnsafeBytes<R>(_ body: (UnsafeRawBufferPointer) throws -> R) rethrows -> R {
        try storage.withUnsafeBytes(body)
    }

    /// Switches layout first (contiguous to spread, any other to contiguous; values kept, gaps
    /// NaN), as Apple allows: the strides handed to `body` are the new ones, and `strides` reads
    /// them afterwards. A spread backing has no unit stride, so even a [1, n] array written at
    /// the strides it had before the call comes out wrong.
    @available(macOS 12.3, iOS 15.4, *)
    public func withUnsafeMutableBytes<R>(_ body: (UnsafeMutableRawBufferPointer, [Int]) throws -> R) rethrows -> R {
        relayout(layout == .contiguous ? .spread : .contiguous)
        let strides = self.strides.map(\.intValue)
        return try storage.withUnsafeMutableBytes { try body($0, strides) }
    }

    /// The storage in its current layout, without switching (the stand-in's own writes).
    func writeStorage(_ body: (UnsafeMutableRawBufferPointer) -> Void) {
        storage.withUnsafeMutableBytes(body)
    }

    private func relayout(_ layout: Layout) {
        let shape = self.shape.map(\.intValue)
        let from = byteOffsets(), width = dataType.byteWidth
        let strides = Self.strides(shape, layout: layout)
        var bytes = Self.poisoned(Self.span(shape, strides), dataType)
        let old = storage
        self.layout = layout
        self.strides = strides.map { NSNumber(value: $0) }
        for (source, target) in zip(from, byteOffsets()) {
            for byte in 0..<width { bytes[target + byte] = old[source + byte] }
        }
        storage = bytes
    }
}
