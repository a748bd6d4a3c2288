"""Schema revisions this mla-tune knows, without importing Alembic.

The read-only lookup compares a database's `alembic_version` with these; a
test checks they match the migration scripts in `store/migrations/versions/`.
"""

from __future__ import annotations

# Oldest first. Add each new migration's revision id here.
KNOWN_REVISIONS: tuple[str, ...] = ("0001", "0002", "0003", "0004", "0005")
HEAD_REVISION = KNOWN_REVISIONS[-1]

# Tables the read-only lookup reads.
LOOKUP_TABLES = ("decisions", "fingerprints", "measurements")  # measurements: `kernel_tile`


def newer_schema_message(where: str, revision: str) -> str:
    return (f"{where} has schema revision {revision}, which is newer than this mla-tune "
            f"(knows up to {HEAD_REVISION}); upgrade mla-tune")
