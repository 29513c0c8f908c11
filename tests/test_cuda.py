"""On a CUDA device: the decoders decode there as they are specified, a fit trains there in bf16 and
under DDP on NCCL, and a decode waits for the device about once per decoder call.

Every test here is marked `cuda` and skips without a CUDA device (`pytest -m cuda` on a GPU
machine runs them all). The equivalence tests run in float64, on the GPU as on the CPU.
"""
import os
import subprocess
import sys
import warnings

import pytest
import torch
from mlflow.tracking import MlflowClient

from decoders import available, build_decoder
from decoders.loop import Stopwatch, send, split_flat_output
from tasks import fit, test as test_command
from tasks.bench import bounded, with_drafter
from tests.conftest import SPECIAL, always_feeding, first_batch_where, tiny_t5
from tests.test_end_to_end import TINY, tracking
from tests.test_faults import REPO
from tests.plain_pipelined import reference_decode

pytestmark = [pytest.mark.cuda, pytest.mark.float64, pytest.mark.numerics,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

CUDA = torch.device("cuda")
STEPS = 15
EXACT = [name for name in available() if name in ("sequential", "blockwise", "lookup", "aggressive")]
GPU_FIT = ["trainer.accelerator=gpu", "trainer.devices=1"]


def decoder_on(name: str, model, **options):
    # every call feeds its drafts: the measured rule's calls would follow each device's timing
    options = {**bounded(name, STEPS), **always_feeding(name), **options}
    return with_drafter(build_decoder(name, model.config, SPECIAL, **options), model).eval()


def varied_batch(model):
    def varied(input_ids, attention_mask):
        """greedy outputs of at least 3 different lengths, one of them ended by its end token"""
        out = model.generate(input_ids=input_ids, attention_mask=attention_mask, do_sample=False,
                             num_beams=1, max_new_tokens=STEPS)
        ends = [SPECIAL.eos in row for row in out[:, 1:].tolist()]
        return len({int((row != 0).sum()) for row in out[:, 1:]}) >= 3 and any(ends)
    return first_batch_where(varied, 6, seed=20)


def test_send_does_not_synchronize():
    torch.cuda.set_sync_debug_mode("error")   # a synchronizing call raises
    try:
        sent = send([[2, 7], [1, 8]], CUDA)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert sent.device.type == "cuda" and sent.tolist() == [[2, 7], [1, 8]]


def test_a_stopwatch_times_device_work_without_synchronizing():
    clock = Stopwatch(CUDA)
    x = torch.randn(2048, 2048, device=CUDA)
    torch.cuda.set_sync_debug_mode("error")
    try:
        with clock.timing():
            for _ in range(10):
                x = x @ x / 2048
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()   # what a decode's final read-back does
    assert clock.total() > 0 and clock.seconds == 0


@pytest.mark.parametrize("name", EXACT)
def test_exact_decoders_give_the_argmax_of_the_teacher_forced_forward(name):
    """Greedy `generate` on the GPU gives, at every position, the argmax of one teacher-forced
    forward over its own tokens; each exact decoder gives those tokens, split into subsequences."""
    model = tiny_t5(0)
    input_ids, attention_mask = varied_batch(model)
    decoder = decoder_on(name, model)
    model, input_ids, attention_mask = model.to(CUDA), input_ids.to(CUDA), attention_mask.to(CUDA)
    decoder = decoder.to(CUDA)
    with torch.no_grad():
        generated = model.generate(input_ids=input_ids, attention_mask=attention_mask,
                                   do_sample=False, num_beams=1, max_new_tokens=STEPS)
        logits = model(input_ids=input_ids, attention_mask=attention_mask,
                       decoder_input_ids=generated[:, :-1]).logits
        out = decoder.generate(model, input_ids, attention_mask)
    for i, row in enumerate(generated[:, 1:].tolist()):
        length = row.index(SPECIAL.eos) + 1 if SPECIAL.eos in row else len(row)
        assert logits[i, :length].argmax(-1).tolist() == row[:length]
        subsequences, ended = split_flat_output(row[:length], SPECIAL)
        assert out.subsequences[i] == subsequences
        assert out.bound_hit[i] == (not ended)


def test_pipelined_decoding_equals_its_teacher_forced_forward():
    """The cached, batched pipelined decode on the GPU gives the plain decoder's output
    (`tests.plain_pipelined`: each next token the argmax of an uncached teacher-forced forward
    over everything fed so far), also run on the GPU."""
    model = tiny_t5(0).to(CUDA)
    decoder = build_decoder("pipelined", model.config, SPECIAL, delay=2, max_subsequences=4,
                            max_subsequence_length=6, max_steps=100).to(CUDA)

    def writes(input_ids, attention_mask):
        """an example with two subsequences or more, to check beyond the first"""
        out = decoder.generate(model, input_ids.to(CUDA), attention_mask.to(CUDA))
        return max(len(s) for s in out.subsequences) >= 2
    input_ids, attention_mask = (t.to(CUDA) for t in first_batch_where(writes, 6, seed=5))
    with torch.no_grad():
        out = decoder.generate(model, input_ids, attention_mask)
        plain, _ = reference_decode(decoder, model, input_ids, attention_mask)
    assert out == plain


@pytest.mark.parametrize("name", available())
def test_every_decoder_decodes_on_the_gpu_as_on_the_cpu(name):
    """nar and onestep have no teacher-forced reference of their own: they are checked, with the
    others, against their own CPU decode of the same model and inputs (float64 on both)."""
    model = tiny_t5(0)
    input_ids, attention_mask = varied_batch(model)
    decoder = decoder_on(name, model)
    with torch.no_grad():
        on_cpu = decoder.generate(model, input_ids, attention_mask)
        decoder, model = decoder.to(CUDA), model.to(CUDA)
        on_gpu = decoder.generate(model, input_ids.to(CUDA), attention_mask.to(CUDA))
    assert on_gpu.subsequences == on_cpu.subsequences
    assert (on_gpu.decoder_calls, on_gpu.bound_hit) == (on_cpu.decoder_calls, on_cpu.bound_hit)


@pytest.mark.parametrize("name", available())
def test_every_decoder_hands_sdpa_aligned_biases_in_float32(name, monkeypatch):
    """In float32 (float64 never reaches it) SDPA may run its memory-efficient kernel, which fails
    with "misaligned address" on a bias whose data is not 16-byte aligned (`backbone.sdpa_aligned`).
    Every bias with adjacent columns that a decode hands SDPA on the GPU is aligned, and the
    decode completes."""
    model = tiny_t5(0).float()
    model.set_attn_implementation("sdpa")
    input_ids, attention_mask = varied_batch(tiny_t5(0))
    decoder = decoder_on(name, model).float().to(CUDA)
    model = model.to(CUDA)
    handed, attend = [], torch.nn.functional.scaled_dot_product_attention

    def recording(query, key, value, attn_mask=None, **options):
        handed.append(attn_mask)
        return attend(query, key, value, attn_mask=attn_mask, **options)
    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", recording)
    with torch.no_grad():
        out = decoder.generate(model, input_ids.to(CUDA), attention_mask.to(CUDA))
    torch.cuda.synchronize()
    biases = [bias for bias in handed if bias is not None and bias.stride(-1) == 1]
    assert biases and all(bias.data_ptr() % 16 == 0 for bias in biases)
    assert len(out.subsequences) == input_ids.size(0)


def test_sequential_equals_generate():
    model = tiny_t5(1)
    input_ids, attention_mask = varied_batch(model)
    model, input_ids, attention_mask = model.to(CUDA), input_ids.to(CUDA), attention_mask.to(CUDA)
    decoder = build_decoder("sequential", model.config, SPECIAL, max_new_tokens=STEPS).to(CUDA)
    with torch.no_grad():
        generated = model.generate(input_ids=input_ids, attention_mask=attention_mask,
                                   do_sample=False, num_beams=1, max_new_tokens=STEPS)
        out = decoder.generate(model, input_ids, attention_mask)
    expected = [split_flat_output(row, SPECIAL) for row in generated[:, 1:].tolist()]
    assert out.subsequences == [subsequences for subsequences, _ in expected]
    assert out.bound_hit == [not ended for _, ended in expected]
    assert out.batch_decoder_calls == generated.size(1) - 1


@pytest.mark.parametrize("name", available())
def test_a_decode_waits_for_the_gpu_about_once_per_decoder_call(name):
    """Counted by CUDA's own sync debug mode (a warning per synchronizing call) over one decode of
    a batch, after a warm-up decode. A looping decoder may wait 1.3 times per call (its per-call
    read-back, plus the encoder's and the final read-back); one that makes a few calls (nar,
    onestep) at most twice more than its calls."""
    model = tiny_t5(0).to(CUDA)
    input_ids, attention_mask = (t.to(CUDA) for t in varied_batch(tiny_t5(0)))
    decoder = decoder_on(name, tiny_t5(0), **bounded(name, 32)).to(CUDA)
    with torch.no_grad():
        decoder.generate(model, input_ids, attention_mask)
        torch.cuda.synchronize()
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")
            try:
                out = decoder.generate(model, input_ids, attention_mask)
            finally:
                torch.cuda.set_sync_debug_mode("default")
    syncs = sum("synchronizing" in str(w.message) for w in seen)
    calls = out.batch_decoder_calls
    assert calls >= 1
    if calls >= 10:
        assert syncs / calls <= 1.3, (syncs, calls)
    else:
        assert syncs <= calls + 2, (syncs, calls)


def test_a_bf16_mixed_fit_and_its_test_run_on_the_gpu(tmp_path):
    fitted = fit.main(["--decoder", "sequential", *TINY, *GPU_FIT, "trainer.precision=bf16-mixed",
                       *tracking(tmp_path)])
    tested = test_command.main(["--ckpt", fitted["checkpoint"], *GPU_FIT,
                                "trainer.precision=bf16-mixed", *tracking(tmp_path)])
    assert set(tested["scores"]) == set(fitted["scores"])
    client = MlflowClient(f"sqlite:///{tmp_path}/mlflow.db")
    run = client.get_run(fitted["run_id"])
    assert run.data.params["trainer.precision"] == "bf16-mixed"
    assert run.data.params["trainer.accelerator"] == "gpu"
    losses = [m.value for m in client.get_metric_history(run.info.run_id, "train/loss")]
    assert losses and all(torch.isfinite(torch.tensor(losses)))


def test_a_ddp_fit_runs_on_nccl(tmp_path):
    args = ["--decoder", "pipelined", *TINY, *tracking(tmp_path), *GPU_FIT, "trainer.strategy=ddp"]
    done = subprocess.run([sys.executable, "-m", "tasks.fit", *args], cwd=REPO,
                          env={**os.environ, "NCCL_DEBUG": "WARN"}, capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "distributed_backend=nccl" in done.stdout + done.stderr
