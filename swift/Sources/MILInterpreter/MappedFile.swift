import Foundation
#if canImport(Glibc)
import Glibc
#elseif canImport(Darwin)
import Darwin
#endif

/// A whole file mapped read-only into memory, unmapped when the last reference goes. Weight
/// files are mapped once per package; every constant of every function reads from the mapping,
/// so resident memory is the pages actually touched, shared with the page cache.
public final class MappedFile: @unchecked Sendable {
    public let path: String
    public let bytes: UnsafeRawBufferPointer

    public init(path: String) throws {
        self.path = path
        let descriptor = open(path, O_RDONLY)
        guard descriptor >= 0 else {
            throw InterpreterError.weightFile(path: path, reason: String(cString: strerror(errno)))
        }
        defer { close(descriptor) }
        var status = stat()
        guard fstat(descriptor, &status) == 0 else {
            throw InterpreterError.weightFile(path: path, reason: String(cString: strerror(errno)))
        }
        let size = Int(status.st_size)
        guard size > 0 else {
            throw InterpreterError.weightFile(path: path, reason: "the file is empty")
        }
        guard let address = mmap(nil, size, PROT_READ, MAP_PRIVATE, descriptor, 0),
              address != MAP_FAILED else {
            throw InterpreterError.weightFile(path: path, reason: String(cString: strerror(errno)))
        }
        bytes = UnsafeRawBufferPointer(start: address, count: size)
    }

    deinit {
        munmap(UnsafeMutableRawPointer(mutating: bytes.baseAddress), bytes.count)
    }
}
