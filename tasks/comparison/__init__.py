"""`tasks.compare`'s parts: `plan` (rows and where their models come from), `resume` (taking an
interrupted comparison up again), `measure` (speed, memory, calls), `result` (the JSON, built from
the rows' records) and `report` (table and plots, from the JSON alone)."""
