/// The parts of an ML program (`Model.mlProgram`, MIL.proto) that say how its weights are
/// stored: functions, their block specializations, and each operation's type, inputs (bound by
/// name or given inline), outputs and attributes. Values are kept as their type and where they
/// live (a blob of a weight file, or inline); inline tensor contents are decoded
/// (`MILValue.immediateTensor`), blob contents are read only by whoever needs them.
public struct MLProgram: Sendable, Equatable {
    public var version: Int64
    /// In file order. Program.functions is a map: a repeated name keeps its first position and
    /// its last value.
    public var functions: [MILFunction]

    public init(version: Int64 = 0, functions: [MILFunction] = []) {
        self.version = version
        self.functions = functions
    }

    public func function(named name: String) -> MILFunction? {
        functions.first { $0.name == name }
    }
}

public struct MILFunction: Sendable, Equatable {
    /// The key of Program.functions.
    public var name: String
    public var inputs: [MILNamedValueType]
    /// The opset Core ML runs, which names one of `blockSpecializations` (e.g. `CoreML8`).
    public var opset: String
    /// Opset name -> block, in file order.
    public var blockSpecializations: [MILBlockSpecialization]

    public init(name: String = "", inputs: [MILNamedValueType] = [], opset: String = "",
                blockSpecializations: [MILBlockSpecialization] = []) {
        self.name = name
        self.inputs = inputs
        self.opset = opset
        self.blockSpecializations = blockSpecializations
    }

    /// The block of the function's own opset, or nil when the function has none.
    public var block: MILBlock? {
        blockSpecializations.first { $0.opset == opset }?.block
    }
}

public struct MILBlockSpecialization: Sendable, Equatable {
    public var opset: String
    public var block: MILBlock

    public init(opset: String, block: MILBlock) {
        self.opset = opset
        self.block = block
    }
}

public struct MILBlock: Sendable, Equatable {
    public var inputs: [MILNamedValueType]
    public var outputs: [String]
    public var operations: [MILOperation]

    public init(inputs: [MILNamedValueType] = [], outputs: [String] = [], operations: [MILOperation] = []) {
        self.inputs = inputs
        self.outputs = outputs
        self.operations = operations
    }

    /// Every operation of the block and of the blocks nested in its operations (control flow),
    /// depth first in file order.
    public var allOperations: [MILOperation] {
        var result: [MILOperation] = []
        var pending: [ArraySlice<MILOperation>] = [operations[...]]
        while var slice = pending.popLast() {
            guard let operation = slice.popFirst() else { continue }
            result.append(operation)
            pending.append(slice)
            for block in operation.blocks.reversed() {
                pending.append(block.operations[...])
            }
        }
        return result
    }
}

public struct MILOperation: Sendable, Equatable {
    public var type: String
    /// Parameter name -> its arguments, in file order (Operation.inputs is a map; a repeated
    /// name keeps its first position and its last value).
    public var inputs: [MILInput]
    public var outputs: [MILNamedValueType]
    public var blocks: [MILBlock]
    /// Attribute name -> value; a const op's value is under `val`.
    public var attributes: [String: MILValue]

    public init(type: String = "", inputs: [MILInput] = [], outputs: [MILNamedValueType] = [],
                blocks: [MILBlock] = [], attributes: [String: MILValue] = [:]) {
        self.type = type
        self.inputs = inputs
        self.outputs = outputs
        self.blocks = blocks
        self.attributes = attributes
    }

    public func input(named name: String) -> [MILBinding]? {
        inputs.first { $0.name == name }?.arguments
    }
}

public struct MILInput: Sendable, Equatable {
    public var name: String
    public var arguments: [MILBinding]

    public init(name: String, arguments: [MILBinding]) {
        self.name = name
        self.arguments = arguments
    }
}

/// One argument: another value's name, or a value given inline (`Argument.Binding` oneof).
public enum MILBinding: Sendable, Equatable {
    case name(String)
    case value(MILValue)
    /// Neither member was set.
    case unset

    public var value: MILValue? {
        if case .value(let value) = self { return value }
        return nil
    }
}

public struct MILNamedValueType: Sendable, Equatable {
    public var name: String
    public var type: MILValueType?

    public init(name: String, type: MILValueType? = nil) {
        self.name = name
        self.type = type
    }

    public var tensorType: MILTensorType? { type?.tensorType }
}

public enum MILValueType: Sendable, Equatable {
    case tensor(MILTensorType)
    /// `StateType` wrapping a tensor type (a function input that is a Core ML state).
    case state(MILTensorType)
    /// A list, tuple or dictionary type (its `ValueType` field number), a state that wraps no
    /// tensor, or a member this reader does not know.
    case other(fieldNumber: Int)

    public var tensorType: MILTensorType? {
        if case .tensor(let tensor) = self { return tensor }
        return nil
    }

    /// The wrapped tensor type of a state.
    public var stateTensorType: MILTensorType? {
        if case .state(let tensor) = self { return tensor }
        return nil
    }
}

public struct MILTensorType: Sendable, Equatable {
    public var dataType: MILDataType
    public var rank: Int64
    public var dimensions: [MILDimension]

    public init(dataType: MILDataType = .unused, rank: Int64 = 0, dimensions: [MILDimension] = []) {
        self.dataType = dataType
        self.rank = rank
        self.dimensions = dimensions
    }

    /// The sizes when every dimension is a constant, else nil.
    public var shape: [UInt64]? {
        var sizes: [UInt64] = []
        for dimension in dimensions {
            guard case .constant(let size) = dimension else { return nil }
            sizes.append(size)
        }
        return sizes
    }

    /// Elements of a tensor of constant shape (nil for an unknown dimension or on overflow).
    public var elementCount: UInt64? {
        guard let shape = shape else { return nil }
        var count: UInt64 = 1
        for size in shape {
            let (product, overflow) = count.multipliedReportingOverflow(by: size)
            if overflow { return nil }
            count = product
        }
        return count
    }
}

public enum MILDimension: Sendable, Equatable {
    case constant(UInt64)
    case unknown(variadic: Bool)
}

public struct MILValue: Sendable, Equatable {
    public var type: MILValueType?
    public var storage: MILValueStorage
    /// The contents of an immediate tensor value (`ImmediateValue.tensor`); nil for blob values
    /// and for immediate tuples, lists and dictionaries, which no museflash program uses.
    public var immediateTensor: MILTensorValue?

    public init(type: MILValueType? = nil, storage: MILValueStorage = .none,
                immediateTensor: MILTensorValue? = nil) {
        self.type = type
        self.storage = storage
        self.immediateTensor = immediateTensor
    }

    public var tensorType: MILTensorType? { type?.tensorType }

    public var blob: MILBlobReference? {
        if case .blobFile(let reference) = storage { return reference }
        return nil
    }
}

/// The contents of an immediate tensor (`TensorValue` oneof). Which member carries which data
/// type follows coremltools: fp32 as `floats`, int32 and narrower ints as `ints`, fp16, 8-bit
/// and sub-byte types as packed little-endian `bytes`.
public enum MILTensorValue: Sendable, Equatable {
    case floats([Float])
    case ints([Int32])
    case bools([Bool])
    case strings([String])
    case longInts([Int64])
    case doubles([Double])
    case bytes([UInt8])
}

/// Where a value's contents are (`Value.value` oneof).
public enum MILValueStorage: Sendable, Equatable {
    case none
    /// In the spec itself (see `MILValue.immediateTensor`).
    case immediate
    case blobFile(MILBlobReference)
}

/// A blob of a weight file: `fileName` is `@model_path/...`, relative to the directory of the
/// model spec; `offset` is that of the blob's metadata header.
public struct MILBlobReference: Sendable, Hashable {
    public var fileName: String
    public var offset: UInt64

    public init(fileName: String, offset: UInt64) {
        self.fileName = fileName
        self.offset = offset
    }
}

/// MIL.proto's `DataType`. Proto3 enums are open, so unknown values are kept.
public enum MILDataType: Sendable, Hashable, CustomStringConvertible {
    case unused, bool, string
    case float8E4M3FN, float8E5M2, float16, float32, float64, bfloat16
    case int4, int8, int16, int32, int64
    case uint1, uint2, uint3, uint4, uint6, uint8, uint16, uint32, uint64
    case unrecognized(Int32)

    /// Raw value -> case, from coremltools 9.0's MIL_pb2.DataType.
    private static let known: [Int32: MILDataType] = [
        0: .unused, 1: .bool, 2: .string,
        40: .float8E4M3FN, 41: .float8E5M2, 10: .float16, 11: .float32, 12: .float64, 13: .bfloat16,
        25: .int4, 21: .int8, 22: .int16, 23: .int32, 24: .int64,
        37: .uint1, 36: .uint2, 39: .uint3, 35: .uint4, 38: .uint6, 31: .uint8, 32: .uint16, 33: .uint32, 34: .uint64,
    ]

    public init(rawValue: Int32) {
        self = Self.known[rawValue] ?? .unrecognized(rawValue)
    }

    public var rawValue: Int32 {
        if case .unrecognized(let value) = self { return value }
        return Self.known.first { $0.value == self }!.key
    }

    /// Bits per element of the numeric types, nil for the others.
    public var bitWidth: Int? {
        switch self {
        case .uint1: return 1
        case .uint2: return 2
        case .uint3: return 3
        case .int4, .uint4: return 4
        case .uint6: return 6
        case .int8, .uint8, .float8E4M3FN, .float8E5M2: return 8
        case .int16, .uint16, .float16, .bfloat16: return 16
        case .int32, .uint32, .float32: return 32
        case .int64, .uint64, .float64: return 64
        case .unused, .bool, .string, .unrecognized: return nil
        }
    }

    /// The spelling of MIL.proto, e.g. `INT4`.
    public var description: String {
        switch self {
        case .unused: return "UNUSED_TYPE"
        case .bool: return "BOOL"
        case .string: return "STRING"
        case .float8E4M3FN: return "FLOAT8E4M3FN"
        case .float8E5M2: return "FLOAT8E5M2"
        case .float16: return "FLOAT16"
        case .float32: return "FLOAT32"
        case .float64: return "FLOAT64"
        case .bfloat16: return "BFLOAT16"
        case .int4: return "INT4"
        case .int8: return "INT8"
        case .int16: return "INT16"
        case .int32: return "INT32"
        case .int64: return "INT64"
        case .uint1: return "UINT1"
        case .uint2: return "UINT2"
        case .uint3: return "UINT3"
        case .uint4: return "UINT4"
        case .uint6: return "UINT6"
        case .uint8: return "UINT8"
        case .uint16: return "UINT16"
        case .uint32: return "UINT32"
        case .uint64: return "UINT64"
        case .unrecognized(let value): return "DataType(\(value))"
        }
    }
}
