"""tests/unit mirrors the package: a test of ``posttrain/a/b/m.py`` lives in ``tests/unit/a/b/`` (by convention as
``test_m.py``), so a new test cannot land in a folder the package does not have. Every folder there is a package
(``__init__.py``), so equal file names in different folders (``test_model.py`` of two trainers) import apart."""

from pathlib import Path

from tests.conftest import ROOT

UNIT = ROOT / "tests" / "unit"
PACKAGE = ROOT / "posttrain"


def unmirrored(unit: Path, package: Path) -> list[str]:
    """Folders under ``unit`` holding Python files (tests or their helpers) with no folder of the same relative path
    under ``package``, as paths relative to ``unit``'s parent's parent (``tests/unit/x``)."""
    folders = {p.parent for p in unit.rglob("*.py") if "__pycache__" not in p.parts}
    return sorted(str(f.relative_to(unit.parent.parent)) for f in folders
                  if not (package / f.relative_to(unit)).is_dir())


def not_packages(unit: Path) -> list[str]:
    """Folders under ``unit`` (``unit`` included) with Python files but no ``__init__.py``."""
    folders = {p.parent for p in unit.rglob("*.py") if "__pycache__" not in p.parts}
    return sorted(str(f.relative_to(unit.parent.parent)) for f in folders if not (f / "__init__.py").is_file())


def test_tests_unit_mirrors_the_package_layout():
    bad = unmirrored(UNIT, PACKAGE)
    assert not bad, f"test folders with no posttrain/ counterpart (move each test next to its module's path): {bad}"


def test_every_unit_test_folder_is_a_package():
    bad = not_packages(UNIT)
    assert not bad, f"test folders without __init__.py (equal test file names would collide): {bad}"


def test_the_layout_checks_find_a_stray_folder(tmp_path):
    (tmp_path / "posttrain" / "core").mkdir(parents=True)
    unit = tmp_path / "tests" / "unit"
    for folder in ("core", "algorithms"):
        (unit / folder).mkdir(parents=True)
        (unit / folder / "test_x.py").write_text("")
    (unit / "core" / "__init__.py").write_text("")
    assert unmirrored(unit, tmp_path / "posttrain") == ["tests/unit/algorithms"]
    assert not_packages(unit) == ["tests/unit/algorithms"]
