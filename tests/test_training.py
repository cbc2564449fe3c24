"""Drafter training: the training forward (prefix-shared mask blocks) equals the inference drafter
on every prefix; loss/targets on hand-made tensors; a tiny end-to-end run with resume."""

from __future__ import annotations

import json

import pytest
import torch

from dart_ray.drafters.dart import DartDrafter
from dart_ray.drafters.dart_model import DartConfig, DartModel
from dart_ray.models import load_target
from dart_ray.training.trainer import drafter_train_forward, kl_loss, level_targets, teacher_pass


@pytest.fixture(scope="module")
def tiny(tiny_dirs):
    return load_target(str(tiny_dirs["llama"]), "fp32", max_seq_len=256)


@pytest.mark.parametrize("draft_vocab", [None, 512])
def test_train_forward_matches_inference(tiny, draft_vocab):
    torch.manual_seed(0)
    args = tiny.args
    cfg = DartConfig.for_target(args, tiny.model_id, depth=4, draft_vocab=draft_vocab, tie_head=draft_vocab is None)
    model = DartModel(cfg).init_random(3)
    with torch.no_grad():
        model.mask.normal_(0, 1.0)
    if draft_vocab:
        model.d2t.copy_(torch.randperm(args.vocab_size)[:draft_vocab].sort().values)
    model.eval()
    L = 14
    tokens = torch.randint(0, args.vocab_size, (1, L))
    cache = tiny.model.new_cache(1, 64)
    taps, _, _ = teacher_pass(tiny.model, cache, tokens, [L], cfg.tap_layers, 4)
    with torch.no_grad():
        train_logits = drafter_train_forward(model, tiny.model.embed, taps, tokens, tiny.model.lm_head.weight)   # [1, L-1, d, Vd]
    drafter = DartDrafter(model, tiny.model.embed, tiny.model.lm_head.weight)
    drafter.allocate(1, 64)
    for j in (0, 3, 7, L - 2):
        drafter.prefill(slice(0, 1), [j + 1], taps[:, :j + 1], tokens[:, 1:j + 2])
        inf = drafter.draft_logits(1, cfg.depth)[0]                                   # [d, V]
        ref = train_logits[0, j]
        if draft_vocab:
            inf = inf[:, model.d2t]
        torch.testing.assert_close(inf, ref, atol=2e-4, rtol=1e-4)


def test_level_targets_and_loss_by_hand():
    # one sequence of length 4, K=2 teacher entries, depth 2
    top_id = torch.tensor([[[5, 6], [7, 8], [9, 1], [2, 3]]])
    top_lp = torch.log(torch.tensor([[[0.5, 0.5], [0.9, 0.1], [0.6, 0.4], [1.0, 1e-9]]]))
    ids, p, valid = level_targets(top_id, top_lp, None, 2, [4])
    # prefix j, level t -> teacher position j+t
    assert ids[0, 0, 0].tolist() == [7, 8] and ids[0, 0, 1].tolist() == [9, 1]
    assert valid[0].tolist() == [[True, True], [True, True], [True, False]]
    torch.testing.assert_close(p[0, 0, 0], torch.tensor([0.9, 0.1]))
    # draft vocab without token 8: teacher renormalised over what the drafter can express
    t2d = torch.full((10,), -1)
    t2d[torch.tensor([1, 2, 3, 5, 6, 7, 9])] = torch.arange(7)
    ids2, p2, _ = level_targets(top_id, top_lp, t2d, 2, [4])
    torch.testing.assert_close(p2[0, 0, 0], torch.tensor([1.0, 0.0]))
    # a drafter that puts all mass on the teacher tokens has loss = teacher entropy-free CE
    logits = torch.full((1, 3, 2, 10), -30.0)
    for j in range(3):
        for t in range(2):
            for k in range(2):
                logits[0, j, t, ids[0, j, t, k]] = torch.log(p[0, j, t, k].clamp(min=1e-12))
    loss, per_level = kl_loss(logits, ids, p, valid, gamma=0.6)
    ent = -(p * p.clamp(min=1e-12).log()).sum(-1)
    expect = torch.stack([(ent[0, :, t] * valid[0, :, t]).sum() / valid[0, :, t].sum() for t in range(2)])
    torch.testing.assert_close(per_level, expect, atol=1e-4, rtol=1e-4)


def test_tiny_end_to_end_with_resume(tmp_path, tiny_dirs):
    from dart_ray.training.gen_data import generate_data
    from dart_ray.training.trainer import TrainConfig, train

    corpus = [{"prompt": f"def f{i}(x):\n    \"\"\"Return x plus {i}.\"\"\"\n", "source": "code", "chat": False}
              for i in range(12)]
    data = generate_data(tmp_path / "data", model=str(tiny_dirs["llama"]), dtype="fp32", method="none",
                         max_new_tokens=12, batch_size=4, shard_size=6, corpus=corpus, progress=False)
    assert len(list(data.glob("shard-*.parquet"))) == 2
    # resumable: a second call finds every shard and generates nothing
    generate_data(tmp_path / "data", model="/nonexistent", corpus=corpus, shard_size=6, progress=False)
    cfg = TrainConfig(data=str(data), out=str(tmp_path / "run"), model=str(tiny_dirs["llama"]), depth=3,
                      max_steps=2, seqs_per_step=2, max_len=48, draft_vocab=256, eval_every=1, ckpt_every=1,
                      eval_seqs=2)
    s1 = train(cfg, progress=False)
    assert s1["steps"] == 2
    cfg2 = TrainConfig(**{**cfg.__dict__, "max_steps": 3})
    s2 = train(cfg2, progress=False)
    assert s2["steps"] == 3  # resumed at 2, ran one more
    model = DartModel.load(tmp_path / "run" / "drafter")
    assert model.cfg.depth == 3 and model.cfg.draft_vocab == 256
    assert (tmp_path / "run" / "training.png").stat().st_size > 0
    ev = json.loads((tmp_path / "run" / "train_summary.json").read_text())["final_eval"]
    assert len(ev["top1"]) == 3 and ev["chain_tau"] >= 1.0
