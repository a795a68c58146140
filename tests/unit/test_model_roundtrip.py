"""A real small model + AdamW state: save, load into fresh objects, and training continues identically."""

from __future__ import annotations

import copy

import pytest
import torch

import s4w_core
from tests.unit.helpers import assert_same_tensor


class TinyGPT(torch.nn.Module):
    def __init__(self, vocab: int = 64, d: int = 32, layers: int = 2, ctx: int = 16) -> None:
        super().__init__()
        self.tok = torch.nn.Embedding(vocab, d)
        self.pos = torch.nn.Parameter(torch.zeros(ctx, d))
        layer = torch.nn.TransformerEncoderLayer(d, 4, 4 * d, dropout=0.0, batch_first=True, norm_first=True)
        self.blocks = torch.nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.ln = torch.nn.LayerNorm(d)
        self.head = torch.nn.Linear(d, vocab, bias=False)
        self.head.weight = self.tok.weight  # tied
        self.register_buffer("mask", torch.triu(torch.full((ctx, ctx), float("-inf")), 1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.tok(x) + self.pos[: x.shape[1]]
        h = self.blocks(h, mask=self.mask[: x.shape[1], : x.shape[1]], is_causal=True)
        return self.head(self.ln(h))


def _step(model: TinyGPT, opt: torch.optim.Optimizer, sched: torch.optim.lr_scheduler.LRScheduler, g: torch.Generator) -> float:
    x = torch.randint(0, 64, (4, 16), generator=g)
    loss = torch.nn.functional.cross_entropy(model(x[:, :-1]).reshape(-1, 64), x[:, 1:].reshape(-1))
    opt.zero_grad()
    loss.backward()
    opt.step()
    sched.step()
    return float(loss)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_train_save_resume_is_bit_identical(tmp_path, dtype: torch.dtype) -> None:
    torch.manual_seed(0)
    model = TinyGPT().to(dtype)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1)
    sched = torch.optim.lr_scheduler.StepLR(opt, 3, 0.5)
    g = torch.Generator().manual_seed(1)
    for _ in range(5):
        _step(model, opt, sched, g)

    ckpt = {
        "model": model.state_dict(),
        "optimizer": opt.state_dict(),
        "scheduler": sched.state_dict(),
        "rng": {"torch": torch.get_rng_state(), "gen": g.get_state()},
        "step": 5,
    }
    p = tmp_path / "step5.s4w"
    rep = s4w_core.save(ckpt, p)
    assert rep.ratio > 1.0
    assert "optimizer" in rep.groups and "model" in rep.groups
    assert {"exp_avg", "exp_avg_sq"} <= set(rep.kinds)

    ref_model, ref_opt, ref_sched = copy.deepcopy(model), copy.deepcopy(opt), copy.deepcopy(sched)
    del ref_model, ref_opt, ref_sched
    loaded = s4w_core.load(p)
    for k, v in ckpt["model"].items():
        assert_same_tensor(v, loaded["model"][k])
    for i, st in ckpt["optimizer"]["state"].items():
        for k, v in st.items():
            assert_same_tensor(v, loaded["optimizer"]["state"][i][k])
    assert loaded["optimizer"]["param_groups"] == ckpt["optimizer"]["param_groups"]
    assert loaded["scheduler"] == ckpt["scheduler"]

    torch.manual_seed(123)  # resumed process starts from a different state
    model2 = TinyGPT().to(dtype)
    opt2 = torch.optim.AdamW(model2.parameters(), lr=1e-3, weight_decay=0.1)
    sched2 = torch.optim.lr_scheduler.StepLR(opt2, 3, 0.5)
    model2.load_state_dict(loaded["model"])
    opt2.load_state_dict(loaded["optimizer"])
    sched2.load_state_dict(loaded["scheduler"])
    g2 = torch.Generator()
    g2.set_state(loaded["rng"]["gen"])
    torch.set_rng_state(loaded["rng"]["torch"])

    losses_a = [_step(model, opt, sched, g) for _ in range(3)]
    losses_b = [_step(model2, opt2, sched2, g2) for _ in range(3)]
    assert losses_a == losses_b
    for (ka, a), (kb, b) in zip(model.state_dict().items(), model2.state_dict().items()):
        assert ka == kb
        assert torch.equal(a.view(-1).view(torch.uint8) if a.dim() else a.reshape(1).view(torch.uint8),
                           b.view(-1).view(torch.uint8) if b.dim() else b.reshape(1).view(torch.uint8)), ka


def test_info_and_verify_on_a_real_checkpoint(tmp_path) -> None:
    torch.manual_seed(0)
    model = TinyGPT().to(torch.bfloat16)
    opt = torch.optim.AdamW(model.parameters())
    model(torch.randint(0, 64, (2, 8))).float().sum().backward()
    opt.step()
    p = tmp_path / "c.s4w"
    rep = s4w_core.save({"model": model.state_dict(), "optimizer": opt.state_dict()}, p, extra={"run": "t"})
    d = s4w_core.info(p)
    assert d["raw_bytes"] == rep.raw_bytes and d["stored_bytes"] == rep.stored_bytes
    assert d["file_bytes"] == p.stat().st_size == rep.file_bytes
    assert d["extra"] == {"run": "t"} and d["profile"] == "portable"
    assert d["dtypes"]["bfloat16"]["tensors"] > 0
    v = s4w_core.verify(p)
    assert v.ok and v.problems == [] and v.raw_bytes == rep.raw_bytes
