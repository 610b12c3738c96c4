import Foundation
import MLPackage

/// The weight files of one package, each mapped once and shared by all of its functions, and
/// the blob constants already decoded (one tensor per blob, whichever function asks first).
final class WeightStore {
    let package: MLPackage
    private var files: [String: MappedFile] = [:]
    private var fileURLs: [String: URL] = [:]
    private var blobs: [MILBlobReference: Tensor] = [:]
    private var decompressed: [DecompressionKey: Tensor] = [:]

    /// What a constexpr op's result is computed from: its type, the blobs each of its inputs
    /// reads, and the type and shape the program declares for it.
    struct DecompressionKey: Hashable {
        let op: String
        let inputs: [String: [MILBlobReference]]
        let type: ElementType
        let shape: [Int]
    }

    init(package: MLPackage) {
        self.package = package
    }

    /// Bytes of weight files mapped so far.
    var mappedBytes: Int { files.values.reduce(0) { $0 + $1.bytes.count } }

    func tensor(for reference: MILBlobReference, type: MILTensorType) throws -> Tensor {
        if let cached = blobs[reference] { return cached }
        // Checked once per file name: the check resolves symbolic links, a system call per
        // path component, and a package has a few weight files but a blob per tensor.
        let url: URL
        if let known = fileURLs[reference.fileName] {
            url = known
        } else {
            url = try WeightFile.url(forBlobFile: reference.fileName, modelURL: package.modelURL,
                                         packageURL: package.url)
            fileURLs[reference.fileName] = url
        }
        let file: MappedFile
        if let mapped = files[url.path] {
            file = mapped
        } else {
            file = try MappedFile(path: url.path)
            files[url.path] = file
        }
        let tensor = try Self.decode(reference: reference, type: type, file: file)
        blobs[reference] = tensor
        return tensor
    }

    /// A constexpr op's result, decompressed by `make` the first time its key is asked for and
    /// then shared: the functions of a multifunction package (main and prefill, inject_kv and
    /// draft) read the same weight blobs, and each would otherwise decompress them again and keep
    /// its own copy. Without a key (an input given inline, not in a weight file), `make` runs.
    func decompressed(_ key: DecompressionKey?, _ make: () throws -> Tensor) rethrows -> Tensor {
        guard let key = key else { return try make() }
        if let cached = decompressed[key] { return cached }
        let tensor = try make()
        decompressed[key] = tensor
        return tensor
    }

    private static func decode(reference: MILBlobReference, type: MILTensorType, file: MappedFile) throws -> Tensor {
        let path = file.path
        let bytes = file.bytes
        let size = UInt64(bytes.count)
        let offset = reference.offset
        guard offset % BlobHeader.alignment == 0, offset <= size, size - offset >= BlobHeader.length else {
            throw InterpreterError.weightFile(path: path, reason: "no blob header fits at offset \(offset) of \(size) bytes")
        }
        func little<T: FixedWidthInteger>(_: T.Type, at position: UInt64) -> T {
            var value = T.zero
            for index in (0..<UInt64(MemoryLayout<T>.size)).reversed() {
                value = value << 8 | T(bytes[Int(position + index)])
            }
            return value
        }
        guard little(UInt32.self, at: offset) == BlobHeader.sentinel else {
            throw InterpreterError.weightFile(path: path, reason: "no blob header at offset \(offset) (bad sentinel)")
        }
        let dataType = BlobDataType(rawValue: little(UInt32.self, at: offset + 4))
        let dataSize = little(UInt64.self, at: offset + 8)
        let dataOffset = little(UInt64.self, at: offset + 16)
        guard dataOffset >= offset + BlobHeader.length, dataOffset <= size, dataSize <= size - dataOffset else {
            throw InterpreterError.weightFile(
                path: path, reason: "the blob at offset \(offset) claims \(dataSize) bytes at \(dataOffset), past the end of the \(size)-byte file (truncated?)")
        }
        guard let shape = type.shape.map({ $0.map(Int.init) }), let elementType = ElementType(type.dataType) else {
            throw InterpreterError.weightFile(path: path, reason: "the blob at offset \(offset) has no static shape or a type the interpreter cannot hold (\(type.dataType))")
        }
        guard let blobType = dataType.milDataType, blobType == type.dataType, let bits = blobType.bitWidth else {
            throw InterpreterError.weightFile(path: path, reason: "the blob at offset \(offset) holds \(dataType), but the program declares \(type.dataType)")
        }
        let count = shape.reduce(1, *)
        guard let needed = BlobHeader.packedSize(elements: UInt64(count), bits: bits), needed <= dataSize else {
            throw InterpreterError.weightFile(path: path, reason: "the blob at offset \(offset) holds \(dataSize) bytes, too few for \(count) \(type.dataType) values")
        }
        let start = Int(dataOffset)
        let raw = UnsafeRawBufferPointer(rebasing: bytes[start..<start + Int(needed)])
        let data: TensorData
        switch blobType {
        case .float16:
            // Data offsets are 64-byte aligned, so the fp16 values can be read in place.
            let values = raw.bindMemory(to: UInt16.self)
            data = .half(HalfStorage(mapped: values, owner: file))
        case .float32:
            data = .float((0..<count).map { Float(bitPattern: UInt32(littleEndian: raw.loadUnaligned(fromByteOffset: $0 * 4, as: UInt32.self))) })
        case .int32, .uint32:
            data = .int((0..<count).map { Int32(bitPattern: UInt32(littleEndian: raw.loadUnaligned(fromByteOffset: $0 * 4, as: UInt32.self))) })
        case .int16:
            data = .int((0..<count).map { Int32(Int16(bitPattern: UInt16(littleEndian: raw.loadUnaligned(fromByteOffset: $0 * 2, as: UInt16.self)))) })
        case .uint16:
            data = .int((0..<count).map { Int32(UInt16(littleEndian: raw.loadUnaligned(fromByteOffset: $0 * 2, as: UInt16.self))) })
        case .int8:
            data = .int((0..<count).map { Int32(Int8(bitPattern: raw[$0])) })
        case .uint8:
            data = .int((0..<count).map { Int32(raw[$0]) })
        case .int4, .uint1, .uint2, .uint3, .uint4, .uint6:
            data = .int(unpackBits(raw, count: count, bits: bits, signed: blobType == .int4))
        default:
            throw InterpreterError.weightFile(path: path, reason: "blob values of type \(blobType) are not supported")
        }
        return Tensor(shape: shape, type: elementType, data: data)
    }
}

/// Sub-byte values packed little-endian: the first value in the lowest bits of the first byte.
func unpackBits(_ raw: UnsafeRawBufferPointer, count: Int, bits: Int, signed: Bool) -> [Int32] {
    var values = [Int32](repeating: 0, count: count)
    let mask = (1 << bits) - 1
    for index in 0..<count {
        let bit = index * bits
        var word = Int(raw[bit / 8]) >> (bit % 8)
        if bit % 8 + bits > 8 { word |= Int(raw[bit / 8 + 1]) << (8 - bit % 8) }
        var value = word & mask
        if signed && value >= 1 << (bits - 1) { value -= 1 << bits }
        values[index] = Int32(value)
    }
    return values
}

/// A constant given in the spec itself (a `const` op's `val`, or an argument bound inline).
func immediateTensor(_ value: MILValue, type declared: MILTensorType?) throws -> Tensor {
    guard let type = declared ?? value.tensorType else {
        throw KernelError("an immediate value without a tensor type")
    }
    guard let elementType = ElementType(type.dataType) else {
        throw KernelError("immediate values of type \(type.dataType) are not supported")
    }
    guard let shape = type.shape.map({ $0.map(Int.init) }) else {
        throw KernelError("an immediate value without a static shape")
    }
    let count = shape.reduce(1, *)
    guard let contents = value.immediateTensor else {
        throw KernelError("an immediate value with no tensor contents")
    }
    let data: TensorData
    switch contents {
    case .floats(let values):
        data = .float(elementType == .float16 ? values.map { Half.round($0) } : values)
    case .doubles(let values):
        data = .float(values.map { Float($0) })
    case .ints(let values):
        data = elementType.isFloat ? .float(values.map { Float($0) }) : .int(values.map { elementType.wrap($0) })
    case .longInts(let values):
        data = .int(values.map { Int32(truncatingIfNeeded: $0) })
    case .bools(let values):
        data = .bool(values)
    case .strings(let values):
        data = .string(values)
    case .bytes(let bytes):
        data = try bytes.withUnsafeBytes { raw -> TensorData in
            switch type.dataType {
            case .float16:
                guard raw.count >= count * 2 else { throw KernelError("\(raw.count) bytes for \(count) fp16 values") }
                return .float((0..<count).map { Half.toFloat(UInt16(littleEndian: raw.loadUnaligned(fromByteOffset: $0 * 2, as: UInt16.self))) })
            case .int8:
                guard raw.count >= count else { throw KernelError("\(raw.count) bytes for \(count) int8 values") }
                return .int((0..<count).map { Int32(Int8(bitPattern: raw[$0])) })
            case .uint8:
                guard raw.count >= count else { throw KernelError("\(raw.count) bytes for \(count) uint8 values") }
                return .int((0..<count).map { Int32(raw[$0]) })
            case .int4, .uint1, .uint2, .uint3, .uint4, .uint6:
                let bits = type.dataType.bitWidth ?? 8
                guard raw.count * 8 >= count * bits else { throw KernelError("\(raw.count) bytes for \(count) \(type.dataType) values") }
                return .int(unpackBits(raw, count: count, bits: bits, signed: type.dataType == .int4))
            default:
                throw KernelError("immediate bytes of type \(type.dataType) are not supported")
            }
        }
    }
    let tensor = Tensor(shape: shape, type: elementType, data: data)
    let stored: Int
    switch tensor.data {
    case .float(let values): stored = values.count
    case .int(let values): stored = values.count
    case .bool(let values): stored = values.count
    case .string(let values): stored = values.count
    case .half(let values): stored = values.values.count
    }
    guard stored == count else {
        throw KernelError("an immediate value holds \(stored) values for shape \(shape)")
    }
    return tensor
}
