"""Contract names are typed once, in museflash/bundle.py: no other module of the package spells
a state name, a layer type or a drafter-side output name as a string literal. Function names
are left out on purpose: they double as the models' entry points (`with_entry_point("draft")`)."""

import ast
from pathlib import Path

import museflash
from museflash.bundle import LayerType, OutputName, StateName

PACKAGE_ROOT = Path(museflash.__file__).parent
OWNER = PACKAGE_ROOT / "bundle.py"
# Every state name and layer type, and the outputs whose names mean nothing outside the contract
# ("logits" is also torch's and Hugging Face's word).
CONTRACT_NAMES = ({str(name) for name in StateName} | {str(kind) for kind in LayerType}
                  | {str(OutputName.DRAFTER_FEATURES), str(OutputName.LAST_INJECTED_POSITION),
                     str(OutputName.DRAFT_TOKENS)})


def literal_contract_names(path: Path) -> list[str]:
    """`file:line: 'name'` for each string constant in `path` that is a contract name (a
    docstring or comment naming one in prose is not a constant equal to it)."""
    hits = sorted((node.lineno, node.value) for node in ast.walk(ast.parse(path.read_text()))
                  if isinstance(node, ast.Constant) and isinstance(node.value, str)
                  and node.value in CONTRACT_NAMES)
    return [f"{path.name}:{line}: {value!r}" for line, value in hits]


def test_the_names_checked_are_the_contracts():
    assert "globalKeyCache" in CONTRACT_NAMES and "sliding_attention" in CONTRACT_NAMES
    assert len(CONTRACT_NAMES) == len(StateName) + len(LayerType) + 3


def test_no_module_but_bundle_writes_a_contract_name_as_a_literal():
    modules = sorted(p for p in PACKAGE_ROOT.rglob("*.py") if p != OWNER)
    scanned = {p.relative_to(PACKAGE_ROOT).parts[0] for p in modules}
    assert {"models", "tools", "runtime", "export"} <= scanned
    found = [hit for path in modules for hit in literal_contract_names(path)]
    assert found == [], "import these from museflash.bundle instead: " + "; ".join(found)


def test_the_scan_finds_a_literal_and_ignores_prose(tmp_path):
    module = tmp_path / "module.py"
    module.write_text('"""Writes slidingKeyCache."""\n'
                      "# drafterKeyCache\n"
                      'NAMES = ("drafterKeyCache", "slidingKeyCache is full")\n'
                      'KIND = "full_attention"\n')
    assert literal_contract_names(module) == ["module.py:3: 'drafterKeyCache'",
                                              "module.py:4: 'full_attention'"]
