/// Entry points for the kernels' unit tests (swift/Tests/MuseflashRuntimeTests/KernelTests.swift),
/// outside the public API: `@_spi(Testing) import MILInterpreter`.

/// Runs one op type's kernel (or constexpr decompression) on the given tensors (each parameter
/// a list, as MIL binds them) and stores each result in its type as `CompiledFunction.run` does.
@_spi(Testing)
public func runKernel(_ type: String, _ inputs: [String: [Tensor]], outputTypes: [ElementType]) throws -> [Tensor] {
    guard let kernel = kernels[type] ?? decompressors[type] else {
        throw InterpreterError.unsupportedOps(function: "runKernel", ops: [type])
    }
    let arguments = inputs.mapValues { $0.map { ArgumentItem.value($0) } }
    do {
        var results = try kernel(OpArguments(arguments: arguments, frame: Frame(count: 0), states: nil, outputTypes: outputTypes))
        for index in results.indices where index < outputTypes.count { results[index].convert(to: outputTypes[index]) }
        return results
    } catch let error as KernelError {
        throw InterpreterError.opFailed(function: "runKernel", op: type, reason: error.reason)
    }
}

extension HalfStorage {
    /// fp16 values held as a weight file's are: read in place, never widened to a copy.
    @_spi(Testing)
    public convenience init(fp16Bits bits: [UInt16]) {
        self.init(bits: bits)
    }
}

extension CompiledFunction {
    /// How many of the function's `slice_update`s write their `x` in place, and how many of
    /// those take a state's value from the store (CompiledFunction.planInPlaceUpdates).
    @_spi(Testing)
    public var inPlaceWrites: (total: Int, fromState: Int) {
        (operations.filter { $0.consumesX != nil }.count, operations.filter { $0.consumesState != nil }.count)
    }
}

extension Tensor {
    /// Where a float tensor's elements live (nil for other kinds): equal before and after a
    /// call when the call updated the value in place instead of copying it.
    @_spi(Testing)
    public var floatStorageAddress: Int? {
        guard case .float(let values) = data else { return nil }
        return values.withUnsafeBufferPointer { $0.baseAddress.map { Int(bitPattern: $0) } }
    }
}
