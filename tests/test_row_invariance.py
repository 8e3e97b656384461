"""Row invariance: a row's output bits do not depend on how many rows share its call.

Lossless decoding rests on it: an AR step (width 1), a verify (width D + 1) and a fused
verify + draft step (width D + 1 + c·D, up to ~80 at D = 8) compute the same causal rows,
and their greedy tokens must be the same tokens, also at exact float ties. Here every op
``FastModel.forward`` and the heads run is called on a row set alone and inside wider
calls (widths 1, D, D + 1 and the fused widths), and the shared rows are compared bit for
bit; attention compares the verify's visibility (an [M, S] mask over the artifact's narrow
workspace) with the fused step's (row spans over the widened workspace), same visible set.
Then the whole forward: the causal rows of a fused step against the same rows in a verify
and in AR steps, op by op, so a difference names the op that made it.

Without CUDA everything runs under the Triton interpreter on small shapes; the
``@pytest.mark.gpu`` tests repeat the checks compiled, on the embedded model's shapes.
"""

from __future__ import annotations

import contextlib
import dataclasses
from pathlib import Path

import pytest
import torch

pytest.importorskip("triton")  # the interpreter is set up by tests/__init__.py without CUDA

from kernels_ampere import pack_ternary  # noqa: E402
from kernels_ampere.attention import LOG2E, small_width_attention  # noqa: E402
from kernels_ampere.fused_quant import (  # noqa: E402
    act_quant, relu2_mul_rmsnorm_quant, rmsnorm_cast, rmsnorm_quant, silu_mul_quant,
)
from kernels_ampere.heads import f16_head_argmax, int8_head_argmax  # noqa: E402
from kernels_ampere.numerics import quantize_activations, quantize_rows_int8, rope_cos_sin  # noqa: E402
from kernels_ampere.rope_cache import rope_qkv_to_cache  # noqa: E402
from kernels_ampere.w2a8 import w2a8_linear  # noqa: E402
from bitmtp_edge.runtime.masks import fused_step_spans, history_step_spans  # noqa: E402
from tests.helpers import DEVICE, ON_GPU, needs_gpu  # noqa: E402

D = 8
# the widths a row meets: AR, a block, a verify, and fused steps of c = 1..9 (both variants)
WIDTHS = (1, D, D + 1, 2 * D, 2 * D + 1, 4 * D + 1, 9 * D + D + 1)
CPU_WIDTHS = (1, D + 1, 2 * D + 1, 4 * D + 1)  # the interpreter is slow: fewer, still past 16 and 32
gpu = pytest.mark.gpu


def widths() -> tuple[int, ...]:
    return WIDTHS if ON_GPU else CPU_WIDTHS


def bits(t: torch.Tensor) -> torch.Tensor:
    """The raw bits of a tensor (floats as same-width integers: -0.0 != 0.0, NaN == NaN)."""
    if not t.is_floating_point():
        return t
    return t.view({2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()])


def assert_rows_equal(wide, narrow, rows: int, what: str) -> None:
    """The first ``rows`` rows of every tensor in ``wide`` equal ``narrow``'s, bit for bit."""
    wide = wide if isinstance(wide, tuple) else (wide,)
    narrow = narrow if isinstance(narrow, tuple) else (narrow,)
    for i, (a, b) in enumerate(zip(wide, narrow)):
        a, b = a[:rows], b[:rows]
        bad = (bits(a) != bits(b)).nonzero()
        assert bad.numel() == 0, (f"{what} (output {i}): {bad.shape[0]} values differ; first at "
                                  f"{bad[0].tolist()}: {a[tuple(bad[0])].item()} vs {b[tuple(bad[0])].item()}")


def every_width(make, call, what: str) -> None:
    """``make(w)`` -> the inputs of a width-w call (row i the same at every w);
    ``call(inputs)`` -> outputs with rows first. Rows of every narrower call must equal the
    same rows of every wider one."""
    ws = widths()
    outs = {w: call(make(w)) for w in ws}
    for i, w in enumerate(ws):
        for wider in ws[i + 1:]:
            assert_rows_equal(outs[wider], outs[w], w, f"{what}: width {w} inside width {wider}")


def rows_of(gen_seed: int, w: int, shape, scale=1.0, dtype=torch.float32, exact: bool = False):
    """[w, *shape] random rows whose row i does not depend on w. ``exact``: small integers
    (see ``dot_inputs_exact``)."""
    g = torch.Generator().manual_seed(gen_seed)
    if exact:
        full = torch.randint(-2, 3, (max(WIDTHS), *shape), generator=g).float()
    else:
        full = torch.randn(max(WIDTHS), *shape, generator=g) * scale
    return full[:w].to(dtype).to(DEVICE).contiguous()


# The interpreter runs ``tl.dot`` as numpy's float32 matmul, whose summation order depends on
# where a row sits in the matrix: a property of the CPU BLAS, not of the kernel. On the CPU
# the float-dot kernels (attention, the 16-bit head) therefore get inputs whose products and
# sums are exact in float32 (small integers; attention scores that make powers of two), which
# still checks everything but the order (the slots each row sees, the tiling, ties); compiled
# on a GPU they get random floats, where the order is the point.
dot_inputs_exact = not ON_GPU


# --- per op -----------------------------------------------------------------------------------

def linear_shapes():
    if ON_GPU:  # the embedded model's four projections (N, K): qkv, o, gate/up, down; a Qwen3 down (K slices)
        return [(768, 512), (512, 512), (2816, 512), (512, 1408), (2048, 6144)]
    return [(40, 256), (72, 640)]  # 5 chunks: a tree over a step's chunks would differ from K order


@pytest.mark.parametrize("grouped", [False, True], ids=["row", "group128"])
def test_w2a8_rows_do_not_depend_on_the_width(grouped):
    """The launch the table / fallback picks per width (kernel, tiles, split-K). Group-128
    scales too: every kernel adds the groups one chunk at a time in K order, in K slices set
    by K alone."""
    for n, k in linear_shapes():
        gen = torch.Generator().manual_seed(n + k)
        packed = pack_ternary(torch.randint(-1, 2, (n, k), generator=gen, dtype=torch.int8)).to(DEVICE)
        groups = -(-k // 128)
        w_s = (0.5 + torch.rand((n, groups) if grouped else (n,), generator=gen)).to(DEVICE)

        def make(w):
            x = rows_of(k, w, (k,), scale=3.0)
            a, s = quantize_activations(x.cpu())
            return a.to(DEVICE), s.to(DEVICE), rows_of(n, w, (n,))

        every_width(make, lambda t: w2a8_linear(t[0], t[1], packed, w_s, out_dtype=torch.float32, residual=t[2]),
                    f"w2a8_linear N={n} K={k} {'group128' if grouped else 'row'}")


def test_row_kernels_do_not_depend_on_the_width():
    """rmsnorm_quant / rmsnorm_cast / act_quant / the FFN middles: one program per row."""
    k = 1408 if ON_GPU else 200
    weight = (1.0 + 0.1 * torch.randn(k, generator=torch.Generator().manual_seed(1))).to(DEVICE)
    every_width(lambda w: rows_of(2, w, (k,), 4.0), lambda x: rmsnorm_quant(x, weight, 1e-5), "rmsnorm_quant")
    every_width(lambda w: rows_of(3, w, (k,), 4.0), lambda x: rmsnorm_cast(x, weight, 1e-5, torch.bfloat16),
                "rmsnorm_cast")
    every_width(lambda w: rows_of(4, w, (k,), 4.0), act_quant, "act_quant")
    gu = lambda w: (rows_of(5, w, (k,)), rows_of(6, w, (k,)))  # noqa: E731
    every_width(gu, lambda t: relu2_mul_rmsnorm_quant(t[0], t[1], weight, 1e-5), "relu2_mul_rmsnorm_quant")
    every_width(gu, lambda t: silu_mul_quant(t[0], t[1]), "silu_mul_quant")


def test_rope_and_cache_writes_do_not_depend_on_the_width():
    hq, hkv, hd = (8, 2, 64) if ON_GPU else (4, 2, 32)
    slots, first = 300, 120

    def call(t):
        qkv, positions = t
        k_buf = torch.zeros(hkv, slots, hd, dtype=torch.float16, device=DEVICE)
        v_buf = torch.zeros_like(k_buf)
        cos, sin = rope_cos_sin(positions, hd, 10000.0, torch.float32)
        q = rope_qkv_to_cache(qkv, cos, sin, k_buf, v_buf, positions, num_heads=hq)
        w = positions.shape[0]
        return q, cos, sin, k_buf[:, first:first + w].transpose(0, 1), v_buf[:, first:first + w].transpose(0, 1)

    every_width(lambda w: (rows_of(7, w, ((hq + 2 * hkv) * hd,)), torch.arange(first, first + w, device=DEVICE)),
                call, "rope_cos_sin + rope_qkv_to_cache")


def test_heads_do_not_depend_on_the_width():
    v, h = (8192, 512) if ON_GPU else (300, 128)
    g = torch.Generator().manual_seed(8)
    w16 = (torch.randn(v, h, generator=g) * 0.05).to(torch.bfloat16).to(DEVICE)
    if dot_inputs_exact:
        w16 = torch.randint(-2, 3, (v, h), generator=g).to(torch.bfloat16).to(DEVICE)
    every_width(lambda w: rows_of(9, w, (h,), dtype=torch.bfloat16, exact=dot_inputs_exact),
                lambda x: f16_head_argmax(x, w16), "f16_head_argmax (verify head)")
    w8, w8s = quantize_rows_int8(torch.randn(v, h, generator=g))
    w8, w8s = w8.to(DEVICE), w8s.to(DEVICE)

    def make(w):
        a, s = quantize_activations(rows_of(10, w, (h,), 2.0).cpu())
        return a.to(DEVICE), s.to(DEVICE)

    every_width(make, lambda t: int8_head_argmax(t[0], t[1], w8, w8s), "int8_head_argmax (draft head)")


@pytest.mark.parametrize("capacity", [256, 512] if ON_GPU else [96])
def test_attention_rows_are_the_same_in_ar_verify_and_fused_steps(capacity):
    """Causal rows [first, first + n) as the graph backend runs every decode step (row spans
    over the widened workspace, ``GraphBackend._step_view``): one by one as AR steps, all
    at once as a verify, and inside fused steps of every c carrying c blocks in the
    workspace: identical bits."""
    hq, hkv, hd = (8, 2, 64) if ON_GPU else (4, 2, 32)
    wide = (D + 1) * D
    first = capacity - 3 * D
    g = torch.Generator().manual_seed(capacity)
    sm_scale = None
    if dot_inputs_exact:  # scores in 0..3 (log2 units): p = 1, 1/2, 1/4, 1/8, every sum exact
        k = torch.randint(0, 2, (hkv, capacity + wide, hd), generator=g).to(torch.float16).to(DEVICE)
        v = torch.randint(-2, 3, (hkv, capacity + wide, hd), generator=g).to(torch.float16).to(DEVICE)
        sm_scale = 1.0 / LOG2E

        def queries(seed, m):
            q = torch.zeros(max(WIDTHS), hq, hd)
            q[:, :, :3] = torch.randint(0, 2, (max(WIDTHS), hq, 3), generator=torch.Generator().manual_seed(seed))
            return q[:m].to(torch.float16).to(DEVICE)
    else:
        k = torch.randn(hkv, capacity + wide, hd, generator=g).to(torch.float16).to(DEVICE)
        v = torch.randn(hkv, capacity + wide, hd, generator=g).to(torch.float16).to(DEVICE)

        def queries(seed, m):
            return rows_of(seed, m, (hq, hd), dtype=torch.float16)

    def attend(q, rows_limit, spans):
        return small_width_attention(q, k, v, None, torch.tensor([rows_limit], dtype=torch.int32, device=DEVICE),
                                     capacity=capacity, row_spans=spans.to(DEVICE), sm_scale=sm_scale)

    for n in (D + 1, D):
        q_causal = queries(11 + n, n)
        verify = attend(q_causal, first + n, history_step_spans(first, n))
        ar = torch.cat([attend(q_causal[i:i + 1], first + i + 1, history_step_spans(first + i, 1)) for i in range(n)])
        assert_rows_equal(verify, ar, n, f"attention: verify rows vs AR rows (n={n})")
        for c in (range(1, D + 2) if ON_GPU else (1, 3)):
            spans = fused_step_spans(first, n, torch.arange(c), D)
            fused = attend(torch.cat([q_causal, queries(40 + c, c * D)]), first + n, spans)
            assert_rows_equal(fused, verify, n, f"attention: fused c={c} causal rows vs verify (n={n})")


# --- the whole forward: causal rows of a fused step vs a verify vs AR steps, op by op ------------

@dataclasses.dataclass
class Call:
    op: str
    outputs: tuple[torch.Tensor, ...]


def recording(ops, calls: list[Call]):
    """``ops`` with every operator wrapped to append its outputs (cloned) to ``calls``."""
    wrapped = {}
    for f in dataclasses.fields(ops):
        fn = getattr(ops, f.name)
        if not callable(fn) or f.name in ("name",):
            continue

        def rec(*a, _fn=fn, _name=f.name, **kw):
            out = _fn(*a, **kw)
            outs = out if isinstance(out, tuple) else (out,)
            calls.append(Call(_name, tuple(o.detach().clone() for o in outs)))
            return out

        wrapped[f.name] = rec
    return dataclasses.replace(ops, **wrapped)


@contextlib.contextmanager
def recorded(fast, calls):
    saved = fast.ops
    fast.ops = recording(saved, calls)
    try:
        yield
    finally:
        fast.ops = saved


def causal_step(backend, layout: str, tokens: torch.Tensor, first: int, candidates: int = 0):
    """Run ``tokens`` (the causal rows, written at slots first..) as ``layout``: "ar" (one
    width-1 step per row), "verify" (one step) or "fused" (one step with ``candidates``
    blocks in the workspace), each as the graph backend runs it (row spans over
    ``_step_view``) -> the recorded op calls,
    each call's outputs cut to the causal rows (AR: the rows of its n steps, stacked)."""
    fast, kv, st = backend.fast, backend.kv, backend.static
    n, cap = tokens.shape[0], kv.capacity
    dev = tokens.device
    saved = kv.k.clone(), kv.v.clone()
    calls: list[Call] = []
    with recorded(fast, calls):
        view = backend._step_view(kv.segment)
        if layout == "ar":
            for i in range(n):
                st.attn_rows.fill_(first + i + 1)
                pos = torch.tensor([first + i], device=dev)
                x = fast.forward(tokens[i:i + 1], pos, view.k, view.v, pos, None, st.attn_rows, capacity=cap,
                                 row_spans=history_step_spans(first + i, 1, dev))
                fast.verify_top1(x)
        elif layout == "verify":
            st.attn_rows.fill_(first + n)
            pos = torch.arange(first, first + n, device=dev)
            x = fast.forward(tokens, pos, view.k, view.v, pos, None, st.attn_rows, capacity=cap,
                             row_spans=history_step_spans(first, n, dev))
            fast.verify_top1(x)
        else:
            chosen = torch.arange(candidates, device=dev)
            block = torch.cat([tokens.new_full((candidates, 1), 0) + tokens[:candidates, None],
                               torch.full((candidates, D - 1), backend.mask_token_id, device=dev)], 1).reshape(-1)
            pos = torch.cat([torch.arange(first, first + n, device=dev),
                             (first + chosen[:, None] + torch.arange(D, device=dev)).reshape(-1)])
            slots = torch.cat([torch.arange(first, first + n, device=dev),
                               cap + torch.arange(candidates * D, device=dev)])
            st.attn_rows.fill_(first + n)
            x = fast.forward(torch.cat([tokens, block]), pos, view.k, view.v, slots, None, st.attn_rows,
                             capacity=cap, row_spans=fused_step_spans(first, n, chosen, D))
            fast.verify_top1(x[:n])
    kv_rows = (kv.k[:, :, first:first + n].clone(), kv.v[:, :, first:first + n].clone())
    kv.k.copy_(saved[0])
    kv.v.copy_(saved[1])
    if layout == "ar":  # per op: its n width-1 calls, stacked into rows
        per = len(calls) // n
        calls = [Call(calls[j].op, tuple(torch.cat([calls[i * per + j].outputs[o] for i in range(n)])
                                         for o in range(len(calls[j].outputs)))) for j in range(per)]
    else:
        calls = [Call(c.op, tuple(o[:n] for o in c.outputs)) for c in calls]
    return calls, kv_rows


def first_difference(a: list[Call], b: list[Call]) -> str | None:
    assert [c.op for c in a] == [c.op for c in b], "the two layouts ran different op sequences"
    for j, (x, y) in enumerate(zip(a, b)):
        for o, (p, q) in enumerate(zip(x.outputs, y.outputs)):
            if not torch.equal(bits(p), bits(q)):
                diff = (p.float() - q.float()).abs()
                rows = sorted({int(r) for r in (diff.reshape(diff.shape[0], -1) > 0).any(1).nonzero().flatten()})
                return f"op #{j} {x.op} output {o}: rows {rows} differ (max |diff| {diff.max().item():.3g})"
    return None


def check_layouts(backend, prompt: list[int], causal: list[int], counts) -> list[str]:
    """Prefill ``prompt`` and compare the causal rows across AR / verify / fused layouts."""
    backend.reset()
    backend.prefill(prompt)
    backend._reserve(len(prompt) + 2 * D)
    first = len(prompt)  # the causal rows start at the first free slot (a verify after a draft: L - 1)
    tokens = torch.tensor(causal, device=backend.device)
    ar, ar_kv = causal_step(backend, "ar", tokens, first)
    verify, verify_kv = causal_step(backend, "verify", tokens, first)
    problems = []
    if (d := first_difference(verify, ar)) is not None:
        problems.append(f"verify vs AR: {d}")
    for c in counts:
        fused, fused_kv = causal_step(backend, "fused", tokens, first, candidates=c)
        if (d := first_difference(fused, verify)) is not None:
            problems.append(f"fused c={c} (width {len(causal) + c * D}) vs verify: {d}")
        if not all(torch.equal(x, y) for x, y in zip(fused_kv, verify_kv)):
            problems.append(f"fused c={c}: the causal rows' KV differ from the verify's")
    backend.reset()
    return problems


EMBEDDED = Path(__file__).resolve().parents[1] / "bitmtp_edge" / "embedded" / "model"


@gpu
@needs_gpu
@pytest.mark.parametrize("backend_name", ["ampere", "server"])
def test_gpu_embedded_model_fused_rows_equal_verify_and_ar_rows(backend_name):
    """The embedded model compiled: causal rows at every fused width vs a verify vs AR steps,
    history lengths in the first and the second KV segment."""
    from bitmtp_edge import Engine
    from bitmtp_edge.backends.fp8_head import fp8_supported

    if backend_name == "server" and not fp8_supported(torch.device("cuda")):
        pytest.skip("no FP8 tensor cores")
    eng = Engine.load(EMBEDDED, backend=backend_name, device="cuda", runtime="m1")  # eager: ops can be recorded
    g = torch.Generator().manual_seed(13)
    problems = []
    for length in (40, 300):
        prompt = torch.randint(2, eng.manifest.model.vocab_size, (length,), generator=g).tolist()
        causal = torch.randint(2, eng.manifest.model.vocab_size, (D + 1,), generator=g).tolist()
        problems += [f"L={length}: {p}" for p in check_layouts(eng.backend, prompt, causal, counts=range(1, D + 2))]
    assert problems == []
