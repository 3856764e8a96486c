"""docs/field-bugs.md's table, read for the mutation report's "field bugs"
section: each public report with the field mutants (:mod:`dcpcheck.mutants.field`)
carrying its patches."""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from dcpcheck.mutants.catalog import BY_NAME
from dcpcheck.mutants.field import EQUIVALENT_PATCHES, PATCH_MUTANTS

FIELD_BUGS_DOC = Path(__file__).resolve().parents[2] / "docs" / "field-bugs.md"


@dataclass(frozen=True)
class FieldReport:
    """One row of docs/field-bugs.md's table."""

    number: int
    link: str  # the first report cited
    cause: str  # paraphrased root cause
    mutants: tuple[str, ...]  # catalog mutants carrying its patches
    equivalent: tuple[str, ...]  # its patches that are equivalent mutants
    reason: str  # the document's words on what the contract can express


_ROW = re.compile(r"^\| (\d+) \| (.*) \|$")
_LINK = re.compile(r"\((https?://[^)]+)\)")
_NAME = re.compile(r"`([^`]+)`")


def field_reports(doc: Path = FIELD_BUGS_DOC) -> list[FieldReport]:
    """The document's reports, each with the mutants its patches are. A
    backticked patch id that is neither a mutant nor equivalent is an error:
    the table and the field mutants must agree."""
    reports = []
    for line in doc.read_text().splitlines():
        match = _ROW.match(line)
        if not match:
            continue
        cells = [cell.strip() for cell in match.group(2).split(" | ")]
        report, cause, verdict = cells[0], cells[2], cells[3]
        # A row the document calls not expressible may still name a related mutant.
        names = [] if verdict.startswith("not expressible") else _NAME.findall(verdict)
        mutants = [PATCH_MUTANTS.get(name, name) for name in names if name in PATCH_MUTANTS or name in BY_NAME]
        equivalent = [name for name in names if name in EQUIVALENT_PATCHES]
        patch_like = [name for name in names if re.fullmatch(r"[a-z0-9]+(-[a-z0-9]+)+", name)]
        unknown = sorted(set(patch_like) - set(PATCH_MUTANTS) - set(EQUIVALENT_PATCHES))
        if unknown:
            raise ValueError(f"{doc.name} row {match.group(1)}: patches {unknown} are in no mutant")
        links = _LINK.findall(report)
        reports.append(
            FieldReport(
                number=int(match.group(1)),
                link=links[0] if links else report,
                cause=cause,
                mutants=tuple(dict.fromkeys(mutants)),
                equivalent=tuple(equivalent),
                reason=verdict.removeprefix("not expressible: "),
            )
        )
    return reports
