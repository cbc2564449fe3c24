"""Drafter training: every objective's training forward (DART's prefix-shared mask blocks, EAGLE's
unroll, Medusa, SpS) equals its inference drafter on every prefix; loss/targets on hand-made
tensors; tiny end-to-end runs of the loop with resume."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from dart_ray.drafters.dart import DartDrafter
from dart_ray.drafters.dart_model import DartConfig, DartModel
from dart_ray.models import load_target
from dart_ray.training.objectives import drafter_train_forward, kl_loss, level_targets, teacher_pass


@pytest.fixture(scope="module")
def tiny(tiny_dirs):
    return load_target(str(tiny_dirs["llama"]), "fp32", max_seq_len=256)


@pytest.mark.parametrize("draft_vocab", [None, 512])
def test_train_forward_matches_inference(tiny, draft_vocab):
    torch.manual_seed(0)
    args = tiny.args
    cfg = DartConfig.for_target(args, tiny.model_id, depth=4, draft_vocab=draft_vocab,
                                tie_head=draft_vocab is None)
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
        train_logits = drafter_train_forward(model, tiny.model.embed, taps, tokens,
                                             tiny.model.lm_head.weight)  # [1, L-1, d, Vd]
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
    expect = torch.stack([(ent[0, :, t] * valid[0, :, t]).sum() / valid[0, :, t].sum()
                          for t in range(2)])
    torch.testing.assert_close(per_level, expect, atol=1e-4, rtol=1e-4)


def test_prompt_weight_scales_the_prompts_prefixes_in_the_loss():
    """``prompt_weight``: each level's loss is the weighted mean over prefixes, the prompt's
    (j < prompt length - 1) weighted by it; 1 is the unweighted loss; 0 leaves the prompt's logits
    without gradient and equals the loss over the answer's prefixes alone."""
    from dart_ray.training.objectives import get_objective, prefix_weights
    from dart_ray.training.trainer import TrainConfig

    g = torch.Generator().manual_seed(0)
    B, L, K, V, d = 2, 9, 3, 12, 2
    top_id = torch.randint(0, V, (B, L, K), generator=g)
    top_lp = torch.log_softmax(torch.randn(B, L, K, generator=g), -1)
    logits = torch.randn(B, L - 1, d, V, generator=g, requires_grad=True)
    lens, plens = [9, 7], [4, 1]
    obj = get_objective("dart")

    def loss_at(w):
        cfg = TrainConfig(data="d", out="o", depth=d, prompt_weight=w)
        return obj.loss(logits, obj.targets(top_id, top_lp, None, cfg, lens, plens), 0.6)

    plain, _ = kl_loss(logits, *level_targets(top_id, top_lp, None, d, lens), gamma=0.6)
    torch.testing.assert_close(loss_at(1.0)[0], plain)
    ones = torch.ones(B, L - 1)                              # the weighted mean with all weights 1
    torch.testing.assert_close(kl_loss(logits, *level_targets(top_id, top_lp, None, d, lens),
                                       gamma=0.6, weight=ones)[0], plain)
    assert prefix_weights(plens, L - 1, 0.3, "cpu")[0].tolist() == pytest.approx([0.3] * 3
                                                                                 + [1.0] * 5)
    assert prefix_weights(plens, L - 1, 0.3, "cpu")[1].tolist() == [1.0] * 8   # no prompt prefix
    zero, per_level = loss_at(0.0)
    ids, p, valid = level_targets(top_id, top_lp, None, d, lens)
    valid[0, :3] = False                                     # row 0's prompt prefixes j = 0..2
    torch.testing.assert_close(zero, kl_loss(logits, ids, p, valid, gamma=0.6)[0])
    zero.backward()
    assert logits.grad[0, :3].abs().max() == 0 and logits.grad[0, 3:].abs().max() > 0
    half = loss_at(0.5)[1]
    assert not torch.allclose(half, per_level) and not torch.allclose(half, loss_at(1.0)[1])
    with pytest.raises(ValueError, match="prompt_weight"):
        TrainConfig(data="d", out="o", prompt_weight=1.5)


def _code_corpus(name: str, doc: str, n: int) -> list[dict]:
    """``n`` code prompts: ``def <name><i>(x):`` and the docstring ``Return x <doc> <i>.``"""
    return [{"prompt": f"def {name}{i}(x):\n    \"\"\"Return x {doc} {i}.\"\"\"\n",
             "source": "code", "chat": False}
            for i in range(n)]


def _answered(out, tiny_dirs, corpus: list[dict], **kw):
    """``corpus`` answered by the tiny target (fp32, plain decoding) into ``out``."""
    from dart_ray.training.gen_data import generate_data

    kw = {"max_new_tokens": 12, "batch_size": 4, **kw}
    return generate_data(out, model=str(tiny_dirs["llama"]), dtype="fp32", method="none",
                         corpus=corpus, progress=False, **kw)


def test_tiny_end_to_end_with_resume(tmp_path, tiny_dirs):
    from dart_ray.training.gen_data import generate_data
    from dart_ray.training.trainer import TrainConfig, train

    corpus = _code_corpus("f", "plus", 12)
    data = _answered(tmp_path / "data", tiny_dirs, corpus, shard_size=6)
    assert len(list(data.glob("shard-*.parquet"))) == 2
    # resumable: a second call finds every shard and generates nothing
    generate_data(tmp_path / "data", model="/nonexistent", corpus=corpus, shard_size=6,
                  progress=False)
    # never mixes two corpora in one directory
    with pytest.raises(ValueError, match="another corpus"):
        generate_data(tmp_path / "data", model="/nonexistent", corpus=corpus[:-1], shard_size=6,
                      progress=False)
    cfg = TrainConfig(data=str(data), out=str(tmp_path / "run"), model=str(tiny_dirs["llama"]),
                      depth=3, max_steps=2, seqs_per_step=2, max_len=48, draft_vocab=256,
                      eval_every=1, ckpt_every=1, eval_seqs=2)
    s1 = train(cfg, progress=False)
    assert s1["steps"] == 2 and s1["lr_plan"] == {"lr": 1e-3, "warmup": 30, "start": 0, "steps": 2}
    assert train(cfg, progress=False)["steps"] == 2  # restarting a finished run: nothing to do
    # a changed plan in the same directory is refused
    with pytest.raises(ValueError, match="re-plan"):
        train(TrainConfig(**{**cfg.__dict__, "max_steps": 3}), progress=False)
    with pytest.raises(ValueError, match="explicit LR schedule"):
        TrainConfig(**{**cfg.__dict__, "resume": str(tmp_path / "run")})
    # continuing the finished plan has nothing left (its LR is 0); a fresh plan of 1 more step does
    with pytest.raises(ValueError, match="nothing to continue"):
        train(TrainConfig(**{**cfg.__dict__, "out": str(tmp_path / "more"),
                             "resume": str(tmp_path / "run"), "lr_schedule": "continue"}),
              progress=False)
    s2 = train(TrainConfig(**{**cfg.__dict__, "out": str(tmp_path / "more"),
                              "resume": str(tmp_path / "run"), "lr_schedule": "fresh",
                              "max_steps": 1, "warmup_steps": 1}), progress=False)
    assert s2["steps"] == 3 and s2["lr_plan"] == {"lr": 1e-3, "warmup": 1, "start": 2, "steps": 1}
    assert s2["resumed"]["step"] == 2 and len(s2["losses"]) == 3  # history carried over
    model = DartModel.load(tmp_path / "more" / "drafter")
    assert model.cfg.depth == 3 and model.cfg.draft_vocab == 256
    assert (tmp_path / "more" / "training.png").stat().st_size > 0
    ev = json.loads((tmp_path / "more" / "train_summary.json").read_text())["final_eval"]
    assert len(ev["top1"]) == 3 and ev["chain_tau"] >= 1.0
    steps = [r["step"] for r in map(json.loads,
                                    (tmp_path / "more" / "metrics.jsonl").read_text().splitlines())
             if r["kind"] == "train"]
    assert steps == [1, 2, 3]  # the source run's curve continues


@pytest.mark.parametrize("arch", ["eagle", "medusa", "sps"])
def test_tiny_training_every_arch(tmp_path, tiny_dirs, arch):
    """Each baseline architecture trains through the same pipeline, its loss goes down on a
    repeated batch, and the saved artifact loads as that architecture."""
    from dart_ray.training.trainer import TrainConfig, train

    data = _answered(tmp_path / "data", tiny_dirs, _code_corpus("g", "times", 8), shard_size=8)
    cfg = TrainConfig(data=str(data), out=str(tmp_path / arch), model=str(tiny_dirs["llama"]),
                      arch=arch, depth=3, max_steps=12, seqs_per_step=4, max_len=48,
                      draft_vocab=256, eval_every=100, ckpt_every=100, eval_seqs=2, lr=3e-3,
                      warmup_steps=1, epochs=100)
    summary = train(cfg, progress=False)
    hist = json.loads((tmp_path / arch / "train_summary.json").read_text())
    assert summary["steps"] == 12 and hist["config"]["arch"] == arch
    ev = summary["final_eval"]
    assert len(ev["top1"]) == (1 if arch == "sps" else 3) and ev["chain_tau"] >= 1.0
    losses = summary["losses"]
    assert losses[-1] < losses[0], losses
    files = {p.name for p in (tmp_path / arch / "drafter").iterdir()}
    assert f"{'dart' if arch == 'eagle' else arch}_config.json" in files


def _random_eagle(tiny, depth=4, draft_vocab=512):
    args = tiny.args
    cfg = DartConfig.for_target(args, tiny.model_id, depth=depth, arch="eagle",
                                draft_vocab=draft_vocab, tie_head=False)
    model = DartModel(cfg).init_random(5)
    model.d2t.copy_(torch.randperm(args.vocab_size)[:draft_vocab].sort().values)
    return model.eval()


def test_eagle_train_forward_matches_inference(tiny):
    """The unrolled training forward equals the drafter run autoregressively along the true tokens,
    level by level, for several prefixes (context cache + scratch ancestors + positions)."""
    from dart_ray.drafters.eagle import EagleDrafter
    from dart_ray.training.objectives import eagle_train_forward

    torch.manual_seed(1)
    model = _random_eagle(tiny)
    L, d = 16, model.cfg.depth
    tokens = torch.randint(0, tiny.args.vocab_size, (1, L))
    cache = tiny.model.new_cache(1, 64)
    taps, _, _ = teacher_pass(tiny.model, cache, tokens, [L], model.cfg.tap_layers, 4)
    with torch.no_grad():
        train_logp = torch.log_softmax(eagle_train_forward(model, tiny.model.embed, taps, tokens),
                                       -1)  # [1, L-1, d, Vd]
    drafter = EagleDrafter(model, tiny.model.embed, tiny.model.lm_head.weight)
    drafter.allocate(1, 64)
    for j in (0, 4, L - 1 - d):
        drafter.prefill(slice(0, 1), [j + 1], taps[:, :j + 1], tokens[:, 1:j + 2])
        with torch.inference_mode():
            feat = drafter._context_forward(1)[:, None]                             # [1, 1, H]
            lens = torch.tensor(drafter.cache.lengths[:1])
            got = [drafter._logp(feat[:, 0])]
            vis = torch.zeros(1, 1, 0, dtype=torch.bool)
            for m in range(1, d):
                # chain: every slot is an ancestor
                vis = torch.cat([vis, torch.ones(1, 1, 1, dtype=torch.bool)], dim=-1)
                feat = drafter.expand(tokens[:, j + 1 + m, None], feat, vis, lens, m)
                got.append(drafter._logp(feat[:, 0]))
        torch.testing.assert_close(torch.stack(got, 1)[0], train_logp[0, j], atol=2e-4, rtol=1e-4)


def test_eagle_tree_is_prefix_closed_and_within_budget(tiny):
    from dart_ray.config import DecodingConfig
    from dart_ray.drafters.base import BatchView
    from dart_ray.drafters.eagle import EagleDrafter

    model = _random_eagle(tiny)
    drafter = EagleDrafter(model, tiny.model.embed, tiny.model.lm_head.weight)
    drafter.allocate(2, 64)
    tokens = torch.randint(0, tiny.args.vocab_size, (2, 12))
    cache = tiny.model.new_cache(2, 64)
    taps, _, _ = teacher_pass(tiny.model, cache, tokens, [12, 12], model.cfg.tap_layers, 4)
    drafter.prefill(slice(0, 2), [9, 11], taps, tokens[:, 1:])
    dec = DecodingConfig(draft_depth=4, top_k=5, beam_width=3, tree_budget=20)
    view = BatchView(roots=tokens[:, 0], lengths=[9, 11], tokens=tokens.numpy(), decoding=dec)
    tree = drafter.propose(view)
    tree.validate()
    assert tree.num_nodes - 1 == 20 and 2 <= int(tree.depths.max()) <= 4
    assert bool(tree.valid[:, 1:].all())


def test_medusa_and_sps_train_forward_match_inference(tiny):
    from dart_ray.drafters.medusa import MedusaDrafter
    from dart_ray.drafters.medusa_model import MedusaConfig, MedusaModel
    from dart_ray.drafters.sps import SpsDrafter
    from dart_ray.drafters.sps_model import SpsConfig, SpsModel
    from dart_ray.training.objectives import medusa_train_forward, sps_train_forward

    args = tiny.args
    d2t = torch.randperm(args.vocab_size)[:512].sort().values
    medusa = MedusaModel(MedusaConfig.for_target(args, tiny.model_id, depth=3, draft_vocab=512))
    medusa.init_from_target(tiny.model, d2t)
    with torch.no_grad():
        for blk in medusa.blocks:
            blk.weight.normal_(0, 0.1)
    medusa.eval()
    L = 12
    tokens = torch.randint(0, args.vocab_size, (1, L))
    cache = tiny.model.new_cache(1, 64)
    fin, _, _ = teacher_pass(tiny.model, cache, tokens, [L], medusa.cfg.tap_layers, 4)
    with torch.no_grad():
        ref = medusa_train_forward(medusa, fin)                                    # [1, L-1, 3, Vd]
    md = MedusaDrafter(medusa)
    md.allocate(1, 64)
    md.prefill(slice(0, 1), [7], fin, tokens[:, 1:])
    torch.testing.assert_close(md.draft_logits(1, 3)[0][:, d2t], ref[0, 6])
    # SpS: the cached chain (catch-up chunk, then one token at a time) equals the training forward
    sps_cfg = SpsConfig.for_target(args, tiny.model_id, num_layers=2, init_layers=(1, 3),
                                   draft_vocab=512, max_depth=4)
    sps = SpsModel(sps_cfg).init_from_target(tiny.model, d2t).eval()
    with torch.no_grad():
        head = tiny.model.lm_head.weight[d2t]
        ref = sps_train_forward(sps, tiny.model.embed, tokens, head)             # [1, L-1, 1, Vd]
    sd = SpsDrafter(sps, tiny.model.embed, tiny.model.lm_head.weight)
    sd.allocate(1, 64)
    sd.prefill(slice(0, 1), [5], None, None)
    with torch.inference_mode():
        pos = torch.arange(6)[None]
        from dart_ray.masks import attention_mask, causal_ancestors
        lg = sd._logits(tokens[:, :6], pos,
                        attention_mask([0], causal_ancestors(6), 6, torch.float32), [0], 1)
        sd.cache.commit_all(slice(0, 1), [6])
        nxt = sd._logits(tokens[:, 6:7], torch.tensor([[6]]), None, [6], 1)
    torch.testing.assert_close(lg[0, 1:6], ref[0, :5, 0], atol=2e-4, rtol=1e-4)
    torch.testing.assert_close(nxt[0, 0], ref[0, 5, 0], atol=2e-4, rtol=1e-4)


def test_joint_training_shares_batches_and_resumes(tmp_path, tiny_dirs):
    """Several archs in one run: one teacher pass per batch, equal steps, per-arch outputs,
    resume."""
    from dart_ray.training.trainer import TrainConfig, train

    data = _answered(tmp_path / "data", tiny_dirs, _code_corpus("h", "minus", 8),
                     max_new_tokens=10, shard_size=8)
    cfg = TrainConfig(data=str(data), out=str(tmp_path / "run"), model=str(tiny_dirs["llama"]),
                      arch="dart", joint=("eagle:2", "medusa", "sps:4"), depth=3, max_steps=3,
                      seqs_per_step=2, max_len=40, draft_vocab=256, eval_every=100, ckpt_every=1,
                      eval_seqs=2)
    # stops after step 1
    s = train(TrainConfig(**{**cfg.__dict__, "time_budget_s": 1e-9}), progress=False)
    assert s["arch"] == "dart" and s["steps"] == 1
    assert sorted(s["joint_with"]) == ["eagle", "medusa", "sps"]
    for arch in ("dart", "eagle", "medusa", "sps"):
        summ = json.loads((tmp_path / "run" / arch / "train_summary.json").read_text())
        assert summ["steps"] == 1 and summ["train_wall_s"] > 0
    s2 = train(cfg, progress=False)
    assert s2["steps"] == 3 and len(s2["losses"]) == 3
    summary = json.loads((tmp_path / "run" / "eagle" / "train_summary.json").read_text())
    assert summary["config"]["depth"] == 2


@pytest.mark.parametrize("crash", ["before the record", "during the renames"])
def test_joint_checkpoints_are_committed_together(tmp_path, monkeypatch, crash):
    """Jointly trained students' checkpoints are one commit: a crash while writing them leaves
    every student at the old step (pending states dropped on restart) or, once the commit record
    is written, every student at the new one (renames completed on restart) -- never students at
    different steps, which no restart could continue."""
    from dart_ray.training import checkpoint as ck

    dirs = [tmp_path / a / "checkpoint" for a in ("dart", "medusa", "eagle")]
    ck.save_states_together([({"step": 1}, d) for d in dirs], dirs[0])
    assert [ck.load_state(d / ck.STATE_FILE)["step"] for d in dirs] == [1, 1, 1]

    class Killed(BaseException):
        pass

    def die(*args, **kwargs):
        raise Killed

    if crash == "before the record":
        monkeypatch.setattr(ck.json, "dump", die)
    else:                                  # the first rename happened, then the process died
        real = ck.os.replace
        renames = []

        def replace_once(src, dst):
            if str(src).endswith(ck.PENDING_FILE):
                if renames:
                    raise Killed
                renames.append(src)
            return real(src, dst)

        monkeypatch.setattr(ck.os, "replace", replace_once)
    with pytest.raises(Killed):
        ck.save_states_together([({"step": 2}, d) for d in dirs], dirs[0])
    monkeypatch.undo()
    steps = [ck.load_state(d / ck.STATE_FILE)["step"] for d in dirs]
    assert len(set(steps)) == (1 if crash == "before the record" else 2)    # as the crash left it
    ck.finish_joint_commit(dirs[0], dirs)                                  # what a restart does
    want = 1 if crash == "before the record" else 2
    assert [ck.load_state(d / ck.STATE_FILE)["step"] for d in dirs] == [want] * 3
    assert not any((d / ck.PENDING_FILE).exists() for d in dirs)
    assert not (dirs[0] / ck.JOINT_COMMIT_FILE).exists()


def test_ship_baseline_writes_card_and_checks_size(tmp_path, tiny):
    from dart_ray.drafters.medusa_model import MedusaConfig, MedusaModel
    from dart_ray.training.ship import ship

    run = tmp_path / "run"
    MedusaModel(MedusaConfig.for_target(tiny.args, tiny.model_id, depth=2,
                                        draft_vocab=64)).save(run / "drafter")
    ev = {"top1": [0.5, 0.25], "top5": [0.75, 0.5], "chain_tau": 1.6, "n_prefixes": 10}
    (run / "train_summary.json").write_text(json.dumps({
        "arch": "medusa", "steps": 3, "train_seqs": 8, "val_seqs": 2, "train_wall_s": 60.0,
        "joint_with": ["dart"], "final_eval": ev,
        "config": {"arch": "medusa", "depth": 2, "draft_vocab": 64}}))
    dest = ship(run, None, "tiny-model", "make artifacts", dest_root=tmp_path / "artifacts")
    card = (dest / "medusa" / "CARD.md").read_text()
    assert "Medusa heads" in card and "1.60" in card and "jointly with dart" in card
    assert MedusaModel.load(dest / "medusa").cfg.depth == 2
    assert not (dest / "CARD.md").exists()  # the DART card is not touched by a baseline


def test_ship_keeps_the_shipped_ngram_when_it_is_named(tmp_path, tiny):
    """``ship --ngram`` naming the N-gram model already in the destination keeps it (an earlier
    ship deleted the destination first, and with it its own source)."""
    from dart_ray.drafters.dart_model import DartConfig, DartModel
    from dart_ray.training.ship import ship

    run = tmp_path / "run"
    cfg = DartConfig.for_target(tiny.args, tiny.model_id, depth=2, draft_vocab=64, tie_head=False)
    DartModel(cfg).init_random(0).save(run / "drafter")
    ev = {"top1": [0.5, 0.25], "top5": [0.75, 0.5], "chain_tau": 1.6, "n_prefixes": 10}
    (run / "train_summary.json").write_text(json.dumps({
        "arch": "dart", "steps": 3, "train_seqs": 8, "val_seqs": 2, "train_wall_s": 60.0,
        "final_eval": ev, "config": {"arch": "dart", "depth": 2, "draft_vocab": 64}}))
    ngram = tmp_path / "artifacts" / "tiny-model" / "ngram"
    ngram.mkdir(parents=True)
    (ngram / "meta.json").write_text('{"n": 3}')
    dest = ship(run, ngram, "tiny-model", "make artifacts", dest_root=tmp_path / "artifacts")
    assert (dest / "ngram" / "meta.json").read_text() == '{"n": 3}'
    assert DartModel.load(dest / "drafter").cfg.depth == 2 and (dest / "CARD.md").is_file()


def test_batch_stream_resume_replays_across_epochs():
    """A run resumed at step s (here past an epoch boundary) sees the uninterrupted run's
    batches."""
    from itertools import islice

    from dart_ray.training.trainer import _batch_stream

    full = list(islice(_batch_stream(7, 2, seed=3), 8))   # 3 batches of 2 per epoch
    resumed = list(islice(_batch_stream(7, 2, seed=3, skip=5), 3))
    assert resumed == full[5:8]
    assert full[:3] != full[3:6]                           # each epoch draws a new permutation
    assert all(len(set(sum(full[e:e + 3], []))) == 6 for e in (0, 3))  # no index twice an epoch


def test_teacher_cache_rebuilds_batches_exactly():
    """Stored rows come back as teacher_pass gave them (real positions; taps in the teacher's dtype
    losslessly), in any batch composition, padding zeroed; a batch with one uncached row is a miss;
    the byte budget is kept."""
    from dart_ray.training.teacher_cache import TeacherCache

    g = torch.Generator().manual_seed(0)
    lens = [5, 3, 4]
    taps = torch.randn(3, 5, 6, generator=g).bfloat16().float()         # computed in bf16
    top_id = torch.randint(0, 50, (3, 5, 2), generator=g)
    top_lp = torch.randn(3, 5, 2, generator=g)
    tc = TeacherCache(10**6, torch.bfloat16)
    assert tc.lookup([0, 1], lens[:2], torch.device("cpu")) is None and tc.misses == 1
    tc.store([10, 11, 12], lens, taps, top_id, top_lp)
    got = tc.lookup([12, 10], [4, 5], torch.device("cpu"))
    assert got is not None and tc.hits == 1
    t, i, lp = got
    assert t.shape == (2, 5, 6) and i.shape == (2, 5, 2) and i.dtype == torch.long
    assert torch.equal(t[0, :4], taps[2, :4]) and torch.equal(t[1], taps[0])
    assert torch.equal(i[0, :4], top_id[2, :4]) and torch.equal(lp[1], top_lp[0])
    assert not t[0, 4:].any() and not i[0, 4:].any() and not lp[0, 4:].any()
    assert tc.lookup([12, 13], [4, 4], torch.device("cpu")) is None
    with pytest.raises(ValueError, match="positions"):
        tc.lookup([11], [5], torch.device("cpu"))
    small = TeacherCache(5 * 6 * 2 + 5 * 2 * 8, torch.bfloat16)          # room for row 0 only
    small.store([0, 1], lens[:2], taps[:2], top_id[:2], top_lp[:2])
    assert len(small) == 1 and small.bytes == 5 * 6 * 2 + 5 * 2 * 8
    none = TeacherCache(10**6, torch.float32)
    none.store([0], [5], None, top_id[:1], top_lp[:1])
    assert none.lookup([0], [5], torch.device("cpu"))[0] is None


def test_teacher_cache_directory_round_trip(tmp_path):
    """Saved parts come back in a new cache of the same teacher (only the unsaved entries are
    appended each save); another teacher's key reads nothing."""
    from dart_ray.training.teacher_cache import TeacherCache, seq_key

    g = torch.Generator().manual_seed(1)
    key = {"target": "t", "dtype": "bf16", "taps": [1, 2], "topk": 2}
    taps = torch.randn(2, 4, 6, generator=g).bfloat16().float()
    top_id, top_lp = torch.randint(0, 50, (2, 4, 2), generator=g), torch.randn(2, 4, 2, generator=g)
    a = TeacherCache(10**6, torch.bfloat16, tmp_path, key=key)
    ka, kb = seq_key([1, 2, 3, 4]), seq_key([1, 2, 3, 5])
    assert ka != kb and seq_key([1, 2, 3, 4]) == ka
    a.store([ka], [4], taps[:1], top_id[:1], top_lp[:1])
    a.save()
    a.store([ka, kb], [4, 3], taps, top_id, top_lp)
    a.save()
    a.save()                                                  # nothing new: no empty part
    parts = sorted(a.dir.glob("part-*.pt"))
    assert len(parts) == 2 and len(torch.load(parts[1], weights_only=True)) == 1
    b = TeacherCache(10**6, torch.bfloat16, tmp_path, key=key)
    assert b.loaded == 2 and b.dir == a.dir
    got = b.lookup([kb, ka], [3, 4], torch.device("cpu"))
    want = a.lookup([kb, ka], [3, 4], torch.device("cpu"))
    assert all(torch.equal(x, y) for x, y in zip(got, want, strict=True))
    other = TeacherCache(10**6, torch.bfloat16, tmp_path, key={**key, "dtype": "fp32"})
    assert other.loaded == 0 and other.dir != a.dir


def test_teacher_cache_directory_serves_a_later_run(tmp_path, tiny_dirs, tiny_mixed_data,
                                                    monkeypatch):
    """A second run on the same data with the first one's --teacher-cache makes no teacher pass at
    all and trains exactly as the first did."""
    from dart_ray.training import trainer

    calls = []
    real = trainer.teacher_pass

    def counting(*a, **k):
        calls.append(1)
        return real(*a, **k)

    monkeypatch.setattr(trainer, "teacher_pass", counting)
    kw = {"max_steps": None, "epochs": 2.0, "dtype": "fp32",
          "teacher_cache": str(tmp_path / "teacher")}
    first = trainer.train(_base_cfg(tiny_mixed_data, tiny_dirs, out=str(tmp_path / "a"), **kw),
                          progress=False)
    assert calls
    calls.clear()
    again = trainer.train(_base_cfg(tiny_mixed_data, tiny_dirs, out=str(tmp_path / "b"), **kw),
                          progress=False)
    assert not calls
    assert again["losses"] == first["losses"]
    with pytest.raises(ValueError, match="teacher_cache_gb"):
        _base_cfg(tiny_mixed_data, tiny_dirs, out=str(tmp_path / "x"), teacher_cache_gb=0,
                  teacher_cache=str(tmp_path / "t"))


def test_teacher_cache_directory_keeps_continuation_bit_identical(tmp_path, tiny_dirs,
                                                                  tiny_mixed_data):
    """Stopped at step 1 and continued across the epoch boundary, a run with --teacher-cache ends
    bit-identical to the uninterrupted one (the continued run reads the entries computed before the
    stop instead of recomputing them in other batches)."""
    from dart_ray.training.trainer import train

    kw = {"max_steps": None, "epochs": 2.0, "dtype": "bf16"}
    a = train(_base_cfg(tiny_mixed_data, tiny_dirs, out=str(tmp_path / "a"),
                        teacher_cache=str(tmp_path / "ta"), **kw), progress=False)
    b1 = train(_base_cfg(tiny_mixed_data, tiny_dirs, out=str(tmp_path / "b"), time_budget_s=1e-9,
                         teacher_cache=str(tmp_path / "tb"), **kw), progress=False)
    assert b1["steps"] == 1
    b = train(_base_cfg(tiny_mixed_data, tiny_dirs, out=str(tmp_path / "b"),
                        teacher_cache=str(tmp_path / "tb"), **kw), progress=False)
    assert b["steps"] == a["steps"] > b["train_seqs"] // 2
    assert a["losses"] == b["losses"]
    ref, got = _state(tmp_path / "a"), _state(tmp_path / "b")
    for k, v in ref["model"].items():
        assert torch.equal(v, got["model"][k]), k


def test_a_checkpoint_from_before_a_new_setting_still_restarts(tmp_path, tiny_dirs,
                                                               tiny_mixed_data):
    """A run key written before a TrainConfig field existed reads that field as its default, so the
    run restarts (a real change of a plan-fixing setting is still refused)."""
    from dart_ray.training.trainer import train

    cfg = _base_cfg(tiny_mixed_data, tiny_dirs, out=str(tmp_path / "r"), time_budget_s=1e-9)
    train(cfg, progress=False)
    path = tmp_path / "r" / "checkpoint" / "state.pt"
    st = torch.load(path, weights_only=False)
    del st["run_key"]["mlp_width"]
    del st["run_key"]["revocab"]
    torch.save(st, path)
    assert train(_base_cfg(tiny_mixed_data, tiny_dirs, out=str(tmp_path / "r")),
                 progress=False)["steps"] == 4
    # revocab was a bool before "extend" existed: a run saved with False restarts too
    cfg = _base_cfg(tiny_mixed_data, tiny_dirs, out=str(tmp_path / "f"), time_budget_s=1e-9)
    train(cfg, progress=False)
    path = tmp_path / "f" / "checkpoint" / "state.pt"
    st = torch.load(path, weights_only=False)
    st["run_key"]["revocab"] = False
    torch.save(st, path)
    assert train(_base_cfg(tiny_mixed_data, tiny_dirs, out=str(tmp_path / "f")),
                 progress=False)["steps"] == 4
    with pytest.raises(ValueError, match="other settings"):
        train(_base_cfg(tiny_mixed_data, tiny_dirs, out=str(tmp_path / "r"), lr=1e-2),
              progress=False)


def _epochs(n_seqs, per_epoch):
    from itertools import islice

    from dart_ray.training.trainer import _batch_stream

    batches = list(islice(_batch_stream(n_seqs, 2, seed=0), 2 * per_epoch))
    return batches[:per_epoch], batches[per_epoch:]


def test_teacher_cache_skips_the_target_after_the_first_epoch(tmp_path, tiny_dirs, tiny_mixed_data,
                                                              monkeypatch):
    """Two epochs with the cache: teacher passes in the first only, and the run trains as the
    uncached one does (equal to rounding: here fp32, the same numbers)."""
    from dart_ray.training import trainer

    calls = []
    real = trainer.teacher_pass

    def counting(*a, **k):
        calls.append(a[2].shape)
        return real(*a, **k)

    monkeypatch.setattr(trainer, "teacher_pass", counting)
    kw = {"max_steps": None, "epochs": 2.0, "dtype": "fp32"}
    cached = trainer.train(_base_cfg(tiny_mixed_data, tiny_dirs, out=str(tmp_path / "c"), **kw),
                           progress=False)
    n_cached = len(calls)
    plain = trainer.train(_base_cfg(tiny_mixed_data, tiny_dirs, out=str(tmp_path / "p"),
                                    teacher_cache_gb=0, **kw), progress=False)
    per_epoch = cached["train_seqs"] // 2
    assert cached["steps"] == plain["steps"] == 2 * per_epoch
    # the second epoch needs the teacher only for batches holding a sequence the first one left out
    # (an odd count leaves one out each epoch)
    first, second = _epochs(cached["train_seqs"], per_epoch)
    seen = set(sum(first, []))
    fresh = sum(any(i not in seen for i in b) for b in second)
    assert fresh < per_epoch
    assert n_cached == per_epoch + fresh and len(calls) - n_cached == 2 * per_epoch
    assert cached["losses"] == pytest.approx(plain["losses"], rel=1e-4, abs=1e-5)
    with pytest.raises(ValueError, match="teacher_cache_gb"):
        _base_cfg(tiny_mixed_data, tiny_dirs, out=str(tmp_path / "x"), teacher_cache_gb=-1)


# ---------------------------------------------------------------------------------------------
# continuing runs, init from the target, measuring while training (issue 17)
# ---------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def tiny_mixed_data(tmp_path_factory, tiny_dirs):
    """Code and chat rows answered by the tiny target, half of them held out."""
    corpus = _code_corpus("k", "to the power", 10)
    corpus += [{"prompt": f"Give me {i} tips for keeping a small garden tidy.", "source": "chat",
                "chat": True}
               for i in range(10)]
    return _answered(tmp_path_factory.mktemp("mixed") / "data", tiny_dirs, corpus,
                     max_new_tokens=10, shard_size=10, val_frac=0.4)


def _base_cfg(data, tiny_dirs, **kw):
    from dart_ray.training.trainer import TrainConfig

    base = {"data": str(data), "model": str(tiny_dirs["llama"]), "depth": 3, "max_steps": 4,
            "seqs_per_step": 2, "max_len": 40, "draft_vocab": 256, "eval_every": 100,
            "ckpt_every": 100, "eval_seqs": 2, "warmup_steps": 2, "lr": 3e-3}
    return TrainConfig(**{**base, **kw})


def _state(run):
    return torch.load(run / "checkpoint" / "state.pt", weights_only=False)


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_time_budget_stop_and_continue_equal_uninterrupted(tmp_path, tiny_dirs, tiny_mixed_data,
                                                           dtype):
    """A run stopped by its time budget, then rerun (or resumed elsewhere with --lr-schedule
    continue), ends bit-identical to the uninterrupted run: weights, AdamW moments, data order, LR,
    losses. In both training dtypes (bf16: teacher in bf16, students under bf16 autocast)."""
    import shutil

    from dart_ray.training.trainer import train

    a = train(_base_cfg(tiny_mixed_data, tiny_dirs, out=str(tmp_path / "a"), dtype=dtype),
              progress=False)
    b1 = train(_base_cfg(tiny_mixed_data, tiny_dirs, out=str(tmp_path / "b"), time_budget_s=1e-9,
                         dtype=dtype),
               progress=False)
    assert b1["steps"] == 1 and b1["stopped"] == "time budget" and b1["plan_end"] == 4
    # a usable drafter at the stop
    assert (tmp_path / "b" / "drafter" / "model.safetensors").is_file()
    shutil.copytree(tmp_path / "b", tmp_path / "b_at_1")
    b = train(_base_cfg(tiny_mixed_data, tiny_dirs, out=str(tmp_path / "b"), dtype=dtype),
              progress=False)
    c = train(_base_cfg(tiny_mixed_data, tiny_dirs, out=str(tmp_path / "c"),
                        resume=str(tmp_path / "b_at_1"), lr_schedule="continue", dtype=dtype),
              progress=False)
    assert a["steps"] == b["steps"] == c["steps"] == 4
    assert a["losses"] == b["losses"] == c["losses"]
    ref = _state(tmp_path / "a")
    for run in ("b", "c"):
        st = _state(tmp_path / run)
        assert st["step"] == 4 and st["data_pos"] == ref["data_pos"] == 4
        assert st["plan"] == ref["plan"]
        for k, v in ref["model"].items():
            assert torch.equal(v, st["model"][k]), (run, k)
        for pid, s in ref["opt"]["state"].items():
            for name, v in s.items():
                assert torch.equal(v, st["opt"]["state"][pid][name]), (run, pid, name)
    lrs = [[r["lr"] for r in map(json.loads,
                                 (tmp_path / run / "metrics.jsonl").read_text().splitlines())
            if r["kind"] == "train"] for run in ("a", "b", "c")]
    assert lrs[0] == lrs[1] == lrs[2] and len(lrs[0]) == 4
    if dtype == "fp32":
        # continuing the plan with the data batched otherwise would lose its place in the data
        for change in ({"seqs_per_step": 3}, {"max_len": 32}, {"seed": 9}):
            with pytest.raises(ValueError, match="batch the data otherwise"):
                train(_base_cfg(tiny_mixed_data, tiny_dirs, out=str(tmp_path / "d"),
                                resume=str(tmp_path / "b_at_1"), lr_schedule="continue",
                                **change), progress=False)


def test_a_stop_exports_the_drafter_before_the_final_evaluation(tmp_path, tiny_dirs,
                                                                tiny_mixed_data, monkeypatch):
    """A stop (here the time budget) writes the checkpoint and the drafter before the final held-out
    evaluation, so a process killed during that evaluation (a second signal, an orchestrator's
    short grace period) loses nothing; rerunning then finishes the summary."""
    from dart_ray.training import trainer

    def killed(*a, **k):
        raise KeyboardInterrupt

    monkeypatch.setattr(trainer, "_evaluate", killed)
    out = tmp_path / "run"
    with pytest.raises(KeyboardInterrupt):
        trainer.train(_base_cfg(tiny_mixed_data, tiny_dirs, out=str(out), time_budget_s=1e-9),
                      progress=False)
    assert (out / "drafter" / "model.safetensors").is_file()
    assert _state(out)["step"] == 1
    assert not (out / "train_summary.json").exists()


def test_resume_from_a_drafter_dir_keeps_its_vocabulary(tmp_path, tiny, tiny_dirs, tiny_mixed_data):
    """--resume of a shipped-style drafter dir: weights and draft vocabulary kept, fresh plan
    only."""
    from dart_ray.training.trainer import train

    cfg = DartConfig.for_target(tiny.args, tiny.model_id, depth=3, draft_vocab=256, tie_head=False)
    shipped = DartModel(cfg).init_random(7)
    shipped.d2t.copy_(torch.arange(256) * 7)
    shipped.to(torch.bfloat16).save(tmp_path / "shipped")
    with pytest.raises(ValueError, match="drafter directory"):
        train(_base_cfg(tiny_mixed_data, tiny_dirs, out=str(tmp_path / "x"),
                        resume=str(tmp_path / "shipped"), lr_schedule="continue"), progress=False)
    with pytest.raises(ValueError, match="does not fit"):
        train(_base_cfg(tiny_mixed_data, tiny_dirs, out=str(tmp_path / "y"),
                        resume=str(tmp_path / "shipped"), lr_schedule="fresh", depth=4),
              progress=False)
    s = train(_base_cfg(tiny_mixed_data, tiny_dirs, out=str(tmp_path / "z"),
                        resume=str(tmp_path / "shipped"), lr_schedule="fresh", max_steps=2),
              progress=False)
    assert s["steps"] == 2 and s["resumed"]["kind"] == "drafter"
    assert torch.equal(DartModel.load(tmp_path / "z" / "drafter").d2t, torch.arange(256) * 7)
    with pytest.raises(ValueError, match="inside --out"):
        train(_base_cfg(tiny_mixed_data, tiny_dirs, out=str(tmp_path / "w"),
                        resume=str(tmp_path / "w"), lr_schedule="fresh"), progress=False)


def test_choose_draft_vocab_counts_answers_only():
    from dart_ray.training.vocab import choose_draft_vocab, coverage

    # prompt tokens 9 (x5) are read, never drafted: the vocabulary is the answers' top tokens
    seqs = [([9, 9, 9, 9, 9, 1, 1, 2], 5), ([9, 3, 1], 1)]
    d2t = choose_draft_vocab(seqs, 2, 10)
    assert d2t.tolist() == [1, 2]
    assert coverage(seqs, d2t, 10) == pytest.approx(4 / 5)
    # keep: every kept token (7 and 9 are never answered), then the answers' most frequent others
    assert choose_draft_vocab(seqs, 4, 10, keep=torch.tensor([9, 7])).tolist() == [1, 2, 7, 9]
    assert choose_draft_vocab(seqs, 3, 10, keep=torch.tensor([2, 7])).tolist() == [1, 2, 7]
    with pytest.raises(ValueError, match="cannot keep 3"):
        choose_draft_vocab(seqs, 2, 10, keep=torch.tensor([1, 2, 3]))


def test_revocab_head_keeps_shared_rows_and_maps_new_ones():
    """Shared tokens keep their trained rows; when the trained head is an exact linear map of the
    target's rows, the new rows are that map of theirs."""
    from dart_ray.training.vocab import revocab_head

    g = torch.Generator().manual_seed(0)
    target_head = torch.randn(50, 8, generator=g)
    A = torch.randn(8, 8, generator=g)
    old = torch.arange(0, 40)
    head = target_head[old] @ A
    head[3] += 5.0                                      # a trained row that fits no map: kept as is
    new = torch.tensor([3, 5, 41, 45, 49])
    out = revocab_head(head, old, new, target_head, ridge=0.0)
    assert out.shape == (5, 8)
    assert torch.equal(out[0], head[3]) and torch.equal(out[1], head[5])
    exact = revocab_head(target_head[old] @ A, old, new, target_head, ridge=0.0)
    torch.testing.assert_close(exact[2:], target_head[new[2:]] @ A, atol=1e-3, rtol=1e-3)


def test_revocab_resume_re_chooses_the_vocabulary(tmp_path, tiny, tiny_dirs, tiny_mixed_data):
    """--revocab: the resumed drafter's vocabulary becomes the data answers' most frequent tokens,
    the rows of tokens it shares with the source stay (bf16-exact), the rest of the weights too."""
    from dart_ray.training.gen_data import load_rows
    from dart_ray.training.trainer import train
    from dart_ray.training.vocab import choose_draft_vocab

    cfg = DartConfig.for_target(tiny.args, tiny.model_id, depth=3, draft_vocab=256, tie_head=False)
    shipped = DartModel(cfg).init_random(7)
    shipped.d2t.copy_(torch.arange(256) * 7 % tiny.args.vocab_size)
    shipped.d2t.copy_(shipped.d2t.sort().values)
    shipped.to(torch.bfloat16).save(tmp_path / "shipped")
    src = DartModel.load(tmp_path / "shipped")
    with pytest.raises(ValueError, match="revocab"):
        _base_cfg(tiny_mixed_data, tiny_dirs, out=str(tmp_path / "x"), revocab="replace")
    with pytest.raises(ValueError, match="revocab"):
        _base_cfg(tiny_mixed_data, tiny_dirs, out=str(tmp_path / "x"), revocab="replace",
                  resume=str(tmp_path / "shipped"), lr_schedule="continue")
    with pytest.raises(ValueError, match="revocab must be one of"):
        _base_cfg(tiny_mixed_data, tiny_dirs, out=str(tmp_path / "x"), revocab="grow",
                  resume=str(tmp_path / "shipped"), lr_schedule="fresh")
    run = _base_cfg(tiny_mixed_data, tiny_dirs, out=str(tmp_path / "z"), draft_vocab=128,
                    resume=str(tmp_path / "shipped"), lr_schedule="fresh", max_steps=1, lr=0.0,
                    revocab="replace")
    s = train(run, progress=False)
    assert s["steps"] == 1
    got = DartModel.load(tmp_path / "z" / "drafter")
    seqs = [(ids, plen) for ids, plen, _ in load_rows(run.data, "train")]
    want = choose_draft_vocab(seqs, 128, tiny.args.vocab_size)
    assert torch.equal(got.d2t, want)
    shared = torch.isin(want, src.d2t)
    assert 0 < int(shared.sum()) < 128
    where = {int(t): i for i, t in enumerate(src.d2t)}
    rows = torch.tensor([where[int(t)] for t in want[shared]])
    assert torch.equal(got.head.weight[shared], src.head.weight[rows])
    assert torch.equal(got.fc.weight, src.fc.weight)


def test_revocab_extend_keeps_every_token(tmp_path, tiny, tiny_dirs, tiny_mixed_data):
    """--revocab extend: the resumed drafter's whole vocabulary and its rows stay, the answers' most
    frequent other tokens fill the new slots; a smaller vocabulary than the source's is refused."""
    from dart_ray.training.gen_data import load_rows
    from dart_ray.training.trainer import train
    from dart_ray.training.vocab import choose_draft_vocab

    cfg = DartConfig.for_target(tiny.args, tiny.model_id, depth=3, draft_vocab=64, tie_head=False)
    shipped = DartModel(cfg).init_random(7)
    shipped.d2t.copy_((torch.arange(64) * 7 % tiny.args.vocab_size).sort().values)
    shipped.to(torch.bfloat16).save(tmp_path / "shipped")
    src = DartModel.load(tmp_path / "shipped")
    kw = {"resume": str(tmp_path / "shipped"), "lr_schedule": "fresh", "max_steps": 1,
          "lr": 0.0, "revocab": "extend"}
    run = _base_cfg(tiny_mixed_data, tiny_dirs, out=str(tmp_path / "z"), draft_vocab=96, **kw)
    train(run, progress=False)
    got = DartModel.load(tmp_path / "z" / "drafter")
    assert len(got.d2t) == 96 and bool(torch.isin(src.d2t, got.d2t).all())
    seqs = [(ids, plen) for ids, plen, _ in load_rows(run.data, "train")]
    counts = torch.zeros(tiny.args.vocab_size, dtype=torch.long)
    for ids, plen in seqs:
        counts += torch.bincount(torch.tensor(ids[plen:]), minlength=tiny.args.vocab_size)
    added = got.d2t[~torch.isin(got.d2t, src.d2t)]
    others = counts.clone()
    others[src.d2t] = -1
    assert int(counts[added].min()) >= int(others.topk(32).values[-1])   # the most frequent others
    assert torch.equal(got.d2t, choose_draft_vocab(seqs, 96, tiny.args.vocab_size, keep=src.d2t))
    where = torch.searchsorted(got.d2t, src.d2t)
    assert torch.equal(got.head.weight[where], src.head.weight)
    with pytest.raises(ValueError, match="cannot keep 64"):
        train(_base_cfg(tiny_mixed_data, tiny_dirs, out=str(tmp_path / "s"), draft_vocab=48,
                        **kw), progress=False)
    with pytest.raises(ValueError, match="adds no token"):
        train(_base_cfg(tiny_mixed_data, tiny_dirs, out=str(tmp_path / "e"), draft_vocab=64,
                        **kw), progress=False)
    # resuming the extended drafter without re-choosing needs its own size, and the error says which
    kw.pop("revocab")
    with pytest.raises(ValueError, match=r"resumed: \[96\] tokens\); pass --draft-vocab"):
        train(_base_cfg(tiny_mixed_data, tiny_dirs, out=str(tmp_path / "r"), draft_vocab=64,
                        **{**kw, "resume": str(tmp_path / "z")}), progress=False)
    # ... and without --draft-vocab the resumed drafter's own size is taken, rows and all
    s = train(_base_cfg(tiny_mixed_data, tiny_dirs, out=str(tmp_path / "d"), draft_vocab=None,
                        **{**kw, "resume": str(tmp_path / "z")}), progress=False)
    assert s["steps"] == 2                           # global: z's one + this one
    again = DartModel.load(tmp_path / "d" / "drafter")
    assert torch.equal(again.d2t, got.d2t) and torch.equal(again.head.weight, got.head.weight)


def test_mlp_growth_keeps_the_drafter_and_trains_from_it(tmp_path, tiny, tiny_dirs,
                                                        tiny_mixed_data):
    """--mlp-width on a resumed drafter: the grown drafter computes what the source computed (its
    first loss equals an ungrown resume's), old units are kept bf16-exact, the shipped drafter has
    the new width; a narrower width, medusa, or a continued schedule are refused."""
    from dart_ray.training.trainer import train

    cfg = DartConfig.for_target(tiny.args, tiny.model_id, depth=3, draft_vocab=256, tie_head=False)
    shipped = DartModel(cfg).init_random(7)
    shipped.d2t.copy_(torch.arange(256))
    shipped.to(torch.bfloat16).save(tmp_path / "shipped")
    src = DartModel.load(tmp_path / "shipped")
    units = cfg.intermediate_size
    kw = {"resume": str(tmp_path / "shipped"), "lr_schedule": "fresh", "max_steps": 1,
          "dtype": "fp32"}
    plain = train(_base_cfg(tiny_mixed_data, tiny_dirs, out=str(tmp_path / "p"), **kw),
                  progress=False)
    grown = train(_base_cfg(tiny_mixed_data, tiny_dirs, out=str(tmp_path / "g"),
                            mlp_width=units + 24, **kw), progress=False)
    assert grown["losses"][0] == pytest.approx(plain["losses"][0], rel=1e-5)
    got = DartModel.load(tmp_path / "g" / "drafter")
    assert got.cfg.intermediate_size == units + 24
    assert got.mlp.down.weight.shape == (cfg.target_hidden, units + 24)
    assert got.mlp.down.weight[:, units:].abs().sum() > 0     # the new units train at once
    still = train(_base_cfg(tiny_mixed_data, tiny_dirs, out=str(tmp_path / "s"),
                            mlp_width=units + 24, **{**kw, "lr": 0.0}), progress=False)
    assert still["steps"] == 1
    kept = DartModel.load(tmp_path / "s" / "drafter")
    gate, up = kept.mlp.gate_up.weight.chunk(2)
    assert torch.equal(gate[:units], src.mlp.gate_up.weight[:units])
    assert torch.equal(up[:units], src.mlp.gate_up.weight[units:])
    assert torch.equal(kept.mlp.down.weight[:, :units], src.mlp.down.weight)
    assert not kept.mlp.down.weight[:, units:].any()
    # a grown run stopped early restarts from its own checkpoint at the grown width
    stop = _base_cfg(tiny_mixed_data, tiny_dirs, out=str(tmp_path / "r"), mlp_width=units + 24,
                     **{**kw, "max_steps": 3})
    assert train(dataclasses.replace(stop, time_budget_s=1e-9), progress=False)["steps"] == 1
    assert train(stop, progress=False)["steps"] == 3
    assert DartModel.load(tmp_path / "r" / "drafter").cfg.intermediate_size == units + 24
    with pytest.raises(ValueError, match="narrower"):
        train(_base_cfg(tiny_mixed_data, tiny_dirs, out=str(tmp_path / "n"), mlp_width=units - 8,
                        **kw), progress=False)
    with pytest.raises(ValueError, match="mlp_width"):
        _base_cfg(tiny_mixed_data, tiny_dirs, out=str(tmp_path / "m"), arch="medusa",
                  mlp_width=units + 8)
    with pytest.raises(ValueError, match="mlp_width"):
        _base_cfg(tiny_mixed_data, tiny_dirs, out=str(tmp_path / "m"), init_from_target=True,
                  mlp_width=units + 8)
    train(_base_cfg(tiny_mixed_data, tiny_dirs, out=str(tmp_path / "c1"), max_steps=1,
                    dtype="fp32"), progress=False)
    with pytest.raises(ValueError, match="lr-schedule fresh"):
        train(_base_cfg(tiny_mixed_data, tiny_dirs, out=str(tmp_path / "c2"),
                        resume=str(tmp_path / "c1"), lr_schedule="continue",
                        mlp_width=units + 8), progress=False)


def test_grow_mlp_keeps_the_layer_function():
    """The widened MLP computes what the narrow one did (zero down columns: to rounding)."""
    from dart_ray.models.args import ModelArgs
    from dart_ray.models.llama import MLP
    from dart_ray.training.objectives import grow_mlp

    def args(units):
        return ModelArgs(model_type="llama", vocab_size=10, hidden_size=16,
                         intermediate_size=units, num_layers=1, num_heads=2, num_kv_heads=1,
                         head_dim=8)

    torch.manual_seed(0)
    narrow, wide = MLP(args(24)), MLP(args(40))
    state = {"mlp." + k: v for k, v in narrow.state_dict().items()}
    grown = grow_mlp(state, 40, seed=1)
    wide.load_state_dict({k.removeprefix("mlp."): v for k, v in grown.items()})
    x = torch.randn(3, 5, 16)
    torch.testing.assert_close(wide(x), narrow(x), rtol=0, atol=1e-6)   # summation order only
    assert torch.equal(grown["mlp.gate_up.weight"][:24], state["mlp.gate_up.weight"][:24])
    assert torch.equal(grown["mlp.gate_up.weight"][40:64], state["mlp.gate_up.weight"][24:])
    assert grown["mlp.gate_up.weight"][24:40].abs().sum() > 0


def test_train_cli_resume_needs_an_explicit_schedule(tmp_path, capsys):
    from dart_ray.training.cli import train_cli

    base = ["--data", str(tmp_path), "--out", str(tmp_path / "o"), "--resume", str(tmp_path / "r")]
    for extra, msg in (([], "explicit --lr-schedule"),
                       (["--lr-schedule", "continue", "--lr", "1e-4"], "--lr")):
        with pytest.raises(SystemExit):
            train_cli(base + extra)
        assert msg in capsys.readouterr().err


def test_train_cli_revocab_modes(tmp_path, capsys, monkeypatch):
    """--revocab alone replaces the vocabulary (as before 'extend' existed); an unknown mode is a
    usage error."""
    import dart_ray.training.trainer as trainer
    from dart_ray.training.cli import train_cli

    seen = []
    monkeypatch.setattr(trainer, "train", lambda cfg: seen.append(cfg) or {"final_eval": {}})
    base = ["--data", str(tmp_path), "--out", str(tmp_path / "o"), "--resume", str(tmp_path / "r"),
            "--lr-schedule", "fresh"]
    assert train_cli(base + ["--revocab"]) == 0
    assert train_cli(base + ["--revocab", "extend", "--draft-vocab", "12288"]) == 0
    assert train_cli(base) == 0
    assert [c.revocab for c in seen] == ["replace", "extend", None]
    with pytest.raises(SystemExit):
        train_cli(base + ["--revocab", "grow"])
    assert "invalid choice: 'grow'" in capsys.readouterr().err


def test_init_from_target_reproduces_the_target_layer(tiny):
    """With fc passing the tapped residual through and the embedding half silenced, the initialised
    drafter layer computes exactly the target layer it was copied from."""
    from dart_ray.masks import attention_mask, causal_ancestors
    from dart_ray.training.objectives import init_from_target_layer

    cfg = DartConfig.for_target(tiny.args, tiny.model_id, depth=3, draft_vocab=256, tie_head=False)
    model = DartModel(cfg).init_random(1)
    layer = cfg.tap_layers[-1]
    init_from_target_layer(model, tiny.model, layer)
    src = tiny.model.layers[layer]
    assert torch.equal(model.mlp.gate_up.weight, src.mlp.gate_up.weight.float())
    H, L = cfg.target_hidden, 12
    with torch.no_grad():
        model.attn.qkv.weight[:, :H].zero_()
    tokens = torch.randint(0, tiny.args.vocab_size, (1, L))
    cache = tiny.model.new_cache(1, 64)
    taps, _, _ = teacher_pass(tiny.model, cache, tokens, [L], cfg.tap_layers, 4)
    # input of the next layer
    after, _, _ = teacher_pass(tiny.model, cache, tokens, [L], (layer + 1,), 4)
    with torch.no_grad():
        h, r = model.context_inputs(taps[:, :L - 1], tiny.model.embed(tokens[:, 1:]).float())
        mask = attention_mask([0], causal_ancestors(L - 1), L - 1, torch.float32)
        out = model.layer_out(h, r, torch.arange(L - 1)[None], mask, None, L - 1)
    torch.testing.assert_close(out, after[:, :L - 1], atol=1e-4, rtol=1e-4)


def test_metrics_per_domain_logged_plotted_and_carded(tmp_path, tiny_dirs, tiny_mixed_data):
    from dart_ray.training.ship import ship
    from dart_ray.training.trainer import train

    s = train(_base_cfg(tiny_mixed_data, tiny_dirs, out=str(tmp_path / "run"), max_steps=2,
                        eval_every=1, init_from_target=True), progress=False)
    assert s["held_out"] and set(s["final_eval_by_domain"]) == {"chat", "code"}
    assert s["val_seqs_by_domain"] == {"chat": 2, "code": 2}
    recs = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    evals = [(r["step"], r["domain"]) for r in recs if r["kind"] == "eval"]
    assert evals == [(st, d) for st in (1, 2) for d in ("chat", "code", "all")]
    for r in recs:
        if r["kind"] == "eval":
            assert len(r["top1"]) == len(r["top5"]) == 3 and 1.0 <= r["chain_tau"] <= 4.0
            assert 1.0 <= r["chain_len_indep"] <= 4.0
    assert (tmp_path / "run" / "training.png").stat().st_size > 0
    dest = ship(tmp_path / "run", None, "tiny-model", "make artifacts",
                dest_root=tmp_path / "artifacts")
    card = (dest / "CARD.md").read_text()
    assert "**chat**" in card and "**code**" in card and "| chat | **" in card
    assert "1 + sum prod top-1" in card
    assert "LR plan: warmup 2" in card
    assert "answers only" in card and '"prompt_weight": 1.0' in card
    assert all("answer" in r and r["answer"]["n_prefixes"] <= r["n_prefixes"]
               for r in recs if r["kind"] == "eval")


def test_dtype_is_resolved_recorded_and_carded(tmp_path, tiny_dirs, tiny_mixed_data, capsys):
    """dtype "auto" resolves like the engine's (bf16 only where native and fast); the choice is in
    the summary, the checkpoint and the card; a restart may change it (it fixes neither plan nor
    data)."""
    from dart_ray.hardware import resolve_dtype
    from dart_ray.training.cli import train_cli
    from dart_ray.training.ship import ship
    from dart_ray.training.trainer import TrainConfig, train

    want = resolve_dtype("auto", "cpu").dtype
    s = train(_base_cfg(tiny_mixed_data, tiny_dirs, out=str(tmp_path / "run"), max_steps=2,
                        time_budget_s=1e-9),
              progress=False)
    assert s["config"]["dtype"] == "auto"
    assert s["dtype"]["dtype"] == want and s["dtype"]["requested"] == "auto"
    assert _state(tmp_path / "run")["dtype"]["dtype"] == want
    other = "bf16" if want == "fp32" else "fp32"
    s2 = train(_base_cfg(tiny_mixed_data, tiny_dirs, out=str(tmp_path / "run"), max_steps=2,
                         dtype=other),
               progress=False)
    assert s2["steps"] == 2 and s2["dtype"] == {"dtype": other, "requested": other,
                                                "reason": "requested"}
    assert f"trained in {want} before, continues in {other}" in capsys.readouterr().out
    dest = ship(tmp_path / "run", None, "tiny-model", "make artifacts",
                dest_root=tmp_path / "artifacts")
    assert f"- teacher dtype: {other}" in (dest / "CARD.md").read_text()
    with pytest.raises(ValueError, match="dtype must be one of"):
        TrainConfig(data="d", out="o", dtype="fp16")
    with pytest.raises(SystemExit):
        train_cli(["--data", str(tmp_path), "--out", str(tmp_path / "o"), "--dtype", "fp16"])
    assert "--dtype" in capsys.readouterr().err


def test_prompt_weight_reaches_the_loss_with_each_rows_prompt_length(tmp_path, tiny_dirs,
                                                                      tiny_mixed_data,
                                                                      monkeypatch):
    """``--prompt-weight``: every batch's targets get its own rows' prompt lengths (in batch order),
    the first loss differs from an unweighted run's on the same batch, and the card records it."""
    import dart_ray.training.trainer as trainer
    from dart_ray.training.cli import train_cli
    from dart_ray.training.gen_data import load_rows
    from dart_ray.training.objectives import Objective
    from dart_ray.training.ship import ship

    rows = {(tuple(ids[:40]), plen) for ids, plen, _ in load_rows(tiny_mixed_data, "train")}
    seen = []
    real = Objective.targets

    def recording(self, top_id, top_lp, t2d, cfg, lens, prompt_lens=None):
        seen.append((lens, prompt_lens, cfg.prompt_weight))
        return real(self, top_id, top_lp, t2d, cfg, lens, prompt_lens)

    monkeypatch.setattr(Objective, "targets", recording)
    batches = []
    real_pad = trainer.pad_batch

    def pad(batch, device=None):
        batches.append([tuple(s) for s in batch])
        return real_pad(batch, device)

    monkeypatch.setattr(trainer, "pad_batch", pad)
    first = {}
    for w in ("0.25", "1"):
        seen.clear()
        batches.clear()
        out = tmp_path / f"run{w}"
        assert train_cli(["--data", str(tiny_mixed_data), "--out", str(out), "--model",
                          str(tiny_dirs["llama"]), "--depth", "3", "--max-steps", "2",
                          "--seqs-per-step", "2", "--max-len", "40", "--draft-vocab", "256",
                          "--eval-seqs", "2", "--warmup", "1", "--lr", "3e-3",
                          "--prompt-weight", w]) == 0
        assert len(seen) == 2 and all(pw == float(w) for _, _, pw in seen)
        for batch, (lens, plens, _) in zip(batches, seen, strict=True):
            assert [len(s) for s in batch] == lens
            assert all((s, p) in rows for s, p in zip(batch, plens, strict=True))
        recs = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
        first[w] = next(r["loss"] for r in recs if r["kind"] == "train")
    assert first["0.25"] != pytest.approx(first["1"])
    card = (ship(tmp_path / "run0.25", None, "tiny-model", "make artifacts",
                 dest_root=tmp_path / "artifacts") / "CARD.md").read_text()
    assert '"prompt_weight": 0.25' in card


def test_objectives_come_from_the_method_registry():
    """Every registered objective has an implementation; --arch is checked against the registry; a
    method registering an objective nobody implements is refused by name."""
    from dart_ray.methods import MethodSpec, register, unregister
    from dart_ray.training.objectives import get_objective, objective_names
    from dart_ray.training.trainer import TrainConfig

    assert objective_names() == ("dart", "eagle", "medusa", "sps")
    assert [get_objective(a).name for a in objective_names()] == list(objective_names())
    assert [get_objective(a).levels(TrainConfig(data="d", out="o", arch=a, depth=5))
            for a in objective_names()] \
        == [5, 5, 5, 1]
    with pytest.raises(ValueError, match="arch must be one of"):
        TrainConfig(data="d", out="o", arch="ngram")
    register(MethodSpec("unimplemented", lambda *a: None, model="x:Y", config_file="u.json",
                        artifact_dir="u", objective="unimplemented"))
    try:
        with pytest.raises(ValueError, match="no Objective implements"):
            TrainConfig(data="d", out="o", arch="unimplemented")
    finally:
        unregister("unimplemented")


def test_chain_length_definitions_by_hand():
    from dart_ray.training.metrics import LevelCounts, chain_len_indep

    c = LevelCounts([2.0, 1.0], [3.0, 2.0], [4.0, 4.0], chain_sum=3.0, n_prefixes=4)
    both = (c + c).summary()
    assert both["top1"] == [0.5, 0.25] and both["top5"] == [0.75, 0.5]
    assert both["chain_tau"] == 1.75 and both["chain_len_indep"] == 1 + 0.5 + 0.125
    assert chain_len_indep([0.5], chain_levels=3) == 1 + 0.5 + 0.25 + 0.125


def test_one_teacher_pass_per_held_out_batch_serves_every_student(tiny, monkeypatch):
    """Evaluation shares the teacher pass like training does: joint students are scored on one
    teacher pass per batch, with the same numbers as each evaluated alone."""
    import dart_ray.training.metrics as metrics
    from dart_ray.training.objectives import get_objective
    from dart_ray.training.trainer import TrainConfig

    d2t = torch.arange(256) * 3
    students = []
    for arch, depth in (("dart", 3), ("medusa", 2), ("sps", 2)):
        cfg = TrainConfig(data="d", out="o", arch=arch, depth=depth, seqs_per_step=2, max_len=24,
                          draft_vocab=256, teacher_topk=4)
        students.append((get_objective(arch).build(cfg, tiny, d2t, new=True), cfg))
    g = torch.Generator().manual_seed(0)
    seqs = [(torch.randint(0, tiny.args.vocab_size, (n,), generator=g).tolist(), 2)
            for n in (20, 9, 14, 24, 6)]
    val = {"chat": seqs[:2], "code": seqs[2:]}
    cache = tiny.model.new_cache(2, 64)
    t2d = torch.full((tiny.args.vocab_size,), -1, dtype=torch.long)
    t2d[d2t] = torch.arange(256)
    passes = []
    real = metrics.teacher_pass

    def counting(*a, **kw):
        passes.append(a[4])                                           # the tapped layers
        return real(*a, **kw)

    monkeypatch.setattr(metrics, "teacher_pass", counting)
    joint = metrics.evaluate_domains(students, tiny.model, cache, val, t2d, "fp32")
    assert len(passes) == 1 + 2                                       # chat: 1 batch, code: 2
    assert set(passes[0]) == {t for m, _ in students[:2] for t in m.cfg.tap_layers}
    alone = [metrics.evaluate_domains([s], tiny.model, cache, val, t2d, "fp32")[0]
             for s in students]
    assert joint == alone
    assert set(joint[0]) == {"chat", "code", "all"} and len(joint[2]["all"]["top1"]) == 1


def test_answer_metrics_count_only_prefixes_that_drafting_meets(tiny):
    """The nested ``answer`` numbers count exactly the prefixes j >= prompt length - 1 (a loop over
    the drafter's own logits is the oracle); with a one-token prompt they are the every-prefix
    numbers; the prompt's prefixes do enter the top-level numbers."""
    import dart_ray.training.metrics as metrics
    from dart_ray.training.objectives import get_objective, pad_batch, teacher_pass
    from dart_ray.training.trainer import TrainConfig

    cfg = TrainConfig(data="d", out="o", arch="dart", depth=3, seqs_per_step=3, max_len=24,
                      teacher_topk=4)
    obj = get_objective("dart")
    model = obj.build(cfg, tiny, None, new=True)
    g = torch.Generator().manual_seed(1)
    seqs = [(torch.randint(0, tiny.args.vocab_size, (n,), generator=g).tolist(), p)
            for n, p in ((20, 7), (12, 11), (16, 1))]
    cache = tiny.model.new_cache(3, 64)
    got = metrics.evaluate_domains([(model, cfg)], tiny.model, cache, {"chat": seqs}, None,
                                   "fp32")[0]["chat"]
    tokens, lens = pad_batch([s[0] for s in seqs])
    taps, top_id, _ = teacher_pass(tiny.model, cache, tokens, lens, model.cfg.tap_layers, 4)
    with torch.no_grad():
        pred = obj.forward(model.eval(), tiny.model, taps, tokens).argmax(-1)    # [B, J, d]
    hits, total, chain, full = [0] * 3, [0] * 3, 0, 0
    for b, (ids, plen) in enumerate(seqs):
        for j in range(max(plen - 1, 0), len(ids) - 1):
            lead, inside = 0, True
            for t in range(1, 4):
                if j + t >= len(ids):
                    inside = False
                    break
                ok = int(pred[b, j, t - 1]) == int(top_id[b, j + t, 0])
                hits[t - 1] += ok
                total[t - 1] += 1
                lead = lead + 1 if ok and lead == t - 1 else lead
            if inside:
                chain, full = chain + lead, full + 1
    ans = got["answer"]
    assert ans["top1"] == pytest.approx([h / n for h, n in zip(hits, total, strict=True)])
    assert ans["n_prefixes"] == full and ans["chain_tau"] == pytest.approx(1 + chain / full)
    assert got["n_prefixes"] > full                              # the prompts' prefixes count here
    one = [(ids, 1) for ids, _ in seqs]
    every = metrics.evaluate_domains([(model, cfg)], tiny.model, cache, {"chat": one}, None,
                                     "fp32")[0]["chat"]
    assert every["answer"] == {k: v for k, v in every.items() if k != "answer"}
    assert every["top1"] == got["top1"] and every["n_prefixes"] == got["n_prefixes"]


def test_level1_by_confidence_and_inside_the_draft_vocabulary(tiny):
    """The answers' level 1 split by the target's probability of its token (a loop is the oracle;
    the probabilities are drawn so that every bin is used, the tokens so that the drafter is right
    at about half the positions) and the share of those tokens inside the draft vocabulary (here
    the multiples of 3)."""
    import dart_ray.training.metrics as metrics
    from dart_ray.training.objectives import answer_prefixes, get_objective, pad_batch, teacher_pass
    from dart_ray.training.trainer import TrainConfig

    cfg = TrainConfig(data="d", out="o", arch="dart", depth=2, seqs_per_step=3, max_len=40,
                      draft_vocab=256, teacher_topk=4)
    obj = get_objective("dart")
    model = obj.build(cfg, tiny, torch.arange(256) * 3, new=True).eval()
    g = torch.Generator().manual_seed(2)
    seqs = [(torch.randint(0, tiny.args.vocab_size, (n,), generator=g).tolist(), p)
            for n, p in ((40, 5), (33, 9), (38, 1))]
    tokens, lens = pad_batch([s[0] for s in seqs])
    cache = tiny.model.new_cache(3, 64)
    taps, top_id, _ = teacher_pass(tiny.model, cache, tokens, lens, model.cfg.tap_layers, 4)
    with torch.no_grad():
        pred = model.d2t[obj.forward(model, tiny.model, taps, tokens).argmax(-1)]  # [B, J, d]
    # a random drafter seldom agrees with the target: make it right at ~half the positions
    truth = top_id[..., 0].clone()
    agree = torch.rand(pred.shape[:2], generator=g) < 0.5                            # [B, J]
    truth[:, 1:][agree] = pred[..., 0][agree]
    sure = torch.rand(truth.shape, generator=g)
    answer = answer_prefixes([p for _, p in seqs], tokens.shape[1] - 1, tokens.device)
    got = metrics._score(obj, model, cfg, tiny.model, taps, tokens, lens, truth, sure,
                         torch.zeros(1), "fp32", answer)["answer"].summary()
    hits, total, inside = [0] * 5, [0] * 5, 0
    for b, (ids, plen) in enumerate(seqs):
        for j in range(max(plen - 1, 0), len(ids) - 1):
            t = int(truth[b, j + 1])
            k = sum(float(sure[b, j + 1]) >= e for e in metrics.CONF_EDGES)
            total[k] += 1
            hits[k] += int(pred[b, j, 0]) == t
            inside += t % 3 == 0 and t < 768
    assert min(total) > 0 and sum(hits) > 0 and 0 < inside < sum(total)
    bins = got["level1_by_confidence"]
    assert [b["p_min"] for b in bins] == [0.0, *metrics.CONF_EDGES]
    assert [b["share"] for b in bins] == pytest.approx([n / sum(total) for n in total])
    assert [b["top1"] for b in bins] == pytest.approx([h / n for h, n in zip(hits, total,
                                                                             strict=True)])
    assert got["level1_in_vocab"] == pytest.approx(inside / sum(total))
    assert got["top1"][0] == pytest.approx(sum(hits) / sum(total))


def test_data_made_in_parts_trains_as_one(tmp_path, tiny_dirs):
    """Data made in two sittings (e.g. on two machines): the second leaves out what the first
    answered (``exclude_data``), and ``--data A,B`` trains on their union, as one directory holding
    the same rows would (same rows, same fingerprint, so the same run)."""
    import pyarrow.parquet as pq

    from dart_ray.training.checkpoint import data_fingerprint
    from dart_ray.training.gen_data import describe_data, generate_data, load_rows

    corpus = _code_corpus("p", "times", 12)
    first = _answered(tmp_path / "a", tiny_dirs, corpus[:5], shard_size=5)
    second = generate_data(tmp_path / "b", model=str(tiny_dirs["llama"]), dtype="fp32",
                           method="none", corpus=corpus, progress=False, max_new_tokens=12,
                           batch_size=4, shard_size=5, exclude_data=str(first))
    whole = _answered(tmp_path / "w", tiny_dirs, corpus, shard_size=5)

    def prompts(d):
        return [p for f in sorted(d.glob("shard-*.parquet"))
                for p in pq.read_table(f, columns=["prompt"]).column("prompt").to_pylist()]

    assert not set(prompts(first)) & set(prompts(second))        # nothing answered twice
    assert sorted(prompts(first) + prompts(second)) == sorted(prompts(whole))
    both = f"{first},{second}"
    for split in ("train", "val"):
        assert sorted(load_rows(both, split)) == sorted(load_rows(whole, split))
    assert describe_data(both)["rows_by_source"] == {"code": 12}
    with pytest.raises(FileNotFoundError, match="no shard"):
        load_rows(f"{first},{tmp_path / 'missing'}", "train")
    with pytest.raises(FileNotFoundError, match="exclude-data"):
        generate_data(tmp_path / "c", model=str(tiny_dirs["llama"]), corpus=corpus,
                      exclude_data=str(tmp_path / "missing"), progress=False)
    # training reads the union; the parts named in the other order are other data to a restart
    # (another batch order), which the fingerprint tells apart
    seqs = [(ids, n) for ids, n, _ in load_rows(both, "train")]
    swapped = [(ids, n) for ids, n, _ in load_rows(f"{second},{first}", "train")]
    assert data_fingerprint(seqs, 2, 40, 0) != data_fingerprint(swapped, 2, 40, 0)
    from dart_ray.training.trainer import train

    s = train(_base_cfg(both, tiny_dirs, out=str(tmp_path / "run")), progress=False)
    assert s["train_seqs"] == len(seqs) and s["data"]["rows_by_source"] == {"code": 12}


def test_only_split_answers_that_split_and_text_is_its_own_domain(tmp_path, tiny_dirs):
    """``only_split="val"`` answers exactly the prompts a whole run holds out (a larger held-out
    set costs no training rows); stdlib text rows evaluate as their own domain, not as code."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from dart_ray.training.gen_data import SCHEMA_COLUMNS, load_rows

    corpus = _code_corpus("s", "minus", 16)
    whole = _answered(tmp_path / "w", tiny_dirs, corpus, shard_size=8, val_frac=0.4)
    val = _answered(tmp_path / "v", tiny_dirs, corpus, shard_size=8, val_frac=0.4,
                    only_split="val")
    assert load_rows(val, "train") == []
    assert sorted(load_rows(val, "val")) == sorted(load_rows(whole, "val")) != []
    with pytest.raises(ValueError, match="only_split"):
        _answered(tmp_path / "x", tiny_dirs, corpus, only_split="test")
    # such a set joins a run's held-out split (train_rows of it: none, and never trained on)
    from dart_ray.training.trainer import train

    s = train(_base_cfg(whole, tiny_dirs, out=str(tmp_path / "run"), max_steps=1, eval_seqs=50,
                        eval_data=str(val)), progress=False)
    n_val = len(load_rows(whole, "val"))
    assert s["val_seqs_by_domain"] == {"code": 2 * n_val}
    assert s["train_seqs"] == len(load_rows(whole, "train"))
    row = {"prompt": "x.py:0", "source": "text", "chat": False, "prompt_ids": [1],
           "response_ids": [2, 3, 4], "split": "val", "category": "", "followup": ""}
    pq.write_table(pa.table({k: [row[k]] for k in SCHEMA_COLUMNS}), val / "text-00000.parquet")
    assert {d for _, _, d in load_rows(val, "val")} == {"code", "text"}


def test_device_is_a_restart_free_setting_and_cards_carry_notes(tmp_path, tiny):
    """A run may restart on another device (checkpoints are device-free); the card carries the
    notes given to ``ship`` (compute of every sitting)."""
    from dart_ray.drafters.dart_model import DartConfig, DartModel
    from dart_ray.training.objectives import pad_batch
    from dart_ray.training.ship import ship
    from dart_ray.training.trainer import TrainConfig, run_key

    a = TrainConfig(data="d", out="o", device="cpu")
    b = TrainConfig(data="d", out="o", device="cuda:1")
    assert run_key(a, "k") == run_key(b, "k")
    t, lens = pad_batch([[1, 2, 3], [4]], "cpu")
    assert t.device.type == "cpu" and t.tolist() == [[1, 2, 3], [4, 0, 0]] and lens == [3, 1]
    with pytest.raises(ValueError, match="device"):
        TrainConfig(data="d", out="o", device="gpu0")
    run = tmp_path / "run"
    DartModel(DartConfig.for_target(tiny.args, tiny.model_id, depth=2, draft_vocab=64,
                                    tie_head=False)).init_random(0).save(run / "drafter")
    ev = {"top1": [0.5, 0.25], "top5": [0.75, 0.5], "chain_tau": 1.6, "n_prefixes": 10}
    (run / "train_summary.json").write_text(json.dumps({
        "arch": "dart", "steps": 3, "train_seqs": 8, "val_seqs": 2, "train_wall_s": 60.0,
        "final_eval": ev, "config": {"arch": "dart", "depth": 2, "draft_vocab": 64}}))
    dest = ship(run, None, "tiny-model", "make drafter-v2", dest_root=tmp_path / "artifacts",
                notes="## Compute\n\n- GPU: 9 min; CPU: 1.5 h")
    card = (dest / "CARD.md").read_text()
    assert card.index("make drafter-v2") < card.index("## Compute") < card.index("## Data")


def test_top_logprobs_equal_log_softmax_topk_in_chunks():
    from dart_ray.training.objectives import TOP_LOGPROBS_CHUNK, top_logprobs

    g = torch.Generator().manual_seed(0)
    x = (torch.randn(3, TOP_LOGPROBS_CHUNK + 5, 300, generator=g) * 4).to(torch.bfloat16)
    ids, lps = top_logprobs(x, 7)                                   # a ragged last chunk
    want_lp, want_id = torch.log_softmax(x.float(), -1).topk(7, -1)
    assert ids.shape == (3, TOP_LOGPROBS_CHUNK + 5, 7) and torch.equal(ids, want_id)
    torch.testing.assert_close(lps, want_lp, atol=1e-5, rtol=0)


def test_a_cards_measured_section_is_the_bench_table(tmp_path):
    """``ship --bench`` renders each bench JSON with the bench's own table (no second renderer)."""
    from dart_ray.bench.runner import format_table
    from dart_ray.training.ship import measured_section

    rep = {"config": {"n_prompts": 3, "batch_size": 1, "dtype": "fp32", "max_new_tokens": 16,
                      "machine": "test cpu"},
           "methods": {"ar": {"tokens_per_s": 10.0, "speedup_vs_ar": 1.0, "mean_accepted_len": 1.0,
                              "steps": 48, "ar_steps": 48, "draft_ms": 0.1, "tree_ms": 0.0,
                              "verify_ms": 90.0, "outputs_match_ar": True}}}
    p = tmp_path / "x-bs1.json"
    p.write_text(json.dumps(rep))
    lines = measured_section(p)
    assert lines[0] == "## Measured: `x-bs1.json` (3 prompts, bs 1, fp32, 16 new tokens)"
    assert lines[2] == format_table(rep)


@pytest.mark.parametrize("field, value", [
    ("ckpt_every", 0), ("eval_every", 0), ("eval_seqs", 0), ("warmup_steps", -1), ("lr", -1e-3),
    ("epochs", -1.0), ("max_steps", 0), ("time_budget_s", 0.0),
    ("time_budget_s", -5.0)])
def test_train_config_refuses_numbers_that_would_crash_or_be_ignored(field, value):
    """Each of these crashed mid-run (a zero divisor after the first step), ran a different plan
    (a budget of 0 read as none, max_steps 0 as no cap) or failed in torch: refused up front."""
    from dart_ray.training.trainer import TrainConfig

    with pytest.raises(ValueError, match=field):
        TrainConfig(data="d", out="o", **{field: value})
    TrainConfig(data="d", out="o", ckpt_every=1, eval_every=1, warmup_steps=0, max_steps=1,
                time_budget_s=0.5, lr=0.0)
