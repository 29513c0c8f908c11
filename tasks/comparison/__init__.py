"""`tasks.compare`'s parts: `plan` (rows and where their models come from), `measure` (speed,
memory, calls) and `report` (JSON, table, plots)."""
