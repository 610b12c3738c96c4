import XCTest
import Foundation
import MuseflashContract
import TestSupport

/// Flipped bytes anywhere the checker reads must yield a report or a
/// ContractInputError, never a trap or another kind of error.
final class RandomDamageTests: XCTestCase {
    private func flipBytes(in file: URL, count: Int, using generator: inout SystemRandomNumberGenerator) throws {
        var bytes = [UInt8](try Data(contentsOf: file))
        guard !bytes.isEmpty else { return }
        for _ in 0..<count {
            bytes[Int.random(in: 0..<bytes.count, using: &generator)] = UInt8.random(in: 0...255, using: &generator)
        }
        try Data(bytes).write(to: file)
    }

    func testFlippedBytesNeverTrap() throws {
        let pristine = try ScratchDirectory.make()
        defer { ScratchDirectory.remove(pristine) }
        try SyntheticExport.fusedTargetWithDFlashDrafter().write(to: pristine)
        let targets = ["metadata.json", "target.mlpackage/Manifest.json",
                       "target.mlpackage/" + PackageSpec.modelPath, "dflash_drafter.mlpackage/" + PackageSpec.modelPath]
        var generator = SystemRandomNumberGenerator()
        var outcomes = (reports: 0, inputErrors: 0)
        let rounds = 60
        for round in 0..<rounds {
            let copy = try ScratchDirectory.make()
            defer { ScratchDirectory.remove(copy) }
            let export = copy.appendingPathComponent("export")
            try FileManager.default.copyItem(at: pristine, to: export)
            try flipBytes(in: export.appendingPathComponent(targets[round % targets.count]),
                          count: 1 + round % 4, using: &generator)
            do {
                _ = try ContractChecker().check(exportDirectory: export)
                outcomes.reports += 1
            } catch is ContractInputError {
                outcomes.inputErrors += 1
            }
        }
        XCTAssertEqual(outcomes.reports + outcomes.inputErrors, rounds)
    }
}
