"""What a script job uses from its folder but does not send: checked at `gpuforge submit`, where the folder
is, not on the server, where a module or folder left out of `script.files` would fail the job minutes
later with a traceback (run by hand, the same script finds it in place).

An error (submit refuses):
- a path the command names that exists in the job's folder (`--config conf/a.yaml`, `--data data/`,
  `./run.sh`) and that nothing in `script.files` covers;
- a module the script imports, followed from its entry point (`python train.py`, `python -m pkg.train`)
  through the job's own modules, found in the job's folder the way Python would find it (the script's
  folder, the working folder for -m, script.env's PYTHONPATH, `sys.path.insert(0, "lib")`), not sent.
A warning (submit goes on): a text in the sent code that names a path of the job's folder not sent, such
as open("data/rows.txt"): it may be an output the script writes, which a server run makes itself.

The server checks what it can without the folder (`entry_not_sent`): that the file the command runs was
sent.
"""

from __future__ import annotations

import ast
import os
import re
import shlex
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath

from gpuforge.errors import SpecError
from gpuforge.spec import ScriptJobSpec, working_copy_files

MAX_SCANNED = 500  # modules followed from the entry point: a job's own code, not a vendored library
MAX_SOURCE_BYTES = 2 * 2**20  # a module larger than this is not parsed (generated code)
OUTPUT_OPTION = re.compile(r"^--?(out|save|log|checkpoint|ckpt|result|export|tensorboard)", re.IGNORECASE)


@dataclass
class Findings:
    errors: list[str] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)
    told: set[str] = field(default_factory=set)  # paths said already: each once

    def missing(self, rel: str, why: str, sent: set[str], warning: bool = False) -> None:
        """`why` uses `rel`, which is not sent: said once, with what to add to script.files (the
        outermost folder of it that nothing is sent from)."""
        if rel in self.told:
            return
        self.told.add(rel)
        add = rel
        for parent in PurePosixPath(rel).parents:
            if str(parent) != "." and not _covered(str(parent), sent):
                add = str(parent)
        if warning:
            self.warnings.append(
                f"{why}, which script.files does not send (an input the server's run lacks?)"
            )
        else:
            self.errors.append(f"{why}, which script.files does not send: add {add} to script.files")


def check_sent(spec: ScriptJobSpec) -> list[str]:
    """Refuse (SpecError naming each) a script job whose command or imports need a path of its folder
    that `script.files` leaves out; the warnings, for the caller to print."""
    found = unsent(spec, Path(spec.script.workdir))
    if found.errors:
        raise SpecError("; ".join(found.errors))
    return found.warnings


def unsent(spec: ScriptJobSpec, workdir: Path) -> Findings:
    """What the job in `workdir` uses but would not send."""
    root = workdir.resolve()
    sent = set(working_copy_files(spec.script, root))  # a path script.files names but lacks: its own error
    found = Findings()
    argv = _words(spec.script.command)
    for word, output in _path_words(argv):
        rel = _inside(root, root / word)
        if rel is not None and not _covered(rel, sent):
            found.missing(rel, f"script.command names {word}", sent, warning=output)
    _follow_imports(argv, spec, root, sent, found)
    return found


def entry_not_sent(spec: ScriptJobSpec, sent: set[str]) -> str | None:
    """The file the command runs (`python train.py`: train.py; `./run.sh`), where it is a relative path
    that is not among the files sent; None when it was sent or the command runs a program on PATH."""
    argv = _words(spec.script.command)
    entry = _entry_script(argv)
    if entry is None and argv and "/" in argv[0] and not argv[0].startswith("/"):
        entry = argv[0]
    if entry is None or entry.startswith("/"):
        return None
    rel = os.path.normpath(entry)
    if rel.startswith("..") or _covered(PurePosixPath(rel).as_posix(), sent):
        return None
    return f"script.command runs {entry}, which script.files does not send: add it to script.files"


# --- the command ---
def _words(command: str) -> list[str]:
    try:
        return shlex.split(command)
    except ValueError as err:
        raise SpecError(f"script.command: {err}") from None


def _is_python(program: str) -> bool:
    return Path(program).name.startswith("python")


def _entry_script(argv: list[str]) -> str | None:
    """The file a `python [options] FILE` command runs (None for -c or -m)."""
    if not argv or not _is_python(argv[0]):
        return None
    words = iter(argv[1:])
    for word in words:
        if word in ("-c", "-m"):
            return None
        if word in ("-W", "-X"):  # the options that take a value of their own
            next(words, None)
        elif not word.startswith("-"):
            return word
    return None


def _entry_module(argv: list[str]) -> str | None:
    if argv and _is_python(argv[0]) and "-m" in argv[:-1]:
        return argv[argv.index("-m") + 1]
    return None


def _path_words(argv: list[str]) -> list[tuple[str, bool]]:
    """The words of the command that may name a path, each with whether it is an option's value that
    reads as an output (`--out runs/x`, `--log-dir=logs`: a folder a run by hand left, which a server's run
    makes itself): the arguments, and the program itself where it is a relative path (./run.sh)."""
    words = [(argv[0], False)] if argv and "/" in argv[0] else []
    option = ""
    for word in argv[1:]:
        if word.startswith("-"):
            option, _, word = word.partition("=")
        elif not option.startswith("-"):
            option = ""
        if word and not word.startswith("/"):
            words.append((word, bool(OUTPUT_OPTION.match(option))))
            option = ""
    return words


# --- paths ---
def _inside(root: Path, path: Path) -> str | None:
    """`path` relative to `root` (POSIX, without . or ..) where it exists inside it, else None."""
    rel = os.path.normpath(os.path.relpath(os.path.abspath(path), root))
    if rel == "." or rel.startswith(".."):
        return None
    try:
        exists = (root / rel).exists()
    except (OSError, ValueError):  # a name too long for a path, or a text that is no path at all
        return None
    return PurePosixPath(Path(rel).as_posix()).as_posix() if exists else None


def _covered(rel: str, sent: set[str]) -> bool:
    """Whether the file `rel`, or something under the folder `rel`, is sent."""
    return rel in sent or any(s.startswith(rel + "/") for s in sent)


# --- imports ---
def _follow_imports(argv: list[str], spec: ScriptJobSpec, root: Path, sent: set[str], found: Findings):
    """From the entry point through each of the job's own modules it reaches: each module found in the
    job's folder and not sent is an error; texts naming a local path not sent are warnings."""
    script, module = _entry_script(argv), _entry_module(argv)
    if script is not None and script.endswith(".py"):
        first = root / script
        dirs = [first.parent]  # `python dir/train.py` puts dir on sys.path, not the working folder
    elif module is not None:
        dirs = [root]  # -m: the working folder
        first = None
    else:
        return
    python_path = spec.script.env.get("PYTHONPATH", "")
    dirs += [root / p for p in python_path.split(os.pathsep) if p and not os.path.isabs(p)]
    queue: list[Path] = []
    if first is not None:
        queue.append(first)
    else:
        queue += _resolve(module.split("."), dirs, root, sent, f"python -m {module}", found)
    seen: set[Path] = set()
    while queue and len(seen) < MAX_SCANNED:
        path = queue.pop()
        if path in seen or _inside(root, path) not in sent:
            continue
        seen.add(path)
        tree = _parse(path)
        if tree is None:
            continue
        name = _inside(root, path)
        added = _sys_path_additions(tree)
        dirs += [root / d for d in added if root / d not in dirs]
        for parts, base, shown in _imports(tree, path):
            where = [base] if base is not None else dirs
            queue += _resolve(parts, where, root, sent, f"{name} imports {shown}", found)
        for text in dict.fromkeys(t for t in _path_texts(tree) if t not in added):  # added: its imports say
            rel = _inside(root, root / text)
            if rel is not None and not _covered(rel, sent):
                found.missing(rel, f"{name} names {text!r}", sent, warning=True)


def _parse(path: Path) -> ast.Module | None:
    try:
        if path.stat().st_size > MAX_SOURCE_BYTES:
            return None
        return ast.parse(path.read_bytes(), filename=str(path))
    except (OSError, SyntaxError, ValueError):
        return None  # the script's own error, which its run reports


def _imports(tree: ast.Module, path: Path) -> list[tuple[list[str], Path | None, str]]:
    """(dotted name as parts, the folder a relative import starts in, else None, the name as written) of
    each import, a `from X import Y` also as X.Y (Y may be a module)."""
    found: list[tuple[list[str], Path | None, str]] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(alias.name.split("."), None, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = None
            if node.level:
                base = path.parent
                for _ in range(node.level - 1):
                    base = base.parent
            parts = node.module.split(".") if node.module else []
            dots = "." * node.level
            if parts:
                found.append((parts, base, dots + node.module))
            for alias in node.names:
                if alias.name != "*":
                    name = f"{node.module}.{alias.name}" if node.module else alias.name
                    found.append((parts + [alias.name], base, dots + name))
    return found


def _resolve(
    parts: list[str], dirs: list[Path], root: Path, sent: set[str], what: str, found: Findings
) -> list[Path]:
    """The job's own module files `parts` reaches, found as Python would in the first of `dirs` that
    holds its first part; an error for each piece on the way that is in the folder but not sent."""
    for d in dirs:
        chain = _chain(d, parts)
        if not chain:
            continue
        modules = []
        for piece in chain:
            rel = _inside(root, piece)
            if rel is None:
                return []  # outside the job's folder: the environment's, not the job's to send
            if not _covered(rel, sent):
                found.missing(rel, f"{what} ({rel})", sent)
                return []
            if piece.suffix == ".py":
                modules.append(piece)
        return modules
    return []


def _chain(folder: Path, parts: list[str]) -> list[Path]:
    """The folders and the module file that `parts` walks through under `folder` (a package's
    __init__.py too), as far as they exist there."""
    chain: list[Path] = []
    at = folder
    for part in parts:
        if (at / part).is_dir():
            at = at / part
            chain.append(at)
            if (at / "__init__.py").is_file():
                chain.append(at / "__init__.py")
        elif (at / f"{part}.py").is_file():
            chain.append(at / f"{part}.py")
            break
        else:
            break
    return chain


def _sys_path_additions(tree: ast.Module) -> list[str]:
    """The relative folders a module puts on sys.path by text: sys.path.insert(0, "lib"), .append("lib")."""
    found = []
    for node in ast.walk(tree):
        if (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute)
            and node.func.attr in ("insert", "append")
            and ast.unparse(node.func.value) == "sys.path"
            and node.args
            and isinstance(last := node.args[-1], ast.Constant)
            and isinstance(last.value, str)
            and last.value
            and not os.path.isabs(last.value)
        ):
            found.append(last.value)
    return found


def _path_texts(tree: ast.Module) -> list[str]:
    """The texts in a module that look like a relative path of a file or folder ("data/rows.txt")."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant) and isinstance(node.value, str):
            text = node.value
            if 0 < len(text) < 256 and "\n" not in text and not text.startswith(("/", "-")):
                found.append(text)
    return found
