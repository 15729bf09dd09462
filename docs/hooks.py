"""MkDocs hooks: pages generated from the code, so they cannot drift from it, and the measured results.

The pictures in `benchmarks/results/` are served as `results/NAME.png` (pages link them there).

`<!-- config-reference -->` in a page becomes the table of every config field (its dotted key, default
and documentation), read from the config's own pydantic field descriptions: the same text as
`tianji train --help`.
"""

from __future__ import annotations

from pathlib import Path

from mkdocs.structure.files import File

from tianji.config import describe_fields

MARKER = "<!-- config-reference -->"
BENCHMARKS = Path(__file__).parents[1] / "benchmarks"


def config_reference() -> str:
    rows = ["| field | default | what it does |", "|---|---|---|"]
    for key, default, doc in describe_fields():
        rows.append(f"| `{key}` | `{default}` | {doc.replace('|', '&#124;')} |")
    return "\n".join(rows)


def on_page_markdown(markdown: str, page, config, files) -> str:
    return markdown.replace(MARKER, config_reference()) if MARKER in markdown else markdown


def on_files(files, config):
    for picture in sorted((BENCHMARKS / "results").glob("*.png")):
        files.append(File(f"results/{picture.name}", str(BENCHMARKS), config["site_dir"], config["use_directory_urls"]))
    return files
