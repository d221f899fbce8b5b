"""tests/mutation_check.py stays runnable as the source moves (a refactoring or the formatter
can move a file or rewrap a line that a mutation replaces): each mutation's string is in its
file exactly once and each test it names exists."""

import os
from pathlib import Path

import pytest

import mutation_check


@pytest.mark.parametrize("mutation", mutation_check.MUTATIONS, ids=lambda m: m.name)
def test_each_mutation_still_applies(mutation, tmp_path):
    source = os.path.join(mutation_check.REPO_ROOT, mutation.path)
    target = tmp_path / os.path.basename(mutation.path)
    target.write_text(Path(source).read_text(encoding="utf-8"), encoding="utf-8")
    planted = mutation_check.Mutation(mutation.name, target.name, mutation.old, mutation.new, ())
    mutation_check.patch(str(tmp_path), planted)  # (exits unless the string is there once)
    assert target.read_text(encoding="utf-8").count(mutation.new) >= 1
    for test in mutation.tests:
        path, _, name = test.partition("::")
        test_file = os.path.join(mutation_check.REPO_ROOT, path)
        assert os.path.isfile(test_file), test
        if name:  # (a test file alone names all its tests)
            function = name.split("[")[0]
            assert f"def {function}(" in Path(test_file).read_text(encoding="utf-8"), test


def test_a_mutation_whose_string_moved_is_refused(tmp_path):
    (tmp_path / "m.py").write_text("x = (\n    1,\n)\n", encoding="utf-8")
    moved = mutation_check.Mutation("moved", "m.py", "x = (1,", "x = (2,", ())
    with pytest.raises(SystemExit, match="holds 0 copies"):
        mutation_check.patch(str(tmp_path), moved)
