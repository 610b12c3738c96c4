import Foundation

/// The storage type of a blob in a weight file (MILBlob's `BlobDataType`; numbered unlike
/// MIL.proto's `DataType`).
public enum BlobDataType: Sendable, Hashable, CustomStringConvertible {
    case float16, float32, uint8, int8, bfloat16, int16, uint16, int4
    case uint1, uint2, uint4, uint3, uint6, int32, uint32, float8E4M3FN, float8E5M2
    case unrecognized(UInt32)

    /// Raw value -> case, from coremltools' mlmodel/src/MILBlob/Blob/BlobDataType.hpp.
    private static let known: [UInt32: BlobDataType] = [
        1: .float16, 2: .float32, 3: .uint8, 4: .int8, 5: .bfloat16, 6: .int16, 7: .uint16, 8: .int4,
        9: .uint1, 10: .uint2, 11: .uint4, 12: .uint3, 13: .uint6, 14: .int32, 15: .uint32,
        16: .float8E4M3FN, 17: .float8E5M2,
    ]

    public init(rawValue: UInt32) {
        self = Self.known[rawValue] ?? .unrecognized(rawValue)
    }

    public var rawValue: UInt32 {
        if case .unrecognized(let value) = self { return value }
        return Self.known.first { $0.value == self }!.key
    }

    /// The MIL type a tensor stored in this blob has.
    public var milDataType: MILDataType? {
        switch self {
        case .float16: return .float16
        case .float32: return .float32
        case .uint8: return .uint8
        case .int8: return .int8
        case .bfloat16: return .bfloat16
        case .int16: return .int16
        case .uint16: return .uint16
        case .int4: return .int4
        case .uint1: return .uint1
        case .uint2: return .uint2
        case .uint4: return .uint4
        case .uint3: return .uint3
        case .uint6: return .uint6
        case .int32: return .int32
        case .uint32: return .uint32
        case .float8E4M3FN: return .float8E4M3FN
        case .float8E5M2: return .float8E5M2
        case .unrecognized: return nil
        }
    }

    public var description: String {
        if case .unrecognized(let value) = self { return "blob dtype \(value)" }
        return milDataType.map { "\($0)" } ?? "?"
    }
}

/// The metadata header of one blob (MILBlob StorageFormat `blob_metadata`): 64 bytes at the
/// blob's offset, little-endian `uint32 sentinel, uint32 dtype, uint64 sizeInBytes,
/// uint64 offset` (of the data) and padding.
public struct BlobHeader: Sendable, Equatable {
    public static let sentinel: UInt32 = 0xDEAD_BEEF
    public static let length: UInt64 = 64
    /// Headers and data start at multiples of this.
    public static let alignment: UInt64 = 64

    /// Where the header is: the offset a `BlobFileValue` names.
    public var offset: UInt64
    public var dataType: BlobDataType
    /// Bytes of data; sub-byte types are packed (`ceil(elements * bits / 8)`).
    public var size: UInt64
    public var dataOffset: UInt64

    public init(offset: UInt64, dataType: BlobDataType, size: UInt64, dataOffset: UInt64) {
        self.offset = offset
        self.dataType = dataType
        self.size = size
        self.dataOffset = dataOffset
    }

    /// The data size of `elements` values of `bits` bits each, packed.
    public static func packedSize(elements: UInt64, bits: Int) -> UInt64? {
        let (product, overflow) = elements.multipliedReportingOverflow(by: UInt64(bits))
        return overflow ? nil : (product + 7) / 8
    }
}

/// Why a blob of a weight file cannot be read. Each case names the file, and the offset when
/// there is one, so a damaged export can be found.
public enum WeightFileError: Error, Sendable, Equatable, CustomStringConvertible {
    /// A `BlobFileValue.fileName` that is not `@model_path/<relative path>` inside the package.
    case unsupportedFileName(fileName: String)
    case missingFile(path: String)
    case unreadableFile(path: String, reason: String)
    case misalignedHeader(path: String, offset: UInt64)
    case headerOutOfBounds(path: String, offset: UInt64, fileSize: UInt64)
    case badSentinel(path: String, offset: UInt64, found: UInt32)
    case dataOutOfBounds(path: String, offset: UInt64, dataOffset: UInt64, size: UInt64, fileSize: UInt64)

    public var description: String {
        switch self {
        case .unsupportedFileName(let fileName):
            return "blob file name \"\(fileName)\" is not @model_path/<path inside the package>; refusing to read it"
        case .missingFile(let path):
            return "weight file \(path) does not exist"
        case .unreadableFile(let path, let reason):
            return "weight file \(path) cannot be read: \(reason)"
        case .misalignedHeader(let path, let offset):
            return "\(path) at offset \(offset): a blob header must start at a multiple of \(BlobHeader.alignment)"
        case .headerOutOfBounds(let path, let offset, let fileSize):
            return "\(path) at offset \(offset): the \(BlobHeader.length)-byte blob header does not fit "
                + "in the file of \(fileSize) bytes"
        case .badSentinel(let path, let offset, let found):
            return "\(path) at offset \(offset): no blob header there (sentinel 0x\(String(found, radix: 16)), "
                + "expected 0x\(String(BlobHeader.sentinel, radix: 16)))"
        case .dataOutOfBounds(let path, let offset, let dataOffset, let size, let fileSize):
            return "\(path) at offset \(offset): the blob's \(size) data bytes at offset \(dataOffset) "
                + "do not lie after its header within the file of \(fileSize) bytes"
        }
    }
}

public enum WeightFile {
    public static let modelPathPrefix = "@model_path/"

    /// The file a `BlobFileValue.fileName` (`@model_path/weights/weight.bin`) names: relative to
    /// the directory of the model spec, and inside the package even through symlinked
    /// directories (the file itself may be a symlink, as Bazel presents every file).
    public static func url(forBlobFile fileName: String, modelURL: URL, packageURL: URL) throws -> URL {
        guard fileName.hasPrefix(modelPathPrefix) else {
            throw WeightFileError.unsupportedFileName(fileName: fileName)
        }
        let relative = String(fileName.dropFirst(modelPathPrefix.count))
        let components = relative.split(separator: "/", omittingEmptySubsequences: true)
        guard !relative.hasPrefix("/"), !relative.contains("\0"), !components.isEmpty,
              !components.contains(".."), !components.contains(".") else {
            throw WeightFileError.unsupportedFileName(fileName: fileName)
        }
        let url = components.reduce(modelURL.deletingLastPathComponent()) { $0.appendingPathComponent(String($1)) }
        let resolvedRoot = packageURL.resolvingSymlinksInPath().standardizedFileURL.path
        let resolvedParent = url.deletingLastPathComponent().resolvingSymlinksInPath().standardizedFileURL.path
        let rootPrefix = resolvedRoot.hasSuffix("/") ? resolvedRoot : resolvedRoot + "/"
        guard (resolvedParent + "/").hasPrefix(rootPrefix) else {
            throw WeightFileError.unsupportedFileName(fileName: fileName)
        }
        return url
    }

    /// Reads the blob headers at `offsets` of the file at `url`, opening it once. A file that
    /// cannot be opened throws; a bad header is that offset's failure. Only the 64 header bytes
    /// of each blob are read, never its data.
    public static func readHeaders(at offsets: Set<UInt64>, of url: URL) throws
        -> [UInt64: Result<BlobHeader, WeightFileError>] {
        let path = url.path
        var isDirectory: ObjCBool = false
        guard FileManager.default.fileExists(atPath: path, isDirectory: &isDirectory) else {
            throw WeightFileError.missingFile(path: path)
        }
        guard !isDirectory.boolValue else {
            throw WeightFileError.unreadableFile(path: path, reason: "it is a directory")
        }
        let handle: FileHandle
        do {
            handle = try FileHandle(forReadingFrom: url)
        } catch {
            throw WeightFileError.unreadableFile(path: path, reason: error.localizedDescription)
        }
        defer { try? handle.close() }
        let fileSize: UInt64
        do {
            fileSize = try handle.seekToEnd()
        } catch {
            throw WeightFileError.unreadableFile(path: path, reason: error.localizedDescription)
        }

        var headers: [UInt64: Result<BlobHeader, WeightFileError>] = [:]
        for offset in offsets.sorted() {
            headers[offset] = Result {
                try readHeader(at: offset, handle: handle, fileSize: fileSize, path: path)
            }.mapError { $0 as? WeightFileError ?? .unreadableFile(path: path, reason: "\($0)") }
        }
        return headers
    }

    private static func readHeader(at offset: UInt64, handle: FileHandle, fileSize: UInt64,
                                   path: String) throws -> BlobHeader {
        guard offset % BlobHeader.alignment == 0 else {
            throw WeightFileError.misalignedHeader(path: path, offset: offset)
        }
        guard offset <= fileSize, fileSize - offset >= BlobHeader.length else {
            throw WeightFileError.headerOutOfBounds(path: path, offset: offset, fileSize: fileSize)
        }
        let bytes: [UInt8]
        do {
            try handle.seek(toOffset: offset)
            bytes = [UInt8](try handle.read(upToCount: Int(BlobHeader.length)) ?? Data())
        } catch {
            throw WeightFileError.unreadableFile(path: path, reason: "at offset \(offset): \(error.localizedDescription)")
        }
        guard bytes.count == Int(BlobHeader.length) else {
            throw WeightFileError.headerOutOfBounds(path: path, offset: offset, fileSize: fileSize)
        }
        func little<T: FixedWidthInteger>(_ type: T.Type, at start: Int) -> T {
            bytes[start..<start + MemoryLayout<T>.size].reversed().reduce(T.zero) { $0 << 8 | T($1) }
        }
        let sentinel = little(UInt32.self, at: 0)
        guard sentinel == BlobHeader.sentinel else {
            throw WeightFileError.badSentinel(path: path, offset: offset, found: sentinel)
        }
        let header = BlobHeader(offset: offset, dataType: BlobDataType(rawValue: little(UInt32.self, at: 4)),
                                size: little(UInt64.self, at: 8), dataOffset: little(UInt64.self, at: 16))
        guard header.dataOffset >= offset + BlobHeader.length, header.dataOffset <= fileSize,
              header.size <= fileSize - header.dataOffset else {
            throw WeightFileError.dataOutOfBounds(path: path, offset: offset, dataOffset: header.dataOffset,
                                                  size: header.size, fileSize: fileSize)
        }
        return header
    }
}
