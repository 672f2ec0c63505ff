"""FLOPs from the architecture (mmrl.perf.flops) against torch.utils.flop_counter and against counts by hand, and the
per-step meter the recipes log (mmrl.perf.meter).

* Every registered family's forward, on tiny random models of the real classes, equals FlopCounterMode's count of
  the same forward exactly (attention through the math SDPA kernel, which flop_counter sees as bmm; on CPU the
  fused kernel is invisible to it). Backward (all weights trainable) is at least flop_counter's and within the
  share of the layers whose input needs no gradient.
* Families: SD3 / SD3.5, FLUX.1, FLUX.2, Wan, Qwen-Image (and Edit-2511's doubled timestep rows), Z-Image (uneven
  image and caption lengths: the padding to 32 tokens and to the batch's longest), Qwen2-VL, Qwen2.5-VL, Qwen3-VL, GLM-4.1V, InternVL.
* Every registered real-width architecture of a diffusion family, at its tiny widths on the training row it declares
  (the family file's estimator and row builder, read through the registries), equals FlopCounterMode's count.
* One SD3.5-Medium joint block (and its dual attention), one FLUX.1 single-stream block and one Qwen2.5-VL-3B decoder
  layer at their real widths (built on the meta device: no memory) equal the formulas written out by hand below.
"""

from __future__ import annotations

import pytest
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.flop_counter import FlopCounterMode

import mmrl.diffusion.models  # noqa: F401  (each family registers its estimator and architectures)
from mmrl.perf.architectures import ARCHITECTURES, get_architecture
from mmrl.perf.flops import FLOP_FAMILIES, Pass, _window_lengths, flops_estimator
from mmrl.perf.meter import FlopsMeter, attach_flops_meter, device_peak_tflops, perf_metrics


def _counted(fn) -> int:
    with sdpa_kernel(SDPBackend.MATH), FlopCounterMode(display=False) as fc:
        fn()
    return fc.get_total_flops()


def _sd3(**kw):
    from diffusers import SD3Transformer2DModel

    torch.manual_seed(0)
    base = dict(sample_size=8, patch_size=2, in_channels=4, num_layers=3, attention_head_dim=16, num_attention_heads=2,
                joint_attention_dim=32, caption_projection_dim=32, pooled_projection_dim=24, out_channels=4,
                pos_embed_max_size=32, dual_attention_layers=(0,), qk_norm="rms_norm")
    return SD3Transformer2DModel(**{**base, **kw})


def _flux(**kw):
    from diffusers import FluxTransformer2DModel

    torch.manual_seed(0)
    base = dict(patch_size=1, in_channels=16, num_layers=2, num_single_layers=3, attention_head_dim=16,
                num_attention_heads=2, joint_attention_dim=32, pooled_projection_dim=32, guidance_embeds=True,
                axes_dims_rope=(4, 6, 6))
    return FluxTransformer2DModel(**{**base, **kw})


def _sd3_inputs():
    return dict(hidden_states=torch.randn(2, 4, 8, 12), encoder_hidden_states=torch.randn(2, 5, 32),
                pooled_projections=torch.randn(2, 24), timestep=torch.tensor([1.0, 2.0]))


def _flux_inputs():
    return dict(hidden_states=torch.randn(2, 12, 16), encoder_hidden_states=torch.randn(2, 7, 32),
                pooled_projections=torch.randn(2, 32), timestep=torch.tensor([0.5, 0.5]),
                guidance=torch.tensor([3.0, 3.0]), img_ids=torch.zeros(12, 3), txt_ids=torch.zeros(7, 3))


def _flux2():
    from diffusers import Flux2Transformer2DModel

    torch.manual_seed(0)
    model = Flux2Transformer2DModel(patch_size=1, in_channels=128, num_layers=2, num_single_layers=2,
                                    attention_head_dim=16, num_attention_heads=2, joint_attention_dim=96,
                                    axes_dims_rope=(4, 4, 4, 4), guidance_embeds=True)
    kw = dict(hidden_states=torch.randn(2, 12, 128), encoder_hidden_states=torch.randn(2, 7, 96),
              timestep=torch.tensor([0.5, 0.5]), guidance=torch.tensor([3.0, 3.0]),
              img_ids=torch.zeros(2, 12, 4), txt_ids=torch.zeros(2, 7, 4))
    return model, kw


def _wan():
    from diffusers import WanTransformer3DModel

    torch.manual_seed(0)
    model = WanTransformer3DModel(patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=16, in_channels=16,
                                  out_channels=16, text_dim=32, freq_dim=256, ffn_dim=64, num_layers=2,
                                  rope_max_seq_len=64)
    kw = dict(hidden_states=torch.randn(2, 16, 3, 8, 12), timestep=torch.tensor([300.0, 700.0]),
              encoder_hidden_states=torch.randn(2, 9, 32))
    return model, kw


def _qwen_image(zero_cond_t=False):
    from diffusers import QwenImageTransformer2DModel

    torch.manual_seed(0)
    model = QwenImageTransformer2DModel(patch_size=2, in_channels=64, out_channels=16, num_layers=2,
                                        attention_head_dim=16, num_attention_heads=2, joint_attention_dim=24,
                                        axes_dims_rope=(4, 6, 6), zero_cond_t=zero_cond_t)
    shapes = [[(1, 3, 4), (1, 3, 4)]] * 2 if zero_cond_t else [[(1, 3, 4)]] * 2  # an edit: target + reference
    n = sum(f * h * w for f, h, w in shapes[0])
    kw = dict(hidden_states=torch.randn(2, n, 64), encoder_hidden_states=torch.randn(2, 7, 24),
              encoder_hidden_states_mask=torch.ones(2, 7), timestep=torch.tensor([0.5, 0.5]), img_shapes=shapes)
    return model, kw


def _z_image():
    from diffusers import ZImageTransformer2DModel

    torch.manual_seed(0)
    model = ZImageTransformer2DModel(all_patch_size=(2,), all_f_patch_size=(1,), in_channels=16, dim=32, n_layers=2,
                                     n_refiner_layers=1, n_heads=2, n_kv_heads=2, cap_feat_dim=32, axes_dims=[4, 6, 6],
                                     axes_lens=[512, 64, 64])
    # two samples of different sizes: image tokens 6 x 8 = 48 -> 64 and 4 x 4 = 16 -> 32, captions 5 -> 32 and
    # 40 -> 64 (each padded to a multiple of 32, then to the longest in the batch)
    kw = dict(x=[torch.randn(16, 1, 12, 16), torch.randn(16, 1, 8, 8)], t=torch.tensor([0.3, 0.7]),
              cap_feats=[torch.randn(5, 32), torch.randn(40, 32)], return_dict=False)
    return model, kw


DIFFUSION = {"sd3": lambda: (_sd3(), _sd3_inputs()), "flux": lambda: (_flux(), _flux_inputs()), "flux2": _flux2,
             "wan": _wan, "qwen_image": _qwen_image, "qwen_image_edit_2511": lambda: _qwen_image(zero_cond_t=True),
             "z_image": _z_image}


def _total(out):  # the sum of a forward's output (Z-Image: a list of per-sample tensors of different sizes)
    out = out.sample if hasattr(out, "sample") else out[0]
    return sum(o.sum() for o in out) if isinstance(out, list) else out.sum()


@pytest.mark.parametrize("family", sorted(DIFFUSION))
def test_diffusion_transformer_flops_equal_flop_counter(family):
    model, kw = DIFFUSION[family]()
    est = flops_estimator(model)
    shape = est.shapes((), kw)
    assert est.forward_flops(shape) == _counted(lambda: model(**kw))
    both = _counted(lambda: _total(model(**kw)).backward())
    estimate = est.forward_flops(shape) + est.backward_flops(shape)
    # the estimate also counts input gradients of the layers fed by the model's inputs (patch / text / timestep
    # embeddings): autograd skips those; at this tiny width they are a few percent, at real widths < 0.3%
    assert both <= estimate <= 1.06 * both, (both, estimate)


@pytest.mark.parametrize("name", sorted(n for n, a in ARCHITECTURES.items() if a.config_class is None))
def test_every_registered_diffusion_architecture_counts_its_row_exactly(name):
    arch = get_architecture(name, small=True)
    assert arch.class_name in FLOP_FAMILIES, f"{name}: no @register_flops for {arch.class_name}"
    torch.manual_seed(0)
    model = arch.build(dtype=torch.float32)
    kw = arch.inputs(model, arch.small_row, torch.float32)
    est = flops_estimator(model)
    assert est.forward_flops(est.shapes((), kw)) == _counted(lambda: model(**kw))


@pytest.mark.parametrize("builder", ["build_tiny_qwen2_vl", "build_tiny_qwen25_vl", "build_tiny_qwen3_vl",
                                     "build_tiny_glm4v"])
def test_qwen_vl_flops_equal_flop_counter(builder, tmp_path):
    """Vision tower (per-frame attention; Qwen2.5-VL: windows), decoder (left padding excluded) and lm_head: the
    meter's sum over one forward equals flop_counter's count, and a decode step against a KV cache too."""
    import mmrl.tiny as tiny
    from transformers import AutoModelForImageTextToText, AutoProcessor
    from PIL import Image

    path = getattr(tiny, builder)(tmp_path / "m")
    model = AutoModelForImageTextToText.from_pretrained(path).eval()
    proc = AutoProcessor.from_pretrained(path)
    size = 112 if "qwen3" not in builder else 128
    img = Image.new("RGB", (size, 2 * size), (200, 30, 30))
    msgs = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "what colour is the square"}]}]
    text = proc.apply_chat_template(msgs, add_generation_prompt=True)
    proc.tokenizer.padding_side = "left"
    batch = proc(text=[text, text + " red"], images=[img, img], return_tensors="pt", padding=True)
    assert int((batch["attention_mask"] == 0).sum()) > 0  # one row is left-padded
    meter = attach_flops_meter(model)
    assert {type(e.module).__name__ for e in meter.estimators} >= {type(model.model.visual).__name__,
                                                                  type(model.model.language_model).__name__, "Linear"}
    # flop_counter counts what runs, padding included: compare on the unpadded row, then check the padded batch
    one = {k: v[1:] if k in ("input_ids", "attention_mask", "mm_token_type_ids") else v for k, v in batch.items()}
    one["pixel_values"], one["image_grid_thw"] = batch["pixel_values"][len(batch["pixel_values"]) // 2:], batch["image_grid_thw"][1:]
    meter.pop()
    with torch.no_grad():
        counted = _counted(lambda: model(**one))
    assert meter.pop() == counted
    with torch.no_grad():
        counted = _counted(lambda: model(**batch))
    assert meter.pop() < counted  # the padding of the first row is not counted
    # generate 2 tokens: the prefill (lm_head on the last position only) gives the first; one decode step feeds it
    # back (1 new token per row) against the cache: per layer, new tokens x (cached + new) real keys
    with torch.no_grad():
        model(**batch, logits_to_keep=1)
    prefill = meter.pop()
    with torch.no_grad():
        model.generate(**batch, max_new_tokens=2, min_new_tokens=2, do_sample=False)
    cfg = model.config.text_config
    width = cfg.num_attention_heads * (getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads)
    real_kv = int(batch["attention_mask"].sum()) + 2  # 2 rows: their real prompt tokens + the first new token
    lm, head = flops_estimator(model.model.language_model), model.lm_head
    decode = lm.forward_flops(Pass({"text": 2}, width * cfg.num_hidden_layers * real_kv)) \
        + 2 * 2 * head.in_features * head.out_features
    assert meter.pop() == prefill + decode


@pytest.mark.parametrize("decoder", ["qwen2", "qwen3"])
def test_internvl_flops_equal_flop_counter(tmp_path, decoder):
    """InternVL: the vision tower (patch convolution, CLS + patches per tile, attention within a tile), the projector
    after the pixel shuffle, the Qwen2 (InternVL 3) / Qwen3 (InternVL 3.5) decoder and lm_head sum to flop_counter's
    count, for 1 and 3 tiles. Eager attention: flop_counter does not count the CPU flash kernel SDPA dispatches to
    without a mask."""
    from PIL import Image
    from transformers import AutoModelForImageTextToText

    from mmrl.tiny import build_tiny_internvl
    from mmrl.vlm.common import encode_prompt, load_policy, messages_from_text, render_prompt

    path = build_tiny_internvl(tmp_path / "m", decoder=decoder)
    _, proc = load_policy(path)
    model = AutoModelForImageTextToText.from_pretrained(path, attn_implementation="eager").eval()
    meter = attach_flops_meter(model)
    assert {type(e.module).__name__ for e in meter.estimators} == {
        "InternVLVisionModel", "InternVLMultiModalProjector", decoder.capitalize() + "Model", "Linear"}
    for size, tiles in (((90, 60), 3), ((56, 56), 1)):
        enc = encode_prompt(proc, render_prompt(proc, messages_from_text("<image>what colour is it")),
                            [Image.new("RGB", size, "red")])
        assert enc.mm["pixel_values"].shape[0] == tiles
        ids = torch.tensor([enc.input_ids])
        meter.pop()
        with torch.no_grad():
            counted = _counted(lambda: model(input_ids=ids, attention_mask=torch.ones_like(ids), **enc.mm))
        assert meter.pop() == counted


def test_janus_flops_equal_flop_counter(tmp_path):
    """Janus (mmrl.ar_image): the meter watches the Llama decoder, the generation head and the image-token aligner
    (the text lm_head is never called in image generation); guided sampling (a prefill of the prompt and its
    unconditional row, then one token per row against the cache) and the teacher-forced guided forward of the
    trained log-probs each sum to flop_counter's count."""
    from mmrl.ar_image.janus import JanusPolicy, load_janus
    from mmrl.tiny import build_tiny_janus

    path = build_tiny_janus(tmp_path / "m", seed=0, image_size=16, patch_size=4, vq_top_width=4, aligner_dim=32)
    model, proc = load_janus(path, torch.device("cpu"), torch.float32)
    meter = attach_flops_meter(model)
    assert sorted(type(e.module).__name__ for e in meter.estimators) == [
        "JanusVQVAEAlignerMLP", "JanusVQVAEHead", "Linear", "LlamaModel"]
    policy = JanusPolicy(model, proc, guidance_scale=5.0)
    ids = policy.prompt_ids("a red circle on a blue background")
    meter.pop()
    out = {}
    with torch.no_grad():
        counted = _counted(lambda: out.update(tokens=policy.sample(ids, 3)[0]))
    assert counted > 0 and meter.pop() == counted
    tokens = out["tokens"]
    with torch.no_grad():
        counted = _counted(lambda: policy.guided_logits(ids, tokens))
    assert meter.pop() == counted


def test_window_lengths_match_qwen25_get_window_index():
    """Patches per attention window against transformers' own window index of Qwen2.5-VL's vision tower
    (windows of 112 px = 4 merged units of 2 x 2 patches of 14 px; edge windows smaller, empty ones skipped)."""
    from transformers.vision_utils import get_vision_window_index

    for t, h, w in ((1, 8, 8), (1, 12, 20), (2, 6, 26), (1, 2, 2)):
        _, cu = get_vision_window_index(torch.tensor([[t, h, w]]), spatial_merge_size=2, window_size=112, patch_size=14)
        sizes = [n for n in torch.diff(torch.as_tensor(cu)).tolist() if n]  # (empty windows repeat an offset)
        assert sorted(sizes) == sorted(t * _window_lengths(h, w, 2, 4)), (t, h, w)


def _meta(build, **cfg):
    with torch.device("meta"):
        return build(**cfg)


def test_sd35_medium_block_by_hand():
    """One SD3.5-Medium joint block (hidden D = 24 x 64 = 1536) at 512 px (N = 32 x 32 = 1024 image tokens) with
    M = 333 text tokens (77 CLIP + 256 T5), per sample:

      AdaLN  norm1 / norm1_context: D -> 6D each, on 1 row:               2 * 2 * 6 D^2           =  24 D^2
      image  q, k, v, out (4 D^2) + MLP D -> 4D -> D (8 D^2):             2 * N * 12 D^2          =  24 N D^2
      text   the same on the context tokens:                                                      =  24 M D^2
      attention over N + M tokens, Q K^T and P V:                         2 * 2 * (N + M)^2 * D   =   4 (N + M)^2 D
    A dual-attention block (SD3.5's first 13) adds an image-only attention (q, k, v, out: 8 N D^2, 4 N^2 D) and
    3 D more AdaLN outputs (2 * 3 D^2 = 6 D^2)."""
    from diffusers import SD3Transformer2DModel

    d, n, m = 1536, 1024, 333
    real = dict(sample_size=128, patch_size=2, in_channels=16, attention_head_dim=64, num_attention_heads=24,
                joint_attention_dim=4096, caption_projection_dim=1536, pooled_projection_dim=2048, out_channels=16,
                pos_embed_max_size=384, qk_norm="rms_norm")
    shapes = ((1, 16, 64, 64), (1, m, 4096))

    def total(layers, dual):
        est = flops_estimator(_meta(SD3Transformer2DModel, num_layers=layers, dual_attention_layers=dual, **real))
        kw = {"hidden_states": torch.empty(shapes[0], device="meta"),
              "encoder_hidden_states": torch.empty(shapes[1], device="meta")}
        return est.forward_flops(est.shapes((), kw))

    block = 24 * d**2 + 24 * n * d**2 + 24 * m * d**2 + 4 * (n + m) ** 2 * d
    assert total(3, (0,)) - total(2, (0,)) == block  # the added block is a plain joint block
    assert total(3, (0, 1)) - total(3, (0,)) == 8 * n * d**2 + 4 * n**2 * d + 6 * d**2
    assert block == 88_208_037_888  # 0.088 TFLOP per block per 512 px image (76.9e9 linear + 11.3e9 attention)


def test_flux_single_block_and_qwen25_vl_3b_layer_by_hand():
    """FLUX.1-dev single-stream block (D = 24 x 128 = 3072, MLP 4D) on L = N + M tokens, per sample:
    AdaLN D -> 3D on 1 row (6 D^2), q/k/v (3 D^2) + MLP in (4 D^2) + out (5D -> D: 5 D^2) on L tokens (2 * 12 L D^2),
    attention 4 L^2 D.
    Qwen2.5-VL-3B decoder layer (D = 2048, 16 query heads x 128, 2 KV heads x 128, MLP 11008, SwiGLU) on q new
    tokens attending to k keys: q_proj and o_proj (2 D^2), k_proj and v_proj (2 * 256 D), gate/up/down (3 * 11008 D),
    times 2q; attention 4 q k D."""
    from diffusers import FluxTransformer2DModel
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    d, n, m = 3072, 1024, 512
    real = dict(patch_size=1, in_channels=64, num_layers=1, attention_head_dim=128, num_attention_heads=24,
                joint_attention_dim=4096, pooled_projection_dim=768, guidance_embeds=True, axes_dims_rope=(16, 56, 56))
    kw = {"hidden_states": torch.empty(1, n, 64, device="meta"), "encoder_hidden_states": torch.empty(1, m, 4096,
                                                                                                       device="meta")}
    f = [flops_estimator(_meta(FluxTransformer2DModel, num_single_layers=k, **real)) for k in (1, 2)]
    big_l = n + m
    assert f[1].forward_flops(f[1].shapes((), kw)) - f[0].forward_flops(f[0].shapes((), kw)) == \
        6 * d**2 + 2 * 12 * big_l * d**2 + 4 * big_l**2 * d

    text = dict(hidden_size=2048, intermediate_size=11008, num_attention_heads=16, num_key_value_heads=2,
                vocab_size=151936, max_position_embeddings=128000)
    layers = [_meta(lambda **c: Qwen2_5_VLForConditionalGeneration(Qwen2_5_VLConfig(**c)),
                    text_config={**text, "num_hidden_layers": k}, vision_config=dict(depth=1)) for k in (1, 2)]
    est = [flops_estimator(x.model.language_model) for x in layers]
    q, k = 100, 900
    p = [e.forward_flops(Pass({"text": q}, e.module.config.num_attention_heads * 128 * e.module.config.num_hidden_layers
                                          * q * k)) for e in est]
    dd = 2048
    assert p[1] - p[0] == 2 * q * (2 * dd**2 + 2 * 256 * dd + 3 * 11008 * dd) + 4 * q * k * dd


def test_meter_counts_forward_and_backward_once_and_perf_metrics():
    from mmrl.distributed import DistContext

    model, kw = _sd3(), _sd3_inputs()
    model.requires_grad_(False)
    model.transformer_blocks[0].attn.to_q.weight.requires_grad_(True)
    meter = attach_flops_meter(model)
    assert attach_flops_meter(model) is meter  # once per model
    est = meter.estimators[0]
    shape = est.shapes((), kw)
    with torch.no_grad():
        model(**kw)
    assert meter.pop() == est.forward_flops(shape)
    out = model(**kw).sample  # a forward with grad whose output never gets a backward: counted once
    assert meter.pop() == est.forward_flops(shape)
    model(**kw).sample.sum().backward()
    assert meter.pop() == est.forward_flops(shape) + est.backward_flops(shape)
    frozen_bwd = est.backward_flops(shape)
    model.requires_grad_(True)
    meter.refresh()
    assert est.backward_flops(shape) > frozen_bwd  # weight gradients now too
    del out
    model(**kw).sample.sum().backward()
    m = perf_metrics(DistContext(), model, 0.5, "cpu")
    total = est.forward_flops(shape) + est.backward_flops(shape)
    assert m["perf/tflops_per_step"] == total / 1e12 and m["perf/tflops_per_s"] == total / 1e12 / 0.5
    assert "perf/mfu" not in m and m["perf/peak_memory_gib"] > 0  # CPU: no known peak; RSS
    assert perf_metrics(DistContext(), model, 0.5, "cpu")["perf/tflops_per_step"] == 0.0
    assert "perf/tflops_per_step" not in perf_metrics(DistContext(), torch.nn.ReLU(), 1.0, "cpu")  # no estimator
    # a model without an estimator gets no meter, not a partial count of its Linear layers
    uncounted = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Sequential(torch.nn.Linear(4, 2)))
    assert attach_flops_meter(uncounted) is None
    uncounted(torch.randn(3, 4))
    assert "perf/tflops_per_step" not in perf_metrics(DistContext(), uncounted, 1.0, "cpu")
    assert isinstance(meter, FlopsMeter)


def test_device_peak_and_mfu(monkeypatch):
    from mmrl.distributed import DistContext

    assert device_peak_tflops("cpu") is None
    monkeypatch.setenv("MMRL_PEAK_TFLOPS", "2.5")
    assert device_peak_tflops("cpu") == 2.5
    model, kw = _sd3(), _sd3_inputs()
    meter = attach_flops_meter(model)
    with torch.no_grad():
        model(**kw)
    n = meter.estimators[0].forward_flops(meter.estimators[0].shapes((), kw))
    assert perf_metrics(DistContext(), model, 2.0, "cpu")["perf/mfu"] == pytest.approx(n / 1e12 / 2.0 / 2.5)
    monkeypatch.setenv("MMRL_PEAK_TFLOPS", "fast")
    with pytest.raises(ValueError, match="MMRL_PEAK_TFLOPS: expected a number of TFLOP/s per device, got 'fast'"):
        device_peak_tflops("cpu")


def test_z_image_omni_mode_forward_is_not_counted():
    """Z-Image's omni mode (nested lists: several images, SigLIP features) has no count: the estimator says so
    (None) and the meter skips that forward instead of counting part of it."""
    model, kw = _z_image()
    est = flops_estimator(model)
    nested = dict(kw, x=[[t] for t in kw["x"]], cap_feats=[[c] for c in kw["cap_feats"]])
    assert est.shapes((), nested) is None and est.shapes((), kw) is not None
    meter = FlopsMeter()
    assert meter.watch(model)
    pre = model._forward_pre_hooks[next(reversed(model._forward_pre_hooks))]
    post = model._forward_hooks[next(reversed(model._forward_hooks))]
    pre(model, (), nested)
    post(model, (), nested, None)
    assert meter.pop() == 0
    with torch.no_grad():
        model(**kw)
    assert meter.pop() == est.forward_flops(est.shapes((), kw)) > 0


def test_real_width_vlm_lora_targets_are_the_recipes():
    """mmrl.perf (a shared layer) cannot import the VLM recipe's config: its copy of the LoRA targets must stay
    equal to the recipe's default."""
    from mmrl.perf.architectures import _LM_TARGETS
    from mmrl.vlm.config import LM_TARGETS

    assert _LM_TARGETS == LM_TARGETS
