"""Product code speaks in the present tense: no dates, session counts, commit hashes, issue
numbers or result-file names in the comments and docstrings of the product packages. History
belongs in git; figures belong in docs/ and bench/results/INDEX.md.

Usage: python .ci/present_tense.py [PATH ...]   (default: the product packages). Exit 1 on a hit."""

import ast
import io
import re
import sys
import tokenize
from pathlib import Path

PACKAGES = ("jobs", "ring_worker", "admission", "cli")
LAB_NOTES = {
    "a date": re.compile(r"\b20\d\d-[01]\d-[0-3]\d\b"),
    "a session count": re.compile(
        r"\b(?:this|last|previous|next|\w+(?:st|nd|rd|th)|first|second|third|\w+teenth|"
        r"twenty|twentieth|twenty-\w+)\s+session\b",
        re.IGNORECASE,
    ),
    "a commit hash": re.compile(
        r"(?<![\w-])(?=[0-9a-f]*[a-f])(?=[0-9a-f]*\d)[0-9a-f]{7,40}(?![\w-])"
    ),
    "an issue number": re.compile(r"\bissue\s+#?\d+|\(#\d+\)", re.IGNORECASE),
    "a result file": re.compile(r"bench/results"),
}


def notes(source: str) -> list[tuple[int, str]]:
    """(line, text) of every comment and docstring in `source`."""
    found = [
        (tok.start[0], tok.string)
        for tok in tokenize.generate_tokens(io.StringIO(source).readline)
        if tok.type == tokenize.COMMENT
    ]
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef):
            first = node.body[0] if node.body else None
            value = first.value if isinstance(first, ast.Expr) else None
            if isinstance(value, ast.Constant) and isinstance(value.value, str):
                found.append((value.lineno, value.value))
    return found


def hits(path: Path) -> list[str]:
    out = []
    for line, text in notes(path.read_text()):
        for what, pattern in LAB_NOTES.items():
            for match in pattern.finditer(text):
                out.append(f"{path}:{line}: {what} in a comment or docstring: {match.group(0)!r}")
    return out


def main(argv: list[str]) -> int:
    roots = [Path(arg) for arg in argv] or [Path(p) for p in PACKAGES]
    files = [f for root in roots for f in ([root] if root.is_file() else root.rglob("*.py"))]
    found = [hit for f in sorted(files) for hit in hits(f)]
    print("\n".join(found) or f"present tense: {len(files)} files clean")
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
