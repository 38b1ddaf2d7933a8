"""verl_agent.imports.import_object: the one loader of tools, interactions, agent and reward functions."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from verl_agent.imports import import_object, is_file_spec


def test_file_specs_are_told_from_dotted_ones():
    assert is_file_spec("tools/extra.py:f") and is_file_spec("x.py:f") and is_file_spec("dir/mod:f")
    assert not is_file_spec("pkg.mod:Name") and not is_file_spec("pkg.mod.Name") and not is_file_spec("f")


def test_dotted_colon_and_file_forms_resolve(tmp_path, monkeypatch):
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "helpers.py").write_text("COUNT = [0]\nCOUNT[0] += 1\ndef f():\n    return 41\n")
    assert import_object("verl_agent.imports.import_object") is import_object
    assert import_object("verl_agent.imports:is_file_spec") is is_file_spec
    f = import_object("sub/helpers.py:f", base_dir=tmp_path)
    assert f() == 41
    # relative to the cwd without base_dir; one module per resolved path, its code runs once
    monkeypatch.chdir(tmp_path)
    assert import_object("sub/helpers.py:f") is f
    assert import_object(f"{tmp_path}/sub/helpers.py:COUNT") == [1]


def test_modules_in_the_current_directory_import(tmp_path, monkeypatch):
    (tmp_path / "cwd_mod_for_imports.py").write_text("VALUE = 7\n")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p not in ("", str(tmp_path))])
    try:
        assert import_object("cwd_mod_for_imports.VALUE") == 7
    finally:
        sys.modules.pop("cwd_mod_for_imports", None)


@pytest.mark.parametrize(
    "spec, error, fragment",
    [
        ("nope.py:f", ImportError, "nope.py does not exist"),
        ("JustAName", ImportError, "is not a dotted path"),
        ("no_such_mod_for_imports.f", ImportError, "No module named 'no_such_mod_for_imports'"),
        ("verl_agent.imports.nothing_here", AttributeError, "module 'verl_agent.imports' has no attribute"),
        ("ok.py:missing", AttributeError, "ok.py has no attribute 'missing'"),
    ],
)
def test_errors_name_what_is_missing(tmp_path, spec, error, fragment):
    (tmp_path / "ok.py").write_text("x = 1\n")
    with pytest.raises(error, match=fragment.replace("(", r"\(").replace(")", r"\)")):
        import_object(spec, base_dir=tmp_path)


def test_code_that_raises_is_reported_the_same_way_every_time(tmp_path):
    """A file whose code raises (or calls sys.exit) is not kept half-run: the next load runs it again."""
    (tmp_path / "boom.py").write_text("raise SystemExit(3)\n")
    (tmp_path / "pkg_boom_for_imports.py").write_text("1 / 0\n")
    for _ in range(2):
        with pytest.raises(ImportError, match=r"importing .*boom.py failed: SystemExit: 3"):
            import_object("boom.py:f", base_dir=tmp_path)
    sys.path.insert(0, str(tmp_path))
    try:
        with pytest.raises(ImportError, match="importing pkg_boom_for_imports failed: ZeroDivisionError"):
            import_object("pkg_boom_for_imports.f")
    finally:
        sys.path.remove(str(tmp_path))
    (tmp_path / "boom.py").write_text("def f():\n    return 'fixed'\n")
    assert import_object(str(Path(tmp_path) / "boom.py") + ":f")() == "fixed"
