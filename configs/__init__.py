"""The configuration files: `default.yaml` and the groups `task/`, `decoder/`, `model/`, `data/`.

A package so that they install with the library (`pip install .`): `tasks.config` reads them from
beside the `tasks` package, in a clone and in site-packages alike."""
