"""dtlib.bench itself: the one table writer, the slowest rank's median, and the command line's refusals."""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from dtlib.bench.__main__ import main
from dtlib.bench._table import Column, as_records, format_table
from dtlib.measure.timing import slowest_median


@dataclass
class _Row:
    name: str
    seconds: float | None
    calls: int


def test_a_table_is_a_title_a_header_and_one_aligned_line_per_row():
    rows = [_Row("short", 0.5, 3), _Row("a name longer than its column", None, 12)]
    columns = [Column("name", 8, lambda r: r.name, align="<"), Column("seconds", 8, lambda r: r.seconds, ".3f", " s"),
               Column("calls", 5, lambda r: r.calls)]
    lines = format_table("dtlib.bench demo: two rows", columns, rows, footer="2 rows").splitlines()
    # the name column widens from 8 to its longest name (29); None is written "-"
    assert lines == ["# dtlib.bench demo: two rows",
                     f"# {'name':<29} {'seconds':>8} {'calls':>5}",
                     f"  {'short':<29} {'0.500 s':>8} {'3':>5}",
                     f"  {'a name longer than its column':<29} {'-':>8} {'12':>5}",
                     "2 rows"]


def test_records_are_the_rows_fields_then_the_computed_ones():
    rows = [_Row("a", 0.5, 3)]
    assert as_records(rows) == [{"name": "a", "seconds": 0.5, "calls": 3}]
    records = as_records(rows, per_call=lambda r: r.seconds / r.calls, seconds=lambda r: [r.seconds])
    assert list(records[0].items()) == [("name", "a"), ("calls", 3), ("per_call", 0.5 / 3), ("seconds", [0.5])]


def test_the_slowest_ranks_median():
    assert slowest_median([[9.0, 1.0, 2.0], [9.0, 3.0, 3.0]], skip=1) == 3.0  # step 0 left out on every rank
    assert slowest_median([[1.0, 100.0, 2.0], [5.0]]) == 5.0  # one rank's outlier moves its median, not the max
    assert slowest_median([[4.0]], skip=1) == 4.0  # nothing after the skipped ones: the times themselves
    assert slowest_median(iter([[1.0], [2.0]])) == 2.0  # any iterable of ranks
    with pytest.raises(ValueError, match="no rank"):
        slowest_median([])


@pytest.mark.timeout(120)
@pytest.mark.parametrize("arguments, what", [
    ("allreduce --world-size 0", "argument --world-size: must be >= 1, got 0"),  # was a ZeroDivisionError
    ("fsdp --world-size 3", "world_size=3 cannot split the comparison's global batch of 16 samples evenly: "
                            "use 1, 2, 4, 8 or 16 ranks"),  # was a global_batch the command line does not expose
    ("launch --methods teleport", "unknown methods ['teleport']; choose from forkserver-first, forkserver"),
    ("allreduce --min-bytes 64M --max-bytes 1K", "min_bytes"),
    ("allreduce --min-bytes 5X", "argument --min-bytes: cannot read the size '5X'"),
    ("ddp --model resnet", "unknown model 'resnet'; choose one of mlp"),
    ("ddp --steps 2", "argument --steps: must be >= 3, got 2"),
    ("launch --repeats 2.5", "argument --repeats: expected a whole number, got '2.5'"),
], ids=["allreduce-world-size-0", "fsdp-world-size-3", "launch-unknown-method", "sizes-reversed", "unreadable-size",
        "ddp-unknown-model", "ddp-steps-2", "repeats-2.5"])
def test_command_line_refuses_bad_settings_in_one_line_with_status_2(arguments, what, capsys, no_process_start):
    """In-process (``main(argv)``): each refusal comes before any rank or store starts (no_process_start)."""
    with pytest.raises(SystemExit) as exit_info:
        main(arguments.split())
    out, err = capsys.readouterr()
    assert exit_info.value.code == 2, err
    command = arguments.split()[0]
    assert err.startswith(f"python -m dtlib.bench {command}: error: "), err
    assert err.count("\n") == 1 and err.endswith("\n"), err  # no traceback
    assert what in err
    assert out == ""
