"""Training curves of several MLflow runs in one figure: one panel per metric, one line per run.

    python -m tasks.bench.plot_curves --out F.png LABEL=RUN_ID ... [--metrics train/loss,val/present_f1_at_M]
        [--tracking-uri sqlite:///mlruns/mlflow.db]

Each metric's full history is read from the tracking store and drawn against the training step;
a run that lacks a metric is left out of that panel. Used for the pretraining comparison of
docs/pretraining.md (fits on kp20k with and without `train.init_from`).
"""
import argparse

from mlflow.tracking import MlflowClient

from tasks.comparison.report import pyplot

parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
parser.add_argument("runs", nargs="+", metavar="LABEL=RUN_ID")
parser.add_argument("--out", required=True)
parser.add_argument("--metrics", default="train/loss,val/present_f1_at_M")
parser.add_argument("--tracking-uri", default="sqlite:///mlruns/mlflow.db")
args = parser.parse_args()
runs = [run.split("=", 1) for run in args.runs]
if any(len(run) != 2 for run in runs):
    parser.error("each run is LABEL=RUN_ID")
client = MlflowClient(args.tracking_uri)
metrics = args.metrics.split(",")
plt = pyplot()
figure, axes = plt.subplots(1, len(metrics), figsize=(5 * len(metrics), 3.6), squeeze=False)
for axis, metric in zip(axes[0], metrics):
    for label, run_id in runs:
        history = sorted(client.get_metric_history(run_id, metric), key=lambda m: m.step)
        if history:
            axis.plot([m.step for m in history], [m.value for m in history], marker=".", label=label)
    axis.set_title(metric)
    axis.set_xlabel("training step")
    axis.legend(fontsize="small")
figure.tight_layout()
figure.savefig(args.out, dpi=110)
print(f"wrote {args.out}")
