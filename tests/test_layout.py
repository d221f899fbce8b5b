"""The import layering of bertjax/ (issue 12), read from the source with `ast`:

* nothing imports an entry point (the `python -m` modules);
* the floors (issue 54, FLOORS): no import climbs a floor, no package imports one that imports
  it, no module imports one that imports it (each rule proven by a planted violation);
* tools/ (measurement) is imported by nothing outside tools/;
* no module reaches a private (`_name`) of another bertjax module;
* no library function takes the whole config: no parameter annotated ConfigDict, no parameter
  named `config` without a concrete type, no `param.<config section>.<field>` read;
* module sizes: entry points under 250 lines, every module at most 450;
* no test code in the product: no test_* module, no switch read from a test's environment
  variable, no config field for tests only (tests inject faults from tests/);
* each entry point catches an exception class once (UserError covers its subclasses);
* parameters typed `Any` as a whole: at most ANY_PARAMETERS (issue 45: it only goes down);
* every function is annotated, each parameter and its return (issue 54);
* one reporter (issue 54): no module but the entry points and bertjax.runtime.console calls
  `print`, and one function (console.error_line) writes the `error:` prefix (both rules
  proven by planted violations).
"""

import ast
import functools
import pathlib

import pytest

PACKAGE = pathlib.Path(__file__).resolve().parents[1] / "bertjax"
ENTRY_POINTS = {
    "bertjax.train",
    "bertjax.finetune",
    "bertjax.extract_features",
    "bertjax.convert",
    "bertjax.probe",
    "bertjax.tools.aot",
    "bertjax.tools.bench",
    "bertjax.tools.bench_data",
    "bertjax.prepare",
    "bertjax.data.tokenization",
}
# Modules whose `main` is a command line but which libraries may import for their functions.
LIBRARY_WITH_CLI = {"bertjax.data.tokenization"}
CONFIG_SECTIONS = {"model", "data", "train", "optimizer", "mesh", "long_phase"}


def module_name(path: pathlib.Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def modules() -> dict[str, pathlib.Path]:
    return {module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


KNOWN = set(modules())


def imports(tree: ast.AST) -> set[str]:
    """The bertjax modules a module imports (`from bertjax import x` counts bertjax.x)."""
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name.startswith("bertjax"))
        elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("bertjax"):
            found.add(node.module)
            found.update(
                f"{node.module}.{a.name}" for a in node.names if f"{node.module}.{a.name}" in KNOWN
            )
    return found & KNOWN


def private_reaches(tree: ast.AST) -> list[str]:  # noqa: C901 (one branch per form of reach)
    """`from bertjax.x import _name` and `alias._name` for an imported bertjax module."""
    aliases, found = {}, []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("bertjax"):
            for a in node.names:
                if a.name.startswith("_"):
                    found.append(f"{node.module}.{a.name}")
                elif f"{node.module}.{a.name}" in KNOWN:
                    aliases[a.asname or a.name] = f"{node.module}.{a.name}"
        elif isinstance(node, ast.Import):
            for a in node.names:
                if a.name.startswith("bertjax") and a.asname:
                    aliases[a.asname] = a.name
    for node in ast.walk(tree):
        if (
            isinstance(node, ast.Attribute)
            and isinstance(node.value, ast.Name)
            and node.value.id in aliases
            and node.attr.startswith("_")
            and not node.attr.startswith("__")
        ):
            found.append(f"{aliases[node.value.id]}.{node.attr}")
    return found


def whole_config_uses(tree: ast.AST) -> list[str]:
    """Functions that take the whole config: a parameter annotated ConfigDict, a parameter
    named `config` with no concrete type, or `param.<section>.<field>` read off a parameter."""
    found = []
    for function in ast.walk(tree):
        if not isinstance(function, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            continue
        args = function.args
        params = args.posonlyargs + args.args + args.kwonlyargs
        names = {a.arg for a in params}
        name = getattr(function, "name", "lambda")
        for a in params:
            annotation = ast.unparse(a.annotation) if a.annotation is not None else ""
            if "ConfigDict" in annotation:
                found.append(f"{name}({a.arg}: {annotation})")
            elif a.arg == "config" and annotation in ("", "Any"):
                found.append(f"{name}(config) without a concrete type")
        for node in ast.walk(function):
            if (
                isinstance(node, ast.Attribute)
                and isinstance(node.value, ast.Attribute)
                and isinstance(node.value.value, ast.Name)
                and node.value.value.id in names
                and node.value.attr in CONFIG_SECTIONS
            ):
                found.append(f"{name}: {ast.unparse(node)}")
    return found


def parsed(name: str) -> ast.AST:
    return ast.parse(modules()[name].read_text(encoding="utf-8"))


# The one library whose job is the whole config: every field's range checked before any work.
WHOLE_CONFIG_OWNERS = {"bertjax.training.validate"}


def libraries() -> list[str]:
    return [
        n
        for n in KNOWN
        if (n not in ENTRY_POINTS or n in LIBRARY_WITH_CLI) and not n.startswith("bertjax.tools")
    ]


def test_nothing_imports_an_entry_point():
    offenders = {
        name: sorted(imports(parsed(name)) & (ENTRY_POINTS - LIBRARY_WITH_CLI)) for name in KNOWN
    }
    assert {k: v for k, v in offenders.items() if v} == {}


# The floors, bottom up: a module imports only modules on its own floor or below (an entry
# point: none of another). A floor names its packages (or modules); `bertjax` is the package's
# face, bertjax/__init__.py. The models' family registry loads the built-in families (on the
# families floor) by name, as it would a plugin, not by an import.
FLOORS: tuple[tuple[str, ...], ...] = (
    ("bertjax.errors",),  # UserError, the base of every error a user can act on
    ("bertjax.runtime",),  # processes, files, stops and failures
    ("bertjax.data",),  # corpus to batches
    ("bertjax.models",),  # the networks, their shared layers, the family interface and registry
    ("bertjax.checkpoints",),  # checkpoints on disk: Orbax, their checks, the run record
    ("bertjax.tasks",),  # the fine-tuning tasks
    ("bertjax.interop",),  # checkpoint formats: Google TF, Hugging Face, bertjax's own
    ("bertjax.training",),  # settings, state, steps, optimizer, resume, the loops
    ("bertjax.families",),  # each family's adapter (BERT, ModernBERT)
    ("bertjax.cli",),  # what every entry point shares
    ("bertjax", *sorted(n for n in ENTRY_POINTS - LIBRARY_WITH_CLI if "tools" not in n)),
    ("bertjax.tools",),  # measurement: imported by nothing else
)


def floor(name: str) -> int:
    """The floor of module `name`: the one naming it or its package (the longest such name);
    KeyError for a module on no floor."""
    found = [
        (len(prefix), index)
        for index, prefixes in enumerate(FLOORS)
        for prefix in prefixes
        if name == prefix or (prefix != "bertjax" and name.startswith(prefix + "."))
    ]
    if not found:
        raise KeyError(f"{name} is on no floor: name it (or its package) in FLOORS")
    return max(found)[1]


def package(name: str) -> str:
    """What the package rules compare: bertjax's subpackage (`bertjax.training`), or a
    top-level module (`bertjax.train`)."""
    return ".".join(name.split(".")[:2])


@functools.cache
def import_graph() -> dict[str, set[str]]:
    """Each module of bertjax/ and the modules it imports (a package's `__init__`, named by
    `from package import module`, is not counted)."""
    packages = {n for n, path in modules().items() if path.name == "__init__.py"}
    return {name: imports(parsed(name)) - packages - {name} for name in KNOWN}


def climbs(graph: dict[str, set[str]]) -> list[str]:
    """The imports that climb a floor."""
    return sorted(
        f"{a} -> {b}" for a, targets in graph.items() for b in targets if floor(b) > floor(a)
    )


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one node (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        for target in sorted(graph.get(node, ())):
            if target not in index:
                visit(target)
                low[node] = min(low[node], low[target])
            elif target in stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            component = []
            while not component or component[-1] != node:
                component.append(stack.pop())
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return sorted(found)


def package_graph(graph: dict[str, set[str]]) -> dict[str, set[str]]:
    out: dict[str, set[str]] = {}
    for a, targets in graph.items():
        out.setdefault(package(a), set()).update(
            package(b) for b in targets if package(b) != package(a)
        )
    return out


def test_every_module_is_on_a_floor():
    assert {floor(n) for n in KNOWN} == set(range(len(FLOORS)))
    assert (
        floor("bertjax.training.steps")
        > floor("bertjax.interop.pretrained")
        > floor("bertjax.runtime.files")
    )


def test_no_import_climbs_a_floor():
    assert climbs(import_graph()) == []


def test_no_package_imports_another_that_imports_it():
    assert cycles(package_graph(import_graph())) == []


def test_no_module_imports_one_that_imports_it():
    """Also not through others, nor only for annotations (`if TYPE_CHECKING:`)."""
    assert cycles(import_graph()) == []


def test_the_floor_rules_catch_planted_violations():
    planted = {
        "bertjax.runtime.files": {"bertjax.data.batch"},  # climbs
        "bertjax.interop.native": {"bertjax.training.state"},  # climbs; a package cycle ...
        "bertjax.training.resume": {"bertjax.interop.pretrained"},  # ... through other files
        "bertjax.data.a": {"bertjax.data.b"},  # a file cycle inside one package
        "bertjax.data.b": {"bertjax.data.c"},
        "bertjax.data.c": {"bertjax.data.a"},
    }
    assert climbs(planted) == [
        "bertjax.interop.native -> bertjax.training.state",
        "bertjax.runtime.files -> bertjax.data.batch",
    ]
    assert cycles(package_graph(planted)) == [["bertjax.interop", "bertjax.training"]]
    assert cycles(planted) == [["bertjax.data.a", "bertjax.data.b", "bertjax.data.c"]]
    with pytest.raises(KeyError, match=r"bertjax\.nowhere is on no floor"):
        floor("bertjax.nowhere")


def untyped_settings(tree: ast.AST) -> list[str]:
    """Parameters and fields named `*_cfg` or `*_config` annotated `Any` (or not at all): a
    config section travelling untyped instead of as its typed settings."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            args = node.args
            named = [(a.arg, a.annotation) for a in args.posonlyargs + args.args + args.kwonlyargs]
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            named = [(node.target.id, node.annotation)]
        else:
            continue
        for name, annotation in named:
            text = ast.unparse(annotation) if annotation is not None else ""
            if name.endswith(("_cfg", "_config")) and text in ("", "Any", "typing.Any"):
                found.append(f"{getattr(node, 'name', 'field')}({name}: {text or 'no type'})")
    return found


def test_no_config_section_travels_untyped():
    offenders = {name: untyped_settings(parsed(name)) for name in KNOWN}
    assert {k: v for k, v in offenders.items() if v} == {}
    assert (
        len(
            untyped_settings(
                ast.parse(
                    "def f(data_cfg: Any, mesh_config, x: Any, model_config: BertConfig):\n"
                    "    y_cfg: Any = None\n"
                )
            )
        )
        == 3
    )


def test_tools_are_imported_only_by_tools():
    offenders = {
        name: sorted(i for i in imports(parsed(name)) if i.startswith("bertjax.tools"))
        for name in KNOWN
        if not name.startswith("bertjax.tools")
    }
    assert {k: v for k, v in offenders.items() if v} == {}


def test_no_module_reaches_a_private_name_of_another():
    offenders = {name: private_reaches(parsed(name)) for name in KNOWN}
    assert {k: v for k, v in offenders.items() if v} == {}


def test_no_library_function_takes_the_whole_config():
    offenders = {
        name: whole_config_uses(parsed(name)) for name in set(libraries()) - WHOLE_CONFIG_OWNERS
    }
    assert {k: v for k, v in offenders.items() if v} == {}


@pytest.mark.parametrize(
    "source, found",
    [
        ("def f(config):\n    return config.train.total_steps", 2),
        ("import ml_collections\ndef f(c: ml_collections.ConfigDict):\n    return c", 1),
        ("def f(data_cfg, config: BertConfig):\n    return data_cfg.seed, config.hidden_size", 0),
        ("def f(run):\n    return run.model.config", 1),
    ],
)
def test_the_config_check_catches_planted_violations(source, found):
    assert len(whole_config_uses(ast.parse(source))) == found


def test_the_import_checks_catch_planted_violations():
    tree = ast.parse(
        "from bertjax import train\nfrom bertjax.data import pipeline\n"
        "from bertjax.interop.tree import _few\nx = pipeline._hash(1)\n"
    )
    assert imports(tree) >= {"bertjax.train", "bertjax.data.pipeline"}
    assert private_reaches(tree) == ["bertjax.interop.tree._few", "bertjax.data.pipeline._hash"]


def code_lines(source: str) -> int:
    """A module's lines, each import statement counted as one (isort writes a long one a
    name per line; that is layout, not code)."""
    wrapped = sum(
        node.end_lineno - node.lineno
        for node in ast.parse(source).body
        if isinstance(node, (ast.Import, ast.ImportFrom)) and node.end_lineno
    )
    return len(source.splitlines()) - wrapped


def test_module_sizes():
    lines = {name: code_lines(path.read_text(encoding="utf-8")) for name, path in modules().items()}
    assert code_lines("from a import (\n    b,\n    c,\n)\nx = 1\n") == 2
    too_long = {n: c for n, c in lines.items() if c > 450}
    # Every command-line module but a library that also has one stays thin.
    fat_entry_points = {
        n: lines[n] for n in sorted(ENTRY_POINTS - LIBRARY_WITH_CLI) if lines[n] >= 250
    }
    assert len(ENTRY_POINTS - LIBRARY_WITH_CLI) == 9
    assert too_long == {} and fat_entry_points == {}


def test_every_error_a_user_meets_is_a_user_error():
    """Each exception class bertjax defines derives from `bertjax.errors.UserError` or OSError
    (one line an entry point prints as `error: ...`), so the entry points catch one class instead of
    lists kept by hand; the exceptions that are control flow are named here."""
    import importlib
    import inspect

    from bertjax.errors import UserError

    control_flow = {
        "bertjax.runtime.failures.Stopped"
    }  # (a stop with a checkpoint saved: exit 130/143)
    found, outside = 0, []
    for name in sorted(KNOWN):
        try:
            module = importlib.import_module(name)
        except ModuleNotFoundError as e:  # (an optional extra's module: torch, apache_beam)
            assert not (e.name or "").startswith("bertjax"), e
            continue
        for cls_name, cls in inspect.getmembers(module, inspect.isclass):
            if cls.__module__ != name or not issubclass(cls, BaseException):
                continue
            found += 1
            if (
                not issubclass(cls, (UserError, OSError))
                and f"{name}.{cls_name}" not in control_flow
            ):  # (OSError: one line too)
                outside.append(f"{name}.{cls_name}")
    assert found >= 20 and outside == [], outside


REPOSITORY = PACKAGE.parent
# What only tests may name: the environment variables of tests/injected_faults.py and the
# other test switches (BERTJAX_TEST_*), and fields that once were tests' own.
TEST_ONLY = ("BERTJAX_TEST_", "debug_nan_steps", "TEST ONLY", "test_pause")


def test_no_test_code_in_the_product():
    """No module of bertjax/ is a test's (test_*.py), and nothing in bertjax/ or configs/ names
    a test switch: faults are injected from tests/ at the product's public seams."""
    assert [p.name for p in PACKAGE.rglob("test_*.py")] == []
    sources = sorted(PACKAGE.rglob("*.py")) + sorted((REPOSITORY / "configs").rglob("*.py"))
    offenders = {
        f"{p.relative_to(REPOSITORY)}: {word}"
        for p in sources
        for word in TEST_ONLY
        if word in p.read_text(encoding="utf-8")
    }
    assert len(sources) > 50 and sorted(offenders) == []


def caught(module_name: str) -> list[list[type]]:
    """The exception classes each `except` clause of `module_name`'s `main` handles: a clause
    that ends by raising the error again (after telling the other processes, say) handles
    none."""
    import importlib

    module = importlib.import_module(module_name)
    main = next(
        node
        for node in parsed(module_name).body
        if isinstance(node, ast.FunctionDef) and node.name == "main"
    )
    clauses = [
        node.type
        for node in ast.walk(main)
        if isinstance(node, ast.ExceptHandler)
        and node.type is not None
        and not (isinstance(node.body[-1], ast.Raise) and node.body[-1].exc is None)
    ]
    return [
        [
            eval(ast.unparse(name), vars(module))  # noqa: S307 (the module's own names)
            for name in (clause.elts if isinstance(clause, ast.Tuple) else [clause])
        ]
        for clause in clauses
    ]


@pytest.mark.parametrize("name", sorted(ENTRY_POINTS))
def test_entry_points_catch_each_error_class_once(name):
    """No `except` clause of an entry point's `main` names a class beside one of its bases
    (e.g. a UserError beside UserError); training, fine-tuning, preparation, probing and
    feature extraction catch every error a user can act on in one `(UserError, OSError)`
    clause, and apart from it only control flow."""
    import jax

    from bertjax.errors import UserError
    from bertjax.runtime import failures

    twice = [
        (a.__name__, b.__name__)
        for clause in caught(name)
        for a in clause
        for b in clause
        if a is not b and issubclass(a, b)
    ]
    assert twice == []
    if name in (
        "bertjax.train",
        "bertjax.finetune",
        "bertjax.prepare",
        "bertjax.probe",
        "bertjax.extract_features",
    ):
        assert [UserError, OSError] in caught(name)
        assert {cls for clause in caught(name) for cls in clause} - {UserError, OSError} <= {
            failures.Stopped,
            KeyboardInterrupt,
            jax.errors.JaxRuntimeError,
        }


def parameters(node: ast.FunctionDef | ast.AsyncFunctionDef) -> list[ast.arg]:
    """Every parameter of `node`, *args and **kwargs included."""
    args = node.args
    rest = [x for x in (args.vararg, args.kwarg) if x]
    return args.posonlyargs + args.args + args.kwonlyargs + rest


def functions(tree: ast.AST) -> list[ast.FunctionDef | ast.AsyncFunctionDef]:
    """Every function and method in `tree`, nested ones included."""
    return [n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))]


# Parameters whose whole annotation is `Any` in bertjax/ (112 before issue 45, 33 before issue
# 54): lower it when a change types more of them, never raise it.
ANY_PARAMETERS = 14


def any_parameters(tree: ast.AST) -> list[str]:
    """`function(parameter)` for each parameter (also *args, **kwargs) annotated `Any`."""
    return [
        f"{node.name}({a.arg})"
        for node in functions(tree)
        for a in parameters(node)
        if a.annotation is not None and ast.unparse(a.annotation) in ("Any", "typing.Any")
    ]


def test_parameters_typed_any_only_go_down():
    counted = {name: any_parameters(parsed(name)) for name in KNOWN}
    total = sum(map(len, counted.values()))
    assert total <= ANY_PARAMETERS, {k: v for k, v in counted.items() if v}
    assert any_parameters(
        ast.parse("def f(a: Any, b: Any | None, *c: Any, d: list[Any], **e: typing.Any): pass")
    ) == ["f(a)", "f(c)", "f(e)"]


def unannotated(tree: ast.AST) -> list[str]:
    """`function(parameter)` for each parameter without an annotation (a method's first
    `self` or `cls` aside) and `function -> ?` for each function without a return annotation
    (`__init__` too: `-> None`)."""
    found = []
    for node in functions(tree):
        for i, a in enumerate(parameters(node)):
            if a.annotation is None and not (i == 0 and a.arg in ("self", "cls")):
                found.append(f"{node.name}({a.arg})")
        if node.returns is None:
            found.append(f"{node.name} -> ?")
    return found


def test_every_function_is_annotated():
    """Every parameter and return of every function in bertjax/ is annotated (nested ones
    too), so that mypy's `disallow_untyped_defs` holds and every body is checked."""
    found = {name: unannotated(parsed(name)) for name in KNOWN}
    assert {k: v for k, v in found.items() if v} == {}
    planted = (
        "class C:\n"
        "    def __init__(self, a: int): ...\n"
        "    @classmethod\n"
        "    def k(cls, b) -> int: ...\n"
        "def f(self, a, *b: int, c: str, **d) -> int:\n"
        "    def g(x: int): ...\n"
        "    return 0\n"
    )
    assert sorted(unannotated(ast.parse(planted))) == sorted(
        ["__init__ -> ?", "k(b)", "f(a)", "f(d)", "g -> ?"]
    )


# The one module that writes lines to the console (`say`, `chief_print`, `warning`, `error`).
# An entry point may print its own results on stdout (a table, JSON, `wrote ...`); its
# progress, notices and `error:` line go through the reporter too.
REPORTER = "bertjax.runtime.console"


def prints(tree: ast.AST) -> list[int]:
    """The lines of the calls of the builtin `print` (`x.print(...)` is another function)."""
    return sorted(
        node.lineno
        for node in ast.walk(tree)
        if isinstance(node, ast.Call)
        and isinstance(node.func, ast.Name)
        and node.func.id == "print"
    )


def test_library_modules_do_not_print():
    """Only the reporter and the entry points call `print`: a library (data/tokenization and
    tasks/squad_eval, whose command lines are library functions, and tools/records included)
    says what it says through bertjax.runtime.console."""
    checked = KNOWN - (ENTRY_POINTS - LIBRARY_WITH_CLI) - {REPORTER}
    offenders = {name: prints(parsed(name)) for name in checked}
    assert len(checked) > 100 and {k: v for k, v in offenders.items() if v} == {}
    assert len(prints(parsed(REPORTER))) == 1  # (in `say`)
    planted = (
        "import sys\n"
        "class C:\n"
        "    def m(self) -> None:\n"
        "        print('x', file=sys.stderr)\n"
        "f = lambda: print(1)\n"
        "console.say('fine'); self.print('fine too')\n"
        "print()\n"
    )
    assert prints(ast.parse(planted)) == [4, 5, 7]


def error_prefixes(tree: ast.AST) -> list[str]:
    """The functions (`<module>` for the top level) holding a string or an f-string that
    starts `error:`, the prefix of the one line that says what went wrong."""
    found = set()

    def visit(node: ast.AST, where: str) -> None:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            where = getattr(node, "name", "<lambda>")
        text = None
        if isinstance(node, ast.Constant) and isinstance(node.value, str):
            text = node.value
        elif isinstance(node, ast.JoinedStr) and node.values:
            first = node.values[0]
            text = first.value if isinstance(first, ast.Constant) else None
        if isinstance(text, str) and text.startswith("error:"):
            found.add(where)
        for child in ast.iter_child_nodes(node):
            visit(child, where)

    visit(tree, "<module>")
    return sorted(found)


def test_one_function_writes_the_error_prefix():
    """cli.py, runtime/failures.py, runtime/peers.py, the entry points and the console's own
    error records all write their `error:` line through console.error_line."""
    found = [f"{name}.{where}" for name in sorted(KNOWN) for where in error_prefixes(parsed(name))]
    assert found == [f"{REPORTER}.error_line"]
    planted = (
        "def f(e):\n"
        "    print(f'error: {e}', file=sys.stderr)\n"
        "def g():\n"
        "    def h():\n"
        "        return 'error: x'\n"
        "    return 'an error: y', f'{level}: z'\n"
        "X = 'error:y'\n"
        "k = lambda: sys.exit(f'error: {X}')\n"
    )
    assert error_prefixes(ast.parse(planted)) == ["<lambda>", "<module>", "f", "h"]
