"""mha_ext.hf: mha_ext's SDPA twin as a transformers attention implementation
(issue 12, point 3).

Tiny random-init models built from configs (no downloads, no tokenizer):
BERT, GPT-2, BART, T5, a Llama with GQA (2 key/value heads for 4 query
heads) and a Mistral with a sliding window.  Each runs once with
attn_implementation="sdpa" and once, same weights, with "mha_ext": logits /
last hidden states must agree within 2e-5 (float32) and 1e-10 (float64),
padded batches included (left-padded for the decoders, so rows that see no
key occur); greedy generate() must give the same tokens; gradients of every
parameter must agree for Llama (GQA) and T5 (its relative-position bias
reaches the attention as a float mask, so its gradient flows through the
twin's mask input).

Tolerances: the contract's (API.md, issue 12) for "same computation,
different summation order": both sides compute the same softmax(QK^T s + M) V
in the same dtype; through two layers of width 32 the rounding differences
stay at a few ulps of the values (about 1e-6 in float32, 1e-15 in float64).

Run with `-s` for the table of worst errors per model.
Legend: B batch, L query length, S key length, H heads, D head width.
"""
import copy

import pytest

from _support import need, require_torch

torch = require_torch()
transformers = need("transformers")

import mha_ext  # noqa: E402
import mha_ext.hf as hf  # noqa: E402
from transformers.integrations.sdpa_attention import (  # noqa: E402
    sdpa_attention_forward)

hf.register()

TOL = {torch.float32: 2e-5, torch.float64: 1e-10}
DTYPES = [torch.float32, torch.float64]
WORST = {}        # (model, dtype name, what) -> worst |mha_ext - sdpa|
B, L = 3, 7
VOCAB = 99
# weights 10x the default init's spread (0.02), so attention is far from
# uniform and a wrong scale, mask or key shows in the outputs (T5 keeps its
# default: it does not scale its scores, they are far from uniform already)
INIT = 0.2


@pytest.fixture(scope="module", autouse=True)
def worst_error_table():
    yield
    if WORST:
        print("\nworst |mha_ext - sdpa| per model:")
        for (kind, dt, what), err in sorted(WORST.items()):
            print(f"  {kind:<8} {dt:<8} {what:<28} {err:.3g}")


def _close(kind, dtype, what, ours, ref, row=None):
    """ours vs ref within TOL[dtype], NaN positions equal; the worst error is
    noted in the table under `row` (default: `what`)."""
    ours, ref = ours.detach(), ref.detach()
    assert ours.shape == ref.shape, f"{kind} {what}: shape {ours.shape} != {ref.shape}"
    assert torch.equal(torch.isnan(ours), torch.isnan(ref)), (
        f"{kind} {what}: NaN positions differ")
    ok = ~torch.isnan(ref)
    err = float((ours[ok] - ref[ok]).abs().max()) if ok.any() else 0.0
    key = (kind, str(dtype).replace("torch.", ""), row or what)
    WORST[key] = max(WORST.get(key, 0.0), err)
    tol = TOL[dtype]
    torch.testing.assert_close(ours, ref, rtol=tol, atol=tol,
                               msg=lambda m: f"{kind} {what}: {m}")


# ------------------------------------------------------------------ models

def _ids(gen, shape, low=3):
    return torch.randint(low, VOCAB, shape, generator=gen)


def _padding(lengths, width, left):
    """(B, width) 0/1 mask, 1 = real token, padded on the left or right."""
    m = torch.zeros(len(lengths), width, dtype=torch.long)
    for b, n in enumerate(lengths):
        if left:
            m[b, width - n:] = 1
        else:
            m[b, :n] = 1
    return m


def _bert():
    cfg = transformers.BertConfig(
        vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
        intermediate_size=37, max_position_embeddings=64, hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0, initializer_range=INIT)
    return transformers.BertModel(cfg), 2


def _gpt2():
    cfg = transformers.GPT2Config(
        vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=4, n_positions=64,
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, initializer_range=INIT, bos_token_id=0,
        eos_token_id=1, pad_token_id=2)
    return transformers.GPT2LMHeadModel(cfg), 2


def _bart():
    cfg = transformers.BartConfig(
        vocab_size=VOCAB, d_model=32, encoder_layers=2, decoder_layers=2,
        encoder_attention_heads=4, decoder_attention_heads=4, encoder_ffn_dim=37,
        decoder_ffn_dim=37, max_position_embeddings=64, dropout=0.0,
        attention_dropout=0.0, activation_dropout=0.0, init_std=INIT, bos_token_id=0, pad_token_id=1,
        eos_token_id=2, decoder_start_token_id=2, forced_eos_token_id=None)
    return transformers.BartForConditionalGeneration(cfg), 6


def _t5():
    cfg = transformers.T5Config(
        vocab_size=VOCAB, d_model=32, d_kv=8, d_ff=37, num_layers=2,
        num_decoder_layers=2, num_heads=4, relative_attention_num_buckets=8,
        dropout_rate=0.0, decoder_start_token_id=0, pad_token_id=0, eos_token_id=1)
    return transformers.T5ForConditionalGeneration(cfg), 6


def _llama():
    cfg = transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=37, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
        initializer_range=INIT, bos_token_id=0, eos_token_id=1, pad_token_id=2)
    return transformers.LlamaForCausalLM(cfg), 2


def _mistral():
    cfg = transformers.MistralConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=37, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
        sliding_window=3, initializer_range=INIT, bos_token_id=0, eos_token_id=1,
        pad_token_id=2)
    return transformers.MistralForCausalLM(cfg), 2


MODELS = {"bert": _bert, "gpt2": _gpt2, "bart": _bart, "t5": _t5,
          "llama": _llama, "mistral": _mistral}
DECODER_ONLY = {"gpt2", "llama", "mistral"}
SEQ2SEQ = {"bart", "t5"}


def build(kind, dtype):
    """(model in eval mode on "sdpa", attention calls per forward)."""
    torch.manual_seed(0)
    model, calls = MODELS[kind]()
    return model.to(dtype).eval(), calls


def inputs(kind):
    """A padded batch: right-padded for BERT, left-padded for the decoders,
    a padded encoder input and a full decoder input for BART and T5."""
    gen = torch.Generator().manual_seed(1)
    ids = _ids(gen, (B, L))
    mask = _padding([L, 5, 2], L, left=kind in DECODER_ONLY)
    if kind in SEQ2SEQ:
        return dict(input_ids=ids, attention_mask=mask,
                    decoder_input_ids=_ids(gen, (B, 5)))
    return dict(input_ids=ids, attention_mask=mask)


def outputs(kind, out):
    """The tensors compared: logits, plus the encoder's output for seq2seq."""
    if kind == "bert":
        return {"last_hidden_state": out.last_hidden_state}
    got = {"logits": out.logits}
    if kind in SEQ2SEQ:
        got["encoder_last_hidden_state"] = out.encoder_last_hidden_state
    return got


def run_both(model, fn):
    """fn(model) with "sdpa", then with "mha_ext" (same weights); back to sdpa."""
    ref = fn(model)
    model.set_attn_implementation(hf.NAME)
    try:
        ours = fn(model)
    finally:
        model.set_attn_implementation("sdpa")
    return ours, ref


# ------------------------------------------------------------------- tests

@pytest.mark.parametrize("padded", [True, False], ids=["padded", "unpadded"])
@pytest.mark.parametrize("dtype", DTYPES, ids=["f32", "f64"])
@pytest.mark.parametrize("kind", sorted(MODELS))
def test_outputs_match_sdpa(kind, dtype, padded):
    """Every position compared, padded ones included (a left-padded
    decoder's pad rows see no key: zero rows, as torch's SDPA gives).
    Unpadded, transformers passes no mask and the layers use is_causal."""
    model, _ = build(kind, dtype)
    x = inputs(kind)
    if not padded:
        x.pop("attention_mask")
    with torch.no_grad():
        ours, ref = run_both(model, lambda m: outputs(kind, m(**x)))
    for what in ref:
        assert ours[what].dtype == dtype
        _close(kind, dtype, what, ours[what], ref[what])


@pytest.mark.parametrize("padded", [True, False], ids=["padded", "unpadded"])
@pytest.mark.parametrize("kind", ["gpt2", "bart", "t5", "llama", "mistral"])
def test_greedy_generate_same_tokens(kind, padded):
    """Padded: every step carries a mask.  Unpadded: transformers passes no
    mask, so the prefill relies on is_causal and each decoding step (one
    query) must see every cached key."""
    model, _ = build(kind, torch.float32)
    x = inputs(kind)
    x.pop("decoder_input_ids", None)
    if not padded:
        x.pop("attention_mask")
    cfg = model.config
    kw = dict(max_new_tokens=6, do_sample=False, num_beams=1,
              pad_token_id=cfg.pad_token_id, eos_token_id=None)
    with torch.no_grad():
        ours, ref = run_both(model, lambda m: m.generate(**x, **kw))
    assert ours.shape == ref.shape
    assert ours.shape[1] >= 6
    assert torch.equal(ours, ref), f"{kind}: generate() tokens differ\n{ours}\n{ref}"


@pytest.mark.parametrize("dtype", DTYPES, ids=["f32", "f64"])
@pytest.mark.parametrize("kind", ["llama", "t5"])
def test_gradients_match_sdpa(kind, dtype):
    model, _ = build(kind, dtype)
    x = inputs(kind)
    names = [n for n, p in model.named_parameters() if p.requires_grad]
    weight = None

    def grads(m):
        nonlocal weight
        m.zero_grad(set_to_none=True)
        logits = m(**x).logits
        if weight is None:
            weight = torch.randn(logits.shape, generator=torch.Generator().manual_seed(2),
                                 dtype=dtype)
        (logits * weight).sum().backward()
        params = dict(m.named_parameters())
        return {"logits": logits.detach(), **{n: params[n].grad.clone() for n in names}}

    ours, ref = run_both(model, grads)
    if kind == "t5":
        # the relative-position bias reaches the attention only as a mask
        bias = "encoder.block.0.layer.0.SelfAttention.relative_attention_bias.weight"
        assert ref[bias].abs().max() > 0
    # T5 under grad mode: its bias needs a gradient, the twin's path for a
    # mask that requires grad, whose forward is checked here too
    _close(kind, dtype, "logits (grad mode)", ours["logits"], ref["logits"])
    # float32: a gradient summed over many terms (an embedding's, over every
    # token) is off from the float64 truth by more than 2e-5 in torch's own
    # float32 run (Llama: up to 4.7e-5), so two correct float32 runs may
    # differ by TOL plus torch's own error there; ours is checked against
    # that, and against the truth itself
    truth = None
    if dtype == torch.float32:
        model64, _ = build(kind, torch.float64)
        w32, weight = weight, weight.to(torch.float64)
        truth = grads(model64)
        weight = w32
    for n in names:
        if truth is None:
            _close(kind, dtype, "grad " + n, ours[n], ref[n], row="every parameter's gradient")
            continue
        t64 = truth[n].to(torch.float32)
        own = float((ref[n] - t64).abs().max())
        slack = TOL[dtype] + own
        err = float((ours[n] - ref[n]).abs().max())
        key = (kind, "float32", "every parameter's gradient")
        WORST[key] = max(WORST.get(key, 0.0), err)
        torch.testing.assert_close(ours[n], ref[n], rtol=TOL[dtype], atol=slack,
                                   msg=lambda m: f"{kind} grad {n}: {m}")
        assert float((ours[n] - t64).abs().max()) <= slack, (
            f"{kind} grad {n}: further from the float64 truth than torch's float32 (+{TOL[dtype]})")


@pytest.mark.parametrize("kind", sorted(MODELS))
def test_every_attention_layer_goes_through_the_twin(kind, monkeypatch):
    """The comparisons above mean nothing unless "mha_ext" reaches the twin:
    count its calls (every attention layer once per forward) and check that
    "sdpa" never calls it."""
    model, per_forward = build(kind, torch.float32)
    x = inputs(kind)
    twin = hf._twin()
    calls = []

    def spy(*args, **kwargs):
        calls.append(kwargs.get("enable_gqa"))
        return twin(*args, **kwargs)

    monkeypatch.setattr(hf, "_twin", lambda: spy)
    with torch.no_grad():
        model(**x)
        assert calls == []
        model.set_attn_implementation(hf.NAME)
        model(**x)
    assert len(calls) == per_forward
    assert all(calls) == (kind in ("llama", "mistral"))


def test_training_mode_passes_the_models_dropout(monkeypatch):
    """Attention dropout reaches the twin in training mode only (its stream
    is mha_ext's own, so the numbers cannot be compared with torch's)."""
    torch.manual_seed(0)
    cfg = transformers.BertConfig(
        vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
        intermediate_size=37, attention_probs_dropout_prob=0.25,
        attn_implementation=hf.NAME)
    model = transformers.BertModel(cfg)
    twin = hf._twin()
    seen = []

    def spy(*args, **kwargs):
        seen.append(kwargs["dropout_p"])
        return twin(*args, **kwargs)

    monkeypatch.setattr(hf, "_twin", lambda: spy)
    x = inputs("bert")
    model.train()(**x)
    model.eval()(**x)
    assert seen == [0.25, 0.25, 0.0, 0.0]


@pytest.mark.parametrize("reentrant", [False, True])
def test_dropout_follows_torchs_generator_under_checkpointing(reentrant):
    """Training with attention dropout: the twin's stream is drawn from
    torch's generator, so transformers.set_seed repeats a step and gradient
    checkpointing (which restores that generator before it recomputes a
    layer) gives the gradients of the forward that made the loss.  Before,
    the stream was fresh per call: the recomputed attention was 3.1 off the
    forward's and the gradients belonged to another mask."""
    torch.manual_seed(0)
    model, _ = _llama()
    layers = [m for m in model.modules() if hasattr(m, "attention_dropout")]
    assert len(layers) == 2
    for m in layers:
        m.attention_dropout = 0.3
    model.set_attn_implementation(hf.NAME)
    model.train()
    ids = torch.randint(3, VOCAB, (2, 6), generator=torch.Generator().manual_seed(1))
    runs = []
    for ckpt in (False, True, True):
        if ckpt:
            model.gradient_checkpointing_enable(
                gradient_checkpointing_kwargs={"use_reentrant": reentrant})
        model.zero_grad()
        transformers.set_seed(123)
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        runs.append((loss.detach(), [p.grad.clone() for p in model.parameters()]))
    (l0, g0), (l1, g1), (l2, g2) = runs
    assert l0 == l1 == l2  # set_seed repeats the masks
    for a, b, c in zip(g0, g1, g2):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(c, b, rtol=0, atol=0)


def test_from_config_with_the_registered_name():
    """The README's spelling: attn_implementation="mha_ext" at construction."""
    torch.manual_seed(0)
    model, _ = _llama()
    torch.manual_seed(0)
    # a copy: from_config writes the name into the config it is given, and
    # model (sharing it) would then compute on "mha_ext" too, the reference
    # compared with itself
    cfg = copy.deepcopy(model.config)
    ours = transformers.AutoModelForCausalLM.from_config(cfg, attn_implementation=hf.NAME)
    ours.load_state_dict(model.state_dict())
    assert ours.config._attn_implementation == hf.NAME
    assert model.config._attn_implementation == "sdpa"
    x = inputs("llama")
    with torch.no_grad():
        _close("llama", torch.float32, "from_config logits",
               ours.eval()(**x).logits, model.eval()(**x).logits)


# ------------------------------------------- the function against "sdpa"'s

def _qkv(gen, Hkv=4, Lq=5, S=6, dtype=torch.float64, Bq=2):
    q = torch.randn(Bq, 4, Lq, 8, generator=gen, dtype=dtype)
    k = torch.randn(Bq, Hkv, S, 8, generator=gen, dtype=dtype)
    v = torch.randn(Bq, Hkv, S, 8, generator=gen, dtype=dtype)
    return q, k, v


class _Layer(torch.nn.Module):
    def __init__(self, is_causal, groups=1):
        super().__init__()
        self.is_causal = is_causal
        self.num_key_value_groups = groups


CASES = {
    "no mask": dict(),
    "causal prefill": dict(causal=True),
    "causal decode step": dict(causal=True, Lq=1),
    "bool mask": dict(mask="bool"),
    "bool mask, a row sees nothing": dict(mask="bool-empty-row"),
    "float mask": dict(mask="float"),
    "gqa causal": dict(causal=True, Hkv=2),
    "gqa decode step with mask": dict(Hkv=2, Lq=1, mask="bool"),
    "position bias": dict(bias=True),
    "position bias, causal": dict(bias=True, causal=True),
    "position bias, bool mask": dict(bias=True, mask="bool"),
    "position bias, bool mask, a row sees nothing": dict(bias=True, mask="bool-empty-row"),
    "position bias, float mask": dict(bias=True, mask="float"),
    "scaling 1.0": dict(scaling=1.0),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_attention_forward_matches_sdpa_attention_forward(case):
    c = CASES[case]
    gen = torch.Generator().manual_seed(3)
    Lq = c.get("Lq", 5)
    q, k, v = _qkv(gen, Hkv=c.get("Hkv", 4), Lq=Lq)
    layer = _Layer(c.get("causal", False), groups=4 // c.get("Hkv", 4))
    mask = None
    if c.get("mask", "").startswith("bool"):
        mask = torch.rand(2, 1, Lq, 6, generator=gen) > 0.3
        mask[..., 0] = True
        if c["mask"] == "bool-empty-row":
            mask[1, 0, -1, :] = False
    elif c.get("mask") == "float":
        mask = torch.randn(2, 1, Lq, 6, generator=gen, dtype=q.dtype)
    kw = dict(scaling=c.get("scaling"))
    if c.get("bias"):
        kw["position_bias"] = torch.randn(1, 4, Lq, 6, generator=gen, dtype=q.dtype)
    ours, w = hf.attention_forward(layer, q, k, v, mask, **kw)
    ref, _ = sdpa_attention_forward(layer, q, k, v, mask, **kw)
    assert w is None
    assert ours.shape == (2, Lq, 4, 8) and ours.is_contiguous()
    _close("fn", q.dtype, case, ours, ref)


@pytest.mark.parametrize("gqa", [False, True], ids=["mha", "gqa"])
@pytest.mark.parametrize("mask", ["none", "bool", "float -inf"])
def test_gradient_into_a_float_mask_matches_sdpa(mask, gqa):
    """A position bias that needs a gradient (T5 training): every gradient,
    the bias's included, as "sdpa" gives them, with -inf in a float mask
    and fewer key/value heads too."""
    gen = torch.Generator().manual_seed(7)
    q, k, v = _qkv(gen, Hkv=2 if gqa else 4)
    bias = torch.randn(1, 4, 5, 6, generator=gen, dtype=q.dtype)
    m = None
    if mask == "bool":
        m = torch.rand(2, 1, 5, 6, generator=gen) > 0.3
        m[..., 0] = True
    elif mask == "float -inf":
        m = torch.randn(2, 1, 5, 6, generator=gen, dtype=q.dtype)
        m[0, 0, 1, 2:] = -float("inf")
    grad_out = torch.randn(2, 5, 4, 8, generator=gen, dtype=q.dtype)
    layer = _Layer(False, groups=2 if gqa else 1)
    got = []
    for fn in (hf.attention_forward, sdpa_attention_forward):
        leaves = [t.clone().requires_grad_() for t in (q, k, v, bias)]
        out, _ = fn(layer, *leaves[:3], m, position_bias=leaves[3])
        out.backward(grad_out)
        got.append([out.detach()] + [t.grad for t in leaves])
    for what, ours, ref in zip(["out", "dq", "dk", "dv", "dbias"], *got):
        _close("fn", q.dtype, f"mask grad ({mask}, {'gqa' if gqa else 'mha'}) {what}",
               ours, ref, row="float mask with gradient")


@pytest.mark.parametrize("kwarg, value, exc, words", [
    ("softcap", 30.0, ValueError, "softcap"),
    ("s_aux", "sinks", ValueError, "s_aux"),
    ("head_mask", "mask", ValueError, "head_mask"),
])
def test_unsupported_options_refused(kwarg, value, exc, words):
    q, k, v = _qkv(torch.Generator().manual_seed(4))
    with pytest.raises(exc, match=words):
        hf.attention_forward(_Layer(False), q, k, v, None, **{kwarg: value})


def test_output_attentions_warns_and_gives_none():
    q, k, v = _qkv(torch.Generator().manual_seed(5))
    with pytest.warns(UserWarning, match="output_attentions"):
        _, w = hf.attention_forward(_Layer(False), q, k, v, None, output_attentions=True)
    assert w is None


def test_three_dimensional_input_refused():
    q, k, v = _qkv(torch.Generator().manual_seed(6))
    with pytest.raises(ValueError, match=r"query, key and value of 4 dimensions"):
        hf.attention_forward(_Layer(False), q[0], k[0], v[0], None)


@pytest.mark.parametrize("name", ["", "sdpa", "eager", "flash_attention_2", 3])
def test_register_refuses_taken_or_bad_names(name):
    with pytest.raises(ValueError, match="register\\(name\\)"):
        hf.register(name)


def test_register_without_twin_is_a_clear_import_error(monkeypatch):
    monkeypatch.setattr(mha_ext, "scaled_dot_product_attention", None, raising=False)
    with pytest.raises(ImportError, match="scaled_dot_product_attention"):
        hf.register("mha_ext_missing")
    from transformers import AttentionInterface
    assert "mha_ext_missing" not in AttentionInterface()


def test_register_is_idempotent_and_sets_the_mask_builder():
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask
    assert hf.register() == hf.register() == "mha_ext"
    assert AttentionInterface()["mha_ext"] is hf.attention_forward
    builder = AttentionMaskInterface()["mha_ext"]
    assert builder.__wrapped__ is sdpa_mask
    hf.register()
    assert AttentionMaskInterface()["mha_ext"] is builder
    # a causal mask is always built, where "sdpa"'s builder leaves it to is_causal
    from transformers.masking_utils import causal_mask_function
    kw = dict(batch_size=2, q_length=4, kv_length=4, mask_function=causal_mask_function,
              allow_is_causal_skip=True)
    assert sdpa_mask(**kw) is None
    torch.testing.assert_close(builder(**kw),
                               torch.ones(4, 4, dtype=torch.bool).tril().expand(2, 1, 4, 4))


def test_register_stopped_part_way_leaves_the_name_unknown_not_unguarded(monkeypatch):
    # transformers takes a name from its AttentionInterface entry on: an
    # exception (a Ctrl-C) after that entry and before the mask builder or
    # the guard left the name taken without SDPA's masks (Llama saw no mask:
    # logits 0.15 off) or without refusing models with their own attention
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    class Interrupt(BaseException):
        pass
    name = "mha_ext_stopped"

    def stop():
        raise Interrupt
    try:
        for step in ("_mask_builder", "_guard_models"):
            with monkeypatch.context() as mp:
                mp.setattr(hf, step, lambda *a, **k: stop())
                with pytest.raises(Interrupt):
                    hf.register(name)
            assert name not in AttentionInterface(), step
        assert hf.register(name) == name and AttentionInterface()[name] is hf.attention_forward
        assert name in AttentionMaskInterface()
    finally:
        AttentionInterface._global_mapping.pop(name, None)
        AttentionMaskInterface._global_mapping.pop(name, None)
        hf._NAMES.discard(name)


def test_a_causal_mask_without_padding_runs_the_causal_pass_with_the_masks_bits(monkeypatch):
    """The mask builder always builds the causal mask; one blocking nothing
    else reaches the twin as is_causal="lower_right" (the blocked blocks
    skipped), a padded one as the mask.  Either way the logits are those of
    "sdpa", and the causal pass gives the bits the mask gives."""
    torch.manual_seed(0)
    model, _ = _llama()
    model = model.double().eval()
    ids = torch.randint(3, VOCAB, (2, 9))
    pad = torch.ones(2, 9, dtype=torch.long)
    pad[0, :3] = 0  # left padding
    twin = hf._twin()
    seen = []

    def spy(q, k, v, **kw):
        seen.append((kw["is_causal"], kw["attn_mask"] is None, q.shape[2], k.shape[2]))
        return twin(q, k, v, **kw)

    with torch.no_grad():
        sdpa = [model(input_ids=ids).logits, model(input_ids=ids, attention_mask=pad).logits]
        gen_sdpa = model.generate(input_ids=ids, max_new_tokens=3, do_sample=False)
        model.set_attn_implementation(hf.NAME)
        monkeypatch.setattr(hf, "_twin", lambda: spy)
        plain = model(input_ids=ids).logits
        assert seen == [("lower_right", True, 9, 9)] * 2
        seen.clear()
        padded = model(input_ids=ids, attention_mask=pad).logits
        assert seen == [(False, False, 9, 9)] * 2
        seen.clear()
        gen = model.generate(input_ids=ids, max_new_tokens=3, do_sample=False)
        # prefill, then decoding steps of one query over the cache
        assert [s[0] for s in seen[:2]] == ["lower_right"] * 2
        assert all(s[2] == 1 for s in seen[2:]) and len(seen) == 6
    torch.testing.assert_close(plain, sdpa[0], rtol=0, atol=1e-12)
    torch.testing.assert_close(padded[1], sdpa[1][1], rtol=0, atol=1e-12)
    torch.testing.assert_close(padded[0, 3:], sdpa[1][0, 3:], rtol=0, atol=1e-12)
    assert torch.equal(gen, gen_sdpa)
    # the causal pass and the mask it stands for: the same bits
    q, k, v = (torch.randn(2, 4, n, 8) for n in (5, 12, 12))
    mask = torch.ones(5, 12, dtype=torch.bool).tril(7).expand(2, 1, 5, 12)
    assert hf._lower_right_causal(mask, 5, 12)
    assert not hf._lower_right_causal(mask.logical_not(), 5, 12)
    assert torch.equal(twin(q, k, v, attn_mask=mask), twin(q, k, v, is_causal="lower_right"))
