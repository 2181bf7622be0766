"""The benchmark's record: one CSV that `cce bench` appends to, and what is rendered from it.

Every row is one (machine, commit, shape, inputs, impl, compiled or not) measurement, in the
fixed columns of `COLUMNS`. The latest row of each (gpu, shape, inputs, impl, compiled) is
what `latest.png`, `latest.md` and the tables marked in the docs show, so a number in the
docs always names the CSV row it came from. Torch-free: results taken on a GPU machine
re-render anywhere.
"""

from __future__ import annotations

import codecs
import csv
import importlib.util
import io
import math
import os
import re
import shlex
import shutil
from pathlib import Path
from typing import Iterable, Mapping

from cce_compile.bench.shapes import parse_shape

COLUMNS = (
    "gpu", "torch", "triton", "commit", "date", "shape", "inputs", "impl", "compiled",
    "fwd_ms", "fwdbwd_ms", "gemm_ms", "fwd_x_gemm", "fwdbwd_x_gemm", "peak_mib", "peak_x_grads", "err_dE", "err_dC",
)
"""date: ISO 8601 UTC; shape: NxDxV; impl: `cce bench`'s impl name, ":mode" after it for a
torch.compile mode other than the default; compiled: 0 or 1; *_x_gemm: over one bf16
e @ c.T GEMM of the shape timed in the same run; peak_x_grads: peak memory above the inputs
during forward+backward over the gradients' own bytes; err_*: ||g - ref|| / ||ref|| against
float32."""
CSV_NAME = "bench.csv"
Row = dict[str, str]
_KEY = ("gpu", "shape", "inputs", "impl", "compiled")
_TABLE_START = re.compile(r"<!-- cce-bench-table(?P<filters>[^>]*?)-->")
_TABLE_END = "<!-- /cce-bench-table -->"
_FILTERS = ("gpu", "shape", "inputs", "impl", "compiled")
_NUMBERS = COLUMNS[COLUMNS.index("fwd_ms"):]
_RATIO_FLOOR = 0.5  # log-scale bars start here, so a 1.03 x memory bar still shows


def _cell(value: object) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return ""
    if isinstance(value, bool):
        return str(int(value))
    if isinstance(value, float):
        return format(value, ".4g")
    return str(value)


def _check_header(header: list[str] | None, path: Path) -> None:
    if header is None or tuple(header) != COLUMNS:
        raise ValueError(f"{path} does not have the results columns {','.join(COLUMNS)} (header: {header})")


def append_rows(csv_path: Path, rows: Iterable[Mapping[str, object]]) -> None:
    """Appends `rows` (a value per column; None for not measured), writing the header to a new
    file; an existing file must read back whole (`read_rows`). A last row whole but without its
    newline (a hand edit, an editor that drops it) is ended first: the first appended row
    would otherwise be glued onto it."""
    csv_path = Path(csv_path)
    exists = csv_path.exists() and csv_path.stat().st_size > 0
    if exists:
        read_rows(csv_path)  # a row cut off mid-line would take the first appended row's cells
    unended = exists and not csv_path.read_bytes().endswith(b"\n")
    csv_path.parent.mkdir(parents=True, exist_ok=True)
    with csv_path.open("a", newline="") as handle:
        writer = csv.writer(handle, lineterminator="\n")
        if not exists:
            writer.writerow(COLUMNS)
        if unended:
            handle.write("\n")
        for row in rows:
            unknown = set(row) - set(COLUMNS)
            if unknown:
                raise ValueError(f"rows: unknown columns {sorted(unknown)}")
            writer.writerow([_cell(row.get(column)) for column in COLUMNS])


def read_rows(csv_path: Path) -> list[Row]:
    """The CSV's rows, each with a cell per column; a UTF-8 byte order mark (an editor's, which
    `cce import` takes too) is no part of the header. A file that cannot be read or is not UTF-8,
    a row with fewer or more cells (a run cut off mid-row, a hand edit) and a cell rendering
    cannot read raise ValueError naming the file and the line: rendering would otherwise meet a
    missing cell as None, or a bad one as a bare ValueError, far from its cause."""
    csv_path = Path(csv_path)
    try:
        data = csv_path.read_bytes()
    except OSError as error:
        raise ValueError(f"{csv_path}: cannot read it: {error.strerror or error}") from None
    mark = len(codecs.BOM_UTF8) if data.startswith(codecs.BOM_UTF8) else 0
    try:
        text = data[mark:].decode("utf-8")
    except UnicodeDecodeError as error:
        at = mark + error.start
        line = data.count(b"\n", 0, at) + 1
        raise ValueError(f"{csv_path} line {line}: not UTF-8 (byte {at} of the file, counted from 0)") from None
    rows: list[Row] = []
    reader = csv.DictReader(io.StringIO(text, newline=""))
    try:
        _check_header(reader.fieldnames, csv_path)
        for row in reader:
            if None in row or None in row.values():
                cells = sum(value is not None for key, value in row.items() if key is not None)
                cells += len(row.get(None) or ())
                raise ValueError(f"{csv_path} line {reader.line_num}: {cells} cells where the results have "
                                 f"{len(COLUMNS)}")
            problem = _cell_problem(row)
            if problem is not None:
                raise ValueError(f"{csv_path} line {reader.line_num}: {problem}")
            rows.append(row)
    except csv.Error as error:  # a field past the csv module's size limit
        raise ValueError(f"{csv_path} line {reader.line_num}: {error}") from None
    return rows


def _cell_problem(row: Row) -> str | None:
    """What in `row` rendering cannot read: a number column's cell that is no number, a shape
    that is neither a shape's name nor NxDxV."""
    for column in _NUMBERS:
        try:
            float(row[column] or 0)
        except ValueError:
            return f"{column} {row[column]!r} is not a number"
    try:
        parse_shape(row["shape"])
    except ValueError as error:
        return str(error)
    return None


def latest(rows: list[Row]) -> list[Row]:
    """The newest row of each (gpu, shape, inputs, impl, compiled), by date, grouped by
    (shape, inputs) in the order each first appears, impls in the order of their newest run."""
    newest: dict[tuple[str, ...], Row] = {}
    for row in rows:
        key = tuple(row[column] for column in _KEY)
        if key not in newest or row["date"] >= newest[key]["date"]:
            newest[key] = row
    groups = list(dict.fromkeys((row["shape"], row["inputs"]) for row in rows))
    position = {id(row): index for index, row in enumerate(rows)}
    chosen = sorted(newest.values(), key=lambda row: (groups.index((row["shape"], row["inputs"])), position[id(row)]))
    return chosen


def _shape_cell(spec: str) -> str:
    shape = parse_shape(spec)
    return spec if shape.name == spec else f"{spec} ({shape.name})"


def _number(text: str, spec: str) -> str:
    return format(float(text), spec) if text else ""


def markdown_table(rows: list[Row]) -> str:
    """The side-by-side table of `rows` (already chosen, e.g. by `latest`)."""
    lines = [
        "| shape NxDxV | inputs | impl | compiled | GEMM ms | fwd x GEMM | fwd+bwd ms | fwd+bwd x GEMM | peak x grads "
        "| err dE | err dC | gpu, commit |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    previous = None
    for row in rows:
        group = (row["shape"], row["inputs"])
        lead = ["", ""] if group == previous else [_shape_cell(row["shape"]), row["inputs"]]
        previous = group
        cells = [
            row["impl"], row["compiled"], _number(row["gemm_ms"], ".2f"), _number(row["fwd_x_gemm"], ".2f"),
            _number(row["fwdbwd_ms"], ".2f"), _number(row["fwdbwd_x_gemm"], ".2f"), _number(row["peak_x_grads"], ".2f"),
            _number(row["err_dE"], ".1e"), _number(row["err_dC"], ".1e"), f"{row['gpu']}, {row['commit']}",
        ]
        lines.append("| " + " | ".join(lead + cells) + " |")
    return "\n".join(lines) + "\n"


def _selected(rows: list[Row], filters: str) -> list[Row]:
    """Rows matching a table marker's filters, e.g. ` impl=cce_exact,torch inputs=lm_like `;
    a value with spaces is quoted as in a shell: `gpu="NVIDIA H200"`."""
    try:
        items = shlex.split(filters)
    except ValueError as error:  # an unclosed quote
        raise ValueError(f"table marker filters {filters.strip()!r}: {error}") from None
    wanted: dict[str, set[str]] = {}
    for item in items:
        name, _, values = item.partition("=")
        if name not in _FILTERS or not values:
            raise ValueError(f"table marker filter {item!r}: use NAME=value,... with NAME one of {_FILTERS}")
        wanted[name] = set(values.split(","))
    return [row for row in rows if all(row[name] in values for name, values in wanted.items())]


def has_tables(text: str) -> bool:
    """Whether `text` has a table block for synced_text to rewrite."""
    return _TABLE_START.search(text) is not None


def synced_text(text: str, rows: list[Row]) -> str:
    """`text` with every `<!-- cce-bench-table FILTERS -->` ... `<!-- /cce-bench-table -->`
    block rewritten as the table of the latest of `rows` that match its filters."""
    chosen = latest(rows)
    out, position = [], 0
    for start in _TABLE_START.finditer(text):
        if start.start() < position:
            continue
        line = text.count("\n", 0, start.start()) + 1
        end = text.find(_TABLE_END, start.end())
        if end < 0:
            raise ValueError(f"line {line}: the table marker has no {_TABLE_END}")
        try:
            selected = _selected(chosen, start.group("filters"))
        except ValueError as error:
            raise ValueError(f"line {line}: {error}") from None
        out += [text[position:start.end()], "\n", markdown_table(selected)]
        position = end
    return "".join(out) + text[position:]


class SyncError(ValueError):
    """A markdown file whose marked tables cannot be rewritten; the message names the file."""


def synced_files(rows: list[Row], markdown_paths: Iterable[Path]) -> dict[Path, str]:
    """The new text of each of `markdown_paths` whose marked tables `rows` change. Every file
    is read and synced here, before any is written, so that one bad file changes nothing."""
    changed = {}
    for path in map(Path, markdown_paths):
        try:
            with path.open(encoding="utf-8", newline="") as file:  # its line breaks as they are
                text = file.read()
            if not has_tables(text):
                raise ValueError("no `<!-- cce-bench-table ... -->` block to rewrite")
            unix_text = text.replace("\r\n", "\n")
            synced = synced_text(unix_text, rows)
        except UnicodeDecodeError as error:
            raise SyncError(f"{path}: not UTF-8 (byte {error.start})") from None
        except OSError as error:
            raise SyncError(f"{path}: {error.strerror or error}") from None
        except ValueError as error:
            raise SyncError(f"{path}: {error}") from None
        if synced != unix_text:  # a Windows checkout's file keeps its CRLF line breaks
            changed[path] = synced.replace("\n", "\r\n") if "\r\n" in text else synced
    return changed


def _bar_label(row: Row) -> str:
    return row["impl"] + (" (compiled)" if row["compiled"] == "1" and ":" not in row["impl"] else "")


def plot(rows: list[Row], png_path: Path) -> None:
    """Per (gpu, shape, inputs): bars of fwd+bwd x GEMM and peak memory x grads for each impl (log scale)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    groups: dict[tuple[str, str, str], list[Row]] = {}
    for row in rows:
        groups.setdefault((row["gpu"], row["shape"], row["inputs"]), []).append(row)
    cols = min(4, max(1, len(groups)))
    nrows = max(1, math.ceil(len(groups) / cols))
    fig, axes = plt.subplots(nrows, cols, figsize=(5.6 * cols, 4.8 * nrows + 0.6), squeeze=False)
    for ax in axes.flat[len(groups):]:
        ax.set_visible(False)
    width = 0.38
    for ax, ((gpu, shape, inputs), group) in zip(axes.flat, groups.items()):
        xs = list(range(len(group)))
        times = [float(row["fwdbwd_x_gemm"] or 0) for row in group]
        memory = [float(row["peak_x_grads"] or 0) for row in group]
        ax.bar([x - width / 2 for x in xs], times, width, color="C0", label="fwd+bwd / GEMM")
        ax.bar([x + width / 2 for x in xs], memory, width, color="C1", label="peak memory / grads")
        ax.set_yscale("log")
        ax.set_ylim(_RATIO_FLOOR, 1.6 * max([1.0, *times, *memory]))
        ax.set_xticks(xs, [_bar_label(row) for row in group], rotation=40, ha="right", fontsize=8)
        ax.set_title(f"{_shape_cell(shape)}, {inputs}\n{gpu}", fontsize=9)
    handles, labels = axes.flat[0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="upper center", ncol=2, frameon=False)
    fig.tight_layout(rect=(0, 0, 1, 1 - 0.6 / fig.get_figheight()))
    fig.savefig(png_path, dpi=100)
    plt.close(fig)


def render(csv_path: Path, sync: Iterable[Path] = ()) -> list[Path]:
    """latest.md and, where matplotlib is installed (the [bench] extra), latest.png beside the
    CSV, then the marked tables of the `sync` files; returns the files written. A `sync` file
    that cannot be synced raises SyncError before anything is written."""
    csv_path = Path(csv_path)
    rows = read_rows(csv_path)
    chosen = latest(rows)
    synced = synced_files(rows, sync)
    md_path = csv_path.with_name("latest.md")
    md_path.write_text(f"# cce bench: the latest row of each measurement in {csv_path.name}\n\n" + markdown_table(chosen))
    written = [md_path]
    if chosen and importlib.util.find_spec("matplotlib") is not None:
        png_path = csv_path.with_name("latest.png")
        plot(chosen, png_path)
        written.append(png_path)
    for path, text in synced.items():
        _replace(path, text)
        written.append(path)
    return written


def _replace(path: Path, text: str) -> None:
    """`path`'s content replaced by `text` whole or not at all (a write stopped midway would
    leave a README cut short): written beside the file it names (through a link: the link
    stays), with its mode, then renamed over it."""
    path = path.resolve()
    partial = path.with_name(f".{path.name}.partial")
    try:
        with partial.open("w", encoding="utf-8", newline="") as file:
            file.write(text)
        shutil.copymode(path, partial)
        os.replace(partial, path)
    finally:
        partial.unlink(missing_ok=True)
