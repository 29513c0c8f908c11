"""What a run of the library is made of, one way down: `trainer` (build, train and test) uses
`checkpoints` (write, load, check, resume), which uses `tracking` (MLflow)."""
