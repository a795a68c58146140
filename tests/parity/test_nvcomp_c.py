"""@gpu: nvCOMP ANS through the low-level C API (``_nvcomp.AnsC``) against nvCOMP's Python API.

The writer and reader call ANS through the C API where it is available; files written before (or
on a machine where only the Python API is usable) must decode either way, so both directions are
checked byte for byte, plus the reporting of sizes and failures."""

from __future__ import annotations

import numpy as np
import pytest
import torch

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def nv():
    pytest.importorskip("nvidia.nvcomp")
    from s4w_core.gpu import _nvcomp

    if _nvcomp._ans_c() is None:
        pytest.skip("this nvCOMP has no usable C API for ANS")
    return _nvcomp


def _chunks(seed: int) -> tuple[torch.Tensor, np.ndarray, np.ndarray]:
    g = torch.Generator().manual_seed(seed)
    lens = np.array([1, 17, 4096, 65536, 300_001, 1 << 19, 1 << 19], dtype=np.int64)
    parts = []
    for i, n in enumerate(lens.tolist()):
        if i % 3 == 0:  # exponent-like: few symbols
            parts.append((torch.randn(n, generator=g) * 3).round().clamp(-8, 8).to(torch.int16).to(torch.uint8) + 120)
        elif i % 3 == 1:
            parts.append(torch.randint(0, 256, (n,), dtype=torch.uint8, generator=g))
        else:
            parts.append(torch.full((n,), 7, dtype=torch.uint8))
    slots = -(-lens // 256) * 256
    offs = np.cumsum(slots) - slots
    buf = torch.zeros(int(slots.sum()), dtype=torch.uint8)
    for o, p in zip(offs.tolist(), parts):
        buf[o : o + p.numel()] = p
    return buf.cuda(), offs, lens


def _encode(nv, c, src, offs, lens):
    cap = max(nv.max_compressed(c, int(n), src.device) for n in lens.tolist())
    dst = torch.zeros(cap * len(lens), dtype=torch.uint8, device=src.device)
    do = np.arange(len(lens), dtype=np.int64) * cap
    with nv.on_stream(src.device):
        sizes = nv.encode_batch(c, src, offs.tolist(), lens.tolist(), dst, do.tolist(), [cap] * len(lens))
    return dst, do, np.asarray(sizes, dtype=np.int64)


def _decode(nv, c, comp, co, cl, offs, lens, dev):
    out = torch.full((int(offs[-1] + lens[-1]) + 256,), 0xA5, dtype=torch.uint8, device=dev)
    with nv.on_stream(dev):
        got = nv.decode_batch(c, comp, co.tolist(), cl.tolist(), out, offs.tolist(), lens.tolist())
        fails = got.failures()
        sizes = list(got)
    assert sizes == lens.tolist()
    if fails is not None:  # the C API counts failed chunks on the device (no read-back)
        assert int(fails.item()) == 0
    return out


def test_c_and_python_api_read_each_others_chunks(nv, monkeypatch):
    dev = torch.device("cuda", torch.cuda.current_device())
    src, offs, lens = _chunks(1)
    c_api = nv.codec("ANS", dev, 1 << 19, data_type="|u1")
    assert isinstance(c_api, nv.AnsC)
    monkeypatch.setenv("S4W_NVCOMP_C", "0")
    monkeypatch.setattr(nv, "_ans_c", lambda: None)
    py_api = nv.codec("ANS", dev, 1 << 19, data_type="|u1")
    assert not isinstance(py_api, nv.AnsC)
    monkeypatch.undo()
    for enc, dec in ((c_api, py_api), (py_api, c_api), (c_api, c_api)):
        comp, co, cl = _encode(nv, enc, src, offs, lens)
        # chunks 2 and 5 are constant (tiny when coded), 3 and 6 have few symbols, 1 and 4 are random
        assert (cl > 0).all() and cl[2] < 512 and cl[5] < 4096 and cl[6] < lens[6] // 2 and cl[4] > lens[4] * 0.99
        out = _decode(nv, dec, comp, co, cl, offs, lens, dev)
        for o, n in zip(offs.tolist(), lens.tolist()):
            assert torch.equal(out[o : o + n], src[o : o + n]), (type(enc).__name__, type(dec).__name__, n)


def test_c_api_reports_a_bad_chunk(nv):
    dev = torch.device("cuda", torch.cuda.current_device())
    src, offs, lens = _chunks(2)
    c = nv.codec("ANS", dev, 1 << 19, data_type="|u1")
    comp, co, cl = _encode(nv, c, src, offs, lens)
    # an output capacity smaller than the chunk decodes to: nvCOMP's status says so, and reading
    # the sizes raises (the reader turns that into DecodeError)
    out = torch.zeros(int(offs[-1] + lens[-1]) + 256, dtype=torch.uint8, device=dev)
    short = lens.copy()
    short[4] = 1000
    with nv.on_stream(dev):
        got = nv.decode_batch(c, comp, co.tolist(), cl.tolist(), out, offs.tolist(), short.tolist())
        assert int(got.failures().item()) == 1  # counted on the device
        with pytest.raises(RuntimeError, match="1 chunk\\(s\\) failed \\(first: chunk 4"):
            list(got)


def test_decode_device_checks_nvcomp_on_the_device(nv):
    """``decode_device`` reads back once: fold64 sums and the count of chunks nvCOMP failed on. A
    clean batch decodes bit-exactly; a chunk whose recorded length is short of what it decodes to
    is a DecodeError (then the sizes are read back for the message)."""
    from s4w_core.errors import DecodeError
    from s4w_core.gpu import _decode, _encode

    dev = torch.device("cuda", torch.cuda.current_device())
    g = torch.Generator().manual_seed(3)
    tl = [(torch.randn(n, generator=g) * 0.02).to(dt).to(dev) for n, dt in
          ((1 << 20, torch.bfloat16), (300_001, torch.bfloat16), (200_000, torch.float32))]
    enc = _encode.encode_tensors_device(tl, "fast")
    entries, recs, kinds = _decode_inputs(enc, tl)

    def decode():
        st = _decode.Staged(host=None, slot=enc.out_off, kinds=kinds, stored=enc.out_len, recs=recs)
        outs = [torch.empty(e["nbytes"], dtype=torch.uint8, device=dev) for e in entries]
        return st, outs

    st, outs = decode()
    with nv.on_stream(dev):
        _decode.decode_device(enc.out, st, entries, outs, [None] * len(tl), dev, "ok")
    for o, t in zip(outs, tl):
        assert torch.equal(o, t.view(-1).view(torch.uint8))
    st, outs = decode()
    plan = st.plan_for(entries)
    assert plan.calls and plan.calls[0].algorithm == "ANS"
    plan.calls[0].raw[0] -= 64  # nvCOMP's output capacity for that chunk is now too small
    tab = plan.calls[0].ans
    assert tab is not None  # the C API's host table, prepared with the plan
    tab.host[2 * tab.n] -= 64
    with nv.on_stream(dev), pytest.raises(DecodeError, match="nvCOMP ANS failed to decode a chunk"):
        _decode.decode_device(enc.out, st, entries, outs, [None] * len(tl), dev, "bad")


def _decode_inputs(enc, tl):
    """What ``decode_device`` needs besides the buffer, for an ``_Encoded`` batch of ``tl``: the
    entries, the chunk records, the chunk kinds."""
    from s4w_core import engine
    from s4w_core.codecs import NVCOMP_ANS
    from s4w_core.gpu import _encode

    seg = _encode.PROFILES["fast"].segment_elems
    entries = []
    for k, t in enumerate(tl):
        transform, w = engine.transform_for(t.dtype, t.numel() * t.element_size())
        transform = enc.transforms.get(k, transform)  # the layout the encoder's probe chose
        entries.append({"path": f"t{k}", "nbytes": t.numel() * t.element_size(), "_width": w, "transform": transform,
                        "segment_elems": seg, "dtype": engine.dtype_name(t.dtype), "checksum": "none"})
    layouts = [engine.chunk_layout(e) for e in entries]
    recs = []
    for ji, ci in enc.owner:
        s0, s1, j = layouts[ji][ci]
        recs.append((ji, j, s0, s1 - s0))
    return entries, recs, ["ans" if c == NVCOMP_ANS.id else "copy" for c in enc.codec_ids]


def _decode_encoded(enc, tl):
    """Decode an ``_Encoded`` batch of ``tl`` on the device (``decode_device``), return the outputs."""
    from s4w_core.gpu import _decode, _nvcomp

    dev = tl[0].device
    entries, recs, kinds = _decode_inputs(enc, tl)
    st = _decode.Staged(host=None, slot=enc.out_off, kinds=kinds, stored=enc.out_len, recs=recs)
    outs = [torch.empty(e["nbytes"], dtype=torch.uint8, device=dev) for e in entries]
    with _nvcomp.on_stream(dev):
        _decode.decode_device(enc.out, st, entries, outs, [None] * len(tl), dev, "test")
    return outs


def test_prepared_encode_codes_current_contents(nv):
    """``PreparedEncode`` (the plan and buffers kept between calls) codes what the tensors hold at
    each call, as a one-call encode of the same contents does (the same choice per chunk, offsets
    and lengths; the same raw bytes; both decode exactly): bf16 and fp32 in
    one batch (plane regions of different widths), a bf16 tensor whose later plane compresses (its
    chunks are coded and compacted, not left in place), and a tensor changed between calls."""
    from s4w_core.gpu import _encode

    dev = torch.device("cuda", torch.cuda.current_device())
    g = torch.Generator().manual_seed(11)
    smooth = torch.randint(-64, 64, (1 << 20,), generator=g).to(torch.bfloat16)  # few mantissa bits set
    tl = [(torch.randn(1 << 20, generator=g) * 0.02).to(torch.bfloat16).to(dev),
          (torch.randn(300_001, generator=g)).to(torch.float32).to(dev),
          smooth.to(dev),
          (torch.randn(77_777, generator=g) * 3).to(torch.bfloat16).to(dev)]
    prep = _encode.PreparedEncode(tl, "fast")
    for step in range(3):
        if step:
            tl[0].add_(torch.randn(tl[0].shape, generator=g).to(tl[0].dtype).to(dev), alpha=1e-3)
            tl[1].mul_(1.5)
        got = prep()
        one = _encode.encode_tensors_device(tl, "fast")
        assert got.coded.tolist() == one.coded.tolist() and got.out_len.tolist() == one.out_len.tolist()
        assert got.out_off.tolist() == one.out_off.tolist()
        # the third tensor's later plane (plane 1) is coded
        later = [i for i, (ji, ci) in enumerate(got.owner) if ji == 2 and ci % 2 == 1]
        assert later and all(got.coded[i] for i in later)
        # raw chunks byte for byte; coded ones by decoding (nvCOMP's ANS bytes need not repeat
        # from call to call, only decode to the same)
        assert all(torch.equal(got.out[o : o + n], one.out[o : o + n])
                   for o, n, c in zip(got.out_off.tolist(), got.out_len.tolist(), got.coded.tolist()) if not c)
        for enc in (got, one):
            for o, t in zip(_decode_encoded(enc, tl), tl):
                assert torch.equal(o, t.view(-1).view(torch.uint8)), step


def test_prepared_encode_refuses_non_contiguous_and_moved_tensors(nv):
    from s4w_core.gpu import _encode

    t = torch.zeros(64, 64, dtype=torch.bfloat16, device="cuda").t()
    with pytest.raises(ValueError, match="contiguous"):
        _encode.PreparedEncode([t], "fast")
    p = torch.nn.Parameter(torch.randn(1 << 20, device="cuda").to(torch.bfloat16))
    q = torch.randn(5000, device="cuda")
    prep = _encode.PreparedEncode([p.data, q], "fast")
    prep()
    q.resize_(4000)  # same storage, another size
    with pytest.raises(ValueError, match="new storage or another size"):
        prep()
    prep2 = _encode.PreparedEncode([p], "fast")
    prep2()
    p.data = torch.zeros_like(p.data)  # new storage
    with pytest.raises(ValueError, match="new storage or another size"):
        prep2()
