"""Learned image rewards on tiny real-architecture backbones (mmrl.tiny), loaded through their real
weight-loading paths, plus OCR with the real PP-OCRv4 models shipped by rapidocr-onnxruntime.

Expected numbers are recomputed by hand from the backbone's own embeddings (or, for preprocessing, by the
peer implementation in a dependency: transformers' CLIPImageProcessor, PIL's bicubic resize)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from PIL import Image, ImageDraw, ImageFont

from mmrl.rewards import available, load
from mmrl.tiny import OPEN_CLIP_CONFIGS, build_tiny_clip, build_tiny_open_clip

PROMPTS = ["a red circle", "a blue square on a white background", "a red circle", "hello world",
           "a green triangle", "a photo of a cat", "a red circle", "two yellow stars"]


# ----------------------------------------------------------------------------------------------- fixtures


@pytest.fixture(scope="module")
def clip_dir(tmp_path_factory):
    return build_tiny_clip(tmp_path_factory.mktemp("clip") / "tiny_clip", seed=0)


@pytest.fixture(scope="module")
def open_clip_dir(tmp_path_factory):
    return build_tiny_open_clip(tmp_path_factory.mktemp("oc") / "tiny_open_clip", seed=0)


def _aesthetic_mlp(in_dim: int, seed: int = 0) -> torch.nn.Module:
    """The improved-aesthetic-predictor MLP layout (keys layers.{0,2,4,6,7}), random weights."""
    torch.manual_seed(seed)
    m = torch.nn.Module()
    m.layers = torch.nn.Sequential(torch.nn.Linear(in_dim, 1024), torch.nn.Dropout(0.2), torch.nn.Linear(1024, 128),
                                   torch.nn.Dropout(0.2), torch.nn.Linear(128, 64), torch.nn.Dropout(0.1),
                                   torch.nn.Linear(64, 16), torch.nn.Linear(16, 1))
    return m


@pytest.fixture(scope="module")
def aesthetic_pth(tmp_path_factory):
    path = tmp_path_factory.mktemp("aes") / "sac+logos+ava1-l14-linearMSE.pth"
    torch.save(_aesthetic_mlp(16).state_dict(), path)  # tiny CLIP projects to 16 (real: ViT-L/14, 768)
    return path


# Tiny ImageReward: the real BLIP ViT + med-BERT + MLP layout with small sizes; vision width (32) differs from
# the text width (24) so a mis-wired cross-attention cannot load.
IR_VISION = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2, image_size=32,
                 patch_size=8)
IR_WORDS = sorted({w for p in PROMPTS for w in p.split()} | {"a", "the", "cat", "dog"})
IR_TEXT = dict(vocab_size=5 + len(IR_WORDS) + 2, hidden_size=24, intermediate_size=48, num_hidden_layers=2,
               num_attention_heads=2, max_position_embeddings=40)


def _imagereward_state_dict(seed=0) -> dict[str, torch.Tensor]:
    """Random weights under the key names of THUDM's ImageReward.pt (BLIP_Pretrain + MLP), shapes from the
    original modules (timm-style ViT in BLIP's vit.py, BERT in med.py)."""
    g = torch.Generator().manual_seed(seed)

    def w(*shape, std=0.2):
        return torch.randn(*shape, generator=g) * std

    def ln(n):
        return 1 + 0.1 * torch.randn(n, generator=g), 0.1 * torch.randn(n, generator=g)

    sd: dict[str, torch.Tensor] = {}
    D, M, P = IR_VISION["hidden_size"], IR_VISION["intermediate_size"], IR_VISION["patch_size"]
    n_patches = (IR_VISION["image_size"] // P) ** 2
    v = "blip.visual_encoder."
    sd[v + "cls_token"], sd[v + "pos_embed"] = w(1, 1, D), w(1, 1 + n_patches, D)
    sd[v + "patch_embed.proj.weight"], sd[v + "patch_embed.proj.bias"] = w(D, 3, P, P, std=0.05), w(D)
    for i in range(IR_VISION["num_hidden_layers"]):
        b = f"{v}blocks.{i}."
        sd[b + "norm1.weight"], sd[b + "norm1.bias"] = ln(D)
        sd[b + "attn.qkv.weight"], sd[b + "attn.qkv.bias"] = w(3 * D, D), w(3 * D)
        sd[b + "attn.proj.weight"], sd[b + "attn.proj.bias"] = w(D, D), w(D)
        sd[b + "norm2.weight"], sd[b + "norm2.bias"] = ln(D)
        sd[b + "mlp.fc1.weight"], sd[b + "mlp.fc1.bias"] = w(M, D), w(M)
        sd[b + "mlp.fc2.weight"], sd[b + "mlp.fc2.bias"] = w(D, M), w(D)
    sd[v + "norm.weight"], sd[v + "norm.bias"] = ln(D)
    H, I, V, L = IR_TEXT["hidden_size"], IR_TEXT["intermediate_size"], IR_TEXT["vocab_size"], IR_TEXT["max_position_embeddings"]
    t = "blip.text_encoder."
    sd[t + "embeddings.word_embeddings.weight"], sd[t + "embeddings.position_embeddings.weight"] = w(V, H), w(L, H)
    sd[t + "embeddings.LayerNorm.weight"], sd[t + "embeddings.LayerNorm.bias"] = ln(H)
    sd[t + "embeddings.position_ids"] = torch.arange(L)[None]
    for i in range(IR_TEXT["num_hidden_layers"]):
        b = f"{t}encoder.layer.{i}."
        for att, kv_dim in (("attention", H), ("crossattention", D)):
            sd[b + f"{att}.self.query.weight"], sd[b + f"{att}.self.query.bias"] = w(H, H), w(H)
            sd[b + f"{att}.self.key.weight"], sd[b + f"{att}.self.key.bias"] = w(H, kv_dim), w(H)
            sd[b + f"{att}.self.value.weight"], sd[b + f"{att}.self.value.bias"] = w(H, kv_dim), w(H)
            sd[b + f"{att}.output.dense.weight"], sd[b + f"{att}.output.dense.bias"] = w(H, H), w(H)
            sd[b + f"{att}.output.LayerNorm.weight"], sd[b + f"{att}.output.LayerNorm.bias"] = ln(H)
        sd[b + "intermediate.dense.weight"], sd[b + "intermediate.dense.bias"] = w(I, H), w(I)
        sd[b + "output.dense.weight"], sd[b + "output.dense.bias"] = w(H, I), w(H)
        sd[b + "output.LayerNorm.weight"], sd[b + "output.LayerNorm.bias"] = ln(H)
    sd["blip.vision_proj.weight"], sd["blip.vision_proj.bias"] = w(8, D), w(8)  # unused by the score
    sd["blip.text_proj.weight"], sd["blip.text_proj.bias"] = w(8, H), w(8)
    for i, (o, n) in zip((0, 2, 4, 6, 7), ((1024, H), (128, 1024), (64, 128), (16, 64), (1, 16))):
        sd[f"mlp.layers.{i}.weight"], sd[f"mlp.layers.{i}.bias"] = w(o, n, std=1 / (n + 1) ** 0.5), w(o, std=0.05)
    return sd


@pytest.fixture(scope="module")
def imagereward_files(tmp_path_factory):
    from transformers import BertTokenizerFast

    root = tmp_path_factory.mktemp("imagereward")
    (root / "vocab.txt").write_text("\n".join(["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"] + IR_WORDS) + "\n")
    BertTokenizerFast.from_pretrained(str(root)).save_pretrained(root / "bert")  # as bert-base-uncased ships
    torch.save(_imagereward_state_dict(), root / "ImageReward.pt")
    return root / "ImageReward.pt", root / "bert"


@pytest.fixture(scope="module")
def rewards(clip_dir, open_clip_dir, aesthetic_pth, imagereward_files):
    """name -> factory(**overrides) for every learned reward, via the registry."""
    kw = {
        "pickscore": dict(weights=clip_dir),
        "clip_score": dict(weights=clip_dir),
        "hpsv2": dict(weights=open_clip_dir / "hps_style.pt", model_config=OPEN_CLIP_CONFIGS["tiny"]),
        "hpsv21": dict(weights=open_clip_dir / "hps_style.pt", model_config=open_clip_dir / "open_clip_config.json"),
        "aesthetic": dict(weights=aesthetic_pth, clip=clip_dir),
        "imagereward": dict(weights=imagereward_files[0], tokenizer=imagereward_files[1], med_config=IR_TEXT,
                            vision_config=IR_VISION),
    }
    cache: dict = {}

    def make(name, **over):
        key = (name, tuple(sorted(over.items())))
        if key not in cache:
            cache[key] = load(name, device="cpu", **{**kw[name], **over})
        return cache[key]

    return make


LEARNED = ["pickscore", "clip_score", "hpsv2", "hpsv21", "aesthetic", "imagereward"]


def _images(n=8, h=48, w=40, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.rand(n, 3, h, w, generator=g)


def _uint8_images(n=4, h=48, w=40, seed=1):
    rng = np.random.default_rng(seed)
    return rng.integers(0, 256, size=(n, h, w, 3), dtype=np.uint8)


# ----------------------------------------------------------------------------------------------- registry


def test_registered_names():
    names = available()
    for n in LEARNED + ["ocr", "jpeg_compressibility"]:  # includes imagereward
        assert n in names


# ----------------------------------------------------------------------------------------------- formulas


def _hf_clip(clip_dir):
    from transformers import AutoTokenizer, CLIPModel

    model = CLIPModel.from_pretrained(str(clip_dir)).eval()
    return model, AutoTokenizer.from_pretrained(str(clip_dir))


def _feat(out):
    return out if isinstance(out, torch.Tensor) else out.pooler_output


def _hf_embeds(model, tok, pixel_values, prompts):
    with torch.no_grad():
        img = _feat(model.get_image_features(pixel_values=pixel_values))
        t = tok(prompts, padding=True, return_tensors="pt")
        txt = _feat(model.get_text_features(input_ids=t["input_ids"], attention_mask=t["attention_mask"]))
    return img / img.norm(dim=-1, keepdim=True), txt / txt.norm(dim=-1, keepdim=True)


def _clip_pixels(x32):
    """32x32 inputs need no resize or crop: the processor only normalises."""
    mean = torch.tensor([0.48145466, 0.4578275, 0.40821073]).view(1, 3, 1, 1)
    std = torch.tensor([0.26862954, 0.26130258, 0.27577711]).view(1, 3, 1, 1)
    return (x32 - mean) / std


def test_pickscore_formula(rewards, clip_dir):
    x = _images(4, 32, 32)
    prompts = PROMPTS[:4]
    model, tok = _hf_clip(clip_dir)
    img, txt = _hf_embeds(model, tok, _clip_pixels(x), prompts)
    expected = model.logit_scale.exp().item() * (img * txt).sum(-1)
    out = rewards("pickscore")(x, prompts)
    assert out.scores.shape == (4,)
    torch.testing.assert_close(out.scores, expected, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(out.details["cosine"], (img * txt).sum(-1), atol=1e-6, rtol=1e-5)
    scaled = rewards("pickscore", scale_by_26=True)(x, prompts).scores
    torch.testing.assert_close(scaled, expected / 26.0, atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("scale,w", [("100", 100.0), ("2.5", 2.5), ("raw", None)])
def test_clip_score_formula(rewards, clip_dir, scale, w):
    x = _images(6, 32, 32, seed=3)
    prompts = PROMPTS[:6]
    model, tok = _hf_clip(clip_dir)
    img, txt = _hf_embeds(model, tok, _clip_pixels(x), prompts)
    cos = (img * txt).sum(-1)
    expected = cos if w is None else w * torch.clamp(cos, min=0)
    out = rewards("clip_score", scale=scale)(x, prompts)
    torch.testing.assert_close(out.scores, expected, atol=1e-5, rtol=1e-5)
    if w is not None:
        assert (out.scores >= 0).all() and (out.scores <= w + 1e-5).all()
        assert (cos < 0).any() and (out.scores[cos < 0] == 0).all()  # random tiny CLIP: some negative cosines
    else:
        assert (out.scores.abs() <= 1 + 1e-6).all()


def test_clip_preprocessing_matches_transformers_processor(rewards, clip_dir):
    """Resize-shortest + center-crop as torch ops vs transformers' CLIPImageProcessor on uint8 images."""
    from transformers import CLIPImageProcessor

    arr = _uint8_images(3, 48, 40)
    proc = CLIPImageProcessor.from_pretrained(str(clip_dir))
    ref = proc(images=[Image.fromarray(a) for a in arr], return_tensors="pt")["pixel_values"]
    ours = rewards("clip_score").clip.preprocess(torch.from_numpy(arr).permute(0, 3, 1, 2).float() / 255)
    assert ours.shape == ref.shape == (3, 3, 32, 32)
    diff = (ours - ref).abs()
    # only uint8 rounding of the resized image differs: 1/255 / std ~= 0.015 in normalised units
    assert diff.max() < 0.03 and diff.mean() < 0.01


def test_hps_formula_and_padding(rewards, open_clip_dir):
    import open_clip
    from safetensors.torch import load_file

    model = open_clip.CLIP(**OPEN_CLIP_CONFIGS["tiny"]).eval()
    model.load_state_dict(load_file(str(open_clip_dir / "open_clip_model.safetensors")))
    tok = open_clip.SimpleTokenizer(context_length=77)
    x = _images(3, 32, 16, seed=5)  # longest side already 32: no resize, pad 8 columns of black each side
    prompts = PROMPTS[:3]
    padded = torch.zeros(3, 3, 32, 32)
    padded[..., :, 8:24] = x
    pix = _clip_pixels(padded)
    with torch.no_grad():
        img = model.encode_image(pix, normalize=True)
        txt = model.encode_text(tok(prompts), normalize=True)
    expected = torch.diagonal(img @ txt.T)
    r = rewards("hpsv2")
    torch.testing.assert_close(r.preprocess(x), pix, atol=1e-6, rtol=0)
    out = r(x, prompts)
    torch.testing.assert_close(out.scores, expected, atol=1e-5, rtol=1e-5)
    assert (out.scores.abs() <= 1 + 1e-6).all()
    # v2.1 shares architecture and formula; here it is loaded from the open_clip_config.json file
    torch.testing.assert_close(rewards("hpsv21")(x, prompts).scores, expected, atol=1e-5, rtol=1e-5)


def test_hps_checkpoint_formats(rewards, open_clip_dir, tmp_path):
    """Plain state dict with DDP `module.` prefixes, and safetensors, load to the same scores."""
    from safetensors.torch import load_file

    sd = load_file(str(open_clip_dir / "open_clip_model.safetensors"))
    torch.save({"module." + k: v for k, v in sd.items()}, tmp_path / "ddp.pt")
    x = _images(2, 40, 24)
    ref = rewards("hpsv2")(x, PROMPTS[:2]).scores
    for path in (tmp_path / "ddp.pt", open_clip_dir / "open_clip_model.safetensors"):
        r = load("hpsv2", weights=path, model_config=OPEN_CLIP_CONFIGS["tiny"], device="cpu")
        torch.testing.assert_close(r(x, PROMPTS[:2]).scores, ref, atol=1e-6, rtol=0)
    with pytest.raises(ValueError, match="unknown open_clip arch 'NoSuchArch'"):
        load("hpsv2", weights=tmp_path / "ddp.pt", arch="NoSuchArch", device="cpu")
    (tmp_path / "junk.pt").write_bytes(b"not a checkpoint")
    with pytest.raises(ValueError, match="cannot read"):
        load("hpsv2", weights=tmp_path / "junk.pt", model_config=OPEN_CLIP_CONFIGS["tiny"], device="cpu")


def test_hps_resize_longest_matches_pil():
    """Longest side -> size with bicubic antialias, as HPSv2's ResizeMaxSize does with PIL."""
    from mmrl.rewards.image._common import resize_longest_pad

    arr = _uint8_images(1, 64, 48, seed=7)[0]
    ref = np.asarray(Image.fromarray(arr).resize((24, 32), Image.BICUBIC), dtype=np.float32) / 255
    ours = resize_longest_pad(torch.from_numpy(arr).permute(2, 0, 1)[None].float() / 255, 32)[0]
    assert ours.shape == (3, 32, 32)
    assert (ours[:, :, :4] == 0).all() and (ours[:, :, 28:] == 0).all()  # (32 - 24) / 2 black columns
    diff = np.abs(ours[:, :, 4:28].permute(1, 2, 0).numpy() - ref)
    assert diff.max() < 1.5 / 255 and diff.mean() < 0.5 / 255  # uint8 rounding only


def test_aesthetic_formula(rewards, clip_dir):
    x = _images(4, 32, 32, seed=9)
    model, tok = _hf_clip(clip_dir)
    img, _ = _hf_embeds(model, tok, _clip_pixels(x), ["x"] * 4)
    sd = _aesthetic_mlp(16).state_dict()
    h = img
    for i in (0, 2, 4, 6, 7):  # linear layers only: the linearMSE predictor has no activations
        h = h @ sd[f"layers.{i}.weight"].T + sd[f"layers.{i}.bias"]
    out = rewards("aesthetic")(x)
    assert out.scores.shape == (4,)
    torch.testing.assert_close(out.scores, h[:, 0], atol=1e-5, rtol=1e-5)


def test_aesthetic_relu_variant(tmp_path, clip_dir):
    torch.manual_seed(1)
    m = torch.nn.Module()
    L, R, D = torch.nn.Linear, torch.nn.ReLU, torch.nn.Dropout
    m.layers = torch.nn.Sequential(L(16, 1024), R(), D(0.2), L(1024, 128), R(), D(0.2), L(128, 64), R(), D(0.1),
                                   L(64, 16), R(), L(16, 1))
    torch.save(m.state_dict(), tmp_path / "relu.pth")
    r = load("aesthetic", weights=tmp_path / "relu.pth", clip=clip_dir, device="cpu")
    x = _images(2, 32, 32)
    emb = r.clip.image_embeds(x)
    with torch.no_grad():
        torch.testing.assert_close(r(x).scores, m.eval().layers(emb)[:, 0], atol=1e-5, rtol=1e-5)


def _reference_imagereward(sd, pixels, input_ids, attn_mask):
    """ImageReward.score written out in plain torch from the ORIGINAL key layout: BLIP's timm-style ViT
    (vit.py, LayerNorm eps 1e-6), med.py's BERT with cross-attention (eps 1e-12), [CLS] -> MLP -> (r-mean)/std."""
    import torch.nn.functional as F

    def lin(x, key):
        return F.linear(x, sd[key + ".weight"], sd[key + ".bias"])

    def lnorm(x, key, eps):
        return F.layer_norm(x, (x.shape[-1],), sd[key + ".weight"], sd[key + ".bias"], eps)

    def heads(x, n):
        return x.view(x.shape[0], x.shape[1], n, -1).transpose(1, 2)

    v, nh = "blip.visual_encoder.", IR_VISION["num_attention_heads"]
    x = F.conv2d(pixels, sd[v + "patch_embed.proj.weight"], sd[v + "patch_embed.proj.bias"], stride=IR_VISION["patch_size"])
    x = x.flatten(2).transpose(1, 2)
    x = torch.cat([sd[v + "cls_token"].expand(x.shape[0], -1, -1), x], 1) + sd[v + "pos_embed"]
    for i in range(IR_VISION["num_hidden_layers"]):
        b = f"{v}blocks.{i}."
        B, N, D = x.shape
        q, k, val = lin(lnorm(x, b + "norm1", 1e-6), b + "attn.qkv").view(B, N, 3, nh, D // nh).permute(2, 0, 3, 1, 4)
        a = ((q @ k.transpose(-2, -1)) * (D // nh) ** -0.5).softmax(-1)
        x = x + lin((a @ val).transpose(1, 2).reshape(B, N, D), b + "attn.proj")
        x = x + lin(F.gelu(lin(lnorm(x, b + "norm2", 1e-6), b + "mlp.fc1")), b + "mlp.fc2")
    image_embeds = lnorm(x, v + "norm", 1e-6)

    t, nh = "blip.text_encoder.", IR_TEXT["num_attention_heads"]
    L = input_ids.shape[1]
    h = sd[t + "embeddings.word_embeddings.weight"][input_ids] + sd[t + "embeddings.position_embeddings.weight"][:L]
    h = lnorm(h, t + "embeddings.LayerNorm", 1e-12)
    self_mask = (1.0 - attn_mask[:, None, None, :].float()) * torch.finfo(torch.float32).min

    def attention(prefix, hs, kv, mask):
        q, k, val = (heads(lin(hs, prefix + ".self.query"), nh), heads(lin(kv, prefix + ".self.key"), nh),
                     heads(lin(kv, prefix + ".self.value"), nh))
        scores = q @ k.transpose(-2, -1) / (q.shape[-1] ** 0.5)
        if mask is not None:
            scores = scores + mask
        ctx = (scores.softmax(-1) @ val).transpose(1, 2).reshape(hs.shape)
        return lnorm(lin(ctx, prefix + ".output.dense") + hs, prefix + ".output.LayerNorm", 1e-12)

    for i in range(IR_TEXT["num_hidden_layers"]):
        b = f"{t}encoder.layer.{i}."
        h = attention(b + "attention", h, h, self_mask)
        h = attention(b + "crossattention", h, image_embeds, None)
        h = lnorm(lin(F.gelu(lin(h, b + "intermediate.dense")), b + "output.dense") + h, b + "output.LayerNorm", 1e-12)
    r = h[:, 0]
    for i in (0, 2, 4, 6, 7):
        r = lin(r, f"mlp.layers.{i}")
    return (r[:, 0] - 0.16717362830052426) / 1.0333394966054072


def test_imagereward_matches_original_layout_forward(rewards, imagereward_files):
    from transformers import BertTokenizerFast

    x = _images(4, 32, 32, seed=11)
    prompts = PROMPTS[:4]
    tok = BertTokenizerFast.from_pretrained(str(imagereward_files[1]))
    tok.add_special_tokens({"bos_token": "[DEC]"})
    tok.add_special_tokens({"additional_special_tokens": ["[ENC]"]})
    enc = tok(prompts, padding="max_length", truncation=True, max_length=35, return_tensors="pt")
    assert enc["input_ids"][0, 0] == tok.cls_token_id and len(tok) == IR_TEXT["vocab_size"]
    sd = torch.load(imagereward_files[0])
    with torch.no_grad():
        expected = _reference_imagereward(sd, _clip_pixels(x), enc["input_ids"], enc["attention_mask"])
    r = rewards("imagereward")
    out = r(x, prompts)
    assert out.scores.shape == (4,)
    print("imagereward max |diff| vs original-layout forward:", (out.scores - expected).abs().max().item(), expected)
    torch.testing.assert_close(out.scores, expected, atol=1e-5, rtol=1e-5)
    assert sorted(r.skipped_keys) == ["blip.text_encoder.embeddings.position_ids", "blip.text_proj.bias",
                                      "blip.text_proj.weight", "blip.vision_proj.bias", "blip.vision_proj.weight"]


def test_imagereward_bad_checkpoint(imagereward_files, tmp_path):
    ckpt, tok = imagereward_files
    with pytest.raises(ValueError, match="does not fit"):  # one ViT block more than the checkpoint has
        load("imagereward", weights=ckpt, tokenizer=tok, med_config=IR_TEXT,
             vision_config=dict(IR_VISION, num_hidden_layers=3), device="cpu")
    with pytest.raises(ValueError, match="tokens"):  # real bert-base vocabulary size, tiny tokenizer
        load("imagereward", weights=ckpt, tokenizer=tok, vision_config=IR_VISION, device="cpu")
    sd = _imagereward_state_dict()
    sd["blip.visual_encoder.blocks.0.attn.relative_position_bias_table"] = torch.zeros(3)
    torch.save(sd, tmp_path / "odd.pt")
    with pytest.raises(ValueError, match="unknown vision key"):
        load("imagereward", weights=tmp_path / "odd.pt", tokenizer=tok, med_config=IR_TEXT, vision_config=IR_VISION,
             device="cpu")
    with pytest.raises(FileNotFoundError, match="THUDM/ImageReward"):
        load("imagereward", tokenizer=tok, device="cpu")
    with pytest.raises(FileNotFoundError, match="bert-base-uncased"):
        load("imagereward", weights=ckpt, tokenizer=tmp_path / "nope", device="cpu")


# ----------------------------------------------------------------------------------------------- invariances


@pytest.mark.parametrize("name", LEARNED)
def test_batch_size_and_order_invariance(rewards, name):
    x = _images(8)
    prompts = PROMPTS
    r = rewards(name)
    bs0 = r.batch_size
    try:
        got = {}
        for bs in (8, 1, 3):  # `batch_size` is the internal chunk size: 8 = one chunk, 3 = uneven chunks
            r.batch_size = bs
            got[bs] = r(x, prompts).scores
    finally:
        r.batch_size = bs0
    full = got[8]
    assert full.shape == (8,) and full.dtype == torch.float32 and torch.isfinite(full).all()
    # 1e-5 absolute, or relative for scores on a x100 scale (PickScore, CLIPScore-100)
    torch.testing.assert_close(got[1], full, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(got[3], full, atol=1e-5, rtol=1e-5)
    perm = torch.tensor([5, 2, 7, 0, 3, 1, 6, 4])
    permuted = r(x[perm], [prompts[i] for i in perm]).scores
    torch.testing.assert_close(permuted, full[perm], atol=1e-5, rtol=1e-5)
    assert full.std() > 0  # the score depends on the input


@pytest.mark.parametrize("name", ["pickscore", "clip_score", "hpsv2", "imagereward"])
def test_prompt_changes_score(rewards, name):
    x = _images(1).expand(3, -1, -1, -1)
    s = rewards(name)(x, ["a red circle", "two yellow stars", "a photo of a cat"]).scores
    assert len(set(s.tolist())) == 3


@pytest.mark.parametrize("name", LEARNED)
def test_input_forms_agree(rewards, name, tmp_path):
    arr = _uint8_images(4)
    t = torch.from_numpy(arr).permute(0, 3, 1, 2).float() / 255
    prompts = PROMPTS[:4]
    r = rewards(name)
    ref = r(t, prompts).scores
    pils = [Image.fromarray(a) for a in arr]
    paths = []
    for i, p in enumerate(pils):
        paths.append(tmp_path / f"img{i}.png")
        p.save(paths[-1])
    for images in (pils, arr, list(arr), [str(p) for p in paths], torch.from_numpy(arr).permute(0, 3, 1, 2)):
        torch.testing.assert_close(r(images, prompts).scores, ref, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("name", LEARNED)
def test_gradients_reach_input(rewards, name):
    x = _images(3).requires_grad_(True)
    r = rewards(name, differentiable=True)
    assert r.differentiable
    out = r(x, PROMPTS[:3])
    assert out.scores.requires_grad
    out.scores.sum().backward()
    assert x.grad is not None and torch.isfinite(x.grad).all() and x.grad.abs().sum() > 0
    # weights stay frozen
    assert all(not p.requires_grad for m in r.modules() for p in m.parameters())


@pytest.mark.parametrize("name", ["pickscore", "aesthetic"])
def test_not_differentiable_by_default(rewards, name):
    x = _images(2).requires_grad_(True)
    assert not rewards(name).differentiable
    assert not rewards(name)(x, PROMPTS[:2]).scores.requires_grad


def test_dtype_bfloat16_runs(clip_dir):
    r = load("clip_score", weights=clip_dir, device="cpu", dtype="bfloat16", scale="raw")
    ref = load("clip_score", weights=clip_dir, device="cpu", scale="raw")
    x = _images(2)
    assert r(x, PROMPTS[:2]).scores.dtype == torch.float32
    torch.testing.assert_close(r(x, PROMPTS[:2]).scores, ref(x, PROMPTS[:2]).scores, atol=0.05, rtol=0)


# ----------------------------------------------------------------------------------------------- errors


@pytest.mark.parametrize("name,kw,needle", [
    ("pickscore", {}, "yuvalkirstain/PickScore_v1"),
    ("pickscore", {"weights": "/no/such/PickScore_v1"}, "/no/such/PickScore_v1"),
    ("clip_score", {"weights": "/no/such/clip"}, "openai/clip-vit-large-patch14"),
    ("hpsv2", {"weights": "/no/such/HPS_v2_compressed.pt"}, "HPS_v2_compressed.pt"),
    ("hpsv21", {}, "HPS_v2.1_compressed.pt"),
    ("aesthetic", {"weights": "/no/such/mlp.pth"}, "sac+logos+ava1-l14-linearMSE.pth"),
])
def test_missing_weights(name, kw, needle):
    with pytest.raises(FileNotFoundError, match="nothing is downloaded") as e:
        load(name, device="cpu", **kw)
    assert needle in str(e.value)


def test_missing_clip_or_processor(aesthetic_pth, clip_dir, tmp_path):
    with pytest.raises(FileNotFoundError, match="openai/clip-vit-large-patch14"):
        load("aesthetic", weights=aesthetic_pth, clip=tmp_path / "nope", device="cpu")
    with pytest.raises(FileNotFoundError, match="laion/CLIP-ViT-H-14"):
        load("pickscore", weights=clip_dir, processor=tmp_path / "nope", device="cpu")
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match="laion/CLIP-ViT-H-14"):  # PickScore_v1 ships no tokenizer
        load("pickscore", weights=clip_dir, processor=tmp_path / "empty", device="cpu")


def test_wrong_checkpoints(open_clip_dir, clip_dir, tmp_path):
    with pytest.raises(ValueError, match="missing keys"):  # tiny checkpoint into the real ViT-H-14 layout
        small = dict(OPEN_CLIP_CONFIGS["tiny"], embed_dim=8)
        load("hpsv2", weights=open_clip_dir / "hps_style.pt", model_config=dict(small, vision_cfg=dict(
            small["vision_cfg"], layers=3)), device="cpu")
    torch.save({"layers.0.weight": torch.zeros(4, 16), "layers.0.bias": torch.zeros(4)}, tmp_path / "bad.pth")
    with pytest.raises(ValueError, match="layers"):
        load("aesthetic", weights=tmp_path / "bad.pth", clip=clip_dir, device="cpu")
    torch.save(_aesthetic_mlp(768).state_dict(), tmp_path / "l14.pth")
    with pytest.raises(ValueError, match="expects 768-d"):
        load("aesthetic", weights=tmp_path / "l14.pth", clip=clip_dir, device="cpu")
    with pytest.raises(ValueError, match="unknown scale"):
        load("clip_score", weights=clip_dir, scale="42", device="cpu")


def test_bad_inputs(rewards, tmp_path):
    r = rewards("pickscore")
    x = _images(2)
    with pytest.raises(ValueError, match="1, 3 or 4 channels"):
        r(torch.rand(2, 2, 32, 32), PROMPTS[:2])
    with pytest.raises(ValueError, match="empty batch"):
        r(torch.rand(0, 3, 32, 32), [])
    with pytest.raises(ValueError, match="2 inputs but 3 prompts"):
        r(x, PROMPTS[:3])
    with pytest.raises(ValueError, match="needs prompts"):
        r(x)
    with pytest.raises((ValueError, FileNotFoundError), match="missing.png"):
        r([str(tmp_path / "missing.png")], ["a"])
    with pytest.raises(ValueError, match=r"\[0,1\]"):
        r(x * 2 - 1, PROMPTS[:2])


# ----------------------------------------------------------------------------------------------- OCR


def _render(text: str | None, size=(512, 160)) -> Image.Image:
    im = Image.new("RGB", size, "white")
    if text:
        font = ImageFont.load_default(size=64)
        d = ImageDraw.Draw(im)
        left, top, right, bottom = d.textbbox((0, 0), text, font=font)
        d.text(((size[0] - (right - left)) / 2 - left, (size[1] - (bottom - top)) / 2 - top), text, fill="black",
               font=font)
    return im


@pytest.fixture(scope="module")
def ocr():
    pytest.importorskip("rapidocr_onnxruntime")
    return load("ocr")


def test_ocr_real_model(ocr):
    hello, blank = _render("HELLO MMRL"), _render(None)
    out = ocr([hello, hello, blank, hello],
              ['a sign that says "HELLO MMRL"', "a sign that says 'GOODBYE WORLD'", 'a sign that says "HELLO MMRL"',
               "a poster"],
              metadata=[{}, {}, {}, {"text": "hello mmrl"}])
    s = out.scores.tolist()
    assert out.scores.shape == (4,) and not ocr.differentiable
    assert s[0] >= 0.9 and s[3] >= 0.9, out.details
    assert s[1] < 0.5
    assert s[2] == 0.0 and out.details["ocr_text"][2] == ""
    assert out.details["target"] == ["HELLO MMRL", "GOODBYE WORLD", "HELLO MMRL", "hello mmrl"]


def test_ocr_tensor_input_and_errors(ocr):
    t = torch.from_numpy(np.array(_render("HELLO MMRL"))).permute(2, 0, 1).float()[None] / 255
    assert ocr(t, ['"hello mmrl"']).scores.item() >= 0.9
    with pytest.raises(ValueError, match="no target text"):
        ocr(t)


def test_ocr_prompt_without_quoted_text_is_not_applicable():
    """No quoted text and no metadata text: NaN ("does not apply"; trainers apply reward.on_nonfinite), one warning,
    the other samples scored as usual; no_target="zero" scores 0 instead."""
    import warnings

    from mmrl.rewards import load as load_reward

    pytest.importorskip("rapidocr_onnxruntime")
    hello = _render("HELLO MMRL")
    ocr = load_reward("ocr")  # a new object: the warning is once per reward object
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = ocr([hello, hello], ["a sign without quotes", 'a sign that says "HELLO MMRL"'])
        ocr([hello], ["a cat"])  # warned once per reward object
    assert torch.isnan(out.scores[0]) and out.scores[1] >= 0.9 and out.details["target"] == ["", "HELLO MMRL"]
    warned = [str(w.message) for w in caught if "no quoted text" in str(w.message)]
    assert len(warned) == 1 and warned[0].startswith("ocr: prompt 'a sign without quotes' has no quoted text")
    zero = load_reward("ocr", no_target="zero")
    assert zero([hello], ["a cat"]).scores.tolist() == [0.0]
    with pytest.raises(ValueError, match=r"no_target must be one of \['nan', 'zero'\], got 'skip'"):
        load_reward("ocr", no_target="skip")


def test_edit_distance_and_similarity():
    from mmrl.rewards.image.ocr import edit_distance, ocr_similarity, target_text

    assert edit_distance("kitten", "sitting") == 3
    assert edit_distance("", "abc") == 3 and edit_distance("abc", "") == 3 and edit_distance("abc", "abc") == 0
    assert edit_distance("flaw", "lawn") == 2
    assert ocr_similarity("HELLO MMRL", "hello mmrl") == 1.0
    assert ocr_similarity("xx hellommrl yy", "HELLO MMRL") == 1.0  # target inside prediction: no penalty
    assert ocr_similarity("HELLOMMRI", "HELLO MMRL") == pytest.approx(1 - 1 / 9)  # one substitution over 9 chars
    assert ocr_similarity("", "HELLO") == 0.0
    assert ocr_similarity("zzzzzzzzzzzzzzzzz", "abc") == 0.0  # distance clamped to len(target)
    assert target_text('a cat\'s sign saying "OPEN 24H" today', None) == "OPEN 24H"
    assert target_text("a cat's sign saying 'OPEN' today", None) == "OPEN"
    assert target_text("a sign saying \u201cSALE\u201d", None) == "SALE"
    assert target_text("ignored 'x'", {"text": "META"}) == "META"
    with pytest.raises(ValueError, match="empty"):
        ocr_similarity("abc", "  ")
