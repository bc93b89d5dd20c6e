"""Render a report (a list of blocks) as Markdown and as one self-contained HTML file (images as data URIs)."""
from __future__ import annotations

import base64
import html
from dataclasses import dataclass, field
from pathlib import Path

__all__ = ["Heading", "Para", "Table", "Figure", "to_markdown", "to_html"]


@dataclass
class Heading:
    text: str
    level: int = 2


@dataclass
class Para:
    text: str


@dataclass
class Table:
    header: list[str]
    rows: list[list[str]]
    caption: str = ""
    title: str = ""
    key_value: bool = False  # a two-column "item: value" table: left-aligned text, header hidden in HTML
    # Numbered notes printed below the table. Long explanations live here, not in cells: a cell that holds a
    # sentence widens its column until the columns to its right (the Claims verdicts) scroll out of view.
    notes: list[str] = field(default_factory=list)
    # Columns (0-based) whose cells may wrap at spaces in HTML; the others stay on one line. A wide table gives up
    # line breaks in its descriptive columns so that the short ones (verdicts) stay in view without scrolling.
    wrap_columns: tuple[int, ...] = ()


@dataclass
class Figure:
    path: Path
    caption: str
    alt: str = field(default="")


def _md_cell(text: str) -> str:
    return str(text).replace("|", "\\|").replace("\n", " ")


def to_markdown(blocks: list, base: Path) -> str:
    """Markdown with figures linked relative to `base` (the folder report.md lives in)."""
    out: list[str] = []
    for b in blocks:
        if isinstance(b, Heading):
            out += ["#" * b.level + " " + b.text, ""]
        elif isinstance(b, Para):
            out += [b.text, ""]
        elif isinstance(b, Table):
            if b.title:
                out += [f"**{b.title}**", ""]
            out.append("| " + " | ".join(_md_cell(h) for h in b.header) + " |")
            out.append("|" + "---|" * len(b.header))
            out += ["| " + " | ".join(_md_cell(c) for c in row) + " |" for row in b.rows]
            out.append("")
            if b.notes:
                out += [f"{i}. {_md_cell(n)}" for i, n in enumerate(b.notes, 1)] + [""]
            if b.caption:
                out += [f"*{b.caption}*", ""]
        elif isinstance(b, Figure):
            rel = Path(b.path).resolve().relative_to(base.resolve()).as_posix()
            out += [f"![{b.alt or b.caption}]({rel})", "", f"*{b.caption}*", ""]
        else:  # pragma: no cover - programming error
            raise TypeError(f"unknown report block {b!r}")
    return "\n".join(out).rstrip() + "\n"


CSS = """
body { font-family: system-ui, -apple-system, "Segoe UI", Roboto, sans-serif; max-width: 1180px; margin: 2em auto;
       padding: 0 1.5em; color: #1a1a1a; line-height: 1.5; }
h1 { border-bottom: 2px solid #ddd; padding-bottom: .3em; }
h2 { margin-top: 2em; border-bottom: 1px solid #eee; }
table { border-collapse: collapse; margin: .8em 0; font-size: 0.92em; display: block; overflow-x: auto; }
th, td { border: 1px solid #ccc; padding: .3em .6em; text-align: right; white-space: nowrap; }
th:first-child, td:first-child { text-align: left; }
th { background: #f3f3f3; }
tr:nth-child(even) td { background: #fafafa; }
.caption { color: #444; font-size: 0.92em; margin-top: .2em; }
figure { margin: 1.5em 0; }
figure img { max-width: 100%; height: auto; border: 1px solid #eee; }
.table-title { font-weight: 600; margin-bottom: 0; }
table.kv td { text-align: left; white-space: normal; }
table.kv td:first-child { font-weight: 600; white-space: nowrap; }
td.wrap, th.wrap { white-space: normal; overflow-wrap: break-word; }  /* at spaces: an identifier is never split */
ol.notes { color: #444; font-size: 0.88em; margin: .2em 0 .4em; padding-left: 1.6em; }
"""


def _data_uri(path: Path) -> str:
    return "data:image/png;base64," + base64.b64encode(Path(path).read_bytes()).decode("ascii")


def to_html(blocks: list, title: str) -> str:
    """One HTML document that needs no other file: CSS inline, every image embedded as base64."""
    e = html.escape
    out = ["<!DOCTYPE html>", '<html lang="en">', "<head>", '<meta charset="utf-8">',
           '<meta name="viewport" content="width=device-width, initial-scale=1">', f"<title>{e(title)}</title>",
           f"<style>{CSS}</style>", "</head>", "<body>"]
    for b in blocks:
        if isinstance(b, Heading):
            out.append(f"<h{b.level}>{e(b.text)}</h{b.level}>")
        elif isinstance(b, Para):
            out.append(f"<p>{e(b.text)}</p>")
        elif isinstance(b, Table):
            if b.title:
                out.append(f'<p class="table-title">{e(b.title)}</p>')
            if b.key_value:
                out.append('<table class="kv"><tbody>')
            else:
                # A wrapping column's header wraps too: a long one ("affine_gated − scaled_softmax") would
                # otherwise set the column's width and push the verdicts out of view.
                out.append("<table><thead><tr>" + "".join(f'<th class="wrap">{e(h)}</th>' if i in b.wrap_columns
                                                          else f"<th>{e(h)}</th>" for i, h in enumerate(b.header)) +
                           "</tr></thead><tbody>")
            out += ["<tr>" + "".join(f'<td class="wrap">{e(str(c))}</td>' if i in b.wrap_columns
                                     else f"<td>{e(str(c))}</td>" for i, c in enumerate(row)) + "</tr>"
                    for row in b.rows]
            out.append("</tbody></table>")
            if b.notes:
                out.append('<ol class="notes">' + "".join(f"<li>{e(n)}</li>" for n in b.notes) + "</ol>")
            if b.caption:
                out.append(f'<p class="caption">{e(b.caption)}</p>')
        elif isinstance(b, Figure):
            out.append(f'<figure><img src="{_data_uri(b.path)}" alt="{e(b.alt or b.caption)}">'
                       f'<figcaption class="caption">{e(b.caption)}</figcaption></figure>')
        else:  # pragma: no cover
            raise TypeError(f"unknown report block {b!r}")
    out += ["</body>", "</html>"]
    return "\n".join(out) + "\n"
