"""What bertjax imports is what it declares: every third-party module imported in `bertjax/`
or `tests/` (lazy imports included) belongs to a distribution named in setup.py, in
`install_requires` or an extra, and the jax family is pinned to one tested release (read from
the installed package's metadata, i.e. setup.py as pip saw it)."""

from __future__ import annotations

import ast
import importlib.metadata
import os
import re
import sys

from packaging.requirements import Requirement

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# Import names whose distribution is named otherwise, for modules not installed in every
# environment (packages_distributions() knows only the installed ones).
NOT_ALWAYS_INSTALLED = {
    "apache_beam": "apache-beam",
    "tensorflow": "tensorflow-cpu",
    "gcp_storage_emulator": "gcp-storage-emulator",
}


def _canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _declared() -> dict[str, Requirement]:
    """Each declared distribution's first requirement (install_requires come first)."""
    declared: dict[str, Requirement] = {}
    for line in importlib.metadata.requires("bertjax") or []:
        declared.setdefault(_canonical(Requirement(line).name), Requirement(line))
    return declared


def _third_party_imports(folder: str) -> set[str]:
    local = {
        name[:-3] for name in os.listdir(os.path.join(REPO_ROOT, "tests")) if name.endswith(".py")
    }
    found = set()
    for root, _, names in os.walk(os.path.join(REPO_ROOT, folder)):
        for name in (n for n in names if n.endswith(".py")):
            with open(os.path.join(root, name), encoding="utf-8") as f:
                tree = ast.parse(f.read())
            for node in ast.walk(tree):
                if isinstance(node, ast.Import):
                    found.update(alias.name.split(".")[0] for alias in node.names)
                elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                    found.add(node.module.split(".")[0])
    return found - set(sys.stdlib_module_names) - local - {"bertjax", "__future__"}


def test_every_imported_module_is_declared():
    declared = _declared()
    distributions = importlib.metadata.packages_distributions()
    undeclared = []
    for module in sorted(_third_party_imports("bertjax") | _third_party_imports("tests")):
        names = distributions.get(module) or [NOT_ALWAYS_INSTALLED.get(module, module)]
        if not any(_canonical(name) in declared for name in names):
            undeclared.append(f"{module} ({' or '.join(names)})")
    assert not undeclared, f"imported but not declared in setup.py: {undeclared}"


def test_sentencepiece_model_proto_dependency_is_declared():
    """sentencepiece's generated model proto (read by bertjax.data.tokenization) imports
    protobuf, which sentencepiece itself does not declare."""
    from sentencepiece import sentencepiece_model_pb2

    assert sentencepiece_model_pb2.ModelProto.__module__.endswith("pb2")
    assert "protobuf" in _declared()


def test_jax_family_is_pinned_to_one_release_everywhere():
    declared = _declared()
    jax_pin = str(declared["jax"].specifier)
    assert re.fullmatch(r"==\d+\.\d+\.\d+", jax_pin), f"jax is not pinned: {jax_pin!r}"
    for name in ("jaxlib", "jax-cuda13-plugin", "jax-cuda13-pjrt"):
        assert str(declared[name].specifier) == jax_pin, (name, declared[name])
    tpu = [r for r in importlib.metadata.requires("bertjax") if 'extra == "tpu"' in r]
    assert tpu and Requirement(tpu[0]).name == "jax" and "tpu" in Requirement(tpu[0]).extras
    # The installed jax is the pinned one (CI installs from setup.py, nothing else).
    assert jax_pin == "==" + importlib.metadata.version("jax")
