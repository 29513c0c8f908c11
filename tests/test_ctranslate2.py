"""CTranslate2 as a peer (`tasks.comparison.timing.CTranslate2Greedy`): an exported checkpoint,
converted, decodes greedily as the sequential decoder does on every row whose decisions no rounding
can change, its outputs split and bounded as the library's; without the package, peers refuses
`--ctranslate2` before any work, saying how to install it.

The engine computes in float32 with kernels of its own, so on a random model a near tie between two
tokens may go either way: rows are compared where every decision of the sequential decode had a
margin (best minus second best logit) above `MARGIN`, found by property."""
import builtins
from pathlib import Path

import pytest
import torch

from decoders import build_decoder
from decoders.loop import through_end
from tasks.bench import peers
from tasks.comparison.timing import CTranslate2Greedy
from tasks.config import ConfigError
from tasks.runs.checkpoints import load_checkpoint
from tasks.runs.restore import checkpoint_config, restore_module, save_pretrained_folder
from tests.test_export import ending_checkpoint
from tests.test_predict import saved

MARGIN = 1e-2


def margins(backbone, input_ids, attention_mask, outputs: list[list[int]], start: int) -> list[float]:
    """Per row, the smallest gap between the best and second best logit over the steps that chose
    its output tokens (teacher-forced)."""
    width = max(map(len, outputs))
    labels = torch.tensor([row + [0] * (width - len(row)) for row in outputs])
    decoder_input = torch.cat([torch.full((len(outputs), 1), start), labels[:, :-1]], dim=1)
    logits = backbone(input_ids=input_ids, attention_mask=attention_mask,
                      decoder_input_ids=decoder_input).logits                    # (B, T, V)
    top = logits.topk(2, dim=-1).values
    gaps = top[..., 0] - top[..., 1]                                            # (B, T)
    return [float(gaps[row, : len(tokens)].min()) for row, tokens in enumerate(outputs)]


def test_ctranslate2_decodes_as_the_sequential_decoder_where_no_rounding_decides(tmp_path):
    pytest.importorskip("ctranslate2")
    texts = [record["title"] for record in saved(tmp_path / "data", "keyphrase").records[:8]]
    path = ending_checkpoint(tmp_path, "sequential", texts)
    exported = save_pretrained_folder(path, str(tmp_path / "exported"))
    stored = load_checkpoint(path)
    module = restore_module(stored, path, checkpoint_config(stored, path, ["decoder=sequential"]))
    special = module.decoder.special
    batch = module.tokenizer(texts, return_tensors="pt", padding=True)
    engine = CTranslate2Greedy(str(exported), module.tokenizer, special, 40, "float32",
                               torch.device("cpu"), threads=1)
    with torch.no_grad():
        backbone = module.backbone.eval()
        ours = build_decoder("sequential", backbone.config, special, max_new_tokens=40).generate(
            backbone, batch["input_ids"], batch["attention_mask"])
        theirs = engine.generate(None, batch["input_ids"], batch["attention_mask"])
        produced = backbone.generate(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                                     do_sample=False, num_beams=1, max_new_tokens=40)[:, 1:].tolist()
        outputs = [through_end(row, special.eos) for row in produced]
        gaps = margins(backbone, batch["input_ids"], batch["attention_mask"], outputs, special.start)
    clear = [row for row, gap in enumerate(gaps) if gap > MARGIN]
    assert len(clear) >= 4, f"rows decided by a wide margin: {clear} (margins {gaps})"
    assert any(ours.tokens[row] < 40 for row in clear), "a clear row that ends at its end token"
    for row in clear:
        assert theirs.subsequences[row] == ours.subsequences[row], row
        assert theirs.tokens[row] == ours.tokens[row] and theirs.bound_hit[row] == ours.bound_hit[row]
        assert theirs.decoder_calls[row] == ours.tokens[row]   # one engine step per token


def test_peers_refuses_ctranslate2_without_the_package_before_any_work(monkeypatch):
    real_import = builtins.__import__

    def without_ctranslate2(name, *args, **kwargs):
        if name == "ctranslate2":
            raise ImportError("No module named 'ctranslate2'")
        return real_import(name, *args, **kwargs)
    monkeypatch.setattr(builtins, "__import__", without_ctranslate2)
    monkeypatch.setattr(peers, "restored", lambda *_: pytest.fail("a checkpoint was read"))
    with pytest.raises(ConfigError, match=r'ctranslate2 package: pip install -e "\.\[bench\]"'):
        peers.main(["--ckpt", str(Path("s.ckpt")), "--ctranslate2"])
