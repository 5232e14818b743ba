"""The documentation site (docs/): every Python snippet of its pages runs, the API reference names
every public name and states the compiled classes' constructors as the sources define them,
every public class, method and field has a docstring, and every citation of a section of a page
(``docs/DESIGN.md, "Block pool"``) names a section that page has.

The site itself is built by .ci/run (``python -m sphinx -W``, the ``docs`` extra); these tests need
no Sphinx."""

from __future__ import annotations

import ast
import contextlib
import importlib
import inspect
import io
import pathlib
import re
import sys

import pytest

import qualia

CHECKOUT = pathlib.Path(__file__).resolve().parents[2]
DOCS = CHECKOUT / "docs"
API = DOCS / "api"

#: A fenced block preceded by this comment is not run (it needs what a test cannot have).
NOT_RUN = re.compile(r"<!-- not run: (?P<why>[^>]+?) -->\n+```python\n")
BLOCK = re.compile(r"(?P<marker><!-- not run: [^>]+ -->\n+)?```python\n(?P<code>.*?)```", re.S)


def pages():
    return sorted(p for p in DOCS.rglob("*.md") if "_build" not in p.parts)


def blocks(page):
    """The page's Python blocks to run, in order."""
    text = page.read_text(encoding="utf-8")
    return [m.group("code") for m in BLOCK.finditer(text) if not m.group("marker")]


PAGES_WITH_SNIPPETS = [p for p in pages() if blocks(p)]


def test_the_guides_have_snippets():
    names = {p.name for p in PAGES_WITH_SNIPPETS}
    assert {"concepts.md", "adopting.md", "c-abi.md", "cluster.md"} <= names


@pytest.mark.parametrize("page", PAGES_WITH_SNIPPETS, ids=lambda p: p.relative_to(DOCS).as_posix())
def test_every_snippet_of_the_page_runs(page, monkeypatch, tmp_path):
    # a page's blocks run in order in one namespace, from the checkout's root (where the
    # examples are), as a reader pasting them into one session would
    monkeypatch.chdir(CHECKOUT)
    namespace: dict = {"__name__": "__docs__"}
    out = io.StringIO()
    for i, code in enumerate(blocks(page)):
        with contextlib.redirect_stdout(out):
            exec(compile(code, f"{page.name} snippet {i}", "exec"), namespace)


def test_few_blocks_are_marked_not_run():
    marked = [(p.name, m.group("why")) for p in pages()
              for m in NOT_RUN.finditer(p.read_text(encoding="utf-8"))]
    assert len(marked) <= 3, marked
    assert all(len(why.split()) >= 3 for _, why in marked), marked


# -- the API reference ----------------------------------------------------------------------------

#: Each public module and the page of the reference that documents it.
REFERENCE = {"qualia": "core.rst", "qualia.twin": "twin.rst", "qualia.sim": "sim.rst",
             "qualia.sim.clock": "sim.rst", "qualia.sim.figures": "sim.rst",
             "qualia.cluster": "cluster.rst", "qualia.model": "model.rst",
             "qualia.vllm": "vllm.rst"}


def public_names(modname):
    """A module's ``__all__``; qualia.vllm's is read from its source (it imports vLLM)."""
    if modname == "qualia.vllm":
        tree = ast.parse((CHECKOUT / "qualia" / "vllm" / "__init__.py").read_text())
        for node in tree.body:
            if isinstance(node, ast.Assign) and getattr(node.targets[0], "id", "") == "__all__":
                return list(ast.literal_eval(node.value))
        raise AssertionError("qualia.vllm has no __all__")
    return list(importlib.import_module(modname).__all__)


@pytest.mark.parametrize("modname", sorted(REFERENCE))
def test_the_api_reference_names_every_public_name(modname):
    text = (API / REFERENCE[modname]).read_text(encoding="utf-8")
    if re.search(rf"^\.\. automodule:: {re.escape(modname)}\n(   :.*\n)*   :imported-members:",
                 text, re.M) or re.search(rf"^\.\. automodule:: {re.escape(modname)}$", text, re.M):
        return  # automodule documents every name of __all__
    directive = r"\.\. (?:autoclass|autoexception|autofunction|data|automodule)::"
    named = set(re.findall(rf"^{directive} (\w+)", text, re.M))
    missing = [n for n in public_names(modname) if n not in named and n != "errors"]
    assert not missing, f"{REFERENCE[modname]} does not document {missing}"


def cinit_signatures():
    """``{class: constructor arguments}`` of every compiled class built by ``__cinit__``, read
    from the core's sources."""
    found = {}
    for path in (CHECKOUT / "qualia" / "core").rglob("*.pxi"):
        text = path.read_text(encoding="utf-8")
        for m in re.finditer(r"^cdef class (\w+).*?\n    def __cinit__\(self(?:, )?(.*?)\):",
                             text, re.M | re.S):
            if "cdef class" not in m.group(0)[len("cdef class"):]:
                found[m.group(1)] = " ".join(m.group(2).split())
    return found


def test_the_reference_states_each_compiled_constructor_as_defined():
    text = (API / "core.rst").read_text(encoding="utf-8")
    stated = dict(re.findall(r"^\.\. autoclass:: (\w+)\((.*)\)$", text, re.M))
    defined = {k: v for k, v in cinit_signatures().items() if k in qualia.__all__ and v}
    assert set(defined) <= set(stated), set(defined) - set(stated)
    for name, args in defined.items():
        assert stated[name].replace('"', "'") == args.replace('"', "'"), name


# -- docstrings ----------------------------------------------------------------------------------

DOCUMENTED_MODULES = ["qualia", "qualia.twin", "qualia.sim", "qualia.sim.clock",
                      "qualia.sim.figures", "qualia.cluster", "qualia.model"]
MEMBER_KINDS = (property, staticmethod, classmethod)
#: Twin classes named apart from the core class they mirror (docs/conf.py has the same table).
TWIN_OF = {"PyHashBackend": "HashBackend"}


def own_doc(obj):
    """The docstring without the signature line Cython embeds (empty when that is all)."""
    doc = inspect.getdoc(obj) or ""
    name = getattr(obj, "__name__", "")
    lines = doc.splitlines()
    if lines and name and re.match(rf"(\w+\.)?{re.escape(name)}\(", lines[0]):
        lines = lines[1:]
    return "\n".join(lines).strip()


def is_member(value):
    return (inspect.isfunction(value) or inspect.ismethoddescriptor(value)
            or inspect.isdatadescriptor(value) or isinstance(value, MEMBER_KINDS))


def field_docs(cls):
    """Fields of a Python class documented in its source: by a docstring right after the field,
    or by a ``#:`` comment right before it."""
    try:
        lines, _ = inspect.getsourcelines(cls)
    except (OSError, TypeError):
        return set()
    tree = ast.parse(inspect.cleandoc("".join(lines)) if lines[0][0] == " " else "".join(lines))
    body = tree.body[0].body
    found = set()
    for i, node in enumerate(body):
        if isinstance(node, (ast.AnnAssign, ast.Assign)):
            target = node.target if isinstance(node, ast.AnnAssign) else node.targets[0]
            name = getattr(target, "id", None)
            after = body[i + 1] if i + 1 < len(body) else None
            if (isinstance(after, ast.Expr) and isinstance(after.value, ast.Constant)
                    and isinstance(after.value.value, str)):
                found.add(name)
            source_line = lines[node.lineno - 2].strip() if node.lineno >= 2 else ""
            if source_line.startswith("#:"):
                found.add(name)
    return found


def undocumented(modname):
    mod = importlib.import_module(modname)
    missing = []
    for name in mod.__all__:
        obj = getattr(mod, name)
        if not (inspect.isclass(obj) or callable(obj)):
            continue  # constants: the reference documents them (test above)
        if inspect.ismodule(obj):
            continue
        if not own_doc(obj):
            missing.append(name)
        if not inspect.isclass(obj):
            continue
        core = getattr(qualia, TWIN_OF.get(name, name), None) if modname == "qualia.twin" else None
        for key, value in vars(obj).items():
            if key.startswith("_") or not is_member(value):
                continue
            target = value.__func__ if isinstance(value, (staticmethod, classmethod)) else value
            if own_doc(target):
                continue
            mirrored = getattr(core, key, None)  # a twin member: the core member's docstring
            if mirrored is not None and own_doc(mirrored):
                continue
            missing.append(f"{name}.{key}")
        if obj.__module__.startswith("qualia.") and "_core" not in obj.__module__:
            # a field is documented in its class's source, or named by the class's docstring
            # (or by those of a base class that declares it)
            bases = [c for c in obj.__mro__ if c.__module__.startswith("qualia.")]
            in_source = set().union(*(field_docs(c) for c in bases))
            class_docs = " ".join(own_doc(c) for c in bases)
            for field in vars(obj).get("__annotations__", {}):
                if field.startswith("_") or field in in_source:
                    continue
                value = getattr(obj, field, None)
                if inspect.isclass(value) and own_doc(value):
                    continue  # an error family's variant
                if re.search(rf"\b{re.escape(field)}\b", class_docs):
                    continue
                if core is not None and own_doc(getattr(core, field, None)):
                    continue  # a twin field: the core's
                missing.append(f"{name}.{field}")
    return missing


@pytest.mark.parametrize("modname", DOCUMENTED_MODULES)
def test_every_public_class_method_and_field_has_a_docstring(modname):
    assert undocumented(modname) == []


def test_vllm_scheduler_members_have_docstrings():
    # qualia.vllm imports vLLM: read its classes from the source
    missing = []
    for path in (CHECKOUT / "qualia" / "vllm").glob("*.py"):
        tree = ast.parse(path.read_text(encoding="utf-8"))
        for node in tree.body:
            if isinstance(node, (ast.FunctionDef, ast.ClassDef)) and not node.name.startswith("_"):
                if not ast.get_docstring(node):
                    missing.append(f"{path.name}:{node.name}")
                if isinstance(node, ast.ClassDef):
                    for item in node.body:
                        if (isinstance(item, ast.FunctionDef) and not item.name.startswith("_")
                                and not ast.get_docstring(item)):
                            missing.append(f"{path.name}:{node.name}.{item.name}")
    assert missing == []


def test_the_engine_step_and_the_facade_each_describe_their_own_api():
    step, facade = qualia.StepScheduler.__doc__, qualia.Scheduler.__doc__
    for verb in ("add_request", "schedule", "update", "abort", "discard_plan", "run"):
        assert f"``{verb}``" in step, verb
        assert f"``{verb}``" not in facade, verb
    for verb in ("admit", "reserve", "advance", "complete_prefill", "decode", "fork", "finish"):
        assert f"``{verb}``" in facade, verb
        assert f"``{verb}``" not in step, verb


# -- citations of sections -----------------------------------------------------------------------

NAME = r"[\"'][^\"'\n]*[A-Za-z][^\"'\n]*[\"']"
CITATION = re.compile(rf"(?P<page>\w+)\.md[,:]?\s*\(?(?P<names>(?:{NAME}(?:,\s*)?)+)")


def headings(page):
    return [re.sub(r"^#+\s*", "", line).strip()
            for line in page.read_text(encoding="utf-8").splitlines() if line.startswith("#")]


def names_a_section(name, titles):
    # a section is cited by its title, or by the words before a parenthesis or code in it
    # ("Forks in the engine" for "Forks in the engine (`Engine(n=...)`)")
    return any(t == name or t.startswith(name + " (") or t.startswith(name + " `")
               for t in titles)


SOURCES = ("qualia", "csrc", "tests", "bench", "tools", "examples", "docs", ".ci")
SUFFIXES = {".py", ".pyx", ".pxi", ".pxd", ".pyi", ".c", ".h", ".md", ".rst", ".sh"}
SKIPPED = {"build", "_build", "dist", "__pycache__", ".venv-vllm", "_core.c"}


def source_files():
    yield CHECKOUT / "README.md"
    yield CHECKOUT / "setup.py"
    for top in SOURCES:
        for path in sorted((CHECKOUT / top).rglob("*")):
            rel = path.relative_to(CHECKOUT).parts
            if path.is_file() and not SKIPPED & set(rel) and (
                    path.suffix in SUFFIXES or top == ".ci"):
                yield path


def citations():
    for path in source_files():
        text = path.read_text(encoding="utf-8", errors="replace")
        for m in CITATION.finditer(text):
            target = DOCS / f"{m.group('page')}.md"
            if not target.exists():
                continue
            rel = path.relative_to(CHECKOUT).as_posix()
            for name in re.findall(r"[\"']([^\"'\n]+)[\"']", m.group("names")):
                yield rel, text.count("\n", 0, m.start()) + 1, m.group("page"), name


def test_every_cited_section_exists():
    titles = {p.stem: headings(p) for p in DOCS.glob("*.md")}
    wrong = [f"{rel}:{line}: {page}.md {name!r}" for rel, line, page, name in citations()
             if not names_a_section(name, titles[page])]
    assert wrong == [], "\n".join(wrong)


def test_the_citation_pattern_finds_citations():
    assert sum(1 for _ in citations()) > 50


if __name__ == "__main__":  # pragma: no cover - a listing for whoever edits the docs
    for modname in DOCUMENTED_MODULES:
        print(modname, undocumented(modname))
    sys.exit(0)
