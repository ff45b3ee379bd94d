"""Structure gates of a kvhive checkout: how much code one decode step runs, and how the package is shaped.

Measures, for each ``--repo PATH`` (a kvhive checkout; default: the checkout this script is in), in a
subprocess of its own whose ``sys.path`` starts with that checkout, so that two checkouts are compared
side by side in one run (``--repo /work/baseline --repo .``):

1. Runtime trace. One eager decode step of the tiny Llama-GQA (``kvhive.models.tiny_model("llama",
   "gqa")``, torch seed 0), traced with ``sys.setprofile`` (and ``threading.setprofile``): a
   ``--prompt``-token prompt (default 160, random ids with seed 0 as tests/cache/test_decode_host_reads.py
   draws them), budget ``--budget`` (48), ``--warm`` (6) untraced decode steps, then one traced step.
   Counted: the distinct kvhive functions called (code objects whose file lies under the checkout's
   ``kvhive/``; comprehensions, generator expressions and lambdas are part of the function around
   them and are not counted apart), the sum of their source lines (``inspect.getsourcelines`` of each
   code object: decorators, signature, docstring and body) and their files. Configurations:
   ``tova``, ``h2o``, ``buzz``, ``full`` (no compression) and ``snapkv+capacity`` (a prefill-only
   method with ``decode_capacity=16``: the fixed-capacity layout a compiled decode uses; TOVA keeps
   the same layout with or without ``decode_capacity``, so ``tova+capacity`` is measured too).
2. Static shape:
   - files in ``kvhive/`` over 700 lines;
   - functions over 80 lines (``def`` line to last line, decorators not counted) in
     ``kvhive/cache``, ``kvhive/attention`` and ``kvhive/api.py``; Triton kernels and their
     launchers (``@triton.jit`` functions, functions that launch one with ``kernel[grid](...)``,
     functions named ``*kernel*`` in a module that imports triton) listed apart; the package-wide
     count beside it;
   - mode references in branch conditions (``if``/``elif``/``while`` tests, conditional
     expressions, comprehension filters) over ``kvhive/cache``, ``kvhive/attention``,
     ``kvhive/api.py`` and ``kvhive/methods``: each ``Name``/``Attribute`` whose name is in
     ``MODE_FAMILIES``, plus each comparison with ``phases`` (``DECODE in policy.phases``) and each
     comparison of ``positions`` with ``"cache"``/``"original"``; a node is counted once even when
     conditions nest.
3. Imports: the graph of kvhive modules (module-level and function-level imports; imports under
   ``if TYPE_CHECKING:`` are listed but never run, so they close no circle), every elementary circle
   in it, and the private names (``_x``) that one kvhive module imports from, or reads off, another.

    python benchmarks/structure_gates.py --repo /work/baseline --repo . --json results/gates.json

The checkout's own venv runs each worker when it has one (``PATH/.venv/bin/python``), else ``--python``
(default: this interpreter). Only the standard library is used here; the worker needs torch and
transformers, which the venv has.
"""

from __future__ import annotations

import argparse
import ast
import collections
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

CONFIGS = {
    # name: (method, make_cache keyword arguments besides the budget)
    "tova": ("tova", {}),
    "h2o": ("h2o", {}),
    "buzz": ("buzz", {}),
    "full": ("full", {}),
    "tova+capacity": ("tova", {"decode_capacity": 16}),
    "snapkv+capacity": ("snapkv", {"decode_capacity": 16}),
}

# Mode families of the review's table (architecture-review.md §2 item 3). A condition naming one of
# these names branches on a storage mode, a phase or a run-time mode instead of having decided it once.
MODE_FAMILIES: dict[str, set[str]] = {
    "per-row / stacked": {
        "row_lengths_device",
        "has_row_lengths",
        "is_stacked",
        "is_slotted",
        "row_active",
        "row_active_device",
        "grows_in_slots",
        "row_capacity",
        "per_row",
        "decodes_rows_of_different_lengths",
        "_slots",
        "slots_held",
    },
    "static step / compiling": {
        "in_static_step",
        "is_compiling",
        "compiling",
        "static_decode",
        "_static_decode",
        "_compileable",
        "compileable",
        "is_compileable",
        "compiles_kvhive",
        "TORCH_COMPILES_KVHIVE",
        "is_current_stream_capturing",
        "captures_conditional_nodes",
    },
    "prompt chunks / question": {
        "takes_prompt_chunks",
        "question_tokens",
        "prefill_chunk",
        "question",
        "chunk_on_cpu",
        "ran_chunk_on_cpu",
    },
    "decode phase (X in phases)": set(),  # comparisons with `phases` and `policy.phases` tested as a truth
    "fixed / bounded capacity": {
        "fixed_capacity",
        "bounded_capacity",
        "fills_to_budget",
        "declares_capacity",
    },
    "sliding": {"is_sliding", "sliding_window", "compress_sliding"},  # and the constant "sliding" in a comparison
    "hole filling / stored order": {
        "fills_holes",
        "_fills_holes",
        "reads_stored_order",
        "stored_in_order",
        "drops_at_most_one",
        "fill_hole",
    },
    'positions == "cache"': {"CACHE_POSITIONS", "ORIGINAL_POSITIONS"},  # and comparisons, below
    "dense vs packed": {"is_uniform", "is_packed"},
    "stale host mirrors": {"trust_the_device"},  # and every name ending in `_stale`
    "override identity (is Policy.X)": set(),  # `is`/`is not` against an attribute of `Policy`
}
PHASE_FAMILY = "decode phase (X in phases)"
POSITIONS_FAMILY = 'positions == "cache"'
STALE_FAMILY = "stale host mirrors"
OVERRIDE_FAMILY = "override identity (is Policy.X)"
SLIDING_FAMILY = "sliding"
SLIDING_CONSTANTS = {"sliding", "sliding_attention"}
POSITION_MODES = {"cache", "original"}

MODE_SCOPE = ("kvhive/cache", "kvhive/attention", "kvhive/api.py", "kvhive/methods")
FUNCTION_SCOPE = ("kvhive/cache", "kvhive/attention", "kvhive/api.py")
MAX_FILE_LINES = 700
MAX_FUNCTION_LINES = 80
MAX_CYCLES = 200


# ---------------------------------------------------------------------------------------- static
def python_files(repo: Path, scope: tuple[str, ...] = ("kvhive",)) -> list[Path]:
    files: list[Path] = []
    for entry in scope:
        path = repo / entry
        files.extend(sorted(path.rglob("*.py")) if path.is_dir() else [path] if path.exists() else [])
    return files


def relative(repo: Path, path: Path) -> str:
    return path.relative_to(repo).as_posix()


def module_name(repo: Path, path: Path) -> str:
    parts = list(path.relative_to(repo).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def long_files(repo: Path) -> list[dict]:
    rows = []
    for path in python_files(repo):
        lines = len(path.read_text().splitlines())
        if lines > MAX_FILE_LINES:
            rows.append({"file": relative(repo, path), "lines": lines})
    return sorted(rows, key=lambda row: -row["lines"])


def _is_triton_decorator(node: ast.expr) -> bool:
    target = node.func if isinstance(node, ast.Call) else node
    text = ast.unparse(target)
    return text.startswith("triton.") or text.startswith("tl.")


def _functions(tree: ast.AST):
    """Every function with its qualified name (nested ones included)."""
    stack: list[tuple[ast.AST, str]] = [(tree, "")]
    while stack:
        node, prefix = stack.pop()
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                name = f"{prefix}{child.name}"
                yield child, name
                stack.append((child, f"{name}.<locals>."))
            elif isinstance(child, ast.ClassDef):
                stack.append((child, f"{prefix}{child.name}."))
            else:
                stack.append((child, prefix))


def long_functions(repo: Path, scope: tuple[str, ...]) -> tuple[list[dict], list[dict]]:
    """Functions over MAX_FUNCTION_LINES: (others, Triton kernels and launchers)."""
    others, triton_rows = [], []
    for path in python_files(repo, scope):
        source = path.read_text()
        tree = ast.parse(source)
        imports_triton = any(
            (isinstance(node, ast.Import) and any(alias.name.split(".")[0] == "triton" for alias in node.names))
            or (isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "triton")
            for node in ast.walk(tree)
        )
        functions = list(_functions(tree))
        jitted = {f.name for f, _ in functions if any(_is_triton_decorator(d) for d in f.decorator_list)}
        for function, name in functions:
            lines = function.end_lineno - function.lineno + 1
            if lines <= MAX_FUNCTION_LINES:
                continue
            launches = any(
                isinstance(call, ast.Call)
                and isinstance(call.func, ast.Subscript)
                and isinstance(call.func.value, (ast.Name, ast.Attribute))
                and (call.func.value.id if isinstance(call.func.value, ast.Name) else call.func.value.attr) in jitted
                for call in ast.walk(function)
            )
            row = {"function": name, "file": relative(repo, path), "line": function.lineno, "lines": lines}
            is_triton = function.name in jitted or launches or (imports_triton and "kernel" in function.name)
            (triton_rows if is_triton else others).append(row)
    key = lambda row: -row["lines"]  # noqa: E731
    return sorted(others, key=key), sorted(triton_rows, key=key)


def _condition_roots(tree: ast.AST) -> list[ast.expr]:
    roots: list[ast.expr] = []
    for node in ast.walk(tree):
        if isinstance(node, (ast.If, ast.While, ast.IfExp)):
            roots.append(node.test)
        elif isinstance(node, ast.comprehension):
            roots.extend(node.ifs)
    return roots


def _name_of(node: ast.AST) -> str | None:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        return node.attr
    return None


def _family_of_name(name: str) -> str | None:
    if name.endswith("_stale"):
        return STALE_FAMILY
    for family, names in MODE_FAMILIES.items():
        if name in names:
            return family
    return None


def _family_of(node: ast.AST) -> str | None:
    """The mode family a node of a branch condition references, if any."""
    if isinstance(node, ast.Compare):
        operands = [node.left, *node.comparators]
        names = {_name_of(operand) for operand in operands}
        strings = {o.value for o in operands if isinstance(o, ast.Constant) and isinstance(o.value, str)}
        if "phases" in names and any(isinstance(op, (ast.In, ast.NotIn)) for op in node.ops):
            return PHASE_FAMILY
        if names & {"positions", "_positions"} and strings & POSITION_MODES:
            return POSITIONS_FAMILY
        if strings & SLIDING_CONSTANTS:
            return SLIDING_FAMILY
        if any(isinstance(op, (ast.Is, ast.IsNot)) for op in node.ops) and any(
            isinstance(o, ast.Attribute) and _name_of(o.value) == "Policy" for o in operands
        ):
            return OVERRIDE_FAMILY
        return None
    name = _name_of(node)
    if name == "phases":  # `if policy.phases:` (a method that compresses at all); comparisons are above
        return PHASE_FAMILY
    return _family_of_name(name) if name else None


def mode_references(repo: Path) -> dict:
    """Mode references in branch conditions, per family and per file, with every hit."""
    per_family: collections.Counter = collections.Counter()
    per_file: collections.Counter = collections.Counter()
    hits = []
    for path in python_files(repo, MODE_SCOPE):
        tree = ast.parse(path.read_text())
        counted: set[int] = set()
        for root in _condition_roots(tree):
            for node in ast.walk(root):
                if id(node) in counted:
                    continue
                family = _family_of(node)
                if family is None:
                    continue
                counted.update(id(sub) for sub in ast.walk(node))  # `a.b.mode` or a comparison: one reference
                per_family[family] += 1
                per_file[relative(repo, path)] += 1
                hits.append(f"{relative(repo, path)}:{node.lineno} [{family}] {ast.unparse(node)[:60]}")
    return {
        "total": sum(per_family.values()),
        "per_family": {family: per_family.get(family, 0) for family in MODE_FAMILIES},
        "per_file": dict(per_file.most_common()),
        "hits": hits,
    }


def _type_checking_blocks(tree: ast.AST) -> set[int]:
    """ids of the import nodes inside ``if TYPE_CHECKING:`` blocks."""
    inside: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            for statement in node.body:
                inside.update(id(sub) for sub in ast.walk(statement))
    return inside


def _imports_with_level(tree: ast.AST):
    """(import node, at module level?) for every import, module-level meaning outside any function."""
    stack: list[tuple[ast.AST, bool]] = [(tree, True)]
    while stack:
        node, module_level = stack.pop()
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.Import, ast.ImportFrom)):
                yield child, module_level
            in_function = isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
            stack.append((child, module_level and not in_function))


def _resolve(importer: str, is_package: bool, node: ast.ImportFrom) -> str:
    if not node.level:
        return node.module or ""
    base = importer.split(".") if is_package else importer.split(".")[:-1]
    base = base[: len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def import_graph(repo: Path) -> dict:
    """Edges between kvhive modules, circles, and private names used across modules."""
    paths = {module_name(repo, path): path for path in python_files(repo)}
    modules = set(paths)
    edges: dict[tuple[str, str], set[str]] = collections.defaultdict(set)  # (a, b) -> {"module", "function", "type"}
    private_imports, private_reads = [], []
    private_definitions: dict[str, set[str]] = collections.defaultdict(set)
    trees = {name: ast.parse(path.read_text()) for name, path in paths.items()}
    for name, tree in trees.items():  # private names each module defines (functions, classes, attributes)
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                private_definitions[node.name].add(name)
            elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
                private_definitions[node.id].add(name)
            elif (
                isinstance(node, ast.Attribute)
                and isinstance(node.ctx, ast.Store)
                and isinstance(node.value, ast.Name)
                and node.value.id in {"self", "cls"}
            ):  # an attribute a class of this module sets on itself (not one it sets on a library's object)
                private_definitions[node.attr].add(name)
    for importer, tree in trees.items():
        is_package = paths[importer].name == "__init__.py"
        type_only = _type_checking_blocks(tree)
        module_aliases: dict[str, str] = {}  # local name -> kvhive module it names
        for node, module_level in _imports_with_level(tree):
            kind = "type" if id(node) in type_only else "module" if module_level else "function"
            if isinstance(node, ast.Import):
                for alias in node.names:
                    if alias.name.split(".")[0] != "kvhive" or alias.name not in modules:
                        continue
                    edges[(importer, alias.name)].add(kind)
                    if alias.asname:
                        module_aliases[alias.asname] = alias.name
                continue
            source = _resolve(importer, is_package, node)
            if source.split(".")[0] != "kvhive":
                continue
            for alias in node.names:
                submodule = f"{source}.{alias.name}"
                if submodule in modules:
                    edges[(importer, submodule)].add(kind)
                    module_aliases[alias.asname or alias.name] = submodule
                elif source in modules:
                    edges[(importer, source)].add(kind)
                    if _is_private(alias.name) and source != importer:
                        private_imports.append(
                            f"{relative(repo, paths[importer])}:{node.lineno} from {source} import {alias.name} ({kind})"
                        )
        for node in ast.walk(tree):
            if not (isinstance(node, ast.Attribute) and _is_private(node.attr)):
                continue
            owner = _name_of(node.value) if isinstance(node.value, ast.Name) else None
            where = f"{relative(repo, paths[importer])}:{node.lineno} {ast.unparse(node)[:70]}"
            if owner in module_aliases and module_aliases[owner] != importer:
                private_reads.append(("module attribute", where))
            elif owner not in {"self", "cls"} and importer not in private_definitions.get(node.attr, set()):
                if private_definitions.get(node.attr):
                    defined_in = ",".join(sorted(private_definitions[node.attr]))
                    private_reads.append(("another module's member", f"{where}  (defined in {defined_in})"))
    runtime = {edge for edge, kinds in edges.items() if kinds - {"type"}}
    module_level = {edge for edge, kinds in edges.items() if "module" in kinds}
    cycles = _elementary_cycles(runtime)
    return {
        "modules": len(modules),
        "edges": len(runtime),
        "cycles": [
            {
                "modules": cycle,
                "edges": [sorted(edges[(a, b)] - {"type"}) for a, b in zip(cycle, cycle[1:] + cycle[:1], strict=True)],
                "import_time": all((a, b) in module_level for a, b in zip(cycle, cycle[1:] + cycle[:1], strict=True)),
            }
            for cycle in cycles
        ],
        "type_checking_edges": sorted(f"{a} -> {b}" for (a, b), kinds in edges.items() if kinds == {"type"}),
        "private_imports": private_imports,
        "private_reads": [where for _, where in private_reads],
        "private_read_kinds": dict(collections.Counter(kind for kind, _ in private_reads)),
    }


def _is_private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__") and name != "_"


def _elementary_cycles(edges: set[tuple[str, str]]) -> list[list[str]]:
    """Every elementary circle (at most MAX_CYCLES), each from its smallest module, shortest first."""
    successors: dict[str, list[str]] = collections.defaultdict(list)
    for a, b in sorted(edges):
        successors[a].append(b)
    cycles: list[list[str]] = []
    for start in sorted(successors):
        # Circles whose smallest module is `start`: a depth-first search over modules > start.
        stack = [(start, [start], iter(successors[start]))]
        while stack and len(cycles) < MAX_CYCLES:
            node, path, children = stack[-1]
            child = next(children, None)
            if child is None:
                stack.pop()
            elif child == start:
                cycles.append(list(path))
            elif child > start and child not in path:
                stack.append((child, [*path, child], iter(successors[child])))
    return sorted(cycles, key=lambda cycle: (len(cycle), cycle))


# --------------------------------------------------------------------------------------- runtime
def trace_decode_step(repo: Path, config: str, prompt: int, budget: int, warm: int) -> dict:
    import inspect
    import threading
    import warnings

    import torch

    import kvhive
    from kvhive.models import tiny_model

    package = Path(kvhive.__file__).resolve().parent
    if package != (repo / "kvhive").resolve():
        raise SystemExit(f"imported kvhive from {package}, not from {repo}")
    method, options = CONFIGS[config]
    torch.manual_seed(0)
    model = tiny_model("llama", "gqa")
    ids = torch.randint(3, model.config.vocab_size, (1, prompt), generator=torch.Generator().manual_seed(0))
    key = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        cache = kvhive.make_cache(model, method, budget=None if method == "full" else budget, **options)
        prefix = str(package) + os.sep
        files: dict[str, bool] = {}
        seen: dict = {}

        def profile(frame, event, arg):
            if event != "call":
                return
            code = frame.f_code
            inside = files.get(code.co_filename)
            if inside is None:
                inside = files[code.co_filename] = os.path.realpath(code.co_filename).startswith(prefix)
            if inside:
                seen[code] = seen.get(code, 0) + 1

        with torch.no_grad():
            token = model(input_ids=ids, **{key: cache}, use_cache=True).logits[:, -1:].argmax(-1)
            for _ in range(warm):
                token = model(input_ids=token, **{key: cache}, use_cache=True).logits[:, -1:].argmax(-1)
            threading.setprofile(profile)
            sys.setprofile(profile)
            try:
                model(input_ids=token, **{key: cache}, use_cache=True)
            finally:
                sys.setprofile(None)
                threading.setprofile(None)
    functions, skipped = [], 0
    for code, calls in seen.items():
        if code.co_name.startswith("<"):  # <listcomp>, <genexpr>, <lambda>: inside a counted function
            skipped += 1
            continue
        lines = len(inspect.getsourcelines(code)[0])
        path = Path(os.path.realpath(code.co_filename)).relative_to(package.parent).as_posix()
        functions.append(
            {"file": path, "line": code.co_firstlineno, "function": code.co_qualname, "lines": lines, "calls": calls}
        )
    functions.sort(key=lambda row: (row["file"], row["line"]))
    per_file = collections.defaultdict(lambda: [0, 0])
    for row in functions:
        per_file[row["file"]][0] += 1
        per_file[row["file"]][1] += row["lines"]
    return {
        "config": config,
        "method": method,
        "options": options,
        "functions": len(functions),
        "lines": sum(row["lines"] for row in functions),
        "files": len(per_file),
        "per_file": {path: {"functions": n, "lines": lines} for path, (n, lines) in sorted(per_file.items())},
        "inner_code_objects_skipped": skipped,
        "trace": [f"{row['file']}:{row['line']} {row['function']} ({row['lines']} lines)" for row in functions],
    }


def worker(repo: Path, configs: list[str], prompt: int, budget: int, warm: int) -> dict:
    import platform

    import torch
    import transformers

    commit = subprocess.run(
        ["git", "-C", str(repo), "rev-parse", "--short", "HEAD"], capture_output=True, text=True
    ).stdout.strip()
    dirty = subprocess.run(
        ["git", "-C", str(repo), "status", "--porcelain", "--untracked-files=no", "kvhive"],
        capture_output=True,
        text=True,
    ).stdout.strip()
    others, triton_rows = long_functions(repo, FUNCTION_SCOPE)
    package_others, package_triton = long_functions(repo, ("kvhive",))
    return {
        "repo": str(repo),
        "commit": commit + ("+dirty" if dirty else ""),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "trace_setup": {"prompt": prompt, "budget": budget, "warm_steps": warm, "model": "tiny llama gqa"},
        "trace": {config: trace_decode_step(repo, config, prompt, budget, warm) for config in configs},
        "long_files": long_files(repo),
        "long_functions": others,
        "long_triton_functions": triton_rows,
        "long_functions_package": len(package_others) + len(package_triton),
        "mode_references": mode_references(repo),
        "imports": import_graph(repo),
    }


# ---------------------------------------------------------------------------------------- report
def interpreter_for(repo: Path, fallback: str) -> str:
    own = repo / ".venv" / "bin" / "python"
    return str(own) if own.exists() else fallback


def run_worker(repo: Path, args) -> dict:
    with tempfile.TemporaryDirectory() as scratch:
        out = Path(scratch) / "gates.json"
        environment = dict(os.environ, PYTHONPATH=os.pathsep.join([str(repo), os.environ.get("PYTHONPATH", "")]))
        environment.setdefault("OMP_NUM_THREADS", "1")
        command = [
            interpreter_for(repo, args.python),
            str(Path(__file__).resolve()),
            "--worker",
            str(out),
            "--repo",
            str(repo),
            "--configs",
            args.configs,
            "--prompt",
            str(args.prompt),
            "--budget",
            str(args.budget),
            "--warm",
            str(args.warm),
        ]
        done = subprocess.run(command, env=environment, cwd=scratch, capture_output=True, text=True)
        if done.returncode:
            raise SystemExit(f"worker for {repo} failed ({done.returncode}):\n{done.stderr[-4000:]}")
        return json.loads(out.read_text())


def print_report(results: list[dict], verbose: bool) -> None:
    width = 22
    names = [f"{Path(r['repo']).name}@{r['commit']}" for r in results]
    header = f"{'':38s}" + "".join(f"{name[:width]:>{width}s}" for name in names)

    def row(label: str, values) -> None:
        print(f"{label:38s}" + "".join(f"{str(value):>{width}s}" for value in values))

    first = results[0]
    setup = first["trace_setup"]
    print(
        f"torch {first['torch']}, transformers {first['transformers']}, python {first['python']}; trace: "
        f"{setup['model']}, prompt {setup['prompt']}, budget {setup['budget']}, {setup['warm_steps']} warm steps"
    )
    print(header)
    print("one eager decode step: functions / lines / files (gate: tova <= 30 / 350, full <= 20 functions)")
    for config in first["trace"]:
        row(
            f"  {config}",
            [
                "{functions} / {lines} / {files}".format(**r["trace"][config]) if config in r["trace"] else "-"
                for r in results
            ],
        )
    print("static")
    row(f"  files over {MAX_FILE_LINES} lines (gate 0)", [len(r["long_files"]) for r in results])
    row(
        f"  functions over {MAX_FUNCTION_LINES} (cache/attention/api)",
        [f"{len(r['long_functions'])} (+{len(r['long_triton_functions'])} triton)" for r in results],
    )
    row(f"  functions over {MAX_FUNCTION_LINES}, whole package", [r["long_functions_package"] for r in results])
    row("  mode refs in conditions (gate 60)", [r["mode_references"]["total"] for r in results])
    for family in MODE_FAMILIES:
        row(f"    {family}", [r["mode_references"]["per_family"].get(family, 0) for r in results])
    print("imports")
    row("  import circles (gate 0)", [len(r["imports"]["cycles"]) for r in results])
    row("    of them at import time", [sum(c["import_time"] for c in r["imports"]["cycles"]) for r in results])
    row("  private names imported across", [len(r["imports"]["private_imports"]) for r in results])
    row("  private members read across", [len(r["imports"]["private_reads"]) for r in results])
    for name, r in zip(names, results, strict=True):
        print(f"\n== {name} ({r['repo']})")
        for config, trace in r["trace"].items():
            files = ", ".join(f"{Path(p).name} {v['functions']}/{v['lines']}" for p, v in trace["per_file"].items())
            print(f"  {config}: {files}")
        print("  files over 700: " + ", ".join(f"{f['file']} {f['lines']}" for f in r["long_files"]))
        print("  functions over 80 (cache/attention/api):")
        for f in r["long_functions"]:
            print(f"    {f['lines']:4d}  {f['file']}:{f['line']} {f['function']}")
        for f in r["long_triton_functions"]:
            print(f"    {f['lines']:4d}  {f['file']}:{f['line']} {f['function']}  (triton)")
        print(
            "  mode references per file: " + ", ".join(f"{k} {v}" for k, v in r["mode_references"]["per_file"].items())
        )
        print("  import circles:")
        for cycle in r["imports"]["cycles"]:
            arrows = " -> ".join(cycle["modules"] + cycle["modules"][:1])
            kinds = "/".join(",".join(k) for k in cycle["edges"])
            print(f"    {arrows}   [{kinds}]{'  import time' if cycle['import_time'] else ''}")
        print("  private names imported across modules:")
        for line in r["imports"]["private_imports"]:
            print(f"    {line}")
        print(f"  private members read across modules: {r['imports']['private_read_kinds']}")
        if verbose:
            for line in r["imports"]["private_reads"]:
                print(f"    {line}")
            print("  mode references:")
            for line in r["mode_references"]["hits"]:
                print(f"    {line}")
            for config, trace in r["trace"].items():
                print(f"  trace {config}:")
                for line in trace["trace"]:
                    print(f"    {line}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repo", action="append", default=None, help="a kvhive checkout; repeat to compare")
    parser.add_argument("--configs", default=",".join(CONFIGS), help=f"of {', '.join(CONFIGS)}")
    parser.add_argument("--prompt", type=int, default=160)
    parser.add_argument("--budget", type=int, default=48)
    parser.add_argument("--warm", type=int, default=6, help="untraced decode steps before the traced one")
    parser.add_argument("--python", default=sys.executable, help="interpreter for a checkout without .venv")
    parser.add_argument("--json", default=None, help="write every measurement (all hits and traces) here")
    parser.add_argument("--verbose", action="store_true", help="print every mode reference and traced function")
    parser.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    configs = [c for c in args.configs.split(",") if c]
    unknown = sorted(set(configs) - set(CONFIGS))
    if unknown:
        raise SystemExit(f"--configs: unknown {unknown}; known: {', '.join(CONFIGS)}")
    repos = [Path(r).resolve() for r in (args.repo or [Path(__file__).resolve().parent.parent])]
    if args.worker:
        result = worker(repos[0], configs, args.prompt, args.budget, args.warm)
        Path(args.worker).write_text(json.dumps(result, indent=1))
        return
    results = [run_worker(repo, args) for repo in repos]
    print_report(results, args.verbose)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1) + "\n")


if __name__ == "__main__":
    main()
