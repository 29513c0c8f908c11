"""LightningModules: one per task, on a shared base that trains and decodes with any decoder plug-in.

The base knows nothing about a particular decoder: it asks the decoder for the layout and the loss
while training, and for `generate` while validating or testing; it turns the generated token ids
back into text and hands texts to the task's metrics. A task subclass only says which metrics it
reports and how a record's fields feed them, both without a model, so that outputs no model wrote
(the baselines of `tasks.baselines`) are scored exactly as a decoder's are (`task_scores`).
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import lightning as L
import numpy as np
import torch
import torch.distributed as dist
from lightning.pytorch.utilities import move_data_to_device
from omegaconf import DictConfig, OmegaConf
from torchmetrics import Metric
from tqdm.auto import tqdm

from datamodules.datamodule import process_group
from datamodules.schema import schema_for, target_texts
from datamodules.tokenizer import serialize
from decoders.base import Decoder
from tasks.metrics import KeyphraseF1, MultiSpanMatch, Rouge

log = logging.getLogger("tasks")

# the share of a decoding pass's outputs cut by a decoder bound from which a fit or test warns
BOUND_WARNING_SHARE = 0.05


def timed_generate(decoder: Decoder, model, input_ids: torch.Tensor,
                   attention_mask: torch.Tensor):
    """(DecodeOutput, seconds) of one `generate` call: encoder + decoder calls only; on a GPU the
    queued work is waited for on both sides so the time is the decode's own."""
    device = input_ids.device
    cuda = device.type == "cuda"
    if cuda:
        torch.cuda.synchronize(device)  # the inputs' GPU, which need not be the current one
    start = time.perf_counter()
    out = decoder.generate(model, input_ids, attention_mask)
    if cuda:
        torch.cuda.synchronize(device)
    return out, time.perf_counter() - start


def subsequence_texts(tokenizer, subsequences: list[list[list[int]]]) -> list[list[str]]:
    """Per example, its subsequences' token ids as the text the metrics score: each decoded without
    special tokens and stripped, the empty ones dropped. Anything scored beside the decoders'
    outputs (tasks.baselines) goes through this too."""
    texts = [[tokenizer.decode(sub, skip_special_tokens=True).strip() for sub in subs]
             for subs in subsequences]
    return [[text for text in subs if text] for subs in texts]


@dataclass(frozen=True)
class Evaluation:
    """What one validation or test pass measured over its whole split: the task's quality scores,
    the decoding telemetry (`DecodeTelemetry.summary`), the decoder's own counters
    (`DecodeOutput.stats`, summed over the split) and the number of examples decoded."""
    quality: dict[str, float]
    telemetry: dict[str, float]
    counters: dict[str, float]
    examples: int

    @property
    def scores(self) -> dict[str, float]:
        """Everything the pass logs, as it logs it (`<split>/<name>`): quality, telemetry, counters."""
        return {**self.quality, **self.telemetry, **self.counters}


class DecodeTelemetry:
    """Per-example decoding counters of one validation/test pass, keyed by dataset index."""

    def __init__(self) -> None:
        self.rows: dict[int, dict] = {}
        self.seconds = 0.0
        self.stats: dict[str, float] = {}

    def summary(self) -> dict[str, float]:
        n = max(len(self.rows), 1)
        calls = sum(r["decoder_calls"] for r in self.rows.values())
        tokens = sum(r["tokens"] for r in self.rows.values())
        return {
            "examples_per_second": len(self.rows) / self.seconds if self.seconds else 0.0,
            "decoder_calls_per_example": calls / n,
            "tokens_per_call": tokens / calls if calls else 0.0,
            "bound_hits": float(sum(r["bound_hit"] for r in self.rows.values())),
            "decode_seconds": self.seconds,
        }

    @classmethod
    def merged(cls, parts: list["DecodeTelemetry"]) -> "DecodeTelemetry":
        """The telemetry of all processes of a distributed run: every example once (the evaluation
        shards are disjoint), decode seconds and decoder statistics summed, so examples per second
        is the throughput of one process, as in a single-process run."""
        whole = cls()
        for part in parts:
            whole.rows.update(part.rows)
            whole.seconds += part.seconds
            for key, value in part.stats.items():
                whole.stats[key] = whole.stats.get(key, 0.0) + value
        return whole


def warmup_then_decay(optimizer: torch.optim.Optimizer, warmup_steps: int, total_steps: int,
                      decay: float) -> torch.optim.lr_scheduler.LambdaLR:
    """The learning rate rises linearly from 0 over `warmup_steps`, stays at its peak, then falls
    linearly to 0 over the last `decay` share of the steps after warm-up (`train.lr_decay`: 1.0 is
    transformers' `get_linear_schedule_with_warmup`, step for step; 0 keeps the peak to the end)."""
    decay_steps = decay * (total_steps - warmup_steps)

    def factor(step: int) -> float:
        if step < warmup_steps:
            return step / max(1, warmup_steps)
        if total_steps - step > decay_steps:
            return 1.0
        return max(0.0, (total_steps - step) / max(1, decay_steps))

    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)


def parameter_groups(module: torch.nn.Module, position_bias_lr: float) -> list[dict]:
    """AdamW's parameter groups: T5's relative-position bias tables at `position_bias_lr`, the rest at
    the optimizer's learning rate. Why apart: each bias is one scalar added to an attention score,
    and Adam moves a parameter by about the learning rate per step whatever its gradient, so at
    1e-3 a bias trained from scratch for a few thousand steps stays within about 1 of its start,
    too little to make a head attend by position; the scores of the other parameters are products
    of many of them and grow much faster."""
    named = list(module.named_parameters())
    bias = [p for name, p in named if "relative_attention_bias" in name]
    rest = [p for name, p in named if "relative_attention_bias" not in name]
    return [{"params": rest}, {"params": bias, "lr": position_bias_lr}]


# The devices whose parameters AdamW updates with its fused kernel (`configure_optimizers`).
FUSED_ADAMW_DEVICES = ("cpu", "cuda")


def epoch_seed(seed: int, epoch: int, rank: int) -> int:
    """A seed for torch's global generator in one epoch of one process, derived from the run's seed."""
    return int(np.random.SeedSequence([seed, epoch, rank]).generate_state(1, dtype=np.uint64)[0] >> 1)


class BackboneTraining(L.LightningModule):
    """A backbone trained with a decoder plug-in's layout and loss, whose checkpoints carry what
    rebuilds it (tokenizer, architecture, configuration): the training half of every task module,
    and all of `tasks.experiments.pretrain`'s denoising module."""

    def __init__(self, cfg: DictConfig, backbone, decoder: Decoder, tokenizer):
        super().__init__()
        self.cfg = cfg
        self.backbone = backbone
        self.decoder = decoder
        self.tokenizer = tokenizer
        self.save_hyperparameters({"cfg": OmegaConf.to_container(cfg, resolve=True)})

    def on_train_epoch_start(self):
        # Dropout and the decoders' own draws (e.g. NAR's training masks) use torch's global
        # generator. Reseeding it from (seed, epoch, rank) makes an epoch's draws independent of
        # whatever ran before it (validation, a restart from a checkpoint), so a resumed run trains
        # exactly like an uninterrupted one; the batch order is seeded the same way by the sampler.
        torch.manual_seed(epoch_seed(self.cfg.seed, self.current_epoch, self.global_rank))

    def batch_loss(self, batch) -> torch.Tensor:
        """The decoder's training loss on a batch's targets, in the decoder's layout."""
        layout = {k: v.to(self.device) for k, v in self.decoder.layout(batch["targets"]).items()}
        return self.decoder.loss(self.backbone, batch["input_ids"], batch["attention_mask"], layout)

    def training_step(self, batch, batch_idx):
        loss = self.batch_loss(batch)
        self.log("train/loss", loss, prog_bar=True, batch_size=batch["input_ids"].size(0))
        return loss

    def configure_optimizers(self):
        train = self.cfg.train
        # fused: one kernel updates every parameter where the default loops over them in Python,
        # a visible share of a small model's step on a CPU; the same update, where the kernel exists.
        # Not under mixed precision: there Lightning clips gradients only for an optimizer that
        # leaves their unscaling to it, which a fused one does not.
        fused = (self.device.type in FUSED_ADAMW_DEVICES
                 and not str(self.trainer.precision).endswith("-mixed"))
        optimizer = torch.optim.AdamW(parameter_groups(self, train.lr * train.position_bias_lr_scale),
                                      lr=train.lr, weight_decay=train.weight_decay, fused=fused)
        total = max(int(self.trainer.estimated_stepping_batches), 1)
        schedule = warmup_then_decay(optimizer, min(train.warmup_steps, total // 2), total,
                                     train.lr_decay)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": schedule, "interval": "step"}}

    # -- checkpoints carry what is needed to rebuild the model ---------------------------------
    def on_save_checkpoint(self, checkpoint: dict) -> None:
        checkpoint["decoder_name"] = self.decoder.name
        # The tokenizer and the backbone's architecture, so that testing, resuming or starting from
        # the checkpoint needs neither a pretrained model's folder nor the hub (`tasks.runs.
        # checkpoints.stored_model`); plain strings, lists and dicts, loadable with
        # torch.load(weights_only=True).
        checkpoint["tokenizer_json"], checkpoint["tokenizer_settings"] = serialize(self.tokenizer)
        checkpoint["backbone_config"] = self.backbone.config.to_dict()


class GenerationTask(BackboneTraining):
    """A task: training as `BackboneTraining`, validation and test by decoding with the decoder
    plug-in and scoring with the task's metrics."""
    primary_metric = ""  # the validation metric that picks the best checkpoint

    def __init__(self, cfg: DictConfig, backbone, decoder: Decoder, tokenizer):
        super().__init__(cfg, backbone, decoder, tokenizer)
        self.metrics = torch.nn.ModuleDict(self.make_metrics(cfg, tokenizer))
        self.telemetry = DecodeTelemetry()
        self.evaluations: dict[str, Evaluation] = {}  # split ("val", "test") -> its last pass's

    # -- what a task defines: functions of the configuration and the data alone (`task_scores`) --
    @staticmethod
    def make_metrics(cfg: DictConfig, tokenizer) -> dict[str, Metric]:
        raise NotImplementedError

    @staticmethod
    def update_metrics(metrics: dict[str, Metric], predictions: list[list[str]],
                       records: list[dict]) -> None:
        raise NotImplementedError

    # -- decoding and scoring ------------------------------------------------------------------
    def decode_batch(self, batch) -> list[list[str]]:
        """Generate for one batch, record telemetry, return the predicted subsequences as text."""
        out, seconds = timed_generate(self.decoder, self.backbone, batch["input_ids"],
                                      batch["attention_mask"])
        self.telemetry.seconds += seconds
        for key, value in out.stats.items():
            self.telemetry.stats[key] = self.telemetry.stats.get(key, 0.0) + value

        predictions = subsequence_texts(self.tokenizer, out.subsequences)
        for i, index in enumerate(batch["index"].tolist()):
            self.telemetry.rows[index] = {
                "prediction": predictions[i], "decoder_calls": out.decoder_calls[i],
                "tokens": out.tokens[i], "bound_hit": out.bound_hit[i],
                "subsequences": len(out.subsequences[i]),
            }
        return predictions

    def with_predictions(self, records: list[dict], batches, device: torch.device,
                         desc: str) -> list[dict]:
        """`records`, in order, with their target field replaced by the decoder's outputs:
        `batches` (the data module's batches of `records`, `index` their positions) decoded on
        `device` outside a trainer (`tasks.runs.trainer.DecodeTarget.predict` places the module
        there and opens its precision's context). A progress bar `desc` on stderr shows when there
        is more than one batch."""
        field = schema_for(self.cfg.task.name).target_field
        outputs: dict[int, list[str]] = {}
        with torch.no_grad():
            for batch in tqdm(batches, desc=desc, disable=len(batches) <= 1):
                predictions = self.decode_batch(move_data_to_device(batch, device))
                outputs.update(zip(batch["index"].tolist(), predictions))
        return [{**record, field: outputs[i]} for i, record in enumerate(records)]

    def _eval_step(self, batch, split: str) -> None:
        predictions = self.decode_batch(batch)
        records = self.trainer.datamodule.records(split)
        self.update_metrics(self.metrics, predictions, [records[i] for i in batch["index"].tolist()])

    def _eval_start(self) -> None:
        for metric in self.metrics.values():
            metric.reset()
        self.telemetry = DecodeTelemetry()

    def _eval_end(self, split: str) -> None:
        """The pass's `Evaluation`, kept as `evaluations[split]` and logged (`<split>/<name>`).

        Under DDP each process decoded its own shard: the metrics' `compute` sums their statistics
        over the processes, and the telemetry (hence the predictions) is gathered here, so every
        process holds and logs the same whole-split values."""
        quality = computed_scores(self.metrics)
        world, _ = process_group()
        if world > 1:
            parts = [None] * world
            dist.all_gather_object(parts, self.telemetry)
            self.telemetry = DecodeTelemetry.merged(parts)
        evaluation = Evaluation(quality, self.telemetry.summary(), dict(self.telemetry.stats),
                                len(self.telemetry.rows))
        self.evaluations[split] = evaluation
        # The values are already whole-split ones, equal on every process: reducing them with
        # "max" keeps them exact (and stops Lightning advising to reduce epoch-level values).
        self.log_dict({f"{split}/{k}": v for k, v in evaluation.scores.items()}, sync_dist=True,
                      reduce_fx="max")

    def validation_step(self, batch, batch_idx):
        self._eval_step(batch, "validation")

    def test_step(self, batch, batch_idx):
        self._eval_step(batch, "test")

    def on_validation_epoch_start(self):
        self._eval_start()

    def on_test_epoch_start(self):
        self._eval_start()

    def on_validation_epoch_end(self):
        self._eval_end("val")

    def on_test_epoch_end(self):
        self._eval_end("test")
        self.warn_bound_hits("test")

    def on_fit_end(self):
        self.warn_bound_hits("val")  # the last validation's: once per fit, not once per epoch

    def warn_bound_hits(self, split: str) -> None:
        """One warning when at least BOUND_WARNING_SHARE of the last `split` pass's outputs were
        stopped by a decoder bound instead of their own end token (each pass logs the count as
        `<split>/bound_hits`)."""
        evaluation = self.evaluations.get(split)
        if evaluation is None:
            return
        hits, examples = int(evaluation.telemetry["bound_hits"]), evaluation.examples
        if examples and hits / examples >= BOUND_WARNING_SHARE and self.global_rank == 0:
            log.warning("%s: %d of %d examples reached one of the decoder's length or step bounds "
                        "before ending by themselves; their outputs may be cut (see the decoder's "
                        "max_* options)", split, hits, examples)

    def prediction_rows(self, split: str) -> list[dict]:
        """The predictions of the last decoding pass, in dataset order, with targets and telemetry."""
        records = self.trainer.datamodule.records(split)
        return [{"id": records[i]["id"], **row, "targets": target_texts(self.cfg.task.name, records[i])}
                for i, row in sorted(self.telemetry.rows.items())]


class KeyphraseTask(GenerationTask):
    primary_metric = "val/present_f1_at_M"

    @staticmethod
    def make_metrics(cfg, tokenizer):
        return {"keyphrase": KeyphraseF1(unk_token=tokenizer.unk_token)}

    @staticmethod
    def update_metrics(metrics, predictions, records):
        source = schema_for("keyphrase").source_text
        metrics["keyphrase"].update(preds=predictions,
                                    targets=[target_texts("keyphrase", r) for r in records],
                                    sources=[source(r) for r in records],
                                    aliases=[r.get("aliases", {}) for r in records])


class QATask(GenerationTask):
    primary_metric = "val/em_f1"

    @staticmethod
    def make_metrics(cfg, tokenizer):
        metrics = {"span": MultiSpanMatch()}
        if cfg.task.level == "sentence":
            metrics["rouge"] = Rouge()
        return metrics

    @staticmethod
    def update_metrics(metrics, predictions, records):
        targets = [target_texts("qa", r) for r in records]
        for metric in metrics.values():
            metric.update(preds=predictions, targets=targets)


class SummarizationTask(GenerationTask):
    primary_metric = "val/rougeL"

    @staticmethod
    def make_metrics(cfg, tokenizer):
        return {"rouge": Rouge()}

    @staticmethod
    def update_metrics(metrics, predictions, records):
        metrics["rouge"].update(preds=predictions,
                                targets=[target_texts("summarization", r) for r in records])


TASK_MODULES: dict[str, type[GenerationTask]] = {
    "keyphrase": KeyphraseTask, "qa": QATask, "summarization": SummarizationTask,
}


def task_scores(cfg: DictConfig, tokenizer, predictions: list[list[str]],
                records: list[dict]) -> dict[str, float]:
    """The quality scores of `predictions` (per record of `records`, its subsequences as text, as
    `subsequence_texts` gives them) under `cfg`'s task: its module's metrics, fed as its module
    feeds them, on one process. What needs no model (tasks.baselines) is scored through this."""
    task = TASK_MODULES[cfg.task.name]
    metrics = task.make_metrics(cfg, tokenizer)
    task.update_metrics(metrics, predictions, records)
    return computed_scores(metrics)


def computed_scores(metrics) -> dict[str, float]:
    """Every score of a task's `metrics` (name -> torchmetrics Metric), as plain floats."""
    return {key: float(value) for metric in metrics.values() for key, value in metric.compute().items()}
