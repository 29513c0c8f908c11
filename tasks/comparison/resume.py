"""Taking up an interrupted comparison: which comparison run to continue, whether the plan is the
one it was made for, and what each of its rows left.

A comparison run records its plan (`plan.json`: every row's label and resolved configuration, less
the keys that only say where files go) and a digest of it (the `plan_digest` tag). `--resume` finds
the latest unfinished comparison run with the same digest, `--resume ID` the comparison `ID`, whose
plan must then be this one: a plan that differs is refused, naming the keys that differ. Each row's
run carries its place in the plan (the `row_index` tag); what the latest attempt at a row left
(`Attempt`) decides what is done with it: a finished row is reused, a fit that wrote its
`last.ckpt` goes on from there in its own run, anything else is abandoned (tagged so and deleted
from the experiment's view, its files kept) and done again.
"""
from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path

from omegaconf import DictConfig

from tasks.comparison.plan import row_label
from tasks.config import ConfigError, flatten
from tasks.runs.checkpoints import Resume, find_resumable, last_checkpoint
from tasks.runs.tracking import experiment_name

PLAN_FILE = "plan.json"
# Keys that say where files go or how progress shows, not what is trained or decoded: a comparison
# resumed with other values of these is the same comparison.
WHERE_KEYS = ("tracking.", "data.tokenizer_cache", "data.num_workers", "data.cache_dir",
              "trainer.enable_progress_bar")


def plan_record(planned: list[tuple[DictConfig, list[str]]], starts: list[bool],
                checkpoints: dict[str, str]) -> dict:
    """What a comparison was planned as: each row's label and configuration (`WHERE_KEYS` left
    out), whether it starts from the sequential row's checkpoint, and the --ckpt checkpoints."""
    rows = [{"label": row_label(cfg, swept), "from_sequential": start,
             "config": {key: value for key, value in flatten(cfg).items()
                        if not key.startswith(WHERE_KEYS)}}
            for (cfg, swept), start in zip(planned, starts)]
    return {"rows": rows, "checkpoints": dict(sorted(checkpoints.items()))}


def plan_digest(record: dict) -> str:
    return hashlib.sha256(json.dumps(record, sort_keys=True, default=str).encode()).hexdigest()[:16]


def plan_differences(stored: dict, record: dict) -> list[str]:
    """How the plan `record` differs from the `stored` one: its rows, then each row's keys, each
    group's name first."""
    before, now = [row["label"] for row in stored["rows"]], [row["label"] for row in record["rows"]]
    if before != now:
        return [f"rows: {', '.join(before)} in the comparison, {', '.join(now)} now"]
    differences = []
    if stored["checkpoints"] != record["checkpoints"]:
        differences.append(f"--ckpt: {stored['checkpoints']} in the comparison, "
                           f"{record['checkpoints']} now")
    for place, (old, new) in enumerate(zip(stored["rows"], record["rows"]), start=1):
        if old["from_sequential"] != new["from_sequential"]:
            differences.append(f"row {place} ({new['label']}) starts from the sequential row: "
                               f"{old['from_sequential']} in the comparison, {new['from_sequential']} now")
        # a group's name first (task.name, model.name, ...): a different task or model explains the
        # differences of the defaults that come with it, and the message keeps only the first few
        keys = sorted(set(old["config"]) | set(new["config"]),
                      key=lambda key: (not key.endswith(".name"), key))
        differences += [f"row {place} ({new['label']}) {key}: {old['config'].get(key)!r} in the "
                        f"comparison, {new['config'].get(key)!r} now"
                        for key in keys if old["config"].get(key) != new["config"].get(key)]
    return differences


@dataclass
class Attempt:
    """The latest run of one row of a comparison being resumed."""
    run_id: str
    status: str
    tags: dict
    fit_seconds: float | None

    @property
    def finished(self) -> bool:
        return self.status == "FINISHED"


@dataclass
class Resumed:
    """A comparison to go on with: its run, its id, and its rows' latest attempts by place."""
    run_id: str
    comparison_id: str
    attempts: dict[int, Attempt]


def comparison_runs(cfg: DictConfig, unfinished: bool, digest: str | None = None,
                    comparison_id: str | None = None, every_experiment: bool = False) -> list:
    """The experiment's comparison runs (latest first; with `every_experiment`, those of every
    experiment of the store: a comparison of another task), only the unfinished ones, or those of
    one plan digest or comparison id."""
    from mlflow.tracking import MlflowClient
    client = MlflowClient(cfg.tracking.uri)
    if every_experiment:
        experiments = [e.experiment_id for e in client.search_experiments()]
    else:
        experiment = client.get_experiment_by_name(experiment_name(cfg))
        experiments = [] if experiment is None else [experiment.experiment_id]
    if not experiments:
        return []
    where = ["tags.role = 'comparison'"]
    if unfinished:
        where.append("attributes.status != 'FINISHED'")
    if digest is not None:
        where.append(f"tags.plan_digest = '{digest}'")
    if comparison_id is not None:
        where.append(f"tags.comparison_id = '{comparison_id}'")
    return client.search_runs(experiments, filter_string=" and ".join(where),
                              order_by=["attributes.start_time DESC"])


def stored_plan(cfg: DictConfig, run) -> dict | None:
    """The plan a comparison run recorded, or None for one that recorded none."""
    from mlflow.tracking import MlflowClient
    from mlflow.exceptions import MlflowException
    try:
        path = MlflowClient(cfg.tracking.uri).download_artifacts(run.info.run_id, PLAN_FILE)
    except (MlflowException, OSError):
        return None
    return json.loads(Path(path).read_text())


def find_comparison(cfg: DictConfig, record: dict, comparison_id: str | None) -> Resumed:
    """The comparison `comparison_id`, or the latest unfinished one of this plan, with its rows'
    latest attempts; ConfigError when there is none, when it finished, or when its plan differs."""
    digest = plan_digest(record)
    if comparison_id is not None:
        # in every experiment: a comparison of another task is refused below, naming task.name
        runs = comparison_runs(cfg, unfinished=False, comparison_id=comparison_id,
                               every_experiment=True)
        if not runs:
            raise ConfigError(f"--resume {comparison_id}: no comparison with that id in "
                              f"tracking.uri={cfg.tracking.uri!r}")
        run = runs[0]
        if run.info.status == "FINISHED":
            raise ConfigError(f"--resume {comparison_id}: that comparison finished; there is "
                              f"nothing to resume")
    else:
        runs = comparison_runs(cfg, unfinished=True, digest=digest)
        if not runs:
            others = comparison_runs(cfg, unfinished=True)
            hint = ""
            if others:
                latest = others[0]
                stored = stored_plan(cfg, latest)
                differences = plan_differences(stored, record) if stored else ["it recorded no plan"]
                hint = (f"; the latest unfinished comparison, {latest.data.tags.get('comparison_id')}, "
                        f"was planned otherwise ({'; '.join(differences[:6])})")
            raise ConfigError(f"--resume: no unfinished comparison of this plan in experiment "
                              f"{experiment_name(cfg)!r}{hint}")
        run = runs[0]
    if run.data.tags.get("plan_digest") != digest:
        stored = stored_plan(cfg, run)
        differences = plan_differences(stored, record) if stored else ["it recorded no plan"]
        raise ConfigError(f"--resume {run.data.tags.get('comparison_id')}: that comparison was "
                          f"planned otherwise; resume it with the command that started it "
                          f"({'; '.join(differences[:8])})")
    comparison = run.data.tags["comparison_id"]
    return Resumed(run.info.run_id, comparison, row_attempts(cfg, comparison))


def row_attempts(cfg: DictConfig, comparison_id: str) -> dict[int, Attempt]:
    """The latest run of each row of comparison `comparison_id`, by its place in the plan."""
    from mlflow.tracking import MlflowClient
    client = MlflowClient(cfg.tracking.uri)
    experiment = client.get_experiment_by_name(experiment_name(cfg))
    runs = client.search_runs([experiment.experiment_id],
                              filter_string=f"tags.comparison_id = '{comparison_id}' and "
                                            f"tags.role = 'row'",
                              order_by=["attributes.start_time ASC"])
    attempts: dict[int, Attempt] = {}
    for run in runs:  # the latest of a place wins
        if "row_index" in run.data.tags:
            attempts[int(run.data.tags["row_index"])] = Attempt(
                run.info.run_id, run.info.status, dict(run.data.tags),
                run.data.metrics.get("train/fit_seconds"))
    return attempts


def resumable_fit(cfg: DictConfig, attempt: Attempt | None) -> Resume | None:
    """Where an unfinished fit of a row goes on: its run and `last.ckpt`, checked against `cfg`
    (`find_resumable`); None when there is no earlier attempt or it wrote no checkpoint (it is then
    `abandon`ed by the caller and fitted again)."""
    if attempt is None or attempt.finished:
        return None
    if not last_checkpoint(cfg, attempt.run_id).is_file():
        return None
    return find_resumable(cfg, attempt.run_id)


def abandon(cfg: DictConfig, attempt: Attempt | None, why: str) -> None:
    """An unfinished attempt that is done again: tagged `abandoned` with `why`, and deleted from the
    experiment's view (MLflow's soft delete: its files and record stay, `mlflow gc` removes them),
    so that the comparison shows each row once."""
    if attempt is None or attempt.finished:
        return
    from mlflow.tracking import MlflowClient
    client = MlflowClient(cfg.tracking.uri)
    client.set_tag(attempt.run_id, "abandoned", why)
    client.delete_run(attempt.run_id)
