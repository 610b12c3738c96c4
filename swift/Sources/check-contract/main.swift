import Foundation
import MuseflashContract

let outcome = ContractCommand.run(arguments: Array(CommandLine.arguments.dropFirst()),
                                  environment: ProcessInfo.processInfo.environment)
FileHandle.standardOutput.write(Data(outcome.standardOutput.utf8))
FileHandle.standardError.write(Data(outcome.standardError.utf8))
exit(outcome.status)
