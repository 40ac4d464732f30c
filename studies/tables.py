"""The one way the studies write a table: GitHub markdown."""


def markdown_table(header: list[str], rows: list[list]) -> list[str]:
    """The table's lines: the header, its rule, then one line per row (cells as str() writes them)."""
    return [
        "| " + " | ".join(header) + " |",
        "|" + " --- |" * len(header),
        *("| " + " | ".join(str(cell) for cell in row) + " |" for row in rows),
    ]
