"""
The connection-settings tables of the backend pages under docs/backends/, made from each backend's
settings table (``hooks/forms/<backend>.py``), so a page never documents a setting the form lacks.

A page marks where its table goes with ``<!-- settings:<forms module> -->`` and ``<!-- /settings -->``; a
backend on another provider's connection type names its settings module (one with ``SETTINGS``) instead.
``python tests/docs/settings_tables.py`` rewrites every marked table; ``test_docs.py`` fails while a
page's table differs from what this makes.
"""

from __future__ import annotations

import importlib
import inspect
import re
import sys
from pathlib import Path

DOCS = Path(__file__).resolve().parents[2] / "docs"
MARKED = re.compile(r"(<!-- settings:(?P<module>[\w.]+) -->\n)(?P<body>.*?)(<!-- /settings -->)", re.S)
_KIND = {
    int: "whole number",
    float: "number",
    str: "text",
    bool: "true / false",
    list: "JSON list",
    dict: "JSON object",
}


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def table(module: str) -> str:
    """The markdown table of the settings of the connection form in ``module``."""
    from sandbox_provider.hooks import BACKENDS, hook_class, hook_classes

    found = importlib.import_module(module)
    form = getattr(found, "FORM", None)
    if form is not None:
        hook = hook_class(next(path for path, forms in BACKENDS.items() if forms == module))
        settings = form.settings
    else:  # a backend on another provider's connection type: its settings module's table, no form of ours
        settings = found.SETTINGS
        hook = next(cls for cls in hook_classes() if cls.settings is settings)
    taken = inspect.signature(hook.__init__).parameters
    rows = [
        "| extra | form label | kind | what it does | default | hook argument |",
        "|---|---|---|---|---|---|",
    ]
    for setting in settings:
        kind = _KIND[setting.kind] + (f", {setting.unit}" if setting.unit else "")
        if setting.choices:
            kind += ": " + ", ".join(f"`{c}`" for c in setting.choices)
        label = setting.label if setting.form else "(no form field)"
        rows.append(
            f"| `{setting.name}` | {_cell(label)} | {kind} | {_cell(setting.help)} | {_cell(setting.default_words)} | "
            f"{'yes' if setting.name in taken else 'no'} |"
        )
    if form is None:
        intro = (
            f"The settings, each an argument of `{hook.__name__}` or an extra of its `{hook.conn_type}` "
            "connection (whose form is another provider's: set the extras in the connection's JSON); the argument "
            "wins over the extra:\n\n"
        )
    else:
        intro = (
            f"The `{form.conn_type}` connection's extras, each a field of its form; where `{hook.__name__}` takes "
            "an argument of the same name, the argument wins over the extra:\n\n"
        )
    return intro + "\n".join(rows) + "\n"


def rendered(text: str) -> str:
    """``text`` with every marked table made anew."""
    return MARKED.sub(lambda m: m.group(1) + "\n" + table(m.group("module")) + "\n" + m.group(4), text)


def pages() -> list[Path]:
    """The pages holding a marked table."""
    return sorted(p for p in DOCS.rglob("*.md") if MARKED.search(p.read_text(encoding="utf-8")))


def main() -> int:
    sys.path.insert(0, str(DOCS.parent / "src"))
    for page in pages():
        text = page.read_text(encoding="utf-8")
        new = rendered(text)
        if new != text:
            page.write_text(new, encoding="utf-8")
            print(f"rewrote {page.relative_to(DOCS.parent)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
