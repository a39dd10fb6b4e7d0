"""bench/profile.py's table: py-spy raw stacks summed per function, inclusive once per stack, self at the leaf."""

from bench.profile import table


def test_table_sums_inclusive_and_self(tmp_path):
    raw = tmp_path / "x.raw"
    raw.write_text("main (/r/gateway/cli.py:3);run (/v/lib/python3.12/site-packages/uvicorn/server.py:9);"
                   "send (/v/lib/python3.12/site-packages/uvicorn/h.py:5) 3\n"
                   "main (/r/gateway/cli.py:3);main (/r/gateway/cli.py:4) 1\n")
    rows = table(raw, top=10).splitlines()
    assert rows[0] == "x.raw: 4 samples"
    assert "| 100.0 | 25.0 | `main (/r/gateway/cli.py)` |" in rows       # a recursive frame counts once per stack
    assert "| 75.0 | 75.0 | `send (uvicorn/h.py)` |" in rows
    assert len(table(raw, top=10, pattern="uvicorn").splitlines()) == 5
